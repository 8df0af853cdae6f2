"""Postgres: migrations, the session store's tenant scoping, paging and failure modes."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit

import asyncpg
import pytest

from gateway.database import migrate, migrations, open_database
from gateway.sessions import Sessions
from servicekit.errors import InvalidArgument, NotFound, Unavailable

pytestmark = pytest.mark.integration

INJECTION = "'); DROP TABLE agw_sessions; --"


@pytest.fixture
async def fresh_database(database_url):
    """A database of its own, dropped afterwards, so migrations start from nothing."""
    name = f"agw_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    # The path names the database; the query may hold a socket directory (pgserver's URLs do).
    yield urlsplit(database_url)._replace(path=f"/{name}").geturl()
    await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    await admin.close()


@pytest.fixture
async def sessions(database_url):
    async with open_database(database_url, min_size=1, max_size=4, acquire_timeout_s=2,
                             command_timeout_s=5, statement_cache_size=100) as database:
        yield Sessions(database)


async def test_migrations_apply_once_even_from_concurrent_processes(fresh_database):
    connections = [await asyncpg.connect(fresh_database) for _ in range(3)]
    try:
        applied = await asyncio.gather(*(migrate(c) for c in connections))
        names = [name for _, name, _ in migrations()]
        assert sorted(applied, key=len, reverse=True)[0] == names  # one process applied everything
        assert sum(len(a) for a in applied) == len(names)          # and nobody applied anything twice
        assert await migrate(connections[0]) == []                  # a rerun is a no-op
        rows = await connections[0].fetch("SELECT version FROM agw_schema_migrations ORDER BY version")
        assert [r["version"] for r in rows] == [v for v, _, _ in migrations()]
    finally:
        for connection in connections:
            await connection.close()


async def test_sessions_are_scoped_to_their_tenant(sessions):
    created = await sessions.create("dev", {"purpose": INJECTION})
    fetched = await sessions.get("dev", created.id)
    assert fetched.metadata == {"purpose": INJECTION} and fetched.message_count == 0
    for call in (sessions.get("other", created.id), sessions.delete("other", created.id),
                 sessions.list_messages("other", created.id, 10, "")):
        with pytest.raises(NotFound) as caught:
            await call
        assert str(caught.value) == f"session {created.id} does not exist"  # same words as a missing one
    await sessions.delete("dev", created.id)
    with pytest.raises(NotFound):
        await sessions.get("dev", created.id)


async def test_messages_page_in_order(sessions, database_url):
    created = await sessions.create("dev", {})
    connection = await asyncpg.connect(database_url)
    try:
        await connection.executemany(
            "INSERT INTO agw_messages (session_id, ordinal, role, content) VALUES ($1, $2, $3, $4)",
            [(uuid.UUID(created.id), i, "user" if i % 2 == 0 else "assistant", f"{INJECTION} #{i}") for i in range(7)],
        )
    finally:
        await connection.close()
    seen, token = [], ""
    while True:
        page, token = await sessions.list_messages("dev", created.id, 3, token)
        seen += page
        if not token:
            break
    assert [m.ordinal for m in seen] == list(range(7))
    assert seen[4].content == f"{INJECTION} #4" and seen[1].role == "assistant"
    assert (await sessions.get("dev", created.id)).message_count == 7


@pytest.mark.parametrize(("call", "field"), [
    (lambda s: s.get("dev", "not-a-uuid"), "session_id"),
    (lambda s: s.list_messages("dev", str(uuid.uuid4()), 1001, ""), "page_size"),
    (lambda s: s.list_messages("dev", str(uuid.uuid4()), 10, "garbage!"), "page_token"),
])
async def test_bad_input_is_invalid_argument(sessions, call, field):
    with pytest.raises(InvalidArgument) as caught:
        await call(sessions)
    assert caught.value.field == field


async def test_pool_exhaustion_is_unavailable_within_the_acquire_timeout(database_url):
    async with open_database(database_url, min_size=1, max_size=1, acquire_timeout_s=0.2,
                             command_timeout_s=5, statement_cache_size=100) as database:
        async with database.connection():
            with pytest.raises(Unavailable, match="no database connection free within 0.2s"):
                async with database.connection():
                    pass


async def test_a_slow_command_is_unavailable_naming_the_command_timeout_not_the_pool(database_url):
    async with open_database(database_url, min_size=1, max_size=1, acquire_timeout_s=5,
                             command_timeout_s=0.2, statement_cache_size=100) as database:
        with pytest.raises(Unavailable, match=r"did not answer within 0.2s \(AGW_GATEWAY_DB_COMMAND_TIMEOUT_S\)"):
            async with database.connection() as connection:
                await connection.execute("SELECT pg_sleep(2)")
        async with database.connection() as connection:  # the connection went back to the pool, usable
            assert await connection.fetchval("SELECT 1") == 1


async def test_a_release_sends_nothing_yet_rolls_back_an_open_transaction(database_url):
    """The pool's connections skip asyncpg's reset query (a round trip per release), and still lose what an
    abandoned transaction did."""
    async with open_database(database_url, min_size=1, max_size=1, acquire_timeout_s=5,
                             command_timeout_s=5, statement_cache_size=100) as database:
        sent = []
        async with database.connection() as connection:
            pid = await connection.fetchval("SELECT pg_backend_pid()")
            connection.add_query_logger(lambda record: sent.append(record.query))
        assert sent == []  # released without a query
        session_id = uuid.uuid4()
        async with database.connection() as connection:
            connection.add_query_logger(lambda record: sent.append(record.query))
            await connection.execute("BEGIN")  # unmanaged, as a cancelled operation could leave it
            await connection.execute("INSERT INTO agw_sessions (id, tenant) VALUES ($1, 'dev')", session_id)
        assert sent[-1] == "ROLLBACK"
        async with database.connection() as connection:
            assert await connection.fetchval("SELECT pg_backend_pid()") == pid  # the same pooled connection
            assert not connection.is_in_transaction()
            assert await connection.fetchval("SELECT count(*) FROM agw_sessions WHERE id = $1", session_id) == 0


async def test_connections_killed_by_the_server_do_not_fail_the_next_call(database_url):
    """What a database restart does to a warm pool: every pooled connection dies at once."""
    async with open_database(database_url, min_size=2, max_size=2, acquire_timeout_s=1,
                             command_timeout_s=5, statement_cache_size=100) as database:
        sessions = Sessions(database)
        created = await sessions.create("dev", {})
        async with database.connection() as first, database.connection() as second:  # the whole pool
            ours = [await first.fetchval("SELECT pg_backend_pid()"), await second.fetchval("SELECT pg_backend_pid()")]
        admin = await asyncpg.connect(database_url)
        try:
            await admin.execute("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", list(ours))
        finally:
            await admin.close()
        for _ in range(3):  # more calls than pooled connections: none may fail
            assert (await sessions.get("dev", created.id)).id == created.id
