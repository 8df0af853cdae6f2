"""Calls to the retrieval and inference services, with deadlines and error mapping.

Every backend call carries the caller's remaining deadline less a margin (or
the configured default), runs on a pooled channel, and turns a backend's
failure into our own error with its status kept: a backend's UNAVAILABLE
reaches the client as UNAVAILABLE, never UNKNOWN.

Inference calls go to the replica a :class:`Route` names (``gateway.routing``
chooses it); a call that failed UNAVAILABLE before its first message may be
sent once more, to the next replica (:meth:`Backends.reroute`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from agent.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from servicekit.channels import ChannelSpec, status_after_failed_write, status_lost
from servicekit.errors import DeadlineExceeded, ServiceError, Unavailable, from_rpc_error
from servicekit.metrics import meter
from servicekit.pool import ChannelPool, Liveness, PooledChannel
from servicekit.tasks import cancel_and_wait
from servicekit.telemetry import outgoing_metadata
from servicekit.tls import CertificateFiles, ClientTls

from gateway.replicas import Replica, Replicas
from gateway.routing import Policy, Reason, Router
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
RETRIEVAL_SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["Retrieval"]
_SEARCH = RETRIEVAL_SERVICE.methods_by_name["Search"]
_ROUTED = meter("gateway").create_counter(
    "agw.routing.calls", description="Inference calls routed, by replica and reason (affinity, spill, retry, balanced).")


@dataclass(frozen=True)
class Route:
    """Where an inference call goes: the replica, why, the call's routing key, and the replicas tried before."""

    key: bytes
    replica: Replica
    reason: Reason
    tried: tuple[Replica, ...] = ()

    def note(self) -> None:
        """Count the routing and put it on the current span (the call's: Chat's generation, Generate's server)."""
        self.replica.routed[self.reason] += 1
        _ROUTED.add(1, {"replica": self.replica.name, "reason": self.reason.value})
        trace.get_current_span().set_attributes({
            "agw.inference.replica": self.replica.name, "agw.inference.route_reason": self.reason.value})


class Deadlines:
    """How long a backend call may take, from what the caller has left."""

    def __init__(self, default_s: float, margin_ms: float) -> None:
        self.default_s = default_s
        self.margin_s = margin_ms / 1000

    def for_call(self, context) -> float:
        remaining = context.time_remaining() if context is not None else None
        if remaining is None:
            return self.default_s
        timeout = remaining - self.margin_s
        if timeout <= 0:
            raise DeadlineExceeded("the caller's deadline leaves no time for the backend call")
        return timeout


