"""Forwarding a backend's serialised messages without parsing them.

A gateway method that only passes a backend's answer on (``Generate``,
``Retrieve``) has a response message of one field holding the backend's
message. Its wire form is that field's header followed by the backend's bytes
unchanged, so the gateway can answer with ``header + payload`` and never parse
or re-serialise what it forwards: the per-message cost of a proxy, not of a
protobuf round trip. Both ends use identity serialisers: the backend call's
response deserialiser and the gateway method's response serialiser are None.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from functools import partial

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from servicekit.wire import ONE_BYTE, varint

_LENGTH_DELIMITED = 2


#: The tags of fields 1 to 15 (one byte each): every wrapped message of a stream starts with one.
_TAGS = {number: varint(number << 3 | _LENGTH_DELIMITED) for number in range(1, 16)}


def wrap(field_number: int, payload: bytes) -> bytes:
    """The wire form of a message whose only set field ``field_number`` holds the message ``payload``."""
    # Per forwarded message (a streamed token's): the tag is looked up, and a length under 128 is one byte.
    tag = _TAGS.get(field_number) or varint(field_number << 3 | _LENGTH_DELIMITED)
    size = len(payload)
    return b"".join((tag, ONE_BYTE[size] if size < 0x80 else varint(size), payload))


def unwrap(field_number: int, data: bytes) -> bytes:
    """The payload of :func:`wrap`'s output (what a test or a client reading raw bytes needs)."""
    header = varint(field_number << 3 | _LENGTH_DELIMITED)
    if not data.startswith(header):
        raise ValueError(f"not a message holding only field {field_number}")
    length, shift, index = 0, 0, len(header)
    while True:
        byte = data[index]
        length |= (byte & 0x7F) << shift
        index += 1
        if byte < 0x80:
            break
        shift += 7
    if index + length != len(data):
        raise ValueError(f"field {field_number} holds {length} bytes, the message has {len(data) - index}")
    return data[index:]


def _message_class(descriptor):
    return message_factory.GetMessageClass(descriptor)


def method_handlers(service: ServiceDescriptor, servicer, raw_responses: Collection[str] = ()) -> dict:
    """The generated ``add_*Servicer_to_server``'s handlers, except that methods named in ``raw_responses``
    answer with bytes as they are (the handler returns or writes serialised messages)."""
    handlers = {}
    for method in service.methods:
        factory = getattr(grpc, f"{_kind(method)}_rpc_method_handler")
        response = _message_class(method.output_type)
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=_message_class(method.input_type).FromString,
            response_serializer=None if method.name in raw_responses else response.SerializeToString,
        )
    return handlers


def add_service(server, service: ServiceDescriptor, servicer, raw_responses: Collection[str] = ()) -> None:
    """Register ``servicer`` for ``service`` on ``server`` (see :func:`method_handlers`)."""
    handlers = method_handlers(service, servicer, raw_responses)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _kind(method: MethodDescriptor) -> str:
    return f"{'stream' if method.client_streaming else 'unary'}_{'stream' if method.server_streaming else 'unary'}"


def raw_multicallable(channel: grpc.aio.Channel, method: MethodDescriptor):
    """A callable for ``method`` on ``channel`` that serialises the request and returns the response(s) as bytes."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    make = getattr(channel, _kind(method))
    return make(path, request_serializer=_message_class(method.input_type).SerializeToString,
                response_deserializer=None, _registered_method=True)


def add_public_passthroughs(server, service: ServiceDescriptor, behaviors: Mapping[str, Callable]) -> None:
    """Serve the public passthrough methods of ``service`` named in ``behaviors`` on a backend, for an edge.

    Each public response holds the backend's own message in its one field
    ``response = 1``: a behavior returns (or yields) the backend's message,
    and its serialiser writes it behind that field's header, so the edge
    forwards the backend's frames as they are, and a client reads what the
    gateway's own passthrough would have sent it, byte for byte.
    """
    handlers = {}
    for name, behavior in behaviors.items():
        method = service.methods_by_name[name]
        field = method.output_type.fields_by_name["response"].number
        factory = getattr(grpc, f"{_kind(method)}_rpc_method_handler")
        handlers[name] = factory(behavior, request_deserializer=_message_class(method.input_type).FromString,
                                 response_serializer=partial(_serialise_into, field))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _serialise_into(field_number: int, message) -> bytes:
    return wrap(field_number, message.SerializeToString())
