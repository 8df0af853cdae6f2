"""The tracer provider a service installs: spans recorded only when something takes them, trace ids always."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

#: Installs the provider as a service process does (once per process, hence a subprocess) and starts a span.
SCRIPT = """
import json, sys
from pathlib import Path
from opentelemetry import trace
from servicekit.telemetry import configure_tracing, spans_recorded
configure_tracing("test", trace_file=Path(sys.argv[1]) if sys.argv[1] else None)
span = trace.get_tracer("test").start_span("call")
child = trace.get_tracer("test").start_span("child", context=trace.set_span_in_context(span))
print(json.dumps([span.is_recording(), span.get_span_context().is_valid, spans_recorded(),
                  child.get_span_context() == span.get_span_context()]))
"""


def _span(trace_file: str) -> list[bool]:
    """[the span is recorded, it has a trace id, spans_recorded(), a span started under it is itself]"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, trace_file], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def test_without_a_collector_or_a_file_no_span_is_recorded_but_every_call_has_a_trace_id():
    # ... and instrumentation that would only build unsampled spans (asyncpg's, per query) can tell.
    # Nor a child span: one started under the call's span is that span (no new span id for no one to read).
    assert _span("") == [False, True, False, True]


def test_with_a_trace_file_spans_are_recorded(tmp_path):
    assert _span(str(tmp_path / "spans.jsonl")) == [True, True, True, False]
