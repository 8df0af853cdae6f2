"""Traces without Jaeger: spans appended to a local JSON-lines file, and a terminal waterfall.

Every process with ``AGW_TRACE_FILE`` set appends its finished spans to that
file (one JSON object per line, one ``write`` per batch on an ``O_APPEND``
file, so processes sharing it do not interleave lines). ``agentgw trace
TRACE_ID`` reads it back and prints the turn hop by hop. A convenience for a
laptop; Jaeger stays the tool for real deployments.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class FileSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    error: bool
    status: str
    attributes: dict
    events: list


def read_trace(path: Path, trace_id: str) -> list[FileSpan]:
    """The spans of one trace (a prefix of its id is enough), oldest first."""
    wanted = trace_id.strip().lower()
    spans = []
    with Path(path).open(encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            record = json.loads(line)
            if record["trace_id"].startswith(wanted):
                spans.append(FileSpan(**record))
    return sorted(spans, key=lambda s: s.start_ns)


def render_waterfall(spans: Sequence[FileSpan], width: int = 40) -> str:
    """One line per span, indented by depth, with offset, duration and a bar on a shared time axis."""
    if not spans:
        return "no spans"
    by_id = {s.span_id: s for s in spans}
    children: dict[str, list[FileSpan]] = {}
    roots = []
    for span in spans:
        if span.parent_span_id and span.parent_span_id in by_id:
            children.setdefault(span.parent_span_id, []).append(span)
        else:
            roots.append(span)
    start = min(s.start_ns for s in spans)
    end = max(s.end_ns for s in spans)
    total = max(end - start, 1)
    services = sorted({s.service for s in spans})
    lines = [f"trace {spans[0].trace_id}: {len(spans)} spans, {len(services)} services, {total / 1e6:.1f} ms",
             f"{'offset ms':>10} {'took ms':>9}  {'span':<58} timeline"]

    def walk(span: FileSpan, depth: int) -> None:
        offset, took = (span.start_ns - start) / 1e6, (span.end_ns - span.start_ns) / 1e6
        left = int((span.start_ns - start) / total * width)
        bar = " " * left + "#" * max(1, int((span.end_ns - span.start_ns) / total * width))
        service = span.service.removeprefix("agent-gateway-")
        label = f"{'  ' * depth}{span.name} [{service}]" + (" ERROR" if span.error else "")
        lines.append(f"{offset:10.2f} {took:9.2f}  {label[:58]:<58} |{bar:<{width}}|")
        for child in children.get(span.span_id, []):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return "\n".join(lines)
