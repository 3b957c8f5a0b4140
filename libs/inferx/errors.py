"""One place that maps errors to gRPC status codes, in both directions.

Domain code raises an `InferxError` subclass; the server bootstrap turns it into
the matching status (`grpc_status_for`). Clients turn an `AioRpcError` back into the
same typed exception (`from_rpc_error`), so the CLI and SDK never show a traceback.
"""

from __future__ import annotations

import grpc


class InferxError(Exception):
    """Base of every error InferX reports to callers."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self, message: str, *, retry_after_s: float | None = None, owner_address: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        #: a partitioned service's answer to a call for a partition it does not own: the
        #: owner's address ("" = no owner yet), so the caller re-resolves (see OWNER_KEY)
        self.owner_address = owner_address


class InvalidArgument(InferxError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(InferxError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(InferxError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(InferxError):
    code = grpc.StatusCode.ABORTED


class ResourceExhausted(InferxError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(InferxError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(InferxError):
    code = grpc.StatusCode.UNAVAILABLE


class Internal(InferxError):
    code = grpc.StatusCode.INTERNAL


class AlreadyExists(InferxError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unauthenticated(InferxError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(InferxError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(InferxError):
    """The server does not offer this call (e.g. a worker whose engine reports no KV events)."""

    code = grpc.StatusCode.UNIMPLEMENTED


_BY_CODE: dict[grpc.StatusCode, type[InferxError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        Aborted,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        Internal,
        AlreadyExists,
        Unauthenticated,
        Unimplemented,
        PermissionDenied,
    )
}

# Trailing metadata key carrying a retry hint for RESOURCE_EXHAUSTED / UNAVAILABLE.
RETRY_AFTER_KEY = "inferx-retry-after-s"
# Trailing metadata key set on every status an InferX service's own code raised (value:
# "1"): a failed call without it was ended by the transport (the peer died, the
# connection dropped), which a caller may treat differently (the router re-submits a
# hop whose scheduler died).
SERVICE_STATUS_KEY = "inferx-status"
# Trailing metadata key of a "not the owner" answer (FAILED_PRECONDITION, or UNAVAILABLE
# while nobody owns the partition): the owner's address, "" when there is none yet.
OWNER_KEY = "inferx-partition-owner"


class NotOwner(FailedPrecondition):
    """A call for a partition (model pool) that this instance does not own."""

    def __init__(self, message: str, *, owner_address: str) -> None:
        super().__init__(message, owner_address=owner_address)


class NoOwner(Unavailable):
    """A call for a partition that no instance owns yet (an election is under way)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, owner_address="")


def _unreachable_hint(details: str, plaintext: bool | None) -> str:
    """Why a connection failed, where its text tells: a TLS client at a plaintext port
    (the server answers the handshake with plain HTTP/2: WRONG_VERSION_NUMBER), a
    plaintext client at a TLS port (the server closes the socket), else not running."""
    lowered = details.lower()
    if "wrong_version_number" in lowered or (
        plaintext is False and "handshake" in lowered and "ssl" in lowered
    ):
        return (
            "the TLS handshake failed: it looks like a plaintext (--insecure) port, and this "
            "client speaks TLS (drop --tls-ca / INFERX_TLS_CA, or start it with TLS)"
        )
    if "socket closed" in lowered and plaintext is not False:
        return (
            "it closed the connection: it looks like a TLS port, and this client speaks plaintext "
            "(give --tls-ca / INFERX_TLS_CA, the CA that issued its certificate)"
        )
    return "is it running?"


def from_rpc_error(
    error: grpc.aio.AioRpcError | grpc.RpcError, *, target: str = "", plaintext: bool | None = None
) -> InferxError:
    """Convert a failed call into the typed exception for its status code. `target`:
    what was called, named when it cannot be reached; `plaintext`: whether the caller
    spoke plaintext (None: not known), to tell a TLS/plaintext mismatch from a service
    that is not running."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    retry_after = None
    owner: str | None = None
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == RETRY_AFTER_KEY:
            try:
                retry_after = float(value)
            except ValueError:
                retry_after = None
        elif key == OWNER_KEY:
            owner = str(value)
    if code == grpc.StatusCode.UNAVAILABLE and target and "failed to connect" in details.lower():
        details = f"cannot reach {target}: {_unreachable_hint(details, plaintext)} ({details})"
    if owner is not None and code == grpc.StatusCode.FAILED_PRECONDITION:
        return NotOwner(details, owner_address=owner)
    if owner is not None and code == grpc.StatusCode.UNAVAILABLE:
        return NoOwner(details)
    cls = _BY_CODE.get(code, Internal)
    return cls(details, retry_after_s=retry_after)


# The status message travels percent-encoded in the grpc-message trailer, and a client
# drops a call whose trailers pass 8 KiB (soft limit) with RESOURCE_EXHAUSTED "Stream
# removed" instead of the real status. Messages are cut to fit well under that.
MAX_STATUS_MESSAGE_BYTES = 4096


def _encoded_size(char: str) -> int:
    """Bytes `char` takes in grpc-message: printable ASCII but '%' as is, else %XX per byte."""
    return 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8"))


def fit_status_message(message: str, limit: int = MAX_STATUS_MESSAGE_BYTES) -> str:
    """`message`, cut (with a note of how much was left out) so it fits a status trailer,
    and valid UTF-8: a lone surrogate, which gRPC cannot send, is written as its escape."""
    try:
        message.encode("utf-8")
    except UnicodeEncodeError:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(message) * 12 <= limit:  # 12: the most one character can take
        return message
    budget, used, keep = limit - 48, 0, None  # 48: room for the note
    for index, char in enumerate(message):
        used += _encoded_size(char)
        if keep is None and used > budget:
            keep = index
        if used > limit:
            assert keep is not None
            return f"{message[:keep]}... ({len(message) - keep:,} more characters)"
    return message


def status_trailers(error: InferxError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a status raised by a service for `error` (a plain call's,
    and a hop stream's call's too: `inferx.hopstream`)."""
    trailers: list[tuple[str, str]] = [(SERVICE_STATUS_KEY, "1")]
    if error.retry_after_s is not None:
        trailers.append((RETRY_AFTER_KEY, f"{error.retry_after_s:g}"))
    if error.owner_address is not None:
        trailers.append((OWNER_KEY, error.owner_address))
    return tuple(trailers)


async def abort_with(context: grpc.aio.ServicerContext, error: InferxError) -> None:
    """Abort the current RPC with the status that matches `error`."""
    context.set_trailing_metadata(status_trailers(error))
    await context.abort(error.code, fit_status_message(error.message))
