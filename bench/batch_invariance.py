"""What ``batch_invariant=True`` costs: a decode step and a prefill, against the default
engine on the same checkpoint, in the same run.

    python bench/batch_invariance.py [--model DIR] [--size medium] [--json PATH]

One ``LLMEngine`` per mode on a bfloat16 checkpoint (a random Llama of ``--size``):
``default`` (the checkpoint's bfloat16: oneDNN GEMMs, SDPA prefill), ``float32`` (the
default engine in float32, to separate the dtype's cost from the invariance's) and
``batch-invariant`` (float32, the native GEMM, every query row through the attention
kernel). Measured, median of ``--repeats``: the time of one prefill step of an L-token
prompt, and the mean decode step of B sequences at a 256-token context.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.cluster_bench import emit, provenance
from tandem.engine import SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine

MODES = {
    "default": {},
    "float32": {"dtype": "float32"},
    "batch-invariant": {"batch_invariant": True},
}


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 4096) for _ in range(n)]


def prefill_s(engine: LLMEngine, length: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        engine.add_request(_prompt(length, 1000 + r), SamplingParams(max_tokens=1), f"p{r}")
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_step_s(
    engine: LLMEngine,
    batch: int,
    repeats: int,
    steps: int = 32,
    context: int = 256,
    adapters: Sequence[str] = (),
) -> float:
    """The mean decode step of ``batch`` sequences at ``context`` tokens (median of
    ``repeats``); ``adapters``: LoRA adapters given to the sequences round-robin."""
    times = []
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for r in range(repeats):
        for i in range(batch):
            lora = adapters[i % len(adapters)] if adapters else None
            prompt = _prompt(context, 2000 + 100 * r + i)
            engine.add_request(prompt, params, f"d{r}-{i}", lora_request=lora)
        engine.step()  # the prefills (one step: 256 x batch tokens within the budget)
        while engine.scheduler.waiting or any(
            req.num_computed_tokens < req.num_prompt_tokens for req in engine.scheduler.running
        ):
            engine.step()
        start = time.perf_counter()
        count = 0
        while engine.has_unfinished_requests():
            engine.step()
            count += 1
        times.append((time.perf_counter() - start) / count)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="bfloat16 checkpoint (default: a random one of --size)")
    parser.add_argument("--size", default="medium")
    parser.add_argument("--lengths", default="256,1024")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = args.model
    if model is None:
        import tempfile

        from tandem.tools.checkpoint_maker import make_model

        work = Path(tempfile.mkdtemp(prefix="tandem-bench-invariance-"))
        model = str(make_model(work / "model", arch="llama", size=args.size, dtype="bfloat16"))
    report: dict = {**provenance(args.model, args.size), "checkpoint_dtype": "bfloat16"}
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    for mode, settings in MODES.items():
        engine = LLMEngine(
            EngineConfig(model, num_kv_blocks=1024, max_model_len=2048, **settings),
            detokenize=False,
        )
        engine.add_request(_prompt(64, 1), SamplingParams(max_tokens=4), "warm")
        while engine.has_unfinished_requests():
            engine.step()
        figures = {
            f"prefill_{n}_ms": round(1e3 * prefill_s(engine, n, args.repeats), 2) for n in lengths
        }
        for b in batches:
            figures[f"decode_step_b{b}_ms"] = round(1e3 * decode_step_s(engine, b, args.repeats), 3)
        rt = engine.runtime
        dtype = str(rt.dtype).removeprefix("torch.")
        figures["backends"] = (
            f"{rt.linear_backend.value} GEMM, {rt.backend.value} attention, {dtype}"
        )
        report[mode] = figures
        print(f"[invariance] {mode}: {figures}", flush=True)
    base = report["default"]
    report["cost_vs_default"] = {
        k: round(report["batch-invariant"][k] / base[k], 2) for k in base if k.endswith("_ms")
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
