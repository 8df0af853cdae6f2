"""Chat's response stream, written with adaptive coalescing.

A writer task sends the stream's messages with ``context.write``, one at a
time, in order. While a write is in flight (a slow client, a busy process),
the deltas that arrive meanwhile gather into one batch, which a ``merge``
function turns into as few messages as their meaning allows, instead of one
message each. When the client keeps up, the writer is idle when a delta
arrives and writes it at once: the first token is never held, and the message
count equals the backend's. Messages queued with :meth:`CoalescingWriter.message`
(the context event, tool calls, the final summary) are never merged and keep
their place, so the summary is always last.

What is pending is capped (``max_pending_bytes``). At the cap the producer
waits for the writer before it reads another message from the backend, so a
client that stops reading stops the backend stream through HTTP/2 flow control
instead of growing this process's memory. It waits at most ``send_timeout_s``:
a paused generation still holds its engine slot and KV cache, so a client
that reads nothing for that long ends the stream (``DEADLINE_EXCEEDED``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

from agent.gateway.v1 import gateway_pb2 as pb
from servicekit.errors import DeadlineExceeded
from servicekit.tasks import cancel_and_wait


class _Batch:
    """Deltas gathered behind a write in flight, in arrival order."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list = []
        self.size = 0


def merge_text(parts: Sequence[str]) -> list[pb.ChatResponse]:
    """Chat: text deltas concatenate into one."""
    return [pb.ChatResponse(delta=pb.TokenDelta(text="".join(parts)))]


class CoalescingWriter:
    """Writes a server stream's messages from one writer task; use ``async with`` around the producer.

    Leaving the block waits for everything queued to be written (or raises
    the write's error); a producer that fails or is cancelled cancels the
    writer instead.
    """

    def __init__(self, context, merge: Callable[[list], list], max_pending_bytes: int = 64 * 1024,
                 send_timeout_s: float | None = None) -> None:
        """``send_timeout_s``: the longest the producer waits at the cap for the client to read (None: no bound)."""
        self._context = context
        self._merge = merge
        self._max_pending = max_pending_bytes
        self._send_timeout_s = send_timeout_s
        self._queue: deque = deque()
        self._pending_size = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None
        #: Messages written, and deltas received (equal unless deltas were merged).
        self.written = 0
        self.deltas = 0

    async def __aenter__(self) -> CoalescingWriter:
        self._task = asyncio.create_task(self._write_all(), name="stream-writer")
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            await cancel_and_wait(self._task)
            return
        self._closing = True
        self._wake.set()
        await self._task  # a failed write raises here

    async def delta(self, part, size: int) -> None:
        """Queue a delta of ``size`` bytes, batched with those still pending. Waits while pending is at the cap."""
        self._check_writer()
        self.deltas += 1
        tail = self._queue[-1] if self._queue else None
        if not isinstance(tail, _Batch):
            tail = _Batch()
            self._queue.append(tail)
        tail.parts.append(part)
        tail.size += size
        self._pending_size += size
        self._wake.set()
        while self._pending_size >= self._max_pending:
            self._check_writer()
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), self._send_timeout_s)
            except TimeoutError:
                raise send_timed_out(self._send_timeout_s, f" while {self._pending_size} bytes of the stream waited"
                                     ) from None

    async def message(self, message) -> None:
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
            if isinstance(item, _Batch):
                self._pending_size -= item.size
                self._room.set()
                messages = self._merge(item.parts)
            else:
                messages = (item,)
            for message in messages:
                await self._context.write(message)
                self.written += 1


def send_timed_out(timeout_s: float, detail: str = "") -> DeadlineExceeded:
    """The status of a stream ended because its client read nothing for ``timeout_s``."""
    return DeadlineExceeded(f"the client read nothing for {timeout_s:g} s{detail} (AGW_GATEWAY_STREAM_SEND_TIMEOUT_S); "
                            "the stream and its generation were ended")


class SendWatch:
    """Cancels the current task once one write to its client has waited ``timeout_s``: for a stream written with
    ``context.write`` as read (the Generate passthrough), where reading waits for each write.

    Wrap each write in :meth:`writing` and :meth:`written` (two stores of a clock reading); one timer a stream
    checks them, re-armed at its own interval, never per message (a timer per write would cost every token).
    Use ``with SendWatch(timeout_s) as watch:``; where the task sees ``CancelledError``, :attr:`fired` tells
    whether the watch sent it (then :meth:`expired` is the status to end the stream with).
    """

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._timeout_s = timeout_s
        self._since: float | None = None
        self.fired = False
        self._timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> SendWatch:
        self._timer = self._loop.call_later(self._timeout_s, self._check)
        return self

    def __exit__(self, *exc_info) -> None:
        self._timer.cancel()

    def writing(self) -> None:
        self._since = self._loop.time()

    def written(self) -> None:
        self._since = None

    def expired(self) -> DeadlineExceeded:
        """The status to end the stream with once the watch has fired; the task's cancel request is withdrawn."""
        self._task.uncancel()
        return send_timed_out(self._timeout_s)

    def _check(self) -> None:
        since, now = self._since, self._loop.time()
        if since is not None and now - since >= self._timeout_s:
            self.fired = True
            self._task.cancel()
            return
        self._timer = self._loop.call_later(self._timeout_s if since is None else since + self._timeout_s - now,
                                            self._check)
