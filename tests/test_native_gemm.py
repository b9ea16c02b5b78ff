"""Tandem's float32 AVX2 GEMM (``engine/layers/native_gemm``) against a float64 reference:
odd sizes on every edge of its blocking (6-row tiles, 16-column panels, 256-deep slices,
192-row blocks), biases, the gated MLP's SiLU-product epilogue, one and two threads; rows
that do not depend on the call they are in; and what it refuses."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.layers.native_gemm import native_gemm, native_gemm_supported

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or not native_gemm_supported(),
    reason="needs a C compiler and a CPU with AVX2 + FMA",
)

# (rows, in, out): a decode row, tile / panel / slice / row-block edges, a prefill chunk.
SHAPES = [
    (1, 768, 3072),
    (1, 3, 1),
    (5, 255, 15),
    (6, 256, 16),
    (7, 257, 17),
    (13, 513, 33),
    (64, 768, 100),
    (193, 300, 48),
    (400, 1000, 31),
]


@pytest.fixture(scope="module")
def gemm():
    return native_gemm()


@pytest.fixture(params=[1, 2], ids=lambda t: f"{t}thr")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _data(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    return x, w, torch.randn(n, generator=g)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A float32 dot product's forward error bound: k units of rounding of sum |x w|."""
    return 2 * x.shape[-1] * 2.0**-24 * (x.abs().double() @ w.abs().double().T) + 1e-30


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_linear_matches_float64(gemm, threads, shape, with_bias) -> None:
    m, k, n = shape
    x, w, b = _data(m, k, n, seed=m + k + n)
    bias = b if with_bias else None
    got = gemm.linear(x, gemm.pack(w), bias)
    expected = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert ((got.double() - expected).abs() <= _bound(x, w) + 1e-6 * with_bias).all()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gated_is_silu_of_gate_times_up(gemm, threads, shape) -> None:
    """Gate and up run through the same sums as two plain products (bitwise equal sums),
    so the gated form must equal silu(gate) * up of those within the epilogue's rounding
    (a polynomial exp: about 1e-7 relative)."""
    m, k, n = shape
    x, gate, _ = _data(m, k, n, seed=7 * m + k)
    up = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    got = gemm.gated(x, gemm.pack_gated(gate, up))
    g = gemm.linear(x, gemm.pack(gate)).double()
    u = gemm.linear(x, gemm.pack(up)).double()
    torch.testing.assert_close(got.double(), F.silu(g) * u, rtol=2e-6, atol=1e-6)
    # Against float64 throughout: each product's error, through silu (slope <= 1.1).
    x64 = x.double()
    expected = F.silu(x64 @ gate.double().T) * (x64 @ up.double().T)
    tol = 1.1 * _bound(x, gate) * u.abs() + F.silu(g).abs() * _bound(x, up)
    assert ((got.double() - expected).abs() <= tol + 1e-5 * expected.abs() + 1e-6).all()


def test_a_row_does_not_depend_on_its_batch_or_the_threads(gemm) -> None:
    """Each output sums its inputs in the same order wherever its row sits in the call
    (first or last tile, a tile of 6 rows or of 1, thread 0 or 1): bitwise equal."""
    m, k, n = 197, 700, 77
    x, w, b = _data(m, k, n, seed=3)
    packed, gated = gemm.pack(w), gemm.pack_gated(w, w.flip(0).contiguous())
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch, batch_gated = gemm.linear(x, packed, b), gemm.gated(x, gated)
        torch.set_num_threads(1)
        for row in (0, 5, 6, 191, 192, 196):
            alone = gemm.linear(x[row : row + 1], packed, b)
            assert torch.equal(alone[0], batch[row]), row
            assert torch.equal(gemm.gated(x[row : row + 1], gated)[0], batch_gated[row]), row
    finally:
        torch.set_num_threads(before)


def test_leading_dims_views_and_empty_inputs(gemm) -> None:
    x, w, _ = _data(24, 96, 40, seed=5)
    packed = gemm.pack(w)
    batched = gemm.linear(x.view(2, 3, 4, 96), packed)
    assert batched.shape == (2, 3, 4, 40)
    assert torch.equal(batched.view(24, 40), gemm.linear(x, packed))
    strided = torch.randn(96, 24).t()  # a non-contiguous view: copied, not misread
    torch.testing.assert_close(gemm.linear(strided, packed), strided @ w.T)
    bias = torch.randn(40, 2)[:, 0]  # a strided bias: its contiguous copy outlives the call
    torch.testing.assert_close(gemm.linear(x, packed, bias), x @ w.T + bias)
    assert gemm.linear(torch.empty(0, 96), packed).shape == (0, 40)
    assert gemm.gated(torch.empty(3, 0, 96), gemm.pack_gated(w, w)).shape == (3, 0, 40)
    no_inputs, bias = gemm.pack(torch.empty(40, 0)), torch.randn(40)
    assert torch.equal(gemm.linear(torch.empty(3, 0), no_inputs, bias), bias.expand(3, 40))
    no_gate_inputs = gemm.pack_gated(torch.empty(40, 0), torch.empty(40, 0))
    assert torch.equal(gemm.gated(torch.empty(2, 0), no_gate_inputs), torch.zeros(2, 40))
    assert gemm.linear(x, gemm.pack(torch.empty(0, 96))).shape == (24, 0)


