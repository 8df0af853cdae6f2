"""bench/load_goals.py's rules: each goal judged on the median of the runs, with the issue's limits.

The inputs are shaped as `chat_turn.py --json` and `gateway_overhead.py --json`
write them (only the keys the judge reads); the benches themselves run by
hand, and `tests/unit/test_bench_scripts.py` checks that they start.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.bench import BENCH, import_bench


@pytest.fixture(scope="module")
def goals():
    return import_bench("load_goals")


def chat_run(share_c8: float, chat_p99: float, direct_p99: float, paired_c8: float = 1.0) -> dict:
    return {"command": "python bench/chat_turn.py", "stats": {
        "8": {"gateway_share_p50": share_c8, "paired_share": {"p50": paired_c8},
              "gateway_ttft": {"p99": 100.0}, "direct_ttft": {"p99": 90.0}},
        "32": {"gateway_share_p50": 30.0, "gateway_ttft": {"p99": chat_p99}, "direct_ttft": {"p99": direct_p99}}}}


def overhead_run(*, edge_c1: float = 1.30, envoy_c1: float = 1.25, edge_u64_rps: float = 900.0,
                 edge_s64_rps: float = 170.0, edge_s64_p50: float = 320.0, envoy_s64_p50: float = 310.0,
                 edge_cpu_s: float = 0.2, inference_cpu_s: float = 0.8) -> dict:
    def row(kind, c, path, p50, throughput, cpu=None, tokens=0):
        return {"workers": 1, "kind": kind, "concurrency": c, "path": path, "p50": p50, "throughput": throughput,
                "tokens": tokens, "calls": 60, "cpu_s": cpu or {}}
    return {"command": "python bench/gateway_overhead.py", "rows": [
        row("unary", 1, "direct", 1.00, 950.0), row("unary", 1, "envoy", envoy_c1, 700.0),
        row("unary", 1, "edge", edge_c1, 690.0), row("unary", 1, "gateway", 1.90, 480.0),
        row("unary", 64, "direct", 50.0, 1000.0), row("unary", 64, "envoy", 48.0, 1050.0),
        row("unary", 64, "edge", 52.0, edge_u64_rps),
        row("stream", 64, "direct", 300.0, 200.0), row("stream", 64, "envoy", envoy_s64_p50, 190.0),
        row("stream", 64, "edge", edge_s64_p50, edge_s64_rps,
            {"edge": edge_cpu_s, "inference": inference_cpu_s}, tokens=1920),
        # Another worker count in the same file is not mixed in.
        {**row("unary", 1, "edge", 99.0, 1.0), "workers": 2},
    ]}


def by_goal(verdicts, words: str):
    (found,) = [v for v in verdicts if words in v.goal]
    return found


def test_the_chat_goals_are_judged_on_the_median_not_the_best_or_worst_run(goals):
    verdicts = goals.chat_verdicts([chat_run(2.0, 150.0, 100.0), chat_run(9.0, 250.0, 100.0),
                                    chat_run(5.0, 190.0, 100.0)])
    share = by_goal(verdicts, "share at c=8, p50 form")
    assert share.runs == (2.0, 9.0, 5.0) and share.median == 5.0 and share.limit == 4.0
    assert not share.met and share.margin == pytest.approx(-1.0) and share.runs_within == 1
    ratio = by_goal(verdicts, "p99")
    assert ratio.median == pytest.approx(1.9) and ratio.met and ratio.runs_within == 2


def test_the_share_is_also_judged_in_its_sum_form_and_paired(goals):
    def with_sum_form(run, sum_form):
        run["stats"]["8"]["gateway_share_sum_form"] = sum_form
        return run

    verdicts = goals.chat_verdicts([with_sum_form(chat_run(9.0, 150.0, 100.0, paired_c8=4.5), 2.0),
                                    with_sum_form(chat_run(12.0, 150.0, 100.0, paired_c8=1.0), 5.0),
                                    with_sum_form(chat_run(8.0, 150.0, 100.0, paired_c8=6.0), 3.0)])
    assert by_goal(verdicts, "p50 form").median == 9.0 and not by_goal(verdicts, "p50 form").met
    sum_form = by_goal(verdicts, "sum form")
    assert sum_form.median == 3.0 and sum_form.met and sum_form.runs_within == 2
    paired = by_goal(verdicts, "paired p50")
    assert paired.runs == (4.5, 1.0, 6.0) and paired.median == 4.5 and not paired.met and paired.runs_within == 1
    # Runs made before the sum form existed are judged on the p50 form alone.
    assert not [v for v in goals.chat_verdicts([chat_run(9.0, 150.0, 100.0)] * 3) if "sum form" in v.goal]


def test_the_unary_goal_compares_each_run_with_envoy_in_the_same_run(goals):
    # The edge adds 0.05 ms more than Envoy in two runs of three: missed, by the median difference.
    verdicts = goals.overhead_verdicts([overhead_run(edge_c1=1.35, envoy_c1=1.30),
                                        overhead_run(edge_c1=1.20, envoy_c1=1.28),
                                        overhead_run(edge_c1=1.40, envoy_c1=1.35)])
    unary = by_goal(verdicts, "unary c=1")
    assert unary.median == pytest.approx(0.05) and not unary.met and unary.runs_within == 1


def test_throughput_goals_need_eighty_percent_of_direct(goals):
    verdicts = goals.overhead_verdicts([overhead_run(edge_u64_rps=790.0, edge_s64_rps=170.0)] * 3)
    assert not by_goal(verdicts, "unary c=64").met
    assert by_goal(verdicts, "stream c=64: edge's throughput").met


@pytest.mark.parametrize(("envoy_added", "edge_added", "limit", "met"), [
    (10.0, 29.0, 30.0, True),    # 3x Envoy's
    (10.0, 31.0, 30.0, False),
    (-5.0, 9.0, 10.0, True),     # Envoy adds under 3 ms: at most 10 ms
    (-5.0, 11.0, 10.0, False),
])
def test_the_stream_latency_goal_is_three_times_envoys_or_ten_ms(goals, envoy_added, edge_added, limit, met):
    run = overhead_run(edge_s64_p50=300.0 + edge_added, envoy_s64_p50=300.0 + envoy_added)
    verdict = by_goal(goals.overhead_verdicts([run] * 3), "stream c=64: edge's added p50")
    assert verdict.limit == pytest.approx(limit) and verdict.met is met


def test_cpu_per_token_is_against_the_inference_process_own(goals):
    verdicts = goals.overhead_verdicts([overhead_run(edge_cpu_s=0.9, inference_cpu_s=0.8)] * 3)
    cpu = by_goal(verdicts, "CPU per token")
    assert cpu.median == pytest.approx(0.9 / 0.8) and not cpu.met


def test_a_run_without_the_measured_levels_is_refused_with_the_command_to_use(goals):
    with pytest.raises(ValueError, match="without c=32.*chat_turn.py --turns 256 --concurrency 8 32"):
        goals.chat_verdicts([{"command": "x", "stats": {"8": {}}}])
    without_edge = overhead_run()
    without_edge["rows"] = [r for r in without_edge["rows"] if r["path"] != "edge"]
    with pytest.raises(ValueError, match="'edge'.*--edge"):
        goals.overhead_verdicts([without_edge])


def test_judging_files_prints_the_table_and_exits_1_when_a_goal_is_missed(goals, tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(__import__("json").dumps(chat_run(6.0, 150.0, 100.0)))
    done = subprocess.run([sys.executable, "load_goals.py", "--chat", str(chat)], cwd=BENCH, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "MISSED by 2.00 ms" in done.stdout and "met by 0.50x" in done.stdout


def test_export_traces_with_runs_already_made_is_refused_with_the_reason(tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(__import__("json").dumps(chat_run(6.0, 150.0, 100.0)))
    done = subprocess.run([sys.executable, "load_goals.py", "--chat", str(chat), "--export-traces", "all"],
                          cwd=BENCH, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--export-traces sets how this command runs the benches" in done.stderr


def test_with_rounds_a_path_is_judged_on_the_median_of_its_paired_round_differences(goals):
    # The pooled p50s say the edge adds 0.10 ms over Envoy; round by round it was faster in 2 rounds of 3.
    run = overhead_run(edge_c1=1.40, envoy_c1=1.30)
    for row in run["rows"]:
        if (row["kind"], row["concurrency"], row["workers"]) == ("unary", 1, 1):
            row["round_p50"] = {"direct": [1.0, 1.0, 1.0], "envoy": [1.3, 1.6, 1.2],
                                "edge": [1.25, 1.7, 1.1], "gateway": [1.9, 1.9, 1.9]}[row["path"]]
    unary = by_goal(goals.overhead_verdicts([run] * 3), "unary c=1")
    assert unary.median == pytest.approx(-0.05) and unary.met


def test_added_p50_pairs_rounds_only_where_both_paths_ran_the_same_rounds():
    harness = import_bench("harness")
    base = {"p50": 10.0, "round_p50": [10.0, 30.0, 11.0]}
    assert harness.added_p50({"p50": 12.0, "round_p50": [11.0, 31.0, 14.0]}, base) == pytest.approx(1.0)
    # One round, rows from before rounds, or rounds that do not match: the difference of the p50s.
    assert harness.added_p50({"p50": 12.0, "round_p50": [12.0]}, {"p50": 10.0, "round_p50": [10.0]}) == 2.0
    assert harness.added_p50({"p50": 12.0}, base) == 2.0
    assert harness.added_p50({"p50": 12.0, "round_p50": [11.0, 31.0]}, base) == 2.0


def with_twin(run: dict, twin_c1: float) -> dict:
    """``run`` with gateway_overhead.py --edge's second plain Envoy at unary c=1 (since 2026-12-07)."""
    twin = {"workers": 1, "kind": "unary", "concurrency": 1, "path": "envoy-twin", "p50": twin_c1,
            "throughput": 700.0, "tokens": 0, "calls": 60, "cpu_s": {}}
    return {**run, "rows": [*run["rows"], twin]}


