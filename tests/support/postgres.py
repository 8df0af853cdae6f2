"""Private PostgreSQL servers from the pgserver wheel, for tests that need their own."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def start_pgserver(pgdata: Path, attempts: int = 2):
    """A running pgserver on ``pgdata`` (stopped by its ``cleanup()``).

    Retried once: its bundled pg_ctl was seen to die with SIGSEGV at start in
    one CI run out of many, leaving a data folder that a second start uses.
    """
    import pgserver

    for attempt in range(1, attempts + 1):
        try:
            return pgserver.get_server(pgdata, cleanup_mode="stop")
        except Exception as exc:  # noqa: BLE001 - pgserver raises several kinds; the last one propagates
            if attempt == attempts:
                raise
            log.warning("pgserver failed to start (%s); retrying once", exc)
    raise AssertionError("unreachable")
