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
