"""End to end through a real cluster (router + 1 prefill + 1 decode worker as separate
processes, real gRPC, real Redis, KV pulled over gloo): outputs equal the offline
engine's and transformers', prefix sharing pulls only missing blocks, and nothing leaks
when streams are cancelled or fail."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem.cli.launcher import LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request, stream_generate
from tandem.common.model_config import ModelConfig
from tandem.engine import LLM, SamplingParams
from tandem.protos import common_pb2
from tests.cluster_util import cluster_spec, complete_all, worker_status
from tests.hf_reference import hf_greedy, random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_NEW = 16
GREEDY = common_pb2.SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
WORKER_ARGS = ("--num-kv-blocks", "256", "--max-num-seqs", "64")
DECODE_ARGS = ("--kv-pull-timeout", "3")
DECODE_STEP_S = 0.01
"""Every decode-0 step is held this long (fault injection), so that a long request takes
a known least time: a few hundred steps in all for the other tests, and 20 s for a
stream that runs to the end of the model's context."""


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, redis_url: str, tmp_path_factory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("cluster-logs")
    spec = cluster_spec(
        model_dir,
        redis_url,
        logs,
        "e2e",
        worker_args=WORKER_ARGS,
        decode_args=DECODE_ARGS,
        worker_env={"decode-0": {"TANDEM_FAULTS": f"engine.step:delay={DECODE_STEP_S}"}},
    )
    with LocalCluster(spec) as running:
        yield running


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=256)


def _offline_greedy(llm: LLM, prompts: list[list[int]], n: int = NUM_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _wait_idle(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    """Both workers back to every block free, no lease, nothing running."""
    deadline = time.monotonic() + timeout_s
    while True:
        p, d = worker_status(cluster, "prefill-0"), worker_status(cluster, "decode-0")
        idle = (
            p.num_free_kv_blocks == p.num_kv_blocks
            and p.num_leases == 0
            and p.num_running == 0
            and d.num_free_kv_blocks == d.num_kv_blocks
            and d.num_running == 0
            and d.num_waiting == 0
        )
        if idle:
            return
        assert time.monotonic() < deadline, f"workers not idle: {p} {d}"
        time.sleep(0.2)


def test_concurrent_greedy_streams_equal_offline_and_transformers(cluster, offline, model_dir):
    prompts = random_prompts(8, 4096, (33, 90), seed=21)  # all above the 32-token threshold
    before = worker_status(cluster, "prefill-0").num_requests
    results = asyncio.run(complete_all(cluster.router_address, prompts, GREEDY))
    expected = _offline_greedy(offline, prompts)
    assert [r.token_ids for r in results] == expected
    assert expected == hf_greedy(model_dir, prompts, NUM_NEW)
    assert all(r.finish_reason == "length" for r in results)
    assert worker_status(cluster, "prefill-0").num_requests == before + len(prompts)
    assert worker_status(cluster, "decode-0").kv_blocks_received > 0
    _wait_idle(cluster)


def test_short_prompts_skip_the_prefill_worker_and_still_match(cluster, offline):
    prompts = random_prompts(4, 4096, (3, 20), seed=5)
    before = worker_status(cluster, "prefill-0").num_requests
    results = asyncio.run(complete_all(cluster.router_address, prompts, GREEDY))
    assert [r.token_ids for r in results] == _offline_greedy(offline, prompts)
    assert worker_status(cluster, "prefill-0").num_requests == before


def test_shared_prefix_pulls_only_missing_blocks(cluster, offline):
    shared = random_prompts(1, 4096, (64, 64), seed=77)[0]  # 4 full blocks
    first, second = [*shared, 11, 12, 13], [*shared, 21, 22, 23, 24, 25]
    received = worker_status(cluster, "decode-0").kv_blocks_received
    asyncio.run(complete_all(cluster.router_address, [first], GREEDY))
    after_first = worker_status(cluster, "decode-0").kv_blocks_received
    assert after_first - received == 5  # 67 tokens: 4 full blocks + 1 partial
    results = asyncio.run(complete_all(cluster.router_address, [second], GREEDY))
    after_second = worker_status(cluster, "decode-0").kv_blocks_received
    assert after_second - after_first == 1  # only the tail block: the 4 shared ones are local
    assert results[0].token_ids == _offline_greedy(offline, [second])[0]
    assert results[0].cached_prompt_tokens == 64  # the prefill worker's prefix cache hit


def test_text_and_stop_strings_match_offline(cluster, offline):
    prompt = random_prompts(1, 4096, (40, 40), seed=8)[0]
    free = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )[0]
    stop = free.text[len(free.text) // 2 :][:3]
    sampling = common_pb2.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    (result,) = asyncio.run(complete_all(cluster.router_address, [prompt], sampling))
    expected = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    )[0]
    assert result.text == expected.text == free.text[: free.text.index(stop)]
    assert result.finish_reason == "stop"
    _wait_idle(cluster)


def test_seeded_sampling_matches_offline(cluster, offline):
    prompts = random_prompts(3, 4096, (40, 60), seed=9)
    sampling = common_pb2.SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True
    )
    results = asyncio.run(complete_all(cluster.router_address, prompts, sampling))
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    assert [r.token_ids for r in results] == [
        o.token_ids for o in offline.generate(prompts, params)
    ]


def test_thirty_two_concurrent_streams(cluster, offline):
    prompts = random_prompts(32, 4096, (10, 80), seed=32)
    results = asyncio.run(complete_all(cluster.router_address, prompts, GREEDY))
    assert [r.token_ids for r in results] == _offline_greedy(offline, prompts)
    _wait_idle(cluster)


def test_cancelled_stream_frees_blocks_on_both_workers(cluster, model_dir):
    prompt = random_prompts(1, 4096, (80, 80), seed=3)[0]
    max_tokens = ModelConfig.from_dir(model_dir).max_position_embeddings - len(prompt)
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def start_then_cancel() -> int:
        async with AsyncGenerationClient(cluster.router_address) as client:
            call = client.generate(build_request(prompt, sampling))
            seen = 0
            async for response in call:
                seen += len(response.token_ids)
                if seen >= 5:
                    call.cancel()
                    break
            return seen

    assert asyncio.run(start_then_cancel()) >= 5
    # not cancelled, the request would hold decode-0 for max_tokens slowed steps
    _wait_idle(cluster, timeout_s=max_tokens * DECODE_STEP_S / 4)


def test_bad_requests_get_clear_errors(cluster):
    bad = common_pb2.SamplingParams(max_tokens=4, top_p=1.5)
    with pytest.raises(grpc.RpcError) as err:
        list(stream_generate(cluster.router_address, [11, 12, 13], bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stream_generate(cluster.router_address, [11] * 5000, GREEDY))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    long = common_pb2.SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as err:
        list(stream_generate(cluster.router_address, [11] * 40, long, timeout_s=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(cluster)


def test_every_server_reports_health_and_lists_its_services(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    addresses = {
        "router": (cluster.router_address, "tandem.v1.Generation"),
        "prefill-0": (cluster.children["prefill-0"].ready_line.split()[-1], "tandem.v1.KVTransfer"),
        "decode-0": (cluster.children["decode-0"].ready_line.split()[-1], "tandem.v1.DecodeWorker"),
    }
    for name, (address, service) in addresses.items():
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING, name
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
            names = {s.name for s in answer.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names, name


def test_tandem_generate_cli_streams_from_the_cluster(cluster, offline):
    import subprocess
    import sys

    prompt = "def add(a, b):"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "generate",
            "--addr",
            cluster.router_address,
            prompt,
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    expected = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    assert result.stdout.rstrip("\n") == expected.text
    assert "completion 12 tokens" in result.stderr
