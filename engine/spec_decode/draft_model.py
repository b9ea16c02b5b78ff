"""A smaller draft model proposes k tokens autoregressively, with its own paged KV cache.

Per step, for every request to speculate on: the draft first catches up (computes the
tokens it has not seen yet: the prompt the first time, then the tokens accepted or
produced since its last proposal), then drafts k tokens one forward pass at a time,
batched across requests. Drafted tokens the target rejected are rolled back at the next
proposal: the draft's computed tokens shrink to the longest prefix it shares with the
request, and the blocks past it are trimmed. Greedy requests draft greedily; sampled
ones draw from the draft's own distribution under the request's temperature and
filters, and those distributions go to the rejection sampler. A small float32 draft on
the CPU runs its forwards natively (``tandem.engine.models.native_decode``): a step of a few
tokens is then one call instead of a few dozen torch operators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.model_runner import ModelRunner
from tandem.engine.models.native_decode import MAX_ROWS, NativeDecoder
from tandem.engine.request import Request
from tandem.engine.sampler import SamplingRow, filtered_probs
from tandem.engine.scheduler import ScheduledChunk
from tandem.engine.spec_decode.proposer import Proposal
from tandem.engine.spec_decode.rejection import sample

_DRAFT_SEED_OFFSET = 0x5EED


@dataclass(eq=False)
class DraftSequence:
    """The draft's view of one request (duck-types what the KV manager needs)."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    generator: torch.Generator | None = None
    kv_namespace: str = ""
    """The draft serves the base model only (no adapters)."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    def __init__(
        self,
        runner: ModelRunner,
        num_blocks: int,
        block_size: int,
        seed: int,
        native: bool = True,
    ) -> None:
        """``runner``: the draft model (same tokenizer as the target), KV allocated by us.
        ``native``: run small steps through ``NativeDecoder`` where it supports the model."""
        self.runner = runner
        runner.allocate_kv_cache(num_blocks)
        self.native = None
        if native and NativeDecoder.supports(runner.model):
            self.native = NativeDecoder(runner.model, runner.kv_caches, block_size)
        self.kv = KVCacheManager(BlockPool(num_blocks), block_size)
        self.generator = torch.Generator(runner.device).manual_seed(seed)
        self._seqs: dict[str, DraftSequence] = {}

    def propose(self, requests: Sequence[tuple[Request, int]]) -> dict[str, Proposal]:
        active = [(r, self._sync(r), k) for r, k in requests]
        active = [(r, s, k) for r, s, k in active if s is not None]
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _, _ in active}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in active}
        step = 0
        while active:
            chunks = [self._next_chunk(s) for _, s, _ in active]
            logits = self._last_logits(chunks)
            for (request, seq, _), chunk, row in zip(active, chunks, logits, strict=True):
                seq.num_computed_tokens = chunk.end
                self.kv.publish_full_blocks(seq)
                token, q = self._draw(request, seq, row)
                drafts[request.request_id].append(token)
                if q is not None:
                    probs[request.request_id].append(q)
                seq.all_token_ids.append(token)
            step += 1
            active = [(r, s, k) for r, s, k in active if k > step and self.kv.allocate(s, 1)]
        return {
            rid: Proposal(tokens, torch.stack(probs[rid]) if probs[rid] else None)
            for rid, tokens in drafts.items()
        }

    def _last_logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        if self.native is not None and sum(c.num_tokens for c in chunks) <= MAX_ROWS:
            return self.native.last_logits(chunks)
        return self.runner.last_logits(chunks)

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.forget(seq)

    def _sync(self, request: Request) -> DraftSequence | None:
        """Bring the draft's copy of ``request`` up to date; ``None`` if no room."""
        seq = self._seqs.get(request.request_id)
        tokens = request.all_token_ids
        if seq is None:
            seq = DraftSequence(
                request.request_id, list(tokens), generator=self._generator_for(request)
            )
            prefix = self.kv.find_cached_prefix(seq)
            if not self.kv.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix):
                return None
            seq.num_computed_tokens = prefix.num_tokens
            self._seqs[request.request_id] = seq
            return seq
        # At least the last token is (re)computed: its logits are the first draft's. (A
        # request the target skipped last step has no new token; its KV is rewritten.)
        seq.num_computed_tokens = min(
            seq.num_computed_tokens, _common_prefix(seq.all_token_ids, tokens), len(tokens) - 1
        )
        seq.all_token_ids = list(tokens)
        self.kv.trim(seq)
        if not self.kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens):
            self.forget(request.request_id)
            return None
        return seq

    def _next_chunk(self, seq: DraftSequence) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(seq, start, seq.num_tokens - start, tuple(self.kv.block_ids(seq)))

    def _draw(
        self, request: Request, seq: DraftSequence, logits: torch.Tensor
    ) -> tuple[int, torch.Tensor | None]:
        params = request.sampling_params
        if params.greedy:
            return int(logits.argmax()), None
        row = SamplingRow(params, [], [], None, ())
        q = filtered_probs(logits.float().unsqueeze(0), [row])[0]
        return sample(q, seq.generator or self.generator), q

    def _generator_for(self, request: Request) -> torch.Generator | None:
        """Seeded requests draft from their own stream: their output must not depend on
        what else is in the batch."""
        seed = request.sampling_params.seed
        if seed is None:
            return None
        return torch.Generator(self.runner.device).manual_seed(seed ^ _DRAFT_SEED_OFFSET)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
