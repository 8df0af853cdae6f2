"""Chat's response stream, written with adaptive coalescing.

A writer task sends the stream's messages with ``context.write``, one at a
time, in order. While a write is in flight (a slow client, a busy connection),
the text deltas that arrive meanwhile merge into one pending delta instead of
queueing one message each. When the client keeps up, the writer is idle when
a delta arrives and writes it at once: the first token is never held, and the
message count equals the backend's. Only deltas merge: the context event, the
tool calls and the final summary keep their own messages and their order, so
the summary is always last.

The pending text is capped (``max_pending_bytes``). At the cap the producer
waits for the writer before it reads another message from the backend, so a
client that stops reading stops the backend stream through HTTP/2 flow control
instead of growing this process's memory.
"""

from __future__ import annotations

import asyncio
from collections import deque

from agent.gateway.v1 import gateway_pb2 as pb
from servicekit.tasks import cancel_and_wait


class _PendingDelta:
    """Text deltas merged in arrival order."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0

    def add(self, text: str, size: int) -> None:
        self.parts.append(text)
        self.size += size

    def message(self) -> pb.ChatResponse:
        return pb.ChatResponse(delta=pb.TokenDelta(text="".join(self.parts)))


class CoalescingWriter:
    """Writes a server stream's messages from one writer task; use ``async with`` around the producer.

    Leaving the block waits for everything queued to be written (or raises
    the write's error); a producer that fails or is cancelled cancels the
    writer instead.
    """

    def __init__(self, context, max_pending_bytes: int = 64 * 1024) -> None:
        self._context = context
        self._max_pending = max_pending_bytes
        self._queue: deque[pb.ChatResponse | _PendingDelta] = deque()
        self._pending_size = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None
        #: Messages written, and deltas received (equal unless deltas were merged).
        self.written = 0
        self.deltas = 0

    async def __aenter__(self) -> CoalescingWriter:
        self._task = asyncio.create_task(self._write_all(), name="chat-stream-writer")
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            await cancel_and_wait(self._task)
            return
        self._closing = True
        self._wake.set()
        await self._task  # a failed write raises here

    async def delta(self, text: str) -> None:
        """Queue a text delta; merged with the one still pending, if any. Waits while the pending text is at the cap."""
        self._check_writer()
        self.deltas += 1
        tail = self._queue[-1] if self._queue else None
        if not isinstance(tail, _PendingDelta):
            tail = _PendingDelta()
            self._queue.append(tail)
        size = len(text.encode())
        tail.add(text, size)
        self._pending_size += size
        self._wake.set()
        while self._pending_size >= self._max_pending:
            self._check_writer()
            self._room.clear()
            await self._room.wait()

    async def message(self, message: pb.ChatResponse) -> None:
        """Queue a message that is never merged (context, tool call, final), after everything before it."""
        self._check_writer()
        self._queue.append(message)
        self._wake.set()

    def _check_writer(self) -> None:
        if self._task.done():  # a write failed (the client went away): the producer stops with its error
            self._task.result()
            raise RuntimeError("the stream's writer ended before the stream did")

    async def _write_all(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            item = self._queue.popleft()
            if isinstance(item, _PendingDelta):
                self._pending_size -= item.size
                self._room.set()
                item = item.message()
            await self._context.write(item)
            self.written += 1
