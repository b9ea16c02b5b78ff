"""Every attention backend agrees with the plain-torch reference on the same paged cache:
decodes and prefill chunks (with and without a cached prefix), GQA/MQA/MHA, sliding
windows, blocks scattered through the pool."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.attention import cpu_paged
from tandem.engine.attention.base import AttentionBackendKind, make_backend, native_cpu_available
from tandem.engine.attention.metadata import AttentionMetadata

BLOCK = 4


def _batch(q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, dim: int, seed: int):
    """A flattened batch (decodes first) over randomly placed blocks of a shared pool."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    pool = list(range(sum(blocks_per_seq) + 5))
    rng.shuffle(pool)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.long)
    slots, start = [], 0
    for i, (q_len, seq_len, n) in enumerate(zip(q_lens, seq_lens, blocks_per_seq, strict=True)):
        table[i, :n] = torch.tensor(pool[start : start + n])
        start += n
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(table[i, pos // BLOCK]) * BLOCK + pos % BLOCK)
    cache = torch.randn(2, len(pool), BLOCK, kv_heads, dim)
    total = sum(q_lens)
    loc = [0]
    for n in q_lens:
        loc.append(loc[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_table=table,
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=tuple(loc),
        seq_lens_list=tuple(seq_lens),
        num_decodes=sum(1 for n in q_lens if n == 1),
        block_size=BLOCK,
    )
    q = torch.randn(total, heads, dim)
    k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    return q, k, v, cache, meta


def _run(kind: AttentionBackendKind, q, k, v, cache, meta, window):
    backend = make_backend(kind, q.shape[-1] ** -0.5, BLOCK)
    backend.plan(meta)
    return backend.forward(q, k, v, cache.clone(), meta, window)


KINDS = [AttentionBackendKind.SDPA]
if native_cpu_available(torch.device("cpu"), torch.float32):
    KINDS.append(AttentionBackendKind.CPU)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 1, 32), (4, 4, 64), (8, 2, 128)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kernel_seq_len", [cpu_paged.KERNEL_SEQ_LEN, 30])
def test_backend_matches_reference(
    kind, heads: int, kv_heads: int, dim: int, window, kernel_seq_len, monkeypatch
) -> None:
    # 3 decodes (contexts 1, 7, 23), then prefill chunks: fresh, after a prefix, a full one,
    # and two longer than the kernel always takes (17, 40 tokens): through the kernel as
    # rows while their sequences (17 and 45 positions) are short, else (over 30) SDPA.
    monkeypatch.setattr(cpu_paged, "KERNEL_SEQ_LEN", kernel_seq_len)
    q_lens = [1, 1, 1, 6, 5, 9, 17, 40]
    seq_lens = [1, 7, 23, 6, 12, 9, 17, 45]
    q, k, v, cache, meta = _batch(q_lens, seq_lens, heads, kv_heads, dim, seed=heads + dim)
    expected = _run(AttentionBackendKind.TORCH, q, k, v, cache, meta, window)
    got = _run(kind, q, k, v, cache, meta, window)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_backend_writes_new_keys_and_values_at_their_slots(kind) -> None:
    q, k, v, cache, meta = _batch([1, 3], [5, 3], 4, 2, 16, seed=1)
    backend = make_backend(kind, 0.25, BLOCK)
    backend.plan(meta)
    written = cache.clone()
    backend.forward(q, k, v, written, meta, None)
    flat_k = written[0].view(-1, 2, 16)
    flat_v = written[1].view(-1, 2, 16)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[meta.slot_mapping], v, rtol=0, atol=0)


@pytest.mark.skipif(AttentionBackendKind.CPU not in KINDS, reason="native kernel unavailable")
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 4, 64), (6, 1, 32), (5, 5, 20)])
@pytest.mark.parametrize("window", [None, 9])
def test_native_decode_rows_do_not_depend_on_how_threads_share_them(
    heads: int, kv_heads: int, dim: int, window
) -> None:
    # Enough decode rows that each thread takes a run of whole rows (and asks for its next
    # row while computing the current one), of very different lengths so the runs differ
    # in row count; with 1, 2 and 3 threads every row is the reference's, and the same bits.
    rng = random.Random(dim)
    seq_lens = [rng.choice([1, 2, 3, 17, 40, 95]) for _ in range(29)]
    q, k, v, cache, meta = _batch([1] * len(seq_lens), seq_lens, heads, kv_heads, dim, seed=dim)
    expected = _run(AttentionBackendKind.TORCH, q, k, v, cache, meta, window)
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got[n] = _run(AttentionBackendKind.CPU, q, k, v, cache, meta, window)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got[1], expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(got[2], got[1]) and torch.equal(got[3], got[1])


@pytest.mark.skipif(AttentionBackendKind.CPU not in KINDS, reason="native kernel unavailable")
def test_native_kernel_refuses_head_dims_beyond_its_vectors() -> None:
    """Its per-row vector arrays hold 64 vectors: beyond that head_dim the engine picks
    SDPA, an explicit ``cpu`` is refused by name, and the kernel itself writes nothing."""
    from tandem.engine.attention.base import native_cpu_max_head_dim, select_backend_kind
    from tandem.engine.native_build import select_isa

    limit = native_cpu_max_head_dim()
    assert limit == 64 * {"avx512": 16, "avx2": 8, "portable": 4}[select_isa().value]
    cpu, f32 = torch.device("cpu"), torch.float32
    assert select_backend_kind(None, cpu, f32, limit) is AttentionBackendKind.CPU
    assert select_backend_kind(None, cpu, f32, limit + 4) is AttentionBackendKind.SDPA
    with pytest.raises(ValueError, match=f"head_dim <= {limit} .*head_dim {limit + 4}"):
        select_backend_kind(AttentionBackendKind.CPU, cpu, f32, limit + 4)
    q, k, v, cache, meta = _batch([1, 3], [5, 9], 2, 1, limit + 4, 0)
    with pytest.raises(RuntimeError, match="head_dim beyond the kernel's"):
        _run(AttentionBackendKind.CPU, q, k, v, cache, meta, None)
