"""servicekit: what the three agent-gateway services are built from.

Settings, the server bootstrap (health, reflection, mTLS, graceful drain), the
outbound channel factory, the keepalive policy both ends share, identities
and the domain errors that map to gRPC status codes. This module only
re-exports; the code lives in the submodules.
"""

from servicekit.channels import ChannelNotReady, ChannelSpec, RetryPolicy, open_channel, service_config, wait_ready
from servicekit.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    from_rpc_error,
)
from servicekit.keepalive import KeepalivePolicy
from servicekit.identity import Identity, IdentityFiles
from servicekit.server import Health, RunningService, ServiceApp, main_for, run, running_service, serve_until_signalled
from servicekit.settings import Port, ServiceSettings, SettingsError, deployment_field, load_settings, prefixed_config
from servicekit.tls import CertificateFiles, ClientTls, ServerTls, TlsConfigError

__all__ = [
    "Aborted",
    "AlreadyExists",
    "ChannelNotReady",
    "ChannelSpec",
    "CertificateFiles",
    "ClientTls",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Health",
    "Identity",
    "IdentityFiles",
    "Internal",
    "InvalidArgument",
    "KeepalivePolicy",
    "NotFound",
    "PermissionDenied",
    "Port",
    "ResourceExhausted",
    "RetryPolicy",
    "RunningService",
    "ServerTls",
    "ServiceApp",
    "ServiceError",
    "ServiceSettings",
    "Unauthenticated",
    "SettingsError",
    "TlsConfigError",
    "Unavailable",
    "Unimplemented",
    "deployment_field",
    "from_rpc_error",
    "load_settings",
    "main_for",
    "open_channel",
    "run",
    "running_service",
    "serve_until_signalled",
    "service_config",
    "prefixed_config",
    "wait_ready",
]
