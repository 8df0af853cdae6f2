"""The server bootstrap every service runs on.

Start-up: build a ``grpc.aio`` server with health and reflection, register the
app's servicers, bind mTLS, start listening with health ``NOT_SERVING``, run
the app's warm-up (its lifespan), then report ``SERVING``.

Shutdown, in reverse: on SIGTERM or SIGINT health turns ``NOT_SERVING``, the
server refuses new calls and gives in-flight ones ``grace_s`` to finish, then
the app's lifespan closes its backends. A second signal exits at once. A
signal during warm-up cancels the warm-up.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
import uvloop
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from servicekit.authz import Authorizer, Denylist, Policy
from servicekit.gc_pauses import GcPauses
from servicekit.interceptors import HEALTH_SERVICE, EdgeHandlers, Readiness
from servicekit.keepalive import GrpcOptions
from servicekit.metrics import configure_metrics, counter, gauge, meter
from servicekit.procfs import runqueue_wait_s
from servicekit.settings import ServiceSettings, SettingsError, load_settings
from servicekit.telemetry import configure_tracing
from servicekit.tls import CertificateFiles, ServerTls, TlsConfigError, reloading_server_credentials

log = logging.getLogger(__name__)

S = TypeVar("S", bound=ServiceSettings)


class Health:
    """The service's health as probes see it: one status for the server and each service."""

    def __init__(self, servicer: health_aio.HealthServicer, services: Sequence[str]) -> None:
        self._servicer = servicer
        self._names = ("", *services)
        self.serving = False

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for the server and all its services."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._names:
            await self._servicer.set(name, status)
        self.serving = serving

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for good: later set_serving calls are ignored."""
        await self._servicer.enter_graceful_shutdown()
        self.serving = False


class ServiceApp(Protocol):
    """What a service hands the bootstrap."""

    #: Short name for logs and errors, such as "inference".
    name: str
    #: The gRPC services it implements, for health and reflection.
    services: Sequence[ServiceDescriptor]
    # Optional attributes, read with getattr:
    #   insecure: bool, True to listen in plaintext (only the gateway, only with AGW_INSECURE_DEV);
    #   plaintext_identity: Identity, the identity of a caller without TLS in that mode;
    #   method_policies: {method name or full path: identity patterns}, methods allowed to others than
    #     AGW_*_ALLOWED_CLIENTS;
    #   edge_only: full paths of methods that answer only calls an edge forwards (AGW_*_EDGE_CLIENTS);
    #   client_trace: "link" or "continue" at a public port, whose callers' trace context is not trusted.

    def register(self, server: grpc.aio.Server) -> None:
        """Add the servicers to ``server`` (called before it starts)."""

    def lifespan(self, health: Health) -> AbstractAsyncContextManager[None]:
        """Entering opens backends and warms up; exiting closes them.

        The bootstrap reports SERVING once entered. ``health`` lets the app
        report NOT_SERVING later, for example when its engine dies.
        """


@dataclass
class RunningService:
    """A started service: where it listens and how to stop it."""

    port: int
    server: grpc.aio.Server
    health: Health
    grace_s: float
    #: Who may call what; its ``peers_seen`` records the certificate serials of callers.
    authorizer: Authorizer

    async def drain(self) -> None:
        """Refuse new calls, give in-flight ones ``grace_s``, then stop."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s)


#: Public-port limits a service's settings may declare (the gateway's), as gRPC server arguments.
_PUBLIC_LIMITS = (
    # Streams one connection may hold: one client cannot hold thousands open.
    ("max_concurrent_streams", "grpc.max_concurrent_streams", 1),
    # Connections the port holds: past it gRPC closes a new one as it arrives (its connection quota).
    ("max_connections", "grpc.max_allowed_incoming_connections", 1),
    # A handshake not finished by then is dropped: a silent client does not hold one of those places for 120 s.
    ("handshake_timeout_s", "grpc.server_handshake_timeout_ms", 1000),
    # Idle and aged connections are closed with GOAWAY: no descriptor is held
    # forever, and clients behind an L4 balancer move to new processes.
    ("max_connection_idle_s", "grpc.max_connection_idle_ms", 1000),
    ("max_connection_age_s", "grpc.max_connection_age_ms", 1000),
    ("max_connection_age_grace_s", "grpc.max_connection_age_grace_ms", 1000),
)
#: Request headers a caller may send (gRPC's default is 8 KiB with a soft limit; this is one hard bound).
MAX_METADATA_BYTES = 16 * 1024


