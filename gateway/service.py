"""The ``agent.gateway.v1.AgentGateway`` servicer and the gateway app.

Passthroughs only convert, scope to the caller's tenant, and delegate; the
session RPCs go to the session store and Chat to :class:`gateway.chat.ChatTurns`.
Authorization ran before any of this (``servicekit.authz``): tenants on every
method, operators on GetStats alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager

import grpc
from opentelemetry import trace

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2
from servicekit.admission import Admission
from servicekit.bounds import Bounds
from servicekit.errors import InvalidArgument, NotFound, ServiceError
from servicekit.json_schema import SchemaVerdicts, check_schema
from servicekit.metrics import counter, gauge, meter
from servicekit.passthrough import add_service, wrap
from servicekit.procfs import available_cpus, open_fds
from servicekit.server import Health
from servicekit.tenancy import DEV_IDENTITY, cache_salt_for, current_tenant, physical_collection, scoped_search
from gateway.backends import Backends, open_backends
from gateway.replicas import Replica
from gateway.routing import Reason, generate_key, session_key
from gateway.chat import ChatTurns, Clock
from gateway.convert import message_to_proto, session_to_proto, turn_event_to_proto, turn_request_from_proto
from gateway.database import embedded_postgres_url, open_database
from gateway.sessions import Sessions
from gateway.settings import GatewaySettings
from gateway.stream_writer import CoalescingWriter, SendWatch, merge_text
from gateway.turn_types import Delta

log = logging.getLogger(__name__)
tracer = trace.get_tracer("agent-gateway.gateway")

GATEWAY_SERVICE = pb.DESCRIPTOR.services_by_name["AgentGateway"]
#: Methods answered with the backend's bytes behind their response's one field, ``response = 1``.
PASSTHROUGH_METHODS = ("Generate", "Retrieve")
_RESPONSE_FIELD = pb.GenerateResponse.DESCRIPTOR.fields_by_name["response"].number
assert _RESPONSE_FIELD == pb.RetrieveResponse.DESCRIPTOR.fields_by_name["response"].number


def _note_turn_shape(request: pb.ChatRequest) -> None:
    """The turn's shape on its span, never its content: enough for ``agentgw load --replay`` to send its like."""
    session = request.session_id
    trace.get_current_span().set_attributes({
        "agw.turn.message_chars": len(request.message),
        "agw.turn.retrieval": request.HasField("retrieval"),
        "agw.turn.max_tokens": request.generation.max_tokens,
        "agw.turn.tool_results": len(request.tool_results),
        # Which turns share a session, without naming it.
        "agw.turn.session_key": hashlib.sha256(session.encode()).hexdigest()[:16] if session else "",
    })


def _note_stream(messages_in: int, messages_out: int, last: bytes = b"", replica: Replica | None = None) -> None:
    """Per stream, not per message: messages in and out, and the token counts of a forwarded final message
    (which the replica that served it adds to its prefix-cache hit rate)."""
    span = trace.get_current_span()
    span.set_attributes({"agw.stream.messages_in": messages_in, "agw.stream.messages_out": messages_out})
    if last:
        usage = inference_pb2.GenerateResponse.FromString(last).result.usage
        span.set_attribute("agw.generate.completion_tokens", usage.completion_tokens)
        span.set_attribute("agw.generate.cached_prompt_tokens", usage.cached_prompt_tokens)
        if replica is not None:
            replica.note_usage(usage)


