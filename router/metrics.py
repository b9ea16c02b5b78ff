"""The router's numbers, as Prometheus families (``tandem.common.metrics``).

What users feel, per request (``RequestMetrics``: time to first token, time per output
token, end-to-end latency, token counts, finish reasons, errors by status code) and
what only a disaggregated router has: routing decisions by pool, policy and whether
the KV index matched a prefix; the prompt tokens each policy sent to prefill workers
and the share of them those workers found cached; prefill retries, decode migrations
and stalls; the KV index and its event stream; each worker's load as the router sees
it.

Hit rate = prompt tokens the chosen prefill workers found cached (as they report
them) / prompt tokens sent to prefill workers. ``predicted`` counts what the KV index
expected the chosen worker to hold.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter

from tandem.common.metrics import (
    ComponentMetrics,
    RequestMetrics,
    Sample,
)
from tandem.common.registry import RegistryWatcher, WorkerRole
from tandem.router.kv_index.indexer import KVIndexer
from tandem.router.routing.inflight import InflightLoad

DECISION_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3)
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


MIGRATION_SERIES = {
    "failure": ("recompute",),
    "stall": ("recompute",),
    "drain": ("kv", "recompute"),
    "rebalance": ("kv", "recompute"),
    "requested": ("kv", "recompute"),
}
"""``router_decode_migrations_total``'s label pairs: a failed worker hands nothing over."""


class RouterMetrics(ComponentMetrics):
    def __init__(self, model_name: str = "") -> None:
        super().__init__(model_name, "router")
        self.requests = RequestMetrics(self)
        self.num_running = self.gauge("num_requests_running", "client requests in flight")
        self._errors = self.counter(
            "request_errors", "requests refused or failed, by gRPC status code", ["code"]
        )
        self._decisions = self.counter(
            "router_routing_decisions",
            "workers picked, by pool, policy and whether the KV index matched a prefix there",
            ["pool", "policy", "prefix_match"],
        )
        self._policy_prompt = self.counter(
            "router_prompt_tokens",
            "prompt tokens sent to prefill workers, by the policy that picked them",
            ["policy"],
        )
        self._policy_cached = self.counter(
            "router_cached_prompt_tokens",
            "of those, tokens the prefill workers found in their prefix cache",
            ["policy"],
        )
        self.predicted_cached_tokens = self.counter(
            "router_predicted_cached_tokens",
            "prompt tokens the KV index expected the chosen prefill worker to hold",
        )
        self.prefill_requests = self.counter(
            "router_prefill_requests", "requests prefilled by a prefill worker"
        )
        self.kv_blocks_pulled = self.counter(
            "router_kv_blocks_pulled", "KV blocks decode workers pulled for this router's requests"
        )
        self.prefill_retries = self.counter(
            "router_prefill_retries", "prefills that failed on a worker and were tried on another"
        )
        self._migrations = self.counter(
            "router_decode_migrations",
            "decode streams moved to another decode worker, by cause (failure, stall: the "
            "worker failed; drain, rebalance, requested: it handed the stream over) and by "
            "what the next worker got (kv: the KV to pull; recompute: the tokens alone)",
            ("cause", "mode"),
        )
        for cause, modes in MIGRATION_SERIES.items():  # exported at 0 from the start
            for mode in modes:
                self.labelled(self._migrations, cause=cause, mode=mode)
        self._local_prefills = self.counter(
            "router_local_prefills",
            "prompts the decode worker prefilled itself, skipping the prefill pool: short "
            "(below --disaggregation-min-tokens) or cached_on_decode (conditional "
            "disaggregation: a decode worker held most of the prompt)",
            ("reason",),
        )
        for reason in ("short", "cached_on_decode"):
            self.labelled(self._local_prefills, reason=reason)
        self._lora_requests = self.counter(
            "router_lora_requests",
            "requests served under each LoRA adapter (by the name the request gave)",
            ("adapter",),
        )
        self._lora_tokens = self.counter(
            "router_lora_generation_tokens",
            "tokens generated under each LoRA adapter",
            ("adapter",),
        )
        self.decode_stalls = self.counter(
            "router_decode_stalls", "of those, streams moved because they stalled"
        )
        self.event_batches_read = self.counter("router_kv_event_batches", "KV event batches read")
        self.event_batches_undecodable = self.counter(
            "router_kv_event_batches_undecodable", "stream entries that were not event batches"
        )
        self.snapshots_fetched = self.counter(
            "router_kv_snapshots", "worker cache snapshots fetched"
        )
        self.snapshot_failures = self.counter(
            "router_kv_snapshot_failures", "failed snapshot fetches"
        )
        self.decision_seconds = self.histogram(
            "router_decision_seconds",
            "time to pick a worker (index + load + policy)",
            DECISION_BUCKETS_S,
        )
        self.hash_seconds = self.histogram(
            "router_block_hash_seconds",
            "time to hash a prompt, once per request",
            DECISION_BUCKETS_S,
        )
        self.event_lag_seconds = self.histogram(
            "router_kv_event_lag_seconds",
            "worker publish to router read of KV events (wall clocks of both)",
            LAG_BUCKETS_S,
        )

    # --- the request path --------------------------------------------------------------

    def failed(self, code: str) -> None:
        self.labelled(self._errors, code=code).inc()

    def lora_request(self, adapter: str, tokens: int) -> None:
        """A request of ``adapter`` ended with ``tokens`` generated."""
        self.labelled(self._lora_requests, adapter=adapter).inc()
        self.labelled(self._lora_tokens, adapter=adapter).inc(tokens)

    def local_prefill(self, reason: str) -> None:
        self.labelled(self._local_prefills, reason=reason).inc()

    def migrated(self, cause: str, with_kv: bool) -> None:
        """A decode stream moved on (``cause``: failure, stall, drain, rebalance,
        requested), its KV moving with it or not."""
        self.labelled(self._migrations, cause=cause, mode="kv" if with_kv else "recompute").inc()

    def decided(self, seconds: float, pool: WorkerRole, policy: str, matched_blocks: int) -> None:
        self.decision_seconds.observe(seconds)
        match = "hit" if matched_blocks else "miss"
        self.labelled(self._decisions, pool=pool.value, policy=policy, prefix_match=match).inc()

    def prefilled(
        self, policy: str, prompt_tokens: int, cached_tokens: int, predicted_tokens: int
    ) -> None:
        self.prefill_requests.inc()
        self.labelled(self._policy_prompt, policy=policy).inc(prompt_tokens)
        self.labelled(self._policy_cached, policy=policy).inc(cached_tokens)
        self.predicted_cached_tokens.inc(predicted_tokens)

    def hashed(self, seconds: float) -> None:
        self.hash_seconds.observe(seconds)

    # --- reading (tests, benches) ------------------------------------------------------

    @property
    def prompt_tokens(self) -> float:
        """Prompt tokens sent to prefill workers, over every policy."""
        return _sum(self._policy_prompt)

    @property
    def cached_prompt_tokens(self) -> float:
        return _sum(self._policy_cached)

    @property
    def hit_rate(self) -> float:
        prompt = self.prompt_tokens
        return self.cached_prompt_tokens / prompt if prompt else 0.0

    # --- live gauges -------------------------------------------------------------------

    def watch(
        self, watcher: RegistryWatcher, indexer: KVIndexer | None, inflight: InflightLoad
    ) -> None:
        """Report the KV index and each worker's load (merged with this router's work in
        flight) at every scrape."""
        self.collect_with(lambda: _live(self, watcher, indexer, inflight))


