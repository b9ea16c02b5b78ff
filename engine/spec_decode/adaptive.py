"""How many tokens to propose for one request, from how many it has been getting accepted.

With a per-token acceptance rate ``a`` (tracked as an exponential moving average), k
proposals yield on average ``E(k) = 1 + a + ... + a^k`` tokens per target pass, and cost
``1 + c * k`` target-pass equivalents, ``c`` being the estimated cost of one proposed token
(drafting it plus verifying it) relative to a plain decode step. The controller picks the
k in ``[0, k_max]`` maximizing ``E(k) / (1 + c * k)``: with acceptance near zero that is
k = 0, and the request decodes plainly, re-probing with k = 1 every ``PROBE_EVERY`` steps
so a request whose text turns predictable gets speculation back.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 16
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
    acceptance: float = INITIAL_ACCEPTANCE
    steps_without: int = 0

    def next_k(self, cost_per_token: float) -> int:
        k = best_k(self.acceptance, self.k_max, cost_per_token)
        if k > 0:
            return k
        self.steps_without += 1
        if self.steps_without >= PROBE_EVERY:
            self.steps_without = 0
            return 1
        return 0

    def observe(self, proposed: int, accepted: int) -> None:
        """``accepted`` of ``proposed`` drafts were accepted (in order) this step."""
        if proposed == 0:
            return
        # Per-token rate whose run lengths match what we saw: a^proposed ~ P(all accepted).
        rate = accepted / proposed if accepted < proposed else 1.0
        self.acceptance += SMOOTHING * (rate - self.acceptance)
