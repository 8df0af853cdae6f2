"""Shared pieces of the benchmarks: statistics, tables, JSON, throwaway PKI.

Benchmarks measure and report; they never assert. Each prints the command
that produced its figures, so docs/benchmarks.md can quote it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/x.py` from anywhere
    sys.path.insert(0, str(REPO))


from servicekit.procfs import cpu_seconds, descendants, runqueue_wait_s, thread_cpu_s  # noqa: E402
from servicekit.stats import percentile  # noqa: E402 - after the sys.path fix above


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values),
    }


def round_order(names: Sequence, round_: int) -> list:
    """The order in which round ``round_`` (from 0) runs ``names``: a row of a Williams square, reversed on odd rounds.

    Rotating one fixed order (as these benches did until 2026-12-07) puts
    every path after the same predecessor in all rounds but the one it
    opens, so a path may inherit that one's wake-ups and cache state (a
    second plain Envoy, identical to the first, trailed it in 3 of 4 runs
    so; docs/benchmarks.md says how it did since). Here rounds 2k and
    2k + 1 run row k of a Williams square forwards and backwards: over 2n
    rounds of n paths every path follows every other exactly twice, and
    takes every place twice; any two consecutive rounds from an even one put
    each neighbouring pair in both orders.
    """
    count = len(names)
    base, low, high = [0], 1, count - 1
    while len(base) < count:  # 0, 1, n-1, 2, n-2, ...: each difference between neighbours once
        base.append(low)
        low += 1
        if len(base) < count:
            base.append(high)
            high -= 1
    row = [names[(index + round_ // 2) % count] for index in base]
    return row[::-1] if round_ % 2 else row


def added_p50(row: dict, base: dict) -> float:
    """What ``row``'s path adds to ``base``'s p50, ms.

    Where both ran in the same rounds (``round_p50``: each round ran every
    path back to back, bench/gateway_overhead.py), the median of the rounds'
    paired differences: the host's and the engine's drift between rounds
    falls on both paths of a round alike. Otherwise the difference of the
    two p50s (one round, or a row from before rounds existed).
    """
    ours, theirs = row.get("round_p50") or [], base.get("round_p50") or []
    if len(ours) > 1 and len(ours) == len(theirs):
        return statistics.median(a - b for a, b in zip(ours, theirs))
    return row["p50"] - base["p50"]


def print_table(title: str, rows: list[dict], columns: Sequence[str]) -> None:
    print(f"\n{title}")
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "" if value is None else str(value)


def command_line() -> str:
    """The invocation, with the script path relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return "python " + " ".join(shlex.quote(str(a)) for a in [shown, *sys.argv[1:]])


def write_json(path: Path | None, data: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"command": command_line(), **data}, indent=2))
        print(f"\nwrote {path}")


