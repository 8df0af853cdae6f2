"""The garbage collector's pauses, as metrics: each collection stops the event loop for as long as it runs.

CPython collects when allocations outrun frees, inside whatever code
allocated: in a service that is some call's handler, so every call the event
loop holds waits with it. Young collections take microseconds; a full one
walks every tracked object, which before ``gc.freeze`` (servicekit.server)
was about 300 ms in the inference service. These metrics show how often each
generation runs and how long the process stopped, so a p99 that moves can be
checked against them.

The collector's callback runs inside whatever allocation triggered it, in
any thread, including inside the metrics SDK's own locked sections (a
scrape). Recording into an instrument from there deadlocked a scrape (a CI
run's /metrics timed out; tests/unit/test_gc_pauses.py reproduces it), so
the callback only adds to plain numbers, and the metrics read them when
scraped.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from opentelemetry import metrics

from servicekit.metrics import counter, gauge, meter

GENERATIONS = (0, 1, 2)


class GcPauses:
    """While entered, counts every collection and its pause by generation (2 is a full collection).

    Exported as ``agw.process.gc_collections`` and ``agw.process.gc_pause`` (seconds; counters) and
    ``agw.process.gc_longest_pause`` (seconds, since start; a gauge). A context manager, so the callback is
    removed when the service stops (a test process runs many services, one after another).
    """

    def __init__(self, service: str, *, meter_: metrics.Meter | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.longest_s = [0.0, 0.0, 0.0]
        self._clock = clock
        self._started = 0.0
        labels = [{"service": service, "generation": str(generation)} for generation in GENERATIONS]
        meter_ = meter_ or meter("servicekit")
        counter(meter_, "agw.process.gc_collections", lambda: zip(self.collections, labels), unit="{collection}",
                description="Garbage collections in this process, by generation (2 is a full collection).")
        counter(meter_, "agw.process.gc_pause", lambda: zip(self.pause_s, labels), unit="s",
                description="Seconds garbage collections stopped this process (its event loop), by generation.")
        gauge(meter_, "agw.process.gc_longest_pause", lambda: zip(self.longest_s, labels), unit="s",
              description="The longest single garbage collection since start, by generation.")

    def _on_gc(self, phase: str, info: dict) -> None:
        # Plain arithmetic only: see the module's docstring. Collections never overlap (they hold the GIL).
        if phase == "start":
            self._started = self._clock()
            return
        generation, pause = info["generation"], self._clock() - self._started
        self.collections[generation] += 1
        self.pause_s[generation] += pause
        if pause > self.longest_s[generation]:
            self.longest_s[generation] = pause

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc_info) -> None:
        gc.callbacks.remove(self._on_gc)
