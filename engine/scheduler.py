"""Iteration-level scheduling: which requests compute how many tokens this step.

Every step has a token budget (``max_num_batched_tokens``). Running requests are served
first, in priority order (lower ``priority`` first, then earlier arrival): a decode asks
for one token, an unfinished prefill for as much of its prompt as the budget allows
(chunked prefill), so long prompts never stall the decodes sharing their step. Then
waiting requests are admitted in the same order while budget, ``max_num_seqs`` and KV
blocks last; each starts after its longest cached prefix.

When a running request cannot get a block, the lowest-priority, latest-arrived running
request is preempted: its blocks are freed and it waits to recompute its KV (its
prompt *and* the tokens it already produced, so its output continues unchanged).

Disaggregation is two more states, still counted in tokens. A ``REMOTE`` request (decode
worker) is admitted by allocating blocks for the remote tokens (its prompt; with a
migration, prompt and output but the last) its local prefix cache lacks, then waits
(``WAITING_FOR_KV``, no compute budget) until the caller reports the pull done; its
computed tokens then jump to the remote count — or stay at the local prefix on failure,
and the tokens are computed here like any other. A ``HAND_OFF`` request (prefill
worker) stops after its first token and keeps its blocks (``PREFILLED``) until
released; a running request ``hold`` takes out (migration) keeps them the same way.

Speculative decoding adds drafts, passed in as token ids: a decoding request given k of
them gets a chunk of 1 + k positions (its last token, then the drafts to verify), when
the budget allows. ``update`` keeps the KV of the drafts the target accepted and rolls
back the rest (``_roll_back_rejected_drafts``).

Torch-free: the scheduler decides; the model runner executes.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import FinishReason, PrefillMode, Request, RequestStatus
from tandem.engine.stopping import check_token_stop

LORA_WAIT_STEPS = 32
"""Steps a request may wait for a free adapter slot before the adapters ahead of it stop
taking new requests (``Scheduler._admit``)."""

NO_DRAFTS: Mapping[str, tuple[int, ...]] = MappingProxyType({})
"""No request speculates this step (the default of ``Scheduler.schedule``)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    max_loras: int = 0
    """Distinct LoRA adapters one batch may mix (0: adapters are not served)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len}) so any prompt fits one step"
            )


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` positions of ``request`` from ``start`` are computed this step: its
    tokens, then (speculative decoding) ``draft_token_ids`` to verify."""

    request: Request
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    draft_token_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the request's last token, so a token is sampled (and
        the drafts, if any, verified)."""
        return self.end - len(self.draft_token_ids) == self.request.num_tokens


@dataclass(frozen=True)
class KVPull:
    """Blocks to fill with KV pulled from ``request``'s prefill worker before it can run:
    ``block_ids`` are local destinations, in prompt order, for the request's blocks
    ``first_block``, ``first_block + 1``, ... (the ones before came from the local prefix
    cache). May be empty, when the local cache held the whole prompt."""

    request: Request
    block_ids: tuple[int, ...]
    first_block: int


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    kv_pulls: tuple[KVPull, ...] = ()
    preempted: tuple[Request, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    """Requests that left since the previous step (the runner drops their state)."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class StepUpdate:
    """What one step did to one request: tokens appended and, maybe, its finish."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    handed_off: bool = False
    """A ``HAND_OFF`` request reached ``PREFILLED``: its KV is held for a decode worker."""
    num_draft_tokens: int = 0
    """Speculative tokens verified this step."""
    num_accepted_drafts: int = 0
    """How many of them were accepted (``new_token_ids`` starts with those, then has the
    target's own token, unless a stop cut the run short)."""


@dataclass
class Scheduler:
    config: SchedulerConfig
    kv: KVCacheManager
    eos_token_ids: Collection[int]
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    waiting_for_kv: dict[str, Request] = field(default_factory=dict)
    prefilled: dict[str, Request] = field(default_factory=dict)
    num_preemptions: int = 0
    """Total since start (a metric; the model output never depends on it)."""
    _finished_ids: list[str] = field(default_factory=list)

    # --- queue management -------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=_order)

    def finish(self, request: Request, reason: FinishReason | None) -> None:
        """Remove ``request`` wherever it is and free its blocks (abort included). A
        ``PREFILLED`` request is released with ``reason=None``: it has no outcome here."""
        if request.is_finished:
            return
        status = request.status
        if status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif status is RequestStatus.WAITING_FOR_KV:
            del self.waiting_for_kv[request.request_id]
        elif status is RequestStatus.PREFILLED:
            del self.prefilled[request.request_id]
        else:
            self.waiting.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self.kv.forget(request)
        self._finished_ids.append(request.request_id)

    def kv_arrived(self, request: Request, ok: bool) -> None:
        """The pull for a ``WAITING_FOR_KV`` request ended; on failure its tokens are
        computed here, after whatever the local prefix cache held."""
        del self.waiting_for_kv[request.request_id]
        if ok:
            request.num_computed_tokens = max(
                request.num_computed_tokens, request.num_remote_tokens
            )
            self.kv.publish_full_blocks(request)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=_order)

    @property
    def num_unfinished(self) -> int:
        """Requests still to produce tokens here (held ``PREFILLED`` ones excluded)."""
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    @property
    def num_seqs(self) -> int:
        """Sequences holding blocks and counted against ``max_num_seqs``."""
        return len(self.running) + len(self.waiting_for_kv)

    # --- one step ----------------------------------------------------------------------

    def schedule(self, drafts: Mapping[str, tuple[int, ...]] = NO_DRAFTS) -> SchedulerOutput:
        """Decide this step's chunks, preemptions and pulls.

        ``drafts``: speculative tokens to verify after a running request's tokens, by
        request id. A request gets them in its chunk (``ScheduledChunk.draft_token_ids``)
        only if its whole remainder plus the drafts fits the budget; otherwise it runs
        without. Entries for requests not running are ignored; nothing is kept for later.
        """
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            request_drafts = tuple(drafts.get(request.request_id, ()))
            num_new = request.num_uncomputed_tokens + len(request_drafts)
            if num_new > budget:  # verify drafts only with the whole remainder of the request
                request_drafts, num_new = (), min(request.num_uncomputed_tokens, budget)
            if not self._grow_or_preempt(request, num_new, preempted):
                break  # `request` itself was preempted: nothing after it can run either
            chunks.append(self._chunk(request, num_new, request_drafts))
            budget -= num_new
            i += 1
        pulls: list[KVPull] = []
        if not preempted:
            self._admit(budget, chunks, pulls)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(tuple(chunks), tuple(pulls), tuple(preempted), finished)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[StepUpdate]:
        """Advance computed tokens, append sampled ones, finish what is done.

        ``sampled``: per request of a chunk that ``samples``, its new tokens; for a chunk
        with drafts, the accepted drafts then one token of the target's own.
        """
        updates = []
        for chunk in output.chunks:
            if chunk.request.is_finished:
                continue  # aborted while the step ran
            update = self._advance(chunk, sampled.get(chunk.request.request_id, []))
            if update is not None:
                updates.append(update)
        return updates

    def _advance(self, chunk: ScheduledChunk, tokens: list[int]) -> StepUpdate | None:
        """Apply one chunk's outcome to its request; ``None`` if nothing was appended."""
        request = chunk.request
        num_drafts = len(chunk.draft_token_ids)
        num_accepted = max(0, len(tokens) - 1) if num_drafts else 0
        appended, reason = self._append(request, tokens)
        # The chunk computed positions start..end-1: the request's own tokens, then k
        # drafts, of which the target accepted the first a; the last k - a positions hold
        # rejected drafts. A stop may cut the appended run shorter still:
        #     computed = min(end - (k - a), num_tokens)
        request.num_computed_tokens = min(
            chunk.end - (num_drafts - num_accepted), request.num_tokens
        )
        self.kv.publish_full_blocks(request)
        if reason is not None:
            self.finish(request, reason)
        elif num_drafts:
            self._roll_back_rejected_drafts(request)
        if not appended:
            return None
        handed_off = reason is None and request.prefill_mode is PrefillMode.HAND_OFF
        if handed_off:
            self._hand_off(request)
        return StepUpdate(request, appended, reason, handed_off, num_drafts, num_accepted)

    def _roll_back_rejected_drafts(self, request: Request) -> None:
        """Free the blocks past what ``request.num_tokens`` needs: after a verification
        they held only rejected drafts (never published: ``num_computed_tokens`` already
        stops before them). The KV of rejected drafts left in a kept block is simply
        overwritten by the next step."""
        self.kv.trim(request)

    def _append(self, request: Request, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append tokens up to the first that ends the request; returns those appended and
        the finish reason (the caller finishes the request)."""
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            reason = check_token_stop(request, self.eos_token_ids, self.config.max_model_len)
            if reason is not None:
                return tokens[: i + 1], reason
        return tokens, None

    # --- helpers -----------------------------------------------------------------------

    def _chunk(
        self, request: Request, num_new: int, drafts: tuple[int, ...] = ()
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, num_new, tuple(self.kv.block_ids(request)), drafts)

    def _grow_or_preempt(self, request: Request, num_new: int, preempted: list[Request]) -> bool:
        """Allocate for ``request``, preempting from the back of ``running`` until it fits.
        Returns ``False`` if ``request`` itself had to go."""
        while not self.kv.allocate(request, num_new):
            if len(self.running) == 1:
                raise RuntimeError(
                    f"request {request.request_id!r} alone needs more KV cache than exists; "
                    "the engine must keep max_model_len within the pool"
                )
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_order)
        request.status = RequestStatus.PREEMPTED

    def _hand_off(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.PREFILLED
        self.prefilled[request.request_id] = request

    def hold(self, request: Request) -> None:
        """Stop running ``request`` and keep its blocks (``PREFILLED``) for another worker
        to pull: a migration. Its blocks go back with ``finish(request, None)``."""
        self._hand_off(request)

    def _admit(self, budget: int, chunks: list[ScheduledChunk], pulls: list[KVPull]) -> None:
        """Admit waiting requests in order while budget, ``max_num_seqs`` and blocks last.
        A request whose adapter would be one more than ``max_loras`` in the batch waits
        (those behind it may go ahead); once one has waited so for ``LORA_WAIT_STEPS``
        steps, no adapter request behind it is admitted until it is, so the batch's
        adapters drain and free a slot for it (base requests still go ahead)."""
        adapters = self._adapters_in_batch()
        starved = False
        i = 0
        while i < len(self.waiting) and self.num_seqs < self.config.max_num_seqs:
            request = self.waiting[i]
            name = request.lora_name
            if name is not None and (
                starved or (name not in adapters and len(adapters) >= self.config.max_loras)
            ):
                if name not in adapters:
                    request.num_lora_waits += 1
                    starved |= request.num_lora_waits > LORA_WAIT_STEPS
                i += 1
                continue
            if self._awaits_remote_kv(request):
                if not self._admit_for_pull(i, pulls):
                    break
            else:
                if budget <= 0:
                    break
                num_new = self._admit_local(i, budget, chunks)
                if num_new is None:
                    break
                budget -= num_new
            if name is not None:
                adapters.add(name)

    def _admit_local(self, index: int, budget: int, chunks: list[ScheduledChunk]) -> int | None:
        """Admit ``waiting[index]`` for up to ``budget`` tokens; how many it takes, or
        ``None`` when it does not fit now."""
        request = self.waiting[index]
        prefix = self.kv.find_cached_prefix(request)
        num_new = request.num_tokens - prefix.num_tokens
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget
        if not self.kv.allocate(request, num_new, prefix):
            return None
        self._take(index, prefix.num_tokens, RequestStatus.RUNNING)
        bisect.insort(self.running, request, key=_order)
        chunks.append(self._chunk(request, num_new))
        return num_new

    def _take(self, index: int, num_cached: int, status: RequestStatus) -> None:
        """Move ``waiting[index]``, its blocks allocated, out of the queue into ``status``."""
        request = self.waiting.pop(index)
        _note_admission(request)
        request.num_computed_tokens = request.num_cached_tokens = num_cached
        request.status = status

    def _adapters_in_batch(self) -> set[str]:
        """The adapters of the requests holding blocks to run (running or pulling)."""
        held = [*self.running, *self.waiting_for_kv.values()]
        return {r.lora_name for r in held if r.lora_name is not None}

    @staticmethod
    def _awaits_remote_kv(request: Request) -> bool:
        """A ``REMOTE`` request pulls once; after a preemption it recomputes like any other."""
        return request.prefill_mode is PrefillMode.REMOTE and request.num_preemptions == 0

    def _admit_for_pull(self, index: int, pulls: list[KVPull]) -> bool:
        request = self.waiting[index]
        prefix = self.kv.find_cached_prefix(request)
        num_new = max(0, request.num_remote_tokens - prefix.num_tokens)
        if not self.kv.allocate(request, num_new, prefix):
            return False
        self._take(index, prefix.num_tokens, RequestStatus.WAITING_FOR_KV)
        self.waiting_for_kv[request.request_id] = request
        first = len(prefix.blocks)
        pulls.append(KVPull(request, tuple(self.kv.block_ids(request)[first:]), first))
        return True


def _note_admission(request: Request) -> None:
    if request.admitted_time is None:  # a preempted request's queue time was counted
        request.admitted_time = time.monotonic()


def _order(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)
