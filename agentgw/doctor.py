"""``agentgw doctor``: check a running stack against each known cause of slow agent turns.

Every check measures something on the live stack and prints PASS, WARN or
FAIL with the value it saw and, when not PASS, the fix. The exit status is
the worst result (0 pass, 1 warn, 2 fail), so CI can gate on it.
The root causes come from the analysis behind this project: no prefix-cache
reuse, scheduler queueing, a TLS handshake per call, a cold tokenizer,
blocking I/O on the event loop and oversized vector-search payloads.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import ssl
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from cryptography import x509

from agent.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from agent.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from agentgw.checks import Check, Status
from agentgw.connection import Connection
from agentgw.edge import PASSTHROUGH_ROUTES
from agentgw.host_hazards import cpu_frequencies, cpu_frequency_check, memory_high_events, memory_pressure_check
from gateway.settings import CPUS_PER_WORKER, default_workers
from servicekit.identity import Identity, IdentityFiles
from servicekit.procfs import cpu_scheduling_group, descendants

#: An agent turn's typical length (prompt with history and context, plus the answer).
TYPICAL_SEQ_TOKENS = 2048
#: Bytes per search result above which payloads are not trimmed (a text chunk plus a source is ~1 KB).
PAYLOAD_WARN_BYTES = 2048
PAYLOAD_FAIL_BYTES = 8192
#: A certificate in use that expires sooner than this is a WARN (an expired one a FAIL).
CERT_WARN_DAYS = 7
#: A shared prefix long enough to fill several KV blocks.
PREFIX = "The doctor asks about a shared prefix so the second request can reuse its KV cache. " * 12


# -- inference ---------------------------------------------------------------

async def inference_checks(connection: Connection) -> list[Check]:
    async with connection.backend_channel("inference") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
        checks = [Check(
            "prefix caching on", Status.PASS if info.prefix_caching else Status.FAIL,
            f"prefix_caching={info.prefix_caching}",
            "unset AGW_INFERENCE_ENABLE_PREFIX_CACHING (on by default): without it every turn re-reads "
            "the system prompt and history (first token 186 ms -> 47 ms in the analysis)")]

        async def generate(suffix: str) -> inference_pb2.GenerationResult:
            request = inference_pb2.GenerateRequest(
                prompt=PREFIX + suffix, sampling=inference_pb2.SamplingParams(max_tokens=1, temperature=0))
            return [m async for m in stub.Generate(request, timeout=60)][-1].result

        await generate(f" First {time.time_ns()}?")
        second = await generate(f" Second {time.time_ns()}?")
        cached = second.usage.cached_prompt_tokens
        checks.append(Check(
            "prefix cache hit on a repeated prefix", Status.PASS if cached > 0 else Status.FAIL,
            f"{cached}/{second.usage.prompt_tokens} prompt tokens from cache",
            "turn prefix caching on, and keep prompts prefix-stable (system prompt and history first)"))
        checks.append(Check(
            "chunked prefill", Status.PASS if info.chunked_prefill else Status.WARN,
            f"chunked_prefill={info.chunked_prefill}",
            "unset AGW_INFERENCE_ENABLE_CHUNKED_PREFILL: long prefills then stall every decode in the batch"))

        timings = []
        for _ in range(3):
            started = time.perf_counter()
            await stub.Tokenize(inference_pb2.TokenizeRequest(text=PREFIX), timeout=10)
            timings.append((time.perf_counter() - started) * 1000)
        cold = timings[0] > 5 * min(timings[1:]) + 20
        checks.append(Check(
            "tokenizer warm", Status.WARN if cold else Status.PASS,
            f"first Tokenize {timings[0]:.1f} ms, later {min(timings[1:]):.1f} ms",
            "the service warms its tokenizer before SERVING; a slow first call means it was restarted "
            "without warm-up or the tokenizer runs on the event loop"))
        # A full batch of typical sequences must fit the KV cache, or the
        # scheduler preempts and requests queue (the analysis's scheduler cause).
        per_seq = min(TYPICAL_SEQ_TOKENS, info.max_context_tokens)
        needed = info.max_num_seqs * per_seq
        fits = info.kv_cache_tokens == 0 or needed <= info.kv_cache_tokens
        checks.append(Check(
            "max_num_seqs against KV memory", Status.PASS if fits else Status.WARN,
            f"max_num_seqs={info.max_num_seqs} x {per_seq} tokens = {needed} of {info.kv_cache_tokens} KV tokens"
            f" on {info.device}",
            "leave AGW_INFERENCE_MAX_NUM_SEQS unset so it is sized from KV-cache memory "
            "(GPU: int(VRAM GiB x 12)), or give the cache more memory"))
    return checks

# -- the public API ------------------------------------------------------------

#: The public methods an edge sends straight to a backend, by name, and that backend (its settings' prefix).
PASSTHROUGH_BACKENDS = {path.rsplit("/", 1)[1]: backend for path, backend in PASSTHROUGH_ROUTES.items()}


def _ping_generate() -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request=inference_pb2.GenerateRequest(
        prompt="ping", sampling=inference_pb2.SamplingParams(max_tokens=1)))


async def public_method_checks(connection: Connection) -> list[Check]:
    """Generate and Retrieve answered on the public port, as a tenant calls them. Behind an edge they go straight to
    a backend, which serves them only when it believes the edge: a backend without AGW_<SERVICE>_EDGE_CLIENTS
    answers UNIMPLEMENTED, which a client cannot tell from a wrong address."""
    checks = []
    async with connection.gateway_channel() as channel:
        stub = gateway_pb2_grpc.AgentGatewayStub(channel)
        probe = gateway_pb2.RetrieveRequest(request=retrieval_pb2.SearchRequest(
            collection=f"agentgw-doctor-probe-{time.time_ns()}", text="ping", top_k=1))
        calls = {"Generate": lambda: _drain(stub.Generate(_ping_generate(), timeout=30)),
                 # A collection that does not exist: NOT_FOUND is the method answering.
                 "Retrieve": lambda: stub.Retrieve(probe, timeout=10)}
        for method, call in calls.items():
            backend = PASSTHROUGH_BACKENDS[method]
            try:
                await call()
                checks.append(Check(f"{method} served", Status.PASS, "answered"))
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                answered = method == "Retrieve" and code == grpc.StatusCode.NOT_FOUND
                status = Status.PASS if answered else Status.FAIL
                measured = f"{code.name}: {exc.details()}"
                fix = (f"behind an edge, {method} goes straight to the {backend} service, which serves it only with "
                       f"AGW_{backend.upper()}_EDGE_CLIENTS=service/edge (agentgw up --edge, compose/edge.yml and "
                       "deploy/k8s/components/edge set it)" if code == grpc.StatusCode.UNIMPLEMENTED
                       else f"is the {backend} service up and reachable from the public port?")
                checks.append(Check(f"{method} served", status, "answered" if answered else measured, fix))
    return checks


async def _drain(stream) -> None:
    async for _message in stream:
        pass


# -- gateway -------------------------------------------------------------------

async def gateway_checks(connection: Connection) -> list[Check]:
    async with connection.gateway_channel() as channel:
        stub = gateway_pb2_grpc.AgentGatewayStub(channel)
        try:
            for _ in range(3):  # calls through the inference pool too, so reuse shows
                await _drain(stub.Generate(_ping_generate(), timeout=30))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # reported by public_method_checks
                raise
    async with connection.gateway_operator_channel() as channel:  # GetStats serves operators only
        stats = await gateway_pb2_grpc.AgentGatewayStub(channel).GetStats(gateway_pb2.GetStatsRequest(), timeout=10)
    checks = []
    for backend in stats.backends:
        calls = sum(c.calls for c in backend.channels)
        connects = sum(c.connections_ready for c in backend.channels)
        reused = connects <= len(backend.channels) * 2
        checks.append(Check(
            f"channels reused ({backend.replica.name or backend.name})", Status.PASS if reused else Status.WARN,
            f"{connects} connections for {calls} calls on {len(backend.channels)} channels",
            "connections keep dropping: check keepalive settings (AGW_KEEPALIVE_TIME_S) against any proxy's "
            "idle timeout, and the backend's health"))
    db = stats.database
    warm = db.open >= db.min_size > 0
    checks.append(Check(
        "Postgres pool warm, acquire bounded", Status.PASS if warm and db.acquire_timeout_ms else Status.WARN,
        f"{db.open} open ({db.idle} idle), min {db.min_size}, max {db.max_size}, "
        f"acquire timeout {db.acquire_timeout_ms} ms",
        "set AGW_GATEWAY_DB_MIN_SIZE >= 1 so turns do not pay for a connection, and keep "
        "AGW_GATEWAY_DB_ACQUIRE_TIMEOUT_S finite"))
    checks.append(_loop_check("gateway", stats.event_loop))
    checks.append(public_limits_check(stats.limits))
    checks.append(workers_check(stats.workers, stats.cpu_count or 1))
    checks += replica_checks([b.replica for b in stats.backends if b.name == "inference"], stats.inference_routing)
    return checks


#: A replica given more than this multiple of the even share of calls is skewed (with enough calls to tell).
SKEW_FACTOR = 1.5
SKEW_MIN_CALLS = 20


def replica_checks(replicas, routing: str) -> list[Check]:
    """Each inference replica's prefix-cache hit rate (as this worker's generations saw it), and the load split."""
    checks = []
    for replica in replicas:
        rate = replica.cached_prompt_tokens / replica.prompt_tokens if replica.prompt_tokens else None
        checks.append(Check(
            f"replica {replica.name}", Status.PASS if replica.routable else Status.WARN,
            f"{'routable' if replica.routable else 'NOT routable'}, running {replica.running_requests}, waiting "
            f"{replica.waiting_requests}, KV {replica.kv_cache_usage:.0%}; prefix cache "
            + (f"{rate:.0%} of {replica.prompt_tokens} prompt tokens" if rate is not None else "not measured yet"),
            "the replica is not serving or its WatchLoad stream is down: check its health and logs"))
    routed = [r.routed_affinity + r.routed_spill + r.routed_retry + r.routed_balanced for r in replicas]
    total = sum(routed)
    if len(replicas) > 1:
        heaviest = max(routed) / (total / len(replicas)) if total else 0.0
        skewed = total >= SKEW_MIN_CALLS and heaviest > SKEW_FACTOR
        spills = sum(r.routed_spill for r in replicas)
        checks.append(Check(
            "replica load split", Status.WARN if skewed else Status.PASS,
            f"{routing}: " + " / ".join(f"{r.name} {n}" for r, n in zip(replicas, routed))
            + f" calls ({spills} spilled past the load margin)",
            f"one replica takes {heaviest:.1f}x the even share: a few hot sessions or tenants dominate. Lower "
            "AGW_GATEWAY_ROUTING_LOAD_MARGIN to spill them sooner, or add replicas"))
    return checks


def workers_check(workers: int, cpus: int) -> Check:
    """The gateway's workers against the rule its default follows (``gateway.settings.default_workers``)."""
    rule = default_workers(cpus)
    return Check(
        "gateway workers against CPUs", Status.PASS if 1 <= workers <= rule else Status.WARN,
        f"{workers} workers on {cpus} usable CPUs (the rule gives {rule})",
        f"AGW_GATEWAY_WORKERS: each worker keeps about {CPUS_PER_WORKER} CPUs busy at saturation (its event loop and "
        "gRPC's poller thread); more workers than the CPUs carry only contend with each other and the engine. "
        "Unset it to follow the rule")

