"""The attention backend interface, and the choice of backend (made once at start-up).

A backend computes attention for one layer: it stores the layer's new keys and values
in that layer's paged cache, then lets every query attend to its sequence's keys
(cached prefix + new tokens) under a causal and, per layer, sliding-window mask.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from tandem.engine.attention.kv_quant import FloatKV, KVCacheDtype, make_kv_codec
from tandem.engine.attention.metadata import AttentionMetadata


class AttentionBackendKind(enum.Enum):
    TORCH = "torch"
    """Reference paged attention in plain torch ops: every key read through the block table."""
    SDPA = "sdpa"
    """``scaled_dot_product_attention`` per prefill chunk, one padded batch for decodes."""
    FLASH = "flash"
    """``flash_attn`` varlen + paged kernels; CUDA only."""
    CPU = "cpu"
    """SDPA for prefill, Tandem's native paged kernel for decodes; CPU, float32."""


class AttentionBackend(Protocol):
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare per-step state shared by all layers; called once per step."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """``q [T, H, D]``, ``k, v [T, KVH, D]``, ``kv_cache [2, num_blocks, block_size, KVH,
        width]`` (``width`` ``D``, or ``D + 4`` uint8 when quantized: ``kv_quant``) →
        ``[T, H, D]``. Writes ``k``/``v`` into ``kv_cache`` at ``meta.slot_mapping``."""
        ...


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys/values at their cache slots (an unquantized cache)."""
    FloatKV().write(kv_cache, k, v, slots)


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def native_cpu_max_head_dim() -> int | None:
    """The largest head_dim the native CPU kernel takes (by instruction set: 1,024 with
    AVX-512, 512 with AVX2, 256 portable), or ``None`` when it cannot be built here."""
    from tandem.engine.attention.native import paged_decode_library

    library = paged_decode_library()
    return None if library is None else int(library.tandem_paged_decode_max_head_dim())


def native_cpu_available(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    softcap: float | None = None,
) -> bool:
    """Whether the native CPU kernel serves ``dtype`` on ``device`` (and ``head_dim``;
    it has no score soft-capping)."""
    if device.type != "cpu" or dtype != torch.float32 or softcap is not None:
        return False
    limit = native_cpu_max_head_dim()
    return limit is not None and (head_dim is None or head_dim <= limit)


def select_backend_kind(
    requested: AttentionBackendKind | None,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    softcap: float | None = None,
    latent: bool = False,
) -> AttentionBackendKind:
    """``flash`` when importable on CUDA; on CPU in float32 the native kernel when it
    builds and takes ``head_dim`` (and the model soft-caps no scores); ``sdpa``
    otherwise — unless one is requested. A latent cache (``latent``: multi-head latent
    attention) is read by ``sdpa`` or the ``torch`` reference only."""
    if latent:
        if requested in (AttentionBackendKind.CPU, AttentionBackendKind.FLASH):
            raise ValueError(
                f"attention_backend {requested.value!r} cannot read a latent (MLA) KV "
                "cache; use 'sdpa' (the default) or 'torch'"
            )
        return requested or AttentionBackendKind.SDPA
    if requested is AttentionBackendKind.FLASH and not (
        device.type == "cuda" and flash_attn_available()
    ):
        raise ValueError("attention_backend 'flash' needs CUDA and the flash-attn package")
    if requested is AttentionBackendKind.CPU and not native_cpu_available(
        device, dtype, head_dim, softcap
    ):
        limit = native_cpu_max_head_dim()
        within = f", head_dim <= {limit}" if limit is not None else ""
        capped = ", attention soft-capping" if softcap is not None else ""
        raise ValueError(
            f"attention_backend 'cpu' needs a CPU, float32, a C compiler, no score "
            f"soft-capping{within} (got {device.type}, {str(dtype).removeprefix('torch.')}, "
            f"head_dim {head_dim}{capped})"
        )
    if requested is not None:
        return requested
    if device.type == "cuda" and flash_attn_available():
        return AttentionBackendKind.FLASH
    if native_cpu_available(device, dtype, head_dim, softcap):
        return AttentionBackendKind.CPU
    return AttentionBackendKind.SDPA


def make_backend(
    kind: AttentionBackendKind,
    scale: float,
    block_size: int,
    kv_dtype: KVCacheDtype = KVCacheDtype.AUTO,
    softcap: float | None = None,
    latent_value_dim: int | None = None,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """``kv_dtype``: how the cache stores values; every backend but flash reads a
    quantized cache (``EngineConfig`` refuses flash with one). ``softcap``: scores
    become ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2).
    ``latent_value_dim``: the cache is latent (one plane of rows whose first
    ``latent_value_dim`` values are also the values; ``attention.latent``).
    ``batch_invariant`` (``cpu`` only): every query row through the kernel, long prompt
    chunks included, so a row's result never depends on the step's shape."""
    codec = make_kv_codec(kv_dtype)
    if latent_value_dim is not None:
        if kind not in (AttentionBackendKind.SDPA, AttentionBackendKind.TORCH):
            raise ValueError(
                f"attention_backend {kind.value!r} cannot read a latent (MLA) KV cache"
            )
        from tandem.engine.attention.latent import LatentAttention

        return LatentAttention(
            scale, latent_value_dim, codec, reference=kind is AttentionBackendKind.TORCH
        )
    if kind is AttentionBackendKind.TORCH:
        from tandem.engine.attention.torch_ref import TorchPagedAttention

        return TorchPagedAttention(scale, codec, softcap)
    if kind is AttentionBackendKind.SDPA:
        from tandem.engine.attention.sdpa import SdpaAttention

        return SdpaAttention(scale, codec, softcap)
    if softcap is not None and kind is AttentionBackendKind.CPU:
        raise ValueError("attention_backend 'cpu' has no score soft-capping")
    if kind is AttentionBackendKind.CPU:
        from tandem.engine.attention.cpu_paged import CpuPagedAttention
        from tandem.engine.attention.native import paged_decode_library

        return CpuPagedAttention(scale, paged_decode_library(), kv_dtype, batch_invariant)
    if kv_dtype.quantized:
        raise ValueError(f"attention_backend 'flash' cannot read a {kv_dtype.value} KV cache")
    from tandem.engine.attention.flash import FlashAttention

    return FlashAttention(scale, block_size, softcap)
