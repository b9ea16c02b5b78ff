"""A mixture of experts against a dense model with the same active parameters, same run.

    python bench/moe.py [--size small] [--experts-arch mixtral] [--rounds 5] [--steps 32]
                        [--batch 32] [--no-hf]

Two random checkpoints of one size preset (``tandem make-model``): the MoE (Mixtral:
4 experts of width I, top-2, on every layer) and a Llama whose MLP is 2I wide, so both
run the same multiply-adds per token (the MoE adds its router, d x 4 per layer).
Measured in alternating rounds, float32, in one process:

- the batch-1 decode step (one 32-token prompt, ``--steps`` tokens, median step);
- throughput at ``--batch`` requests of 64-token prompts and 64 output tokens (output
  tokens / s of ``LLM.generate``);
- with transformers installed (``--no-hf`` skips it), transformers' own batch-1 step
  for the MoE, for reference.

Goals (issue 32): the MoE's batch-1 step at most 1.3x the dense one's, its batch-32
throughput at least 0.8x. Writes ``bench/results/moe.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.quantization import _decode_step_ms

RESULTS = Path(__file__).resolve().parent / "results" / "moe.json"


def _throughput(llm, batch: int) -> float:
    from tandem.engine import SamplingParams

    prompts = [[100 + (7 * i + j) % 3000 for j in range(64)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def _hf_step_ms(model_dir: Path, steps: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(100, 132))])
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - start)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times) * 1e3


def _make(out: Path, arch: str, size: str, inner: int | None) -> Path:
    from tandem.tools.checkpoint_maker import make_model

    return make_model(out, arch=arch, size=size, intermediate_size=inner)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="size preset of both models")
    parser.add_argument("--experts-arch", default="mixtral", choices=("mixtral",))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' step")
    args = parser.parse_args()

    import torch

    from tandem.engine import LLM
    from tandem.tools.checkpoint_maker import PRESETS

    torch.set_num_threads(args.threads)
    inner = PRESETS[args.size].intermediate_size
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir = _make(Path(tmp) / "moe", args.experts_arch, args.size, inner)
        dense_dir = _make(Path(tmp) / "dense", "llama", args.size, 2 * inner)
        kwargs = {"dtype": "float32", "kv_cache_memory_gb": 1.0, "num_threads": args.threads}
        engines = {"moe": LLM(moe_dir, **kwargs), "dense": LLM(dense_dir, **kwargs)}
        steps: dict[str, list[float]] = {name: [] for name in engines}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for llm in engines.values():  # warm-up: first-call setup is not a step's cost
            _decode_step_ms(llm.engine, 4)
            _throughput(llm, 4)
        for _ in range(args.rounds):
            for name, llm in engines.items():
                steps[name].append(_decode_step_ms(llm.engine, args.steps))
                rates[name].append(_throughput(llm, args.batch))
        hf = None if args.no_hf else _hf_step_ms(moe_dir, args.steps)
    step = {name: statistics.median(v) for name, v in steps.items()}
    rate = {name: statistics.median(v) for name, v in rates.items()}
    result = {
        "commit": _commit(),
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads",
        "command": " ".join(["python", "bench/moe.py", *sys.argv[1:]]),
        "size": args.size,
        "batch1_step_ms": step,
        "batch1_step_ms_rounds": steps,
        "throughput_tok_s": rate,
        "throughput_rounds": rates,
        "moe_over_dense_step": step["moe"] / step["dense"],
        "moe_over_dense_throughput": rate["moe"] / rate["dense"],
        "transformers_moe_step_ms": hf,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"batch-1 step: MoE {step['moe']:.2f} ms, dense {step['dense']:.2f} ms "
        f"({result['moe_over_dense_step']:.2f}x; goal <= 1.3x)"
    )
    print(
        f"batch {args.batch} throughput: MoE {rate['moe']:.1f}, dense {rate['dense']:.1f} "
        f"tok/s ({result['moe_over_dense_throughput']:.2f}x; goal >= 0.8x)"
    )
    if hf is not None:
        print(f"transformers, MoE batch-1 step: {hf:.2f} ms")
    return 0


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
