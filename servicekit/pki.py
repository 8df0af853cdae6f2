"""A development PKI: one CA, server certificates and tenant client certificates.

``agentgw certs`` calls :func:`ensure_dev_pki`. Client certificates carry the
tenant as their subject's common name; the gateway reads it from the TLS peer
(``x509_common_name`` in the gRPC auth context). Keys are EC P-256: as strong as
RSA-3072 for this use, and their handshakes are cheaper.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Names a server certificate answers to: loopback, and the compose services.
DEFAULT_SERVER_NAMES = ("localhost", "127.0.0.1", "::1", "gateway", "retrieval", "inference")
#: The identity our gateway presents to the backends.
GATEWAY_IDENTITY = "gateway"
#: The tenant a fresh install issues a certificate for.
DEFAULT_TENANT = "dev"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class TlsLayout:
    """File names inside a TLS folder. Every service and client agrees on these."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca-key.pem"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server-key.pem"

    def client_cert(self, name: str) -> Path:
        return self.root / f"client-{name}.pem"

    def client_key(self, name: str) -> Path:
        return self.root / f"client-{name}-key.pem"


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    @property
    def key(self) -> ec.EllipticCurvePrivateKey:
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return key


def validate_name(name: str) -> str:
    """Tenant and client names go into file names and subjects: keep them plain."""
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid name {name!r}: use letters, digits, '.', '_' or '-', at most 63")
    return name


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _san(names: Iterable[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def new_ca(common_name: str = "agent-gateway dev CA", *, valid_days: int = 3650) -> Issued:
    """A self-signed CA that may sign leaf certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(
    ca: Issued,
    common_name: str,
    *,
    server_names: Sequence[str] = (),
    client: bool = False,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> Issued:
    """Sign a leaf certificate.

    Args:
        ca: the issuing CA.
        common_name: the subject's CN; for a client, the tenant.
        server_names: DNS names and IP addresses for the SAN; makes it a server
            certificate.
        client: also allow TLS client authentication.
        not_before, not_after: validity; default from five minutes ago for 825
            days (tests use them to issue expired certificates).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = []
    if server_names:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    if not usages:
        raise ValueError("a certificate needs server_names, client=True, or both")
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - dt.timedelta(minutes=5))
        .not_valid_after(not_after or now + dt.timedelta(days=825))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
    )
    if server_names:
        builder = builder.add_extension(_san(server_names), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write_private(path: Path, data: bytes) -> None:
    # Create with 0600 from the start: a chmod after writing leaves a window.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


def _write_public(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.chmod(path, 0o644)


def write_pair(cert_path: Path, key_path: Path, issued: Issued) -> None:
    """Write a certificate (0644) and its key (0600)."""
    _write_private(key_path, issued.key_pem)
    _write_public(cert_path, issued.cert_pem)


def _load_pair(cert_path: Path, key_path: Path) -> Issued:
    return Issued(cert_path.read_bytes(), key_path.read_bytes())


@dataclass(frozen=True)
class PkiReport:
    """What :func:`ensure_dev_pki` did, for the CLI to print."""

    layout: TlsLayout
    created: tuple[Path, ...]
    reused: tuple[Path, ...]


def ensure_dev_pki(
    tls_dir: Path,
    *,
    tenants: Sequence[str] = (DEFAULT_TENANT,),
    server_names: Sequence[str] = DEFAULT_SERVER_NAMES,
    force: bool = False,
) -> PkiReport:
    """Create whatever of the dev PKI is missing under ``tls_dir``; keep the rest.

    With ``force`` everything is issued anew, the CA included (which invalidates
    every certificate issued before). A new CA also re-issues all leaves,
    since the old ones would no longer verify.
    """
    for tenant in tenants:
        validate_name(tenant)
    layout = TlsLayout(tls_dir)
    tls_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(tls_dir, 0o700)
    created: list[Path] = []
    reused: list[Path] = []

    renew_all = force or not (layout.ca_cert.exists() and layout.ca_key.exists())
    if renew_all:
        ca = new_ca()
        write_pair(layout.ca_cert, layout.ca_key, ca)
        created.append(layout.ca_cert)
    else:
        ca = _load_pair(layout.ca_cert, layout.ca_key)
        reused.append(layout.ca_cert)

    def ensure(cert_path: Path, key_path: Path, make) -> None:
        if not renew_all and cert_path.exists() and key_path.exists():
            reused.append(cert_path)
            return
        write_pair(cert_path, key_path, make())
        created.append(cert_path)

    ensure(
        layout.server_cert,
        layout.server_key,
        lambda: issue(ca, "agent-gateway server", server_names=server_names),
    )
    for name in dict.fromkeys([GATEWAY_IDENTITY, *tenants]):
        ensure(layout.client_cert(name), layout.client_key(name), lambda n=name: issue(ca, n, client=True))
    return PkiReport(layout, tuple(created), tuple(reused))
