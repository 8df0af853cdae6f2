"""Keepalive: an idle channel pinging every second stays READY (no GOAWAY too_many_pings).

Both ends take their options from servicekit's KeepalivePolicy. The control
case shows the test can fail: a server whose policy disagrees (it expects pings
no more often than every 30 s) answers the same client with GOAWAY.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from servicekit import KeepalivePolicy, wait_ready
from tests.support.grpc_client import mtls_channel
from tests.support.servers import scripted_server

pytestmark = pytest.mark.integration

FAST = KeepalivePolicy(time_s=1.0, timeout_s=1.0)
IDLE_S = 5.0  # five keepalive intervals


async def _states_while_idle(channel: grpc.aio.Channel, seconds: float) -> list[grpc.ChannelConnectivity]:
    """Every connectivity state the channel moves to during ``seconds`` of idleness."""
    seen = []
    state = channel.get_state()
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), remaining)
        except asyncio.TimeoutError:
            break
        state = channel.get_state()
        seen.append(state)
    return seen


async def _stream(channel: grpc.aio.Channel) -> list[str]:
    stub = inference_pb2_grpc.InferenceStub(channel)
    call = stub.Generate(inference_pb2.GenerateRequest(prompt="tokens=5 delay=0.01"), timeout=5)
    return [message.text async for message in call if message.text]


async def test_idle_channel_with_agreeing_policy_stays_ready(pki):
    async with scripted_server(pki.root, keepalive_time_s=FAST.time_s, keepalive_timeout_s=FAST.timeout_s) as server:
        async with mtls_channel(server.port, pki.root, keepalive=FAST) as channel:
            await wait_ready(channel, timeout_s=5, target="scripted")
            changes = await _states_while_idle(channel, IDLE_S)
            assert changes == [], f"channel left READY while idle: {changes}"
            assert await _stream(channel) == [f"t{i} " for i in range(5)]
            assert channel.get_state() == grpc.ChannelConnectivity.READY


async def test_idle_channel_with_disagreeing_policy_gets_goaway(pki):
    # The server accepts pings at most every 30 s; the client pings every 1 s.
    async with scripted_server(pki.root, keepalive_time_s=60, keepalive_timeout_s=10) as server:
        async with mtls_channel(server.port, pki.root, keepalive=FAST) as channel:
            await wait_ready(channel, timeout_s=5, target="scripted")
            # Twice the idle time: the third ping (the strike that draws the
            # GOAWAY) can come late when the machine is busy.
            changes = await _states_while_idle(channel, 2 * IDLE_S)
            # Any change means the channel left READY (it started there); it
            # may be READY again by the time the state is read, having
            # reconnected at once, so the first state seen can be READY.
            assert changes, "expected GOAWAY too_many_pings to drop the connection"
