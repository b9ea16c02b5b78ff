"""Reading a PEFT LoRA adapter into the slices of the targets it adapts, checked.

PEFT saves ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight``
(``[out, r]``) per adapted module, and ``adapter_config.json`` with ``r``, ``lora_alpha``,
``use_rslora`` (scaling ``alpha / sqrt(r)`` instead of ``alpha / r``) and per-module
``rank_pattern`` / ``alpha_pattern``. Each module maps to a target and a slice of it
(``targets.peft_target``); this rank keeps its share (A's input columns of a row-parallel
target, B's rows of a column-parallel one) with the scaling folded into B.

Everything a served adapter could get wrong is refused here, by name, before any slot
changes: a rank above ``max_lora_rank``, a module the model does not have or Tandem does
not adapt (embeddings, the LM head, experts), shapes of another base model, a missing
file, and the PEFT features this engine does not run (DoRA, trained biases,
``modules_to_save``, Conv1D's ``fan_in_fan_out``).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.common.checkpoint_files import open_safetensors
from tandem.common.lora import (
    LoRARequest,
    adapter_weights_file,
    kv_namespace,
    read_adapter_config,
)
from tandem.engine.lora.targets import Target, peft_target

_PEFT_KEY = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.\w+)?\.weight")
"""``base_model.model.<module>.lora_A[.<adapter name>].weight``."""

SliceWeights = tuple[int, torch.Tensor, torch.Tensor]
"""``(slice index, A [r, in held], B [rows held, r] scaled)``."""


@dataclass(frozen=True)
class LoadedAdapter:
    request: LoRARequest
    kv_namespace: str
    rank: int
    """The largest rank of any of its modules."""
    weights: dict[str, list[SliceWeights]]
    """By target path."""

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for ws in self.weights.values() for _, a, b in ws)


def load_adapter(
    request: LoRARequest,
    model: nn.Module,
    targets: dict[str, Target],
    max_rank: int,
    dtype: torch.dtype,
) -> LoadedAdapter:
    """The adapter at ``request.lora_path`` as this rank applies it to ``model`` (whose
    adaptable layers are ``targets``); ``ValueError`` naming the adapter and the fault."""
    name = request.lora_name
    config = read_adapter_config(request.lora_path, name)
    _check_config(name, config, max_rank)
    pairs = _read_pairs(request, config)
    weights: dict[str, list[SliceWeights]] = defaultdict(list)
    rank = 0
    for module, (a, b) in sorted(pairs.items()):
        where = f"LoRA adapter {name!r}, module {module}"
        try:
            path, shard = peft_target(model, module)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        target = targets.get(path)
        if target is None:
            raise ValueError(
                f"{where}: Tandem applies adapters to the attention and MLP projections "
                "(q/k/v/o, gate/up/down), not to this module"
            )
        r = a.shape[0]
        if r > max_rank:
            raise ValueError(f"{where}: rank {r} is above max_lora_rank {max_rank}")
        scale = _scaling(config, module, r)
        weights[path].extend(_slices(where, target, shard, a, b * scale, dtype))
        rank = max(rank, r)
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: {request.lora_path} holds no LoRA weights")
    return LoadedAdapter(request, kv_namespace(name, request.lora_path), rank, dict(weights))


def _check_config(name: str, config: dict[str, Any], max_rank: int) -> None:
    where = f"LoRA adapter {name!r}"
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{where} is a {peft_type} adapter; Tandem serves LoRA adapters")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained layers)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"{where} uses {what}, which Tandem does not serve")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where} trains biases (bias={config['bias']!r}); not supported")
    if config.get("layer_replication"):
        raise ValueError(f"{where} uses layer_replication, which Tandem does not serve")
    _check_types(where, config)
    ranks = [int(config.get("r", 8)), *(int(r) for r in config.get("rank_pattern", {}).values())]
    if max(ranks) > max_rank:
        raise ValueError(
            f"{where} has rank {max(ranks)}, above max_lora_rank {max_rank} (raise --max-lora-rank)"
        )


def _check_types(where: str, config: dict[str, Any]) -> None:
    """The fields this loader reads, of the types PEFT writes (a clear error, not a
    ``TypeError`` from deep inside)."""
    if "r" in config and not (_is_number(config["r"]) and config["r"] >= 1):
        raise ValueError(f"{where}: adapter_config.json's r must be >= 1, not {config['r']!r}")
    if "lora_alpha" in config and not _is_number(config["lora_alpha"]):
        raise ValueError(f"{where}: adapter_config.json's lora_alpha must be a number")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key, {})
        if not isinstance(patterns, dict) or not all(map(_is_number, patterns.values())):
            raise ValueError(f"{where}: adapter_config.json's {key} must map modules to numbers")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(
                    f"{where}: {key} key {pattern!r} is not a pattern: {err}"
                ) from None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read_pairs(
    request: LoRARequest, config: dict[str, Any]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``module path -> (A, B)`` in float32, with PEFT's prefix and adapter name gone."""
    name = request.lora_name
    found: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    with open_safetensors(adapter_weights_file(request.lora_path, name)) as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            match = _PEFT_KEY.fullmatch(key)
            if match is None:
                raise ValueError(
                    f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight "
                    "(embedding adapters, DoRA magnitudes and trained biases are not served)"
                )
            found[match[1]][match[2]] = f.get_tensor(key).float()
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise ValueError(f"LoRA adapter {name!r}: module {module} has no lora_{missing}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"LoRA adapter {name!r}, module {module}: lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)} do not make a LoRA pair"
            )
        pairs[module] = (a, b)
    return pairs


def _pattern_value(patterns: dict[str, Any], module: str) -> Any | None:
    """PEFT's per-module override: a key matching the module path's end."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({key})", module):
            return value
    return None


def _scaling(config: dict[str, Any], module: str, r: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern", {}), module)
    alpha = float(config.get("lora_alpha", 8) if alpha is None else alpha)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _slices(
    where: str,
    target: Target,
    shard: int | None,
    a: torch.Tensor,
    b: torch.Tensor,
    dtype: torch.dtype,
) -> list[SliceWeights]:
    """This rank's share of one module's pair, per slice of ``target`` it covers."""
    if a.shape[1] != target.in_features:
        raise ValueError(
            f"{where}: lora_A takes {a.shape[1]} inputs but the layer has "
            f"{target.in_features} (an adapter for another base model?)"
        )
    if target.in_span is not None:
        a = a[:, target.in_span.start : target.in_span.start + target.in_span.size]
    indices = range(len(target.slices)) if shard is None else [shard]
    expected = sum(target.slices[j].full_size for j in indices)
    if b.shape[0] != expected:
        raise ValueError(
            f"{where}: lora_B has {b.shape[0]} outputs but the layer has {expected} "
            "(an adapter for another base model?)"
        )
    out, row = [], 0
    for j in indices:
        piece = target.slices[j]
        held = b[row + piece.held.start : row + piece.held.start + piece.held.size]
        out.append((j, a.to(dtype).contiguous(), held.to(dtype).contiguous()))
        row += piece.full_size
    return out
