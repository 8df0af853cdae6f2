"""``agentgw up``: the whole stack on one machine, on embedded defaults, no Docker.

Starts, in order, each step timed and printed:
1. dev certificates under ``$AGW_HOME/tls`` (kept when present);
2. Postgres: ``AGW_DATABASE_URL``, or a private server from the pgserver wheel
   (data in ``$AGW_HOME/postgres``, stopped again on exit);
3. the model: ``AGW_MODEL``, or the offline smoke model, built once;
4. retrieval (Qdrant Edge under ``$AGW_HOME`` unless ``AGW_QDRANT_URL``),
   inference and the gateway, as child processes, each waited on until its
   health check says SERVING;
5. the sample corpus, ingested into collection ``docs`` (and its hnsw_ef
   tuned) on the first run only.
Then it writes the connection file that ``agentgw chat``/``doctor`` read, and
waits. SIGINT or SIGTERM drains the services in reverse order, stops
Postgres and removes the connection file. Each service logs to
``$AGW_HOME/run/<service>/service.log``; spans go to ``$AGW_HOME/traces.jsonl``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import warnings
from contextlib import ExitStack, contextmanager

from agentgw.connection import Connection, MetricsPorts
from agentgw.pki import ensure_dev_pki
from servicekit.settings import ServiceSettings, load_settings
from agentgw.supervisor import ServiceProcess, ServiceStartError
from agentgw.edge import EDGE
from agentgw.edge_process import EdgeProcess

SAMPLE_COLLECTION = "docs"
#: Prometheus ports, one per service, when AGW_*_METRICS_PORT is not set.
DEFAULT_METRICS_PORTS = {"gateway": 9464, "retrieval": 9465, "inference": 9466}


class Progress:
    """One line per step: what it was and how long it took."""

    def __init__(self, out=sys.stdout) -> None:
        self.out = out

    @contextmanager
    def step(self, name: str):
        started = time.perf_counter()
        print(f"  {name} ...", end="", flush=True, file=self.out)
        try:
            yield
        except BaseException:
            print(" FAILED", flush=True, file=self.out)
            raise
        print(f" done in {time.perf_counter() - started:.1f} s", flush=True, file=self.out)


@contextmanager
def _postgres(settings: ServiceSettings, url: str | None, progress: Progress):
    if url:
        with progress.step("Postgres (AGW_DATABASE_URL)"):
            pass
        yield url
        return
    data = settings.home / "postgres"
    with progress.step(f"Postgres (embedded, data in {data})"):
        data.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # platformdirs complains about XDG_RUNTIME_DIR on servers
            warnings.simplefilter("ignore")
            import pgserver

            # "stop": this command owns the server and stops it on exit, so
            # nothing outlives Ctrl-C; the data stays for the next run.
            server = pgserver.get_server(data, cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


def _service(name: str, port: int, metrics_port: int, settings: ServiceSettings, env: dict[str, str], *,
             run_name: str | None = None) -> ServiceProcess:
    """``python -m <name>.main`` on fixed ports, logging under ``$AGW_HOME/run/<run_name or name>``."""
    prefix = f"AGW_{name.upper()}_"
    return ServiceProcess(f"{name}.main", settings.home / "run" / (run_name or name), settings.tls_dir, prefix, env={
        "AGW_HOME": str(settings.home),
        f"{prefix}PORT": str(port),
        f"{prefix}METRICS_PORT": str(metrics_port),
        "AGW_TRACE_FILE": str(settings.home / "traces.jsonl"),
        # Spans reach the file (and a collector) within half a second, so a
        # trace can be opened right after the answer.
        "OTEL_BSP_SCHEDULE_DELAY": os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "500"),
        **env,
    })


def _ports(name: str, settings_cls) -> tuple[int, int]:
    """The service's port and metrics port, as its own settings resolve them."""
    settings = load_settings(settings_cls)
    return settings.port, settings.metrics_port or DEFAULT_METRICS_PORTS[name]


async def _ingest_sample(connection: Connection) -> int:
    from agent.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from agent.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
    from servicekit.tenancy import physical_collection
    from retrieval.convert import passage_to_proto
    from retrieval.ingest import sample_corpus

    documents = [passage_to_proto(passage) for passage in sample_corpus(max_per_topic=2)]
    async with connection.gateway_channel() as channel:
        await gateway_pb2_grpc.AgentGatewayStub(channel).IngestDocuments(
            gateway_pb2.IngestDocumentsRequest(collection=SAMPLE_COLLECTION, documents=documents), timeout=300)
    async with connection.backend_channel("retrieval") as channel:
        await retrieval_pb2_grpc.RetrievalStub(channel).TuneCollection(retrieval_pb2.TuneCollectionRequest(
            collection=physical_collection(connection.identity, SAMPLE_COLLECTION), target_recall=0.95, k=5),
            timeout=300)
    return len(documents)


