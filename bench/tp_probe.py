"""What one tensor-parallel all-reduce costs on its own, for ``tensor_parallel.py``.

``probe_all_reduce`` joins this process and a child as the two ranks of a model group,
the way the engine joins its ranks (``TensorParallelGroup.join``: gloo over loopback),
one torch thread each, and times all-reduces of ``[B, hidden]`` float32 two ways (see
``ProbeMode``). ``python -m tandem.bench.tp_probe SPEC`` is the child's side.
"""

from __future__ import annotations

import enum
import json
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tandem.engine.parallel.group import (
    Rendezvous,
    TensorParallelGroup,
    host_store,
)

CALLS = 200
WARMUP_CALLS = 20


class ProbeMode(enum.Enum):
    BACK_TO_BACK = "back_to_back"
    """The ranks do nothing else: the collective's own latency."""
    BETWEEN_COMPUTE = "between_compute"
    """Before each call both ranks run the matmuls of their half of an MLP, as a decode
    step computes between its all-reduces; the same work, so neither waits for a slower
    peer."""


@dataclass(frozen=True)
class Probe:
    """The loop both ranks run (sent to the child as JSON)."""

    host: str
    port: int
    key: str
    hidden: int
    intermediate: int
    batch_sizes: tuple[int, ...]


def probe_all_reduce(
    hidden: int, intermediate: int, batch_sizes: list[int]
) -> dict[str, dict[str, float]]:
    """Median microseconds of one all-reduce, by ``ProbeMode`` value, then batch size."""
    store, rendezvous = host_store("127.0.0.1", 2, uuid.uuid4().hex)
    probe = Probe(
        "127.0.0.1", rendezvous.port, rendezvous.key, hidden, intermediate, tuple(batch_sizes)
    )
    command = [sys.executable, "-m", "tandem.bench.tp_probe", json.dumps(asdict(probe))]
    peer = subprocess.Popen(command)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        group = TensorParallelGroup.join(rendezvous, 0, torch.device("cpu"), store=store)
        return _all_reduce_loop(group, probe)
    finally:
        torch.set_num_threads(threads)
        peer.wait(timeout=120)


def _all_reduce_loop(group: TensorParallelGroup, probe: Probe) -> dict[str, dict[str, float]]:
    half = probe.intermediate // 2
    gate_up, down = torch.randn(2 * half, probe.hidden), torch.randn(probe.hidden, half)
    result: dict[str, dict[str, float]] = {mode.value: {} for mode in ProbeMode}
    for batch in probe.batch_sizes:
        tensor = torch.zeros(batch, probe.hidden)
        for mode in ProbeMode:
            times = []
            for i in range(WARMUP_CALLS + CALLS):
                if mode is ProbeMode.BETWEEN_COMPUTE:
                    F.linear(F.linear(tensor, gate_up)[:, :half], down)
                start = time.perf_counter()
                group.all_reduce(tensor)
                if i >= WARMUP_CALLS:
                    times.append(time.perf_counter() - start)
            result[mode.value][str(batch)] = 1e6 * statistics.median(times)
    return result


def main() -> None:
    """Rank 1 of the probe."""
    raw = json.loads(sys.argv[1])
    probe = Probe(**{**raw, "batch_sizes": tuple(raw["batch_sizes"])})
    torch.set_num_threads(1)
    rendezvous = Rendezvous(probe.host, probe.port, 2, probe.key)
    _all_reduce_loop(TensorParallelGroup.join(rendezvous, 1, torch.device("cpu")), probe)


if __name__ == "__main__":
    main()
