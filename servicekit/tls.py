"""gRPC mTLS credentials from an identity's folder, reloaded when the files change.

Servers always demand a client certificate signed by our CA; clients always
present one and verify the server's certificate against the same CA and the
name they dialled. Which identity a certificate speaks for is
:mod:`servicekit.authz`'s business; here it is only files and credentials.

Certificates rotate without restarts: :class:`CertificateFiles` notices new
files (by their inode, size and mtime, which also catches the symlink swap
Kubernetes makes for a renewed Secret), checks that the new key matches the
new certificate, and hands out the new material. Servers take it on their
next handshake (gRPC's dynamic server credentials ask before every one);
outbound pools rebuild their channels with it (``ChannelPool.reload_tls``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from servicekit.identity import Identity, IdentityFiles

log = logging.getLogger(__name__)


class TlsConfigError(RuntimeError):
    """A certificate or key file is missing, unreadable, or the key does not match the certificate."""


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsConfigError(f"{what} not found at {path}; run `agentgw certs` or set AGW_TLS_DIR") from None
    except OSError as exc:
        raise TlsConfigError(f"cannot read {what} at {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class TlsMaterial:
    """One identity's certificate chain and key, and the CA (or CA bundle) it trusts."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def read(cls, files: IdentityFiles) -> TlsMaterial:
        material = cls(
            ca_pem=_read(files.ca, "CA certificate"),
            cert_pem=_read(files.cert, "certificate"),
            key_pem=_read(files.key, "key"),
        )
        material.check_pair(files.root)
        return material

    def check_pair(self, where: Path | str = "") -> None:
        """Raise TlsConfigError unless the key belongs to the certificate (a renewal caught half-way)."""
        try:
            cert = x509.load_pem_x509_certificate(self.cert_pem)
            key = serialization.load_pem_private_key(self.key_pem, password=None)
        except ValueError as exc:
            raise TlsConfigError(f"unreadable certificate or key in {where}: {exc}") from None
        if cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
                != key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
            raise TlsConfigError(f"the key in {where} does not belong to its certificate")

    @property
    def serial(self) -> str:
        """The certificate's serial number, in hex (as logs and denylists write it)."""
        return format(x509.load_pem_x509_certificate(self.cert_pem).serial_number, "x")


def _signature(paths) -> tuple:
    signature = []
    for path in paths:
        try:
            stat = os.stat(path)  # follows symlinks: a swapped link target changes the inode
            signature.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
        except OSError:
            signature.append(None)
    return tuple(signature)


class CertificateFiles:
    """An identity's folder, read at start and again whenever its files change.

    :meth:`refresh` is cheap enough for every handshake: it stats the three
    files at most once per ``check_every_s`` and reads them only when their
    signature moved. A half-renewed folder (a new certificate beside the old
    key) is ignored until it is whole; the old material stays in use.
    Thread-safe: gRPC calls a server's fetcher from its own threads.
    """

    def __init__(self, files: IdentityFiles, *, check_every_s: float = 1.0) -> None:
        self.files = files
        self.check_every_s = check_every_s
        self.current = TlsMaterial.read(files)
        self._signature = _signature(files.paths)
        self._checked_at = time.monotonic()
        self._lock = threading.Lock()

    def refresh(self) -> TlsMaterial | None:
        """New material if the files changed since the last look (and are whole), else None."""
        now = time.monotonic()
        if now - self._checked_at < self.check_every_s:
            return None
        with self._lock:
            self._checked_at = now
            signature = _signature(self.files.paths)
            if signature == self._signature:
                return None
            try:
                material = TlsMaterial.read(self.files)
            except TlsConfigError as exc:
                log.warning("certificate files changed but are not usable yet (%s); keeping the current ones", exc)
                return None
            self._signature = signature
            if material == self.current:
                return None
            log.info("certificate files in %s renewed (serial %s -> %s)", self.files.root,
                     self.current.serial, material.serial)
            self.current = material
            return material


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key, and the CA its clients must chain to."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def from_dir(cls, identity_dir: Path) -> ServerTls:
        material = TlsMaterial.read(IdentityFiles(Path(identity_dir)))
        return cls(material.ca_pem, material.cert_pem, material.key_pem)

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that refuse any client without a certificate from our CA (fixed files)."""
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.ca_pem,
            require_client_auth=True,
        )


def _server_configuration(material: TlsMaterial):
    return grpc.ssl_server_certificate_configuration([(material.key_pem, material.cert_pem)],
                                                     root_certificates=material.ca_pem)


def reloading_server_credentials(source: CertificateFiles) -> grpc.ServerCredentials:
    """mTLS server credentials that take renewed files on the next handshake, without a restart.

    Existing connections keep the certificate they were made with until they
    close; every new one gets the current files.
    """

    def fetch():
        try:
            material = source.refresh()
        except Exception:  # noqa: BLE001 - an exception here would fail the client's handshake
            log.exception("checking %s for renewed certificates failed", source.files.root)
            return None
        return None if material is None else _server_configuration(material)

    return grpc.dynamic_ssl_server_credentials(_server_configuration(source.current), fetch,
                                               require_client_authentication=True)


@dataclass(frozen=True)
class ClientTls:
    """A client's identity (certificate and key) and the CA it trusts."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    #: Verify the server as this name instead of the dialled host (for an
    #: address that is not in the server certificate's SAN).
    server_name: str | None = None

    @classmethod
    def from_dir(cls, identity_dir: Path, *, server_name: str | None = None) -> ClientTls:
        """The identity whose folder is ``identity_dir`` (``cert.pem``, ``key.pem``, ``ca.pem``)."""
        return cls.from_material(TlsMaterial.read(IdentityFiles(Path(identity_dir))), server_name=server_name)

    @classmethod
    def for_identity(cls, tls_dir: Path, identity: Identity | str, *, server_name: str | None = None) -> ClientTls:
        """``identity``'s folder under a TLS folder laid out by ``agentgw certs``."""
        if isinstance(identity, str):
            identity = Identity.parse(identity)
        return cls.from_dir(IdentityFiles.of(Path(tls_dir), identity).root, server_name=server_name)

    @classmethod
    def from_material(cls, material: TlsMaterial, *, server_name: str | None = None) -> ClientTls:
        return cls(material.ca_pem, material.cert_pem, material.key_pem, server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )
