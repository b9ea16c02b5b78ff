"""What every system runner does, whatever the system under test.

``throughput.py`` starts one runner subprocess per (system, workload) as
``python -m tandem.bench._<system>_runner JOB.json RESULT.json`` (the vLLM runner by
path, ``python bench/_vllm_runner.py ...``). The runner loads the model once,
warms up, times one ``generate`` call over the whole workload (model load excluded),
reads the system's KV waste, times the batch-1 decode probe, and writes a ``RunnerResult``.

Batch-1 decode step, measured the same way for every system: per repeat, time a request
generating ``N`` tokens and one generating 1 token from same-length prompts; the prefill
and per-call overheads cancel, so ``step = (t_N - t_1) / (N - 1)``; report the median.

Stdlib-only at import: the vLLM runner imports this module from its own virtualenv.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from tandem.bench.workloads import (
    Request,
    requests_from_json,
    requests_to_json,
    total_output_tokens,
)

_REQUEST_FIELDS = ("warmup", "requests", "probe_long", "probe_short")


class System(Protocol):
    """A loaded model behind one system's offline API."""

    def generate(self, requests: Sequence[Request]) -> list[list[int]]:
        """Greedy, ignore-EOS generation of every request at once; token ids in request order."""
        ...

    def kv_waste(self) -> float | None:
        """Fraction of allocated KV slots holding no token at the peak, or None if not known."""
        ...

    def settings(self) -> dict[str, str]:
        """Settings the system actually ran with (for the report), as display strings."""
        ...


@dataclass(frozen=True)
class EngineLimits:
    """Scheduler limits passed to paged engines (vLLM, Tandem); None keeps each one's default."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def as_kwargs(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Storage:
    """How a Tandem variant stores its weights and KV cache (``throughput.py``'s
    ``tandem-*`` systems); the other systems ignore it."""

    weights: str | None = None
    """Weight-only quantization: ``int8``, ``int4`` or ``None`` (float32)."""
    group_size: int | None = None
    """int4's group of input channels; ``None``: the engine's default."""
    kv_cache_dtype: str = "auto"
    """``auto`` (float32), ``int8`` or ``fp8``."""

    def engine_kwargs(self) -> dict[str, object]:
        """``EngineConfig`` fields for this storage."""
        kwargs: dict[str, object] = {"kv_cache_dtype": self.kv_cache_dtype}
        if self.weights is not None:
            kwargs["quantization"] = self.weights
        if self.group_size is not None:
            kwargs["quantization_group_size"] = self.group_size
        return kwargs


@dataclass(frozen=True)
class RunnerJob:
    """Everything a runner needs; written by ``throughput.py``, read once by the runner."""

    system: str
    workload: str
    model_dir: str
    threads: int
    limits: EngineLimits
    warmup: tuple[Request, ...]
    requests: tuple[Request, ...]
    probe_long: tuple[Request, ...]
    probe_short: tuple[Request, ...]
    storage: Storage = Storage()
    kv_cache_memory_gb: float | None = None
    """The KV budget for Tandem (vLLM gets it as ``VLLM_CPU_KVCACHE_SPACE``); ``None``:
    the engine's default."""

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "system": self.system,
            "workload": self.workload,
            "model_dir": self.model_dir,
            "threads": self.threads,
            "limits": asdict(self.limits),
            "storage": asdict(self.storage),
            "kv_cache_memory_gb": self.kv_cache_memory_gb,
        }
        for name in _REQUEST_FIELDS:
            data[name] = requests_to_json(getattr(self, name))
        return data

    @classmethod
    def from_json(cls, data: dict[str, object]) -> RunnerJob:
        fields = dict(data)
        fields["limits"] = EngineLimits(**data["limits"])
        fields["storage"] = Storage(**data.get("storage", {}))
        for name in _REQUEST_FIELDS:
            fields[name] = requests_from_json(data[name])
        return cls(**fields)


@dataclass(frozen=True)
class StepProbe:
    """Raw batch-1 probe timings (seconds), one pair per repeat."""

    long_tokens: int
    long_s: tuple[float, ...]
    short_s: tuple[float, ...]

    @property
    def step_samples_s(self) -> list[float]:
        return [
            (lo - sh) / (self.long_tokens - 1)
            for lo, sh in zip(self.long_s, self.short_s, strict=True)
        ]

    @property
    def step_ms(self) -> float:
        return 1000 * statistics.median(self.step_samples_s)


@dataclass(frozen=True)
class RunnerResult:
    """One (system, workload) measurement. ``output_tokens`` counts requested tokens only."""

    system: str
    workload: str
    num_requests: int
    output_tokens: int
    wall_s: float
    load_s: float
    probe: StepProbe
    kv_waste: float | None
    settings: dict[str, str]
    outputs: tuple[tuple[int, ...], ...]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["probe"]["step_ms"] = self.probe.step_ms
        data["tokens_per_s"] = self.tokens_per_s
        return data

    @classmethod
    def from_json(cls, data: dict[str, object]) -> RunnerResult:
        probe = data["probe"]
        fields = {k: v for k, v in data.items() if k != "tokens_per_s"}
        fields["probe"] = StepProbe(
            int(probe["long_tokens"]), tuple(probe["long_s"]), tuple(probe["short_s"])
        )
        fields["outputs"] = tuple(tuple(o) for o in data["outputs"])
        return cls(**fields)


class OutputLengthError(RuntimeError):
    """A system returned a different number of tokens than a request asked for."""

    def __init__(self, index: int, expected: int, got: int) -> None:
        super().__init__(f"request {index}: expected {expected} tokens, got {got}")
        self.index, self.expected, self.got = index, expected, got


def run(load: Callable[[RunnerJob], System], argv: Sequence[str] | None = None) -> int:
    """Runner entry point: ``load`` builds the system (timed as model load)."""
    job_path, result_path = argv if argv is not None else sys.argv[1:]
    job = RunnerJob.from_json(json.loads(Path(job_path).read_text()))
    start = time.perf_counter()
    system = load(job)
    load_s = time.perf_counter() - start
    system.generate(job.warmup)
    wall_s, outputs = _timed(system, job.requests)
    _check_lengths(job.requests, outputs)
    kv_waste = system.kv_waste()  # read before the probe so it reflects the workload's peak
    result = RunnerResult(
        system=job.system,
        workload=job.workload,
        num_requests=len(job.requests),
        output_tokens=total_output_tokens(job.requests),
        wall_s=wall_s,
        load_s=load_s,
        probe=_probe(system, job),
        kv_waste=kv_waste,
        settings=system.settings(),
        outputs=tuple(tuple(o) for o in outputs),
    )
    Path(result_path).write_text(json.dumps(result.to_json()))
    return 0


def _timed(system: System, requests: Sequence[Request]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = system.generate(requests)
    return time.perf_counter() - start, outputs


def _check_lengths(requests: Sequence[Request], outputs: Sequence[Sequence[int]]) -> None:
    if len(outputs) != len(requests):
        raise RuntimeError(f"expected {len(requests)} outputs, got {len(outputs)}")
    for i, (request, output) in enumerate(zip(requests, outputs, strict=True)):
        if len(output) != request.max_tokens:
            raise OutputLengthError(i, request.max_tokens, len(output))


def _probe(system: System, job: RunnerJob) -> StepProbe:
    long_s, short_s = [], []
    for long_request, short_request in zip(job.probe_long, job.probe_short, strict=True):
        long_s.append(_timed(system, [long_request])[0])
        short_s.append(_timed(system, [short_request])[0])
    return StepProbe(job.probe_long[0].max_tokens, tuple(long_s), tuple(short_s))