def _loop_check(service: str, loop: str) -> Check:
    return Check(
        f"uvloop ({service})", Status.PASS if loop == "uvloop" else Status.WARN,
        f"event loop: {loop or 'unknown (no metrics endpoint)'}",
        "run the service through its entry point (agentgw serve), which installs uvloop"
        if loop else f"set AGW_{service.upper()}_METRICS_PORT so the doctor can read it")

def loop_checks_from_metrics(connection: Connection) -> list[Check]:
    checks = []
    for service in ("retrieval", "inference"):
        port = getattr(connection.metrics, service)
        loop = ""
        if port:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
                for line in text.splitlines():
                    if line.startswith("agw_process_info{") and 'event_loop="' in line:
                        loop = line.split('event_loop="', 1)[1].split('"', 1)[0]
            except OSError:
                loop = ""
        checks.append(_loop_check(service, loop))
    return checks

# -- TLS -----------------------------------------------------------------------

def _hops(connection: Connection) -> list[tuple[str, str, Identity]]:
    """Each TLS endpoint, with the identity the doctor presents to it (a tenant to the gateway, else the operator)."""
    operator = Identity.operator(connection.operator)
    return [("client -> gateway", connection.gateway, Identity.tenant(connection.identity)),
            ("gateway -> retrieval", connection.retrieval, operator),
            ("gateway -> inference", connection.inference, operator)]

