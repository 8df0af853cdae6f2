#!/usr/bin/env python3
"""An OTLP/gRPC trace sink for the benches: it takes every export, counts it, and keeps nothing.

A deployment's collector runs on hosts of its own; here it shares the
bench's cores with the stack, so it does the least a receiver can: a generic
handler with identity serialisers takes each ``Export`` as bytes, never
parsed, and answers with the empty response. It runs as a process of its own
(``harness.trace_sink`` starts it), so that its threads do not take the
GIL from the bench's client. It prints its port on the first line, and when
its standard input closes it stops and prints the exports and bytes it
took, and its own CPU seconds, as JSON.

    python bench/trace_sink.py
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent import futures

import grpc

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


class ExportCounter:
    """Exports taken and their bytes; ``export`` is the handler, called on the server's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exports = 0
        self.bytes = 0

    def export(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.exports += 1
            self.bytes += len(request)
        return b""  # ExportTraceServiceResponse with no partial_success: the empty message

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"exports": self.exports, "bytes": self.bytes}


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    counter = ExportCounter()
    # No serialisers given: the handler takes and returns bytes.
    handler = grpc.method_handlers_generic_handler(SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(counter.export)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the bench closes it (or exits)
    server.stop(grace=1).wait()
    # Its own CPU too: on a shared host, what the sink took from the stack.
    print(json.dumps({**counter.counts(), "cpu_s": round(time.process_time(), 3)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
