"""Eager PyTorch tensors on the tpubox daemon's device, in TorchTPU's eager modes.

``x.to(tpubox.torch.device())`` (or ``x.to("tpubox")``, ``torch.zeros(3, device="tpubox")``,
``model.to("tpubox")``) gives tensors whose data lives on the daemon's device, in a session
(:func:`tpubox.default_session`, or the one given to :func:`device`). Ordinary PyTorch code runs
on them: each ATen op (forward, autograd's backward ops, the optimizer's in-place updates) is
lowered to StableHLO by torch-mlir, compiled once per op, attributes and operand specs, and run
in the session. Values come back to the host on ``.cpu()``, ``.item()``, ``.numpy()``,
``.tolist()`` and printing.

Modes (:class:`EagerMode`, TorchTPU's names):

- ``DEFER_NEVER`` (default): each op is launched at once (:meth:`tpubox.Executable.launch`,
  asynchronous: the next op is queued while the device works).
- ``DEFER_AND_FUSE`` (``TPUBOX_DEFER_AND_FUSE=1``): ops are recorded into a graph; the graph
  runs as one program (compiled once per graph structure) when a value is read, an op of
  another mode or the CPU needs a pending value, :func:`mark_step` is called, or the graph
  reaches :func:`max_fused_ops` ops.
- ``DEFER_NEVER_AND_LAUNCH_BLOCKING`` (``TPUBOX_LAUNCH_BLOCKING=1``, which wins): as
  ``DEFER_NEVER``, but each op waits for the device, so a device error is the op's own.

:func:`set_eager_mode` sets the mode (for a block: ``with set_eager_mode(mode):``), in this
process; :func:`eager_mode` says which mode is in force.

Ops without a lowering (torch-mlir cannot lower them, the daemon refuses the program, e.g. the
random ops whose lowering holds a custom call, or data-dependent shapes such as ``nonzero``) run
on the CPU: their operands are copied to the host, the op runs in PyTorch and its results are
put back, with a :class:`CpuFallbackWarning` naming the op (once per op).

Aliasing: a view (``x.t()``, ``x[0]``, ``x.detach()``) is computed on the device and reads its
base again after the base changed in place; an in-place op on a view (``x[0] = 1``) rewrites
its base through a functionalized program. Ops that change a tensor's metadata in place
(``resize_``, ``set_``, ``as_strided_``) are not supported.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import session as _session
from .._dtypes import as_device_array
from ..errors import ResourceExhausted, TpuboxError
from ..session import Session, Tensor
from ._lowering import (
    CpuFallbackWarning,
    _decompositions,
    _fell_back,
    _forget_fallbacks,
    _from_numpy,
    _op_name,
    _Options,
    _Program,
    _to_numpy,
    cpu_fallback_ops,
    current_precision,
)
from ._lowering import (
    _count as backend_count,
)

__all__ = [
    "EagerMode",
    "eager_mode",
    "set_eager_mode",
    "device",
    "DEVICE_TYPE",
    "mark_step",
    "max_fused_ops",
    "set_max_fused_ops",
    "eager_stats",
    "reset_eager_stats",
    "cpu_fallback_ops",
    "CpuFallbackWarning",
    "is_device_tensor",
]

#: The device type name of eager device tensors (PyTorch's PrivateUse1 backend, renamed).
DEVICE_TYPE = "tpubox"

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# Modes


class EagerMode(enum.Enum):
    """TorchTPU's eager modes (``torch.tpu.EagerMode``)."""

    #: Each op launched at once (asynchronously); the default.
    DEFER_NEVER = "DEFER_NEVER"
    #: Ops recorded into a graph, run as one program when a value is needed.
    DEFER_AND_FUSE = "DEFER_AND_FUSE"
    #: As DEFER_NEVER, but each op waits for the device (its error is its own).
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "DEFER_NEVER_AND_LAUNCH_BLOCKING"


ENV_DEFER_AND_FUSE = "TPUBOX_DEFER_AND_FUSE"
ENV_LAUNCH_BLOCKING = _session.ENV_LAUNCH_BLOCKING  # "TPUBOX_LAUNCH_BLOCKING"

# The mode and the pending graph are the process's, not a thread's: autograd runs the backward
# ops of device tensors in a thread of its own.
_MODES: list[EagerMode] = []
_GLOBAL = threading.RLock()


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_mode() -> EagerMode:
    if _env_on(ENV_LAUNCH_BLOCKING):
        return EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    if _env_on(ENV_DEFER_AND_FUSE):
        return EagerMode.DEFER_AND_FUSE
    return EagerMode.DEFER_NEVER


def _as_mode(mode: Any) -> EagerMode:
    if isinstance(mode, EagerMode):
        return mode
    if isinstance(mode, str) and mode.strip().upper() in EagerMode.__members__:
        return EagerMode[mode.strip().upper()]
    raise ValueError(f"eager mode must be a tpubox.torch.EagerMode or its name, not {mode!r}")


def eager_mode() -> EagerMode:
    """The mode ops run in now: the innermost :func:`set_eager_mode` still in
    force, else the environment's (``TPUBOX_LAUNCH_BLOCKING=1`` gives
    DEFER_NEVER_AND_LAUNCH_BLOCKING, else ``TPUBOX_DEFER_AND_FUSE=1`` gives DEFER_AND_FUSE, else
    DEFER_NEVER)."""
    stack = _MODES
    if stack:
        return stack[-1]
    return _env_mode()


class set_eager_mode(contextlib.AbstractContextManager):  # noqa: N801 (TorchTPU's name)
    """Sets this process's eager mode to MODE (an :class:`EagerMode` or its name), TorchTPU's
    ``torch.tpu.set_eager_mode``. As a context manager (``with set_eager_mode(m):``) the mode
    before is restored at the end of the block; blocks nest. Called alone, the mode stays.

    Leaving DEFER_AND_FUSE (at the end of the block, or by another mode) runs the pending graph
    (:func:`mark_step`); values stay usable across modes either way."""

    def __init__(self, mode: EagerMode | str):
        self.mode = _as_mode(mode)
        stack = _MODES
        before = eager_mode()
        stack.append(self.mode)
        self._depth = len(stack)
        if before is EagerMode.DEFER_AND_FUSE and self.mode is not EagerMode.DEFER_AND_FUSE:
            mark_step()

    def __enter__(self) -> EagerMode:
        return self.mode

    def __exit__(self, *exc: object) -> None:
        del _MODES[self._depth - 1 :]
        if self.mode is EagerMode.DEFER_AND_FUSE and eager_mode() is not EagerMode.DEFER_AND_FUSE:
            mark_step()


# ---------------------------------------------------------------------------------------------
# Statistics and warnings


