"""Verify drafted tokens against the target's distributions (Leviathan et al. 2023;
Chen et al. 2023).

With target distributions p_1..p_{k+1} (rows for the positions of the k drafts and the
one after them) and drafts d_j drawn from q_j:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), in order;
    at the first rejection, emit a token from  normalize(max(0, p_j - q_j))  and stop;
    if all k are accepted, emit a bonus token from p_{k+1}.

Every emitted token is then distributed exactly as p (the residual makes up for the
mass the draft over-proposed). A deterministic proposer (n-gram lookup) is the case
q_j = one-hot(d_j): accept with probability p_j(d_j), resample from p_j without d_j.
Greedy requests compare with the target's argmax instead: identical to decoding without
speculation.
"""

from __future__ import annotations

import torch


def verify_greedy(target_argmax: list[int], drafts: tuple[int, ...]) -> list[int]:
    """Accepted drafts, then the target's token at the first mismatch (or the bonus)."""
    out = []
    for j, draft in enumerate(drafts):
        if draft != target_argmax[j]:
            break
        out.append(draft)
    out.append(target_argmax[len(out)])
    return out


def verify_sampled(
    p: torch.Tensor,
    drafts: tuple[int, ...],
    q: torch.Tensor | None,
    generator: torch.Generator,
) -> list[int]:
    """``p``: ``[k + 1, V]`` target probabilities; ``q``: ``[k, V]`` draft probabilities,
    ``None`` for a deterministic proposer."""
    k = len(drafts)
    uniforms = torch.rand(k, generator=generator, device=p.device).tolist()
    accepted_p = p[torch.arange(k), list(drafts)].tolist()
    accepted_q = q[torch.arange(k), list(drafts)].tolist() if q is not None else [1.0] * k
    out = []
    for j, draft in enumerate(drafts):
        if uniforms[j] * accepted_q[j] < accepted_p[j]:
            out.append(draft)
            continue
        out.append(sample(residual(p[j], None if q is None else q[j], draft), generator))
        return out
    out.append(sample(p[k], generator))
    return out


def residual(p: torch.Tensor, q: torch.Tensor | None, draft: int) -> torch.Tensor:
    """``max(0, p - q)``, unnormalized; with no ``q``, ``p`` without the draft token."""
    if q is None:
        out = p.clone()
        out[draft] = 0.0
    else:
        out = (p - q).clamp_min(0.0)
    if float(out.sum()) <= 0.0:  # p == q: rejection had probability 0; keep p
        return p
    return out


def sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One draw proportional to ``weights`` (exponential race, as the sampler does)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise.clamp_min(1e-20)).argmax())
