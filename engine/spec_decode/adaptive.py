"""How many tokens to propose for one request, from how many it has been getting accepted.

With a per-token acceptance rate ``a``, k proposals yield on average
``E(k) = 1 + a + ... + a^k`` tokens per target pass, and cost ``1 + c * k`` target-pass
equivalents, ``c`` being the estimated cost of one proposed token
(drafting it plus verifying it) relative to a plain decode step. The controller picks the
k in ``[0, k_max]`` maximizing ``E(k) / (1 + c * k)``: with acceptance near zero that is
k = 0, and the request decodes plainly, re-probing with k = 1 after ``PROBE_EVERY`` steps
so a request whose text turns predictable gets speculation back. Each failed probe
doubles the wait before the next (up to ``MAX_PROBE_EVERY``); an accepted one resets it.

``a`` is estimated as drafts accepted / (drafts accepted + rejections), over exponentially
decayed counts: the maximum-likelihood rate when each draft is accepted with probability
``a`` until the first rejection. (Accepted / proposed would count the drafts after a
rejection, which were never tested, as failures: 2 of 4 accepted is a = 2/3, not 1/2.)
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 16
MAX_PROBE_EVERY = 256
SMOOTHING = 0.3
INITIAL_ACCEPTANCE = 0.6


def best_k(acceptance: float, k_max: int, cost_per_token: float) -> int:
    best, best_rate, expected, power = 0, 1.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        power *= acceptance
        expected += power
        rate = expected / (1.0 + cost_per_token * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class AdaptiveK:
    k_max: int
    accepted: float = INITIAL_ACCEPTANCE
    """Decayed count of accepted drafts per verification."""
    rejected: float = 1 - INITIAL_ACCEPTANCE
    """Decayed count of rejections per verification (0 or 1 each)."""
    steps_without: int = 0
    probe_every: int = PROBE_EVERY
    probing: bool = False

    @property
    def acceptance(self) -> float:
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else 0.0

    def next_k(self, cost_per_token: float) -> int:
        k = best_k(self.acceptance, self.k_max, cost_per_token)
        if k > 0:
            return k
        self.steps_without += 1
        if self.steps_without >= self.probe_every:
            self.steps_without = 0
            self.probing = True
            return 1
        return 0

    def observe(self, proposed: int, accepted: int) -> None:
        """``accepted`` of ``proposed`` drafts were accepted (in order) this step."""
        if proposed == 0:
            return
        if self.probing:
            self.probing = False
            failed = accepted == 0
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY) if failed else PROBE_EVERY
        self.accepted += SMOOTHING * (accepted - self.accepted)
        self.rejected += SMOOTHING * (float(accepted < proposed) - self.rejected)
