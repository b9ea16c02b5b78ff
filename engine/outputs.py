"""What the engine hands back: per-step deltas (online) and whole results (offline)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.sampler import TokenLogprobs

if TYPE_CHECKING:
    from tandem.engine.llm_engine import Handover
    from tandem.engine.spec_decode.speculator import SpecDecodeStats


@dataclass(frozen=True)
class RequestDelta:
    """One request's progress in one engine step (the unit a server streams)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    """Text that became final this step (never a partial UTF-8 character, never the
    beginning of a stop string that might still match)."""
    finish_reason: str | None
    """``None`` while running; then ``"stop"``, ``"length"`` or ``"abort"``."""
    new_logprobs: list[TokenLogprobs]
    prefilled: bool = False
    """``HAND_OFF`` requests: the first token is out and the prompt KV is now held for a
    decode worker (release it with ``LLMEngine.release_prefilled``)."""
    num_cached_tokens: int = 0
    """Prompt tokens this engine did not compute (prefix cache hits, pulled KV)."""
    queued_s: float = 0.0
    """Arrival to first admission: the request's time in this engine's queue."""
    handover: Handover | None = None
    """Set on the last delta of a request ``migrate_out`` took off this engine: where its
    KV is held for the next one."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A finished (or aborted) request, as the offline ``LLM.generate`` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class KVUsage:
    """KV memory in use against the ideal (exactly the computed tokens, no padding)."""

    used_blocks: int
    stored_tokens: int
    block_size: int
    bytes_per_token: int

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_size * self.bytes_per_token

    @property
    def ideal_bytes(self) -> int:
        return self.stored_tokens * self.bytes_per_token

    @property
    def waste(self) -> float:
        """Fraction of allocated slots holding no token (0 when nothing is allocated)."""
        slots = self.used_blocks * self.block_size
        return 1 - self.stored_tokens / slots if slots else 0.0


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of how busy an engine is (published by workers, read by the router)."""

    num_kv_blocks: int
    num_free_blocks: int
    """Allocatable now: never-used plus evictable cached blocks."""
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_prefilled: int
    """Requests whose prompt KV is held for a decode worker to pull."""
    queued_prefill_tokens: int
    """Prompt tokens admitted or queued but not computed yet."""
    num_preemptions: int
    spec_decode: SpecDecodeStats | None = None
    """Speculative decoding's counters (``None``: the engine does not speculate)."""
    busy_seconds: float = 0.0
    """Time spent in ``step()`` since start (the denominator of the proposer's share)."""
    lora_adapters: Mapping[str, str] = field(default_factory=dict)
    """LoRA adapters loaded: name -> KV namespace (``tandem.common.lora``)."""
    lora_running: Mapping[str, int] = field(default_factory=dict)
    """Running requests per adapter (vLLM's ``lora_requests_info``)."""
    lora_waiting: Mapping[str, int] = field(default_factory=dict)
    """Queued requests per adapter."""
    max_loras: int = 0
    """Adapters one batch may mix (0: LoRA off)."""
    lora_resident: tuple[str, ...] = ()
    """Adapters in a slot or in memory here (the others are read from disk when used)."""
