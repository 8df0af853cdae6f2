"""A cancelled stream's handler cleans up at once, even when it is waiting to send.

A handler that yields a message and is cancelled while gRPC is still sending it
is suspended at the yield, where the call's cancellation never reaches it: it
is closed when gRPC drops it, by asyncio's generator finaliser. Chat relies on
that when a client leaves at the context event (its backend call is already in
flight then), so this pins it down, with the cyclic garbage collector off so
that it cannot be what closes the handler.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from tests.support.grpc_client import mtls_channel
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration


async def test_a_stream_cancelled_while_its_handler_waits_to_send_is_closed_at_once(pki):
    prompt = "tokens=1000 delay=0 pad=262144 blocked-send"
    gc.disable()  # the garbage collector must not be what closes it
    try:
        async with scripted_app(pki.root) as (running, app):
            async with mtls_channel(running.port, pki.root) as channel:
                call = inference_pb2_grpc.InferenceStub(channel).Generate(
                    inference_pb2.GenerateRequest(prompt=prompt), timeout=30)
                await call.read()
                await asyncio.sleep(0.5)  # not reading: the server's sends fill the window and wait
                call.cancel()
                for _ in range(40):
                    if prompt in app.servicer.closed:
                        break
                    await asyncio.sleep(0.05)
                assert prompt in app.servicer.closed, "the cancelled stream's handler was not closed within 2 s"
    finally:
        gc.enable()
