"""In-process servers on loopback, on the real bootstrap, always stopped."""

from __future__ import annotations

import functools
import itertools
import random
import socket
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from servicekit import running_service
from tests.support.scripted_inference import ScriptedApp, ScriptedSettings


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


@functools.cache
def _candidate_ports() -> Iterator[int]:
    """Every candidate port once, in a random order, then round again.

    One order per process, so that successive calls never hand out the same
    port: a port handed out is not bound until its process starts, and two
    random draws did collide (CI: `agentgw up` told its retrieval service and
    its gateway to listen on the same port).
    """
    low, high = _ephemeral_range()
    ports = [port for port in range(20_000, 32_000) if not low <= port <= high]
    random.shuffle(ports)
    return itertools.cycle(ports)


def free_port() -> int:
    """A loopback port free now (for a process that must be told its port in advance), and not one an earlier
    call in this process returned.

    Chosen outside the kernel's ephemeral range: a port the kernel handed out
    here could be handed out again, to any process's outgoing connection or
    bind to port 0 (vLLM's engine processes make several), before the process
    told to listen on it starts. Seen in CI: a gateway's metrics port taken
    while the inference service of the same stack was starting.
    """
    for port in itertools.islice(_candidate_ports(), 50):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every sampled port taken: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@asynccontextmanager
async def scripted_app(tls_dir: Path, *, credentials: grpc.ServerCredentials | None = None, **overrides):
    """A scripted Inference server on a free loopback port; yields (RunningService, ScriptedApp)."""
    settings = ScriptedSettings(tls_dir=tls_dir, **{"port": 0, "grace_s": 2.0, **overrides})
    app = ScriptedApp(settings)
    async with running_service(app, settings, credentials=credentials) as running:
        yield running, app


@asynccontextmanager
async def scripted_server(tls_dir: Path, **options):
    """A scripted Inference server on a free loopback port; yields RunningService."""
    async with scripted_app(tls_dir, **options) as (running, _):
        yield running
