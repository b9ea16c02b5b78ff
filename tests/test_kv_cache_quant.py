"""A quantized KV cache (``--kv-cache-dtype int8|fp8``): the round trip stays within each
format's error bound, the native kernel reads it as the torch reference does, the pool
holds ~4x the blocks, the wire carries its bytes and names its dtype, and greedy output
through prefix-cache hits, preemption, speculative rollback and a disaggregated transfer
(and tensor parallelism) equals the same quantized engine without them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.attention import cpu_paged
from tandem.engine.attention.base import AttentionBackendKind, make_backend, native_cpu_available
from tandem.engine.attention.kv_quant import KVCacheDtype, QuantizedKV
from tandem.engine.attention.native import paged_decode_library
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.model_runner import KVCacheLayout
from tandem.engine.request import PrefillMode
from tandem.kvtransfer.blocks import pack_blocks, unpack_blocks
from tandem.kvtransfer.errors import IncompatibleKV
from tandem.kvtransfer.layout import KVLayout, check_compatible
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.testing import RandomKVServer, RandomKVSpec, random_kv_caches
from tests.hf_reference import random_prompts
from tests.test_attention_backends import BLOCK, _batch

QUANTIZED = [KVCacheDtype.INT8, KVCacheDtype.FP8]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.value)
def test_round_trip_error_is_within_the_format_bound(kind: KVCacheDtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4, 32) * torch.logspace(-3, 2, 64).view(64, 1, 1)
    x[3, 1] = 0  # an all-zero token-head decodes to zeros
    codec = QuantizedKV(kind)
    rows = codec.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 4, 36)
    scale = rows[..., 32:].contiguous().view(torch.float32)
    err = (codec.dequantize(rows) - x).abs()
    if kind is KVCacheDtype.INT8:
        assert (err <= scale / 2 * (1 + 1e-5)).all()
    else:  # e4m3: 3 mantissa bits; below 2**-6 the subnormal step is 2**-9
        bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
        assert (err <= bound * (1 + 1e-5)).all()
    assert (codec.dequantize(rows)[3, 1] == 0).all()


def _quantized_batch(q_lens, seq_lens, heads, kv_heads, dim, kind, seed):
    q, k, v, cache, meta = _batch(q_lens, seq_lens, heads, kv_heads, dim, seed)
    return q, k, v, QuantizedKV(kind).quantize(cache), meta


def _run(kind, kv_dtype, q, k, v, cache, meta, window):
    backend = make_backend(kind, q.shape[-1] ** -0.5, BLOCK, kv_dtype)
    backend.plan(meta)
    written = cache.clone()
    return backend.forward(q, k, v, written, meta, window), written


KINDS = [AttentionBackendKind.SDPA]
if native_cpu_available(torch.device("cpu"), torch.float32):
    KINDS.append(AttentionBackendKind.CPU)


@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=lambda k: k.value)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(4, 2, 16), (6, 1, 32), (8, 2, 64), (4, 2, 128), (5, 1, 80)]
)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kernel_seq_len", [cpu_paged.KERNEL_SEQ_LEN, 16])
def test_backend_matches_reference_over_a_quantized_cache(
    kv_dtype, kind, heads: int, kv_heads: int, dim: int, window, kernel_seq_len, monkeypatch
) -> None:
    # Decodes (odd contexts), chunks the kernel always takes (3, 16 tokens; one after a
    # cached prefix) and ones (17, 20) it takes only while their sequences are short, here
    # the 30- and 20-position ones, else SDPA; blocks scattered through the pool.
    monkeypatch.setattr(cpu_paged, "KERNEL_SEQ_LEN", kernel_seq_len)
    q_lens = [1, 1, 1, 3, 16, 17, 20]
    seq_lens = [1, 7, 23, 12, 16, 30, 20]
    batch = _quantized_batch(q_lens, seq_lens, heads, kv_heads, dim, kv_dtype, heads + dim)
    expected, ref_cache = _run(AttentionBackendKind.TORCH, kv_dtype, *batch, window)
    got, cache = _run(kind, kv_dtype, *batch, window)
    assert torch.equal(cache, ref_cache)  # both wrote the same codes and scales
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


needs_native = pytest.mark.skipif(paged_decode_library() is None, reason="no C compiler")


@needs_native
def test_native_fp8_decoding_is_torchs_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float()
    for start in (0, 3):  # vector lanes, then a scalar tail
        got = torch.empty(256 - start)
        paged_decode_library().tandem_fp8_decode(
            codes[start:].data_ptr(), 256 - start, got.data_ptr()
        )
        torch.testing.assert_close(got, expected[start:], rtol=0, atol=0, equal_nan=True)


@needs_native
@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.value)
def test_native_quantizing_write_stores_the_torch_bytes(kind: KVCacheDtype) -> None:
    from tandem.engine.attention.cpu_paged import NativeQuantizedKV

    torch.manual_seed(1)
    tokens, kv_heads, dim = 40, 2, 24
    k = torch.randn(tokens, kv_heads, dim) * torch.logspace(-40, 30, tokens).view(-1, 1, 1)
    k[:8] = torch.randint(-254, 255, (8, kv_heads, dim)) / 2  # ties at half steps
    k[8, 0], k[9, 1, 3] = 0.0, -0.0
    qkv = torch.randn(tokens, 3, kv_heads, dim)  # v as a strided view, as the model passes it
    slots = torch.randperm(64)[:tokens]
    expected = torch.zeros(2, 4, 16, kv_heads, dim + 4, dtype=torch.uint8)
    got = expected.clone()
    QuantizedKV(kind).write(expected, k, qkv[:, 2], slots)
    NativeQuantizedKV(kind, paged_decode_library()).write(got, k, qkv[:, 2], slots)
    assert torch.equal(got, expected)


def test_pool_holds_about_four_times_the_blocks() -> None:
    def layout(kind: KVCacheDtype) -> KVCacheLayout:
        return KVCacheLayout(16, 12, 12, 64, torch.float32, kind)

    f32, i8, f8 = (layout(k).bytes_per_block for k in KVCacheDtype)
    assert i8 == f8 == f32 * (64 + 4) // (4 * 64)  # 1-byte codes + a 4-byte scale per row
    assert f32 / i8 > 3.7


@pytest.mark.parametrize("max_num_seqs", [128, 1])
def test_engine_sizes_the_pool_from_the_real_block_bytes(make_checkpoint, max_num_seqs) -> None:
    """A given ``kv_cache_memory_gb`` holds ~4x the quantized blocks, also beyond what
    ``max_num_seqs`` full-length sequences need."""
    model = str(make_checkpoint("llama"))
    engines = {
        kind: LLMEngine(
            EngineConfig(
                model,
                dtype="float32",
                kv_cache_memory_gb=0.01,
                kv_cache_dtype=kind,
                max_num_seqs=max_num_seqs,
            ),
            detokenize=False,
        )
        for kind in ("auto", "int8", "fp8")
    }
    blocks = {kind: engine.num_kv_blocks for kind, engine in engines.items()}
    for kind, engine in engines.items():
        assert blocks[kind] == int(0.01 * 2**30) // engine.runner.layout.bytes_per_block
    runtime = engines["auto"].runtime
    if max_num_seqs == 1:  # past where a default budget is capped
        assert blocks["int8"] > -(-runtime.max_model_len // runtime.block_size)
    dim = engines["auto"].runner.layout.head_dim
    assert blocks["int8"] == blocks["fp8"]
    assert blocks["int8"] / blocks["auto"] == pytest.approx(4 * dim / (dim + 4), rel=0.01)
    cache = engines["int8"].runner.kv_caches[0]
    assert cache.dtype == torch.uint8 and cache.shape[1:] == (blocks["int8"], 16, 2, dim + 4)


def test_default_pool_is_capped_at_max_num_seqs_full_sequences(make_checkpoint) -> None:
    config = EngineConfig(str(make_checkpoint("llama")), dtype="float32", max_num_seqs=2)
    engine = LLMEngine(config, detokenize=False)
    per_seq = -(-engine.runtime.max_model_len // engine.runtime.block_size)
    assert engine.num_kv_blocks == 2 * per_seq


def test_config_refuses_bad_values_by_name() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig("m", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match=r"got 'fp8_e5m2' \(fp8 stores e4m3 codes"):
        EngineConfig("m", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs attention_backend"):
        EngineConfig("m", kv_cache_dtype="int8", attention_backend="flash")


def test_handshake_names_a_kv_dtype_mismatch() -> None:
    local = KVLayout("m", 2, 16, 2, 8, torch.float32, kv_cache_dtype=KVCacheDtype.INT8)
    remote = KVLayout("m", 2, 16, 2, 8, torch.float32)
    check_compatible(local, local.to_compat())
    with pytest.raises(IncompatibleKV, match="kv cache dtype: local 'int8', remote 'auto'"):
        check_compatible(local, remote.to_compat())


@pytest.mark.timeout(90)
def test_quantized_blocks_cross_the_wire_as_stored() -> None:
    layout = KVLayout("m", 2, 4, 2, 32, torch.float32, kv_cache_dtype=KVCacheDtype.INT8)
    spec = RandomKVSpec(layout, 8, ((5, 1, 6),), seed=3)
    sent = random_kv_caches(layout, 8, spec.seed)
    received = [torch.zeros(layout.cache_shape(4), dtype=torch.uint8) for _ in range(2)]

    async def pull(endpoint: str, lease: str) -> int:
        receiver = KVReceiver(layout, "decode-q", "cpu")
        packed = await receiver.pull(endpoint, lease, [0, 2], timeout=20)
        unpack_blocks(received, [3, 0], packed)
        await receiver.close()
        return receiver.stats.bytes

    with RandomKVServer(spec) as server:
        wire_bytes = asyncio.run(pull(server.endpoint, server.lease_ids[0]))
    fp32 = dataclasses.replace(layout, kv_cache_dtype=KVCacheDtype.AUTO).bytes_per_block
    assert wire_bytes == 2 * layout.bytes_per_block == 2 * fp32 * 36 // 128
    for got, want in zip(received, sent, strict=True):
        assert torch.equal(got[:, 3], want[:, 5]) and torch.equal(got[:, 0], want[:, 6])


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    plain = random_prompts(6, 4096, (10, 90), seed=5)
    return plain + [p[:12] * 4 for p in plain[:2]]  # some that repeat (n-gram drafts)


@pytest.fixture(scope="module", params=["int8", "fp8"])
def kv_dtype(request: pytest.FixtureRequest) -> str:
    return request.param


def _llm(model_dir: Path, kv_dtype: str, **config: object) -> LLM:
    return LLM(model_dir, dtype="float32", kv_cache_dtype=kv_dtype, **config)


@pytest.fixture(scope="module")
def reference(model_dir: Path, kv_dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """The quantized engine's tokens with no prefix cache, preemption or speculation."""
    llm = _llm(model_dir, kv_dtype, num_kv_blocks=256, enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_prefix_cache_hits_give_the_same_tokens(model_dir, kv_dtype, prompts, reference):
    llm = _llm(model_dir, kv_dtype, num_kv_blocks=256)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    again = llm.generate(prompts, GREEDY)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.token_ids for o in again] == reference


