"""Calls to the retrieval and inference services, with deadlines and error mapping.

Every backend call carries the caller's remaining deadline less a margin (or
the configured default), runs on a pooled channel, and turns a backend's
failure into our own error with its status kept: a backend's UNAVAILABLE
reaches the client as UNAVAILABLE, never UNKNOWN.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager

import grpc

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from agent.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from servicekit.channels import ChannelSpec
from servicekit.errors import DeadlineExceeded, Unavailable, from_rpc_error
from servicekit.tasks import cancel_and_wait
from servicekit.telemetry import outgoing_metadata
from servicekit.tls import CertificateFiles, ClientTls

from gateway.admission import Admission
from servicekit.pool import ChannelPool, Liveness, PooledChannel
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
RETRIEVAL_SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["Retrieval"]
_SEARCH = RETRIEVAL_SERVICE.methods_by_name["Search"]


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
    """The two backend pools and typed calls on them."""

    def __init__(self, inference: ChannelPool, retrieval: ChannelPool, deadlines: Deadlines) -> None:
        self.inference = inference
        self.retrieval = retrieval
        self.deadlines = deadlines
        #: False once the inference service answered OpenGenerate with
        #: UNIMPLEMENTED (older than this gateway): plain Generate from then on.
        self.inference_opens_early = True

    @property
    def pools(self) -> tuple[ChannelPool, ...]:
        return (self.inference, self.retrieval)

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

    async def get_load(self, context=None) -> inference_pb2.GetLoadResponse:
        return await self._unary(self.inference, inference_pb2_grpc.InferenceStub, "GetLoad",
                                 inference_pb2.GetLoadRequest(), context)

    def _start(self, method: str, *request, context, raw: bool = False) -> StartedStream:
        timeout = self.deadlines.for_call(context)
        slot = ExitStack()
        pooled = slot.enter_context(self.inference.use())
        start = (pooled.raw(INFERENCE_SERVICE.methods_by_name[method]) if raw
                 else getattr(pooled.stub(inference_pb2_grpc.InferenceStub), method))
        call = start(*request, timeout=timeout, metadata=outgoing_metadata())
        return StartedStream(call, slot, self.inference, pooled)

    def start_generate(self, request: inference_pb2.GenerateRequest, context) -> StartedStream:
        """Start a Generate call now: it goes out the next time the event loop runs.

        For a caller with its own writes to do before it reads (Chat's context
        event): ``await asyncio.sleep(0)`` after this sends the request first,
        so the engine's prefill overlaps those writes instead of following them.
        """
        return self._start("Generate", request, context=context)

    def start_generate_bytes(self, request: inference_pb2.GenerateRequest, context) -> StartedStream:
        """:meth:`start_generate` whose messages stay the inference service's bytes (passed through unparsed)."""
        return self._start("Generate", request, context=context, raw=True)

    def open_generate(self, context) -> StartedStream:
        """Open an inference call whose prompt follows (:meth:`StartedStream.send_prefix`, then :meth:`StartedStream.send`).

        The call's setup (the stream, its headers, the server's dispatch) then
        happens while the caller still builds its prompt, not after.
        """
        return self._start("OpenGenerate", context=context)


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
                          tools: tuple[inference_pb2.Tool, ...] = ()) -> None:
        """The first messages of the chat to come, on a call from :meth:`Backends.open_generate` (at most once, first)."""
        await self._write(inference_pb2.OpenGenerateRequest(
            prefix=inference_pb2.ChatMessages(messages=messages, tools=tools)))

    async def send(self, request: inference_pb2.GenerateRequest) -> None:
        """The request of a call from :meth:`Backends.open_generate` (once, last)."""
        await self._write(inference_pb2.OpenGenerateRequest(request=request))

    async def _write(self, message) -> None:
        try:
            await self._call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The call ended before or during this write (an early call refused as UNIMPLEMENTED, say). The
            # write's own error can be a transport detail ("Internal error from Core"): the call's status says why.
            status = grpc.aio.AioRpcError(await self._call.code(), await self._call.initial_metadata(),
                                          await self._call.trailing_metadata(), await self._call.details())
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
    )


async def _watch_inference_load(backends: Backends, admission: Admission, bound: int, every_s: float) -> None:
    """Admission's optional look at the inference queue."""
    while True:
        try:
            load = await backends.get_load()
            admission.backend_saturated = (
                f"inference queue holds {load.waiting_requests} requests "
                f"(AGW_GATEWAY_MAX_INFERENCE_WAITING={bound}); retry shortly"
                if load.waiting_requests >= bound else None
            )
        except Exception as exc:  # noqa: BLE001 - a failed poll must not stop polling
            log.debug("GetLoad poll failed: %s", exc)
            admission.backend_saturated = None
        await asyncio.sleep(every_s)


async def _follow_certificates(certificates: CertificateFiles, pools, server_name: str | None,
                               every_s: float) -> None:
    """Renewed gateway certificate files: new connections for every pool, the old ones drained."""
    while True:
        await asyncio.sleep(every_s)
        material = await asyncio.to_thread(certificates.refresh)  # file reads stay off the event loop
        if material is not None:
            tls = ClientTls.from_material(material, server_name=server_name)
            for pool in pools:
                pool.reload_tls(tls)


@asynccontextmanager
async def open_backends(settings: GatewaySettings, admission: Admission) -> AsyncIterator[Backends]:
    """Open and warm both pools (and the load and certificate watchers); close them in reverse.

    The gateway presents its own service identity (``AGW_GATEWAY_IDENTITY``)
    to the backends, from the same folder as the certificate it serves with.
    """
    certificates = CertificateFiles(settings.identity_files, check_every_s=0)
    tls = ClientTls.from_material(certificates.current, server_name=settings.backend_server_name)
    async with AsyncExitStack() as stack:
        pools = []
        for name, target, service in (
            ("inference", settings.inference_target, INFERENCE_SERVICE),
            ("retrieval", settings.retrieval_target, RETRIEVAL_SERVICE),
        ):
            pool = ChannelPool(name, _spec(settings, target, service, tls), settings.channels_per_backend,
                               health_service=service.full_name, drain_s=settings.default_deadline_s,
                               liveness=Liveness(settings.backend_probe_s, settings.backend_probe_timeout_s)
                               if settings.backend_probe_s else None)
            await pool.start(connect_timeout_s=settings.connect_timeout_s, wait=settings.on_backend_down == "wait")
            stack.push_async_callback(pool.close)
            pools.append(pool)
            log.info("%s: %d channels, READY", pool.describe(), settings.channels_per_backend)
        backends = Backends(*pools, deadlines=Deadlines(settings.default_deadline_s, settings.deadline_margin_ms))
        if settings.tls_reload_s > 0:
            follower = asyncio.create_task(_follow_certificates(
                certificates, pools, settings.backend_server_name, settings.tls_reload_s), name="gateway-certificates")
            stack.push_async_callback(cancel_and_wait, follower)
        if settings.max_inference_waiting:
            watcher = asyncio.create_task(_watch_inference_load(
                backends, admission, settings.max_inference_waiting, settings.load_poll_s))
            stack.push_async_callback(cancel_and_wait, watcher)
        yield backends
