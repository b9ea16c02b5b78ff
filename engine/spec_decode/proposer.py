"""The proposer interface: guess up to k next tokens for running requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.engine.request import Request


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None = None
    """``[len(token_ids), V]``: the distribution each token was drawn from, for rejection
    sampling; ``None`` for a deterministic proposer (a point mass on each token)."""


class Proposer(Protocol):
    def propose(self, requests: Sequence[tuple[Request, int]]) -> dict[str, Proposal]:
        """For each ``(request, k)``: at most k tokens to follow ``request.all_token_ids``.
        A request may get no proposal (nothing worth guessing)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop any state kept for it."""
        ...
