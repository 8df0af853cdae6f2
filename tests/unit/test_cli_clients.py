"""`agentgw chat` and `agentgw doctor` say what is missing instead of failing obscurely."""

from __future__ import annotations

import pytest

from agentgw import cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("command", [["chat", "hello"], ["doctor"]])
def test_without_a_stack_they_point_at_agentgw_up(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AGW_HOME", str(tmp_path))
    assert cli.main(command) == 2
    error = capsys.readouterr().err
    assert f"{tmp_path / 'connection.json'} does not exist" in error and "agentgw up" in error


@pytest.mark.parametrize("command", [["chat", "hello"], ["doctor"]])
def test_a_target_needs_its_tls_folder(command, capsys):
    assert cli.main([*command, "--target", "127.0.0.1:1"]) == 2
    assert "--target needs --tls-dir" in capsys.readouterr().err


def test_clients_built_by_the_cli_use_the_configured_keepalive(tmp_path, monkeypatch):
    """With AGW_KEEPALIVE_TIME_S above 40 s on the servers, a client on gRPC's defaults would ping too often
    and get GOAWAY too_many_pings: every client the CLI builds takes the same setting."""
    import argparse

    from agentgw.connection import Connection
    from agentgw.pki import ensure_dev_pki
    from agentgw.retrieval_tools import channel_spec
    from servicekit.identity import Identity
    from servicekit.settings import ServiceSettings, load_settings

    monkeypatch.setenv("AGW_HOME", str(tmp_path))
    monkeypatch.setenv("AGW_KEEPALIVE_TIME_S", "90")
    monkeypatch.setenv("AGW_KEEPALIVE_TIMEOUT_S", "20")
    ensure_dev_pki(tmp_path / "tls")
    settings = load_settings(ServiceSettings)
    Connection(gateway="127.0.0.1:1", tls_dir=str(tmp_path / "tls")).write(tmp_path)
    connection = Connection.for_cli(settings, None, None, "dev")
    specs = [connection.spec(connection.gateway, Identity.tenant("dev")),
             channel_spec(argparse.Namespace(target="127.0.0.1:2", identity="operator/admin"), settings)]
    for spec in specs:
        options = dict(spec.options())
        assert options["grpc.keepalive_time_ms"] == 90_000
        assert options["grpc.keepalive_timeout_ms"] == 20_000
    assert settings.keepalive.server_options() and dict(settings.keepalive.server_options())[
        "grpc.http2.min_ping_interval_without_data_ms"] <= 90_000
