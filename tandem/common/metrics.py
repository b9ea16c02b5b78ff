"""Prometheus metrics of every component, on ``prometheus_client``.

Each component owns a ``CollectorRegistry`` (never the process-wide default: tests and
benches run a router and workers in one process, and two of them must not share
numbers) and serves it on ``GET /metrics`` (``MetricsServer``; the router's HTTP API
also mounts it). Names follow vLLM's where one exists, with the prefix ``tandem:``
instead of ``vllm:``; every family carries ``model_name`` and ``role`` (``router``,
``prefill``, ``decode``), so one dashboard query can split the pools. The full list is
in ``docs/metrics.md``.

Two kinds of source: numbers a component holds already (engine load, KV index size,
receiver counters) are read at scrape time by a collector (``Snapshot``); events on
the request path are counted or observed as they happen (``RequestMetrics``).
Torch-free.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, make_server

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PREFIX = "tandem:"

# vLLM's buckets, so percentiles read the same way on both.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

prometheus_client.disable_created_metrics()  # no ``*_created`` series beside each counter

log = logging.getLogger(__name__)


class ComponentMetrics:
    """A registry whose families all carry this component's ``model_name`` and ``role``
    (the ``counter``/``gauge``/``histogram`` makers bind them)."""

    def __init__(self, model_name: str, role: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.role = role
        self.const = {"model_name": model_name, "role": role}

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        family = Counter(
            PREFIX + name, doc, ["model_name", "role", *labels], registry=self.registry
        )
        return family if labels else family.labels(self.model_name, self.role)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        family = Gauge(PREFIX + name, doc, ["model_name", "role", *labels], registry=self.registry)
        return family if labels else family.labels(self.model_name, self.role)

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        family = Histogram(
            PREFIX + name,
            doc,
            ["model_name", "role", *labels],
            buckets=buckets,
            registry=self.registry,
        )
        return family if labels else family.labels(self.model_name, self.role)

    def labelled(self, family: Counter | Gauge | Histogram, **labels: str):
        """``family``'s child for ``labels`` plus this component's own."""
        return family.labels(model_name=self.model_name, role=self.role, **labels)

    def collect_with(self, read: Callable[[], Iterable[Sample]]) -> None:
        """Add families read at scrape time from ``read()`` (see ``Sample``)."""
        self.registry.register(_Snapshot(read, self.const))

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when absent): for tests and benches."""
        found = self.registry.get_sample_value(PREFIX + name, {**self.const, **labels})
        return 0.0 if found is None else found

    def exposition(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()


@dataclass(frozen=True)
class Sample:
    """One value a collector reports: ``kind`` is ``"gauge"`` or ``"counter"`` (whose
    ``name`` then ends in ``_total``, as exposed)."""

    name: str
    kind: str
    doc: str
    value: float
    labels: Mapping[str, str] | None = None


class _Snapshot(Collector):
    def __init__(self, read: Callable[[], Iterable[Sample]], const: Mapping[str, str]) -> None:
        self._read = read
        self._const = dict(const)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        try:
            samples = list(self._read())
        except Exception:  # a scrape must never take the component down
            log.exception("reading metrics failed")
            return []
        for s in samples:
            labels = {**self._const, **(s.labels or {})}
            family = families.get(s.name)
            if family is None:
                kind = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                name = PREFIX + s.name.removesuffix("_total")
                family = families[s.name] = kind(name, s.doc, labels=list(labels))
            family.add_metric(list(labels.values()), s.value)
        return list(families.values())


class RequestMetrics:
    """What vLLM reports per request, as this component sees the request: time to
    first token, time per output token (the request's mean after the first) and the
    gap between tokens, end-to-end latency, token counts, finish reasons.

    The router's figures are the ones users feel (they include routing, prefill, the
    KV transfer and every migration); a worker's cover its own part."""

    def __init__(self, metrics: ComponentMetrics) -> None:
        m = metrics
        self.ttft = m.histogram(
            "time_to_first_token_seconds", "time to the first output token", TTFT_BUCKETS_S
        )
        self.tpot = m.histogram(
            "time_per_output_token_seconds",
            "per request: (end-to-end - first token) / (output tokens - 1)",
            TOKEN_LATENCY_BUCKETS_S,
        )
        self.itl = m.histogram(
            "inter_token_latency_seconds",
            "gap between successive output messages, per token",
            TOKEN_LATENCY_BUCKETS_S,
        )
        self.e2e = m.histogram(
            "e2e_request_latency_seconds", "arrival to last token", REQUEST_LATENCY_BUCKETS_S
        )
        self.prompt_len = m.histogram(
            "request_prompt_tokens", "prompt tokens per request", TOKEN_COUNT_BUCKETS
        )
        self.output_len = m.histogram(
            "request_generation_tokens", "output tokens per request", TOKEN_COUNT_BUCKETS
        )
        self.prompt_tokens = m.counter("prompt_tokens", "prompt tokens of admitted requests")
        self.generation_tokens = m.counter("generation_tokens", "output tokens sent")
        self._success = m.counter(
            "request_success", "requests that finished, by reason", ["finished_reason"]
        )
        self._metrics = m

    def finished(self, reason: str) -> None:
        self._metrics.labelled(self._success, finished_reason=reason).inc()


class RequestTimer:
    """One request's clock for ``RequestMetrics``: call ``tokens(n)`` as each message
    with ``n`` tokens goes out, ``end(reason)`` once (``reason=None``: it failed, only
    latency-free counts are kept)."""

    __slots__ = ("_clock", "_count", "_first", "_last", "_m", "_start")

    def __init__(self, metrics: RequestMetrics, num_prompt_tokens: int, clock) -> None:
        self._m = metrics
        self._clock = clock
        self._start = self._last = clock()
        self._first: float | None = None
        self._count = 0
        metrics.prompt_tokens.inc(num_prompt_tokens)
        metrics.prompt_len.observe(num_prompt_tokens)

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = self._clock()
        if self._first is None:
            self._first = now
            self._m.ttft.observe(now - self._start)
        else:
            gap = (now - self._last) / n
            for _ in range(n):
                self._m.itl.observe(gap)
        self._last = now
        self._count += n
        self._m.generation_tokens.inc(n)

    def end(self, reason: str | None) -> None:
        if reason is None:
            return
        now = self._clock()
        self._m.e2e.observe(now - self._start)
        self._m.output_len.observe(self._count)
        if self._first is not None and self._count > 1:
            self._m.tpot.observe((now - self._first) / (self._count - 1))
        self._m.finished(reason)


class MetricsServer:
    """``GET /metrics`` of one registry on ``host:port`` (0: a free port), on a daemon
    thread.

    Always the text format 0.0.4, whatever the scraper asks for: ``prometheus_client``
    (0.26) answers an OpenMetrics ``Accept`` header, which Prometheus sends, with
    every ``:`` in a name turned into ``_``, so ``tandem:`` names would reach Prometheus
    as ``tandem_``. The text format keeps them as they are."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        def app(environ, start_response):
            if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"only GET /metrics is served here\n"]
            body = prometheus_client.generate_latest(registry)
            start_response("200 OK", [("Content-Type", prometheus_client.CONTENT_TYPE_LATEST)])
            return [body]

        self._server = make_server(
            host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self.port: int = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # one line per scrape: no
        pass


class Scrape:
    """One scrape of a ``/metrics`` endpoint, parsed by ``prometheus_client``'s parser
    (for tests, benches and the planner)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [
            sample for family in text_string_to_metric_families(text) for sample in family.samples
        ]

    @classmethod
    def of(cls, url: str, timeout_s: float = 10.0) -> Scrape:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return cls(answer.read().decode())

    @classmethod
    def merged(cls, scrapes: Sequence[Scrape]) -> Scrape:
        """One scrape holding the samples of all of ``scrapes``: ``value`` and the
        histogram buckets then sum over them (e.g. several routers' counts)."""
        if len(scrapes) == 1:
            return scrapes[0]
        merged = cls("")
        merged.text = "".join(s.text for s in scrapes)
        merged.samples = [sample for s in scrapes for sample in s.samples]
        return merged

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` (prefix optional) whose labels include
        ``labels``; 0 when there are none."""
        full = name if name.startswith(PREFIX) else PREFIX + name
        return sum(
            s.value
            for s in self.samples
            if s.name == full and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def labels(self, name: str, key: str) -> set[str]:
        """The values label ``key`` takes on samples named ``name``."""
        full = name if name.startswith(PREFIX) else PREFIX + name
        return {s.labels[key] for s in self.samples if s.name == full and key in s.labels}
