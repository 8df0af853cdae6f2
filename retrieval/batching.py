"""Coalesce concurrent single-item calls into batches, without ever waiting to fill one.

A query embedding is a forward pass over a handful of tokens: on a CPU most
of its cost is per pass, not per text. Eight searches arriving together used
to make eight passes in a row on the embedder's thread, each waiting for the
ones before it. Here the first call starts a pass at once with whatever is
queued; calls that arrive while it runs queue up and go together in the next
pass. An idle service adds no delay, and a busy one makes fewer, larger passes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from servicekit.tasks import cancel_and_wait

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """Runs ``run_batch`` over the items queued by concurrent :meth:`submit` calls.

    Args:
        run_batch: computes one result per item, in order.
        max_batch: most items in one call of ``run_batch``.
    """

    def __init__(self, run_batch: Callable[[Sequence[T]], Awaitable[Sequence[R]]], max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1 (got {max_batch})")
        self._run_batch = run_batch
        self._max_batch = max_batch
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._drainer: asyncio.Task | None = None
        self.batches = 0
        """Calls of ``run_batch`` so far (for tests and stats)."""

    async def submit(self, item: T) -> R:
        """The result for ``item``, computed in the next batch that has room."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._drainer is None:
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        return await future  # cancelled: the future is cancelled too, and the drain skips it

    async def _drain(self) -> None:
        batch: list[tuple[T, asyncio.Future[R]]] = []
        try:
            while self._queue:
                taken, self._queue = self._queue[:self._max_batch], self._queue[self._max_batch:]
                batch = [(item, future) for item, future in taken if not future.done()]
                if not batch:
                    continue
                self.batches += 1
                try:
                    results = await self._run_batch([item for item, _ in batch])
                except Exception as exc:  # noqa: BLE001 - every caller in the batch gets the failure
                    _settle(batch, error=exc)
                else:
                    _settle(batch, results)
                batch = []
        finally:
            self._drainer = None
            # Only when the drain itself was cancelled (close): nobody is left waiting.
            for _, future in [*batch, *self._queue]:
                future.cancel()
            self._queue.clear()

    async def close(self) -> None:
        """Cancel the batch in progress and every queued call."""
        if self._drainer is not None:
            await cancel_and_wait(self._drainer)
        # A drain cancelled before it ever ran left its queue behind.
        for _, future in self._queue:
            future.cancel()
        self._queue.clear()
        self._drainer = None


def _settle(batch, results: Sequence | None = None, error: Exception | None = None) -> None:
    """Hand each caller still waiting its result, or the batch's error."""
    if error is None and len(results) != len(batch):
        error = RuntimeError(f"a batch of {len(batch)} items gave {len(results)} results")
    for index, (_, future) in enumerate(batch):
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(results[index])