def _wait_for_signal() -> int:
    """Block until SIGINT/SIGTERM; return its number."""
    received = threading.Event()
    caught = []

    def handler(signum, _frame):
        caught.append(signum)
        received.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)
    while not received.wait(0.5):
        pass
    return caught[0]


def _interrupt_start_up() -> None:
    """SIGINT/SIGTERM during start-up unwind it (stopping what started), once.

    Installed explicitly because a shell script's background job inherits
    SIGINT ignored, and Python's default SIGTERM would skip all clean-up.
    """
    interrupted = []

    def handler(signum, _frame):
        if not interrupted:  # a second signal must not break the unwinding
            interrupted.append(signum)
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


def _connection(settings: ServiceSettings, ports: dict, processes: dict) -> Connection:
    """What ``agentgw chat`` and ``doctor`` need to find the running stack."""
    return Connection(
        gateway=f"127.0.0.1:{ports['gateway'][0]}",
        retrieval=f"127.0.0.1:{ports['retrieval'][0]}",
        inference=f"127.0.0.1:{ports['inference'][0]}",
        tls_dir=str(settings.tls_dir.resolve()),
        metrics=MetricsPorts(**{name: ports[name][1] for name in ("gateway", "retrieval", "inference")}),
        trace_file=str((settings.home / "traces.jsonl").resolve()),
        pids={name: process.pid for name, process in processes.items()},
        keepalive=settings.keepalive,
    )


def _ingest_once(settings: ServiceSettings, connection: Connection, progress: Progress) -> None:
    """The sample corpus, on the first run only (a marker file remembers it)."""
    marker = settings.home / f"sample-{SAMPLE_COLLECTION}.ingested"
    if not marker.exists():
        with progress.step(f"sample corpus into collection {SAMPLE_COLLECTION!r} (first run only)"):
            count = asyncio.run(_ingest_sample(connection))
        marker.write_text(f"{count}\n")


def _print_ready(connection: Connection, path, edge: bool = False) -> None:
    print(f"\nready: gateway at {connection.gateway} (mTLS, certificates in {connection.tls_dir})")
    if edge:
        print("  behind the edge (Envoy): Generate and Retrieve go straight to the backends, the rest to the gateway")
    print(f"  connection file {path}")
    print('  ask:     agentgw chat "What does the with statement do?"')
    print("  check:   agentgw doctor")
    print(f"  metrics: http://127.0.0.1:{connection.metrics.gateway}/metrics (gateway)")
    print("Ctrl-C drains and stops everything.", flush=True)


def _inference_replicas(count: int, port: int, metrics_port: int, settings: ServiceSettings,
                        env: dict[str, str]) -> dict:
    """``count`` inference services on consecutive ports (and metrics ports), named inference-1, -2, ...:
    the first keeps the plain name ``inference`` (its log folder, the connection file's backend)."""
    processes = {}
    for index in range(count):
        name = "inference" if index == 0 else f"inference-{index + 1}"
        processes[name] = (port + index, metrics_port + index, _service(
            "inference", port + index, metrics_port + index, settings,
            {"AGW_INFERENCE_REPLICA_NAME": f"inference-{index + 1}", **env}, run_name=name))
    return processes


def _edge_env(name: str, edge: bool) -> dict[str, str]:
    """With an edge, each service acts for the clients the edge forwards (and the backends serve it Generate or
    Retrieve)."""
    return {f"AGW_{name.upper()}_EDGE_CLIENTS": str(EDGE)} if edge else {}


