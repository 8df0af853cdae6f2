"""One keepalive policy, from which both the client's and the server's options come.

A gRPC server that receives pings more often than its
``min_ping_interval_without_data`` allows counts "strikes" and, past
``max_ping_strikes``, closes the connection with GOAWAY ``too_many_pings``;
the client then drops to IDLE and pays a new TCP+TLS handshake on the next
call. Deriving both sides from the same numbers makes that impossible between
our own services.
"""

from __future__ import annotations

from dataclasses import dataclass

GrpcOptions = list[tuple[str, int | str]]


@dataclass(frozen=True)
class KeepalivePolicy:
    """How often an idle connection is pinged, and how long an ack may take."""

    time_s: float = 20.0
    timeout_s: float = 10.0

    @property
    def _time_ms(self) -> int:
        return int(self.time_s * 1000)

    def client_options(self) -> GrpcOptions:
        """Channel options: ping every ``time_s`` of idleness, calls or not."""
        return [
            ("grpc.keepalive_time_ms", self._time_ms),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            # Keep idle pooled channels alive between bursts: a dead connection
            # found by a ping is redialled in the background, not on a call.
            ("grpc.keepalive_permit_without_calls", 1),
            # The default (2) stops pinging after two pings without data, which
            # would let a NAT or load balancer silently drop an idle channel.
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def server_options(self) -> GrpcOptions:
        """Server options that accept exactly the pings :meth:`client_options` sends."""
        return [
            # The server also pings, to find clients that vanished.
            ("grpc.keepalive_time_ms", self._time_ms),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            # Our clients ping idle connections (see client_options).
            ("grpc.keepalive_permit_without_calls", 1),
            # Accept pings at half the client's interval: timers jitter, and a
            # ping that arrives early must not count as a strike. The default
            # (5 minutes) is what causes GOAWAY too_many_pings.
            ("grpc.http2.min_ping_interval_without_data_ms", self._time_ms // 2),
            ("grpc.http2.max_pings_without_data", 0),
        ]
