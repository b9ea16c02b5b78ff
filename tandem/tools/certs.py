"""A development certificate authority and per-component certificates (``tandem certs``).

Writes, into one directory:

- ``ca.pem`` / ``ca-key.pem``: a self-signed CA (keep the key away from the fleet);
- ``<name>.pem`` / ``<name>-key.pem`` for each component name (default ``router``,
  ``prefill``, ``decode``): a leaf certificate the CA signed, usable both as a TLS
  server and as a TLS client (mutual TLS), for the hosts given (always ``localhost``,
  ``127.0.0.1`` and ``::1``) and the fleet name ``tandem-internal``.

ECDSA P-256 keys, SHA-256 signatures; keys are written mode 0600. For production use an
organisation's CA or cert-manager; this is the same layout with shorter-lived keys.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

FLEET_NAME = "tandem-internal"
"""A DNS name every component certificate carries, for ``--ssl-server-name``."""
DEFAULT_COMPONENTS = ("router", "prefill", "decode")
_ALWAYS_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class IssuedCerts:
    directory: Path
    components: tuple[str, ...]

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def cert(self, component: str) -> Path:
        return self.directory / f"{component}.pem"

    def key(self, component: str) -> Path:
        return self.directory / f"{component}-key.pem"


def make_certs(
    directory: Path,
    components: Sequence[str] = DEFAULT_COMPONENTS,
    hosts: Sequence[str] = (),
    days: int = 30,
) -> IssuedCerts:
    """Make a CA and one certificate per component in ``directory`` (created if needed);
    existing files of the same names are replaced."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ValueError("certificates must be valid for at least one day")
    names = tuple(dict.fromkeys(components))
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"component name {name!r} cannot be a file name")
        if name in ("ca",):
            raise ValueError("'ca' is the authority's own file name")
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid_from, valid_to = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(pem)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tandem development CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    issued = IssuedCerts(directory, names)
    issued.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    write_key(directory / "ca-key.pem", ca_key)

    alt_names: list[x509.GeneralName] = []
    for host in dict.fromkeys((*_ALWAYS_HOSTS, *hosts, FLEET_NAME)):
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tandem-{name}")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid_from)
            .not_valid_after(valid_to)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
            .sign(ca_key, hashes.SHA256())
        )
        issued.cert(name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(issued.key(name), key)
    return issued
