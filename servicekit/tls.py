"""gRPC mTLS credentials from PEM files.

Servers always demand a client certificate signed by our CA; clients always
present one and verify the server's certificate against the same CA and the
name they dialled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from servicekit.pki import TlsLayout


class TlsConfigError(RuntimeError):
    """A certificate or key file is missing or unreadable."""


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsConfigError(f"{what} not found at {path}; run `agentgw certs` or set AGW_TLS_DIR") from None
    except OSError as exc:
        raise TlsConfigError(f"cannot read {what} at {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key, and the CA its clients must chain to."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def from_dir(cls, tls_dir: Path) -> ServerTls:
        layout = TlsLayout(tls_dir)
        return cls(
            ca_pem=_read(layout.ca_cert, "CA certificate"),
            cert_pem=_read(layout.server_cert, "server certificate"),
            key_pem=_read(layout.server_key, "server key"),
        )

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that refuse any client without a certificate from our CA."""
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.ca_pem,
            require_client_auth=True,
        )


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
    def from_dir(cls, tls_dir: Path, identity: str, *, server_name: str | None = None) -> ClientTls:
        layout = TlsLayout(tls_dir)
        return cls(
            ca_pem=_read(layout.ca_cert, "CA certificate"),
            cert_pem=_read(layout.client_cert(identity), f"client certificate for {identity!r}"),
            key_pem=_read(layout.client_key(identity), f"client key for {identity!r}"),
            server_name=server_name,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )
