"""A scripted client call that its peer has already ended, for the rules around grpc.aio's lost statuses."""

from __future__ import annotations

import asyncio

import grpc

from servicekit.channels import CORE_WRITE_PLACEHOLDER


class EndedCall:
    """A call the peer ended with ``code``/``details``, whose writes fail.

    Its status reads as grpc.aio's write placeholder (INTERNAL, "Internal
    error from Core") for the first ``placeholder_reads`` reads, then as the
    peer's; ``None``: the placeholder for good, as when grpc.aio overwrote the
    peer's status with it.
    """

    def __init__(self, code: grpc.StatusCode, details: str, placeholder_reads: int | None = 0) -> None:
        self._code, self._details = code, details
        self._left = placeholder_reads

    def _placeholder(self) -> bool:
        return self._left is None or self._left > 0

    async def write(self, message) -> None:
        raise asyncio.InvalidStateError("the call is already finished")

    async def code(self):
        if self._left:
            self._left -= 1
            return grpc.StatusCode.INTERNAL
        return grpc.StatusCode.INTERNAL if self._left is None else self._code

    async def details(self):
        return CORE_WRITE_PLACEHOLDER if self._placeholder() else self._details

    async def initial_metadata(self):
        return ()

    async def trailing_metadata(self):
        return ()

    async def debug_error_string(self):
        return ""

    def cancel(self) -> None:
        pass
