"""Settings shared by every service, read from ``AGW_*`` environment variables.

Each service subclasses :class:`ServiceSettings` and gives its own fields the
service's prefix (``AGW_INFERENCE_PORT``), while the fields declared here keep
one name for the whole deployment (``AGW_HOME``, ``AGW_KEEPALIVE_TIME_S``):
a client and a server must agree on them, so they must not differ by service.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from servicekit.identity import (
    DEFAULT_TRUST_DOMAIN,
    Identity,
    IdentityFiles,
    check_identity_pattern,
    validate_trust_domain,
)
from servicekit.keepalive import KeepalivePolicy

ENV_PREFIX = "AGW_"

S = TypeVar("S", bound="ServiceSettings")

#: A TCP port; 0 picks a free one. Subclasses declare ``port: Port = 50053``.
Port = Annotated[int, Field(ge=0, le=65535, description="Port to listen on; 0 picks a free one.")]


class SettingsError(ValueError):
    """A setting has a bad value; the message names each variable at fault."""


def deployment_field(default: Any, name: str, **constraints: Any) -> Any:
    """A field read from ``AGW_<NAME>`` whatever the subclass's prefix.

    Only the prefixed name is an alias: a bare alias such as "home" would be
    matched, case-insensitively, against the environment's ``HOME``. Code
    still passes the field name, thanks to ``populate_by_name``.
    """
    return Field(default, validation_alias=f"{ENV_PREFIX}{name.upper()}", **constraints)


class ServiceSettings(BaseSettings):
    """What every service needs: local state, TLS, listening, keepalive, drain.

    Subclasses set ``model_config = prefixed_config("inference")`` and declare
    ``port: Port = <default>`` (the ``Port`` type keeps the range check).
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore", populate_by_name=True)

    home: Path = deployment_field(Path(".agentgw"), "home", description="Folder for all local state.")
    tls_dir: Path | None = deployment_field(
        None, "tls_dir", description="Folder of the CA, server and client certificates; default $AGW_HOME/tls."
    )
    host: str = Field("127.0.0.1", description="Address to listen on; 0.0.0.0 or [::] for all.")
    port: Port = 0
    port_file: Path | None = Field(None, description="If set, the bound port is written here once listening (removed on exit).")
    grace_s: float = deployment_field(10.0, "grace_s", gt=0, description="Drain period after SIGTERM, in seconds.")
    keepalive_time_s: float = deployment_field(
        20.0, "keepalive_time_s", ge=1.0, description="Idle time before a keepalive ping, in seconds."
    )
    keepalive_timeout_s: float = deployment_field(
        10.0, "keepalive_timeout_s", gt=0, description="Wait for a ping's ack before the connection is dropped."
    )
    max_message_bytes: int = deployment_field(
        16 * 1024 * 1024, "max_message_bytes", ge=64 * 1024, description="Largest gRPC message sent or received."
    )
    log_level: str = deployment_field(
        "INFO", "log_level", pattern="^(DEBUG|INFO|WARNING|ERROR)$", description="DEBUG, INFO, WARNING or ERROR."
    )
    nice: int = Field(
        0, ge=0, le=19, description="Scheduling niceness the process (and what it starts) takes at start, 0-19. On "
        "a host the whole stack shares, backends at 5 shorten the gateway's wait for a CPU and the turns' p99, and "
        "lengthen their p50 (docs/benchmarks.md, \"The backends at nice 5\"); 0 by default.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Serve Prometheus metrics on this port (/metrics); unset: no metrics endpoint."
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address /metrics listens on (plain HTTP, no authentication): loopback unless a "
        "private network's scraper needs it.")
    trace_content: bool = deployment_field(
        False, "trace_content", description="Record prompt and output text on spans (AGW_TRACE_CONTENT=1); off by default."
    )
    trace_file: Path | None = deployment_field(
        None, "trace_file", description="Also append every finished span to this JSON-lines file (agentgw trace reads it).")
    trust_domain: str = deployment_field(
        DEFAULT_TRUST_DOMAIN, "trust_domain",
        description="SPIFFE trust domain of every identity; certificates of any other are refused.")
    identity_from_cn: bool = deployment_field(
        False, "identity_from_cn",
        description="Compatibility only, weaker: take a certificate without a SPIFFE ID by its common name "
        "(CN gateway is the gateway, any other CN a tenant).")
    tls_reload_s: float = deployment_field(
        2.0, "tls_reload_s", ge=0,
        description="How often certificate files are checked for renewal (servers on new handshakes, outbound "
        "pools in the background); 0: never, a restart rotates them.")
    identity: str = Field(
        "", description="The service identity this process presents (service/<name>): its certificate and key are "
        "in $AGW_TLS_DIR/service/<name>/.")
    allowed_clients: str = Field(
        "service/gateway,operator/*", description="Identities allowed to call this service, comma-separated "
        "kind/name patterns (* matches any name). Health answers any verified certificate.")
    edge_clients: str = Field(
        "", description="Identities of edge proxies (service/edge) whose calls act for the client certificate they "
        "verified and forward in x-forwarded-client-cert, comma-separated patterns; empty: no edge, the header is "
        "never read. On the backends it also serves the public Generate or Retrieve to the edge.")
    denied_clients_file: Path | None = Field(
        None, description="File of identities (kind/name) or certificate serials (hex) to refuse, one per line; "
        "read again when it changes, no restart.")

    @model_validator(mode="after")
    def _derive_and_check(self) -> ServiceSettings:
        if self.tls_dir is None:
            # Frozen model: derived defaults are set once, here, and never again.
            object.__setattr__(self, "tls_dir", self.home / "tls")
        validate_trust_domain(self.trust_domain)
        if self.identity:
            Identity.service(self.identity)  # a valid name, or ValueError naming it
        for pattern in (*self.allowed_client_patterns, *self.edge_client_patterns):
            check_identity_pattern(pattern)
        if self.keepalive_timeout_s >= self.keepalive_time_s * 4:
            raise ValueError("AGW_KEEPALIVE_TIMEOUT_S should be well under AGW_KEEPALIVE_TIME_S")
        return self

    @property
    def allowed_client_patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.allowed_clients.split(",") if p.strip())

    @property
    def edge_client_patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.edge_clients.split(",") if p.strip())

    @property
    def identity_files(self) -> IdentityFiles:
        """This service's own certificate, key and CA (``$AGW_TLS_DIR/service/<identity>/``)."""
        if not self.identity:
            raise ValueError("these settings name no service identity")
        return IdentityFiles.of(self.tls_dir, Identity.service(self.identity))

    @property
    def keepalive(self) -> KeepalivePolicy:
        """The keepalive policy both ends of every channel derive their options from."""
        return KeepalivePolicy(time_s=self.keepalive_time_s, timeout_s=self.keepalive_timeout_s)

    @property
    def listen_address(self) -> str:
        host = self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port}"


