"""Who may call what: the caller's identity from its verified certificate, checked once per call.

mTLS proves a certificate chains to our CA; this module decides whether *that*
identity may call *that* method. :class:`Authorizer` runs once, at the start of
every call, in the edge's wrapper of each method (``servicekit.interceptors``),
before the handler sees the request: a handler that forwards bytes without parsing
messages is authorized exactly like one that parses them.

- The identity is the certificate's SPIFFE ID (``peer_spiffe_id`` in gRPC's
  auth context). A certificate without one, with several, or from another
  trust domain is refused. The CN-based identity of earlier releases is
  available only behind ``AGW_IDENTITY_FROM_CN`` (weaker: see
  :func:`_identity_from_cn`).
- A :class:`Policy` lists the identities allowed, by default and per method.
- A :class:`Denylist` file lists identities or certificate serials to refuse
  (a compromised certificate), read again whenever it changes.
- An edge proxy (``AGW_<SERVICE>_EDGE_CLIENTS``, ``service/edge``) may act for
  the client whose certificate it verified: its calls are authorized as that
  client, read from ``x-forwarded-client-cert`` (``servicekit.forwarded``),
  which no other caller's header can set. Methods a service serves only for
  the edge (the public ``Generate`` and ``Retrieve`` on the backends) refuse
  everyone else, whatever the policy says.
- Every refusal is logged with the identity, counted (``agw.authz.denied``) and
  recorded as a span event; the call gets ``PERMISSION_DENIED`` (or
  ``UNAUTHENTICATED`` without a usable identity).

The admitted caller is available to the handler through :func:`caller`.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from servicekit.call_metadata import call_metadata
from servicekit.errors import PermissionDenied, Unauthenticated
from servicekit.forwarded import XFCC_HEADER, forwarded_certificate
from servicekit.identity import SERVICE_NAMES, Identity, check_identity_pattern
from servicekit.metrics import meter

log = logging.getLogger(__name__)
_DENIED = meter("servicekit").create_counter(
    "agw.authz.denied", description="Calls refused by authorization, by service, method and reason.")


@dataclass(frozen=True)
class Peer:
    """A verified caller: its identity and its certificate's serial (hex; empty without a certificate)."""

    identity: Identity
    serial: str = ""


_CALLER: ContextVar[Peer | None] = ContextVar("agw_caller", default=None)


def caller() -> Peer:
    """The caller of the RPC being served, as authorization admitted it."""
    peer = _CALLER.get()
    if peer is None:
        raise Unauthenticated("the call carries no authorized identity")
    return peer


class Policy:
    """Identity patterns (``kind/name``, with ``*`` wildcards) allowed by default and per method."""

    def __init__(self, allowed: Iterable[str], per_method: Mapping[str, Iterable[str]] | None = None) -> None:
        self.allowed = tuple(check_identity_pattern(p) for p in allowed)
        self.per_method = {method: tuple(check_identity_pattern(p) for p in patterns)
                           for method, patterns in (per_method or {}).items()}
        # The patterns never change, so each (identity, method) is matched once: fnmatch on every call cost
        # 1.6 µs a match (docs/benchmarks.md, "The goals on a Zen 3 EPYC, and the edge's per-call work").
        self._decided: dict[tuple[Identity, str], bool] = {}

    def patterns_for(self, method: str) -> tuple[str, ...]:
        """The patterns for ``method`` (``/package.Service/Name``): by full path, else by name, else the default."""
        patterns = self.per_method.get(method)
        return patterns if patterns is not None else self.per_method.get(method.rsplit("/", 1)[-1], self.allowed)

    def allows(self, identity: Identity, method: str) -> bool:
        decided = self._decided.get((identity, method))
        if decided is None:
            name = str(identity)
            decided = any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns_for(method))
            if len(self._decided) >= 4096:  # bounded: identities come from certificates, methods from the server
                self._decided.clear()
            self._decided[(identity, method)] = decided
        return decided


