"""What OpenTelemetry tracing costs a request: off (the default) and on, in the same run.

    python bench/tracing.py [--model DIR] [--requests 300] [--json PATH]

Two local clusters of the same model (1 prefill + 1 decode worker each, one thread per
worker): one with tracing off, one with every component exporting to an OTLP collector
this script runs (a real gRPC ``TraceService``; batching exporters, as in production).
The same requests go to both, one at a time and alternating which cluster goes first,
so that neither gets a warmer machine: 64-token prompts (disaggregated: prefill, KV
pull, decode) for 8 tokens. Reported: p50 / p90 of the whole request and of its first
token, per cluster, and the spans the collector received.

Off, a request still calls the tracing functions (each returns a shared do-nothing
span), which the two clusters cannot show apart from noise: that cost is measured alone,
as the time of ``--count`` such calls (default 40: a disaggregated request makes about
25 in the router, 5 on the prefill worker and 10 on the decode worker).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import timeit
from concurrent import futures
from pathlib import Path

import grpc

from tandem.cli.launcher import ClusterSpec, LocalCluster
from tandem.common import tracing
from tandem.protos import common_pb2, generation_pb2, generation_pb2_grpc


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Collector:
    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        class Sink(trace_service_pb2_grpc.TraceServiceServicer):
            def __init__(self) -> None:
                self.spans = 0
                self.lock = threading.Lock()

            def Export(self, request, context):
                with self.lock:
                    self.spans += sum(
                        len(scope.spans)
                        for rs in request.resource_spans
                        for scope in rs.scope_spans
                    )
                return trace_service_pb2.ExportTraceServiceResponse()

        self.sink = Sink()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.sink, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def _request(stub, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(first token, whole request) seconds of one Generate call."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    request = generation_pb2.GenerateRequest(token_ids={"ids": prompt}, sampling=sampling)
    start = time.perf_counter()
    first = None
    for _ in stub.Generate(request, timeout=60):
        if first is None:
            first = time.perf_counter() - start
    return first, time.perf_counter() - start


def off_call_cost_ns(calls_per_request: int) -> float:
    """Nanoseconds of ``calls_per_request`` tracing calls with tracing off (a mix of the
    kinds a request makes: start, recording checks, metadata, end)."""
    assert not tracing.enabled()

    def one_request() -> None:
        for _ in range(calls_per_request // 4):
            span = tracing.start("x", None)
            if span.recording:
                raise AssertionError
            tracing.metadata(span)
            span.end()

    n = 20_000
    return timeit.timeit(one_request, number=n) / n * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the built-in trained model)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--count",
        type=int,
        default=40,
        help="tracing calls one request makes in all components (off-cost part)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    from tandem.cli.serve import default_model

    model = args.model or str(default_model())
    collector = _Collector()
    common = {
        "model_dir": model,
        "threads_per_worker": 1,
        "log_dir": Path("bench/results/logs"),
        "env": (("OTEL_BSP_SCHEDULE_DELAY", "500"),),
    }
    traced = ("--otlp-traces-endpoint", f"http://127.0.0.1:{collector.port}")
    specs = {
        "off": ClusterSpec(router_port=50071, model_name="bench-off", **common),
        "on": ClusterSpec(
            router_port=50072,
            model_name="bench-on",
            worker_args=traced,
            router_args=traced,
            **common,
        ),
    }
    rng = random.Random(0)
    times: dict[str, dict[str, list[float]]] = {k: {"first": [], "whole": []} for k in specs}
    with LocalCluster(specs["off"]) as off, LocalCluster(specs["on"]) as on:
        clusters = {"off": off, "on": on}
        channels = {k: grpc.insecure_channel(c.router_address) for k, c in clusters.items()}
        stubs = {k: generation_pb2_grpc.GenerationStub(ch) for k, ch in channels.items()}
        for i in range(args.warmup + args.requests):
            order = ["off", "on"] if i % 2 else ["on", "off"]
            for name in order:
                prompt = [rng.randrange(10, 4000) for _ in range(args.prompt_len)]
                first, whole = _request(stubs[name], prompt, args.max_tokens)
                if i >= args.warmup:
                    times[name]["first"].append(first)
                    times[name]["whole"].append(whole)
        for channel in channels.values():
            channel.close()
    time.sleep(1)  # the last batch of spans
    report = {
        name: {
            f"{kind}_p{q}_ms": _percentile(values, q / 100) * 1e3
            for kind, values in figures.items()
            for q in (50, 90)
        }
        for name, figures in times.items()
    }
    report["on_over_off_whole_p50"] = report["on"]["whole_p50_ms"] / report["off"]["whole_p50_ms"]
    report["spans_received"] = collector.sink.spans
    report["spans_per_request"] = collector.sink.spans / (args.warmup + args.requests)
    off_ns = off_call_cost_ns(args.count)
    report["off_calls_per_request"] = args.count
    report["off_cost_us_per_request"] = off_ns / 1e3
    report["off_cost_share_of_whole_p50"] = off_ns / 1e9 / (report["off"]["whole_p50_ms"] / 1e3)
    collector.server.stop(0)
    for name in ("off", "on"):
        r = report[name]
        print(
            f"tracing {name:3}: whole p50 {r['whole_p50_ms']:.2f} ms, p90 "
            f"{r['whole_p90_ms']:.2f} ms | first token p50 {r['first_p50_ms']:.2f} ms, p90 "
            f"{r['first_p90_ms']:.2f} ms"
        )
    print(
        f"on / off (whole, p50): {report['on_over_off_whole_p50']:.3f}; "
        f"{report['spans_per_request']:.1f} spans per request received"
    )
    print(
        f"off: {args.count} no-op tracing calls per request cost "
        f"{report['off_cost_us_per_request']:.2f} us "
        f"({report['off_cost_share_of_whole_p50'] * 100:.4f} % of a request)"
    )
    print(json.dumps({k: v for k, v in report.items()}, indent=None))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
