"""What Tandem needs to know about a checkpoint, parsed once from ``config.json``.

Torch-free: the router reads it to validate prompt lengths, the engine to build the
model. Both config spellings found in the wild are accepted: ``rope_theta`` +
``rope_scaling`` (most released checkpoints) and ``rope_parameters`` (what
``transformers`` 5 writes).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Architecture(enum.Enum):
    LLAMA = "LlamaForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    MISTRAL = "MistralForCausalLM"


class RopeScaling(enum.Enum):
    NONE = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling: RopeScaling = RopeScaling.NONE
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer checkpoint."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: attend to at most this many most recent positions (self included)."""
    dtype: str
    bos_token_id: int | None
    eos_token_ids: frozenset[int]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model directory {model_dir!s} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = _architecture(raw)
        num_heads = _require(raw, "num_attention_heads")
        hidden = _require(raw, "hidden_size")
        num_layers = _require(raw, "num_hidden_layers")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=_require(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_require(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch is Architecture.QWEN2)),
            qkv_bias=arch is Architecture.QWEN2 or bool(raw.get("attention_bias", False)),
            sliding_windows=_sliding_windows(raw, arch, num_layers),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )


def _architecture(raw: dict[str, Any]) -> Architecture:
    names = raw.get("architectures") or []
    for name in names:
        try:
            return Architecture(name)
        except ValueError:
            continue
    supported = ", ".join(a.value for a in Architecture)
    raise ValueError(
        f"architectures {names!r} in config.json is not supported (supported: {supported})"
    )


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ValueError(f"config.json is missing required field {key!r}")
    return raw[key]


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    try:
        scaling = RopeScaling(kind)
    except ValueError:
        raise ValueError(f"rope scaling type {kind!r} is not supported") from None
    if scaling is RopeScaling.NONE:
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        scaling=scaling,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def _sliding_windows(
    raw: dict[str, Any], arch: Architecture, num_layers: int
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch is Architecture.MISTRAL:
        return (window,) * num_layers
    if arch is Architecture.QWEN2 and raw.get("use_sliding_window") and window:
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers
