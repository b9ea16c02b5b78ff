"""A disaggregated cluster of tensor-parallel replicas: 1 prefill + 1 decode worker at
TP=2 each (real processes, gRPC, Redis, gloo), with the KV moving rank i -> rank i.
Greedy output equals the offline engine and transformers, every decode rank received
its heads (no fallback to local prefill), and a decode replica of another TP size is
refused by name at the handshake and falls back to computing the prompt itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem.cli.launcher import LocalCluster
from tandem.protos import common_pb2
from tests.cluster_util import cluster_spec, complete_all, worker_status
from tests.hf_reference import offline_greedy_checked, random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_NEW = 12
GREEDY = common_pb2.SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
TP2 = ("--num-kv-blocks", "256", "--dtype", "float32", "--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, 4096, (40, 90), seed=5)  # above the router's 32-token threshold


@pytest.fixture(scope="module")
def expected(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return offline_greedy_checked(model_dir, prompts, NUM_NEW)


def _cluster(model_dir: Path, redis_url: str, logs: Path, decode_args: tuple[str, ...]):
    spec = cluster_spec(
        model_dir,
        redis_url,
        logs,
        "tp",
        prefill_args=TP2,
        decode_args=(*decode_args, "--kv-pull-timeout", "10"),
    )
    return LocalCluster(spec)


@pytest.fixture(scope="module")
def tp_cluster(model_dir: Path, redis_url: str, tmp_path_factory) -> Iterator[LocalCluster]:
    with _cluster(model_dir, redis_url, tmp_path_factory.mktemp("tp-logs"), TP2) as running:
        yield running


def test_tp2_replicas_transfer_rank_to_rank_and_match(tp_cluster, prompts, expected) -> None:
    results = asyncio.run(complete_all(tp_cluster.router_address, prompts, GREEDY))
    assert [r.token_ids for r in results] == expected
    decode = worker_status(tp_cluster, "decode-0")
    assert decode.num_fallbacks == 0, "a pull fell back to local prefill"
    assert decode.kv_blocks_received >= sum(len(p) // 16 for p in prompts)
    prefill = worker_status(tp_cluster, "prefill-0")
    assert prefill.kv_blocks_sent == decode.kv_blocks_received
    # Blocks freed everywhere once the streams ended (rank 0's pool is the replica's).
    assert decode.num_free_kv_blocks == decode.num_kv_blocks


def test_tp_size_mismatch_is_refused_by_name(model_dir, redis_url, tmp_path, prompts, expected):
    decode_tp1 = ("--num-kv-blocks", "256", "--dtype", "float32")
    with _cluster(model_dir, redis_url, tmp_path, decode_tp1) as cluster:
        results = asyncio.run(complete_all(cluster.router_address, prompts[:2], GREEDY))
        assert [r.token_ids for r in results] == expected[:2]
        assert worker_status(cluster, "decode-0").num_fallbacks == 2
    log = (tmp_path / "decode-0.log").read_text()
    assert "tensor-parallel size" in log, log[-2000:]


def test_a_tp2_decode_replica_hands_its_streams_to_another_rank_to_rank(
    model_dir, redis_url, tmp_path, prompts
) -> None:
    """Live migration between two TP=2 decode replicas: each rank of the replica handing
    over sends its heads to the same rank of the receiving one; the streams continue
    exactly (the offline engine, itself checked against transformers), with no recompute."""
    from tandem.protos import worker_pb2, worker_pb2_grpc

    n = 160
    decoders = ("decode-0", "decode-1")
    spec = cluster_spec(
        model_dir,
        redis_url,
        tmp_path,
        "tp-migrate",
        num_decode=2,
        prefill_args=TP2,
        decode_args=(*TP2, "--kv-pull-timeout", "10"),
        router_args=("--decode-policy", "round_robin"),
        worker_env={d: {"TANDEM_FAULTS": "engine.step:delay=0.03"} for d in decoders},
    )
    expected = offline_greedy_checked(model_dir, prompts[:4], n)
    greedy = common_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    moved: list[worker_pb2.MigrateResponse] = []
    with LocalCluster(spec) as cluster:

        async def run() -> list[list[int]]:
            from tandem.common.client import AsyncGenerationClient, build_request

            acted = asyncio.Event()

            async def one(client, prompt) -> list[int]:
                tokens: list[int] = []
                request = build_request(prompt, greedy)
                async for response in client.generate(request, timeout_s=300):
                    tokens += response.token_ids
                    if len(tokens) >= 10 and not acted.is_set():
                        acted.set()
                        await asyncio.to_thread(migrate)
                return tokens

            async with AsyncGenerationClient(cluster.router_address) as client:
                return list(await asyncio.gather(*(one(client, p) for p in prompts[:4])))

        def migrate() -> None:
            running = {d: worker_status(cluster, d).num_running for d in decoders}
            busiest = max(running, key=running.__getitem__)
            with cluster.worker_channel(busiest) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                request = worker_pb2.MigrateRequest(num_blocks=10_000)
                moved.append(stub.Migrate(request, timeout=30))

        assert asyncio.run(run()) == expected
        assert moved and len(moved[0].request_ids) >= 1
        assert all(worker_status(cluster, d).num_fallbacks == 0 for d in decoders)
        received = sum(worker_status(cluster, d).kv_blocks_received for d in decoders)
        sent = worker_status(cluster, "prefill-0").kv_blocks_sent
        assert received > sent  # the prefill's prompts, and the handed-over streams
