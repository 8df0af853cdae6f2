"""Traces without Jaeger: spans appended to a local JSON-lines file.

Every process with ``AGW_TRACE_FILE`` set appends its finished spans to that
file (one JSON object per line, one ``write`` per batch on an ``O_APPEND``
file, so processes sharing it do not interleave lines). ``agentgw trace
TRACE_ID`` (``agentgw.trace``) reads it back and prints the turn hop by hop. A
convenience for a laptop; Jaeger stays the tool for real deployments.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

TRACE_FILE_ENV = "AGW_TRACE_FILE"


class JsonLinesSpanExporter(SpanExporter):
    """Appends spans to ``path`` as JSON lines."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(_to_record(span), default=str) + "\n" for span in spans)
        try:
            descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # spans name tenants' data
            try:
                os.write(descriptor, lines.encode())
            finally:
                os.close(descriptor)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _to_record(span: ReadableSpan) -> dict:
    return {
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent_span_id": format(span.parent.span_id, "016x") if span.parent else "",
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "error": span.status.status_code.name == "ERROR",
        "status": span.status.description or "",
        "attributes": dict(span.attributes or {}),
        "events": [{"name": event.name, "time_ns": event.timestamp} for event in span.events],
    }
