"""Quantized linear layers and ``quantize_model``, the one step that swaps them in.

A ``QuantizedLinear`` holds a ``QuantizedWeight`` (``scheme``) and multiplies with the
native kernels. int8 rounds each row of activations to int8 at every row count (one
scale per row; codes in ``[-127, 127]``, or ``[-64, 64]`` with the AVX2 build, whose byte
products saturate beyond: ``QuantKernels.act_max``) and multiplies integers exactly, so
a row's result is the same whatever else its step holds (a decode alone or batched, a
speculative verification, a recomputation after preemption): the native kernel up to
``MAX_KERNEL_ROWS`` rows, beyond either it or ``torch._int_mm`` (``IntGemm``, chosen once
per model; ``TANDEM_INT8_GEMM=native`` forces the native one), both rescaled by the same
C code. int4 keeps its native kernel (int8 activations per group, integer dot products)
at every row count with the AVX2 and AVX-512 builds, whose panel kernel takes 16 rows
and more (its per-group float sums are added in another order than the one-row loop's
below 16 rows: a row's result can differ between the two in the last bits); the
portable build's kernel only up to ``INT4_KERNEL_ROWS`` rows, beyond which the weight is
dequantized to float32 in C for a float GEMM.

Tensor parallelism: each rank quantizes its own slice. A column-parallel slice is whole
rows, so it quantizes as the full weight would. A row-parallel slice is a range of input
columns: int8 takes each row's scale from the maximum over all ranks (one all-reduce at
load), int4 needs the slice to be whole groups (refused otherwise). A model quantized at
tensor_parallel_size N therefore holds exactly the slices of the model quantized at 1.
Likewise a row-parallel int8 layer rounds its slice of the activations with the whole
row's scale (an all-reduce of the row maxima per call), so each rank's integers are a
slice of the one-rank product's; the ranks then add their int32 products (instead of
scaled floats) and scale the sum: bitwise the one-rank output.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.model_config import Activation
from tandem.engine.layers.attention import SelfAttention
from tandem.engine.layers.mla import MultiLatentAttention
from tandem.engine.layers.mlp import GatedMLP, activate
from tandem.engine.layers.moe import FusedExperts, run_experts
from tandem.engine.layers.native_ops import FusedOps
from tandem.engine.native_build import select_isa
from tandem.engine.parallel.group import TensorParallelGroup
from tandem.engine.parallel.layers import CheckpointSlice, RowParallelLinear, Span
from tandem.engine.quantization.kernels import (
    IntGemm,
    QuantKernels,
    quant_kernels,
    select_int_gemm,
)
from tandem.engine.quantization.scheme import (
    QuantizationConfig,
    QuantizedWeight,
    QuantMethod,
    empty_quantized,
    quantize_int4,
    quantize_int8,
    scales_from_absmax,
)

MAX_KERNEL_ROWS = 16
"""Rows up to which int8's integer product always runs in the native kernel (a batch-1
step of the medium model with AVX-512 VNNI: 0.34x float32's with it, 0.47x through
torch's oneDNN product; beyond, ``IntGemm`` decides)."""
INT4_KERNEL_ROWS = 128
"""Rows up to which the portable build's int4 kernel is used; beyond, dequantize + float
GEMM (the kernel's cost grows with the rows, the dequantization's does not; the
one-row-at-a-time loop measured, over the medium model's four projection shapes, 0.79x
the dequantize + GEMM time at 128 rows and 1.05x at 256). The AVX2 / AVX-512 panel
kernel has no such limit: 0.39-0.40x the dequantize + GEMM time at 512-1,024 rows with
AVX-512, 0.57-0.75x with AVX2."""