def test_preemption_gives_the_same_tokens(model_dir, kv_dtype, prompts, reference) -> None:
    llm = _llm(model_dir, kv_dtype, block_size=8, num_kv_blocks=14, max_model_len=112)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference


def test_ngram_speculation_gives_the_same_tokens(model_dir, kv_dtype, prompts, reference):
    llm = _llm(model_dir, kv_dtype, num_kv_blocks=256, speculative_method="ngram")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    stats = llm.engine.speculator.stats
    assert stats.num_verifications > 0 and stats.acceptance_rate < 1  # some rolled back


def test_disaggregated_transfer_gives_the_same_tokens(model_dir, kv_dtype, prompts, reference):
    def engine() -> LLMEngine:
        config = EngineConfig(
            str(model_dir),
            dtype="float32",
            num_kv_blocks=64,
            max_model_len=256,
            kv_cache_dtype=kv_dtype,
        )
        return LLMEngine(config, detokenize=False)

    prompt, expected = prompts[4], reference[4]
    p, d = engine(), engine()
    p.add_request(prompt, GREEDY, request_id="x", prefill_mode=PrefillMode.HAND_OFF)
    (first,) = [t for _ in range(20) for delta in p.step() for t in delta.new_token_ids]
    src_blocks = p.prefilled_block_ids("x")
    d.add_request(
        prompt, GREEDY, request_id="x", output_token_ids=[first], prefill_mode=PrefillMode.REMOTE
    )
    d.step()
    (pull,) = d.take_kv_pulls()
    packed = pack_blocks(p.runner.kv_caches, src_blocks[pull.first_block :])
    layout = p.runner.layout
    fp32 = dataclasses.replace(layout, kv_cache_dtype=KVCacheDtype.AUTO).bytes_per_block
    assert packed.nbytes == len(pull.block_ids) * layout.bytes_per_block
    dim = layout.head_dim
    assert packed.nbytes / (len(pull.block_ids) * fp32) == (dim + 4) / (4 * dim)
    assert d.finish_kv_pull("x", lambda ids: unpack_blocks(d.runner.kv_caches, ids, packed))
    tokens = [first]
    while d.has_unfinished_requests():
        tokens += [t for delta in d.step() for t in delta.new_token_ids]
    assert tokens == expected


