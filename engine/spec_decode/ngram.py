"""Prompt lookup: if the last n tokens occurred earlier in the request (prompt or output),
propose the tokens that followed them there.

Free to run and exact when the output copies its input (editing, extraction, code that
repeats a pattern). The longest suffix (``max_n`` down to ``min_n``) with an earlier
match wins, and among its matches the most recent. When the continuation runs into the
end of the text (the match is less than ``k`` tokens back, as in a loop) it is read as a
period and repeated: after ``a b c a b``, ``c a b c`` rather than just ``c a b``. Costs one
vectorized scan of the request's tokens per step, then one pass over the surviving
matches per further token matched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.engine.request import Request
from tandem.engine.spec_decode.proposer import Proposal


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
    matching suffix of ``tokens``; a continuation cut short by the end of ``tokens``
    repeats with the period ``len(tokens) - start``."""
    length = len(tokens)
    if length < 2:
        return []
    # Earlier positions holding the last token, then narrowed to those whose preceding
    # tokens match too, one more each round: what is left matches the longest suffix.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    n = 1 if ends.size else 0
    while n < max_n:
        room = ends[ends >= n]
        longer = room[tokens[room - n] == tokens[length - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if n < min_n:
        return []
    start = int(ends[-1]) + 1
    period = length - start
    if period >= k:
        return tokens[start : start + k].tolist()
    return np.resize(tokens[start:], k).tolist()