def _start_services(settings: ServiceSettings, stack: ExitStack, database_url: str, inference_replicas: int,
                    progress: Progress, edge: bool = False) -> tuple[dict, dict]:
    """Retrieval and the inference replicas together, then the gateway in front of them (and the edge in front of
    all three); stopped in reverse."""
    from gateway.settings import GatewaySettings
    from inference.settings import InferenceSettings
    from retrieval.settings import RetrievalSettings

    ports, processes = {}, {}
    ports["retrieval"] = _ports("retrieval", RetrievalSettings)
    processes["retrieval"] = _service("retrieval", *ports["retrieval"], settings, _edge_env("retrieval", edge))
    stack.callback(processes["retrieval"].stop)
    for name, (port, metrics_port, process) in _inference_replicas(
            inference_replicas, *_ports("inference", InferenceSettings), settings, _edge_env("inference", edge)).items():
        ports[name], processes[name] = (port, metrics_port), process
        stack.callback(process.stop)
    ports["gateway"] = _ports("gateway", GatewaySettings)
    for name in [n for n in processes if n != "gateway"]:  # all start together; wait in turn
        with progress.step(f"{name} service on port {ports[name][0]}"):
            processes[name].wait_serving()
    targets = [f"127.0.0.1:{port}" for name, (port, _) in ports.items() if name.startswith("inference")]
    # Behind an edge, the edge takes the public port and the gateway a free one.
    gateway_port, gateway_metrics = (0, ports["gateway"][1]) if edge else ports["gateway"]
    processes["gateway"] = _service("gateway", gateway_port, gateway_metrics, settings, {
        **_edge_env("gateway", edge),
        "AGW_GATEWAY_WORKERS": "1",
        "AGW_DATABASE_URL": database_url,
        "AGW_GATEWAY_INFERENCE_TARGET": "",  # the replicas below, whatever the environment says
        "AGW_GATEWAY_INFERENCE_TARGETS": ",".join(targets),
        "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{ports['retrieval'][0]}",
    })
    stack.callback(processes["gateway"].stop)  # registered last: stopped first
    with progress.step(f"gateway on port {ports['gateway'][0] if not edge else 'chosen at start'}"):
        gateway_port = processes["gateway"].wait_serving()
    if edge:
        processes["edge"] = _start_edge(settings, stack, ports, gateway_port, progress)
    return ports, processes


def _start_edge(settings: ServiceSettings, stack: ExitStack, ports: dict, gateway_port: int,
                progress: Progress) -> EdgeProcess:
    """Envoy on the public port: Generate and Retrieve straight to the backends, the rest to the gateway."""
    from gateway.settings import GatewaySettings

    host = load_settings(GatewaySettings).host
    inference = [f"127.0.0.1:{port}" for name, (port, _) in ports.items() if name.startswith("inference")]
    with progress.step(f"edge (Envoy) on port {ports['gateway'][0]}, the gateway behind it on {gateway_port}"):
        edge = EdgeProcess(settings.home / "run" / "edge", settings.tls_dir, listen=f"{host}:{ports['gateway'][0]}",
                           gateway=f"127.0.0.1:{gateway_port}", inference=inference,
                           retrieval=f"127.0.0.1:{ports['retrieval'][0]}", trust_domain=settings.trust_domain,
                           keepalive_s=settings.keepalive_time_s)
        stack.callback(edge.stop)  # registered after the gateway's: stopped first
        edge.wait_answering()
    return edge


def up(inference_replicas: int = 1, edge: bool = False) -> int:
    """Run the stack until interrupted; 0 after a clean stop, 1 if a service failed to start.

    ``inference_replicas`` inference services start on consecutive ports, and
    the gateway routes across them (``AGW_GATEWAY_INFERENCE_TARGETS``).
    ``edge``: Envoy on the public port, in front of all three (agentgw.edge).
    """
    from gateway.settings import GatewaySettings
    from inference.settings import InferenceSettings
    from inference.smoke_model import build_smoke_model

    _interrupt_start_up()
    # Everything under AGW_HOME (keys, spans, logs, data) is this user's alone:
    # files 0600, folders 0700, here and in every service started from here.
    os.umask(0o077)
    settings = load_settings(ServiceSettings)
    progress = Progress()
    print(f"agentgw up: everything under {settings.home.resolve()}")
    with ExitStack() as stack:
        try:
            with progress.step(f"dev certificates ({settings.tls_dir})"):
                ensure_dev_pki(settings.tls_dir, trust_domain=settings.trust_domain)
            database_url = stack.enter_context(_postgres(settings, load_settings(GatewaySettings).database_url,
                                                         progress))
            inference_settings = load_settings(InferenceSettings)
            if not inference_settings.model:
                with progress.step("smoke model (offline, random weights)"):
                    build_smoke_model(inference_settings.smoke_model_dir)

            ports, processes = _start_services(settings, stack, database_url, inference_replicas, progress, edge)
        except ServiceStartError as exc:
            print(f"\nagentgw up: a service failed to start: {exc}", file=sys.stderr)
            return 1

        connection = _connection(settings, ports, processes)
        _ingest_once(settings, connection, progress)
        path = connection.write(settings.home)
        stack.callback(path.unlink, missing_ok=True)
        _print_ready(connection, path, edge)
        signum = _wait_for_signal()
        print(f"\n{signal.Signals(signum).name}: draining the gateway, then the backends", flush=True)
    print("stopped.")
    return 0

