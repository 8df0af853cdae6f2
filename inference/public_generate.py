"""The public API's ``Generate``, served by the inference service for the calls an edge forwards.

With an edge proxy on the public port (docs/architecture.md, "The edge"), a
tenant's ``Generate`` goes from the edge straight here, as frames, with no
Python hop between. What the gateway's passthrough does to the request is done
here instead, once per call: the public API's bounds, the tenant's own
prefix-cache partition, then admission (per process and per tenant, as the
gateway's). The responses are this service's own messages behind
the public response's one field, so the client reads the same bytes as through
the gateway. The tenant is the one whose certificate the edge verified
(``servicekit.authz``): no tenant certificate reaches this service directly.
"""

from __future__ import annotations

from agent.gateway.v1 import gateway_pb2
from servicekit.public_methods import PublicPassthrough
from servicekit.tenancy import cache_salt_for, current_tenant


class PublicGenerate(PublicPassthrough):
    """``AgentGateway.Generate`` on top of the inference servicer's own ``Generate``."""

    method = "Generate"
    service = "inference"

    def Generate(self, request: gateway_pb2.GenerateRequest, context):
        """Checked, scoped and admitted, then the servicer's own stream, returned (not re-yielded: no generator hop).

        The admission slot is held until the call ends, however it ends
        (finished, failed, cancelled): gRPC's done callback frees it, so the
        stream needs no wrapper of its own.
        """
        tenant = current_tenant()
        self.bounds.generate(request)
        self.bounds.affinity(context)  # the edge routed on it; bounded here as the gateway bounds it
        inner = request.request
        inner.cache_salt = cache_salt_for(self.api.prefix_cache, tenant, inner.cache_salt)
        release = self.admit(tenant)
        context.add_done_callback(lambda _context: release())
        return self.servicer.Generate(inner, context)
