"""The call's request metadata, read from gRPC once per call.

``context.invocation_metadata()`` is not a field: grpc.aio builds a new tuple
from the C core's metadata on every call of it, decoding each key and value
(2.0-2.4 µs a read for a plain call, 3.6-4.0 with an edge's forwarded
certificate of 1.2 KB, grpcio 1.85: bench/metadata_reads.py). gRPC already builds it once
per call for the generic handler lookup, and the server span, the
authorization of an edge's call and the affinity bound each read it again.
The edge's wrapper (``servicekit.interceptors``) keeps the tuple the lookup
was given, for the rest of the call's task; :func:`call_metadata` reads it.
"""

from __future__ import annotations

from contextvars import ContextVar

# Set in the call's own task by its handler lookup (grpc.aio looks the handler up and runs it in one task per
# call, so no call sees another's), read by the call's handler.
_METADATA: ContextVar[tuple | None] = ContextVar("agw_call_metadata", default=None)


def keep(metadata: tuple | None) -> None:
    """Keep ``metadata`` (the handler lookup's ``invocation_metadata``) for the rest of the current call."""
    _METADATA.set(metadata)


def call_metadata(context) -> tuple:
    """The current call's request metadata: what its handler lookup was given, or ``context``'s own."""
    metadata = _METADATA.get()
    if metadata is None:  # a handler run without the lookup (a test calling it directly)
        metadata = context.invocation_metadata()
    return metadata or ()
