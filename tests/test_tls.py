"""TLS on the router's public port: a real router with a certificate made here."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tandem.common.client import AsyncGenerationClient
from tandem.common.tls import TLSFiles
from tandem.router.main import RouterState, run
from tests.cluster_util import router_options

x509 = pytest.importorskip("cryptography.x509", reason="cryptography (test extra) not installed")


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost, signed by its own key (PEM files)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = directory / f"{name}.crt", directory / f"{name}.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return certfile, keyfile


def test_a_router_serving_tls_answers_only_clients_that_trust_it(
    make_checkpoint: Callable[..., Path], redis_url: str, tmp_path: Path
) -> None:
    certfile, keyfile = _self_signed(tmp_path, "router")
    stranger, _ = _self_signed(tmp_path, "stranger")
    options = router_options(
        make_checkpoint("llama"),
        redis_url,
        "tls",
        tls=TLSFiles(certfile, keyfile),
    )

    async def models(address: str, roots: bytes | None) -> str:
        async with AsyncGenerationClient(address, root_certificates=roots) as client:
            return (await client.list_models(timeout_s=5)).models[0].name

    async def scenario() -> None:
        stop = asyncio.Event()
        started: asyncio.Future[RouterState] = asyncio.get_running_loop().create_future()
        router = asyncio.create_task(run(options, stop, started))
        address = f"127.0.0.1:{(await started).port}"
        try:
            assert await models(address, certfile.read_bytes()) == options.model_name
            for roots in (None, stranger.read_bytes()):  # plaintext, or an unknown CA
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await models(address, roots)
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        finally:
            stop.set()
            await router

    asyncio.run(scenario())


def test_unreadable_tls_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read TLS (key|certificate)"):
        TLSFiles(tmp_path / "missing.crt", tmp_path / "missing.key").server_credentials()
