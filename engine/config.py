"""Engine configuration: what the user chose (``EngineConfig``, validated, frozen) and
what the engine derived from it at start-up (``EngineRuntime``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from tandem.common.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from tandem.common.model_config import ModelConfig
from tandem.common.sampling_params import MAX_SPECULATIVE_TOKENS, SpecMethod
from tandem.engine.attention.base import (
    AttentionBackendKind,
    native_cpu_available,
    select_backend_kind,
)
from tandem.engine.attention.flash import FLASH_BLOCK_SIZE_MULTIPLE
from tandem.engine.attention.kv_quant import KVCacheDtype, parse_kv_cache_dtype
from tandem.engine.layers.linear import (
    LinearBackend,
    linear_backend_available,
    select_linear_backend,
)
from tandem.engine.layers.moe import ExpertSplit
from tandem.engine.lora.manager import LoRAConfig
from tandem.engine.quantization.checkpoint import stored_quantization
from tandem.engine.quantization.scheme import (
    DEFAULT_GROUP_SIZE,
    INT4_GROUP_SIZES,
    QuantizationConfig,
    QuantMethod,
)

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_KV_CACHE_GB = 4.0
DEFAULT_CPU_STEP_TOKENS = 1024
DEFAULT_GPU_STEP_TOKENS = 8192

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """HuggingFace checkpoint directory (config.json, *.safetensors, tokenizer.json)."""
    dtype: str = "auto"
    """``float32``, ``bfloat16``, ``float16``, or ``auto`` (the checkpoint's dtype)."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N``, or ``auto`` (CUDA when available)."""
    block_size: int | None = None
    """Tokens per KV block; ``None``: 16, or 256 with the flash backend (its kernels need it)."""
    num_kv_blocks: int | None = None
    """Exact pool size; ``None``: from ``kv_cache_memory_gb`` / GPU free memory."""
    kv_cache_memory_gb: float | None = None
    """KV pool size, used whole; ``None``: 4 GiB on CPU, ``gpu_memory_utilization`` of free
    memory on GPU, either capped at what ``max_num_seqs`` full-length sequences need."""
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    """Token budget per step; ``None``: 1,024 on CPU (measured best for a 110M model on 2
    cores: intermediates stay in cache), 8,192 on GPU."""
    max_model_len: int | None = None
    """Longest prompt + output; ``None``: the checkpoint's ``max_position_embeddings``, or
    as much as the KV pool holds when that is less and the pool is sized from memory
    (``num_kv_blocks`` unset; see ``fit_kv_pool``)."""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str | None = None
    """``torch``, ``sdpa``, ``cpu``, ``flash`` or ``None`` (the best one available)."""
    linear_backend: str | None = None
    """``torch`` or ``onednn`` (pre-packed weights, CPU) or ``None`` (onednn where it works)."""
    num_threads: int | None = None
    """Torch intra-op threads on CPU; ``None`` leaves torch's default."""
    seed: int = 0
    tensor_parallel_size: int = 1
    """Ranks the model is split over (heads, MLP columns, vocabulary); the engine starts
    ranks 1..N-1 itself: local processes, or Ray actors when Ray is initialised."""
    speculative_method: str | None = None
    """``ngram`` or ``draft``: speculative decoding's default proposer (``None``: off,
    unless ``draft_model`` is set, which implies ``draft``)."""
    num_speculative_tokens: int = 4
    """Most tokens proposed per step (k); the adaptive controller may use fewer."""
    draft_model: str | None = None
    """Checkpoint of the draft model (same tokenizer as the target)."""
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    speculative_adaptive: bool = True
    """Adapt k per request to its acceptance (down to 0 when drafts keep failing)."""
    speculative_by_default: bool = True
    """Requests speculate unless they opt out (``SamplingParams.speculative``)."""
    quantization: str | None = None
    """Weight-only quantization of the linear layers at load: ``int8`` (symmetric, per
    output channel) or ``int4`` (asymmetric, per group of input channels); ``None``: as
    the checkpoint is (a ``tandem quantize`` checkpoint loads quantized). CPU, float32."""
    quantization_group_size: int = DEFAULT_GROUP_SIZE
    """Input channels per int4 scale / zero point: 32, 64 or 128."""
    quantize_lm_head: bool = False
    """Quantize the output projection too (embeddings always stay float)."""
    kv_cache_dtype: str = "auto"
    """How the KV cache stores keys and values: ``auto`` (the model dtype), ``int8``
    (symmetric absmax) or ``fp8`` (e4m3), both with a float32 scale per token and KV head
    (``engine/attention/kv_quant.py``); 1-byte values fit ~4x the float32 blocks in the
    same memory. Not with the flash backend."""
    enable_expert_parallel: bool = False
    """Mixture-of-experts models under tensor parallelism: each rank holds
    ``num_experts / tensor_parallel_size`` whole experts instead of every expert's
    slice of the intermediate dims (``engine/layers/moe.py``)."""
    batch_invariant: bool = False
    """A sequence's logits do not depend on its batch, its chunking, or whether its KV
    came from a prefill or from decode: every product runs on Tandem's native CPU
    kernels in float32, whose reduction order is fixed whatever the row count (the
    GEMM sums each output in input-channel order; attention runs every query row, a
    prompt's included, as a decode over its own keys). A recomputed failover, a
    preemption and speculation then give bitwise the tokens of an undisturbed run.
    CPU only; computes in float32 whatever the checkpoint's dtype."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) beside the base model: requests name one
    (``lora_request``), one batch mixes the base and up to ``max_loras`` adapters
    (``engine/lora``)."""
    max_loras: int = DEFAULT_MAX_LORAS
    """Distinct adapters one batch may mix (slots in every adapted layer)."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    """The largest adapter rank accepted (sizes the slots)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in CPU memory (>= ``max_loras``); ``None``: ``max_loras``."""
    lora_dtype: str = "auto"
    """Adapter weights' dtype: ``auto`` (the model's), ``float32``, ``bfloat16``,
    ``float16``. On a float32 model, ``bfloat16`` halves the bytes a step with many
    adapters reads (the native products widen them exactly; the sums stay float32)."""

    @property
    def expert_split(self) -> ExpertSplit:
        return ExpertSplit.EXPERT if self.enable_expert_parallel else ExpertSplit.TENSOR

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.batch_invariant and self.dtype not in ("auto", "float32"):
            raise ValueError(
                "batch_invariant computes in float32 (the kernels whose reduction order is "
                f"fixed are float32 ones): leave dtype auto or set float32, not {self.dtype}"
            )
        if self.linear_backend is not None:
            valid = [k.value for k in LinearBackend]
            if self.linear_backend not in valid:
                raise ValueError(
                    f"linear_backend must be one of {valid}, got {self.linear_backend!r}"
                )
        if self.attention_backend is not None:
            valid = [k.value for k in AttentionBackendKind]
            if self.attention_backend not in valid:
                raise ValueError(
                    f"attention_backend must be one of {valid}, got {self.attention_backend!r}"
                )
        for name in (
            "block_size",
            "num_kv_blocks",
            "max_model_len",
            "num_threads",
            "max_num_batched_tokens",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.speculative_method is not None and self.speculative_method not in (
            "ngram",
            "draft",
        ):
            raise ValueError(
                f"speculative_method must be 'ngram' or 'draft', got {self.speculative_method!r}"
            )
        if self.speculative_method == "draft" and self.draft_model is None:
            raise ValueError(
                "speculative_method 'draft' needs draft_model (a checkpoint directory)"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError(
                f"ngram_min_n/ngram_max_n need 1 <= min <= max, got {self.ngram_min_n}, "
                f"{self.ngram_max_n}"
            )
        self.quantization_config()  # raises on a bad method or group size
        if (
            parse_kv_cache_dtype(self.kv_cache_dtype).quantized
            and self.attention_backend == AttentionBackendKind.FLASH.value
        ):
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} needs attention_backend torch, sdpa or "
                "cpu: the flash kernels read only an unquantized cache"
            )
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs quantization (int8 or int4)")
        if self.quantize_lm_head and self.tensor_parallel_size > 1:
            raise ValueError("quantize_lm_head is not supported with tensor_parallel_size > 1")
        if self.enable_lora:
            self.lora_config()  # raises on bad limits
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def lora_config(self) -> LoRAConfig | None:
        """The adapter limits when ``enable_lora``, else ``None``."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)

    def quantization_config(self) -> QuantizationConfig | None:
        """The requested quantization, or ``None``; ``ValueError`` naming the field."""
        if self.quantization is None:
            return None
        valid = [m.value for m in QuantMethod]
        if self.quantization not in valid:
            raise ValueError(f"quantization must be one of {valid}, got {self.quantization!r}")
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {list(INT4_GROUP_SIZES)}, "
                f"got {self.quantization_group_size}"
            )
        return QuantizationConfig(
            QuantMethod(self.quantization), self.quantization_group_size, self.quantize_lm_head
        )


