"""The one factory for outbound gRPC channels.

Every channel our code opens comes from :func:`open_channel`, so every channel
gets the same mTLS, keepalive, message limits, load balancing and retry policy.
(qdrant-client shows what happens otherwise: its sync and async factories were
copied by hand and drifted apart.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.descriptor_pb2 import MethodOptions

from servicekit.keepalive import GrpcOptions, KeepalivePolicy
from servicekit.tls import ClientTls

_SAFE_TO_RETRY = (MethodOptions.NO_SIDE_EFFECTS, MethodOptions.IDEMPOTENT)


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's built-in retry for idempotent unary methods.

    Only UNAVAILABLE is retried: it means the request did not reach a handler
    (connection refused or reset, server draining). A streaming method is never
    retried by gRPC once it has received a response message, and we never mark
    Generate idempotent in the first place.
    """

    max_attempts: int = 3
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    backoff_multiplier: float = 2.0
    retryable_codes: tuple[str, ...] = ("UNAVAILABLE",)
    # Throttling stops retries when more than half the recent calls failed
    # (tokens fall below max_tokens / 2), so an outage is not multiplied.
    throttle_max_tokens: int = 10
    throttle_token_ratio: float = 0.1


def idempotent_methods(services: Iterable[ServiceDescriptor]) -> list[MethodDescriptor]:
    """Unary methods whose proto declares ``idempotency_level`` safe to repeat."""
    return [
        method
        for service in services
        for method in service.methods
        if method.GetOptions().idempotency_level in _SAFE_TO_RETRY
        and not method.client_streaming
        and not method.server_streaming
    ]


def service_config(services: Sequence[ServiceDescriptor], retry: RetryPolicy | None = RetryPolicy()) -> str:
    """The JSON service config for a channel to ``services``.

    ``round_robin`` spreads calls over every address a target resolves to (for
    example several inference replicas behind one DNS name); with one address
    it behaves like ``pick_first``.
    """
    config: dict = {"loadBalancingConfig": [{"round_robin": {}}]}
    methods = idempotent_methods(services)
    if retry is not None and methods:
        config["methodConfig"] = [
            {
                "name": [{"service": m.containing_service.full_name, "method": m.name} for m in methods],
                "retryPolicy": {
                    "maxAttempts": retry.max_attempts,
                    "initialBackoff": f"{retry.initial_backoff_s:g}s",
                    "maxBackoff": f"{retry.max_backoff_s:g}s",
                    "backoffMultiplier": retry.backoff_multiplier,
                    "retryableStatusCodes": list(retry.retryable_codes),
                },
            }
        ]
        config["retryThrottling"] = {
            "maxTokens": retry.throttle_max_tokens,
            "tokenRatio": retry.throttle_token_ratio,
        }
    return json.dumps(config, separators=(",", ":"))


@dataclass(frozen=True)
class ChannelSpec:
    """Everything that decides how a channel to one backend behaves."""

    target: str
    tls: ClientTls | None
    services: Sequence[ServiceDescriptor] = ()
    keepalive: KeepalivePolicy = field(default_factory=KeepalivePolicy)
    max_message_bytes: int = 16 * 1024 * 1024
    retry: RetryPolicy | None = field(default_factory=RetryPolicy)
    user_agent: str = "agent-gateway"
    #: Bytes a backend may send on one stream before this side reads them; None lets gRPC size it from its
    #: bandwidth-delay probes (``bdp_probe``).
    stream_window_bytes: int | None = None

    def options(self) -> GrpcOptions:
        """The channel arguments, each with the reason it is not gRPC's default."""
        options: GrpcOptions = [
            # Each channel owns its connection. By default channels with equal
            # arguments share subchannels process-wide, so a "pool" of M
            # channels would silently be one HTTP/2 connection.
            ("grpc.use_local_subchannel_pool", 1),
            # Defaults are 4 MiB received and unlimited sent; use one explicit
            # bound both ways, equal to the servers'.
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.service_config", service_config(self.services, self.retry)),
            # Ignore service configs from DNS TXT records: ours is the policy.
            ("grpc.service_config_disable_resolution", 1),
            ("grpc.primary_user_agent", self.user_agent),
            # Redial a lost backend within about a second, not up to two
            # minutes (gRPC's default backoff): a restarted backend must be
            # back in use without restarting its callers.
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 1000),
            *self.keepalive.client_options(),
        ]
        if self.stream_window_bytes is not None:
            # What a stream holds for a reader that has stopped is its window. gRPC's probes grow it with the
            # bytes that arrive within a ping's round trip, which a loaded host stretches: a stalled Chat client
            # left 6 to 24 MiB in the gateway (docs/benchmarks.md, "A stalled client's stream, pinned").
            options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", self.stream_window_bytes)]
        if self.tls is not None and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return options


def open_channel(spec: ChannelSpec) -> grpc.aio.Channel:
    """Open an aio channel (lazily connected; see :func:`wait_ready`).

    Use it as ``async with open_channel(spec) as channel:`` or close it with
    ``await channel.close()``.
    """
    if spec.tls is None:
        return grpc.aio.insecure_channel(spec.target, options=spec.options())
    return grpc.aio.secure_channel(spec.target, spec.tls.credentials(), options=spec.options())


async def wait_ready(channel: grpc.aio.Channel, *, timeout_s: float, target: str) -> None:
    """Connect now and wait until READY, or raise :class:`ChannelNotReady`."""
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except asyncio.TimeoutError:
        state = channel.get_state(try_to_connect=False)
        raise ChannelNotReady(f"{target} not ready after {timeout_s:g}s (state {state.name})") from None


class ChannelNotReady(ConnectionError):
    """A channel did not reach READY in time; the message names the target."""


#: What grpc.aio puts in a call's status when a write fails inside Core: a
#: placeholder, overwritten once the peer's own status is received. If that
#: status had already arrived, grpc.aio overwrites it instead, and it is lost.
CORE_WRITE_PLACEHOLDER = "Internal error from Core"


def status_lost(error: grpc.aio.AioRpcError) -> bool:
    """Whether ``error`` is grpc.aio's placeholder (:data:`CORE_WRITE_PLACEHOLDER`), not a status a peer sent."""
    return error.code() == grpc.StatusCode.INTERNAL and error.details() == CORE_WRITE_PLACEHOLDER


async def status_after_failed_write(call, *, settle_s: float = 1.0, poll_s: float = 0.005) -> grpc.aio.AioRpcError:
    """The status a peer ended ``call`` with, after a write to it failed.

    A server that refuses a client-streaming call at once (authorization,
    UNIMPLEMENTED) can end it before or during our first write. grpc.aio then
    sets a client-side INTERNAL "Internal error from Core" as the call's status
    and replaces it when the server's status arrives, a moment later. Reading
    the status at once can see the placeholder (a CI run did), so this waits
    up to ``settle_s`` for the real one; a placeholder still there after that
    is returned as it is (:func:`status_lost` tells it apart).
    """
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + settle_s
    while (await call.code() == grpc.StatusCode.INTERNAL and await call.details() == CORE_WRITE_PLACEHOLDER
           and loop.time() < give_up_at):
        await asyncio.sleep(poll_s)
    return grpc.aio.AioRpcError(await call.code(), await call.initial_metadata(), await call.trailing_metadata(),
                                await call.details(), await call.debug_error_string())