def test_tensor_parallel_ranks_quantize_their_own_heads(model_dir, kv_dtype, prompts, reference):
    with _llm(model_dir, kv_dtype, num_kv_blocks=256, tensor_parallel_size=2, num_threads=1) as llm:
        assert llm.engine.runner.kv_caches[0].dtype == torch.uint8
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_vllm_spelling_fp8_e4m3_is_the_fp8_cache(make_checkpoint) -> None:
    """``fp8_e4m3`` (vLLM's name) builds the fp8 cache: the same layout, so a worker
    started with either spelling passes the other's transfer handshake, and the same
    tokens."""
    model = str(make_checkpoint("llama"))
    layouts, tokens = {}, {}
    for kind in ("fp8", "fp8_e4m3"):
        with LLM(model, dtype="float32", num_kv_blocks=256, kv_cache_dtype=kind) as llm:
            runner = llm.engine.runner
            layouts[kind] = runner.layout
            out = llm.generate(
                [[5, 9, 13, 2, 7]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            )
            tokens[kind] = out[0].token_ids
        assert runner.kv_caches[0].dtype == torch.uint8
    assert layouts["fp8_e4m3"] == layouts["fp8"]
    assert layouts["fp8"].kv_cache_dtype is KVCacheDtype.FP8
    assert tokens["fp8_e4m3"] == tokens["fp8"]
