"""Quantized serving through a real cluster (router, prefill and decode worker processes,
real gRPC, KV pulled over gloo), both roles with int8 weights and an int8 KV cache:
greedy tokens equal the offline engine's with the same settings, with and without the
decode worker's n-gram speculation; the int8 blocks cross from the prefill to the decode
worker as stored (bytes per block from ``/metrics``); and a prefill worker whose KV dtype
differs is refused at the handshake, counted, logged, and the decode worker prefills
itself, so the answer is still right."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem.cli.launcher import LocalCluster
from tandem.common.metrics import Scrape
from tandem.engine import LLM, SamplingParams
from tandem.protos import common_pb2
from tests.cluster_util import cluster_spec, complete_all, greedy, worker_status
from tests.hf_reference import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_NEW = 16
NUM_KV_BLOCKS = 256
QUANTIZED = {"quantization": "int8", "kv_cache_dtype": "int8"}
WORKER_ARGS = (
    "--quantization=int8",
    "--kv-cache-dtype=int8",
    f"--num-kv-blocks={NUM_KV_BLOCKS}",
    "--max-num-seqs=16",
)


def _greedy(n: int = NUM_NEW, **speculative: object) -> common_pb2.SamplingParams:
    return greedy(n, **speculative)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, redis_url: str, tmp_path_factory) -> Iterator[LocalCluster]:
    """int8 weights and KV on both roles; the decode worker speculates by n-gram lookup
    unless a request turns it off."""
    spec = cluster_spec(
        model_dir,
        redis_url,
        tmp_path_factory.mktemp("quant-cluster-logs"),
        "quant",
        worker_args=WORKER_ARGS,
        decode_args=("--speculative-method", "ngram"),
        metrics_port=0,
    )
    with LocalCluster(spec) as running:
        yield running


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> Iterator[LLM]:
    with LLM(str(model_dir), num_kv_blocks=NUM_KV_BLOCKS, **QUANTIZED) as llm:
        yield llm


def _offline_greedy(llm: LLM, prompts: list[list[int]], n: int = NUM_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _scrape(cluster: LocalCluster, name: str) -> Scrape:
    return Scrape.of(f"http://127.0.0.1:{cluster.metrics_ports[name]}/metrics")


def test_int8_cluster_equals_offline_and_moves_int8_blocks(cluster, offline) -> None:
    prompts = random_prompts(6, 4096, (40, 90), seed=41)  # above the 32-token threshold
    before = {n: _scrape(cluster, n) for n in ("prefill-0", "decode-0")}
    results = asyncio.run(complete_all(cluster.router_address, prompts, _greedy(enabled=False)))
    assert [r.token_ids for r in results] == _offline_greedy(offline, prompts)

    after = {n: _scrape(cluster, n) for n in ("prefill-0", "decode-0")}

    def grew(name: str, metric: str, **labels: str) -> float:
        return after[name].value(metric, **labels) - before[name].value(metric, **labels)

    blocks = grew("decode-0", "kv_transfer_received_blocks_total")
    received = grew("decode-0", "kv_transfer_received_bytes_total")
    assert grew("decode-0", "kv_transfer_pulls_total") == len(prompts)
    assert grew("decode-0", "kv_transfer_fallbacks_total") == 0
    assert blocks == sum(-(-len(p) // 16) for p in prompts)  # every prompt block, 16 a block
    assert received == grew("prefill-0", "kv_transfer_sent_bytes_total") > 0
    # the blocks travelled as stored: one-byte codes + a float32 scale per token and head
    assert received / blocks == offline.engine.runner.layout.bytes_per_block
    assert offline.engine.runner.layout.storage_dtype.itemsize == 1


def test_ngram_speculation_on_the_decode_worker_keeps_the_tokens(cluster, offline) -> None:
    phrases = random_prompts(3, 4096, (12, 20), seed=43)
    prompts = [phrase * 3 for phrase in phrases]  # repeats for the n-gram lookup to find
    before = worker_status(cluster, "decode-0").spec_decode
    results = asyncio.run(complete_all(cluster.router_address, prompts, _greedy(24)))
    assert [r.token_ids for r in results] == _offline_greedy(offline, prompts, 24)
    after = worker_status(cluster, "decode-0").spec_decode
    assert after.num_draft_tokens > before.num_draft_tokens  # it did speculate


def test_a_kv_dtype_mismatch_falls_back_to_local_prefill(
    model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """Prefill stores int8 KV, decode fp8: the handshake refuses by name, and the decode
    worker computes prompt + first token itself. So the first token is the int8-KV
    engine's and the rest the fp8-KV engine's continuation of prompt + that token."""
    spec = cluster_spec(
        model_dir,
        redis_url,
        tmp_path,
        "quant-mismatch",
        worker_args=(f"--num-kv-blocks={NUM_KV_BLOCKS}",),
        prefill_args=("--kv-cache-dtype=int8",),
        decode_args=("--kv-cache-dtype=fp8", "--kv-pull-timeout=5"),
        metrics_port=0,
    )
    prompts = random_prompts(3, 4096, (40, 70), seed=47)
    with LocalCluster(spec) as running:
        results = asyncio.run(complete_all(running.router_address, prompts, _greedy()))
        decode = _scrape(running, "decode-0")
        assert decode.value("kv_transfer_fallbacks_total") == len(prompts)
        assert decode.value("kv_transfer_pull_failures_total", reason="incompatible") >= 1
        assert decode.value("kv_transfer_received_blocks_total") == 0
    assert "kv cache dtype" in (tmp_path / "decode-0.log").read_text()

    firsts = [r.token_ids[0] for r in results]
    with LLM(str(model_dir), num_kv_blocks=NUM_KV_BLOCKS, kv_cache_dtype="int8") as llm:
        assert firsts == [t[0] for t in _offline_greedy(llm, prompts, 1)]
    with LLM(str(model_dir), num_kv_blocks=NUM_KV_BLOCKS, kv_cache_dtype="fp8") as llm:
        rest = _offline_greedy(llm, [[*p, t] for p, t in zip(prompts, firsts, strict=True)], 15)
    assert [r.token_ids[1:] for r in results] == rest
