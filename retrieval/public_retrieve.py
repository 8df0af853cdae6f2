"""The public API's ``Retrieve``, served by the retrieval service for the calls an edge forwards.

The retrieval half of docs/architecture.md's "The edge": what the gateway's
passthrough does to a ``Retrieve`` (bounds, the tenant's own collection, the
clamps on exact search and ``hnsw_ef``, admission) is done here, once per call, and the
answer is this service's ``SearchResponse`` behind the public response's one
field. The tenant is the one whose certificate the edge verified.
"""

from __future__ import annotations

import grpc

from agent.gateway.v1 import gateway_pb2
from servicekit.errors import NotFound, ServiceError
from servicekit.public_methods import PublicPassthrough
from servicekit.tenancy import current_tenant, scoped_search


class PublicRetrieve(PublicPassthrough):
    """``AgentGateway.Retrieve`` on top of the retrieval servicer's own ``Search``."""

    method = "Retrieve"
    service = "retrieval"

    async def Retrieve(self, request: gateway_pb2.RetrieveRequest, context):
        tenant = current_tenant()
        self.bounds.retrieve(request)
        asked = request.request.collection
        search = scoped_search(self.api, tenant, request)
        release = self.admit(tenant)
        try:
            return await self.servicer.Search(search, context)
        except ServiceError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:  # named as the tenant named it, not by its physical name
                raise NotFound(f"collection {asked!r} does not exist") from None
            raise
        finally:
            release()
