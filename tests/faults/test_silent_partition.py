"""A silent partition: the path to the inference service stops forwarding without closing.

From the moment it freezes, no call waits longer than AGW_KEEPALIVE_TIME_S +
AGW_KEEPALIVE_TIMEOUT_S + 1 s: the gateway's liveness probes find the silent
connection and replace it, ending the calls on it with UNAVAILABLE (gRPC's
keepalive alone did not: on grpcio 1.85 a ping written into a connection
whose peer reads nothing more was never timed out here, and calls waited for
their whole deadline). After detection, calls fail at once; once the path
flows again, turns succeed without a restart. Keepalive is 3 s + 1 s and the
probes 0.5 s + 0.5 s so that the test takes seconds; the bound scales with
the settings.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app
from tests.support.tcp_relay import TcpRelay

pytestmark = pytest.mark.faults

KEEPALIVE = {"keepalive_time_s": 3.0, "keepalive_timeout_s": 1.0}
BOUND_S = 3.0 + 1.0 + 1.0
#: The gateway's liveness probes, scaled down with keepalive (defaults 1 s and 1 s against 20 s + 10 s).
PROBES = {"backend_probe_s": 0.5, "backend_probe_timeout_s": 0.5}


async def _turn(stub, message: str, timeout: float = 30) -> tuple[str, float]:
    started = time.monotonic()
    try:
        async for _ in stub.Chat(pb.ChatRequest(message=message), timeout=timeout):
            pass
        return "OK", time.monotonic() - started
    except grpc.aio.AioRpcError as error:
        return error.code().name, time.monotonic() - started


async def _until_ok(stub, within_s: float) -> float:
    started = time.monotonic()
    while (code := (await _turn(stub, "tokens=2", timeout=5))[0]) != "OK":
        assert code == "UNAVAILABLE", code
        assert time.monotonic() - started < within_s, "turns never succeeded again after the partition healed"
        await asyncio.sleep(0.2)
    return time.monotonic() - started


async def test_a_silent_partition_costs_no_call_more_than_keepalive_and_heals(tmp_path, pki, database_url):
    async with scripted_app(pki.root, **KEEPALIVE) as (inference, _), \
            TcpRelay(inference.port).running() as relay, \
            retrieval_server(tmp_path / "retrieval", pki.root, **KEEPALIVE) as (retrieval, _), \
            gateway_server(pki.root, relay.port, retrieval.port, database_url=database_url, **KEEPALIVE,
                           **PROBES) as (gw, _), \
            gateway_stub(gw.port, pki.root) as stub:
        assert (await _turn(stub, "tokens=2"))[0] == "OK"
        streaming = stub.Chat(pb.ChatRequest(message="tokens=2000 delay=0.01"), timeout=30)
        assert (await streaming.read()).WhichOneof("event") == "delta"

        relay.freeze()
        frozen_at = time.monotonic()
        later = asyncio.ensure_future(_turn(stub, "tokens=2"))  # a turn that starts into the partition
        try:
            while await streaming.read() is not grpc.aio.EOF:
                pass
            in_flight = "OK"
        except grpc.aio.AioRpcError as error:
            in_flight = error.code().name
        in_flight_waited = time.monotonic() - frozen_at
        later_code, later_waited = await later
        assert in_flight == "UNAVAILABLE" and in_flight_waited <= BOUND_S, (in_flight, in_flight_waited)
        assert later_code == "UNAVAILABLE" and later_waited <= BOUND_S, (later_code, later_waited)

        after_code, after_waited = await _turn(stub, "tokens=2")  # detected: at once
        assert after_code == "UNAVAILABLE" and after_waited < 0.5, (after_code, after_waited)

        relay.thaw()
        healed_s = await _until_ok(stub, within_s=15)
        print(f"silent partition: in-flight turn ended after {in_flight_waited:.2f} s, a turn started into it "
              f"after {later_waited:.2f} s, then failures took {after_waited * 1000:.0f} ms; healed in {healed_s:.2f} s")