def scrape(metrics_port: int) -> dict[str, float]:
    """A service's Prometheus samples, ``name{labels}`` to value; empty if unreadable."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"agw-bench-{prefix}-"))


def add_serve_arguments(parser: argparse.ArgumentParser, kinds: Sequence[str]) -> None:
    """The hidden arguments with which a bench runs one of its own servers in a child (:func:`child_servers`)."""
    parser.add_argument("--serve", choices=kinds, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tls", type=Path, help=argparse.SUPPRESS)


def served_as_child(args: argparse.Namespace, serve) -> bool:
    """Whether this process is one of :func:`child_servers`' children; if so, ``serve(kind, port, tls)`` has run
    on uvloop until the process was stopped."""
    if not args.serve:
        return False
    import uvloop

    uvloop.run(serve(args.serve, args.port, args.tls))
    return True


@contextmanager
def child_servers(script: str, kinds: Sequence[str], tls: Path) -> Iterator[tuple[dict[str, int], dict[str, int]]]:
    """One process per server kind, each ``script --serve KIND --port PORT --tls TLS``; yields their ports and
    pids, each by kind, and stops them on the way out."""
    from tests.support.servers import free_port

    ports = {kind: free_port() for kind in kinds}
    processes = {kind: subprocess.Popen([sys.executable, script, "--serve", kind, "--port", str(port),
                                         "--tls", str(tls)]) for kind, port in ports.items()}
    try:
        yield ports, {kind: process.pid for kind, process in processes.items()}
    finally:
        for process in processes.values():
            process.terminate()
            process.wait()


def echo_handler(service: str, behavior):
    """A generic handler serving ``behavior`` as ``/<service>/Check``, in health's Check messages (an echo server's
    one method, for the benches that measure a server's own cost per call)."""
    import grpc
    from grpc_health.v1 import health_pb2

    check = grpc.unary_unary_rpc_method_handler(behavior, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                                                response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(service, {"Check": check})


async def serve_mtls(server, port: int, tls: Path) -> None:
    """Run the grpc.aio ``server`` on loopback ``port`` with the dev PKI's retrieval identity, mTLS, until stopped."""
    import grpc

    folder = tls / "service" / "retrieval"
    credentials = grpc.ssl_server_credentials([((folder / "key.pem").read_bytes(), (folder / "cert.pem").read_bytes())],
                                              root_certificates=(tls / "ca.pem").read_bytes(), require_client_auth=True)
    server.add_secure_port(f"127.0.0.1:{port}", credentials)
    await server.start()
    await server.wait_for_termination()


def process_threads_cpu_s(pid: int) -> float:
    """Every thread's on-CPU time of process ``pid`` (schedstat), seconds."""
    return sum(thread_cpu_s(pid).values())


def dev_pki(root: Path, tenants: tuple[str, ...] = ("dev",)) -> Path:
    """A dev CA, server certificate and a client certificate per tenant under ``root/tls``."""
    from agentgw.pki import ensure_dev_pki

    return ensure_dev_pki(root / "tls", tenants=tenants).root


def _service_process(module: str, prefix: str, root: Path, tls_dir: Path, name: str, env: dict):
    from agentgw.supervisor import ServiceProcess

    # From the repository the bench is in: `python -m` looks in the working directory first, and only then in
    # the editable install, which may be another checkout's (a worktree's bench ran the main tree's services).
    return ServiceProcess(
        module, root / name, tls_dir, prefix,
        env={"AGW_HOME": str(root / "home"), "AGW_LOG_LEVEL": "WARNING", **env}, cwd=REPO,
    )


def inference_process(root: Path, tls_dir: Path, name: str, **env: str):
    """The inference service (smoke model unless AGW_MODEL is set) as a child process."""
    return _service_process("inference.main", "AGW_INFERENCE_", root, tls_dir, name, env)


def retrieval_process(root: Path, tls_dir: Path, name: str, **env: str):
    """The retrieval service (Qdrant Edge unless AGW_QDRANT_URL is set) as a child process."""
    return _service_process("retrieval.main", "AGW_RETRIEVAL_", root, tls_dir, name, env)


#: Admission past anything a bench sends (c=64, one tenant), in every process that admits public calls: the
#: gateway, and behind the edge the backends (servicekit.admission). Refusals would be measured as latency.
UNBOUNDED_ADMISSION = {"AGW_GATEWAY_MAX_IN_FLIGHT": "1024", "AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT": "1024"}

#: The KV cache of the inference service that ``backend_processes`` starts (and of peers' engines measured next to it).
BACKEND_KV_CACHE_GIB = 2.0


@contextmanager
def backend_processes(root: Path, tls_dir: Path, **env: str):
    """Inference (2 GiB of KV cache), retrieval and a private Postgres, serving.

    Yields ``(ports, started)``: the services' ports, Postgres's URL, and the
    pids of the two services and of Postgres's server (``inference_pid``,
    ``retrieval_pid``, ``postgres_pid``, for CPU meters). Add processes started later (gateways) to
    ``started`` and they are stopped too, all in reverse order, Postgres last
    (a gateway left to start its own embedded server would leave it running).
    """
    import pgserver

    started = []
    postgres = pgserver.get_server(root / "postgres", cleanup_mode="stop")
    try:
        inference = inference_process(root, tls_dir, "inference", AGW_INFERENCE_KV_CACHE_GIB=str(BACKEND_KV_CACHE_GIB), **env)
        started.append(inference)
        retrieval = retrieval_process(root, tls_dir, "retrieval", **env)
        started.append(retrieval)
        yield {"inference": inference.wait_serving(), "retrieval": retrieval.wait_serving(),
               "database_url": postgres.get_uri(), "inference_pid": inference.pid, "retrieval_pid": retrieval.pid,
               "postgres_pid": postgres.get_pid()}, started
    finally:
        for process in reversed(started):
            process.stop()
        postgres.cleanup()


def gateway_process(root: Path, tls_dir: Path, name: str, ports: dict[str, int], **env: str):
    """One gateway worker on the backends in ``ports``, as a child process."""
    return _service_process("gateway.main", "AGW_GATEWAY_", root, tls_dir, name, {
        "AGW_GATEWAY_WORKERS": "1",
        "AGW_GATEWAY_INFERENCE_TARGET": f"127.0.0.1:{ports['inference']}",
        "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{ports['retrieval']}",
        "AGW_DATABASE_URL": ports["database_url"],
        **env,
    })


def clustered_vectors(count: int, dim: int, seed: int = 0):
    """Unit vectors around 200 centres, so close neighbours exist as with real embeddings."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(200, dim))
    vectors = centres[rng.integers(0, 200, count)] + rng.normal(scale=0.9, size=(count, dim))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


class CpuMeter:
    """CPU seconds of groups of processes (``/proc/<pid>/stat``), read before and after each run."""

    def __init__(self, groups: dict[str, callable]) -> None:
        self.groups = groups  # name -> a function listing the group's pids now

    def sample(self) -> dict[str, float]:
        cpu = {name: sum(cpu_seconds(pid) or 0.0 for pid in pids()) for name, pids in self.groups.items()}
        # How long the gateway's event-loop threads (each worker's main thread) were runnable but not running:
        # on a shared host that, not its own CPU, is what its added latency is made of.
        if "gateway" in self.groups:
            cpu["gateway_runqueue_wait"] = sum(runqueue_wait_s(str(pid)) or 0.0 for pid in self.groups["gateway"]())
        # Each hop's CPU by thread (the event loop is the main thread; gRPC's poller and executors are others),
        # in nanoseconds from schedstat, where /proc/<pid>/stat counts 10 ms ticks.
        for proxy in ("gateway", "bare"):
            for pid in self.groups.get(proxy, list)():
                for thread, seconds in thread_cpu_s(pid).items():
                    key = f"{proxy} thread {thread}"
                    cpu[key] = cpu.get(key, 0.0) + seconds
        return cpu

    @staticmethod
    def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {name: after[name] - before.get(name, 0.0) for name in after}

    def idle(self, seconds: float) -> dict[str, float]:
        """CPU milliseconds per second of each group while no call runs: its background (health and liveness
        probes, WatchLoad, metric and span readers, the gRPC poller), which every per-call figure includes."""
        before = self.sample()
        time.sleep(seconds)
        return {name: spent * 1000 / seconds for name, spent in self.spent(before, self.sample()).items()}


def engine_worker_cpus(inference_pid: int) -> set[int]:
    """The CPUs vLLM's CPU worker bound its threads to (its OpenMP binding, one CPU on 2 cores): the union of
    the affinities, among the inference service's descendants' threads, narrower than this process's own.
    Empty where nothing is bound (a GPU engine, or ``VLLM_CPU_OMP_THREADS_BIND=nobind``)."""
    allowed = os.sched_getaffinity(0)
    bound: set[int] = set()
    for pid in descendants(inference_pid):
        for tid in _threads(pid):
            try:
                cpus = os.sched_getaffinity(tid)
            except OSError:  # the thread ended meanwhile
                continue
            if cpus < allowed:
                bound |= cpus
    return bound


def move_off_cpus(pids: Sequence[int], cpus: set[int]) -> tuple[int, int]:
    """Every thread of ``pids`` and of their descendants onto the CPUs other than ``cpus``, except threads
    already bound within ``cpus`` (the engine worker's own). Threads and processes started later inherit
    their starter's mask. Returns (threads kept, threads moved)."""
    rest = os.sched_getaffinity(0) - cpus
    if not cpus or not rest:
        raise ValueError(f"nothing to move off: CPUs {sorted(cpus)} of {sorted(os.sched_getaffinity(0))}")
    kept = moved = 0
    for root in pids:
        for pid in (root, *descendants(root)):
            for tid in _threads(pid):
                try:
                    if os.sched_getaffinity(tid) <= cpus:
                        kept += 1
                    else:
                        os.sched_setaffinity(tid, rest)
                        moved += 1
                except OSError:  # the thread ended meanwhile
                    continue
    return kept, moved


def _threads(pid: int) -> list[int]:
    try:
        return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:  # the process ended meanwhile
        return []


def export_ratio(text: str) -> float:
    """A bench's ``--export-traces``: ``all`` (1.0), or the ratio of traces to keep, in (0, 1]."""
    if text == "all":
        return 1.0
    try:
        ratio = float(text)
    except ValueError:
        ratio = 0.0
    if not 0.0 < ratio <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: give `all` or a ratio of traces in (0, 1], such as 0.1")
    return ratio


def sampling_environment(ratio: float) -> dict[str, str]:
    """OpenTelemetry's own variables to keep ``ratio`` of the traces (none where that is all of them)."""
    if ratio >= 1.0:
        return {}
    return {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(ratio)}


@dataclass
class TraceSink:
    """A running ``trace_sink.py`` and the ratio of traces services keep; once it stopped, what it took."""

    port: int
    ratio: float
    counts: dict[str, int] = field(default_factory=dict)

    def environment(self) -> dict[str, str]:
        """What a service needs to export its traces here, at the sink's ratio: OpenTelemetry's own variables,
        the batch processor at its defaults, as a deployment runs it."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
                **sampling_environment(self.ratio)}


@contextmanager
def trace_sink(ratio: float = 1.0) -> Iterator[TraceSink]:
    """An OTLP/gRPC receiver that counts exports and keeps nothing (``trace_sink.py``), as a child process, for
    services keeping ``ratio`` of their traces; its counts are on the yielded sink once the block ends."""
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("trace_sink.py"))],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        sink = TraceSink(int(process.stdout.readline()), ratio)
        yield sink
    finally:
        out, _ = process.communicate(timeout=30)  # closes its stdin: it stops and prints its counts
    if process.returncode != 0 or not out.strip():
        raise RuntimeError(f"trace_sink.py exited {process.returncode} without its counts")
    sink.counts = json.loads(out)


def exporting(ratio: float | None):
    """``trace_sink(ratio)`` where a bench exports traces (``ratio`` given), else a block that yields None."""
    return nullcontext() if ratio is None else trace_sink(ratio)


def export_environment(sink: TraceSink | None) -> dict[str, str]:
    """The services' environment for ``exporting()``'s sink: empty where nothing is exported."""
    return {} if sink is None else sink.environment()


def report_export(sink: TraceSink | None) -> dict:
    """What a run exported, for its JSON; printed too where it exported."""
    if sink is None:
        return {"ratio": None}
    exported = {"ratio": sink.ratio, **sink.counts}
    print(f"traces exported (every service of ours, ratio {sink.ratio:g}): {exported['exports']} exports, "
          f"{exported['bytes'] / 2**20:.1f} MiB; the sink's own CPU {exported['cpu_s']:.1f} s")
    return exported