def certificate_checks(connection: Connection) -> list[Check]:
    """Every certificate in use: each service's (as it presents it now) and the doctor's own."""
    tls_dir = Path(connection.tls_dir)
    checks = []
    for hop, address, identity in _hops(connection):
        if address:
            checks.append(served_certificate_check(hop.split(" -> ")[1], address, IdentityFiles.of(tls_dir, identity)))
    for identity in {identity for _, _, identity in _hops(connection)}:
        path = IdentityFiles.of(tls_dir, identity).cert
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
        except (OSError, ValueError) as exc:
            checks.append(Check(f"certificate valid ({identity})", Status.FAIL, f"cannot read {path}: {exc}",
                                "issue it with agentgw certs"))
            continue
        checks.append(expiry_check(f"certificate valid ({identity})", cert))
    return checks

def tls_checks(connection: Connection) -> list[Check]:
    tls_dir = Path(connection.tls_dir)
    checks = []
    for hop, address, identity in _hops(connection):
        if not address:
            checks.append(Check(f"TLS 1.3 ({hop})", Status.WARN, "address unknown", "run against agentgw up's "
                                "connection file to check the backend hops"))
            continue
        context = _client_context(IdentityFiles.of(tls_dir, identity), verify=True)
        host, port = address.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                with context.wrap_socket(raw, server_hostname=host) as tls:
                    version = tls.version() or "?"
        except (OSError, ssl.SSLError) as exc:
            checks.append(Check(f"TLS 1.3 ({hop})", Status.FAIL, f"handshake failed: {exc}",
                                "check the certificates in the TLS folder (agentgw certs)"))
            continue
        checks.append(Check(f"TLS 1.3 ({hop})", Status.PASS if version == "TLSv1.3" else Status.WARN,
                            f"negotiated {version}; channels are long-lived, one handshake per connection",
                            "upgrade OpenSSL/BoringSSL so TLS 1.3 is offered (one round trip less per handshake)"))
    return checks

