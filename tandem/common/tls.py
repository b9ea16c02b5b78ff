"""TLS for Tandem's gRPC links: server-side TLS on the router's public port, and mutual
TLS (mTLS) on every internal link — router to workers, decode worker to prefill worker
(the KV control channel).

Internal trust is one certificate authority: a process accepts a peer whose certificate
that CA signed, and nothing else; every component holds its own certificate and key and
presents it both as a server and as a client. A peer is verified against the host it is
reached at (the address a worker registered) unless ``server_name`` names one identity
the whole fleet's certificates carry (what a cert-manager ``Certificate`` per role
gives on Kubernetes, where pod IPs change).

What mTLS does not cover: the torch.distributed data path (the prefill worker's
``TCPStore`` and the gloo/NCCL connections) — see docs/reliability.md, "Trust boundary".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {what} {err.filename}: {err.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class TLSFiles:
    """A server's certificate chain and private key (PEM files), for TLS on its port."""

    certfile: Path
    keyfile: Path

    def pair(self) -> tuple[bytes, bytes]:
        """``(private key, certificate chain)``, as gRPC takes them."""
        return _read(self.keyfile, "TLS key"), _read(self.certfile, "TLS certificate")

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([self.pair()])


@dataclass(frozen=True)
class InternalTLS:
    """Mutual TLS between Tandem's own processes: this process's certificate and key
    and the internal CA that signed every component's certificate."""

    ca_certs: Path
    certfile: Path
    keyfile: Path
    server_name: str | None = None
    """Verify peers against this name instead of the host they are reached at."""

    def check(self) -> InternalTLS:
        """Read every file now, so a bad path fails at start with its name."""
        self._files()
        return self

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve TLS and require a client certificate signed by the CA."""
        ca, key, chain = self._files()
        return grpc.ssl_server_credentials(
            [(key, chain)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Trust servers the CA signed; present this process's certificate."""
        ca, key, chain = self._files()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=chain
        )

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        if self.server_name is None:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),)

    def _files(self) -> tuple[bytes, bytes, bytes]:
        ca = _read(self.ca_certs, "CA certificates")
        key, chain = TLSFiles(self.certfile, self.keyfile).pair()
        return ca, key, chain


def internal_channel(
    address: str,
    tls: InternalTLS | None,
    options: Sequence[tuple[str, object]] = (),
) -> grpc.aio.Channel:
    """An asyncio channel to another Tandem process: mTLS when ``tls`` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=tuple(options))
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=(*options, *tls.channel_options())
    )


def internal_sync_channel(address: str, tls: InternalTLS | None) -> grpc.Channel:
    """A blocking channel to another Tandem process (health checks of the launcher)."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
