"""Live migration through a real cluster: decode workers hand running streams to a peer
with their KV (pulled over the same transfer path a prefill's KV takes) instead of
letting the next worker recompute them.

- SIGTERM with a 1 s drain, in bfloat16: every stream comes back identical to the
  no-fault run and moved with its KV (no recompute, no fallback);
- a scale-down under load takes seconds, not the streams' lifetime;
- ``Migrate`` (rebalancing) moves streams, speculative and structured-output ones
  included, and they continue token for token;
- a hand-over whose pull fails falls back to recomputing, with nothing lost or leaked.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem.cli.launcher import LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request
from tandem.common.metrics import Scrape
from tandem.common.sampling_params import SpeculativeOptions, StructuredKind, StructuredOutput
from tandem.engine import LLM, SamplingParams
from tandem.protos import common_pb2, worker_pb2, worker_pb2_grpc
from tests.cluster_util import cluster_factory, worker_status
from tests.hf_reference import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER_ARGS = (
    "--num-kv-blocks",
    "256",
    "--max-num-seqs",
    "32",
    "--registry-ttl",
    "2",
    "--heartbeat-interval",
    "0.5",
)
DECODERS = ("decode-0", "decode-1")
SLOW = {"TANDEM_FAULTS": "engine.step:delay=0.02"}
"""Decode steps of >= 20 ms: a few-hundred-token stream is still running when the test
acts on it, whatever the machine's load."""
REGEX = r"[a-z]{3}( [a-z]{2,6}){60}"


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture
def make_cluster(
    model_dir: Path, redis_url: str, tmp_path: Path
) -> Iterator[Callable[..., LocalCluster]]:
    with cluster_factory(model_dir, redis_url, tmp_path / "logs", "migrate") as make:

        def start(
            worker_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (), **spec: object
        ) -> LocalCluster:
            spec.setdefault("num_decode", 2)
            return make(
                worker_args=(*WORKER_ARGS, *worker_args),
                router_args=("--decode-policy", "round_robin", *router_args),
                metrics_port=0,
                **spec,
            )

        yield start


def _greedy(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _offline_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    offline = LLM(model_dir, dtype="float32", num_kv_blocks=512)
    greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.token_ids for o in offline.generate(prompts, greedy)]


def _router_metrics(cluster: LocalCluster) -> Scrape:
    return Scrape.of(f"http://127.0.0.1:{cluster.metrics_ports['router']}/metrics")


def _migrations(cluster: LocalCluster, cause: str, mode: str) -> float:
    return _router_metrics(cluster).value("router_decode_migrations_total", cause=cause, mode=mode)


async def _streams(
    cluster: LocalCluster,
    requests: list[tuple[list[int], common_pb2.SamplingParams]],
    act: Callable[[], None] | None = None,
    after_tokens: int = 8,
) -> list[list[int]]:
    """Run the streams at once; ``act()`` once the first stream has ``after_tokens``."""
    acted = asyncio.Event()

    async def one(client: AsyncGenerationClient, prompt, sampling) -> list[int]:
        tokens: list[int] = []
        async for response in client.generate(build_request(prompt, sampling), timeout_s=240):
            tokens += response.token_ids
            if act is not None and len(tokens) >= after_tokens and not acted.is_set():
                acted.set()
                await asyncio.to_thread(act)
        return tokens

    async with AsyncGenerationClient(cluster.router_address) as client:
        return list(await asyncio.gather(*(one(client, p, s) for p, s in requests)))


def _busiest(cluster: LocalCluster) -> tuple[str, int]:
    running = {n: worker_status(cluster, n).num_running for n in DECODERS}
    name = max(running, key=running.__getitem__)
    return name, running[name]


