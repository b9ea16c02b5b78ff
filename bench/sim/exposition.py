"""What the simulated components' ``/metrics`` say: the router's and the workers' own
families (names, labels, histogram buckets as ``tandem.common.metrics`` defines them),
as ``Scrape`` objects for ``tandem.planner.signals.signals``.

A ``Scrape`` is its parsed samples; these are built as samples directly, skipping the
text round trip, which costs milliseconds per scrape and tells the planner nothing more
(``tests/test_planner_sim.py`` checks every name here is one the real router and
workers expose). Histograms are cumulative like Prometheus': observations are buffered
and binned when a scrape is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from tandem.common.metrics import PREFIX, TOKEN_LATENCY_BUCKETS_S, TTFT_BUCKETS_S, Scrape

MODEL_NAME = "sim"


def scrape_of(samples: list[Sample]) -> Scrape:
    """A ``Scrape`` holding ``samples``, as if parsed from their exposition."""
    scrape = Scrape("")
    scrape.samples = samples
    return scrape


class _Histogram:
    def __init__(self, name: str, bounds: Sequence[float]) -> None:
        self.name = PREFIX + name
        self.bounds = np.asarray(bounds, dtype=float)
        self.le = [floatToGoString(b) for b in bounds] + ["+Inf"]
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self.total = 0.0
        self._pending: list[float] = []

    def observe(self, value: float) -> None:
        self._pending.append(value)

    def samples(self, labels: dict[str, str]) -> list[Sample]:
        if self._pending:
            values = np.asarray(self._pending)
            # Bucket i holds values <= bounds[i] (Prometheus' ``le``); the last is +Inf.
            index = np.searchsorted(self.bounds, values, side="left")
            self.counts += np.bincount(index, minlength=len(self.counts))
            self.total += float(values.sum())
            self._pending.clear()
        cumulative = np.cumsum(self.counts)
        out = [
            Sample(self.name + "_bucket", {**labels, "le": le}, float(n))
            for le, n in zip(self.le, cumulative, strict=True)
        ]
        out.append(Sample(self.name + "_sum", labels, self.total))
        out.append(Sample(self.name + "_count", labels, float(cumulative[-1])))
        return out


class RouterMetrics:
    """The router's request families (``RequestMetrics``), fed by the simulation."""

    def __init__(self) -> None:
        self.labels = {"model_name": MODEL_NAME, "role": "router"}
        self.ttft = _Histogram("time_to_first_token_seconds", TTFT_BUCKETS_S)
        self.tpot = _Histogram("time_per_output_token_seconds", TOKEN_LATENCY_BUCKETS_S)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.arrived_count = 0
        self.finished_count = 0
        self.output_tokens = 0
        self.e2e_seconds = 0.0

    def arrived(self, prompt_tokens: int) -> None:
        self.arrived_count += 1
        self.prompt_tokens += prompt_tokens

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.generation_tokens += 1

    def finished(self, output_tokens: int, tpot_s: float | None, e2e_s: float) -> None:
        """``tpot_s``: ``None`` for a single-token answer (no TPOT is observed)."""
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.finished_count += 1
        self.output_tokens += output_tokens
        self.generation_tokens += output_tokens - 1
        self.e2e_seconds += e2e_s

    def scrape(self) -> Scrape:
        labels, p = self.labels, PREFIX
        samples = [
            *self.ttft.samples(labels),
            *self.tpot.samples(labels),
            Sample(p + "e2e_request_latency_seconds_count", labels, float(self.finished_count)),
            Sample(p + "e2e_request_latency_seconds_sum", labels, self.e2e_seconds),
            Sample(p + "request_prompt_tokens_count", labels, float(self.arrived_count)),
            Sample(p + "request_prompt_tokens_sum", labels, float(self.prompt_tokens)),
            Sample(p + "request_generation_tokens_count", labels, float(self.finished_count)),
            Sample(p + "request_generation_tokens_sum", labels, float(self.output_tokens)),
            Sample(p + "prompt_tokens_total", labels, float(self.prompt_tokens)),
            Sample(p + "generation_tokens_total", labels, float(self.generation_tokens)),
        ]
        return scrape_of(samples)


@dataclass(frozen=True)
class WorkerReading:
    """One worker's numbers at a scrape (``WorkerMetrics``' engine and request families)."""

    role: str
    """``prefill`` or ``decode``."""
    prompt_tokens: int
    """Prompt tokens of the requests it received (counted on arrival, as the real one)."""
    prefix_queries: int
    """Prompt tokens of the prefills it finished (a real one counts its prefix-cache
    queries when the first token is out; nothing is ever cached here)."""
    generation_tokens: int
    busy_seconds: float
    running: int
    waiting: int
    waiting_for_kv: int
    queued_prefill_tokens: int
    kv_usage: float


def worker_scrape(r: WorkerReading) -> Scrape:
    labels, p = {"model_name": MODEL_NAME, "role": r.role}, PREFIX
    return scrape_of(
        [
            Sample(p + "prompt_tokens_total", labels, float(r.prompt_tokens)),
            Sample(p + "prefix_cache_queries_total", labels, float(r.prefix_queries)),
            Sample(p + "prefix_cache_hits_total", labels, 0.0),
            Sample(p + "generation_tokens_total", labels, float(r.generation_tokens)),
            Sample(p + "engine_busy_seconds_total", labels, r.busy_seconds),
            Sample(p + "num_requests_running", labels, float(r.running)),
            Sample(p + "num_requests_waiting", labels, float(r.waiting)),
            Sample(p + "num_requests_waiting_for_kv", labels, float(r.waiting_for_kv)),
            Sample(p + "queued_prefill_tokens", labels, float(r.queued_prefill_tokens)),
            Sample(p + "kv_cache_usage_perc", labels, r.kv_usage),
        ]
    )
