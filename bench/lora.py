"""What serving LoRA adapters costs: a decode step at batch B with 0, 1, 4 and 16
distinct adapters in the batch, against the base model alone, in the same run; and an
adapter's cold load.

    python bench/lora.py [--model DIR] [--size medium] [--batch 32] [--rank 16] [--json PATH]

One float32 ``LLMEngine`` with ``enable_lora`` (``max_loras`` 16, ``max_lora_rank`` =
``--rank``), a random Llama of ``--size``, and 16 random adapters of rank ``--rank`` on
all seven projections (``tandem make-lora``). Each figure is the mean decode step of
``--batch`` sequences at a 128-token context, the median of ``--repeats``; the adapters
are spread round-robin over the batch. Twice: adapter weights in float32 (the default on
a float32 model, exact) and in bfloat16 (``lora_dtype``: half the bytes a step reads).
``base_no_lora_engine`` is a plain engine (the gated MLP fused, nothing wrapped): the
cost of turning LoRA on at all. The cold load is ``add_lora`` of a new adapter: read,
checked and sharded, from a warm page cache.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tandem.bench.batch_invariance import decode_step_s
from tandem.bench.cluster_bench import emit, provenance
from tandem.common.lora import LoRARequest
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine

CONTEXT = 128


def lora_figures(
    model: str, paths: list[Path], counts: list[int], args: argparse.Namespace, **settings
) -> dict[str, float]:
    """Base and 1..N-adapter decode steps on one LoRA engine of ``settings``."""
    common = {"num_kv_blocks": 1024, "max_model_len": 1024, "max_num_seqs": args.batch}
    config = EngineConfig(
        model,
        dtype="float32",
        enable_lora=True,
        max_loras=max(counts),
        max_lora_rank=args.rank,
        **common,
        **settings,
    )
    engine = LLMEngine(config, detokenize=False)
    names = []
    for i, path in enumerate(paths[: max(counts)]):
        engine.add_lora(LoRARequest(f"a{i}", i + 1, str(path)))
        names.append(f"a{i}")
    start = time.perf_counter()
    engine.add_lora(LoRARequest("cold", 99, str(paths[-1])))
    figures = {"cold_load_ms": round(1e3 * (time.perf_counter() - start), 1)}
    decode_step_s(engine, args.batch, 1, 4, CONTEXT, names)  # warm-up, every slot filled
    base = decode_step_s(engine, args.batch, args.repeats, 24, CONTEXT)
    figures["base_ms"] = round(1e3 * base, 3)
    for n in counts:
        step = decode_step_s(engine, args.batch, args.repeats, 24, CONTEXT, names[:n])
        figures[f"adapters_{n}_ms"] = round(1e3 * step, 3)
        figures[f"adapters_{n}_vs_base"] = round(step / base, 3)
        print(f"[lora] {settings or 'float32'} {n} adapters: {step / base:.2f}x base", flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="float checkpoint (default: a random one of --size)")
    parser.add_argument("--size", default="medium")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--counts", default="1,4,16", help="distinct adapters per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from tandem.tools.checkpoint_maker import make_model
    from tandem.tools.lora_maker import make_lora

    work = Path(tempfile.mkdtemp(prefix="tandem-bench-lora-"))
    model = args.model or str(make_model(work / "model", arch="llama", size=args.size))
    counts = [int(x) for x in args.counts.split(",")]
    paths = [
        make_lora(model, work / f"a{i}", args.rank, 2.0 * args.rank, seed=i)
        for i in range(max(counts) + 1)
    ]
    report: dict = {**provenance(args.model, args.size), "batch": args.batch, "rank": args.rank}
    plain = LLMEngine(
        EngineConfig(
            model, dtype="float32", num_kv_blocks=1024, max_model_len=1024, max_num_seqs=args.batch
        ),
        detokenize=False,
    )
    decode_step_s(plain, args.batch, 1, 4, CONTEXT)  # warm-up
    step = decode_step_s(plain, args.batch, args.repeats, 24, CONTEXT)
    report["base_no_lora_engine_ms"] = round(1e3 * step, 3)
    del plain
    report["lora_float32"] = lora_figures(model, paths, counts, args)
    report["lora_bfloat16"] = lora_figures(model, paths, counts, args, lora_dtype="bfloat16")
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