def _assert_nothing_held(cluster: LocalCluster, names: tuple[str, ...]) -> None:
    """No KV block, lease or request left on any worker once every stream ended."""
    deadline = time.monotonic() + 15
    while True:
        statuses = {n: worker_status(cluster, n) for n in names}
        held = {
            n: (s.num_kv_blocks - s.num_free_kv_blocks, s.num_leases, s.num_running)
            for n, s in statuses.items()
        }
        if all(h == (0, 0, 0) for h in held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(h == (0, 0, 0) for h in held.values()), held


@pytest.mark.parametrize("how", ["sigterm-1s-drain", "scale-down"])
def test_a_draining_decode_worker_hands_its_streams_over_with_their_kv(make_cluster, how):
    """The issue's test, in the checkpoint's bfloat16: 6 greedy 480-token streams over a
    router, 1 prefill and 2 decode workers. Recomputing a moved stream rounds differently
    there; moving its KV does not, so every stream is identical to the no-fault run."""
    drain = ("--drain-timeout", "1") if how == "sigterm-1s-drain" else ()
    cluster = make_cluster(
        worker_args=("--dtype", "bfloat16"),
        decode_args=("--kv-pull-timeout", "5", *drain),
        worker_env={name: SLOW for name in DECODERS},
    )
    prompts = random_prompts(6, 4096, (40, 120), seed=34)
    requests = [(p, _greedy(480)) for p in prompts]
    reference = asyncio.run(_streams(cluster, requests))
    received_before = {n: worker_status(cluster, n).kv_blocks_received for n in DECODERS}

    signalled: list[tuple[str, int, float]] = []  # (worker, its running streams, exit time)

    def act() -> None:
        name, running = _busiest(cluster)
        start = time.monotonic()
        if how == "scale-down":
            victim = cluster.workers("decode")[-1]
            name, running = victim, worker_status(cluster, victim).num_running
            cluster.scale("decode", 1)  # SIGTERM to the newest; returns once it exited
            code = 0
        else:
            pid = cluster.children[name].process.pid
            os.kill(pid, signal.SIGTERM)
            code = cluster.children[name].process.wait(timeout=60)
        assert code == 0
        signalled.append((name, running, time.monotonic() - start))

    assert asyncio.run(_streams(cluster, requests, act)) == reference
    ((name, running, exit_s),) = signalled
    assert running > 0, "no stream was on the signalled worker"
    # The default drain timeout is 25 s and each stream has >= 9 s left at 20 ms a
    # step: a worker that hands its streams over leaves long before either.
    assert exit_s < 8, f"{name} took {exit_s:.1f} s to leave"
    assert _migrations(cluster, "drain", "kv") >= running
    assert _migrations(cluster, "drain", "recompute") == 0
    (peer,) = [n for n in DECODERS if n != name]
    status = worker_status(cluster, peer)
    assert status.num_fallbacks == 0
    assert status.kv_blocks_received > received_before[peer]
    _assert_nothing_held(cluster, ("prefill-0", peer))


def test_decode_workers_stopped_together_do_not_hand_streams_to_each_other(make_cluster):
    """A scale-down of every decode worker at once: each leaves the registry before
    counting its peers, finds none, and lets its streams finish there (within
    --drain-timeout) instead of handing them to a peer that is leaving too."""
    cluster = make_cluster(
        decode_args=("--drain-timeout", "30"), worker_env={name: SLOW for name in DECODERS}
    )
    prompts = random_prompts(4, 4096, (40, 80), seed=38)
    requests = [(p, _greedy(250)) for p in prompts]
    reference = asyncio.run(_streams(cluster, requests))

    def stop_both() -> None:
        for name in DECODERS:
            cluster.children[name].process.send_signal(signal.SIGTERM)

    assert asyncio.run(_streams(cluster, requests, stop_both)) == reference
    for name in DECODERS:
        assert cluster.children[name].process.wait(timeout=60) == 0
    assert _migrations(cluster, "drain", "kv") == 0


def test_migrate_moves_speculative_and_structured_streams_unchanged(make_cluster, model_dir):
    """Rebalancing by hand: ``Migrate`` on the busiest decode worker hands its streams
    to the other one mid-flight; with n-gram speculation on and structured-output and
    seeded streams in the mix, every stream equals the offline engine's."""
    cluster = make_cluster(
        decode_args=("--speculative-method", "ngram"),
        worker_env={name: SLOW for name in DECODERS},
    )
    prompts = random_prompts(6, 4096, (40, 80), seed=35)
    structured = common_pb2.SamplingParams(
        max_tokens=150, temperature=0, structured=common_pb2.StructuredOutput(regex=REGEX)
    )
    # A seeded, sampled stream that speculates draws a varying amount of noise per token
    # and would continue on a different (equally valid) random path after any move; one
    # that does not speculate continues exactly.
    seeded = common_pb2.SamplingParams(
        max_tokens=150,
        temperature=0.8,
        seed=4,
        ignore_eos=True,
        speculative=common_pb2.SpeculativeParams(enabled=False),
    )
    requests = [
        (prompts[0], structured),
        (prompts[1], seeded),
        *((p, _greedy(150)) for p in prompts[2:]),
    ]
    offline = LLM(model_dir, dtype="float32", num_kv_blocks=512, speculative_method="ngram")
    expected = [
        offline.generate(
            [prompts[0]],
            SamplingParams(
                max_tokens=150,
                temperature=0,
                structured=StructuredOutput(StructuredKind.REGEX, REGEX),
            ),
        ),
        offline.generate(
            [prompts[1]],
            SamplingParams(
                max_tokens=150,
                temperature=0.8,
                seed=4,
                ignore_eos=True,
                speculative=SpeculativeOptions(enabled=False),
            ),
        ),
        offline.generate(
            prompts[2:], SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
        ),
    ]
    expected_tokens = [o.token_ids for batch in expected for o in batch]
    moved: list[worker_pb2.MigrateResponse] = []

    def act() -> None:
        name, _ = _busiest(cluster)
        with cluster.worker_channel(name) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            moved.append(
                stub.Migrate(
                    worker_pb2.MigrateRequest(
                        num_blocks=10_000, cause=worker_pb2.MIGRATION_CAUSE_REBALANCE
                    ),
                    timeout=10,
                )
            )

    assert asyncio.run(_streams(cluster, requests, act)) == expected_tokens
    (response,) = moved
    assert len(response.request_ids) >= 2 and response.num_blocks > 0
    assert _migrations(cluster, "rebalance", "kv") == len(response.request_ids)
    assert all(worker_status(cluster, n).num_fallbacks == 0 for n in DECODERS)
    _assert_nothing_held(cluster, ("prefill-0", *DECODERS))


def test_the_router_rebalances_onto_a_decode_worker_that_joins(make_cluster, model_dir):
    """Scale-up under load: every stream sits on the one decode worker, whose KV pool
    fills; a second one joins, and the router's rebalancer moves streams (with their
    KV) onto it. Nothing changes in the output."""
    cluster = make_cluster(
        num_decode=1,
        worker_args=("--num-kv-blocks", "128"),
        router_args=("--rebalance-interval", "0.5", "--rebalance-cooldown", "30"),
        worker_env={name: {"TANDEM_FAULTS": "engine.step:delay=0.04"} for name in DECODERS},
    )
    prompts = random_prompts(6, 4096, (56, 64), seed=37)
    expected = _offline_greedy(model_dir, prompts, 400)
    got = asyncio.run(
        _streams(
            cluster,
            [(p, _greedy(400)) for p in prompts],
            lambda: cluster.scale("decode", 2),
            after_tokens=60,
        )
    )
    assert got == expected
    assert _migrations(cluster, "rebalance", "kv") >= 1
    assert _migrations(cluster, "rebalance", "recompute") == 0
    assert worker_status(cluster, "decode-1").kv_blocks_received > 0
    _assert_nothing_held(cluster, ("prefill-0", *DECODERS))


def test_migrate_refuses_a_request_that_names_nothing(make_cluster):
    cluster = make_cluster()
    with cluster.worker_channel("decode-0") as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Migrate(worker_pb2.MigrateRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_ids, or a num_blocks" in err.value.details()
        unknown = stub.Migrate(worker_pb2.MigrateRequest(request_ids=["nobody"]), timeout=10)
        assert list(unknown.request_ids) == [] and unknown.num_blocks == 0


def test_a_handover_whose_pull_fails_is_recomputed_with_nothing_lost(make_cluster, model_dir):
    """decode-0's KV sends are dropped: the peer's pull of a handed-over stream fails,
    it recomputes the stream from its tokens (float32: identical), the lease on decode-0
    ends, and no block stays held anywhere."""
    cluster = make_cluster(
        decode_args=("--kv-pull-timeout", "2"),
        worker_env={
            "decode-0": {"TANDEM_FAULTS": "kv.send:drop,engine.step:delay=0.02"},
            "decode-1": SLOW,
        },
    )
    prompts = random_prompts(4, 4096, (40, 80), seed=36)
    expected = _offline_greedy(model_dir, prompts, 200)

    def act() -> None:
        with cluster.worker_channel("decode-0") as channel:
            worker_pb2_grpc.DecodeWorkerStub(channel).Migrate(
                worker_pb2.MigrateRequest(num_blocks=10_000), timeout=10
            )

    got = asyncio.run(_streams(cluster, [(p, _greedy(200)) for p in prompts], act))
    assert got == expected
    assert _migrations(cluster, "requested", "kv") >= 1
    assert worker_status(cluster, "decode-1").num_fallbacks >= 1
    _assert_nothing_held(cluster, ("prefill-0", *DECODERS))


def test_a_handover_whose_target_dies_is_recomputed_with_nothing_lost(make_cluster, model_dir):
    """decode-0 hands its streams over (``Migrate``) and decode-1, the only target, is
    killed at once: the router's next attempt recomputes each stream on decode-0 from its
    tokens (float32: identical), and the leases decode-0 granted for the dead worker's
    pulls end by expiry, freeing every block."""
    cluster = make_cluster(
        decode_args=("--lease-ttl", "3"),
        worker_env={name: SLOW for name in DECODERS},
    )
    prompts = random_prompts(4, 4096, (40, 80), seed=39)
    expected = _offline_greedy(model_dir, prompts, 200)
    moved: list[worker_pb2.MigrateResponse] = []

    def act() -> None:
        with cluster.worker_channel("decode-0") as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            moved.append(stub.Migrate(worker_pb2.MigrateRequest(num_blocks=10_000), timeout=10))
        cluster.children["decode-1"].process.kill()

    got = asyncio.run(_streams(cluster, [(p, _greedy(200)) for p in prompts], act))
    assert got == expected
    assert moved and moved[0].request_ids, "decode-0 ran no stream to hand over"
    assert _migrations(cluster, "requested", "kv") == len(moved[0].request_ids)
    assert _migrations(cluster, "failure", "recompute") >= 1
    _assert_nothing_held(cluster, ("prefill-0", "decode-0"))
