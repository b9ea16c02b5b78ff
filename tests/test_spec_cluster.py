"""Speculative decoding inside the decode worker, through a real cluster (router, prefill
and decode worker processes, KV pulled over gloo): greedy output equals plain offline
decoding, per-request control reaches the engine, the worker exports the counters, and
no KV block is left behind."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem.cli.launcher import LocalCluster
from tandem.cli.serve import _speculative_args, default_model
from tandem.common.sampling_params import SpecMethod, SpeculativeOptions
from tandem.engine import LLM, SamplingParams
from tandem.engine.spec_decode.speculator import SpecDecodeStats
from tandem.protos import common_pb2
from tests.cluster_util import cluster_spec, complete_all, greedy, worker_status
from tests.hf_reference import random_prompts

NUM_NEW = 24
WORKER_ARGS = ("--num-kv-blocks", "256", "--max-num-seqs", "16")


def _greedy(**speculative: object) -> common_pb2.SamplingParams:
    return greedy(NUM_NEW, **speculative)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, redis_url: str, tmp_path_factory) -> Iterator[LocalCluster]:
    """The draft is the target itself, so every proposal should be accepted."""
    spec = cluster_spec(
        model_dir,
        redis_url,
        tmp_path_factory.mktemp("spec-cluster-logs"),
        "spec",
        worker_args=WORKER_ARGS,
        decode_args=("--draft-model", str(model_dir), "--num-speculative-tokens", "4"),
    )
    with LocalCluster(spec) as running:
        yield running


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=256)


def _plain_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _spec(cluster: LocalCluster):
    status = worker_status(cluster, "decode-0")
    assert status.HasField("spec_decode"), "the decode worker does not report speculation"
    return status.spec_decode


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_draft_model_through_the_cluster_keeps_greedy_output(cluster, plain) -> None:
    prompts = random_prompts(8, 4096, (40, 90), seed=31)  # long enough to disaggregate
    before = _spec(cluster)
    results = asyncio.run(complete_all(cluster.router_address, prompts, _greedy()))
    assert [r.token_ids for r in results] == _plain_greedy(plain, prompts)
    after = _spec(cluster)
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    passes = after.num_request_passes - before.num_request_passes
    tokens = after.num_pass_tokens - before.num_pass_tokens
    assert drafted > 0
    assert accepted / drafted > 0.9  # the draft is the target
    # every token but the first (sampled by the prefill worker) came from a decode pass
    assert tokens == len(prompts) * (NUM_NEW - 1)
    # each pass emits the target's own token plus the drafts it accepted (the adaptive k
    # soon stops drafting here: a draft as big as the target never pays for itself)
    assert tokens == passes + accepted
    assert after.proposer_seconds > before.proposer_seconds
    assert worker_status(cluster, "decode-0").busy_seconds > after.proposer_seconds
    _wait_idle(cluster)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_request_control_reaches_the_decode_worker(cluster, plain, model_dir) -> None:
    prompts = random_prompts(3, 4096, (40, 60), seed=32)
    expected = _plain_greedy(plain, prompts)

    before = _spec(cluster)
    off = asyncio.run(complete_all(cluster.router_address, prompts, _greedy(enabled=False)))
    assert [r.token_ids for r in off] == expected
    assert _spec(cluster).num_draft_tokens == before.num_draft_tokens  # nothing proposed

    # n-gram lookup with k=2, asked for by the request of a worker whose default is the
    # draft model. The random model does not copy its prompt, so lookups hit only where
    # its output repeats an earlier token: an offline n-gram engine says how often.
    repeating = [phrase * 3 for phrase in random_prompts(3, 4096, (20, 20), seed=34)]
    ngram = _greedy(method=common_pb2.SPECULATIVE_METHOD_NGRAM, num_speculative_tokens=2)
    before = _spec(cluster)
    out = asyncio.run(complete_all(cluster.router_address, repeating, ngram))
    assert [r.token_ids for r in out] == _plain_greedy(plain, repeating)
    after, offline = _spec(cluster), _offline_ngram_stats(model_dir, repeating)
    assert offline.num_verifications > 0
    for counter in ("num_verifications", "num_draft_tokens", "num_accepted_tokens"):
        grew = getattr(after, counter) - getattr(before, counter)
        assert grew == getattr(offline, counter), counter
    _wait_idle(cluster)


def _offline_ngram_stats(model_dir: Path, prompts: list[list[int]]) -> SpecDecodeStats:
    """What an offline engine speculating by n-gram lookup with k=2 counts for ``prompts``."""
    options = SpeculativeOptions(method=SpecMethod.NGRAM, num_tokens=2)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, speculative=options)
    with LLM(model_dir, dtype="float32", num_kv_blocks=256, speculative_method="ngram") as llm:
        llm.generate(prompts, params)
        return llm.engine.speculator.stats


def _wait_idle(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    """Every decode block back (rejected drafts' slots included), nothing running."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = worker_status(cluster, "decode-0")
        if d.num_free_kv_blocks == d.num_kv_blocks and d.num_running == 0:
            return
        assert time.monotonic() < deadline, f"decode worker not idle: {d}"
        time.sleep(0.2)


# --- `tandem serve`'s flags ---------------------------------------------------------------


def _serve_args(**overrides: object) -> argparse.Namespace:
    fields = {
        "model": None,
        "speculative_method": None,
        "draft_model": None,
        "num_speculative_tokens": None,
    }
    return argparse.Namespace(**(fields | overrides))


@pytest.mark.skipif(
    not (Path(__file__).resolve().parents[1] / "engine/assets/trained/draft").exists(),
    reason="no trained assets in this tree",
)
def test_serve_gives_decode_workers_the_default_models_draft() -> None:
    draft = str(default_model().parent / "draft")
    assert _speculative_args(_serve_args()) == []  # off unless asked for
    assert _speculative_args(_serve_args(speculative_method="draft")) == [
        "--speculative-method",
        "draft",
        "--draft-model",
        draft,
    ]
    with_k = _serve_args(speculative_method="draft", num_speculative_tokens=3)
    assert _speculative_args(with_k)[-2:] == ["--num-speculative-tokens", "3"]
    assert _speculative_args(_serve_args(speculative_method="none")) == []
    assert _speculative_args(_serve_args(speculative_method="ngram")) == [
        "--speculative-method",
        "ngram",
    ]


def test_serve_passes_speculative_flags_for_a_given_model() -> None:
    assert _speculative_args(_serve_args(model="/m")) == []
    assert _speculative_args(_serve_args(model="/m", draft_model="/d")) == ["--draft-model", "/d"]
    assert _speculative_args(_serve_args(model="/m", speculative_method="ngram")) == [
        "--speculative-method",
        "ngram",
    ]
