"""Settings: AGW_* variables, per-service prefixes, errors that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from servicekit import Port, ServiceSettings, SettingsError, load_settings, prefixed_config

pytestmark = pytest.mark.unit


class DemoSettings(ServiceSettings):
    model_config = prefixed_config("demo")

    port: Port = 50099
    batch: int = 8


def test_deployment_wide_and_service_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("AGW_HOME", str(tmp_path))
    monkeypatch.setenv("AGW_DEMO_PORT", "6000")
    monkeypatch.setenv("AGW_KEEPALIVE_TIME_S", "30")
    settings = load_settings(DemoSettings)
    assert settings.home == tmp_path
    assert settings.tls_dir == tmp_path / "tls"
    assert settings.port == 6000
    assert settings.keepalive.time_s == 30
    assert settings.listen_address == "127.0.0.1:6000"


def test_tls_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("AGW_TLS_DIR", str(tmp_path / "certs"))
    assert load_settings(DemoSettings).tls_dir == tmp_path / "certs"


def test_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("AGW_DEMO_PORT", "not-a-port")
    monkeypatch.setenv("AGW_GRACE_S", "-1")
    with pytest.raises(SettingsError) as caught:
        load_settings(DemoSettings)
    message = str(caught.value)
    assert "AGW_DEMO_PORT" in message and "'not-a-port'" in message
    assert "AGW_GRACE_S" in message and "greater than 0" in message


def test_out_of_range_port_is_refused(monkeypatch):
    monkeypatch.setenv("AGW_DEMO_PORT", "70000")
    with pytest.raises(SettingsError, match="AGW_DEMO_PORT"):
        load_settings(DemoSettings)


def test_keepalive_timeout_must_be_shorter_than_interval(monkeypatch):
    monkeypatch.setenv("AGW_KEEPALIVE_TIME_S", "2")
    monkeypatch.setenv("AGW_KEEPALIVE_TIMEOUT_S", "20")
    with pytest.raises(SettingsError, match="AGW_KEEPALIVE_TIMEOUT_S"):
        load_settings(DemoSettings)


def test_settings_are_frozen():
    settings = load_settings(DemoSettings)
    with pytest.raises(Exception):
        settings.port = 1  # type: ignore[misc]


def test_ipv6_listen_address():
    assert DemoSettings(host="::", port=1).listen_address == "[::]:1"
    assert Path(DemoSettings().home) == Path(".agentgw")


def test_a_load_watch_interval_past_a_minute_is_refused_naming_the_variable(monkeypatch):
    from inference.settings import InferenceSettings

    monkeypatch.setenv("AGW_INFERENCE_LOAD_WATCH_INTERVAL_MS", "600000")
    with pytest.raises(SettingsError, match="AGW_INFERENCE_LOAD_WATCH_INTERVAL_MS"):
        load_settings(InferenceSettings)


def test_watch_load_interval_is_the_callers_within_the_least_and_a_minute():
    from inference.service import watch_interval_s

    assert watch_interval_s(0, 100) == 0.1  # unset: the service's least
    assert watch_interval_s(50, 100) == 0.1  # raised to the least
    assert watch_interval_s(2_000, 100) == 2.0  # the caller's
    assert watch_interval_s(4_000_000_000, 100) == 60.0  # lowered to a minute


@pytest.mark.parametrize("value", ["-1", "20"])
def test_a_niceness_outside_0_to_19_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("AGW_DEMO_NICE", value)
    with pytest.raises(SettingsError, match="AGW_DEMO_NICE"):
        load_settings(DemoSettings)
