"""Multi-head latent attention (DeepSeek-V2/V3): the latent paged cache and what runs on
it. Greedy equality with transformers on every engine path is in test_engine_vs_hf.py
and test_tensor_parallel.py (both families), the disaggregated cluster, speculation and
int8 weights in test_model_families.py; here:

- the cache holds one row of ``kv_lora_rank + qk_rope_head_dim`` values per token and
  layer (one plane, one "head"), the bytes per token the pool is sized by;
- absorbed attention over that cache equals multi-head attention over the keys and
  values expanded from the latent (both backends, decodes and prefills after a cached
  prefix in one step, float and quantized caches);
- a quantized (int8 / fp8) latent cache keeps a request's tokens independent of its
  batch, of prefix caching, chunking and preemption, and mostly agrees with float;
- latent blocks pack and unpack like K/V blocks, and a latent layout never handshakes
  with an expanded one;
- the config errors of the family name their field; V3's multi-token-prediction layer
  tensors are skipped at load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.common.model_config import ModelConfig
from tandem.engine import LLM, SamplingParams
from tandem.engine.attention.base import AttentionBackendKind, make_backend
from tandem.engine.attention.kv_quant import KVCacheDtype
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.kvtransfer.blocks import pack_blocks, unpack_blocks
from tandem.kvtransfer.errors import IncompatibleKV
from tandem.kvtransfer.layout import KVLayout, check_compatible
from tests.hf_reference import hf_greedy, random_prompts

NUM_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, vocab=4096, lengths=(1, 100))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


# -- the cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_the_cache_holds_one_latent_row_per_token_and_layer(arch, make_checkpoint) -> None:
    config = ModelConfig.from_dir(make_checkpoint(arch))
    mla = config.mla
    assert mla is not None and config.num_kv_heads == 1
    width = mla.kv_lora_rank + mla.qk_rope_head_dim  # 40 + 8
    assert config.head_dim == width == 48
    llm = LLM(make_checkpoint(arch), dtype="float32", num_kv_blocks=32, max_model_len=512)
    runner = llm.engine.runner
    assert [tuple(c.shape) for c in runner.kv_caches] == [(1, 32, 16, 1, width)] * 4
    assert runner.layout.bytes_per_token == config.num_layers * width * 4
    # The expanded layout (per-head K of qk_head_dim and V of v_head_dim) of the same
    # model: 4 heads * (24 + 12) = 144 values per token and layer, 3x the latent row.
    expanded = config.num_heads * (mla.qk_head_dim + mla.v_head_dim)
    assert expanded / width == 3.0


def _expanded_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale, context) -> torch.Tensor:
    """Multi-head attention over keys/values rebuilt from the latent (HF's form):
    ``q_* [Q, H, *]``, ``latent [K, r]``, ``k_rope [K, rope]``, ``w_uk [H, nope, r]``,
    ``w_uv [H, v, r]``; query ``i`` sits at position ``context + i``."""
    keys_nope = torch.einsum("kr,hnr->khn", latent, w_uk)
    values = torch.einsum("kr,hvr->khv", latent, w_uv)
    num_keys, heads = latent.shape[0], w_uk.shape[0]
    keys = torch.cat([keys_nope, k_rope.unsqueeze(1).expand(num_keys, heads, -1)], dim=-1)
    query = torch.cat([q_nope, q_rope], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys.double()) * scale
    positions = torch.arange(context, context + q_nope.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(num_keys).unsqueeze(0) > positions, -math.inf)
    return torch.einsum("hqk,khv->qhv", scores.softmax(-1), values.double())


@pytest.mark.parametrize("kind", [AttentionBackendKind.SDPA, AttentionBackendKind.TORCH])
@pytest.mark.parametrize("kv_dtype", [KVCacheDtype.AUTO, KVCacheDtype.INT8])
def test_absorbed_attention_equals_attention_on_expanded_keys(kind, kv_dtype) -> None:
    """One step of two decodes and two prefill chunks (one after a cached prefix) over a
    latent cache equals HF-style attention on keys and values expanded per head."""
    torch.manual_seed(0)
    heads, nope, rope, v, rank, block = 3, 10, 6, 7, 20, 4
    width, scale = rank + rope, (nope + rope) ** -0.5
    w_uk, w_uv = torch.randn(heads, nope, rank) * 0.3, torch.randn(heads, v, rank)
    seq_lens, new = [9, 5, 11, 6], [1, 1, 4, 6]  # decodes, then prefills
    num_blocks = sum(-(-n // block) for n in seq_lens) + 1
    cache = torch.zeros(1, num_blocks, block, 1, width + (4 if kv_dtype.quantized else 0))
    if kv_dtype.quantized:
        cache = cache.to(torch.uint8)
    backend = make_backend(kind, scale, block, kv_dtype, latent_value_dim=rank)
    tables, slots, rows, queries, expected = [], [], [], [], []
    next_block = 1
    for seq_len, n in zip(seq_lens, new, strict=True):
        blocks = list(range(next_block, next_block + -(-seq_len // block)))
        next_block += len(blocks)
        tables.append(blocks)
        latent, k_rope = torch.randn(seq_len, rank), torch.randn(seq_len, rope)
        q_nope, q_rope = torch.randn(n, heads, nope), torch.randn(n, heads, rope)
        row = torch.cat([latent, k_rope], dim=-1)
        # The cached prefix is written as the cache would hold it (quantized or not).
        prefix = seq_len - n
        slot_of = [blocks[p // block] * block + p % block for p in range(seq_len)]
        if prefix:
            backend.kv.write_plane(
                cache[0], row[:prefix].unsqueeze(1), torch.tensor(slot_of[:prefix])
            )
        slots += slot_of[prefix:]
        rows.append(row[prefix:])
        absorbed = torch.einsum("qhn,hnr->qhr", q_nope, w_uk)
        queries.append(torch.cat([absorbed, q_rope], dim=-1))
        read = backend.kv.roundtrip(row.unsqueeze(1))[:, 0]  # what the cache gives back
        expected.append(
            _expanded_attention(
                q_nope, q_rope, read[:, :rank], read[:, rank:], w_uk, w_uv, scale, prefix
            )
        )
    width_blocks = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_table=torch.tensor([t + [0] * (width_blocks - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=tuple([0, *torch.tensor(new).cumsum(0).tolist()]),
        seq_lens_list=tuple(seq_lens),
        num_decodes=2,
        block_size=block,
    )
    backend.plan(meta)
    out = backend.forward(torch.cat(queries), torch.cat(rows).unsqueeze(1), None, cache, meta, None)
    got = torch.einsum("thr,hvr->thv", out.double(), w_uv.double())
    assert torch.allclose(got, torch.cat(expected), atol=1e-4, rtol=1e-4)


def test_latent_cache_is_read_by_sdpa_or_torch_only(make_checkpoint) -> None:
    with pytest.raises(ValueError, match=r"'cpu' cannot read a latent \(MLA\) KV cache"):
        LLM(make_checkpoint("deepseek_v2"), dtype="float32", attention_backend="cpu")


@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype"), [("deepseek_v3", "int8"), ("deepseek_v2", "fp8")]
)
def test_a_quantized_latent_cache_gives_the_same_tokens_on_every_path(
    arch, kv_cache_dtype, make_checkpoint, prompts
) -> None:
    """A request's tokens depend neither on its batch, nor on its prefix coming from
    the cache, nor on tiny prefill chunks, nor on preemption; and the first step mostly
    agrees with float32 (a random MoE's routing flips on small changes; broken rows
    would agree by chance, 1 in 4096). Measured first-step agreement over these 6
    prompts: V3 int8 4, fp8 0 (its sigmoid routing with a choice bias flips on fp8's
    2.5 % row error: the rows themselves round-trip within the format's bound), V2 int8
    6, fp8 4; a Llama of the same size int8 5, fp8 4."""
    model_dir = make_checkpoint(arch)
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    quantized = {"dtype": "float32", "kv_cache_dtype": kv_cache_dtype}
    llm = LLM(model_dir, num_kv_blocks=256, **quantized)
    assert llm.engine.runner.kv_caches[0].dtype == torch.uint8
    assert llm.engine.runner.kv_caches[0].shape[-1] == 48 + 4  # codes + one scale per row
    batched = _greedy(llm, prompts)
    assert batched == [_greedy(llm, [p])[0] for p in prompts]
    again = llm.generate(prompts, GREEDY)  # leading blocks from the prefix cache
    assert [o.token_ids for o in again] == batched
    assert sum(o.num_cached_tokens for o in again) > 0
    chunked = LLM(model_dir, num_kv_blocks=256, max_num_batched_tokens=7, **quantized)
    assert _greedy(chunked, prompts) == batched
    small = LLM(model_dir, block_size=8, num_kv_blocks=18, max_model_len=144, **quantized)
    assert _greedy(small, prompts) == batched
    assert small.engine.scheduler.num_preemptions > 0
    first_equal = sum(b[0] == e[0] for b, e in zip(batched, expected, strict=True))
    assert first_equal >= len(prompts) // 2, (batched, expected)


# -- moving latent blocks --------------------------------------------------------------


def _layout(planes: int, heads: int = 1, dim: int = 48) -> KVLayout:
    return KVLayout(
        model="m",
        num_layers=2,
        block_size=4,
        num_kv_heads=heads,
        head_dim=dim,
        dtype=torch.float32,
        planes=planes,
    )


def test_latent_blocks_pack_and_unpack_and_never_meet_expanded_ones() -> None:
    latent = _layout(1)
    assert latent.cache_shape(5) == (1, 5, 4, 1, 48)
    assert latent.bytes_per_block == 2 * 4 * 48 * 4  # layers * slots * width * fp32
    caches = [torch.randn(latent.cache_shape(6)) for _ in range(2)]
    packed = pack_blocks(caches, [4, 1])
    assert tuple(packed.shape) == latent.packed_shape(2)
    assert packed.numel() * 4 == 2 * latent.bytes_per_block
    target = [torch.zeros(latent.cache_shape(6)) for _ in range(2)]
    unpack_blocks(target, [0, 5], packed)
    assert all(
        torch.equal(t[:, 0], c[:, 4]) and torch.equal(t[:, 5], c[:, 1])
        for t, c in zip(target, caches, strict=True)
    )
    # Same sizes but K/V planes (a model run without MLA): refused at the handshake.
    with pytest.raises(IncompatibleKV, match="KV layout"):
        check_compatible(latent, _layout(2).to_compat())
    with pytest.raises(ValueError, match="planes must be 1"):
        _layout(3)


# -- configs and checkpoints -------------------------------------------------------------


def _config(make_checkpoint: Callable[..., Path], arch: str) -> dict:
    return json.loads((make_checkpoint(arch) / "config.json").read_text())


@pytest.mark.parametrize(
    ("arch", "change", "message"),
    [
        ("deepseek_v3", {"n_group": 3}, r"'n_group' \(3\) must divide n_routed_experts \(8\)"),
        ("deepseek_v3", {"topk_group": 5}, r"'topk_group' \(5\) must be between 1 and n_group"),
        ("deepseek_v2", {"topk_method": "sinkhorn"}, r"'topk_method' = 'sinkhorn'"),
        ("deepseek_v2", {"qk_rope_head_dim": 7}, r"'qk_rope_head_dim' \(7\) must be even"),
        ("deepseek_v2", {"kv_lora_rank": 0}, r"'kv_lora_rank' must be a positive integer"),
        (
            "deepseek_v2",
            {"num_experts_per_tok": 3},
            r"'num_experts_per_tok' \(3\) exceeds the experts",
        ),
        ("deepseek_v3", {"n_routed_experts": 1}, r"'num_experts_per_tok' \(2\) exceeds"),
    ],
)
def test_bad_deepseek_configs_are_refused_by_field(make_checkpoint, arch, change, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_config(make_checkpoint, arch) | change)


def test_the_configs_read_each_routing(make_checkpoint) -> None:
    v2 = ModelConfig.from_dir(make_checkpoint("deepseek_v2"))
    v3 = ModelConfig.from_dir(make_checkpoint("deepseek_v3"))
    assert (v2.moe.scoring, v2.moe.group_choice, v2.moe.correction_bias) == (
        "softmax",
        "max",
        False,
    )
    assert (v3.moe.scoring, v3.moe.group_choice, v3.moe.correction_bias) == (
        "sigmoid",
        "top2",
        True,
    )
    assert v2.moe.sparse_layers == v3.moe.sparse_layers == (False, True, True, True)
    assert (v2.moe.shared_intermediate_size, v3.moe.shared_intermediate_size) == (96, 48)
    assert (v2.mla.q_lora_rank, v3.mla.q_lora_rank) == (None, 48)
    # YaRN's mscale_all_dim (0.707, factor 4) folds into the softmax scale, squared.
    mscale = 0.1 * 0.707 * math.log(4.0) + 1
    assert v3.attention_scale == pytest.approx(24**-0.5 * mscale**2)


def test_v3_multi_token_prediction_layers_are_skipped(make_checkpoint, prompts, tmp_path) -> None:
    """Released V3 checkpoints carry layer ``num_hidden_layers`` (the MTP module)."""
    source = make_checkpoint("deepseek_v3")
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    tensors = load_file(source / "model.safetensors")
    extra = {
        "model.layers.4.self_attn.kv_b_proj.weight": torch.zeros(112, 40),
        "model.layers.4.eh_proj.weight": torch.zeros(64, 128),
    }
    save_file(tensors | extra, tmp_path / "model.safetensors")
    expected = _greedy(LLM(source, dtype="float32", num_kv_blocks=256), prompts)
    assert _greedy(LLM(tmp_path, dtype="float32", num_kv_blocks=256), prompts) == expected


def test_the_router_stays_float32_in_a_bfloat16_model(make_checkpoint) -> None:
    """As transformers keeps DeepSeek's ``gate.weight`` and correction bias: a bf16
    rounding of the scores would move choices at near-ties."""
    llm = LLM(make_checkpoint("deepseek_v3"), dtype="bfloat16", num_kv_blocks=64, max_model_len=256)
    model = llm.engine.runner.model
    gates = [layer.mlp.gate for layer in model.model.layers[1:]]
    assert all(g.weight.dtype == g.e_score_correction_bias.dtype == torch.float32 for g in gates)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    source = load_file(make_checkpoint("deepseek_v3") / "model.safetensors")
    assert torch.equal(gates[0].weight, source["model.layers.1.mlp.gate.weight"])
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.token_ids) == 4
