"""`agentgw load` against a real gateway (scripted inference, real retrieval, Postgres) on loopback mTLS.

Open loop keeps its schedule and counts from it; a run's Chat spans, written as
the gateway's trace file, replay with the same gaps, retrieval share and
sizes; the CLI writes its JSON and plot and exits 1 on a missed SLO, 0 on a
met one.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from argparse import Namespace

import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agentgw.connection import Connection
from agentgw.load import run
from agentgw.load.report import summarize, text_report
from agentgw.load.slo import Slo
from agentgw.load.workload import CHAT_SPAN, TurnSpec, replay, synthetic
from servicekit.tracefile import JsonLinesSpanExporter
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import passage_documents, retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, pki, database_url):
    # A wide history budget: these tests are about the load tool, and the stack shares one event loop (and, in CI,
    # two busy cores) with it; a CI run once saw one turn's history pass the default 1 s.
    async with retrieval_server(tmp_path_factory.mktemp("load-retrieval"), pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, _), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           history_budget_s=10.0) as (gateway, _):
        from retrieval.ingest import sample_corpus

        async with gateway_stub(gateway.port, pki.root) as stub:
            await stub.IngestDocuments(pb.IngestDocumentsRequest(
                collection="docs", documents=passage_documents(sample_corpus(max_per_topic=1)[:10])), timeout=60)
        yield Connection(gateway=f"127.0.0.1:{gateway.port}", tls_dir=str(pki.root), identity="dev")


def _args(**overrides) -> Namespace:
    return Namespace(**{"concurrency": None, "think_time": 0.0, "collection": "docs", "timeout": 20.0, **overrides})


def _offsets(times: list[float]) -> list[float]:
    """Arrival times, in order, from the first."""
    ordered = sorted(times)
    return [t - ordered[0] for t in ordered]


async def test_an_open_loop_run_replays_from_its_own_trace_with_the_same_gaps_and_shapes(stack, recorded_spans,
                                                                                         tmp_path):
    # A gentle rate: the stack shares this event loop with the load tool, whose sends its work could delay.
    turns = synthetic(rate=8, duration_s=3.0, tenants=["dev"], sessions_per_tenant=4, retrieval_share=0.5,
                      max_tokens=4, seed=7)
    recorded_spans.clear()
    results, _elapsed = await run(stack, _args(), turns, ["dev"])
    summary = summarize(results, _elapsed)
    assert summary["statuses"] == {"OK": len(turns)} and summary["first_token_ms"]["p50"] > 0
    assert summary["stages_ms"]["history"] and summary["stages_ms"]["retrieval"]

    # The gateway's trace file, as AGW_TRACE_FILE writes it, from this run's spans.
    chat_spans = [s for s in recorded_spans.get_finished_spans() if s.name == CHAT_SPAN]
    assert len(chat_spans) == len(turns)
    trace_file = tmp_path / "traces.jsonl"
    JsonLinesSpanExporter(trace_file).export(recorded_spans.get_finished_spans())
    replayed = replay(trace_file)
    from collections import Counter
    got = Counter((t.message_chars, t.retrieval, t.max_tokens) for t in replayed)
    want = Counter((t.message_chars, t.retrieval, t.max_tokens) for t in turns)
    assert got == want, (got - want, want - got)
    assert len({t.session for t in replayed}) == len({t.session for t in turns})

    # The replay's schedule is the recorded arrivals' gaps, exactly.
    recorded = _offsets([s.start_time / 1e9 for s in chat_spans])
    assert _offsets([t.at_s for t in replayed]) == pytest.approx(recorded, abs=1e-6)

    recorded_spans.clear()
    again, again_elapsed = await run(stack, _args(), replayed, ["dev"])
    assert summarize(again, again_elapsed)["statuses"] == {"OK": len(replayed)}
    # And the runner kept it: turn by turn, each arrives at the gateway where its recorded one did, measured at the
    # same point both times. The median, not the worst: the stack shares this event loop, and a CI run saw single
    # sends move 50 ms under load. 5-12 ms on an idle machine; a replay that lost the schedule (sent at once, or
    # scaled) is off by hundreds of ms, against gaps of 125 ms on average.
    arrived = _offsets([s.start_time / 1e9 for s in recorded_spans.get_finished_spans() if s.name == CHAT_SPAN])
    drift_ms = statistics.median(abs(a - b) * 1000 for a, b in zip(arrived, recorded, strict=True))
    assert drift_ms <= 50, f"replayed turns arrived {drift_ms:.1f} ms (median) off their recorded times"


async def test_slos_hold_or_fail_on_the_measured_figures():
    summary = {"turns": 10, "errors": 1, "first_token_ms": {"p99": 120.0}, "total_ms": {"p50": 900.0}}
    assert Slo.parse("first_token_p99=1ms").check(summary)[0] is False
    assert Slo.parse("first_token_p99=10s").check(summary)[0] is True
    assert Slo.parse("total_p50=0.5s").check(summary) == (False, "total_p50=0.5s: measured 900.0 ms")
    assert Slo.parse("errors=0").check(summary)[0] is False and Slo.parse("error_rate=10%").check(summary)[0]
    with pytest.raises(ValueError, match="use first_token_p99=800ms"):
        Slo.parse("latency<1s")


async def _cli(stack, tmp_path, *slos: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentgw.cli", "load", "--target", stack.gateway, "--tls-dir", stack.tls_dir,
        "--rate", "10", "--duration", "1.5", "--max-tokens", "3", "--json", str(tmp_path / "run.json"),
        "--plot", str(tmp_path / "run.png"), *(part for slo in slos for part in ("--slo", slo)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await process.communicate()  # the loop keeps serving the in-process stack meanwhile
    return process.returncode, out.decode()


async def test_the_cli_reports_writes_json_and_a_plot_and_gates_on_slos(stack, tmp_path):
    code, out = await _cli(stack, tmp_path, "first_token_p99=1ms")
    assert code == 1, out
    assert "first token" in out and "FAIL  slo first_token_p99=1ms" in out
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["summary"]["turns"] == len(data["turns"]) > 0 and data["meta"]["mode"] == "open"
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out = await _cli(stack, tmp_path, "first_token_p99=60s", "errors=0")
    assert code == 0, out


async def test_a_failed_turn_reports_the_gateways_message(stack):
    # Past AGW_GATEWAY_MAX_MESSAGE_CHARS: refused by the real gateway, and the run says why, not only the code.
    turns = [TurnSpec(at_s=0.0, tenant="dev", session=None, message_chars=10**6, retrieval=False, max_tokens=2)]
    results, elapsed = await run(stack, _args(), turns, ["dev"])
    summary = summarize(results, elapsed)
    assert summary["statuses"] == {"INVALID_ARGUMENT": 1}
    ((message, count),) = summary["error_messages"].items()
    assert count == 1 and message.startswith("INVALID_ARGUMENT: ") and "message" in message, message
    assert message.removeprefix("INVALID_ARGUMENT: ") == results[0].detail
    assert message in text_report(summary)
