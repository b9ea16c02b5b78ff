"""How busy the machine is with work that is not ours, for benchmarks that time things.

On a small machine shared with other jobs, a timing is only worth reporting with the
load it ran under. ``OtherLoad`` measures, over a span, the average number of cores
busy with processes other than this one and its children (Linux ``/proc/stat``);
``wait_for_quiet`` waits until that falls below a threshold. (``bench/throughput.py``'s
``LoadMeter`` counts this process as "other"; benchmarks that run in-process use this.)
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OtherLoad:
    wall: float
    busy: float | None
    ours: float

    @classmethod
    def start(cls) -> OtherLoad:
        return cls(time.monotonic(), _machine_busy_s(), _our_cpu_s())

    def cores(self, ours_elsewhere_s: float = 0.0) -> float | None:
        """Average cores used by other processes since ``start`` (None off Linux).

        ``ours_elsewhere_s``: CPU seconds our own processes spent meanwhile that
        ``getrusage`` does not see (children still running, such as a local cluster;
        ``processes_cpu_s`` measures them)."""
        busy = _machine_busy_s()
        if busy is None or self.busy is None:
            return None
        elapsed = max(1e-9, time.monotonic() - self.wall)
        ours = _our_cpu_s() - self.ours + ours_elsewhere_s
        return max(0.0, (busy - self.busy - ours) / elapsed)


def processes_cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) the running processes ``pids`` have used so far, from
    ``/proc/<pid>/stat``; a process that is gone counts 0."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)"
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(
    max_wait_s: float, max_cores: float = 0.3, window_s: float = 2.0
) -> float | None:
    """Wait at most ``max_wait_s`` until other processes use under ``max_cores``; returns
    the last measured load."""
    deadline = time.monotonic() + max_wait_s
    load = None
    while True:
        meter = OtherLoad.start()
        time.sleep(window_s)
        load = meter.cores()
        if load is None or load < max_cores or time.monotonic() > deadline:
            return load
        print(f"  other processes use {load:.1f} cores; waiting for quiet", flush=True)


def _machine_busy_s() -> float | None:
    try:
        ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return None
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _our_cpu_s() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total
