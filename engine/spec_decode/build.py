"""Assemble an engine's speculator from its config (once, at start-up)."""

from __future__ import annotations

from collections.abc import Collection

from tandem.common.model_config import ModelConfig
from tandem.common.sampling_params import SpecMethod
from tandem.engine.attention.kv_quant import KVCacheDtype, cache_row
from tandem.engine.config import EngineConfig, EngineRuntime, default_spec_method
from tandem.engine.layers.linear import LinearBackend, select_linear_backend
from tandem.engine.model_runner import KVCacheLayout, ModelRunner
from tandem.engine.spec_decode.draft_model import DraftModelProposer
from tandem.engine.spec_decode.ngram import NgramProposer
from tandem.engine.spec_decode.proposer import Proposer
from tandem.engine.spec_decode.speculator import SpeculationConfig, Speculator


def build_speculator(
    config: EngineConfig,
    runtime: EngineRuntime,
    target: ModelConfig,
    eos_token_ids: Collection[int],
    num_blocks: int,
) -> Speculator | None:
    """``None`` when the engine is configured without speculation. The n-gram proposer is
    always available once speculation is on; the draft one when a draft model is given."""
    method = default_spec_method(config)
    if method is None:
        return None
    proposers: dict[SpecMethod, Proposer] = {
        SpecMethod.NGRAM: NgramProposer(config.ngram_min_n, config.ngram_max_n)
    }
    cost = {SpecMethod.NGRAM: 0.0}
    if config.draft_model is not None:
        draft = ModelConfig.from_dir(config.draft_model)
        blocks = draft_cache_blocks(num_blocks, target, runtime)
        proposer = _draft_proposer(config, runtime, target, draft, eos_token_ids, blocks)
        proposers[SpecMethod.DRAFT] = proposer
        cost[SpecMethod.DRAFT] = relative_step_cost(
            draft, target, runtime.device.type, native_draft=proposer.native is not None
        )
    speculation = SpeculationConfig(
        method,
        config.num_speculative_tokens,
        config.speculative_adaptive,
        config.speculative_by_default,
    )
    return Speculator(speculation, proposers, cost)


def draft_cache_blocks(target_blocks: int, target: ModelConfig, runtime: EngineRuntime) -> int:
    """The draft model's KV pool in blocks: the target's count (room for the same tokens),
    except beside a quantized target cache. The draft's cache stays float (its native
    forward reads float32), and the ~4x blocks a quantized cache gets from its memory
    would cost the draft ~4x its float bytes; it gets the blocks a float target cache
    would have had in the same memory instead (at least one full-length sequence's). A
    request the draft has no room for gets no proposals, not an error."""
    if not runtime.kv_cache_dtype.quantized:
        return target_blocks
    quantized = cache_row(runtime.kv_cache_dtype, target.head_dim, runtime.dtype)
    unquantized = cache_row(KVCacheDtype.AUTO, target.head_dim, runtime.dtype)
    equivalent = (
        target_blocks
        * (quantized[0] * quantized[1].itemsize)
        // (unquantized[0] * unquantized[1].itemsize)
    )
    per_sequence = -(-runtime.max_model_len // runtime.block_size)
    return min(target_blocks, max(equivalent, per_sequence))


LAYER_OVERHEAD_MACS = {"cpu": 1_500_000, "cuda": 50_000_000}
"""What a layer's fixed costs (op dispatch, kernel launches, KV bookkeeping) are worth in
multiply-adds at batch 1, per device type. Rough figures: on this project's 2-core CPU a
layer of a ~3M-parameter model costs about 70 us beyond its arithmetic; on a GPU without
CUDA graphs, a dozen launches of ~4 us each while HBM could have streamed ~50M weights.
They matter for small drafts, whose steps are mostly overhead."""

NATIVE_LAYER_OVERHEAD_MACS = 100_000
"""The same for a draft whose forward runs natively (``tandem.engine.models.native_decode``):
about 5 us per layer on the 2-core CPU."""


def relative_step_cost(
    draft: ModelConfig, target: ModelConfig, device_type: str, native_draft: bool = False
) -> float:
    """A draft decode step's cost in target decode steps: multiply-adds per token plus a
    fixed overhead per layer. An estimate from the configs, not a timing, so the adaptive
    k (and with it a seeded request's random stream) never depends on machine speed."""
    overhead = LAYER_OVERHEAD_MACS.get(device_type, LAYER_OVERHEAD_MACS["cuda"])
    draft_overhead = NATIVE_LAYER_OVERHEAD_MACS if native_draft else overhead

    def cost(model: ModelConfig, per_layer: int) -> float:
        return flops_per_token(model) + per_layer * model.num_layers

    return cost(draft, draft_overhead) / cost(target, overhead)


def flops_per_token(model: ModelConfig) -> int:
    """Multiply-adds of one decode step per token (weights only; embeddings are lookups)."""
    attention = model.hidden_size * (2 * model.q_size + 2 * model.kv_size)
    mlp = 3 * model.hidden_size * model.intermediate_size
    return model.num_layers * (attention + mlp) + model.hidden_size * model.vocab_size


def _draft_proposer(
    config: EngineConfig,
    runtime: EngineRuntime,
    target: ModelConfig,
    draft: ModelConfig,
    eos_token_ids: Collection[int],
    num_blocks: int,
) -> DraftModelProposer:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft_model's vocabulary ({draft.vocab_size}) differs from the target's "
            f"({target.vocab_size}); a draft must share the target's tokenizer"
        )
    if draft.max_position_embeddings < runtime.max_model_len:
        raise ValueError(
            f"draft_model's max_position_embeddings ({draft.max_position_embeddings}) is "
            f"below max_model_len ({runtime.max_model_len}): the draft could not follow "
            "long requests; lower max_model_len or use a draft with a longer context"
        )
    layout = KVCacheLayout(
        runtime.block_size, draft.num_layers, draft.num_kv_heads, draft.head_dim, runtime.dtype
    )
    requested = LinearBackend(config.linear_backend) if config.linear_backend else None
    linear = select_linear_backend(requested, runtime.device, runtime.dtype, draft.hidden_size)
    runner = ModelRunner(
        config.draft_model,
        draft,
        layout,
        runtime.backend,
        linear,
        runtime.device,
        eos_token_ids,
        config.seed,
    )
    return DraftModelProposer(runner, num_blocks, runtime.block_size, config.seed)
