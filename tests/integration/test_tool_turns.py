"""Tool loops through Chat, without an engine: the scripted inference service calls tools on cue.

What the gateway owns: the tools and tool choice reach the inference service
in the prompt's stable part; tool calls come back as events; a loop is stored
in order (user, call, result, call, result, answer) and replays from its
idempotency key; tool results must answer the session's last calls; bad tools
and schemas are refused naming the field. The same loop on real vLLM is in
tests/e2e/test_agent_turns.py.
"""

from __future__ import annotations

import json

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.grpc_client import health_status, mtls_channel
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration

SEARCH = inference_pb2.Tool(name="search_docs", description="Search the docs.", parameters=json.dumps(
    {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}))
ROLE = inference_pb2.Role


@pytest.fixture(scope="module")
async def loop(tmp_path_factory, pki, database_url):
    async with retrieval_server(tmp_path_factory.mktemp("tools-retrieval"), pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, scripted), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url) as (gateway, _):
        async with gateway_stub(gateway.port, pki.root) as stub:
            yield stub, scripted.servicer, gateway.port


async def _turn(stub, **fields) -> list[pb.ChatResponse]:
    return [event async for event in stub.Chat(pb.ChatRequest(**fields), timeout=20)]


def _calls(events) -> list[inference_pb2.ToolCall]:
    return [e.tool_call.call for e in events if e.WhichOneof("event") == "tool_call"]


async def _session(stub) -> str:
    return (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id


async def test_a_three_step_loop_is_stored_in_order_and_replays(loop):
    stub, scripted, _ = loop
    session = await _session(stub)
    first = await _turn(stub, session_id=session, message="tokens=1 call=search_docs", tools=[SEARCH],
                        idempotency_key="step-1")
    [call_1] = _calls(first)
    assert call_1.name == "search_docs" and json.loads(call_1.arguments)
    assert first[-1].final.finish_reason == inference_pb2.FINISH_REASON_TOOL_CALLS
    assert [e.WhichOneof("event") for e in first][-2:] == ["tool_call", "final"]  # calls come before the final

    # The result's text is the scripted service's next script: call again, then answer.
    second = await _turn(stub, session_id=session, tools=[SEARCH], tool_results=[
        pb.ToolResult(tool_call_id=call_1.id, content="tokens=1 call=search_docs")])
    [call_2] = _calls(second)
    third = await _turn(stub, session_id=session, tools=[SEARCH], tool_results=[
        pb.ToolResult(tool_call_id=call_2.id, content="tokens=2")])
    assert not _calls(third) and third[-1].final.finish_reason == inference_pb2.FINISH_REASON_LENGTH

    # The last prompt: tools in the stable part, then the loop so far, in order, with ids.
    request = scripted.requests[-1]
    assert [t.name for t in request.chat.tools] == ["search_docs"]
    assert [(m.role, m.tool_call_id, [c.id for c in m.tool_calls]) for m in request.chat.messages] == [
        (ROLE.ROLE_SYSTEM, "", []), (ROLE.ROLE_USER, "", []), (ROLE.ROLE_ASSISTANT, "", [call_1.id]),
        (ROLE.ROLE_TOOL, call_1.id, []), (ROLE.ROLE_ASSISTANT, "", [call_2.id]), (ROLE.ROLE_TOOL, call_2.id, [])]

    stored = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=10)).messages
    assert [(m.role, m.tool_call_id, [c.id for c in m.tool_calls]) for m in stored] == [
        (ROLE.ROLE_USER, "", []), (ROLE.ROLE_ASSISTANT, "", [call_1.id]), (ROLE.ROLE_TOOL, call_1.id, []),
        (ROLE.ROLE_ASSISTANT, "", [call_2.id]), (ROLE.ROLE_TOOL, call_2.id, []), (ROLE.ROLE_ASSISTANT, "", [])]
    assert stored[1].tool_calls[0] == call_1 and stored[2].content == "tokens=1 call=search_docs"

    generations = scripted.generations
    again = await _turn(stub, session_id=session, message="tokens=1 call=search_docs", tools=[SEARCH],
                        idempotency_key="step-1")
    assert scripted.generations == generations  # answered from the store
    assert _calls(again) == [call_1] and again[-1].final.replayed
    assert again[-1].final.finish_reason == inference_pb2.FINISH_REASON_TOOL_CALLS


