"""Errors of the tpubox client: one exception class per tpubox error kind.

Every call to the daemon that fails raises a :class:`TpuboxError` subclass. Its ``kind`` is the
kebab-case tpubox error kind the daemon put in the ``tpubox-error-kind`` trailer (the names of
``tpubox:device/types.error-kind`` plus ``unauthenticated`` and ``session-ended``), or, when the
daemon could not be reached at all, ``unavailable``. A limit that refused a request is named in
the message (``max-device-bytes``, ``max-live-tensors``, ...) and in ``limit``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import grpc

__all__ = [
    "TpuboxError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "PermissionDenied",
    "ResourceExhausted",
    "Unsupported",
    "CompileFailed",
    "ExecutionFailed",
    "Internal",
    "Unauthenticated",
    "SessionEnded",
    "Unavailable",
    "DeadlineExceeded",
    "ERROR_KIND_KEY",
]

#: The trailing-metadata key that carries the exact tpubox error kind.
ERROR_KIND_KEY = "tpubox-error-kind"

_LIMIT = re.compile(r"\bmax-[a-z]+(?:-[a-z]+)*\b")


class TpuboxError(Exception):
    """An error of the tpubox daemon (or of reaching it).

    Args:
        kind: the kebab-case error kind, e.g. ``"resource-exhausted"``.
        message: what went wrong, for people; a refused limit is named in it.

    Attributes:
        kind: as above; each subclass has its own (``NotFound.KIND == "not-found"``).
        message: as above.
        limit: the first limit name (``max-...``) in the message, or ``None``.
        code: the gRPC status code the daemon answered with, or ``None`` for errors made here.
    """

    KIND = "internal"

    def __init__(self, kind: str, message: str, code: grpc.StatusCode | None = None):
        super().__init__(kind, message)
        self.kind = kind
        self.message = message
        self.code = code
        m = _LIMIT.search(message)
        self.limit: str | None = m.group(0) if m else None

    def __reduce__(self):
        return (type(self), (self.kind, self.message))

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class InvalidArgument(TpuboxError):
    """A request the daemon refused as malformed: wrong byte count, unknown dtype, wrong
    argument count or shapes for an executable, a requested limit above the tenant's."""

    KIND = "invalid-argument"


class NotFound(TpuboxError):
    """A handle the session does not have (never made, freed, or another session's), or an
    unknown weight set or component."""

    KIND = "not-found"


class FailedPrecondition(TpuboxError):
    """A handle in a state that does not allow the call, e.g. a tensor that was donated."""

    KIND = "failed-precondition"


class PermissionDenied(TpuboxError):
    """Not allowed: a tenant without sessions, a program the policy refuses (its rule is named:
    ``unbounded-loop``, ``max-loop-trips``, ``host-transfer``, ``custom-call``), donating a
    shared weight."""

    KIND = "permission-denied"


class ResourceExhausted(TpuboxError):
    """Over a limit; the limit is named in the message and in ``limit``
    (``max-device-bytes``, ``max-live-tensors``, ``max-sessions``, ...). Nothing was
    allocated: free something and go on."""

    KIND = "resource-exhausted"


class Unsupported(TpuboxError):
    """Something this daemon or its plugin does not do."""

    KIND = "unsupported"


class CompileFailed(TpuboxError):
    """The program did not parse, verify or compile."""

    KIND = "compile-failed"


class ExecutionFailed(TpuboxError):
    """The device failed to run the program."""

    KIND = "execution-failed"


class Internal(TpuboxError):
    """A daemon fault (or an answer this client cannot read)."""

    KIND = "internal"


class Unauthenticated(TpuboxError):
    """No token, or a token the daemon does not know."""

    KIND = "unauthenticated"


class SessionEnded(TpuboxError):
    """The session has ended (closed, timed out, its last Attach stream went away, or the
    daemon is stopping): open a new one."""

    KIND = "session-ended"


class Unavailable(TpuboxError):
    """The daemon cannot be reached (not running, the socket or port is wrong) or went away
    during the call. The message names the address."""

    KIND = "unavailable"


class DeadlineExceeded(TpuboxError):
    """The call did not finish within its deadline."""

    KIND = "deadline-exceeded"


_BY_KIND: dict[str, type[TpuboxError]] = {
    c.KIND: c
    for c in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        PermissionDenied,
        ResourceExhausted,
        Unsupported,
        CompileFailed,
        ExecutionFailed,
        Internal,
        Unauthenticated,
        SessionEnded,
        Unavailable,
        DeadlineExceeded,
    )
}

# Without the trailer (a status from gRPC itself, or a proxy), the kind follows the status code.
_BY_CODE: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid-argument",
    grpc.StatusCode.NOT_FOUND: "not-found",
    grpc.StatusCode.FAILED_PRECONDITION: "failed-precondition",
    grpc.StatusCode.PERMISSION_DENIED: "permission-denied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource-exhausted",
    grpc.StatusCode.UNIMPLEMENTED: "unsupported",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline-exceeded",
    grpc.StatusCode.INTERNAL: "internal",
    grpc.StatusCode.UNKNOWN: "internal",
    grpc.StatusCode.DATA_LOSS: "internal",
    grpc.StatusCode.ABORTED: "internal",
    grpc.StatusCode.OUT_OF_RANGE: "invalid-argument",
    grpc.StatusCode.ALREADY_EXISTS: "failed-precondition",
    grpc.StatusCode.CANCELLED: "unavailable",
}


def error(kind: str, message: str, code: grpc.StatusCode | None = None) -> TpuboxError:
    """The exception for KIND (a known kebab-case kind; any other is :class:`TpuboxError`)."""
    return _BY_KIND.get(kind, TpuboxError)(kind, message, code)


def _socket_denied(address: str) -> str | None:
    """Why this user cannot use the Unix socket ADDRESS names (it exists but is not readable
    and writable), or None (not a Unix socket, not there, or open to this user)."""
    a = str(address).strip()
    if a.startswith("unix:"):
        a = a[len("unix:") :]
    elif not a.startswith(("/", "./", "../", "~")):
        return None
    path = os.path.abspath(os.path.expanduser(a))
    try:
        st = os.stat(path)
    except OSError:
        return None
    if os.access(path, os.R_OK | os.W_OK):
        return None
    return (
        f"the tpubox daemon's socket {path} is not open to this user (mode "
        f"{st.st_mode & 0o777:04o}, owner uid {st.st_uid}, group gid {st.st_gid}; this process "
        f"runs as uid {os.getuid()}): run as the daemon's user or a member of the socket's "
        "group, or connect over TCP"
    )


def from_rpc_error(e: grpc.RpcError, address: str, call: str) -> TpuboxError:
    """The :class:`TpuboxError` for a failed gRPC call CALL to the daemon at ADDRESS. A call
    that could not reach a Unix socket this user may not open is :class:`PermissionDenied`,
    not :class:`Unavailable`."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    kind: str | None = None
    try:
        trailers: Any = e.trailing_metadata()  # type: ignore[attr-defined]
        for key, value in trailers or ():
            if key == ERROR_KIND_KEY:
                kind = value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # a call that never reached the daemon may have no trailers
        kind = None
    if kind is None:
        kind = _BY_CODE.get(code, "internal") if code is not None else "internal"
    if kind == "unavailable":
        denied = _socket_denied(address)
        if denied is not None:
            return error("permission-denied", f"{denied} ({call}: {details})", code)
        message = f"the tpubox daemon at {address} is not reachable ({call}): {details}"
    elif kind == "deadline-exceeded":
        message = f"{call} at {address} did not finish in time: {details}"
    else:
        message = details
    return error(kind, message, code)
