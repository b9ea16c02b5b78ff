"""Turn the last hidden state's logits into next tokens, for a whole batch at once.

Order of operations per row (all batched; the only Python loop is over *seeded* rows,
each drawing its own noise so its output does not depend on what else is in the batch):

1. raw log-probabilities, if any row asked for ``logprobs``;
2. ban EOS and stop tokens for rows still under ``min_tokens``; add ``logit_bias``;
3. repetition (prompt + output), frequency and presence (output) penalties;
4. greedy rows: argmax. Other rows: divide by temperature, keep top-k, then the smallest
   top-p nucleus, then drop tokens below ``min_p`` × the top probability, and sample
   with the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``, which draws from ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.common.sampling_params import SamplingParams
from tandem.engine.spec_decode.rejection import verify_greedy, verify_sampled


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one request this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...]
    """EOS/stop ids to forbid this step (non-empty only while under ``min_tokens``)."""


@dataclass(frozen=True)
class TokenLogprobs:
    token_logprob: float
    top: tuple[tuple[int, float], ...]
    """``(token id, log-probability)``, most likely first."""


@dataclass(frozen=True)
class RowGroup:
    """Consecutive logits rows of one request. A plain group is one row and yields one
    token. With ``draft_token_ids`` (k of them) it is k + 1 rows, one per drafted
    position and one after, and yields the accepted drafts plus one token of its own.
    ``draft_probs`` ``[k, V]``: the distributions the drafts were drawn from (``None``:
    a deterministic proposer)."""

    first_row: int
    draft_token_ids: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.draft_token_ids) + 1


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[list[int]]
    """Per group: the tokens it emits (one, or accepted drafts plus one)."""
    logprobs: list[list[TokenLogprobs]]
    """Per group: one entry per emitted token when the request asked for logprobs."""


class Sampler:
    """Stateless but for the generator that unseeded random rows draw from (seeded from
    the engine's ``seed``, so a whole run is reproducible)."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], groups: list[RowGroup]
    ) -> SamplerOutput:
        """``rows[i]`` describes logits row ``i`` (for drafted positions, with the drafts
        before it counted as output, so penalties and ``min_tokens`` see them)."""
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._ban_tokens(logits, rows)
        if any(r.params.logit_bias for r in rows):
            logits = apply_logit_bias(logits, rows)
        if any(r.params.uses_penalties for r in rows):
            logits = apply_penalties(logits, rows)
        tokens = self._emit(logits, rows, groups)
        logprobs = [
            _gather_logprobs(raw_logprobs, g, toks, rows)
            for g, toks in zip(groups, tokens, strict=True)
        ]
        return SamplerOutput(tokens, logprobs)

    def _emit(
        self, logits: torch.Tensor, rows: list[SamplingRow], groups: list[RowGroup]
    ) -> list[list[int]]:
        plain = [g.first_row for g in groups if not g.draft_token_ids]
        picked = {}
        if plain:
            index = torch.tensor(plain, device=logits.device)
            chosen = self._pick(logits.index_select(0, index), [rows[i] for i in plain])
            picked = dict(zip(plain, chosen.tolist(), strict=True))
        out = []
        for group in groups:
            if not group.draft_token_ids:
                out.append([picked[group.first_row]])
                continue
            span = slice(group.first_row, group.first_row + group.num_rows)
            out.append(self._verify(logits[span], rows[span], group))
        return out

    def _verify(self, logits: torch.Tensor, rows: list[SamplingRow], group: RowGroup) -> list[int]:
        params = rows[0].params
        if params.greedy:
            return verify_greedy(logits.argmax(dim=-1).tolist(), group.draft_token_ids)
        probs = filtered_probs(logits, rows)
        generator = rows[0].generator or self.generator
        return verify_sampled(probs, group.draft_token_ids, group.draft_probs, generator)

    def _ban_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, list(row.banned_token_ids)] = float("-inf")
        return logits

    def _pick(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return greedy
        index = torch.tensor(random_rows, device=logits.device)
        sub_rows = [rows[i] for i in random_rows]
        probs = filtered_probs(logits.index_select(0, index), sub_rows)
        greedy[index] = exponential_race(probs, [r.generator for r in sub_rows], self.generator)
        return greedy


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's ``logit_bias`` added to its logits (one scatter for the batch)."""
    row_ids, token_ids, biases = [], [], []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias:
            if token_id < logits.shape[1]:  # ids past the model's vocabulary: none drawn
                row_ids.append(i)
                token_ids.append(token_id)
                biases.append(bias)
    index = (
        torch.tensor(row_ids, device=logits.device),
        torch.tensor(token_ids, device=logits.device),
    )
    values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    return logits.index_put(index, values, accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    counts = _token_counts([r.output_token_ids for r in rows], vocab, device)
    in_prompt = _token_counts([r.prompt_token_ids for r in rows], vocab, device) > 0
    rep = _column([r.params.repetition_penalty for r in rows], device)
    freq = _column([r.params.frequency_penalty for r in rows], device)
    pres = _column([r.params.presence_penalty for r in rows], device)
    seen = in_prompt | (counts > 0)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied; rows of probabilities summing to 1."""
    device = logits.device
    logits = logits / _column([r.params.temperature for r in rows], device)
    if any(r.params.top_k is not None or r.params.top_p < 1.0 for r in rows):
        logits = _top_k_top_p(logits, rows)
    probs = logits.softmax(dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        min_p = _column([r.params.min_p for r in rows], device)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=device).unsqueeze(1)
    drop = ranks >= top_k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= _column([r.params.top_p for r in rows], device)
    drop[:, 0] = False  # the most likely token always survives
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def exponential_race(
    probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator
) -> torch.Tensor:
    """One draw per row from ``probs``: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d.
    Seeded rows draw their noise from their own generator, one row at a time; the
    others share one draw from ``shared``."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(
            len(unseeded), probs.shape[1], device=probs.device
        ).exponential_(generator=shared)
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    return (probs / noise.clamp_min(1e-20)).argmax(dim=-1)


def _gather_logprobs(
    raw: torch.Tensor | None, group: RowGroup, tokens: list[int], rows: list[SamplingRow]
) -> list[TokenLogprobs]:
    """Raw log-probabilities of each emitted token, from the row that produced it."""
    n = rows[group.first_row].params.logprobs
    if raw is None or n is None:
        return []
    row_ids = list(range(group.first_row, group.first_row + len(tokens)))
    chosen = raw[row_ids, tokens].tolist()
    top_values, top_ids = raw[row_ids].topk(n, dim=-1) if n else (None, None)
    out = []
    for j in range(len(tokens)):
        top = ()
        if n:
            top = tuple(zip(top_ids[j].tolist(), top_values[j].tolist(), strict=True))
        out.append(TokenLogprobs(chosen[j], top))
    return out


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    if width == 0:
        return torch.zeros(len(token_lists), vocab, device=device)
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    padded = torch.zeros(len(token_lists), vocab + 1, device=device)
    padded.scatter_add_(1, ids.to(device), torch.ones_like(ids, dtype=torch.float, device=device))
    return padded[:, :vocab]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
