"""Tandem on a real local Ray (``tandem.ray``): replicas as actors in placement groups.

- 1 prefill + 1 decode replica at TP=2, launched through Ray, serve greedy output equal to
  the offline engine and transformers, with the KV moving rank i -> rank i (no fallback);
  every actor is named and found by Ray's state API, each replica's ranks sit in its own
  STRICT_PACK placement group, and stopping leaves no actor or group behind.
- ``kill -9`` of one rank process restarts its whole replica while the router keeps
  serving through the other replica, with every request answered in full.
- ``tandem scale --role decode --replicas 2`` and back to 1, run as the CLI a user runs,
  under load: the new replica serves, the retired one drains, no request is lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.util.state import list_actors, list_placement_groups  # noqa: E402

from tandem.cli.launcher import ClusterSpec  # noqa: E402
from tandem.protos import common_pb2  # noqa: E402
from tandem.ray.cluster import RayCluster  # noqa: E402
from tandem.ray.spec import RankResources, RaySpec  # noqa: E402
from tests.cluster_util import (  # noqa: E402
    SLOW_DECODE_0,
    complete_all,
    free_port,
    tpot_breach_planner,
)
from tests.hf_reference import offline_greedy_checked, random_prompts  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_NEW = 12
GREEDY = common_pb2.SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
ENGINE = ("--num-kv-blocks", "256", "--dtype", "float32")
TP2 = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A small local Ray for this module (its dashboard on: the state API needs it)."""
    ray.init(
        address="local",
        num_cpus=8,
        object_store_memory=80 * 2**20,
        include_dashboard=True,
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 4096, (40, 90), seed=11)  # above the 32-token disaggregation bar


@pytest.fixture(scope="module")
def expected(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return offline_greedy_checked(model_dir, prompts, NUM_NEW)


def _cluster(
    model_dir: Path, redis_url: str, *, prefill: int, decode: int, tp: int, **overrides: object
) -> RayCluster:
    """A cluster in a Ray namespace (and registry namespace) of its own; ``overrides``:
    further ``ClusterSpec`` fields."""
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_prefill=prefill,
        num_decode=decode,
        router_port=free_port(),
        redis_url=redis_url,
        model_name=namespace,  # the registry namespace too: tests share one Redis
        worker_args=(*ENGINE, *(TP2 if tp == 2 else ())),
        decode_args=("--kv-pull-timeout", "10"),
        threads_per_worker=1,
    )
    spec = dataclasses.replace(spec, **overrides)
    return RayCluster(spec, RaySpec(namespace=namespace, tensor_parallel_size=tp))


def _alive(namespace: str) -> list:
    alive = list_actors(filters=[("state", "=", "ALIVE")], limit=1000, detail=True)
    return [a for a in alive if a.ray_namespace == namespace]


def test_tp2_replicas_on_ray_match_and_transfer_rank_to_rank(
    local_ray, model_dir, redis_url, prompts, expected
) -> None:
    cluster = _cluster(model_dir, redis_url, prefill=1, decode=1, tp=2)
    namespace = cluster.ray_spec.namespace
    with cluster:
        results = asyncio.run(complete_all(cluster.router_address, prompts, GREEDY))
        assert [r.token_ids for r in results] == expected
        decode, prefill = cluster.worker_status("decode-0"), cluster.worker_status("prefill-0")
        assert decode.num_fallbacks == 0, "a pull fell back to local prefill"
        assert decode.kv_blocks_received >= sum(len(p) // 16 for p in prompts)
        assert prefill.kv_blocks_sent == decode.kv_blocks_received
        assert decode.num_free_kv_blocks == decode.num_kv_blocks

        actors = {a.name: a for a in _alive(namespace)}
        for name in ("controller", "router", "prefill-0", "decode-0"):
            assert f"tandem-{name}" in actors, sorted(actors)
        groups = {g.name: g for g in list_placement_groups(limit=1000)}
        table = ray.util.placement_group_table()
        for replica in ("prefill-0", "decode-0"):
            group = groups[f"tandem-{replica}"]
            row = table[group.placement_group_id]
            assert group.state == "CREATED" and len(row["bundles"]) == 2
            assert row["strategy"] == "STRICT_PACK"
            rank0 = actors[f"tandem-{replica}"]
            ranks = [n for n in actors if n.startswith(f"tandem-{replica}-")]
            assert len(ranks) == 1 and ranks[0].endswith("-rank1"), ranks
            for actor in (rank0, actors[ranks[0]]):
                assert actor.placement_group_id == group.placement_group_id
        assert cluster.status().endpoint("decode-0").pid == rank0.pid
    assert _alive(namespace) == []
    left = [g.name for g in list_placement_groups(limit=1000) if g.state != "REMOVED"]
    assert not [n for n in left if n in ("tandem-prefill-0", "tandem-decode-0")], left


class Load:
    """Requests from a thread, ``concurrency`` at a time, until stopped; every answer
    is checked against the expected tokens."""

    def __init__(self, address: str, prompts, expected, concurrency: int = 3) -> None:
        self.address, self.prompts, self.expected = address, prompts, expected
        self.concurrency = concurrency
        self.answered = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)
        assert not self._thread.is_alive(), "the load's last requests hung"

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            picks = [(i + k) % len(self.prompts) for k in range(self.concurrency)]
            i += self.concurrency
            try:
                batch = [self.prompts[p] for p in picks]
                results = asyncio.run(complete_all(self.address, batch, GREEDY, timeout_s=120))
            except Exception as err:  # a failed stream is what the tests look for
                self.errors.append(f"{type(err).__name__}: {err}")
                continue
            for pick, result in zip(picks, results, strict=True):
                if result.token_ids != self.expected[pick]:
                    self.errors.append(f"prompt {pick}: {result.token_ids}")
            self.answered += len(results)


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _router_sees(cluster: RayCluster, decode: int) -> bool:
    """Whether the router's registry view holds ``decode`` decode workers now."""
    import grpc

    from tandem.protos import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10).models
        except grpc.RpcError:
            return False
    return models[0].num_decode_workers == decode


def test_killed_rank_restarts_its_replica_while_the_other_serves(
    local_ray, model_dir, redis_url, prompts, expected
) -> None:
    with _cluster(model_dir, redis_url, prefill=0, decode=2, tp=2) as cluster:
        namespace = cluster.ray_spec.namespace
        before = cluster.status().endpoint("decode-0")
        rank1 = next(
            a for a in _alive(namespace) if a.name.startswith("tandem-decode-0-")
        )  # decode-0's rank 1
        with Load(cluster.router_address, prompts, expected) as load:
            _wait(lambda: load.answered >= 3, 120, "the first answers")
            os.kill(rank1.pid, signal.SIGKILL)
            _wait(
                lambda: (
                    (e := cluster.status().endpoint("decode-0")) is not None and e.pid != before.pid
                ),
                180,
                "decode-0 to come back",
            )
            _wait(lambda: _router_sees(cluster, 2), 60, "the router to see decode-0 again")
            answered = load.answered
            _wait(lambda: load.answered >= answered + 6, 120, "answers after the restart")
        assert load.errors == []
        restarted = {a.name: a for a in _alive(namespace)}["tandem-decode-0"]
        assert restarted.num_restarts >= 1
        assert cluster.worker_status("decode-0").num_kv_blocks > 0

        # The router actor comes back too, on the same port.
        router = {a.name: a for a in _alive(namespace)}["tandem-router"]
        os.kill(router.pid, signal.SIGKILL)
        _wait(
            lambda: (
                {a.name: a.pid for a in _alive(namespace)}.get("tandem-router")
                not in (None, router.pid)
                and _router_sees(cluster, 2)
            ),
            120,
            "the router to come back on its port",
        )
        results = asyncio.run(complete_all(cluster.router_address, prompts[:2], GREEDY))
        assert [r.token_ids for r in results] == expected[:2]


def _scale_cli(cluster: RayCluster, replicas: int) -> str:
    command = [sys.executable, "-m", "tandem.cli", "scale", "--role", "decode"]
    command += ["--replicas", str(replicas), "--ray-address", cluster.ray_address]
    command += ["--ray-namespace", cluster.ray_spec.namespace]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_scale_decode_up_and_down_under_load_loses_nothing(
    local_ray, model_dir, redis_url, prompts, expected
) -> None:
    with _cluster(model_dir, redis_url, prefill=1, decode=1, tp=1) as cluster:
        with Load(cluster.router_address, prompts, expected, concurrency=4) as load:
            _wait(lambda: load.answered >= 4, 120, "the first answers")
            out = _scale_cli(cluster, 2)
            assert "decode: 1 -> 2 replicas" in out and "decode-0, decode-1" in out
            assert cluster.workers("decode") == ["decode-0", "decode-1"]
            assert _router_sees(cluster, 2)
            _wait(
                lambda: cluster.worker_status("decode-1").num_requests > 0,
                120,
                "decode-1 to take requests",
            )
            out = _scale_cli(cluster, 1)
            assert "decode: 2 -> 1 replicas" in out
            answered = load.answered
            _wait(lambda: load.answered >= answered + 4, 120, "answers after the scale-down")
        assert load.errors == []
        assert cluster.workers("decode") == ["decode-0"]
        assert _router_sees(cluster, 1)
        names = {a.name for a in _alive(cluster.ray_spec.namespace)}
        assert "tandem-decode-1" not in names
        groups = [g for g in list_placement_groups(limit=1000) if g.name == "tandem-decode-1"]
        assert groups and all(g.state == "REMOVED" for g in groups)


