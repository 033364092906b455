"""Run JAX functions on the tpubox daemon's device.

``tpubox.jax.jit(f)`` is used like ``jax.jit(f)``, but the program runs on the daemon: once per
input signature (the pytree structure, each leaf's shape and dtype, the static arguments) it
exports ``f`` with ``jax.export`` for the daemon's platform (``Session.platform.name``: cpu,
cuda, tpu), sends the serialized StableHLO (portable VHLO bytecode) to the daemon to compile,
and keeps the :class:`tpubox.Executable`. Each call then executes it: leaves that are
:class:`tpubox.Tensor` s are used where they are (on the device), other leaves (NumPy arrays,
JAX arrays, Python scalars) are sent with the execution, in the same round trip (the session
API's ``Call``), and never become handles. Results come
back as ``tpubox.Tensor`` s in the function's output pytree, still on the device: feed them to
the next call, or bring them over with :func:`device_get` (or ``Tensor.numpy()``).

JAX itself only traces and lowers here (on the CPU, in the client process); it never touches
an accelerator. What cannot run this way is refused with :class:`tpubox.Unsupported`: effects
(host callbacks, ``jax.debug.print``, ordered effects) and symbolic shapes. Python scalars are
weakly typed, as in JAX; dtypes follow JAX's (float64 inputs become float32 unless
``jax_enable_x64`` is on).

**Several devices.** ``tpubox.jax.jit(f, in_shardings=..., out_shardings=...)`` takes JAX's
own ``NamedSharding`` s over a ``Mesh`` of the client's JAX CPU devices (give the client as
many as the mesh needs: ``jax.config.update("jax_num_cpu_devices", 4)`` before JAX starts),
and ``shard_map`` programs too: the function is exported for the mesh (``jax.export`` writes
its shardings and ``mhlo.num_partitions``) and compiled on the daemon over the session's first
N devices, mesh device i (the i-th of ``mesh.devices.flat``) running on ``session.devices[i]``.
Global arrays among the arguments are split by the program's input shardings on the daemon,
:class:`tpubox.ShardedTensor` s are used where they are, and the outputs come back as
ShardedTensors (``device_get`` gathers them). A mesh larger than the session's devices is
refused by the daemon (:class:`tpubox.PermissionDenied`, naming the first device the session
does not hold).

Needs the ``jax`` extra (``pip install 'tpubox[jax]'``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Hashable, Iterable, Sequence

import jax
import numpy as np
from jax import export as jax_export

from . import _dtypes, _export
from . import session as _session
from .errors import Internal, Unsupported
from .session import Executable, Session, ShardedTensor, Tensor

__all__ = [
    "jit",
    "JitFunction",
    "device_get",
    "device_put",
    "jax_platform",
    "export_model",
    "write_safetensors",
]

_LOCATIONS_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_source_locations() -> Any:
    """Exports inside this context carry no Python source locations (file names and lines;
    ``jax_traceback_in_locations_limit`` 0): a notebook cell's file name holds its kernel's
    process id, so with them the same cell in another kernel, or after a restart, would be
    another program and compile again. Op names (``loc("jit(f)/tanh")``) stay; they depend
    only on the function. The setting is process-wide, restored on exit."""
    with _LOCATIONS_LOCK:
        old = jax.config.jax_traceback_in_locations_limit
        jax.config.update("jax_traceback_in_locations_limit", 0)
        try:
            yield
        finally:
            jax.config.update("jax_traceback_in_locations_limit", old)


# PJRT platform names (what the daemon reports) -> jax.export platform names.
_PLATFORMS = {
    "cpu": "cpu",
    "host": "cpu",
    "cuda": "cuda",
    "gpu": "cuda",
    "rocm": "rocm",
    "tpu": "tpu",
}


def jax_platform(session: Session) -> str:
    """The ``jax.export`` platform name for SESSION's daemon (``cpu``, ``cuda``, ``rocm``,
    ``tpu``)."""
    name = session.platform.name.lower()
    return _PLATFORMS.get(name, name)


class _Entry:
    """One compiled signature: the Exported, its Executable, and how to call it."""

    __slots__ = ("exported", "executable", "kept", "in_dtypes", "donate")

    def __init__(
        self,
        exported: Any,
        executable: Executable,
        kept: tuple[int, ...],
        in_dtypes: list[np.dtype],
        donate: tuple[int, ...],
    ):
        self.exported = exported
        self.executable = executable
        self.kept = kept
        self.in_dtypes = in_dtypes
        self.donate = donate


def _leaf_spec(x: Any) -> tuple[Any, tuple[tuple[int, ...], np.dtype, bool]]:
    """(the leaf to send, (shape, dtype, weak_type)) of one input leaf."""
    if isinstance(x, (Tensor, ShardedTensor)):
        return x, (x.shape, x.dtype, False)
    if isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):
        # Python scalars are weakly typed in JAX: `x_f16 * 2.0` stays float16.
        dtype = jax.dtypes.canonicalize_dtype(np.asarray(x).dtype)
        return np.asarray(x, dtype=dtype), ((), dtype, True)
    try:
        a = np.asarray(x)
    except Exception as e:
        raise TypeError(f"tpubox.jax.jit: cannot pass a {type(x).__name__} ({e})") from None
    dtype = jax.dtypes.canonicalize_dtype(a.dtype)
    if a.dtype != dtype:
        a = a.astype(dtype)
    return a, (tuple(a.shape), dtype, False)


class JitFunction:
    """A function compiled for and run on the tpubox daemon (:func:`jit` makes one).

    Calling it returns the function's outputs as :class:`tpubox.Tensor` s, in the function's
    output pytree.

    Attributes:
        compiles: how many times it exported and compiled (once per new signature and
            session).
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        *,
        session: Session | None,
        static_argnums: Sequence[int],
        static_argnames: Sequence[str],
        donate_argnums: Sequence[int],
        in_shardings: Any = None,
        out_shardings: Any = None,
    ):
        self._fun = fun
        self._session = session
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        self._static_argnums = tuple(sorted(set(int(i) for i in static_argnums)))
        self._static_argnames = frozenset(static_argnames)
        self._donate_argnums = frozenset(int(i) for i in donate_argnums)
        self._cache: weakref.WeakKeyDictionary[Session, dict[Hashable, _Entry]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self.compiles = 0
        functools.update_wrapper(self, fun)

    # -- signatures -------------------------------------------------------------------------

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple, tuple, dict]:
        n = len(args)
        static_pos = tuple(sorted({i + n if i < 0 else i for i in self._static_argnums}))
        for i in static_pos:
            if not 0 <= i < n:
                raise TypeError(f"static_argnums names argument {i}, but {n} were given")
        statics = tuple((i, args[i]) for i in static_pos)
        dyn_positions = tuple(i for i in range(n) if i not in static_pos)
        dyn_args = tuple(args[i] for i in dyn_positions)
        static_kw = {k: v for k, v in kwargs.items() if k in self._static_argnames}
        dyn_kw = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        for v in (*(v for _, v in statics), *static_kw.values()):
            try:
                hash(v)
            except TypeError:
                raise TypeError(f"tpubox.jax.jit: static argument {v!r} is not hashable") from None
        return dyn_args, dyn_kw, statics, dyn_positions, static_kw

    def _entry(self, session: Session, args: tuple, kwargs: dict) -> tuple[_Entry, list[Any]]:
        dyn_args, dyn_kw, statics, dyn_positions, static_kw = self._split(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kw))
        sent = []
        specs = []
        for leaf in leaves:
            s, spec = _leaf_spec(leaf)
            sent.append(s)
            specs.append(spec)
        key = (
            treedef,
            tuple((shape, str(dtype), weak) for shape, dtype, weak in specs),
            statics,
            tuple(sorted(static_kw.items())),
            bool(jax.config.jax_enable_x64),  # type: ignore[attr-defined]
        )
        with self._lock:
            # Entries of closed sessions are dead (their executables went with them).
            for old in [s for s in self._cache if s.closed]:
                del self._cache[old]
            per_session = self._cache.setdefault(session, {})
            entry = per_session.get(key)
        if entry is None:
            entry = self._compile(session, treedef, specs, statics, static_kw, dyn_positions)
            with self._lock:
                per_session[key] = entry
        return entry, sent

    def _compile(
        self,
        session: Session,
        treedef: Any,
        specs: list[tuple[tuple[int, ...], np.dtype, bool]],
        statics: tuple,
        static_kw: dict,
        dyn_positions: tuple[int, ...],
    ) -> _Entry:
        fun = self._fun
        n_args = len(dyn_positions) + len(statics)

        def bound(dyn_args: tuple, dyn_kw: dict) -> Any:
            full: list[Any] = [None] * n_args
            for i, v in statics:
                full[i] = v
            for i, v in zip(dyn_positions, dyn_args):
                full[i] = v
            return fun(*full, **dyn_kw, **static_kw)

        sds = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in specs]
        dyn_args_sds, dyn_kw_sds = jax.tree_util.tree_unflatten(treedef, sds)
        platform = jax_platform(session)
        name = getattr(fun, "__name__", "function")
        sharded = self._in_shardings is not None or self._out_shardings is not None
        try:
            with _without_source_locations():
                if sharded:
                    # jax.jit's own in_shardings/out_shardings (positional arguments only, as
                    # in jax.jit); the flat leaves keep the order of (dyn_args, dyn_kw).
                    def positional(*a: Any, **k: Any) -> Any:
                        return bound(a, k)

                    kw: dict[str, Any] = {}
                    if self._in_shardings is not None:
                        kw["in_shardings"] = self._in_shardings
                        # The shardings in the arguments' types too, as a jax.Array's: a
                        # mesh of Explicit axes (make_mesh's default) types them.
                        dyn_args_sds = _with_shardings(self._in_shardings, dyn_args_sds)
                    if self._out_shardings is not None:
                        kw["out_shardings"] = self._out_shardings
                    exp = jax_export.export(jax.jit(positional, **kw), platforms=[platform])(
                        *dyn_args_sds, **dyn_kw_sds
                    )
                else:
                    exp = jax_export.export(jax.jit(bound), platforms=[platform])(
                        dyn_args_sds, dyn_kw_sds
                    )
        except NotImplementedError as e:
            raise Unsupported(
                "unsupported", f"tpubox.jax.jit({name}): jax.export cannot export it: {e}"
            ) from e
        self._check(exp, name, len(sds))
        in_dtypes = []
        for i, (aval, (shape, dtype, _)) in enumerate(zip(exp.in_avals, specs)):
            if tuple(aval.shape) != tuple(shape) or np.dtype(aval.dtype) != np.dtype(dtype):
                raise TypeError(
                    f"tpubox.jax.jit({name}): input leaf {i} is {np.dtype(dtype)}{list(shape)} "
                    f"but JAX traces it as {aval.str_short()} (a float64/int64/complex128 "
                    "tensor needs jax_enable_x64; or put it with the dtype JAX uses)"
                )
            in_dtypes.append(np.dtype(aval.dtype))
        n_devices = int(exp.nr_devices)
        if n_devices > 1:
            exe = session.compile(
                exp.mlir_module_serialized,
                format="bytecode",
                devices=_mesh_devices(session, n_devices),
            )
        else:
            exe = session.compile(exp.mlir_module_serialized, format="bytecode")
        kept = tuple(int(i) for i in exp.module_kept_var_idx)
        if len(exe.parameters) != len(kept) or len(exe.results) != len(exp.out_avals):
            exe.free()
            raise Internal(
                "internal",
                f"tpubox.jax.jit({name}): the daemon compiled {len(exe.parameters)} parameters "
                f"and {len(exe.results)} results; jax.export made {len(kept)} and "
                f"{len(exp.out_avals)}",
            )
        # Donated positional arguments -> positions among the kept leaves.
        donate: list[int] = []
        if self._donate_argnums:
            leaf_arg = _leaf_positions(treedef, dyn_positions)
            for j, leaf in enumerate(kept):
                if leaf_arg[leaf] in self._donate_argnums:
                    donate.append(j)
        self.compiles += 1
        return _Entry(exp, exe, kept, in_dtypes, tuple(donate))

    @staticmethod
    def _check(exp: Any, name: str, n_leaves: int) -> None:
        effects = tuple(exp.ordered_effects) + tuple(exp.unordered_effects)
        if effects:
            raise Unsupported(
                "unsupported",
                f"tpubox.jax.jit({name}): the function has effects {effects} (host callbacks, "
                "debug printing, ordered effects), which need the JAX runtime beside the device",
            )
        uses_constants = getattr(exp, "uses_global_constants", False)
        if callable(uses_constants):
            uses_constants = uses_constants()
        if uses_constants or any(
            not isinstance(d, (int, np.integer)) for a in exp.in_avals for d in a.shape
        ):
            raise Unsupported(
                "unsupported",
                f"tpubox.jax.jit({name}): the export has symbolic shapes or dimension arguments; "
                "call it with concrete shapes",
            )
        if len(exp.in_avals) != n_leaves:
            raise Internal(
                "internal",
                f"tpubox.jax.jit({name}): {n_leaves} input leaves but the export has "
                f"{len(exp.in_avals)}",
            )

    # -- calls ------------------------------------------------------------------------------

    def _session_for(self, session: Session | None) -> Session:
        return session or self._session or _session.default_session()

    def export(self, *args: Any, **kwargs: Any) -> Any:
        """The ``jax.export.Exported`` this function runs for ARGS (compiling it if this
        signature is new): for looking at ``mlir_module()``, ``in_avals``, ``out_avals``."""
        entry, _ = self._entry(self._session_for(None), args, kwargs)
        return entry.exported

    def executable(self, *args: Any, **kwargs: Any) -> Executable:
        """The :class:`tpubox.Executable` this function runs for ARGS (compiling it if new)."""
        entry, _ = self._entry(self._session_for(None), args, kwargs)
        return entry.executable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the function on the daemon's device; returns its outputs as Tensors in its
        output pytree.

        On the daemon's local socket a call that donates nothing is launched without waiting
        for the daemon's reply (as ``jax.jit`` dispatches asynchronously): what the daemon
        refuses or the device fails with is raised by the next read or wait of the session
        (``Tensor.numpy``, :meth:`tpubox.Session.wait_all`), naming the launch. Over gRPC,
        with launch blocking on, or with ``donate_argnums``, the call returns once the
        daemon ran it.

        Raises:
            tpubox.Unsupported: what cannot be exported for one device (see the module doc);
            TypeError: an input leaf that is not an array, or a dtype JAX changes;
            any error of :meth:`tpubox.Session.compile` or :class:`tpubox.Executable`.
        """
        session = self._session_for(None)
        entry, sent = self._entry(session, args, kwargs)
        exe = entry.executable
        spmd = exe.is_spmd
        call_args: list[Any] = []
        for j, i in enumerate(entry.kept):
            leaf = sent[i]
            if isinstance(leaf, (Tensor, ShardedTensor)):
                if leaf.session is not session and leaf.session.session_id != session.session_id:
                    raise ValueError(
                        f"tpubox.jax.jit: {leaf!r} belongs to session "
                        f"{leaf.session.session_id}, not {session.session_id}"
                    )
                if spmd and isinstance(leaf, ShardedTensor):
                    if (
                        leaf.sharding == exe.parameter_shardings[j]
                        and leaf.devices == exe.devices
                    ):
                        call_args.append(leaf)
                        continue
                    # Laid out otherwise: resharded through the host, as the program takes it.
                    call_args.append(leaf.numpy())
                elif spmd or isinstance(leaf, ShardedTensor):
                    call_args.append(leaf.numpy())  # the global array, split by the daemon
                else:
                    call_args.append(leaf)
            else:
                call_args.append(np.asarray(leaf, dtype=entry.in_dtypes[i]))
        outs = None
        if not spmd and not entry.donate:
            outs = session._launch_pipelined(
                exe,
                [
                    a if isinstance(a, Tensor) else _dtypes.as_device_array(a, None)
                    for a in call_args
                ],
                (),
            )
        if outs is None:
            outs = exe(*call_args, donate=entry.donate)
        if spmd:
            # The daemon's global shape is the per-device shape times the tiles; where the
            # tiles do not divide a dimension, JAX's is smaller (the shards are the same).
            for o, aval in zip(outs, entry.exported.out_avals):
                if isinstance(o, ShardedTensor) and o.shape != tuple(aval.shape):
                    o.shape = tuple(int(d) for d in aval.shape)
                    o.nbytes = int(np.prod(o.shape, dtype=np.int64)) * o.dtype.itemsize
        return jax.tree_util.tree_unflatten(entry.exported.out_tree, outs)

    def clear_cache(self) -> None:
        """Frees every executable compiled so far; the next call compiles again."""
        with self._lock:
            entries = [e for d in self._cache.values() for e in d.values()]
            self._cache.clear()
        for e in entries:
            try:
                e.executable.free()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"tpubox.jax.jit({getattr(self._fun, '__name__', self._fun)!r})"


def _with_shardings(in_shardings: Any, args: tuple) -> tuple:
    """ARGS (a tuple of pytrees of ``ShapeDtypeStruct``) with the shardings of IN_SHARDINGS (a
    sharding, or a pytree prefix of ARGS with shardings or None) in their leaves; ARGS as they
    are when the structures do not match (``jax.jit`` then says why)."""
    is_sharding = lambda x: x is None or isinstance(x, jax.sharding.Sharding)  # noqa: E731

    def attach(sh: Any, sub: Any) -> Any:
        if sh is None:
            return sub
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type, sharding=sh),
            sub,
        )

    try:
        if is_sharding(in_shardings):
            return tuple(attach(in_shardings, a) for a in args)
        prefix = tuple(in_shardings) if isinstance(in_shardings, list) else in_shardings
        return tuple(jax.tree_util.tree_map(attach, prefix, tuple(args), is_leaf=is_sharding))
    except (ValueError, TypeError):
        return args


def _mesh_devices(session: Session, n: int) -> list[int]:
    """The session devices a program over N devices is compiled for: the session's first N,
    logical (mesh) device i on ``session.devices[i]``. A session with fewer gets the host's
    other devices after its own, which the daemon refuses (PermissionDenied, naming the first
    the session does not hold), or indices past the host's (InvalidArgument, NotFound)."""
    devs = list(session.devices)
    if len(devs) >= n:
        return devs[:n]
    others = [d.index for d in session.platform.devices if d.index not in devs]
    devs += others[: n - len(devs)]
    nxt = max([*devs, len(session.platform.devices) - 1]) + 1
    while len(devs) < n:
        devs.append(nxt)
        nxt += 1
    return devs


