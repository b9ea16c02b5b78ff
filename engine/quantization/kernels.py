"""The native quantized matmuls (``csrc/quant_matmul.c``), one build per instruction set.

Built like every native kernel (``engine/native_build.py``: compiled on first use,
cached, ``select_isa`` / ``TANDEM_CPU_ISA``), with these flags: ``avx512``
(``-mavx512f -mavx512bw ... -mavx512vnni``), ``avx2`` (``-mavx2 -mfma``) and ``portable``
(no ``-m`` flag: GCC's generic vectors). Callers pass ``torch.get_num_threads()``, which
the engine's ``num_threads`` sets.

``IntGemm`` names what multiplies int8 activations by int8 weights (int8 layers beyond 16
rows): ``torch._int_mm`` where it passes a once-per-process exactness check, else the
native kernel; ``TANDEM_INT8_GEMM=torch|native`` forces one.
"""

from __future__ import annotations

import ctypes
import enum
import os
from functools import cache
from pathlib import Path

import torch

from tandem.engine.native_build import Isa, KernelBuildError, build_library, select_isa

SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.c"
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
INT_GEMM_ENV = "TANDEM_INT8_GEMM"
_ISA_FLAGS: dict[Isa, tuple[str, ...]] = {
    Isa.AVX512: (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512vnni",
        "-mavx2",
        "-mfma",
    ),
    Isa.AVX2: ("-mavx2", "-mfma"),
    Isa.PORTABLE: (),
}


class IntGemm(enum.Enum):
    """What multiplies int8 activations by int8 weights (int8 layers, more than 16 rows)."""

    TORCH = "torch"
    """``torch._int_mm`` (oneDNN): about a third of a float32 GEMM's time with AVX-512
    VNNI, but wrong (saturating u8 x s8 products) when oneDNN runs its AVX2 code."""
    NATIVE = "native"
    """``tandem_int8_int8_matmul`` in ``csrc/quant_matmul.c``: exact on every build."""


def select_int_gemm() -> IntGemm:
    """``TANDEM_INT8_GEMM=torch|native`` if set (``ValueError`` when unknown, or ``torch``
    where it fails its check), else ``torch`` where the instruction set is ``avx512``
    (which includes VNNI) and ``torch_int_mm_is_exact()``, otherwise ``native``. Without
    VNNI torch either runs oneDNN's saturating AVX2 code or, since pytorch#136746, a plain
    loop many times slower than a float GEMM, so the native kernel is the choice there
    whatever the check says. Called once per model (``quantize_model``)."""
    forced = os.environ.get(INT_GEMM_ENV)
    if not forced:
        fast = select_isa() is Isa.AVX512 and torch_int_mm_is_exact()
        return IntGemm.TORCH if fast else IntGemm.NATIVE
    try:
        choice = IntGemm(forced)
    except ValueError:
        valid = ", ".join(g.value for g in IntGemm)
        raise ValueError(f"{INT_GEMM_ENV} must be one of {valid}, got {forced!r}") from None
    if choice is IntGemm.TORCH and not torch_int_mm_is_exact():
        raise ValueError(f"{INT_GEMM_ENV}=torch but torch._int_mm fails its exactness check here")
    return choice


