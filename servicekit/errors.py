"""Domain errors that know their gRPC status, and the one place that converts them.

Service code raises :class:`ServiceError` subclasses and stays free of
``grpc``; :class:`~servicekit.interceptors.EdgeHandlers` turns them into
``context.abort`` with a ``google.rpc.Status`` (and its details) attached, and
:func:`from_rpc_error` turns a backend's status back into the same classes on
the client side.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"
_QUOTED_ERROR_ID = re.compile(r" \(error id [0-9a-f]+\)$")


def quote_error_id(message: str, error_id: str) -> str:
    """A status message that names the error id to quote when reporting it (our server faults)."""
    return f"{message} (error id {error_id})"


def without_error_id(message: str) -> str:
    """``message`` less what :func:`quote_error_id` added: what equal failures have in common."""
    return _QUOTED_ERROR_ID.sub("", message)


class ServiceError(Exception):
    """An error a caller can act on; ``str(error)`` is the message it sees."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, details: Sequence[object] = (), internal: str = "") -> None:
        """
        Args:
            message: what the caller sees: what happened and what to do, never an
                address, a database error or a backend's own text about itself.
            details: ``google.rpc`` detail messages sent with the status.
            internal: what only the logs and the span get (addresses, driver
                errors), filed under the error id the caller sees.
        """
        super().__init__(message)
        self.message = message
        self.details = tuple(details)
        self.internal = internal

    def to_status(self, message: str | None = None) -> status_pb2.Status:
        """The ``google.rpc.Status`` sent in the trailers (with ``message`` as sent, if it differs)."""
        packed = []
        for detail in self.details:
            any_msg = any_pb2.Any()
            any_msg.Pack(detail)
            packed.append(any_msg)
        return status_pb2.Status(code=self.code.value[0], message=message or self.message, details=packed)


class InvalidArgument(ServiceError):
    """The request is malformed or out of range; retrying it as is cannot help."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        super().__init__(f"{field}: {message}", details=[error_details_pb2.BadRequest(field_violations=[violation])])
        self.field = field


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(ServiceError):
    """The caller's verified identity may not call this method (or is on the denylist)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(ServiceError):
    """The caller presented no usable identity (no certificate, no SPIFFE ID, another trust domain)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Aborted(ServiceError):
    """The call lost a concurrency race (another turn holds its idempotency key); retry it."""

    code = grpc.StatusCode.ABORTED


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    """Over a limit; ``retry_after_s`` travels as ``google.rpc.RetryInfo``.

    ``retry_after_s=None`` sends no retry hint: for a request that can never
    fit, retrying as is cannot help.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, retry_after_s: float | None = 0.1) -> None:
        super().__init__(message, details=_retry_info(retry_after_s))
        self.retry_after_s = retry_after_s


def _retry_info(retry_after_s: float | None) -> list:
    """``google.rpc.RetryInfo`` for a retry hint of ``retry_after_s`` seconds; nothing for None."""
    if retry_after_s is None:
        return []
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_after_s * 1e9))
    return [error_details_pb2.RetryInfo(retry_delay=delay)]


class Unavailable(ServiceError):
    """Not able to serve now (warming up, draining, a dependency down); retry later.

    ``retry_after_s``, when the server knows roughly how long, travels as ``google.rpc.RetryInfo``.
    """

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, *, retry_after_s: float | None = None, internal: str = "") -> None:
        super().__init__(message, details=_retry_info(retry_after_s), internal=internal)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


class Unimplemented(ServiceError):
    """A method this server does not provide (an older server than the caller's contract)."""

    code = grpc.StatusCode.UNIMPLEMENTED


_BY_CODE: dict[grpc.StatusCode, type[ServiceError]] = {
    cls.code: cls
    for cls in (NotFound, AlreadyExists, FailedPrecondition, Unavailable, DeadlineExceeded, Internal, Unimplemented,
                Aborted)
}


def trailing_metadata(error: ServiceError, message: str | None = None) -> tuple[tuple[str, bytes], ...]:
    """The trailers that carry ``error``'s rich status."""
    return ((STATUS_DETAILS_KEY, error.to_status(message).SerializeToString()),)


def status_details(error: grpc.aio.AioRpcError | grpc.RpcError) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` a server attached to a failed call, if any."""
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_DETAILS_KEY:
            return status_pb2.Status.FromString(value)
    return None


def retry_delay_s(error: grpc.RpcError) -> float | None:
    """The server's retry hint (``google.rpc.RetryInfo``), in seconds."""
    status = status_details(error)
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.ToNanoseconds() / 1e9
    return None


#: Statuses whose backend text is about the caller's request, and so is the caller's to read.
CALLER_FAULTS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
})


def from_rpc_error(error: grpc.aio.AioRpcError, *, backend: str, where: str = "") -> ServiceError:
    """A backend's failure as our own error, keeping its code and naming the backend (not its address).

    The client's problems (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, ...)
    keep the backend's text, which is about the request; any other failure
    tells the caller which service failed and keeps the backend's own text and
    address for the logs (``internal``).
    """
    code = error.code()
    text = error.details() or code.name.lower()
    internal = f"{backend} backend at {where or '?'}: {code.name}: {text}"
    if code in CALLER_FAULTS or code == grpc.StatusCode.UNIMPLEMENTED:  # the latter: which contract it serves
        message = f"{backend}: {text}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"the {backend} service did not answer within the deadline"
    else:
        message = f"the {backend} service failed this call ({code.name}); retry shortly"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        failure: ServiceError = ServiceError(message, internal=internal)
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        failure = ResourceExhausted(message, retry_after_s=retry_delay_s(error) or 0.1)
        failure.internal = internal
    else:
        failure = _BY_CODE.get(code, Internal)(message, internal=internal)
    failure.code = code
    status = status_details(error)
    if status is not None and code in CALLER_FAULTS and code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        failure.details = tuple(_unpack_known(status.details))
    return failure


def _unpack_known(details: Sequence[any_pb2.Any]) -> list[object]:
    known = (error_details_pb2.BadRequest, error_details_pb2.RetryInfo, error_details_pb2.ErrorInfo)
    out = []
    for detail in details:
        for cls in known:
            if detail.Is(cls.DESCRIPTOR):
                msg = cls()
                detail.Unpack(msg)
                out.append(msg)
    return out

