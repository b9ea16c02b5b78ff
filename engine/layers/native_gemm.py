"""Tandem's float32 GEMM for CPUs with AVX2 + FMA (``csrc/gemm_f32.c``).

Weights are packed once into 16-column panels; a 6 x 16 register tile streams each panel
slice from L1 while the next slice is requested from memory, and the gated MLP's gate and
up columns share panels so one pass writes ``silu(gate) * up``. Against oneDNN's AVX2
kernels (``ONEDNN_MAX_CPU_ISA=AVX2``), same process, 2 threads of the development EPYC,
medium model's shapes with cold weights, best of five: 1.13-1.23x at 64 rows, 1.22x at 1
and 16, 1.07-1.10x at 128-1,024; the gated MLP 1.46x at 64 rows (one pass instead of
oneDNN's two GEMMs with fused SiLU / product). With AVX-512 oneDNN is as fast or faster
(0.85-1.05x), so the engine picks this kernel only where the CPU's best instruction set
is AVX2 (``linear.select_linear_backend``); ``linear_backend="native"`` forces it on any
AVX2 CPU.

One build (``-mavx2 -mfma``), whatever ``select_isa`` picks above it; none on CPUs
without AVX2 + FMA or with ``TANDEM_CPU_ISA=portable``. Results differ from
``F.linear`` by float rounding only (sums in input-channel order, one FMA per term).
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from tandem.engine.native_build import (
    Isa,
    KernelBuildError,
    build_library,
    cpu_flags,
    select_isa,
)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gemm_f32.c"
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-mavx2", "-mfma")

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class NativeGemm:
    """The loaded kernels. Packed weights are flat float32 tensors; inputs are float32
    ``[..., k]`` (made contiguous when they are not)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._packed_floats = library.tandem_gemm_packed_floats
        self._gated_packed_floats = library.tandem_gemm_gated_packed_floats
        for size in (self._packed_floats, self._gated_packed_floats):
            size.restype = _i64
            size.argtypes = [_i64, _i64]
        self._pack = library.tandem_gemm_pack_f32
        self._pack.restype = None
        self._pack.argtypes = [_ptr, _i64, _i64, _ptr]
        self._pack_gated = library.tandem_gemm_pack_gated_f32
        self._pack_gated.restype = None
        self._pack_gated.argtypes = [_ptr, _ptr, _i64, _i64, _ptr]
        self._gemm = library.tandem_gemm_f32
        self._gemm.restype = None
        self._gemm.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int]
        self._gated = library.tandem_gemm_gated_f32
        self._gated.restype = None
        self._gated.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _int]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [n, k]`` in panel order."""
        weight = _float32_matrix(weight, "weight")
        n, k = weight.shape
        packed = torch.empty(self._packed_floats(n, k), dtype=torch.float32)
        self._pack(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def pack_gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``gate`` and ``up`` (both ``[n, k]``) interleaved 8 columns at a time."""
        gate, up = _float32_matrix(gate, "gate"), _float32_matrix(up, "up")
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        n, k = gate.shape
        packed = torch.empty(self._gated_packed_floats(n, k), dtype=torch.float32)
        self._pack_gated(gate.data_ptr(), up.data_ptr(), n, k, packed.data_ptr())
        return packed

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for ``packed = pack(W)``, ``W [n, k]``."""
        x, rows, k = self._rows(x, packed, n, self._packed_floats)
        out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        if rows:
            bias_ptr = None if bias is None else bias.contiguous().data_ptr()
            self._gemm(
                x.data_ptr(), rows, k, packed.data_ptr(), n, bias_ptr, out.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def gated(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """``silu(x @ G.T) * (x @ U.T)`` for ``packed = pack_gated(G, U)``."""
        x, rows, k = self._rows(x, packed, n, self._gated_packed_floats)
        out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        if rows:
            self._gated(
                x.data_ptr(), rows, k, packed.data_ptr(), n, out.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    @staticmethod
    def _rows(x: torch.Tensor, packed: torch.Tensor, n: int, size) -> tuple[torch.Tensor, int, int]:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the native GEMM takes float32 CPU inputs, not {x.dtype} {x.device}")
        k = x.shape[-1]
        if packed.numel() != size(n, k):
            raise ValueError(f"a packed weight of {packed.numel()} floats is not [{n}, {k}]")
        x = x.contiguous()
        return x, x.numel() // k if k else 0, k


def _float32_matrix(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2 or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be a float32 CPU matrix, not {t.dtype} {tuple(t.shape)}")
    return t.detach().contiguous()


def native_gemm_supported() -> bool:
    """AVX2 + FMA here, and ``TANDEM_CPU_ISA`` does not force the portable kernels."""
    return {"avx2", "fma"} <= cpu_flags() and select_isa() is not Isa.PORTABLE


@cache
def native_gemm() -> NativeGemm:
    """The kernels (compiled on first use, then cached on disk and here);
    ``KernelBuildError`` when unsupported here, no C compiler is found or it fails."""
    if not native_gemm_supported():
        raise KernelBuildError("the native GEMM needs AVX2 and FMA")
    return NativeGemm(build_library(SOURCE, Isa.AVX2, FLAGS))


def native_gemm_preferred() -> bool:
    """Whether float32 linears should default to this GEMM: the CPU's best instruction
    set is AVX2 (with AVX-512 oneDNN is as fast) and the kernels build (logged if not)."""
    if select_isa() is not Isa.AVX2:
        return False
    try:
        native_gemm()
    except KernelBuildError as error:
        log.warning("native float32 GEMM unavailable, using oneDNN: %s", error)
        return False
    return True
