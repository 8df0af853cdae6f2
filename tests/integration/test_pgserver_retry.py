"""The private-Postgres helper's retry: a start that dies leaves nothing that breaks the second one."""

from __future__ import annotations

import pytest
from pgserver.postgres_server import PostgresServer

from tests.support.postgres import start_pgserver

pytestmark = pytest.mark.integration


def test_a_failed_pgserver_start_is_retried_in_a_new_folder_and_serves(tmp_path, monkeypatch):
    real, failures = PostgresServer.ensure_pgdata_inited, []

    def dies_once(server):
        if not failures:
            failures.append(server.pgdata)
            raise RuntimeError("initdb died with <Signals.SIGSEGV: 11> (injected)")
        return real(server)

    monkeypatch.setattr(PostgresServer, "ensure_pgdata_inited", dies_once)
    server = start_pgserver(tmp_path / "pgdata")
    try:
        # Not the broken instance pgserver cached for the first folder: a server that answers.
        assert server.pgdata != failures[0] and server.pgdata.name == "pgdata-retry2"
        assert server.psql("SELECT 41 + 1;").split().count("42") == 1
    finally:
        server.cleanup()
