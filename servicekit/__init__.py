"""servicekit: what the three agent-gateway services are built from.

Settings, the server bootstrap (health, reflection, mTLS, graceful drain), the
outbound channel factory, the keepalive policy both ends share, identities
and the domain errors that map to gRPC status codes. This module
re-exports only what the services' callers (tests, benches, tools) use from
the kit as a whole; the code lives in the submodules, and the services import
those directly.
"""

from servicekit.channels import ChannelSpec, RetryPolicy, open_channel, service_config, wait_ready
from servicekit.errors import (
    InvalidArgument,
    ResourceExhausted,
    from_rpc_error,
)
from servicekit.keepalive import KeepalivePolicy
from servicekit.identity import Identity, IdentityFiles
from servicekit.server import main_for, running_service
from servicekit.settings import Port, ServiceSettings, SettingsError, deployment_field, load_settings, prefixed_config
from servicekit.tls import ClientTls

__all__ = [
    "ChannelSpec",
    "ClientTls",
    "Identity",
    "IdentityFiles",
    "InvalidArgument",
    "KeepalivePolicy",
    "Port",
    "ResourceExhausted",
    "RetryPolicy",
    "ServiceSettings",
    "SettingsError",
    "deployment_field",
    "from_rpc_error",
    "load_settings",
    "main_for",
    "open_channel",
    "running_service",
    "service_config",
    "prefixed_config",
    "wait_ready",
]
