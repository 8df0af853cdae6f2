"""Chat's adaptive coalescing, through the real gateway on loopback mTLS, with the scripted inference service.

A client that keeps up gets one message per backend message; a slow one gets
fewer, larger ones with the same text; one that stops reading stops the
backend stream (flow control reaches it) instead of growing the gateway's
memory. The writer's rules alone are in tests/unit/test_stream_writer.py.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agentgw.supervisor import ServiceProcess
from servicekit import ClientTls
from servicekit.procfs import rss_bytes
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def backends(tmp_path_factory, pki):
    """(retrieval port, inference port, the scripted inference servicer), in process."""
    async with retrieval_server(tmp_path_factory.mktemp("coalescing-retrieval"), pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, scripted):
        yield retrieval.port, inference.port, scripted.servicer


@asynccontextmanager
async def _gateway(workdir, pki, database_url, backends, **env: str):
    """The gateway as a process of its own (its memory is measured) on ``backends``, and a tenant's stub to it."""
    retrieval_port, inference_port, _ = backends
    gateway = ServiceProcess("gateway.main", workdir, pki.root, "AGW_GATEWAY_", env={
        "AGW_GATEWAY_WORKERS": "1", "AGW_DATABASE_URL": database_url,
        "AGW_GATEWAY_INFERENCE_TARGET": f"127.0.0.1:{inference_port}",
        "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{retrieval_port}", **env})
    try:
        port = await asyncio.to_thread(gateway.wait_serving, 60)  # the loop keeps serving the backends
        # No BDP probing: the client's flow-control window stays at 64 KiB, as a slow reader's would,
        # instead of growing to hold the whole stream.
        credentials = ClientTls.for_identity(pki.root, "tenant/dev").credentials()
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials,
                                           options=[("grpc.http2.bdp_probe", 0)]) as channel:
            yield gateway_pb2_grpc.AgentGatewayStub(channel), gateway.pid
    finally:
        await asyncio.to_thread(gateway.stop)


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, pki, database_url, backends):
    """The gateway with its defaults (a client may stall for 60 s before its stream ends)."""
    async with _gateway(tmp_path_factory.mktemp("coalescing-gateway"), pki, database_url, backends) as (stub, pid):
        yield stub, backends[2], pid


def _expected(tokens: int, pad: int) -> str:
    return "".join(f"t{i} " + "x" * pad for i in range(tokens))


async def test_a_client_that_keeps_up_gets_every_delta_as_sent(stack):
    stub, _, _ = stack
    events = [e async for e in stub.Chat(pb.ChatRequest(message="tokens=20 delay=0.05"), timeout=20)]
    deltas = [e.delta.text for e in events if e.WhichOneof("event") == "delta"]
    assert deltas == [f"t{i} " for i in range(20)]  # nothing merged, nothing held
    assert events[-1].WhichOneof("event") == "final"


async def test_a_slow_client_gets_fewer_larger_deltas_with_the_same_text(stack):
    stub, _, _ = stack
    tokens, pad = 300, 16384  # 4.9 MB: past every flow-control window, so the gateway's writes wait
    kinds, deltas = [], []
    async for event in stub.Chat(pb.ChatRequest(message=f"tokens={tokens} delay=0 pad={pad}"), timeout=60):
        kinds.append(event.WhichOneof("event"))
        if kinds[-1] == "delta":
            deltas.append(event.delta.text)
        await asyncio.sleep(0.01)  # a slow reader
    assert "".join(deltas) == _expected(tokens, pad)
    # Behind a write that waits, deltas merge up to the pending cap (64 KiB: four of these); the delta after a
    # merged write goes alone, since no write is then in flight. So about 2.5 deltas a message on a quiet
    # machine (120-137 messages seen), fewer merged on a loaded one (151 seen); nothing merged is 300.
    assert len(deltas) < tokens * 0.8, f"{len(deltas)} messages for {tokens} deltas: too little was merged"
    largest = max(len(delta) for delta in deltas) // len(_expected(1, pad))
    assert largest >= 3, f"the largest message holds {largest} deltas: nothing filled the pending cap"
    assert kinds[-1] == "final" and "final" not in kinds[:-1]


