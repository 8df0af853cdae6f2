"""The coalescing writer's rules, against a context whose writes the test holds and releases.

Through the real gateway and gRPC: tests/integration/test_stream_coalescing.py.
"""

from __future__ import annotations

import asyncio

import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from gateway.stream_writer import CoalescingWriter, SendWatch, merge_text
from servicekit.errors import DeadlineExceeded

pytestmark = pytest.mark.unit

FINAL = pb.ChatResponse(final=pb.TurnSummary(trace_id="t"))
CONTEXT = pb.ChatResponse(context=pb.ContextEvent())


class HeldContext:
    """``write`` waits until the test opens the gate (a client that is not reading)."""

    def __init__(self) -> None:
        self.written: list[pb.ChatResponse] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def write(self, message) -> None:
        await self.gate.wait()
        self.written.append(message)


def _kinds(messages) -> list[str]:
    return [m.WhichOneof("event") for m in messages]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_idle_writer_sends_each_delta_at_once():
    context = HeldContext()
    async with CoalescingWriter(context, merge_text) as out:
        for text in ("a", "b", "c"):
            await out.delta(text, len(text))
            await _settle()  # the client keeps up: each write is done before the next delta
            assert context.written[-1].delta.text == text
        await out.message(FINAL)
    assert [m.delta.text for m in context.written[:3]] == ["a", "b", "c"] and out.written == out.deltas + 1


async def test_deltas_behind_a_pending_write_merge_in_order_and_other_events_keep_their_place():
    context = HeldContext()
    async with CoalescingWriter(context, merge_text) as out:
        context.gate.clear()
        await out.message(CONTEXT)
        await _settle()  # the context event's write is in flight and held
        for text in ("x", "y", "z"):
            await out.delta(text, len(text))
        await out.message(pb.ChatResponse(tool_call=pb.ToolCallEvent()))
        await out.delta("after", len("after"))
        await out.message(FINAL)
        context.gate.set()
    assert _kinds(context.written) == ["context", "delta", "tool_call", "delta", "final"]
    assert [m.delta.text for m in context.written if m.HasField("delta")] == ["xyz", "after"]
    assert out.deltas == 4 and out.written == 5


async def test_at_the_cap_the_producer_waits_for_the_client():
    context = HeldContext()
    async with CoalescingWriter(context, merge_text, max_pending_bytes=1024) as out:
        context.gate.clear()
        await out.delta("first", len("first"))
        await _settle()  # "first" is being written, held
        await out.delta("x" * 600, len("x" * 600))
        blocked = asyncio.ensure_future(out.delta("y" * 600, len("y" * 600)))  # 1200 bytes pending: over the cap
        await _settle()
        assert not blocked.done(), "the producer ran on past the cap"
        context.gate.set()
        await asyncio.wait_for(blocked, 1)
        await out.message(FINAL)
    assert "".join(m.delta.text for m in context.written if m.HasField("delta")) == "first" + "x" * 600 + "y" * 600


async def test_a_client_that_reads_nothing_past_the_send_timeout_ends_the_stream():
    context = HeldContext()
    with pytest.raises(DeadlineExceeded) as ended:
        async with CoalescingWriter(context, merge_text, max_pending_bytes=1024, send_timeout_s=0.2) as out:
            context.gate.clear()  # the client stops reading
            await out.delta("first", len("first"))
            await _settle()
            started = asyncio.get_running_loop().time()
            await out.delta("x" * 2048, 2048)  # over the cap: waits for the client, at most 0.2 s
    waited = asyncio.get_running_loop().time() - started
    assert 0.15 < waited < 2, waited
    assert "read nothing for 0.2 s" in ended.value.message
    assert "AGW_GATEWAY_STREAM_SEND_TIMEOUT_S" in ended.value.message


async def test_a_slow_client_that_reads_within_the_send_timeout_gets_every_delta():
    context = HeldContext()
    async with CoalescingWriter(context, merge_text, max_pending_bytes=1024, send_timeout_s=0.5) as out:
        for index in range(6):  # each time at the cap, the client reads within 0.1 s
            context.gate.clear()
            asyncio.get_running_loop().call_later(0.1, context.gate.set)
            await out.delta(str(index) * 2048, 2048)
        await out.message(FINAL)
    assert "".join(m.delta.text for m in context.written if m.HasField("delta")) == "".join(
        str(index) * 2048 for index in range(6))


async def test_a_failed_write_reaches_the_producer():
    class Broken:
        async def write(self, message):
            raise ConnectionResetError("client gone")

    with pytest.raises(ConnectionResetError):
        async with CoalescingWriter(Broken(), merge_text) as out:
            await out.delta("a", len("a"))
            await _settle()
            await out.message(FINAL)


async def test_a_failed_producer_cancels_the_writer():
    context = HeldContext()
    context.gate.clear()
    with pytest.raises(RuntimeError):
        async with CoalescingWriter(context, merge_text) as out:
            await out.delta("a", len("a"))
            await _settle()
            raise RuntimeError("turn failed")
    assert out._task.cancelled()



async def test_a_send_watch_ends_a_stream_whose_write_waits_past_its_timeout():
    stalled = asyncio.Event()  # a write the client never takes

    async def stream() -> None:
        with SendWatch(0.2) as watch:
            try:
                for _ in range(3):
                    watch.writing()
                    await asyncio.wait_for(asyncio.sleep(0.01), 1)  # taken at once
                    watch.written()
                watch.writing()
                await stalled.wait()
            except asyncio.CancelledError:
                assert watch.fired
                raise watch.expired() from None

    started = asyncio.get_running_loop().time()
    with pytest.raises(DeadlineExceeded) as ended:
        await stream()
    assert 0.2 <= asyncio.get_running_loop().time() - started < 2
    assert "read nothing for 0.2 s" in ended.value.message and "AGW_GATEWAY_STREAM_SEND_TIMEOUT_S" in ended.value.message


async def test_a_send_watch_leaves_a_client_that_takes_each_message_in_time():
    async def stream() -> int:
        written = 0
        with SendWatch(0.2) as watch:
            for _ in range(8):  # 0.8 s in all, each write taken within 0.1 s
                watch.writing()
                await asyncio.sleep(0.1)
                watch.written()
                written += 1
        return written

    assert await stream() == 8
    await asyncio.sleep(0.3)  # the watch's timer went with the stream: nothing cancels this task later
