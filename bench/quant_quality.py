"""Quality of int8 / int4 weights on the shipped trained model: perplexity on held-out
text and greedy agreement with float32.

    python bench/quant_quality.py [--model DIR] [--tokens 16384] [--prompts 32]

Held-out text: the Python sources of the installed ``numpy`` package (the model was
trained on the standard library only; see engine/assets/trained/README.md), files in
sorted order, concatenated up to ``--tokens`` tokens and scored in windows of the
model's training length (256). Perplexity is computed with HuggingFace ``transformers``
on the very weights the engine holds (each projection replaced by
``dequantize(quantize(w))`` with the engine's own functions, which is what the kernels
multiply by, up to float rounding). Greedy agreement runs the engine itself: prompts are
32-token windows of the same text; reported are the fraction of prompts whose first 32
greedy tokens equal float32's and the mean position of the first difference (32 when
none). Writes ``bench/results/quant_quality.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "quant_quality.json"
WINDOW = 256
SETTINGS = {"int8": ("int8", 64), "int4-g64": ("int4", 64), "int4-g128": ("int4", 128)}


def held_out_tokens(model: Path, limit: int) -> list[int]:
    import numpy

    tokenizer = _tokenizer(model)
    tokens: list[int] = []
    for path in sorted(Path(numpy.__file__).parent.rglob("*.py")):
        tokens += tokenizer.encode(path.read_text(errors="replace"))
        if len(tokens) >= limit:
            break
    return tokens[:limit]


def _tokenizer(model: Path):
    from tandem.common.tokenizer import Tokenizer

    return Tokenizer.from_dir(model)


def perplexity(model: Path, tokens: list[int], setting: tuple[str, int] | None) -> float:
    from transformers import AutoModelForCausalLM

    from tandem.engine.quantization.scheme import (
        QuantMethod,
        dequantize,
        quantize_int4,
        quantize_int8,
    )

    hf = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()
    if setting is not None:
        method, group = QuantMethod(setting[0]), setting[1]
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2].endswith("proj"):
                w = module.weight.detach()
                q = quantize_int8(w) if method is QuantMethod.INT8 else quantize_int4(w, group)
                module.weight.data = dequantize(q, method, group)
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, WINDOW):
            ids = torch.tensor([tokens[start : start + WINDOW + 1]])
            if ids.shape[1] < 2:
                break
            logits = hf(ids[:, :-1]).logits[0]
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return math.exp(nll / count)


def greedy(model: Path, prompts: list[list[int]], setting: tuple[str, int] | None):
    from tandem.engine import LLM, SamplingParams

    config = {} if setting is None else {"quantization": setting[0]}
    if setting is not None:
        config["quantization_group_size"] = setting[1]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(str(model), num_kv_blocks=256, **config) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    firsts = []
    for a, b in zip(reference, other, strict=True):
        firsts.append(
            next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        )
    exact = sum(f == len(a) for f, a in zip(firsts, reference, strict=True)) / len(reference)
    return exact, sum(firsts) / len(firsts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "engine/assets/trained/target"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()
    model = Path(args.model)
    tokens = held_out_tokens(model, args.tokens)
    step = len(tokens) // args.prompts
    prompts = [tokens[i * step : i * step + 32] for i in range(args.prompts)]
    base_ppl = perplexity(model, tokens, None)
    base_tokens = greedy(model, prompts, None)
    report = {"tokens": len(tokens), "prompts": len(prompts), "float32_ppl": base_ppl}
    print(f"float32      perplexity {base_ppl:.3f}")
    for name, setting in SETTINGS.items():
        ppl = perplexity(model, tokens, setting)
        exact, first = agreement(base_tokens, greedy(model, prompts, setting))
        report[name] = {
            "ppl": ppl,
            "ppl_increase": ppl / base_ppl - 1,
            "greedy_32_match": exact,
            "mean_first_divergence": first,
        }
        print(
            f"{name:12s} perplexity {ppl:.3f} ({100 * (ppl / base_ppl - 1):+.2f}%)  "
            f"first 32 greedy tokens equal: {100 * exact:.0f}%  "
            f"mean first divergence: {first:.1f}"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