def server_options(settings: ServiceSettings) -> GrpcOptions:
    """Server arguments, each with the reason it is not gRPC's default."""
    limits = [(option, int(getattr(settings, field) * scale))
              for field, option, scale in _PUBLIC_LIMITS if getattr(settings, field, None) is not None]
    return [
        *limits,
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        *settings.keepalive.server_options(),
        # A public port sets its own, smaller bound (AGW_GATEWAY_MAX_RECEIVE_BYTES);
        # internal hops take the deployment's.
        ("grpc.max_receive_message_length", getattr(settings, "max_receive_bytes", settings.max_message_bytes)),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        # gRPC sets SO_REUSEPORT by default, so a second server on a taken
        # port starts "fine" and steals half the connections. Only the
        # gateway, which runs several worker processes on one port, wants it.
        ("grpc.so_reuseport", int(getattr(settings, "reuse_port", False))),
    ]


def authorizer_for(app: ServiceApp, settings: ServiceSettings, *, insecure: bool) -> Authorizer:
    """The service's authorization, from its settings and what the app declares per method."""
    return Authorizer(
        app.name,
        Policy(settings.allowed_client_patterns, getattr(app, "method_policies", None)),
        trust_domain=settings.trust_domain,
        denylist=Denylist(settings.denied_clients_file, check_every_s=min(settings.tls_reload_s or 1.0, 1.0)),
        identity_from_cn=settings.identity_from_cn,
        plaintext_identity=getattr(app, "plaintext_identity", None) if insecure else None,
        edges=settings.edge_client_patterns,
        edge_only=getattr(app, "edge_only", ()),
    )


@asynccontextmanager
async def running_service(
    app: ServiceApp,
    settings: ServiceSettings,
    *,
    credentials: grpc.ServerCredentials | None = None,
    insecure: bool = False,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    freeze_heap: bool = False,
) -> AsyncIterator[RunningService]:
    """Serve ``app`` until the body exits, then drain and close in reverse order.

    Args:
        credentials: server credentials; default mTLS from the service's own
            identity folder, reloaded when renewed (``AGW_TLS_RELOAD_S``).
        insecure: listen in plaintext (development only; the caller warns).
        interceptors: grpc.aio interceptors, run before the edge's wrapper of each method (tests use them to
            record what a service received).
        freeze_heap: once warmed up, collect and then freeze what start-up
            built (``gc.freeze``), so that the collector's full passes walk
            only what calls made; a process's entry point asks for it, a test
            serving in its own process does not (it would freeze the test's heap).
    """
    started = time.perf_counter()
    insecure = insecure or getattr(app, "insecure", False)
    if credentials is None and not insecure:
        credentials = _server_credentials(settings)
    readiness = Readiness(app.name)
    authorizer = authorizer_for(app, settings, insecure=insecure)
    server = grpc.aio.server(interceptors=list(interceptors) or None, options=server_options(settings))
    edge = EdgeHandlers(readiness, authorizer, client_trace=getattr(app, "client_trace", None))
    health = await _health_and_reflection(GenericHandlersOnly(server, edge), app)
    app.register(GenericHandlersOnly(server, edge))
    if insecure:
        port = server.add_insecure_port(settings.listen_address)
    else:
        port = server.add_secure_port(settings.listen_address, credentials)
    running = RunningService(port=port, server=server, health=health, grace_s=settings.grace_s,
                             authorizer=authorizer)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(server.stop, None)  # last: whatever happened, stop
        _process_metrics(app.name, stack)
        await server.start()
        log.info("%s listening on %s:%d (%s), warming up", app.name, settings.host, port,
                 "PLAINTEXT" if insecure else "mTLS")
        if settings.port_file is not None:
            # Written as soon as we listen, so a supervisor can watch health
            # through the warm-up.
            _write_port_file(settings.port_file, port)
            stack.callback(settings.port_file.unlink, missing_ok=True)
        await stack.enter_async_context(app.lifespan(health))
        stack.push_async_callback(running.drain)  # first: drain before backends close
        if freeze_heap:
            _freeze_startup_heap(app.name)
        readiness.ready = True
        await health.set_serving(True)
        log.info("%s SERVING on port %d after %.0f ms", app.name, port, (time.perf_counter() - started) * 1000)
        yield running
    log.info("%s stopped", app.name)


