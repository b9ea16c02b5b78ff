"""What the router adds to time-to-first-token, measured against calling a worker directly.

    python bench/router_overhead.py [--model DIR] [--requests 200] [--prompt-len 16]

Starts a local cluster (1 prefill + 1 decode worker, embedded Redis), then sends the same
requests one at a time (no queueing, so only per-request costs show) in two ways:

* ``direct``: the decode worker's own ``Decode`` RPC (local prefill), first response;
* ``router``: the public ``Generate`` RPC through the router, first response (a prompt
  shorter than the disaggregation threshold takes the same decode-worker path, so the
  difference is the router: validation, tokenization checks, routing, the extra hop,
  detokenization).

and, for prompts above the threshold, the prefill worker's ``Prefill`` RPC against the
router's disaggregated path. Reports p50/p90 TTFT of each and the router's added p50.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from tandem.cli.launcher import ClusterSpec, LocalCluster
from tandem.protos import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _first_message(stream: grpc.Call) -> object:
    message = next(iter(stream))
    stream.cancel()
    return message


class Paths:
    """The two ways of getting a first token for a prompt: straight to the worker, or
    through the router."""

    def __init__(self, worker: grpc.Channel, router: grpc.Channel, disaggregated: bool) -> None:
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(worker)
        self.decode = worker_pb2_grpc.DecodeWorkerStub(worker)
        self.router = generation_pb2_grpc.GenerationStub(router)
        self.disaggregated = disaggregated
        self.sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def direct(self, rid: str, prompt: list[int]) -> object:
        if self.disaggregated:
            request = worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=self.sampling
            )
            return self.prefill.Prefill(request, timeout=30)
        request = worker_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=self.sampling
        )
        return _first_message(self.decode.Decode(request, timeout=30))

    def via_router(self, prompt: list[int]) -> object:
        request = generation_pb2.GenerateRequest(token_ids={"ids": prompt}, sampling=self.sampling)
        return _first_message(self.router.Generate(request, timeout=30))


def measure(
    cluster: LocalCluster, prompts: list[list[int]], disaggregated: bool
) -> dict[str, list[float]]:
    worker = cluster.children["prefill-0" if disaggregated else "decode-0"]
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with (
        grpc.insecure_channel(worker.ready_line.split()[-1]) as worker_channel,
        grpc.insecure_channel(cluster.router_address) as router_channel,
    ):
        paths = Paths(worker_channel, router_channel, disaggregated)
        for i, prompt in enumerate(prompts):
            # The router gets a different prompt of the same length (no prefix-cache help),
            # and the order alternates so neither path always runs second.
            other = [(t + 1) % 4000 + 10 for t in prompt]
            calls = [
                ("direct", functools.partial(paths.direct, f"bench-{disaggregated}-{i}", prompt)),
                ("router", functools.partial(paths.via_router, other)),
            ]
            for name, call in calls if i % 2 else calls[::-1]:
                times[name].append(_seconds(call))
    return times


def _report(label: str, direct: list[float], router: list[float]) -> str:
    d50, r50 = statistics.median(direct), statistics.median(router)
    return (
        f"{label}: direct p50 {d50 * 1e3:.2f} ms, p90 {_percentile(direct, 0.9) * 1e3:.2f} ms"
        f" | router p50 {r50 * 1e3:.2f} ms, p90 {_percentile(router, 0.9) * 1e3:.2f} ms"
        f" | the router adds {(r50 - d50) * 1e3:.2f} ms at p50"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the built-in trained model)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--port", type=int, default=50061)
    args = parser.parse_args()
    from tandem.cli.serve import default_model

    rng = random.Random(0)
    spec = ClusterSpec(
        model_dir=args.model or str(default_model()),
        router_port=args.port,
        threads_per_worker=1,
        worker_args=("--num-kv-blocks", "512"),
        log_dir=Path("bench/results/logs"),
    )
    cases = (
        ("local prefill, 16-token prompts", 16, False),
        ("disaggregated, 64-token prompts", 64, True),
    )
    with LocalCluster(spec) as cluster:
        for label, length, disaggregated in cases:
            n = args.requests + args.warmup
            prompts = [[rng.randrange(10, 4000) for _ in range(length)] for _ in range(n)]
            times = measure(cluster, prompts, disaggregated)
            print(_report(label, times["direct"][args.warmup :], times["router"][args.warmup :]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
