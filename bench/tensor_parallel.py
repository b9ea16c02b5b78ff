"""Tensor parallelism on the CPU: TP=2 against TP=1, on the same machine in the same run.

    python -m tandem.bench.tensor_parallel [--size medium | --model DIR]
        [--setups 1x1,1x2,2x1] [--batch-sizes 1,16] [--steps 24] [--rounds 3]

A setup is ``TPxT``: tensor-parallel size x torch threads per rank (``2x1`` is two
ranks of one thread each, as many threads as ``1x2``). Every setup runs in a fresh
child process per round (so each rank's memory is its own), the rounds interleaved
(1x1, 1x2, 2x1, 1x1, ...) so a drift in machine speed hits every setup alike; each
figure is the median over rounds.

In a child, for each batch size B: B greedy requests with ``--prompt-len``-token random
prompts prefill, decode ``WARMUP_STEPS`` steps, then ``--steps`` engine steps are timed,
each a decode of B tokens (``LLMEngine.step`` on rank 0: scheduling, the plan broadcast,
the forward, sampling). Figures:

* **step ms**: the median timed step; **tok/s**: B / step.
* **collective shares** (TP > 1): seconds rank 0 spends inside each kind of collective
  over the seconds of the timed steps: the row-parallel layers' all-reduces (``o_proj``,
  ``down_proj``), the embedding's all-reduce, the logits gather, the plan broadcast. A
  collective's time includes waiting for the other rank to reach it. Timed by pointing
  rank 0's parallel layers at a timing stand-in for their group (``instrument``), in
  the benchmark's child only; the engine's code is unchanged.
* **memory per rank**, once the requests are done: RSS (``VmRSS``, of each of ``LocalRanks.pids``),
  anonymous RSS and peak RSS (``/proc``: ``RssAnon``, ``VmHWM``) of every rank's
  process, the child's RSS before the engine started (interpreter, torch and the engine
  imported: what every rank costs before weights), and the bytes of weights (from the
  rank's shard shapes) and of KV cache each rank holds.
* **greedy match**: the share of requests whose greedy tokens equal the first setup's
  (near-ties on a random model may flip under a different summation order).
* **a TP step taken apart**, from the round whose timed steps took the median time:
  the step's mean = rank 0's work outside the forward (scheduling, the plan broadcast,
  sampling) + the forward (``ModelRunner.run_plan``) = compute + all-reduces + the
  logits gather; next to the TP=1 steps split the same way, and to what as many
  all-reduces cost in a probe (``tp_probe.probe_all_reduce``, once per round): two
  processes joined as the engine joins its ranks, all-reducing ``[B, hidden]`` back to
  back, and with the matmuls of half an MLP before each call.

Prints a table; the last line is one JSON object with every figure (also written to
``tensor_parallel.json`` in ``--results-dir``, by default ``bench/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from tandem.bench.machine_load import OtherLoad, processes_cpu_s, wait_for_quiet
from tandem.bench.tp_probe import probe_all_reduce
from tandem.bench.tp_timing import COLLECTIVES, Span, SpanClock, instrument
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tandem.engine.llm_engine import LLMEngine

RESULTS = Path("bench/results")
WARMUP_STEPS = 3
BLOCK_SIZE = 16
MIB = 1 << 20


@dataclass(frozen=True)
class Setup:
    tp: int
    threads: int
    """Torch threads per rank."""

    @property
    def name(self) -> str:
        return f"{self.tp}x{self.threads}"

    @classmethod
    def parse(cls, text: str) -> Setup:
        tp, _, threads = text.partition("x")
        return cls(int(tp), int(threads))


@dataclass(frozen=True)
class Job:
    """What one child measures (sent to it as JSON)."""

    model: str
    tp: int
    threads: int
    batch_sizes: tuple[int, ...]
    steps: int
    prompt_len: int


@dataclass(frozen=True)
class Decode:
    """One batch size in one child."""

    batch: int
    num_steps: int
    step_s: float
    """Median timed step."""
    total_s: float
    """All timed steps."""
    span_s: dict[str, float]
    """Rank 0's seconds inside each ``Span`` over the timed steps."""
    span_calls: dict[str, int]
    other_load: float | None
    """Cores other processes used meanwhile."""
    token_ids: list[list[int]]