def _hlo_sharding(sharding: Any, ndim: int) -> str:
    """XLA's text form of a JAX sharding (``NamedSharding``, ``PositionalSharding``...) of an
    array of NDIM dims; its device numbers are positions in the sharding's device
    assignment (the mesh's ``devices.flat``)."""
    to_xla = getattr(sharding, "_to_xla_hlo_sharding", None)
    if to_xla is None:
        raise TypeError(f"tpubox.jax: {sharding!r} is not a JAX sharding")
    return str(to_xla(ndim))


def _leaf_positions(treedef: Any, dyn_positions: tuple[int, ...]) -> list[int]:
    """For each flat leaf of (dyn_args, dyn_kw): the positional argument it came from (-1 for
    keyword arguments)."""
    (args_def, kw_def) = treedef.children()
    out: list[int] = []
    for pos, child in zip(dyn_positions, args_def.children()):
        out.extend([pos] * child.num_leaves)
    out.extend([-1] * kw_def.num_leaves)
    return out


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    session: Session | None = None,
    static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (),
    donate_argnums: int | Iterable[int] = (),
    in_shardings: Any = None,
    out_shardings: Any = None,
) -> Any:
    """Compiles FUN for the tpubox daemon's device, like ``jax.jit``.

    Usable as ``tpubox.jax.jit(f)``, ``@tpubox.jax.jit`` or ``@tpubox.jax.jit(session=s)``.

    Args:
        fun: the function: JAX-traceable, taking and returning pytrees of arrays.
        session: the session to run in (default: :func:`tpubox.default_session` at each call,
            i.e. the last one connected, or the kernel's).
        static_argnums, static_argnames: arguments that are Python values, part of the
            signature (hashable), as in ``jax.jit``.
        donate_argnums: positional arguments whose tensors are donated to the execution (their
            device memory may be reused; the Tensors cannot be used again).
        in_shardings, out_shardings: as in ``jax.jit``: JAX shardings (``NamedSharding`` over
            a ``Mesh`` of the client's JAX CPU devices), one per positional argument
            (pytree prefixes; not with keyword arguments, as in JAX) and per output. The
            program then runs on the session's first ``mesh.size`` devices, mesh device i on
            ``session.devices[i]``; a ``shard_map`` over a mesh of ``AxisType.Auto`` axes
            needs none of them (its mesh says the devices; over ``make_mesh``'s default
            Explicit axes, give ``in_shardings``, which also type the arguments). Global arrays are split by the daemon, and the outputs are
            :class:`tpubox.ShardedTensor` s (global shape and dtype as JAX's).

    Returns:
        A :class:`JitFunction`: calling it returns the outputs as :class:`tpubox.Tensor` s
        (:class:`tpubox.ShardedTensor` s for a program over several devices).

    Raises (at the first call):
        tpubox.PermissionDenied: a mesh larger than the session's devices.
    """
    as_tuple = lambda v: (v,) if isinstance(v, (int, str)) else tuple(v)  # noqa: E731
    if fun is None:
        return functools.partial(
            jit,
            session=session,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
        )
    return JitFunction(
        fun,
        session=session,
        static_argnums=as_tuple(static_argnums),
        static_argnames=as_tuple(static_argnames),
        donate_argnums=as_tuple(donate_argnums),
        in_shardings=in_shardings,
        out_shardings=out_shardings,
    )


