"""Handle lifetimes: :class:`Tensor` and :class:`Executable`, the handles a session holds on
the daemon's device. Each is freed once: now (``free()``, a ``with`` block, ``Session.free``),
or, when its last reference is dropped, queued by ``__del__`` (which never blocks on an RPC)
and sent in one batch with the session's next call (``Session._flush_frees`` and :func:`drain`).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, Union

import numpy as np

from . import _dtypes
from ._proto import session_pb2 as pb
from ._values import ArrayLike, TensorSpec

if TYPE_CHECKING:
    from .session import Session

#: What :meth:`Session.free` takes: Tensor, ShardedTensor and Executable objects, or tensor
#: handle numbers.
Handle = Union["Tensor", "ShardedTensor", "Executable", int]


class _Handle:
    """What a :class:`Tensor` and an :class:`Executable` share: a handle of a session, freed
    once, now (:meth:`free`, a ``with`` block) or with the session's next call after the last
    reference is dropped (``__del__`` only queues it: it never blocks on an RPC)."""

    __slots__ = ()
    _session: Session
    _freed: bool
    handle: int

    def _free_now(self) -> None:
        raise NotImplementedError

    def _queue_free(self) -> None:
        raise NotImplementedError

    def free(self) -> None:
        """Frees the handle now (one Free call); freeing twice is a no-op."""
        if self._freed:
            return
        self._freed = True
        if not self._session.closed:
            self._free_now()

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __del__(self) -> None:
        try:
            if not self._freed and not self._session._closed:
                self._freed = True
                self._queue_free()
        except Exception:  # interpreter shutdown: attributes may be gone
            pass


class Tensor(_Handle):
    """A tensor on the daemon's device, held by a session.

    Its data stays on the device until :meth:`numpy`; pass it to an :class:`Executable` (or a
    :func:`tpubox.jax.jit` function) to use it without copying. Free it with :meth:`free`, a
    ``with`` block, or by dropping the last reference (the free is then sent with the session's
    next call; nothing blocks in ``__del__``). A donated tensor stays a handle that the daemon
    refuses to use (:class:`tpubox.FailedPrecondition`) until freed.

    Attributes:
        handle: the handle number (meaningful in its session only).
        shape: dims (``()`` for a scalar).
        dtype: the NumPy dtype.
        device: the device index it lives on.
        nbytes: dense size in bytes (dtype size × product of dims), what it is charged.
        read_only: a shared weight, or a tensor its session published (may be read and
            passed, never donated).
        weights: the weight-set versions it is a tensor of or was computed from, as sorted
            ``(set name, version)`` pairs: a tensor of :meth:`Session.weights` carries its set's
            version, and an execution's results carry their arguments' (through any number of
            executions); ``()`` for others. One set named twice means two versions were mixed.
    """

    __slots__ = (
        "_session",
        "handle",
        "shape",
        "dtype",
        "device",
        "nbytes",
        "read_only",
        "weights",
        "_freed",
        "_donated",
        "_host",
        "__weakref__",
    )

    def __init__(
        self,
        session: Session,
        handle: int,
        shape: tuple[int, ...],
        dtype: np.dtype,
        device: int = 0,
        nbytes: int = 0,
        read_only: bool = False,
        weights: tuple[tuple[str, int], ...] = (),
    ):
        self._session = session
        self.handle: int = handle
        self.shape: tuple[int, ...] = shape
        self.dtype: np.dtype = dtype
        self.device: int = device
        self.nbytes: int = nbytes
        self.read_only: bool = read_only
        self.weights: tuple[tuple[str, int], ...] = weights
        self._freed = False
        self._donated = False
        # Its bytes when a call fetched them as it kept the tensor (Executable.call's `keep`):
        # numpy() then answers without a round trip.
        self._host: np.ndarray | None = None

    @classmethod
    def _from_pb(cls, session: Session, info: pb.TensorInfo) -> Tensor:
        return cls(
            session,
            info.handle,
            tuple(int(d) for d in info.spec.dims),
            _dtypes.from_wire(info.spec.dtype),
            info.device,
            info.byte_size,
            info.read_only,
            tuple((w.name, int(w.version)) for w in info.weights),
        )

    @classmethod
    def _from_json(cls, session: Session, info: Mapping[str, Any]) -> Tensor:
        """From the local socket's TENSOR_INFO (dtype by its wire name)."""
        return cls(
            session,
            int(info["handle"]),
            tuple(int(d) for d in info["dims"]),
            _dtypes.from_wire(pb.DType.Value(str(info["dtype"]).upper())),
            int(info.get("device", 0)),
            int(info.get("byte_size", 0)),
            bool(info.get("read_only", False)),
            tuple((str(w["name"]), int(w["version"])) for w in info.get("weights", ())),
        )

    @property
    def session(self) -> Session:
        """The session that holds it."""
        return self._session

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def spec(self) -> TensorSpec:
        """Its :class:`TensorSpec` (shape and dtype)."""
        return TensorSpec(self.shape, self.dtype)

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` was called (or its session was closed)."""
        return self._freed or self._session.closed

    @property
    def donated(self) -> bool:
        """Whether it was donated to an execution (its device memory is gone)."""
        return self._donated

    def numpy(self, *, timeout: float | None = None) -> np.ndarray:
        """Copies the tensor to a new, writable NumPy array of its shape and dtype.

        A tensor that :meth:`Executable.call` both fetched and kept answers from the bytes
        that call brought back (a device tensor never changes), without a round trip.

        Raises:
            tpubox.NotFound: it was freed; tpubox.FailedPrecondition: it was donated;
            tpubox.Unavailable: the daemon is gone.
        """
        host = self._host
        if host is not None and not self._freed and not self._donated and not self._session.closed:
            return host.copy()
        return self._session.get(self, timeout=timeout)

    def wait(self, *, timeout: float | None = None) -> None:
        """Waits until the launch that makes this tensor (:meth:`Executable.launch`) finished;
        at once for a tensor that has its value.

        Raises:
            tpubox.ExecutionFailed (or the kind the device's error maps to): its launch failed,
            named (``launch <id> of program <fingerprint> failed: ...``); tpubox.NotFound: it
            was freed; tpubox.FailedPrecondition: it was donated.
        """
        self._session._wait([self.handle], False, timeout)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        a = self.numpy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def _free_now(self) -> None:
        self._session._free_handles([self.handle], [])

    def _queue_free(self) -> None:
        self._session._pending_tensors.append(self.handle)

    def __enter__(self) -> Tensor:
        return self

    def __repr__(self) -> str:
        state = ""
        if self._freed:
            state = ", freed"
        elif self._donated:
            state = ", donated"
        elif self._session.closed:
            state = ", session closed"
        ro = ", read_only" if self.read_only else ""
        return (
            f"tpubox.Tensor(handle={self.handle}, shape={self.shape}, dtype={self.dtype}, "
            f"device={self.device}{ro}{state})"
        )


class Executable(_Handle):
    """A compiled program held by a session (:meth:`Session.compile`).

    Call it with one argument per parameter: :class:`Tensor` s (used where they are) or
    anything NumPy can turn into an array (put on the device for this call and freed after;
    Python scalars and lists take the parameter's dtype). It returns one new :class:`Tensor`
    per result.

    Attributes:
        handle: the executable's handle number.
        parameters: the parameters' :class:`TensorSpec` s, in order.
        results: the results' specs.
        result_bytes: device bytes of the results of one execution.
        temp_bytes: device bytes of the temporaries one execution holds.
        fingerprint: the program's compile-cache key (hex).
        tier: which compile-cache tier served the compile: ``"memory"`` (tier 1, the daemon's
            loaded executables; not charged against ``max-compiles-per-minute``), ``"disk"``
            (tier 2), ``"remote"`` (tier 3), ``"compiled"`` (a cache miss) or
            ``"compiled-without-cache"``; ``""`` from a daemon too old to say.
        devices: the device indices it runs on: one, or for a program compiled over several
            (``Session.compile(..., devices=[...])``, SPMD) all of them in partition order
            (the order of every :class:`ShardedTensor`'s ``shards`` it takes and returns).
        parameter_shardings, result_shardings: each parameter's and result's sharding in
            XLA's text form (``"{devices=[4,1]<=[4]}"``, ``"{replicated}"``; device numbers
            are positions in ``devices``); all ``"{replicated}"`` for one device.
        global_parameters, global_results: each parameter's and result's global
            :class:`TensorSpec` (``parameters`` and ``results`` are the per-device specs; the
            same for one device).
    """

    __slots__ = (
        "_session",
        "handle",
        "parameters",
        "results",
        "result_bytes",
        "temp_bytes",
        "fingerprint",
        "tier",
        "devices",
        "parameter_shardings",
        "result_shardings",
        "global_parameters",
        "global_results",
        "_freed",
        "_out_meta",
        "__weakref__",
    )

    def __init__(self, session: Session, resp: pb.CompileResponse):
        self._session = session
        self.handle: int = resp.executable
        self.parameters: tuple[TensorSpec, ...] = tuple(
            TensorSpec._from_pb(s) for s in resp.parameters
        )
        self.results: tuple[TensorSpec, ...] = tuple(TensorSpec._from_pb(s) for s in resp.results)
        self.result_bytes: int = resp.result_bytes
        self.temp_bytes: int = resp.temp_bytes
        self.fingerprint: str = resp.fingerprint
        self.tier: str = resp.tier
        self.devices: tuple[int, ...] = tuple(int(d) for d in resp.devices)
        if resp.parameter_shardings or not resp.parameters:
            self.parameter_shardings: tuple[str, ...] = tuple(
                x.sharding for x in resp.parameter_shardings
            )
            self.global_parameters: tuple[TensorSpec, ...] = tuple(
                TensorSpec._from_pb(x.global_spec) for x in resp.parameter_shardings
            )
        else:  # a daemon too old to say: one device
            self.parameter_shardings = ("{replicated}",) * len(self.parameters)
            self.global_parameters = self.parameters
        if resp.result_shardings or not resp.results:
            self.result_shardings: tuple[str, ...] = tuple(
                x.sharding for x in resp.result_shardings
            )
            self.global_results: tuple[TensorSpec, ...] = tuple(
                TensorSpec._from_pb(x.global_spec) for x in resp.result_shardings
            )
        else:
            self.result_shardings = ("{replicated}",) * len(self.results)
            self.global_results = self.results
        self._freed = False
        # Per result: (shape, dtype, nbytes), and the device (Session._launch_pipelined).
        self._out_meta: tuple[tuple[tuple[tuple[int, ...], np.dtype, int], ...], int] | None = None

    @property
    def is_spmd(self) -> bool:
        """Whether it runs on several devices at once (compiled with ``devices=[...]``): it is
        then called with global arrays or :class:`ShardedTensor` s and returns
        ShardedTensors."""
        return len(self.devices) > 1

    @property
    def session(self) -> Session:
        """The session that holds it."""
        return self._session

    def __call__(
        self, *args: Tensor | ArrayLike, donate: Iterable[int] = (), timeout: float | None = None
    ) -> list[Tensor]:
        """Executes the program on ARGS; returns one new Tensor per result.

        Arrays among ARGS are sent with the execution, in the same round trip (a ``Call``:
        inline bytes over gRPC, one memfd on the local socket), and never become handles; with
        only Tensors it is one ``Execute`` (on the local socket, a ``call`` of handles).

        A program over several devices (:attr:`is_spmd`) takes one global array (of
        :attr:`global_parameters`' shape and dtype, split on the daemon by
        :attr:`parameter_shardings`) or one :class:`ShardedTensor` (shards of
        :attr:`parameters`' per-device specs on :attr:`devices`, in order) per parameter, and
        returns one :class:`ShardedTensor` per result (a ``CallSharded``, always over gRPC;
        Tensors of one device are refused with TypeError). Extra errors then:
        tpubox.InvalidArgument for a global array of other dims or dtype, or a ShardedTensor
        with the wrong number of shards or a shard of other dims; tpubox.FailedPrecondition
        for a shard on another device than its partition's.

        Args:
            args: one per parameter, in order: Tensors of this session, or arrays.
            donate: positions in ARGS whose tensors are donated: on success their device memory
                is gone (the Tensor objects stay handles, refused by the daemon, until freed).
            timeout: deadline of the call in seconds (default none).

        Raises:
            tpubox.InvalidArgument: wrong argument count, dtypes or shapes;
            tpubox.NotFound: a tensor this session does not have (freed, another session's);
            tpubox.FailedPrecondition: a donated tensor;
            tpubox.ResourceExhausted: the results would exceed ``max-device-bytes`` or
            ``max-live-tensors``; tpubox.ExecutionFailed.
        """
        args = tuple(args)
        donate = tuple(int(i) for i in donate)
        if self.is_spmd:
            return self._run_sharded(args, donate, [], [], (), timeout)  # type: ignore[return-value]
        if all(isinstance(a, Tensor) for a in args):
            outs = self._session._execute(
                self.handle, [a.handle for a in args], donate, timeout  # type: ignore[union-attr]
            )
            _mark_donated(args, donate)
            return outs
        return self.call(*args, donate=donate, fetch=False, timeout=timeout)  # type: ignore[return-value]

    def call(
        self,
        *args: Tensor | ArrayLike,
        donate: Iterable[int] = (),
        fetch: bool | Iterable[int] = True,
        keep: Iterable[int] = (),
        free: Iterable[Tensor | int] = (),
        timeout: float | None = None,
    ) -> list[Any]:
        """Executes the program in one round trip (the session API's ``Call``): arrays among
        ARGS are sent with it (inline bytes over gRPC, one memfd on the local socket), the
        results named by FETCH come back as NumPy arrays, and the tensors of FREE are freed
        after it, all in one request. ``exe.call(x, w)`` with NumPy arrays returns NumPy arrays.
        For a program over several devices, ARGS are global arrays or :class:`ShardedTensor` s
        (as in :meth:`__call__`), fetched results come back as the gathered global arrays (one
        fetched and kept is a ShardedTensor whose ``numpy()`` answers from those bytes), and
        results not fetched as ShardedTensors; FREE may hold ShardedTensors.

        On failure the session is as it was: nothing is kept and nothing in FREE is freed.

        Args:
            args: one per parameter, in order: Tensors of this session, or arrays (Python
                scalars and lists take the parameter's dtype).
            donate: positions in ARGS whose tensors are donated (as in :meth:`__call__`; an
                array's tensor may be donated too).
            fetch: which results come back: True (all, the default), False (none) or their
                positions.
            keep: positions of fetched results that also stay on the device.
            free: Tensors (or handle numbers) to free after the execution; they may be
                arguments of this call.
            timeout: deadline of the call in seconds (default none).

        Returns:
            One entry per result: a NumPy array (dense, writable) for a fetched result, a
            :class:`Tensor` for one not fetched, and for one fetched and kept a Tensor whose
            :meth:`Tensor.numpy` answers from the fetched bytes without another round trip.

        Raises:
            As :meth:`__call__`, and: tpubox.InvalidArgument for a FETCH or KEEP position out
            of range or listed twice; tpubox.ResourceExhausted (``max-device-bytes``) when the
            fetched results' host copies do not fit the session's transfers in flight.
            TypeError: an array of a dtype tpubox tensors cannot hold.
        """
        n_results = len(self.results)
        if fetch is True:
            fetch_pos = list(range(n_results))
        elif fetch is False:
            fetch_pos = []
        else:
            fetch_pos = [int(i) for i in fetch]  # type: ignore[union-attr]
        if self.is_spmd:
            return self._run_sharded(
                tuple(args), donate, fetch_pos, [int(i) for i in keep], free, timeout
            )
        return self._run(args, donate, fetch_pos, [int(i) for i in keep], free, timeout, False)

    def launch(
        self,
        *args: Tensor | ArrayLike,
        donate: Iterable[int] = (),
        free: Iterable[Tensor | int] = (),
        timeout: float | None = None,
    ) -> list[Tensor]:
        """Launches the program without waiting for the device (a ``Call`` with ``launch``):
        returns as soon as the daemon checked and charged it, one *pending* :class:`Tensor` per
        result, while the device works. Pass them to later calls and launches (the daemon
        orders them), read them (:meth:`Tensor.numpy` waits for the value), or wait with
        :meth:`Tensor.wait` / :meth:`Session.wait_all`. Arrays among ARGS travel with the
        launch, as in :meth:`call`.

        Donation is final at launch. The device's error (say ``execution-failed``) is raised at
        the first wait or read of an output, naming the launch (``launch <id> of program
        <fingerprint> failed: ...``), or by :meth:`Session.wait_all`; with launch blocking on
        (:meth:`Session.set_launch_blocking`, ``TPUBOX_LAUNCH_BLOCKING=1``) by this call.

        Raises:
            As :meth:`__call__` for what is checked at launch, and
            tpubox.ResourceExhausted naming ``max-pending-launches`` when the session has as
            many launches queued or running as its tenant may.
        """
        if self.is_spmd:
            raise ValueError(
                "a program over several devices runs with exe(...) or exe.call(...), not launch"
            )
        return self._run(tuple(args), donate, [], [], free, timeout, True)  # type: ignore[return-value]

    def _run_sharded(
        self,
        args: tuple[Any, ...],
        donate: Iterable[int],
        fetch_pos: list[int],
        keep_pos: list[int],
        free: Iterable[Tensor | ShardedTensor | int],
        timeout: float | None,
    ) -> list[Any]:
        """One ``CallSharded``: ARGS are ShardedTensors (their shards on this executable's
        devices, in its order) or global arrays, sent inline and split by the daemon (over
        gRPC, arrays beyond one request's worth are put first with the parameter's sharding and
        freed by the call); returns one entry per result: a NumPy array (the gathered global
        array) when fetched and not kept, else a ShardedTensor."""
        s = self._session
        donate = tuple(int(i) for i in donate)
        n_results = len(self.results)
        free_handles: list[int] = []
        free_objs: list[Tensor] = []
        for f in free:
            for t in f.shards if isinstance(f, ShardedTensor) else (f,):
                if isinstance(t, Tensor):
                    if not t._freed:
                        free_objs.append(t)
                        free_handles.append(t.handle)
                else:
                    free_handles.append(int(t))
        big: set[int] = set()
        in_range = [i for i in fetch_pos if 0 <= i < n_results]
        total = sum(
            int(np.prod(self.global_results[i].shape, dtype=np.int64))
            * self.global_results[i].dtype.itemsize
            for i in in_range
        )
        if total > MAX_CALL_FETCH_BYTES:
            big = set(in_range)
        send_fetch = [i for i in fetch_pos if i not in big]
        send_keep = [i for i in keep_pos if i not in big]
        temps: list[ShardedTensor] = []
        call_args: list[Any] = []
        inline_bytes = 0
        try:
            for i, a in enumerate(args):
                if isinstance(a, ShardedTensor):
                    call_args.append(a)
                    continue
                if isinstance(a, Tensor):
                    raise TypeError(
                        f"argument {i}: a program over {len(self.devices)} devices takes "
                        "global arrays or ShardedTensors, not a Tensor of one device "
                        "(tensor.numpy() is its global array)"
                    )
                dtype = None
                if not isinstance(a, np.ndarray) and not hasattr(a, "__array__"):
                    if i < len(self.global_parameters):
                        dtype = self.global_parameters[i].dtype
                arr = _dtypes.as_device_array(a, dtype)
                if inline_bytes + arr.nbytes > INLINE_GRPC_BYTES and i < len(
                    self.parameter_shardings
                ):
                    t = s.put_sharded(
                        arr, self.parameter_shardings[i], devices=self.devices, timeout=timeout
                    )
                    temps.append(t)
                    call_args.append(t)
                    continue
                inline_bytes += arr.nbytes
                call_args.append(arr)
            outs = s._call_sharded(
                self.handle,
                call_args,
                donate,
                send_fetch,
                send_keep,
                free_handles + [t.handle for tt in temps for t in tt.shards],
                timeout,
            )
        except BaseException:
            if temps:
                s.free(*temps)
            raise
        for tt in temps:
            for t in tt.shards:
                t._freed = True
        for t in free_objs:
            t._freed = True
        for i in donate:
            if 0 <= i < len(args) and isinstance(args[i], ShardedTensor):
                for t in args[i].shards:
                    t._donated = True
        for i in big:
            st = outs[i]
            assert isinstance(st, ShardedTensor)
            outs[i] = st.numpy(timeout=timeout) if i not in keep_pos else st
            if i not in keep_pos:
                st.free()
        return outs

    def _run(
        self,
        args: tuple[Any, ...],
        donate: Iterable[int],
        fetch_pos: list[int],
        keep_pos: list[int],
        free: Iterable[Tensor | int],
        timeout: float | None,
        launch: bool,
    ) -> list[Any]:
        s = self._session
        donate = tuple(int(i) for i in donate)
        n_results = len(self.results)
        free_handles = []
        free_objs = []
        for f in free:
            if isinstance(f, Tensor):
                if not f._freed:
                    free_objs.append(f)
                    free_handles.append(f.handle)
            else:
                free_handles.append(int(f))
        # Results too large for one reply are kept and read with GetTensor (streamed).
        big: set[int] = set()
        in_range = [i for i in fetch_pos if 0 <= i < n_results]
        total = sum(
            int(np.prod(self.results[i].shape, dtype=np.int64)) * self.results[i].dtype.itemsize
            for i in in_range
        )
        if total > MAX_CALL_FETCH_BYTES:
            big = set(in_range)
        send_fetch = [i for i in fetch_pos if i not in big]
        send_keep = [i for i in keep_pos if i not in big]
        # Arrays go inline; over gRPC, arrays that would make the request larger than one
        # PutTensor message are put first and freed by the call.
        temps: list[Tensor] = []
        call_args: list[Any] = []
        inline_bytes = 0
        try:
            for i, a in enumerate(args):
                if isinstance(a, Tensor):
                    call_args.append(a)
                    continue
                dtype = None
                if not isinstance(a, np.ndarray) and not hasattr(a, "__array__"):
                    if i < len(self.parameters):
                        dtype = self.parameters[i].dtype
                arr = _dtypes.as_device_array(a, dtype)
                if s._local is None and inline_bytes + arr.nbytes > INLINE_GRPC_BYTES:
                    t = s.tensor(arr, timeout=timeout)
                    temps.append(t)
                    call_args.append(t)
                    continue
                inline_bytes += arr.nbytes
                call_args.append(arr)
            outs = s._call(
                self.handle,
                call_args,
                donate,
                send_fetch,
                send_keep,
                free_handles + [t.handle for t in temps],
                timeout,
                launch,
            )
        except BaseException:
            if temps:
                s.free(*temps)
            raise
        for t in temps:
            t._freed = True
        for f in free_objs:
            f._freed = True
        _mark_donated(args, donate)
        for i in big:
            t = outs[i]
            assert isinstance(t, Tensor)
            outs[i] = t.numpy(timeout=timeout) if i not in keep_pos else t
            if i not in keep_pos:
                t.free()
        return outs

    def _free_now(self) -> None:
        self._session._free_handles([], [self.handle])

    def _queue_free(self) -> None:
        self._session._pending_executables.append(self.handle)

    def __enter__(self) -> Executable:
        return self

    def __repr__(self) -> str:
        def specs(ss: Sequence[TensorSpec]) -> str:
            return ", ".join(f"{s.dtype}{list(s.shape)}" for s in ss)

        freed = ", freed" if self._freed else ""
        return (
            f"tpubox.Executable(handle={self.handle}, ({specs(self.parameters)}) -> "
            f"({specs(self.results)}){freed})"
        )


class ShardedTensor:
    """One global array held as one :class:`Tensor` per device, laid out by a sharding: what
    :meth:`Session.put_sharded` makes and a program over several devices takes and returns
    (``jax.Array`` with a ``NamedSharding``, on the daemon's devices).

    Its data stays on the devices until :meth:`numpy`, which gathers the global array on the
    daemon (each part read from the first device that holds it). Each shard is charged on its
    own device; free them all with :meth:`free`, a ``with`` block, or by dropping the last
    reference to the ShardedTensor and its shards.

    Attributes:
        shape: the global array's dims.
        dtype: its NumPy dtype.
        sharding: the sharding in XLA's text form (``"{devices=[4,1]<=[4]}"``: split in 4
            along dim 0; ``"{replicated}"``; ``"{devices=[2,1,2]<=[4]
            last_tile_dim_replicate}"``: split in 2, each half on 2 devices); its device
            numbers are positions in ``devices``.
        devices: the device index of each shard, in the sharding's logical order.
        shards: the per-device :class:`Tensor` s, in the same order; each has the sharding's
            tile dims (``ceil(n / tiles)`` along each dim; zero-padded where the tiles do not
            divide it).
        nbytes: dense size of the global array in bytes.
    """

    __slots__ = ("_session", "shape", "dtype", "sharding", "devices", "shards", "nbytes",
                 "_host", "__weakref__")  # fmt: skip

    def __init__(
        self,
        session: Session,
        shape: tuple[int, ...],
        dtype: np.dtype,
        sharding: str,
        shards: Sequence[Tensor],
        nbytes: int | None = None,
    ):
        self._session = session
        self.shape: tuple[int, ...] = tuple(int(d) for d in shape)
        self.dtype: np.dtype = np.dtype(dtype)
        self.sharding: str = sharding
        self.shards: tuple[Tensor, ...] = tuple(shards)
        self.devices: tuple[int, ...] = tuple(t.device for t in self.shards)
        self.nbytes: int = (
            int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
            if nbytes is None
            else int(nbytes)
        )
        # The global array when a call fetched it as it kept the shards (``keep``): numpy()
        # then answers without a round trip.
        self._host: np.ndarray | None = None

    @classmethod
    def _from_pb(cls, session: Session, info: pb.ShardedTensorInfo) -> ShardedTensor:
        return cls(
            session,
            tuple(int(d) for d in info.spec.dims),
            _dtypes.from_wire(info.spec.dtype),
            info.sharding,
            [Tensor._from_pb(session, t) for t in info.shards],
            info.byte_size,
        )

    @property
    def session(self) -> Session:
        """The session that holds it."""
        return self._session

    @property
    def ndim(self) -> int:
        """Number of dims of the global array."""
        return len(self.shape)

    @property
    def spec(self) -> TensorSpec:
        """The global array's :class:`TensorSpec`."""
        return TensorSpec(self.shape, self.dtype)

    @property
    def freed(self) -> bool:
        """Whether its shards were freed (or its session closed)."""
        return all(t.freed for t in self.shards)

    @property
    def donated(self) -> bool:
        """Whether it was donated to an execution (its shards' device memory is gone)."""
        return any(t.donated for t in self.shards)

    def numpy(self, *, timeout: float | None = None) -> np.ndarray:
        """The global array, gathered on the daemon from the shards (each part read once, from
        the first device that holds it), as a new, writable NumPy array of :attr:`shape` and
        :attr:`dtype`. One that :meth:`Executable.call` both fetched and kept answers from the
        bytes that call brought back, without a round trip.

        Raises:
            tpubox.NotFound: a shard was freed; tpubox.FailedPrecondition: it was donated;
            tpubox.ResourceExhausted (``max-device-bytes``): the session's transfers in
            flight leave no room for the gathered copy.
        """
        host = self._host
        if host is not None and not self.freed and not self.donated and not self._session.closed:
            return host.copy()
        return self._session._get_sharded(self, timeout=timeout)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        a = self.numpy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def free(self) -> None:
        """Frees every shard now (one Free call); freeing twice is a no-op."""
        live = [t for t in self.shards if not t._freed]
        if live:
            self._session.free(*live)

    def __enter__(self) -> ShardedTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = ", freed" if self.freed else (", donated" if self.donated else "")
        return (
            f"tpubox.ShardedTensor(shape={self.shape}, dtype={self.dtype}, "
            f"sharding={self.sharding!r}, devices={list(self.devices)}{state})"
        )


#: Most bytes of results one ``Call`` fetches (``MAX_CALL_FETCH_BYTES`` of
#: crates/session-api/src/registry.rs): larger results are kept and read with GetTensor.
MAX_CALL_FETCH_BYTES = 256 << 20

#: Most bytes of arrays a ``Call`` over gRPC carries inline: one PutTensor message's worth
#: (``_transport.CHUNK_BYTES``), which every daemon's ``--max-request-mib`` admits; larger
#: arrays are put first (streamed) and freed by the call.
INLINE_GRPC_BYTES = 4 << 20


def _mark_donated(args: Sequence[Any], donate: Sequence[int]) -> None:
    for i in donate:
        if 0 <= i < len(args) and isinstance(args[i], Tensor):
            args[i]._donated = True


def drain(dq: collections.deque[int]) -> list[int]:
    """Takes every handle queued in DQ (safe against ``__del__`` appending meanwhile)."""
    out = []
    while True:
        try:
            out.append(dq.popleft())
        except IndexError:
            return out
