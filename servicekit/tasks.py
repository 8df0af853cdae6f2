"""Stopping background tasks: cancel them, then wait until each has finished unwinding."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(*tasks: asyncio.Future) -> None:
    """Cancel ``tasks`` and wait for them to end; their outcomes (cancelled, failed, done) are dropped.

    Waiting matters: a task still unwinding may hold what the caller is about
    to close (a generator it iterates, a connection it uses).
    """
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