_STATS_LOCK = threading.Lock()
_STATS: dict[str, int] = {}
_STAT_NAMES = (
    "ops",  # ATen ops dispatched on device tensors
    "launches",  # programs launched (one per op in DEFER_NEVER, one per graph when fused)
    "compiles",  # programs compiled (Session.compile calls)
    "op_cache_hits",  # ops whose program was already compiled
    "fused_graphs",  # fused graphs run (DEFER_AND_FUSE)
    "fused_ops",  # ops recorded into fused graphs
    "cpu_fallbacks",  # ops run on the CPU
    "puts",  # host tensors put on the device
    "fetches",  # device values read back to the host
)


def _count(name: str, n: int = 1) -> None:
    with _STATS_LOCK:
        _STATS[name] = _STATS.get(name, 0) + n


def eager_stats() -> dict[str, int]:
    """Counters of eager device tensors in this process since :func:`reset_eager_stats`:
    ``ops``, ``launches``, ``compiles``, ``op_cache_hits``, ``fused_graphs``, ``fused_ops``,
    ``cpu_fallbacks``, ``puts``, ``fetches``."""
    with _STATS_LOCK:
        return {k: _STATS.get(k, 0) for k in _STAT_NAMES}


def reset_eager_stats() -> None:
    """Sets every counter of :func:`eager_stats` to zero and forgets :func:`cpu_fallback_ops`."""
    with _STATS_LOCK:
        _STATS.clear()
    _forget_fallbacks()


def _warn_fallback(func: Any, why: str) -> None:
    name = _op_name(func)
    _count("cpu_fallbacks")
    _fell_back(
        name,
        f"tpubox.torch eager: {name} has no lowering to the device ({why}); it runs on the "
        "CPU (operands copied to the host, results put back)",
        stacklevel=3,
    )


# ---------------------------------------------------------------------------------------------
# The session


_SESSION: Session | None = None


def _current_session() -> Session:
    s = _SESSION
    if s is not None and not s.closed:
        return s
    return _session.default_session()


def device(index: int = 0, *, session: Session | None = None) -> torch.device:
    """The PyTorch device of tensors on the tpubox daemon: ``torch.device("tpubox", INDEX)``.
    ``x.to(tpubox.torch.device())`` puts X there; ops on such tensors run in the session
    (SESSION when given, which is kept for later calls, else :func:`tpubox.default_session`)."""
    global _SESSION
    _register()
    if session is not None:
        _SESSION = session
    if index != 0:
        raise ValueError("tpubox.torch.device: only device index 0 is supported")
    return torch.device(DEVICE_TYPE, index)


def is_device_tensor(t: Any) -> bool:
    """Whether T is an eager tensor on the tpubox device."""
    return isinstance(t, DeviceTensor)


# ---------------------------------------------------------------------------------------------
# Values: what a device tensor holds


class _Pending:
    """A value still in a fused graph (DEFER_AND_FUSE): output OUT of record REC of TRACE."""

    __slots__ = ("trace", "rec", "out", "resolved", "__weakref__")

    def __init__(self, trace: "_Trace", rec: int, out: int):
        self.trace = trace
        self.rec = rec
        self.out = out
        self.resolved: Tensor | None = None


class _Root:
    """A tensor's storage on the device: its current value (a tpubox Tensor, a _Pending, or
    None while uninitialised), its spec and a version moved by every in-place write."""

    __slots__ = ("value", "version", "spec")

    def __init__(self, value: Any, spec: tuple):
        self.value = value
        self.version = 0
        self.spec = spec  # (shape, stride, dtype)


class _State:
    """What a DeviceTensor is: its root and the chain of view ops from the root to it (empty
    for the root itself), with the value computed for the root's version CACHE_VERSION."""

    __slots__ = ("root", "chain", "cache", "cache_version")

    def __init__(self, root: _Root, chain: tuple = (), cache: Any = None, version: int = -1):
        self.root = root
        self.chain = chain
        self.cache = cache
        self.cache_version = version


def _spec_of(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype)


class DeviceTensor(torch.Tensor):
    """A tensor whose data lives on the tpubox daemon's device (see the module doc)."""

    _tb: _State

    @staticmethod
    def __new__(cls, state: _State, spec: tuple) -> "DeviceTensor":
        shape, stride, dtype = spec
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, dtype=dtype, device=_DEVICE, requires_grad=False
        )
        r._tb = state
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        return _dispatch(func, args, kwargs or {})

    # Host reads -------------------------------------------------------------------------

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        with torch.no_grad():
            host = _to_host(self)
        text = repr(host)
        extra = f", device='{self.device}'"
        if self.requires_grad and self.grad_fn is None:
            extra += ", requires_grad=True"
        elif self.grad_fn is not None:
            extra += f", grad_fn=<{type(self.grad_fn).__name__}>"
        return text[:-1] + extra + ")" if text.endswith(")") else text

    __str__ = __repr__  # type: ignore[assignment]

    def numpy(self, *, force: bool = False) -> np.ndarray:  # type: ignore[override]
        if self.requires_grad and not force:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy()"
            )
        return _to_host(self).numpy()

    def tolist(self) -> Any:  # type: ignore[override]
        return _to_host(self).tolist()

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec) if not spec else repr(self).__format__(spec)

    # `.data` -----------------------------------------------------------------------------

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        """The tensor without autograd history (PyTorch's ``.data``), sharing the value."""
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # PyTorch's set_data swaps the metadata (shape, dtype) only; the device value is the
        # Python state, which follows (shared, as `.data =` shares storage).
        torch._C.TensorBase.data.__set__(self, new)
        if isinstance(new, DeviceTensor):
            self._tb = new._tb

    # Copies and pickles ----------------------------------------------------------------

    def __deepcopy__(self, memo: dict) -> "DeviceTensor":
        if id(self) in memo:
            return memo[id(self)]
        import copy

        spec = _spec_of(self)
        with torch.no_grad():
            new = DeviceTensor(_State(_Root(_value(self), spec)), spec)
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k != "_tb":
                setattr(new, k, copy.deepcopy(v, memo))
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        return new

    def __reduce_ex__(self, proto: Any) -> Any:
        # Pickled (torch.save) as its values, put on the device again when loaded: PyTorch's
        # way for devices without storage.
        with torch.no_grad():
            host = _to_host(self)
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (host, self.dtype, str(self.device), self.requires_grad),
        )

    # The traceable-wrapper protocol, so that `module.to(dtype)` and friends swap parameters
    # (torch.utils.swap_tensors) rather than set `.data`, which would keep the old values, and
    # so that TorchDynamo traces a model whose parameters and inputs are device tensors into
    # one graph: each is faked as a plain fake tensor of its spec on the tpubox device
    # (`__tensor_unflatten__` under a fake mode), guarded on its spec only
    # (`__metadata_guard__`), never on its value; the compiled programs get the device tensors
    # themselves at run time (tpubox.torch's backend passes their device values).
    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return [], (_StateRef(self._tb), _spec_of(self))

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        ref, spec = ctx
        fake_mode = torch._guards.detect_fake_mode()
        if fake_mode is not None:
            shape, stride, dtype = spec
            with fake_mode:
                return torch.empty_strided(
                    tuple(outer_size) if outer_size is not None else shape,
                    tuple(outer_stride) if outer_stride is not None else stride,
                    dtype=dtype,
                    device=_DEVICE,
                )
        return DeviceTensor(ref.state, spec)

    @classmethod
    def __metadata_guard__(cls, orig: Any, other: Any) -> bool:
        """Dynamo's guard on a device tensor's flatten context: the same spec (its value may
        change between calls, as parameters' do after an optimizer step)."""
        return bool(orig[1] == other[1])

    def __coerce_same_metadata_as_tangent__(
        self, expected_metadata: Any, expected_type: Any = None
    ) -> Any:
        """aot_autograd's hook for a tangent (the gradient flowing into a compiled backward)
        of another type than it traced: a device tensor, where the trace had a plain fake
        tensor. The same device value, as a tensor aot_autograd passes through unflattened."""
        # Contiguous already, so that aot_autograd's memory-format coercion keeps this object.
        t = self if self.is_contiguous() else self.contiguous()
        return _Tangent(t._tb, _spec_of(t))


