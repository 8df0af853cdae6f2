"""The garbage collector's pauses reach the metric, by generation, only while the watch is entered."""

from __future__ import annotations

import gc

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from servicekit.gc_pauses import GcPauses

pytestmark = pytest.mark.unit


def _pauses(reader: InMemoryMetricReader) -> dict[str, tuple[int, float]]:
    """(count, sum in ms) of agw.process.gc_pause, by generation."""
    data = reader.get_metrics_data()
    found = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "agw.process.gc_pause":
                    for point in metric.data.data_points:
                        found[point.attributes["generation"]] = (point.count, point.sum)
    return found


@pytest.fixture(autouse=True)
def only_explicit_collections():
    """Automatic collections off, so the test's own gc.collect calls are the only ones the watch sees."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_each_collection_is_recorded_with_its_generation_and_duration():
    reader = InMemoryMetricReader()
    ticks = iter([10.0, 10.25, 20.0, 20.5])  # two collections: 250 ms, then 500 ms
    with GcPauses("test", meter_=MeterProvider(metric_readers=[reader]).get_meter("t"), clock=lambda: next(ticks)):
        gc.collect(2)
        gc.collect(0)
    assert _pauses(reader) == {"2": (1, 250.0), "0": (1, 500.0)}


def test_nothing_is_recorded_once_the_watch_has_exited():
    reader = InMemoryMetricReader()
    with GcPauses("test", meter_=MeterProvider(metric_readers=[reader]).get_meter("t")) as watch:
        gc.collect(1)
    gc.collect(1)
    gc.collect(2)
    [(generation, (count, _ms))] = _pauses(reader).items()
    assert (generation, count) == ("1", 1)
    assert watch._on_gc not in gc.callbacks