class GenericHandlersOnly:
    """A grpc.aio server as registration code sees it: handlers go in as generic handlers only, each method's
    wrapped by the edge (:class:`~servicekit.interceptors.EdgeHandlers`) the first time it is called.

    The generated ``add_*Servicer_to_server`` also registers every method with
    the server as a "registered method". grpc.aio then keeps one pending
    request task per registered method, and its accept loop runs
    ``asyncio.wait`` over all of them for every incoming call, adding and
    removing a done callback on each: a cost per call that grows with the
    number of methods served (the gateway's methods, health's and
    reflection's), where one generic handler costs one task. Generic handlers
    are looked up in Python by method name, one dict lookup per service.
    """

    def __init__(self, server: grpc.aio.Server, edge: EdgeHandlers) -> None:
        self._server = server
        self._edge = edge

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(self._edge.generic(handler) for handler in handlers))

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        """Ignored: the same handlers came in through :meth:`add_generic_rpc_handlers` (see the class)."""


async def _health_and_reflection(server: GenericHandlersOnly, app: ServiceApp) -> Health:
    """Add the health service (NOT_SERVING until warmed up) and reflection for the app's services."""
    service_names = [service.full_name for service in app.services]
    health_servicer = health_aio.HealthServicer()
    health = Health(health_servicer, service_names)
    await health.set_serving(False)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # The asyncio servicer, named: enable_server_reflection picks the sync one for anything that is not a
    # grpc.aio.Server, as GenericHandlersOnly is not, and its generator cannot be served by grpc.aio.
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer([*service_names, HEALTH_SERVICE, reflection.SERVICE_NAME]), server)
    return health


def _freeze_startup_heap(name: str) -> None:
    """Move what start-up built out of the garbage collector's reach (``gc.freeze``).

    Start-up's objects (modules, descriptors, pools, the engine) live as long
    as the process, yet every full collection walked them, a pause inside
    some call: 65k objects in 39 ms in a gateway worker, and 670k (vLLM,
    torch) in about 300 ms in the inference service. Collected first, so
    start-up's garbage is freed, not kept: that one pass blocks the loop,
    but before SERVING, so no call waits on it.
    """
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("%s: %d objects from start-up frozen out of garbage collection (%.0f ms)", name,
             gc.get_freeze_count(), (time.perf_counter() - started) * 1000)


def _server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials:
    """mTLS from the service's own identity folder: reloaded on renewal, or fixed with AGW_TLS_RELOAD_S=0."""
    if settings.tls_reload_s > 0:
        return reloading_server_credentials(CertificateFiles(settings.identity_files,
                                                             check_every_s=settings.tls_reload_s))
    return ServerTls.from_dir(settings.identity_files.root).credentials()


def _process_metrics(service: str, stack: AsyncExitStack) -> None:
    """This process's gauges, and its garbage-collection pauses while ``stack`` is open."""
    stack.enter_context(GcPauses(service))
    loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
    gauge(meter("servicekit"), "agw.process.info", lambda: [(1, {"service": service, "event_loop": loop_name})],
          description="Always 1; its labels say which service and event loop (uvloop or asyncio) this process runs.")
    loop = asyncio.get_running_loop()
    gauge(meter("servicekit"), "agw.process.asyncio_tasks", lambda: [(len(asyncio.all_tasks(loop)), {"service": service})],
          unit="{task}", description="asyncio tasks alive in this process: growth under steady load is a leak "
                                    "(bench/soak.py watches it).")
    counter(meter("servicekit"), "agw.process.runqueue_wait", lambda: _runqueue_wait(service), unit="s",
            description="Seconds the event-loop thread was runnable but waiting for a CPU (Linux schedstat). "
                        "Growing under load means the host starves this process; see docs/architecture.md.")