class Backends:
    """The inference replicas, the retrieval pool, and typed calls on them."""

    def __init__(self, inference: Replicas, retrieval: ChannelPool, deadlines: Deadlines) -> None:
        self.inference = inference
        self.retrieval = retrieval
        self.deadlines = deadlines
        #: False once the inference service answered OpenGenerate with
        #: UNIMPLEMENTED (older than this gateway): plain Generate from then on.
        self.inference_opens_early = True

    @property
    def pools(self) -> tuple[ChannelPool, ...]:
        return (*self.inference.pools, self.retrieval)

    @property
    def ready(self) -> bool:
        """Retrieval SERVING and an inference replica routable: the gateway may serve."""
        return self.retrieval.serving and any(r.routable for r in self.inference.replicas.values())

    def route(self, key: bytes) -> Route:
        """The replica for a call with routing key ``key`` (``gateway.routing``)."""
        choice = self.inference.choose(key)
        return Route(key, choice.replica, choice.reason)

    def reroute(self, route: Route, error: ServiceError) -> Route | None:
        """The retry of a call that failed with ``error`` before its first message: once, on another replica,
        and only for UNAVAILABLE (the replica went away or stopped serving; nothing was generated)."""
        if error.code != grpc.StatusCode.UNAVAILABLE or route.tried:
            return None
        try:
            choice = self.inference.choose(route.key, exclude=(route.replica,))
        except ServiceError:
            return None
        log.warning("inference replica %s failed before the first token (%s); retrying on %s",
                    route.replica.name, error.message, choice.replica.name)
        return Route(route.key, choice.replica, Reason.RETRY, (route.replica,))

    async def _unary(self, pool: ChannelPool, stub_class, method: str, request, context, *, raw=None):
        """One unary call on ``pool``; ``raw``: the method's descriptor, to get the response as the backend's bytes."""
        timeout = self.deadlines.for_call(context)
        with pool.use() as pooled, BackendErrors(pool, pooled):
            call = pooled.raw(raw) if raw is not None else getattr(pooled.stub(stub_class), method)
            return await call(request, timeout=timeout, metadata=outgoing_metadata())

    async def search(self, request: retrieval_pb2.SearchRequest, context) -> retrieval_pb2.SearchResponse:
        return await self._unary(self.retrieval, retrieval_pb2_grpc.RetrievalStub, "Search", request, context)

    async def search_bytes(self, request: retrieval_pb2.SearchRequest, context) -> bytes:
        """A search whose response stays the retrieval service's serialised SearchResponse (passed through)."""
        return await self._unary(self.retrieval, None, "Search", request, context, raw=_SEARCH)

    async def get_collection(self, name: str, context) -> retrieval_pb2.GetCollectionResponse:
        return await self._unary(self.retrieval, retrieval_pb2_grpc.RetrievalStub, "GetCollection",
                                 retrieval_pb2.GetCollectionRequest(name=name), context)

    async def create_collection(self, collection: retrieval_pb2.Collection, context):
        return await self._unary(self.retrieval, retrieval_pb2_grpc.RetrievalStub, "CreateCollection",
                                 retrieval_pb2.CreateCollectionRequest(collection=collection), context)

    async def upsert(self, request: retrieval_pb2.UpsertRequest, context) -> retrieval_pb2.UpsertResponse:
        return await self._unary(self.retrieval, retrieval_pb2_grpc.RetrievalStub, "Upsert", request, context)

    def _start(self, method: str, *request, route: Route, context, raw: bool = False) -> StartedStream:
        timeout = self.deadlines.for_call(context)
        pool = route.replica.pool
        slot = ExitStack()
        pooled = slot.enter_context(pool.use())
        start = (pooled.raw(INFERENCE_SERVICE.methods_by_name[method]) if raw
                 else getattr(pooled.stub(inference_pb2_grpc.InferenceStub), method))
        call = start(*request, timeout=timeout, metadata=outgoing_metadata())
        route.note()
        return StartedStream(call, slot, pool, pooled)

    def start_generate(self, request: inference_pb2.GenerateRequest, context, route: Route) -> StartedStream:
        """Start a Generate call now: it goes out the next time the event loop runs.

        For a caller with its own writes to do before it reads (Chat's context
        event): ``await asyncio.sleep(0)`` after this sends the request first,
        so the engine's prefill overlaps those writes instead of following them.
        """
        return self._start("Generate", request, route=route, context=context)

    def start_generate_bytes(self, request: inference_pb2.GenerateRequest, context, route: Route) -> StartedStream:
        """:meth:`start_generate` whose messages stay the inference service's bytes (passed through unparsed)."""
        return self._start("Generate", request, route=route, context=context, raw=True)

    def open_generate(self, context, route: Route) -> StartedStream:
        """Open an inference call whose prompt follows (:meth:`StartedStream.send_prefix`, then :meth:`StartedStream.send`).

        The call's setup (the stream, its headers, the server's dispatch) then
        happens while the caller still builds its prompt, not after.
        """
        return self._start("OpenGenerate", route=route, context=context)


def backend_error(exc: grpc.aio.AioRpcError, pool: ChannelPool, pooled: PooledChannel, generation: int):
    """A backend call's failure as our error; a call ended because its connection fell silent is UNAVAILABLE."""
    if exc.code() == grpc.StatusCode.CANCELLED and pooled.generation != generation:
        return stalled_error(pool, pooled)
    return from_rpc_error(exc, backend=pool.name, where=pool.target)


