"""Seeded random LoRA adapters in PEFT's format, for a local base checkpoint.

What ``peft`` writes with ``save_pretrained``: ``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight [r, in]``
and ``lora_B.weight [out, r]``; PEFT loads them as its own (the tests check Tandem's
output against PEFT's on these files). Unlike PEFT's default start (B = 0, an adapter
that changes nothing), B is random too, so an adapter visibly changes the output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tandem.common.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tandem.common.model_config import Architecture, ModelConfig

_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"})
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``module -> (in, out)`` of each projection an adapter may target, by the
    checkpoint's own names (Phi-3 keeps q/k/v and gate/up fused)."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = {"o_proj": (q, h), "down_proj": (i, h)}
    if config.architecture is Architecture.PHI3:
        shapes |= {"qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * i)}
    else:
        shapes |= {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv)}
        shapes |= {"gate_proj": (h, i), "up_proj": (h, i)}
    return shapes


def make_lora(
    base_dir: str | Path,
    out_dir: str | Path,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = DEFAULT_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    strength: float = 1.0,
) -> Path:
    """Write an adapter of ``rank`` on ``targets`` of every layer of the model in
    ``base_dir``; returns ``out_dir``. ``strength`` scales B (how far the adapter moves
    the base model's output)."""
    import torch
    from safetensors.torch import save_file

    config = ModelConfig.from_dir(base_dir)
    shapes = module_shapes(config)
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"targets {unknown} are not modules of this model: {sorted(shapes)}")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            block = (
                "self_attn"
                if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
                else "mlp"
            )
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = shapes[module]
            a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=generator) * strength / rank**0.5
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "use_rslora": use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
