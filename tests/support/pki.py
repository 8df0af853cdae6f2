"""Certificates for TLS tests: the dev PKI plus deliberately broken ones."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from servicekit.pki import DEFAULT_SERVER_NAMES, TlsLayout, ensure_dev_pki, issue, new_ca, write_pair


@dataclass(frozen=True)
class PkiFixture:
    """A dev PKI under ``root`` and, under ``root/bad``, certificates that must fail."""

    root: Path

    @property
    def layout(self) -> TlsLayout:
        return TlsLayout(self.root)

    @property
    def bad(self) -> TlsLayout:
        return TlsLayout(self.root / "bad")


def make_test_pki(root: Path, tenants=("dev", "other")) -> PkiFixture:
    pki = PkiFixture(root)
    ensure_dev_pki(root, tenants=tenants)
    bad = pki.bad.root
    bad.mkdir(parents=True, exist_ok=True)
    ca = _load_ca(pki.layout)
    foreign_ca = new_ca("some other CA")
    now = dt.datetime.now(dt.timezone.utc)
    # A client certificate signed by a CA the server does not trust.
    write_pair(bad / "client-foreign.pem", bad / "client-foreign-key.pem", issue(foreign_ca, "dev", client=True))
    # A client certificate from our CA whose validity ended yesterday.
    expired = issue(ca, "dev", client=True, not_before=now - dt.timedelta(days=30), not_after=now - dt.timedelta(days=1))
    write_pair(bad / "client-expired.pem", bad / "client-expired-key.pem", expired)
    # A server certificate from our CA for a name nobody dials.
    write_pair(bad / "server-wrong-san.pem", bad / "server-wrong-san-key.pem", issue(ca, "wrong", server_names=["wrong.example"]))
    # An expired server certificate with the right names.
    expired_server = issue(
        ca, "server", server_names=DEFAULT_SERVER_NAMES,
        not_before=now - dt.timedelta(days=30), not_after=now - dt.timedelta(days=1),
    )
    write_pair(bad / "server-expired.pem", bad / "server-expired-key.pem", expired_server)
    return pki


def _load_ca(layout: TlsLayout):
    from servicekit.pki import Issued

    return Issued(layout.ca_cert.read_bytes(), layout.ca_key.read_bytes())