@dataclass(frozen=True)
class EngineRuntime:
    """Values fixed at start-up from the config, the checkpoint and the machine."""

    device: torch.device
    dtype: torch.dtype
    backend: AttentionBackendKind
    linear_backend: LinearBackend
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    quantization: QuantizationConfig | None = None
    """Applied at load to a float checkpoint; ``None`` for float weights or a checkpoint
    that is quantized already (it loads as written)."""
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    batch_invariant: bool = False
    """Every query row through the attention kernel (``EngineConfig.batch_invariant``)."""


def resolve_runtime(config: EngineConfig, model: ModelConfig) -> EngineRuntime:
    device = _device(config.device)
    quantization, stored = _quantization(config)
    dtype = (
        _DTYPES.get(model.dtype, torch.float32) if config.dtype == "auto" else _DTYPES[config.dtype]
    )
    if config.batch_invariant:
        _check_batch_invariant(config, model, device)
        dtype = torch.float32
    if quantization is not None or stored is not None:
        if config.dtype == "auto":
            dtype = torch.float32  # the quantized kernels take float32 activations
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(
                f"quantization runs on the CPU in float32, not {device.type} {config.dtype}"
            )
    requested = AttentionBackendKind(config.attention_backend) if config.attention_backend else None
    if config.batch_invariant:
        requested = AttentionBackendKind.CPU
    kv_cache_dtype = parse_kv_cache_dtype(config.kv_cache_dtype)
    backend = select_backend_kind(
        requested, device, dtype, model.head_dim, model.attn_logit_softcap, model.mla is not None
    )
    if kv_cache_dtype.quantized and backend is AttentionBackendKind.FLASH:
        backend = AttentionBackendKind.SDPA  # flash was only the default (a request is refused)
    block_size = config.block_size or (
        FLASH_BLOCK_SIZE_MULTIPLE if backend is AttentionBackendKind.FLASH else DEFAULT_BLOCK_SIZE
    )
    max_model_len = config.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"({model.max_position_embeddings})"
        )
    if config.num_threads is not None and device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    requested_linear = LinearBackend(config.linear_backend) if config.linear_backend else None
    if config.batch_invariant:
        requested_linear = LinearBackend.NATIVE
    linear = select_linear_backend(requested_linear, device, dtype, model.hidden_size)
    return EngineRuntime(
        device,
        dtype,
        backend,
        linear,
        block_size,
        max_model_len,
        _step_budget(config, device, max_model_len),
        quantization,
        kv_cache_dtype,
        config.batch_invariant,
    )


def _check_batch_invariant(config: EngineConfig, model: ModelConfig, device: torch.device) -> None:
    """``ValueError`` naming what keeps ``batch_invariant`` from holding here."""
    why = None
    if device.type != "cpu":
        why = f"runs on the CPU's native kernels, not {device.type} (not yet on GPUs)"
    elif config.attention_backend not in (None, AttentionBackendKind.CPU.value):
        why = (
            f"needs the native attention kernel, not attention_backend {config.attention_backend!r}"
        )
    elif model.mla is not None:
        why = "needs the native attention kernel, which does not read a latent (MLA) cache yet"
    elif not native_cpu_available(device, torch.float32, model.head_dim, model.attn_logit_softcap):
        why = (
            "needs the native attention kernel, which cannot run this model here (a C compiler,"
            f" head_dim {model.head_dim} within its limit, no score soft-capping)"
        )
    elif config.linear_backend not in (None, LinearBackend.NATIVE.value):
        why = f"needs the native GEMM, not linear_backend {config.linear_backend!r}"
    elif not linear_backend_available(LinearBackend.NATIVE, device, torch.float32):
        why = "needs the native GEMM, which needs a CPU with AVX2 and FMA"
    if why is not None:
        raise ValueError(f"batch_invariant {why}")


def _step_budget(config: EngineConfig, device: torch.device, max_model_len: int) -> int:
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    budget = DEFAULT_CPU_STEP_TOKENS if device.type == "cpu" else DEFAULT_GPU_STEP_TOKENS
    if not config.enable_chunked_prefill:
        budget = max(budget, max_model_len)  # a whole prompt must fit one step
    return budget


