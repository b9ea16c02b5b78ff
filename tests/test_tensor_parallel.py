"""Tensor parallelism in the engine: TP=2 greedy output equals TP=1 and transformers for
every architecture (Llama with one KV head, so it is replicated; Qwen2 with q/k/v bias
and tied embeddings; Mistral with a sliding window shorter than the prompts), each
rank's shard holds exactly its slice of the checkpoint, and a dead rank breaks the
replica promptly instead of hanging it."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tandem.common.model_config import ModelConfig
from tandem.engine import LLM, SamplingParams
from tandem.engine.loader import load_model
from tandem.engine.parallel.group import RankLost, TensorParallelGroup
from tests.hf_reference import hf_greedy, random_prompts

NUM_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
VOCAB = 4097  # odd: the last rank's vocabulary rows are padded
CASES = {
    "llama-mqa": {"arch": "llama", "kv_heads": 1},
    "qwen2": {"arch": "qwen2"},
    "mistral": {"arch": "mistral"},
    "qwen3": {"arch": "qwen3"},
    "phi3": {"arch": "phi3"},
    "gemma2": {"arch": "gemma2"},
    "gemma3": {"arch": "gemma3"},
    "mixtral": {"arch": "mixtral"},
    "qwen3_moe": {"arch": "qwen3_moe"},
    "deepseek_v2": {"arch": "deepseek_v2"},
    "deepseek_v3": {"arch": "deepseek_v3"},
}
EXPERT_PARALLEL = {"mixtral-ep", "qwen3_moe-ep", "deepseek_v3-ep"}
"""Cases run with ``enable_expert_parallel``: each rank holds half of the experts."""
CASES |= {case: {"arch": case.removesuffix("-ep")} for case in EXPERT_PARALLEL}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, vocab=VOCAB, lengths=(1, 100))  # beyond the 64-token window


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_greedy_equals_tp1_and_transformers(
    case: str, make_checkpoint: Callable[..., Path], prompts: list[list[int]]
) -> None:
    kwargs = dict(CASES[case])
    model_dir = make_checkpoint(kwargs.pop("arch"), vocab_size=VOCAB, **kwargs)
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    single = LLM(model_dir, dtype="float32", num_kv_blocks=128).generate(prompts, GREEDY)
    with LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=128,
        tensor_parallel_size=2,
        num_threads=1,
        enable_expert_parallel=case in EXPERT_PARALLEL,
    ) as llm:
        assert llm.engine.runner.layout.num_kv_heads == max(
            1, ModelConfig.from_dir(model_dir).num_kv_heads // 2
        )
        outs = llm.generate(prompts, GREEDY)
        again = llm.generate(prompts, GREEDY)  # prefix-cache hits on every rank
        ranks = llm.engine.ranks
    assert [o.token_ids for o in single] == expected
    assert [o.token_ids for o in outs] == expected
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0
    assert not ranks.alive(), "close() left a rank running"


class _Unconnected(TensorParallelGroup):
    """Rank ``rank`` of 2, for loading only: no collective is ever called."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, 2, None, None, torch.device("cpu"))


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("case", ["llama-mqa", "qwen2"])
def test_each_rank_holds_exactly_its_slice(case: str, make_checkpoint) -> None:
    kwargs = dict(CASES[case])
    model_dir = make_checkpoint(kwargs.pop("arch"), vocab_size=VOCAB, **kwargs)
    config = ModelConfig.from_dir(model_dir)
    full = _checkpoint(model_dir)
    d, q_per_rank = config.head_dim, config.num_heads // 2
    inter = config.intermediate_size // 2
    rows_per_rank = -(-VOCAB // 2)
    for rank in (0, 1):
        model = load_model(
            model_dir, config, torch.float32, torch.device("cpu"), _Unconnected(rank)
        )
        attn = model.model.layers[1].self_attn
        prefix = "model.layers.1."
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        q_rows = slice(rank * q_per_rank * d, (rank + 1) * q_per_rank * d)
        kv_head = rank * config.num_kv_heads // 2  # MQA: both ranks hold the one KV head
        kv_rows = slice(kv_head * d, kv_head * d + attn.kv_size)
        assert torch.equal(q, full[prefix + "self_attn.q_proj.weight"][q_rows])
        assert torch.equal(k, full[prefix + "self_attn.k_proj.weight"][kv_rows])
        assert torch.equal(v, full[prefix + "self_attn.v_proj.weight"][kv_rows])
        if config.qkv_bias:
            q_bias = attn.qkv_proj.bias[: attn.q_size]
            assert torch.equal(q_bias, full[prefix + "self_attn.q_proj.bias"][q_rows])
        o = attn.o_proj.weight
        assert torch.equal(o, full[prefix + "self_attn.o_proj.weight"][:, q_rows])
        mlp = model.model.layers[1].mlp
        gate, up = mlp.gate_up_proj.weight.split(inter)
        cols = slice(rank * inter, (rank + 1) * inter)
        assert torch.equal(gate, full[prefix + "mlp.gate_proj.weight"][cols])
        assert torch.equal(up, full[prefix + "mlp.up_proj.weight"][cols])
        assert torch.equal(mlp.down_proj.weight, full[prefix + "mlp.down_proj.weight"][:, cols])
        embed = model.model.embed_tokens.weight
        real = min(rows_per_rank, VOCAB - rank * rows_per_rank)
        start = rank * rows_per_rank
        want = full["model.embed_tokens.weight"][start : start + real]
        assert torch.equal(embed[:real], want)
        assert not embed[real:].any(), "padding rows past the vocabulary must be zero"
        head = model.lm_head.weight
        if config.tie_word_embeddings:
            assert head is embed
        else:
            assert torch.equal(head[:real], full["lm_head.weight"][start : start + real])
        held = sum(p.numel() for p in model.parameters())
        assert held < 0.6 * sum(t.numel() for t in full.values())


@pytest.mark.parametrize("backend", ["onednn", "native"])
def test_tp2_with_packed_linears_keeps_the_all_reduce(
    backend: str, make_checkpoint: Callable[..., Path], prompts: list[list[int]]
) -> None:
    """oneDNN (from hidden size 256 up) and the native AVX2 GEMM (where AVX2 is the
    CPU's best) replace every ``nn.Linear`` by a packed copy; a row-parallel layer's must
    still sum over the ranks (it once did not, and TP=2 output was garbage for every
    model but the tiniest)."""
    from tandem.engine.layers.linear import LinearBackend, linear_backend_available

    if not linear_backend_available(LinearBackend(backend), torch.device("cpu"), torch.float32):
        pytest.skip(f"the {backend} linear backend is unavailable here")
    model_dir = make_checkpoint("llama")
    kwargs = {"dtype": "float32", "num_kv_blocks": 128, "linear_backend": backend}
    single = LLM(model_dir, **kwargs).generate(prompts, GREEDY)
    with LLM(model_dir, tensor_parallel_size=2, num_threads=1, **kwargs) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]


def test_indivisible_sizes_are_refused_by_name(make_checkpoint) -> None:
    model_dir = make_checkpoint("llama")  # 4 heads, 2 KV heads, intermediate 192
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .*num_attention_heads \(4\)"):
        LLM(model_dir, dtype="float32", num_kv_blocks=64, tensor_parallel_size=3)


def test_a_dead_rank_breaks_the_replica_promptly(make_checkpoint) -> None:
    model_dir = make_checkpoint("llama")
    lost = threading.Event()
    reasons: list[str] = []
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=128, tensor_parallel_size=2, num_threads=1)
    llm.engine._on_rank_lost = lambda reason: (reasons.append(reason), lost.set())
    assert llm.generate([[11, 12, 13]], GREEDY)[0].token_ids
    (pid,) = llm.engine.ranks.pids
    os.kill(pid, signal.SIGKILL)
    assert lost.wait(10), "the rank watch did not notice the dead rank"
    assert "died" in reasons[0]
    with pytest.raises(RankLost):
        llm.generate([[11, 12, 13]], GREEDY)
    llm.close()  # returns: no STOP is sent to a broken replica, the dead rank is reaped
    assert len(reasons) == 1