def test_the_c1_noise_floor_is_a_second_envoy_against_the_first_in_each_run(goals):
    runs = [with_twin(overhead_run(envoy_c1=1.25), 1.31), with_twin(overhead_run(envoy_c1=1.30), 1.22)]
    assert goals.noise_floor(runs) == pytest.approx([0.06, -0.08])
    # A run made before the twin existed: no floor, rather than one over fewer runs than the verdicts.
    assert goals.noise_floor([*runs, overhead_run()]) is None
    assert goals.against_twin(runs, "edge") == pytest.approx([1.30 - 1.31, 1.30 - 1.22])
    assert goals.against_twin([*runs, overhead_run()], "edge") is None


def test_judging_runs_with_the_twin_prints_the_floor_beside_the_verdicts(tmp_path):
    files = []
    for n, (edge, twin) in enumerate([(1.35, 1.20), (1.33, 1.32), (1.29, 1.34)]):
        path = tmp_path / f"overhead-{n}.json"
        path.write_text(__import__("json").dumps(with_twin(overhead_run(edge_c1=edge, envoy_c1=1.25), twin)))
        files.append(str(path))
    done = subprocess.run([sys.executable, "load_goals.py", "--overhead", *files], cwd=BENCH, capture_output=True,
                          text=True, timeout=60)
    assert "MISSED by 0.080 ms" in done.stdout, done.stdout + done.stderr
    assert "measured -0.050 ms, +0.070 ms, +0.090 ms (median +0.070 ms) against it" in done.stdout
    assert "a c=1 margin within ±0.090 ms is not resolved by these runs" in done.stdout
    # The edge against the second Envoy: its p50 less the twin's, each run.
    assert "the edge against that second Envoy: +0.150 ms, +0.010 ms, -0.050 ms (median +0.010 ms)" in done.stdout
