"""What Tandem needs to know about a checkpoint, parsed once from ``config.json``.

Torch-free: the router reads it to validate prompt lengths, the engine to build the
model. Both config spellings found in the wild are accepted: ``rope_theta`` +
``rope_scaling`` (most released checkpoints) and ``rope_parameters`` (what
``transformers`` 5 writes).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.common.checkpoint_files import read_json


class Architecture(enum.Enum):
    LLAMA = "LlamaForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    MISTRAL = "MistralForCausalLM"
    QWEN3 = "Qwen3ForCausalLM"
    PHI3 = "Phi3ForCausalLM"
    GEMMA2 = "Gemma2ForCausalLM"
    GEMMA3 = "Gemma3ForCausalLM"
    MIXTRAL = "MixtralForCausalLM"
    QWEN3_MOE = "Qwen3MoeForCausalLM"
    DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
    DEEPSEEK_V3 = "DeepseekV3ForCausalLM"


GEMMA_ARCHS = frozenset({Architecture.GEMMA2, Architecture.GEMMA3})
QK_NORM_ARCHS = frozenset({Architecture.QWEN3, Architecture.QWEN3_MOE, Architecture.GEMMA3})
DEEPSEEK_ARCHS = frozenset({Architecture.DEEPSEEK_V2, Architecture.DEEPSEEK_V3})


class Activation(enum.Enum):
    """The gate's activation in a gated MLP (``hidden_act`` / ``hidden_activation``)."""

    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"


