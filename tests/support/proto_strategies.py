"""Hypothesis strategies for arbitrary protobuf messages, built from their descriptors.

Every field may be set or not, scalars range over their whole type, enums
include values the contract does not define, strings include ones far past
any bound, maps and repeated fields get a few entries, nested messages
recurse to a depth limit. ``overrides`` narrows a field by
``(message name, field name)``, so that fuzzing does not spend its budget
generating thousands of tokens.
"""

from __future__ import annotations

import hypothesis.strategies as st
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor

_F = FieldDescriptor
_INTS = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1), _F.TYPE_SINT32: (-(2**31), 2**31 - 1), _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1), _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_INT64: (-(2**63), 2**63 - 1), _F.TYPE_SINT64: (-(2**63), 2**63 - 1), _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1), _F.TYPE_FIXED64: (0, 2**64 - 1),
}
#: Strings a fuzzer would not find alone: names that exist, ids of the right form, values past every bound.
SPECIAL_STRINGS = ("", "docs", "dev", "00000000-0000-0000-0000-000000000000", "../../etc/passwd", "t3-dev-docs",
                   '{"type": "object"}', '{"$ref": "#"}', "x" * 70_000, "\u0000", "🙂" * 300)


def _scalar(field: FieldDescriptor, overrides: dict):
    key = (field.containing_type.name, field.name)
    if key in overrides:
        return overrides[key]
    if field.type in _INTS:
        low, high = _INTS[field.type]
        return st.integers(low, high)
    if field.type == _F.TYPE_BOOL:
        return st.booleans()
    if field.type in (_F.TYPE_DOUBLE, _F.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=64 if field.type == _F.TYPE_DOUBLE else 32)
    if field.type == _F.TYPE_STRING:
        return st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL_STRINGS))
    if field.type == _F.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == _F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 1000))
    raise TypeError(f"no strategy for {field.full_name}")


@st.composite
def messages(draw, descriptor: Descriptor, overrides: dict | None = None, depth: int = 0, only: str | None = None):
    """An instance of ``descriptor``'s message with any subset of its fields set (``only``: just that one)."""
    overrides = overrides or {}
    message = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if (field.name != only) if only else not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            _fill_map(draw, message, field, overrides, depth)
        elif field.message_type is not None:
            if depth >= 3:
                continue
            values = draw(st.lists(messages(field.message_type, overrides, depth + 1), max_size=3)) \
                if field.is_repeated else [draw(messages(field.message_type, overrides, depth + 1))]
            target = getattr(message, field.name)
            for value in values:
                (target.add() if field.is_repeated else target).CopyFrom(value)
        elif field.is_repeated:
            getattr(message, field.name).extend(draw(st.lists(_scalar(field, overrides), max_size=4)))
        else:
            setattr(message, field.name, draw(_scalar(field, overrides)))
    return message


@st.composite
def one_field_changed(draw, base, overrides: dict | None = None):
    """``base`` (a valid request) with one top-level field set to an arbitrary value: past the first check,
    into the paths behind it."""
    descriptor = base.DESCRIPTOR
    if not descriptor.fields:
        return base
    field = draw(st.sampled_from(list(descriptor.fields)))
    change = draw(messages(descriptor, overrides, only=field.name))
    message = type(base)()
    message.CopyFrom(base)
    message.ClearField(field.name)
    message.MergeFrom(change)
    return message


def _fill_map(draw, message, field: FieldDescriptor, overrides: dict, depth: int) -> None:
    key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
    entries = draw(st.lists(_scalar(key_field, overrides), max_size=3, unique=True))
    target = getattr(message, field.name)
    for key in entries:
        if value_field.message_type is not None:
            if depth < 3:
                target[key].CopyFrom(draw(messages(value_field.message_type, overrides, depth + 1)))
        else:
            target[key] = draw(_scalar(value_field, overrides))


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` with bytes flipped, inserted, removed or the message cut short."""
    buffer = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(("flip", "insert", "delete", "truncate")))
        position = draw(st.integers(0, max(0, len(buffer) - 1)))
        if kind == "flip" and buffer:
            buffer[position] ^= draw(st.integers(1, 255))
        elif kind == "insert":
            buffer[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and buffer:
            del buffer[position:position + draw(st.integers(1, 4))]
        elif kind == "truncate":
            del buffer[position:]
    return bytes(buffer)