def _sum(family: Counter) -> float:
    """A labelled counter's total over its children (read from the family itself, not
    the registry: the registry's scrape calls ``_live``, which reads this)."""
    return sum(s.value for m in family.collect() for s in m.samples if s.name.endswith("_total"))


def _live(
    m: RouterMetrics, watcher: RegistryWatcher, indexer: KVIndexer | None, inflight: InflightLoad
) -> Iterator[Sample]:
    yield Sample(
        "router_prefix_hit_rate", "gauge", "cached / prompt tokens since start", m.hit_rate
    )
    yield Sample(
        "router_prefill_tokens_computed_total",
        "counter",
        "prompt tokens prefill workers computed (sent - cached)",
        m.prompt_tokens - m.cached_prompt_tokens,
    )
    for role in WorkerRole:
        records = inflight.adjust(list(watcher.workers(role)))
        yield Sample(
            "router_workers", "gauge", "workers registered", len(records), {"pool": role.value}
        )
        for record in records:
            labels = {"worker": record.info.worker_id, "pool": role.value}
            load = record.load
            yield Sample(
                "router_worker_queued_prefill_tokens",
                "gauge",
                "queued prefill tokens per worker (reported, merged with in-flight)",
                load.num_queued_prefill_tokens,
                labels,
            )
            yield Sample(
                "router_worker_running_seqs",
                "gauge",
                "running sequences",
                load.num_running_seqs,
                labels,
            )
            yield Sample(
                "router_worker_free_kv_blocks",
                "gauge",
                "free KV blocks",
                load.free_kv_blocks,
                labels,
            )
            yield Sample(
                "router_worker_busy_fraction",
                "gauge",
                "share of the last ~10 s the worker's engine spent stepping",
                load.busy_fraction,
                labels,
            )
    if indexer is None:
        return
    stats, index = indexer.stats, indexer.index
    yield Sample(
        "router_kv_index_entries",
        "gauge",
        "(worker, block) pairs in the KV index",
        index.num_entries,
    )
    yield Sample(
        "router_kv_index_hashes", "gauge", "distinct block hashes in the KV index", index.num_hashes
    )
    yield Sample(
        "router_kv_index_workers_syncing",
        "gauge",
        "workers waiting for a snapshot",
        len(indexer.syncing),
    )
    yield Sample(
        "router_kv_event_gaps_total",
        "counter",
        "lost KV events detected (each triggers a resync)",
        stats.gaps,
    )
    yield Sample(
        "router_kv_snapshots_applied_total",
        "counter",
        "snapshots applied to the index",
        stats.snapshots_applied,
    )
    yield Sample(
        "router_kv_event_batches_applied_total",
        "counter",
        "event batches applied",
        stats.batches_applied,
    )
    yield Sample(
        "router_kv_event_batches_ignored_total",
        "counter",
        "batches of unknown workers or old incarnations",
        stats.batches_ignored,
    )
    for worker in sorted(index.workers()):
        yield Sample(
            "router_kv_index_worker_blocks",
            "gauge",
            "blocks indexed per worker",
            index.num_blocks(worker),
            {"worker": worker},
        )
