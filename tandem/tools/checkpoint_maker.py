"""Random-weight HuggingFace checkpoints for tests and benchmarks, made offline.

``make_model(out_dir, arch, size, ...)`` writes a directory that ``transformers`` loads
with ``AutoModelForCausalLM`` / ``AutoTokenizer``: ``config.json``,
``generation_config.json``, ``model.safetensors`` (standard HF tensor names),
``tokenizer.json`` and ``tokenizer_config.json`` (see ``tandem.tools.checkpoint_tokenizer``).

Weights are a pure function of ``(seed, tensor name, shape)``: every tensor draws from
its own PCG64 stream seeded by ``(seed, crc32(name))`` and uses only the raw 64-bit
outputs (whose streams numpy keeps stable), mapped to uniform floats with exact
arithmetic, so the same seed gives the same bytes on every machine.

Initialisation (uniform distributions, given by their standard deviation; d = hidden
size, L = layers), chosen so that a float32 greedy comparison against transformers is
meaningful:

* ``embed_tokens`` and ``lm_head``: std ``1/sqrt(d)`` (rows of norm about 1).
* final ``model.norm`` weight: ``LOGIT_SCALE * (1 ± NORM_JITTER)``, so logits have a
  std of about ``LOGIT_SCALE`` (4) over the vocabulary; other RMSNorm weights are
  ``1 ± NORM_JITTER`` (not all ones, so a norm-loading bug shows).
* ``q/k/v_proj``: std ``1/sqrt(d)``, q and k times ``QK_GAIN`` (scores of std ~2, so
  attention is sharp and position-dependent and a RoPE or mask bug changes the
  output). Qwen2 q/k/v biases: std ``BIAS_STD``, small because a v bias passes through
  attention undiluted and adds the same "favourite token" to every position.
* ``o_proj`` / ``down_proj``: std ``BRANCH_GAIN / sqrt(fan_in * L)``: every block adds
  a comparable share and the residual RMS grows smoothly to about 2 (tiny: 0.1 after
  the embedding, then 1.0, 1.4, 1.8). The small embedding share matters for tied
  embeddings (Qwen2): the logit of the input token is raised by about
  ``embedding RMS * sqrt(d) / residual RMS`` standard deviations, and a large
  embedding makes greedy decoding repeat its input token forever.

Measured with transformers (float32, greedy, 8 prompts x 48 new tokens x 3 seeds,
tiny and small): top-1 minus top-2 logit margin median 0.74-0.81, 1st percentile
0.008-0.016, below 1e-3 in 0.1-0.35 % of steps; medium (1 seed, 32 tokens): median
0.70-0.82, none below 1e-3. Greedy output does not collapse: the mean fraction of
distinct tokens is 0.75-0.91 (llama/mistral 0.82-0.91, qwen2 0.75-0.81).

``python -m tandem.tools.checkpoint_maker`` is not a CLI; use ``tandem make-model``.
"""

from __future__ import annotations

import enum
import json
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tandem.tools.checkpoint_tokenizer import MIN_VOCAB_SIZE, TokenIds, write_tokenizer

