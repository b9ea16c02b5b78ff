"""Native float32 CPU kernels for the decoder's element-wise layers (``csrc/fused_ops.c``).

RMSNorm (alone, and fused with the residual add before it) in one pass over each row, and
rotary embedding of q and k in one call, with no temporaries: on the CPU the torch forms
of these take several passes and allocations each (``pow``, ``mean``, ``rsqrt``, two
``mul``; ``chunk``, ``neg``, ``cat``, four ``mul``, two ``add``). Measured on one core
of the 2-core development EPYC (process time, 768 wide, 12 + 4 heads of 64): 128 tokens
take 47 instead of 85 us for residual add + norm and 36 instead of 198 us for rotary; a
decode token 8 instead of 17 us and 16 instead of 45 us; fp32 workload A 4.9% less CPU.

Built and cached like every native kernel (``engine/native_build.py``): compiled
with the system C compiler on first use, once per instruction set, which
``select_isa`` picks once (``TANDEM_CPU_ISA`` forces one). ``use_native_ops`` switches a
loaded model's norms and rotary embedding over; the modules keep their torch code for
other devices, other dtypes and training (these kernels have no backward).
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch
from torch import nn

from tandem.engine.native_build import Isa, KernelBuildError, build_library, select_isa

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fused_ops.c"
# -ffp-contract=off: no FMA contraction, so products round where torch's do.
# -fno-trapping-math: compares may become blends (the SiLU's clamp); no result changes.
COMMON_FLAGS = (
    "-O3",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=gnu11",
    "-ffp-contract=off",
    "-fno-trapping-math",
)
_ISA_FLAGS: dict[Isa, tuple[str, ...]] = {
    Isa.AVX512: ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"),
    Isa.AVX2: ("-mavx2", "-mfma"),
    Isa.PORTABLE: (),
}

_i64, _ptr, _float, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


class FusedOps:
    """One instruction set's build. Tensors are float32 CPU tensors; the wrappers check
    only what the kernels rely on beyond that (contiguity, the head dim's stride)."""

    def __init__(self, library: ctypes.CDLL, isa: Isa) -> None:
        self.isa = isa
        self._norm = library.tandem_rms_norm_f32
        self._norm.restype = None
        self._norm.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _float, _int]
        self._add_norm = library.tandem_add_rms_norm_f32
        self._add_norm.restype = None
        self._add_norm.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _float, _int]
        self._rotary = library.tandem_rotary_f32
        self._rotary.restype = ctypes.c_int
        self._rotary.argtypes = [
            *[_ptr, _i64, _i64, _i64] * 2,  # q, k: data, token stride, head stride, heads
            _ptr, _ptr, _i64, _i64,  # q_out, k_out, tokens, head_dim
            _ptr, _ptr, _ptr, _i64, _int,  # positions, cos, sin, max_positions, threads
        ]  # fmt: skip
        self._silu_mul = library.tandem_silu_mul_f32
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_ptr, _ptr, _i64, _i64, _int]
        name = library.tandem_fused_isa
        name.restype = ctypes.c_char_p
        built = name().decode()
        if built != isa.value:
            raise KernelBuildError(f"the {isa.value} build reports {built!r}")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``RMSNorm`` of ``x [..., n]`` (made contiguous if it is not)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        self._norm(
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // n,
            n,
            eps,
            torch.get_num_threads(),
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, the sum written into ``residual``
        (into a contiguous copy if it is not contiguous), which is returned."""
        x, residual = x.contiguous(), residual.contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        self._add_norm(
            x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // n,
            n,
            eps,
            torch.get_num_threads(),
        )
        return out, residual

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]`` and ``k [T, KVH, D]`` (any token / head strides, the head dim
        contiguous) rotated by ``positions [T]`` (int64) into new contiguous tensors;
        ``cos`` / ``sin``: contiguous ``[max_positions, D]`` tables."""
        if q.stride(2) != 1 or k.stride(2) != 1:
            q, k = q.contiguous(), k.contiguous()
        positions = positions.to(torch.int64).contiguous()
        tokens, _, dim = q.shape
        q_out = torch.empty(q.shape, dtype=q.dtype)
        k_out = torch.empty(k.shape, dtype=k.dtype)
        status = self._rotary(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            q.shape[1],
            k.data_ptr(),
            k.stride(0),
            k.stride(1),
            k.shape[1],
            q_out.data_ptr(),
            k_out.data_ptr(),
            tokens,
            dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            torch.get_num_threads(),
        )
        if status != 0:
            raise IndexError(f"a position outside the rotary tables (0..{cos.shape[0] - 1})")
        return q_out, k_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [..., 2n]`` (gate first), ``[..., n]``; SiLU
        through a polynomial exp, within about 1e-6 relative of torch's."""
        gate_up = gate_up.contiguous()
        n = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype)
        rows = gate_up.numel() // (2 * n) if n else 0
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads())
        return out


@cache
def fused_ops(isa: Isa) -> FusedOps:
    """The kernels built for ``isa`` (compiled on first use, then cached on disk and here);
    ``KernelBuildError`` when no C compiler is found or it fails."""
    flags = (*COMMON_FLAGS, *_ISA_FLAGS[isa], f'-DTANDEM_ISA="{isa.value}"', "-lm")
    return FusedOps(build_library(SOURCE, isa, flags), isa)


def native_ops_for(device: torch.device, dtype: torch.dtype) -> FusedOps | None:
    """The kernels for a model of ``dtype`` on ``device``: float32 on the CPU only;
    ``None`` elsewhere, or (logged) when they cannot be built here."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    try:
        return fused_ops(select_isa())
    except KernelBuildError as error:
        log.warning("fused norm / rotary kernels unavailable, using torch: %s", error)
        return None


def use_native_ops(model: nn.Module, ops: FusedOps) -> int:
    """Point every module of an inference-only model that has a native form (``RMSNorm``,
    ``RotaryEmbedding``) at ``ops``; returns how many. The model must be float32 on the
    CPU (``native_ops_for``) and is not trainable afterwards."""
    from tandem.engine.layers.norm import RMSNorm
    from tandem.engine.layers.rotary import RotaryEmbedding
    from tandem.engine.quantization.linear import QuantizedGatedMLP

    count = 0
    for module in model.modules():
        if isinstance(module, RMSNorm | RotaryEmbedding | QuantizedGatedMLP):
            module.native = ops
            count += 1
    return count
