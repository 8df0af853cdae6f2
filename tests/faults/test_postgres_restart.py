"""Postgres stopped and started again under load (a private pgserver: never the machine's shared server).

While it is down, turns with a session fail UNAVAILABLE with retry info and
stateless turns (no session, nothing to store) keep running; afterwards the
pool recovers by itself, and a turn retried with its idempotency key is stored
exactly once: its rows are counted in Postgres.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg
import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from servicekit.errors import retry_delay_s
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.postgres import start_pgserver
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.faults


def _stop(server) -> None:
    """Stop the server fast (its connections are cut), as pgserver runs pg_ctl: as the server's own user."""
    from pgserver._commands import pg_ctl

    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user)


async def _turn(stub, **fields) -> tuple[str, grpc.aio.AioRpcError | None]:
    try:
        events = [e async for e in stub.Chat(pb.ChatRequest(**fields), timeout=10)]
        return ("OK" if events[-1].HasField("final") else "NO FINAL"), None
    except grpc.aio.AioRpcError as error:
        return error.code().name, error


async def test_postgres_restarted_under_load(tmp_path, pki):
    server = start_pgserver(tmp_path / "pgdata")
    url = server.get_uri()
    try:
        async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
                scripted_app(pki.root) as (inference, _), \
                gateway_server(pki.root, inference.port, retrieval.port, database_url=url) as (gateway, _), \
                gateway_stub(gateway.port, pki.root) as stub:
            session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id
            assert (await _turn(stub, session_id=session, message="tokens=2"))[0] == "OK"

            await asyncio.to_thread(_stop, server)
            stopped_at = time.monotonic()
            stateless = [await _turn(stub, message="tokens=2") for _ in range(5)]
            assert [code for code, _ in stateless] == ["OK"] * 5
            code, error = await _turn(stub, session_id=session, message="tokens=2 keyed", idempotency_key="k1")
            assert code == "UNAVAILABLE", (code, error)
            assert retry_delay_s(error) is not None and "retry" in error.details(), error.details()
            failed_in = time.monotonic() - stopped_at

            await asyncio.to_thread(server.ensure_postgres_running)
            started = time.monotonic()
            while (code := (await _turn(stub, session_id=session, message="tokens=2 keyed",
                                        idempotency_key="k1"))[0]) != "OK":
                assert code == "UNAVAILABLE" and time.monotonic() - started < 15, code
                await asyncio.sleep(0.2)
            recovered_s = time.monotonic() - started
            assert (await _turn(stub, session_id=session, message="tokens=2 keyed", idempotency_key="k1"))[0] == "OK"

            connection = await asyncpg.connect(url)
            try:
                keyed = await connection.fetchval(
                    "select count(*) from agw_messages where session_id = $1::uuid and content = 'tokens=2 keyed'",
                    session)
            finally:
                await connection.close()
            assert keyed == 1, f"the keyed turn's user message is stored {keyed} times"
            print(f"postgres restart: while down, 5 of 5 stateless turns OK and a session turn refused UNAVAILABLE "
                  f"with retry info ({failed_in:.2f} s after the stop, 6 turns in); session turns OK again "
                  f"{recovered_s:.2f} s after Postgres was back; the keyed turn stored once")
    finally:
        server.cleanup()
