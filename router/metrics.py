"""The router's numbers: prefix hits, prefill work, decision time, the KV index and its
event stream, per-worker load.

``RouterMetrics`` holds the counters the request path and the event consumer update
(plain attributes, read directly by tests and benchmarks); ``render_metrics`` turns
them plus live gauges into Prometheus text for ``GET /metrics`` on ``--metrics-port``.

Hit rate = prompt tokens the chosen prefill workers found cached (as they report
them) / prompt tokens sent to prefill workers. Prefill tokens computed = the
difference. ``predicted`` counts what the KV index expected the chosen worker to hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.common.metrics_text import Histogram, Sample, format_family
from tandem.common.registry import RegistryWatcher, WorkerRole
from tandem.router.kv_index.indexer import KVIndexer
from tandem.router.routing.inflight import InflightLoad

DECISION_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3)
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


@dataclass
class RouterMetrics:
    prefill_requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    kv_blocks_pulled: int = 0
    event_batches_read: int = 0
    event_batches_undecodable: int = 0
    snapshots_fetched: int = 0
    snapshot_failures: int = 0
    prefill_retries: int = 0
    """Prefills that failed on a worker and were tried on another."""
    decode_migrations: int = 0
    """Decode streams whose worker failed or stalled (each goes on elsewhere if it can)."""
    decode_stalls: int = 0
    """Of those, streams moved because they stalled (``router.stall``)."""
    decision_seconds: Histogram = field(default_factory=lambda: Histogram(DECISION_BUCKETS_S))
    """Index lookup + load merge + policy, per pick."""
    hash_seconds: Histogram = field(default_factory=lambda: Histogram(DECISION_BUCKETS_S))
    """Block hashing, once per request."""
    event_lag_seconds: Histogram = field(default_factory=lambda: Histogram(LAG_BUCKETS_S))
    """Worker publish -> router read, per event batch (wall clocks of both)."""

    @property
    def prefill_tokens_computed(self) -> int:
        return self.prompt_tokens - self.cached_prompt_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def prefilled(self, prompt_tokens: int, cached_tokens: int, predicted_tokens: int) -> None:
        self.prefill_requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_tokens
        self.predicted_cached_tokens += predicted_tokens

    def decided(self, seconds: float) -> None:
        self.decision_seconds.observe(seconds)

    def hashed(self, seconds: float) -> None:
        self.hash_seconds.observe(seconds)


def render_metrics(
    metrics: RouterMetrics,
    watcher: RegistryWatcher,
    indexer: KVIndexer | None,
    inflight: InflightLoad,
) -> str:
    """Prometheus text of everything above, plus live per-worker and index gauges."""
    m = metrics
    counters = (
        ("prefill_requests_total", "requests prefilled by a prefill worker", m.prefill_requests),
        ("prompt_tokens_total", "prompt tokens sent to prefill workers", m.prompt_tokens),
        (
            "cached_prompt_tokens_total",
            "prompt tokens prefill workers found in their prefix cache",
            m.cached_prompt_tokens,
        ),
        (
            "predicted_cached_tokens_total",
            "prompt tokens the KV index expected the chosen prefill worker to hold",
            m.predicted_cached_tokens,
        ),
        (
            "prefill_tokens_computed_total",
            "prompt tokens prefill workers computed",
            m.prefill_tokens_computed,
        ),
        ("kv_blocks_pulled_total", "KV blocks decode workers pulled", m.kv_blocks_pulled),
        ("kv_event_batches_total", "KV event batches read", m.event_batches_read),
        (
            "kv_event_batches_undecodable_total",
            "stream entries that were not event batches",
            m.event_batches_undecodable,
        ),
        ("kv_snapshots_total", "worker cache snapshots fetched", m.snapshots_fetched),
        ("kv_snapshot_failures_total", "failed snapshot fetches", m.snapshot_failures),
        (
            "prefill_retries_total",
            "prefills that failed on a worker and were tried on another",
            m.prefill_retries,
        ),
        (
            "decode_migrations_total",
            "decode streams whose worker failed or stalled (each goes on elsewhere if it can)",
            m.decode_migrations,
        ),
        ("decode_stalls_total", "decode streams moved because they stalled", m.decode_stalls),
    )
    parts = [
        format_family(f"tandem_router_{name}", "counter", text, [Sample({}, value)])
        for name, text, value in counters
    ]
    parts.append(
        format_family(
            "tandem_router_prefix_hit_rate",
            "gauge",
            "cached / prompt tokens of prefilled requests since start",
            [Sample({}, m.hit_rate)],
        )
    )
    parts.append(
        m.decision_seconds.render(
            "tandem_router_decision_seconds", "time to pick a worker (index + load + policy)"
        )
    )
    parts.append(m.hash_seconds.render("tandem_router_block_hash_seconds", "time to hash a prompt"))
    parts.append(
        m.event_lag_seconds.render(
            "tandem_router_kv_event_lag_seconds", "worker publish to router read of KV events"
        )
    )
    parts += _index_families(indexer)
    parts += _worker_families(watcher, inflight)
    return "".join(parts)


def _index_families(indexer: KVIndexer | None) -> list[str]:
    if indexer is None:
        return []
    stats, index = indexer.stats, indexer.index
    gauges = (
        ("kv_index_entries", "(worker, block) pairs in the KV index", index.num_entries),
        ("kv_index_hashes", "distinct block hashes in the KV index", index.num_hashes),
        ("kv_index_workers_syncing", "workers waiting for a snapshot", len(indexer.syncing)),
    )
    counters = (
        ("kv_event_gaps_total", "lost KV events detected (each triggers a resync)", stats.gaps),
        ("kv_snapshots_applied_total", "snapshots applied to the index", stats.snapshots_applied),
        ("kv_event_batches_applied_total", "event batches applied", stats.batches_applied),
        (
            "kv_event_batches_ignored_total",
            "batches of unknown workers or old incarnations",
            stats.batches_ignored,
        ),
    )
    parts = [format_family(f"tandem_router_{n}", "gauge", t, [Sample({}, v)]) for n, t, v in gauges]
    parts += [
        format_family(f"tandem_router_{n}", "counter", t, [Sample({}, v)]) for n, t, v in counters
    ]
    per_worker = [Sample({"worker": w}, index.num_blocks(w)) for w in sorted(index.workers())]
    parts.append(
        format_family(
            "tandem_router_kv_index_worker_blocks", "gauge", "blocks indexed per worker", per_worker
        )
    )
    return parts


def _worker_families(watcher: RegistryWatcher, inflight: InflightLoad) -> list[str]:
    samples: dict[str, list[Sample]] = {"queued": [], "running": [], "free": [], "busy": []}
    for role in WorkerRole:
        for record in inflight.adjust(list(watcher.workers(role))):
            labels = {"worker": record.info.worker_id, "role": role.value}
            samples["queued"].append(Sample(labels, record.load.num_queued_prefill_tokens))
            samples["running"].append(Sample(labels, record.load.num_running_seqs))
            samples["free"].append(Sample(labels, record.load.free_kv_blocks))
            samples["busy"].append(Sample(labels, record.load.busy_fraction))
    return [
        format_family(
            "tandem_router_worker_queued_prefill_tokens",
            "gauge",
            "queued prefill tokens per worker (reported, merged with in-flight)",
            samples["queued"],
        ),
        format_family(
            "tandem_router_worker_running_seqs", "gauge", "running sequences", samples["running"]
        ),
        format_family(
            "tandem_router_worker_free_kv_blocks", "gauge", "free KV blocks", samples["free"]
        ),
        format_family(
            "tandem_router_worker_busy_fraction",
            "gauge",
            "share of the last ~10 s the worker's engine spent stepping (reported, brought "
            "up to now with this router's work since)",
            samples["busy"],
        ),
    ]