def stalled_error(pool: ChannelPool, pooled: PooledChannel) -> Unavailable:
    return Unavailable(f"the {pool.name} service stopped answering (no reply to liveness probes); retry shortly",
                       internal=f"{pool.describe()}: call ended when channel {pooled.index} was replaced")


class BackendErrors:
    """Around a backend call's await: its failure becomes our error (``backend_error``), and a cancellation
    caused by a liveness probe replacing the channel (closing a channel cancels its calls) becomes
    UNAVAILABLE; our own task's cancellation stays one. A class, not a generator: it wraps every read."""

    __slots__ = ("_pool", "_pooled", "_generation")

    def __init__(self, pool: ChannelPool, pooled: PooledChannel) -> None:
        self._pool = pool
        self._pooled = pooled
        self._generation = pooled.generation

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            return False
        if issubclass(exc_type, grpc.aio.AioRpcError):
            raise backend_error(exc, self._pool, self._pooled, self._generation) from None
        if issubclass(exc_type, asyncio.CancelledError) and self._pooled.generation != self._generation:
            raise stalled_error(self._pool, self._pooled) from None
        return False


class StartedStream:
    """A server-streaming backend call already under way, on a pooled channel.

    Iterate it for the messages (a backend error becomes our ServiceError);
    leave its ``async with`` (or :meth:`close`) to cancel the call if still
    running and give the channel back. Unlike an async generator, closing it
    works even if it was never iterated.
    """

    def __init__(self, call, slot: ExitStack, pool: ChannelPool, pooled: PooledChannel) -> None:
        self._call = call
        self._slot = slot
        self._pool = pool
        self._pooled = pooled
        self._generation = pooled.generation
        self._errors = BackendErrors(pool, pooled)

    async def send_prefix(self, messages: list[inference_pb2.ChatMessage],
                          tools: tuple[inference_pb2.Tool, ...] = (), prefill_cache_salt: str | None = None) -> None:
        """The first messages of the chat to come, on a call from :meth:`Backends.open_generate` (at most once,
        first); with ``prefill_cache_salt`` (the request's cache salt), prefilled too while the engine has room."""
        await self._write(inference_pb2.OpenGenerateRequest(
            prefix=inference_pb2.ChatMessages(messages=messages, tools=tools), prefill_cache_salt=prefill_cache_salt))

    async def send(self, request: inference_pb2.GenerateRequest) -> None:
        """The request of a call from :meth:`Backends.open_generate` (once, last)."""
        await self._write(inference_pb2.OpenGenerateRequest(request=request))

    async def _write(self, message) -> None:
        try:
            await self._call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The call ended before or during this write (an early call refused as UNIMPLEMENTED, say). The
            # write's own error can be a transport detail ("Internal error from Core"): the call's status says why.
            status = await status_after_failed_write(self._call)
            if status_lost(status):
                # The backend ended the call (a replica draining, say) and grpc.aio overwrote its status with
                # the write's placeholder. Nothing was generated: UNAVAILABLE, which Generate and Chat retry
                # once on another replica, not an INTERNAL error that fails the turn.
                raise Unavailable(f"the {self._pool.name} service ended the call as its request was sent; retry "
                                  "shortly", internal=f"{self._pool.describe()}: the call's status was lost to "
                                  "grpc.aio's write placeholder") from None
            raise backend_error(status, self._pool, self._pooled, self._generation) from None

    def __aiter__(self) -> StartedStream:
        return self

    async def __anext__(self):
        # read(), not the call's own iterator: no generator layer per message,
        # and nothing left suspended for the garbage collector on an early exit.
        with self._errors:
            message = await self._call.read()
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        self._pooled.received()
        return message

    def close(self) -> None:
        self._call.cancel()  # no-op once finished; on a cancelled caller, frees the engine now
        self._slot.close()

    async def __aenter__(self) -> StartedStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()