class _Tangent(DeviceTensor):
    """A device tensor handed to a compiled backward program: without the traceable-wrapper
    protocol on the instance (``__tensor_flatten__`` raises AttributeError), so aot_autograd
    passes it to the program as it is. Ops on it give plain device tensors."""

    @property
    def __tensor_flatten__(self) -> Any:  # type: ignore[override]
        raise AttributeError("__tensor_flatten__")


class _StateRef:
    """A device tensor's state inside its flatten context: deep copies (Dynamo copies guard
    metadata) share it rather than copy device values."""

    __slots__ = ("state",)

    def __init__(self, state: _State):
        self.state = state

    def __deepcopy__(self, memo: dict) -> "_StateRef":
        return self


def _fake_of(t: "DeviceTensor", fake_mode: Any) -> torch.Tensor:
    """A plain fake tensor of T's spec and ``requires_grad`` on the tpubox device, in
    FAKE_MODE: how traces (Dynamo's, aot_autograd's) see a device tensor."""
    shape, stride, dtype = _spec_of(t)
    with fake_mode:
        return torch.empty_strided(
            shape, stride, dtype=dtype, device=_DEVICE, requires_grad=t.requires_grad
        )


_DEVICE: torch.device = None  # type: ignore[assignment]  # set by _register()


def _wrap(value: Any, spec: tuple) -> DeviceTensor:
    root = _Root(value, spec)
    return DeviceTensor(_State(root), spec)


def _concrete(v: Any) -> Any:
    """V as a tpubox Tensor (a fused graph pending V runs first); NumPy arrays pass."""
    if isinstance(v, _Pending):
        if v.resolved is None:
            v.trace.flush()
        if v.resolved is None:
            if v.trace.error is not None:
                raise v.trace.error
            raise TpuboxError("internal", "tpubox.torch eager: a pending value was not computed")
        return v.resolved
    return v


def _root_value(root: _Root) -> Any:
    if root.value is None:
        shape, _, dtype = root.spec
        root.value = _put(torch.zeros(shape, dtype=dtype))
    return root.value


def _value(t: DeviceTensor) -> Any:
    """T's current value (a tpubox Tensor or a _Pending): a view is recomputed from its root
    when the root changed since."""
    st = t._tb
    if not st.chain:
        return _root_value(st.root)
    if st.cache is None or st.cache_version != st.root.version:
        version = st.root.version
        st.cache = _run_chain(st.root, st.chain)
        st.cache_version = version
    return st.cache


def _put(host: torch.Tensor) -> Tensor:

    _count("puts")
    return _current_session().tensor(_to_numpy(host))


def _fetch(v: Any) -> torch.Tensor:

    t = _concrete(v)
    _count("fetches")
    if isinstance(t, np.ndarray):
        return _from_numpy(t.copy())
    return _from_numpy(np.asarray(t.numpy()))


def _to_host(t: DeviceTensor) -> torch.Tensor:
    """T's values as a new CPU tensor (of T's shape and dtype; contiguous)."""
    host = _fetch(_value(t))
    shape, _, dtype = _spec_of(t)
    if host.dtype != dtype:
        host = host.to(dtype)
    return host.reshape(shape)


# ---------------------------------------------------------------------------------------------
# Keys


def _const_key(x: Any) -> Any:
    if isinstance(x, float):
        return ("f", repr(x))
    if isinstance(x, (bool, int, str, type(None), torch.dtype, torch.memory_format, torch.layout)):
        return (type(x).__name__, x)
    if isinstance(x, torch.device):
        return ("device", str(x))
    if isinstance(x, complex):
        return ("c", repr(x))
    raise _NotKeyable(type(x).__name__)


class _NotKeyable(Exception):
    pass


def _host_device(x: Any) -> Any:
    if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
        return torch.device("cpu")
    if isinstance(x, str) and x.split(":")[0] == DEVICE_TYPE:
        return "cpu"
    return x


# ---------------------------------------------------------------------------------------------
# Ops: each (op, attributes, operand specs) traced once into a function of device values


class _Unlowerable(Exception):
    pass


