"""How long the router waits for a decode stream's next message before it calls the
worker stalled and moves the stream elsewhere.

A worker can hang without dying: a stuck engine loop, a paused process, a network
that drops packets without resetting connections. Its registry entry may even live on
(heartbeats run on another loop). So the router bounds the gap between two messages of
every decode stream, scaled to the stream's own pace:

    bound = max(floor_s, tpot_multiple * mean gap between this stream's messages so far)

and, before the stream's first message (which waits for admission, a KV pull or a
local prefill), ``first_message_multiple * floor_s``. A stream past its bound is
cancelled and continued on another decode worker, like one whose worker died.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StallPolicy:
    floor_s: float = 10.0
    """The shortest bound; also sets the first message's."""
    tpot_multiple: float = 20.0
    first_message_multiple: float = 3.0

    def __post_init__(self) -> None:
        if self.floor_s <= 0:
            raise ValueError(f"stall floor_s must be > 0, got {self.floor_s}")
        if self.tpot_multiple < 1 or self.first_message_multiple < 1:
            raise ValueError("stall multiples must be >= 1")


class StreamClock:
    """One decode stream's pace, for its next bound. ``observe()`` after each message."""

    def __init__(self, policy: StallPolicy) -> None:
        self.policy = policy
        self._started = time.monotonic()
        self._last: float | None = None
        self._num_gaps = 0

    def observe(self) -> None:
        now = time.monotonic()
        if self._last is not None:
            self._num_gaps += 1
        else:
            self._started = now  # gaps are measured from the first message on
        self._last = now

    @property
    def mean_gap_s(self) -> float | None:
        if not self._num_gaps or self._last is None:
            return None
        return (self._last - self._started) / self._num_gaps

    def next_bound_s(self) -> float:
        policy = self.policy
        if self._last is None:
            return policy.first_message_multiple * policy.floor_s
        gap = self.mean_gap_s
        return policy.floor_s if gap is None else max(policy.floor_s, policy.tpot_multiple * gap)


class StreamStalled(Exception):
    """A decode stream sent nothing within its bound."""
