"""The local span file and `agentgw trace`: spans from a real SDK provider, read back as a waterfall."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from agentgw import cli
from agentgw.trace import read_trace, render_waterfall
from servicekit.tracefile import JsonLinesSpanExporter

pytestmark = pytest.mark.unit


def _provider(path, service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    return provider


def _write_turn(path) -> str:
    gateway = _provider(path, "agent-gateway-gateway").get_tracer("t")
    inference = _provider(path, "agent-gateway-inference").get_tracer("t")
    with gateway.start_as_current_span("agent.gateway.v1.AgentGateway/Chat") as root:
        with gateway.start_as_current_span("history"):
            pass
        with gateway.start_as_current_span("generation"):
            # Another process's span, joined by context as over gRPC metadata.
            with inference.start_as_current_span("chat smoke") as generate:
                generate.set_status(Status(StatusCode.ERROR, "boom"))
        return format(root.get_span_context().trace_id, "032x")


def test_spans_from_two_processes_read_back_as_one_tree(tmp_path):
    path = tmp_path / "traces.jsonl"
    trace_id = _write_turn(path)
    _write_turn(path)  # another trace in the same file is left out

    spans = read_trace(path, trace_id[:12])
    assert [s.name for s in spans] == ["agent.gateway.v1.AgentGateway/Chat", "history", "generation", "chat smoke"]
    assert {s.service for s in spans} == {"agent-gateway-gateway", "agent-gateway-inference"}

    lines = render_waterfall(spans).splitlines()
    assert lines[0].startswith(f"trace {trace_id}: 4 spans, 2 services")
    body = lines[2:]
    assert body[0].split()[2] == "agent.gateway.v1.AgentGateway/Chat"
    # Indentation follows the parent links: the inference span sits under generation.
    generation = next(line for line in body if "generation [gateway]" in line)
    generate = next(line for line in body if "chat smoke [inference]" in line)
    assert generate.index("chat smoke") > generation.index("generation")
    assert "ERROR" in generate


def test_cli_prints_the_waterfall_or_says_what_is_missing(tmp_path, capsys):
    path = tmp_path / "traces.jsonl"
    assert cli.main(["trace", "0" * 32, "--file", str(path)]) == 2
    assert "no span file" in capsys.readouterr().err

    trace_id = _write_turn(path)
    assert cli.main(["trace", trace_id, "--file", str(path)]) == 0
    assert "chat smoke [inference]" in capsys.readouterr().out

    assert cli.main(["trace", "f" * 32, "--file", str(path)]) == 1
    assert "no spans of trace" in capsys.readouterr().err