async def test_a_client_that_stops_reading_stops_the_backend_not_the_gateways_memory(stack):
    stub, scripted, gateway_pid = stack
    script = "tokens=5000 delay=0 pad=16384"  # 80 MB if nothing pushed back
    before = rss_bytes(gateway_pid)
    call = stub.Chat(pb.ChatRequest(message=script), timeout=60)
    assert (await call.read()).WhichOneof("event") == "delta"
    await asyncio.sleep(2)  # windows and the pending delta fill
    sent_at_2s, rss_at_2s = scripted.sent[script], rss_bytes(gateway_pid)
    await asyncio.sleep(8)  # ten seconds without reading
    sent_at_10s, grown = scripted.sent[script], rss_bytes(gateway_pid) - before
    call.cancel()
    assert sent_at_10s == sent_at_2s < 5000, "the backend kept producing for a client that stopped reading"
    # What was sent is what the windows hold: the gateway's stream window from the backend (256 KiB,
    # AGW_GATEWAY_BACKEND_STREAM_WINDOW_BYTES), its pending delta (64 KiB) and the client's window (64 KiB), about
    # 25 of these 16 KiB deltas (28 to 31 seen). With gRPC's probes sizing the gateway's window it was 290 to 377
    # here, and on a loaded host the RSS grew 24 MiB (a full run, 2026-12-07).
    assert sent_at_2s < 64, f"the backend sent {sent_at_2s} deltas of 16 KiB into a stream nobody reads"
    assert grown < 10 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB (at 2 s: {(rss_at_2s - before) / 2**20:.1f})"


STALLED = "tokens=5000 delay=0 pad=16384"


async def _a_stall_past_the_send_timeout_ends_the_generation(open_call, scripted) -> None:
    """``open_call()`` opens a stream of ``STALLED`` on a gateway whose send timeout is 2 s; its client reads one
    message, then nothing for 5 s. The gateway has ended the generation by then; the client, reading again, gets
    what was written before the end, then DEADLINE_EXCEEDED naming the setting."""
    generations_closed = len(scripted.closed)
    call = open_call()
    await call.read()
    await asyncio.sleep(5)  # past the 2 s: the gateway ended the stream, and with it the generation
    assert len(scripted.closed) == generations_closed + 1, "the generation still runs for a stalled client"
    assert scripted.sent[STALLED] < 64
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        while await call.read() is not grpc.aio.EOF:
            pass
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "read nothing for 2 s" in ended.value.details()
    assert "AGW_GATEWAY_STREAM_SEND_TIMEOUT_S" in ended.value.details()


async def test_a_chat_client_that_reads_nothing_past_the_send_timeout_ends_its_turn_and_generation(
        tmp_path, pki, database_url, backends):
    async with _gateway(tmp_path, pki, database_url, backends, AGW_GATEWAY_STREAM_SEND_TIMEOUT_S="2") as (stub, _):
        await _a_stall_past_the_send_timeout_ends_the_generation(
            lambda: stub.Chat(pb.ChatRequest(message=STALLED), timeout=60), backends[2])


async def test_a_generate_client_that_takes_nothing_past_the_send_timeout_ends_its_generation(
        tmp_path, pki, database_url, backends):
    from agent.inference.v1 import inference_pb2

    async with _gateway(tmp_path, pki, database_url, backends, AGW_GATEWAY_STREAM_SEND_TIMEOUT_S="2") as (stub, _):
        await _a_stall_past_the_send_timeout_ends_the_generation(
            lambda: stub.Generate(pb.GenerateRequest(request=inference_pb2.GenerateRequest(prompt=STALLED)),
                                  timeout=60), backends[2])
