"""MicroBatcher: concurrent calls share a batch; an idle one runs at once; failures and cancels stay contained."""

from __future__ import annotations

import asyncio

import pytest

from retrieval.batching import MicroBatcher

pytestmark = pytest.mark.unit


class Recorder:
    """A batch function that records its batches and holds each until released."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.release = asyncio.Event()
        self.fail_on = fail_on

    async def __call__(self, items):
        self.batches.append(list(items))
        await self.release.wait()
        if self.fail_on in items:
            raise ValueError(f"cannot embed {self.fail_on!r}")
        return [item.upper() for item in items]


async def test_an_idle_batcher_runs_a_lone_call_at_once():
    recorder = Recorder()
    recorder.release.set()
    batcher = MicroBatcher(recorder, max_batch=8)
    assert await asyncio.wait_for(batcher.submit("a"), 1) == "A"
    assert recorder.batches == [["a"]]


async def test_calls_arriving_during_a_pass_share_the_next_and_get_their_own_results():
    recorder = Recorder()
    batcher = MicroBatcher(recorder, max_batch=3)
    first = asyncio.ensure_future(batcher.submit("a"))
    await asyncio.sleep(0)  # the first pass starts with "a" alone
    rest = [asyncio.ensure_future(batcher.submit(x)) for x in "bcdef"]
    await asyncio.sleep(0)
    recorder.release.set()
    assert await asyncio.gather(first, *rest) == list("ABCDEF")
    assert recorder.batches == [["a"], ["b", "c", "d"], ["e", "f"]]
    assert batcher.batches == 3


async def test_a_failed_batch_fails_its_callers_only():
    recorder = Recorder(fail_on="bad")
    batcher = MicroBatcher(recorder, max_batch=2)
    calls = [asyncio.ensure_future(batcher.submit(x)) for x in ("ok", "bad", "later")]
    await asyncio.sleep(0)
    recorder.release.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert [type(r) for r in results[:2]] == [ValueError, ValueError] and "'bad'" in str(results[1])
    assert results[2] == "LATER"


async def test_a_cancelled_caller_is_left_out_and_the_others_are_served():
    recorder = Recorder()
    batcher = MicroBatcher(recorder, max_batch=8)
    running = asyncio.ensure_future(batcher.submit("a"))
    await asyncio.sleep(0)
    gone, stays = asyncio.ensure_future(batcher.submit("gone")), asyncio.ensure_future(batcher.submit("stays"))
    await asyncio.sleep(0)
    gone.cancel()
    recorder.release.set()
    assert await asyncio.gather(running, stays) == ["A", "STAYS"]
    assert recorder.batches == [["a"], ["stays"]]


async def test_close_cancels_the_pass_and_the_queue():
    recorder = Recorder()
    batcher = MicroBatcher(recorder, max_batch=1)
    calls = [asyncio.ensure_future(batcher.submit(x)) for x in "ab"]
    await asyncio.sleep(0)
    await batcher.close()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)


def test_a_batch_size_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        MicroBatcher(Recorder(), max_batch=0)
