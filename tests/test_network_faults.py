"""Network faults between hosts: router, prefill and decode worker each in a network
namespace of its own (Redis and the client in the test's), the KV traffic on a direct
prefill-decode link that the test slows, makes lossy and partitions mid-transfer.

Every request ends in exactly one outcome — the right tokens, or a clean gRPC error —
and after the partition heals the decode worker pulls KV again (a new pair generation).
Skipped, with the reason, where the machine cannot make namespaces (not root, no
iproute2, a kernel without veth/tbf). Without ``sch_netem`` the lossy phase uses a
narrow ``tbf`` whose short queue drops bursts instead of netem's random loss.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem.common.client import AsyncGenerationClient, build_request, worker_status
from tandem.common.redis_server import find_redis_binary
from tandem.engine import LLM, SamplingParams
from tandem.protos import common_pb2, worker_pb2
from tests.cluster_util import free_port
from tests.hf_reference import random_prompts
from tests.netns_util import Lab, LabUnavailable, check_privileges, network_lab

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_TOKENS = 12
GREEDY = common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
WORKER_ARGS = ("--num-kv-blocks", "160", "--max-model-len", "512", "--num-threads", "1")
CLEAN = {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
"""Outcomes a client may see here. DEADLINE_EXCEEDED is the client's own 90 s deadline:
allowed as an outcome (it is one, not a hang), and then asserted never to happen."""


class Component:
    """A process in a namespace; its output in a log file, its READY line awaited."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.ready = threading.Event()
        self.address = ""
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        with open(self.log, "a") as out:
            for line in self.process.stdout:
                out.write(line)
                out.flush()
                if line.startswith("READY "):
                    self.address = line.split()[-1]
                    self.ready.set()

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            code = self.process.poll()
            assert code is None, f"exited with {code}: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"not ready: {self.log.read_text()[-2000:]}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    try:
        check_privileges()
    except LabUnavailable as why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with network_lab() as built:
        yield built


