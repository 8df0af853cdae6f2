"""Postgres for the gateway: one warmed asyncpg pool per process, and versioned migrations.

Migrations are the ``migrations/NNNN_name.sql`` files, applied in order at
start inside one transaction that holds an advisory lock: running them twice,
or from several worker processes at once, applies each exactly once.
"""

from __future__ import annotations

import logging
import re
import time
from contextlib import asynccontextmanager
from importlib import resources

import asyncpg
from opentelemetry import trace
from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

from servicekit.errors import Unavailable
from servicekit.telemetry import spans_recorded

log = logging.getLogger(__name__)
tracer = trace.get_tracer("agent-gateway.database")

#: Any constant shared by every process that migrates this schema.
MIGRATION_LOCK_ID = 0x61677731  # "agw1"
#: The retry hint sent with "session store unavailable": a restarting Postgres takes about a second or more.
STORE_RETRY_AFTER_S = 1.0
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

#: Errors that mean "the database is not reachable now", as opposed to a bad query.
CONNECTION_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
    # What a pooled connection whose server side was killed (a restart) can
    # raise on its first use, before asyncpg notices it is closed.
    asyncpg.exceptions.InternalClientError,
)


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every migration shipped with the package, in order."""
    found = []
    for entry in resources.files("gateway.migrations").iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text()))
    return sorted(found)


async def migrate(connection: asyncpg.Connection) -> list[str]:
    """Apply what is missing; return the names applied."""
    applied_now = []
    async with connection.transaction():
        await connection.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK_ID)
        await connection.execute(
            "CREATE TABLE IF NOT EXISTS agw_schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {row["version"] for row in await connection.fetch("SELECT version FROM agw_schema_migrations")}
        for version, name, sql in migrations():
            if version in done:
                continue
            await connection.execute(sql)
            await connection.execute("INSERT INTO agw_schema_migrations (version, name) VALUES ($1, $2)", version, name)
            applied_now.append(name)
    return applied_now


class StatelessConnection(asyncpg.Connection):
    """A pooled connection that goes back to the pool without asyncpg's session reset query.

    On every release asyncpg's pool runs ``SELECT pg_advisory_unlock_all();
    CLOSE ALL; UNLISTEN *; RESET ALL;``: a round trip inside the latency of
    every store operation (a turn's history read and its write), and the
    gateway's and Postgres's CPU. The gateway leaves nothing for it to undo:
    no session-level advisory lock (migrations take a transaction-scoped one),
    no cursor outside a transaction, no LISTEN, no SET. What it does need on
    release, the rollback of a transaction left open (a cancelled turn), asyncpg
    still does before the reset query. With the query instrumentation off where
    no span is recorded (:func:`open_database`), a history-sized read at one
    operation at a time took 182 against 370 µs and 137 against 266 µs of the
    gateway's CPU (``bench/postgres_pool.py``, docs/benchmarks.md).
    """

    def get_reset_query(self) -> str:
        return ""


class Database:
    """The pool, with acquire bounded in time and outages reported as UNAVAILABLE."""

    def __init__(self, pool: asyncpg.Pool, acquire_timeout_s: float, command_timeout_s: float) -> None:
        self.pool = pool
        self.acquire_timeout_s = acquire_timeout_s
        self.command_timeout_s = command_timeout_s

    async def run(self, operation):
        """``await operation(connection)``, once more on a fresh connection if the first was dead.

        After a database restart every pooled connection is dead but looks
        alive until used; expiring them all and retrying once lets the next
        call succeed instead of failing once per pooled connection. Operations must be safe to repeat
        when their first attempt never reached the server.
        """
        try:
            async with self.connection() as connection:
                return await operation(connection)
        except Unavailable as first:
            if not isinstance(first.__cause__, CONNECTION_ERRORS) or isinstance(first.__cause__, TimeoutError):
                raise
            log.info("database connection lost (%s); renewing the pool's connections and retrying once",
                     type(first.__cause__).__name__)
            # After a restart every pooled connection is dead, not just this
            # one: have the pool replace them all on their next use.
            await self.pool.expire_connections()
            async with self.connection() as connection:
                return await operation(connection)

    @asynccontextmanager
    async def connection(self):
        """A pooled connection. Each way to fail is UNAVAILABLE with its own message: no connection free within
        the acquire timeout (the pool), a command past the command timeout (the server or a lock), and a lost
        connection (an outage)."""
        connection = await self._acquire()
        try:
            yield connection
        except TimeoutError as exc:  # asyncpg's command_timeout: the pool had a connection; the server was slow
            raise Unavailable(
                f"the session store did not answer within {self.command_timeout_s:g}s "
                "(AGW_GATEWAY_DB_COMMAND_TIMEOUT_S); retry shortly", retry_after_s=STORE_RETRY_AFTER_S,
                internal=f"postgres command timeout: {exc!r}") from exc
        except CONNECTION_ERRORS as exc:
            raise _store_unavailable(exc) from exc
        finally:
            await self.pool.release(connection)

    async def _acquire(self):
        try:
            # The asyncpg instrumentation traces queries, not the wait for a
            # pooled connection, which is where an undersized pool shows.
            with tracer.start_as_current_span("postgres pool acquire", attributes={
                "db.system.name": "postgresql",
                "agw.db.pool.size": self.pool.get_size(),
                "agw.db.pool.idle": self.pool.get_idle_size(),
                "agw.db.pool.max": self.pool.get_max_size(),
            }):
                return await self.pool.acquire(timeout=self.acquire_timeout_s)
        except TimeoutError as exc:
            raise Unavailable(
                f"no database connection free within {self.acquire_timeout_s:g}s "
                f"(pool max {self.pool.get_max_size()}); retry shortly"
            ) from exc
        except CONNECTION_ERRORS as exc:
            raise _store_unavailable(exc) from exc


def _store_unavailable(exc: BaseException) -> Unavailable:
    return Unavailable("the session store is unavailable; retry shortly", retry_after_s=STORE_RETRY_AFTER_S,
                       internal=f"postgres: {type(exc).__name__}: {exc}")


async def embedded_postgres_url(pgdata) -> str:
    """Start (or reuse) a private PostgreSQL server from the pgserver wheel; return its URL."""
    import asyncio

    import pgserver

    def start() -> str:
        pgdata.mkdir(parents=True, exist_ok=True)
        # cleanup_mode None: the server outlives this process, so workers and
        # restarts share it; it is reused on the next start.
        return pgserver.get_server(pgdata, cleanup_mode=None).get_uri()

    url = await asyncio.to_thread(start)
    log.info("embedded PostgreSQL at %s (data in %s)", url, pgdata)
    return url


@asynccontextmanager
async def open_database(url: str, *, min_size: int, max_size: int, acquire_timeout_s: float,
                        command_timeout_s: float, statement_cache_size: int, password: str | None = None):
    """Create the pool (``min_size`` connections opened now), migrate, and close it on exit.

    Queries are traced (asyncpg's OpenTelemetry instrumentation, a span per
    query under the caller's span) where this process records spans at all.
    Where it records none, the instrumentation stays off: its unsampled span
    still cost about 40 µs of CPU a query (``bench/postgres_pool.py``).
    """
    started = time.perf_counter()
    instrumentor = AsyncPGInstrumentor()
    if spans_recorded() and not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()  # process-wide
    pool = await asyncpg.create_pool(
        url, password=password, min_size=min_size, max_size=max_size, command_timeout=command_timeout_s,
        # 0 under pgbouncer in transaction mode, where prepared statements
        # cannot follow a client from one server connection to the next.
        statement_cache_size=statement_cache_size,
        connection_class=StatelessConnection,
        # A connection idle this long is closed, so a restarted server's dead
        # sockets are not kept forever.
        max_inactive_connection_lifetime=60.0,
    )
    try:
        async with pool.acquire(timeout=acquire_timeout_s) as connection:
            applied = await migrate(connection)
        log.info("database ready in %.0f ms: pool %d-%d, migrations applied now: %s",
                 (time.perf_counter() - started) * 1000, min_size, max_size, applied or "none")
        yield Database(pool, acquire_timeout_s, command_timeout_s)
    finally:
        await pool.close()
