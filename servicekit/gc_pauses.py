"""The garbage collector's pauses, as a metric: each collection stops the event loop for as long as it runs.

CPython collects when allocations outrun frees, inside whatever code
allocated: in a service that is some call's handler, so every call the event
loop holds waits with it. Young collections take microseconds; a full one
walks every tracked object, which before ``gc.freeze`` (servicekit.server)
was about 300 ms in the inference service. This histogram shows how often
each generation runs and how long the loop stopped, so a p99 that moves can
be checked against it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from opentelemetry import metrics

from servicekit.metrics import meter


class GcPauses:
    """While entered, records every collection's duration in ``agw.process.gc_pause`` (ms, by generation).

    A context manager, so the callback is removed when the service stops (a
    test process runs many services, one after another).
    """

    def __init__(self, service: str, *, meter_: metrics.Meter | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._histogram = (meter_ or meter("servicekit")).create_histogram(
            "agw.process.gc_pause", unit="ms",
            description="How long each garbage collection stopped this process's event loop, by generation "
                        "(2 is a full collection).")
        self._attributes = {generation: {"service": service, "generation": str(generation)} for generation in range(3)}
        self._clock = clock
        self._started = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self._clock()
        else:
            self._histogram.record((self._clock() - self._started) * 1000, self._attributes[info["generation"]])

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc_info) -> None:
        gc.callbacks.remove(self._on_gc)
