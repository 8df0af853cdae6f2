"""Entry point: ``agentgw serve gateway [--workers N]`` or ``python -m gateway.main``.

Python serves one core per process, so the gateway runs N worker processes on
one port (SO_REUSEPORT; the kernel spreads connections), each with its own
event loop, pools and admission. With N = 1 the process serves by itself;
otherwise it supervises N children, forwards SIGTERM/SIGINT to them for a
graceful drain, and exits when they have.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from servicekit.server import configure_logging, main_for
from servicekit.settings import SettingsError, load_settings

from gateway.service import GatewayApp
from gateway.settings import GatewaySettings

log = logging.getLogger("gateway.main")


def _supervise(settings: GatewaySettings) -> int:
    workers = settings.workers
    env = {**os.environ, "AGW_GATEWAY_WORKERS": str(workers)}  # the workers' environment: settings stay one source
    if not settings.database_url:
        # Start the embedded server once, here, rather than racing N workers to it.
        import asyncio

        from gateway.database import embedded_postgres_url

        env["AGW_DATABASE_URL"] = asyncio.run(embedded_postgres_url(settings.embedded_postgres_dir))
    def worker_env(index: int) -> dict[str, str]:
        worker = {**env, "AGW_GATEWAY_WORKER_INDEX": str(index)}
        if settings.metrics_port is not None:  # one Prometheus endpoint per worker, on consecutive ports
            worker["AGW_GATEWAY_METRICS_PORT"] = str(settings.metrics_port + index)
        return worker

    children = [subprocess.Popen([sys.executable, "-m", "gateway.main"], env=worker_env(i)) for i in range(workers)]
    log.info("gateway: %d workers on one port: %s", workers, [c.pid for c in children])

    def forward(signum, _frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    return max(codes, key=abs)


def main(**overrides) -> int:
    """The gateway's entry point; ``overrides`` (``workers=N`` from ``agentgw serve``) win over the environment."""
    try:
        settings = load_settings(GatewaySettings, **overrides)
    except SettingsError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if settings.workers > 1 and settings.worker_index is None:
        if settings.port == 0:
            print("gateway: AGW_GATEWAY_WORKERS > 1 needs a fixed AGW_GATEWAY_PORT", file=sys.stderr)
            return 2
        return _supervise(settings)
    return main_for(GatewaySettings, GatewayApp, **overrides)


if __name__ == "__main__":
    sys.exit(main())