# -- retrieval -----------------------------------------------------------------

async def retrieval_checks(connection: Connection, collections: list[str]) -> list[Check]:
    from servicekit.tenancy import physical_collection

    checks = []
    async with connection.gateway_channel() as gateway_channel, \
            connection.backend_channel("retrieval") as retrieval_channel:
        gateway = gateway_pb2_grpc.AgentGatewayStub(gateway_channel)
        retrieval = retrieval_pb2_grpc.RetrievalStub(retrieval_channel)
        for name in collections:
            physical = physical_collection(connection.identity, name)
            try:
                collection = (await retrieval.GetCollection(
                    retrieval_pb2.GetCollectionRequest(name=physical), timeout=10)).collection
            except grpc.aio.AioRpcError as exc:
                checks.append(Check(f"collection {name!r}", Status.WARN, f"{exc.code().name}: {exc.details()}",
                                    "ingest it first (agentgw up ingests 'docs'), or pass --collection"))
                continue
            found = (await gateway.Retrieve(gateway_pb2.RetrieveRequest(request=retrieval_pb2.SearchRequest(
                collection=name, text="How does the for statement work?", top_k=5)), timeout=30)).response
            sizes = [len(hit.payload.SerializeToString()) for hit in found.results]
            per_result = sum(sizes) / max(len(sizes), 1)
            defaults = set(collection.default_payload_fields)
            extra = sorted({key for hit in found.results for key in hit.payload.keys()} - defaults)
            if extra:  # the service returns whole payloads: trimming is off
                status, fix = Status.FAIL, ("unset AGW_RETRIEVAL_TRIM_PAYLOADS (on by default): a Search naming no "
                                            "fields must get only the collection's default_payload_fields")
            else:
                status = (Status.FAIL if per_result > PAYLOAD_FAIL_BYTES else
                          Status.WARN if per_result > PAYLOAD_WARN_BYTES else Status.PASS)
                fix = ("set the collection's default_payload_fields to what prompts use (text, source), or name "
                       "payload_fields per request: untrimmed payloads cost bytes and milliseconds")
            checks.append(Check(
                f"Search payloads trimmed ({name})", status,
                f"{per_result:.0f} bytes/result, default fields {sorted(defaults)}"
                + (f", also returned {extra}" if extra else ""), fix))
            tuned = collection.tuned_ef > 0
            checks.append(Check(
                f"hnsw_ef tuned ({name})", Status.PASS if tuned else Status.WARN,
                f"ef={collection.tuned_ef}, recall {collection.tuned_recall:.3f}" if tuned else "not tuned",
                f"agentgw tune-ef --collection {physical}: picks the smallest ef that meets the recall target"))
    return checks

