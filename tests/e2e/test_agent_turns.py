"""Agent-native turns on real vLLM (the smoke model): tool calls, structured outputs and a 3-step tool loop.

The smoke model's weights are random, so only constrained decoding gives it a
shape: these tests check that the constraint holds (the output parses as
strict JSON and validates against the schema, with a real JSON-Schema
validator), that unconstrained AUTO never fails on the model's garbage, and
that a tool loop is stored and replayed whole.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from agent.inference.v1 import inference_pb2_grpc
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.grpc_client import health_status, mtls_channel
from tests.support.retrieval_service import retrieval_server

pytestmark = pytest.mark.e2e

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
SEARCH = {"type": "object", "additionalProperties": False, "required": ["query"],
          "properties": {"query": {"type": "string", "maxLength": 16}}}
TOOLS = [inference_pb2.Tool(name="get_weather", description="The weather for a city.", parameters=json.dumps(WEATHER)),
         inference_pb2.Tool(name="search_docs", description="Search the docs.", parameters=json.dumps(SEARCH))]
SCHEMAS = {"get_weather": WEATHER, "search_docs": SEARCH}
REQUIRED = inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_REQUIRED)


@pytest.fixture(scope="module")
async def stub(tmp_path_factory, pki, inference_service, database_url):
    async with retrieval_server(tmp_path_factory.mktemp("agent-retrieval"), pki.root) as (retrieval, _):
        async with gateway_server(pki.root, inference_service.port, retrieval.port,
                                  database_url=database_url) as (gateway, _):
            async with gateway_stub(gateway.port, pki.root) as stub:
                yield stub


def _sampling(tokens: int = 128, seed: int = 0, temperature: float = 1.0) -> inference_pb2.SamplingParams:
    return inference_pb2.SamplingParams(max_tokens=tokens, temperature=temperature, seed=seed)


async def _turn(stub, **fields) -> list[pb.ChatResponse]:
    fields.setdefault("generation", _sampling())
    events = [e async for e in stub.Chat(pb.ChatRequest(**fields), timeout=120)]
    assert events[-1].WhichOneof("event") == "final"
    return events


def _calls(events) -> list[inference_pb2.ToolCall]:
    return [e.tool_call.call for e in events if e.WhichOneof("event") == "tool_call"]


def _text(events) -> str:
    return "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")


async def _session(stub) -> str:
    return (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_required_tool_calls_validate_against_their_schemas(stub, seed):
    events = await _turn(stub, message="What is the weather in Paris?", tools=TOOLS, tool_choice=REQUIRED,
                         generation=_sampling(256, seed))
    calls = _calls(events)
    assert calls, _text(events)
    assert events[-1].final.finish_reason == inference_pb2.FINISH_REASON_TOOL_CALLS
    assert _text(events) == ""  # a forced call's text is the call, not an answer
    for call in calls:
        assert call.id.startswith("call_") and call.name in SCHEMAS
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


async def test_a_named_tool_is_the_one_called(stub):
    events = await _turn(stub, message="Find the docs on tuples.", tools=TOOLS,
                         tool_choice=inference_pb2.ToolChoice(tool_name="search_docs"))
    [call] = _calls(events)
    assert call.name == "search_docs"
    jsonschema.validate(json.loads(call.arguments), SEARCH)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_a_response_format_gives_strict_json_that_validates(stub, seed):
    schema = {"type": "object", "required": ["answer", "confidence", "tags"], "properties": {
        "answer": {"type": "string", "maxLength": 24}, "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}}}}
    events = await _turn(stub, message="Summarise the data model.", generation=_sampling(128, seed),
                         response_format=pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(
                             name="summary", schema=json.dumps(schema), strict=True)))
    text = _text(events)
    assert events[-1].final.finish_reason == inference_pb2.FINISH_REASON_STOP, text
    value = json.loads(text)  # Python's parser is strict: no raw control characters in strings
    jsonschema.validate(value, {**schema, "additionalProperties": False})


@pytest.mark.parametrize("seed", range(4))
async def test_auto_returns_text_or_a_call_and_never_fails_on_garbage(stub, seed):
    events = await _turn(stub, message="Weather in Oslo, or an answer?", tools=TOOLS,
                         tool_choice=inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_AUTO),
                         generation=_sampling(48, seed))
    final = events[-1].final
    if _calls(events):
        assert final.finish_reason == inference_pb2.FINISH_REASON_TOOL_CALLS
    else:
        assert final.finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)
        assert final.usage.completion_tokens > 0


async def test_a_three_step_loop_is_stored_in_order_reads_its_prefix_from_cache_and_replays(stub):
    session = await _session(stub)
    search = inference_pb2.ToolChoice(tool_name="search_docs")
    first = await _turn(stub, session_id=session, message="How do tuples differ from lists?", tools=TOOLS,
                        tool_choice=search, idempotency_key="loop-1")
    [call_1] = _calls(first)
    second = await _turn(stub, session_id=session, tools=TOOLS, tool_choice=search, idempotency_key="loop-2",
                         tool_results=[pb.ToolResult(tool_call_id=call_1.id, content='{"passages": ["Tuples are '
                                                     'immutable sequences."]}')])
    [call_2] = _calls(second)
    third = await _turn(stub, session_id=session, tools=TOOLS, idempotency_key="loop-3",
                        tool_choice=inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_NONE),
                        generation=_sampling(16, temperature=0.0),
                        tool_results=[pb.ToolResult(tool_call_id=call_2.id, content='{"passages": []}')])
    assert not _calls(third) and _text(third)
    for step in (second, third):  # the tools and the loop so far are the cached prefix of the next step
        usage = step[-1].final.usage
        assert usage.cached_prompt_tokens > usage.prompt_tokens // 2, usage

    stored = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=10)).messages
    role = inference_pb2.Role
    assert [m.role for m in stored] == [role.ROLE_USER, role.ROLE_ASSISTANT, role.ROLE_TOOL, role.ROLE_ASSISTANT,
                                        role.ROLE_TOOL, role.ROLE_ASSISTANT]
    assert list(stored[1].tool_calls) == [call_1] and stored[2].tool_call_id == call_1.id
    assert list(stored[3].tool_calls) == [call_2] and stored[4].tool_call_id == call_2.id
    assert stored[5].content == _text(third)

    for key, step, fields in (("loop-1", first, dict(message="How do tuples differ from lists?", tool_choice=search)),
                              ("loop-3", third, dict(
                                  tool_choice=inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_NONE),
                                  generation=_sampling(16, temperature=0.0),
                                  tool_results=[pb.ToolResult(tool_call_id=call_2.id, content='{"passages": []}')]))):
        replay = await _turn(stub, session_id=session, tools=TOOLS, idempotency_key=key, **fields)
        assert replay[-1].final.replayed
        assert _calls(replay) == _calls(step) and _text(replay) == _text(step)


async def test_the_inference_service_constrains_regex_and_choice(inference_service, pki):
    async with mtls_channel(inference_service.port, pki.root, identity="service/gateway") as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)

        async def generate(structured: inference_pb2.StructuredOutput) -> tuple[str, inference_pb2.GenerationResult]:
            request = inference_pb2.GenerateRequest(prompt="Pick one:", sampling=inference_pb2.SamplingParams(
                max_tokens=32, temperature=1.0, seed=3, structured_output=structured))
            messages = [m async for m in inference.Generate(request, timeout=60)]
            return "".join(m.text for m in messages), messages[-1].result

        text, result = await generate(inference_pb2.StructuredOutput(
            choice=inference_pb2.Choices(values=["red", "green", "blue"])))
        assert text in ("red", "green", "blue") and result.structured_output_backend == "guidance"
        text, _ = await generate(inference_pb2.StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"))
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
        _, again = await generate(inference_pb2.StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"))
        assert again.constraint_cache_hit  # the second use of a constraint is compiled already

        for structured, says in (
                (inference_pb2.StructuredOutput(json_schema='{"type": "strin"}'), "at /type"),
                (inference_pb2.StructuredOutput(regex="(unclosed"), "does not compile"),
                (inference_pb2.StructuredOutput(choice=inference_pb2.Choices(values=[])), "at least one value")):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await generate(structured)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            assert caught.value.details().startswith("sampling.structured_output.") and says in caught.value.details()
        assert await health_status(channel) == "SERVING"
