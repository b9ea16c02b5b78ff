"""A point in monotonic time that several steps of one operation share (torch-free)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    """``remaining()`` shrinks to 0.0 and stays there; it is never negative.

    (Negative or zero timeouts mean "wait forever" to ``threading.Lock.acquire`` and to
    ``torch.distributed.Work.wait``, so callers must check ``expired`` first.)
    """

    expires_at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return max(0.0, self.expires_at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.expires_at
