"""Prefix-aware routing through a real cluster (2 prefill + 1 decode worker, routers as
separate processes, real Redis stream, real gRPC snapshots): same prefix -> same worker,
hashes agree across processes, a restarted router and a second replica route to the
worker that holds the prefix, and a worker that leaves is purged and never chosen."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem.cli.launcher import READY_PREFIX, ClusterSpec, LocalCluster
from tandem.common.kv_events.wire import snapshot_from_proto
from tandem.common.metrics import Scrape
from tandem.protos import common_pb2, worker_pb2, worker_pb2_grpc
from tests.cluster_util import complete_all, free_port, worker_status
from tests.hf_reference import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = common_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
WORKER_ARGS = ("--num-kv-blocks", "256", "--max-num-seqs", "16")
WORKER_HASH_SEED = "123"


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, redis_url: str, tmp_path_factory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_prefill=2,
        num_decode=1,
        router_port=free_port(),
        redis_url=redis_url,
        model_name=f"prefix-{uuid.uuid4().hex[:8]}",
        worker_args=WORKER_ARGS,
        threads_per_worker=1,
        log_dir=tmp_path_factory.mktemp("prefix-logs"),
        env=(("PYTHONHASHSEED", WORKER_HASH_SEED),),
    )
    with LocalCluster(spec) as running:
        yield running


class RouterProcess:
    """A router of our own next to the cluster's (a restarted router, or a replica)."""

    def __init__(
        self, cluster: LocalCluster, log_dir: Path, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        args = [
            sys.executable, "-m", "tandem.cli", "router",
            "--model", cluster.spec.model_dir, "--model-name", cluster.model_name,
            "--redis-url", cluster.redis_url, "--port", str(self.port),
            "--metrics-port", str(self.metrics_port), *extra_args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "987"}
        self.log = (log_dir / f"router-{self.port}.log").open("w")
        self.process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self.ready.wait(60), "router did not start"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> Scrape:
        return Scrape.of(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout_s=5)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(READY_PREFIX):
                self.ready.set()
            self.log.write(line)


def address_of(cluster: LocalCluster, name: str) -> str:
    return cluster.children[name].ready_line.split()[-1]


def warm_directly(cluster: LocalCluster, name: str, prompt: list[int]) -> None:
    """Prefill ``prompt`` on worker ``name`` without any router, then free its lease:
    only the worker's events (or its snapshot) can tell a router about it."""
    rid = f"warm-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(address_of(cluster, name)) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        stub.Prefill(
            worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY),
            timeout=60,
        )
        stub.Abort(worker_pb2.AbortRequest(request_id=rid), timeout=10)


def served_by(cluster: LocalCluster, address: str, prompt: list[int]) -> tuple[str, int]:
    """Send ``prompt`` through the router at ``address``: (prefill worker, cached tokens)."""
    before = {n: worker_status(cluster, n).num_requests for n in ("prefill-0", "prefill-1")}
    (result,) = asyncio.run(complete_all(address, [prompt], GREEDY))
    after = {n: worker_status(cluster, n).num_requests for n in before}
    (worker,) = [n for n in before if after[n] > before[n]]
    return worker, result.cached_prompt_tokens


def prompts_with_prefix(prefix: list[int], n: int, seed: int) -> list[list[int]]:
    return [prefix + tail for tail in random_prompts(n, 4096, (5, 20), seed=seed)]


def test_same_prefix_goes_to_the_same_worker(cluster: LocalCluster) -> None:
    shared = random_prompts(1, 4096, (160, 160), seed=1)[0]  # 10 blocks
    first, *rest = prompts_with_prefix(shared, 5, seed=2)
    holder, cached = served_by(cluster, cluster.router_address, first)
    assert cached == 0
    for prompt in rest:
        assert served_by(cluster, cluster.router_address, prompt) == (holder, 160)


