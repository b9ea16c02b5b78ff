"""The native RMSNorm and rotary kernels (``engine/layers/native_ops``) against the torch
code they replace, for every instruction set this CPU runs: odd sizes, strided q/k views
of a fused QKV output, positions anywhere in the tables, and calls big enough to be split
over threads."""

from __future__ import annotations

import shutil

import pytest
import torch

from tandem.common.model_config import RopeConfig, RopeScaling
from tandem.engine.layers.mlp import GatedMLP
from tandem.engine.layers.native_ops import fused_ops, native_ops_for, use_native_ops
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.native_build import supported_isas
from tandem.engine.quantization.linear import QuantizedGatedMLP, quantize_model
from tandem.engine.quantization.scheme import QuantizationConfig, QuantMethod

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(params=supported_isas(), ids=lambda isa: isa.value)
def ops(request):
    return fused_ops(request.param)


def _norm(hidden: int, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return norm.requires_grad_(False)


# (rows, hidden): a decode row, odd widths, a 3-D batch, and calls split over threads.
NORM_SHAPES = [(1, 768), (5, 7), (3, 1), (2, 5, 33), (130, 768), (301, 333), (64, 1000)]


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_matches_torch(ops, shape):
    x = torch.randn(shape) * 3
    norm = _norm(shape[-1], seed=len(shape))
    expected = norm(x)
    norm.native = ops
    got = norm(x)
    assert got.shape == expected.shape
    # Only the sum of squares is ordered differently: rounding-level differences.
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_add_rms_norm_matches_torch_and_writes_the_sum(ops, shape):
    x, residual = torch.randn(shape), torch.randn(shape)
    norm = _norm(shape[-1], seed=1)
    expected, expected_sum = norm.forward_with_residual(x, residual.clone())
    norm.native = ops
    given = residual.clone()
    got, got_sum = norm.forward_with_residual(x, given)
    assert torch.equal(got_sum, expected_sum)  # a single float add: exact
    assert got_sum.data_ptr() == given.data_ptr()  # written in place
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)


def test_rms_norm_of_a_non_contiguous_input(ops):
    x = torch.randn(40, 96)[:, 16:80]
    norm = _norm(64, seed=2)
    expected = norm(x)
    norm.native = ops
    torch.testing.assert_close(norm(x), expected, rtol=2e-6, atol=2e-6)


def _rotary(head_dim: int, max_positions: int, rope: RopeConfig) -> RotaryEmbedding:
    rotary = RotaryEmbedding(head_dim, max_positions, rope, torch.float32)
    rotary.materialize(torch.device("cpu"))
    return rotary


ROPES = [
    RopeConfig(theta=10000.0),
    RopeConfig(theta=500000.0, scaling=RopeScaling.LLAMA3, factor=8.0),
]


@pytest.mark.parametrize("rope", ROPES, ids=["default", "llama3"])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"),
    [(1, 12, 4, 64), (7, 3, 1, 64), (5, 5, 5, 6), (130, 12, 4, 64), (33, 9, 3, 128)],
)
def test_rotary_matches_torch_exactly(ops, rope, tokens, heads, kv_heads, head_dim):
    max_positions = 300
    rotary = _rotary(head_dim, max_positions, rope)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, max_positions, (tokens,))
    positions[0] = max_positions - 1
    expected_q, expected_k = rotary(positions, q, k)
    before = qkv.clone()
    rotary.native = ops
    got_q, got_k = rotary(positions, q, k)
    # Same products and sums in the same order (no FMA contraction): bit for bit.
    assert torch.equal(got_q, expected_q)
    assert torch.equal(got_k, expected_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(qkv, before)  # inputs untouched


def test_rotary_refuses_a_position_outside_the_tables(ops):
    rotary = _rotary(8, 16, ROPES[0])
    rotary.native = ops
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(IndexError):
        rotary(torch.tensor([3, 16]), q, k)
    with pytest.raises(IndexError):
        rotary(torch.tensor([-1, 0]), q, k)


def test_native_ops_only_for_float32_on_the_cpu():
    assert native_ops_for(torch.device("cpu"), torch.float32) is not None
    assert native_ops_for(torch.device("cpu"), torch.bfloat16) is None
    assert native_ops_for(torch.device("meta"), torch.float32) is None


# (rows..., 2n): a decode row, odd widths (vector tails), a 3-D batch, threaded calls.
SILU_SHAPES = [(1, 6144), (3, 14), (2, 5, 66), (130, 6144), (64, 1002)]


@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_mul_matches_torch(ops, shape):
    gate_up = torch.randn(shape) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


def test_silu_mul_at_the_extremes(ops):
    """Far beyond exp's range both ways (the polynomial's input is clamped), zeros and
    infinities of the product's other side."""
    gate = torch.tensor([-1000.0, -90.0, -87.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.5, 90.0, 1e4])
    up = torch.linspace(-3, 3, gate.numel())
    got = ops.silu_mul(torch.cat([gate, up])[None])[0]
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-30)
    assert torch.isfinite(got).all()


def test_a_quantized_mlp_uses_the_fused_activation(ops):
    torch.manual_seed(0)
    model = torch.nn.Sequential(GatedMLP(64, 160))
    quantize_model(model, QuantizationConfig(QuantMethod.INT8))
    mlp = model[0]
    assert isinstance(mlp, QuantizedGatedMLP) and mlp.native is None
    x = torch.randn(40, 64)  # beyond the fused rows: the int8-activation path too
    expected = mlp(x)
    assert use_native_ops(model, ops) == 1
    assert mlp.native is ops
    torch.testing.assert_close(mlp(x), expected, rtol=1e-4, atol=1e-5)
