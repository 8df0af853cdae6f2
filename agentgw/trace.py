"""``agentgw trace``: a turn's spans from the local span file, as a waterfall in the terminal.

The services append their spans to ``AGW_TRACE_FILE`` (``servicekit.tracefile``);
this reads them back, one trace at a time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


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
