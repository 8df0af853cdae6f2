"""Admission: a bounded number of calls in flight, in all and per tenant, refused at once past either.

Never an unbounded queue: a request that cannot start now is answered
RESOURCE_EXHAUSTED with a retry hint, so the client (or its balancer) can go
elsewhere, instead of waiting behind hundreds of others (the analysis saw
312 ms of queueing at 128 concurrent requests).

Fair share: each tenant may hold at most its own bound of the process's
slots (``AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT`` times its weight from
``AGW_GATEWAY_TENANT_WEIGHTS``), so one tenant's flood is refused while other
tenants are still admitted. Both bounds are per process: N gateway workers
(or pods) admit up to N times as much, spread by the kernel (or the load
balancer) over their connections.

Every process that answers the public API admits with these settings: the
gateway for every public call, and, behind an edge, the inference and
retrieval services for the ``Generate`` and ``Retrieve`` the edge sends them
(``servicekit.public_methods``), which never pass through a gateway.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager

from servicekit.errors import ResourceExhausted
from servicekit.metrics import meter

_REJECTIONS = meter("servicekit").create_counter(
    "agw.admission.rejections", description="Calls refused at admission, by reason (tenant or capacity).")


class Admission:
    """Counts the calls in flight in this process, in all and per tenant."""

    def __init__(self, max_in_flight: int, retry_after_s: float = 0.05, *, per_tenant: int = 0,
                 weights: Mapping[str, float] | None = None, holder: str = "this gateway process") -> None:
        """
        Args:
            max_in_flight: calls in flight in this process, all tenants together.
            per_tenant: a tenant's bound before its weight (0: no per-tenant bound).
            weights: tenant -> weight (default 1); a tenant's bound is per_tenant x weight, at least 1.
            holder: what holds the slots, as refusals name it ("this inference service process").
        """
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.per_tenant = per_tenant
        self.weights = dict(weights or {})
        self.holder = holder
        self.in_flight = 0
        self.admitted = 0
        self.rejected = 0
        #: Calls in flight per tenant (tenants with none are not listed).
        self.tenants: dict[str, int] = {}

    def tenant_bound(self, tenant: str) -> int:
        """How many calls ``tenant`` may hold at once in this process (0: unbounded)."""
        if not self.per_tenant:
            return 0
        return max(1, round(self.per_tenant * self.weights.get(tenant, 1.0)))

    def attributes(self, tenant: str) -> dict[str, int]:
        """This process's admission as ``tenant``'s call finds it, for the call's span."""
        return {
            "agw.admission.in_flight": self.in_flight,
            "agw.admission.max_in_flight": self.max_in_flight,
            "agw.admission.tenant_in_flight": self.tenants.get(tenant, 0),
            "agw.admission.tenant_bound": self.tenant_bound(tenant),
        }

    def acquire(self, tenant: str = "", span=None) -> Callable[[], None]:
        """Take a slot now, or raise ResourceExhausted; returns the slot's release, which frees it once.

        For a call whose end is not a block of code (a stream handed to gRPC
        as it is, released from ``context.add_done_callback``); :meth:`admit`
        otherwise. With ``span`` (the call's own), the decision is recorded
        there: :meth:`attributes`, and a refusal as an ``agw.admission.refused``
        event (a child span per call would cost more than the decision:
        gateway.service). A span that records nothing (no collector: the
        services' default) is not given the attributes: their dict would be
        built on every call for nothing.
        """
        if span is not None and span.is_recording():
            span.set_attributes(self.attributes(tenant))
        try:
            return self._acquire(tenant)
        except ResourceExhausted as refusal:
            if span is not None:
                span.add_event("agw.admission.refused", {"agw.admission.reason": refusal.message})
            raise

    def _acquire(self, tenant: str) -> Callable[[], None]:
        held = self.tenants.get(tenant, 0)
        bound = self.tenant_bound(tenant) if tenant else 0
        if bound and held >= bound:
            self.rejected += 1
            _REJECTIONS.add(1, {"reason": "tenant"})
            raise ResourceExhausted(
                f"tenant {tenant} has {held} calls in flight, its share of {self.holder} "
                f"(AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT={self.per_tenant} x weight "
                f"{self.weights.get(tenant, 1.0):g}); retry shortly",
                retry_after_s=self.retry_after_s,
            )
        if self.in_flight >= self.max_in_flight:
            self.rejected += 1
            _REJECTIONS.add(1, {"reason": "capacity"})
            raise ResourceExhausted(
                f"{self.holder} is at capacity: {self.in_flight} calls in flight (AGW_GATEWAY_MAX_IN_FLIGHT="
                f"{self.max_in_flight}); retry shortly or on another replica",
                retry_after_s=self.retry_after_s,
            )
        self.in_flight += 1
        self.admitted += 1
        self.tenants[tenant] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.in_flight -= 1
            left = self.tenants[tenant] - 1
            if left:
                self.tenants[tenant] = left
            else:
                del self.tenants[tenant]

        return release

    @contextmanager
    def admit(self, tenant: str = "", span=None):
        """Hold a slot for the body's duration, or raise ResourceExhausted now (``span``: as :meth:`acquire`)."""
        release = self.acquire(tenant, span)
        try:
            yield
        finally:
            release()
