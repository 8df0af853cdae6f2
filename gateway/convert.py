"""Conversion from the gateway's domain records to ``agent.gateway.v1`` messages."""

from __future__ import annotations

import hashlib

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
    TurnEvent,
    TurnRequest,
)


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


def message_to_proto(message: MessageRecord) -> pb.Message:
    return pb.Message(
        ordinal=message.ordinal, role=role_from_name(message.role), content=message.content,
        token_count=message.token_count, trace_id=message.trace_id, create_time=_timestamp(message.created_at),
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
    if isinstance(event, Finished):
        return pb.ChatResponse(final=outcome_to_proto(event.outcome))
    raise TypeError(f"not a turn event: {event!r}")


def turn_fingerprint(request: pb.ChatRequest) -> str:
    """What makes two requests "the same turn" for an idempotency key: a hash of what decides the answer
    (message, system prompt, retrieval options, generation parameters)."""
    digest = hashlib.sha256()
    for part in (request.message.encode(), request.system_prompt.encode(),
                 request.retrieval.SerializeToString(deterministic=True),
                 request.generation.SerializeToString(deterministic=True)):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def turn_request_from_proto(request: pb.ChatRequest) -> TurnRequest:
    """A Chat request as the turn takes it, with the turn's own rules checked (sizes: gateway.bounds)."""
    if not request.message.strip():
        raise InvalidArgument("message", "is empty; send the user's message")
    if request.idempotency_key and not request.session_id:
        raise InvalidArgument("idempotency_key", "needs a session_id: stateless turns store nothing to replay")
    options = request.retrieval
    wanted = request.HasField("retrieval") and options.collection and not (
        options.HasField("enabled") and not options.enabled)
    retrieval = RetrievalAsk(options.collection, options.top_k,
                             options.filter if options.HasField("filter") else None,
                             tuple(options.payload_fields)) if wanted else None
    return TurnRequest(
        message=request.message,
        session_id=parse_session_id(request.session_id) if request.session_id else None,
        system_prompt=request.system_prompt, retrieval=retrieval, sampling=request.generation,
        idempotency_key=request.idempotency_key,
        fingerprint=turn_fingerprint(request) if request.idempotency_key else "")
