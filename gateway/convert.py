"""Conversion from the gateway's domain records to ``agent.gateway.v1`` messages."""

from __future__ import annotations

import hashlib
import json

from google.protobuf import timestamp_pb2

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2

from servicekit.errors import InvalidArgument

from gateway.sessions import MessageRecord, SessionRecord, parse_session_id
from gateway.turn_types import (
    ContextReady,
    Delta,
    Finished,
    Outcome,
    RetrievalAsk,
    StageTimes,
    ToolCalled,
    ToolResult,
    TurnEvent,
    TurnRequest,
)

_FORCING_TOOL_MODES = (inference_pb2.TOOL_CHOICE_MODE_REQUIRED,)


def role_from_name(name: str) -> int:
    """A stored role ("user", "assistant") as the contract's enum value, by the enum's own names."""
    try:
        return inference_pb2.Role.Value(f"ROLE_{name.upper()}")
    except ValueError:
        return inference_pb2.ROLE_UNSPECIFIED


def _timestamp(value) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value)
    return stamp


def session_to_proto(session: SessionRecord) -> pb.Session:
    return pb.Session(id=session.id, create_time=_timestamp(session.created_at), metadata=session.metadata,
                      message_count=session.message_count)


def tool_calls_from_json(calls: list[dict] | None) -> list[inference_pb2.ToolCall]:
    """Stored tool calls ({"id", "name", "arguments"} objects) as the contract's messages."""
    return [inference_pb2.ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"]) for c in calls or ()]


def tool_calls_to_json(calls) -> list[dict]:
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


def message_to_proto(message: MessageRecord) -> pb.Message:
    return pb.Message(
        ordinal=message.ordinal, role=role_from_name(message.role), content=message.content,
        token_count=message.token_count, trace_id=message.trace_id, create_time=_timestamp(message.created_at),
        tool_calls=tool_calls_from_json(message.tool_calls), tool_call_id=message.tool_call_id,
    )


def outcome_to_proto(outcome: Outcome) -> pb.TurnSummary:
    return pb.TurnSummary(
        finish_reason=outcome.finish_reason, usage=outcome.usage, timings=pb.StageTimings(**outcome.timings.as_dict()),
        degraded=bool(outcome.degraded or outcome.stored_reason), degraded_reason=outcome.degraded_reason,
        trace_id=outcome.trace_id, session_id=outcome.session_id, replayed=outcome.replayed,
        engine_timings=outcome.engine_timings)


def outcome_from_proto(summary: pb.TurnSummary) -> Outcome:
    """A stored turn's summary, read back for a replay."""
    timings = StageTimes(**{name: getattr(summary.timings, name) for name in StageTimes().as_dict()})
    return Outcome(finish_reason=summary.finish_reason, usage=summary.usage if summary.HasField("usage") else None,
                   timings=timings, trace_id=summary.trace_id, session_id=summary.session_id,
                   replayed=summary.replayed, stored_reason=summary.degraded_reason,
                   engine_timings=summary.engine_timings if summary.HasField("engine_timings") else None)


def turn_event_to_proto(event: TurnEvent) -> pb.ChatResponse:
    """A turn's event as the Chat stream sends it."""
    if isinstance(event, Delta):
        return pb.ChatResponse(delta=pb.TokenDelta(text=event.text))
    if isinstance(event, ContextReady):
        return pb.ChatResponse(context=pb.ContextEvent(documents=event.documents))
    if isinstance(event, ToolCalled):
        return pb.ChatResponse(tool_call=pb.ToolCallEvent(call=event.call))
    if isinstance(event, Finished):
        return pb.ChatResponse(final=outcome_to_proto(event.outcome))
    raise TypeError(f"not a turn event: {event!r}")


def turn_fingerprint(request: pb.ChatRequest) -> str:
    """What makes two requests "the same turn" for an idempotency key: a hash of what decides the answer
    (message, system prompt, retrieval options, generation parameters, tools, tool choice, response format
    and tool results)."""
    digest = hashlib.sha256()
    parts = [request.message.encode(), request.system_prompt.encode(),
             request.retrieval.SerializeToString(deterministic=True),
             request.generation.SerializeToString(deterministic=True)]
    if request.tools or request.HasField("tool_choice") or request.HasField("response_format") or request.tool_results:
        # Only when used: a tool-less request keeps the fingerprint it had before tools existed.
        parts += [b"".join(t.SerializeToString(deterministic=True) for t in request.tools),
                  request.tool_choice.SerializeToString(deterministic=True),
                  request.response_format.SerializeToString(deterministic=True),
                  b"".join(r.SerializeToString(deterministic=True) for r in request.tool_results)]
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def turn_request_from_proto(request: pb.ChatRequest) -> TurnRequest:
    """A Chat request as the turn takes it, with the turn's own rules checked (sizes: servicekit.bounds)."""
    if not request.message.strip() and not request.tool_results:
        raise InvalidArgument("message", "is empty; send the user's message, tool_results, or both")
    tool_results = _tool_results(request)
    _check_tool_choice(request)
    if request.idempotency_key and not request.session_id:
        raise InvalidArgument("idempotency_key", "needs a session_id: stateless turns store nothing to replay")
    options = request.retrieval
    wanted = request.HasField("retrieval") and options.collection and not (
        options.HasField("enabled") and not options.enabled)
    retrieval = RetrievalAsk(options.collection, options.top_k,
                             options.filter if options.HasField("filter") else None,
                             tuple(options.payload_fields)) if wanted else None
    return TurnRequest(
        message=request.message if request.message.strip() else "",  # blank beside tool results: none
        session_id=parse_session_id(request.session_id) if request.session_id else None,
        system_prompt=request.system_prompt, retrieval=retrieval, sampling=_sampling(request),
        idempotency_key=request.idempotency_key,
        fingerprint=turn_fingerprint(request) if request.idempotency_key else "",
        tools=tuple(request.tools), tool_choice=request.tool_choice if request.HasField("tool_choice") else None,
        tool_results=tool_results)


def _tool_results(request: pb.ChatRequest) -> tuple[ToolResult, ...]:
    if request.tool_results and not request.session_id:
        raise InvalidArgument("tool_results", "need a session_id: a result answers a call stored in the session")
    seen: set[str] = set()
    for index, result in enumerate(request.tool_results):
        if not result.tool_call_id:
            raise InvalidArgument(f"tool_results[{index}].tool_call_id", "is empty; name the call this answers")
        if result.tool_call_id in seen:
            raise InvalidArgument(f"tool_results[{index}].tool_call_id",
                                  f"{result.tool_call_id!r} is answered twice; send one result per call")
        seen.add(result.tool_call_id)
    return tuple(ToolResult(r.tool_call_id, r.content) for r in request.tool_results)


def _check_tool_choice(request: pb.ChatRequest) -> None:
    choice = request.tool_choice
    forced = choice.WhichOneof("choice") == "tool_name" or choice.mode in _FORCING_TOOL_MODES
    if choice.WhichOneof("choice") == "tool_name" and choice.tool_name not in {t.name for t in request.tools}:
        raise InvalidArgument("tool_choice.tool_name", f"{choice.tool_name[:80]!r} is not one of tools")
    if choice.mode in _FORCING_TOOL_MODES and not request.tools:
        raise InvalidArgument("tool_choice", "is REQUIRED but no tools are given; send tools")
    if forced and request.response_format.WhichOneof("format") == "json_schema":
        raise InvalidArgument("response_format", "cannot be combined with tool_choice REQUIRED or a named tool, "
                              "which constrain the answer to the tool's arguments; drop one")


def _sampling(request: pb.ChatRequest) -> inference_pb2.SamplingParams:
    """The generation options, with the response format as the inference service's constraint."""
    if request.response_format.WhichOneof("format") != "json_schema":
        return request.generation
    if request.generation.HasField("structured_output"):
        raise InvalidArgument("generation.structured_output", "cannot be combined with response_format; use one")
    wanted = request.response_format.json_schema
    if not wanted.schema:
        raise InvalidArgument("response_format.json_schema.schema", "is empty; send a JSON Schema")
    schema = _closed(json.loads(wanted.schema)) if wanted.strict else None
    sampling = inference_pb2.SamplingParams()
    sampling.CopyFrom(request.generation)
    sampling.structured_output.json_schema = (json.dumps(schema, separators=(",", ":"))
                                              if schema is not None else wanted.schema)
    return sampling


#: Keywords whose value maps names to schemas (not a schema itself); and those holding data, not schemas.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples")


def _closed(schema):
    """Strict mode: every object schema that does not say otherwise gets "additionalProperties": false."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _closed(sub) for name, sub in value.items()}
        else:
            closed[key] = value if key in _DATA else _closed(value)
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed
