"""Workers a call just failed on, avoided for a few seconds.

A killed worker stays in the registry until its entry expires (``--registry-ttl``,
seconds), and looks idle all that time, so every new request would try it first and
fail over. The first failure marks it a suspect instead: the policies skip it for
``hold_s``, unless no other worker is left. A worker that comes back is trusted again
when the hold ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

DEFAULT_HOLD_S = 5.0
"""Longer than the default registry TTL (3 s): a dead worker is gone before it ends."""


class Suspects:
    def __init__(
        self, hold_s: float = DEFAULT_HOLD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._until: dict[str, float] = {}

    def mark(self, worker_id: str) -> None:
        self._until[worker_id] = self._clock() + self.hold_s

    def current(self) -> frozenset[str]:
        """The workers held now (empty, and O(1), in the usual case)."""
        if not self._until:
            return frozenset()
        now = self._clock()
        self._until = {w: t for w, t in self._until.items() if t > now}
        return frozenset(self._until)
