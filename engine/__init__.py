"""Tandem's model runtime: paged KV cache, continuous batching, chunked prefill, prefix
caching, sampling, speculative decoding, and the offline ``LLM`` API.

``from tandem.engine import LLM, SamplingParams`` loads torch lazily, so torch-free modules
(``tandem.engine.scheduler``, ``tandem.engine.block_pool``, ...) stay importable without it.

One plain decode step, ``LLMEngine.step``, in order:

1. ``Scheduler.schedule()`` decides: each running request gets a ``ScheduledChunk`` of
   the tokens it has not computed (one, when decoding), its KV blocks grown by
   ``KVCacheManager.allocate`` (preempting the lowest-priority, latest-arrived one if
   the pool is short); waiting requests are admitted after their cached prefix. The
   result is a ``SchedulerOutput``; the scheduler is torch-free and holds no tensors.
2. ``ModelRunner.execute(plan)`` executes: one forward pass over all chunks, flattened
   (``AttentionMetadata``: positions, slot mapping, block table), writing their KV into
   the paged cache; then ``Sampler`` draws a token for every chunk that ends at its
   request's last token. Out comes a ``RunnerOutput`` (tokens and logprobs by request).
3. ``Scheduler.update(plan, sampled)`` appends the tokens (``check_token_stop``),
   advances ``num_computed_tokens``, publishes full blocks to the prefix cache and
   finishes what is done; one ``StepUpdate`` per request that got tokens.
4. ``LLMEngine._emit`` detokenizes (``TextStream``, stop strings) into one
   ``RequestDelta`` per update (with speculation on, the speculator then proposes for
   the next step, as below).

A speculative step is the same step with drafts. At the end of the previous one,
``Speculator.observe`` took in each ``StepUpdate`` (counters, ``AdaptiveK``) and
``Speculator.propose`` chose the decoding requests that speculate and their k
(``Speculator._plan``) and asked a proposer (``NgramProposer``, ``DraftModelProposer``)
for them: a ``Drafts``, holding per request a ``Proposal`` (token ids, and the draft's
distributions if it sampled), which the engine keeps for this step
(``LLMEngine._next_drafts``). Then:

1. ``Scheduler.schedule(drafts.token_ids)``: a request with k drafts gets a chunk of
   1 + k positions (its last token, then the drafts) in ``ScheduledChunk.draft_token_ids``,
   if the budget allows.
2. ``ModelRunner.execute(plan, drafts.probs)``: the same forward pass, now with logits at
   all k + 1 positions; ``Sampler`` verifies each drafted chunk (a ``RowGroup``):
   ``verify_greedy`` (the target's argmax, so greedy output is unchanged) or
   ``verify_sampled`` (rejection sampling against the draft distributions). Its tokens
   are the a accepted drafts, then one of the target's own.
3. ``Scheduler.update``: the chunk computed positions start..end-1, so
   ``num_computed_tokens = min(end - (k - a), num_tokens)``, and
   ``Scheduler._roll_back_rejected_drafts`` frees the blocks that held only rejected
   drafts. The ``StepUpdate`` says how many drafts were verified and accepted.
4. ``LLMEngine._emit`` as before, then ``Speculator.observe`` and ``Speculator.propose``
   for the next step (a draft model rolls its own KV back to the accepted tokens there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.common.lora import LoRARequest
from tandem.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm import LLM
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.outputs import RequestDelta, RequestOutput

__all__ = [
    "LLM",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
]

_LAZY = {
    "LLM": "tandem.engine.llm",
    "LLMEngine": "tandem.engine.llm_engine",
    "EngineConfig": "tandem.engine.config",
    "RequestOutput": "tandem.engine.outputs",
    "RequestDelta": "tandem.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tandem.engine' has no attribute {name!r}")