@dataclass(frozen=True)
class RankMemory:
    rank: int
    rss: int
    anon: int
    """Anonymous resident memory (``RssAnon``): tensors and heap, no mapped files."""
    peak_rss: int
    """The resident-set high-water mark (``VmHWM``), loading included."""
    weight_bytes: int
    kv_bytes: int


@dataclass(frozen=True)
class ChildResult:
    decodes: list[Decode]
    ranks: list[RankMemory]
    baseline_rss: int
    """The child's RSS with torch and the engine imported, before the engine started."""


# --- a child: one setup, one round ---------------------------------------------------------


def run_child(job: Job) -> ChildResult:
    baseline = psutil.Process().memory_info().rss
    max_model_len = job.prompt_len + 1 + WARMUP_STEPS + job.steps
    with LLM(
        job.model,
        dtype="float32",
        tensor_parallel_size=job.tp,
        num_threads=job.threads,
        max_model_len=max_model_len,
        max_num_seqs=max(job.batch_sizes),
        num_kv_blocks=max(job.batch_sizes) * -(-max_model_len // BLOCK_SIZE),
        block_size=BLOCK_SIZE,
    ) as llm:
        clock = SpanClock()
        instrument(llm.engine.runner, clock)
        decodes = [time_decode(llm.engine, clock, b, job) for b in job.batch_sizes]
        ranks = rank_memory(llm.engine, job)
    return ChildResult(decodes, ranks, baseline)


def time_decode(engine: LLMEngine, clock: SpanClock, batch: int, job: Job) -> Decode:
    """Starts ``batch`` requests, lets them prefill and warm up, then times ``job.steps``
    steps; each must decode one token of every request."""
    rng = random.Random(batch)  # the same prompts in every setup and round
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1 + WARMUP_STEPS + job.steps, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for _ in range(batch):
        prompt = [rng.randrange(10, vocab) for _ in range(job.prompt_len)]
        tokens[engine.add_request(prompt, params).request_id] = []

    def step() -> int:
        deltas = engine.step()
        for delta in deltas:
            tokens[delta.request_id].extend(delta.new_token_ids)
        return len(deltas)

    while not all(tokens.values()):
        step()
    for _ in range(WARMUP_STEPS):
        step()
    ranks = list(engine.ranks.pids) if engine.ranks is not None else []
    meter, ranks_cpu = OtherLoad.start(), processes_cpu_s(ranks)
    clock.reset()
    times = []
    for _ in range(job.steps):
        start = time.perf_counter()
        decoded = step()
        times.append(time.perf_counter() - start)
        if decoded != batch:
            raise RuntimeError(f"a timed step decoded {decoded} requests, not {batch}")
    other = meter.cores(processes_cpu_s(ranks) - ranks_cpu)
    if engine.has_unfinished_requests():
        raise RuntimeError("requests outlived the timed steps")
    return Decode(
        batch,
        job.steps,
        statistics.median(times),
        sum(times),
        {span.value: s for span, s in clock.seconds.items()},
        {span.value: n for span, n in clock.calls.items()},
        other,
        list(tokens.values()),
    )


def rank_memory(engine: LLMEngine, job: Job) -> list[RankMemory]:
    """Rank 0 is this process; ranks 1..N-1 are its children (``LocalRanks``)."""
    pids = [os.getpid(), *(engine.ranks.pids if engine.ranks is not None else [])]
    weights = shard_weight_bytes(job.model, job.tp)
    kv = engine.runner.layout.bytes_per_block * engine.num_kv_blocks
    memory = []
    for rank, pid in enumerate(pids):
        # One read of /proc/PID/status: RSS, anonymous RSS and the high-water mark of one
        # moment (a separate RSS read can land after the process grew past the mark).
        status = _proc_status_kib(pid)
        rss, anon, peak = (1024 * status[k] for k in ("VmRSS", "RssAnon", "VmHWM"))
        memory.append(RankMemory(rank, rss, anon, peak, weights[rank], kv))
    return memory


def _proc_status_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[name] = int(value.split()[0])
    return fields


def shard_weight_bytes(model_dir: str, tp: int) -> list[int]:
    """Bytes of float32 weights each rank holds: its shard's parameters, built on the
    meta device by the engine's own ``shard_model`` (tied weights counted once)."""
    from tandem.common.model_config import ModelConfig
    from tandem.engine.models import model_class
    from tandem.engine.parallel.group import TensorParallelGroup
    from tandem.engine.parallel.shard import shard_model

    config = ModelConfig.from_dir(model_dir)
    sizes = []
    for rank in range(tp):
        with torch.device("meta"):
            model = model_class(config)(config, torch.float32)
            if tp > 1:  # shard_model reads only the rank and size of a group
                group = TensorParallelGroup(rank, tp, None, None, torch.device("meta"))
                shard_model(model, config, group)
        sizes.append(sum(p.numel() * p.element_size() for p in model.parameters()))
    return sizes


# --- the parent: rounds of children, then the figures ------------------------------------


def measure(
    setups: list[Setup], args: argparse.Namespace, hidden: int, intermediate: int
) -> tuple[dict[str, list[ChildResult]], list[dict]]:
    """Every setup once per round, each in a fresh child, then the all-reduce probe;
    rounds interleaved."""
    results: dict[str, list[ChildResult]] = {s.name: [] for s in setups}
    probes = []
    for round_ in range(args.rounds):
        for setup in setups:
            if args.wait_quiet:
                wait_for_quiet(args.wait_quiet)
            print(f"  round {round_ + 1}/{args.rounds}: {setup.name}", flush=True)
            job = Job(
                args.model,
                setup.tp,
                setup.threads,
                tuple(args.batch_sizes),
                args.steps,
                args.prompt_len,
            )
            results[setup.name].append(spawn_child(job))
        probes.append(probe_all_reduce(hidden, intermediate, args.batch_sizes))
    return results, probes


def spawn_child(job: Job) -> ChildResult:
    cmd = [sys.executable, "-m", "tandem.bench.tensor_parallel", "--child", json.dumps(asdict(job))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"the child for TP={job.tp} x {job.threads} threads failed")
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return ChildResult(
        [Decode(**d) for d in raw["decodes"]],
        [RankMemory(**r) for r in raw["ranks"]],
        raw["baseline_rss"],
    )


def summarize(
    setups: list[Setup], results: dict[str, list[ChildResult]], probes: list[dict]
) -> dict:
    """Medians over rounds, per setup and batch size; step ratios against each TP=1 setup;
    each TP > 1 step taken apart (``_explain``)."""
    reference = results[setups[0].name][0]
    probe_us = {
        mode: {b: statistics.median(p[mode][b] for p in probes) for b in probes[0][mode]}
        for mode in probes[0]
    }
    summary: dict = {"setups": {}, "all_reduce_probe_us": probe_us}
    median_rounds: dict[str, dict[str, Decode]] = {}
    for setup in setups:
        runs = results[setup.name]
        batches, median_rounds[setup.name] = {}, {}
        for i, first in enumerate(runs[0].decodes):
            decodes = [run.decodes[i] for run in runs]
            batches[str(first.batch)] = _batch_figures(decodes, reference.decodes[i])
            median_rounds[setup.name][str(first.batch)] = _median_round(decodes)
        summary["setups"][setup.name] = {
            "tp": setup.tp,
            "threads_per_rank": setup.threads,
            "batches": batches,
            "memory": _memory_figures(runs),
        }
    bases = [s.name for s in setups if s.tp == 1]
    for setup in setups:
        if setup.tp == 1:
            continue
        figures = summary["setups"][setup.name]
        figures["step_ratio_vs"] = {
            base: {
                b: f["step_ms"] / summary["setups"][base]["batches"][b]["step_ms"]
                for b, f in figures["batches"].items()
            }
            for base in bases
        }
        figures["explain"] = {
            b: _explain(
                decode,
                {mode: us[b] for mode, us in probe_us.items()},
                {base: median_rounds[base][b] for base in bases},
            )
            for b, decode in median_rounds[setup.name].items()
        }
    return summary


def _per_step_ms(decode: Decode, span: Span) -> float:
    return 1e3 * decode.span_s[span.value] / decode.num_steps


def _batch_figures(decodes: list[Decode], reference: Decode) -> dict:
    step = statistics.median(d.step_s for d in decodes)
    figures = {
        "step_ms": 1e3 * step,
        "tokens_per_s": decodes[0].batch / step,
        "step_ms_rounds": [round(1e3 * d.step_s, 3) for d in decodes],
        "mean_step_ms": statistics.median(1e3 * d.total_s / d.num_steps for d in decodes),
        "forward_ms": statistics.median(_per_step_ms(d, Span.FORWARD) for d in decodes),
        "other_load_cores": max((d.other_load or 0.0) for d in decodes),
        "greedy_match": _match(decodes[0].token_ids, reference.token_ids),
    }
    if decodes[0].span_calls[Span.ROW_PARALLEL_ALL_REDUCE.value]:
        figures["collective_ms"] = {
            s.value: statistics.median(_per_step_ms(d, s) for d in decodes) for s in COLLECTIVES
        }
        shares = {
            s.value: statistics.median(d.span_s[s.value] / d.total_s for d in decodes)
            for s in COLLECTIVES
        }
        all_shares = [sum(d.span_s[s.value] for s in COLLECTIVES) / d.total_s for d in decodes]
        figures["shares"] = {**shares, "all_collectives": statistics.median(all_shares)}
        figures["calls_per_step"] = {
            s.value: decodes[0].span_calls[s.value] / decodes[0].num_steps for s in COLLECTIVES
        }
    return figures


def _median_round(decodes: list[Decode]) -> Decode:
    """The round whose timed steps took the median time: its parts add up, which
    medians of each part taken separately would not."""
    return sorted(decodes, key=lambda d: d.total_s)[len(decodes) // 2]


def _explain(tp: Decode, probe_us: dict[str, float], tp1: dict[str, Decode]) -> dict:
    """A TP > 1 step (mean over the median round's steps, ms) taken apart on rank 0, next
    to each TP=1 step; and what as many all-reduces cost in the probe."""
    ms = {s: _per_step_ms(tp, s) for s in Span}
    calls = tp.span_calls
    row, emb = Span.ROW_PARALLEL_ALL_REDUCE, Span.EMBEDDING_ALL_REDUCE
    all_reduce = ms[row] + ms[emb]
    count = (calls[row.value] + calls[emb.value]) / tp.num_steps
    step = 1e3 * tp.total_s / tp.num_steps
    forward = ms[Span.FORWARD]
    return {
        "step_ms": step,
        "outside_forward_ms": step - forward,
        "plan_broadcast_ms": ms[Span.PLAN_BROADCAST],
        "forward_ms": forward,
        "compute_ms": forward - all_reduce - ms[Span.LOGITS_GATHER],
        "all_reduce_ms": all_reduce,
        "all_reduces_per_step": count,
        "same_all_reduces_in_probe_ms": {mode: count * us / 1e3 for mode, us in probe_us.items()},
        "logits_gather_ms": ms[Span.LOGITS_GATHER],
        "tp1": {
            name: {
                "step_ms": 1e3 * d.total_s / d.num_steps,
                "forward_ms": _per_step_ms(d, Span.FORWARD),
                "outside_forward_ms": 1e3 * d.total_s / d.num_steps - _per_step_ms(d, Span.FORWARD),
            }
            for name, d in tp1.items()
        },
    }


def _match(tokens: list[list[int]], reference: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(reference)


def _memory_figures(runs: list[ChildResult]) -> dict:
    ranks = []
    for rank in range(len(runs[0].ranks)):
        mems = [run.ranks[rank] for run in runs]
        ranks.append(
            {
                "rank": rank,
                "rss_mib": statistics.median(m.rss for m in mems) / MIB,
                "anon_mib": statistics.median(m.anon for m in mems) / MIB,
                "peak_rss_mib": statistics.median(m.peak_rss for m in mems) / MIB,
                "weights_mib": mems[0].weight_bytes / MIB,
                "kv_cache_mib": mems[0].kv_bytes / MIB,
            }
        )
    return {
        "ranks": ranks,
        "baseline_rss_mib": statistics.median(r.baseline_rss for r in runs) / MIB,
    }


# --- output --------------------------------------------------------------------------------


def print_tables(summary: dict) -> None:
    setups = summary["setups"]
    bases = [name for name, s in setups.items() if s["tp"] == 1]
    spans = ["all_collectives", *(s.value for s in COLLECTIVES)]
    print()
    print(
        f"{'setup':5} {'batch':>5} {'step ms':>8} {'tok/s':>7} "
        + "".join(f"{'vs ' + b:>7} " for b in bases)
        + f"{'coll.':>6} {'row AR':>6} {'emb AR':>6} {'gather':>6} {'plan':>6} "
        + f"{'greedy=':>7} {'other':>5}  step ms per round"
    )
    for name, setup in setups.items():
        ratios = setup.get("step_ratio_vs", {})
        for batch, f in setup["batches"].items():
            shares = f.get("shares", {})
            print(
                f"{name:5} {batch:>5} {f['step_ms']:8.2f} {f['tokens_per_s']:7.1f} "
                + "".join(f"{_ratio(ratios, b, batch):>7} " for b in bases)
                + "".join(f"{_pct(shares.get(s)):>6} " for s in spans)
                + f"{f['greedy_match']:7.0%} {f['other_load_cores']:5.2f}  "
                + " ".join(f"{x:.2f}" for x in f["step_ms_rounds"])
            )
    print("(vs: step / TP=1 step; coll.: all collectives' share of the step, then by kind;")
    print(" other: most cores other processes used during a setup's timed steps)")
    print()
    head = ("RSS MiB", "anon MiB", "peak MiB", "weights", "KV")
    print(f"{'setup':5} {'rank':>4} " + " ".join(f"{h:>8}" for h in head))
    for name, setup in setups.items():
        for r in setup["memory"]["ranks"]:
            print(
                f"{name:5} {r['rank']:>4} {r['rss_mib']:8.1f} {r['anon_mib']:8.1f} "
                f"{r['peak_rss_mib']:8.1f} {r['weights_mib']:8.1f} {r['kv_cache_mib']:8.1f}"
            )
    baseline = next(iter(setups.values()))["memory"]["baseline_rss_mib"]
    print(f"(a rank's RSS before its engine starts: {baseline:.0f} MiB)")
    print()
    for mode, per_batch in summary["all_reduce_probe_us"].items():
        us = ", ".join(f"batch {b}: {t:.0f} us" for b, t in per_batch.items())
        print(f"one all-reduce in the probe, {mode.replace('_', ' ')}: {us}")
    print("steps taken apart (ms, mean step of the median round):")
    for name, setup in setups.items():
        for batch, e in setup.get("explain", {}).items():
            print(
                f"{name} batch {batch}: step {e['step_ms']:.2f} ms = outside the forward "
                f"{e['outside_forward_ms']:.2f} (plan broadcast {e['plan_broadcast_ms']:.2f}) + "
                f"forward {e['forward_ms']:.2f} = compute {e['compute_ms']:.2f} + all-reduces "
                f"{e['all_reduce_ms']:.2f} ({e['all_reduces_per_step']:.0f} of them; in the probe "
                + ", ".join(
                    f"{mode.replace('_', ' ')} {t:.2f}"
                    for mode, t in e["same_all_reduces_in_probe_ms"].items()
                )
                + f") + logits gather {e['logits_gather_ms']:.2f}"
            )
            for base, b in e["tp1"].items():
                print(
                    f"  {base} batch {batch}: step {b['step_ms']:.2f} ms = outside the forward "
                    f"{b['outside_forward_ms']:.2f} + forward {b['forward_ms']:.2f} "
                    f"(half: {b['forward_ms'] / 2:.2f})"
                )


def _ratio(ratios: dict, base: str, batch: str) -> str:
    return f"{ratios[base][batch]:.2f}x" if base in ratios else "-"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


# --- setup ---------------------------------------------------------------------------------


def cached_model(size: str, results_dir: Path) -> str:
    """A random Llama of preset ``size`` (``tandem make-model``'s maker), made once under
    ``results_dir/models/`` (where ``throughput.py`` keeps its own)."""
    from tandem.tools.checkpoint_maker import PRESETS, make_model

    model_dir = results_dir / "models" / f"llama-{size}"
    config = model_dir / "config.json"
    if config.exists():
        hidden = json.loads(config.read_text())["hidden_size"]
        if hidden != PRESETS[size].hidden_size:
            raise SystemExit(f"{model_dir} holds a model of hidden size {hidden}, not {size}")
        return str(model_dir)
    print(f"making a random llama-{size} in {model_dir}", flush=True)
    return str(make_model(model_dir, arch="llama", size=size))


def model_figures(model_dir: str) -> dict:
    from tandem.common.model_config import ModelConfig

    c = ModelConfig.from_dir(model_dir)
    return {
        "dir": model_dir,
        "parameters": shard_weight_bytes(model_dir, 1)[0] // 4,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
        "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
    }


def machine() -> dict:
    names = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ]
    return {"cpus": os.cpu_count(), "cpu": names[0] if names else None, "torch": torch.__version__}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", help="random Llama preset (tandem make-model)")
    parser.add_argument("--model", help="a checkpoint directory instead of --size")
    parser.add_argument("--setups", default="1x1,1x2,2x1", help="TPxTHREADS, comma-separated")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per batch")
    parser.add_argument("--rounds", type=int, default=3, help="children per setup")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each child, wait up to this long for other processes to use < 0.3 cores",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        raw = json.loads(args.child)
        result = run_child(Job(**{**raw, "batch_sizes": tuple(raw["batch_sizes"])}))
        print(json.dumps(asdict(result)))
        return 0
    setups = [Setup.parse(s) for s in args.setups.split(",")]
    if not any(s.tp == 1 for s in setups):
        raise SystemExit("--setups needs a TP=1 setup to compare with")
    args.model = args.model or cached_model(args.size, args.results_dir)
    model = model_figures(args.model)
    meter, started = OtherLoad.start(), time.perf_counter()
    sizes = model["hidden_size"], model["intermediate_size"]
    summary = summarize(setups, *measure(setups, args, *sizes))
    report = {
        "command": " ".join(["python -m tandem.bench.tensor_parallel", *sys.argv[1:]]),
        "machine": machine(),
        "model": model,
        "settings": {
            "batch_sizes": args.batch_sizes,
            "steps": args.steps,
            "rounds": args.rounds,
            "prompt_len": args.prompt_len,
            "warmup_steps": WARMUP_STEPS,
        },
        **summary,
        "other_load_cores": meter.cores(),
        "wall_s": time.perf_counter() - started,
    }
    print_tables(summary)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "tensor_parallel.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
