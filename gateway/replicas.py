"""The inference replicas: one pool, health watch and load watch each, found from a list or from DNS.

``AGW_GATEWAY_INFERENCE_TARGETS`` lists replicas; an entry ``dns:///name:port``
is re-resolved every ``AGW_GATEWAY_INFERENCE_RESOLVE_S`` (a Kubernetes
headless Service), one replica per address, verified as ``name`` (or
``AGW_GATEWAY_BACKEND_SERVER_NAME``). A replica is routable while its health
says SERVING, a channel is not stalled, and its load has been reported; it
leaves routing the moment its health watch breaks (it rides the pool's
connections, so a dead connection ends it), and rejoins when the watch says
SERVING again, without a restart.

Load is what the replica pushes on ``WatchLoad`` (waiting + running), plus the
calls this worker started on it since that report: between two reports
(100 ms) a burst still sees its own weight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable

import grpc

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from servicekit.errors import ResourceExhausted, Unavailable
from servicekit.pool import ChannelPool
from servicekit.tasks import cancel_and_wait
from servicekit.tls import ClientTls

from gateway.routing import Choice, Placement, Policy, Reason, Router

log = logging.getLogger(__name__)
DNS_PREFIX = "dns:///"
#: Least time between two WatchLoad messages the gateway asks for.
LOAD_INTERVAL_MS = 100
#: A WatchLoad stream that ended is reopened after the first delay, doubling to the second while it fails.
RECONNECT_S = (0.2, 2.0)


class Replica:
    """One inference replica: its pool and what this worker knows of its load and use."""

    def __init__(self, address: str, pool: ChannelPool, server_name: str | None) -> None:
        self.address = address
        self.pool = pool
        self.server_name = server_name
        #: The replica's own name once its WatchLoad said it (its address until then): metrics, spans, stats.
        self.name = address
        #: What routing ranks it by: its address when configured by address (stable, and known before it
        #: answers), its name when found through DNS (a pod back on a new address keeps its name).
        self.key = address
        self.load_known = False
        self.running = 0
        self.waiting = 0
        #: Its batch limit as reported (0: not reported, so it counts as full).
        self.max_running = 0
        self.kv_cache_usage = 0.0
        self._in_flight_at_report = 0
        self.routed: Counter[Reason] = Counter()
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self._watch: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        """This worker's calls on the replica now."""
        return sum(p.stats.in_flight for p in self.pool.channels)

    @property
    def load(self) -> int:
        """Waiting + running as last reported, plus this worker's calls started since (never below 0)."""
        return max(0, self.running + self.waiting + self.in_flight - self._in_flight_at_report)

    @property
    def full(self) -> bool:
        """Whether a new call would wait in its queue: requests waiting, or its batch limit reached (counting
        this worker's calls since the report); a replica that does not report its limit counts as full."""
        if self.waiting or not self.max_running:
            return True
        return self.running + max(0, self.in_flight - self._in_flight_at_report) >= self.max_running

    @property
    def routable(self) -> bool:
        """SERVING (its health watch), its load reported at least once, and a channel not stalled."""
        return self.load_known and self.pool.serving and not all(p.stalled for p in self.pool.channels)

    def note_usage(self, usage) -> None:
        """A finished generation's usage (``inference_pb2.Usage``): the prefix-cache hit rate per replica."""
        if usage is not None:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_prompt_tokens += usage.cached_prompt_tokens

    def start_watch(self, named_by_replica: bool) -> None:
        self._watch = asyncio.create_task(self._watch_load(named_by_replica), name=f"load-{self.address}")

    async def _watch_load(self, named_by_replica: bool) -> None:
        """Follow the replica's WatchLoad; reconnect when it ends, backing off from 0.2 to 2 s while it is down."""
        request = inference_pb2.WatchLoadRequest(interval_ms=LOAD_INTERVAL_MS)
        delay_s = RECONNECT_S[0]
        while True:
            try:
                stub = self.pool.channels[0].stub(inference_pb2_grpc.InferenceStub)
                async for load in stub.WatchLoad(request):
                    delay_s = RECONNECT_S[0]
                    self.running, self.waiting = load.running_requests, load.waiting_requests
                    self.max_running = load.max_running_requests
                    self.kv_cache_usage = load.kv_cache_usage
                    self._in_flight_at_report = self.in_flight
                    if load.replica and load.replica != self.name:
                        self.name = load.replica
                        if named_by_replica:
                            self.key = load.replica
                    if not self.load_known:
                        log.info("inference replica %s (%s): load known, routable when SERVING",
                                 self.name, self.address)
                    self.load_known = True
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # older than WatchLoad: route on health alone
                    log.warning("inference replica %s has no WatchLoad; its load counts this worker's calls only",
                                self.address)
                    self.load_known = True
                    return
                # The replica's health watch, not this stream, takes it out of routing: a stream that ends with
                # its channel (a certificate rotation replaces channels) must not make a healthy replica vanish.
                # Until the stream is back, the last load plus this worker's calls since stand in.
                if delay_s == RECONNECT_S[0]:  # once per outage, not per attempt
                    log.info("inference replica %s (%s): load stream ended (%s); reconnecting", self.name,
                             self.address, exc.code().name)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, RECONNECT_S[1])

    async def close(self) -> None:
        if self._watch is not None:
            await cancel_and_wait(self._watch)
        await self.pool.close()

    async def drain_and_close(self, within_s: float) -> None:
        """Close once this worker's calls on it have finished (a pod leaving DNS is draining), or after ``within_s``.

        Routing no longer sees it: the caller took it out of :attr:`Replicas.replicas` first."""
        deadline = asyncio.get_running_loop().time() + within_s
        try:
            while self.in_flight and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.2)
        finally:  # the gateway stopping meanwhile closes it too
            await self.close()


