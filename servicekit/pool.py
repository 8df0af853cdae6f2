"""Pools of long-lived mTLS channels to one backend.

Each backend gets M channels, each with its own HTTP/2 connection
(``grpc.use_local_subchannel_pool``), opened and warmed at start-up, kept alive
by keepalive pings, and reused by every call: a TLS handshake is paid M times
per process lifetime, not once per call. A call takes the channel with the
fewest calls in flight. Within a channel, gRPC's ``round_robin`` spreads calls
over every address the target resolves to (several vLLM replicas behind one
DNS name), so balancing across replicas is gRPC's, not ours.

The pool watches each channel's connectivity (connection attempts, and READY
transitions, which for a secure channel are completed TLS handshakes) and the
backend's health through ``grpc.health.v1`` Watch.

Certificates rotate without a restart: :meth:`ChannelPool.reload_tls` opens M
new channels with the renewed identity, moves new calls to them once they are
ready, and closes the old ones after the calls still on them had
``drain_s`` to finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.channels import ChannelNotReady, ChannelSpec, open_channel, wait_ready
from servicekit.errors import Unavailable
from servicekit.passthrough import raw_multicallable
from servicekit.tasks import cancel_and_wait
from servicekit.tls import ClientTls

log = logging.getLogger(__name__)


@dataclass
class ChannelStats:
    calls: int = 0
    in_flight: int = 0
    connection_attempts: int = 0
    connections_ready: int = 0


@dataclass
class PooledChannel:
    index: int
    channel: grpc.aio.Channel
    stats: ChannelStats = field(default_factory=ChannelStats)
    _stubs: dict = field(default_factory=dict)
    #: Bumped each time a liveness probe found the connection silent and replaced it: a call started under
    #: an older generation that ends CANCELLED was ended by that replacement, not by its caller.
    generation: int = 0
    #: True from a failed liveness verdict until a probe on the new connection is answered.
    stalled: bool = False
    #: When a message last arrived on a call of this channel (monotonic): a flowing stream is not a silent one.
    last_received: float = 0.0

    def received(self) -> None:
        """Note that a message arrived (backends' stream readers call this)."""
        self.last_received = time.monotonic()

    def replace_channel(self, channel: grpc.aio.Channel) -> grpc.aio.Channel:
        """Put ``channel`` in place of the current one (returned, to be closed)."""
        old, self.channel = self.channel, channel
        self._stubs.clear()
        self.generation += 1
        return old

    def stub(self, stub_class):
        """A stub on this channel, built once."""
        stub = self._stubs.get(stub_class)
        if stub is None:
            stub = self._stubs[stub_class] = stub_class(self.channel)
        return stub

    def raw(self, method):
        """A callable for ``method`` (a MethodDescriptor) on this channel whose responses stay bytes; built once."""
        call = self._stubs.get(method)
        if call is None:
            call = self._stubs[method] = raw_multicallable(self.channel, method)
        return call

    @property
    def state(self) -> grpc.ChannelConnectivity:
        return self.channel.get_state(try_to_connect=False)


@dataclass(frozen=True)
class Liveness:
    """A backend that stopped answering without closing (frozen, partitioned) is found by probing, not waited on.

    Every ``every_s`` each channel sends a health Check with a ``timeout_s``
    deadline. After ``failures`` timeouts in a row, with no message received
    on that channel meanwhile (a flowing stream is not a silent backend), the
    channel is declared stalled: its connection is replaced, which ends the
    calls on it at once (the caller sees UNAVAILABLE), and new calls avoid it
    until a probe on the new connection is answered. Detection takes at most
    about ``failures x (every_s + timeout_s)``, far below keepalive's
    ping interval plus its timeout.
    """

    every_s: float = 1.0
    timeout_s: float = 2.0
    failures: int = 2

    @property
    def window_s(self) -> float:
        return self.failures * (self.every_s + self.timeout_s)


class ChannelPool:
    """M channels to one backend, health-watched. Use ``async with`` or start()/close()."""

    def __init__(self, name: str, spec: ChannelSpec, size: int, health_service: str = "", *,
                 drain_s: float = 30.0, liveness: Liveness | None = None) -> None:
        self.name = name
        self.liveness = liveness
        self.spec = spec
        self.health_service = health_service
        self.drain_s = drain_s
        self.channels = [PooledChannel(i, open_channel(spec)) for i in range(size)]
        self.serving = False
        #: Times the channels were replaced with a renewed certificate.
        self.tls_reloads = 0
        self._tasks: list[asyncio.Task] = []
        self._state_tasks: list[asyncio.Task] = []
        self._health_task: asyncio.Task | None = None
        self._retiring: list[PooledChannel] = []
        self._connect_timeout_s = 10.0

    @property
    def target(self) -> str:
        return self.spec.target

    def describe(self) -> str:
        return f"{self.name} backend at {self.target}"

    async def start(self, *, connect_timeout_s: float, wait: bool) -> None:
        """Connect every channel and start the watchers.

        With ``wait`` false a backend that does not answer in time raises
        :class:`ChannelNotReady` naming it; with ``wait`` true the pool starts
        anyway and gRPC keeps reconnecting in the background.
        """
        self._connect_timeout_s = connect_timeout_s
        self._watch_states()
        try:
            await self._wait_ready(self.channels, connect_timeout_s)
        except ChannelNotReady:
            if not wait:
                await self.close()
                raise
            log.warning("%s not ready; starting NOT_SERVING and retrying in the background", self.describe())
        self._health_task = asyncio.create_task(self._watch_health(), name=f"{self.name}-health")

    def _watch_states(self) -> None:
        self._state_tasks = [asyncio.create_task(self._watch_state(p), name=f"{self.name}-state-{p.index}")
                             for p in self.channels]
        if self.liveness is not None:
            self._state_tasks += [asyncio.create_task(self._probe(p), name=f"{self.name}-probe-{p.index}")
                                  for p in self.channels]

    async def _probe(self, pooled: PooledChannel) -> None:
        """Liveness: a health Check per interval on this channel; a silent channel is replaced (:class:`Liveness`)."""
        liveness = self.liveness
        request = health_pb2.HealthCheckRequest(service=self.health_service)
        misses = 0
        while True:
            await asyncio.sleep(liveness.every_s)
            try:
                await pooled.stub(health_pb2_grpc.HealthStub).Check(request, timeout=liveness.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    misses = 0  # refused or down: gRPC knows, and fails calls itself
                    continue
                misses += 1
                silent_for = time.monotonic() - pooled.last_received
                if misses >= liveness.failures and silent_for >= liveness.window_s and not pooled.stalled:
                    self._stall(pooled, misses)
                continue
            misses = 0
            if pooled.stalled:
                pooled.stalled = False
                log.warning("%s channel %d answers again", self.describe(), pooled.index)

    def _stall(self, pooled: PooledChannel, misses: int) -> None:
        log.warning("%s channel %d: %d liveness probes unanswered and nothing received for %.1fs; replacing its "
                    "connection and ending its calls", self.describe(), pooled.index, misses,
                    time.monotonic() - pooled.last_received)
        pooled.stalled = True
        old = pooled.replace_channel(open_channel(self.spec))
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.create_task(old.close(None), name=f"{self.name}-close-stalled"))

    async def _wait_ready(self, channels: list[PooledChannel], timeout_s: float) -> None:
        await asyncio.gather(*(wait_ready(p.channel, timeout_s=timeout_s, target=self.describe()) for p in channels))

    def reload_tls(self, tls: ClientTls) -> None:
        """Move to a renewed client certificate: new connections now, the old ones drained (in the background)."""
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.create_task(self._replace_channels(tls), name=f"{self.name}-tls-reload"))

    async def _replace_channels(self, tls: ClientTls) -> None:
        self.spec = dataclasses.replace(self.spec, tls=tls)
        fresh = [PooledChannel(i, open_channel(self.spec)) for i in range(len(self.channels))]
        try:
            await self._wait_ready(fresh, self._connect_timeout_s)
        except ChannelNotReady as exc:  # the backend is down: the old channels are no better
            log.warning("%s: renewed certificate, new channels not ready yet (%s); switching anyway", self.describe(), exc)
        old, self.channels = self.channels, fresh
        await cancel_and_wait(*self._state_tasks)
        self._watch_states()
        if self._health_task is not None:  # follow health on a live channel, not one being retired
            await cancel_and_wait(self._health_task)
            self._health_task = asyncio.create_task(self._watch_health(), name=f"{self.name}-health")
        self.tls_reloads += 1
        log.info("%s: %d new channels with the renewed certificate; the old ones drain for up to %gs",
                 self.describe(), len(fresh), self.drain_s)
        # Calls still on the old channels get drain_s to finish; new calls already use the new ones.
        self._retiring.extend(old)
        await asyncio.gather(*(p.channel.close(self.drain_s) for p in old), return_exceptions=True)
        self._retiring = [p for p in self._retiring if p not in old]

    async def _watch_state(self, pooled: PooledChannel) -> None:
        state = pooled.state
        if state == grpc.ChannelConnectivity.CONNECTING:
            pooled.stats.connection_attempts += 1
        while True:
            channel = pooled.channel
            try:
                await channel.wait_for_state_change(state)
            except Exception:  # noqa: BLE001 - closed under us (replaced after a liveness verdict)
                await asyncio.sleep(0.1)
            if channel is not pooled.channel:
                state = pooled.state
                continue
            state = pooled.state
            if state == grpc.ChannelConnectivity.CONNECTING:
                pooled.stats.connection_attempts += 1
            elif state == grpc.ChannelConnectivity.READY:
                pooled.stats.connections_ready += 1

    async def _watch_health(self) -> None:
        """Follow the backend's health; reconnect the watch when the stream breaks."""
        request = health_pb2.HealthCheckRequest(service=self.health_service)
        while True:
            stub = health_pb2_grpc.HealthStub(self.channels[0].channel)
            try:
                async for update in stub.Watch(request):
                    serving = update.status == health_pb2.HealthCheckResponse.SERVING
                    if serving != self.serving:
                        log.info("%s is %s", self.describe(), "SERVING" if serving else "NOT SERVING")
                    self.serving = serving
            except grpc.aio.AioRpcError as exc:
                if self.serving:
                    log.warning("%s health watch lost: %s", self.describe(), exc.code().name)
                self.serving = False
            await asyncio.sleep(0.5)

    def pick(self) -> PooledChannel:
        """The channel with the fewest calls in flight (the first on a tie), among those not stalled."""
        live = [p for p in self.channels if not p.stalled] or self.channels
        return min(live, key=lambda p: p.stats.in_flight)

    @contextmanager
    def use(self):
        """A channel for one call, counted while the call runs."""
        if not self.serving and all(p.state != grpc.ChannelConnectivity.READY for p in self.channels):
            raise Unavailable(f"the {self.name} service is not serving; retry shortly",
                              internal=f"{self.describe()}: health NOT_SERVING and no channel READY")
        if all(p.stalled for p in self.channels):
            raise Unavailable(f"the {self.name} service stopped answering; retry shortly",
                              internal=f"{self.describe()}: every channel failed its liveness probes")
        pooled = self.pick()
        pooled.stats.calls += 1
        pooled.stats.in_flight += 1
        try:
            yield pooled
        finally:
            pooled.stats.in_flight -= 1

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks, *self._state_tasks, *([self._health_task] if self._health_task else []))
        self._tasks.clear()
        self._state_tasks.clear()
        self._health_task = None
        await asyncio.gather(*(p.channel.close() for p in [*self.channels, *self._retiring]), return_exceptions=True)