def test_resources_become_bundles_and_labels() -> None:
    rank = RankResources(cpus=2, gpus=1, memory_gb=1.5, custom={"big": 1}, labels={"pool": "d"})
    assert rank.bundle == {"CPU": 2, "GPU": 1, "memory": 1.5 * 2**30, "big": 1}
    spec = RaySpec(tensor_parallel_size=2, decode=rank)
    assert spec.bundles("decode") == [rank.bundle, rank.bundle]
    assert spec.label_selectors("decode") == [{"pool": "d"}] * 2
    assert spec.label_selectors("prefill") is None
    with pytest.raises(ValueError, match="a CPU or a GPU"):
        RankResources(cpus=0)


def _serve_bench(cluster: RayCluster, out: Path, num_requests: int) -> dict:
    """``bench/serve.py`` against the cluster's router, as a user runs it."""
    command = [sys.executable, "-m", "tandem.bench.serve", "--addr", cluster.router_address]
    command += ["--num-requests", str(num_requests), "--prompt-len", "20:40"]
    command += ["--output-len", "24:24", "--json", str(out), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["report"]


def test_planner_grows_the_ray_decode_pool_on_a_tpot_breach_and_drains_it_back(
    local_ray, model_dir, redis_url, tmp_path
) -> None:
    """``tandem planner --actuator ray`` (its own process, joining the cluster by address)
    under ``bench/serve.py`` load: a TPOT breach adds a decode replica, the end of the
    load drains it, nothing is lost."""
    from tandem.common.metrics import Scrape

    cluster = _cluster(
        model_dir, redis_url, prefill=1, decode=1, tp=1, worker_env=SLOW_DECODE_0, metrics_port=0
    )
    config = tpot_breach_planner()
    command = [sys.executable, "-m", "tandem.cli", "planner", "--actuator", "ray"]
    command += ["--tpot-p99", str(config.tpot_p99_s), "--planner-interval", "1"]
    command += ["--min-decode", "1", "--max-decode", "2", "--min-prefill", "1"]
    command += ["--max-prefill", "1", "--scale-up-cooldown", "0", "--scale-down-cooldown", "0"]
    command += ["--down-stable", "0", "--lead-time", "1", "--metrics-port", "0"]
    log = tmp_path / "planner.log"
    with cluster, log.open("w") as out:
        command += ["--ray-address", cluster.ray_address]
        command += ["--ray-namespace", cluster.ray_spec.namespace]
        planner = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait(lambda: "planner metrics at" in log.read_text(), 60, "the planner to start")
            assert "planner: decode pool = 1 replicas on Ray (decode-0)" in log.read_text()
            (url,) = [w for w in log.read_text().split() if w.endswith("/metrics")]
            up = _serve_bench(cluster, tmp_path / "up.json", 32)
            _wait(lambda: len(cluster.workers("decode")) == 2, 120, "a second decode replica")
            more = _serve_bench(cluster, tmp_path / "more.json", 16)
            _wait(lambda: cluster.workers("decode") == ["decode-0"], 120, "the drain back to 1")
            scale_events = lambda direction: Scrape.of(url).value(  # noqa: E731
                "tandem:planner_scale_events_total", pool="decode", direction=direction
            )
            _wait(lambda: scale_events("down") >= 1, 30, "the planner to count its drain")
            assert scale_events("up") >= 1
        finally:
            planner.send_signal(signal.SIGINT)
            assert planner.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert (up["num_failed"], more["num_failed"]) == (0, 0)
        assert up["num_completed"] + more["num_completed"] == 48
        assert "tandem-decode-1" not in {a.name for a in _alive(cluster.ray_spec.namespace)}