def _quantization(
    config: EngineConfig,
) -> tuple[QuantizationConfig | None, QuantizationConfig | None]:
    """(what to apply at load, what the checkpoint already has). Asking a quantized
    checkpoint for a different quantization is refused: it cannot be undone at load."""
    requested = config.quantization_config()
    stored = stored_quantization(config.model)
    if stored is None:
        return requested, None
    if requested is not None and not requested.matches(stored):
        raise ValueError(
            f"checkpoint {config.model} is quantized ({stored.describe()}); the requested "
            f"{requested.describe()} differs (leave quantization unset to load it as written)"
        )
    return None, stored


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def fit_kv_pool(
    config: EngineConfig, runtime: EngineRuntime, bytes_per_block: int
) -> tuple[int, EngineRuntime]:
    """How many blocks the KV pool gets, and the runtime to run with.

    Blocks: ``num_kv_blocks``, or as many as ``kv_cache_memory_gb`` holds (a quantized
    cache's smaller blocks give more of them; blocks beyond what the running sequences
    hold keep prefixes cached). Without either, the default budget (CPU:
    ``DEFAULT_CPU_KV_CACHE_GB``; GPU: free memory times ``gpu_memory_utilization``) is
    capped at what ``max_num_seqs`` full-length sequences need, so a small model does not
    take the whole budget.

    Runtime: ``runtime``, whose ``max_model_len`` the pool must hold once; except that
    when ``max_model_len`` and ``num_kv_blocks`` are both unset and the pool sized from
    memory holds less than the model's whole context (Llama-3.1's 131,072 tokens in a
    4 GiB CPU pool), ``max_model_len`` becomes the most the pool holds, in whole blocks,
    with one log line (vLLM's auto-fit). A ``max_model_len`` the user set that does not
    fit stays an error naming both numbers."""
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    else:
        blocks = int(_kv_budget_bytes(config, runtime) // bytes_per_block)
        if config.kv_cache_memory_gb is None:
            per_seq = -(-runtime.max_model_len // runtime.block_size)
            blocks = min(blocks, config.max_num_seqs * per_seq)
    needed = -(-runtime.max_model_len // runtime.block_size)
    fits = blocks * runtime.block_size
    may_fit = config.max_model_len is None and config.num_kv_blocks is None
    if blocks < needed and may_fit and fits >= 2:
        log.info(
            "Auto-fit max_model_len: reduced from %d to %d to fit the KV cache (%d blocks of "
            "%d tokens, %.2f GiB); set max_model_len or kv_cache_memory_gb to choose",
            runtime.max_model_len,
            fits,
            blocks,
            runtime.block_size,
            blocks * bytes_per_block / 2**30,
        )
        budget = _step_budget(config, runtime.device, fits)
        return blocks, replace(runtime, max_model_len=fits, max_num_batched_tokens=budget)
    if blocks < needed:
        raise ValueError(
            f"the KV cache holds {blocks} blocks of {runtime.block_size} tokens, fewer than one "
            f"sequence of max_model_len={runtime.max_model_len} needs ({needed}); raise "
            "num_kv_blocks / kv_cache_memory_gb or lower max_model_len"
        )
    return blocks, runtime


def _kv_budget_bytes(config: EngineConfig, runtime: EngineRuntime) -> float:
    """Called after the weights are loaded, so free GPU memory already excludes them."""
    if config.kv_cache_memory_gb is not None:
        return config.kv_cache_memory_gb * 2**30
    if runtime.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(runtime.device)
        return free * config.gpu_memory_utilization
    return DEFAULT_CPU_KV_CACHE_GB * 2**30


def default_spec_method(config: EngineConfig) -> SpecMethod | None:
    """The engine's speculative method: as configured, or ``draft`` when only a draft
    model is given, else ``None`` (no speculation)."""
    if config.speculative_method is not None:
        return SpecMethod(config.speculative_method)
    return SpecMethod.DRAFT if config.draft_model is not None else None