def test_router_and_worker_hashes_agree_across_hash_seeds(cluster: LocalCluster) -> None:
    from tandem.common.hashing import hash_blocks

    prompt = random_prompts(1, 4096, (96, 96), seed=3)[0]
    warm_directly(cluster, "prefill-1", prompt)
    with grpc.insecure_channel(address_of(cluster, "prefill-1")) as channel:
        snapshot = snapshot_from_proto(
            worker_pb2_grpc.PrefillWorkerStub(channel).ListCachedBlocks(
                worker_pb2.ListCachedBlocksRequest(), timeout=10
            )
        )
    code = (
        "import sys; from tandem.common.hashing import hash_blocks\n"
        f"print(','.join(h.hex() for h in hash_blocks({prompt!r}, 16)))"
    )
    for seed in ("0", "987", "random"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        router_side = out.split(",")
        assert router_side == [h.hex() for h in hash_blocks(prompt, 16)]
        assert set(router_side) <= {h.hex() for h in snapshot.block_hashes}
    assert snapshot.block_size == 16 and snapshot.worker_id == "prefill-1"


def test_restarted_router_rebuilds_the_index_and_routes_with_hits(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    router = RouterProcess(cluster, tmp_path)
    router.stop()  # a router that went away ...
    prompt = random_prompts(1, 4096, (128, 128), seed=4)[0]
    warm_directly(cluster, "prefill-1", prompt)  # ... while prefill-1 cached this
    restarted = RouterProcess(cluster, tmp_path)
    try:
        (query,) = prompts_with_prefix(prompt, 1, seed=5)
        _wait_synced(restarted)
        # Idle pool: without the index the tie would go to prefill-0.
        assert served_by(cluster, restarted.address, query) == ("prefill-1", 128)
        assert restarted.metrics().value("router_kv_snapshots_applied_total") == 3
    finally:
        restarted.stop()


def test_two_router_replicas_agree(cluster: LocalCluster, tmp_path: Path) -> None:
    replicas = [RouterProcess(cluster, tmp_path), RouterProcess(cluster, tmp_path)]
    try:
        for replica in replicas:
            _wait_synced(replica)
        on_1 = random_prompts(1, 4096, (112, 112), seed=6)[0]
        before = [_indexed_blocks(r, "prefill-1") for r in replicas]
        warm_directly(cluster, "prefill-1", on_1)  # both replicas learn it from the stream
        for replica, count in zip(replicas, before, strict=True):
            _wait_indexed(replica, "prefill-1", count + 7)
        for i, replica in enumerate(replicas):
            (query,) = prompts_with_prefix(on_1, 1, seed=10 + i)
            assert served_by(cluster, replica.address, query) == ("prefill-1", 112)
        shared = random_prompts(1, 4096, (80, 80), seed=7)[0]
        before = {w: _indexed_blocks(replicas[1], w) for w in ("prefill-0", "prefill-1")}
        placed, _ = served_by(cluster, replicas[0].address, [*shared, 11, 12])
        _wait_indexed(replicas[1], placed, before[placed] + 5)
        assert served_by(cluster, replicas[1].address, [*shared, 13, 14]) == (placed, 80)
        # The workers' heartbeats carry their recent busy share, and it shows once they
        # have worked (what --imbalance-busy-slack guards on).
        deadline = time.monotonic() + 15
        while _busy_fraction(replicas[0], "prefill-1") <= 0:
            assert time.monotonic() < deadline, "prefill-1 never reported being busy"
            time.sleep(0.2)
    finally:
        for replica in replicas:
            replica.stop()


def _busy_fraction(router: RouterProcess, worker: str) -> float:
    return router.metrics().value("router_worker_busy_fraction", worker=worker)


def test_a_removed_worker_is_never_chosen_and_its_entries_are_gone(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # Once prefill-1 is gone the decode worker holds more of the prefix than any prefill
    # worker, and conditional disaggregation would prefill there: this test is about
    # the prefill pool's picks, so every prompt goes through it.
    router = RouterProcess(cluster, tmp_path, ("--max-local-prefill-tokens", "0"))
    try:
        _wait_synced(router)
        prompt = random_prompts(1, 4096, (96, 96), seed=8)[0]
        before = _indexed_blocks(router, "prefill-1")
        warm_directly(cluster, "prefill-1", prompt)
        _wait_indexed(router, "prefill-1", before + 6)
        (query,) = prompts_with_prefix(prompt, 1, seed=19)
        assert served_by(cluster, router.address, query) == ("prefill-1", 96)  # the holder
        cluster.kill("prefill-1", sig=15)  # SIGTERM: deregisters, the router sees it leave
        deadline = time.monotonic() + 10
        while "prefill-1" in router.metrics().labels("router_kv_index_worker_blocks", "worker"):
            assert time.monotonic() < deadline, "prefill-1 stayed in the router's index"
            time.sleep(0.1)
        served_before = worker_status(cluster, "prefill-0").num_requests
        picks_before, retries_before = _prefill_picks(router), _prefill_retries(router)
        # At once, so that prefill-0 is busy when most are placed: the removed worker
        # would be the idler choice.
        queries = prompts_with_prefix(prompt, 6, seed=20)
        results = asyncio.run(complete_all(router.address, queries, GREEDY))
        assert all(r.finish_reason == "length" for r in results)
        # One prefill pick per query, each on prefill-0: a pick of the dead prefill-1
        # would have failed and been retried there.
        assert worker_status(cluster, "prefill-0").num_requests - served_before == len(queries)
        assert _prefill_picks(router) - picks_before == len(queries)
        assert _prefill_retries(router) == retries_before
    finally:
        router.stop()


def _prefill_picks(router: RouterProcess) -> float:
    return router.metrics().value("router_routing_decisions_total", pool="prefill")


def _prefill_retries(router: RouterProcess) -> float:
    return router.metrics().value("router_prefill_retries_total")


def _wait_synced(router: RouterProcess, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        scrape = router.metrics()
        workers = scrape.labels("router_worker_free_kv_blocks", "worker")
        syncing = scrape.value("router_kv_index_workers_syncing")
        if len(workers) == 3 and "router_kv_index_workers_syncing" in scrape.text and not syncing:
            return
        assert time.monotonic() < deadline, "router never synced its KV index"
        time.sleep(0.1)


def _indexed_blocks(router: RouterProcess, worker: str) -> int:
    return int(router.metrics().value("router_kv_index_worker_blocks", worker=worker))


def _wait_indexed(router: RouterProcess, worker: str, blocks: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while _indexed_blocks(router, worker) < blocks:
        assert time.monotonic() < deadline, f"{worker}'s blocks never reached the index"
        time.sleep(0.05)