def device_get(tree: Any) -> Any:
    """TREE with every :class:`tpubox.Tensor` and :class:`tpubox.ShardedTensor` leaf replaced
    by its NumPy array (a sharded one gathered; other leaves as they are)."""
    return jax.tree_util.tree_map(
        lambda x: x.numpy() if isinstance(x, (Tensor, ShardedTensor)) else x, tree
    )


def device_put(tree: Any, session: Session | None = None, sharding: Any = None) -> Any:
    """TREE with every array leaf put on the daemon's device as a :class:`tpubox.Tensor`
    (Tensors stay as they are), in SESSION (default :func:`tpubox.default_session`). Leaves
    take the dtypes JAX would give them (float64 becomes float32 unless ``jax_enable_x64``).

    With SHARDING (a JAX sharding such as ``NamedSharding(mesh, P("x"))``, or a pytree prefix
    of them), each leaf becomes a :class:`tpubox.ShardedTensor` laid out as
    ``jax.device_put(x, sharding)`` lays it out on the client's devices, on the session's
    devices instead (mesh device i on ``session.devices[i]``).

    Raises:
        tpubox.PermissionDenied: a mesh larger than the session's devices; as
        :meth:`tpubox.Session.put_sharded`.
    """
    s = session or _session.default_session()

    def put(x: Any) -> Any:
        if isinstance(x, (Tensor, ShardedTensor)):
            return x
        a, _ = _leaf_spec(x)
        return s.tensor(a)

    if sharding is None:
        return jax.tree_util.tree_map(put, tree)

    def put_sharded(sh: Any, sub: Any) -> Any:
        def one(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                return x
            if isinstance(x, Tensor):
                x = x.numpy()
            a, _ = _leaf_spec(x)
            n = len(getattr(sh, "_device_assignment", ())) or None
            devices = _mesh_devices(s, n) if n else None
            return s.put_sharded(a, _hlo_sharding(sh, a.ndim), devices=devices)

        return jax.tree_util.tree_map(one, sub)

    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    if is_sharding(sharding):
        return put_sharded(sharding, tree)
    return jax.tree_util.tree_map(put_sharded, sharding, tree, is_leaf=is_sharding)


# ---------------------------------------------------------------------------------------------
# Exporting a model for `tpubox serve`'s model repository (docs/SERVING.md, "StableHLO models").

def _export_dtype(dtype: Any, what: str) -> tuple[str, str]:
    return _export.export_dtype(dtype, what, "tpubox.jax.export_model")


def _path_name(path: Any) -> str:
    """A weight's name from its pytree path: keys joined by '/' (``dense1/w``, ``layers/0/b``)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts) or "param"


def write_safetensors(path: Any, tensors: dict[str, np.ndarray]) -> None:
    """Writes TENSORS (name -> array) to PATH in the safetensors format (little-endian, C
    order, names sorted), with NumPy only."""
    _export.write_safetensors(path, tensors, "tpubox.jax.export_model")


def export_model(
    fn: Callable[..., Any],
    params: Any,
    example_args: Sequence[Any],
    repo: Any,
    name: str,
    batch_sizes: Sequence[int] | None = (1, 2, 4, 8),
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    platform: str = "cpu",
    instance_count: int = 1,
    max_queue_delay_microseconds: int = 1000,
    dynamic_batching: bool = True,
) -> Any:
    """Exports ``fn(params, *args)`` as a StableHLO model that ``tpubox serve`` serves from the
    model repository REPO without a guest: writes ``REPO/NAME/`` with one program per batch
    size (``model.b{N}.mlirbc``: ``jax.export``'s portable VHLO bytecode), the weights
    (``weights.safetensors``, one tensor per leaf of PARAMS, named by its path: ``dense1/w``)
    and ``config.toml`` (Triton's field names, and the ``[tpubox.stablehlo]`` table mapping
    the programs' parameters to weights and inputs, their results to outputs).

    Args:
        fn: JAX-traceable, ``fn(params, *args)``; returns an array, a tuple/list of arrays or a
            dict of arrays (the dict's keys name the outputs). Every output has the batch
            dimension first when BATCH_SIZES is given.
        params: a pytree of arrays: the weights, shared by every request.
        example_args: one array (or ``jax.ShapeDtypeStruct``) per input, batch dimension
            first; only their shapes after the batch dimension and dtypes are used (float64
            becomes float32 unless ``jax_enable_x64``). With ``batch_sizes=None`` the shapes
            are exported as they are, for a model without a batch dimension.
        repo: the model repository directory (created if missing).
        name: the model's name, its directory under REPO (must not exist yet, or be empty).
        batch_sizes: the batch sizes to export a program for (the buckets a merged batch is
            padded up to); the largest is the model's ``max_batch_size``. ``None``: no batch
            dimension (``max_batch_size = 0``, one program).
        input_names: the inputs' names (default ``input_0``, ``input_1``, ...).
        output_names: the outputs' names for a tuple/list or single result (default
            ``output_0``, ...); a dict result uses its keys.
        platform: the ``jax.export`` platform of the serving device: ``cpu``, ``cuda``,
            ``tpu``.
        instance_count: instances of the model (``[[instance_group]] count``).
        max_queue_delay_microseconds: how long a request waits for others to batch with.
        dynamic_batching: write a ``[dynamic_batching]`` table (batching models only).

    Returns:
        The model directory (a ``pathlib.Path``).

    Raises:
        ValueError: a bad name, batch size, argument count, an existing non-empty directory,
            an output without the batch dimension.
        tpubox.Unsupported: a dtype the protocol lacks, effects, more than one device.
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"tpubox.jax.export_model: {name!r} cannot name a model directory")
    batched = batch_sizes is not None
    sizes = sorted({int(b) for b in batch_sizes}) if batched else [None]
    if batched and (not sizes or sizes[0] < 1):
        raise ValueError("tpubox.jax.export_model: batch sizes must be at least 1")
    example_args = list(example_args)
    if input_names is None:
        input_names = [f"input_{i}" for i in range(len(example_args))]
    in_names = list(input_names)
    if len(in_names) != len(example_args):
        raise ValueError(
            f"tpubox.jax.export_model: {len(in_names)} input names for "
            f"{len(example_args)} example args"
        )
    if len(set(in_names)) != len(in_names):
        raise ValueError("tpubox.jax.export_model: input names repeat")
    leaves_with_path, params_def = jax.tree_util.tree_flatten_with_path(params)
    weight_names = [_path_name(p) for p, _ in leaves_with_path]
    if len(set(weight_names)) != len(weight_names):
        raise ValueError(f"tpubox.jax.export_model: two weights have the same name: {weight_names}")
    weight_leaves = [np.asarray(leaf) for _, leaf in leaves_with_path]
    n_w = len(weight_leaves)

    out_keys: list[str] | None = None
    out_def_holder: list[Any] = []

    def flat_fn(*flat: Any) -> Any:
        p = jax.tree_util.tree_unflatten(params_def, flat[:n_w])
        out = fn(p, *flat[n_w:])
        if isinstance(out, dict):
            keys = sorted(out)
            out_def_holder.append(keys)
            return tuple(out[k] for k in keys)
        if isinstance(out, (tuple, list)):
            out_def_holder.append(len(out))
            return tuple(out)
        out_def_holder.append(None)
        return (out,)

    def arg_spec(x: Any, b: int | None) -> Any:
        shape = tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        if b is not None:
            if not shape:
                raise ValueError(
                    "tpubox.jax.export_model: an example arg without a batch dimension"
                )
            shape = (b,) + shape[1:]
        return jax.ShapeDtypeStruct(shape, dtype)

    w_specs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weight_leaves]
    exports = []
    for b in sizes:
        exp = jax_export.export(jax.jit(flat_fn, keep_unused=True), platforms=[platform])(
            *w_specs, *[arg_spec(x, b) for x in example_args]
        )
        if exp.ordered_effects or exp.unordered_effects:
            raise Unsupported(
                "unsupported",
                "tpubox.jax.export_model: the function has effects (callbacks, prints)",
            )
        if exp.nr_devices != 1:
            raise Unsupported(
                "unsupported", "tpubox.jax.export_model: the function uses more than one device"
            )
        if len(exp.in_avals) != n_w + len(example_args):
            raise Internal(
                "internal",
                "tpubox.jax.export_model: jax.export dropped parameters despite keep_unused",
            )
        exports.append((b, exp))

    shape_kind = out_def_holder[0]
    if isinstance(shape_kind, list):
        out_names = list(shape_kind)
    else:
        n_out = len(exports[0][1].out_avals)
        if output_names is None:
            output_names = [f"output_{i}" for i in range(n_out)]
        out_names = list(output_names)
        if len(out_names) != n_out:
            raise ValueError(
                f"tpubox.jax.export_model: {len(out_names)} output names for {n_out} outputs"
            )

    def dims(aval: Any, b: int | None, what: str) -> list[int]:
        return _export.unbatched_dims(aval.shape, b, what, "tpubox.jax.export_model")

    b0, exp0 = exports[0]
    in_avals = exp0.in_avals[n_w:]
    inputs = [
        (n, _export_dtype(a.dtype, f"input {n!r}")[1], dims(a, b0, f"input {n!r}"))
        for n, a in zip(in_names, in_avals)
    ]
    outputs = [
        (n, _export_dtype(a.dtype, f"output {n!r}")[1], dims(a, b0, f"output {n!r}"))
        for n, a in zip(out_names, exp0.out_avals)
    ]
    for b, exp in exports[1:]:
        for n, a in zip(out_names, exp.out_avals):
            dims(a, b, f"output {n!r}")

    model_dir = _export.check_model_dir(repo, name, "tpubox.jax.export_model")
    weight_dtypes = [a.dtype for a in exp0.in_avals[:n_w]]
    write_safetensors(
        model_dir / "weights.safetensors",
        {n: np.asarray(w, dtype=d) for n, w, d in zip(weight_names, weight_leaves, weight_dtypes)},
    )
    programs = []
    for b, exp in exports:
        file = f"model.b{b}.mlirbc" if b is not None else "model.mlirbc"
        (model_dir / file).write_bytes(bytes(exp.mlir_module_serialized))
        programs.append((b, file))
    config = _export.config_toml(
        writer="tpubox.jax.export_model",
        name=name,
        max_batch_size=sizes[-1] if batched else 0,
        inputs=inputs,
        outputs=outputs,
        weight_names=weight_names,
        programs=programs,
        instance_count=instance_count,
        max_queue_delay_microseconds=(
            max_queue_delay_microseconds if batched and dynamic_batching else None
        ),
    )
    (model_dir / "config.toml").write_text(config)
    return model_dir
