"""The scaling policies the planner simulation compares, behind ``elastic.Scaler``.

* ``PlannerScaler`` — Tandem's SLO planner: the real ``CapacityModel`` and ``Decider``
  (``tandem.planner.policy``), fed the ``Signals`` that the real
  ``tandem.planner.signals.signals`` computes from two rounds of scrapes, exactly as
  ``tandem.planner.loop.Planner.tick`` does (only components present in both rounds
  count; the current count is the actuator's). The decider's clock is the simulation's.
* ``HpaScaler`` — a Kubernetes HorizontalPodAutoscaler per pool on queue length and
  utilisation, with the HPA's own algorithm and defaults: ``desired = ceil(current *
  metric / target)`` per metric (average value per ready pod), the largest over the
  metrics; a 10% tolerance; pods not ready count as using nothing when scaling up and
  exactly the target when scaling down; a 300 s stabilisation window on the way down
  (the highest recommendation of the window), none on the way up; at most
  ``max(2 * current, current + 4)`` per 15 s sync period.
* ``StaticScaler`` — a fixed fleet (never asked).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

from tandem.bench.sim.elastic import POOLS, FleetScrape
from tandem.planner.policy import CapacityModel, Decider, Decision, PlannerConfig, PoolBounds
from tandem.planner.signals import Signals, signals


class SignalReader:
    """``Signals`` from two consecutive rounds of scrapes, as the planner's loop makes
    them: the interval between the rounds, and only replicas scraped in both."""

    def __init__(self) -> None:
        self._previous: FleetScrape | None = None

    def read(self, scrape: FleetScrape) -> Signals | None:
        """The signals since the previous round (``None`` on the first)."""
        previous, self._previous = self._previous, scrape
        if previous is None or scrape.at_s <= previous.at_s:
            return None
        pre = [name for name in scrape.prefill if name in previous.prefill]
        dec = [name for name in scrape.decode if name in previous.decode]
        return signals(
            scrape.at_s - previous.at_s,
            (previous.router, scrape.router),
            ([previous.prefill[n] for n in pre], [scrape.prefill[n] for n in pre]),
            ([previous.decode[n] for n in dec], [scrape.decode[n] for n in dec]),
        )


class PlannerScaler:
    name = "planner"

    def __init__(self, config: PlannerConfig, interval_s: float = 10.0) -> None:
        """``interval_s``: ``tandem planner --planner-interval``'s default."""
        self.config = config
        self.interval_s = interval_s
        self.model = CapacityModel(config)
        self._now = 0.0
        self.decider = Decider(config, clock=lambda: self._now)
        self.reader = SignalReader()
        self.changes: list[tuple[float, Decision]] = []
        """Every decision that changed a pool, with its time (for reports)."""

    def decide(
        self, now: float, scrape: FleetScrape, replicas: Mapping[str, int]
    ) -> Mapping[str, int]:
        self._now = now
        s = self.reader.read(scrape)
        if s is None:
            return replicas
        self.model.observe(s)
        targets = dict(replicas)
        for estimate in self.model.estimate(s):
            estimate = replace(estimate, current=replicas[estimate.pool])
            decision = self.decider.decide(estimate)
            targets[decision.pool] = decision.target
            if decision.changes:
                self.changes.append((now, decision))
        return targets


@dataclass(frozen=True)
class HpaConfig:
    prefill_busy: float
    """Target engine busy share per prefill replica (0-1]."""
    prefill_queued_tokens: float
    """Target queued prompt tokens per prefill replica."""
    decode_sequences: float
    """Target sequences (running and waiting) per decode replica."""
    prefill: PoolBounds
    decode: PoolBounds
    sync_s: float = 15.0
    """``--horizontal-pod-autoscaler-sync-period``'s default."""
    tolerance: float = 0.1
    down_window_s: float = 300.0
    up_pods: int = 4
    up_factor: float = 2.0
    """Per sync period: at most ``max(current * up_factor, current + up_pods)``."""

    def __post_init__(self) -> None:
        for name in ("prefill_busy", "prefill_queued_tokens", "decode_sequences", "sync_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def hpa_replicas(current: int, ready: int, total: float, target: float, tolerance: float) -> int:
    """One metric's recommendation, as the HPA computes it for an average-value target:
    ``total`` is the metric summed over the ``ready`` pods that report it, out of
    ``current`` pods."""
    if ready == 0 or current == 0:
        return current
    ratio = total / (ready * target)
    if abs(ratio - 1) <= tolerance:
        return current
    missing = max(0, current - ready)
    if ratio > 1:  # pods without metrics are assumed idle on the way up ...
        adjusted = total / (current * target)
    else:  # ... and exactly at the target on the way down
        adjusted = (total + missing * target) / (current * target)
    if abs(adjusted - 1) <= tolerance or (adjusted > 1) != (ratio > 1):
        return current
    return math.ceil(current * adjusted - 1e-9)


class HpaScaler:
    name = "hpa"

    def __init__(self, config: HpaConfig) -> None:
        self.config = config
        self.interval_s = config.sync_s
        self.reader = SignalReader()
        self._history: dict[str, deque[tuple[float, int]]] = {pool: deque() for pool in POOLS}

    def decide(
        self, now: float, scrape: FleetScrape, replicas: Mapping[str, int]
    ) -> Mapping[str, int]:
        s = self.reader.read(scrape)
        if s is None:
            return replicas
        return {pool: self._pool(now, pool, s, replicas[pool]) for pool in POOLS}

    def _pool(self, now: float, pool: str, s: Signals, current: int) -> int:
        c = self.config
        if pool == "prefill":
            p, bounds = s.prefill, c.prefill
            metrics = [
                (p.busy * p.replicas, c.prefill_busy),
                (p.queued_prefill_tokens, c.prefill_queued_tokens),
            ]
        else:
            p, bounds = s.decode, c.decode
            metrics = [(p.running + p.waiting, c.decode_sequences)]
        wanted = max(hpa_replicas(current, p.replicas, t, g, c.tolerance) for t, g in metrics)
        wanted = bounds.clamp(wanted)
        history = self._history[pool]
        history.append((now, wanted))
        while history[0][0] < now - c.down_window_s:
            history.popleft()
        if wanted < current:  # the highest recommendation of the window, not above now
            wanted = min(current, max(n for _, n in history))
        limit = max(math.floor(current * c.up_factor), current + c.up_pods)
        return bounds.clamp(min(wanted, limit))


class StaticScaler:
    name = "static"
    interval_s = None

    def decide(
        self, now: float, scrape: FleetScrape, replicas: Mapping[str, int]
    ) -> Mapping[str, int]:
        return replicas
