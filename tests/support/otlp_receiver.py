"""A real OTLP/gRPC trace receiver (opentelemetry-proto's TraceService) for tests.

It runs on its own threads, outside any test's event loop, so processes
started before a test (the session's inference service) can export to it for
the whole session. It keeps every span it receives, flattened with the name
of the service that sent it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    status_code: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int
    attributes: dict
    events: tuple[str, ...]
    #: Each event's attributes, by the event's name (the last of a name that repeats).
    event_attributes: dict = field(default_factory=dict)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=resource.get("service.name", ""),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        status_code=span.status.code,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=tuple(e.name for e in span.events),
                        event_attributes={e.name: {a.key: _value(a.value) for a in e.attributes} for e in span.events},
                    ))
        with self.lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, service: _TraceService, port: int) -> None:
        self._service = service
        self.port = port

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        """What a service process needs to export here, fast (small batch delay)."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._service.lock:
            spans = list(self._service.spans)
        return [s for s in spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(self, trace_id: str, predicate, timeout: float = 15.0) -> list[ReceivedSpan]:
        """The trace's spans once ``predicate(spans)`` holds; fails with what arrived."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(trace_id)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted(f"{s.service}:{s.name}" for s in spans)
                raise AssertionError(f"trace {trace_id} incomplete after {timeout}s; received {names}")
            time.sleep(0.05)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    service = _TraceService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield OtlpReceiver(service, port)
    finally:
        server.stop(grace=None)
