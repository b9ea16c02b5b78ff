"""``shard_model``: the one step that makes a full-size model one rank's slice of it.

Applied to the model built on the meta device, before any weight is read; the loader
then fills each parallel layer from its slice of the checkpoint. The model files stay
free of parallel code: the attention and MLP blocks keep their forward, and see only
their (now parallel) linear layers and their local head / column counts.

Heads. Query heads split evenly. KV heads split evenly when there are at least as many
as ranks; with fewer (multi-query, or ``tp > num_key_value_heads``) each rank holds one
KV head, the one its query heads attend to, so ``tp / num_kv_heads`` ranks hold a
copy of each.

Multi-head latent attention (DeepSeek) splits its query heads the same way; its latent
cache has one row per token for all heads (one "KV head"), so every rank holds the
whole latent path and caches the same rows (``layers.mla``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tandem.common.model_config import ModelConfig
from tandem.engine.layers.attention import SelfAttention
from tandem.engine.layers.mla import MultiLatentAttention
from tandem.engine.layers.mlp import GatedMLP
from tandem.engine.layers.moe import ExpertSplit, SparseMoE
from tandem.engine.parallel.group import TensorParallelGroup
from tandem.engine.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Span,
    VocabParallelEmbedding,
    even_span,
)


@dataclass(frozen=True)
class HeadSplit:
    """The heads one rank holds (in heads, not features)."""

    q: Span
    kv: Span


def check_tensor_parallel(
    config: ModelConfig, size: int, expert_split: ExpertSplit = ExpertSplit.TENSOR
) -> None:
    """Raises ``ValueError`` naming what does not divide by ``size``."""
    if size == 1:
        return
    problems = []
    if config.num_heads % size:
        problems.append(f"num_attention_heads ({config.num_heads})")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads ({kv}; or tp a multiple of it)")
    if config.intermediate_size % size and (
        config.moe is None or not all(config.moe.sparse_layers)
    ):
        problems.append(f"intermediate_size ({config.intermediate_size})")
    moe = config.moe
    if moe is not None and moe.shared_intermediate_size % size:
        problems.append(f"the shared experts' intermediate size ({moe.shared_intermediate_size})")
    if moe is not None and expert_split is ExpertSplit.EXPERT and moe.num_experts % size:
        problems.append(f"the number of experts ({moe.num_experts}; expert parallelism)")
    if moe is not None and expert_split is ExpertSplit.TENSOR and moe.intermediate_size % size:
        problems.append(f"the experts' intermediate size ({moe.intermediate_size})")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} must divide the model's " + ", ".join(problems)
        )
    if config.mla is not None and config.qkv_bias:
        raise ValueError(
            "tensor parallelism of latent attention with attention_bias (a biased o_proj) "
            "is not supported"
        )


def head_split(config: ModelConfig, rank: int, size: int) -> HeadSplit:
    q = even_span(config.num_heads, rank, size)
    kv_heads = config.num_kv_heads
    if kv_heads >= size:
        return HeadSplit(q, even_span(kv_heads, rank, size))
    return HeadSplit(q, Span(rank // (size // kv_heads), 1))


def shard_model(
    model: nn.Module,
    config: ModelConfig,
    group: TensorParallelGroup,
    expert_split: ExpertSplit = ExpertSplit.TENSOR,
) -> None:
    """Replaces, in place, the linear layers and the embedding / LM head of a Llama-family
    model (on the meta device) by this rank's parallel slices; a mixture of experts
    keeps this rank's share of its experts (``expert_split``)."""
    check_tensor_parallel(config, group.size, expert_split)
    heads = head_split(config, group.rank, group.size)
    d = config.head_dim
    q = Span(heads.q.start * d, heads.q.size * d)
    kv = Span(heads.kv.start * d, heads.kv.size * d)
    hidden = config.hidden_size
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.qkv_proj = ColumnParallelLinear(
                hidden, [q, kv, kv], bias=module.qkv_proj.bias is not None
            )
            module.o_proj = RowParallelLinear(q, hidden, group)
            module.num_heads, module.num_kv_heads = heads.q.size, heads.kv.size
            module.q_size, module.kv_size = q.size, kv.size
        elif isinstance(module, MultiLatentAttention):
            _shard_latent_attention(module, heads.q, hidden, group)
        elif isinstance(module, GatedMLP):  # a dense MLP, or a MoE's shared experts
            columns = even_span(module.intermediate_size, group.rank, group.size)
            module.gate_up_proj = ColumnParallelLinear(hidden, [columns, columns], bias=False)
            module.down_proj = RowParallelLinear(columns, hidden, group)
            module.intermediate_size = columns.size
        elif isinstance(module, SparseMoE):
            module.shard(expert_split, group)
    embedding = VocabParallelEmbedding(config.vocab_size, hidden, group)
    model.model.embed_tokens = embedding
    model.lm_head = ParallelLMHead(embedding, tied=config.tie_word_embeddings)


def _shard_latent_attention(
    module: MultiLatentAttention, heads: Span, hidden: int, group: TensorParallelGroup
) -> None:
    """Query heads ``heads`` of every per-head projection; the latent path replicated."""
    mla = module.mla
    qk, v = mla.qk_head_dim, mla.v_head_dim
    q_rows = Span(heads.start * qk, heads.size * qk)
    if mla.q_lora_rank is None:
        module.q_proj = ColumnParallelLinear(hidden, [q_rows], bias=False)
    else:
        module.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [q_rows], bias=False)
    module.kv_b_proj.shard(heads.start, heads.size)
    module.o_proj = RowParallelLinear(Span(heads.start * v, heads.size * v), hidden, group)
    module.num_heads = heads.size
