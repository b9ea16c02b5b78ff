"""The serving benchmark: its statistics, its request plan, one short run against a fake
router (a real grpc.aio server on the benchmark's own event loop) and one against a real
local cluster."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem.bench import serve
from tandem.bench.loadgen import (
    Distribution,
    LoadSpec,
    PlannedRequest,
    RequestResult,
    Slo,
    arrival_times,
    percentile,
    plan_requests,
    summarize,
)
from tandem.bench.workloads import IntRange, TokenPool
from tandem.cli.launcher import LocalCluster
from tandem.common.client import StreamClock, StreamTiming
from tandem.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.cluster_util import cluster_spec, worker_status

PLAN = PlannedRequest(send_at=0.0, prompt_token_ids=(1, 2, 3), max_tokens=4)


def timing(ttft: float | None, tpot: float | None = None, tokens: int = 4) -> StreamTiming:
    """A stream sent at t=10 whose tokens arrived evenly after ``ttft``."""
    if ttft is None:
        return StreamTiming(10.0, None, None, 10.5, 0)
    first = 10.0 + ttft
    last = first + (tpot or 0.0) * (tokens - 1)
    return StreamTiming(10.0, first, last, last + 0.001, tokens)


def result(
    ttft: float | None, tpot: float | None = None, error: str | None = None
) -> RequestResult:
    return RequestResult(PLAN, timing(ttft, tpot), error)


# --- percentiles and summaries ---------------------------------------------------------


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_agrees_with_the_stdlib_inclusive_method() -> None:
    values = [random.Random(3).expovariate(1.0) for _ in range(101)]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    assert [percentile(values, q) for q in (50, 90, 99)] == pytest.approx(
        [cuts[49], cuts[89], cuts[98]]
    )


def test_percentile_refuses_no_values() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution_is_in_milliseconds_and_none_when_empty() -> None:
    assert Distribution.of_seconds([]) is None
    dist = Distribution.of_seconds([0.1, 0.2, 0.3])
    assert dist is not None
    assert (dist.mean, dist.p50) == pytest.approx((200.0, 200.0))


# --- TPOT from the stream's timestamps ----------------------------------------------------


def test_tpot_is_the_gap_between_first_and_last_token_over_n_minus_one() -> None:
    ticks = iter([0.0, 0.5, 0.7, 0.9, 1.3, 1.4])  # sent, 4 token messages, finished
    clock = StreamClock(clock=lambda: next(ticks))
    for ids in ([7], [8], [], [9, 10], [11]):  # the empty message reads no clock
        clock.observe(generation_pb2.GenerateResponse(token_ids=ids))
    t = clock.finish()
    assert t.num_tokens == 5
    assert t.ttft_s == pytest.approx(0.5)
    assert t.tpot_s == pytest.approx((1.3 - 0.5) / 4)
    assert t.e2e_s == pytest.approx(1.4)


def test_tpot_is_undefined_below_two_tokens() -> None:
    assert timing(0.1, tokens=1).tpot_s is None
    assert timing(None).tpot_s is None and timing(None).ttft_s is None


# --- goodput --------------------------------------------------------------------------


def test_goodput_counts_completed_requests_within_every_slo() -> None:
    results = [
        result(0.1, 0.02),  # good
        result(0.3, 0.02),  # TTFT too slow
        result(0.1, 0.06),  # TPOT too slow
        result(0.1, 0.02, error="UNAVAILABLE: gone"),  # failed
        RequestResult(PLAN, timing(0.1, tokens=1), None),  # one token: no TPOT to miss
    ]
    report = summarize(results, duration_s=2.0, slo=Slo(ttft_s=0.2, tpot_s=0.05))
    assert report.goodput == pytest.approx(2 / 2.0)
    assert (report.num_completed, report.num_failed) == (4, 1)
    assert report.request_throughput == pytest.approx(4 / 2.0)
    assert report.output_throughput == pytest.approx((4 + 4 + 4 + 1) / 2.0)


def test_goodput_with_one_slo_ignores_the_other_figure() -> None:
    results = [result(0.1, 0.5), result(0.3, 0.01)]
    assert summarize(results, 1.0, Slo(ttft_s=0.2)).goodput == pytest.approx(1.0)
    assert summarize(results, 1.0, Slo(tpot_s=0.1)).goodput == pytest.approx(1.0)


def test_no_slo_means_no_goodput() -> None:
    assert summarize([result(0.1, 0.01)], 1.0, Slo()).goodput is None


def test_a_stream_without_tokens_misses_a_ttft_slo_and_adds_no_ttft() -> None:
    report = summarize([result(None), result(0.1, 0.01)], 1.0, Slo(ttft_s=1.0))
    assert report.goodput == pytest.approx(1.0)
    assert report.ttft_ms is not None and report.ttft_ms.p99 == pytest.approx(100.0)


# --- the request plan -------------------------------------------------------------------


def test_poisson_arrivals_have_the_requested_mean_gap() -> None:
    times = arrival_times(4000, rate=20.0, rng=random.Random(0))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.1)  # exponential: sd = mean


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf, random.Random(0)) == [0.0] * 5


def test_plan_draws_lengths_in_range_and_shares_prefixes() -> None:
    pool = TokenPool.from_vocab(1000, special_ids=[0, 1])
    spec = LoadSpec(50, 10.0, IntRange(3, 9), IntRange(2, 5), num_prefixes=3, prefix_len=16)
    planned = plan_requests(spec, pool)
    assert len(planned) == 50
    assert all(19 <= len(p.prompt_token_ids) <= 25 for p in planned)
    assert all(2 <= p.max_tokens <= 5 for p in planned)
    assert all(2 <= t < 1000 for p in planned for t in p.prompt_token_ids)
    prefixes = {p.prompt_token_ids[:16] for p in planned}
    assert len(prefixes) == 3
    assert len({p.prompt_token_ids for p in planned}) == 50


def test_plan_is_seeded_and_its_prompts_do_not_depend_on_the_rate() -> None:
    pool = TokenPool.from_vocab(500)
    spec = LoadSpec(20, 5.0, IntRange(4, 8), IntRange(1, 3), seed=7)
    assert plan_requests(spec, pool) == plan_requests(spec, pool)
    faster = LoadSpec(20, 50.0, IntRange(4, 8), IntRange(1, 3), seed=7)
    same_work = [(p.prompt_token_ids, p.max_tokens) for p in plan_requests(faster, pool)]
    assert same_work == [(p.prompt_token_ids, p.max_tokens) for p in plan_requests(spec, pool)]
    reseeded = LoadSpec(20, 5.0, IntRange(4, 8), IntRange(1, 3), seed=8)
    assert plan_requests(reseeded, pool) != plan_requests(spec, pool)


def test_spec_refuses_half_a_prefix_setting() -> None:
    with pytest.raises(ValueError, match="together"):
        LoadSpec(1, 1.0, IntRange(1, 1), IntRange(1, 1), num_prefixes=2)


# --- one short run against a fake router ---------------------------------------------------

VOCAB, MAX_MODEL_LEN = 300, 128


class FakeRouter(generation_pb2_grpc.GenerationServicer):
    """Sends ``max_tokens`` tokens, one message each, a millisecond apart."""

    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.requests.append(request)
        if request.sampling.max_tokens == 13:  # the plan's unlucky number
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks")
        for i in range(request.sampling.max_tokens):
            await asyncio.sleep(0.001)
            yield generation_pb2.GenerateResponse(token_ids=[i % VOCAB])
        yield generation_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListModelsResponse:
        info = generation_pb2.ModelInfo(name="fake", max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB)
        return generation_pb2.ListModelsResponse(models=[info])


def run_against_fake(*args: str) -> tuple[int, FakeRouter]:
    servicer = FakeRouter()

    async def scenario() -> int:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            argv = ["--addr", f"127.0.0.1:{port}", "--no-progress", *args]
            return await serve.run(serve.build_parser().parse_args(argv))
        finally:
            await server.stop(None)

    return asyncio.run(scenario()), servicer


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, FakeRouter]]:
    out = tmp_path_factory.mktemp("serve") / "run.json"
    args = ["--num-requests", "24", "--rate", "200", "--prompt-len", "4:12"]
    args += ["--output-len", "10:16", "--num-prefixes", "2", "--prefix-len", "8", "--seed", "3"]
    args += ["--ttft-slo-ms", "5000", "--tpot-slo-ms", "1000", "--json", str(out)]
    code, servicer = run_against_fake(*args)
    assert code == 0
    yield json.loads(out.read_text()), servicer


def test_short_run_sends_every_request_as_token_ids_with_ignore_eos(
    short_run: tuple[dict, FakeRouter],
) -> None:
    _, servicer = short_run
    assert len(servicer.requests) == 24
    for request in servicer.requests:
        assert request.WhichOneof("input") == "token_ids"
        assert all(0 <= t < VOCAB for t in request.token_ids.ids)
        assert request.sampling.ignore_eos and request.sampling.temperature == 0
    assert len({tuple(r.token_ids.ids[:8]) for r in servicer.requests}) == 2


def test_short_run_reports_what_the_fake_router_did(short_run: tuple[dict, FakeRouter]) -> None:
    doc, servicer = short_run
    failed = sum(r.sampling.max_tokens == 13 for r in servicer.requests)
    assert 0 < failed < 24  # the seed gives some of each
    report, requests = doc["report"], doc["requests"]
    assert (report["num_completed"], report["num_failed"]) == (24 - failed, failed)
    ok = [r for r in requests if r["error"] is None]
    assert all(r["output_tokens"] == r["max_tokens"] for r in ok)
    assert {r["error"] for r in requests} == {None, "RESOURCE_EXHAUSTED: no free KV blocks"}
    total_tokens = sum(r["output_tokens"] for r in ok)
    assert report["output_throughput"] == pytest.approx(total_tokens / report["duration_s"])
    assert report["goodput"] == pytest.approx(report["request_throughput"])  # generous SLOs
    assert 0 < report["ttft_ms"]["p50"] <= report["ttft_ms"]["p99"]
    assert report["tpot_ms"]["p50"] >= 0.9  # the fake sleeps 1 ms between tokens
    assert doc["spec"]["rate"] == 200.0 and doc["model"] == "fake"


def test_prompts_too_long_for_the_model_are_refused_before_sending() -> None:
    code, servicer = run_against_fake("--prompt-len", f"{MAX_MODEL_LEN}")
    assert code == serve.EXIT_USAGE and servicer.requests == []


def test_plot_without_matplotlib_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None)
    code, servicer = run_against_fake("--num-requests", "1", "--plot", str(tmp_path / "p.png"))
    assert code == serve.EXIT_USAGE and servicer.requests == []
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_plot_is_written_when_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "latency.png"
    code, _ = run_against_fake("--num-requests", "4", "--prompt-len", "4", "--plot", str(out))
    assert code == 0
    assert out.read_bytes().startswith(b"\x89PNG")


# --- one short run against a real cluster ----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_short_run_against_a_real_cluster_measures_every_request(
    make_checkpoint: Callable[..., Path], redis_url: str, tmp_path: Path
) -> None:
    """Router, one prefill and one decode worker as processes: prompts on both sides of
    the 32-token disaggregation threshold, every token asked for, none lost."""
    model_dir = make_checkpoint("llama")
    out = tmp_path / "run.json"
    spec = cluster_spec(model_dir, redis_url, tmp_path / "logs", "loadgen")
    with LocalCluster(spec) as cluster:
        args = ["--addr", cluster.router_address, "--model-dir", str(model_dir), "--no-progress"]
        args += ["--num-requests", "6", "--rate", "inf", "--prompt-len", "8:64"]
        args += ["--output-len", "2:12", "--seed", "1", "--timeout", "60", "--json", str(out)]
        assert serve.main(args) == 0
        prefilled = worker_status(cluster, "prefill-0").num_requests
    doc = json.loads(out.read_text())
    report, requests = doc["report"], doc["requests"]
    assert doc["model"] == spec.model_name
    assert (report["num_requests"], report["num_completed"], report["num_failed"]) == (6, 6, 0)
    assert [r["error"] for r in requests] == [None] * 6
    assert [r["output_tokens"] for r in requests] == [r["max_tokens"] for r in requests]
    long_prompts = sum(r["prompt_tokens"] >= 32 for r in requests)
    assert 0 < long_prompts < 6 and prefilled == long_prompts  # both paths were taken
    for r in requests:
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] > 0
    assert report["ttft_ms"]["p50"] > 0 and report["tpot_ms"]["p50"] > 0
    total = sum(r["output_tokens"] for r in requests)
    assert report["output_throughput"] == pytest.approx(total / report["duration_s"])
