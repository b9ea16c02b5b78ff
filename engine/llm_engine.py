"""The online engine: requests in, per-step deltas out.

``step()`` is the whole loop — schedule, execute, update — plus the text side
(detokenize, stop strings). Servers call ``add_request`` / ``abort_request`` between
steps and stream the deltas; the offline ``LLM`` drives the same loop to completion.
Single-threaded: call it from one thread (workers run it in a dedicated thread).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from engine.block_pool import BlockPool
from engine.config import EngineConfig, EngineRuntime, num_kv_blocks, resolve_runtime
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import KVCacheLayout, ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import KVUsage, RequestDelta
from engine.request import FinishReason, Request
from engine.sampler import TokenLogprobs
from engine.scheduler import Scheduler, SchedulerConfig, StepUpdate
from tandem.kv_events import KVCacheEvent
from tandem.model_config import ModelConfig
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer

KVEventCallback = Callable[[list[KVCacheEvent]], None]


class LLMEngine:
    def __init__(self, config: EngineConfig, on_kv_events: KVEventCallback | None = None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.eos_token_ids = self.tokenizer.eos_token_ids | self.model_config.eos_token_ids
        self.runtime: EngineRuntime = resolve_runtime(config, self.model_config)
        self._on_kv_events = on_kv_events
        mc, rt = self.model_config, self.runtime
        layout = KVCacheLayout(rt.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, rt.dtype)
        self.runner = ModelRunner(
            config.model, mc, layout, rt.backend, rt.device, self.eos_token_ids, config.seed
        )
        self.num_kv_blocks = num_kv_blocks(config, rt, layout.bytes_per_block)
        self.runner.allocate_kv_cache(self.num_kv_blocks)
        self.block_pool = BlockPool(self.num_kv_blocks, config.enable_prefix_caching)
        self.kv_cache = KVCacheManager(self.block_pool, rt.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=rt.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.kv_cache,
            self.eos_token_ids,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.peak_kv_usage = self.kv_usage()
        self._ids = itertools.count()

    # --- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate and queue a request; raises ``ValueError`` naming the bad field."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(token_ids)
        request = Request(request_id, token_ids, params or SamplingParams(), priority)
        self.requests[request_id] = request
        self.outputs.add(request)
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; ``False`` if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, FinishReason.ABORT)
        self.outputs.remove(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        result = self.runner.execute(plan)
        updates = self.scheduler.update(plan, result.sampled)
        deltas = [self._emit(u, result.logprobs.get(u.request.request_id, [])) for u in updates]
        self._track_kv_usage()
        events = self.block_pool.take_events()
        if events and self._on_kv_events is not None:
            self._on_kv_events(events)
        return deltas

    def _emit(self, update: StepUpdate, logprobs: list[TokenLogprobs]) -> RequestDelta:
        request = update.request
        text = self.outputs.process(request, update.new_token_ids, update.finish_reason is not None)
        reason = update.finish_reason
        if text.stop_string_hit and reason is None:
            reason = FinishReason.STOP
            self.scheduler.finish(request, reason)
        if reason is not None:
            self.requests.pop(request.request_id, None)
            self.outputs.remove(request.request_id)
        return RequestDelta(
            request.request_id,
            update.new_token_ids,
            text.new_text,
            reason.value if reason else None,
            logprobs,
        )

    # --- introspection -----------------------------------------------------------------

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

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {vocab})"
            )
        limit = self.runtime.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {limit}; "
                "the prompt and at least one output token must fit"
            )
