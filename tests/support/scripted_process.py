"""The scripted Inference service in a process of its own: for drains, kills and restarts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from agentgw.supervisor import ServiceProcess

REPO = Path(__file__).resolve().parents[2]


class ScriptedProcess(ServiceProcess):
    """The scripted Inference service in its own process, recording its backend close."""

    def __init__(self, workdir: Path, tls_dir: Path, **env: str) -> None:
        self.closed_file = workdir / "closed"
        super().__init__(
            "tests.support.scripted_inference", workdir, tls_dir, "AGW_SCRIPTED_", cwd=REPO,
            env={"AGW_SCRIPTED_CLOSED_FILE": str(self.closed_file), "AGW_GRACE_S": "10", **env},
        )

    async def port(self) -> int:
        return self.wait_port(timeout=20)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait(self, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.process.poll()) is None:
            assert time.monotonic() < deadline, "server did not exit"
            await asyncio.sleep(0.05)
        return code