# -- CPU scheduling ------------------------------------------------------------

def scheduling_check(connection: Connection) -> Check:
    """The services and vLLM's engine processes share one CPU scheduling group.

    Across groups the kernel shares CPU between groups first: next to
    vLLM's spinning CPU workers we measured the gateway's process runnable
    but unscheduled for seconds (docs/architecture.md, "CPU scheduling").
    """
    name = "one CPU scheduling group"
    pids = dict(connection.pids)
    if not pids:
        return Check(name, Status.WARN, "process ids unknown (--target given)",
                     "run on the machine of agentgw up, which records them")
    if "inference" in pids:
        pids |= {f"inference child {child}": child for child in sorted(descendants(pids["inference"]))}
    groups = {service: cpu_scheduling_group(pid) for service, pid in pids.items()}
    if None in groups.values():
        missing = ", ".join(service for service, group in groups.items() if group is None)
        return Check(name, Status.WARN, f"cannot read the groups of: {missing}",
                     "run the doctor on the services' host, as the user that runs them")
    if len(set(groups.values())) == 1:
        return Check(name, Status.PASS, f"{len(groups)} processes in {next(iter(groups.values()))}")
    listed = "; ".join(f"{service}: {group}" for service, group in groups.items())
    return Check(name, Status.WARN, listed,
                 "start the services from one session (agentgw up does) or put them in one cgroup; else give "
                 "the gateway its own cores (cpuset) and watch agw_process_runqueue_wait_seconds_total")


class Doctor:
    """Runs every check against one stack; each check is a function of its own, below."""

    def __init__(self, connection: Connection, collections: list[str]) -> None:
        self.connection = connection
        self.collections = collections

    def certificate_checks(self) -> list[Check]:
        return certificate_checks(self.connection)

    def scheduling_check(self) -> Check:
        return scheduling_check(self.connection)

    def memory_events(self) -> dict[str, int | None]:
        """Each service's cgroup ``memory.high`` count now (None where the host does not expose it)."""
        return {service: memory_high_events(pid) for service, pid in self.connection.pids.items()}

    async def run(self) -> list[Check]:
        connection = self.connection
        checks: list[Check] = []
        memory_before = self.memory_events()
        sections: list[tuple[str, Callable[[], Awaitable[list[Check]]]]] = [
            # Retrieval before the gateway: its searches go through the
            # gateway's pool, so the channel-reuse check sees real calls.
            ("inference", lambda: inference_checks(connection)),
            ("retrieval", lambda: retrieval_checks(connection, self.collections)),
            ("public API", lambda: public_method_checks(connection)),
            ("gateway", lambda: gateway_checks(connection)),
        ]
        for name, section in sections:
            if name in ("inference", "retrieval") and not getattr(connection, name):
                checks.append(Check(f"{name} service", Status.WARN, "address unknown (--target given)",
                                    "run on the machine of agentgw up, or without --target"))
                continue
            try:
                checks += await section()
            except (grpc.aio.AioRpcError, ConnectionError, OSError) as exc:
                detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                checks.append(Check(f"{name} reachable", Status.FAIL, detail, f"is the {name} service running?"))
        # Read right after the sections' calls, while the stack was busy: a throttled core shows under load.
        checks.append(cpu_frequency_check(await asyncio.to_thread(cpu_frequencies)))
        for blocking in (tls_checks, certificate_checks, loop_checks_from_metrics):
            checks += await asyncio.to_thread(blocking, connection)
        checks.append(await asyncio.to_thread(scheduling_check, connection))
        checks.append(memory_pressure_check(memory_before, self.memory_events()))
        return checks


