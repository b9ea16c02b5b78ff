"""Quality of int8 / int4 weights on the shipped trained model: perplexity on held-out
text and greedy agreement with float32.

    python bench/quant_quality.py [--model DIR] [--tokens 16384] [--prompts 32] \\
        [--settings int8 int4-g64 int4-g128] [--json PATH]

Held-out text: the Python sources of the installed ``numpy`` package (the model was
trained on the standard library only; see engine/assets/trained/README.md), files in
sorted order, concatenated up to ``--tokens`` tokens and scored in windows of the
model's training length (256). Perplexity is computed with HuggingFace ``transformers``
with each projection replaced by the engine's own ``QuantizedLinear`` over the engine's
quantized weights, so a window's 256 rows take the engine's path for that many rows:
int8 rounds the activations to int8 per row and multiplies in int32 (W8A8), int4
multiplies float activations by the dequantized weight. Greedy agreement runs the engine
itself (decode steps of one row, where int8 multiplies float activations and int4 int8
activations rounded per group): prompts are
32-token windows of the same text; reported are the fraction of prompts whose first 32
greedy tokens equal float32's and the mean position of the first difference (32 when
none). Writes ``bench/results/quant_quality.json`` (or ``--json PATH``): ``float32_ppl``
and, per setting, ``ppl``, ``ppl_increase`` (a fraction: 0.01 is +1%),
``greedy_32_match`` and ``mean_first_divergence``.

    python bench/quant_quality.py --kv-cache-dtype int8 fp8 [--kv-cache-memory-gb 1]

measures a quantized KV cache instead (weights float32): perplexity through the engine's
own model and attention with the cache of each ``--kv-cache-dtype`` (each window fed in
64-token chunks, so every chunk after the first reads its context back from the
quantized cache), greedy agreement with a float32-KV engine as above, and the KV blocks
and full-length (``max_model_len``) sequences that ``--kv-cache-memory-gb`` holds for
each storage. Writes ``bench/results/kv_quant_quality.json`` (or ``--json PATH``): the
float32 cache under ``auto``, and per dtype the fields above plus ``kv_blocks`` and
``max_seqs``.

``tests/test_quant_quality.py`` runs both modes at 4,096 tokens and 4 prompts against the
issue's targets (perplexity within +1% of float32 for int8 weights and int8 / fp8 KV,
+5% for int4 g64).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "quant_quality.json"
KV_RESULTS = REPO / "bench" / "results" / "kv_quant_quality.json"
WINDOW = 256
KV_CHUNK = 64
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

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    if setting is not None:
        _quantize_projections(hf, setting)
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


def _quantize_projections(hf: torch.nn.Module, setting: tuple[str, int]) -> None:
    """Every ``*_proj`` linear of ``hf`` becomes the engine's ``QuantizedLinear``."""
    from tandem.engine.native_build import select_isa
    from tandem.engine.parallel.layers import Span
    from tandem.engine.quantization.kernels import quant_kernels, select_int_gemm
    from tandem.engine.quantization.linear import QuantizedLinear
    from tandem.engine.quantization.scheme import (
        QuantizationConfig,
        QuantMethod,
        quantize_int4,
        quantize_int8,
    )

    config = QuantizationConfig(QuantMethod(setting[0]), setting[1])
    kernels, int_gemm = quant_kernels(select_isa()), select_int_gemm()
    for parent in list(hf.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and name.endswith("proj"):
                w = child.weight.detach()
                q = (
                    quantize_int8(w)
                    if config.method is QuantMethod.INT8
                    else quantize_int4(w, config.group_size)
                )
                spans = (Span(0, w.shape[0]),)
                layer = QuantizedLinear(q, child.bias, config, kernels, spans, int_gemm=int_gemm)
                setattr(parent, name, layer)


def kv_perplexity(model: Path, tokens: list[int], kv_cache_dtype: str) -> float:
    """Perplexity of the engine's own forward (float32 weights) with the given KV cache,
    each window of ``WINDOW`` tokens fed as ``KV_CHUNK``-token prefill chunks."""
    from tandem.engine import LLM
    from tandem.engine.attention.metadata import AttentionMetadata

    nll, count = 0.0, 0
    with (
        LLM(
            str(model),
            dtype="float32",
            num_kv_blocks=64,
            max_model_len=4 * WINDOW,
            kv_cache_dtype=kv_cache_dtype,
        ) as llm,
        torch.no_grad(),
    ):
        runner = llm.engine.runner
        bs = runner.layout.block_size
        table = torch.arange(-(-WINDOW // bs)).unsqueeze(0)
        for start in range(0, len(tokens) - 1, WINDOW):
            ids = torch.tensor(tokens[start : start + WINDOW + 1])
            for lo in range(0, len(ids) - 1, KV_CHUNK):
                hi = min(lo + KV_CHUNK, len(ids) - 1)
                positions = torch.arange(lo, hi)
                meta = AttentionMetadata(
                    slot_mapping=positions,  # the window's blocks are 0, 1, ... in order
                    block_table=table,
                    seq_lens=torch.tensor([hi]),
                    query_start_loc=(0, hi - lo),
                    seq_lens_list=(hi,),
                    num_decodes=int(hi - lo == 1),
                    block_size=bs,
                )
                runner.backend.plan(meta)
                hidden = runner.model(ids[lo:hi], positions, runner.kv_caches, runner.backend, meta)
                logits = runner.model.compute_logits(hidden)
                loss = torch.nn.functional.cross_entropy(
                    logits, ids[lo + 1 : hi + 1], reduction="sum"
                )
                nll += loss.item()
                count += hi - lo
    return math.exp(nll / count)


def kv_capacity(model: Path, memory_gb: float, kv_cache_dtype: str) -> tuple[int, int]:
    """(KV blocks, full-length sequences) that ``memory_gb`` of cache holds."""
    from tandem.common.model_config import ModelConfig
    from tandem.engine.config import DEFAULT_BLOCK_SIZE, EngineConfig
    from tandem.engine.llm_engine import check_config

    config = EngineConfig(
        str(model),
        dtype="float32",
        kv_cache_memory_gb=memory_gb,
        max_num_seqs=1 << 20,
        kv_cache_dtype=kv_cache_dtype,
    )
    blocks = check_config(config)
    max_len = ModelConfig.from_dir(str(model)).max_position_embeddings
    return blocks, blocks // -(-max_len // DEFAULT_BLOCK_SIZE)


def greedy(
    model: Path,
    prompts: list[list[int]],
    setting: tuple[str, int] | None,
    kv_cache_dtype: str = "auto",
):
    from tandem.engine import LLM, SamplingParams

    config = {} if setting is None else {"quantization": setting[0]}
    if setting is not None:
        config["quantization_group_size"] = setting[1]
    config["kv_cache_dtype"] = kv_cache_dtype
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


def kv_report(
    model: Path, tokens: list[int], prompts: list[list[int]], kinds: list[str], memory_gb: float
) -> dict:
    base_ppl = kv_perplexity(model, tokens, "auto")
    base_tokens = greedy(model, prompts, None)
    blocks, seqs = kv_capacity(model, memory_gb, "auto")
    report = {
        "tokens": len(tokens),
        "prompts": len(prompts),
        "kv_cache_memory_gb": memory_gb,
        "auto": {"ppl": base_ppl, "kv_blocks": blocks, "max_seqs": seqs},
    }
    print(f"KV auto (float32) perplexity {base_ppl:.3f}  {blocks} blocks, {seqs} sequences")
    for kind in kinds:
        ppl = kv_perplexity(model, tokens, kind)
        exact, first = agreement(base_tokens, greedy(model, prompts, None, kind))
        blocks, seqs = kv_capacity(model, memory_gb, kind)
        report[kind] = {
            "ppl": ppl,
            "ppl_increase": ppl / base_ppl - 1,
            "greedy_32_match": exact,
            "mean_first_divergence": first,
            "kv_blocks": blocks,
            "max_seqs": seqs,
        }
        print(
            f"KV {kind:5s} perplexity {ppl:.3f} ({100 * (ppl / base_ppl - 1):+.2f}%)  "
            f"first 32 greedy tokens equal: {100 * exact:.0f}%  "
            f"mean first divergence: {first:.1f}  {blocks} blocks, {seqs} sequences"
        )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "engine/assets/trained/target"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=("int8", "fp8"),
        help="measure these KV cache dtypes against float32 KV instead of weight quantization",
    )
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=tuple(SETTINGS),
        default=tuple(SETTINGS),
        help="weight settings to measure (default: all)",
    )
    parser.add_argument("--json", type=Path, help="write the report here instead")
    args = parser.parse_args(argv)
    model = Path(args.model)
    tokens = held_out_tokens(model, args.tokens)
    step = len(tokens) // args.prompts
    prompts = [tokens[i * step : i * step + 32] for i in range(args.prompts)]
    if args.kv_cache_dtype:
        report = kv_report(model, tokens, prompts, args.kv_cache_dtype, args.kv_cache_memory_gb)
        _write(report, args.json or KV_RESULTS)
        return 0
    base_ppl = perplexity(model, tokens, None)
    base_tokens = greedy(model, prompts, None)
    report = {"tokens": len(tokens), "prompts": len(prompts), "float32_ppl": base_ppl}
    print(f"float32      perplexity {base_ppl:.3f}")
    for name in args.settings:
        setting = SETTINGS[name]
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
    _write(report, args.json or RESULTS)
    return 0


def _write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
