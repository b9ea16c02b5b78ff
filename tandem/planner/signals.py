"""What the planner reads: one ``Signals`` per interval, from two scrapes of every
component's ``/metrics`` (``tandem.common.metrics.Scrape``), the later minus the earlier.

Rates are per second over the interval; latency percentiles come from the histogram
buckets that filled during it (as Prometheus' ``histogram_quantile`` would); load gauges
are the later scrape's. Per-replica throughput is measured, not configured: the prefill
pool's computed prompt tokens per second of engine busy time, and the decode pool's
running sequences against its time per output token, which is what the capacity model
(``tandem.planner.policy``) is calibrated from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.common.metrics import PREFIX, Scrape


@dataclass(frozen=True)
class PoolSignals:
    replicas: int
    """Workers that answered the scrape."""
    running: float
    """Sequences running (decode) or requests in the batch (prefill), summed."""
    waiting: float
    queued_prefill_tokens: float
    busy: float
    """Mean share of the interval the pool's engines spent stepping (0-1)."""
    tokens_per_busy_second: float | None
    """Prefill: prompt tokens computed per second of engine busy time, per replica;
    decode: output tokens per busy second. ``None`` without work in the interval."""
    kv_usage: float
    """Highest KV cache usage in the pool (0-1)."""
    cached_share: float = 0.0
    """Prefill: the share of the prompt tokens of the prefills finished in the interval
    that the prefix cache held (0 without any)."""


@dataclass(frozen=True)
class Signals:
    interval_s: float
    request_rate: float
    prompt_token_rate: float
    """Prompt tokens arriving per second (the prefill pool's load)."""
    output_token_rate: float
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    prefill: PoolSignals
    decode: PoolSignals
    tpot_mean: float | None = None
    """The mean TPOT of the interval: exact (the histogram's sum over its count), where
    the percentiles are interpolated inside buckets up to 2.5x wide."""


def histogram_quantile(
    q: float, before: Scrape, after: Scrape, family: str, **labels: str
) -> float | None:
    """The ``q`` quantile of the observations a histogram got between two scrapes, by
    linear interpolation inside the bucket it falls in; ``None`` when it got none."""
    name = PREFIX + family + "_bucket"

    def buckets(scrape: Scrape) -> dict[float, float]:
        out: dict[float, float] = {}
        for s in scrape.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                bound = float(s.labels["le"])
                out[bound] = out.get(bound, 0.0) + s.value
        return out

    earlier, later = buckets(before), buckets(after)
    bounds = sorted(later)
    counts = [later[b] - earlier.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower  # past the last finite bucket: its bound is all we know
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


def histogram_mean(before: Scrape, after: Scrape, family: str) -> float | None:
    """The mean of the observations a histogram got between two scrapes (``None``: none)."""
    name = PREFIX + family
    count = after.value(name + "_count") - before.value(name + "_count")
    total = after.value(name + "_sum") - before.value(name + "_sum")
    return total / count if count > 0 else None


def _rate(before: Scrape, after: Scrape, interval: float, name: str, **labels: str) -> float:
    return max(0.0, after.value(name, **labels) - before.value(name, **labels)) / interval


def _pool(
    role: str, before: Sequence[Scrape], after: Sequence[Scrape], interval: float
) -> PoolSignals:
    busy, computed, usage, queried, cached = [], 0.0, 0.0, 0.0, 0.0
    for b, a in zip(before, after, strict=True):
        busy.append(min(1.0, _rate(b, a, interval, "engine_busy_seconds_total")))
        if role == "prefill":
            # A prefill worker counts a prompt's cache query and hits when its first token
            # is out: the prompts finished in the interval, less their cached tokens, are
            # what it computed. (Its prompt_tokens_total counts prompts as they arrive: a
            # saturated pool would be credited with its growing queue.)
            prompt = a.value("prefix_cache_queries_total") - b.value("prefix_cache_queries_total")
            hits = a.value("prefix_cache_hits_total") - b.value("prefix_cache_hits_total")
            computed += max(0.0, prompt - hits)
            queried, cached = queried + max(0.0, prompt), cached + max(0.0, hits)
        else:
            computed += max(
                0.0, a.value("generation_tokens_total") - b.value("generation_tokens_total")
            )
        usage = max(usage, a.value("kv_cache_usage_perc"))
    busy_seconds = sum(busy) * interval
    return PoolSignals(
        replicas=len(after),
        running=sum(a.value("num_requests_running") for a in after),
        waiting=sum(
            a.value("num_requests_waiting") + a.value("num_requests_waiting_for_kv") for a in after
        ),
        queued_prefill_tokens=sum(a.value("queued_prefill_tokens") for a in after),
        busy=sum(busy) / len(busy) if busy else 0.0,
        tokens_per_busy_second=computed / busy_seconds if busy_seconds > 0.05 * interval else None,
        kv_usage=usage,
        cached_share=min(1.0, cached / queried) if queried > 0 else 0.0,
    )


def signals(
    interval_s: float,
    router: tuple[Scrape, Scrape],
    prefill: tuple[Sequence[Scrape], Sequence[Scrape]],
    decode: tuple[Sequence[Scrape], Sequence[Scrape]],
) -> Signals:
    """``Signals`` over ``interval_s`` from (earlier, later) scrapes of the router and of
    each pool's workers (the same workers, in the same order, in both)."""
    r0, r1 = router
    t = interval_s
    done = _rate(r0, r1, t, "e2e_request_latency_seconds_count", role="router")
    prompts = r1.value("request_prompt_tokens_sum") - r0.value("request_prompt_tokens_sum")
    outputs = r1.value("request_generation_tokens_sum") - r0.value("request_generation_tokens_sum")
    arrived = r1.value("request_prompt_tokens_count") - r0.value("request_prompt_tokens_count")
    finished = done * t
    return Signals(
        interval_s=t,
        request_rate=arrived / t,
        prompt_token_rate=_rate(r0, r1, t, "prompt_tokens_total", role="router"),
        output_token_rate=_rate(r0, r1, t, "generation_tokens_total", role="router"),
        ttft_p50=histogram_quantile(0.5, r0, r1, "time_to_first_token_seconds"),
        ttft_p99=histogram_quantile(0.99, r0, r1, "time_to_first_token_seconds"),
        tpot_p50=histogram_quantile(0.5, r0, r1, "time_per_output_token_seconds"),
        tpot_p99=histogram_quantile(0.99, r0, r1, "time_per_output_token_seconds"),
        mean_prompt_tokens=prompts / arrived if arrived else None,
        mean_output_tokens=outputs / finished if finished else None,
        prefill=_pool("prefill", *prefill, t),
        decode=_pool("decode", *decode, t),
        tpot_mean=histogram_mean(r0, r1, "time_per_output_token_seconds"),
    )
