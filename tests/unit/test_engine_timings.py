"""A request's engine timings, from vLLM's own per-request stats."""

from __future__ import annotations

import time

import pytest
from vllm.v1.metrics.stats import RequestStateStats

from inference.engine import engine_timings

pytestmark = pytest.mark.unit


def _stats(*, arrived_s_ago: float, queued_s_ago: float, scheduled_s_ago: float, first_token_s_ago: float,
           last_token_s_ago: float) -> RequestStateStats:
    """Stats as vLLM stamps them: the arrival on the front end's wall clock, the rest on the engine core's
    monotonic clock, the first token's latency on the wall clock again."""
    wall, mono = time.time(), time.monotonic()
    return RequestStateStats(arrival_time=wall - arrived_s_ago, queued_ts=mono - queued_s_ago,
                             scheduled_ts=mono - scheduled_s_ago, first_token_ts=mono - first_token_s_ago,
                             last_token_ts=mono - last_token_s_ago,
                             first_token_latency=arrived_s_ago - first_token_s_ago + 0.001)


def test_queue_counts_the_wait_for_the_step_in_progress():
    # Arrived 100 ms ago; the engine core took it in 60 ms ago (a step was
    # running) and scheduled it 2 ms after that.
    stats = _stats(arrived_s_ago=0.100, queued_s_ago=0.060, scheduled_s_ago=0.058, first_token_s_ago=0.020,
                   last_token_s_ago=0.005)
    timings = engine_timings(stats, started=time.perf_counter() - 0.110)
    assert timings.queue_ms == pytest.approx(42.0, abs=1.0)  # not vLLM's own 2 ms
    assert timings.first_token_ms == pytest.approx(81.0)
    assert timings.decode_ms == pytest.approx(15.0, abs=0.01)
    assert timings.queue_ms < timings.first_token_ms < timings.total_ms


def test_a_request_never_scheduled_has_no_queue_time():
    stats = _stats(arrived_s_ago=0.010, queued_s_ago=0.009, scheduled_s_ago=0.0, first_token_s_ago=0.0,
                   last_token_s_ago=0.0)
    stats.scheduled_ts = stats.first_token_ts = stats.last_token_ts = 0.0
    timings = engine_timings(stats, started=time.perf_counter())
    assert (timings.queue_ms, timings.decode_ms) == (0.0, 0.0)


def test_without_stats_only_the_total_is_known():
    timings = engine_timings(None, started=time.perf_counter() - 0.005)
    assert (timings.queue_ms, timings.first_token_ms, timings.decode_ms) == (0.0, 0.0, 0.0)
    assert timings.total_ms >= 5.0