class RopeScaling(enum.Enum):
    NONE = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling: RopeScaling = RopeScaling.NONE
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (``rope_type`` "yarn"): the band of dims blended between interpolation and
    # extrapolation, and the magnitude corrections.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def yarn_attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 for the other scalings)."""
        if self.scaling is not RopeScaling.YARN:
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """The factor MLA models (DeepSeek) fold into the softmax scale, squared:
        YaRN's ``mscale_all_dim`` correction of the dims that do not rotate."""
        if self.scaling is RopeScaling.NONE or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not scaled)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are rebuilt per head
    from one compressed latent of ``kv_lora_rank`` values per token plus one shared
    rotated key of ``qk_rope_head_dim``; those two are all the KV cache holds."""

    q_lora_rank: int | None
    """Queries through a low-rank bottleneck of this size (``None``: one projection)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved_rope: bool
    """The rotated dims pair up as (0, 1), (2, 3), ... (DeepSeek's checkpoints)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values per token and layer in the cache: the latent, then the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: ``top_k`` of ``num_experts`` gated MLPs per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Of one expert (a dense layer keeps ``ModelConfig.intermediate_size``)."""
    renormalize: bool
    """Scale the chosen experts' softmax weights to sum to one (Mixtral; Qwen3-MoE's
    ``norm_topk_prob``)."""
    weights_in_model_dtype: bool
    """Round the routing weights to the model dtype before the experts' outputs are
    scaled (Qwen3-MoE) rather than scaling in float32 (Mixtral)."""
    sparse_layers: tuple[bool, ...]
    """Per layer: a mixture of experts (``True``) or a dense MLP."""
    scoring: str = "softmax"
    """Router scores: ``softmax`` over the experts, or each expert's ``sigmoid``
    (DeepSeek-V3)."""
    group_choice: str | None = None
    """Group-limited routing: experts come from the ``topk_group`` of ``num_groups``
    groups that score best, a group scoring its ``max`` expert (DeepSeek-V2) or the sum
    of its ``top2`` (V3); ``None``: every expert competes."""
    num_groups: int = 1
    topk_group: int = 1
    correction_bias: bool = False
    """A per-expert bias added to the scores for the choice only (V3's
    ``e_score_correction_bias``); the weights stay the plain scores."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routing weights (after any renormalisation)."""
    shared_intermediate_size: int = 0
    """A dense MLP of this size every token also runs (DeepSeek's shared experts;
    0: none)."""
    scoring_in_float32: bool = False
    """The router's weights (and correction bias) stay float32 in a lower-precision
    model, its scores computed in float32 (DeepSeek)."""


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
    hidden_act: Activation = Activation.SILU
    qk_norm: bool = False
    """An RMSNorm over each head of q and k before the rotation (Qwen3, Gemma 3)."""
    rotary_dim: int | None = None
    """Leading dims of each head that are rotated (``partial_rotary_factor``); ``None``:
    all of ``head_dim``."""
    local_rope: RopeConfig | None = None
    """Rotation of the sliding-window layers when it differs from ``rope`` (Gemma 3)."""
    query_pre_attn_scalar: float | None = None
    """Scores are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma); ``None``:
    ``head_dim ** -0.5``."""
    attn_logit_softcap: float | None = None
    """Scores become ``cap * tanh(scores / cap)`` before the softmax (Gemma 2)."""
    final_logit_softcap: float | None = None
    """Logits become ``cap * tanh(logits / cap)`` (Gemma 2)."""
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    """Multi-head latent attention; then ``num_kv_heads`` is 1 and ``head_dim`` is the
    cache row (``MLAConfig.cache_width``): the latent is stored once per token."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        if self.mla is not None:
            return self.mla.qk_head_dim**-0.5 * self.rope.softmax_mscale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotated_dims(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """``ValueError`` naming ``config.json`` when it is missing or not a JSON object."""
        return cls.from_dict(read_json(Path(model_dir) / "config.json"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = _architecture(raw)
        num_heads = _positive(raw, "num_attention_heads")
        hidden = _positive(raw, "hidden_size")
        num_layers = _positive(raw, "num_hidden_layers")
        head_dim = raw.get("head_dim") or hidden // num_heads
        eos = raw.get("eos_token_id")
        gemma = arch in GEMMA_ARCHS
        mla = _mla(raw, arch)
        return cls(
            architecture=arch,
            vocab_size=_positive(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=1 if mla else raw.get("num_key_value_heads") or num_heads,
            head_dim=mla.cache_width if mla else head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_rope(
                raw,
                _rope_params(raw, arch, "full_attention"),
                1_000_000.0 if arch is Architecture.GEMMA3 else 10_000.0,
            ),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch in _TIED_BY_DEFAULT)),
            qkv_bias=arch is Architecture.QWEN2 or bool(raw.get("attention_bias", False)),
            sliding_windows=_sliding_windows(raw, arch, num_layers),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            hidden_act=_activation(raw, gemma),
            qk_norm=arch in QK_NORM_ARCHS,
            rotary_dim=None if mla else _rotary_dim(raw, arch, head_dim),
            local_rope=_local_rope(raw, arch),
            query_pre_attn_scalar=_optional_float(raw, "query_pre_attn_scalar") if gemma else None,
            attn_logit_softcap=_optional_float(raw, "attn_logit_softcapping") if gemma else None,
            final_logit_softcap=_optional_float(raw, "final_logit_softcapping") if gemma else None,
            moe=_moe(raw, arch, num_layers),
            mla=mla,
        )


_TIED_BY_DEFAULT = frozenset({Architecture.QWEN2, *GEMMA_ARCHS})


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


def _rope_params(raw: dict[str, Any], arch: Architecture, layer_type: str) -> dict[str, Any]:
    """The rope parameters of one layer type: ``rope_parameters`` (transformers 5; keyed
    by layer type for Gemma 3) or the legacy ``rope_scaling``."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json field 'rope_parameters' must be an object, got {params!r}")
    keyed = "full_attention" in params or "sliding_attention" in params
    if keyed:
        return params.get(layer_type) or {}
    return params if layer_type == "full_attention" else {}


