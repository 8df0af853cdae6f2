"""The client certificate an edge proxy verified, as it forwards it in ``x-forwarded-client-cert``.

With an edge proxy (Envoy) on the public port, a tenant's TLS session ends at
the edge, and the service it forwards to sees the edge's certificate. The
edge is configured (``agentgw edge-config``) to drop any such header a client
sent and to set its own, one element naming the certificate it verified::

    By=spiffe://agentgw.local/service/edge;Hash=<sha256>;Cert="<URL-encoded PEM>";URI=spiffe://agentgw.local/tenant/dev

A service believes this header only from a caller whose own verified
certificate is an edge's (``AGW_<SERVICE>_EDGE_CLIENTS``, checked by
``servicekit.authz``). It takes the identity from the forwarded certificate
itself, checks that it names the same SPIFFE ID as ``URI``, and reads the
serial for the denylist: what a direct caller's certificate would give.
"""

from __future__ import annotations

from urllib.parse import unquote

from cryptography import x509

from servicekit.errors import Unauthenticated

#: The header an edge sets (Envoy's ``forward_client_cert_details: SANITIZE_SET``).
XFCC_HEADER = "x-forwarded-client-cert"
#: Larger is not one certificate (a chain or a pile of elements): refused before parsing.
MAX_XFCC_CHARS = 8192


def _split(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside double quotes (Envoy quotes values that hold , ; or =)."""
    parts, current, quoted = [], [], False
    for char in text:
        if char == '"':
            quoted = not quoted
        if char == separator and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if quoted:
        raise ValueError("an unterminated quoted value")
    parts.append("".join(current))
    return parts


def parse_xfcc(value: str) -> dict[str, list[str]]:
    """The keys and values of a header holding exactly one element; ValueError otherwise.

    One element: an edge that sanitises the header sets one, for the client
    it verified. Several mean another proxy appended to what a client sent.
    """
    if len(value) > MAX_XFCC_CHARS:
        raise ValueError(f"{len(value)} characters, over {MAX_XFCC_CHARS}")
    elements = _split(value, ",")
    if len(elements) != 1:
        raise ValueError(f"{len(elements)} elements; an edge that sanitises the header sets exactly one")
    fields: dict[str, list[str]] = {}
    for pair in _split(elements[0], ";"):
        key, sep, raw = pair.strip().partition("=")
        if not sep or not key:
            raise ValueError(f"{pair[:40]!r} is not key=value")
        fields.setdefault(key.strip().lower(), []).append(raw.strip().strip('"'))
    return fields


def forwarded_certificate(value: str) -> tuple[x509.Certificate, str]:
    """The forwarded certificate and the one SPIFFE ID it carries, checked against the header's ``URI``.

    Raises:
        Unauthenticated: naming what is missing or inconsistent.
    """
    try:
        fields = parse_xfcc(value)
    except ValueError as exc:
        raise Unauthenticated(f"the edge's {XFCC_HEADER} header is malformed: {exc}") from None
    certs, uris = fields.get("cert", []), fields.get("uri", [])
    if len(certs) != 1 or len(uris) != 1:
        raise Unauthenticated(f"the edge's {XFCC_HEADER} header must carry one Cert and one URI (it has {len(certs)} "
                              f"and {len(uris)}); configure the edge with `agentgw edge-config`")
    try:
        certificate = x509.load_pem_x509_certificate(unquote(certs[0]).encode())
    except ValueError:
        raise Unauthenticated(f"the edge's {XFCC_HEADER} header carries a Cert that is not a PEM certificate") from None
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        spiffe = [uri for uri in sans.get_values_for_type(x509.UniformResourceIdentifier)
                  if uri.startswith("spiffe://")]
    except x509.ExtensionNotFound:
        spiffe = []
    if spiffe != [uris[0]]:
        raise Unauthenticated(f"the forwarded certificate's SPIFFE IDs {spiffe} do not match the edge's URI "
                              f"{uris[0]!r}")
    return certificate, uris[0]
