"""Conversion from the gateway's domain records to ``agent.gateway.v1`` messages."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from agent.gateway.v1 import gateway_pb2 as pb
from inference.convert import ROLE_BY_NAME

from gateway.sessions import MessageRecord, SessionRecord


def _timestamp(value) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value)
    return stamp


def session_to_proto(session: SessionRecord) -> pb.Session:
    return pb.Session(id=session.id, create_time=_timestamp(session.created_at), metadata=session.metadata,
                      message_count=session.message_count)


def message_to_proto(message: MessageRecord) -> pb.Message:
    return pb.Message(
        ordinal=message.ordinal, role=ROLE_BY_NAME.get(message.role, 0), content=message.content,
        token_count=message.token_count, trace_id=message.trace_id, create_time=_timestamp(message.created_at),
    )
