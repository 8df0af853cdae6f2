"""A backend's public passthrough method, served to an edge: the base of the inference and retrieval ones.

Behind an edge (docs/architecture.md, "The edge"), ``Generate`` and
``Retrieve`` of the public ``AgentGateway`` contract are served by the
backends themselves. Each such method checks the public API's bounds and
scopes to the tenant the edge verified, takes an admission slot (the
gateway's ``AGW_GATEWAY_MAX_IN_FLIGHT*`` bounds, per process and per tenant:
these calls never pass a gateway, so its admission cannot hold a tenant's
flood back), then calls the backend's own handler; its answer goes out as
the backend's message behind the public response's one field
(``servicekit.passthrough.add_public_passthroughs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import trace

from agent.gateway.v1 import gateway_pb2
from servicekit.bounds import Bounds
from servicekit.metrics import gauge, meter
from servicekit.passthrough import add_public_passthroughs
from servicekit.public_api import PublicApiSettings

PUBLIC_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["AgentGateway"]


def public_path(method: str) -> str:
    """The full path of a public method (for policies: the backends' own methods share its name)."""
    return f"/{PUBLIC_SERVICE.full_name}/{method}"


class PublicPassthrough:
    """One public method on a backend; a subclass names it (``method``) and defines it, as a method of that name."""

    #: The public method this serves, by name ("Generate").
    method: str = ""
    #: The service serving it, as refusals name it ("inference").
    service: str = ""

    def __init__(self, api: PublicApiSettings, servicer: Any) -> None:
        self.api = api
        self.bounds = Bounds(api)
        self.servicer = servicer
        self.admission = api.admission(f"this {self.service} service process")

    def admit(self, tenant: str) -> Callable[[], None]:
        """A slot for this call, recorded on its span, or ResourceExhausted now; returns the slot's release."""
        return self.admission.acquire(tenant, trace.get_current_span())

    @property
    def path(self) -> str:
        return public_path(self.method)

    def declare_on(self, app: Any) -> None:
        """Tell the bootstrap, through ``app``, of this method: its service (health, reflection), and that only
        tenants call it, through an edge (``method_policies``, ``edge_only``: servicekit.server)."""
        app.services = (*app.services, PUBLIC_SERVICE)
        app.method_policies = {**getattr(app, "method_policies", {}), self.path: ("tenant/*",)}
        app.edge_only = (*getattr(app, "edge_only", ()), self.path)

    def register(self, server) -> None:
        add_public_passthroughs(server, PUBLIC_SERVICE, {self.method: getattr(self, self.method)})
        # As the gateway exports its own (gateway.service): what this process has admitted, read at each scrape.
        gauge(meter("servicekit"), "agw.admission.in_flight", lambda: [(self.admission.in_flight, {})],
              description="Public calls admitted and running in this process (behind an edge: those it sent here).")
