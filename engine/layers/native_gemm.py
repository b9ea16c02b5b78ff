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
``F.linear`` by float rounding only (sums in input-channel order, one FMA per term), and
a row's result does not depend on the other rows of the call (``batch_invariant``).

A weight whose every value is a bfloat16 (a bfloat16 checkpoint run in float32) may be
packed in bfloat16 (``pack(..., narrow=True)``): half the bytes to read per decode step,
widened exactly as the kernel loads them, so every result bit is the float32 panels'.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
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


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernel's panel order: ``data`` (flat float32) for an ``[n, k]``
    weight, or for a gate and an up weight of ``[n, k]`` each when ``gated``. Made by
    ``NativeGemm.pack`` / ``pack_gated`` only (the kernels trust its size)."""

    data: torch.Tensor
    n: int
    k: int
    gated: bool = False
    narrow: bool = False
    """``data`` holds bfloat16 bit patterns (int16), not float32."""


@dataclass(frozen=True)
class PackedStack:
    """Same-shape ``PackedWeight`` data stacked, ``[E, floats per weight]`` (the experts of
    a mixture of experts). Made by ``NativeGemm.stack`` only."""

    data: torch.Tensor
    n: int
    k: int
    gated: bool


class NativeGemm:
    """The loaded kernels. Inputs are float32 ``[..., k]`` (made contiguous when they are
    not); a weight must come from ``pack`` (for ``linear``) or ``pack_gated`` (for
    ``gated``), which the wrappers check before the kernel reads it."""

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
        self._pack_bf16 = library.tandem_gemm_pack_bf16
        self._pack_bf16.restype = None
        self._pack_bf16.argtypes = [_ptr, _i64, _i64, _ptr]
        self._pack_gated_bf16 = library.tandem_gemm_pack_gated_bf16
        self._pack_gated_bf16.restype = None
        self._pack_gated_bf16.argtypes = [_ptr, _ptr, _i64, _i64, _ptr]
        self._gemm_bf16w = library.tandem_gemm_bf16w
        self._gemm_bf16w.restype = None
        self._gemm_bf16w.argtypes = self._gemm.argtypes
        self._gated_bf16w = library.tandem_gemm_gated_bf16w
        self._gated_bf16w.restype = None
        self._gated_bf16w.argtypes = self._gated.argtypes
        self._grouped = {
            gated: getattr(library, name)
            for gated, name in (
                (False, "tandem_gemm_grouped_f32"),
                (True, "tandem_gemm_grouped_gated_f32"),
            )
        }
        for fn in self._grouped.values():
            fn.restype = None
            fn.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _int]

    def pack(self, weight: torch.Tensor, narrow: bool = False) -> PackedWeight:
        """``weight [n, k]`` in panel order; in bfloat16 when ``narrow`` and every value
        is one (the results are the same either way)."""
        weight = _float32_matrix(weight, "weight")
        n, k = weight.shape
        if narrow and _is_bfloat16(weight):
            data = torch.empty(self._packed_floats(n, k), dtype=torch.int16)
            bits = _bits(weight)  # held: the kernel reads it after this line
            self._pack_bf16(bits.data_ptr(), n, k, data.data_ptr())
            return PackedWeight(data, n, k, narrow=True)
        data = torch.empty(self._packed_floats(n, k), dtype=torch.float32)
        self._pack(weight.data_ptr(), n, k, data.data_ptr())
        return PackedWeight(data, n, k)

    def pack_gated(
        self, gate: torch.Tensor, up: torch.Tensor, narrow: bool = False
    ) -> PackedWeight:
        """``gate`` and ``up`` (both ``[n, k]``) interleaved 8 columns at a time; in
        bfloat16 when ``narrow`` and every value of both is one."""
        gate, up = _float32_matrix(gate, "gate"), _float32_matrix(up, "up")
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        n, k = gate.shape
        if narrow and _is_bfloat16(gate) and _is_bfloat16(up):
            data = torch.empty(self._gated_packed_floats(n, k), dtype=torch.int16)
            gate_bits, up_bits = _bits(gate), _bits(up)  # held while the kernel reads them
            self._pack_gated_bf16(gate_bits.data_ptr(), up_bits.data_ptr(), n, k, data.data_ptr())
            return PackedWeight(data, n, k, gated=True, narrow=True)
        data = torch.empty(self._gated_packed_floats(n, k), dtype=torch.float32)
        self._pack_gated(gate.data_ptr(), up.data_ptr(), n, k, data.data_ptr())
        return PackedWeight(data, n, k, gated=True)

    def linear(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for ``weight = pack(W)``; ``bias`` float32 ``[n]``."""
        x, rows = self._rows(x, weight, gated=False)
        n = weight.n
        if bias is not None:
            if bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.numel() != n:
                raise ValueError(
                    f"bias must be {n} float32 values on the CPU, not {bias.dtype} "
                    f"{tuple(bias.shape)} on {bias.device}"
                )
            bias = bias.contiguous()  # held here: the kernel reads it after this line
        if weight.k == 0:  # no inputs: every output is its bias
            out = torch.zeros(*x.shape[:-1], n, dtype=torch.float32)
            return out if bias is None else out + bias
        out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        if rows:
            (self._gemm_bf16w if weight.narrow else self._gemm)(
                x.data_ptr(), rows, weight.k, weight.data.data_ptr(), n,
                None if bias is None else bias.data_ptr(), out.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def gated(self, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        """``silu(x @ G.T) * (x @ U.T)`` for ``weight = pack_gated(G, U)``."""
        x, rows = self._rows(x, weight, gated=True)
        n = weight.n
        if weight.k == 0:  # silu(0) * 0
            return torch.zeros(*x.shape[:-1], n, dtype=torch.float32)
        out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        if rows:
            (self._gated_bf16w if weight.narrow else self._gated)(
                x.data_ptr(), rows, weight.k, weight.data.data_ptr(), n, out.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def stack(self, weights: list[PackedWeight]) -> PackedStack:
        """Weights of one shape (all from ``pack``, or all from ``pack_gated``) side by
        side, for ``grouped``."""
        first = weights[0]
        if any((w.n, w.k, w.gated) != (first.n, first.k, first.gated) for w in weights):
            raise ValueError("stacked weights must share their shape and packing")
        if any(w.narrow for w in weights):
            raise ValueError("stacked weights must be packed in float32 (narrow=False)")
        data = torch.stack([w.data for w in weights])
        return PackedStack(data, first.n, first.k, first.gated)

    def grouped(self, x: torch.Tensor, offsets: torch.Tensor, weights: PackedStack) -> torch.Tensor:
        """Rows ``[offsets[e], offsets[e + 1])`` of ``x [rows, k]`` times weight ``e``
        (``linear``, or ``gated`` for a stack from ``pack_gated``), rows kept in place;
        ``offsets``: int64, ``len(weights) + 1`` values from 0 to ``rows``."""
        x = x.contiguous()
        if x.dtype != torch.float32 or x.shape[-1] != weights.k:
            raise ValueError(
                f"inputs {x.dtype} {tuple(x.shape)} for stacked weights of {weights.k}"
            )
        offsets = offsets.to(torch.int64).contiguous()
        out = torch.empty(x.shape[0], weights.n, dtype=torch.float32)
        self._grouped[weights.gated](
            x.data_ptr(), offsets.data_ptr(), weights.data.shape[0], weights.k,
            weights.data.data_ptr(), weights.data.shape[1], weights.n, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    @staticmethod
    def _rows(x: torch.Tensor, weight: PackedWeight, gated: bool) -> tuple[torch.Tensor, int]:
        """``x`` contiguous and its row count, after the checks a call needs (the packed
        data was made by ``pack`` / ``pack_gated`` for its ``n``, ``k``: not re-checked on
        every call of the decode loop)."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the native GEMM takes float32 CPU inputs, not {x.dtype} {x.device}")
        if weight.gated != gated:
            made, use = ("pack_gated", "gated") if weight.gated else ("pack", "linear")
            raise ValueError(f"a weight from {made} goes to {use}")
        if x.shape[-1] != weight.k:
            raise ValueError(f"inputs of {x.shape[-1]} features for a weight of {weight.k}")
        x = x.contiguous()
        return x, x.numel() // weight.k if weight.k else 0


def _is_bfloat16(t: torch.Tensor) -> bool:
    """Whether every value of float32 ``t`` is a bfloat16 (its low 16 bits are zero)."""
    return not bool(torch.any(t.view(torch.int32) & 0xFFFF))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bfloat16 patterns of float32 ``t`` whose values all are bfloat16."""
    return (t.view(torch.int32) >> 16).to(torch.int16).contiguous()


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
