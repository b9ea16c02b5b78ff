"""OpenTelemetry traces across the components, received by an OTLP collector the tests
start (a real gRPC ``TraceService``, and an HTTP one for ``http/protobuf``): one trace
spans the router, the prefill worker, the KV pull and the decode worker, continuing the
caller's W3C ``traceparent`` over gRPC and over HTTP; off, no tracer is loaded; the
missing extra is a one-line error."""

from __future__ import annotations

import http.server
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from tandem.cli.launcher import LocalCluster
from tandem.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.cluster_util import cluster_spec, free_port, greedy
from tests.hf_reference import random_prompts

ROOT = Path(__file__).resolve().parents[1]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Every span exported to it, flattened: (service name, span)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        self.take(request, dict(context.invocation_metadata()))
        return trace_service_pb2.ExportTraceServiceResponse()

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest, headers: dict) -> None:
        with self._lock:
            self.headers.append(headers)
            for resource_spans in request.resource_spans:
                attributes = {
                    a.key: a.value.string_value for a in resource_spans.resource.attributes
                }
                service = attributes.get("service.name", "")
                for scope in resource_spans.scope_spans:
                    self.spans += [(service, span) for span in scope.spans]

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self._lock:
            return [(s, span) for s, span in self.spans if span.trace_id == trace_id]

    def wait_for(
        self, trace_id: bytes, names: set[str], timeout: float = 20
    ) -> dict[str, list[tuple[str, object]]]:
        """The trace's spans by name, once every one of ``names`` has arrived."""
        deadline = time.monotonic() + timeout
        while True:
            by_name: dict[str, list] = {}
            for service, span in self.trace(trace_id):
                by_name.setdefault(span.name, []).append((service, span))
            if names <= by_name.keys():
                return by_name
            assert time.monotonic() < deadline, f"missing {names - by_name.keys()}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(0)


def _attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        value = a.value
        out[a.key] = getattr(value, value.WhichOneof("value"))
    return out


def _traceparent() -> tuple[str, bytes, bytes]:
    trace_id, span_id = secrets.token_bytes(16), secrets.token_bytes(8)
    return f"00-{trace_id.hex()}-{span_id.hex()}-01", trace_id, span_id


@pytest.fixture(scope="module")
def cluster(
    make_checkpoint: Callable[..., Path], redis_url: str, tmp_path_factory, collector
) -> Iterator[tuple[LocalCluster, int]]:
    _, port = collector
    http_port = free_port()
    traces = ("--otlp-traces-endpoint", f"http://127.0.0.1:{port}")
    spec = cluster_spec(
        make_checkpoint("llama"),
        redis_url,
        tmp_path_factory.mktemp("tracing-logs"),
        "tracing",
        worker_args=("--num-kv-blocks", "128", *traces),
        router_args=("--http-port", str(http_port), "--disaggregation-min-tokens", "16", *traces),
        env=(("OTEL_BSP_SCHEDULE_DELAY", "100"),),
    )
    with LocalCluster(spec) as running:
        yield running, http_port


PATH_SPANS = {
    "tandem.v1.Generation/Generate",
    "tandem.router.admit",
    "tandem.router.request",
    "tandem.router.route",
    "tandem.router.prefill",
    "tandem.prefill",
    "tandem.router.decode",
    "tandem.decode",
    "tandem.kv.pull",
}