def dns_entry(entry: str) -> tuple[str, int] | None:
    """``(name, port)`` of a ``dns:///name:port`` entry; None for a plain address."""
    if not entry.startswith(DNS_PREFIX):
        return None
    host, _, port = entry[len(DNS_PREFIX):].rpartition(":")
    return host, int(port)


async def resolve_addresses(host: str, port: int) -> list[str]:
    """The addresses DNS gives ``host`` (the system resolver, in a thread: it never blocks the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ipaddress.ip_address(host).version == 6 else f"{host}:{port}"


class Replicas:
    """The inference replicas and the router that picks among them.

    ``open_pool(address, server_name, tls, first)`` makes and starts a
    replica's pool (the gateway's channel settings; ``first``: at start-up); ``max_waiting`` (0: off) keeps calls off a
    replica whose queue holds that many.
    """

    def __init__(self, entries: list[str], open_pool: Callable, router: Router, *, tls: ClientTls,
                 max_waiting: int, resolve_s: float, server_name: str | None, drain_s: float = 30.0,
                 resolve: Callable[[str, int], Awaitable[list[str]]] | None = None, place_sessions: bool = True) -> None:
        self.entries = entries
        self.tls = tls
        self._resolve_name = resolve or resolve_addresses
        self._open_pool = open_pool
        self.router = router
        self.max_waiting = max_waiting
        self.resolve_s = resolve_s
        self.server_name = server_name
        self.replicas: dict[str, Replica] = {}
        self._resolver: asyncio.Task | None = None
        self._leaving: set[asyncio.Task] = set()
        #: How long a replica that left DNS keeps its pool for the calls still on it.
        self.drain_s = drain_s
        self.placement = Placement() if place_sessions else None

    @property
    def policy(self) -> Policy:
        return self.router.policy

    @property
    def pools(self) -> list[ChannelPool]:
        return [replica.pool for replica in self.replicas.values()]

    async def start(self) -> None:
        """Open a pool per replica (failing, or waiting, as the pools do); re-resolve DNS entries from now on."""
        await self._sync(await self._resolve(), first=True)
        if any(dns_entry(e) for e in self.entries):
            self._resolver = asyncio.create_task(self._follow_dns(), name="inference-resolver")

    async def _resolve(self) -> dict[str, str | None]:
        """Every replica's address, with the name to verify its certificate as (None: the dialled host)."""
        found: dict[str, str | None] = {}
        for entry in self.entries:
            named = dns_entry(entry)
            if named is None:
                found[entry] = self.server_name
                continue
            host, port = named
            for ip in await self._resolve_name(host, port):
                found[address(ip, port)] = self.server_name or host
        return found

    async def _sync(self, found: dict[str, str | None], *, first: bool = False) -> None:
        for gone in [a for a in self.replicas if a not in found]:
            replica = self.replicas.pop(gone)
            log.warning("inference replica %s (%s) left DNS; no new calls, its pool closes once the %d calls on it "
                        "are done", replica.name, gone, replica.in_flight)
            self._leaving.add(asyncio.create_task(replica.drain_and_close(self.drain_s), name=f"leave-{gone}"))
            self._leaving = {task for task in self._leaving if not task.done()}
        for new in [a for a in found if a not in self.replicas]:
            pool = await self._open_pool(new, found[new], self.tls, first)
            replica = self.replicas[new] = Replica(new, pool, found[new])
            replica.start_watch(named_by_replica=new not in self.entries)
            if not first:
                log.info("inference replica %s joined", new)

    async def _follow_dns(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_s)
            try:
                found = await self._resolve()
            except OSError as exc:  # the resolver is down: keep the replicas we have
                log.warning("re-resolving %s failed (%s); keeping %d replicas", self.entries, exc, len(self.replicas))
                continue
            if found:
                await self._sync(found)

    def reload_tls(self, tls: ClientTls) -> None:
        self.tls = tls  # for replicas that join later
        for replica in self.replicas.values():
            replica.pool.reload_tls(dataclasses.replace(tls, server_name=replica.server_name or tls.server_name))

    def choose(self, key: bytes, exclude: tuple[Replica, ...] = ()) -> Choice[Replica]:
        """The replica for ``key`` now; UNAVAILABLE when none is routable, RESOURCE_EXHAUSTED when all are full."""
        routable = [r for r in self.replicas.values() if r.routable and r not in exclude]
        if not routable:
            raise Unavailable("no inference replica is serving; retry shortly",
                              internal=f"replicas: {self.describe()}")
        open_ = [r for r in routable if not self.max_waiting or r.waiting < self.max_waiting]
        if not open_:
            raise ResourceExhausted(
                f"every inference replica's queue holds {self.max_waiting} or more requests "
                f"(AGW_GATEWAY_MAX_INFERENCE_WAITING={self.max_waiting}); retry shortly", retry_after_s=0.2)
        return self.router.choose(key, open_)

    def new_session_id(self, key_of: Callable[[str], bytes]) -> str:
        """A new session's id. Under ``affinity``, one whose routing key (``key_of(id)``) ranks first the routable
        replica this worker has placed the fewest sessions on (:class:`gateway.routing.Placement`); otherwise
        (placement off, another policy, one replica) a plain random id."""
        if self.placement is None or self.policy is not Policy.AFFINITY:
            return str(uuid.uuid4())
        return self.placement.session_id(key_of, [r.key for r in self.replicas.values() if r.routable])

    def describe(self) -> str:
        return ", ".join(f"{r.name}@{r.address} serving={r.pool.serving} load_known={r.load_known}"
                         for r in self.replicas.values()) or "none"

    async def close(self) -> None:
        if self._resolver is not None:
            await cancel_and_wait(self._resolver)
        await cancel_and_wait(*self._leaving)
        await asyncio.gather(*(replica.close() for replica in self.replicas.values()), return_exceptions=True)
        self.replicas.clear()
