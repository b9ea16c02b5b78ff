"""Mutual TLS between components: a real cluster whose every internal link (router to
workers, the decode worker's KV control channel to the prefill worker) is mTLS with the
certificates of ``tandem certs``, and whose public port is TLS with API keys. Outputs
still equal transformers', KV still moves, and a caller without a certificate from the
internal CA is refused by every worker."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cli.launcher import LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request
from tandem.common.grpc_server import LIVENESS_SERVICE
from tandem.common.tls import InternalTLS, internal_channel, internal_sync_channel
from tandem.protos import common_pb2, worker_pb2, worker_pb2_grpc
from tandem.tools.certs import make_certs
from tests.cluster_util import cluster_spec, complete_all, worker_status
from tests.hf_reference import hf_greedy, random_prompts

GREEDY = common_pb2.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
KEY = "mtls-test-key"


def _status(channel: grpc.Channel, name: str = "decode") -> worker_pb2.WorkerStatus:
    stub = worker_pb2_grpc.PrefillWorkerStub if name.startswith("prefill") else None
    stub = stub or worker_pb2_grpc.DecodeWorkerStub
    return stub(channel).GetStatus(worker_pb2.StatusRequest(), timeout=10)


def _refused(channel: grpc.Channel, name: str = "decode") -> grpc.StatusCode:
    with channel, pytest.raises(grpc.RpcError) as caught:
        _status(channel, name)
    return caught.value.code()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cluster_on_mutual_tls_serves_and_refuses_callers_without_a_certificate(
    make_checkpoint: Callable[..., Path], redis_url: str, tmp_path: Path
) -> None:
    model_dir = make_checkpoint("llama")
    certs = make_certs(tmp_path / "certs")
    stranger = make_certs(tmp_path / "stranger")  # another CA: same names, other keys
    spec = cluster_spec(
        model_dir,
        redis_url,
        tmp_path / "logs",
        "mtls",
        worker_args=("--num-kv-blocks", "128"),
        router_args=("--disaggregation-min-tokens", "8"),
        tls_dir=certs.directory,
        api_keys=(KEY,),
    )
    prompts = random_prompts(3, 256, (20, 40), seed=5)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    with LocalCluster(spec) as cluster:
        roots = cluster.ca_certificates
        got = asyncio.run(
            complete_all(
                cluster.router_address, prompts, GREEDY, api_key=KEY, root_certificates=roots
            )
        )
        assert [c.token_ids for c in got] == expected
        # The prompts were prefilled remotely and their KV pulled over the mTLS control channel.
        assert worker_status(cluster, "decode-0").kv_blocks_received > 0
        assert worker_status(cluster, "prefill-0").kv_blocks_sent > 0

        for name in ("prefill-0", "decode-0"):
            address = cluster.worker_address(name)
            assert _refused(grpc.insecure_channel(address), name) is grpc.StatusCode.UNAVAILABLE
            # Trusts the server, presents no certificate of its own.
            anonymous = grpc.ssl_channel_credentials(certs.ca.read_bytes())
            assert (
                _refused(grpc.secure_channel(address, anonymous), name)
                is grpc.StatusCode.UNAVAILABLE
            )
            # A certificate from another CA.
            foreign = InternalTLS(certs.ca, stranger.cert("router"), stranger.key("router"))
            assert (
                _refused(internal_sync_channel(address, foreign), name)
                is grpc.StatusCode.UNAVAILABLE
            )
            # The fleet's name instead of the address works too (one identity for all pods).
            named = InternalTLS(
                certs.ca, certs.cert("router"), certs.key("router"), server_name="tandem-internal"
            )
            with internal_sync_channel(address, named) as channel:
                assert _status(channel, name).worker_id == name

        # The public port: plaintext is refused; TLS without the key is UNAUTHENTICATED.
        assert (
            _refused(grpc.insecure_channel(cluster.router_address)) is grpc.StatusCode.UNAVAILABLE
        )

        async def without_key() -> grpc.StatusCode:
            async with AsyncGenerationClient(cluster.router_address, None, roots) as client:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in client.generate(build_request(prompts[0], GREEDY), timeout_s=30):
                        pass
                return caught.value.code()

        assert asyncio.run(without_key()) is grpc.StatusCode.UNAUTHENTICATED
        # The refusals cost nothing: the cluster is still ready and answers.
        assert cluster.router_health() == health_pb2.HealthCheckResponse.SERVING
        again = asyncio.run(
            complete_all(
                cluster.router_address, prompts[:1], GREEDY, api_key=KEY, root_certificates=roots
            )
        )
        assert again[0].token_ids == expected[0]


def test_tandem_certs_writes_a_ca_and_private_keys_only_the_owner_reads(tmp_path: Path) -> None:
    out = tmp_path / "dev-certs"
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "certs", str(out), "--host", "10.1.2.3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"--ssl-ca-certs {out / 'ca.pem'}" in done.stdout
    for name in ("ca", "router", "prefill", "decode"):
        assert (out / f"{name}.pem").read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
        mode = stat.S_IMODE(os.stat(out / f"{name}-key.pem").st_mode)
        assert mode == 0o600, f"{name}-key.pem is {oct(mode)}"
    from cryptography import x509

    leaf = x509.load_pem_x509_certificate((out / "decode.pem").read_bytes())
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    hosts = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", "10.1.2.3"} <= hosts
    assert "tandem-internal" in names.get_values_for_type(x509.DNSName)


def _worker_cli(*flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tandem.cli", "decode-worker", "--model", "unused"]
    return subprocess.run(
        [*command, "--redis-url", "redis://127.0.0.1:1", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_worker_tls_flags_that_cannot_work_are_one_line_errors(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ("decode",))
    missing_cert = _worker_cli("--ssl-ca-certs", str(certs.ca))
    assert missing_cert.returncode == 2
    assert "--ssl-ca-certs needs this process's certificate and key" in missing_cert.stderr
    without_ca = _worker_cli("--ssl-certfile", str(certs.cert("decode")), "--ssl-keyfile", "k")
    assert without_ca.returncode == 2
    assert "need --ssl-ca-certs" in without_ca.stderr
    unreadable = _worker_cli(
        "--ssl-ca-certs",
        str(tmp_path / "nope.pem"),
        "--ssl-certfile",
        str(certs.cert("decode")),
        "--ssl-keyfile",
        str(certs.key("decode")),
    )
    assert unreadable.returncode != 0
    assert f"cannot read CA certificates {tmp_path / 'nope.pem'}" in unreadable.stderr
    assert "Traceback" not in unreadable.stderr
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    wrong = _worker_cli(
        "--ssl-ca-certs",
        str(not_pem),
        "--ssl-certfile",
        str(certs.cert("decode")),
        "--ssl-keyfile",
        str(certs.key("decode")),
    )
    assert "is not a PEM file" in wrong.stderr and "Traceback" not in wrong.stderr


def test_probes_use_a_plaintext_health_port_that_serves_health_alone(tmp_path: Path) -> None:
    """A kubelet's gRPC probe cannot present a certificate: ``--health-port`` answers
    health in plaintext there, while the mTLS port refuses it and the health port
    serves nothing else."""
    from tandem.common.grpc_server import start_server

    certs = make_certs(tmp_path / "certs", ("decode", "router"))
    mtls = InternalTLS(certs.ca, certs.cert("decode"), certs.key("decode"))
    client = InternalTLS(certs.ca, certs.cert("router"), certs.key("router"))
    request = health_pb2.HealthCheckRequest()

    async def code_of(call) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        return caught.value.code()

    async def scenario() -> None:
        service = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
        add = lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(  # noqa: E731
            worker_pb2_grpc.DecodeWorkerServicer(), s
        )
        server = await start_server("127.0.0.1", 0, [add], [service], tls=mtls, health_port=0)
        main, probe = f"127.0.0.1:{server.port}", f"127.0.0.1:{server.health_port}"
        try:
            async with internal_channel(main, client) as channel:
                ok = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
                assert ok.status == health_pb2.HealthCheckResponse.SERVING
            async with grpc.aio.insecure_channel(main) as channel:
                refused = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
                assert await code_of(refused) is grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(probe) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                assert (await health.Check(request, timeout=5)).status == ok.status
                liveness = health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE)
                assert (await health.Check(liveness, timeout=5)).status == ok.status
                await server.set_serving(False)  # readiness follows the main server's
                not_ready = (await health.Check(request, timeout=5)).status
                assert not_ready == health_pb2.HealthCheckResponse.NOT_SERVING
                status = worker_pb2_grpc.DecodeWorkerStub(channel).GetStatus(
                    worker_pb2.StatusRequest(), timeout=5
                )
                assert await code_of(status) is grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop(0)

    asyncio.run(scenario())
