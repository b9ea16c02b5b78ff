"""How many prefill and decode replicas to run: a capacity model calibrated from what the
replicas measurably do, a forecast for the time a new replica takes to start, and a
decider with hysteresis, cooldowns and bounds.

**Prefill pool** (time to first token): load = prompt tokens per second that must be
computed (arrivals less prefix-cache hits); capacity = one replica's computed tokens per
second of engine busy time (measured), planned at ``target_busy`` so queues stay short
under the TTFT target. **Decode pool** (time per output token): load = sequences running
or waiting, or, if more, the sequences the arrivals need at the TPOT target (request rate
x mean output tokens x target); capacity = sequences one replica holds at the TPOT target:
within the target, the output tokens per second a loaded replica makes times the target;
over it, the sequences it runs now scaled by ``target / observed`` (this errs low, i.e.
towards more replicas). Both forecasts add the load's rising trend over ``lead_s``
(Holt's linear smoothing), because a replica takes minutes to start; a falling trend is
ignored, so the pools shrink on what is, not on what may be. A step is not smoothed: an
interval whose load exceeds the forecast by more than ``surge`` resets it, and while an
SLO is broken the pool is sized on the larger of the forecast and the latest interval.
An SLO already broken adds a replica whatever the model says. A pool whose load needs at
most ``tolerance`` more than its replicas carry keeps its size (noise near a whole
number of replicas must not add one).

The decider moves at most ``max_step_up`` up at once, one down at a time, only after the
lower count was wanted for ``down_stable_s``. The up-cooldown holds back only the SLO
guard's extra replica (a reaction to the count as it is, which must first take effect);
the count the load asks for is absolute, so it is acted on at once. Scaling down is
always a drain (the actuator's job): no request is lost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.planner.signals import Signals


@dataclass(frozen=True)
class PoolBounds:
    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"replica bounds must satisfy 0 <= min <= max, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True)
class PlannerConfig:
    ttft_p99_s: float = 2.0
    """The time-to-first-token target (prefill pool)."""
    tpot_p99_s: float = 0.1
    """The time-per-output-token target (decode pool)."""
    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    target_busy: float = 0.7
    """Prefill replicas are planned to be busy this share of the time at the forecast."""
    lead_s: float = 120.0
    """How far ahead to forecast: about the time a new replica takes to serve."""
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    down_stable_s: float = 60.0
    """A lower count must have been wanted this long before a replica is drained."""
    max_step_up: int = 4
    prefill_tokens_per_s: float | None = None
    """Prior for one prefill replica's computed tokens per busy second (until measured)."""
    decode_seqs_per_replica: float | None = None
    """Prior for the sequences one decode replica holds at the TPOT target."""
    smoothing: float = 0.3
    """Weight of a new measurement in the calibration and the forecast (0-1]."""
    tolerance: float = 0.2
    """A pool is not grown while its load needs at most this share more than it carries."""
    surge: float = 0.25
    """An interval's load above the forecast by more than this share is a step: the
    forecast restarts from it instead of smoothing it in."""

    def __post_init__(self) -> None:
        for name in ("ttft_p99_s", "tpot_p99_s", "lead_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.target_busy <= 1:
            raise ValueError(f"target_busy must be in (0, 1], got {self.target_busy}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        for name in ("tolerance", "surge"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_step_up < 1:
            raise ValueError(f"max_step_up must be >= 1, got {self.max_step_up}")


class Forecast:
    """Holt's linear smoothing of one load signal: level and trend per second. A value
    above the level by more than ``surge`` (a share of it) is a step: the level jumps to
    it and the trend is kept (a step is not a slope). ``latest`` is the last value."""

    def __init__(self, alpha: float, surge: float = math.inf) -> None:
        self.alpha, self.surge = alpha, surge
        self.level: float | None = None
        self.trend = 0.0
        self.latest = 0.0

    def observe(self, value: float, dt: float) -> None:
        self.latest = value
        if self.level is None or value > self.level * (1 + self.surge):
            self.level = value
            return
        previous = self.level
        # A load is never negative: a falling trend must not carry the level below zero
        # (it would then climb back through zero long after the load is gone).
        self.level = max(0.0, self.alpha * value + (1 - self.alpha) * (previous + self.trend * dt))
        slope = (self.level - previous) / dt if dt > 0 else 0.0
        self.trend = self.alpha * slope + (1 - self.alpha) * self.trend

    def ahead(self, lead_s: float) -> float:
        """The level plus the rising part of the trend over ``lead_s``."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + max(0.0, self.trend) * lead_s)


class _Ewma:
    def __init__(self, alpha: float, prior: float | None) -> None:
        self.alpha, self.value = alpha, prior

    def observe(self, sample: float | None) -> None:
        if sample is None or not math.isfinite(sample) or sample <= 0:
            return
        self.value = (
            sample if self.value is None else (self.alpha * sample + (1 - self.alpha) * self.value)
        )


@dataclass(frozen=True)
class Estimate:
    """The model's answer for one pool, with what it was computed from."""

    pool: str
    current: int
    wanted: int
    load: float
    forecast: float
    capacity_per_replica: float | None
    slo_broken: bool
    load_wanted: int = 0
    """What the load alone asks for (``wanted`` less the SLO guard's extra replica): an
    absolute count, which the up-cooldown does not hold back."""


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    wanted: int
    target: int
    reason: str
    estimate: Estimate

    @property
    def changes(self) -> bool:
        return self.target != self.current


class CapacityModel:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        a = config.smoothing
        self.prefill_tps = _Ewma(a, config.prefill_tokens_per_s)
        self.decode_seqs = _Ewma(a, config.decode_seqs_per_replica)
        self.prefill_load = Forecast(a, config.surge)
        self.decode_load = Forecast(a, config.surge)

    def observe(self, s: Signals) -> None:
        c = self.config
        self.prefill_tps.observe(s.prefill.tokens_per_busy_second)
        self.decode_seqs.observe(self._decode_capacity(s))
        computed_share = 1.0 - s.prefill.cached_share
        self.prefill_load.observe(s.prompt_token_rate * computed_share, s.interval_s)
        # Sequences held understate what a pool with room to spare needs: each runs
        # faster, so fewer run at once, and a pool sized on them shrinks, slows down and
        # grows back, over and over. What the arrivals need at the TPOT target (Little's
        # law) does not depend on the pool's size.
        at_target = s.request_rate * (s.mean_output_tokens or 0.0) * c.tpot_p99_s
        self.decode_load.observe(max(s.decode.running + s.decode.waiting, at_target), s.interval_s)

    def _decode_capacity(self, s: Signals) -> float | None:
        """What this interval says of the sequences one decode replica holds at the TPOT
        target (``None``: nothing)."""
        target = self.config.tpot_p99_s
        per_replica = s.decode.running / max(1, s.decode.replicas)
        if not s.tpot_p99 or per_replica < 1:
            return None
        tokens_per_s, mean = s.decode.tokens_per_busy_second, s.tpot_mean
        if tokens_per_s is None or mean is None:
            return per_replica * target / s.tpot_p99
        # The output tokens a replica made per second over the interval, held for the
        # target's time. A replica's throughput climbs with its batch to a ceiling
        # (beyond the target too, but by little there: the SLO guard covers it), so a
        # loaded replica tells it well; on a light one (mean TPOT under a quarter of the
        # target) a step's fixed cost hides the cost per sequence, and sizing on that
        # would grow the pool, lighten it further and grow it again.
        if mean < target / 4:
            return None
        return tokens_per_s * target

    def estimate(self, s: Signals) -> tuple[Estimate, Estimate]:
        c = self.config
        ttft_broken = s.ttft_p99 is not None and s.ttft_p99 > c.ttft_p99_s
        tpot_broken = s.tpot_p99 is not None and s.tpot_p99 > c.tpot_p99_s
        prefill_forecast = self._sized_load(self.prefill_load, ttft_broken)
        tps = self.prefill_tps.value
        prefill_per_replica = tps * c.target_busy if tps else None
        prefill_for_load = self._replicas(prefill_forecast, prefill_per_replica, s.prefill.replicas)
        queued = s.prefill.queued_prefill_tokens
        if ttft_broken and prefill_per_replica and queued > 0:
            # The queue must be computed within the TTFT target, on top of what arrives:
            # after a step up in load, it is what the forecast has not caught up with.
            drain = prefill_forecast + queued / c.ttft_p99_s
            prefill_for_load = max(prefill_for_load, math.ceil(drain / prefill_per_replica))
        prefill_wanted = prefill_for_load
        if ttft_broken and (queued > 0 or s.prefill.busy > c.target_busy):
            prefill_wanted = max(prefill_for_load, s.prefill.replicas + 1)
        decode_forecast = self._sized_load(self.decode_load, tpot_broken)
        seqs = self.decode_seqs.value
        decode_for_load = self._replicas(decode_forecast, seqs, s.decode.replicas)
        decode_wanted = decode_for_load
        if tpot_broken:
            decode_wanted = max(decode_for_load, s.decode.replicas + 1)
        return (
            Estimate(
                "prefill", s.prefill.replicas, c.prefill.clamp(prefill_wanted),
                self.prefill_load.level or 0.0, prefill_forecast, tps, ttft_broken,
                c.prefill.clamp(prefill_for_load),
            ),
            Estimate(
                "decode", s.decode.replicas, c.decode.clamp(decode_wanted),
                self.decode_load.level or 0.0, decode_forecast, seqs, tpot_broken,
                c.decode.clamp(decode_for_load),
            ),
        )  # fmt: skip

    def _sized_load(self, load: Forecast, slo_broken: bool) -> float:
        """The load a pool is sized for: the forecast ``lead_s`` ahead, or, while its SLO
        is broken, the latest interval's if more (the forecast still lags a step)."""
        ahead = load.ahead(self.config.lead_s)
        return max(ahead, load.latest) if slo_broken else ahead

    def _replicas(self, load: float, per_replica: float | None, current: int) -> int:
        """Replicas for ``load`` at ``per_replica`` each (``None``: not yet measured); a
        pool short of it by no more than ``tolerance`` of what it carries keeps its size."""
        if not per_replica:
            return _uncalibrated(load, current)
        needed = load / per_replica
        within_tolerance = current < needed <= current * (1 + self.config.tolerance)
        return current if within_tolerance else math.ceil(needed)


def _uncalibrated(forecast: float, replicas: int) -> int:
    """Replicas wanted before a replica's capacity was ever measured: the pool as it is,
    unless less than one unit of load (a sequence, a token per second) is forecast, when
    nothing beyond the pool's minimum is needed."""
    return replicas if forecast >= 1.0 else 0


class Decider:
    """Hysteresis and cooldowns over the model's wanted counts, per pool."""

    def __init__(self, config: PlannerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._last_change: dict[str, float] = {}
        self._lower_since: dict[str, float] = {}

    def decide(self, estimate: Estimate) -> Decision:
        c, now, pool = self.config, self.clock(), estimate.pool
        current, wanted = estimate.current, estimate.wanted
        since_change = now - self._last_change.get(pool, -math.inf)
        if wanted > current:
            self._lower_since.pop(pool, None)
            if since_change < c.scale_up_cooldown_s:
                if estimate.load_wanted <= current:
                    return self._keep(estimate, f"up-cooldown ({since_change:.0f} s)")
                wanted = estimate.load_wanted  # the guard's extra replica waits
            target = min(wanted, current + c.max_step_up)
            return self._change(estimate, target, "slo" if estimate.slo_broken else "load")
        if wanted < current:
            lower_since = self._lower_since.setdefault(pool, now)
            if now - lower_since < c.down_stable_s:
                return self._keep(estimate, f"lower for {now - lower_since:.0f} s")
            if since_change < c.scale_down_cooldown_s:
                return self._keep(estimate, f"down-cooldown ({since_change:.0f} s)")
            return self._change(estimate, current - 1, "load")
        self._lower_since.pop(pool, None)
        return self._keep(estimate, "steady")

    def _keep(self, estimate: Estimate, reason: str) -> Decision:
        return Decision(
            estimate.pool, estimate.current, estimate.wanted, estimate.current, reason, estimate
        )

    def _change(self, estimate: Estimate, target: int, reason: str) -> Decision:
        self._last_change[estimate.pool] = self.clock()
        self._lower_since.pop(estimate.pool, None)
        return Decision(estimate.pool, estimate.current, estimate.wanted, target, reason, estimate)
