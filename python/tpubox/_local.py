"""The daemon's local socket: the fast path for a client on the same machine.

Beside its session socket ``PATH`` the daemon listens on ``PATH.local`` (the ``local_socket``
of ``Open`` and ``Info``). A request is one message, a 4-byte little-endian length and that
many bytes of JSON, with file descriptors attached (``SCM_RIGHTS``); the reply has the same
form. Tensor data moves through sealed memfds instead of protobuf messages, and execute and free
skip HTTP/2 (the messages are documented in ``crates/session-api/src/local.rs``). Linux only:
elsewhere, or over TCP, the session uses gRPC for everything.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import threading
from typing import Any

import numpy as np

from .errors import TpuboxError, Unavailable, error

_SEALS = (
    getattr(fcntl, "F_SEAL_WRITE", 0)
    | getattr(fcntl, "F_SEAL_SHRINK", 0)
    | getattr(fcntl, "F_SEAL_GROW", 0)
)
_MAX_REPLY = 1 << 16
#: Most bytes sent after a request's header, or asked for after a reply's JSON, instead of in a
#: memfd (``MAX_INLINE_BYTES`` in crates/session-api/src/local.rs).
MAX_INLINE_BYTES = 64 << 10
#: Most launches sent without reading their replies (:meth:`LocalChannel.launch`) before
#: the replies are read.
PIPELINE_WINDOW = 32
#: Pipelined launches sent together, in one write (``TPUBOX_LAUNCH_BATCH``, default 8; 1
#: sends each at once): each write wakes the daemon, which costs the client tens of µs on a
#: busy machine (docs/BENCHMARKS.md, issue 46). The batch is sent when full and before any
#: other request (a read, a wait), so a launch waits at most that many later launches.
LAUNCH_BATCH = max(1, int(os.environ.get("TPUBOX_LAUNCH_BATCH", "8") or 8))
#: Tensors packed in one memfd (a call's inline arguments, its fetched results) each start at
#: the next multiple of this many bytes (``PACK_ALIGN`` in crates/session-api/src/local.rs).
PACK_ALIGN = 64


# The requests sent with the batched launches before their replies are read.
_AFTER_LAUNCHES = frozenset(("get", "wait"))


def packed(sizes: list[int]) -> tuple[list[int], int]:
    """Where tensors of SIZES bytes start when packed in one memfd (each at the next multiple of
    ``PACK_ALIGN``, the first at 0), and the bytes they span in all."""
    offsets = []
    end = 0
    for n in sizes:
        at = -(-end // PACK_ALIGN) * PACK_ALIGN
        offsets.append(at)
        end = at + n
    return offsets, end


def available() -> bool:
    """Whether this platform has what the local socket needs (memfds, seals, SCM_RIGHTS)."""
    return (
        hasattr(os, "memfd_create")
        and hasattr(os, "MFD_ALLOW_SEALING")
        and hasattr(socket, "send_fds")
        and hasattr(fcntl, "F_ADD_SEALS")
    )


class LocalChannel:
    """One connection to the local socket at ``path`` for the session of ``token``; ``address``
    is the session's address, for messages. Thread-safe (one request at a time)."""

    def __init__(self, path: str, token: str, address: str) -> None:
        self._path = path
        self._token = token
        self._address = address
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        # The end of a launch's JSON (launch).
        self._launch_end = ',"op":"call","token":%s}' % json.dumps(token)
        # Bytes received past the last reply read (replies to pipelined launches arrive in
        # bunches).
        self._buf = bytearray()
        # Descriptors received while reading the replies of pipelined launches, which carry
        # none: they came with the reply after them (a get sent with the batch), in one read.
        self._early_fds: list[int] = []
        # The launches sent and not yet answered, oldest first: what each was, for the error.
        self._unread: list[tuple[int, list[int], tuple[int, ...]]] = []
        # Tensor handles a refused pipelined launch was to free: the session frees them again.
        self.unfreed: list[int] = []
        # Launches not sent yet (at most LAUNCH_BATCH), framed.
        self._out = bytearray()
        self._batched = 0
        # The first failure among the pipelined launches answered since it was last raised.
        self._deferred: TpuboxError | None = None
        # Leases of memfds the daemon lent (a get's, a call's fetched results) that were
        # copied out and closed: released with the next get or call.
        self._release: list[int] = []

    def connect(self) -> None:
        """Connects. Raises ``OSError`` when the socket cannot be reached."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self._sock = s

    def _connected(self) -> socket.socket:
        """The connection, made now if there is none (under the lock). Raises
        ``Unavailable`` when the socket cannot be reached."""
        if self._sock is None:
            try:
                self.connect()
            except OSError as e:
                raise self._gone(e) from None
        assert self._sock is not None
        return self._sock

    def _failed(self, e: OSError, got: list[int], timeout: float | None) -> TpuboxError:
        """The error for E, raised by a send or a receive: closes the descriptors in GOT and
        the connection (a reply may still come: it is out of step)."""
        for f in got:
            os.close(f)
        self.close()
        if isinstance(e, socket.timeout):
            return error(
                "deadline-exceeded",
                f"no reply from the tpubox daemon at {self._address} within {timeout} s",
            )
        return self._gone(e)

    def close(self) -> None:
        """Closes the connection (the session is not affected)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf = bytearray()
        for f in self._early_fds:
            os.close(f)
        self._early_fds = []
        if self._unread and self._deferred is None:
            self._deferred = self._gone(
                f"the connection closed before {len(self._unread)} launches sent on it were "
                f"answered (the first: of executable {self._unread[0][0]}, results "
                f"{self._unread[0][1]})"
            )
        self._unread = []
        self._out = bytearray()
        self._batched = 0

    def _flush(self, s: socket.socket) -> None:
        """Sends the launches batched so far."""
        if self._out:
            out, self._out, self._batched = self._out, bytearray(), 0
            s.sendall(out)

    def _read_message(self, s: socket.socket, got: list[int]) -> tuple[bytes, bytes, Any]:
        """The next reply on S: its JSON, the bytes after it (``tail``) and the JSON parsed
        when it had to be (to find the tail), else None; descriptors that arrive are added to
        GOT. Raises ``OSError``, ``socket.timeout``; ``ConnectionError`` when the daemon closed
        the connection."""
        buf = self._buf
        tail = -1
        parsed = None
        while True:
            if len(buf) >= 4:
                (n,) = struct.unpack_from("<I", buf)
                if len(buf) >= 4 + n:
                    if tail < 0:
                        body = bytes(buf[4 : 4 + n])
                        tail = 0
                        if b'"tail"' in body:
                            parsed = json.loads(body)
                            tail = int(parsed.get("tail", 0))
                    if len(buf) >= 4 + n + tail:
                        body = bytes(buf[4 : 4 + n])
                        rest = bytes(buf[4 + n : 4 + n + tail])
                        del buf[: 4 + n + tail]
                        return body, rest, parsed
            data, fds, _, _ = socket.recv_fds(s, _MAX_REPLY, 1)
            got.extend(fds)
            if not data:
                raise ConnectionError("the daemon closed the connection")
            buf += data

    def _drain(self, s: socket.socket) -> None:
        """Sends the launches batched and reads the replies of the pipelined launches sent so
        far; keeps the first failure."""
        self._flush(s)
        while self._unread:
            got: list[int] = []
            body, _, _ = self._read_message(s, got)
            # A launch's reply carries no descriptor: one read here belongs to a later reply.
            self._early_fds.extend(got)
            exe, out, frees = self._unread.pop(0)
            if body.startswith(b'{"ok"'):
                continue
            self.unfreed.extend(frees)
            reply = json.loads(body)
            if "error" in reply and self._deferred is None:
                err = reply["error"]
                self._deferred = error(
                    str(err["kind"]),
                    f"the pipelined launch of executable {exe} (results {out}) failed: "
                    f"{err['message']}",
                )

    def send_batch(self, timeout: float | None) -> None:
        """Sends the launches batched so far, without reading their replies.

        Raises: ``Unavailable`` when the daemon is gone; ``DeadlineExceeded``.
        """
        with self._lock:
            if not self._out or self._sock is None:
                return
            s = self._sock
            try:
                s.settimeout(timeout)
                self._flush(s)
            except OSError as e:
                raise self._failed(e, [], timeout) from None

    def take_deferred(self) -> TpuboxError | None:
        """The first failure of a pipelined launch not raised yet (cleared)."""
        e, self._deferred = self._deferred, None
        return e

    def launch(
        self,
        head: str,
        executable: int,
        out: list[int],
        timeout: float | None,
        tail: bytes | None = None,
        window: int = PIPELINE_WINDOW,
        frees: tuple[int, ...] = (),
        send_now: bool = False,
    ) -> bool:
        """Sends a launch (``op: call`` with ``launch`` and its result handles in ``out``:
        HEAD is its JSON without the closing brace, the op and the token) without reading its
        reply (EXECUTABLE's handle and OUT name it in its error; FREES, the handles it frees,
        go to :attr:`unfreed` if it is refused): batched with
        the next ones (:data:`LAUNCH_BATCH`), and sent by the last of the batch or before the
        next request; with SEND_NOW, sent at once with those before it (a program whose work
        the daemon should start while the caller goes on). The reply is read with the next request's, or when WINDOW launches are
        unanswered; a failure is kept and raised by the next :meth:`request` (or
        :meth:`take_deferred`). Returns whether the window was full (its replies were read).

        Raises: ``Unavailable`` when the daemon is gone; ``DeadlineExceeded``.
        """
        body = (head + self._launch_end).encode()
        msg = struct.pack("<I", len(body)) + body
        if tail is not None:
            msg += tail
        with self._lock:
            s = self._connected()
            full = False
            try:
                if len(self._unread) >= window:
                    s.settimeout(timeout)
                    self._drain(s)
                    full = True
                self._out += msg
                self._batched += 1
                if send_now or self._batched >= LAUNCH_BATCH:
                    s.settimeout(timeout)
                    self._flush(s)
            except OSError as e:
                raise self._failed(e, [], timeout) from None
            self._unread.append((executable, out, frees))
            return full

    def _gone(self, what: object) -> TpuboxError:
        return Unavailable(
            "unavailable",
            f"the tpubox daemon at {self._address} is not reachable (local socket "
            f"{self._path}: {what})",
        )

    def request(
        self,
        op: str,
        fields: dict[str, Any],
        fd: int | None,
        timeout: float | None,
        tail: bytes | memoryview | None = None,
        *,
        deferred: bool = True,
    ) -> tuple[Any, int | None]:
        """Sends request ``op`` with ``fields`` (and descriptor ``fd``, and TAIL's bytes after
        the header); returns the reply's ``ok`` value and the descriptor it carried, if any
        (the caller closes it). The bytes after the reply's JSON, if any, are in the ``ok``
        value's ``"_tail"``.

        The replies of pipelined launches (:meth:`launch`) are read first; the first of them
        that failed is raised instead of sending the request (unless DEFERRED is false: it is
        then kept for the next one). A request that could not be sent (the connection was
        dropped, the daemon restarted) is sent once more on a new connection.

        Raises: the TpuboxError of the reply's kind; ``Unavailable`` when the daemon is gone;
        ``DeadlineExceeded`` after ``timeout`` seconds.
        """
        req = dict(fields)
        req["op"] = op
        req["token"] = self._token
        if tail is not None:
            req["tail"] = len(tail)
        body = json.dumps(req, separators=(",", ":")).encode()
        msg = struct.pack("<I", len(body)) + body
        if tail is not None:
            msg += tail
        with self._lock:
            got: list[int] = []
            s = self._connected()
            # A read or a wait goes out with the launches batched, without waiting for their
            # replies first (nothing is made or changed by it: its reply is dropped if one of
            # them failed); other requests only once the launches were answered.
            after = bool(self._unread) and op in _AFTER_LAUNCHES and fd is None
            raised: TpuboxError | None = None
            try:
                if self._unread and not after:
                    s.settimeout(timeout)
                    self._drain(s)
                    # Nothing but launches was in flight: descriptors read are stray.
                    for f in self._early_fds:
                        os.close(f)
                    self._early_fds = []
                if deferred and self._deferred is not None and not after:
                    raise self.take_deferred()  # type: ignore[misc]
                if after:
                    s.settimeout(timeout)
                    self._out += msg
                    self._drain(s)
                    if deferred and self._deferred is not None:
                        raised = self.take_deferred()
                else:
                    self._send_or_resend(s, msg, fd, timeout)
                    s = self._sock
                    assert s is not None
                # Descriptors that came in while the launches' replies were read are this
                # reply's.
                got.extend(self._early_fds)
                self._early_fds = []
                try:
                    data, rest, parsed = self._read_message(s, got)
                except ConnectionError:
                    data, rest, parsed = b"", b"", None
            except OSError as e:
                raise self._failed(e, got, timeout) from None
            if not data:
                for f in got:
                    os.close(f)
                self.close()
                raise self._gone("the daemon closed the connection")
        if raised is not None:
            for f in got:
                os.close(f)
            raise raised
        reply = parsed if parsed is not None else json.loads(data)
        if "error" in reply:
            for f in got:
                os.close(f)
            raise error(str(reply["error"]["kind"]), str(reply["error"]["message"]))
        ok = reply["ok"]
        if "tail" in reply:
            ok["_tail"] = rest
        return ok, (got[0] if got else None)

    def _send_or_resend(
        self, s: socket.socket, msg: bytes, fd: int | None, timeout: float | None
    ) -> None:
        """Sends MSG on S; a request that could not be sent (the daemon restarted, or the
        connection was dropped) is sent once more on a new connection (``self._sock``)."""
        try:
            s.settimeout(timeout)
            self._send(s, msg, fd)
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError):
            self.close()
            self.connect()
            s = self._sock
            assert s is not None
            s.settimeout(timeout)
            self._send(s, msg, fd)

    @staticmethod
    def _send(s: socket.socket, msg: bytes, fd: int | None) -> None:
        if fd is not None:
            socket.send_fds(s, [msg], [fd])
        else:
            s.sendall(msg)

    def put(
        self, raw: memoryview, dtype: str, dims: list[int], device: int | None
    ) -> dict[str, Any]:
        """Creates a tensor from dense little-endian bytes ``raw`` of XLA type ``dtype``
        (``"F32"``, ``"BF16"``, ...) and ``dims``; returns its tensor info (handle, dtype, dims,
        device, byte_size, read_only). Up to :data:`MAX_INLINE_BYTES` travel after the
        request's header, more in a sealed memfd."""
        fields: dict[str, Any] = {"dtype": dtype, "dims": [int(d) for d in dims]}
        if device is not None:
            fields["device"] = int(device)
        if 0 < len(raw) <= MAX_INLINE_BYTES:
            info, extra = self.request("put", fields, None, None, raw)
            if extra is not None:
                os.close(extra)
            return dict(info)
        fd = os.memfd_create("tpubox-tensor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            done = 0
            while done < len(raw):
                done += os.write(fd, raw[done:])
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            info, extra = self.request("put", fields, fd, None)
            if extra is not None:
                os.close(extra)
            return dict(info)
        finally:
            os.close(fd)

    def _releases(self, fields: dict[str, Any]) -> None:
        """Adds the leases to release to a get's or a call's FIELDS."""
        if self._release:
            rel, self._release = self._release, []
            fields["release"] = rel

    def _lent(self, info: dict[str, Any], fd: int, size: int) -> np.ndarray:
        """The first SIZE bytes of memfd FD the daemon lent (lease ``info["lease"]``) copied
        into a new array (one copy in the kernel, no map); the lease is released with the next
        get or call. The daemon truncates a lent memfd when its lease ends, so no map of it
        may outlive the lease: hence the copy (crates/session-api/src/local.rs)."""
        out = np.empty(size, np.uint8)
        view = memoryview(out)
        done = 0
        while done < size:
            n = os.preadv(fd, [view[done:]], done)
            if n <= 0:
                raise error("internal", "a memfd the daemon sent is shorter than its reply says")
            done += n
        if "lease" in info:
            self._release.append(int(info["lease"]))
        return out

    def get(self, handle: int) -> tuple[dict[str, Any], np.ndarray]:
        """Reads tensor ``handle``: its info and its bytes as a new writable uint8 array (copied
        from the memfd the daemon lent, whose lease is released with the next request; a
        tensor of up to :data:`MAX_INLINE_BYTES` comes after the reply's JSON instead)."""
        fields: dict[str, Any] = {"handle": int(handle), "inline": True}
        self._releases(fields)
        info, fd = self.request("get", fields, None, None)
        if info.get("inline"):
            if fd is not None:
                os.close(fd)
            raw = info.pop("_tail", b"")
            return dict(info), np.frombuffer(bytearray(raw), np.uint8)
        if fd is None:
            raise error("internal", "the daemon's reply to a local get carried no memfd")
        try:
            out = self._lent(info, fd, int(info["byte_size"]))
        finally:
            os.close(fd)
        return dict(info), out

    def call(
        self, fields: dict[str, Any], inline: list[memoryview], timeout: float | None
    ) -> tuple[dict[str, Any], list[np.ndarray | None]]:
        """A one-round-trip call (``op: call``): FIELDS are the request's (``executable``,
        ``arguments``, ``donate``, ``fetch``, ``keep``, ``free``; an inline argument is
        ``{"dtype", "dims"}``), INLINE the inline arguments' dense little-endian bytes in
        argument order (packed in one sealed memfd). Returns the reply and, per result, its
        bytes as a writable uint8 array when it was fetched (views of one array copied from the
        memfd the daemon lent), else None."""
        fd = None
        tail: bytes | None = None
        fields = dict(fields)
        fields["inline"] = True
        self._releases(fields)
        if inline:
            offsets, total = packed([len(b) for b in inline])
            if total <= MAX_INLINE_BYTES:
                # Small arguments travel after the header.
                buf = bytearray(total)
                for b, at in zip(inline, offsets):
                    buf[at : at + len(b)] = b
                tail = bytes(buf)
            else:
                fd = os.memfd_create("tpubox-call", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            if fd is not None:
                os.ftruncate(fd, total)
                for b, at in zip(inline, offsets):
                    done = 0
                    while done < len(b):
                        done += os.pwrite(fd, b[done:], at + done)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            reply, got = self.request("call", fields, fd, timeout, tail)
        finally:
            if fd is not None:
                os.close(fd)
        results = reply["results"]
        out: list[np.ndarray | None] = [None] * len(results)
        if "_tail" in reply:
            if got is not None:
                os.close(got)
            buf = np.frombuffer(bytearray(reply["_tail"]), np.uint8)
            for i, r in enumerate(results):
                if "offset" in r:
                    at = int(r["offset"])
                    out[i] = buf[at : at + int(r["byte_size"])]
            return reply, out
        if got is None:
            if any("offset" in r for r in results):
                raise error("internal", "the daemon's reply to a local call carried no memfd")
            return reply, out
        try:
            ends = [int(r["offset"]) + int(r["byte_size"]) for r in results if "offset" in r]
            buf = self._lent(reply, got, max(ends, default=0))
        finally:
            os.close(got)
        for i, r in enumerate(results):
            if "offset" in r:
                at = int(r["offset"])
                out[i] = buf[at : at + int(r["byte_size"])]
        return reply, out