#: Passwords that are placeholders, never secrets (compose's example used to carry one).
PLACEHOLDER_SECRETS = frozenset({"change-me", "changeme", "password", "secret"})


def read_secret(path: Path, what: str) -> str:
    """A secret from a file (a Docker or Kubernetes secret), stripped; ValueError naming ``what`` if unusable."""
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if not value or value.lower() in PLACEHOLDER_SECRETS:
        raise ValueError(f"{what}: {path} holds an empty or placeholder secret; put a real one there")
    return value


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") is reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def prefixed_config(service: str) -> SettingsConfigDict:
    """The pydantic config for a service's settings: its own ``AGW_<SERVICE>_`` prefix."""
    return SettingsConfigDict(env_prefix=f"{ENV_PREFIX}{service.upper()}_")


def environment_names(cls: type[BaseSettings]) -> dict[str, str]:
    """Each setting's environment variable, mapped to its field name (what docs and checks compare against)."""
    prefix = cls.model_config.get("env_prefix", "")
    names = {}
    for name, field in cls.model_fields.items():
        alias = field.validation_alias if isinstance(field.validation_alias, str) else None
        names[alias or f"{prefix}{name}".upper()] = name
    return names


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Read ``cls`` from the environment, failing with every bad variable named.

    Raises:
        SettingsError: one line per bad value, as ``AGW_NAME: reason (got 'x')``.
    """
    try:
        return cls(**overrides)
    except ValidationError as exc:
        prefix = cls.model_config.get("env_prefix", ENV_PREFIX)
        lines = []
        for error in exc.errors():
            loc = [str(part) for part in error["loc"]]
            variable = loc[0] if loc and loc[0].startswith(ENV_PREFIX) else f"{prefix}{'_'.join(loc)}".upper()
            if not loc:
                variable = cls.__name__
            got = f" (got {error['input']!r})" if "input" in error and not isinstance(error["input"], dict) else ""
            lines.append(f"{variable}: {error['msg']}{got}")
        raise SettingsError("invalid settings:\n  " + "\n  ".join(lines)) from None
