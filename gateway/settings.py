"""Settings of the gateway (``AGW_GATEWAY_*``, plus ``AGW_INSECURE_DEV``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from servicekit.procfs import available_cpus
from servicekit.public_api import PublicApiSettings
from servicekit.settings import (
    PLACEHOLDER_SECRETS,
    Port,
    ServiceSettings,
    deployment_field,
    is_loopback,
    prefixed_config,
    read_secret,
)


#: CPUs one gateway worker keeps busy at saturation: its event loop, plus gRPC's poller thread, which py-spy
#: found in 15-20% of a loaded worker's samples (docs/benchmarks.md, "The gateway under load").
CPUS_PER_WORKER = 1.25


def default_workers(cpus: int) -> int:
    """The worker rule: one worker per ``CPUS_PER_WORKER`` usable CPUs (affinity and cgroup quota), at least one.

    On 2 CPUs that is 1: a second worker there measured no better than one
    (and, before the byte-level passthrough, far worse), since both compete
    with each other's poller threads and whatever else runs on the host.
    """
    return max(1, int(cpus / CPUS_PER_WORKER))


class GatewaySettings(ServiceSettings, PublicApiSettings):
    """The public port, the backends, pools, deadlines and admission; the public API's bounds (PublicApiSettings)."""

    model_config = prefixed_config("gateway")

    port: Port = 50051
    identity: str = Field(
        "gateway", description="The service identity this process presents, to its clients and to the backends; "
        "its files are in $AGW_TLS_DIR/service/<name>/.")
    allowed_clients: str = Field(
        "tenant/*", description="Identities allowed on the public API, comma-separated kind/name patterns. "
        "GetStats answers operators (operator/*) only.")
    reuse_port: bool = Field(True, description="SO_REUSEPORT, so several worker processes share the port.")
    workers: int = Field(default_factory=lambda: default_workers(available_cpus()), gt=0,
                         description="Processes on the port; default one per 1.25 usable CPUs, at least 1.")
    worker_index: int | None = Field(
        None, ge=0, description="Set by the supervisor in each worker it starts; not for operators.")
    insecure_dev: bool = deployment_field(
        False, "insecure_dev", description="Serve plaintext without client certificates (development only)."
    )
    inference_target: str | None = Field(
        None, description="The inference service's address: the one-replica form of AGW_GATEWAY_INFERENCE_TARGETS "
        "(default 127.0.0.1:50053); setting both is an error.")
    inference_targets: str = Field(
        "", description="Inference replicas, comma-separated: host:port entries, and dns:///name:port entries that "
        "are re-resolved every AGW_GATEWAY_INFERENCE_RESOLVE_S, one replica per address (a headless Service).")
    inference_resolve_s: float = Field(10.0, gt=0, description="How often dns:/// inference entries are re-resolved.")
    inference_routing: Literal["affinity", "least_loaded", "round_robin"] = Field(
        "affinity", description="How a call picks its inference replica: affinity (rendezvous hashing of the session, "
        "or of the prompt's leading chunk, with a load bound), least_loaded, or round_robin.")
    # 8, not 4: with sessions placed evenly, 4 still spilled 1-5% of a replica bench's turns in the tails of its
    # rounds (a CPU engine queues while prefilling), each a whole prompt prefilled without its prefix; 8 spilled
    # none, cached more (0.73 against 0.69-0.72) and had a lower TTFT p99 in two runs of three (docs/benchmarks.md).
    routing_load_margin: int = Field(
        8, ge=0, description="affinity: a key's first replica is passed over while it is full (requests wait in its "
        "queue, or its batch limit is reached) and its load (waiting + running) exceeds the least-loaded replica's by "
        "more than this.")
    routing_prefix_chars: int = Field(
        2048, gt=0, description="affinity, calls without a session: how much of the prompt's leading text (system "
        "prompt, first messages) makes the routing key.")
    place_sessions: bool = Field(
        True, description="affinity: CreateSession chooses each new session's id so that this worker's sessions "
        "spread evenly over the replicas (routing stays a hash of the id); off: a plain random id, the hash alone "
        "decides the split.")
    retrieval_target: str = Field("127.0.0.1:50052", description="Retrieval service address.")
    backend_server_name: str | None = Field(
        None, description="Verify backends' certificates as this name instead of the dialled host."
    )
    channels_per_backend: int = Field(2, gt=0, le=64, description="Long-lived connections kept to each backend.")
    connect_timeout_s: float = Field(10.0, gt=0, description="Wait for each backend channel at start-up.")
    on_backend_down: Literal["fail", "wait"] = Field(
        "fail", description="At start-up: exit naming the backend, or start NOT_SERVING and keep retrying."
    )
    default_deadline_s: float = Field(30.0, gt=0, description="Backend deadline when the caller set none.")
    backend_probe_s: float = Field(
        1.0, ge=0, description="Liveness: each backend channel is probed (a health Check) this often; two "
        "unanswered probes with nothing received meanwhile replace its connection and end its calls UNAVAILABLE, "
        "so a frozen or partitioned backend costs seconds, not a deadline. 0: off (keepalive alone).")
    backend_probe_timeout_s: float = Field(2.0, gt=0, description="How long a liveness probe waits for its answer.")
    deadline_margin_ms: float = Field(20.0, ge=0, description="Taken off the caller's deadline for backend calls.")
    max_inference_waiting: int = Field(
        0, ge=0, description="Route no call to a replica whose queue holds this many, and refuse (RESOURCE_EXHAUSTED) "
        "when every replica's does (0: do not look).")
    database_url: str | None = deployment_field(
        None, "database_url", description="PostgreSQL DSN; unset means a private server from the pgserver wheel."
    )
    database_password_file: Path | None = deployment_field(
        None, "database_password_file", description="File holding the Postgres password (a Docker or Kubernetes "
        "secret), used with AGW_DATABASE_URL instead of a password in the URL.")
    db_min_size: int = Field(2, ge=1, description="Connections opened at start and kept.")
    db_max_size: int = Field(10, ge=1, description="Most connections per worker process.")
    db_acquire_timeout_s: float = Field(2.0, gt=0, description="Wait for a free connection before UNAVAILABLE.")
    db_command_timeout_s: float = Field(5.0, gt=0, description="Deadline of each SQL command.")
    db_statement_cache_size: int = Field(100, ge=0, description="Prepared statements per connection; 0 for pgbouncer.")

    client_trace: Literal["link", "continue"] = Field(
        "link", description="A tenant's W3C trace context: link (a new trace per call, the client's span as a link) "
        "or continue (one trace end to end). Either way the gateway decides sampling and drops baggage.")
    max_sessions_per_tenant: int = Field(
        100_000, gt=0, description="Sessions one tenant may hold; past it CreateSession gets RESOURCE_EXHAUSTED.")
    max_concurrent_streams: int = Field(
        100, gt=0, description="Streams one client connection may hold open at once on the public port; more wait "
        "in the client's HTTP/2 queue (RFC 9113 advises at least 100, so as not to limit parallelism). With "
        "max_receive_bytes it bounds a connection's buffered requests.")
    max_connections: int = Field(
        4096, gt=0, description="Client connections one worker process holds on the public port; past it a new one "
        "is closed as it arrives, so a flood of connections costs bounded memory and descriptors.")
    handshake_timeout_s: float = Field(
        10.0, gt=0, description="A public connection that has not finished its TLS handshake by then is closed "
        "(gRPC's default is 120 s), so a slow or silent client cannot hold a connection's place.")
    max_connection_idle_s: float = Field(
        300.0, gt=0, description="A public connection with no call for this long is closed (GOAWAY).")
    max_connection_age_s: float = Field(
        1800.0, gt=0, description="A public connection is closed after this long (GOAWAY), so clients behind an L4 "
        "balancer spread over new gateway processes; calls in flight get the grace below.")
    max_connection_age_grace_s: float = Field(30.0, ge=0, description="Grace for calls in flight on an aged connection.")
    max_receive_bytes: int = Field(
        4 * 1024 * 1024, ge=64 * 1024, description="Largest message the public port accepts; larger ones are "
        "refused before they are decoded (internal hops keep AGW_MAX_MESSAGE_BYTES).")
    stream_pending_bytes: int = Field(
        64 * 1024, ge=1024, le=16 * 1024 * 1024, description="Chat text waiting behind a write to a slow client is "
        "merged into one delta up to this many bytes; at the cap the gateway stops reading from the inference "
        "service until the client reads, so flow control reaches the engine.")
    stream_send_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="A Chat or Generate stream whose client has taken nothing for this long (a "
        "write waiting, or Chat's pending delta full) is ended DEADLINE_EXCEEDED, and its generation with it (nginx's "
        "send_timeout): a client that stops reading holds an engine slot and its KV cache for at most this long.")
    backend_stream_window_bytes: int = Field(
        256 * 1024, ge=64 * 1024, le=64 * 1024 * 1024, description="Bytes a backend may send on one stream before "
        "the gateway reads them (HTTP/2's stream window, fixed: gRPC's probes would size it from round trips, which "
        "a loaded host stretches). With the pending cap, what a client that stops reading holds in the gateway.")
    history_messages: int = Field(50, gt=0, description="Most past messages a turn loads.")
    history_token_budget: int = Field(2048, gt=0, description="History beyond this many tokens is trimmed, oldest first.")
    history_window_step: int = Field(
        16, gt=0, multiple_of=2,
        description="The history window starts on a multiple of this many messages, so long sessions keep hitting "
        "the prefix cache; even, so the window opens on a user message.")
    open_generate_early: bool = Field(
        True, description="In turns that search, open the inference call (OpenGenerate) while history and retrieval "
        "run, send the system prompt and history on it once loaded (tokenized while retrieval runs), and the request "
        "when the prompt is ready: the call's setup and most tokenizing leave the first token's path. Turns without "
        "a search, and all turns when off: a Generate call once the prompt is ready (also the fallback when the "
        "inference service lacks OpenGenerate).")
    prefill_prefix: bool = Field(
        True, description="With the early call: ask the inference service to prefill the system prompt and history "
        "it sent ahead while retrieval runs (it does when its engine has room), so the request prefills only the "
        "turn's own messages.")
    prefill_min_tokens: int = Field(
        64, ge=0, description="Ask for the prefill only when about this many tokens of the history are new to the "
        "engine's cache (the previous turn's answer and question): below it, one more engine request costs more "
        "than it saves (docs/benchmarks.md).")
    history_budget_s: float = Field(1.0, gt=0, description="Longest a turn waits for its history.")
    retrieval_budget_s: float = Field(0.5, gt=0, description="Longest a turn waits for context before going on without.")
    retrieval_top_k: int = Field(4, gt=0, description="Passages retrieved when a request names no top_k.")
    fail_on_retrieval_error: bool = Field(False, description="Fail the turn, instead of degrading, when retrieval fails.")
    default_system_prompt: str = Field(
        "You are a helpful assistant. Answer from the context when it is relevant.",
        description="System prompt when a request sends none; keep it stable so its KV is reused.",
    )

    @model_validator(mode="after")
    def _check_database_secret(self) -> GatewaySettings:
        if self.database_url:
            url = urlsplit(self.database_url)
            # An empty password is "none" (trust or peer authentication), acceptable on this machine only:
            # a Unix socket (no host, as the embedded server's URL has) or loopback.
            local = not url.hostname or is_loopback(url.hostname)
            if url.password is not None and (url.password.lower() in PLACEHOLDER_SECRETS or
                                             (not url.password and not local)):
                raise ValueError("AGW_DATABASE_URL carries an empty or placeholder password; set a real one, "
                                 "or leave it out and use AGW_DATABASE_PASSWORD_FILE")
        if self.database_password_file is not None:
            self.database_password()  # readable and real, now
        return self

    def database_password(self) -> str | None:
        """The password from AGW_DATABASE_PASSWORD_FILE, if set (read at start; ValueError if unusable)."""
        if self.database_password_file is None:
            return None
        return read_secret(self.database_password_file, "AGW_DATABASE_PASSWORD_FILE")

    @model_validator(mode="after")
    def _check_insecure_dev(self) -> GatewaySettings:
        if self.insecure_dev and not is_loopback(self.host):
            raise ValueError(f"AGW_INSECURE_DEV serves plaintext to anyone who can reach the port, as tenant dev: "
                             f"it is refused unless AGW_GATEWAY_HOST is loopback (got {self.host!r})")
        return self

    @model_validator(mode="after")
    def _check_history_window(self) -> GatewaySettings:
        # The window carries between history_messages - step + 1 and
        # history_messages messages: a step past the limit could carry none.
        if self.history_window_step > self.history_messages:
            raise ValueError(f"AGW_GATEWAY_HISTORY_WINDOW_STEP ({self.history_window_step}) should be at most "
                             f"AGW_GATEWAY_HISTORY_MESSAGES ({self.history_messages})")
        return self

    @model_validator(mode="after")
    def _check_inference_targets(self) -> GatewaySettings:
        if self.inference_target and self.inference_targets:
            raise ValueError("set AGW_GATEWAY_INFERENCE_TARGETS (replicas) or AGW_GATEWAY_INFERENCE_TARGET (one), "
                             "not both")
        for entry in self.inference_target_list:
            host, sep, port = entry.removeprefix("dns:///").rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"AGW_GATEWAY_INFERENCE_TARGETS: {entry!r} is not host:port or dns:///name:port")
        if len(set(self.inference_target_list)) != len(self.inference_target_list):
            raise ValueError("AGW_GATEWAY_INFERENCE_TARGETS lists a replica twice")
        return self

    @property
    def inference_target_list(self) -> list[str]:
        """The inference replicas' entries (AGW_GATEWAY_INFERENCE_TARGETS, else the one target)."""
        if self.inference_targets:
            return [entry.strip() for entry in self.inference_targets.split(",") if entry.strip()]
        return [self.inference_target or "127.0.0.1:50053"]

    @property
    def embedded_postgres_dir(self):
        return self.home / "postgres"