class _OpInfo:
    """One op call's shape: the function of its inputs' values that gives the new values of
    the roots it writes, then its results (new tensors and views), traced once."""

    def __init__(
        self,
        key: Any,
        name: str,
        fn: Callable[..., tuple],
        in_specs: list[tuple],
        mutating: bool,
    ):
        self.key = key
        self.name = name
        self.fn = fn
        self.in_specs = in_specs
        self.mutating = mutating
        self.unsupported: str | None = None
        self._gm: Any = None
        self._prog: Any = None
        self.out_specs: list[tuple] = []
        self.ret_tree: Any = None
        self.ret_plan: list[Any] = []
        self._lock = threading.Lock()
        self._exes: weakref.WeakKeyDictionary[Session, dict[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )

    def examples(self) -> list[torch.Tensor]:
        return [torch.empty_strided(s, st, dtype=d) for s, st, d in self.in_specs]

    def gm(self) -> Any:
        """The op's ATen graph (decomposed with torch-mlir's table, functionalized)."""
        if self._gm is None:
            from torch.fx.experimental.proxy_tensor import make_fx


            fn = self.fn
            if self.mutating:
                fn = torch.func.functionalize(fn, remove="mutations")
            def trace() -> Any:
                return make_fx(fn, decomposition_table=_decompositions(), tracing_mode="fake")(
                    *self.examples()
                )

            try:
                # In a thread of its own: the caller is inside __torch_dispatch__, whose
                # dispatch-key state (thread-local) functionalization cannot trace under.
                self._gm = _tracer().submit(trace).result()
            except Exception as e:
                raise _Unlowerable(f"tracing failed: {type(e).__name__}: {str(e)[:200]}") from e
        return self._gm

    def program(self) -> Any:
        """The op's lowered program (tpubox.torch's _Program); raises _Unlowerable."""
        if self._prog is None:

            gm = self.gm()
            try:
                prog = _Program(gm, "eager", f"eager/{self.name}", _Options({"name": "eager"}))
                _uncount_graph()
            except Exception as e:
                raise _Unlowerable(f"torch-mlir: {str(e)[:200]}") from e
            if prog.n_results:

                text = prog.text(current_precision())
                if "custom_call" in text:
                    raise _Unlowerable("its lowering holds a custom call")
            self._prog = prog
        return self._prog


_TRACER: Any = None


def _tracer() -> Any:
    global _TRACER
    if _TRACER is None:
        from concurrent.futures import ThreadPoolExecutor

        _TRACER = ThreadPoolExecutor(1, thread_name_prefix="tpubox-eager-trace")
    return _TRACER


_OPS: dict[Any, _OpInfo] = {}
_OPS_LOCK = threading.Lock()


def _uncount_graph() -> None:
    """_Program counted a graph in the backend's stats(): eager programs are not its."""

    backend_count("graphs", -1)


def _fake_run(info: _OpInfo) -> Any:
    """Runs INFO's function on fake tensors: the specs of its outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fakes = [mode.from_tensor(e) for e in info.examples()]
        return info.fn(*fakes)


def _replay(chain: tuple, t: Any) -> Any:
    for func, tree, leaves, self_pos, out_idx in chain:
        leaves = list(leaves)
        leaves[self_pos] = t
        a, kw = tree_unflatten(leaves, tree)
        out = func(*a, **kw)
        t = tree_flatten(out)[0][out_idx] if out_idx is not None else out
    return t


def _chain_key(chain: tuple) -> tuple:
    return tuple(
        (func, tree, tuple(None if i == pos else _const_key(x) for i, x in enumerate(ls)), pos, o)
        for func, tree, ls, pos, o in chain
    )


def _run_chain(root: _Root, chain: tuple) -> Any:
    """The value of the view CHAIN of ROOT, computed now (in the mode in force)."""
    key = ("chain", root.spec, _chain_key(chain))
    info = _OPS.get(key)
    if info is None:

        def fn(r: torch.Tensor) -> tuple:
            return (_replay(chain, r),)

        info = _OpInfo(key, "view", fn, [root.spec], False)
        out = _fake_run(info)
        info.out_specs = [_spec_of(out[0])]
        with _OPS_LOCK:
            _OPS[key] = info
    return _run(info, [_root_value(root)], None)[0]


# ---------------------------------------------------------------------------------------------
# Running: DEFER_NEVER launches, DEFER_AND_FUSE records


def _launch(
    exe: Any, args: list[Any], blocking: bool = False, send_now: bool = False
) -> list[Tensor]:
    """Launches EXE on ARGS; the result tensors (pending). Not BLOCKING: without waiting for
    the daemon's reply (its refusal, if any, is raised by the next read or wait, naming the
    launch), batched with the next launches unless SEND_NOW (a program of more than one op:
    the daemon starts it while Python traces the next)."""
    if not blocking:
        outs = exe.session._launch_pipelined(
            exe,
            [a if isinstance(a, Tensor) else as_device_array(a, None) for a in args],
            (),
            send_now,
        )
        if outs is not None:
            return outs
    try:
        return exe.launch(*args)
    except ResourceExhausted as e:
        if "pending" not in str(e):
            raise
        exe.session.wait_all()
        return exe.launch(*args)


_PRECISION: list[Any] = []


def _run_program(
    prog: Any, args: list[Any], blocking: bool, send_now: bool = False
) -> list[Any]:
    """Launches PROG on ARGS (tpubox Tensors and NumPy arrays); the values of its outputs.
    SEND_NOW: see :func:`_launch`."""
    session = _current_session()
    outs: list[Any] = []
    if prog.n_results:
        known = prog._exes.get(session)
        if not _PRECISION:

            _PRECISION.append(current_precision)
        p = _PRECISION[0]()
        if known is None or p not in known:
            _count("compiles")
        else:
            _count("op_cache_hits")
        exe = prog.executable(session, p)
        outs = _launch(exe, args, blocking, send_now)
        _count("launches")
        if blocking and outs:
            session._wait([o.handle for o in outs], False, None)
    result = []
    for what, v in prog.out_map:
        if what == "program":
            result.append(outs[v])
        elif what == "input":
            a = args[v]
            result.append(session.tensor(a) if isinstance(a, np.ndarray) else a)
        else:
            raise _Unlowerable(f"a program output is the constant {v!r}")
    return result


# Errors of Session.compile that mean "this program cannot run here": the op falls back.
_UNLOWERABLE_KINDS = ("compile-failed", "permission-denied", "unsupported")


def _host_arg(v: Any) -> Any:
    """An op input's value as a launch argument."""
    if isinstance(v, torch.Tensor):

        return _to_numpy(v)
    return _concrete(v)


def _run(info: _OpInfo, in_vals: list[Any], func: Any) -> list[Any]:
    """INFO's outputs on IN_VALS (tpubox Tensors, _Pendings, CPU tensors), in the mode in
    force. Raises _Unlowerable (nothing ran) where the op has no lowering."""
    mode = eager_mode()
    if mode is EagerMode.DEFER_AND_FUSE:
        prog = info.program()
        return _trace().record(info, prog, in_vals)
    prog = info.program()
    args = [_host_arg(v) for v in in_vals]
    try:
        return _run_program(prog, args, mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING)
    except TpuboxError as e:
        if e.kind in _UNLOWERABLE_KINDS:
            raise _Unlowerable(f"{e.kind}: {str(e)[:200]}") from e
        raise


# ---------------------------------------------------------------------------------------------
# DEFER_AND_FUSE: the pending graph (one per process)


_DEFAULT_MAX_FUSED_OPS = 512
_MAX_FUSED_OPS = [_DEFAULT_MAX_FUSED_OPS]
_TRACE: list[Any] = [None]


def max_fused_ops() -> int:
    """The most ops a fused graph records before it runs by itself (512 unless
    :func:`set_max_fused_ops` changed it), in this process."""
    return _MAX_FUSED_OPS[0]


def set_max_fused_ops(n: int) -> None:
    """Sets :func:`max_fused_ops` (at least 1)."""
    _MAX_FUSED_OPS[0] = max(1, int(n))


def mark_step() -> None:
    """Runs this process's pending fused graph now (DEFER_AND_FUSE), as TorchTPU's
    ``mark_step``: the tensors still held get their values (the device computes; reads wait).
    Nothing happens when no graph is pending. In DEFER_NEVER it sends the launches batched so
    far on the local socket (they go out by themselves with the next read, wait or batch)."""
    t = _TRACE[0]
    if t is not None and t.records:
        t.flush()
    s = _SESSION
    if s is None:
        with _session._LAST_LOCK:
            s = _session._LAST() if _session._LAST is not None else None
    if s is not None and not s.closed:
        s._send_launches()