LOGIT_SCALE = 4.0
QK_GAIN = 1.5
BRANCH_GAIN = 2.0
BIAS_STD = 0.1
NORM_JITTER = 0.25
MAX_POSITION_EMBEDDINGS = 2048
ROPE_SCALING_FACTOR = 2.0
PHI3_PARTIAL_ROTARY = 0.75
GEMMA_QUERY_SCALAR_OFFSET = 8  # query_pre_attn_scalar != head_dim, so the scale is read
GEMMA2_ATTN_SOFTCAP = 8.0  # low enough that capping changes scores of std ~2-3
GEMMA2_FINAL_SOFTCAP = 30.0
GEMMA_EMBED_STD = 0.1  # of the embedding after its sqrt(d) scaling (tied: see docstring)
GEMMA_FINAL_NORM = 40.0  # logits of std ~4 through the small tied embedding
GEMMA3_PATTERN = 2  # every 2nd layer global, so a 4-layer model has both kinds
GEMMA3_LOCAL_THETA = 10_000.0
MOE_TOP_K = 2
QWEN3_MOE_DENSE_LAYERS = (1,)  # mlp_only_layers: one dense layer among the sparse ones
ROUTER_STD_GAIN = 2.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 1024  # below MAX_POSITION_EMBEDDINGS, so scaling matters
# DeepSeek's latent attention, odd on purpose: a latent that is no multiple of the head
# sizes, v_head_dim != qk_nope_head_dim, 8 of 24 query/key dims rotated.
DEEPSEEK_KV_LORA_RANK = 40
DEEPSEEK_Q_LORA_RANK = 48  # V3 only: V2's queries take one projection (no query LoRA)
DEEPSEEK_NOPE_DIM, DEEPSEEK_ROPE_DIM, DEEPSEEK_V_DIM = 16, 8, 12
DEEPSEEK_EXPERTS, DEEPSEEK_GROUPS = 8, 4
# Groups kept per token: V3 2 (groups scored by their two best experts); V2 1, because
# with V2's score (a group's best expert) and top_k <= topk_group the choice never
# differs from plain top-k, so a test model must keep fewer groups than top_k.
DEEPSEEK_TOPK_GROUP = {"deepseek_v2": 1, "deepseek_v3": 2}
DEEPSEEK_FIRST_DENSE = 1  # first_k_dense_replace: layer 0 dense, the rest sparse
# YaRN as the released checkpoints use it; mscale != mscale_all_dim, so both the rotary
# magnitude and the softmax correction differ from 1.
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
CORRECTION_BIAS_STD = 0.05


@dataclass(frozen=True)
class SizePreset:
    """Shape of one model size.

    ``sliding_window`` applies only to archs that use one: each position attends to at
    most that many most recent positions, itself included (transformers' semantics).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    sliding_window: int


PRESETS: dict[str, SizePreset] = {
    "tiny": SizePreset(64, 4, 4, 2, 192, sliding_window=64),
    "small": SizePreset(256, 6, 8, 2, 768, sliding_window=64),
    "medium": SizePreset(768, 12, 12, 4, 3072, sliding_window=256),  # ≈110M parameters
    # Trained on the stdlib by `tandem make-model --train-pair` (tandem.tools.training), shipped
    # in engine/assets/trained: sized so the pair fits in ~8 MB in bfloat16.
    "trained-target": SizePreset(192, 4, 6, 2, 512, sliding_window=64),  # 3.1M parameters
    "trained-draft": SizePreset(64, 2, 4, 2, 192, sliding_window=64),  # 0.6M parameters
    # With --arch qwen3_moe: 6 experts of 96 (2 per token) on 3 of 4 layers, 2.2M parameters.
    "trained-moe": SizePreset(128, 4, 4, 2, 384, sliding_window=64),
}


class Family(enum.Enum):
    """How a family lays out its layers' tensors (``_layer_weights``)."""

    LLAMA = "llama"
    PHI3 = "phi3"  # fused qkv_proj and gate_up_proj tensors
    GEMMA = "gemma"  # four norms per layer, stored as offsets from one
    DEEPSEEK = "deepseek"  # latent attention (q_a/q_b or q_proj, kv_a/kv_b), shared experts


