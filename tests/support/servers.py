"""In-process servers on loopback, on the real bootstrap, always stopped."""

from __future__ import annotations

import socket
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from servicekit import running_service
from tests.support.scripted_inference import ScriptedApp, ScriptedSettings


def free_port() -> int:
    """A loopback port free now (for a process that must be told its port in advance)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@asynccontextmanager
async def scripted_app(tls_dir: Path, *, credentials: grpc.ServerCredentials | None = None, **overrides):
    """A scripted Inference server on a free loopback port; yields (RunningService, ScriptedApp)."""
    settings = ScriptedSettings(tls_dir=tls_dir, port=0, grace_s=2.0, **overrides)
    app = ScriptedApp(settings)
    async with running_service(app, settings, credentials=credentials) as running:
        yield running, app


@asynccontextmanager
async def scripted_server(tls_dir: Path, **options):
    """A scripted Inference server on a free loopback port; yields RunningService."""
    async with scripted_app(tls_dir, **options) as (running, _):
        yield running