def test_silu_of_extreme_gates(gemm) -> None:
    """Far below -87 silu(g) is 0 in float32 (torch too); the polynomial exp's clamp must
    not leave g / e^88 there. NaN stays NaN."""
    gates = torch.tensor([-3e38, -1e30, -1e4, -90.0, -87.0, -20.0, 0.0, 20.0, 1e4, 3e38])
    k = 1
    x = torch.ones(1, k)
    gate = gates.view(-1, 1)
    up = torch.ones(len(gates), k)
    got = gemm.gated(x, gemm.pack_gated(gate, up))[0]
    torch.testing.assert_close(got, F.silu(gates), rtol=2e-6, atol=1e-30)
    nan = gemm.gated(x, gemm.pack_gated(torch.tensor([[float("nan")]]), torch.ones(1, 1)))
    assert nan.isnan().all()


def test_bad_inputs_are_refused_by_name(gemm) -> None:
    w = torch.randn(32, 64)
    packed = gemm.pack(w)
    with pytest.raises(ValueError, match="float32 CPU inputs"):
        gemm.linear(torch.randn(2, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="inputs of 65 features for a weight of 64"):
        gemm.linear(torch.randn(2, 65), packed)
    with pytest.raises(ValueError, match=r"gate \(32, 64\) and up \(16, 64\) differ"):
        gemm.pack_gated(w, w[:16])
    with pytest.raises(ValueError, match="weight must be a float32 CPU matrix"):
        gemm.pack(w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias must be 32 float32 values"):
        gemm.linear(torch.randn(2, 64), packed, torch.randn(3))
    with pytest.raises(ValueError, match="bias must be 32 float32 values"):
        gemm.linear(torch.randn(2, 64), packed, torch.randn(32, dtype=torch.float64))
    with pytest.raises(ValueError, match="a weight from pack goes to linear"):
        gemm.gated(torch.randn(2, 64), packed)
    with pytest.raises(ValueError, match="a weight from pack_gated goes to gated"):
        gemm.linear(torch.randn(2, 64), gemm.pack_gated(w, w))


@pytest.mark.parametrize("counts", [[3, 0, 7, 1], [0, 0, 0, 200], [1], [13, 6, 0, 0, 5]], ids=str)
def test_grouped_products_equal_each_experts_own_call(gemm, threads, counts) -> None:
    """A mixture of experts' grouped call (``tandem_gemm_grouped_*``): each expert's rows
    come out bitwise as that expert's own ``linear`` / ``gated`` call gives them, experts
    without rows included, rows in place."""
    k, n = 257, 33
    g = torch.Generator().manual_seed(sum(counts))
    weights = [torch.randn(n, k, generator=g) for _ in counts]
    ups = [torch.randn(n, k, generator=g) for _ in counts]
    x = torch.randn(sum(counts), k, generator=g)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    plain = gemm.grouped(x, offsets, gemm.stack([gemm.pack(w) for w in weights]))
    gated_stack = gemm.stack([gemm.pack_gated(w, u) for w, u in zip(weights, ups, strict=True)])
    gated = gemm.grouped(x, offsets, gated_stack)
    for e, (w, u) in enumerate(zip(weights, ups, strict=True)):
        rows = x[offsets[e] : offsets[e + 1]]
        if len(rows):
            assert torch.equal(plain[offsets[e] : offsets[e + 1]], gemm.linear(rows, gemm.pack(w)))
            alone = gemm.gated(rows, gemm.pack_gated(w, u))
            assert torch.equal(gated[offsets[e] : offsets[e + 1]], alone)


def test_stacks_of_mixed_weights_are_refused(gemm) -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="share their shape and packing"):
        gemm.stack([gemm.pack(w), gemm.pack_gated(w, w)])
    with pytest.raises(ValueError, match="share their shape and packing"):
        gemm.stack([gemm.pack(w), gemm.pack(torch.randn(9, 16))])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bfloat16_panels_give_the_float32_panels_results_bitwise(gemm, threads, shape) -> None:
    """Weights whose values are bfloat16 (a bfloat16 checkpoint run in float32), packed
    narrow, take half the bytes and give every bit of the float32 packing's results."""
    m, k, n = shape
    x, w, b = _data(m, k, n, seed=11)
    w = w.bfloat16().float()
    u = torch.randn(n, k, generator=torch.Generator().manual_seed(12)).bfloat16().float()
    wide, narrow = gemm.pack(w), gemm.pack(w, narrow=True)
    assert narrow.narrow and narrow.data.dtype == torch.int16
    assert narrow.data.nbytes * 2 == wide.data.nbytes
    assert torch.equal(gemm.linear(x, narrow, b), gemm.linear(x, wide, b))
    gated_wide, gated_narrow = gemm.pack_gated(w, u), gemm.pack_gated(w, u, narrow=True)
    assert gated_narrow.narrow
    assert torch.equal(gemm.gated(x, gated_narrow), gemm.gated(x, gated_wide))


def test_weights_that_are_not_bfloat16_stay_float32(gemm) -> None:
    _, w, _ = _data(4, 64, 24, seed=13)
    w[3, 5] = w[3, 5].bfloat16().float()  # one bfloat16 value does not make the rest
    assert not gemm.pack(w, narrow=True).narrow
    b16 = w.bfloat16().float()
    assert not gemm.pack_gated(b16, w, narrow=True).narrow  # both must be
    with pytest.raises(ValueError, match="packed in float32"):
        gemm.stack([gemm.pack(b16, narrow=True)])
