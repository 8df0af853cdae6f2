"""Who is calling, and the names their resources have on the backends.

The tenant is the name in the caller's verified identity
(``spiffe://<trust domain>/tenant/<name>``, which ``servicekit.authz`` checked
before the handler ran); a client cannot choose it. A tenant's collection
``docs`` is ``t3-dev-docs`` on the retrieval service: the tenant's length
prefixes it, so no two (tenant, collection) pairs map to one name, whatever
characters either holds. With ``AGW_GATEWAY_PREFIX_CACHE=tenant`` (the
default), a tenant's prompts are also in a prefix-cache partition of their
own, named the same way.
"""

from __future__ import annotations

import re

from opentelemetry import trace

from agent.gateway.v1 import gateway_pb2
from agent.retrieval.v1 import retrieval_pb2
from servicekit.authz import caller
from servicekit.errors import InvalidArgument, PermissionDenied
from servicekit.identity import DEFAULT_TENANT, Identity
from servicekit.public_api import PublicApiSettings

_COLLECTION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
DEV_TENANT = DEFAULT_TENANT
#: The caller of every plaintext call with AGW_INSECURE_DEV.
DEV_IDENTITY = Identity.tenant(DEV_TENANT)
#: The inference service takes salts of up to 256 characters; the tenant's part takes up to 68.
MAX_REQUESTED_SALT_CHARS = 128


def current_tenant() -> str:
    """The calling tenant's name (authorization admitted only tenants to the methods that ask)."""
    identity = caller().identity
    if identity.kind != "tenant":
        raise PermissionDenied(f"{identity} is not a tenant; this method serves tenants only")
    return identity.name


def physical_collection(tenant: str, collection: str, field: str = "collection") -> str:
    """The retrieval service's name for ``tenant``'s ``collection``."""
    if not _COLLECTION_RE.match(collection or ""):
        raise InvalidArgument(field, f"{collection!r} is not a valid collection name (letters, digits, '-', '_'; 1-64)")
    return f"t{len(tenant)}-{tenant}-{collection}"


def tenant_collection(physical: str) -> str:
    """The caller-facing name of a physical collection name."""
    length, _, rest = physical[1:].partition("-")
    return rest[int(length) + 1:]


def tenant_cache_salt(tenant: str, requested: str = "") -> str:
    """The inference ``cache_salt`` for ``tenant``: its own partition, subdivided by what the client asked for.

    Without it, a tenant could time its requests to learn whether another
    tenant had sent the same prefix (a cached prefix answers sooner). The
    length prefix keeps ("a", "b/c") and ("a/b", "c") apart.
    """
    if len(requested) > MAX_REQUESTED_SALT_CHARS:
        raise InvalidArgument("request.cache_salt", f"is {len(requested)} characters; the limit is "
                              f"{MAX_REQUESTED_SALT_CHARS} (the gateway prefixes it with the tenant)")
    salt = f"t{len(tenant)}-{tenant}"
    return f"{salt}/{requested}" if requested else salt


def cache_salt_for(prefix_cache: str, tenant: str, requested: str = "") -> str:
    """The salt a request reaches the inference service with, under ``AGW_GATEWAY_PREFIX_CACHE``.

    ``tenant``: the tenant's own partition (:func:`tenant_cache_salt`);
    ``shared``: the client's salt as sent (empty: the shared cache).
    """
    return tenant_cache_salt(tenant, requested) if prefix_cache == "tenant" else requested


def scoped_search(api: PublicApiSettings, tenant: str,
                  request: gateway_pb2.RetrieveRequest) -> retrieval_pb2.SearchRequest:
    """The search a tenant's ``Retrieve`` becomes: in the tenant's own collection, kept on the index, ef capped.

    Exhaustive search is an operator's tool, and ``hnsw_ef`` is capped at
    ``AGW_GATEWAY_MAX_HNSW_EF``; each clamp is recorded on the current span.

    The request's own search is scoped in place and returned: the call owns
    its parsed request, and a copy of a 384-value query vector cost 4 µs a
    call. Read the name the tenant asked for before (for messages).
    """
    search = request.request
    # The tenant decides the collection; nothing in the request can name another tenant's.
    search.collection = physical_collection(tenant, search.collection, "request.collection")
    if search.exact:
        search.exact = False
        trace.get_current_span().set_attribute("agw.retrieve.exact_clamped", True)
    if search.HasField("hnsw_ef") and search.hnsw_ef > api.max_hnsw_ef:
        trace.get_current_span().set_attribute("agw.retrieve.hnsw_ef_clamped_from", search.hnsw_ef)
        search.hnsw_ef = api.max_hnsw_ef
    return search