class Denylist:
    """Identities (``kind/name``) and certificate serials (hex) to refuse, from a file read again on change.

    One entry per line; ``#`` starts a comment. A missing file is an empty
    list (a denylist can be created while the service runs). The file is
    stat-ed at most once per ``check_every_s``, on the call path.
    """

    def __init__(self, path: Path | None, *, check_every_s: float = 1.0) -> None:
        self.path = path
        self.check_every_s = check_every_s
        self.identities: frozenset[str] = frozenset()
        self.serials: frozenset[str] = frozenset()
        self._signature: tuple | None = None
        self._checked_at = -float("inf")

    def refresh(self) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if now - self._checked_at < self.check_every_s:
            return
        self._checked_at = now
        try:
            stat = os.stat(self.path)
            signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except FileNotFoundError:
            signature = None
        if signature == self._signature:
            return
        self._signature = signature
        lines = self.path.read_text().splitlines() if signature else []
        entries = [line.split("#", 1)[0].strip() for line in lines]
        entries = [entry for entry in entries if entry]
        self.identities = frozenset(e for e in entries if "/" in e)
        self.serials = frozenset(e.lower().replace(":", "").lstrip("0") for e in entries if "/" not in e)
        log.info("denylist %s: %d identities, %d certificate serials", self.path, len(self.identities),
                 len(self.serials))

    def refuses(self, peer: Peer) -> str | None:
        """Why ``peer`` is denied, or None."""
        self.refresh()
        if str(peer.identity) in self.identities:
            return f"identity {peer.identity} is on the denylist"
        if peer.serial and peer.serial.lstrip("0") in self.serials:
            return f"certificate serial {peer.serial} is on the denylist"
        return None


def _identity_from_cn(common_name: str) -> Identity:
    """The compatibility mapping (``AGW_IDENTITY_FROM_CN``): CN ``gateway`` is the gateway, any other a tenant.

    Weaker than SPIFFE IDs: anyone the CA issued a certificate with CN
    ``gateway`` to is the gateway, and operators cannot be told apart.
    """
    if common_name in SERVICE_NAMES:
        return Identity.service(common_name)
    return Identity.tenant(common_name)