class _Trace:
    def __init__(self) -> None:
        self.records: list[tuple[_OpInfo, tuple]] = []
        self.inputs: list[Any] = []  # tpubox Tensors and NumPy arrays
        self.input_index: dict[int, int] = {}
        self.pendings: list[tuple[weakref.ref, int, int]] = []
        self.lock = threading.RLock()
        self.flushed = False
        self.error: BaseException | None = None
        self._held: list[_Pending] | None = None

    def _ref(self, v: Any) -> tuple:
        if isinstance(v, _Pending) and v.resolved is None:
            if v.trace is self:
                return ("n", v.rec, v.out)
            v = _concrete(v)
        elif isinstance(v, _Pending):
            v = v.resolved
        if isinstance(v, torch.Tensor):

            v = _to_numpy(v)
            self.inputs.append(v)
            return ("p", len(self.inputs) - 1)
        i = self.input_index.get(id(v))
        if i is None or self.inputs[i] is not v:
            self.inputs.append(v)
            i = len(self.inputs) - 1
            self.input_index[id(v)] = i
        return ("p", i)

    def record(self, info: _OpInfo, prog: Any, in_vals: list[Any]) -> list[_Pending]:
        with self.lock:
            refs = tuple(self._ref(v) for v in in_vals)
            r = len(self.records)
            self.records.append((info, refs))
            n_out = len(info.out_specs)
            outs = [_Pending(self, r, o) for o in range(n_out)]
            for o, p in enumerate(outs):
                self.pendings.append((weakref.ref(p), r, o))
            _count("fused_ops")
            full = len(self.records) >= max_fused_ops()
        if full:
            # The outputs are held by the caller's frame: they stay outputs of this graph.
            self._held = outs
            self.flush()
            self._held = None
        return outs

    def flush(self) -> None:
        with self.lock:
            if self.flushed:
                return
            self.flushed = True
            if _TRACE[0] is self:
                _TRACE[0] = None
            live = self._live()
            if not live or not self.records:
                return
            key = (tuple((info.key, refs) for info, refs in self.records), len(self.inputs))
            with _GLOBAL:
                known = _FUSED.get(key)
            # A program of this structure exists but not for these values: garbage in
            # reference cycles may hold some. Collect it rather than compile again, the
            # youngest generation first (this step's cycles: a full collection of a process
            # that imported torch and Dynamo takes hundreds of milliseconds).
            generation = 0
            while (
                known is not None
                and generation <= 2
                and not known[0].issuperset((r, o) for _, r, o in live)
            ):
                del live
                gc.collect(generation)
                generation += 1
                live = self._live()
            wanted = [(r, o) for _, r, o in live]
            try:
                try:
                    prog, order = _fused_for(key, self.records, len(self.inputs), wanted)
                    got = _run_program(prog, list(self.inputs), False, len(self.records) > 1)
                    index = {ro: i for i, ro in enumerate(order)}
                    outs = [got[index[ro]] for ro in wanted]
                    _count("fused_graphs")
                except (_Unlowerable, TpuboxError) as e:
                    if isinstance(e, TpuboxError) and e.kind not in _UNLOWERABLE_KINDS:
                        raise
                    # One op at a time instead.
                    outs = self._replay_ops(wanted)
            except BaseException as e:
                self.error = e
                raise
            for (p, _, _), v in zip(live, outs):
                p.resolved = v
            self.records = []
            self.inputs = []

    def _live(self) -> list[tuple[_Pending, int, int]]:
        """The recorded values still held (by tensors), not computed yet."""
        live = []
        for ref, r, o in self.pendings:
            p = ref()
            if p is not None and p.resolved is None:
                live.append((p, r, o))
        return live

    def _replay_ops(self, wanted: list[tuple[int, int]]) -> list[Any]:
        values: list[list[Any]] = []
        for info, refs in self.records:
            ins = [self.inputs[r[1]] if r[0] == "p" else values[r[1]][r[2]] for r in refs]
            values.append(_run_program(info.program(), ins, False))
        return [values[r][o] for r, o in wanted]


# Fused programs by graph structure: for each, the programs compiled and the outputs each gives.
# Which recorded values are still held at a flush can vary between two runs of the same code
# (Python's cycle collector frees some objects late), so a program serves every flush whose
# held values are among its outputs, and a new one is compiled for the union of the outputs
# asked so far: a loop settles on one program.
_FUSED: dict[Any, tuple[frozenset, Any, list[tuple[int, int]]]] = {}


def _fused_for(
    key: Any, records: list, n_inputs: int, wanted: list[tuple[int, int]]
) -> tuple[Any, list[tuple[int, int]]]:
    with _GLOBAL:
        known = _FUSED.get(key)
    if known is not None and known[0].issuperset(wanted):
        return known[1], known[2]
    outs = set(wanted) | (known[0] if known is not None else frozenset())
    order = sorted(outs)
    prog = _fused_program(records, n_inputs, order)
    with _GLOBAL:
        _FUSED[key] = (frozenset(order), prog, order)
    return prog, order


def _trace() -> _Trace:
    with _GLOBAL:
        t = _TRACE[0]
        if t is None or t.flushed:
            t = _TRACE[0] = _Trace()
        return t


def _fused_program(records: list, n_inputs: int, wanted: list[tuple[int, int]]) -> Any:
    """The records' op graphs stitched into one graph (outputs WANTED), lowered."""

    g = torch.fx.Graph()
    holder = torch.nn.Module()
    phs = [g.placeholder(f"in{i}") for i in range(n_inputs)]
    outs: list[list[Any]] = []
    n_attr = 0
    for info, refs in records:
        gm = info.gm()
        env: dict[Any, Any] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for n, ref in zip(placeholders, refs):
            if ref[0] == "p":
                ph = phs[ref[1]]
                if "val" not in ph.meta:
                    ph.meta.update(n.meta)
                env[n] = ph
            else:
                env[n] = outs[ref[1]][ref[2]]
        rec_out: list[Any] = []
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                rec_out = [env[a] for a in n.args[0]]
                continue
            if n.op == "get_attr":
                name = f"_c{n_attr}"
                n_attr += 1
                setattr(holder, name, getattr(gm, n.target))
                new = g.get_attr(name)
                new.meta.update(n.meta)
                env[n] = new
                continue
            env[n] = g.node_copy(n, lambda x: env[x])
        outs.append(rec_out)
    g.output(tuple(outs[r][o] for r, o in wanted))
    gm = torch.fx.GraphModule(holder, g)
    gm.graph.eliminate_dead_code()
    try:
        prog = _Program(gm, "fused", f"eager/fused{len(records)}", _Options({"name": "eager"}))
        _uncount_graph()
        return prog
    except Exception as e:
        raise _Unlowerable(f"torch-mlir: {str(e)[:200]}") from e


# ---------------------------------------------------------------------------------------------
# Dispatch


def _is_list_type(t: Any) -> bool:
    return isinstance(t, torch.ListType)


def _is_tensor_type(t: Any) -> bool:
    """Whether a schema type is a tensor, an optional tensor or a list of (optional) tensors."""
    tensor = torch._C.TensorType.get()
    if isinstance(t, torch.ListType):
        t = t.getElementType()
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return t.isSubtypeOf(tensor)


def _is_view_op(func: Any) -> bool:
    rets = func._schema.returns
    return bool(rets) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in rets
    )


_IDENTITY_VIEWS = {aten.detach.default, aten.alias.default, aten.lift_fresh.default}


def _schema_arg(func: Any, args: Sequence[Any], kwargs: dict, i: int) -> Any:
    a = func._schema.arguments[i]
    if a.kwarg_only:
        return kwargs.get(a.name)
    if i < len(args):
        return args[i]
    return kwargs.get(a.name)


_ALIASED_ARGS: dict[Any, list[tuple[int, Any]]] = {}


def _mutated(func: Any, args: Sequence[Any], kwargs: dict) -> tuple[set[int], dict[Any, Any]]:
    """IDs of the tensors FUNC writes; the written argument of each write alias set."""
    ids: set[int] = set()
    by_set: dict[Any, Any] = {}
    aliased = _ALIASED_ARGS.get(func)
    if aliased is None:
        aliased = _ALIASED_ARGS[func] = [
            (i, a.alias_info) for i, a in enumerate(func._schema.arguments) if a.alias_info
        ]
    for i, ai in aliased:
        v = _schema_arg(func, args, kwargs, i)
        if ai.is_write:
            for t in tree_flatten(v)[0]:
                if isinstance(t, torch.Tensor):
                    ids.add(id(t))
        for s in ai.before_set:
            by_set[s] = v
    return ids, by_set


def _dispatch(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    _count("ops")
    special = _SPECIAL.get(func)
    if special is not None:
        r = special(func, args, kwargs)
        if r is not NotImplemented:
            return r
    if func in _IDENTITY_VIEWS:
        x = args[0]
        if isinstance(x, DeviceTensor):
            return DeviceTensor(x._tb, _spec_of(x))
    try:
        return _dispatch_device(func, args, kwargs)
    except _Unlowerable as e:
        return _cpu_fallback(func, args, kwargs, str(e))


def _flatten(args: Sequence[Any], kwargs: dict) -> tuple[list[Any], tuple]:
    """The leaves of (ARGS, KWARGS) in torch's pytree order, and a hashable
    description of their containers: a cheaper tree_flatten for ATen arguments (lists and
    tuples of tensors and numbers)."""
    leaves: list[Any] = []
    shape: list[Any] = []

    def walk(x: Any) -> None:
        t = type(x)
        if t is list or t is tuple or t is torch.Size:
            shape.append((t.__name__, len(x)))
            for y in x:
                walk(y)
        else:
            shape.append(1)
            leaves.append(x)

    walk(tuple(args))
    shape.append(tuple(kwargs))
    for v in kwargs.values():
        walk(v)
    return leaves, tuple(shape)


# Per op overload: (whether it is a view op, whether it returns a value that is no tensor).
_FUNC_FACTS: dict[Any, tuple[bool, bool]] = {}


def _func_facts(func: Any) -> tuple[bool, bool]:
    facts = _FUNC_FACTS.get(func)
    if facts is None:
        facts = _FUNC_FACTS[func] = (
            _is_view_op(func),
            any(
                r.alias_info is None and not _is_tensor_type(r.type)
                for r in func._schema.returns
            ),
        )
    return facts


def _dispatch_device(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    mutated_ids, by_set = _mutated(func, args, kwargs)
    view_op, returns_value = _func_facts(func)
    if returns_value:
        raise _Unlowerable("it returns a value, not a tensor")
    flat, shape = _flatten(args, kwargs)
    leaf_keys: list[Any] = []
    in_vals: list[Any] = []
    in_specs: list[tuple] = []
    plan: list[tuple] = []  # per tensor input: (flat index, "mut", chain) or (index, "in", None)
    consts: list[Any] = list(flat)
    mutated_wrappers: list[DeviceTensor] = []
    for i, x in enumerate(flat):
        if isinstance(x, DeviceTensor):
            st = x._tb
            if id(x) in mutated_ids:
                leaf_keys.append(("m", st.root.spec, _chain_key(st.chain)))
                in_vals.append(("root", st.root))
                in_specs.append(st.root.spec)
                plan.append((i, "mut", st.chain))
                mutated_wrappers.append(x)
            else:
                spec = _spec_of(x)
                leaf_keys.append(("t", spec))
                in_vals.append(x)
                in_specs.append(spec)
                plan.append((i, "in", None))
            consts[i] = None
        elif isinstance(x, torch.Tensor):
            if id(x) in mutated_ids:
                raise _Unlowerable("it writes a host tensor")
            spec = _spec_of(x)
            leaf_keys.append(("c", spec))
            in_vals.append(x)
            in_specs.append(spec)
            plan.append((i, "in", None))
            consts[i] = None
        else:
            try:
                leaf_keys.append(_const_key(x))
            except _NotKeyable as e:
                raise _Unlowerable(f"an argument of type {e}") from None
            consts[i] = _host_device(x)
    key = (func, shape, tuple(leaf_keys))
    info = _OPS.get(key)
    if info is None:
        flat2, tree = tree_flatten((tuple(args), kwargs))
        if len(flat2) != len(flat) or any(a is not b for a, b in zip(flat2, flat)):
            raise _Unlowerable("arguments of an unexpected structure")
        info = _new_info(func, key, tree, consts, plan, in_specs, view_op)
    if info.unsupported is not None:
        raise _Unlowerable(info.unsupported)
    # The values: mutated roots are read as roots.
    vals = []
    for v in in_vals:
        if isinstance(v, tuple):
            vals.append(_root_value(v[1]))
        elif isinstance(v, DeviceTensor):
            vals.append(_value(v))
        else:
            vals.append(v)
    try:
        outs = _run(info, vals, func)
    except _Unlowerable as e:
        info.unsupported = str(e)
        raise
    n_mut = len(mutated_wrappers)
    for w, v in zip(mutated_wrappers, outs[:n_mut]):
        root = w._tb.root
        root.value = v
        root.version += 1
    results = iter(zip(outs[n_mut:], info.out_specs[n_mut:]))
    ret_leaves: list[Any] = []
    for kind, extra in info.ret_plan:
        if kind == "arg":
            ret_leaves.append(by_set[extra])
        elif kind == "new":
            v, spec = next(results)
            ret_leaves.append(_wrap(v, spec))
        elif kind == "view":
            v, spec = next(results)
            base_pos, link = extra
            base = flat[base_pos]
            bst = base._tb
            st = _State(bst.root, bst.chain + (link,), v, bst.root.version)
            ret_leaves.append(DeviceTensor(st, spec))
        else:
            ret_leaves.append(extra)
    if info.ret_tree.is_leaf():
        return ret_leaves[0]  # one tensor: tree_unflatten would return it
    return tree_unflatten(ret_leaves, info.ret_tree)


def _new_info(
    func: Any, key: Any, tree: Any, consts: list, plan: list, in_specs: list, view_op: bool
) -> _OpInfo:
    schema = func._schema
    mutating = any(k == "mut" for _, k, _ in plan)
    # For view ops: the viewed tensor is the first argument, the only tensor operand.
    view_base: int | None = None
    if view_op and not mutating and len(plan) == 1 and plan[0][0] == 0:
        view_base = 0
    write_sets = [
        r.alias_info.before_set if r.alias_info is not None and r.alias_info.is_write else None
        for r in schema.returns
    ]

    captured: dict[str, Any] = {}

    def fn(*ins: torch.Tensor) -> tuple:
        leaves = list(consts)
        roots = []
        for t, (i, kind, chain) in zip(ins, plan):
            if kind == "mut":
                r = t.clone()
                roots.append(r)
                leaves[i] = _replay(chain, r)
            else:
                leaves[i] = t
        a, kw = tree_unflatten(leaves, tree)
        out = func(*a, **kw)
        captured["out"] = out
        groups = [out] if len(schema.returns) == 1 else list(out) if schema.returns else []
        res = []
        for g, ws in zip(groups, write_sets):
            if ws is not None:
                continue
            res.extend(x for x in tree_flatten(g)[0] if isinstance(x, torch.Tensor))
        return tuple(roots) + tuple(res)

    info = _OpInfo(key, _op_name(func), fn, in_specs, mutating)
    try:
        fake_out = _fake_run(info)
    except Exception as e:  # no fake kernel, data-dependent shapes, or the user's error
        info.unsupported = f"no shape rule: {type(e).__name__}"
        with _OPS_LOCK:
            _OPS[key] = info
        return info
    info.out_specs = [_spec_of(t) for t in fake_out]
    # How the op's return is built from the outputs after the roots (and the written args),
    # following the structure of the fake return (undefined tensors are None).
    out = captured.pop("out", None)
    groups = [out] if len(schema.returns) == 1 else list(out) if schema.returns else []
    ret_plan: list[Any] = []
    tree_src: list[Any] = []
    for g, r in zip(groups, schema.returns):
        if r.alias_info is not None and r.alias_info.is_write:
            ret_plan.append(("arg", next(iter(r.alias_info.before_set))))
            tree_src.append(0)
            continue
        is_list = _is_list_type(r.type)
        leaves, sub = tree_flatten(g)
        for j, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                ret_plan.append(("const", leaf))
            elif view_base is not None:
                link = (func, tree, tuple(consts), view_base, j if is_list else None)
                ret_plan.append(("view", (view_base, link)))
            else:
                ret_plan.append(("new", None))
        tree_src.append(tree_unflatten([0] * len(leaves), sub))
    if len(schema.returns) == 1:
        info.ret_tree = tree_flatten(tree_src[0])[1]
    else:
        info.ret_tree = tree_flatten(tuple(tree_src))[1]
    info.ret_plan = ret_plan
    with _OPS_LOCK:
        _OPS[key] = info
    return info


# ---------------------------------------------------------------------------------------------
# The CPU fallback


def _histc_any_dtype(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``aten.histc`` as accelerators have it, integer inputs included (PyTorch's CPU kernel
    takes floating point only; transformers' MoE layers count tokens per expert with an int32
    ``histc`` on every device but the CPU): counted in f64, given back in X's dtype."""
    if x.is_floating_point():
        return aten.histc.default(x, *args, **kwargs)
    return aten.histc.default(x.double(), *args, **kwargs).to(x.dtype)


# The forms of ATen ops run on the host where PyTorch's CPU kernel is narrower than the op.
_HOST_FORMS: dict[Any, Callable[..., Any]] = {aten.histc.default: _histc_any_dtype}


def _dense_layout(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether no two elements of a tensor of SHAPE and STRIDE share memory (strides of
    dimensions of more than one element distinct from 0 and not overlapping)."""
    dims = sorted((s, n) for n, s in zip(shape, stride) if n > 1)
    span = 1
    for s, n in dims:
        if s < span:
            return False
        span = s * n
    return True


def _cpu_fallback(func: Any, args: Sequence[Any], kwargs: dict, why: str) -> Any:
    mutated_ids, _ = _mutated(func, args, kwargs)
    flat, tree = tree_flatten((tuple(args), kwargs))
    host_of: dict[int, torch.Tensor] = {}
    writes: list[tuple[DeviceTensor, torch.Tensor]] = []
    roots_done: dict[int, torch.Tensor] = {}
    leaves = []
    for x in flat:
        if isinstance(x, DeviceTensor):
            st = x._tb
            if id(x) in mutated_ids:
                r = roots_done.get(id(st.root))
                if r is None:
                    shape, stride, dtype = st.root.spec
                    r = torch.empty_strided(shape, stride, dtype=dtype)
                    r.copy_(_fetch(_root_value(st.root)).reshape(shape))
                    roots_done[id(st.root)] = r
                    writes.append((x, r))
                h = _replay(st.chain, r)
            else:
                h = _to_host(x)
                shape, stride, dtype = _spec_of(x)
                if h.stride() != stride and len(shape) > 0 and _dense_layout(shape, stride):
                    # The op sees the layout it would on the device (an expanded tensor, whose
                    # elements share memory, keeps the dense one: its values are the same).
                    h = torch.empty_strided(shape, stride, dtype=dtype).copy_(h)
            host_of[id(h)] = x
            leaves.append(h)
        else:
            leaves.append(_host_device(x))
    a, kw = tree_unflatten(leaves, tree)
    out = _HOST_FORMS.get(func, func)(*a, **kw)
    _warn_fallback(func, why)
    for w, r in writes:
        root = w._tb.root
        root.value = _put(r)
        root.version += 1

    def back(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            w = host_of.get(id(o))
            if w is not None:
                return w
            return _wrap(_put(o), _spec_of(o))
        return o

    return tree_unflatten([back(o) for o in tree_flatten(out)[0]], tree_flatten(out)[1])


# ---------------------------------------------------------------------------------------------
# Ops handled without a program


def _to_copy(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    x = args[0]
    dev = kwargs.get("device")
    if isinstance(x, DeviceTensor) and dev is not None and torch.device(dev).type == "cpu":
        host = _to_host(x)
        dtype = kwargs.get("dtype")
        if dtype is not None and dtype != host.dtype:
            host = host.to(dtype)
        if kwargs.get("pin_memory"):
            host = host.pin_memory()
        return host
    if isinstance(x, DeviceTensor) and kwargs.get("dtype") in (None, x.dtype):
        # A copy of a device tensor on the device: values are never written in place, so the
        # copy is a new root holding the same value.
        return _wrap(_value(x), (tuple(x.shape), _contiguous(x.shape), x.dtype))
    return NotImplemented


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(list(shape)):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def _copy_(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if not isinstance(dst, DeviceTensor):
        # Device -> host.
        host = _to_host(src)
        dst.copy_(host)
        return dst
    if dst._tb.chain or tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        return NotImplemented
    root = dst._tb.root
    if isinstance(src, DeviceTensor):
        root.value = _value(src)
    else:
        root.value = _put(src)
    root.version += 1
    return dst


def _copy_from(src: Any, dst: Any, non_blocking: bool = False) -> Any:
    """``aten::_copy_from(self, dst)``: what PyTorch's ``copy_`` of a host tensor calls when its
    source is on another device (``cpu_tensor.copy_(device_tensor)``, seen in Llama's rotary
    embedding): SRC copied into DST, DST returned."""
    if isinstance(dst, DeviceTensor):
        out = _copy_(aten.copy_.default, (dst, src), {})
        if out is NotImplemented:
            raise NotImplementedError(
                "tpubox.torch eager: copying into a view of a device tensor is not supported"
            )
        return out
    dst.copy_(_to_host(src) if isinstance(src, DeviceTensor) else src)
    return dst


def _local_scalar_dense(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    return _to_host(args[0]).item()


def _clone(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    x = args[0]
    if isinstance(x, DeviceTensor):
        return _wrap(_value(x), (tuple(x.shape), _contiguous(x.shape), x.dtype))
    return NotImplemented


def _native_batch_norm(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    # Its schema does not say that it updates the running statistics in training mode: run
    # the functional form (what functionalization uses) and write them back.
    a = list(args) + [None] * (8 - len(args))
    for i, name in enumerate(("input", "weight", "bias", "running_mean", "running_var",
                              "training", "momentum", "eps")):  # fmt: skip
        if name in kwargs:
            a[i] = kwargs[name]
    x, w, b, rm, rv, training, momentum, eps = a
    if not training and rm is not None and rv is not None:
        # BatchNorm's inference form (eval mode): the running statistics normalize; nothing
        # is written. The functional op of that form is what torch-mlir's table decomposes.
        return _dispatch(
            aten._native_batch_norm_legit_no_training.default,
            (x, w, b, rm, rv, momentum, eps),
            {},
        )
    if not training or rm is None or rv is None:
        return NotImplemented
    out, mean, rstd, new_rm, new_rv = _dispatch(
        aten._native_batch_norm_legit_functional.default,
        (x, w, b, rm, rv, training, momentum, eps),
        {},
    )
    _dispatch(aten.copy_.default, (rm, new_rm), {})
    _dispatch(aten.copy_.default, (rv, new_rv), {})
    return out, mean, rstd


def _refused(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    raise NotImplementedError(
        f"tpubox.torch eager: {_op_name(func)} (changing a device tensor's shape or storage in "
        "place) is not supported"
    )


def _as_strided_inplace(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    """``as_strided_`` that only restates the tensor's layout (the same sizes; the same strides
    in every dimension of more than one element; the same offset) is a no-op: PyTorch's
    ``adaptive_avg_pool2d`` writes one on its mean for an input whose strides suggest channels
    last (Swin's pooler on a transposed tensor). Any other is refused."""
    a = list(args) + [None] * (4 - len(args))
    x, size, stride, offset = a[0], kwargs.get("size", a[1]), kwargs.get("stride", a[2]), (
        kwargs.get("storage_offset", a[3])
    )
    if (
        isinstance(x, torch.Tensor)
        and list(size) == list(x.shape)
        and len(stride) == x.dim()
        and all(n <= 1 or int(s) == x.stride(d) for d, (n, s) in enumerate(zip(size, stride)))
        and (offset is None or int(offset) == x.storage_offset())
    ):
        return x
    return _refused(func, args, kwargs)


def _as_strided(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    """``as_strided`` of a contiguous device tensor into a dense block of it (what DDP's
    reducer does to view each gradient inside its flat bucket): a view by the ops the device
    tensors chain (flatten, slice, view), so writes through it reach the bucket. Other
    strides go the generic way (a CPU fallback, a copy)."""
    x, size = args[0], list(args[1])
    stride = list(args[2]) if len(args) > 2 else list(kwargs.get("stride", []))
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    offset = 0 if offset is None else int(offset)
    if (
        not isinstance(x, DeviceTensor)
        or not x.is_contiguous()
        or x.storage_offset() != 0
        or stride != list(_contiguous(size))
    ):
        return NotImplemented
    n = 1
    for d in size:
        n *= int(d)
    if offset + n > x.numel():
        return NotImplemented
    flat = aten.view.default(x, [-1])
    return aten.view.default(aten.slice.Tensor(flat, 0, offset, offset + n), size)


_SPECIAL: dict[Any, Callable[..., Any]] = {
    aten.as_strided.default: _as_strided,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.clone.default: _clone,
    aten.native_batch_norm.default: _native_batch_norm,
    aten.resize_.default: _refused,
    aten.set_.source_Tensor: _refused,
    aten.as_strided_.default: _as_strided_inplace,
}


# ---------------------------------------------------------------------------------------------
# The device: PyTorch's PrivateUse1 backend renamed "tpubox"; factories on it


_REGISTERED = False
_LIB: Any = None


def _factory(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        kwargs = {k: _host_device(v) for k, v in kwargs.items()}
        kwargs.pop("pin_memory", None)
        host = op(*[_host_device(a) for a in args], **kwargs)
        return _wrap(_put(host), _spec_of(host))

    return kernel


def _empty(*args: Any, **kwargs: Any) -> Any:
    kwargs = {k: _host_device(v) for k, v in kwargs.items()}
    kwargs.pop("pin_memory", None)
    kwargs.pop("memory_format", None)
    size = args[0]
    if len(args) > 1 and not isinstance(args[1], torch.dtype):
        host = torch.empty_strided(size, args[1], **kwargs)
    else:
        host = torch.empty(size, **kwargs)
    return _wrap(None, _spec_of(host))


def _register() -> None:
    """Registers the device type ``tpubox`` with PyTorch (once per process)."""
    global _REGISTERED, _LIB
    if _REGISTERED:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    name = torch._C._get_privateuse1_backend_name()
    if name == DEVICE_TYPE:
        raise RuntimeError(
            f"tpubox.torch eager: the device {DEVICE_TYPE!r} was registered by another module"
        )
    if name != "privateuseone":
        raise RuntimeError(
            f"tpubox.torch eager: PyTorch's PrivateUse1 backend is already {name!r}; the "
            f"device {DEVICE_TYPE!r} cannot be registered in this process"
        )
    _setup_privateuseone_for_python_backend(DEVICE_TYPE)
    global _DEVICE
    _DEVICE = torch.device(DEVICE_TYPE, 0)
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty, "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    lib.impl("empty_strided", _empty, "PrivateUse1")
    for op in (
        "arange",
        "arange.start",
        "arange.start_step",
        "full",
        "zeros",
        "ones",
        "rand",
        "randn",
        "randint",
        "randint.low",
        "linspace",
        "eye",
        "eye.m",
        "scalar_tensor",
    ):
        name_, _, overload = op.partition(".")
        try:
            packet = getattr(aten, name_)
            ov = getattr(packet, overload or "default")
            lib.impl(op, _factory(ov), "PrivateUse1")
        except (AttributeError, RuntimeError):
            pass
    _LIB = lib
    _REGISTERED = True


try:
    _register()
except RuntimeError as _e:  # another PrivateUse1 backend owns the slot
    warnings.warn(str(_e), RuntimeWarning, stacklevel=2)
