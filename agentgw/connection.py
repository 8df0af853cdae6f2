"""The connection file: how clients on this machine reach a stack that ``agentgw up`` started.

``$AGW_HOME/connection.json`` holds the addresses, the TLS folder and the
metrics ports, so ``agentgw chat`` and ``agentgw doctor`` need no flags.
It is written once every service is SERVING and removed when the stack stops.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from servicekit.channels import ChannelSpec, open_channel
from servicekit.identity import DEFAULT_OPERATOR, DEFAULT_TENANT, Identity
from servicekit.keepalive import KeepalivePolicy
from servicekit.tls import ClientTls

FILE_NAME = "connection.json"


class NoConnection(Exception):
    """No stack is known: no connection file and no explicit target."""


@dataclass(frozen=True)
class MetricsPorts:
    gateway: int | None = None
    retrieval: int | None = None
    inference: int | None = None


@dataclass(frozen=True)
class Connection:
    gateway: str
    tls_dir: str
    retrieval: str = ""
    inference: str = ""
    #: The tenant whose certificate talks to the gateway's public API.
    identity: str = DEFAULT_TENANT
    #: The operator whose certificate talks to the backends and the gateway's GetStats.
    operator: str = DEFAULT_OPERATOR
    metrics: MetricsPorts = field(default_factory=MetricsPorts)
    trace_file: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    #: This machine's keepalive policy (AGW_KEEPALIVE_*), not the file's: clients and servers must agree.
    keepalive: KeepalivePolicy = field(default_factory=KeepalivePolicy, compare=False)

    def with_keepalive(self, keepalive: KeepalivePolicy) -> Connection:
        return replace(self, keepalive=keepalive)

    def write(self, home: Path) -> Path:
        path = Path(home) / FILE_NAME
        tmp = path.with_suffix(".tmp")
        data = {key: value for key, value in asdict(self).items() if key != "keepalive"}
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)  # readers never see half a file
        return path

    @classmethod
    def read(cls, home: Path) -> Connection:
        path = Path(home) / FILE_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise NoConnection(
                f"no running stack found: {path} does not exist. Start one with 'agentgw up' "
                "(same AGW_HOME), or pass --target and --tls-dir") from None
        data["metrics"] = MetricsPorts(**data.get("metrics", {}))
        return cls(**data)

    @classmethod
    def for_cli(cls, settings, target: str | None, tls_dir: Path | None, identity: str,
                operator: str = DEFAULT_OPERATOR) -> Connection:
        """What ``agentgw chat`` and ``doctor`` connect with: :meth:`for_client` under the settings' AGW_HOME,
        with the settings' keepalive policy (the servers' ping policy comes from the same numbers)."""
        return cls.for_client(settings.home, target, tls_dir, identity, operator).with_keepalive(settings.keepalive)

    @classmethod
    def for_client(cls, home: Path, target: str | None, tls_dir: Path | None, identity: str,
                   operator: str = DEFAULT_OPERATOR) -> Connection:
        """An explicit ``--target``/``--tls-dir``, else the connection file under ``home``."""
        if not target:
            return cls.read(home)
        if not tls_dir:
            raise NoConnection("--target needs --tls-dir (the folder of agentgw certs: tenant/<name>/, operator/<name>/)")
        return cls(gateway=target, tls_dir=str(tls_dir), identity=identity, operator=operator)

    def spec(self, target: str, identity: Identity) -> ChannelSpec:
        """How a client channel to ``target`` is built: ``identity``'s certificate, this machine's keepalive."""
        return ChannelSpec(target=target, tls=ClientTls.for_identity(Path(self.tls_dir), identity),
                           keepalive=self.keepalive)

    def _channel(self, target: str, identity: Identity):
        return open_channel(self.spec(target, identity))

    def gateway_channel(self):
        """A channel to the gateway as this machine's tenant."""
        return self._channel(self.gateway, Identity.tenant(self.identity))

    def tenant_channel(self, tenant: str):
        """A channel to the gateway as tenant ``tenant`` (its certificate must be in the TLS folder)."""
        return self._channel(self.gateway, Identity.tenant(tenant))

    def gateway_operator_channel(self):
        """A channel to the gateway as the operator (for GetStats, which serves operators only)."""
        return self._channel(self.gateway, Identity.operator(self.operator))

    def backend_channel(self, name: str):
        """A channel to the retrieval or inference service, as the operator (never as the gateway)."""
        target = {"retrieval": self.retrieval, "inference": self.inference}[name]
        if not target:
            raise NoConnection(f"the {name} service's address is unknown (connection made with --target)")
        return self._channel(target, Identity.operator(self.operator))
