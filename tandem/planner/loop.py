"""The planner's loop: scrape every component, turn two scrapes into ``Signals``,
calibrate and forecast, decide per pool, act, and report each decision (a log line with
its inputs, and the planner's own Prometheus families)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tandem.common.metrics import ComponentMetrics, Scrape
from tandem.planner.actuators import Actuator
from tandem.planner.policy import CapacityModel, Decider, Decision, PlannerConfig
from tandem.planner.signals import Signals, signals

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """``/metrics`` URLs: the router's and each worker's, by pool. With several routers
    (replicas behind one Service), ``more_routers`` holds the others: each sees only
    the requests it routed, so their counts add up."""

    router: str
    prefill: Sequence[str]
    decode: Sequence[str]
    more_routers: Sequence[str] = ()

    @property
    def routers(self) -> list[str]:
        return [self.router, *self.more_routers]


class Planner:
    def __init__(
        self,
        config: PlannerConfig,
        actuator: Actuator,
        endpoints: Callable[[], Endpoints],
        model_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.actuator = actuator
        self.endpoints = endpoints
        self.clock = clock
        self.model = CapacityModel(config)
        self.decider = Decider(config, clock)
        self.metrics = ComponentMetrics(model_name, "planner")
        m = self.metrics
        self._replicas = m.gauge("planner_replicas", "replicas running, by pool", ["pool"])
        self._wanted = m.gauge(
            "planner_wanted_replicas", "what the capacity model asks for", ["pool"]
        )
        self._target = m.gauge("planner_target_replicas", "what the planner set", ["pool"])
        self._forecast = m.gauge(
            "planner_forecast_load",
            "forecast load lead_s ahead: prompt tokens/s (prefill), sequences (decode)",
            ["pool"],
        )
        self._capacity = m.gauge(
            "planner_capacity_per_replica",
            "calibrated capacity of one replica, in the same unit as the load",
            ["pool"],
        )
        self._events = m.counter(
            "planner_scale_events",
            "replica changes made, by pool and direction",
            ["pool", "direction"],
        )
        self._slo = m.gauge(
            "planner_observed_p99_seconds", "TTFT / TPOT p99 of the last interval", ["slo"]
        )
        self._previous: tuple[float, dict[str, Scrape]] | None = None
        self.last_signals: Signals | None = None
        self.decisions: list[Decision] = []

    def tick(self) -> list[Decision]:
        """One round; no decision until two scrapes of a router exist. Only components
        that answered both scrapes count (one starting or going away is left out)."""
        endpoints = self.endpoints()
        now = self.clock()
        scraped = _scrape_all([*endpoints.routers, *endpoints.prefill, *endpoints.decode])
        previous, self._previous = self._previous, (now, scraped)
        if previous is None:
            return []
        then, before = previous
        both = lambda urls: [u for u in urls if u in scraped and u in before]  # noqa: E731
        routers, pre, dec = both(endpoints.routers), both(endpoints.prefill), both(endpoints.decode)
        if not routers:
            return []
        s = signals(
            now - then,
            (
                Scrape.merged([before[u] for u in routers]),
                Scrape.merged([scraped[u] for u in routers]),
            ),
            ([before[u] for u in pre], [scraped[u] for u in pre]),
            ([before[u] for u in dec], [scraped[u] for u in dec]),
        )
        self.last_signals = s
        self.model.observe(s)
        decisions = []
        for estimate in self.model.estimate(s):
            estimate = replace(estimate, current=self.actuator.replicas(estimate.pool))
            decision = self.decider.decide(estimate)
            self._report(decision, s)
            if decision.changes:
                self.actuator.scale(decision.pool, decision.target)
                direction = "up" if decision.target > decision.current else "down"
                self.metrics.labelled(self._events, pool=decision.pool, direction=direction).inc()
            decisions.append(decision)
        self.decisions.extend(decisions)
        return decisions

    def run(self, interval_s: float, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad round must not end the planner
                log.exception("planner round failed")
            stop.wait(interval_s)

    def _report(self, d: Decision, s: Signals) -> None:
        e, labelled = d.estimate, self.metrics.labelled
        labelled(self._replicas, pool=d.pool).set(d.current)
        labelled(self._wanted, pool=d.pool).set(d.wanted)
        labelled(self._target, pool=d.pool).set(d.target)
        labelled(self._forecast, pool=d.pool).set(e.forecast)
        labelled(self._capacity, pool=d.pool).set(e.capacity_per_replica or 0.0)
        labelled(self._slo, slo="ttft").set(s.ttft_p99 or 0.0)
        labelled(self._slo, slo="tpot").set(s.tpot_p99 or 0.0)
        log.log(
            logging.INFO if d.changes else logging.DEBUG,
            "%s: %d -> %d (wanted %d; %s) load %.1f forecast %.1f capacity/replica %s; "
            "ttft p99 %s tpot p99 %s, %.2f req/s",
            d.pool, d.current, d.target, d.wanted, d.reason, e.load, e.forecast,
            "?" if e.capacity_per_replica is None else f"{e.capacity_per_replica:.1f}",
            _ms(s.ttft_p99), _ms(s.tpot_p99), s.request_rate,
        )  # fmt: skip


def _scrape_all(urls: Sequence[str]) -> dict[str, Scrape]:
    out = {}
    for url in urls:
        try:
            out[url] = Scrape.of(url, timeout_s=5)
        except OSError as err:  # a worker starting or going away: skip it this round
            log.debug("scrape of %s failed: %s", url, err)
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"
