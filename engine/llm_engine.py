"""The online engine: requests in, per-step deltas out.

``step()`` is the whole loop — schedule, execute, update — plus the text side
(detokenize, stop strings) and, with speculative decoding, the proposal for the next
step. Servers call ``add_request`` / ``abort_request`` between steps and stream the
deltas; the offline ``LLM`` drives the same loop to completion. Single-threaded: call it
from one thread (workers run it in a dedicated thread).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.common.kv_events.events import KVCacheEvent
from tandem.common.lora import LoRARequest
from tandem.common.model_config import ModelConfig
from tandem.common.sampling_params import SamplingParams, SpecMethod
from tandem.common.text_stream import TextStream
from tandem.common.tokenizer import Tokenizer
from tandem.engine.block_pool import BlockPool
from tandem.engine.config import EngineConfig, EngineRuntime, fit_kv_pool, resolve_runtime
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.lora.manager import LoRAManager
from tandem.engine.model_runner import KVCacheLayout, ModelRunner
from tandem.engine.outputs import EngineLoad, KVUsage, RequestDelta
from tandem.engine.parallel.control import RankControl
from tandem.engine.parallel.group import RankLost, Rendezvous, TensorParallelGroup
from tandem.engine.parallel.ranks import (
    STOP_TIMEOUT_S,
    Ranks,
    RankWatch,
    connect_control,
    start_ranks,
)
from tandem.engine.parallel.shard import check_tensor_parallel, head_split
from tandem.engine.request import FinishReason, PrefillMode, Request, RequestStatus
from tandem.engine.sampler import TokenLogprobs
from tandem.engine.scheduler import KVPull, Scheduler, SchedulerConfig, StepUpdate
from tandem.engine.spec_decode.build import build_speculator
from tandem.engine.spec_decode.proposer import Proposal
from tandem.engine.spec_decode.speculator import Drafts, Speculator
from tandem.engine.structured import StructuredOutputs

log = logging.getLogger(__name__)

KVEventCallback = Callable[[list[KVCacheEvent]], None]


def check_config(config: EngineConfig) -> int:
    """What an engine checks at start-up before it loads weights: the checkpoint's
    config, the runtime the settings resolve to, and that the KV pool holds at least one
    full-length sequence (``fit_kv_pool``). Returns the pool's size in blocks (on GPU an
    estimate: the engine sizes it from the memory free after loading). Raises
    ``ValueError`` naming the setting at fault; for launchers that validate before
    starting anything."""
    model_config = ModelConfig.from_dir(config.model)
    check_tensor_parallel(model_config, config.tensor_parallel_size, config.expert_split)
    runtime = resolve_runtime(config, model_config)
    layout = kv_layout(model_config, runtime, config.tensor_parallel_size)
    return fit_kv_pool(config, runtime, layout.bytes_per_block)[0]


def kv_layout(mc: ModelConfig, rt: EngineRuntime, tp_size: int = 1) -> KVCacheLayout:
    """The KV cache of one rank: its KV heads only (all of them at ``tp_size`` 1)."""
    heads = head_split(mc, 0, tp_size).kv.size
    planes = 1 if mc.mla is not None else 2  # a latent cache: one row per token
    return KVCacheLayout(
        rt.block_size, mc.num_layers, heads, mc.head_dim, rt.dtype, rt.kv_cache_dtype, planes
    )


def build_runner(config: EngineConfig, rank: int, rendezvous: Rendezvous) -> ModelRunner:
    """Rank ``rank`` (> 0) of a tensor-parallel replica: joins rank 0's groups, then
    loads its slice. It only runs forwards (no sampling, so no EOS ids needed)."""
    mc = ModelConfig.from_dir(config.model)
    rt = resolve_runtime(config, mc)
    group = TensorParallelGroup.join(rendezvous, rank, rt.device)
    return _model_runner(config, mc, rt, (), group)


def _model_runner(
    config: EngineConfig,
    mc: ModelConfig,
    rt: EngineRuntime,
    eos_token_ids: Collection[int],
    group: TensorParallelGroup | None,
) -> ModelRunner:
    """The model runner of one rank (rank 0 with the EOS ids it samples against)."""
    size = group.size if group is not None else 1
    return ModelRunner(
        config.model,
        mc,
        kv_layout(mc, rt, size),
        rt.backend,
        rt.linear_backend,
        rt.device,
        eos_token_ids,
        config.seed,
        group,
        rt.quantization,
        config.expert_split,
        rt.batch_invariant,
        config.lora_config(),
    )


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        on_kv_events: KVEventCallback | None = None,
        detokenize: bool = True,
        on_rank_lost: Callable[[str], None] | None = None,
    ) -> None:
        """``detokenize=False``: deltas carry token ids only and stop strings are refused —
        for workers whose caller (the router) turns tokens into text.
        ``on_rank_lost(reason)``: called once when another rank of this tensor-parallel
        replica dies (from a watcher thread, or the engine thread); the engine is broken
        from then on (``step`` raises ``RankLost``). A worker exits there, for its
        supervisor to restart the replica whole."""
        self.config = config
        self.detokenize = detokenize
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.eos_token_ids = self.tokenizer.eos_token_ids | self.model_config.eos_token_ids
        self.runtime: EngineRuntime = resolve_runtime(config, self.model_config)
        self._on_kv_events = on_kv_events
        mc, rt = self.model_config, self.runtime
        size = config.tensor_parallel_size
        check_tensor_parallel(mc, size, config.expert_split)
        layout = kv_layout(mc, rt, size)
        self.broken: str | None = None
        """Why the engine cannot go on (a lost rank), or ``None``."""
        self._on_rank_lost = on_rank_lost
        self.ranks: Ranks | None = None
        """Ranks 1..N-1 of a tensor-parallel engine (``None`` at size 1)."""
        self._rank_watch: RankWatch | None = None
        group = None
        if size > 1:
            group, self.ranks, self._tp_store = start_ranks(config, size, rt.device)
        self.runner = _model_runner(config, mc, rt, self.eos_token_ids, group)
        if self.ranks is not None:
            self._rank_watch = RankWatch(self.ranks, self._rank_lost)
        self.num_kv_blocks, rt = fit_kv_pool(config, rt, layout.bytes_per_block)
        self.runtime = rt  # max_model_len may be fitted to the pool
        log.info(
            "KV cache: %d blocks of %d tokens, %s, %d bytes per block",
            self.num_kv_blocks,
            layout.block_size,
            rt.kv_cache_dtype.value,
            layout.bytes_per_block,
        )
        self.runner.allocate_kv_cache(self.num_kv_blocks)
        self.rank_control: RankControl | None = None
        """Rank 0's call channel to the other ranks (KV transfer), at size > 1."""
        if group is not None:
            self.rank_control = connect_control(group)
        self.block_pool = BlockPool(self.num_kv_blocks, config.enable_prefix_caching)
        self.kv_cache = KVCacheManager(self.block_pool, rt.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=rt.max_num_batched_tokens,
                max_model_len=rt.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_loras=config.max_loras if config.enable_lora else 0,
            ),
            self.kv_cache,
            self.eos_token_ids,
        )
        self.speculator = build_speculator(
            config, rt, self.model_config, self.eos_token_ids, self.num_kv_blocks
        )
        self._next_drafts = Drafts()
        """Proposed at the end of the last step, for the next one's ``schedule`` and
        ``execute`` (see ``_step`` for why then)."""
        self.num_steps = 0
        """Target forward passes so far."""
        self.busy_seconds = 0.0
        """Time spent in ``step()`` so far."""
        self.text_streams: dict[str, TextStream] = {}
        self.requests: dict[str, Request] = {}
        self._kv_pulls: list[KVPull] = []
        self.last_step_idle = True
        """Whether the last ``step`` found nothing to compute (a driver may then sleep)."""
        self.peak_kv_usage = self.kv_usage()
        self._ids = itertools.count()
        self._structured: StructuredOutputs | None = None
        self._structured_lock = threading.Lock()  # servers prepare constraints off-thread

    @property
    def structured(self) -> StructuredOutputs:
        """The structured-output compiler, made on first use (``llguidance`` loads then)."""
        with self._structured_lock:
            if self._structured is None:
                tokenizer_json = (Path(self.config.model) / "tokenizer.json").read_text()
                self._structured = StructuredOutputs(
                    tokenizer_json, self.model_config.vocab_size, sorted(self.eos_token_ids)
                )
                self.runner.structured = self._structured
            return self._structured

    # --- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        output_token_ids: list[int] | None = None,
        prefill_mode: PrefillMode = PrefillMode.LOCAL,
        num_remote_tokens: int = 0,
        lora_request: LoRARequest | str | None = None,
    ) -> Request:
        """Validate and queue a request; raises ``ValueError`` naming the bad field.

        ``output_token_ids``: tokens already generated elsewhere (a prefill worker's first
        token, or a stream resumed after a worker failure or handed over); generation
        continues after them, and a seeded request continues its random sequence where
        they left it. ``num_remote_tokens`` (``REMOTE``): how many tokens the pulled KV
        covers, 0 for the prompt (a migration's covers all but the last token).
        ``lora_request``: the adapter it runs under, by name (loaded already) or as a
        ``LoRARequest`` (loaded now if new: ``add_lora``).
        """
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        outputs = list(output_token_ids or [])
        self._validate(token_ids, outputs, params, prefill_mode, num_remote_tokens)
        lora_name, namespace = self._adapter_of(lora_request, params)
        request = Request(request_id, token_ids, params, priority, prefill_mode, outputs)
        request.num_remote_tokens = num_remote_tokens or request.num_remote_tokens
        request.lora_name, request.kv_namespace = lora_name, namespace
        if params.structured is not None:
            request.grammar = self.structured.matcher(params.structured, outputs)
        self.requests[request_id] = request
        if self.detokenize:
            self.text_streams[request_id] = TextStream(self.tokenizer, params)
        self.scheduler.add(request)
        return request

    # --- LoRA adapters -------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter for requests to name (vLLM's ``add_lora``): read, checked
        against the model and ``max_lora_rank``, kept in CPU memory until a batch needs
        it; returns whether the name is new here. Safe to call from another thread while
        the engine steps; ``ValueError`` naming the adapter and the fault (nothing
        changes then)."""
        return self._lora_manager().add(lora_request)

    def remove_lora(self, name: str, dry_run: bool = False) -> bool:
        """Unload adapter ``name``; ``False`` if it is not loaded. Refused
        (``ValueError``) while requests of it are unfinished. ``dry_run``: only check."""
        manager = self._lora_manager()
        busy = sum(1 for r in self.requests.values() if r.lora_name == name)
        if busy:
            raise ValueError(f"LoRA adapter {name!r} has {busy} unfinished requests")
        if dry_run:
            return manager.get(name) is not None
        return manager.remove(name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded (registered), in load order; empty without LoRA."""
        return [] if self.runner.lora is None else self.runner.lora.registered()

    def lora_namespace(self, name: str) -> str:
        """The KV namespace of loaded adapter ``name`` (``tandem.common.lora``)."""
        return self._lora_manager().namespace(name)

    def _lora_manager(self) -> LoRAManager:
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        return self.runner.lora

    def _adapter_of(
        self, lora_request: LoRARequest | str | None, params: SamplingParams
    ) -> tuple[str | None, str]:
        """A request's adapter name and KV namespace (``None``, ``""``: the base)."""
        if lora_request is None:
            return None, ""
        manager = self._lora_manager()
        if isinstance(lora_request, LoRARequest):
            known = manager.get(lora_request.lora_name)
            if known is None or known.lora_path != lora_request.lora_path:
                manager.add(lora_request)  # refused when the name has another path
            name = lora_request.lora_name
        else:
            name = lora_request
            if manager.get(name) is None:
                raise ValueError(f"LoRA adapter {name!r} is not loaded")
        if params.speculative.method is SpecMethod.DRAFT:
            raise ValueError(
                "draft-model speculation does not run LoRA adapters (the draft model knows "
                "only the base model); use the ngram method, or none"
            )
        return name, manager.namespace(name)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; ``False`` if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, FinishReason.ABORT)
        self.text_streams.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.forget(request_id)
            self._next_drafts = self._next_drafts.without(request_id)  # the id may return
        return True

    def migrate_out(self, request_id: str) -> Handover | None:
        """Stop running ``request_id`` here so another engine can continue it: its KV
        blocks are held (``PREFILLED``) for a pull, and freed by ``release_prefilled``.
        A request with no KV yet (queued, preempted, or waiting for a pull) is aborted
        and hands over no blocks: the next engine computes its tokens. ``None`` when the
        request is unknown or done. Nothing more is emitted for it here: every token it
        produced was in an earlier step's deltas."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished or request.status is RequestStatus.PREFILLED:
            return None
        if self.speculator is not None:
            self.speculator.forget(request_id)
        self._next_drafts = self._next_drafts.without(request_id)
        num_tokens = request.num_computed_tokens
        if request.status is not RequestStatus.RUNNING or not num_tokens:
            self.abort_request(request_id)
            return Handover((), 0)
        self.scheduler.hold(request)
        self.text_streams.pop(request_id, None)
        num_blocks = -(-num_tokens // self.runtime.block_size)
        return Handover(tuple(self.kv_cache.block_ids(request)[:num_blocks]), num_tokens)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --- disaggregation ----------------------------------------------------------------

    def take_kv_pulls(self) -> list[KVPull]:
        """Pulls the caller must now perform (see ``KVPull``), each answered exactly once
        by ``finish_kv_pull``. Drained by the caller after every ``step``."""
        pulls, self._kv_pulls = self._kv_pulls, []
        return pulls

    def finish_kv_pull(self, request_id: str, fill: Callable[[list[int]], None] | None) -> bool:
        """End a pull: ``fill(block_ids)`` writes the pulled KV into those local blocks
        (the pull's ``block_ids``) and the request runs; ``fill=None`` means the pull
        failed and the prompt is computed here. The engine thread owns the KV cache, so
        this runs on it, and ``fill`` is not called for a request aborted meanwhile
        (returns ``False``)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_KV:
            return False
        if fill is not None:
            first_block = request.num_cached_tokens // self.runtime.block_size
            fill(self.kv_cache.block_ids(request)[first_block:])
        self.scheduler.kv_arrived(request, ok=fill is not None)
        return True

    def prefilled_block_ids(self, request_id: str) -> list[int] | None:
        """Blocks holding a ``PREFILLED`` request's prompt KV, in prompt order."""
        request = self.scheduler.prefilled.get(request_id)
        return None if request is None else self.kv_cache.block_ids(request)

    def release_prefilled(self, request_id: str) -> bool:
        """A decode worker has the KV (or gave up): free the blocks, which stay findable
        in the prefix cache until evicted."""
        request = self.scheduler.prefilled.get(request_id)
        if request is None:
            return False
        self.scheduler.finish(request, None)
        del self.requests[request_id]
        return True

    # --- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        if self.broken is not None:
            raise RankLost(self.broken)
        start = time.perf_counter()
        try:
            return self._step()
        except RankLost as lost:
            self._rank_lost(str(lost))
            raise
        finally:
            self.busy_seconds += time.perf_counter() - start

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel engine (nothing to do at size 1).
        Idempotent; the engine is unusable afterwards."""
        if self.ranks is None:
            return
        ranks, self.ranks = self.ranks, None
        self._rank_watch.stop()
        if self.broken is None:
            with contextlib.suppress(RankLost):
                self.runner.stop_ranks()
        self.broken = self.broken or "the engine was closed"
        ranks.stop(STOP_TIMEOUT_S)
        if self.rank_control is not None:
            self.rank_control.close()

    def _rank_lost(self, reason: str) -> None:
        with self._structured_lock:  # the watcher and the engine thread may both call
            first = self.broken is None
            self.broken = self.broken or reason
        if first:
            log.error("tensor-parallel replica broken: %s", reason)
            if self._on_rank_lost is not None:
                self._on_rank_lost(reason)

    def _step(self) -> list[RequestDelta]:
        """Schedule (with the drafts proposed last step), execute, update, emit; then
        observe and propose for the next step.

        The proposal is made at the end of a step, not at the start of the next, because
        what happens between steps must not change it: a ``REMOTE`` request whose KV
        arrives in between (``finish_kv_pull``) decodes its first step plainly, as it
        always has (speculating there would change its step count, the counters and a
        seeded request's random stream), and a request aborted in between had its drafts
        dropped with it."""
        dropped = self._drop_unreadable_adapters() if self.runner.lora is not None else []
        drafts, self._next_drafts = self._next_drafts, Drafts()
        plan = self.scheduler.schedule(drafts.token_ids)
        self._kv_pulls.extend(plan.kv_pulls)
        self.last_step_idle = not plan.chunks
        if self.speculator is not None:
            for request in plan.preempted:
                self.speculator.forget(request.request_id)
        if not plan.chunks:
            return dropped
        result = self.runner.execute(plan, drafts.probs)
        self.num_steps += 1
        updates = self.scheduler.update(plan, result.sampled)
        deltas = [self._emit(u, result.logprobs.get(u.request.request_id, [])) for u in updates]
        deltas += dropped
        if self.speculator is not None:
            self._next_drafts = self._speculate(self.speculator, updates)
        self._track_kv_usage()
        events = self.block_pool.take_events()
        if events and self._on_kv_events is not None:
            self._on_kv_events(events)
        return deltas

    def _drop_unreadable_adapters(self) -> list[RequestDelta]:
        """End (``abort``) the requests of adapters this step may need that are in no
        slot, out of memory and can no longer be read (their files changed or went
        away), so one broken adapter fails its own requests, not the step."""
        s = self.scheduler
        queued = [*s.running, *s.waiting, *s.waiting_for_kv.values()]
        names = {r.lora_name for r in queued if r.lora_name is not None}
        failed = self.runner.lora.unreadable(names) if names else {}
        deltas = []
        for request in queued:
            why = failed.get(request.lora_name)
            if why is None or request.is_finished:
                continue
            log.error("request %s ends: %s", request.request_id, why)
            self.scheduler.finish(request, FinishReason.ABORT)
            self.requests.pop(request.request_id, None)
            self.text_streams.pop(request.request_id, None)
            if self.speculator is not None:
                self.speculator.forget(request.request_id)
            deltas.append(RequestDelta(request.request_id, [], "", FinishReason.ABORT.value, []))
        return deltas

    def _speculate(self, speculator: Speculator, updates: list[StepUpdate]) -> Drafts:
        """Feed the step's outcome to ``speculator``, then propose for the requests still
        running (finished ones, by a token stop or a stop string in ``_emit``, are gone).
        A constrained request's drafts end before the first token its grammar refuses."""
        for update in updates:
            speculator.observe(update)
            if update.request.is_finished:
                speculator.forget(update.request.request_id)
        drafts = speculator.propose(self.scheduler.running, self.runtime.max_model_len)
        if self._structured is None:
            return drafts
        return _within_grammar(drafts, self.requests)

    def _emit(self, update: StepUpdate, logprobs: list[TokenLogprobs]) -> RequestDelta:
        request = update.request
        reason = update.finish_reason
        try:
            complete = request.grammar is not None and StructuredOutputs.advance(
                request.grammar, update.new_token_ids
            )
        except RuntimeError as err:  # this request's output broke its grammar: end it alone
            log.error("request %s ends: %s", request.request_id, err)
            complete = False
            if reason is None:
                reason = FinishReason.ABORT
                self.scheduler.finish(request, reason)
        if complete and reason is None:  # the constraint is complete: nothing may follow
            reason = FinishReason.STOP
            self.scheduler.finish(request, reason)
        new_text = ""
        if self.detokenize:
            text = self.text_streams[request.request_id].push(
                update.new_token_ids, finishing=reason is not None
            )
            new_text = text.new_text
            if text.stop_string_hit and reason is None:
                reason = FinishReason.STOP
                self.scheduler.finish(request, reason)
        if reason is not None or update.handed_off:
            self.text_streams.pop(request.request_id, None)
        if reason is not None:
            self.requests.pop(request.request_id, None)
        return RequestDelta(
            request.request_id,
            update.new_token_ids,
            new_text,
            reason.value if reason else None,
            logprobs,
            prefilled=update.handed_off,
            num_cached_tokens=request.num_cached_tokens,
            queued_s=(request.admitted_time or request.arrival_time) - request.arrival_time,
        )

    # --- introspection -----------------------------------------------------------------

    def load(self) -> EngineLoad:
        s, pool = self.scheduler, self.block_pool
        queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in s.running)
        queued += sum(r.num_prompt_tokens for r in s.waiting)
        return EngineLoad(
            num_kv_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_waiting_for_kv=len(s.waiting_for_kv),
            num_prefilled=len(s.prefilled),
            queued_prefill_tokens=queued,
            num_preemptions=s.num_preemptions,
            spec_decode=None if self.speculator is None else replace(self.speculator.stats),
            busy_seconds=self.busy_seconds,
            lora_adapters={} if self.runner.lora is None else self.runner.lora.namespaces(),
            lora_running=_count_adapters(s.running),
            lora_waiting=_count_adapters([*s.waiting, *s.waiting_for_kv.values()]),
            max_loras=s.config.max_loras,
            lora_resident=() if self.runner.lora is None else tuple(self.runner.lora.resident()),
        )

    def kv_usage(self) -> KVUsage:
        pool = self.block_pool
        stored = sum(r.num_computed_tokens for r in self.scheduler.running)
        return KVUsage(
            used_blocks=pool.num_blocks - pool.num_free_blocks,
            stored_tokens=stored,
            block_size=self.runtime.block_size,
            bytes_per_token=self.runner.layout.bytes_per_token,
        )

    def _track_kv_usage(self) -> None:
        usage = self.kv_usage()
        if usage.used_blocks > self.peak_kv_usage.used_blocks:
            self.peak_kv_usage = usage

    def _validate(
        self,
        prompt: list[int],
        outputs: list[int],
        params: SamplingParams,
        mode: PrefillMode,
        num_remote_tokens: int = 0,
    ) -> None:
        if not prompt:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        for name, ids in (("prompt_token_ids", prompt), ("output_token_ids", outputs)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} contains {bad[0]}, outside the vocabulary [0, {vocab})")
        limit = self.runtime.max_model_len
        if len(prompt) + len(outputs) >= limit:
            raise ValueError(
                f"prompt has {len(prompt) + len(outputs)} tokens but max_model_len is {limit}; "
                "the prompt and at least one output token must fit"
            )
        if len(outputs) >= params.max_tokens:
            raise ValueError(
                f"output_token_ids already holds {len(outputs)} tokens, max_tokens is "
                f"{params.max_tokens}: nothing left to generate"
            )
        if mode is PrefillMode.REMOTE and not outputs:
            raise ValueError("output_token_ids must hold the prefill's first token")
        num_tokens = len(prompt) + len(outputs)
        remote = mode is PrefillMode.REMOTE
        if num_remote_tokens and (not remote or num_remote_tokens >= num_tokens):
            raise ValueError(
                f"the pulled KV may cover at most {num_tokens - 1} of the request's "
                f"{num_tokens} tokens (the last one is computed here), got {num_remote_tokens}"
                + ("" if remote else " for a request that pulls none")
            )
        if params.stop and not self.detokenize:
            raise ValueError("stop strings need an engine that detokenizes (detokenize=True)")


def _count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_name is not None:
            counts[request.lora_name] = counts.get(request.lora_name, 0) + 1
    return counts


@dataclass(frozen=True)
class Handover:
    """A sequence ``migrate_out`` took out of the running set: ``block_ids`` hold the KV
    of its first ``num_tokens`` tokens, in order (both empty/0: it had none yet)."""

    block_ids: tuple[int, ...]
    num_tokens: int


def _within_grammar(drafts: Drafts, requests: Mapping[str, Request]) -> Drafts:
    """``drafts`` with each constrained request's cut at its grammar's first refusal."""
    kept = {}
    for rid, proposal in drafts.proposals.items():
        request = requests.get(rid)
        if request is not None and request.grammar is not None:
            n = StructuredOutputs.valid_drafts(request.grammar, proposal.token_ids)
            if n == 0:
                continue
            if n < len(proposal.token_ids):
                probs = None if proposal.probs is None else proposal.probs[:n]
                proposal = Proposal(proposal.token_ids[:n], probs)
        kept[rid] = proposal
    return Drafts(kept)
