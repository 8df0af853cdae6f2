"""OpenTelemetry metrics with a Prometheus scrape endpoint, one per process.

Code records through the OpenTelemetry API everywhere; only a process whose
settings name a metrics port installs a meter provider and serves
``/metrics`` on it. Without one the API's no-op meter makes every record a
cheap no-op, so tests and tools pay nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

log = logging.getLogger(__name__)

#: Millisecond buckets from sub-millisecond hops to multi-second turns.
LATENCY_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


def configure_metrics(service: str, host: str, port: int | None) -> MeterProvider | None:
    """Serve Prometheus metrics on ``host:port``; do nothing when ``port`` is None."""
    if port is None:
        return None
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    provider = MeterProvider(
        resource=Resource.create({"service.name": f"agent-gateway-{service}"}),
        metric_readers=[PrometheusMetricReader()],
        views=[View(instrument_type=Histogram, aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS_MS))],
    )
    metrics.set_meter_provider(provider)
    server, _thread = start_http_server(port, addr=host)
    log.info("metrics: Prometheus endpoint on http://%s:%d/metrics", host, server.server_port)
    return provider


def meter(name: str) -> metrics.Meter:
    return metrics.get_meter(f"agent-gateway.{name}")


def gauge(meter_: metrics.Meter, name: str, read: Callable[[], Iterable[tuple[float, dict]]], *,
          unit: str = "1", description: str = "") -> None:
    """An observable gauge whose ``read()`` yields (value, attributes) pairs at each scrape."""
    meter_.create_observable_gauge(name, callbacks=[_observe(name, read)], unit=unit, description=description)


def counter(meter_: metrics.Meter, name: str, read: Callable[[], Iterable[tuple[float, dict]]], *,
            unit: str = "1", description: str = "") -> None:
    """An observable (monotonic) counter whose ``read()`` yields running totals at each scrape."""
    meter_.create_observable_counter(name, callbacks=[_observe(name, read)], unit=unit, description=description)


def _observe(name: str, read: Callable[[], Iterable[tuple[float, dict]]]):
    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        try:
            return [Observation(value, attributes) for value, attributes in read()]
        except Exception:  # noqa: BLE001 - a scrape must never fail for one instrument
            log.debug("%s failed to read", name, exc_info=True)
            return []

    return callback
