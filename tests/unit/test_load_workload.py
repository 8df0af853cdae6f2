"""`agentgw load`'s schedules: Poisson arrivals, exact message sizes, and replay from both trace formats."""

from __future__ import annotations

import json
import statistics

import pytest

from agentgw.load.workload import CHAT_SPAN, TurnSpec, message_text, replay, synthetic

pytestmark = pytest.mark.unit


def test_synthetic_arrivals_are_poisson_at_the_rate_and_spread_over_sessions_and_tenants():
    turns = synthetic(rate=20, duration_s=60, tenants=["a", "b"], sessions_per_tenant=4, retrieval_share=0.25,
                      max_tokens=8, seed=3)
    gaps = [b.at_s - a.at_s for a, b in zip(turns, turns[1:])]
    assert 0.9 / 20 < statistics.mean(gaps) < 1.1 / 20  # exponential gaps of mean 1/rate
    assert statistics.median(gaps) < statistics.mean(gaps)  # skewed, as exponential gaps are
    assert {t.tenant for t in turns} == {"a", "b"} and {t.session for t in turns} == {0, 1, 2, 3}
    assert 0.2 < sum(t.retrieval for t in turns) / len(turns) < 0.3


@pytest.mark.parametrize("chars", [1, 7, 64, 1000])
def test_made_up_messages_have_exactly_the_recorded_size(chars):
    assert len(message_text(chars, seed=chars)) == chars


def _otlp_span(start_ns: int, attributes: dict) -> dict:
    values = []
    for key, value in attributes.items():
        kind = "boolValue" if isinstance(value, bool) else "intValue" if isinstance(value, int) else "stringValue"
        values.append({"key": key, "value": {kind: str(value) if kind == "intValue" else value}})
    return {"name": CHAT_SPAN, "startTimeUnixNano": str(start_ns), "attributes": values}


def test_replay_reads_an_otlp_json_export_and_a_collector_file_alike(tmp_path):
    shapes = [(0, {"agw.turn.message_chars": 40, "agw.turn.retrieval": True, "agw.turn.max_tokens": 16,
                   "agw.turn.session_key": "s1"}),
              (250_000_000, {"agw.turn.message_chars": 12, "agw.turn.retrieval": False, "agw.turn.max_tokens": 4,
                             "agw.turn.session_key": ""}),
              (1_000_000_000, {"agw.turn.message_chars": 90, "agw.turn.retrieval": True, "agw.turn.max_tokens": 8,
                               "agw.turn.session_key": "s1"})]
    document = {"resourceSpans": [{"scopeSpans": [{"spans": [
        _otlp_span(1_700_000_000_000_000_000 + at, attributes) for at, attributes in shapes]}]}]}
    export = tmp_path / "export.json"
    export.write_text(json.dumps(document))
    lines = tmp_path / "collector.jsonl"
    lines.write_text("\n".join(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})
                               for span in document["resourceSpans"][0]["scopeSpans"][0]["spans"]))
    for path in (export, lines):
        turns = replay(path, time_scale=2.0)
        assert [round(t.at_s, 3) for t in turns] == [0.0, 0.5, 2.0]
        assert [(t.message_chars, t.retrieval, t.max_tokens) for t in turns] == [(40, True, 16), (12, False, 4),
                                                                                  (90, True, 8)]
        assert turns[0].session == turns[2].session is not None and turns[1].session is None


def test_a_trace_without_chat_turns_is_refused_with_the_reason(tmp_path):
    empty = tmp_path / "traces.jsonl"
    empty.write_text(json.dumps({"name": "other", "start_ns": 1, "attributes": {}}) + "\n")
    with pytest.raises(ValueError, match="no agent.gateway.v1.AgentGateway/Chat spans"):
        replay(empty)


def test_error_messages_count_equal_causes_together_whatever_their_error_ids():
    from agentgw.load.report import error_messages
    from agentgw.load.runner import TurnResult

    spec = TurnSpec(at_s=0.0, tenant="dev", session=None, message_chars=10, retrieval=False, max_tokens=2)
    results = [TurnResult(spec, 0.0, 0.0, status="UNAVAILABLE", detail=f"inference is not serving (error id {i:016x})")
               for i in range(3)]
    results += [TurnResult(spec, 0.0, 0.0, status="RESOURCE_EXHAUSTED", detail="too many calls"),
                TurnResult(spec, 0.0, 0.0)]
    assert error_messages(results) == {"UNAVAILABLE: inference is not serving": 3,
                                       "RESOURCE_EXHAUSTED: too many calls": 1}
