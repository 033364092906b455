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
import mmap
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
#: Tensors packed in one memfd (a call's inline arguments, its fetched results) each start at
#: the next multiple of this many bytes (``PACK_ALIGN`` in crates/session-api/src/local.rs).
PACK_ALIGN = 64


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

    def connect(self) -> None:
        """Connects. Raises ``OSError`` when the socket cannot be reached."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self._sock = s

    def close(self) -> None:
        """Closes the connection (the session is not affected)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _gone(self, what: object) -> TpuboxError:
        return Unavailable(
            "unavailable",
            f"the tpubox daemon at {self._address} is not reachable (local socket "
            f"{self._path}: {what})",
        )

    def request(
        self, op: str, fields: dict[str, Any], fd: int | None, timeout: float | None
    ) -> tuple[Any, int | None]:
        """Sends request ``op`` with ``fields`` (and descriptor ``fd``); returns the reply's
        ``ok`` value and the descriptor it carried, if any (the caller closes it).

        A request that could not be sent (the connection was dropped, the daemon restarted) is
        sent once more on a new connection.

        Raises: the TpuboxError of the reply's kind; ``Unavailable`` when the daemon is gone;
        ``DeadlineExceeded`` after ``timeout`` seconds.
        """
        req = dict(fields)
        req["op"] = op
        req["token"] = self._token
        body = json.dumps(req, separators=(",", ":")).encode()
        msg = struct.pack("<I", len(body)) + body
        with self._lock:
            got: list[int] = []
            if self._sock is None:
                try:
                    self.connect()
                except OSError as e:
                    raise self._gone(e) from None
            s = self._sock
            assert s is not None
            try:
                try:
                    s.settimeout(timeout)
                    self._send(s, msg, fd)
                except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError):
                    # The request never reached the daemon (it restarted, or the connection
                    # was dropped): reconnect once and send it again.
                    self.close()
                    self.connect()
                    s = self._sock
                    assert s is not None
                    s.settimeout(timeout)
                    self._send(s, msg, fd)
                data, got, _, _ = socket.recv_fds(s, _MAX_REPLY, 1)
                while data and (len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]):
                    more = s.recv(_MAX_REPLY)
                    if not more:
                        data = b""
                        break
                    data += more
            except socket.timeout:
                for f in got:
                    os.close(f)
                # The reply may still come: this connection is out of step, drop it.
                self.close()
                raise error(
                    "deadline-exceeded",
                    f"no reply from the tpubox daemon at {self._address} within {timeout} s",
                ) from None
            except OSError as e:
                for f in got:
                    os.close(f)
                self.close()
                raise self._gone(e) from None
            if not data:
                for f in got:
                    os.close(f)
                self.close()
                raise self._gone("the daemon closed the connection")
        (n,) = struct.unpack("<I", data[:4])
        reply = json.loads(data[4 : 4 + n])
        if "error" in reply:
            for f in got:
                os.close(f)
            raise error(str(reply["error"]["kind"]), str(reply["error"]["message"]))
        return reply["ok"], (got[0] if got else None)

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
        device, byte_size, read_only)."""
        fd = os.memfd_create("tpubox-tensor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            done = 0
            while done < len(raw):
                done += os.write(fd, raw[done:])
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            fields: dict[str, Any] = {"dtype": dtype, "dims": [int(d) for d in dims]}
            if device is not None:
                fields["device"] = int(device)
            info, extra = self.request("put", fields, fd, None)
            if extra is not None:
                os.close(extra)
            return dict(info)
        finally:
            os.close(fd)

    def get(self, handle: int) -> tuple[dict[str, Any], np.ndarray]:
        """Reads tensor ``handle``: its info and its bytes as a writable uint8 array (a private,
        copy-on-write map of the sealed memfd the daemon sent: no copy is made)."""
        info, fd = self.request("get", {"handle": int(handle)}, None, None)
        if fd is None:
            raise error("internal", "the daemon's reply to a local get carried no memfd")
        try:
            size = int(info["byte_size"])
            if size == 0:
                return dict(info), np.empty(0, np.uint8)
            # (No MAP_POPULATE: on a private writable map it would copy every page up front.)
            m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return dict(info), np.frombuffer(m, np.uint8)

    def call(
        self, fields: dict[str, Any], inline: list[memoryview], timeout: float | None
    ) -> tuple[dict[str, Any], list[np.ndarray | None]]:
        """A one-round-trip call (``op: call``): FIELDS are the request's (``executable``,
        ``arguments``, ``donate``, ``fetch``, ``keep``, ``free``; an inline argument is
        ``{"dtype", "dims"}``), INLINE the inline arguments' dense little-endian bytes in
        argument order (packed in one sealed memfd). Returns the reply and, per result, its
        bytes as a writable uint8 array when it was fetched (views of one private,
        copy-on-write map of the memfd the daemon sent), else None."""
        fd = None
        if inline:
            offsets, total = packed([len(b) for b in inline])
            fd = os.memfd_create("tpubox-call", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            if fd is not None:
                os.ftruncate(fd, total)
                for b, at in zip(inline, offsets):
                    done = 0
                    while done < len(b):
                        done += os.pwrite(fd, b[done:], at + done)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            reply, got = self.request("call", fields, fd, timeout)
        finally:
            if fd is not None:
                os.close(fd)
        results = reply["results"]
        out: list[np.ndarray | None] = [None] * len(results)
        if got is None:
            if any("offset" in r for r in results):
                raise error("internal", "the daemon's reply to a local call carried no memfd")
            return reply, out
        try:
            ends = [int(r["offset"]) + int(r["byte_size"]) for r in results if "offset" in r]
            total = max(ends, default=0)
            if total == 0:
                buf = np.empty(0, np.uint8)
            else:
                m = mmap.mmap(
                    got, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
                buf = np.frombuffer(m, np.uint8)
        finally:
            os.close(got)
        for i, r in enumerate(results):
            if "offset" in r:
                at = int(r["offset"])
                out[i] = buf[at : at + int(r["byte_size"])]
        return reply, out
