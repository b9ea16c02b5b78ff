"""A request's life inside one engine: its tokens, its progress and its status.

Progress is counted in tokens, never in phases: ``num_computed_tokens`` (tokens whose
KV is in the cache) catches up with ``num_tokens`` (prompt + output). A prefix-cache
hit, a chunk of prefill, KV received from another worker and a decode step are all
just computed tokens. Torch-free.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    """Queued; holds no KV blocks."""
    RUNNING = "running"
    """Admitted; holds KV blocks and is scheduled every step until it finishes."""
    PREEMPTED = "preempted"
    """Evicted to free blocks; back in the queue and will recompute its KV."""
    WAITING_FOR_KV = "waiting_for_kv"
    """Holds blocks for its prompt; their KV is being pulled from a prefill worker."""
    PREFILLED = "prefilled"
    """Its KV stays held here for another worker to pull, until ``release``; done on
    this engine. A prefill worker's request after its first token (``HAND_OFF``), or a
    decode worker's running sequence handed to another decode worker (a migration)."""
    FINISHED = "finished"


class PrefillMode(enum.Enum):
    """Which part of a request this engine runs (disaggregated serving splits it)."""

    LOCAL = "local"
    """Prefill and decode here."""
    HAND_OFF = "hand_off"
    """Prefill worker: compute the prompt, sample the first token, then hold the KV."""
    REMOTE = "remote"
    """Decode worker: the KV of the first ``num_remote_tokens`` tokens (the prompt, from a
    prefill worker; or prompt and output, from a decode worker handing the sequence
    over) is pulled, then decode here."""


class FinishReason(enum.Enum):
    """Why a request stopped; ``.value`` is the vLLM-compatible string."""

    STOP = "stop"
    """An EOS token, a stop token id or a stop string."""
    LENGTH = "length"
    """``max_tokens`` reached, or the model's context is full."""
    ABORT = "abort"
    """Cancelled by the caller or failed."""


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    """Lower runs first; ties go to the earlier arrival."""
    prefill_mode: PrefillMode = PrefillMode.LOCAL
    output_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None
    """When the scheduler first gave it KV blocks (the end of its queue time)."""
    grammar: object | None = None
    """Its structured-output matcher (``tandem.engine.structured``), if constrained."""
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at the last admission."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_remote_tokens: int = 0
    """``REMOTE``: how many tokens, from the first, the pulled KV covers (0: the prompt)."""
    lora_name: str | None = None
    """The LoRA adapter it runs under (``None``: the base model)."""
    kv_namespace: str = ""
    """The root of its block hashes: the adapter's (``tandem.common.lora.kv_namespace``),
    empty for the base model, so KV is never shared across adapters."""
    num_lora_waits: int = 0
    """Steps it waited because its adapter found no free slot in the batch."""

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        if self.prefill_mode is PrefillMode.REMOTE and not self.num_remote_tokens:
            self.num_remote_tokens = self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
