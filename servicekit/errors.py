"""Domain errors that know their gRPC status, and the one place that converts them.

Service code raises :class:`ServiceError` subclasses and stays free of
``grpc``; :class:`~servicekit.interceptors.ErrorInterceptor` turns them into
``context.abort`` with a ``google.rpc.Status`` (and its details) attached, and
:func:`from_rpc_error` turns a backend's status back into the same classes on
the client side.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class ServiceError(Exception):
    """An error a caller can act on; ``str(error)`` is the message it sees."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, details: Sequence[object] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.details = tuple(details)

    def to_status(self) -> status_pb2.Status:
        """The ``google.rpc.Status`` sent in the trailers."""
        packed = []
        for detail in self.details:
            any_msg = any_pb2.Any()
            any_msg.Pack(detail)
            packed.append(any_msg)
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)


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
        details = []
        if retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(retry_after_s * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        super().__init__(message, details=details)
        self.retry_after_s = retry_after_s


class Unavailable(ServiceError):
    """Not able to serve now (warming up, draining, a dependency down); retry later."""

    code = grpc.StatusCode.UNAVAILABLE


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


def trailing_metadata(error: ServiceError) -> tuple[tuple[str, bytes], ...]:
    """The trailers that carry ``error``'s rich status."""
    return ((STATUS_DETAILS_KEY, error.to_status().SerializeToString()),)


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


def from_rpc_error(error: grpc.aio.AioRpcError, *, backend: str) -> ServiceError:
    """A backend's failure as our own error, keeping its code and naming the backend.

    The client's problems (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) keep their
    meaning; everything else keeps its code with the backend named.
    """
    code = error.code()
    message = f"{backend}: {error.details() or code.name.lower()}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        failure: ServiceError = ServiceError(message)
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        failure = ResourceExhausted(message, retry_after_s=retry_delay_s(error) or 0.1)
    else:
        failure = _BY_CODE.get(code, Internal)(message)
    failure.code = code
    status = status_details(error)
    if status is not None and code != grpc.StatusCode.RESOURCE_EXHAUSTED:
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

