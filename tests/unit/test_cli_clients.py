"""`agentgw chat` and `agentgw doctor` say what is missing instead of failing obscurely."""

from __future__ import annotations

import pytest

from servicekit import cli

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
