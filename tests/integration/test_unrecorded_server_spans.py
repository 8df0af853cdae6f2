"""A service that records no span still gives every call a trace id: its caller's, or a new one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = ("traceparent", f"00-{TRACE}-00f067aa0ba902b7-01")

#: A real mTLS service with the tracer provider a service process installs without a collector (once per process,
#: hence a subprocess), called with each metadata list in argv[2]; prints each call's x-trace-id trailer.
SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from servicekit.telemetry import configure_tracing, unrecorded_server_spans
configure_tracing("test")
from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from tests.support.grpc_client import mtls_channel
from tests.support.servers import scripted_app

async def main(tls):
    ids = []
    async with scripted_app(tls) as (server, _):
        channel = mtls_channel(server.port, tls, identity="service/gateway")
        stub = inference_pb2_grpc.InferenceStub(channel)
        for metadata in json.loads(sys.argv[2]):
            call = stub.Tokenize(inference_pb2.TokenizeRequest(text="hi"), timeout=10,
                                 metadata=[tuple(pair) for pair in metadata])
            await call
            ids.append(dict(await call.trailing_metadata())["x-trace-id"])
        await channel.close()
    print(json.dumps({"fast": unrecorded_server_spans(None) is not None, "ids": ids}))

asyncio.run(main(Path(sys.argv[1])))
"""


def test_every_call_has_a_trace_id_and_a_callers_trace_is_continued(pki):
    calls = [[TRACEPARENT], [], [], [TRACEPARENT, ("tracestate", "vendor=1")],
             [("traceparent", f"ff-{TRACE}-00f067aa0ba902b7-01")]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(pki.root), json.dumps(calls)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fast"]  # nothing records spans: the server spans are made without the SDK
    continued, new, other_new, with_state, invalid = result["ids"]
    assert continued == with_state == TRACE  # the caller's trace, whichever way the span was made
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in (new, other_new, invalid))
    assert len({new, other_new, invalid, TRACE}) == 4  # a trace of its own for each call without a valid parent
