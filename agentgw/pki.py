"""A development PKI: one CA, and a certificate and key for every identity.

``agentgw certs`` calls :func:`ensure_dev_pki`. Each certificate carries its
identity as a SPIFFE-style URI SAN (``spiffe://<trust domain>/<kind>/<name>``,
see :mod:`servicekit.identity`), which is what every service reads; the
subject's common name repeats the name for people and for the CN
compatibility mode. Each identity gets a folder of its own with its
certificate, its key and the CA certificate, so a service can be given its own
folder and nothing else. Keys are EC P-256: as strong as RSA-3072 for this
use, and their handshakes are cheaper.

Files are replaced atomically (written aside, then renamed), so a service that
reloads certificates while they are renewed never reads half a file.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from servicekit.identity import (
    DEFAULT_OPERATOR,
    DEFAULT_TENANT,
    DEFAULT_TRUST_DOMAIN,
    SERVICE_NAMES,
    Identity,
    IdentityFiles,
    validate_name,
)

__all__ = [
    "CaFiles",
    "DEFAULT_LEAF_DAYS",
    "Issued",
    "PkiReport",
    "ensure_dev_pki",
    "issue",
    "new_ca",
    "server_names_for",
    "validate_name",
    "write_identity",
]

#: Loopback names every service certificate answers to, besides its own service name.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
DEFAULT_LEAF_DAYS = 825


def server_names_for(service: str) -> tuple[str, ...]:
    """The names a service's certificate answers to: loopback and its compose/Kubernetes name."""
    return (*LOOPBACK_NAMES, service)


@dataclass(frozen=True)
class CaFiles:
    """The CA's certificate and key at the top of a TLS folder (the key never leaves it)."""

    root: Path

    @property
    def cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def key(self) -> Path:
        return self.root / "ca-key.pem"


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


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _san(names: Iterable[str], uris: Iterable[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri) for uri in uris]
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
    identity: Identity | None,
    *,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
    common_name: str | None = None,
    server_names: Sequence[str] = (),
    client: bool = True,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    days: int = DEFAULT_LEAF_DAYS,
) -> Issued:
    """Sign a leaf certificate.

    Args:
        ca: the issuing CA.
        identity: written as the URI SAN ``spiffe://<trust_domain>/<kind>/<name>``;
            None issues a certificate without one (tests of the refusal).
        common_name: the subject's CN; default the identity's name.
        server_names: DNS names and IP addresses for the SAN; makes it a server
            certificate too.
        client: allow TLS client authentication (services use one certificate both ways).
        not_before, not_after, days: validity; default from five minutes ago for
            ``days`` (tests issue expired and short-lived ones).
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
    cn = common_name or (identity.name if identity else "anonymous")
    uris = [identity.spiffe_id(trust_domain)] if identity else []
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - dt.timedelta(minutes=5))
        .not_valid_after(not_after or now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
    )
    if uris or server_names:
        builder = builder.add_extension(_san(server_names, uris), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    # Created with its final mode from the start (a chmod after writing leaves
    # a window), then renamed over the old file: a reader sees old or new, whole.
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_pair(cert_path: Path, key_path: Path, issued: Issued) -> None:
    """Write a certificate (0644) and its key (0600); the key first, so a new certificate never meets an old key."""
    _write_atomic(key_path, issued.key_pem, 0o600)
    _write_atomic(cert_path, issued.cert_pem, 0o644)


def write_identity(files: IdentityFiles, issued: Issued, ca_pem: bytes) -> None:
    """Fill an identity's folder (0700): its certificate, its key, and the CA certificate it trusts."""
    files.root.mkdir(parents=True, exist_ok=True)
    os.chmod(files.root, 0o700)
    _write_atomic(files.ca, ca_pem, 0o644)
    write_pair(files.cert, files.key, issued)


@dataclass(frozen=True)
class PkiReport:
    """What :func:`ensure_dev_pki` did, for the CLI to print."""

    root: Path
    created: tuple[Path, ...]
    reused: tuple[Path, ...]

    @property
    def ca(self) -> CaFiles:
        return CaFiles(self.root)


def check_names(tenants: Iterable[str], operators: Iterable[str]) -> None:
    """Tenant and operator names must be valid and must not be a service's name."""
    for kind, names in (("tenant", tenants), ("operator", operators)):
        for name in names:
            validate_name(name)
            if name in SERVICE_NAMES:
                raise ValueError(f"{kind} name {name!r} is a service's name ({', '.join(SERVICE_NAMES)}); "
                                 f"choose another, so no {kind} can be mistaken for a service")


def ensure_dev_pki(
    tls_dir: Path,
    *,
    tenants: Sequence[str] = (DEFAULT_TENANT,),
    operators: Sequence[str] = (DEFAULT_OPERATOR,),
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
    force: bool = False,
    renew: bool = False,
    leaf_days: int = DEFAULT_LEAF_DAYS,
) -> PkiReport:
    """Create whatever of the dev PKI is missing under ``tls_dir``; keep the rest.

    Always issues the three services (each its own key), the operators and the
    tenants named. With ``renew`` every leaf is issued anew under the same CA
    (running services pick them up without a restart); with ``force``
    everything is, the CA included, which invalidates every certificate issued
    before.
    """
    check_names(tenants, operators)
    if leaf_days <= 0:
        raise ValueError(f"leaf validity must be at least one day (got {leaf_days})")
    ca_files = CaFiles(Path(tls_dir))
    ca_files.root.mkdir(parents=True, exist_ok=True)
    os.chmod(ca_files.root, 0o700)
    created: list[Path] = []
    reused: list[Path] = []

    new_authority = force or not (ca_files.cert.exists() and ca_files.key.exists())
    if new_authority:
        ca = new_ca()
        write_pair(ca_files.cert, ca_files.key, ca)
        created.append(ca_files.cert)
    else:
        ca = Issued(ca_files.cert.read_bytes(), ca_files.key.read_bytes())
        reused.append(ca_files.cert)

    identities = [
        *(Identity.service(name) for name in SERVICE_NAMES),
        *(Identity.operator(name) for name in dict.fromkeys(operators)),
        *(Identity.tenant(name) for name in dict.fromkeys(tenants)),
    ]
    for identity in identities:
        files = IdentityFiles.of(ca_files.root, identity)
        if not (new_authority or renew) and all(path.exists() for path in files.paths):
            reused.append(files.cert)
            continue
        names = server_names_for(identity.name) if identity.kind == "service" else ()
        write_identity(files, issue(ca, identity, trust_domain=trust_domain, server_names=names, days=leaf_days),
                       ca.cert_pem)
        created.append(files.cert)
    return PkiReport(ca_files.root, tuple(created), tuple(reused))
