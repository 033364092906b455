"""Sessions on the tpubox daemon: tensors that stay on the device, compiled programs,
shared weight sets and sandboxed guest runs, over the daemon's gRPC session API
(``tpubox.v1.Session``, host/proto/tpubox/v1/session.proto).

Everything here is a thin, typed layer over the protocol: a :class:`Tensor` is a handle number
plus its shape and dtype, an :class:`Executable` a handle plus its parameter and result specs.
Every limit is the daemon's; every error is a :class:`tpubox.TpuboxError`.

This module holds the entry points, :class:`Session` and :func:`connect` (with
:func:`default_session`, :func:`tenant_usage`, :func:`wait_for_daemon`), and the sessions this
process owns. The pieces they are made of, each with one job: ``_values`` (plain records:
limits, usage, platform, specs), ``_handles`` (Tensor and Executable, and how they are freed),
``_transport`` (the gRPC channel and the choice of the daemon's local socket; the local
socket's protocol is ``_local``, the bulk messages' encoding ``_wire``), ``_output`` (where a
guest's streamed output goes), ``_dtypes`` (NumPy dtypes and the wire's). The public types of
``_values`` and ``_handles`` are importable from here, as from :mod:`tpubox`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import json
import math
import os
import re
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Sequence

import grpc
import numpy as np

from . import _dtypes, _local, _output, _transport
from ._handles import Executable, Handle, ShardedTensor, Tensor, drain
from ._proto import session_pb2 as pb
from ._proto import session_pb2_grpc as pb_grpc
from ._transport import CHUNK_BYTES
from ._values import (
    ArrayLike,
    Device,
    DeviceBytes,
    Limits,
    Platform,
    RunResult,
    SessionInfo,
    TenantUsage,
    TensorSpec,
    Usage,
    WeightVersions,
)
from .errors import (
    Internal,
    NotFound,
    SessionEnded,
    TpuboxError,
    Unavailable,
    Unsupported,
    from_rpc_error,
)

__all__ = [
    "connect",
    "default_session",
    "tenant_usage",
    "Session",
    "Tensor",
    "ShardedTensor",
    "Executable",
    "TensorSpec",
    "Limits",
    "Usage",
    "TenantUsage",
    "Platform",
    "Device",
    "DeviceBytes",
    "SessionInfo",
    "RunResult",
    "WeightSet",
    "WeightVersions",
    "ENV_ADDRESS",
    "ENV_SESSION_TOKEN",
    "ENV_SESSION_ID",
    "ENV_LAUNCH_BLOCKING",
    "wait_for_daemon",
]

#: Environment variables a kernel provisioner sets for the kernel it starts.
ENV_ADDRESS = "TPUBOX_ADDRESS"
ENV_SESSION_TOKEN = "TPUBOX_SESSION_TOKEN"
ENV_SESSION_ID = "TPUBOX_SESSION_ID"
#: ``TPUBOX_LAUNCH_BLOCKING=1``: every session :func:`connect` returns has synchronous launches
#: (:meth:`Session.set_launch_blocking`), TorchTPU's ``TORCH_TPU_LAUNCH_BLOCKING`` analogue.
ENV_LAUNCH_BLOCKING = "TPUBOX_LAUNCH_BLOCKING"


def _launch_blocking_from_env(s: Session) -> Session:
    v = os.environ.get(ENV_LAUNCH_BLOCKING, "").strip().lower()
    if v not in ("", "0", "false", "no", "off"):
        s.set_launch_blocking(True)
    return s

#: Deadline of control calls (Open, Info, Free, Usage, Close, ...), in seconds.
DEFAULT_TIMEOUT = 30.0

# TorchTPU's `xla_optimization_level` values (crates/pjrt OptimizationLevel).
_OPTIMIZATION_LEVELS = ("O0", "O1", "O2", "O3")

_FORMATS = {
    "auto": pb.CompileRequest.FORMAT_AUTO,
    "text": pb.CompileRequest.MLIR_TEXT,
    "mlir": pb.CompileRequest.MLIR_TEXT,
    "bytecode": pb.CompileRequest.MLIR_BYTECODE,
    "mlirbc": pb.CompileRequest.MLIR_BYTECODE,
}


# Names the tests import from here (python/tests/test_units.py).
_Sink = _output.Sink
_target = _transport.grpc_target


# ---------------------------------------------------------------------------------------------
# Sessions this process opened (and so ends at exit, when they were not closed before), and
# the last one connect() returned (default_session)


_OWNED: weakref.WeakSet[Session] = weakref.WeakSet()
_LAST: weakref.ref[Session] | None = None
_LAST_LOCK = threading.Lock()


def _close_owned_at_exit() -> None:
    for s in list(_OWNED):
        try:
            s.close(timeout=2.0)
        except Exception:
            pass


atexit.register(_close_owned_at_exit)


# ---------------------------------------------------------------------------------------------
# The session


class Session:
    """A session on the tpubox daemon (:func:`connect` makes one).

    A session is the daemon's unit of ownership and accounting: every tensor and executable
    it makes is charged to it, within its :attr:`limits`, and everything it holds is freed when
    it ends. Use it as a context manager (``with tpubox.connect(...) as s:``) to close it at the
    end of the block.

    Methods are safe to call from several threads.

    Attributes:
        session_id: the daemon's id of the session.
        tenant: the tenant it is charged to.
        address: the daemon's address as given.
        limits: the :class:`Limits` in force.
        platform: the daemon's :class:`Platform` (``platform.name``: cpu, cuda, tpu;
            ``platform.devices``: every device of the host).
        devices: the device indices this session may use, its default first: a tensor or
            compile that names no device lands on ``devices[0]``, and one naming a device not
            listed is refused (:class:`tpubox.PermissionDenied`). Empty for a joined session
            (the daemon's ``Info`` does not say them).
        exclusive_devices: whether the session holds its devices alone (no other session is
            placed on them while it lives).
        owned: True when this process opened the session (it is closed by :meth:`close`, at
            exit, and by the daemon when this process goes away); False when it joined one a
            provisioner opened (:meth:`close` then only disconnects).
    """

    def __init__(
        self,
        *,
        address: str,
        token: str,
        session_id: str,
        tenant: str,
        limits: Limits,
        platform: Platform,
        owned: bool,
        channel: grpc.Channel,
        timeout: float | None,
        local: _local.LocalChannel | None = None,
        devices: Sequence[int] = (),
        exclusive_devices: bool = False,
    ):
        self.address = address
        self.session_id = session_id
        self.tenant = tenant
        self.limits = limits
        self.platform = platform
        self.devices: tuple[int, ...] = tuple(int(d) for d in devices)
        self.exclusive_devices = bool(exclusive_devices)
        self.owned = owned
        self.timeout = timeout
        self._token = token
        self._md = _transport.auth_metadata(token)
        self._channel = channel
        self._stub = pb_grpc.SessionStub(channel)
        self._put, self._get = _transport.bulk_calls(channel)
        self._put_sharded, self._get_sharded_call = _transport.sharded_calls(channel)
        self._closed = False
        self._close_lock = threading.Lock()
        self._pending_tensors: collections.deque[int] = collections.deque()
        self._pending_executables: collections.deque[int] = collections.deque()
        self._attachment: _transport.Attachment | None = None
        self._local = local
        # Handle numbers reserved for the results of pipelined launches: [next, end).
        self._reserved = [0, 0]
        self._reserve_lock = threading.Lock()
        # Whether launches may be pipelined (launch blocking off); None until known.
        self._pipeline_ok: bool | None = None
        # The first result handle of the first launch of each window of pipelined launches
        # (waited for a window later: at most two windows of them pending).
        self._marks: collections.deque[int] = collections.deque()
        self._window = _local.PIPELINE_WINDOW

    # -- properties -------------------------------------------------------------------------

    @property
    def token(self) -> str:
        """The session token: the session's capability (whoever holds it uses the session).
        Keep it secret; it is what a provisioner hands a kernel."""
        return self._token

    @property
    def transport(self) -> str:
        """``"local"`` when tensor data, executions and frees go through the daemon's local
        socket (shared memory; a Unix-socket session on the daemon's machine), else
        ``"grpc"``."""
        return "local" if self._local is not None else "grpc"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called or the daemon said the session ended."""
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("owned" if self.owned else "joined")
        return (
            f"tpubox.Session(session_id={self.session_id!r}, tenant={self.tenant!r}, "
            f"address={self.address!r}, platform={self.platform.name!r}, "
            f"devices={list(self.devices)}{', exclusive' if self.exclusive_devices else ''}, "
            f"{state})"
        )

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # No RPC here: cancelling the Attach stream is enough for the daemon to end an owned
        # session that nobody else is attached to.
        try:
            if self._attachment is not None and not self._closed:
                self._attachment.cancel()
        except Exception:
            pass

    # -- plumbing ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SessionEnded("session-ended", f"session {self.session_id} was closed")
        a = self._attachment
        if a is not None and a.ended_reason is not None:
            self._closed = True
            raise SessionEnded(
                "session-ended", f"session {self.session_id} has ended: {a.ended_reason}"
            )

    def _error(self, e: grpc.RpcError, call: str) -> TpuboxError:
        err = from_rpc_error(e, self.address, call)
        if err.kind == "session-ended":
            self._closed = True
        return err

    def _deadline(self, timeout: float | None | object) -> float | None:
        return self.timeout if timeout is _DEFAULT else timeout  # type: ignore[return-value]

    def _flush_frees(self) -> None:
        """Sends the frees queued by ``__del__`` of dropped Tensors and Executables (and those
        a refused pipelined launch did not do)."""
        self._take_unfreed()
        if not self._pending_tensors and not self._pending_executables:
            return
        tensors = drain(self._pending_tensors)
        executables = drain(self._pending_executables)
        if not tensors and not executables:
            return
        try:
            if self._local is not None:
                self._local.request(
                    "free",
                    {"tensors": tensors, "executables": executables},
                    None,
                    self.timeout,
                    deferred=False,
                )
            else:
                self._stub.Free(
                    pb.FreeRequest(tensors=tensors, executables=executables),
                    metadata=self._md,
                    timeout=self.timeout,
                )
        except (grpc.RpcError, TpuboxError):
            pass  # the session ended or the daemon is gone: nothing is held any more

    def _unary(self, name: str, request: Any, timeout: Any = None, *, flush: bool = True) -> Any:
        self._check_open()
        if flush:
            self._flush_frees()
        try:
            return getattr(self._stub, name)(
                request, metadata=self._md, timeout=self._deadline(timeout)
            )
        except grpc.RpcError as e:
            raise self._error(e, name) from None

    @contextlib.contextmanager
    def _local_call(self) -> Iterator[_local.LocalChannel]:
        """The local channel for one call; marks the session closed when the daemon says it
        has ended."""
        assert self._local is not None
        try:
            yield self._local
        except TpuboxError as e:
            if e.kind == "session-ended":
                self._closed = True
            raise

    def _local_request(
        self, op: str, fields: dict[str, Any], fd: int | None = None, timeout: Any = None
    ) -> tuple[Any, int | None]:
        self._check_open()
        self._flush_frees()
        with self._local_call() as local:
            return local.request(op, fields, fd, self._deadline(timeout))

    def _free_handles(self, tensors: list[int], executables: list[int]) -> int:
        if self._local is not None:
            r, _ = self._local_request(
                "free", {"tensors": tensors, "executables": executables}, None, _DEFAULT
            )
            return int(r["freed"])
        resp = self._unary(
            "Free", pb.FreeRequest(tensors=tensors, executables=executables), _DEFAULT
        )
        return int(resp.freed)

    def _execute(
        self, executable: int, arguments: list[int], donate: tuple[int, ...], timeout: float | None
    ) -> list[Tensor]:
        if self._local is not None:
            # A call of handles only: an execute that also frees what dropped handles queued.
            fields: dict[str, Any] = {
                "executable": executable,
                "arguments": [{"handle": h} for h in arguments],
                "donate": list(donate),
            }
            self._check_open()
            queued = self._frees_for_call()
            if queued:
                fields["free"] = queued
            try:
                with self._local_call() as local:
                    r, _ = local.call(fields, [], self._deadline(timeout))
            except BaseException:
                self._pending_tensors.extend(queued)
                raise
            return [Tensor._from_json(self, t) for t in r["results"]]
        resp = self._unary(
            "Execute",
            pb.ExecuteRequest(executable=executable, arguments=arguments, donate=donate),
            timeout,
        )
        return [Tensor._from_pb(self, r) for r in resp.results]

    def _call(
        self,
        executable: int,
        args: Sequence[Tensor | np.ndarray],
        donate: Sequence[int],
        fetch: Sequence[int],
        keep: Sequence[int],
        free: Sequence[int],
        timeout: float | None,
        launch: bool = False,
    ) -> list[Tensor | np.ndarray]:
        """One ``Call`` (one round trip): ARGS are Tensors of this session or arrays already
        normalised (``_dtypes.as_device_array``), sent inline; returns one entry per result: a
        NumPy array when it was fetched and not kept, else a Tensor (holding the fetched array
        when it was both). With LAUNCH, the call returns once the launch is admitted, with
        pending Tensors."""
        fetch = [int(i) for i in fetch]
        keep = [int(i) for i in keep]
        inline: list[memoryview] = []
        if self._local is not None:
            arguments: list[dict[str, Any]] = []
            for a in args:
                if isinstance(a, Tensor):
                    arguments.append({"handle": a.handle})
                else:
                    name = _dtypes.dtype_name(_dtypes.to_wire(a.dtype))
                    arguments.append({"dtype": name, "dims": list(a.shape)})
                    inline.append(_raw(a))
            fields = {
                "executable": executable,
                "arguments": arguments,
                "donate": [int(i) for i in donate],
                "fetch": fetch,
                "keep": keep,
                "free": [int(h) for h in free],
            }
            if launch:
                fields["launch"] = True
            self._check_open()
            # Frees queued by dropped handles go with the call (freed once it succeeded);
            # executables' in a request of their own.
            queued = self._frees_for_call()
            fields["free"] += queued
            try:
                with self._local_call() as local:
                    reply, data = local.call(fields, inline, self._deadline(timeout))
            except BaseException:
                self._pending_tensors.extend(queued)
                raise
            return [
                _result(Tensor._from_json(self, r), raw) for r, raw in zip(reply["results"], data)
            ]
        req = pb.CallRequest(
            executable=executable,
            donate=[int(i) for i in donate],
            fetch=fetch,
            keep=keep,
            free=[int(h) for h in free],
            launch=launch,
        )
        for a in args:
            if isinstance(a, Tensor):
                req.arguments.add(handle=a.handle)
            else:
                spec = pb.TensorSpec(dtype=_dtypes.to_wire(a.dtype), dims=a.shape)
                req.arguments.add(tensor=pb.InlineTensor(spec=spec, data=_raw(a).tobytes()))
        resp = self._unary("Call", req, timeout)
        out: list[Tensor | np.ndarray] = []
        for r in resp.results:
            raw = np.frombuffer(r.data, np.uint8) if r.fetched else None
            out.append(_result(Tensor._from_pb(self, r.info), raw))
        return out

    def _call_sharded(
        self,
        executable: int,
        args: Sequence[ShardedTensor | np.ndarray],
        donate: Sequence[int],
        fetch: Sequence[int],
        keep: Sequence[int],
        free: Sequence[int],
        timeout: float | None,
    ) -> list[ShardedTensor | np.ndarray]:
        """One ``CallSharded`` (always over gRPC): ARGS are ShardedTensors of this session or
        normalised global arrays, sent inline; returns one entry per result: the gathered
        global array when it was fetched and not kept, else a ShardedTensor."""
        req = pb.CallShardedRequest(
            executable=executable,
            donate=[int(i) for i in donate],
            fetch=[int(i) for i in fetch],
            keep=[int(i) for i in keep],
            free=[int(h) for h in free],
        )
        for a in args:
            if isinstance(a, ShardedTensor):
                req.arguments.add(shards=pb.ShardHandles(handles=[t.handle for t in a.shards]))
            else:
                spec = pb.TensorSpec(dtype=_dtypes.to_wire(a.dtype), dims=a.shape)
                req.arguments.add(array=pb.InlineTensor(spec=spec, data=_raw(a).tobytes()))
        resp = self._unary("CallSharded", req, timeout)
        out: list[ShardedTensor | np.ndarray] = []
        for r in resp.results:
            st = ShardedTensor._from_pb(self, r.info)
            if not r.fetched:
                out.append(st)
                continue
            a = np.frombuffer(r.data, np.uint8).view(st.dtype.newbyteorder("<")).reshape(st.shape)
            if not a.flags.writeable:
                a = a.copy()
            if st.shards and st.shards[0].handle == 0:
                for t in st.shards:
                    t._freed = True  # never handles: nothing to free
                out.append(a)
            else:
                st._host = a
                out.append(st)
        return out

    def _get_sharded(self, st: ShardedTensor, *, timeout: float | None = None) -> np.ndarray:
        """The global array of ST, gathered by the daemon (GetShardedTensor)."""
        self._check_open()
        self._flush_frees()
        req = pb.GetShardedTensorRequest(
            spec=pb.TensorSpec(dtype=_dtypes.to_wire(st.dtype), dims=st.shape),
            sharding=st.sharding,
            shards=[t.handle for t in st.shards],
            chunk_bytes=CHUNK_BYTES,
        )
        call = self._get_sharded_call(req, metadata=self._md, timeout=timeout)
        try:
            return _transport.read_tensor(call)
        except grpc.RpcError as e:
            raise self._error(e, "GetShardedTensor") from None

    def _take_unfreed(self) -> None:
        """Queues again the frees a refused pipelined launch carried and did not do."""
        if self._local is not None and self._local.unfreed:
            self._pending_tensors.extend(self._local.unfreed)
            self._local.unfreed.clear()

    def _frees_for_call(self) -> list[int]:
        """The tensor handles dropped Tensors queued for freeing, taken to travel with the next
        call on the local socket (the caller puts them back if the call fails); with
        executables queued too, everything is freed now in a request of its own instead."""
        self._take_unfreed()
        if self._pending_executables:
            self._flush_frees()
            return []
        return drain(self._pending_tensors)

    def _out_handles(self, n: int) -> list[int]:
        """N handle numbers from this session's reservation (reserving more when it runs
        out: one round trip per 4096). The caller holds ``_reserve_lock``."""
        nxt, end = self._reserved
        if end - nxt < n:
            count = max(4096, n)
            r, _ = self._local_request("reserve", {"count": count}, None, _DEFAULT)
            nxt, end = int(r["first"]), int(r["first"]) + count
        self._reserved[0], self._reserved[1] = nxt + n, end
        return list(range(nxt, nxt + n))

    def _launch_pipelined(
        self,
        exe: Executable,
        args: Sequence[Tensor | np.ndarray],
        free: Sequence[int],
        send_now: bool = False,
    ) -> list[Tensor] | None:
        """Launches EXE on ARGS (Tensors of this session, normalised arrays) without waiting
        for the daemon's reply: the results are named from the session's reservation, so
        they can be used at once. What the daemon refuses (a limit, a freed handle) is raised
        by the session's next request other than a launch (a wait, a read), naming the launch;
        the results of a refused launch are never made (using them says not-found). At most
        two windows of launches are left pending (a window: :data:`tpubox._local.
        PIPELINE_WINDOW`, or a quarter of ``max_pending_launches`` when that is less): the
        first launch of the window before the last is waited for. Launches are sent in batches
        (:data:`tpubox._local.LAUNCH_BATCH`); SEND_NOW sends this one (and those batched before
        it) at once: a large program, which the daemon should run while Python goes on. Returns None where it cannot
        pipeline (gRPC, launch blocking on, arguments too large to go inline); the caller
        launches as usual."""
        local = self._local
        if local is None:
            return None
        if self._pipeline_ok is None:
            self._pipeline_ok = not self.info().launch_blocking
            limit = int(getattr(self.limits, "max_pending_launches", 0) or 0)
            if limit:
                self._window = max(1, min(_local.PIPELINE_WINDOW, limit // 4))
        if not self._pipeline_ok:
            return None
        meta = exe._out_meta
        if meta is None:
            if exe.is_spmd:
                return None
            device = exe.devices[0] if exe.devices else (self.devices[0] if self.devices else 0)
            meta = exe._out_meta = (
                tuple(
                    (tuple(r.shape), r.dtype, math.prod(r.shape) * r.dtype.itemsize)
                    for r in exe.results
                ),
                device,
            )
        # The request's JSON is written here (its fields are numbers, and names JSON writes).
        arguments: list[str] = []
        inline: list[memoryview] = []
        weights: set[tuple[str, int]] = set()
        for a in args:
            if isinstance(a, Tensor):
                arguments.append('{"handle":%d}' % a.handle)
                if a.weights:
                    weights.update(a.weights)
            else:
                name = _dtypes.dtype_name(_dtypes.to_wire(a.dtype))
                arguments.append(json.dumps({"dtype": name, "dims": [int(d) for d in a.shape]}))
                inline.append(_raw(a))
        tail = None
        if inline:
            offsets, total = _local.packed([len(b) for b in inline])
            if total > _local.MAX_INLINE_BYTES:
                return None
            buf = bytearray(total)
            for b, at in zip(inline, offsets):
                buf[at : at + len(b)] = b
            tail = bytes(buf)
        if self._closed:
            self._check_open()
        results, device = meta
        n = len(results)
        # The daemon takes reserved numbers in increasing order: a launch is queued under the
        # lock that reserved its numbers, so that launches from several threads (eager ops run
        # by Hugging Face's loading threads) reach the socket in the order of their numbers.
        with self._reserve_lock:
            ids = self._out_handles(n)
            queued = self._frees_for_call()
            head = '{"executable":%d,"arguments":[%s],"launch":true,"out":[%s]' % (
                exe.handle,
                ",".join(arguments),
                ",".join(map(str, ids)),
            )
            frees = (*free, *queued)
            if frees:
                head += ',"free":[%s]' % ",".join(map(str, frees))
            if tail is not None:
                head += ',"tail":%d' % len(tail)
            try:
                full = local.launch(
                    head,
                    exe.handle,
                    ids,
                    self._deadline(_DEFAULT),
                    tail,
                    self._window,
                    frees,
                    send_now,
                )
            except TpuboxError as e:
                if e.kind == "session-ended":
                    self._closed = True
                raise
        if full:
            # A window of launches was answered and this one starts the next: wait for the
            # first launch of the window before the last (those before it ran, in order).
            if len(self._marks) >= 2:
                try:
                    self._wait([self._marks.popleft()], False, _DEFAULT)
                except (NotFound, IndexError):
                    pass  # freed since (or taken by another thread): nothing to wait for
            if ids:
                self._marks.append(ids[0])
        w = tuple(sorted(weights)) if weights else ()
        return [
            Tensor(self, h, shape, dtype, device, nbytes, False, w)
            for h, (shape, dtype, nbytes) in zip(ids, results)
        ]

    def _send_launches(self) -> None:
        """Sends the pipelined launches batched so far (their replies are read later)."""
        if self._local is not None:
            self._local.send_batch(self._deadline(_DEFAULT))

    def _wait(self, tensors: list[int], all: bool, timeout: Any) -> None:
        if self._local is not None:
            self._local_request("wait", {"tensors": tensors, "all": all}, None, timeout)
            return
        self._unary("Wait", pb.WaitRequest(tensors=tensors, all=all), timeout)

    # -- launches ---------------------------------------------------------------------------

    # Process groups (docs/DISTRIBUTED.md): collectives over several sessions' tensors, one
    # device each, run by the daemon as one program. The local socket only.

    def _group_request(self, op: str, fields: dict[str, Any], timeout: float | None) -> Any:
        if self._local is None:
            raise Unsupported(
                "unsupported",
                "process groups need the daemon's local socket (connect with a unix: address)",
            )
        r, _ = self._local_request(op, fields, None, timeout)
        return r

    def create_group(self, size: int, rank: int, *, timeout: float = 600.0) -> str:
        """Makes a process group of SIZE ranks, one device each (this session's default
        device is rank RANK's), and joins it; returns its id, which the other ranks pass to
        :meth:`join_group`. TIMEOUT (seconds) bounds how long a collective waits for the last
        rank; after it the group is broken (every later collective fails).

        Raises: tpubox.ResourceExhausted: SIZE over the devices the tenant may use (the
        message names both numbers) or too many groups; tpubox.InvalidArgument: a size or
        rank out of range."""
        r = self._group_request(
            "group_create",
            {"size": int(size), "rank": int(rank), "timeout_ms": int(timeout * 1000)},
            _DEFAULT,
        )
        return str(r["group"])

    def join_group(self, group: str, rank: int) -> None:
        """Joins process group GROUP (an id :meth:`create_group` gave, in this tenant) as
        RANK, on this session's default device.

        Raises: tpubox.NotFound: an unknown id (or another tenant's); tpubox.
        FailedPrecondition: a rank joined already, or a device another rank has."""
        self._group_request("group_join", {"group": group, "rank": int(rank)}, _DEFAULT)

    def collective(
        self,
        group: str,
        kind: str,
        tensor: Tensor | None = None,
        *,
        reduce: str = "sum",
        root: int | None = None,
        peer: int | None = None,
        tag: int = 0,
        timeout: float | None = None,
    ) -> Tensor | None:
        """This rank's next collective of GROUP: KIND is ``all_reduce``, ``broadcast``
        (ROOT: the rank whose tensor every rank gets), ``all_gather`` (concatenated along
        dimension 0), ``reduce_scatter`` (the reduction's part RANK along dimension 0),
        ``all_to_all`` (dimension 0 split in equal parts), ``barrier`` (no tensor), ``send``
        (TENSOR to rank PEER, queued at once: returns None) or ``recv`` (what PEER sent with
        the same TAG; TENSOR gives the dtype and dims expected); REDUCE is ``sum``, ``avg``,
        ``product``, ``min`` or ``max``. Returns the result, a new
        tensor of this session on this rank's device (None for a barrier). Every rank must
        call the same collectives in the same order.

        Raises: tpubox.FailedPrecondition: a rank did not arrive within the group's timeout,
        or the group is broken (a rank's session ended); tpubox.InvalidArgument: the ranks
        disagree, or the tensor does not fit the collective (rank 0, a first dimension the
        group's size does not divide)."""
        fields: dict[str, Any] = {"group": group, "kind": kind, "reduce": reduce}
        if root is not None:
            fields["root"] = int(root)
        if peer is not None:
            fields["peer"], fields["tag"] = int(peer), int(tag)
        if tensor is not None:
            fields["handle"] = tensor.handle
        r = self._group_request("collective", fields, timeout)
        return Tensor._from_json(self, r["result"]) if "result" in r else None

    def wait_all(self, *, timeout: float | None = None) -> None:
        """Waits until every launch of this session so far (:meth:`Executable.launch`) has
        finished.

        Raises:
            tpubox.ExecutionFailed (or the kind the device's error maps to): the first failed
            launch no wait or read reported yet, named (``launch <id> of program <fingerprint>
            failed: ...``), with how many others failed.
        """
        self._wait([], True, timeout)

    def set_launch_blocking(self, on: bool = True) -> bool:
        """Makes this session's launches synchronous (``on``): :meth:`Executable.launch` then
        returns only once the device finished, raising its error there, TorchTPU's
        ``TORCH_TPU_LAUNCH_BLOCKING=1`` for debugging. :func:`connect` turns it on when the
        environment has ``TPUBOX_LAUNCH_BLOCKING=1``. Returns whether launches are synchronous
        now (also true when the daemon runs with ``--launch-blocking``)."""
        r = self._unary("SetLaunchBlocking", pb.SetLaunchBlockingRequest(on=bool(on)), _DEFAULT)
        self._pipeline_ok = not r.blocking
        return bool(r.blocking)

    # -- session ----------------------------------------------------------------------------

    def info(self) -> SessionInfo:
        """The session's id, tenant, limits, platform, usage, weight sets and components.

        Raises:
            tpubox.SessionEnded, tpubox.Unavailable.
        """
        r = self._unary("Info", pb.InfoRequest(), _DEFAULT)
        return SessionInfo(
            session_id=r.session_id,
            tenant=r.tenant,
            limits=Limits._from_pb(r.limits),
            platform=Platform._from_pb(r.platform),
            usage=Usage._from_pb(r.usage),
            weight_sets=tuple(r.weight_sets),
            components=tuple(r.components),
            launch_blocking=r.launch_blocking,
        )

    def usage(self) -> Usage:
        """What the session holds now and has done (:class:`Usage`).

        Raises:
            tpubox.SessionEnded, tpubox.Unavailable.
        """
        return Usage._from_pb(self._unary("Usage", pb.UsageRequest(), _DEFAULT))

    def close(self, *, end: bool | None = None, timeout: float | None = None) -> bool:
        """Closes the session; closing again is a no-op.

        An owned session (opened by this process) is ended on the daemon, which frees
        everything it holds. A joined session (a kernel's, opened by its provisioner) is only
        disconnected from here unless ``end=True``: its owner ends it.

        Args:
            end: end the session on the daemon (default: whether it is owned).
            timeout: deadline of the Close call (default the session's control timeout).

        Returns:
            Whether this call ended the session on the daemon.

        Never raises for a daemon that is gone or a session that already ended.
        """
        with self._close_lock:
            if self._closed:
                return False
            self._closed = True
        end = self.owned if end is None else end
        ended = False
        try:
            if end:
                try:
                    r = self._stub.Close(
                        pb.CloseRequest(),
                        metadata=self._md,
                        timeout=self.timeout if timeout is None else timeout,
                    )
                    ended = r.closed
                except grpc.RpcError as e:
                    err = from_rpc_error(e, self.address, "Close")
                    if err.kind not in ("unavailable", "session-ended", "deadline-exceeded"):
                        raise err from None
        finally:
            if self._attachment is not None:
                self._attachment.cancel()
            try:
                self._channel.close()
            except Exception:
                pass
            if self._local is not None:
                self._local.close()
            _OWNED.discard(self)
        return ended

    # -- tensors ----------------------------------------------------------------------------

    def tensor(
        self,
        value: ArrayLike,
        dtype: Any = None,
        *,
        device: int | None = None,
        timeout: float | None = None,
    ) -> Tensor:
        """Puts VALUE on the device as a new tensor of its shape and dtype.

        Args:
            value: an array or anything ``numpy.asarray`` takes (a scalar makes a 0-d tensor).
                Supported dtypes: bool, int8-int64, uint8-uint64, float16,
                ``ml_dtypes.bfloat16``, float32, float64, complex64, complex128. Non-contiguous
                and big-endian arrays are converted (copied) first; others are sent from their
                own memory in 4 MiB chunks.
            dtype: convert to this dtype first (``numpy.asarray(value, dtype)``).
            device: the device index, one of :attr:`devices` (default: the session's first
                device, ``devices[0]``).
            timeout: deadline of the upload in seconds (default none).

        Raises:
            TypeError: a dtype tpubox tensors cannot hold (strings, objects, datetimes, ...).
            tpubox.ResourceExhausted: over ``max-device-bytes`` or ``max-live-tensors``, or
            the per-device limit on that device (nothing allocated);
            tpubox.PermissionDenied: a device that is not one of the session's
            (:attr:`devices`); tpubox.NotFound: a device the host does not have.
        """
        a = _dtypes.as_device_array(value, dtype)
        header = pb.PutTensorChunk(spec=pb.TensorSpec(dtype=_dtypes.to_wire(a.dtype), dims=a.shape))
        if device is not None:
            header.device = device
        raw = _raw(a)
        if self._local is not None:
            self._check_open()
            self._flush_frees()
            with self._local_call() as local:
                info = local.put(raw, _dtypes.dtype_name(header.spec.dtype), list(a.shape), device)
            return Tensor._from_json(self, info)
        self._check_open()
        self._flush_frees()
        try:
            info = self._put(
                _transport.put_messages(header, raw), metadata=self._md, timeout=timeout
            )
        except grpc.RpcError as e:
            raise self._error(e, "PutTensor") from None
        return Tensor._from_pb(self, info)

    def get(self, tensor: Tensor | int, *, timeout: float | None = None) -> np.ndarray:
        """Copies a tensor (a Tensor or a handle number of this session) into a new, writable
        NumPy array of its shape and dtype.

        Raises:
            tpubox.NotFound: a handle this session does not have (freed, never made, another
            session's); tpubox.FailedPrecondition: a donated tensor.
        """
        handle = tensor.handle if isinstance(tensor, Tensor) else int(tensor)
        self._check_open()
        self._flush_frees()
        if self._local is not None:
            with self._local_call() as local:
                jinfo, out = local.get(handle)
            dt = _dtypes.from_wire(pb.DType.Value(str(jinfo["dtype"]).upper()))
            return out.view(dt.newbyteorder("<")).reshape(tuple(int(d) for d in jinfo["dims"]))
        call = self._get(
            pb.GetTensorRequest(handle=handle, chunk_bytes=CHUNK_BYTES),
            metadata=self._md,
            timeout=timeout,
        )
        try:
            return _transport.read_tensor(call)
        except grpc.RpcError as e:
            raise self._error(e, "GetTensor") from None

    def put_sharded(
        self,
        value: ArrayLike,
        sharding: str,
        devices: Sequence[int] | None = None,
        *,
        dtype: Any = None,
        timeout: float | None = None,
    ) -> ShardedTensor:
        """Puts the global array VALUE on several devices as SHARDING lays it out, one
        :class:`Tensor` per device (what ``jax.device_put(x, NamedSharding(mesh, spec))``
        does; :func:`tpubox.jax.device_put` takes JAX's shardings). The daemon splits it: each
        device gets its part in a buffer of the sharding's tile dims (``ceil(n / tiles)``
        along each dim, zero-padded where the tiles do not divide it), charged on that
        device.

        Args:
            value: the global array (as for :meth:`tensor`).
            sharding: XLA's text form of the sharding, e.g. ``"{devices=[4,1]<=[4]}"`` (dim 0
                in 4 parts, part k on logical device k), ``"{devices=[2,2]<=[4]}"`` (a 2x2
                grid), ``"{devices=[2,1,2]<=[4] last_tile_dim_replicate}"`` (dim 0 in 2
                parts, each on 2 devices), ``"{replicated}"`` (a whole copy on each device);
                what an :class:`Executable`'s ``parameter_shardings`` hold.
            devices: the session device of each logical device of the sharding, in order
                (default: the first as many of :attr:`devices` as the sharding names; all of
                them for ``{replicated}``).
            dtype: convert to this dtype first.
            timeout: deadline of the upload in seconds (default none).

        Returns:
            A :class:`ShardedTensor` (global ``shape`` and ``dtype``, ``sharding``,
            ``devices``, ``shards``).

        Raises:
            TypeError: a dtype tpubox tensors cannot hold.
            tpubox.InvalidArgument: a sharding that does not parse, does not tile VALUE's rank,
                or does not name exactly ``len(devices)`` devices; a device given twice;
            tpubox.PermissionDenied: a device that is not one of :attr:`devices`;
            tpubox.NotFound: a device the host lacks; tpubox.Unsupported: a sharding with no
                global view (``{manual}``);
            tpubox.ResourceExhausted: over ``max-device-bytes`` (in all or on one device) or
                ``max-live-tensors``; nothing is kept.
        """
        a = _dtypes.as_device_array(value, dtype)
        if devices is None:
            n = _sharding_devices(sharding)
            devices = self.devices if n is None else self.devices[:n]
        header = pb.PutShardedChunk(
            spec=pb.TensorSpec(dtype=_dtypes.to_wire(a.dtype), dims=a.shape),
            sharding=str(sharding),
            devices=[int(d) for d in devices],
        )
        self._check_open()
        self._flush_frees()
        try:
            info = self._put_sharded(
                _transport.put_sharded_messages(header, _raw(a)),
                metadata=self._md,
                timeout=timeout,
            )
        except grpc.RpcError as e:
            raise self._error(e, "PutShardedTensor") from None
        return ShardedTensor._from_pb(self, info)

    def free(self, *handles: Handle) -> int:
        """Frees tensors, sharded tensors (every shard) and executables (Tensor, ShardedTensor
        and Executable objects, or tensor handle numbers) in one call. Returns how many
        handles the daemon freed; unknown handles (already freed, another session's) are not
        an error."""
        tensors: list[int] = []
        executables: list[int] = []
        flat: list[Any] = []
        for h in handles:
            flat.extend(h.shards if isinstance(h, ShardedTensor) else (h,))
        for h in flat:
            if isinstance(h, Tensor):
                if h._freed:
                    continue
                h._freed = True
                tensors.append(h.handle)
            elif isinstance(h, Executable):
                if h._freed:
                    continue
                h._freed = True
                executables.append(h.handle)
            else:
                tensors.append(int(h))
        if not tensors and not executables:
            return 0
        return self._free_handles(tensors, executables)

    def weights(self, name: str, version: int | None = None) -> WeightSet:
        """Opens a version of the weight set NAME: one the daemon loaded (``tpubox serve
        --weights NAME=FILE``) or one a tenant published (:meth:`publish_weights`) for this
        session's tenant. Returns one read-only Tensor per tensor of the set, by name, in a
        :class:`WeightSet` that says which version it is. They are charged to nobody but count
        as live tensors, and keep their version alive while any of them is held.

        Args:
            version: the version to open; ``None`` for the latest.

        Raises:
            tpubox.NotFound: no such weight set for this tenant (``info().weight_sets`` lists
                them), or a version the daemon no longer holds (a version is freed once no
                reader holds it and a newer one exists).
        """
        r = self._unary(
            "OpenWeights", pb.OpenWeightsRequest(name=name, version=version or 0), _DEFAULT
        )
        return WeightSet(
            name, int(r.version), {e.name: Tensor._from_pb(self, e.tensor) for e in r.tensors}
        )

    def publish_weights(
        self,
        name: str,
        tensors: Mapping[str, Tensor],
        *,
        readers: Sequence[str] = (),
        timeout: float | None = None,
    ) -> int:
        """Publishes TENSORS (tensor name -> a Tensor of this session) as the next version of
        the weight set NAME and returns the version (1 for the first).

        Nothing is copied, on the device or to the host: the version shares the tensors'
        device memory, and they become read-only for everyone, this session included (donating
        one raises :class:`tpubox.PermissionDenied`; compute new values into new tensors, as a
        train step without donation does). Readers (:meth:`weights`) always get one whole
        version; the daemon keeps the latest and frees an older one once no reader holds it.
        The version is charged to the tenant's publish ledger (``Usage.published_bytes``),
        which outlives its sessions, until it is freed. Pending tensors are waited for first.

        Args:
            readers: tenants besides this one that may open the set (``"*"``: every tenant).

        Raises:
            tpubox.PermissionDenied: the tenant may not publish (its operator sets
                ``publish_weights = true`` in its ``[tenant.session]`` table), or NAME is a set
                the daemon loaded or another tenant published.
            tpubox.ResourceExhausted: over ``max-published-bytes`` or
                ``max-published-versions`` (the message says which).
            tpubox.FailedPrecondition: a donated tensor.
            tpubox.InvalidArgument: no tensors, or a name that is empty or over 256 bytes.
        """
        req = pb.PublishWeightsRequest(name=name, readers=list(readers))
        for tname, t in tensors.items():
            if not isinstance(t, Tensor) or t.session is not self:
                raise TypeError(f"tensor {tname!r}: publish_weights takes Tensors of this session")
            req.tensors.add(name=tname, handle=t.handle)
        r = self._unary("PublishWeights", req, _DEFAULT if timeout is None else timeout)
        for t in tensors.values():
            t.read_only = True
        return int(r.version)

    def weight_versions(self, name: str) -> WeightVersions:
        """The latest version of the weight set NAME (0 once unpublished) and the versions the
        daemon holds now: a cheap call for a reader waiting for a new version.

        Raises:
            tpubox.NotFound: no such weight set for this tenant.
        """
        r = self._unary("WeightVersions", pb.WeightVersionsRequest(name=name), _DEFAULT)
        return WeightVersions(int(r.latest), tuple(int(v) for v in r.held))

    def unpublish_weights(self, name: str) -> None:
        """Ends the weight set NAME this tenant published: the daemon lets go of its latest
        version (readers keep the versions they hold; a later publish continues the
        numbering).

        Raises:
            tpubox.NotFound: no such set; tpubox.PermissionDenied: a set the daemon loaded or
                another tenant published.
        """
        self._unary("UnpublishWeights", pb.UnpublishWeightsRequest(name=name), _DEFAULT)

    # -- programs ---------------------------------------------------------------------------

    def compile(
        self,
        program: str | bytes | os.PathLike[str],
        format: str = "auto",
        *,
        device: int | None = None,
        optimization_level: str | None = None,
        timeout: float | None = None,
        devices: Sequence[int] | None = None,
    ) -> Executable:
        """Compiles a StableHLO program whose entry function is ``main``.

        A program over several devices (a ``jax.export`` of ``jax.jit`` with shardings over a
        mesh of N devices, or of a ``shard_map``: its module says ``mhlo.num_partitions = N``)
        is compiled with ``devices=`` naming N of the session's devices: one partition each,
        XLA's SPMD partitioner (Shardy) splitting it and inserting its collectives. Call it
        with global arrays or :class:`ShardedTensor` s; it returns ShardedTensors
        (``Executable.devices``, ``parameter_shardings``, ``result_shardings`` say how).

        The returned executable's ``tier`` says which compile-cache tier served it; a compile
        served from the daemon's memory (tier 1) is not charged against
        ``max-compiles-per-minute``.

        Args:
            program: MLIR text (str), MLIR text or bytecode (bytes; e.g.
                ``jax.export``'s ``mlir_module_serialized``), or a path to a file of either.
            format: ``"auto"`` (bytecode when it starts with ``ML\\xefR``), ``"text"``,
                ``"bytecode"``.
            device: the device the executable runs on, one of :attr:`devices` (default: the
                session's first device, ``devices[0]``); its arguments must live there.
            optimization_level: how hard XLA optimises, TorchTPU's ``xla_optimization_level``:
                ``"O0"`` (fastest compile, for single ops) … ``"O3"`` (most optimisation, for
                fused programs); default: the plugin's. Part of the compile-cache key.
            timeout: deadline in seconds (default none; the daemon bounds a compile with its
                ``--max-compile-seconds``).
            devices: compile one SPMD program over these device indices of the session (in
                order: partition k runs on ``devices[k]``); ``device`` is then ignored. Their
                number must be the program's partition count.

        Raises:
            tpubox.CompileFailed: it did not parse or compile; tpubox.PermissionDenied: the
            program policy refused it (rule named); tpubox.ResourceExhausted:
            ``max-program-bytes``, ``max-compiles-per-minute``, ``max-live-executables``, or
            results and temporaries that cannot fit ``max-device-bytes``;
            tpubox.PermissionDenied also for a device that is not one of the session's
            (:attr:`devices`), e.g. a program over more devices than the session holds;
            tpubox.NotFound for a device the host lacks; tpubox.InvalidArgument for a device
            named twice or more devices than the host has.
        """
        if isinstance(program, os.PathLike):
            data = Path(program).read_bytes()
        elif isinstance(program, str):
            data = program.encode()
        else:
            data = bytes(program)
        try:
            fmt = _FORMATS[format]
        except KeyError:
            raise ValueError(f"format must be one of {sorted(_FORMATS)}, not {format!r}") from None
        if optimization_level is not None and optimization_level not in _OPTIMIZATION_LEVELS:
            raise ValueError(
                f"optimization_level must be one of {list(_OPTIMIZATION_LEVELS)}, "
                f"not {optimization_level!r}"
            )
        req = pb.CompileRequest(program=data, format=fmt)
        if devices is not None:
            req.devices.extend(int(d) for d in devices)
        if device is None and self.devices:
            # Named, not left to the daemon: its Compile takes an unset device as 0.
            device = self.devices[0]
        if device is not None:
            req.device = device
        if optimization_level is not None:
            req.optimization_level = optimization_level
        return Executable(self, self._unary("Compile", req, timeout))

    def run(
        self,
        component: bytes | str | os.PathLike[str],
        args: Sequence[str] = (),
        stdin: bytes | str = b"",
        timeout: float | None = None,
        stdout: IO[Any] | None | bool = None,
        stderr: IO[Any] | None | bool = None,
    ) -> RunResult:
        """Runs a guest component (a WASI command) in the daemon's sandbox, charged to this
        session, streaming its output as it comes.

        Args:
            component: the component's bytes, a path to a ``.wasm`` file (Path, or a str naming
                an existing file), or the name of a component the daemon offers
                (``info().components``; ``tpubox serve --components DIR``).
            args: arguments after the program name.
            stdin: the guest's standard input.
            timeout: wall-clock limit in seconds (default and at most the session's
                ``max_call_seconds``).
            stdout, stderr: file objects (text or binary) that get the guest's output as it
                arrives; default ``sys.stdout``/``sys.stderr`` at call time (so a notebook
                shows it live); False: only capture.

        Returns:
            A :class:`RunResult`: exit code, why it was stopped (if it was), elapsed seconds,
            and all of stdout and stderr.

        Raises:
            tpubox.NotFound: an unknown component name; FileNotFoundError: a path (ending in
            ``.wasm`` or holding a ``/``) to a file that does not exist; tpubox.InvalidArgument:
            bytes that are not a component. A guest that fails or traps is not an error: see ``exit_code`` and
            ``error``. Ctrl-C (KeyboardInterrupt) cancels the run.
        """
        req = pb.RunComponentRequest(
            args=[str(a) for a in args],
            stdin=stdin.encode() if isinstance(stdin, str) else bytes(stdin),
            timeout_seconds=float(timeout or 0.0),
        )
        if isinstance(component, (bytes, bytearray, memoryview)):
            req.wasm = bytes(component)
        elif isinstance(component, os.PathLike) or (
            isinstance(component, str) and os.path.isfile(component)
        ):
            req.wasm = Path(component).read_bytes()
        elif isinstance(component, str) and (
            component.endswith(".wasm") or "/" in component or os.sep in component
        ):
            # A path (it names a file, not a component the daemon offers) that is not there.
            raise FileNotFoundError(errno.ENOENT, "no such component file", component)
        elif isinstance(component, str):
            req.name = component
        else:
            raise TypeError(f"component must be bytes, a path or a name, not {type(component)}")
        out = _output.Sink(sys.stdout if stdout is None else stdout)
        err = _output.Sink(sys.stderr if stderr is None else stderr)
        self._check_open()
        self._flush_frees()
        # The daemon stops the guest at its deadline; ours only catches a daemon that hangs.
        deadline = None if timeout is None else timeout + 60.0
        call = self._stub.RunComponent(req, metadata=self._md, timeout=deadline)
        got_out: list[bytes] = []
        got_err: list[bytes] = []
        exit_ev = None
        try:
            for ev in call:
                which = ev.WhichOneof("event")
                if which == "stdout":
                    got_out.append(ev.stdout)
                    out.write(ev.stdout)
                elif which == "stderr":
                    got_err.append(ev.stderr)
                    err.write(ev.stderr)
                elif which == "exit":
                    exit_ev = ev.exit
        except KeyboardInterrupt:
            call.cancel()
            raise
        except grpc.RpcError as e:
            raise self._error(e, "RunComponent") from None
        finally:
            out.finish()
            err.finish()
        if exit_ev is None:
            raise Internal("internal", "RunComponent: the stream ended without the guest's exit")
        return RunResult(
            exit_code=exit_ev.code,
            error=exit_ev.error,
            elapsed=exit_ev.elapsed_seconds,
            stdout=b"".join(got_out),
            stderr=b"".join(got_err),
        )


class WeightSet(dict):  # type: ignore[type-arg]
    """One version of a weight set, as :meth:`Session.weights` opens it: a ``dict`` of tensor
    name -> read-only :class:`Tensor`, with the set's ``name`` and ``version``. The version is
    unchanged for as long as its tensors are held, whatever is published meanwhile."""

    def __init__(self, name: str, version: int, tensors: Mapping[str, Tensor]):
        super().__init__(tensors)
        self.name: str = name
        self.version: int = version

    def __repr__(self) -> str:
        return f"WeightSet({self.name!r}, version={self.version}, tensors={sorted(self)})"


_TILE_DEVICES = re.compile(r"devices=\[([0-9,\s]+)\]")


def _sharding_devices(sharding: str) -> int | None:
    """How many logical devices a sharding in XLA's text form names: the product of its tile
    assignment's dims (``{devices=[2,1,2]<=[4] ...}``: 4); None when it names no count
    (``{replicated}``, ``{maximal device=k}``: as many as there are)."""
    m = _TILE_DEVICES.search(str(sharding))
    if m is None:
        return None
    try:
        return int(np.prod([int(x) for x in m.group(1).split(",") if x.strip()]))
    except ValueError:
        return None


def _raw(a: np.ndarray) -> memoryview:
    """The bytes of a normalised array (C-contiguous, little-endian), without a copy."""
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")  # type: ignore[arg-type]


def _result(t: Tensor, raw: np.ndarray | None) -> Tensor | np.ndarray:
    """A Call's result: the fetched bytes RAW as an array of T's shape and dtype (writable),
    T holding them when it was also kept (handle != 0), or T when nothing was fetched."""
    if raw is None:
        return t
    a = raw.view(t.dtype.newbyteorder("<")).reshape(t.shape)
    if not a.flags.writeable:
        a = a.copy()
    if t.handle == 0:
        t._freed = True  # never a handle: nothing to free
        return a
    t._host = a
    return t


class _DefaultType:
    def __repr__(self) -> str:
        return "<default>"


_DEFAULT: Any = _DefaultType()


# ---------------------------------------------------------------------------------------------
# Entry points


def connect(
    address: str | os.PathLike[str] | None = None,
    token: str | None = None,
    *,
    limits: Limits | Mapping[str, Any] | None = None,
    label: str = "",
    timeout: float | None = DEFAULT_TIMEOUT,
    local: bool | None = None,
    tls: Any = None,
    devices: int | Sequence[int] | None = None,
    exclusive_devices: bool = False,
) -> Session:
    """Opens (or joins) a session on the tpubox daemon.

    - ``connect(address, token)``: opens a new session for the tenant of TOKEN (a tenant token
      of the daemon's tokens file; None when the daemon runs without ``--tokens``). The session
      ends when it is closed, when this process exits, or when this process goes away any other
      way: it is opened with ``end_on_disconnect`` and held by an Attach stream read by a
      daemon thread.
    - ``connect()``: joins the session named by the environment, ``TPUBOX_ADDRESS`` and
      ``TPUBOX_SESSION_TOKEN``, which the tpubox kernel provisioner sets for a Jupyter kernel.
      The provisioner owns that session: it is not ended when this process closes it or exits.

    Args:
        address: ``unix:/path/to/socket`` (or just the path), or ``HOST:PORT``.
        token: the tenant token.
        limits: tighter limits than the tenant's (:class:`Limits` or a dict of its fields, e.g.
            ``{"max_device_bytes": 1 << 30}``).
        label: free text the daemon logs with the session (e.g. a kernel id).
        timeout: deadline of control calls (Open, Info, Free, Usage, Close), in seconds.
        local: move tensor data, executions and frees through the daemon's local socket
            (shared memory, no HTTP/2; several times faster) instead of gRPC. Default: when
            the address is a Unix socket and the daemon offers a local socket this process can
            open. True: also for a TCP address (the daemon must be on this machine); False:
            gRPC only. :attr:`Session.transport` says which.
        tls: TLS for a TCP address of a daemon started with ``--tls-cert``:
            :class:`tpubox.TLS` (``ca``, ``cert``, ``key``, ``server_name``: PEM files), a
            mapping of those fields, a path (the CA file), or True (the system's roots).
            Default: ``TPUBOX_TLS_CA``/``TPUBOX_TLS_CERT``/``TPUBOX_TLS_KEY`` from the
            environment when set, TLS with the system's roots for a ``grpcs://`` or
            ``https://`` address, else plain text. A Unix socket never uses TLS.
        devices: which of the tenant's devices the session uses (:attr:`Session.devices`): an
            int is a count the daemon picks (the devices with the fewest sessions); a sequence
            names device indices, in order, the first the session's default. Default: every
            device the tenant may use (its ``[tenant.session]`` ``devices`` in the tokens
            file; all of the host's unless another tenant holds them alone), the lowest its
            default.
        exclusive_devices: hold the devices alone: no other session, of this tenant or any
            other, is placed on them while this one lives (a Ray task's device of its own).
            They must have no session when it opens.

    Raises:
        ValueError: no address and no TPUBOX_ADDRESS/TPUBOX_SESSION_TOKEN in the environment;
            ``tls`` given for a Unix socket; ``devices`` that is not a positive count or a
            non-empty sequence of indices; ``limits`` or ``devices`` given to join a
            kernel's session.
        tpubox.Unavailable: the daemon is not reachable at the address (at once, no waiting);
        tpubox.Unauthenticated: an unknown token; tpubox.PermissionDenied: a tenant that may
            not open sessions, a named device the tenant may not use, or one another tenant's
            session holds alone; tpubox.NotFound: a named device the host does not have;
        tpubox.ResourceExhausted: ``max-sessions``; or ``devices`` (the message ends in
            ``(limit devices)``): more devices than the tenant may use, a device another of
            its sessions holds alone, too few free devices for the count, or, with
            ``exclusive_devices``, a device that has other sessions now;
        tpubox.InvalidArgument: a limit above the tenant's; a count above the host's devices;
            a device named twice.
    """
    if address is None and token is None:
        env_address = os.environ.get(ENV_ADDRESS)
        env_token = os.environ.get(ENV_SESSION_TOKEN)
        if not env_address or not env_token:
            raise ValueError(
                "tpubox.connect(): give the daemon's address and a tenant token "
                "(tpubox.connect('unix:/run/tpubox.sock', token)), or run where a tpubox "
                f"provisioner set {ENV_ADDRESS} and {ENV_SESSION_TOKEN} (a tpubox Jupyter "
                "kernel); neither is the case here"
            )
        if limits is not None:
            raise ValueError("limits apply to a new session, not to the kernel's (joined) one")
        if devices is not None or exclusive_devices:
            raise ValueError(
                "devices and exclusive_devices apply to a new session, not to the kernel's "
                "(joined) one"
            )
        return _join(env_address, env_token, timeout, local, tls)
    if address is None:
        address = os.environ.get(ENV_ADDRESS)
        if not address:
            raise ValueError(f"tpubox.connect(): no address given and {ENV_ADDRESS} is not set")
    count, device_ids = _placement(devices)
    return _open(
        os.fspath(address),
        token,
        Limits.coerce(limits),
        label,
        timeout,
        local,
        tls,
        count=count,
        device_ids=device_ids,
        exclusive_devices=bool(exclusive_devices),
    )


def _placement(devices: int | Sequence[int] | None) -> tuple[int, list[int]]:
    """``connect``'s ``devices=`` as ``OpenRequest``'s ``devices`` (a count, 0 for every
    device) and ``device_ids``.

    Raises:
        ValueError: a count below 1, an empty sequence, or something that is neither.
    """
    if devices is None:
        return 0, []
    if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"devices={devices}: a session needs at least one device")
        return int(devices), []
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (Sequence, np.ndarray)):
        raise ValueError(
            f"devices must be a count (int) or a sequence of device indices, not {devices!r}"
        )
    ids = []
    for d in devices:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ValueError(f"devices={devices!r}: {d!r} is not a device index")
        ids.append(int(d))
    if not ids:
        raise ValueError("devices=[]: a session needs at least one device")
    return 0, ids


def _channel(address: str | os.PathLike[str], tls: Any) -> Any:
    """The gRPC channel to ADDRESS with the TLS ``tls=`` asks for (see :func:`connect`).

    Raises:
        FileNotFoundError: a TLS file that does not exist.
    """
    address = os.fspath(address)
    return _transport.grpc_channel(
        _transport.grpc_target(address), _transport.resolve_tls(address, tls)
    )


def _remember(s: Session) -> Session:
    global _LAST
    with _LAST_LOCK:
        _LAST = weakref.ref(s)
    return s


def _open(
    address: str,
    token: str | None,
    limits: Limits,
    label: str,
    timeout: float | None,
    local: bool | None = None,
    tls: Any = None,
    *,
    count: int = 0,
    device_ids: Sequence[int] = (),
    exclusive_devices: bool = False,
) -> Session:
    channel = _channel(address, tls)
    stub = pb_grpc.SessionStub(channel)
    try:
        r = stub.Open(
            pb.OpenRequest(
                limits=limits._to_pb(),
                end_on_disconnect=True,
                label=label,
                devices=count,
                device_ids=list(device_ids),
                exclusive_devices=exclusive_devices,
            ),
            metadata=_transport.auth_metadata(token),
            timeout=timeout,
        )
    except grpc.RpcError as e:
        channel.close()
        raise from_rpc_error(e, address, "Open") from None
    s = Session(
        address=address,
        token=r.session_token,
        session_id=r.session_id,
        tenant=r.tenant,
        limits=Limits._from_pb(r.limits),
        platform=Platform._from_pb(r.platform),
        owned=True,
        channel=channel,
        timeout=timeout,
        devices=r.session_devices,
        exclusive_devices=r.exclusive_devices,
    )
    try:
        s._local = _transport.local_channel(address, r.local_socket, r.session_token, local)
    except TpuboxError:
        s.close(timeout=2.0)
        raise
    att = _transport.Attachment(s._stub, s._md, s.session_id)
    s._attachment = att
    if not att.attached.wait(timeout) or att.error is not None or att.done.is_set():
        err = att.error
        s.close(timeout=2.0)
        if err is not None:
            raise from_rpc_error(err, address, "Attach") from None
        raise Unavailable(
            "unavailable", f"the tpubox daemon at {address} did not confirm the Attach stream"
        )
    _OWNED.add(s)
    try:
        _launch_blocking_from_env(s)
    except TpuboxError:
        s.close(timeout=2.0)
        raise
    return _remember(s)


def _join(
    address: str, token: str, timeout: float | None, local: bool | None = None, tls: Any = None
) -> Session:
    channel = _channel(address, tls)
    stub = pb_grpc.SessionStub(channel)
    try:
        r = stub.Info(pb.InfoRequest(), metadata=_transport.auth_metadata(token), timeout=timeout)
    except grpc.RpcError as e:
        channel.close()
        raise from_rpc_error(e, address, "Info") from None
    s = Session(
        address=address,
        token=token,
        session_id=r.session_id,
        tenant=r.tenant,
        limits=Limits._from_pb(r.limits),
        platform=Platform._from_pb(r.platform),
        owned=False,
        channel=channel,
        timeout=timeout,
        devices=r.session_devices,
        exclusive_devices=r.exclusive_devices,
    )
    s._local = _transport.local_channel(address, r.local_socket, token, local)
    return _remember(_launch_blocking_from_env(s))


def default_session() -> Session:
    """The session :func:`tpubox.jax.jit` and friends use when given none: the last one
    :func:`connect` returned that is still open, else ``connect()`` (the kernel's session from
    the environment).

    Raises:
        ValueError: no open session and no TPUBOX_ADDRESS/TPUBOX_SESSION_TOKEN.
    """
    with _LAST_LOCK:
        s = _LAST() if _LAST is not None else None
    if s is not None and not s.closed:
        return s
    return connect()


def tenant_usage(
    address: str | os.PathLike[str],
    token: str | None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    tls: Any = None,
) -> TenantUsage:
    """What all live sessions of TOKEN's tenant hold, summed (for operators and provisioners:
    after a kernel's session ends, its tenant's device bytes are back to zero).

    Args:
        address: the daemon's address, as for :func:`connect`.
        token: a tenant token (not a session token).
        tls: as for :func:`connect`.

    Raises:
        tpubox.Unauthenticated, tpubox.PermissionDenied, tpubox.Unavailable.
    """
    address = os.fspath(address)
    channel = _channel(address, tls)
    try:
        r = pb_grpc.SessionStub(channel).TenantUsage(
            pb.TenantUsageRequest(), metadata=_transport.auth_metadata(token), timeout=timeout
        )
    except grpc.RpcError as e:
        raise from_rpc_error(e, address, "TenantUsage") from None
    finally:
        channel.close()
    return TenantUsage(tenant=r.tenant, sessions=r.sessions, usage=Usage._from_pb(r.usage))


def wait_for_daemon(
    address: str | os.PathLike[str],
    timeout: float = 30.0,
    token: str | None = None,
    *,
    tls: Any = None,
) -> None:
    """Waits until the daemon at ADDRESS answers (a TenantUsage call with TOKEN; any answer but
    Unavailable counts), for up to TIMEOUT seconds. ``tls`` as for :func:`connect`.

    Raises:
        tpubox.Unavailable: not answering after TIMEOUT seconds.
    """
    deadline = time.monotonic() + timeout
    last: TpuboxError | None = None
    while time.monotonic() < deadline:
        try:
            tenant_usage(address, token, timeout=2.0, tls=tls)
            return
        except Unavailable as e:
            last = e
        except TpuboxError:
            return
        time.sleep(0.1)
    raise Unavailable(
        "unavailable", f"the tpubox daemon at {address} did not answer in {timeout} s: {last}"
    )