def public_limits_check(limits) -> Check:
    """The public port bounds one client and one tenant (docs/architecture.md, Security model)."""
    problems = []
    if not 0 < limits.max_concurrent_streams <= 1000:
        problems.append("AGW_GATEWAY_MAX_CONCURRENT_STREAMS (1-1000)")
    if not 0 < limits.max_receive_bytes <= 16 * 1024 * 1024:
        problems.append("AGW_GATEWAY_MAX_RECEIVE_BYTES (at most 16 MiB)")
    if not limits.max_connection_idle_ms or not limits.max_connection_age_ms:
        problems.append("AGW_GATEWAY_MAX_CONNECTION_IDLE_S and _AGE_S")
    if not limits.max_in_flight_per_tenant:
        problems.append("AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT (0 lets one tenant take every slot)")
    if not limits.max_connections:
        problems.append("AGW_GATEWAY_MAX_CONNECTIONS (this gateway reports no bound on its connections: upgrade it)")
    measured = (f"{limits.max_connections} connections, "
                f"{limits.max_concurrent_streams} streams/connection, {limits.max_receive_bytes // 1024} KiB/message, "
                f"idle {limits.max_connection_idle_ms / 1000:g} s, age {limits.max_connection_age_ms / 1000:g} s, "
                f"{limits.max_in_flight_per_tenant} of {limits.max_in_flight} in flight per tenant")
    if problems:
        return Check("public port bounded", Status.WARN, measured, "set " + "; ".join(problems))
    return Check("public port bounded", Status.PASS, measured)


def _client_context(files: IdentityFiles, *, verify: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.set_alpn_protocols(["h2"])
    context.check_hostname = False  # the dev certificates name "localhost"; the CA is what is checked
    if not verify:  # to read a certificate that would fail verification (expired), not to trust it
        context.verify_mode = ssl.CERT_NONE
    return context


def expiry_check(name: str, cert: x509.Certificate, now: dt.datetime | None = None) -> Check:
    """FAIL for an expired certificate, WARN within CERT_WARN_DAYS of its end, else PASS."""
    now = now or dt.datetime.now(dt.timezone.utc)
    left = cert.not_valid_after_utc - now
    serial = format(cert.serial_number, "x")
    when = f"expires {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC (serial {serial})"
    fix = ("renew it: agentgw certs --renew (services and pools take renewed files without a restart; "
           "docs/architecture.md, Security model)")
    if left <= dt.timedelta(0):
        return Check(name, Status.FAIL, f"EXPIRED: {when}", fix)
    if left < dt.timedelta(days=CERT_WARN_DAYS):
        return Check(name, Status.WARN, f"{when}, in {left.total_seconds() / 86400:.1f} days", fix)
    return Check(name, Status.PASS, f"{when}, in {left.days} days")


def served_certificate_check(service: str, address: str, client: IdentityFiles) -> Check:
    """The certificate ``service`` presents on a new connection now (read without verifying it), checked for expiry."""
    name = f"certificate valid ({service}, served)"
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            with _client_context(client, verify=False).wrap_socket(raw, server_hostname=host) as tls:
                der = tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError) as exc:
        return Check(name, Status.FAIL, f"handshake failed: {exc}", "check the certificates (agentgw certs)")
    return expiry_check(name, x509.load_der_x509_certificate(der))


def report(checks: list[Check]) -> tuple[str, Status]:
    worst = max((c.status for c in checks), default=Status.PASS)
    counts = {s: sum(c.status is s for c in checks) for s in Status}
    lines = [c.line() for c in checks]
    lines.append(f"\n{counts[Status.PASS]} pass, {counts[Status.WARN]} warn, {counts[Status.FAIL]} fail")
    return "\n".join(lines), worst