async def test_a_result_must_answer_a_call_of_the_last_assistant_message(loop):
    stub, scripted, _ = loop
    session = await _session(stub)
    await _turn(stub, session_id=session, message="tokens=1")  # a plain answer: no calls to answer
    generations = scripted.generations
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _turn(stub, session_id=session, tool_results=[pb.ToolResult(tool_call_id="call_x", content="{}")])
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tool_results[0].tool_call_id: 'call_x' is not a tool call" in caught.value.details()

    [call] = _calls(await _turn(stub, session_id=session, message="tokens=1 call=search_docs", tools=[SEARCH]))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _turn(stub, session_id=session, tools=[SEARCH], tool_results=[
            pb.ToolResult(tool_call_id=call.id, content="tokens=1"), pb.ToolResult(tool_call_id="call_old")])
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tool_results[1].tool_call_id" in caught.value.details()
    assert scripted.generations == generations + 1  # refused before any generation
    stored = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=10)).messages
    assert len(stored) == 4  # the refused turns stored nothing


BAD_SCHEMA = json.dumps({"type": "object", "properties": {"when": {"type": "strin"}}})


@pytest.mark.parametrize(("fields", "field", "says"), [
    (dict(tools=[inference_pb2.Tool(name="bad name")]), "tools[0].name", "is not a tool name"),
    (dict(tools=[SEARCH, SEARCH]), "tools[1].name", "is given twice"),
    (dict(tools=[SEARCH] * 33), "tools", "the limit is 32 (AGW_GATEWAY_MAX_TOOLS)"),
    (dict(tools=[inference_pb2.Tool(name="t", parameters="{not json")]), "tools[0].parameters", "is not JSON"),
    (dict(tools=[inference_pb2.Tool(name="t", parameters=BAD_SCHEMA)]), "tools[0].parameters",
     "is not a valid JSON Schema at /properties/when/type"),
    (dict(tools=[inference_pb2.Tool(name="t", parameters=json.dumps({"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}))]),
     "tools[0].parameters", "nests deeper than 16 levels"),
    (dict(tools=[inference_pb2.Tool(name="t", parameters="x" * 20_000)]), "tools[0].parameters",
     "the limit is 16384 (AGW_GATEWAY_MAX_SCHEMA_BYTES)"),
    (dict(tool_choice=inference_pb2.ToolChoice(tool_name="missing"), tools=[SEARCH]), "tool_choice.tool_name",
     "is not one of tools"),
    (dict(tool_choice=inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_REQUIRED)), "tool_choice",
     "no tools are given"),
    (dict(response_format=pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema=BAD_SCHEMA))),
     "response_format.json_schema.schema", "at /properties/when/type"),
    (dict(response_format=pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema='{"type":"object"}')),
          tools=[SEARCH], tool_choice=inference_pb2.ToolChoice(tool_name="search_docs")),
     "response_format", "cannot be combined"),
    (dict(message="", tool_results=[pb.ToolResult(tool_call_id="c", content="x")]), "tool_results",
     "need a session_id"),
    (dict(message=""), "message", "send the user's message, tool_results, or both"),
])
async def test_bad_tools_and_schemas_are_refused_naming_the_field(loop, fields, field, says):
    stub, scripted, port = loop
    generations = scripted.generations
    fields = {"message": "tokens=1", **fields}
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _turn(stub, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert caught.value.details().startswith(f"{field}: ") and says in caught.value.details(), caught.value.details()
    assert scripted.generations == generations


async def test_the_gateway_stays_serving_after_refusals(loop, pki):
    stub, _, port = loop
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError):
            await _turn(stub, message="tokens=1", tools=[inference_pb2.Tool(name="t", parameters=BAD_SCHEMA)])
    async with mtls_channel(port, pki.root, identity="tenant/dev") as channel:
        assert await health_status(channel) == "SERVING"
    events = await _turn(stub, message="tokens=1")
    assert events[-1].WhichOneof("event") == "final"


async def test_a_response_format_reaches_the_inference_service_as_a_constraint(loop):
    stub, scripted, _ = loop
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "trip": {
        "type": "object", "properties": {"days": {"type": "integer"}}}}}
    await _turn(stub, message="tokens=1", response_format=pb.ResponseFormat(
        json_schema=pb.JsonSchemaFormat(name="trip", schema=json.dumps(schema), strict=True)))
    sent = json.loads(scripted.requests[-1].sampling.structured_output.json_schema)
    # Strict: every object is closed; nothing else changes.
    assert sent["additionalProperties"] is False and sent["properties"]["trip"]["additionalProperties"] is False
    assert sent["properties"]["city"] == {"type": "string"}
