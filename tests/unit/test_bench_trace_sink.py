"""The benches' trace sink (bench/trace_sink.py) and their ``--export-traces``: real processes, real exporters.

A child process sets tracing up as our services do (``configure_tracing``)
with the environment the sink gives, and records spans; the sink counts
what arrives. The ratio's environment is checked the same way: a ratio too
small to keep any of the child's traces leaves nothing to export.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from tests.support.bench import import_bench

#: A service's tracing as our services set it up, then ``spans`` root spans, flushed at shutdown.
_TRACED = """
import sys
from opentelemetry import trace
from servicekit.telemetry import configure_tracing
provider = configure_tracing("bench-sink-test")
tracer = trace.get_tracer("test")
for n in range(int(sys.argv[1])):
    with tracer.start_as_current_span(f"turn-{n}"):
        pass
provider.shutdown()
"""


@pytest.fixture(scope="module")
def harness():
    return import_bench("harness")


def _traced(environment: dict[str, str], spans: int) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", _TRACED, str(spans)], env={**env, **environment},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_spans_a_service_exports_with_the_sinks_environment_are_counted(harness):
    with harness.trace_sink() as sink:
        _traced(sink.environment(), spans=40)
    assert sink.counts["exports"] >= 1
    # Each span carries at least its 16-byte trace id, 8-byte span id and its name.
    assert sink.counts["bytes"] > 40 * 30, sink.counts
    assert sink.counts["cpu_s"] >= 0


def test_a_ratio_is_handed_to_opentelemetrys_sampler(harness):
    with harness.trace_sink(1e-12) as sink:  # no trace id falls under it, in practice
        environment = sink.environment()
        assert environment["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        _traced(environment, spans=40)
    assert sink.counts["exports"] == 0, sink.counts
    assert "OTEL_TRACES_SAMPLER" not in harness.TraceSink(port=1, ratio=1.0).environment()


@pytest.mark.parametrize("text, ratio", [("all", 1.0), ("0.1", 0.1), ("1", 1.0)])
def test_export_traces_takes_all_or_a_ratio(harness, text, ratio):
    assert harness.export_ratio(text) == ratio


@pytest.mark.parametrize("text", ["0", "1.5", "-0.1", "some", ""])
def test_export_traces_refuses_what_is_not_a_ratio_and_says_what_to_give(harness, text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"`all` or a ratio of traces in \(0, 1\]"):
        harness.export_ratio(text)


def test_no_export_means_no_sink_and_no_environment(harness):
    with harness.exporting(None) as sink:
        assert sink is None
        assert harness.export_environment(sink) == {}
    assert harness.report_export(None) == {"ratio": None}
