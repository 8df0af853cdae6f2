"""Admission: a bounded number of streams in flight, in all and per tenant, refused at once past either.

Never an unbounded queue: a request that cannot start now is answered
RESOURCE_EXHAUSTED with a retry hint, so the client (or its balancer) can go
elsewhere, instead of waiting behind hundreds of others (the analysis saw
312 ms of queueing at 128 concurrent requests).

Fair share: each tenant may hold at most its own bound of the process's
slots (``AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT`` times its weight from
``AGW_GATEWAY_TENANT_WEIGHTS``), so one tenant's flood is refused while other
tenants are still admitted. Both bounds are per gateway process: N workers
(or pods) admit up to N times as much, spread by the kernel (or the load
balancer) over their connections.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

from servicekit.errors import ResourceExhausted
from servicekit.metrics import meter

_REJECTIONS = meter("gateway").create_counter(
    "agw.admission.rejections", description="Calls refused at admission, by reason (tenant or capacity).")


class Admission:
    """Counts streams in flight in this process, in all and per tenant."""

    def __init__(self, max_in_flight: int, retry_after_s: float = 0.05, *, per_tenant: int = 0,
                 weights: Mapping[str, float] | None = None) -> None:
        """
        Args:
            max_in_flight: streams in flight in this process, all tenants together.
            per_tenant: a tenant's bound before its weight (0: no per-tenant bound).
            weights: tenant -> weight (default 1); a tenant's bound is per_tenant x weight, at least 1.
        """
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.per_tenant = per_tenant
        self.weights = dict(weights or {})
        self.in_flight = 0
        self.admitted = 0
        self.rejected = 0
        #: Streams in flight per tenant (tenants with none are not listed).
        self.tenants: dict[str, int] = {}

    def tenant_bound(self, tenant: str) -> int:
        """How many streams ``tenant`` may hold at once in this process (0: unbounded)."""
        if not self.per_tenant:
            return 0
        return max(1, round(self.per_tenant * self.weights.get(tenant, 1.0)))

    @contextmanager
    def admit(self, tenant: str = ""):
        """Hold a slot for the body's duration, or raise ResourceExhausted now."""
        held = self.tenants.get(tenant, 0)
        bound = self.tenant_bound(tenant) if tenant else 0
        if bound and held >= bound:
            self.rejected += 1
            _REJECTIONS.add(1, {"reason": "tenant"})
            raise ResourceExhausted(
                f"tenant {tenant} has {held} streams in flight, its share of this gateway process "
                f"(AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT={self.per_tenant} x weight "
                f"{self.weights.get(tenant, 1.0):g}); retry shortly",
                retry_after_s=self.retry_after_s,
            )
        if self.in_flight >= self.max_in_flight:
            self.rejected += 1
            _REJECTIONS.add(1, {"reason": "capacity"})
            raise ResourceExhausted(
                f"gateway at capacity: {self.in_flight} streams in flight (AGW_GATEWAY_MAX_IN_FLIGHT="
                f"{self.max_in_flight}); retry shortly or on another replica",
                retry_after_s=self.retry_after_s,
            )
        self.in_flight += 1
        self.admitted += 1
        self.tenants[tenant] = held + 1
        try:
            yield
        finally:
            self.in_flight -= 1
            left = self.tenants[tenant] - 1
            if left:
                self.tenants[tenant] = left
            else:
                del self.tenants[tenant]