class GatewayServicer(gateway_pb2_grpc.AgentGatewayServicer):
    def __init__(self, settings: GatewaySettings, admission: Admission) -> None:
        self.settings = settings
        self.admission = admission
        self.bounds = Bounds(settings)
        self.schemas = SchemaVerdicts()
        self.backends: Backends | None = None
        self.sessions: Sessions | None = None
        self.turns: ChatTurns | None = None

    def _tenant(self, context) -> str:
        return current_tenant()

    def _admit(self, slot: ExitStack, tenant: str, *, stage: bool = False) -> None:
        """Take an admission slot for the call's duration (held by ``slot``), or refuse now; traced.

        ``stage``: Chat's admission is a stage of the turn, with a span of its
        own (docs/architecture.md). A one-hop call (Generate, Retrieve,
        IngestDocuments) records the same attributes on its server span, and a
        refusal as an ``agw.admission.refused`` event there: a child span per
        call cost 17-22 µs of the tracing SDK's CPU (bench/edge_costs.py), a
        tenth of what the gateway adds to a unary call over a bare hop, for a
        decision that takes microseconds and whose refusal is the server
        span's status anyway.
        """
        if stage:
            with tracer.start_as_current_span("admission", attributes=self.admission.attributes(tenant)):
                slot.enter_context(self.admission.admit(tenant))
            return
        slot.enter_context(self.admission.admit(tenant, trace.get_current_span()))

    async def Generate(self, request, context):
        """A passthrough: the inference service's messages go out as the bytes it sent (servicekit.passthrough).

        Written with ``context.write`` as read, not yielded: no generator hop
        per message here or at the edge, and no second task (a coalescing
        writer here cost more CPU per token than it saved: the gateway's
        writes finish well within a stream's inter-token gap even at 64
        streams, so nothing merged; docs/benchmarks.md). Reading waits for
        each write, so a slow client holds the backend back through flow
        control, and a client that takes no message for
        ``AGW_GATEWAY_STREAM_SEND_TIMEOUT_S`` ends the stream (``SendWatch``).
        Only the last message is parsed, after the stream, for the span's
        token counts.
        """
        tenant = self._tenant(context)
        self.bounds.generate(request)
        # The request is ours to change: no copy of the prompt.
        request.request.cache_salt = cache_salt_for(self.settings.prefix_cache, tenant, request.request.cache_salt)
        key = self._generate_key(request.request, context)
        messages, last = 0, b""
        with ExitStack() as slot, SendWatch(self.settings.stream_send_timeout_s) as watch:
            self._admit(slot, tenant)
            route = self.backends.route(key)
            try:
                while True:
                    try:
                        async with self.backends.start_generate_bytes(request.request, context, route) as stream:
                            async for payload in stream:
                                watch.writing()
                                await context.write(wrap(_RESPONSE_FIELD, payload))
                                watch.written()
                                messages += 1
                                last = payload
                        break
                    except ServiceError as exc:  # before the first message, once, on the next replica
                        if messages or (route := self.backends.reroute(route, exc)) is None:
                            raise
            except asyncio.CancelledError:
                if not watch.fired:  # the client cancelled, or its deadline passed
                    raise
                raise watch.expired() from None  # the generation was cancelled on the way out
        _note_stream(messages, messages, last, route.replica)

    def _generate_key(self, request: inference_pb2.GenerateRequest, context) -> bytes:
        """Where a Generate goes: the client's ``x-agw-affinity`` key, routed as a session of that id (so a
        session's Generate calls meet its Chat turns), else the prompt's leading text."""
        affinity = self.bounds.affinity(context)
        if affinity:
            return session_key(request.cache_salt, affinity)
        return generate_key(request, self.settings.routing_prefix_chars)

    async def Retrieve(self, request, context):
        """A passthrough: the retrieval service's SearchResponse goes out as the bytes it sent."""
        tenant = self._tenant(context)
        self.bounds.retrieve(request)
        asked = request.request.collection
        search = scoped_search(self.settings, tenant, request)
        with ExitStack() as slot:
            self._admit(slot, tenant)
            try:
                response = await self.backends.search_bytes(search, context)
            except ServiceError as exc:
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    raise NotFound(f"collection {asked!r} does not exist") from None
                raise
        return wrap(_RESPONSE_FIELD, response)

    async def IngestDocuments(self, request, context):
        tenant = self._tenant(context)
        self.bounds.ingest(request)
        name = physical_collection(tenant, request.collection)
        if not request.documents:
            raise InvalidArgument("documents", "is empty; send at least one document")
        with ExitStack() as slot:
            self._admit(slot, tenant)
            return await self._ingest(tenant, name, request, context)

    async def _ingest(self, tenant: str, name: str, request, context) -> pb.IngestDocumentsResponse:
        created = False
        try:
            await self.backends.get_collection(name, context)
        except ServiceError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            collection = retrieval_pb2.Collection(
                name=name, tenant=tenant, default_payload_fields=list(request.default_payload_fields) or ["text"])
            try:
                await self.backends.create_collection(collection, context)
                created = True
            except ServiceError as race:
                if race.code != grpc.StatusCode.ALREADY_EXISTS:  # another ingest created it first
                    raise
        response = await self.backends.upsert(
            retrieval_pb2.UpsertRequest(collection=name, documents=request.documents), context)
        return pb.IngestDocumentsResponse(ingested=response.upserted, created_collection=created)

    async def GetStats(self, request, context):
        # Operators only (GatewayApp.method_policies): it names backends and processes.
        backends = [*(_backend_stats(r.pool, _replica_stats(r)) for r in self.backends.inference.replicas.values()),
                    _backend_stats(self.backends.retrieval)]
        pool = self.sessions.database.pool
        database = pb.DatabaseStats(
            min_size=pool.get_min_size(), max_size=pool.get_max_size(), open=pool.get_size(),
            idle=pool.get_idle_size(), acquire_timeout_ms=int(self.sessions.database.acquire_timeout_s * 1000),
        )
        return pb.GetStatsResponse(
            backends=backends, in_flight=self.admission.in_flight, admitted=self.admission.admitted,
            rejected=self.admission.rejected, worker_pid=os.getpid(), database=database,
            event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
            workers=self.settings.workers, cpu_count=available_cpus(), asyncio_tasks=len(asyncio.all_tasks()),
            inference_routing=self.backends.inference.policy.value,
            open_fds=open_fds(), limits=pb.PublicLimits(
                max_concurrent_streams=self.settings.max_concurrent_streams,
                max_connection_idle_ms=int(self.settings.max_connection_idle_s * 1000),
                max_connection_age_ms=int(self.settings.max_connection_age_s * 1000),
                max_receive_bytes=self.settings.max_receive_bytes, max_in_flight=self.settings.max_in_flight,
                max_in_flight_per_tenant=self.settings.max_in_flight_per_tenant,
                max_connections=self.settings.max_connections),
        )

    async def Chat(self, request, context):
        """A turn's events, written by a :class:`CoalescingWriter` (deltas merge only behind a slow client)."""
        clock = Clock(time.perf_counter())
        tenant = self._tenant(context)
        self.bounds.chat(request)
        _note_turn_shape(request)
        turn = turn_request_from_proto(request)
        await self._check_schemas(request)
        with ExitStack() as slot:
            self._admit(slot, tenant, stage=True)  # held for the whole turn
            admitted_at = time.perf_counter()
            async with CoalescingWriter(context, merge_text, self.settings.stream_pending_bytes,
                                        self.settings.stream_send_timeout_s) as out:
                async for event in self.turns.run(tenant, turn, context, admitted_at, clock):
                    if isinstance(event, Delta):
                        await out.delta(event.text, len(event.text.encode()))
                    else:
                        await out.message(turn_event_to_proto(event))
        _note_stream(out.deltas, out.written)

    async def _check_schemas(self, request: pb.ChatRequest) -> None:
        """Tool and response-format schemas against the meta-schema: once per text, on a thread (CPU work)."""
        named = [(f"tools[{i}].parameters", t.parameters) for i, t in enumerate(request.tools) if t.parameters]
        if request.response_format.json_schema.schema:
            named.append(("response_format.json_schema.schema", request.response_format.json_schema.schema))
        for field, text in named:
            key = SchemaVerdicts.key(text)
            if not self.schemas.seen(key):
                await asyncio.to_thread(check_schema, field, text, max_depth=self.settings.max_schema_depth)
                self.schemas.remember(key)

    async def CreateSession(self, request, context):
        self.bounds.create_session(request)
        tenant = self._tenant(context)
        session_id = self.backends.inference.new_session_id(self.turns.session_route_key(tenant))
        session = await self.sessions.create(tenant, dict(request.metadata), session_id)
        return pb.CreateSessionResponse(session=session_to_proto(session))

    async def GetSession(self, request, context):
        self.bounds.session(request)
        session = await self.sessions.get(self._tenant(context), request.session_id)
        return pb.GetSessionResponse(session=session_to_proto(session))

    async def ListMessages(self, request, context):
        self.bounds.session(request)
        messages, token = await self.sessions.list_messages(
            self._tenant(context), request.session_id, request.page_size, request.page_token)
        return pb.ListMessagesResponse(messages=[message_to_proto(m) for m in messages], next_page_token=token)

    async def DeleteSession(self, request, context):
        self.bounds.session(request)
        await self.sessions.delete(self._tenant(context), request.session_id)
        return pb.DeleteSessionResponse()


def _backend_stats(pool, replica: pb.ReplicaStats | None = None) -> pb.BackendStats:
    return pb.BackendStats(
        name=pool.name, target=pool.target, serving=pool.serving, replica=replica,
        channels=[
            pb.ChannelStats(
                index=p.index, state=p.state.name, calls=p.stats.calls, in_flight=p.stats.in_flight,
                connection_attempts=p.stats.connection_attempts, connections_ready=p.stats.connections_ready,
            )
            for p in pool.channels
        ],
    )


def _replica_stats(replica: Replica) -> pb.ReplicaStats:
    routed = replica.routed
    return pb.ReplicaStats(
        name=replica.name, routable=replica.routable, running_requests=replica.running,
        waiting_requests=replica.waiting, kv_cache_usage=replica.kv_cache_usage,
        routed_affinity=routed[Reason.AFFINITY], routed_spill=routed[Reason.SPILL], routed_retry=routed[Reason.RETRY],
        routed_balanced=routed[Reason.BALANCED], prompt_tokens=replica.prompt_tokens,
        cached_prompt_tokens=replica.cached_prompt_tokens)


def _observe(backends: Backends, database, admission: Admission) -> None:
    """Gauges read at each scrape: channel load, the Postgres pool, admission."""
    gateway_meter = meter("gateway")
    gauge(gateway_meter, "agw.channel.in_flight", lambda: [
        (pooled.stats.in_flight, {"backend": pool.name, "target": pool.target, "channel": pooled.index})
        for pool in backends.pools for pooled in pool.channels
    ], description="Calls in flight on each pooled backend channel (each inference replica has its own pool).")
    gauge(gateway_meter, "agw.db.pool.connections", lambda: [
        (database.pool.get_size(), {"state": "open"}), (database.pool.get_idle_size(), {"state": "idle"}),
    ], description="Postgres pool connections, open and idle.")
    gauge(gateway_meter, "agw.admission.in_flight", lambda: [(admission.in_flight, {})],
          description="Streams admitted and running in this worker.")
    replicas = backends.inference.replicas
    gauge(gateway_meter, "agw.replica.load", lambda: [
        (value, {"replica": r.name, "state": state}) for r in replicas.values()
        for state, value in (("running", r.running), ("waiting", r.waiting))
    ], description="Each inference replica's requests, running and waiting, from its WatchLoad stream.")
    counter(gateway_meter, "agw.replica.prompt_tokens", lambda: [
        (value, {"replica": r.name, "cached": cached}) for r in replicas.values()
        for cached, value in (("true", r.cached_prompt_tokens), ("false", r.prompt_tokens - r.cached_prompt_tokens))
    ], description="Prompt tokens of generations each replica finished for this worker, by whether its prefix "
       "cache served them.")


class GatewayApp:
    """The gateway, as the servicekit bootstrap runs it."""

    name = "gateway"
    services = (GATEWAY_SERVICE,)
    #: GetStats shows backend addresses and processes: operators', not tenants'.
    method_policies = {"GetStats": ("operator/*",)}
    #: Every caller with AGW_INSECURE_DEV (plaintext, so no certificate to read).
    plaintext_identity = DEV_IDENTITY

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.client_trace = settings.client_trace  # tenants' trace context: servicekit.telemetry.client_context
        self.insecure = settings.insecure_dev
        if self.insecure:
            log.warning("!" * 72)
            log.warning("AGW_INSECURE_DEV=1: the gateway serves PLAINTEXT with NO client authentication.")
            log.warning("Every caller is tenant 'dev'. Never use this outside a development machine.")
            log.warning("!" * 72)
        self.admission = settings.admission("this gateway process")
        self.servicer = GatewayServicer(settings, self.admission)

    def register(self, server) -> None:
        add_service(server, GATEWAY_SERVICE, self.servicer, raw_responses=PASSTHROUGH_METHODS)

    @asynccontextmanager
    async def lifespan(self, health: Health):
        async with AsyncExitStack() as stack:
            settings = self.settings
            url = settings.database_url or await embedded_postgres_url(settings.embedded_postgres_dir)
            database = await stack.enter_async_context(open_database(
                url, password=settings.database_password(), min_size=settings.db_min_size, max_size=settings.db_max_size,
                acquire_timeout_s=settings.db_acquire_timeout_s, command_timeout_s=settings.db_command_timeout_s,
                statement_cache_size=settings.db_statement_cache_size,
            ))
            self.servicer.sessions = Sessions(database, max_per_tenant=settings.max_sessions_per_tenant)
            backends = await stack.enter_async_context(open_backends(self.settings))
            self.servicer.turns = ChatTurns(settings, backends, database)
            _observe(backends, database, self.admission)
            # With AGW_GATEWAY_ON_BACKEND_DOWN=wait the gateway stays NOT_SERVING
            # (calls get UNAVAILABLE) until every backend reports SERVING.
            while not backends.ready:
                await asyncio.sleep(0.1)
            self.servicer.backends = backends
            try:
                yield
            finally:
                self.servicer.backends = None
