"""`agentgw certs` as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _certs(home, *args):
    env = {**os.environ, "AGW_HOME": str(home)}
    env.pop("AGW_TLS_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "agentgw.cli", "certs", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_certs_creates_then_reuses_then_forces(tmp_path):
    first = _certs(tmp_path, "--tenant", "acme")
    assert first.returncode == 0, first.stderr
    tls = tmp_path / "tls"
    assert {p.name for p in tls.iterdir()} == {"ca.pem", "ca-key.pem", "service", "operator", "tenant"}
    assert {p.name for p in (tls / "service").iterdir()} == {"gateway", "retrieval", "inference", "edge"}
    assert {p.name for p in (tls / "tenant").iterdir()} == {"acme"}
    assert {p.name for p in (tls / "operator").iterdir()} == {"admin"}
    ca = (tls / "ca.pem").read_bytes()

    again = _certs(tmp_path, "--tenant", "acme")
    assert again.returncode == 0 and "created" not in again.stdout
    assert (tls / "ca.pem").read_bytes() == ca

    forced = _certs(tmp_path, "--force")
    assert forced.returncode == 0 and (tls / "ca.pem").read_bytes() != ca


def test_certs_renews_leaves_under_the_same_ca(tmp_path):
    assert _certs(tmp_path).returncode == 0
    tls = tmp_path / "tls"
    ca, leaf = (tls / "ca.pem").read_bytes(), (tls / "service/gateway/cert.pem").read_bytes()
    renewed = _certs(tmp_path, "--renew", "--leaf-days", "30")
    assert renewed.returncode == 0, renewed.stderr
    assert "renewed" in renewed.stdout
    assert (tls / "ca.pem").read_bytes() == ca and (tls / "service/gateway/cert.pem").read_bytes() != leaf


def test_certs_refuses_a_service_name_for_a_tenant(tmp_path):
    result = _certs(tmp_path, "--tenant", "gateway")
    assert result.returncode == 2
    assert "tenant name 'gateway' is a service's name" in result.stderr
    assert not (tmp_path / "tls" / "tenant" / "gateway").exists()


def test_certs_refuses_a_bad_tenant_name(tmp_path):
    result = _certs(tmp_path, "--tenant", "../evil")
    assert result.returncode == 2
    assert "invalid name '../evil'" in result.stderr


def test_bad_setting_fails_naming_the_variable(tmp_path):
    env = {**os.environ, "AGW_HOME": str(tmp_path), "AGW_GRACE_S": "soon"}
    result = subprocess.run([sys.executable, "-m", "agentgw.cli", "certs"], env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert "AGW_GRACE_S" in result.stderr