def _rope(
    raw: dict[str, Any], params: dict[str, Any], default_theta: float = 10000.0
) -> RopeConfig:
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    kind = params.get("rope_type", params.get("type", "default"))
    try:
        scaling = RopeScaling(kind)
    except ValueError:
        supported = ", ".join(repr(r.value) for r in RopeScaling)
        raise ValueError(
            f"config.json rope type {kind!r} is not supported (supported: {supported})"
        ) from None
    if scaling is RopeScaling.NONE:
        return RopeConfig(theta=theta)
    factor = float(_require(params, "factor"))
    if factor <= 0:
        raise ValueError(f"config.json rope 'factor' must be positive, got {factor}")
    return RopeConfig(
        theta=theta,
        scaling=scaling,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_optional_float(params, "mscale"),
        mscale_all_dim=_optional_float(params, "mscale_all_dim"),
        attention_factor=_optional_float(params, "attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _sliding_windows(
    raw: dict[str, Any], arch: Architecture, num_layers: int
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch in (Architecture.MISTRAL, Architecture.PHI3, Architecture.MIXTRAL):
        return (window,) * num_layers
    if arch is Architecture.GEMMA2:  # even layers local, odd layers global
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if arch is Architecture.GEMMA3:  # every `pattern`-th layer global
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    qwen = (Architecture.QWEN2, Architecture.QWEN3, Architecture.QWEN3_MOE)
    if arch in qwen and raw.get("use_sliding_window") and window:
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def _positive(raw: dict[str, Any], key: str) -> int:
    value = _require(raw, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def _optional_float(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    return None if value is None else float(value)


def _activation(raw: dict[str, Any], gemma: bool) -> Activation:
    # Gemma's MLP reads `hidden_activation`; its `hidden_act` is a leftover of Gemma 1.
    key = "hidden_activation" if gemma and "hidden_activation" in raw else "hidden_act"
    name = raw.get(key, "gelu_pytorch_tanh" if gemma else "silu")
    try:
        return Activation(name)
    except ValueError:
        supported = ", ".join(repr(a.value) for a in Activation)
        raise ValueError(
            f"config.json field {key!r} = {name!r} is not supported (supported: {supported})"
        ) from None


def _rotary_dim(raw: dict[str, Any], arch: Architecture, head_dim: int) -> int | None:
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if not 0.0 < factor <= 1.0:
        raise ValueError(
            f"config.json field 'partial_rotary_factor' must be in (0, 1], got {factor}"
        )
    dims = int(head_dim * factor)
    if dims % 2:
        raise ValueError(
            f"config.json field 'partial_rotary_factor' ({factor}) gives {dims} rotated dims "
            f"of head_dim {head_dim}; they must be even"
        )
    return None if dims == head_dim else dims


def _local_rope(raw: dict[str, Any], arch: Architecture) -> RopeConfig | None:
    if arch is not Architecture.GEMMA3:
        return None
    params = _rope_params(raw, arch, "sliding_attention")
    if not params:  # legacy spelling: only a base, no scaling
        params = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    return _rope({}, params, default_theta=10000.0)


def _moe(raw: dict[str, Any], arch: Architecture, num_layers: int) -> MoEConfig | None:
    if arch is Architecture.MIXTRAL:
        num_experts = _positive(raw, "num_local_experts")
        sparse = (True,) * num_layers
        inner = _positive(raw, "intermediate_size")
        renormalize, in_model_dtype = True, False
    elif arch is Architecture.QWEN3_MOE:
        num_experts = _positive(raw, "num_experts")
        step = _positive(raw, "decoder_sparse_step") if "decoder_sparse_step" in raw else 1
        dense = set(raw.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        inner = _positive(raw, "moe_intermediate_size")
        renormalize, in_model_dtype = bool(raw.get("norm_topk_prob", False)), True
    elif arch in DEEPSEEK_ARCHS:
        return _deepseek_moe(raw, arch, num_layers)
    else:
        return None
    top_k = _top_k(raw, num_experts)
    return MoEConfig(num_experts, top_k, inner, renormalize, in_model_dtype, sparse)


def _top_k(raw: dict[str, Any], num_experts: int) -> int:
    top_k = _positive(raw, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(
            f"config.json field 'num_experts_per_tok' ({top_k}) exceeds the number of "
            f"experts ({num_experts})"
        )
    return top_k


_DEEPSEEK_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _deepseek_moe(raw: dict[str, Any], arch: Architecture, num_layers: int) -> MoEConfig:
    """DeepSeek's MoE: ``n_routed_experts`` routed plus ``n_shared_experts`` always run,
    dense MLPs on the first ``first_k_dense_replace`` layers (and off the
    ``moe_layer_freq`` stride). V2 scores by softmax, picking greedily or from the best
    groups (``topk_method``); V3 by sigmoid with a choice-only bias, from the groups
    whose two best experts score best."""
    num_experts = _positive(raw, "n_routed_experts")
    top_k = _top_k(raw, num_experts)
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    freq = _positive(raw, "moe_layer_freq") if "moe_layer_freq" in raw else 1
    sparse = tuple(i >= first_dense and i % freq == 0 for i in range(num_layers))
    v3 = arch is Architecture.DEEPSEEK_V3
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in _DEEPSEEK_TOPK_METHODS:
        raise ValueError(
            f"config.json field 'topk_method' = {method!r} is not supported "
            f"(supported: {', '.join(repr(m) for m in _DEEPSEEK_TOPK_METHODS)})"
        )
    grouped = v3 or method == "group_limited_greedy"
    num_groups = int(raw.get("n_group") or 1) if grouped else 1
    topk_group = int(raw.get("topk_group") or num_groups) if grouped else 1
    if grouped and (num_groups < 1 or num_experts % num_groups):
        raise ValueError(
            f"config.json field 'n_group' ({num_groups}) must divide n_routed_experts "
            f"({num_experts})"
        )
    if grouped and not 1 <= topk_group <= num_groups:
        raise ValueError(
            f"config.json field 'topk_group' ({topk_group}) must be between 1 and n_group "
            f"({num_groups})"
        )
    if grouped and top_k > topk_group * (num_experts // num_groups):
        raise ValueError(
            f"config.json field 'num_experts_per_tok' ({top_k}) exceeds the experts of "
            f"the topk_group ({topk_group}) groups chosen"
        )
    shared = int(raw.get("n_shared_experts") or 0)
    inner = _positive(raw, "moe_intermediate_size")
    return MoEConfig(
        num_experts,
        top_k,
        inner,
        renormalize=bool(raw.get("norm_topk_prob", False)),
        weights_in_model_dtype=False,
        sparse_layers=sparse,
        scoring="sigmoid" if v3 else "softmax",
        group_choice=("top2" if v3 else "max") if grouped else None,
        num_groups=num_groups,
        topk_group=topk_group,
        correction_bias=v3,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        shared_intermediate_size=shared * inner,
        scoring_in_float32=True,
    )


def _mla(raw: dict[str, Any], arch: Architecture) -> MLAConfig | None:
    if arch not in DEEPSEEK_ARCHS:
        return None
    q_lora = raw.get("q_lora_rank")
    mla = MLAConfig(
        q_lora_rank=None if q_lora is None else _positive(raw, "q_lora_rank"),
        kv_lora_rank=_positive(raw, "kv_lora_rank"),
        qk_nope_head_dim=_positive(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=_positive(raw, "qk_rope_head_dim"),
        v_head_dim=_positive(raw, "v_head_dim"),
        # V2's checkpoints always pair neighbours; V3 says so (transformers' default).
        interleaved_rope=arch is Architecture.DEEPSEEK_V2 or bool(raw.get("rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2:
        raise ValueError(
            f"config.json field 'qk_rope_head_dim' ({mla.qk_rope_head_dim}) must be even"
        )
    return mla