def _runqueue_wait(service: str) -> list[tuple[float, dict]]:
    waited = runqueue_wait_s()
    return [] if waited is None else [(waited, {"service": service})]


def _write_port_file(path, port: int) -> None:
    # Write-then-rename so a reader never sees a half-written file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


class _SignalHandler:
    """First signal: drain (or cancel a warm-up). Second: exit at once."""

    def __init__(self, main_task: asyncio.Task, stop: asyncio.Event) -> None:
        self._main = main_task
        self._stop = stop
        self.received = 0
        self.last_signal = 0
        self.ready = False

    def __call__(self, signum: int) -> None:
        self.received += 1
        self.last_signal = signum
        name = signal.Signals(signum).name
        if self.received > 1:
            log.warning("second %s: exiting now without draining", name)
            logging.shutdown()
            os._exit(128 + signum)
        if self.ready:
            log.info("%s: draining", name)
            self._stop.set()
        else:
            log.info("%s during warm-up: cancelling start-up", name)
            self._main.cancel()


async def serve_until_signalled(app: ServiceApp, settings: ServiceSettings, **kwargs) -> int:
    """Serve ``app`` until SIGTERM or SIGINT; return the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()
    assert main_task is not None
    handler = _SignalHandler(main_task, stop)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, handler, signum)
    try:
        async with running_service(app, settings, freeze_heap=True, **kwargs):
            handler.ready = True
            await stop.wait()
        return 0
    except asyncio.CancelledError:
        if handler.received:
            return 128 + handler.last_signal
        raise
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def configure_logging(level: str) -> None:
    """One line per record, with time and logger: what an operator greps."""
    logging.basicConfig(
        level=level,
        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def run(app: ServiceApp, settings: ServiceSettings, **kwargs) -> int:
    """Run ``app`` on uvloop until signalled; the process entry point of a service."""
    # Everything a service writes under AGW_HOME (Qdrant Edge, models, spans,
    # port files) is its own: files 0600, folders 0700.
    os.umask(0o077)
    configure_logging(settings.log_level)
    provider = configure_tracing(app.name, trace_file=settings.trace_file)
    configure_metrics(app.name, settings.metrics_host, settings.metrics_port)
    try:
        return uvloop.run(serve_until_signalled(app, settings, **kwargs))
    finally:
        provider.shutdown()  # flushes spans still batched


def lower_priority(nice: int) -> None:
    """Every thread of this process at niceness ``nice`` or more; threads and processes started later inherit it.

    Linux keeps a niceness per thread, and imports (PyTorch, vLLM) may have
    started some already, so each is set, not only the caller. Raising
    niceness needs no privilege.
    """
    if nice <= 0:
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread, and what it starts
        threads = [0]
    for tid in threads:
        with suppress(OSError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))


def main_for(settings_cls: type[S], make_app: Callable[[S], ServiceApp], **overrides) -> int:
    """A service's ``main()``: read and check settings, then run until signalled.

    A bad setting exits with status 2 and the variable named, before anything
    starts. ``overrides`` win over the environment (command-line flags).
    """
    try:
        settings = load_settings(settings_cls, **overrides)
        app = make_app(settings)
        if not getattr(app, "insecure", False):
            ServerTls.from_dir(settings.identity_files.root)  # fail now, naming the missing file
    except (SettingsError, TlsConfigError, ValueError) as exc:
        print(f"{settings_cls.__module__.split('.')[0]}: {exc}", file=sys.stderr)
        return 2
    lower_priority(settings.nice)  # before the app starts its threads and processes (vLLM's engine)
    return run(app, settings)
