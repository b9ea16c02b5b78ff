"""The batched LoRA products as one native call per layer (``csrc/lora_sgmv.c``).

``shrink`` computes every token's ``u = A_slot @ x`` and ``expand`` adds ``Bt_slot^T u``
into the layer's output, each over the whole mixed batch at once: no Python loop over
adapters, no gathered copy of their weights. A float32 model on the CPU, with adapter
weights in float32 or bfloat16 (``lora_dtype``); elsewhere the layer runs the same
products with torch, one pair of matmuls per adapter in the batch
(``layers.LoRALinear``).

Measured (2-core Xeon, one layer of the 110M Llama, 32 decode rows of 16 rank-16
adapters): the expand as one axpy per rank over column chunks of a 4-row tile runs in
146 us for gate/up, against 1,320 us with the rank sum innermost. Built and cached like
every native kernel (``engine/native_build.py``).
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from tandem.engine.layers.native_ops import COMMON_FLAGS
from tandem.engine.native_build import Isa, KernelBuildError, build_library, select_isa

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "lora_sgmv.c"
_ISA_FLAGS: dict[Isa, tuple[str, ...]] = {
    Isa.AVX512: ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"),
    Isa.AVX2: ("-mavx2", "-mfma"),
    Isa.PORTABLE: (),
}
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
"""The adapter weight dtypes the kernels read (activations are float32)."""


class LoRAKernels:
    def __init__(self, library: ctypes.CDLL, isa: Isa) -> None:
        self.isa = isa
        self._shrink, self._expand = {}, {}
        for dtype, suffix in zip(WEIGHT_DTYPES, ("f32", "bf16"), strict=True):
            shrink = getattr(library, f"tandem_lora_shrink_{suffix}")
            shrink.restype = ctypes.c_int
            shrink.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]
            expand = getattr(library, f"tandem_lora_expand_{suffix}")
            expand.restype = ctypes.c_int
            expand.argtypes = [
                _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int
            ]  # fmt: skip
            self._shrink[dtype], self._expand[dtype] = shrink, expand

    def shrink(
        self,
        x: torch.Tensor,
        slots: torch.Tensor,
        a: torch.Tensor,
        ranks: torch.Tensor,
        max_rank: int,
    ) -> torch.Tensor:
        """``u [T, S*R]``: ``x [T, in]`` (rows may be strided) through each row's slot of
        ``a [L, S*R, in]`` (float32 or bfloat16); zero where a row has no adapter here."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        tokens, width = x.shape[0], a.shape[1]
        u = torch.empty(tokens, width, dtype=torch.float32)
        status = self._shrink[a.dtype](
            x.data_ptr(), x.stride(0), u.data_ptr(), tokens, slots.data_ptr(), a.data_ptr(),
            ranks.data_ptr(), width // max_rank, max_rank, a.shape[2], torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("LoRA shrink: out of memory for the tile list")
        return u

    def expand(
        self,
        u: torch.Tensor,
        y: torch.Tensor,
        slots: torch.Tensor,
        bt: torch.Tensor,
        ranks: torch.Tensor,
        offsets: torch.Tensor,
        max_rank: int,
    ) -> None:
        """``y [T, out] += u @ Bt_slot`` per row, slice by slice (``offsets [S+1]``)."""
        assert y.stride(-1) == 1
        status = self._expand[bt.dtype](
            u.data_ptr(), y.data_ptr(), y.stride(0), u.shape[0], slots.data_ptr(),
            bt.data_ptr(), ranks.data_ptr(), offsets.data_ptr(), len(offsets) - 1, max_rank,
            bt.shape[2], torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("LoRA expand: out of memory for the tile list")


@cache
def lora_kernels(isa: Isa) -> LoRAKernels:
    flags = (*COMMON_FLAGS, *_ISA_FLAGS[isa], f'-DTANDEM_ISA="{isa.value}"', "-lm")
    return LoRAKernels(build_library(SOURCE, isa, flags), isa)


def lora_kernels_for(
    device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype | None = None
) -> LoRAKernels | None:
    """The native kernels for a float32 model on the CPU whose adapter weights are
    ``weight_dtype`` (default ``dtype``) float32 or bfloat16; ``None`` elsewhere, or
    (logged) when they cannot be built here."""
    weights = dtype if weight_dtype is None else weight_dtype
    if device.type != "cpu" or dtype != torch.float32 or weights not in WEIGHT_DTYPES:
        return None
    try:
        return lora_kernels(select_isa())
    except KernelBuildError as error:
        log.warning("LoRA kernels unavailable, using torch: %s", error)
        return None
