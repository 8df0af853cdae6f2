"""Prefilling an OpenGenerate call's prefix while its caller still builds the request.

A Chat turn knows its session's history before its retrieval returns: the
gateway sends the system prompt and history as the call's prefix, then the
request once the retrieved passages are in. Tokenizing the prefix meanwhile
saves the tokenizer's time; prefilling it saves the engine's. The history's
newest messages (the previous turn's question and answer) are not in the
prefix cache yet: the previous prompt carried that question with its
retrieved passages, and its answer was generated, not prefilled. Computed
while retrieval runs, their KV blocks are cached when the request arrives,
which then prefills only this turn's messages.

Only idle room is used: with a request waiting in the engine, a prefill would
queue behind it and finish no sooner than the request itself. When the
request arrives, a prefill still running is stopped (aborting it keeps the
blocks computed so far cached); the request computes the rest, as it would
have without one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from servicekit.tasks import cancel_and_wait

from inference.engine import Engine
from inference.prompt_encoding import EncodedPrefix

log = logging.getLogger(__name__)

#: Why a prefill ran or not (the ``outcome`` label of ``agw.inference.prefix_prefills``).
OUTCOMES = ("prefilled", "stopped", "busy", "short", "unsupported", "failed")


class PrefixPrefills:
    """Starts prefills of OpenGenerate prefixes and counts their outcomes (one per service)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.outcomes: Counter[str] = Counter({outcome: 0 for outcome in OUTCOMES})

    def start(self, engine: Engine, prefix: asyncio.Future, cache_salt: str) -> asyncio.Task | None:
        """A task prefilling ``prefix`` (the task tokenizing it) once tokenized; None when prefills are off."""
        if not self.enabled:
            return None
        return asyncio.ensure_future(_prefill(engine, prefix, cache_salt))

    async def finish(self, task: asyncio.Task) -> str:
        """Stop ``task`` if it still runs (the request has arrived); count and return its outcome."""
        if not task.done():
            await cancel_and_wait(task)
            outcome = "stopped"
        elif task.cancelled():
            outcome = "stopped"
        elif task.exception() is not None:
            # An optimisation: a failed prefill fails nothing; the request reports the engine's state itself.
            log.debug("prefix prefill failed", exc_info=task.exception())
            outcome = "failed"
        else:
            outcome = task.result()
        self.outcomes[outcome] += 1
        return outcome


async def _prefill(engine: Engine, prefix: asyncio.Future, cache_salt: str) -> str:
    # Shielded: stopping the prefill must not cancel the tokenizing, which the request still uses.
    encoded: EncodedPrefix | None = await asyncio.shield(prefix)
    if encoded is None:
        return "unsupported"
    return await engine.prefill(encoded, cache_salt)
