"""Certificates for TLS tests: the dev PKI plus deliberately broken ones."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from servicekit.identity import Identity, IdentityFiles
from agentgw.pki import CaFiles, Issued, ensure_dev_pki, issue, new_ca, server_names_for, write_identity

#: Certificates under ``<root>/bad`` that every service must refuse (or that clients must refuse).
BAD = {
    "foreign-ca": "a tenant certificate from a CA nobody trusts",
    "expired": "a tenant certificate from our CA whose validity ended yesterday",
    "no-spiffe": "a certificate from our CA without a SPIFFE ID (only CN=dev)",
    "foreign-domain": "a certificate from our CA for spiffe://elsewhere.example/service/gateway",
    "server-wrong-san": "a server certificate from our CA for a name nobody dials",
    "server-expired": "a retrieval server certificate from our CA whose validity ended yesterday",
}


@dataclass(frozen=True)
class PkiFixture:
    """A dev PKI under ``root`` and, under ``root/bad/<name>/``, certificates that must fail."""

    root: Path

    @property
    def ca(self) -> CaFiles:
        return CaFiles(self.root)

    def identity(self, identity: str) -> IdentityFiles:
        return IdentityFiles.of(self.root, Identity.parse(identity))

    def bad(self, name: str) -> IdentityFiles:
        assert name in BAD, name
        return IdentityFiles(self.root / "bad" / name)

    def load_ca(self) -> Issued:
        return Issued(self.ca.cert.read_bytes(), self.ca.key.read_bytes())


def make_test_pki(root: Path, tenants=("dev", "other")) -> PkiFixture:
    pki = PkiFixture(root)
    ensure_dev_pki(root, tenants=tenants)
    ca = pki.load_ca()
    foreign_ca = new_ca("some other CA")
    now = dt.datetime.now(dt.timezone.utc)
    yesterday = {"not_before": now - dt.timedelta(days=30), "not_after": now - dt.timedelta(days=1)}
    dev = Identity.tenant("dev")
    issued = {
        "foreign-ca": issue(foreign_ca, dev),
        "expired": issue(ca, dev, **yesterday),
        "no-spiffe": issue(ca, None, common_name="dev"),
        "foreign-domain": issue(ca, Identity.service("gateway"), trust_domain="elsewhere.example"),
        "server-wrong-san": issue(ca, Identity.service("inference"), server_names=["wrong.example"]),
        "server-expired": issue(ca, Identity.service("inference"), server_names=server_names_for("inference"),
                                **yesterday),
    }
    for name, certificate in issued.items():
        write_identity(pki.bad(name), certificate, ca.cert_pem)
    return pki
