"""A TCP relay that can freeze: it stops forwarding without closing anything, as a partition does.

Frozen, it reads nothing more and writes nothing on; the peers' sockets stay
open and silent, their TCP windows fill, and new connections are accepted by
the kernel but never reach the backend. Only keepalive (or a deadline) can
tell such a peer from a slow one.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class TcpRelay:
    def __init__(self, backend_port: int) -> None:
        self.backend_port = backend_port
        self.port = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._tasks: set[asyncio.Task] = set()
        self._writers: list[asyncio.StreamWriter] = []

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()  # frozen: hold this chunk and read no more
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _accept(self, client_reader, client_writer) -> None:
        await self._flowing.wait()  # frozen: the connection is accepted, and goes nowhere
        backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        self._writers += [client_writer, backend_writer]
        for reader, writer in ((client_reader, backend_writer), (backend_reader, client_writer)):
            task = asyncio.ensure_future(self._pump(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @asynccontextmanager
    async def running(self):
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            for writer in self._writers:
                writer.close()
