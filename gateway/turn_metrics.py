"""What each Chat turn records in metrics: the first token, each stage, and why a turn was degraded."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from servicekit.metrics import meter

_METER = meter("gateway")
_FIRST_TOKEN = _METER.create_histogram(
    "agw.chat.first_token", unit="ms", description="Time from the Chat call to its first token.")
_STAGE = _METER.create_histogram(
    "agw.chat.stage.duration", unit="ms", description="Chat stage latencies (admission, history, retrieval, "
    "generation, persist, total), by stage.")
_DEGRADED = _METER.create_counter("agw.chat.degraded", description="Turns answered degraded, by cause.")
_TOOL_CALLS = _METER.create_counter("agw.chat.tool_calls", description="Tool calls the model made in Chat turns.")
_CONSTRAINED = _METER.create_counter(
    "agw.chat.constrained", description="Turns decoded under a structured-output constraint, by backend and "
    "whether the inference service had it compiled (cache_hit).")
STAGES = ("admission", "history", "retrieval", "generation", "persist", "total")


class DegradedCause(enum.Enum):
    """Why a turn ran without something it asked for: what the client is told, and the metric's label."""

    RETRIEVAL_TIMED_OUT = ("no context: retrieval timed out", "retrieval")
    RETRIEVAL_UNAVAILABLE = ("no context: retrieval unavailable", "retrieval")
    HISTORY_OVER_BUDGET = ("history trimmed to AGW_GATEWAY_HISTORY_TOKEN_BUDGET (oldest messages left out)",
                           "history_trimmed")
    HISTORY_OVER_CONTEXT = ("history trimmed to fit the model's context (oldest messages left out)",
                            "history_trimmed")

    def __init__(self, reason: str, label: str) -> None:
        self.reason = reason
        self.label = label


def record_turn(timings, degraded: Iterable[DegradedCause], result=None) -> None:
    """``timings``: a turn's StageTimes (gateway.turn_types); ``result``: the inference GenerationResult."""
    if result is not None and result.tool_calls:
        _TOOL_CALLS.add(len(result.tool_calls))
    if result is not None and result.structured_output_backend:
        _CONSTRAINED.add(1, {"backend": result.structured_output_backend,
                             "cache_hit": str(result.constraint_cache_hit).lower()})
    if timings.first_token_ms:
        _FIRST_TOKEN.record(timings.first_token_ms)
    for stage in STAGES:
        _STAGE.record(getattr(timings, f"{stage}_ms"), {"stage": stage})
    for cause in degraded:
        _DEGRADED.add(1, {"cause": cause.label})
