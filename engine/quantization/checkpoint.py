"""Quantized checkpoints: written by ``tandem quantize``, loaded without the original.

Layout: a HuggingFace directory like its float source, where each quantized projection
``P.weight`` (``*.self_attn.{q,k,v,o}_proj``, ``*.mlp.{gate,up,down}_proj``, and
``lm_head`` when asked) is replaced by

- ``P.qweight``: int8 ``[out, in]`` (int8), or uint8 ``[out, ceil(in/32)*16]`` holding
  int4 values two to a byte (``scheme`` describes the packing);
- ``P.scales``: float32 ``[out]`` (int8) or ``[out, ceil(in/group)]`` (int4);
- ``P.zeros``: uint8 ``[out, ceil(in/group)]``, int4 only (integer zero points);

and ``config.json`` gains ``"quantization_config": {"quant_method": "tandem", "method":
"int8" | "int4", "group_size": 64 (int4 only), "lm_head": false}``. Everything else
(embeddings, norms, biases) is copied as it was. The quantized values are those
load-time quantization computes, so both give the same tokens.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tandem.common.checkpoint_files import (
    SAFETENSORS_INDEX,
    open_safetensors,
    read_json,
    safetensors_files,
)
from tandem.engine.quantization.linear import AllReducedLinear, QuantizedLinear
from tandem.engine.quantization.scheme import (
    QuantizationConfig,
    QuantMethod,
    quantize_int4,
    quantize_int8,
)

QUANTIZED_LEAVES = ("qweight", "scales", "zeros")
PROJECTIONS = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    *("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"),  # latent attention (DeepSeek)
)


def stored_quantization(model_dir: str | Path) -> QuantizationConfig | None:
    """The ``quantization_config`` of a checkpoint, or ``None`` for a float one."""
    path = Path(model_dir) / "config.json"
    entry = read_json(path).get("quantization_config")
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: quantization_config must be an object, got {entry!r}")
    try:
        return QuantizationConfig.from_json(entry)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def _quantized_name(name: str, config: QuantizationConfig) -> bool:
    """A mixture's experts stay float in the file (the loader quantizes them once read,
    ``linear.quantize_experts``): their per-expert tensors feed stacked weights."""
    module, _, leaf = name.rpartition(".")
    if leaf != "weight" or ".experts." in name:
        return False
    return module.rpartition(".")[2] in PROJECTIONS or (config.lm_head and module == "lm_head")


def quantize_checkpoint(source: str | Path, dest: str | Path, config: QuantizationConfig) -> int:
    """Writes ``source`` quantized into ``dest`` (created; its safetensors files are
    replaced); returns how many weights were quantized. ``source`` must be float. Its
    weight files are the loader's (``safetensors_files``); each is written quantized
    under its own name, with a new index when the source has one."""
    source, dest = Path(source), Path(dest)
    if stored_quantization(source) is not None:
        raise ValueError(f"{source} is already quantized")
    files = safetensors_files(source)
    if dest.exists() and dest.resolve() == source.resolve():
        raise ValueError(f"the output directory is the source {source}: give another one")
    dest.mkdir(parents=True, exist_ok=True)
    for old in (*dest.glob("*.safetensors"), dest / SAFETENSORS_INDEX):
        old.unlink(missing_ok=True)
    model_config = read_json(source / "config.json")
    count = 0
    weight_map: dict[str, str] = {}
    total_size = 0
    for path in files:
        out: dict[str, torch.Tensor] = {}
        with open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                if _quantized_name(name, config):
                    out.update(_quantized_tensors(name.removesuffix(".weight"), tensor, config))
                    count += 1
                else:
                    out[name] = tensor.contiguous()
                tied = name == "model.embed_tokens.weight" and model_config.get(
                    "tie_word_embeddings", False
                )
                if tied and config.lm_head:
                    out.update(_quantized_tensors("lm_head", tensor, config))
                    count += 1
        save_file(out, str(dest / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, path.name))
        total_size += sum(t.numel() * t.element_size() for t in out.values())
    if (source / SAFETENSORS_INDEX).exists():
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (dest / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for extra in source.iterdir():
        skip = extra.suffix == ".safetensors" or extra.name.endswith(".safetensors.index.json")
        if extra.is_file() and not skip and extra.name != "config.json":
            shutil.copy2(extra, dest / extra.name)
    model_config["quantization_config"] = config.to_json()
    (dest / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    return count


def _quantized_tensors(
    prefix: str, weight: torch.Tensor, config: QuantizationConfig
) -> dict[str, torch.Tensor]:
    if config.method is QuantMethod.INT8:
        q = quantize_int8(weight)
        return {f"{prefix}.qweight": q.qweight, f"{prefix}.scales": q.scales}
    q = quantize_int4(weight, config.group_size)
    assert q.zeros is not None
    return {
        f"{prefix}.qweight": q.qweight,
        f"{prefix}.scales": q.scales,
        f"{prefix}.zeros": q.zeros,
    }


def load_quantized(model: nn.Module, tensors: Iterable[tuple[str, object]]) -> set[str]:
    """Fills the quantized layers of ``model`` (made by ``quantize_model(empty=True)``)
    from a quantized checkpoint and passes every other tensor to ``model.load_weights``;
    returns the float parameters filled. ``ValueError`` when a quantized layer misses a
    tensor."""
    modules = dict(model.named_modules())
    seen: dict[str, set[tuple[str, int]]] = {}

    def float_tensors() -> Iterator[tuple[str, object]]:
        for name, tensor in tensors:
            target = _quantized_target(model, modules, name)
            if target is None:
                yield name, tensor
                continue
            path, layer, leaf, shard = target
            layer.load_part(leaf, tensor, shard)  # type: ignore[arg-type]
            seen.setdefault(path, set()).add((leaf, shard or 0))

    filled = model.load_weights(float_tensors())
    for path, module in modules.items():
        if isinstance(module, QuantizedLinear):
            _check_complete(path, module, seen.get(path, set()))
    return filled


def _quantized_target(
    model: nn.Module, modules: dict[str, nn.Module], name: str
) -> tuple[str, QuantizedLinear, str, int | None] | None:
    """Where a checkpoint tensor goes if it belongs to a quantized layer, else ``None``."""
    prefix, _, leaf = name.rpartition(".")
    if leaf not in (*QUANTIZED_LEAVES, "bias"):
        return None
    if prefix == "lm_head":
        target: tuple[str, int | None] | None = ("lm_head.weight", None)
    else:
        target = model.checkpoint_targets(f"{prefix}.weight")
    if target is None:
        return None
    path = target[0].removesuffix(".weight")
    layer = modules.get(path)
    if isinstance(layer, AllReducedLinear):
        path, layer = f"{path}.product", layer.product
    if not isinstance(layer, QuantizedLinear):
        if leaf == "bias":
            return None
        raise ValueError(f"checkpoint tensor {name!r} has no quantized layer to go to")
    return path, layer, leaf, target[1]


def _check_complete(path: str, layer: QuantizedLinear, seen: set[tuple[str, int]]) -> None:
    leaves = ["qweight", "scales"]
    if layer.zeros is not None:
        leaves.append("zeros")
    if layer.bias is not None:
        leaves.append("bias")
    missing = [
        f"{leaf}[{shard}]"
        for leaf in leaves
        for shard in range(len(layer.row_spans))
        if (leaf, shard) not in seen
    ]
    if missing:
        raise ValueError(f"quantized checkpoint lacks {', '.join(missing)} of {path}")
    if layer.zeros is not None and layer.zeros.numel() and int(layer.zeros.max()) > 15:
        raise ValueError(
            f"quantized checkpoint's {path}.zeros holds {int(layer.zeros.max())}: int4 zero "
            "points are 0..15"
        )