def test_one_trace_spans_router_prefill_kv_pull_and_decode(collector, cluster) -> None:
    """A gRPC call with the caller's traceparent: every hop is in the caller's trace,
    each span under the one that called it, across three processes."""
    sink, _ = collector
    running, _ = cluster
    traceparent, trace_id, caller_span = _traceparent()
    prompt = random_prompts(1, 4096, (40, 40), seed=91)[0]
    request = generation_pb2.GenerateRequest(
        request_id="traced-1", token_ids=common_pb2.TokenIds(ids=prompt), sampling=greedy(8)
    )
    with grpc.insecure_channel(running.router_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        answers = list(stub.Generate(request, metadata=[("traceparent", traceparent)]))
    assert answers[-1].usage.completion_tokens == 8
    spans = sink.wait_for(trace_id, PATH_SPANS)
    one = {name: found[0] for name, found in spans.items()}

    def parent_of(name: str) -> bytes:
        return one[name][1].parent_span_id

    def id_of(name: str) -> bytes:
        return one[name][1].span_id

    assert parent_of("tandem.v1.Generation/Generate") == caller_span
    assert parent_of("tandem.router.request") == id_of("tandem.v1.Generation/Generate")
    assert parent_of("tandem.router.prefill") == id_of("tandem.router.request")
    assert parent_of("tandem.prefill") == id_of("tandem.router.prefill")  # across processes
    assert parent_of("tandem.decode") == id_of("tandem.router.decode")
    assert parent_of("tandem.kv.pull") == id_of("tandem.decode")
    services = {name: service for name, (service, _) in one.items()}
    assert services["tandem.router.request"] == "tandem-router"
    assert services["tandem.prefill"] == "tandem-prefill-worker"
    assert services["tandem.decode"] == services["tandem.kv.pull"] == "tandem-decode-worker"
    request_span = _attributes(one["tandem.router.request"][1])
    assert request_span["tandem.request_id"] == "traced-1"
    assert request_span["tandem.prompt_tokens"] == 40
    assert request_span["tandem.completion_tokens"] == 8
    assert request_span["tandem.finish_reason"] == "length"
    pull = _attributes(one["tandem.kv.pull"][1])
    assert pull["tandem.kv_blocks"] > 0 and pull["tandem.kv_bytes"] > 0
    assert _attributes(one["tandem.prefill"][1])["tandem.request_id"] == "traced-1"
    decode = _attributes(one["tandem.decode"][1])
    assert decode["tandem.kv_source"] == "KV_SOURCE_PULLED" and decode["tandem.tokens"] == 7
    routes = {_attributes(span)["tandem.role"] for _, span in spans["tandem.router.route"]}
    assert routes == {"prefill", "decode"}
    # one trace: every span the request made carries the caller's trace id
    assert all(span.trace_id == trace_id for _, span in sink.trace(trace_id))


def test_an_http_request_continues_the_callers_trace(collector, cluster) -> None:
    sink, _ = collector
    _, http_port = cluster
    traceparent, trace_id, caller_span = _traceparent()
    answer = httpx.post(
        f"http://127.0.0.1:{http_port}/v1/completions",
        json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "n": 2},
        headers={"traceparent": traceparent},
        timeout=60,
    )
    assert answer.status_code == 200
    spans = sink.wait_for(
        trace_id, {"POST /v1/completions", "tandem.router.request", "tandem.decode"}
    )
    (root,) = spans["POST /v1/completions"]
    assert root[1].parent_span_id == caller_span
    requests = spans["tandem.router.request"]
    assert len(requests) == 2  # one per choice, both under the HTTP request's span
    assert {span.parent_span_id for _, span in requests} == {root[1].span_id}


def test_a_failed_request_is_marked_in_its_trace(collector, cluster) -> None:
    sink, _ = collector
    running, _ = cluster
    traceparent, trace_id, _ = _traceparent()
    request = generation_pb2.GenerateRequest(prompt="", sampling=greedy(2))
    with grpc.insecure_channel(running.router_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, metadata=[("traceparent", traceparent)]))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    spans = sink.wait_for(trace_id, {"tandem.v1.Generation/Generate", "tandem.router.admit"})
    for name in ("tandem.v1.Generation/Generate", "tandem.router.admit"):
        (_, span), = spans[name]  # fmt: skip
        assert span.status.code == span.status.STATUS_CODE_ERROR
        assert "prompt must not be empty" in span.status.message


class _HttpCollector(http.server.BaseHTTPRequestHandler):
    sink: Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        self.sink.take(request, {k.lower(): v for k, v in self.headers.items()})
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args) -> None:
        pass


def test_http_protobuf_and_the_standard_variables() -> None:
    """``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`` exports over HTTP; headers and
    the service name come from the standard variables."""
    sink = Collector()
    handler = type("Handler", (_HttpCollector,), {"sink": sink})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = (
        "from tandem.common import tracing\n"
        f"assert tracing.setup('tandem-test', 'http://127.0.0.1:{server.server_port}/v1/traces')\n"
        "with tracing.span('outer') as outer:\n"
        "    with tracing.span('inner', outer):\n"
        "        pass\n"
        "tracing.shutdown()\n"
    )
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-tenant=blue",
        "OTEL_SERVICE_NAME": "my-router",
    }
    try:
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=120)
    finally:
        server.shutdown()
    names = {(service, span.name) for service, span in sink.spans}
    assert names == {("my-router", "outer"), ("my-router", "inner")}
    assert any(h.get("x-tenant") == "blue" for h in sink.headers)


def test_tracing_off_loads_no_tracer() -> None:
    """Off, Tandem's tracing imports nothing of OpenTelemetry, and the components load
    no tracer SDK or exporter (the redis client brings OpenTelemetry's API and metrics
    along by itself)."""
    code = (
        "import sys\n"
        "from tandem.common import tracing\n"
        "assert not tracing.setup('x', None)\n"
        "with tracing.span('s', tracing.extract({'traceparent': 'x'})) as s:\n"
        "    assert s is tracing.NO_SPAN and tracing.metadata(s) is None\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "import tandem.router.main, tandem.decode_worker.main, tandem.prefill_worker.main\n"
        "loaded = [m for m in sys.modules if m.startswith(\n"
        "    ('opentelemetry.sdk.trace', 'opentelemetry.exporter'))]\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=120)


def test_the_flag_without_the_extra_says_what_to_install(tmp_path: Path) -> None:
    """An ``opentelemetry`` that fails to import stands for the extra not installed."""
    fake = tmp_path / "opentelemetry"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'opentelemetry'\")\n")
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "router", "--model", "m", "--redis-url",
         "redis://127.0.0.1:1", "--otlp-traces-endpoint", "http://127.0.0.1:4317"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 1
    assert "pip install 'tandem[otel]'" in run.stderr and "Traceback" not in run.stderr
