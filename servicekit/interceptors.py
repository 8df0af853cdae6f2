"""The edge of every RPC: its server span, authorization, readiness gate and error mapping, in one wrapper.

Each method's handler is wrapped once (:class:`EdgeHandlers`), when the
method is first called, rather than by a grpc.aio server interceptor, which
is awaited on every call.

Authorization (:class:`~servicekit.authz.Authorizer`) runs here, once per
call, before the handler: so it holds for every method of every service,
whatever the handler does with its messages. Handlers raise
:class:`~servicekit.errors.ServiceError`; this is the one place that turns it
into a gRPC status with details. A cancelled call's ``CancelledError`` is
never caught here: it must reach gRPC untouched.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from contextlib import aclosing

import grpc
from grpc_health.v1 import health_pb2
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from servicekit.authz import Authorizer
from servicekit.call_metadata import call_metadata, keep
from servicekit.errors import (Internal, InvalidArgument, ServiceError, Unavailable, Unimplemented, quote_error_id,
                               trailing_metadata)
from servicekit.metrics import meter
from servicekit.telemetry import (TRACE_ID_KEY, UnrecordedServerSpans, client_context, extract_context, trace_id_hex,
                                  unrecorded_server_spans)

log = logging.getLogger(__name__)
_TRACER = trace.get_tracer("agent-gateway.servicekit")
_METER = meter("servicekit")
_CALL_DURATION = _METER.create_histogram(
    "rpc.server.duration", unit="ms", description="Server-side duration of each RPC, by method and status code.")
_CALL_ERRORS = _METER.create_counter(
    "agw.rpc.errors", description="RPCs that ended in an error, by method and status code.")

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
#: Services answered even before the app is ready: probes must see NOT_SERVING,
#: not UNAVAILABLE, and tools must be able to list services. Health answers
#: any verified certificate; reflection, like every other service, only the
#: identities the service's policy allows.
ALWAYS_OPEN = frozenset(
    {
        HEALTH_SERVICE,
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


class Readiness:
    """Whether the service has finished warming up. Set once by the bootstrap."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.ready = False

    def check(self) -> None:
        if not self.ready:
            raise Unavailable(f"{self.service} is warming up; retry once its health check reports SERVING")


class _ServerSpan:
    """The call's SERVER span: the caller's W3C context as parent, current while the call runs.

    Attached and detached in the call's own task (a handler runs in one task
    from start to end, unless a cancelled call leaves it to asyncio's
    generator finaliser), and ended however the call ends. The trace id goes
    back to the caller in the ``x-trace-id`` trailer.
    """

    def __init__(self, method: str, context, client_trace: str | None = None,
                 unrecorded: UnrecordedServerSpans | None = None) -> None:
        span = unrecorded.start(call_metadata(context)) if unrecorded is not None else None
        if span is not None:  # this process records no span: the one the SDK would make, without it
            self.span, parent = span, Context()
        else:
            if client_trace is None:  # our own services call us: their context, baggage and sampling stand
                parent, links = extract_context(call_metadata(context)), []
            else:  # a caller outside the deployment: telemetry.client_context says what is kept
                parent, links = client_context(call_metadata(context), client_trace)
            self.span = _TRACER.start_span(method.lstrip("/"), context=parent, kind=trace.SpanKind.SERVER,
                                           links=links, attributes={"rpc.system": "grpc", "rpc.method": method})
        self._token = otel_context.attach(trace.set_span_in_context(self.span, parent))
        self._task = _current_task()
        self.trace_id = trace_id_hex(self.span)
        context.set_trailing_metadata(((TRACE_ID_KEY, self.trace_id),))
        self.method = method
        self._code = grpc.StatusCode.OK
        self._started = time.perf_counter()

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        self._code = code
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        self.span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
        _CALL_ERRORS.add(1, {"rpc.method": self.method, "rpc.grpc.status_code": code.name})

    def end(self) -> None:
        _CALL_DURATION.record((time.perf_counter() - self._started) * 1000,
                              {"rpc.method": self.method, "rpc.grpc.status_code": self._code.name})
        self.span.end()
        # A streaming handler left suspended at a yield by a cancelled call is
        # closed later by asyncio's generator finaliser, in a task of its own:
        # its context is not the one attached to (OpenTelemetry would log an
        # ERROR for every such cancel), and the call's own context is gone.
        if _current_task() is self._task:
            otel_context.detach(self._token)


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop: finalised outside it
        return None


