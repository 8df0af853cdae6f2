"""The garbage collector's pauses reach the metrics, by generation, only while the watch is entered,
and never lock anything from inside a collection."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from servicekit.gc_pauses import GcPauses

pytestmark = pytest.mark.unit


@pytest.fixture
def only_explicit_collections():
    """Automatic collections off, so the test's own gc.collect calls are the only ones the watch sees."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _points(reader: InMemoryMetricReader, name: str) -> dict[str, float]:
    """``name``'s values by generation, as a scrape reads them."""
    data = reader.get_metrics_data()
    return {point.attributes["generation"]: point.value
            for resource in data.resource_metrics for scope in resource.scope_metrics
            for metric in scope.metrics if metric.name == name for point in metric.data.data_points}


def _watch(reader: InMemoryMetricReader, **options) -> GcPauses:
    return GcPauses("test", meter_=MeterProvider(metric_readers=[reader]).get_meter("t"), **options)


def test_each_collection_is_counted_with_its_generation_and_pause(only_explicit_collections):
    reader = InMemoryMetricReader()
    ticks = iter([10.0, 10.25, 20.0, 20.5, 30.0, 30.125])  # pauses of 250, 500 and 125 ms
    with _watch(reader, clock=lambda: next(ticks)):
        gc.collect(2)
        gc.collect(0)
        gc.collect(2)
    assert _points(reader, "agw.process.gc_collections") == {"0": 1, "1": 0, "2": 2}
    assert _points(reader, "agw.process.gc_pause") == {"0": 0.5, "1": 0.0, "2": 0.375}
    assert _points(reader, "agw.process.gc_longest_pause") == {"0": 0.5, "1": 0.0, "2": 0.25}


def test_nothing_is_counted_once_the_watch_has_exited(only_explicit_collections):
    reader = InMemoryMetricReader()
    with _watch(reader) as watch:
        gc.collect(1)
    gc.collect(1)
    gc.collect(2)
    assert _points(reader, "agw.process.gc_collections") == {"0": 0, "1": 1, "2": 0}
    assert watch._on_gc not in gc.callbacks


def test_a_scrape_keeps_going_when_collections_fire_inside_the_metrics_sdk():
    """Recording into an instrument from the collector's callback deadlocked a scrape (a CI run's /metrics timed
    out): a collection triggered inside the SDK's locked section called back into it. With a collection on
    nearly every allocation, a scrape must still finish while another thread records."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    histogram = provider.get_meter("t").create_histogram("busy")
    stop, scrapes = threading.Event(), []

    def record() -> None:
        while not stop.is_set():
            histogram.record(1, {"n": str(len(scrapes) % 5)})

    def scrape() -> None:
        while not stop.is_set():
            reader.get_metrics_data()
            scrapes.append(1)

    thresholds = gc.get_threshold()
    with GcPauses("test", meter_=provider.get_meter("t")):
        gc.set_threshold(1, 1, 1)
        try:
            threads = [threading.Thread(target=f, daemon=True) for f in (record, scrape)]
            for thread in threads:
                thread.start()
            time.sleep(1.0)
            before = len(scrapes)
            time.sleep(2.0)
            after = len(scrapes)
        finally:
            gc.set_threshold(*thresholds)
            stop.set()
    assert after > before, f"no scrape finished in 2 s ({before} before): the collector callback deadlocked one"
