"""What a load run found: percentiles, stages, status counts, thresholds (SLOs), JSON and a plot."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from agentgw.load.runner import TurnResult, late_sends
from servicekit.errors import without_error_id

PERCENTILES = (50, 95, 99)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    array = np.asarray(values, dtype=float)
    return {**{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}, "max": float(array.max()),
            "n": len(values)}


def summarize(results: list[TurnResult], elapsed_s: float) -> dict:
    """The run's figures: first token and total (OK turns), each stage, statuses, and the runner's own lateness."""
    ok = [r for r in results if r.status == "OK"]
    stages = sorted({name for r in ok for name in r.stages})
    late, worst_lag = late_sends(results)
    return {
        "turns": len(results), "elapsed_s": elapsed_s, "rate_per_s": len(results) / elapsed_s if elapsed_s else 0.0,
        "statuses": dict(Counter(r.status for r in results)),
        "errors": len(results) - len(ok),
        "error_messages": error_messages(results),
        "first_token_ms": _stats([r.first_token_ms for r in ok if r.first_token_ms is not None]),
        "total_ms": _stats([r.total_ms for r in ok if r.total_ms is not None]),
        "stages_ms": {name: _stats([r.stages[name] for r in ok if name in r.stages]) for name in stages},
        "late_sends": late, "worst_send_lag_ms": worst_lag,
    }


def error_messages(results: list[TurnResult], most: int = 5) -> dict[str, int]:
    """The failed turns' most common ``STATUS: message`` lines, so that a run says why turns failed
    (error ids left out, so that equal causes count together)."""
    counts = Counter(f"{r.status}: {without_error_id(r.detail)}" for r in results if r.status != "OK")
    return dict(counts.most_common(most))


def text_report(summary: dict) -> str:
    lines = [f"{summary['turns']} turns in {summary['elapsed_s']:.1f} s ({summary['rate_per_s']:.2f}/s); statuses: "
             + ", ".join(f"{code} {count}" for code, count in sorted(summary["statuses"].items()))]
    lines += [f"  {count} x {message}" for message, count in summary["error_messages"].items()]
    lines.append(f"{'ms':<16}" + "".join(f"{k:>10}" for k in ("p50", "p95", "p99", "max")))
    rows = [("first token", summary["first_token_ms"]), ("total", summary["total_ms"])]
    rows += [(f"  {name}", stats) for name, stats in summary["stages_ms"].items()]
    for name, stats in rows:
        if stats:
            lines.append(f"{name:<16}" + "".join(f"{stats[k]:>10.1f}" for k in ("p50", "p95", "p99", "max")))
    if summary["late_sends"]:
        lines.append(f"the load tool fell behind its schedule: {summary['late_sends']} turns sent late, worst by "
                     f"{summary['worst_send_lag_ms']:.0f} ms (their latency still counts from the scheduled time)")
    return "\n".join(lines)


def write_json(path: Path, summary: dict, results: list[TurnResult], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "summary": summary, "turns": [r.to_json() for r in results]},
                               indent=1))


def write_plot(path: Path, results: list[TurnResult], title: str) -> None:
    """Latency over the run (by scheduled time) and its CDF, first token and total, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "OK" and r.total_ms is not None]
    failed = [r for r in results if r.status != "OK"]
    figure, (over_time, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, values in (("first token", [r.first_token_ms for r in ok]), ("total", [r.total_ms for r in ok])):
        points = [(r.scheduled_s, v) for r, v in zip(ok, values) if v is not None]
        if points:
            over_time.scatter(*zip(*points), s=8, label=label)
            ordered = np.sort([v for _, v in points])
            cdf.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)
    if failed:
        over_time.scatter([r.scheduled_s for r in failed], [r.total_ms or 0 for r in failed], s=12, marker="x",
                          color="red", label=f"failed ({len(failed)})")
    over_time.set(xlabel="scheduled send (s)", ylabel="latency (ms)", title="latency over the run")
    cdf.set(xlabel="latency (ms)", ylabel="share of turns", title="CDF", xscale="log")
    for axis in (over_time, cdf):
        axis.legend()
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
