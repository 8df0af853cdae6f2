"""inference.tools and the schema rules: what streams, what is parsed as a call, and what a forced call must match.

The parser is vLLM's real hermes parser over the smoke model's tokenizer (whose
template renders calls the Hermes way); generation itself is tested on vLLM in
tests/e2e/test_agent_turns.py.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from gateway.convert import turn_fingerprint, turn_request_from_proto
from gateway.history import history_window
from inference.prompt_encoding import PromptEncoder
from inference.requests import Message, PromptInput, Tool, ToolCall, ToolChoice, ToolMode
from inference.tools import ToolOutput, ToolParsing, choose_parser_name, tool_call_constraint
from servicekit.errors import InvalidArgument
from servicekit.json_schema import check_schema, json_pointer

pytestmark = pytest.mark.unit

WEATHER = Tool("get_weather", "Weather.", json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"], "additionalProperties": False}))
SEARCH = Tool("search_docs", "Search.", "")
CHAT = (Message("user", "hi"),)


@pytest.fixture(scope="module")
def tokenizer(smoke_model):
    return AutoTokenizer.from_pretrained(smoke_model)


@pytest.fixture(scope="module")
def hermes(tokenizer):
    parsing = ToolParsing.load(choose_parser_name("auto", tokenizer.chat_template), tokenizer)
    assert parsing.name == "hermes" and parsing.marker == "<tool_call>"
    return parsing


def _stream(output: ToolOutput, pieces: list[str]) -> tuple[str, str, tuple[ToolCall, ...]]:
    streamed = "".join(output.feed(piece) for piece in pieces)
    rest, calls = output.finish()
    return streamed, rest, calls


def test_auto_streams_text_and_holds_only_what_may_open_a_call(hermes):
    output = ToolOutput(PromptInput(messages=CHAT, tools=(WEATHER,)), hermes)
    assert output.feed("Hello <tool") == "Hello "  # "<tool" may open a call: held
    assert output.feed("box> done") == "<toolbox> done"  # it did not
    assert output.finish() == ("", ())


def test_auto_parses_a_call_after_text(hermes):
    output = ToolOutput(PromptInput(messages=CHAT, tools=(WEATHER, SEARCH)), hermes)
    streamed, rest, calls = _stream(output, ["Let me check. <tool_", 'call>{"name": "get_weather", ',
                                             '"arguments": {"city": "Oslo"}}</tool_call>'])
    assert streamed == "Let me check. " and rest == ""
    [call] = calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"} and call.id.startswith("call_")


@pytest.mark.parametrize("garbage", ['<tool_call>{"name": "get_weather", "argu', "<tool_call>not json</tool_call>",
                                     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'])
def test_auto_returns_what_it_cannot_read_as_text(hermes, garbage):
    output = ToolOutput(PromptInput(messages=CHAT, tools=(WEATHER,)), hermes)
    streamed, rest, calls = _stream(output, ["x ", garbage])
    assert calls == () and streamed + rest == "x " + garbage  # nothing lost, nothing invented


def test_none_and_no_tools_pass_text_through(hermes):
    for prompt in (PromptInput(messages=CHAT), PromptInput(messages=CHAT, tools=(WEATHER,),
                                                           tool_choice=ToolChoice(ToolMode.NONE))):
        output = ToolOutput(prompt, hermes)
        assert output.feed("<tool_call>") == "<tool_call>" and output.finish() == ("", ())


def test_a_named_call_is_the_whole_output():
    output = ToolOutput(PromptInput(messages=CHAT, tools=(WEATHER,), tool_choice=ToolChoice(ToolMode.NAMED,
                                                                                             "get_weather")), None)
    streamed, rest, [call] = _stream(output, ['{"city":', '"Oslo"}'])
    assert streamed == rest == "" and call.name == "get_weather" and call.arguments == '{"city":"Oslo"}'
    cut = ToolOutput(PromptInput(messages=CHAT, tools=(WEATHER,), tool_choice=ToolChoice(ToolMode.NAMED,
                                                                                          "get_weather")), None)
    assert _stream(cut, ['{"city":"Os']) == ("", '{"city":"Os', ())  # cut short: the text, not a call


def test_the_required_constraint_admits_exactly_calls_of_the_given_tools():
    prompt = PromptInput(messages=CHAT, tools=(WEATHER, SEARCH), tool_choice=ToolChoice(ToolMode.REQUIRED))
    schema = json.loads(tool_call_constraint(prompt).spec)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                         {"name": "search_docs", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "rm_rf", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    [call_1, call_2] = _stream(ToolOutput(prompt, None), [json.dumps(
        [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "search_docs", "arguments": {}}])])[2]
    assert (call_1.name, call_2.name) == ("get_weather", "search_docs") and call_1.id != call_2.id


def test_tools_render_ahead_of_the_history_and_calls_round_trip(tokenizer):
    encoder = PromptEncoder(tokenizer)
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo"}')
    messages = (Message("system", "Be brief."), Message("user", "hi"), Message("assistant", "", (call,)),
                Message("tool", "sunny", tool_call_id="call_1"))
    text = encoder.render(messages, True, (WEATHER,))
    assert text.index("get_weather") < text.index("<|user|>")  # in the stable part, after the system prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    prefix = encoder.encode_prefix(messages[:3], (WEATHER,))
    whole = PromptInput(messages=messages, tools=(WEATHER,))
    assert encoder.encode(whole, prefix) == (encoder.encode(whole)[0], len(prefix.token_ids))
    other_tools = PromptInput(messages=messages, tools=(SEARCH,))
    assert encoder.encode(other_tools, prefix)[1] == 0  # a prefix with other tools is not reused


def test_schema_errors_name_the_json_pointer():
    assert json_pointer(["properties", "a/b", 0]) == "/properties/a~1b/0"
    with pytest.raises(InvalidArgument) as caught:
        check_schema("tools[2].parameters", '{"properties": {"when": {"type": "strin"}}}', max_depth=8)
    assert str(caught.value).startswith("tools[2].parameters: is not a valid JSON Schema at /properties/when/type")


def test_strict_response_formats_close_objects_but_not_data():
    schema = {"type": "object", "properties": {"type": {"type": "string", "enum": ["object"]},
                                               "properties": {"type": "object", "additionalProperties": True}},
              "$defs": {"x": {"properties": {"a": {"const": {"type": "object"}}}}}}
    request = pb.ChatRequest(message="hi", response_format=pb.ResponseFormat(
        json_schema=pb.JsonSchemaFormat(schema=json.dumps(schema), strict=True)))
    sent = json.loads(turn_request_from_proto(request).sampling.structured_output.json_schema)
    assert sent["additionalProperties"] is False
    assert sent["properties"]["type"] == {"type": "string", "enum": ["object"]}  # a property named "type"
    assert sent["properties"]["properties"]["additionalProperties"] is True  # said otherwise: kept
    assert sent["$defs"]["x"]["additionalProperties"] is False
    assert sent["$defs"]["x"]["properties"]["a"] == {"const": {"type": "object"}}  # data, untouched


def test_tools_and_results_change_the_idempotency_fingerprint_and_plain_turns_keep_theirs():
    plain = pb.ChatRequest(message="hi", session_id="s")
    with_tools = pb.ChatRequest(message="hi", session_id="s", tools=[inference_pb2.Tool(name="t")])
    with_result = pb.ChatRequest(message="hi", session_id="s", tool_results=[pb.ToolResult(tool_call_id="c")])
    assert len({turn_fingerprint(r) for r in (plain, with_tools, with_result)}) == 3
    assert turn_fingerprint(plain) == turn_fingerprint(pb.ChatRequest(message="hi", session_id="t"))


def test_a_history_window_of_a_tool_loop_starts_on_a_user_message():
    roles = ["user", "assistant", "tool", "assistant", "tool", "assistant", "user", "assistant", "tool", "assistant"]
    rows = [{"ordinal": i, "role": role, "token_count": 1} for i, role in enumerate(roles)][::-1]
    window = history_window(rows, max_messages=6, token_budget=1000, step=2)
    assert window.messages[0]["role"] == "user" and window.start == 6
    assert [m["ordinal"] for m in window.messages] == [6, 7, 8, 9]


@pytest.mark.parametrize(("request_", "field", "says"), [
    (pb.ChatRequest(tool_results=[pb.ToolResult(tool_call_id=f"c{i}") for i in range(3)]), "tool_results",
     "the limit is 2 (AGW_GATEWAY_MAX_TOOL_RESULTS)"),
    (pb.ChatRequest(tool_results=[pb.ToolResult(tool_call_id="c", content="x" * 101)]), "tool_results[0].content",
     "AGW_GATEWAY_MAX_MESSAGE_CHARS"),
    (pb.ChatRequest(tool_results=[pb.ToolResult(tool_call_id="c" * 300)]), "tool_results[0].tool_call_id",
     "AGW_GATEWAY_MAX_KEY_CHARS"),
    (pb.ChatRequest(tools=[inference_pb2.Tool(name="t", description="d" * 11)]), "tools[0].description",
     "AGW_GATEWAY_MAX_TOOL_DESCRIPTION_CHARS"),
    (pb.ChatRequest(response_format=pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(name="n" * 300))),
     "response_format.json_schema.name", "AGW_GATEWAY_MAX_KEY_CHARS"),
    (pb.ChatRequest(generation=inference_pb2.SamplingParams(structured_output=inference_pb2.StructuredOutput(
        regex="a" * 65))), "generation.structured_output.regex", "AGW_GATEWAY_MAX_SCHEMA_BYTES"),
    (pb.ChatRequest(generation=inference_pb2.SamplingParams(structured_output=inference_pb2.StructuredOutput(
        choice=inference_pb2.Choices(values=["a", "b", "c"])))), "generation.structured_output.choice.values",
     "AGW_GATEWAY_MAX_CHOICE_VALUES"),
])
def test_every_new_chat_field_has_a_bound_named_in_its_refusal(request_, field, says):
    from servicekit.bounds import Bounds
    from gateway.settings import GatewaySettings

    bounds = Bounds(GatewaySettings(max_tool_results=2, max_message_chars=100, max_tool_description_chars=10,
                                    max_schema_bytes=64, max_choice_values=2))
    request_.message = "hi"
    with pytest.raises(InvalidArgument) as caught:
        bounds.chat(request_)
    assert caught.value.field == field and says in str(caught.value), str(caught.value)


def test_generate_passthrough_bounds_tools_and_calls():
    from servicekit.bounds import Bounds
    from gateway.settings import GatewaySettings

    bounds = Bounds(GatewaySettings(max_tools=1, max_message_chars=100))
    chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(
        role=inference_pb2.ROLE_ASSISTANT, tool_calls=[inference_pb2.ToolCall(arguments="x" * 101)])])
    with pytest.raises(InvalidArgument) as caught:
        bounds.generate(pb.GenerateRequest(request=inference_pb2.GenerateRequest(chat=chat)))
    assert caught.value.field == "request.chat.messages[0].tool_calls[0].arguments"
    chat = inference_pb2.ChatMessages(tools=[inference_pb2.Tool(name="a"), inference_pb2.Tool(name="b")])
    with pytest.raises(InvalidArgument) as caught:
        bounds.generate(pb.GenerateRequest(request=inference_pb2.GenerateRequest(chat=chat)))
    assert caught.value.field == "request.chat.tools"
