"""Protobuf's wire format written by hand, where building a message would cost more than its bytes: varints.

``servicekit.passthrough`` wraps a backend's message behind a field header
with it, and ``servicekit.span_export`` writes OTLP spans.
"""

from __future__ import annotations

#: The varints of 0 to 127: one byte each, the value itself.
ONE_BYTE = [bytes((value,)) for value in range(0x80)]


def varint(value: int) -> bytes:
    """``value`` (0 or more) as a base-128 varint, least significant group first."""
    if value < 0x80:
        return ONE_BYTE[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
