"""Runs speculation for an engine: decides who speculates with what k, asks the
proposers, keeps the adaptive k and the counters.

Called by ``LLMEngine.step`` after each update: requests that are decoding (one token
to compute), allowed to speculate (engine default or ``SamplingParams.speculative``) and
far enough from ``max_tokens`` get a proposal in the returned ``Drafts``, which the
engine hands to the next step: the token ids to ``Scheduler.schedule``, the draft
distributions to ``ModelRunner.execute``. Never touches tensors except to pass those
distributions along; never mutates a ``Request``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tandem.common.sampling_params import SpecMethod
from tandem.engine.request import PrefillMode, Request
from tandem.engine.scheduler import StepUpdate
from tandem.engine.spec_decode.adaptive import AdaptiveK
from tandem.engine.spec_decode.proposer import Proposal, Proposer

VERIFY_COST_PER_TOKEN = 0.05
"""Verifying one more position costs little next to a decode step at small batch."""


@dataclass
class SpecDecodeStats:
    """Counters since start; ``dataclasses.replace(stats)`` is a consistent snapshot."""

    num_verifications: int = 0
    """Request-steps that verified at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    """Tokens emitted by verifying steps (accepted drafts plus the target's own)."""
    num_request_passes: int = 0
    """Request-steps that emitted tokens, speculating or not: each is one pass of the
    target over that request."""
    num_pass_tokens: int = 0
    """Tokens those passes emitted."""
    proposer_seconds: float = 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Tokens a request gets per target pass (1.0 without speculation)."""
        return self.num_pass_tokens / self.num_request_passes if self.num_request_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_verification(self) -> float:
        return self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0

    @property
    def tokens_per_verification(self) -> float:
        return self.num_emitted_tokens / self.num_verifications if self.num_verifications else 0.0


@dataclass(frozen=True)
class Drafts:
    """The proposals for one step, by request id. A request without an entry does not
    speculate that step; an entry's tokens follow the request's ``all_token_ids`` as they
    stood when it was proposed."""

    proposals: Mapping[str, Proposal] = field(default_factory=dict)

    @property
    def token_ids(self) -> dict[str, tuple[int, ...]]:
        """The drafts to verify, for ``Scheduler.schedule`` (token ids only: the scheduler
        is torch-free)."""
        return {rid: tuple(p.token_ids) for rid, p in self.proposals.items()}

    @property
    def probs(self) -> dict[str, torch.Tensor]:
        """``[k, V]`` distributions of the drafts that were sampled, for
        ``ModelRunner.execute`` (the rejection sampler); deterministic drafts have none."""
        return {rid: p.probs for rid, p in self.proposals.items() if p.probs is not None}

    def without(self, request_id: str) -> Drafts:
        """These drafts less ``request_id``'s (the request left before they were used)."""
        return Drafts({rid: p for rid, p in self.proposals.items() if rid != request_id})


@dataclass(frozen=True)
class SpeculationConfig:
    method: SpecMethod
    """The engine's default method (a request may pick another configured one)."""
    num_tokens: int
    adaptive: bool = True
    enabled_by_default: bool = True


class Speculator:
    def __init__(
        self,
        config: SpeculationConfig,
        proposers: Mapping[SpecMethod, Proposer],
        drafting_cost: Mapping[SpecMethod, float],
    ) -> None:
        """``drafting_cost``: the cost of proposing one token relative to a target decode
        step (0 for n-gram lookup; ``build.relative_step_cost`` for a draft model). A
        fixed estimate, not a timing, so that k, and with it a seeded request's random
        stream, never depends on how fast the machine happened to be."""
        if config.method not in proposers:
            raise ValueError(f"no proposer for the default method {config.method.value!r}")
        self.config = config
        self.proposers = dict(proposers)
        self.stats = SpecDecodeStats()
        self._controllers: dict[str, AdaptiveK] = {}
        self._cost = {m: drafting_cost.get(m, 0.0) + VERIFY_COST_PER_TOKEN for m in proposers}

    def propose(self, running: Sequence[Request], max_model_len: int) -> Drafts:
        """Proposals for the requests of ``running`` that speculate next step (see the
        module docstring). Advances their adaptive k; leaves the requests untouched."""
        by_method: dict[SpecMethod, list[tuple[Request, int]]] = {}
        for request in running:
            method, k = self._plan(request, max_model_len)
            if k > 0:
                by_method.setdefault(method, []).append((request, k))
        proposals: dict[str, Proposal] = {}
        for method, batch in by_method.items():
            start = time.perf_counter()
            made = self.proposers[method].propose(batch)
            self.stats.proposer_seconds += time.perf_counter() - start
            for request, _ in batch:
                if request.request_id in made:
                    proposals[request.request_id] = made[request.request_id]
        return Drafts(proposals)

    def observe(self, update: StepUpdate) -> None:
        stats = self.stats
        if update.new_token_ids:
            stats.num_request_passes += 1
            stats.num_pass_tokens += len(update.new_token_ids)
        if not update.num_draft_tokens:
            return
        accepted = update.num_accepted_drafts
        stats.num_verifications += 1
        stats.num_draft_tokens += update.num_draft_tokens
        stats.num_accepted_tokens += accepted
        stats.num_emitted_tokens += len(update.new_token_ids)
        controller = self._controllers.get(update.request.request_id)
        if controller is not None:
            controller.observe(update.num_draft_tokens, accepted)

    def forget(self, request_id: str) -> None:
        self._controllers.pop(request_id, None)
        for proposer in self.proposers.values():
            proposer.forget(request_id)

    def _plan(self, request: Request, max_model_len: int) -> tuple[SpecMethod, int]:
        options = request.sampling_params.speculative
        enabled = self.config.enabled_by_default if options.enabled is None else options.enabled
        method = options.method or self.config.method
        if (
            not enabled
            or method not in self.proposers
            or request.prefill_mode is PrefillMode.HAND_OFF
            or request.num_uncomputed_tokens != 1
            # the draft model knows the base only: an adapter's requests do not draft
            or (method is SpecMethod.DRAFT and request.lora_name is not None)
        ):
            return method, 0
        k_max = options.num_tokens or self.config.num_tokens
        room = (
            min(
                request.sampling_params.max_tokens - request.num_output_tokens,
                max_model_len - request.num_tokens,
            )
            - 1
        )
        k = min(k_max, room)
        if k <= 0:
            return method, 0
        if not self.config.adaptive:
            return method, k
        controller = self._controllers.setdefault(request.request_id, AdaptiveK(k_max))
        return method, min(k, controller.next_k(self._cost[method]))
