"""A Chat turn's inference call and its ``generation`` span.

Opened early (``Inference.OpenGenerate``, right after history and retrieval
start) the call's setup is done before the prompt is; the system prompt and
history go out on it as soon as Postgres answers, so the inference service
tokenizes them while retrieval still runs; the request follows when the
prompt is ready. Otherwise, or for a retry, a plain ``Generate`` call starts
at the prompt. Either way the call runs inside the ``generation`` span, so the
inference service's spans sit under it.

The call goes to the replica its routing key picks (``gateway.routing``). If
it fails UNAVAILABLE before its first message, :meth:`GenerationCall.retry`
moves it once to the next replica: an early call is opened there again and
its prefix resent.
"""

from __future__ import annotations

import contextlib
import logging

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from agent.inference.v1 import inference_pb2
from servicekit.errors import ServiceError

from gateway.backends import Backends, Route, StartedStream

log = logging.getLogger(__name__)
_TRACER = trace.get_tracer("agent-gateway.chat")


class GenerationCall:
    """The turn's inference call(s), in one ``generation`` span; :meth:`close` ends whatever is left."""

    def __init__(self, backends: Backends, context, key: bytes) -> None:
        self._backends = backends
        self._context = context
        self._key = key
        self._opened: StartedStream | None = None
        #: What went out on the early call before its request, for a retry to resend.
        self._prefix: tuple[list[inference_pb2.ChatMessage], tuple[inference_pb2.Tool, ...], str | None] | None = None
        self.route: Route | None = None
        self.span: trace.Span | None = None

    def open_early(self) -> None:
        """Open the call now (OpenGenerate); its span, the generation stage's, starts with it."""
        self.span = _TRACER.start_span("generation")
        self.route = self._backends.route(self._key)
        self._opened = self._in_span(lambda: self._backends.open_generate(self._context, self.route))

    async def send_prefix(self, messages: list[inference_pb2.ChatMessage],
                          tools: tuple[inference_pb2.Tool, ...] = (), prefill_cache_salt: str | None = None) -> None:
        """The prompt's first messages (and its tools), for the inference service to tokenize meanwhile, and
        to prefill under ``prefill_cache_salt`` when set and its engine has room (early calls only)."""
        if self._opened is not None:
            self._prefix = (messages, tools, prefill_cache_salt)
            with contextlib.suppress(ServiceError):  # the call ended: sending the request will say why
                await self._opened.send_prefix(messages, tools, prefill_cache_salt)

    def prompt_ready(self) -> trace.Span:
        """Mark the prompt built; the span (started now if the call was not opened early)."""
        self.span = self.span or _TRACER.start_span("generation")
        self.span.add_event("prompt_ready")
        return self.span

    @property
    def opened_early(self) -> bool:
        """Whether :meth:`start` will use the early call (an UNIMPLEMENTED from it: see :meth:`refused`)."""
        return self._opened is not None

    async def start(self, request: inference_pb2.GenerateRequest) -> StartedStream:
        """The stream of ``request``: on the early call the first time, else on a new Generate call."""
        early, self._opened = self._opened, None  # the early call serves the first attempt only
        if early is None:
            self.route = self.route or self._backends.route(self._key)
            return self._in_span(lambda: self._backends.start_generate(request, self._context, self.route))
        try:
            await early.send(request)
        except BaseException:
            early.close()
            raise
        return early

    async def retry(self, error: ServiceError, opened_early: bool) -> bool:
        """Whether the call, failed with ``error`` before its first message, goes once more to another replica
        (:meth:`Backends.reroute`); an early call is opened there again, with its prefix."""
        route = self._backends.reroute(self.route, error) if self.route is not None else None
        if route is None:
            return False
        self.route = route
        if opened_early:
            self._opened = self._in_span(lambda: self._backends.open_generate(self._context, route))
            if self._prefix is not None:
                with contextlib.suppress(ServiceError):
                    await self._opened.send_prefix(*self._prefix)
        return True

    def refused(self, error: ServiceError) -> bool:
        """Whether the early call was refused as unknown: retry with Generate, and do so from now on."""
        if error.code != grpc.StatusCode.UNIMPLEMENTED:
            return False
        log.warning("%s; turns use Generate until the gateway restarts", error.message)
        self._backends.inference_opens_early = False
        return True

    def close(self) -> None:
        """Cancel an early call never used; end the span if nothing else did (a stage failed first)."""
        if self._opened is not None:
            self._opened.close()
            self._opened = None
        if self.span is not None and self.span.is_recording():
            self.span.set_status(Status(StatusCode.ERROR, "the turn ended before its prompt was ready"))
            self.span.end()

    def _in_span(self, start):
        # Current while the call is made, so its metadata carries the span's trace context.
        token = otel_context.attach(trace.set_span_in_context(self.span))
        try:
            return start()
        finally:
            otel_context.detach(token)
