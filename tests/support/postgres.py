"""Private PostgreSQL servers from the pgserver wheel, for tests that need their own."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def start_pgserver(pgdata: Path, attempts: int = 2):
    """A running pgserver on ``pgdata`` (stopped by its ``cleanup()``).

    Retried once, in a new data folder: its bundled pg_ctl and initdb were
    seen to die with SIGSEGV at start (in one CI run out of many, and twice on
    2026-12-03). A failed start leaves its half-made server registered under
    its folder (pgserver caches each instance before starting it), and
    ``get_server`` on that folder would hand the broken one back: a retry in
    the same folder failed at ``get_uri`` in CI.
    """
    import pgserver
    from pgserver.postgres_server import PostgresServer

    for attempt in range(1, attempts + 1):
        folder = pgdata if attempt == 1 else pgdata.with_name(f"{pgdata.name}-retry{attempt}")
        try:
            return pgserver.get_server(folder, cleanup_mode="stop")
        except Exception as exc:  # noqa: BLE001 - pgserver raises several kinds; the last one propagates
            PostgresServer._instances.pop(folder.expanduser().resolve(), None)
            if attempt == attempts:
                raise
            log.warning("pgserver failed to start (%s); retrying once in a new folder", exc)
    raise AssertionError("unreachable")