@cache
def torch_int_mm_is_exact() -> bool:
    """Whether ``torch._int_mm`` gives the exact int32 product here, checked once per
    process (a few ms): odd shapes, every sign combination of the extreme codes +-127
    (where a u8 x s8 pair sum saturates on oneDNN's AVX2 path) and random codes, against
    an int64 product. An error (a shape it refuses, no such op) counts as a failure."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for m, k, n in ((17, 70, 37), (64, 256, 48)):
        for a, b in ((127, 127), (-127, 127), (127, -127), (-127, -127)):
            x = torch.full((m, k), a, dtype=torch.int8)
            cases.append((x, torch.full((n, k), b, dtype=torch.int8)))
        x = torch.randint(-127, 128, (m, k), generator=generator, dtype=torch.int8)
        w = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
        cases.append((x, w))
    try:
        return all(
            torch.equal(torch._int_mm(x, w.t()).long(), x.long() @ w.long().t()) for x, w in cases
        )
    except (RuntimeError, AttributeError):
        return False


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class QuantKernels:
    """One instruction set's build of the kernels. Arguments are CPU tensors, contiguous,
    of the dtypes and shapes the layout in ``quantization.scheme`` describes; nothing is
    checked here (``QuantizedLinear`` builds them), so a wrong shape is memory corruption."""

    def __init__(self, library: ctypes.CDLL, isa: Isa) -> None:
        self.isa = isa
        self._int4 = library.tandem_int4_matmul
        self._int4.restype = ctypes.c_int
        self._int4.argtypes = (
            [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
            + [ctypes.c_void_p] * 3
            + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        )
        self._int8_dq = library.tandem_int8_dequantize
        self._int8_dq.restype = None
        self._int8_dq.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        self._int4_dq = library.tandem_int4_dequantize
        self._int4_dq.restype = None
        self._int4_dq.argtypes = (
            [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int]
        )
        self._int8_int8 = library.tandem_int8_int8_matmul
        self._int8_int8.restype = ctypes.c_int
        self._int8_int8.argtypes = (
            [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
            + [ctypes.c_void_p] * 5
            + [ctypes.c_int]
        )
        self._wsum = library.tandem_int8_weight_sums
        self._wsum.restype = None
        self._wsum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        act_max = library.tandem_int8_act_max
        act_max.restype = ctypes.c_int
        self.act_max: int = act_max()
        """The largest activation code this build's integer product takes (``quantize_rows``
        rounds to ``[-act_max, act_max]``): 127, or 64 with AVX2 (``csrc``, W8A8)."""
        self._rescale = library.tandem_int8_rescale
        self._rescale.restype = None
        self._rescale.argtypes = (
            [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
            + [ctypes.c_void_p] * 4
            + [ctypes.c_int]
        )
        self._absmax = library.tandem_row_absmax
        self._absmax.restype = None
        self._absmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self._absmax.argtypes += [ctypes.c_int]
        self._quantize_rows = library.tandem_int8_quantize_rows
        self._quantize_rows.restype = None
        self._quantize_rows.argtypes = (
            [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
            + [ctypes.c_void_p] * 3
            + [ctypes.c_int]
        )
        self.int4_panel_rows: int = library.tandem_int4_panel_rows()
        """From this many rows on ``int4_matmul`` takes the panel kernel (output channels
        in the vector lanes, their nibbles unpacked once per call); 0: never (portable)."""
        name = library.tandem_quant_isa
        name.restype = ctypes.c_char_p
        built = name().decode()
        if built != isa.value:
            raise KernelBuildError(f"the {isa.value} build reports {built!r}")

    def int4_matmul(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x [m, k]`` times the int4 weight (``q`` packed ``[n, ceil(k/32)*16]`` uint8,
        ``scales`` float32 and ``zeros`` uint8 ``[n, ceil(k/group)]``)."""
        m, k = x.shape
        n = q.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        status = self._int4(
            x.data_ptr(),
            m,
            k,
            q.data_ptr(),
            scales.data_ptr(),
            zeros.data_ptr(),
            group,
            _ptr(bias),
            y.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("int4 matmul: could not allocate its group sums")
        return y

    def row_absmax(self, x: torch.Tensor) -> torch.Tensor:
        """``max |x[r, :]|`` per row of a float32 ``[m, k]`` ``x``: ``[m]``."""
        m, k = x.shape
        amax = torch.empty(m, dtype=torch.float32)
        self._absmax(x.data_ptr(), m, k, amax.data_ptr(), torch.get_num_threads())
        return amax

    def quantize_rows(
        self, x: torch.Tensor, amax: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(xq, sx)``: ``x [m, k]`` rounded per row to int8, ``x ~ sx[:, None] * xq``,
        with ``sx = a / act_max`` and ``xq = round(x * (act_max / a))`` (ties to even;
        ``a = 0`` gives zeros), ``a`` each row's ``max |x|``, or ``amax [m]`` when given (a
        row-parallel slice: the maximum over the whole row)."""
        m, k = x.shape
        xq = torch.empty(m, k, dtype=torch.int8)
        sx = torch.empty(m, dtype=torch.float32)
        self._quantize_rows(
            x.data_ptr(),
            m,
            k,
            _ptr(amax),
            xq.data_ptr(),
            sx.data_ptr(),
            torch.get_num_threads(),
        )
        return xq, sx

    def weight_sums(self, q: torch.Tensor) -> torch.Tensor:
        """``q.sum(1)`` of an int8 ``[n, k]`` weight as int32 ``[n]``: what the integer
        product needs besides the weight (``int8_int8_matmul``); keep it with the weight."""
        n, k = q.shape
        wsum = torch.empty(n, dtype=torch.int32)
        self._wsum(q.data_ptr(), n, k, wsum.data_ptr())
        return wsum

    def int8_int8_matmul(
        self, xq: torch.Tensor, q: torch.Tensor, wsum: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The exact int32 ``xq [m, k] @ q.T`` of two int8 matrices (``q`` ``[n, k]``, codes
        of ``xq`` within ``+-act_max``; ``wsum``: ``weight_sums(q)``, computed if not
        given)."""
        return self._integer_product(xq, q, wsum, None, None, None)

    def int8_int8_linear(
        self,
        xq: torch.Tensor,
        sx: torch.Tensor,
        q: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        wsum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rescale(int8_int8_matmul(xq, q), sx, scales, bias)`` in one pass."""
        return self._integer_product(xq, q, wsum, sx, scales, bias).view(torch.float32)

    def _integer_product(
        self,
        xq: torch.Tensor,
        q: torch.Tensor,
        wsum: torch.Tensor | None,
        sx: torch.Tensor | None,
        scales: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        m, k = xq.shape
        n = q.shape[0]
        if wsum is None:
            wsum = self.weight_sums(q)
        acc = torch.empty(m, n, dtype=torch.int32)
        status = self._int8_int8(
            xq.data_ptr(),
            m,
            k,
            q.data_ptr(),
            n,
            wsum.data_ptr(),
            acc.data_ptr(),
            _ptr(sx),
            _ptr(scales),
            _ptr(bias),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("int8 matmul: could not allocate its unsigned activation codes")
        return acc

    def rescale(
        self,
        acc: torch.Tensor,
        sx: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``float(acc) * sx[:, None] * scales[None, :] + bias`` of an int32 ``[m, n]``
        ``acc``, written over ``acc`` (returned as its float32 view)."""
        m, n = acc.shape
        self._rescale(
            acc.data_ptr(),
            m,
            n,
            sx.data_ptr(),
            scales.data_ptr(),
            _ptr(bias),
            acc.data_ptr(),
            torch.get_num_threads(),
        )
        return acc.view(torch.float32)

    def int8_dequantize(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        n, k = q.shape
        out = torch.empty(n, k, dtype=torch.float32)
        self._int8_dq(
            q.data_ptr(), scales.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()
        )
        return out

    def int4_dequantize(
        self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, k: int
    ) -> torch.Tensor:
        n = q.shape[0]
        out = torch.empty(n, k, dtype=torch.float32)
        self._int4_dq(
            q.data_ptr(),
            scales.data_ptr(),
            zeros.data_ptr(),
            group,
            n,
            k,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out


@cache
def quant_kernels(isa: Isa) -> QuantKernels:
    """The kernels built for ``isa`` (compiled on first use, then cached on disk and here);
    ``KernelBuildError`` when no C compiler is found or it fails."""
    return QuantKernels(build_library(SOURCE, isa, (*COMMON_FLAGS, *_ISA_FLAGS[isa])), isa)