@pytest.fixture(scope="module")
def cluster(lab: Lab, make_checkpoint: Callable[..., Path], tmp_path_factory):
    """Redis on the bridge; the three components, each in its namespace."""
    logs = tmp_path_factory.mktemp("netns-logs")
    model = str(make_checkpoint("llama"))
    redis_port = free_port()
    redis_argv = f"--bind {lab.gateway} --port {redis_port} --appendonly no".split()
    redis = subprocess.Popen(
        [str(find_redis_binary().path), *redis_argv, "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://{lab.gateway}:{redis_port}/0"
    name = f"netns-{uuid.uuid4().hex[:6]}"
    common = [sys.executable, "-m", "tandem.cli"]
    flags = ["--model", model, "--model-name", name, "--redis-url", url]
    kv_prefill, _ = lab.kv_addresses
    decode_host, router_host = lab.hosts["decode"].address, lab.hosts["router"].address

    def start(host: str, command: str, extra: str) -> Component:
        argv = [*lab.exec_prefix(host), *common, command, *flags, *extra.split()]
        return Component(argv, logs / f"{host}.log")

    workers = " ".join(WORKER_ARGS)
    prefill = start(
        "prefill",
        "prefill-worker",
        f"{workers} --host 0.0.0.0 --advertise-host {kv_prefill} --worker-id prefill-0 "
        "--lease-ttl 5",
    )
    decode = start(
        "decode",
        "decode-worker",
        f"{workers} --host {decode_host} --worker-id decode-0 --kv-pull-timeout 3",
    )
    router = start(
        "router",
        "router",
        f"--host {router_host} --port 50051 --min-prefill-workers 1 "
        "--disaggregation-min-tokens 16 --stall-timeout 4",
    )
    components = {"prefill": prefill, "decode": decode, "router": router}
    try:
        for component in components.values():
            component.wait_ready()
        _wait_serving(router.address)
        yield components
    finally:
        for component in components.values():
            component.stop()
        redis.terminate()
        redis.wait()


def _wait_serving(address: str, timeout_s: float = 60) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with grpc.insecure_channel(address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.3)
    raise AssertionError(f"router at {address} never SERVING")


def _status(component: Component, role: str) -> worker_pb2.WorkerStatus:
    with grpc.insecure_channel(component.address) as channel:
        return worker_status(channel, role)


async def _one(client: AsyncGenerationClient, prompt: list[int]) -> tuple[str, list[int]]:
    tokens: list[int] = []
    try:
        async for response in client.generate(build_request(prompt, GREEDY), timeout_s=90):
            tokens += response.token_ids
    except grpc.aio.AioRpcError as error:
        return error.code().name, tokens
    return "OK", tokens


def _send(address: str, prompts: list[list[int]], during: Callable[[], None] | None = None):
    """Send every prompt at once; ``during`` runs (in a thread) once they are in flight."""

    async def run() -> list[tuple[str, list[int]]]:
        async with AsyncGenerationClient(address) as client:
            tasks = [asyncio.ensure_future(_one(client, p)) for p in prompts]
            if during is not None:
                await asyncio.sleep(0.3)
                await asyncio.to_thread(during)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(run())


def _expected(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=160, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _assert_ledger(outcomes, expected, phase: str) -> None:
    """One outcome per request: the right tokens, or a clean error (never a hang)."""
    assert len(outcomes) == len(expected)
    for (code, tokens), want in zip(outcomes, expected, strict=True):
        assert code in CLEAN, f"{phase}: {code}"
        assert code != "DEADLINE_EXCEEDED", f"{phase}: a request hung until its deadline"
        if code == "OK":
            assert tokens == want, f"{phase}: wrong tokens"


def test_kv_transfer_survives_delay_loss_and_a_partition_between_hosts(
    lab: Lab, cluster, make_checkpoint: Callable[..., Path]
) -> None:
    router, prefill, decode = cluster["router"], cluster["prefill"], cluster["decode"]
    prompts = random_prompts(24, 4096, (60, 120), seed=60)
    expected = _expected(make_checkpoint("llama"), prompts)
    batches = [prompts[i : i + 6] for i in range(0, 24, 6)]
    wanted = [expected[i : i + 6] for i in range(0, 24, 6)]

    # 1. A healthy link: the KV is pulled from the other host.
    outcomes = _send(router.address, batches[0])
    _assert_ledger(outcomes, wanted[0], "baseline")
    assert all(code == "OK" for code, _ in outcomes)
    pulled = _status(decode, "decode").kv_blocks_received
    assert pulled > 0

    # 2. Delay and loss on the KV link: slower, still correct.
    lab.lossy_kv_link()
    outcomes = _send(router.address, batches[1])
    _assert_ledger(outcomes, wanted[1], "lossy link")
    assert all(code == "OK" for code, _ in outcomes)

    # 3. A full partition while transfers are in flight on a slow link: pulls fail
    # within --kv-pull-timeout and the decode worker prefills the prompts itself.
    lab.slow_kv_link("1mbit")
    fallbacks_before = _status(decode, "decode").num_fallbacks
    outcomes = _send(router.address, batches[2], during=lab.partition_kv_link)
    _assert_ledger(outcomes, wanted[2], "partition")
    assert all(code == "OK" for code, _ in outcomes)  # the router's links stayed up
    assert _status(decode, "decode").num_fallbacks > fallbacks_before

    # 4. Healed: the broken pair is dropped and a new generation pulls KV again.
    lab.heal_kv_link()
    before = _status(decode, "decode").kv_blocks_received
    deadline = time.monotonic() + 60
    rounds = 0
    while _status(decode, "decode").kv_blocks_received == before:
        assert time.monotonic() < deadline, "no KV pulled after the partition healed"
        fresh = random_prompts(2, 4096, (60, 90), seed=100 + rounds)
        outcomes = _send(router.address, fresh)
        assert all(code == "OK" for code, _ in outcomes)
        rounds += 1
    outcomes = _send(router.address, batches[3])
    _assert_ledger(outcomes, wanted[3], "healed")
    assert all(code == "OK" for code, _ in outcomes)

    # Nothing leaked on either host (leases of failed pulls expire after --lease-ttl 5).
    deadline = time.monotonic() + 30
    while True:
        p, d = _status(prefill, "prefill"), _status(decode, "decode")
        left = (
            p.num_kv_blocks - p.num_free_kv_blocks,
            p.num_leases,
            d.num_kv_blocks - d.num_free_kv_blocks,
            d.num_running + d.num_waiting,
        )
        if not any(left):
            break
        assert time.monotonic() < deadline, f"not back to idle: {left}"
        time.sleep(0.5)