ERROR_ID_KEY = "x-error-id"
#: Statuses that are our failure, not the caller's: their message carries the error id to quote.
_SERVER_FAULTS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS})


async def _abort(context: grpc.aio.ServicerContext, error: ServiceError, span: _ServerSpan) -> None:
    """End the call with ``error``'s status. Every error gets an id, in the trailers, the log and the span;
    what only operators may read (``error.internal``) goes to the log and the span, never to the caller."""
    error_id = uuid.uuid4().hex[:16]
    message = error.message
    if error.code in _SERVER_FAULTS:
        message = quote_error_id(message, error_id)
    if error.internal:
        log.warning("%s %s [error id %s]: %s", span.method, error.code.name, error_id, error.internal)
        span.span.set_attribute("agw.error.internal", error.internal)
    span.span.set_attribute("agw.error.id", error_id)
    span.fail(error.code, message)
    await context.abort(error.code, message, trailing_metadata=(
        *trailing_metadata(error, message), (TRACE_ID_KEY, span.trace_id), (ERROR_ID_KEY, error_id)))


def _unexpected(method: str, exc: Exception) -> ServiceError:
    if isinstance(exc, NotImplementedError):  # the generated servicer's body for a method this server lacks
        return Unimplemented(f"{method} is not implemented by this server; it is older than the caller's contract")
    log.exception("unhandled error in %s", method)
    return Internal(f"internal error in {method} ({type(exc).__name__}); the server log has the traceback")


class _Undecodable:
    """What a request that failed to decode becomes, so the handler's wrapper can answer INVALID_ARGUMENT.

    gRPC itself answers a deserializer's exception with UNKNOWN (or INTERNAL),
    which tells the client nothing it can fix.
    """

    def __init__(self, error: Exception) -> None:
        self.error = error

    def refuse(self) -> InvalidArgument:
        reason = str(self.error) or type(self.error).__name__
        return InvalidArgument("request", f"cannot be decoded as this method's request message ({reason}); "
                                          "check the method and the message (strings must be valid UTF-8)")


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the caller's bytes
            return _Undecodable(exc)

    return decode


def _check_decoded(request):
    if isinstance(request, _Undecodable):
        raise request.refuse()
    return request


def _admit(edge: EdgeHandlers, context, method: str, span: _ServerSpan) -> None:
    # The caller stays bound for the rest of the call's task (gRPC runs each
    # call in a task of its own, so nothing leaks to another call).
    edge.authorizer.bind(edge.authorizer.authorize(context, method, span.span))
    edge.readiness.check()


def _wrap_unary(behavior: Callable[..., Awaitable], method: str, edge: EdgeHandlers):
    async def handler(request, context):
        span = _ServerSpan(method, context, edge.client_trace, edge.unrecorded)
        try:
            _admit(edge, context, method, span)
            return await behavior(_check_decoded(request), context)
        except ServiceError as error:
            await _abort(context, error, span)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except asyncio.CancelledError:
            span.fail(grpc.StatusCode.CANCELLED, "cancelled by the caller or its deadline")
            raise
        except Exception as exc:  # noqa: BLE001 - the edge of the RPC
            await _abort(context, _unexpected(method, exc), span)
        finally:
            span.end()

    return handler