class Authorizer:
    """Decides, once per call, whether the caller may call the method."""

    def __init__(self, service: str, policy: Policy, *, trust_domain: str, denylist: Denylist | None = None,
                 identity_from_cn: bool = False, plaintext_identity: Identity | None = None,
                 edges: Iterable[str] = (), edge_only: Iterable[str] = ()) -> None:
        """
        Args:
            service: this service's name, for logs and metrics.
            policy: who may call what.
            trust_domain: the only trust domain whose identities are ours.
            denylist: identities and serials refused whatever the policy says.
            identity_from_cn: fall back to the certificate's CN (compatibility; weaker).
            plaintext_identity: the identity of a caller without TLS (only the
                gateway's AGW_INSECURE_DEV mode); None refuses such callers.
            edges: identity patterns of edge proxies, whose calls act for the
                client certificate they forward (``servicekit.forwarded``).
            edge_only: methods (full paths) that only an edge's forwarded calls reach.

        Health is never authorized here: the edge's wrapper passes it to any
        verified certificate before asking.
        """
        self.service = service
        self.policy = policy
        self.trust_domain = trust_domain
        self.denylist = denylist or Denylist(None)
        self.identity_from_cn = identity_from_cn
        self.plaintext_identity = plaintext_identity
        self.edges = tuple(check_identity_pattern(p) for p in edges)
        self.edge_only = frozenset(edge_only)
        #: Serial -> identity of the certificates seen, newest last (bounded): the server-side record of peers.
        self.peers_seen: OrderedDict[str, str] = OrderedDict()
        # A certificate decides its identity and serial: read them once per certificate, not once per call.
        self._peers: dict[bytes, Peer] = {}
        self._forwarded: dict[str, Peer] = {}
        self._edge_identities: dict[Identity, bool] = {}

    def authorize(self, context, method: str, span=None) -> Peer:
        """The caller, if it may call ``method``; else raise PermissionDenied/Unauthenticated (logged, counted)."""
        try:
            peer = self._peer(context)
            edge = self._is_edge(peer)
            reason = self._edge_refuses(peer, edge, method)
            if reason is None and edge:
                peer = self._forwarded_peer(context, peer)
        except Unauthenticated as exc:
            self._refuse(method, "unauthenticated", exc.message, span)
            raise
        if reason is None:
            reason = self.denylist.refuses(peer)
        if reason is None and not self.policy.allows(peer.identity, method):
            reason = (f"{peer.identity} may not call {method} on the {self.service} service "
                      f"(allowed: {', '.join(self.policy.patterns_for(method))})")
        if reason is not None:
            self._refuse(method, reason, f"{reason} [serial {peer.serial}]", span)
            raise PermissionDenied(reason)
        return peer

    def _is_edge(self, peer: Peer) -> bool:
        edge = self._edge_identities.get(peer.identity)
        if edge is None:  # matched once per identity, as Policy.allows is
            edge = any(fnmatch.fnmatchcase(str(peer.identity), pattern) for pattern in self.edges)
            if len(self._edge_identities) >= 1024:
                self._edge_identities.clear()
            self._edge_identities[peer.identity] = edge
        return edge

    def _edge_refuses(self, peer: Peer, edge: bool, method: str) -> str | None:
        """Why a call is refused for how it arrived: an edge on the denylist, or an edge-only method called directly."""
        if edge:
            return self.denylist.refuses(peer)
        if method in self.edge_only:
            return (f"{method} on the {self.service} service answers only calls an edge forwards "
                    f"({', '.join(self.edges) or 'none is configured'}); {peer.identity} called it directly: "
                    "call the public port")
        return None

    def _forwarded_peer(self, context, edge: Peer) -> Peer:
        """The client an edge verified and forwarded (``x-forwarded-client-cert``), read once per header value."""
        values = [value for key, value in call_metadata(context) if key == XFCC_HEADER]
        if len(values) != 1:
            raise Unauthenticated(f"the edge {edge.identity} forwarded {len(values)} {XFCC_HEADER} headers; "
                                  "exactly one is needed (configure it with `agentgw edge-config`)")
        peer = self._forwarded.get(values[0])
        if peer is None:
            certificate, spiffe_id = forwarded_certificate(values[0])
            try:
                identity = Identity.from_spiffe_id(spiffe_id, self.trust_domain)
            except ValueError as exc:
                raise Unauthenticated(f"forwarded certificate identity refused: {exc}") from None
            if identity.kind == "service":
                raise Unauthenticated(f"the edge forwarded a service's certificate ({identity}); it forwards only "
                                      "tenants' and operators'")
            peer = Peer(identity, format(certificate.serial_number, "x"))
            if len(self._forwarded) >= 1024:  # bounded, like _peers: one entry per client certificate
                self._forwarded.clear()
            self._forwarded[values[0]] = peer
            self._record(peer)
        return peer

    def bind(self, peer: Peer):
        """Make ``peer`` the current caller (for :func:`caller`); returns the token to reset."""
        return _CALLER.set(peer)

    def _peer(self, context) -> Peer:
        auth = context.auth_context()
        if auth.get("transport_security_type") != [b"ssl"]:  # plaintext ("insecure") or none
            if self.plaintext_identity is not None:
                return Peer(self.plaintext_identity)
            raise Unauthenticated("no client certificate; connect with mTLS and the certificate `agentgw certs` "
                                  "issued for you")
        pem = (auth.get("x509_pem_cert") or [b""])[0]
        peer = self._peers.get(pem)
        if peer is None:
            peer = Peer(self._identity(auth), format(x509.load_pem_x509_certificate(pem).serial_number, "x"))
            if len(self._peers) >= 1024:  # bounded: a new entry per certificate (renewal), not per call
                self._peers.clear()
            self._peers[pem] = peer
            self._record(peer)
        return peer

    def _identity(self, auth) -> Identity:
        spiffe = auth.get("peer_spiffe_id")
        if spiffe:
            try:
                identity = Identity.from_spiffe_id(spiffe[0].decode(), self.trust_domain)
            except ValueError as exc:
                raise Unauthenticated(f"certificate identity refused: {exc}") from None
        else:
            uris = [u.decode() for u in auth.get("x509_subject_alternative_name", []) if u.startswith(b"spiffe://")]
            common_names = auth.get("x509_common_name") or []
            if uris:
                raise Unauthenticated(f"certificate carries {len(uris)} SPIFFE IDs; exactly one is allowed")
            if not (self.identity_from_cn and common_names):
                raise Unauthenticated("certificate carries no SPIFFE ID (spiffe://<trust domain>/<kind>/<name>); "
                                      "issue it with `agentgw certs`")
            try:
                identity = _identity_from_cn(common_names[0].decode())
            except ValueError as exc:
                raise Unauthenticated(f"certificate common name refused: {exc}") from None
        return identity

    def _record(self, peer: Peer) -> None:
        if peer.serial in self.peers_seen:
            return
        self.peers_seen[peer.serial] = str(peer.identity)
        log.info("%s: first call from %s with certificate serial %s", self.service, peer.identity, peer.serial)
        while len(self.peers_seen) > 256:
            self.peers_seen.popitem(last=False)

    def _refuse(self, method: str, reason: str, detail: str, span) -> None:
        log.warning("%s refused %s: %s", self.service, method, detail)
        _DENIED.add(1, {"service": self.service, "rpc.method": method,
                        "reason": "unauthenticated" if reason == "unauthenticated" else "denied"})
        if span is not None:
            span.add_event("authz.denied", {"agw.authz.reason": detail})