def int4_fused_rows(kernels: QuantKernels) -> int:
    """The most rows ``kernels`` multiply int4 weights with (beyond: dequantize)."""
    return sys.maxsize if kernels.int4_panel_rows else INT4_KERNEL_ROWS


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` quantized; inference only, CPU, float32."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        config: QuantizationConfig,
        kernels: QuantKernels,
        row_spans: tuple[Span, ...],
        col_span: Span | None = None,
        int_gemm: IntGemm = IntGemm.NATIVE,
        row_group: TensorParallelGroup | None = None,
    ) -> None:
        """``row_spans[i]``: the rows this layer holds of stacked checkpoint tensor ``i``
        (q/k/v, gate/up); ``col_span``: the input columns it holds (a row-parallel
        slice), ``None`` for all. Both say where a quantized checkpoint's tensors go.
        ``int_gemm``: what multiplies int8 by int8 beyond ``MAX_KERNEL_ROWS`` rows (int8
        only; the native kernel up to there). ``row_group``: for a row-parallel slice,
        the ranks holding the rest of each input row (their row maxima are combined
        before rounding); ``None`` when this layer sees whole rows."""
        super().__init__()
        self.row_spans, self.col_span = row_spans, col_span
        self.int_gemm, self.row_group = int_gemm, row_group
        self.in_features = weight.in_features
        self.out_features = weight.qweight.shape[0]
        self.method, self.group_size = config.method, config.group_size
        int8 = config.method is QuantMethod.INT8
        self.fused_rows = 0 if int8 else int4_fused_rows(kernels)
        """Rows up to which the fused kernel runs (int4; int8 always rounds activations)."""
        self.kernels = kernels
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._weight_sums: torch.Tensor | None = None  # the native integer product's, lazily

    @property
    def weight_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.qweight, self.scales, self.zeros)
            if t is not None
        )

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight this layer stands for."""
        if self.method is QuantMethod.INT8:
            return self.kernels.int8_dequantize(self.qweight, self.scales)
        return self.kernels.int4_dequantize(
            self.qweight, self.scales, self.zeros, self.group_size, self.in_features
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.method is QuantMethod.INT8:
            y = self._int8_activations(rows.contiguous())
        elif rows.shape[0] <= self.fused_rows:
            y = self.kernels.int4_matmul(
                rows.contiguous(), self.qweight, self.scales, self.zeros, self.group_size, self.bias
            )
        else:
            return F.linear(x, self.dequantized(), self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _int8_activations(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` rounded to int8 per row, times the int8 weight, exactly in int32, then
        scaled: ``acc * sx[:, None] * scales[None, :] + bias``. ``torch._int_mm`` takes
        the weight as the transposed view ``qweight.t()``: as fast as a contiguous
        ``[k, n]`` copy (measured at 64 and 512 rows), so only one copy is held."""
        amax = None
        if self.row_group is not None:
            amax = self.row_group.all_reduce_max(self.kernels.row_absmax(rows))
        xq, sx = self.kernels.quantize_rows(rows, amax)
        if self.int_gemm is IntGemm.TORCH and rows.shape[0] > MAX_KERNEL_ROWS:
            acc = torch._int_mm(xq, self.qweight.t())
        else:
            if self._weight_sums is None:
                self._weight_sums = self.kernels.weight_sums(self.qweight)
            if self.row_group is None:
                return self.kernels.int8_int8_linear(
                    xq, sx, self.qweight, self.scales, self.bias, self._weight_sums
                )
            acc = self.kernels.int8_int8_matmul(xq, self.qweight, self._weight_sums)
        if self.row_group is not None:
            self.row_group.all_reduce(acc)  # the one-rank integers, exactly
        return self.kernels.rescale(acc, sx, self.scales, self.bias)

    @property
    def sums_over_ranks(self) -> bool:
        """Whether the output is already the sum over a row-parallel layer's ranks: int8
        adds the ranks' integer products before scaling, so N ranks give bitwise the
        one-rank result (a float all-reduce of scaled partial sums would not)."""
        return self.row_group is not None and self.method is QuantMethod.INT8

    def load_part(self, leaf: str, tensor: CheckpointSlice, shard: int | None) -> None:
        """Fill buffer ``leaf`` (qweight, scales, zeros, bias) from stacked checkpoint
        tensor ``shard`` of a quantized checkpoint, reading only this layer's slice."""
        index = shard or 0
        span = self.row_spans[index]
        dest = getattr(self, leaf)
        if dest is None:
            raise ValueError(f"checkpoint has {leaf} for a layer without one")
        dest = dest.narrow(0, sum(s.size for s in self.row_spans[:index]), span.size)
        if self.col_span is None:
            source = tensor.rows(span.start, span.size)
        elif leaf == "scales" and self.method is QuantMethod.INT8:
            source = tensor.full()  # one scale per row, over all ranks' columns
        else:
            per = {"qweight": 1 if self.method is QuantMethod.INT8 else 2}.get(
                leaf, self.group_size
            )
            source = tensor.cols(self.col_span.start // per, self.col_span.size // per)
        if tuple(source.shape) != tuple(dest.shape):
            raise ValueError(
                f"checkpoint {leaf} has shape {tuple(source.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(source)
        self._weight_sums = None

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.method is QuantMethod.INT4 else ""
        gemm = f", int_gemm={self.int_gemm.value}" if self.method is QuantMethod.INT8 else ""
        return (
            f"in={self.in_features}, out={self.out_features}, {self.method.value}{group}, "
            f"isa={self.kernels.isa.value}{gemm}"
        )


class AllReducedLinear(nn.Module):
    """A row-parallel product followed by the sum over the ranks (which an int8 product
    takes itself, over its integers: ``QuantizedLinear.sums_over_ranks``)."""

    def __init__(self, product: QuantizedLinear, group: TensorParallelGroup) -> None:
        super().__init__()
        self.product = product
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        return y if self.product.sums_over_ranks else self.group.all_reduce(y)


class QuantizedGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` over quantized projections. Not a ``GatedMLP``, so
    oneDNN packing (``layers.linear.pack_linear_layers``) leaves it alone."""

    def __init__(self, mlp: GatedMLP, quantize: _Quantizer) -> None:
        super().__init__()
        self.intermediate_size = size = mlp.intermediate_size
        self.activation = mlp.activation
        self.gate_up_proj = quantize(mlp.gate_up_proj, (size, size))
        self.down_proj = quantize(mlp.down_proj, (mlp.down_proj.out_features,))
        self.native: FusedOps | None = None  # the fused SiLU-and-product (use_native_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native is not None and self.activation is Activation.SILU:
            return self.down_proj(self.native.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(activate(gate, self.activation) * up)


class QuantizedExperts(nn.Module):
    """A mixture's experts (this rank's share) over quantized projections: for each
    expert with rows in the step, one product over its gate and up halves, the
    activation, one down product, on the rows ``run_experts`` sorts by expert (the
    layout of every expert backend). int8 rounds each row of activations on its own as
    everywhere, so a token's output does not depend on the tokens routed with it. With
    tensor parallelism each rank quantizes its slice of every expert (expert
    parallelism: its whole experts, as at one rank)."""

    def __init__(self, experts: FusedExperts, quantize: _Quantizer) -> None:
        super().__init__()
        self.num_experts, self.first_expert = experts.num_experts, experts.first_expert
        self.num_local = experts.num_local
        self.intermediate_size = inner = experts.intermediate_size
        self.activation = experts.activation
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        self.gate_up = nn.ModuleList(quantize(_as_linear(w), (inner, inner)) for w in gate_up)
        self.down = nn.ModuleList(quantize(_as_linear(w), (w.shape[0],)) for w in down)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, ids, weights)

    def products(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        start = 0
        for gate_up, down, count in zip(self.gate_up, self.down, counts.tolist(), strict=True):
            if count:
                part = rows[start : start + count]
                gate, up = gate_up(part).split(self.intermediate_size, dim=-1)
                out[start : start + count] = down(activate(gate, self.activation) * up)
                start += count
        return out


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free linear layer around ``weight [out, in]`` (no copy), for ``_Quantizer``."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


class _Quantizer:
    """Turns one loaded float linear layer into its quantized form (module docstring).
    ``empty``: shapes only, values left for a quantized checkpoint to fill."""

    def __init__(
        self, config: QuantizationConfig, kernels: QuantKernels, int_gemm: IntGemm, empty: bool
    ) -> None:
        self.config = config
        self.kernels = kernels
        self.int_gemm = int_gemm
        self.empty = empty

    def __call__(self, linear: nn.Linear, parts: tuple[int, ...]) -> nn.Module:
        """``parts``: the row counts of the checkpoint tensors stacked in ``linear``
        (used unless a column-parallel layer names its own spans)."""
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        spans = getattr(linear, "spans", None) or tuple(Span(0, size) for size in parts)
        if isinstance(linear, RowParallelLinear):
            quantized = self._row_slice(weight, linear.group)
            product = QuantizedLinear(
                quantized,
                bias,
                self.config,
                self.kernels,
                spans,
                linear.span,
                self.int_gemm,
                linear.group,
            )
            return AllReducedLinear(product, linear.group)
        return QuantizedLinear(
            self._whole(weight), bias, self.config, self.kernels, spans, None, self.int_gemm
        )

    def _whole(self, weight: torch.Tensor) -> QuantizedWeight:
        if self.empty:
            return empty_quantized(weight.shape[0], weight.shape[1], self.config)
        if self.config.method is QuantMethod.INT8:
            return quantize_int8(weight)
        return quantize_int4(weight, self.config.group_size)

    def _row_slice(self, weight: torch.Tensor, group: TensorParallelGroup) -> QuantizedWeight:
        if self.config.method is QuantMethod.INT4 and weight.shape[1] % self.config.group_size:
            raise ValueError(
                f"a tensor-parallel rank holds {weight.shape[1]} input columns of a "
                f"row-parallel layer, not a multiple of quantization_group_size "
                f"{self.config.group_size}; use a smaller group or tensor_parallel_size"
            )
        if self.empty or self.config.method is QuantMethod.INT4:
            return self._whole(weight)
        absmax = weight.abs().amax(dim=1).float()
        group.all_reduce_max(absmax)
        return quantize_int8(weight, scales_from_absmax(absmax))


MLA_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
"""The linear layers of latent attention that quantize (``kv_b_proj`` does not)."""


def _quantizer(config: QuantizationConfig, empty: bool) -> _Quantizer:
    int_gemm = select_int_gemm() if config.method is QuantMethod.INT8 else IntGemm.NATIVE
    return _Quantizer(config, quant_kernels(select_isa()), int_gemm, empty)


def _quantize_experts(model: nn.Module, quantize: _Quantizer) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedExperts):
                setattr(parent, name, QuantizedExperts(child, quantize))
                count += 1
    return count


def quantize_experts(model: nn.Module, config: QuantizationConfig) -> int:
    """Quantizes the float experts of a loaded model (a quantized checkpoint stores its
    experts float, so its loader calls this after reading them); returns how many
    mixtures changed."""
    return _quantize_experts(model, _quantizer(config, empty=False))


def quantize_model(model: nn.Module, config: QuantizationConfig, empty: bool = False) -> int:
    """Replaces, in place, the attention and MLP projections of a loaded float32 CPU
    model (and its ``lm_head`` when ``config.lm_head``) by quantized layers; returns how
    many modules changed. Every rank of a tensor-parallel replica calls it at the same
    point (row-parallel int8 layers all-reduce their row maxima). ``empty``: the layers
    get uninitialised buffers of the right shapes (for ``checkpoint.load_quantized``)."""
    quantize = _quantizer(config, empty)
    count = 0
    for module in model.modules():
        if isinstance(module, SelfAttention):
            parts = (module.q_size, module.kv_size, module.kv_size)
            module.qkv_proj = quantize(module.qkv_proj, parts)
            module.o_proj = quantize(module.o_proj, (module.o_proj.out_features,))
            count += 2
        elif isinstance(module, MultiLatentAttention):
            # kv_b_proj stays float: it is used as per-head factors, not as a product.
            for name in MLA_PROJECTIONS:
                linear = getattr(module, name, None)
                if linear is not None:
                    setattr(module, name, quantize(linear, (linear.out_features,)))
                    count += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GatedMLP):
                setattr(parent, name, QuantizedGatedMLP(child, quantize))
                count += 1
    if not empty:  # a quantized checkpoint keeps its experts float: see quantize_experts
        count += _quantize_experts(model, quantize)
    if config.lm_head:
        if not isinstance(model.lm_head, nn.Linear):
            raise ValueError("quantize_lm_head is not supported with tensor_parallel_size > 1")
        model.lm_head = quantize(model.lm_head, (model.lm_head.out_features,))
        count += 1
    return count