def _wrap_streaming(behavior: Callable, method: str, edge: EdgeHandlers):
    async def handler(request, context):
        span = _ServerSpan(method, context, edge.client_trace, edge.unrecorded)
        try:
            _admit(edge, context, method, span)
            result = behavior(_check_decoded(request), context)
            if inspect.isasyncgen(result):
                # aclosing: a cancelled call closes the handler's generator at
                # once, so its cleanup (an engine abort) runs now, not at GC.
                async with aclosing(result) as messages:
                    async for message in messages:
                        yield message
            else:  # a coroutine that writes with context.write
                await result
        except ServiceError as error:
            await _abort(context, error, span)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except (asyncio.CancelledError, GeneratorExit):
            span.fail(grpc.StatusCode.CANCELLED, "cancelled by the caller or its deadline")
            raise
        except Exception as exc:  # noqa: BLE001 - the edge of the RPC
            await _abort(context, _unexpected(method, exc), span)
        finally:
            span.end()

    return handler


def _authorized_only(behavior: Callable, method: str, authorizer: Authorizer):
    """Reflection: authorized like the service's own methods, but neither traced nor gated on readiness."""

    async def handler(request_iterator, context):
        try:
            authorizer.authorize(context, method)
        except ServiceError as error:
            await context.abort(error.code, error.message)
        async for message in behavior(request_iterator, context):
            yield message

    return handler


class EdgeHandlers:
    """Authorizes and traces each call, rejects calls until ready, and maps domain errors to statuses.

    It wraps each method's handler once, the first time the method is
    called (:meth:`generic`, on every generic handler a service registers),
    not once per call: a grpc.aio server interceptor is awaited on every
    call, and one that wraps the handler builds two handler tuples and three
    closures per call (12 to 24 µs of an echo server's CPU a call, against 2
    to 4 built once; docs/benchmarks.md, "The edge's wrapper built once per
    method"). Health passes untouched (any verified certificate may probe,
    untraced); reflection is authorized but not traced.
    """

    def __init__(self, readiness: Readiness, authorizer: Authorizer, always_open: Collection[str] = ALWAYS_OPEN, *,
                 client_trace: str | None = None) -> None:
        """
        Args:
            client_trace: None where every caller is one of our services (their trace
                context stands); ``link`` or ``continue`` at a public port
                (``telemetry.client_context``).

        Built after the process's tracer provider is installed: whether it
        records spans decides how each call's server span is made
        (``telemetry.unrecorded_server_spans``).
        """
        self.readiness = readiness
        self.authorizer = authorizer
        self.client_trace = client_trace
        self.unrecorded = unrecorded_server_spans(client_trace)
        self._always_open = always_open

    def generic(self, handler: grpc.GenericRpcHandler) -> grpc.GenericRpcHandler:
        """``handler`` (a service's generic handler) with each of its methods wrapped, once per method."""
        return _WrappedOnce(handler, self)

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` of ``method`` (its full path) as every call of it runs: authorized, traced, gated."""
        service = method.rsplit("/", 2)[-2] if method.count("/") >= 2 else ""
        if service == HEALTH_SERVICE:
            return handler
        if service in self._always_open:
            if handler.stream_stream is None:
                return handler
            return handler._replace(stream_stream=_authorized_only(handler.stream_stream, method, self.authorizer))
        if not handler.request_streaming:  # a streamed request is read by the handler (context.read): gRPC's own
            handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method, self))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, method, self))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_streaming(handler.unary_stream, method, self))
        return handler._replace(stream_stream=_wrap_streaming(handler.stream_stream, method, self))


class _WrappedOnce(grpc.GenericRpcHandler):
    """A service's generic handler whose method handlers come wrapped by :meth:`EdgeHandlers.wrap`, each once.

    Only methods the service has are kept (a name a client made up finds
    nothing, and is not remembered): at most one entry per method it serves.
    """

    def __init__(self, inner: grpc.GenericRpcHandler, edge: EdgeHandlers) -> None:
        self._inner = inner
        self._edge = edge
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details):
        keep(handler_call_details.invocation_metadata)  # built for this lookup: the call reads it, not a new one
        method = handler_call_details.method
        handler = self._wrapped.get(method)
        if handler is None:
            handler = self._inner.service(handler_call_details)
            if handler is None:
                return None
            handler = self._wrapped[method] = self._edge.wrap(method, handler)
        return handler