def _spec(settings: GatewaySettings, target: str, service, tls: ClientTls | None) -> ChannelSpec:
    return ChannelSpec(
        target=target, tls=tls, services=[service], keepalive=settings.keepalive,
        max_message_bytes=settings.max_message_bytes, user_agent="agent-gateway/gateway",
        stream_window_bytes=settings.backend_stream_window_bytes,
    )


async def _follow_certificates(certificates: CertificateFiles, targets, server_name: str | None,
                               every_s: float) -> None:
    """Renewed gateway certificate files: new connections for every pool (``reload_tls``), the old ones drained."""
    while True:
        await asyncio.sleep(every_s)
        material = await asyncio.to_thread(certificates.refresh)  # file reads stay off the event loop
        if material is not None:
            tls = ClientTls.from_material(material, server_name=server_name)
            for target in targets:
                target.reload_tls(tls)


def _pool(settings: GatewaySettings, name: str, target: str, service, tls: ClientTls) -> ChannelPool:
    return ChannelPool(name, _spec(settings, target, service, tls), settings.channels_per_backend,
                       health_service=service.full_name, drain_s=settings.default_deadline_s,
                       liveness=Liveness(settings.backend_probe_s, settings.backend_probe_timeout_s)
                       if settings.backend_probe_s else None)


def _replicas(settings: GatewaySettings, tls: ClientTls, resolve=None) -> Replicas:
    """The inference replicas, each opened as a pool is (waiting for it at start only as on_backend_down says);
    ``resolve(host, port)``: the addresses of a ``dns:///`` entry (default the system resolver)."""

    async def open_pool(address: str, server_name: str | None, tls: ClientTls, first: bool) -> ChannelPool:
        pool = _pool(settings, "inference", address, INFERENCE_SERVICE, dataclasses.replace(tls, server_name=server_name))
        await pool.start(connect_timeout_s=settings.connect_timeout_s,
                         wait=not first or settings.on_backend_down == "wait")
        log.info("%s: %d channels", pool.describe(), settings.channels_per_backend)
        return pool

    router = Router(Policy(settings.inference_routing), lambda replica: replica.key, lambda replica: replica.load,
                    margin=settings.routing_load_margin, full=lambda replica: replica.full)
    return Replicas(settings.inference_target_list, open_pool, router, tls=tls,
                    max_waiting=settings.max_inference_waiting, resolve_s=settings.inference_resolve_s,
                    server_name=settings.backend_server_name, drain_s=settings.default_deadline_s, resolve=resolve,
                    place_sessions=settings.place_sessions)


@asynccontextmanager
async def open_backends(settings: GatewaySettings) -> AsyncIterator[Backends]:
    """Open and warm the inference replicas' pools and the retrieval pool (and the certificate watcher);
    close them in reverse.

    The gateway presents its own service identity (``AGW_GATEWAY_IDENTITY``)
    to the backends, from the same folder as the certificate it serves with.
    """
    certificates = CertificateFiles(settings.identity_files, check_every_s=0)
    tls = ClientTls.from_material(certificates.current, server_name=settings.backend_server_name)
    async with AsyncExitStack() as stack:
        inference = _replicas(settings, tls)
        stack.push_async_callback(inference.close)
        await inference.start()
        retrieval = _pool(settings, "retrieval", settings.retrieval_target, RETRIEVAL_SERVICE, tls)
        await retrieval.start(connect_timeout_s=settings.connect_timeout_s, wait=settings.on_backend_down == "wait")
        stack.push_async_callback(retrieval.close)
        log.info("%s: %d channels", retrieval.describe(), settings.channels_per_backend)
        backends = Backends(inference, retrieval, deadlines=Deadlines(settings.default_deadline_s,
                                                                     settings.deadline_margin_ms))
        if settings.tls_reload_s > 0:
            follower = asyncio.create_task(_follow_certificates(
                certificates, (inference, retrieval), settings.backend_server_name, settings.tls_reload_s),
                name="gateway-certificates")
            stack.push_async_callback(cancel_and_wait, follower)
        yield backends
