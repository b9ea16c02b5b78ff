"""What serving LoRA adapters costs: a decode step at batch B with 0, 1, 4 and 16
distinct adapters in the batch, against the base model alone, in the same run; and an
adapter's cold load.

    python bench/lora.py [--model DIR] [--size medium] [--batch 32] [--rank 16] [--rounds 5]
        [--json PATH]

One float32 ``LLMEngine`` with ``enable_lora`` (``max_loras`` 16, ``max_lora_rank`` =
``--rank``), a random Llama of ``--size``, and 16 random adapters of rank ``--rank`` on
all seven projections (``tandem make-lora``). Each figure is the mean decode step of
``--batch`` sequences at a 128-token context; the adapters are spread round-robin over
the batch. Every configuration is measured once per round, in turn, for ``--rounds``
rounds (the machine's slow spells hit them alike); the ratios to the base are taken
within each round, and the report gives their median and range. Twice: adapter weights
in float32 (the default on a float32 model, exact) and in bfloat16 (``lora_dtype``: half
the bytes a step reads). ``base_no_lora_engine`` is a plain engine (the gated MLP fused,
nothing wrapped): the cost of turning LoRA on at all. The cold load is ``add_lora`` of a
new adapter: read, checked and sharded, from a warm page cache.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tandem.bench.batch_invariance import decode_step_s
from tandem.bench.cluster_bench import emit, provenance
from tandem.common.lora import LoRARequest
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine

CONTEXT = 128


def lora_engine(
    model: str, paths: list[Path], counts: list[int], args: argparse.Namespace, **settings
) -> tuple[LLMEngine, list[str], float]:
    """A LoRA engine of ``settings`` with ``max(counts)`` adapters added, and the time
    ``add_lora`` took for one more (the cold load)."""
    config = EngineConfig(
        model,
        dtype="float32",
        enable_lora=True,
        max_loras=max(counts),
        max_lora_rank=args.rank,
        num_kv_blocks=1024,
        max_model_len=1024,
        max_num_seqs=args.batch,
        **settings,
    )
    engine = LLMEngine(config, detokenize=False)
    names = []
    for i, path in enumerate(paths[: max(counts)]):
        engine.add_lora(LoRARequest(f"a{i}", i + 1, str(path)))
        names.append(f"a{i}")
    start = time.perf_counter()
    engine.add_lora(LoRARequest("cold", 99, str(paths[-1])))
    cold = time.perf_counter() - start
    decode_step_s(engine, args.batch, 1, 4, CONTEXT, names)  # warm-up, every slot filled
    return engine, names, cold


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="float checkpoint (default: a random one of --size)")
    parser.add_argument("--size", default="medium")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--counts", default="1,4,16", help="distinct adapters per batch")
    parser.add_argument("--rounds", type=int, default=5)
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
    plain = LLMEngine(
        EngineConfig(
            model, dtype="float32", num_kv_blocks=1024, max_model_len=1024, max_num_seqs=args.batch
        ),
        detokenize=False,
    )
    decode_step_s(plain, args.batch, 1, 4, CONTEXT)  # warm-up
    engines = {
        "float32": lora_engine(model, paths, counts, args),
        "bfloat16": lora_engine(model, paths, counts, args, lora_dtype="bfloat16"),
    }
    # Every configuration once per round, in turn, so a slow spell of the machine hits
    # them alike; a ratio is taken within its round (against that round's base).
    steps: dict[str, list[float]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        steps["base_no_lora_engine"].append(decode_step_s(plain, args.batch, 1, 24, CONTEXT))
        for kind, (engine, names, _) in engines.items():
            base = decode_step_s(engine, args.batch, 1, 24, CONTEXT)
            steps[f"{kind}_base"].append(base)
            for n in counts:
                step = decode_step_s(engine, args.batch, 1, 24, CONTEXT, names[:n])
                steps[f"{kind}_adapters_{n}"].append(step)
                ratios[f"{kind}_adapters_{n}_vs_base"].append(step / base)
    report: dict = {**provenance(args.model, args.size), "batch": args.batch, "rank": args.rank}
    report["rounds"] = args.rounds
    report["median_ms"] = {k: round(1e3 * statistics.median(v), 2) for k, v in steps.items()}
    report["median_ratio"] = {k: round(statistics.median(v), 3) for k, v in ratios.items()}
    report["ratio_range"] = {k: [round(min(v), 3), round(max(v), 3)] for k, v in ratios.items()}
    report["cold_load_ms"] = {k: round(1e3 * e[2], 1) for k, e in engines.items()}
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
