"""A worker's Prometheus families: its engine (read at scrape time from the load
snapshot the engine thread publishes after every step), its requests as it sees them,
its prefix cache, and its side of the KV transfer.

Engine gauges and counters use vLLM's names (``num_requests_running``,
``num_requests_waiting``, ``kv_cache_usage_perc``, ``num_preemptions``,
``spec_decode_num_*``); the transfer ones are Tandem's own. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from tandem.common.metrics import (
    TRANSFER_BUCKETS_S,
    TTFT_BUCKETS_S,
    ComponentMetrics,
    RequestMetrics,
    Sample,
)
from tandem.common.worker_load import EngineLoadLike


class WorkerMetrics(ComponentMetrics):
    def __init__(self, model_name: str, role: str, load: Callable[[], EngineLoadLike]) -> None:
        super().__init__(model_name, role)
        self.requests = RequestMetrics(self)
        self.queue_time = self.histogram(
            "request_queue_time_seconds",
            "arrival at this engine to its first admission (KV blocks granted)",
            TTFT_BUCKETS_S,
        )
        self.prefix_queries = self.counter(
            "prefix_cache_queries", "prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = self.counter(
            "prefix_cache_hits", "of those, tokens found cached (not computed)"
        )
        self.kv_sent_bytes = self.counter(
            "kv_transfer_sent_bytes", "KV payload bytes sent to decode workers"
        )
        self.kv_sent_blocks = self.counter("kv_transfer_sent_blocks", "KV blocks sent")
        self.kv_send_seconds = self.histogram(
            "kv_transfer_send_seconds", "pack + send of one pull, sender side", TRANSFER_BUCKETS_S
        )
        self.kv_pull_seconds = self.histogram(
            "kv_transfer_pull_seconds",
            "one successful KV pull, receiver side (handshake included when there is one)",
            TRANSFER_BUCKETS_S,
        )
        self.kv_fallbacks = self.counter(
            "kv_transfer_fallbacks",
            "KV pulls that failed: the decode worker computed the prompt itself",
        )
        self.leases_expired = self.counter(
            "kv_leases_expired", "held KV (prefilled or migrating) nobody pulled in time"
        )
        self.migrations_out = self.counter(
            "migrations_out",
            "running streams this decode worker handed to a peer, by cause",
            ("cause",),
        )
        if role == "decode":  # exported at 0 from the start
            for cause in ("drain", "rebalance", "requested"):
                self.labelled(self.migrations_out, cause=cause)
        self.collect_with(lambda: _engine_samples(load()))

    def observe_prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)

    def report(self, read: Callable[[], Iterator[Sample]]) -> None:
        """More scrape-time samples (the transfer's own counters, leases held)."""
        self.collect_with(read)


def _engine_samples(load: EngineLoadLike) -> Iterator[Sample]:
    yield Sample("num_requests_running", "gauge", "requests in the running batch", load.num_running)
    yield Sample(
        "num_requests_waiting", "gauge", "requests waiting for admission", load.num_waiting
    )
    yield Sample(
        "num_requests_waiting_for_kv",
        "gauge",
        "admitted requests whose KV is being pulled",
        load.num_waiting_for_kv,
    )
    yield Sample(
        "num_requests_prefilled",
        "gauge",
        "prefilled requests whose KV is held for a decode worker",
        load.num_prefilled,
    )
    used = load.num_kv_blocks - load.num_free_blocks
    yield Sample(
        "kv_cache_usage_perc",
        "gauge",
        "KV cache usage: 1 = every block held by a request (evictable cached blocks are free)",
        used / load.num_kv_blocks if load.num_kv_blocks else 0.0,
    )
    yield Sample("kv_cache_blocks", "gauge", "KV blocks in the pool", load.num_kv_blocks)
    yield Sample(
        "kv_cache_cached_blocks",
        "gauge",
        "blocks holding reusable prefix KV",
        load.num_cached_blocks,
    )
    yield Sample(
        "queued_prefill_tokens",
        "gauge",
        "prompt tokens not computed yet",
        load.queued_prefill_tokens,
    )
    yield Sample("num_preemptions_total", "counter", "preemptions", load.num_preemptions)
    yield Sample(
        "engine_busy_seconds_total", "counter", "time the engine spent stepping", load.busy_seconds
    )
    if load.max_loras:
        yield from _lora_samples(load)
    spec = load.spec_decode
    if spec is not None:
        yield Sample(
            "spec_decode_num_drafts_total",
            "counter",
            "request-steps that verified drafts",
            spec.num_verifications,
        )
        yield Sample(
            "spec_decode_num_draft_tokens_total",
            "counter",
            "draft tokens proposed and verified",
            spec.num_draft_tokens,
        )
        yield Sample(
            "spec_decode_num_accepted_tokens_total",
            "counter",
            "draft tokens the target accepted",
            spec.num_accepted_tokens,
        )
        yield Sample(
            "spec_decode_proposer_seconds_total",
            "counter",
            "time spent proposing drafts",
            spec.proposer_seconds,
        )


def transfer_received(
    pulls: int, blocks: int, nbytes: int, failures: Mapping[str, int]
) -> Iterator[Sample]:
    """The receiver's counters, for ``WorkerMetrics.report``."""
    yield Sample("kv_transfer_pulls_total", "counter", "successful KV pulls", pulls)
    yield Sample("kv_transfer_received_blocks_total", "counter", "KV blocks received", blocks)
    yield Sample("kv_transfer_received_bytes_total", "counter", "KV payload bytes received", nbytes)
    for reason, count in sorted(failures.items()):
        yield Sample(
            "kv_transfer_pull_failures_total",
            "counter",
            "failed KV pulls, by reason",
            count,
            {"reason": reason},
        )


def _lora_samples(load: EngineLoadLike) -> Iterator[Sample]:
    """LoRA serving: vLLM's ``lora_requests_info`` (the adapters of the running and the
    waiting requests, comma-separated, as labels), then Tandem's per-adapter counts."""
    info = {
        "running_lora_adapters": ",".join(sorted(load.lora_running)),
        "waiting_lora_adapters": ",".join(sorted(load.lora_waiting)),
        "max_lora": str(load.max_loras),
    }
    yield Sample("lora_requests_info", "gauge", "adapters of running / waiting requests", 1, info)
    yield Sample("lora_adapters_loaded", "gauge", "LoRA adapters loaded", len(load.lora_adapters))
    for name in sorted(load.lora_adapters):
        yield Sample(
            "lora_requests_running",
            "gauge",
            "running requests per LoRA adapter",
            load.lora_running.get(name, 0),
            {"adapter": name},
        )
