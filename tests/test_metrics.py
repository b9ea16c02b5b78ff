"""Prometheus metrics on every component, scraped from a real cluster (router with the
HTTP API, one prefill and one decode worker with n-gram speculation) and parsed by
``prometheus_client``'s own parser: the numbers agree with what the clients saw and
with each other (prompt and output tokens, requests by finish reason, the KV bytes one
side sent and the other received, routing decisions), errors are counted by status
code, and the HTTP port serves the router's families too."""

from __future__ import annotations

import asyncio
import json
import os
import re
import runpy
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem.cli.launcher import LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request
from tandem.common.metrics import Scrape
from tandem.protos import common_pb2
from tests.cluster_util import cluster_spec, complete_all, free_port, worker_status
from tests.hf_reference import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NEW = 10


@pytest.fixture(scope="module")
def cluster(
    make_checkpoint: Callable[..., Path], redis_url: str, tmp_path_factory
) -> Iterator[tuple[LocalCluster, int]]:
    http_port = free_port()
    spec = cluster_spec(
        make_checkpoint("llama"),
        redis_url,
        tmp_path_factory.mktemp("metrics-logs"),
        "metrics",
        worker_args=("--num-kv-blocks", "128", "--max-model-len", "256"),
        decode_args=("--speculative-method", "ngram"),
        router_args=("--http-port", str(http_port), "--disaggregation-min-tokens", "16"),
        metrics_port=0,
    )
    with LocalCluster(spec) as running:
        yield running, http_port


def scrape(cluster: LocalCluster, name: str) -> Scrape:
    return Scrape.of(f"http://127.0.0.1:{cluster.metrics_ports[name]}/metrics")


def test_counts_agree_with_what_clients_saw(cluster) -> None:
    running, _ = cluster
    # Repetitive prompts (n-gram drafts find matches), long enough to be disaggregated.
    prompts = [([7, 8, 9, 10] * 8)[: 24 + i] for i in range(4)]
    prompts += random_prompts(2, 200, (40, 40), seed=3)
    greedy = common_pb2.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    names = ("router", "prefill-0", "decode-0")
    before = {n: scrape(running, n) for n in names}
    results = asyncio.run(complete_all(running.router_address, prompts, greedy))
    assert all(r.finish_reason == "length" for r in results)
    after = {n: scrape(running, n) for n in names}
    router, prefill, decode = after.values()

    def grew(scraped: Scrape, name: str, **labels: str) -> float:
        (component,) = (n for n in names if after[n] is scraped)
        return scraped.value(name, **labels) - before[component].value(name, **labels)

    sent_prompt = sum(len(p) for p in prompts)
    sent_output = sum(len(r.token_ids) for r in results)
    assert grew(router, "prompt_tokens_total") == sent_prompt
    assert grew(router, "generation_tokens_total") == sent_output == len(prompts) * NEW
    assert grew(router, "request_success_total", finished_reason="length") == len(prompts)
    assert grew(router, "time_to_first_token_seconds_count") == len(prompts)
    assert grew(router, "e2e_request_latency_seconds_count") == len(prompts)
    assert grew(router, "time_per_output_token_seconds_count") == len(prompts)
    # Every request went through the prefill pool, then the decode pool, on one policy.
    assert grew(router, "router_routing_decisions_total", pool="prefill") == len(prompts)
    assert grew(router, "router_routing_decisions_total", pool="decode") == len(prompts)
    assert router.labels("router_routing_decisions_total", "role") == {"router"}
    assert router.value("num_requests_running") == 0

    # The prefill worker saw every prompt once and handed each off after one token.
    assert grew(prefill, "prompt_tokens_total") == sent_prompt
    assert grew(prefill, "prefix_cache_queries_total") == sent_prompt
    assert grew(prefill, "request_queue_time_seconds_count") == len(prompts)
    assert grew(prefill, "request_success_total", finished_reason="prefilled") == len(prompts)
    # What the prefill worker sent is what the decode worker received, byte for byte.
    sent = grew(prefill, "kv_transfer_sent_bytes_total")
    assert sent > 0
    assert sent == grew(decode, "kv_transfer_received_bytes_total")
    assert grew(prefill, "kv_transfer_sent_blocks_total") == grew(
        decode, "kv_transfer_received_blocks_total"
    )
    assert grew(decode, "kv_transfer_pull_seconds_count") == grew(decode, "kv_transfer_pulls_total")
    assert grew(decode, "kv_transfer_fallbacks_total") == 0
    # The decode worker streamed the rest: the first token came from the prefill.
    assert grew(decode, "generation_tokens_total") == sent_output - len(prompts)
    # Speculation's counters are the engine's own (as GetStatus reports them too).
    # (Read both after the batch is over: the engine publishes its load after a step.)
    spec = worker_status(running, "decode-0").spec_decode
    decode = scrape(running, "decode-0")
    assert decode.value("spec_decode_num_drafts_total") == spec.num_verifications
    assert decode.value("spec_decode_num_draft_tokens_total") == spec.num_draft_tokens
    assert decode.value("spec_decode_num_accepted_tokens_total") == spec.num_accepted_tokens
    assert "tandem:spec_decode_num_drafts_total" not in prefill.text
    # Engine gauges are live and in range; nothing is left running.
    for worker in (prefill, decode):
        assert 0 <= worker.value("kv_cache_usage_perc") <= 1
        assert worker.value("num_requests_running") == 0
        assert worker.value("kv_cache_blocks") == 128
    assert prefill.labels("num_requests_running", "role") == {"prefill"}
    assert decode.labels("num_requests_running", "role") == {"decode"}


def test_refused_requests_are_counted_by_status_code(cluster) -> None:
    running, _ = cluster
    before = scrape(running, "router").value("request_errors_total", code="INVALID_ARGUMENT")

    async def bad() -> grpc.StatusCode:
        request = build_request([10**9], common_pb2.SamplingParams(max_tokens=4))
        async with AsyncGenerationClient(running.router_address) as client:
            try:
                async for _ in client.generate(request):
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code()
        raise AssertionError("an out-of-vocabulary prompt was accepted")

    assert asyncio.run(bad()) is grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(running, "router").value("request_errors_total", code="INVALID_ARGUMENT")
    assert after == before + 1


def test_http_port_serves_the_router_families(cluster) -> None:
    running, http_port = cluster
    over_http = Scrape.of(f"http://127.0.0.1:{http_port}/metrics")
    assert over_http.labels("prompt_tokens_total", "role") == {"router"}
    # Both endpoints expose the same families (values may move between the scrapes).
    names = {s.name for s in over_http.samples}
    assert names == {s.name for s in scrape(running, "router").samples}
    assert "tandem:router_worker_free_kv_blocks" in names


DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana"


def dashboard_exprs() -> list[str]:
    board = json.loads((DASHBOARD / "tandem.json").read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", ())]


def test_the_committed_dashboard_is_the_generator_output() -> None:
    generator = runpy.run_path(str(DASHBOARD / "make_dashboard.py"))
    assert (DASHBOARD / "tandem.json").read_text() == generator["render"]()


def test_every_dashboard_query_runs_on_prometheus_scraping_the_cluster(cluster, tmp_path) -> None:
    """The dashboard names only families the components export, and Prometheus (the real
    server, scraping this cluster) evaluates each of its queries."""
    running, _ = cluster
    exported = set().union(
        *({s.name for s in scrape(running, n).samples} for n in running.metrics_ports)
    )
    referenced = {m for e in dashboard_exprs() for m in re.findall(r"tandem:[a-z0-9_:]+", e)}
    assert referenced - exported == set()

    binary = shutil.which("prometheus")
    if binary is None:
        assert not os.environ.get("CI"), "CI installs prometheus (.ci/run)"
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    subprocess.run(
        [
            shutil.which("promtool"),
            "check",
            "config",
            str(DASHBOARD.parent / "prometheus" / "prometheus.yml"),
        ],
        check=True,
        capture_output=True,
    )
    targets = ", ".join(f'"127.0.0.1:{p}"' for p in running.metrics_ports.values())
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: tandem, static_configs: [{{targets: [{targets}]}}]}}]\n"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # Traffic while Prometheus scrapes, so rates and quantiles have points to work on.
        deadline = time.monotonic() + 30
        greedy = common_pb2.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        prompts = random_prompts(4, 200, (24, 40), seed=11)
        while True:
            asyncio.run(complete_all(running.router_address, prompts, greedy))
            up = _prometheus(url, "sum(up)")
            ttft = _prometheus(
                url,
                expand(
                    'rate(tandem:time_to_first_token_seconds_count{role="router"}[$__rate_interval])'
                ),
            )
            if (
                up
                and float(up[0]["value"][1]) == len(running.metrics_ports)
                and ttft
                and float(ttft[0]["value"][1]) > 0
            ):
                break
            assert time.monotonic() < deadline, "Prometheus never scraped every component"
        for expr in dashboard_exprs():
            _prometheus(url, expand(expr))  # raises unless Prometheus accepts the query
        (ttft_p99,) = [e for e in dashboard_exprs() if "0.99" in e and "first_token" in e]
        assert _scalar(url, expand(ttft_p99)) > 0
    finally:
        server.terminate()
        server.wait(timeout=30)


def expand(expr: str) -> str:
    return expr.replace("$__rate_interval", "30s").replace("$model", ".*")


def _scalar(url: str, expr: str) -> float:
    """The first series' value of an instant query (0 when it has none)."""
    result = _prometheus(url, expr)
    return float(result[0]["value"][1]) if result else 0.0


def _prometheus(url: str, expr: str) -> list:
    query = urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=10) as answer:
            body = json.load(answer)
    except urllib.error.HTTPError as err:
        if err.code == 503:  # listening, but its storage is not ready yet
            return []
        raise AssertionError(f"Prometheus refused {expr!r}: {err.read().decode()}") from err
    except OSError:
        return []  # not up yet
    assert body["status"] == "success", body
    return body["data"]["result"]
