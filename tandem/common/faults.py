"""Fault injection: make a chosen operation misbehave, to test what follows.

Off unless the environment variable ``TANDEM_FAULTS`` names faults, so production code
pays one ``None`` check per operation. Each fault is ``POINT:ACTION[@WHEN]``, several
separated by commas::

    TANDEM_FAULTS="kv.send:corrupt@2, engine.step:delay=8@40"

Actions: ``delay=S`` (sleep S seconds, then go on), ``drop`` (skip the operation: what
that means is the point's to say), ``corrupt`` (damage the data the point handles),
``crash`` (``os._exit(70)`` at once, as a ``kill -9`` would end it). ``WHEN``: ``@N``
fires on the N-th call only, ``@N+`` on every call from the N-th, ``~P`` on each call
with probability P (e.g. ``kv.send:corrupt~0.1``), nothing on every call.

Points, and the actions each takes:

- ``engine.step``: the engine thread, before a step (``AsyncEngine``): delay, crash;
- ``kv.send``: the prefill side, a packed KV buffer about to be sent (``KVSender``):
  delay, crash, ``drop`` (nothing is sent: the receiver times out), ``corrupt`` (a byte
  flipped after the checksum was taken);
- ``decode.stream``: the decode worker, a response about to be streamed
  (``DecodeService``): delay, crash, ``drop`` (the stream ends there, without a finish
  reason, as a faulty worker's might).

A component asks for its point once (``fault_at``) and keeps the answer: ``None`` when
no fault names it. The plan is read from the environment once per process.
"""

from __future__ import annotations

import functools
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field

ENV_VAR = "TANDEM_FAULTS"
POINT_ACTIONS: dict[str, frozenset[str]] = {
    "engine.step": frozenset({"delay", "crash"}),
    "kv.send": frozenset({"delay", "crash", "drop", "corrupt"}),
    "decode.stream": frozenset({"delay", "crash", "drop"}),
}
POINTS = tuple(POINT_ACTIONS)
CRASH_EXIT_CODE = 70

_FAULT = re.compile(
    r"(?P<point>[a-z.]+):(?P<action>delay|drop|corrupt|crash)(=(?P<value>[0-9.]+))?"
    r"(@(?P<nth>\d+)(?P<onward>\+)?|~(?P<probability>0?\.\d+|1|1\.0+))?"
)


@dataclass
class Fault:
    """One armed fault. ``fire()`` counts a call and says whether this call misbehaves;
    ``delay`` and ``crash`` act inside ``fire`` itself, so their points need no code of
    their own."""

    point: str
    action: str
    seconds: float = 0.0
    nth: int | None = None
    onward: bool = False
    probability: float | None = None
    calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fire(self) -> bool:
        with self._lock:
            self.calls += 1
            calls = self.calls
        if self.nth is not None and (calls < self.nth or (calls > self.nth and not self.onward)):
            return False
        if self.probability is not None and random.random() >= self.probability:
            return False
        if self.action == "crash":
            os._exit(CRASH_EXIT_CODE)
        if self.action == "delay":
            time.sleep(self.seconds)
        return True


def parse_faults(text: str) -> dict[str, Fault]:
    """The faults ``text`` names, by point; ``ValueError`` names the part it cannot read."""
    faults: dict[str, Fault] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = _FAULT.fullmatch(part)
        if match is None:
            raise ValueError(f"{ENV_VAR}: cannot read {part!r} (expected POINT:ACTION[@N[+]|~P])")
        point, action, value = match["point"], match["action"], match["value"]
        if point not in POINTS:
            raise ValueError(f"{ENV_VAR}: unknown point {point!r}; points: {', '.join(POINTS)}")
        if action not in POINT_ACTIONS[point]:
            raise ValueError(f"{ENV_VAR}: {point} cannot {action}")
        if (action == "delay") != (value is not None):
            raise ValueError(f"{ENV_VAR}: {part!r}: delay takes =SECONDS, the others nothing")
        nth = int(match["nth"]) if match["nth"] else None
        probability = float(match["probability"]) if match["probability"] else None
        faults[point] = Fault(
            point, action, float(value or 0), nth, bool(match["onward"]), probability
        )
    return faults


@functools.cache
def _plan() -> dict[str, Fault]:
    return parse_faults(os.environ.get(ENV_VAR, ""))


def fault_at(point: str) -> Fault | None:
    """The fault armed at ``point`` in this process, or ``None`` (the usual case)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}")
    return _plan().get(point)
