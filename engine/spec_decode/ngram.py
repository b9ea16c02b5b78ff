"""Prompt lookup: if the last n tokens occurred earlier in the request (prompt or output),
propose the tokens that followed them there.

Free to run and exact when the output copies its input (editing, extraction, code that
repeats a pattern). The longest suffix (``max_n`` down to ``min_n``) with an earlier
match wins, and among its matches the most recent. Costs one vectorized scan of the
request's tokens per n per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.request import Request
from engine.spec_decode.proposer import Proposal


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[tuple[Request, int]]) -> dict[str, Proposal]:
        out = {}
        for request, k in requests:
            tokens = lookup(
                np.asarray(request.all_token_ids, dtype=np.int64), k, self.min_n, self.max_n
            )
            if tokens:
                out[request.request_id] = Proposal(tokens)
        return out

    def forget(self, request_id: str) -> None:
        """Stateless."""


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    matching suffix of ``tokens``."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
