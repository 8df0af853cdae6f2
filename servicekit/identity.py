"""Who a certificate speaks for: SPIFFE-style identities, and where each one's files live.

Every certificate carries exactly one URI SAN of the form
``spiffe://<trust domain>/<kind>/<name>``, with kind one of:

- ``tenant``: an agent platform calling the gateway's public API;
- ``service``: the gateway, retrieval and inference services, and the edge
  proxy in front of them (``agentgw edge-config``), each with its own key;
- ``operator``: operators' tools (the doctor, ``ingest``, ``tune-ef``, the benches' direct paths).

The kind is part of the identity, so a tenant named like a service cannot be
taken for it (``agentgw certs`` also refuses such names). An identity from
another trust domain is not ours and is refused everywhere.

On disk each identity has a folder of its own, ``<tls dir>/<kind>/<name>/``,
holding its certificate (``cert.pem``), its key (``key.pem``, 0600) and the CA
certificate it trusts (``ca.pem``), and nothing else: a service is given its
folder alone, never the CA's key or another identity's key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: The kinds of identity, in the order of the URI path.
KINDS = ("tenant", "service", "operator")
#: Our services (the edge: Envoy on the public port); no tenant or operator may take one of these names.
SERVICE_NAMES = ("gateway", "retrieval", "inference", "edge")
DEFAULT_TRUST_DOMAIN = "agentgw.local"
#: The tenant a fresh install issues a certificate for.
DEFAULT_TENANT = "dev"
#: The identity operators' tools present unless told otherwise.
DEFAULT_OPERATOR = "admin"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# RFC 3986 host characters SPIFFE allows in a trust domain: lowercase letters, digits, '.', '-', '_'.
_TRUST_DOMAIN_RE = re.compile(r"^[a-z0-9._-]{1,255}$")


def validate_name(name: str) -> str:
    """Names go into file names, subjects and URIs: keep them plain."""
    if not _NAME_RE.match(name or ""):
        raise ValueError(f"invalid name {name!r}: use letters, digits, '.', '_' or '-', at most 63")
    return name


def validate_trust_domain(domain: str) -> str:
    if not _TRUST_DOMAIN_RE.match(domain or ""):
        raise ValueError(f"invalid trust domain {domain!r}: lowercase letters, digits, '.', '-' or '_'")
    return domain


def check_identity_pattern(pattern: str) -> str:
    """An allow- or denylist entry: ``kind/name`` or ``kind/*`` (``*`` matches any name); ValueError otherwise."""
    kind, sep, name = pattern.strip().partition("/")
    if not sep or not name or kind not in (*KINDS, "*"):
        raise ValueError(f"{pattern!r} is not an identity pattern: write kind/name or kind/* "
                         f"(kinds: {', '.join(KINDS)})")
    return pattern.strip()


@dataclass(frozen=True, order=True)
class Identity:
    """One principal: its kind and name, as ``kind/name``."""

    kind: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown identity kind {self.kind!r}: one of {', '.join(KINDS)}")
        validate_name(self.name)

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> Identity:
        """``tenant/acme`` -> Identity("tenant", "acme")."""
        kind, sep, name = text.strip().partition("/")
        if not sep:
            raise ValueError(f"{text!r} is not an identity: write kind/name, such as tenant/acme or service/gateway")
        return cls(kind, name)

    @classmethod
    def tenant(cls, name: str) -> Identity:
        return cls("tenant", name)

    @classmethod
    def service(cls, name: str) -> Identity:
        return cls("service", name)

    @classmethod
    def operator(cls, name: str = DEFAULT_OPERATOR) -> Identity:
        return cls("operator", name)

    def spiffe_id(self, trust_domain: str) -> str:
        return f"spiffe://{trust_domain}/{self.kind}/{self.name}"

    @classmethod
    def from_spiffe_id(cls, uri: str, trust_domain: str) -> Identity:
        """The identity a SPIFFE ID names, if it is of ``trust_domain``; else ValueError saying why."""
        prefix = "spiffe://"
        if not uri.startswith(prefix):
            raise ValueError(f"{uri!r} is not a SPIFFE ID")
        domain, _, path = uri[len(prefix):].partition("/")
        if domain != trust_domain:
            raise ValueError(f"{uri!r} is of trust domain {domain!r}, not {trust_domain!r}")
        try:
            return cls.parse(path)
        except ValueError as exc:
            raise ValueError(f"{uri!r}: {exc}") from None


@dataclass(frozen=True)
class IdentityFiles:
    """The files of one identity's folder: certificate, key and the CA certificate it trusts."""

    root: Path

    @classmethod
    def of(cls, tls_dir: Path, identity: Identity) -> IdentityFiles:
        return cls(Path(tls_dir) / identity.kind / identity.name)

    @property
    def cert(self) -> Path:
        return self.root / "cert.pem"

    @property
    def key(self) -> Path:
        return self.root / "key.pem"

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def paths(self) -> tuple[Path, Path, Path]:
        return (self.cert, self.key, self.ca)