class Experts(enum.Enum):
    """How a mixture-of-experts checkpoint names its router and experts."""

    MIXTRAL = "mixtral"  # block_sparse_moe.gate, experts.{e}.w1 / w3 / w2
    QWEN3_MOE = "qwen3_moe"  # mlp.gate, experts.{e}.gate_proj / up_proj / down_proj
    DEEPSEEK = "deepseek"  # Qwen3-MoE's names + mlp.shared_experts.*, V3's gate bias


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one HF architecture's checkpoint from another's."""

    class_name: str
    model_type: str
    qkv_bias: bool
    tie_word_embeddings: bool
    has_sliding_window: bool
    rope_theta: float
    rms_norm_eps: float
    extra_fields: Callable[[CheckpointSpec], dict[str, object]]  # arch-only config.json keys
    family: Family = Family.LLAMA
    qk_norm: bool = False
    wide_heads: bool = False
    """``head_dim`` 1.5x ``hidden_size / heads`` (Qwen3 and Gemma set it on its own)."""
    experts: Experts | None = None


def _llama_fields(spec: CheckpointSpec) -> dict[str, object]:
    return {"mlp_bias": False, "pretraining_tp": 1}


def _qwen2_fields(spec: CheckpointSpec) -> dict[str, object]:
    # Qwen2's optional sliding window stays off; `attention_bias` only documents q/k/v bias.
    layers = spec.preset.num_layers
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers}


def _mistral_fields(spec: CheckpointSpec) -> dict[str, object]:
    return {"sliding_window": spec.window}


def _qwen3_fields(spec: CheckpointSpec) -> dict[str, object]:
    return _qwen2_fields(spec)


def _phi3_fields(spec: CheckpointSpec) -> dict[str, object]:
    return {
        "sliding_window": spec.window,
        "partial_rotary_factor": PHI3_PARTIAL_ROTARY,
        "original_max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


def _gemma_fields(spec: CheckpointSpec) -> dict[str, object]:
    return {
        "sliding_window": spec.window,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": spec.head_dim + GEMMA_QUERY_SCALAR_OFFSET,
        "attn_logit_softcapping": GEMMA2_ATTN_SOFTCAP if spec.arch == "gemma2" else None,
        "final_logit_softcapping": GEMMA2_FINAL_SOFTCAP if spec.arch == "gemma2" else None,
    }


def _gemma3_fields(spec: CheckpointSpec) -> dict[str, object]:
    fields = _gemma_fields(spec)
    if spec.config_style is ConfigStyle.LEGACY:
        fields["sliding_window_pattern"] = GEMMA3_PATTERN
        fields["rope_local_base_freq"] = GEMMA3_LOCAL_THETA
    else:
        layers = range(spec.preset.num_layers)
        fields["layer_types"] = [
            "sliding_attention" if (i + 1) % GEMMA3_PATTERN else "full_attention" for i in layers
        ]
    return fields


def _mixtral_fields(spec: CheckpointSpec) -> dict[str, object]:
    return {
        "sliding_window": None,
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": MOE_TOP_K,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def _qwen3_moe_fields(spec: CheckpointSpec) -> dict[str, object]:
    return {
        **_qwen2_fields(spec),
        "num_experts": spec.num_experts,
        "num_experts_per_tok": MOE_TOP_K,
        "moe_intermediate_size": spec.expert_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(QWEN3_MOE_DENSE_LAYERS),
        "norm_topk_prob": False,
        "output_router_logits": False,
    }


def _deepseek_fields(spec: CheckpointSpec) -> dict[str, object]:
    v3 = spec.arch == "deepseek_v3"
    fields: dict[str, object] = {
        # As the released configs: one "KV head" per query head (the latent is shared);
        # transformers takes head_dim for the rotated part.
        "num_key_value_heads": spec.preset.num_heads,
        "head_dim": DEEPSEEK_ROPE_DIM,
        "q_lora_rank": DEEPSEEK_Q_LORA_RANK if v3 else None,
        "kv_lora_rank": DEEPSEEK_KV_LORA_RANK,
        "qk_nope_head_dim": DEEPSEEK_NOPE_DIM,
        "qk_rope_head_dim": DEEPSEEK_ROPE_DIM,
        "v_head_dim": DEEPSEEK_V_DIM,
        "n_routed_experts": spec.num_experts,
        "n_shared_experts": spec.num_shared_experts,
        "num_experts_per_tok": MOE_TOP_K,
        "moe_intermediate_size": spec.expert_intermediate_size,
        "first_k_dense_replace": DEEPSEEK_FIRST_DENSE,
        "moe_layer_freq": 1,
        "n_group": DEEPSEEK_GROUPS,
        "topk_group": DEEPSEEK_TOPK_GROUP[spec.arch],
        "routed_scaling_factor": 2.5 if v3 else 1.5,
        "norm_topk_prob": v3,
        "output_router_logits": False,
    }
    if v3:
        fields.update({"rope_interleave": True, "num_nextn_predict_layers": 0})
    else:
        fields["topk_method"] = "group_limited_greedy"
    return fields


def _deepseek_spec(arch: str) -> ArchSpec:
    """V2 and V3 differ only in config fields (``_deepseek_fields``)."""
    return ArchSpec(
        class_name="DeepseekV2ForCausalLM" if arch == "deepseek_v2" else "DeepseekV3ForCausalLM",
        model_type=arch,
        qkv_bias=False,
        tie_word_embeddings=False,
        has_sliding_window=False,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        extra_fields=_deepseek_fields,
        family=Family.DEEPSEEK,
        experts=Experts.DEEPSEEK,
    )


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        class_name="LlamaForCausalLM",
        model_type="llama",
        qkv_bias=False,
        tie_word_embeddings=False,
        has_sliding_window=False,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        extra_fields=_llama_fields,
    ),
    "qwen2": ArchSpec(
        class_name="Qwen2ForCausalLM",
        model_type="qwen2",
        qkv_bias=True,
        tie_word_embeddings=True,
        has_sliding_window=False,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        extra_fields=_qwen2_fields,
    ),
    "mistral": ArchSpec(
        class_name="MistralForCausalLM",
        model_type="mistral",
        qkv_bias=False,
        tie_word_embeddings=False,
        has_sliding_window=True,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        extra_fields=_mistral_fields,
    ),
}

ARCHS.update(
    {
        "qwen3": ArchSpec(
            class_name="Qwen3ForCausalLM",
            model_type="qwen3",
            qkv_bias=False,
            tie_word_embeddings=True,
            has_sliding_window=False,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            extra_fields=_qwen3_fields,
            qk_norm=True,
            wide_heads=True,
        ),
        "phi3": ArchSpec(
            class_name="Phi3ForCausalLM",
            model_type="phi3",
            qkv_bias=False,
            tie_word_embeddings=False,
            has_sliding_window=True,
            rope_theta=10_000.0,
            rms_norm_eps=1e-5,
            extra_fields=_phi3_fields,
            family=Family.PHI3,
        ),
        "gemma2": ArchSpec(
            class_name="Gemma2ForCausalLM",
            model_type="gemma2",
            qkv_bias=False,
            tie_word_embeddings=True,
            has_sliding_window=True,
            rope_theta=10_000.0,
            rms_norm_eps=1e-6,
            extra_fields=_gemma_fields,
            family=Family.GEMMA,
            wide_heads=True,
        ),
        "gemma3": ArchSpec(
            class_name="Gemma3ForCausalLM",
            model_type="gemma3_text",
            qkv_bias=False,
            tie_word_embeddings=True,
            has_sliding_window=True,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            extra_fields=_gemma3_fields,
            family=Family.GEMMA,
            qk_norm=True,
            wide_heads=True,
        ),
        "mixtral": ArchSpec(
            class_name="MixtralForCausalLM",
            model_type="mixtral",
            qkv_bias=False,
            tie_word_embeddings=False,
            has_sliding_window=False,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-5,
            extra_fields=_mixtral_fields,
            experts=Experts.MIXTRAL,
        ),
        "qwen3_moe": ArchSpec(
            class_name="Qwen3MoeForCausalLM",
            model_type="qwen3_moe",
            qkv_bias=False,
            tie_word_embeddings=False,
            has_sliding_window=False,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            extra_fields=_qwen3_moe_fields,
            qk_norm=True,
            wide_heads=True,
            experts=Experts.QWEN3_MOE,
        ),
        **{arch: _deepseek_spec(arch) for arch in ("deepseek_v2", "deepseek_v3")},
    }
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class RopeScaling(enum.Enum):
    NONE = "none"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"  # DeepSeek's default here (DEEPSEEK_YARN)


class ConfigStyle(enum.Enum):
    LEGACY = "legacy"  # top-level rope_theta + rope_scaling, torch_dtype (transformers 4)
    V5 = "v5"  # rope_parameters holding rope_theta and rope_type, dtype (transformers 5)


@dataclass(frozen=True)
class CheckpointSpec:
    """Everything a made checkpoint depends on; validated at construction."""

    arch: str = "llama"
    size: str = "tiny"
    seed: int = 0
    dtype: str = "float32"
    rope_scaling: RopeScaling = RopeScaling.NONE
    config_style: ConfigStyle = ConfigStyle.LEGACY
    vocab_size: int = 4096
    kv_heads: int | None = None  # None: the preset's
    intermediate_size: int | None = None  # None: the preset's (a MoE's experts follow it)
    sliding_window: int | None = None  # None: the preset's (sliding-window archs only)

    def __post_init__(self) -> None:
        _require(self.arch in ARCHS, f"arch must be one of {sorted(ARCHS)}, got {self.arch!r}")
        _require(self.size in PRESETS, f"size must be one of {list(PRESETS)}, got {self.size!r}")
        _require(self.dtype in DTYPES, f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        _require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        _require(
            self.vocab_size >= MIN_VOCAB_SIZE,
            f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {self.vocab_size}",
        )
        heads = self.preset.num_heads
        _require(
            self.kv_heads is None or (self.kv_heads >= 1 and heads % self.kv_heads == 0),
            f"kv_heads must divide num_heads={heads}, got {self.kv_heads}",
        )
        _require(
            self.intermediate_size is None or self.intermediate_size >= 4,
            f"intermediate_size must be >= 4, got {self.intermediate_size}",
        )
        _require(
            self.sliding_window is None or self.arch_spec.has_sliding_window,
            f"sliding_window needs an arch with sliding-window attention, not {self.arch}",
        )
        _require(
            self.sliding_window is None or self.sliding_window >= 1,
            f"sliding_window must be >= 1, got {self.sliding_window}",
        )

    @property
    def preset(self) -> SizePreset:
        return PRESETS[self.size]

    @property
    def arch_spec(self) -> ArchSpec:
        return ARCHS[self.arch]

    @property
    def intermediate(self) -> int:
        inner = self.intermediate_size
        return self.preset.intermediate_size if inner is None else inner

    @property
    def num_kv_heads(self) -> int:
        return self.preset.num_kv_heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        base = self.preset.hidden_size // self.preset.num_heads
        return base * 3 // 2 if self.arch_spec.wide_heads else base

    @property
    def num_experts(self) -> int:
        """Mixtral 4 (every layer sparse), Qwen3-MoE 6 (3 per rank at TP 2), DeepSeek 8
        (in 4 groups)."""
        experts = self.arch_spec.experts
        if experts is Experts.DEEPSEEK:
            return DEEPSEEK_EXPERTS
        return 4 if experts is Experts.MIXTRAL else 6

    @property
    def num_shared_experts(self) -> int:
        """DeepSeek-V2 2 (as its checkpoints), V3 1; the others none."""
        if self.arch_spec.experts is not Experts.DEEPSEEK:
            return 0
        return 1 if self.arch == "deepseek_v3" else 2

    @property
    def expert_intermediate_size(self) -> int:
        """Mixtral's experts use ``intermediate_size``; Qwen3-MoE's are a quarter of it."""
        inner = self.intermediate
        return inner if self.arch_spec.experts is Experts.MIXTRAL else inner // 4

    @property
    def window(self) -> int | None:
        """The sliding window in tokens, or None for full attention."""
        if not self.arch_spec.has_sliding_window:
            return None
        return self.preset.sliding_window if self.sliding_window is None else self.sliding_window


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    rope_scaling: str = "none",
    config_style: str = "legacy",
    vocab_size: int = 4096,
    kv_heads: int | None = None,
    sliding_window: int | None = None,
    intermediate_size: int | None = None,
) -> Path:
    """Write a random checkpoint to ``out_dir`` (created if needed); return its path."""
    spec = checkpoint_spec(
        arch,
        size,
        seed,
        dtype,
        rope_scaling,
        config_style,
        vocab_size,
        kv_heads,
        sliding_window,
        intermediate_size,
    )
    return write_checkpoint(spec, Path(out_dir))


def checkpoint_spec(
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    rope_scaling: str = "none",
    config_style: str = "legacy",
    vocab_size: int = 4096,
    kv_heads: int | None = None,
    sliding_window: int | None = None,
    intermediate_size: int | None = None,
) -> CheckpointSpec:
    """A validated ``CheckpointSpec`` from plain values (``ValueError`` names a bad one)."""
    return CheckpointSpec(
        arch=arch,
        size=size,
        seed=seed,
        dtype=dtype,
        rope_scaling=RopeScaling(rope_scaling),
        config_style=ConfigStyle(config_style),
        vocab_size=vocab_size,
        kv_heads=kv_heads,
        sliding_window=sliding_window,
        intermediate_size=intermediate_size,
    )


def write_checkpoint(spec: CheckpointSpec, out_dir: Path) -> Path:
    return save_checkpoint(spec, out_dir, init_weights(spec))


def save_checkpoint(spec: CheckpointSpec, out_dir: Path, weights: dict[str, torch.Tensor]) -> Path:
    """Write ``weights`` (HF names, any float dtype; stored as ``spec.dtype``) with the
    configs and tokenizer ``spec`` describes to ``out_dir`` (created if needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out_dir, spec.vocab_size, MAX_POSITION_EMBEDDINGS)
    _write_json(out_dir / "config.json", hf_config(spec, ids))
    _write_json(out_dir / "generation_config.json", generation_config(ids))
    stored = {name: t.detach().to(DTYPES[spec.dtype]).contiguous() for name, t in weights.items()}
    save_file(stored, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def hf_config(spec: CheckpointSpec, ids: TokenIds) -> dict[str, object]:
    """``config.json`` contents, in the spelling ``spec.config_style`` selects."""
    arch, preset = spec.arch_spec, spec.preset
    config: dict[str, object] = {
        "architectures": [arch.class_name],
        "model_type": arch.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "gelu_pytorch_tanh" if arch.family is Family.GEMMA else "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": arch.rms_norm_eps,
        "initializer_range": 0.02,
        "attention_bias": arch.qkv_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
    }
    config.update(arch.extra_fields(spec))
    config.update(_rope_fields(spec))
    dtype_key = "torch_dtype" if spec.config_style is ConfigStyle.LEGACY else "dtype"
    config[dtype_key] = spec.dtype
    return config


def generation_config(ids: TokenIds) -> dict[str, object]:
    """Greedy by default; generation stops at ``<|eos|>`` or the end-of-turn marker."""
    return {
        "bos_token_id": ids.bos,
        "eos_token_id": [ids.eos, ids.end_of_turn],
        "pad_token_id": ids.pad,
        "do_sample": False,
    }


def _rope_fields(spec: CheckpointSpec) -> dict[str, object]:
    theta = spec.arch_spec.rope_theta
    scaling: dict[str, object] | None
    deepseek = spec.arch_spec.family is Family.DEEPSEEK
    if spec.rope_scaling is RopeScaling.YARN or (
        deepseek and spec.rope_scaling is RopeScaling.NONE
    ):
        scaling = dict(DEEPSEEK_YARN)
    elif spec.rope_scaling is RopeScaling.LINEAR:
        scaling = {"rope_type": "linear", "factor": ROPE_SCALING_FACTOR}
    elif spec.rope_scaling is RopeScaling.LLAMA3:
        scaling = {
            "rope_type": "llama3",
            "factor": ROPE_SCALING_FACTOR,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS,
        }
    else:
        scaling = None
    if spec.config_style is ConfigStyle.LEGACY:
        return {"rope_theta": theta, "rope_scaling": scaling}
    parameters = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    if spec.arch == "gemma3":  # one set per layer type; the local layers never scale
        local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_THETA}
        return {"rope_parameters": {"full_attention": parameters, "sliding_attention": local}}
    return {"rope_parameters": parameters}


def init_weights(spec: CheckpointSpec) -> dict[str, torch.Tensor]:
    """All tensors in float32 under their HF names (see the module docstring)."""
    d = spec.preset.hidden_size
    draw = _Drawer(spec.seed)
    gemma = spec.arch_spec.family is Family.GEMMA
    # Gemma scales its embedding by sqrt(d) on the way in (and ties it to the output).
    embed_std = GEMMA_EMBED_STD / math.sqrt(d) if gemma else 1 / math.sqrt(d)
    weights = {
        "model.embed_tokens.weight": draw.with_std(
            "model.embed_tokens.weight", (spec.vocab_size, d), embed_std
        )
    }
    for i in range(spec.preset.num_layers):
        weights.update(_layer_weights(spec, draw, f"model.layers.{i}.", i))
    if gemma:  # stored as an offset from one
        final = GEMMA_FINAL_NORM * draw.norm_weight("model.norm.weight", d) - 1.0
    else:
        final = LOGIT_SCALE * draw.norm_weight("model.norm.weight", d)
    weights["model.norm.weight"] = final
    if not spec.arch_spec.tie_word_embeddings:
        weights["lm_head.weight"] = draw.with_std(
            "lm_head.weight", (spec.vocab_size, d), 1 / math.sqrt(d)
        )
    return weights


def _layer_weights(
    spec: CheckpointSpec, draw: _Drawer, prefix: str, index: int
) -> dict[str, torch.Tensor]:
    d, inner = spec.preset.hidden_size, spec.intermediate
    q_dim, kv_dim = spec.preset.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    residual_std = BRANCH_GAIN / math.sqrt(spec.preset.num_layers)
    plan = {  # name: (shape, std)
        "self_attn.q_proj.weight": ((q_dim, d), QK_GAIN / math.sqrt(d)),
        "self_attn.k_proj.weight": ((kv_dim, d), QK_GAIN / math.sqrt(d)),
        "self_attn.v_proj.weight": ((kv_dim, d), 1 / math.sqrt(d)),
        "self_attn.o_proj.weight": ((d, q_dim), residual_std / math.sqrt(q_dim)),
    }
    experts = spec.arch_spec.experts
    sparse = experts is not None and not (
        experts is Experts.QWEN3_MOE and index in QWEN3_MOE_DENSE_LAYERS
    )
    if spec.arch_spec.family is Family.DEEPSEEK:
        plan = _latent_attention_plan(spec, residual_std)
        sparse = index >= DEEPSEEK_FIRST_DENSE
    if sparse:
        plan.update(_expert_plan(spec, residual_std))
    else:
        plan["mlp.gate_proj.weight"] = ((inner, d), 1 / math.sqrt(d))
        plan["mlp.up_proj.weight"] = ((inner, d), 1 / math.sqrt(d))
        plan["mlp.down_proj.weight"] = ((d, inner), residual_std / math.sqrt(inner))
    if spec.arch_spec.qkv_bias:
        plan["self_attn.q_proj.bias"] = ((q_dim,), BIAS_STD)
        plan["self_attn.k_proj.bias"] = ((kv_dim,), BIAS_STD)
        plan["self_attn.v_proj.bias"] = ((kv_dim,), BIAS_STD)
    weights = {
        prefix + n: draw.with_std(prefix + n, shape, std) for n, (shape, std) in plan.items()
    }
    family = spec.arch_spec.family
    norms = {"input_layernorm.weight": d, "post_attention_layernorm.weight": d}
    if family is Family.GEMMA:
        norms.update(
            {"pre_feedforward_layernorm.weight": d, "post_feedforward_layernorm.weight": d}
        )
    if family is Family.DEEPSEEK:
        norms["self_attn.kv_a_layernorm.weight"] = DEEPSEEK_KV_LORA_RANK
        if spec.arch == "deepseek_v3":
            norms["self_attn.q_a_layernorm.weight"] = DEEPSEEK_Q_LORA_RANK
        if sparse and spec.arch == "deepseek_v3":  # not a norm: a small choice-only bias
            bias = prefix + "mlp.gate.e_score_correction_bias"
            weights[bias] = draw.with_std(bias, (spec.num_experts,), CORRECTION_BIAS_STD)
    if spec.arch_spec.qk_norm:
        norms.update(
            {"self_attn.q_norm.weight": spec.head_dim, "self_attn.k_norm.weight": spec.head_dim}
        )
    offset = 1.0 if family is Family.GEMMA else 0.0  # Gemma stores w for a scale of 1 + w
    for norm, size in norms.items():
        weights[prefix + norm] = draw.norm_weight(prefix + norm, size) - offset
    if family is Family.PHI3:
        _fuse(weights, prefix + "self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        _fuse(weights, prefix + "mlp.", ("gate_proj", "up_proj"), "gate_up_proj")
    return weights


def _expert_plan(spec: CheckpointSpec, residual_std: float) -> dict[str, tuple]:
    """Router and experts of one sparse layer, under the family's checkpoint names."""
    d, inner = spec.preset.hidden_size, spec.expert_intermediate_size
    mixtral = spec.arch_spec.experts is Experts.MIXTRAL
    block = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    # Router logits of std ~2: routing is decisive, so near-ties at the top-k edge are rare.
    plan: dict[str, tuple] = {
        f"{block}.gate.weight": ((spec.num_experts, d), ROUTER_STD_GAIN / math.sqrt(d))
    }
    # top_k experts add up per token: each gets the branch budget of a dense MLP.
    for e in range(spec.num_experts):
        gate, up, down = (f"{block}.experts.{e}.{n}.weight" for n in names)
        plan[gate] = ((inner, d), 1 / math.sqrt(d))
        plan[up] = ((inner, d), 1 / math.sqrt(d))
        plan[down] = ((d, inner), residual_std / math.sqrt(inner))
    shared = spec.num_shared_experts * inner
    if shared:
        plan[f"{block}.shared_experts.gate_proj.weight"] = ((shared, d), 1 / math.sqrt(d))
        plan[f"{block}.shared_experts.up_proj.weight"] = ((shared, d), 1 / math.sqrt(d))
        down = f"{block}.shared_experts.down_proj.weight"
        plan[down] = ((d, shared), residual_std / math.sqrt(shared))
    return plan


def _latent_attention_plan(spec: CheckpointSpec, residual_std: float) -> dict[str, tuple]:
    """DeepSeek's attention tensors (V3 with a query LoRA, V2 without), gains as the
    other families': scores of std ~2 through q and the latent's key part."""
    d, heads = spec.preset.hidden_size, spec.preset.num_heads
    qk = DEEPSEEK_NOPE_DIM + DEEPSEEK_ROPE_DIM
    rank, per_head = DEEPSEEK_KV_LORA_RANK, DEEPSEEK_NOPE_DIM + DEEPSEEK_V_DIM
    plan: dict[str, tuple] = {}
    if spec.arch == "deepseek_v3":
        q_rank = DEEPSEEK_Q_LORA_RANK
        plan["self_attn.q_a_proj.weight"] = ((q_rank, d), 1 / math.sqrt(d))
        plan["self_attn.q_b_proj.weight"] = ((heads * qk, q_rank), QK_GAIN / math.sqrt(q_rank))
    else:
        plan["self_attn.q_proj.weight"] = ((heads * qk, d), QK_GAIN / math.sqrt(d))
    width = rank + DEEPSEEK_ROPE_DIM
    plan["self_attn.kv_a_proj_with_mqa.weight"] = ((width, d), QK_GAIN / math.sqrt(d))
    plan["self_attn.kv_b_proj.weight"] = ((heads * per_head, rank), 1 / math.sqrt(rank))
    v_dim = heads * DEEPSEEK_V_DIM
    plan["self_attn.o_proj.weight"] = ((d, v_dim), residual_std / math.sqrt(v_dim))
    return plan


def _fuse(
    weights: dict[str, torch.Tensor], prefix: str, parts: tuple[str, ...], fused: str
) -> None:
    """Replace the ``prefix{part}.weight`` tensors by their rows stacked as one tensor,
    ``prefix{fused}.weight``."""
    tensors = [weights.pop(f"{prefix}{part}.weight") for part in parts]
    weights[f"{prefix}{fused}.weight"] = torch.cat(tensors, dim=0)


class _Drawer:
    """Machine-independent random tensors, one independent stream per tensor name."""

    def __init__(self, seed: int) -> None:
        self._seed = seed

    def with_std(self, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        """Uniform on ``[-std*sqrt(3), std*sqrt(3))``: zero mean, standard deviation ``std``."""
        return self._uniform(name, shape, std * math.sqrt(3.0))

    def norm_weight(self, name: str, size: int) -> torch.Tensor:
        return 1.0 + self._uniform(name, (size,), NORM_JITTER)

    def _uniform(self, name: str, shape: tuple[int, ...], bound: float) -> torch.Tensor:
        stream = np.random.PCG64(np.random.SeedSequence([self._seed, zlib.crc32(name.encode())]))
        raw = stream.random_raw(math.prod(shape))
        # Top 24 bits -> exact float32 in [0, 1); then an affine map in float64, rounded once.
        unit = (raw >> np.uint64(40)).astype(np.float64) * 2.0**-24
        values = ((2.0 * unit - 1.0) * bound).astype(np.float32)
        return torch.from_numpy(values.reshape(shape))


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
