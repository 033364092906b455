"""Run PyTorch models on the tpubox daemon's device: ``torch.compile(model, backend="tpubox")``.

``import tpubox.torch`` registers the TorchDynamo backend ``"tpubox"`` (it is also found
without the import, through the ``torch_dynamo_backends`` entry point of the installed
package). Each graph Dynamo captures goes through ``aot_autograd``, which turns it into
ATen-level forward and backward graphs with the parameters and buffers lifted to inputs; each
of those is lowered to one StableHLO function by torch-mlir's FX importer, compiled through
the session's :meth:`tpubox.Session.compile` (so every tier of the daemon's compile cache
applies) and executed there. A training step (forward, backward, optimizer step) compiles too;
graph breaks run in PyTorch, as Dynamo does with any backend.

What travels, and what stays:

- Parameters and buffers are put on the device once per session and kept there. They are
  found by identity (an ``nn.Parameter``, or a tensor Dynamo took from a module) and keyed by
  their storage, shape, dtype and version counter (``tensor._version``), so an in-place update
  (``optimizer.step()``, ``p.add_()``, ``copy_``) is noticed and the new values are put again
  before the next execution. Writes through ``tensor.data`` bypass the version counter and are
  not noticed (as with any cache keyed on versions).
- Activations (the user's inputs, what the forward saves for the backward, gradients) travel
  with each execution, in the same round trip (the session API's ``Call``), and the results
  come back as CPU tensors.
- Programs never hold the weights as constants; a program is compiled once per session, per
  input signature and per matmul precision.

Shapes are static: a graph compiles one program per concrete signature of its inputs. When
Dynamo hands over a graph with symbolic sizes (``dynamic=True``, or automatic dynamic shapes
after a second shape), each concrete signature met at run time is traced and compiled on its
own, as ``dynamic=False`` would. Dimensions marked with ``torch._dynamo.mark_dynamic(t, dim,
min=, max=)`` are bucketed instead, as TorchTPU does: one program per bucket, the inputs
padded with zeros to the bucket's size and the outputs cut back (:func:`bucket_of`; options
``num_dynamic_buckets``, ``bucket_size``).

Precision of f32 matrix products and convolutions, TorchTPU's names: :class:`Precision`
``DEFAULT`` / ``HIGH`` / ``HIGHEST`` is StableHLO's ``precision_config`` of every
``dot_general`` and ``convolution`` in the program. :func:`precision` sets it for a block;
outside one it follows ``torch.set_float32_matmul_precision``: ``"medium"`` -> DEFAULT,
``"high"`` -> HIGH, ``"highest"`` (PyTorch's default) -> HIGHEST.

Which session: the backend option ``session`` (a :class:`tpubox.Session`, or a callable that
returns one), else options ``address`` and ``token`` (the backend connects, and connects again
when the session ends), else :func:`tpubox.default_session` at each call (the last session
:func:`tpubox.connect` returned, or a notebook kernel's). When the session ends under a
running program (the daemon restarted, an idle timeout), the next call gets a session again,
puts the weights again, compiles again (the daemon's disk cache usually answers) and goes on.

Backend options (``torch.compile(model, backend="tpubox", options={...})``):

- ``xla_optimization_level``: ``"O0"`` ... ``"O3"``, TorchTPU's compiler option (part of the
  compile-cache key; default the plugin's).
- ``name``: a name for the compiled graphs in :func:`stats` and errors (TorchTPU's ``name``).
- ``debug_callback``: called with a :class:`GraphInfo` for every program compiled (its kind,
  FX graph, StableHLO text, precision, executable), TorchTPU's option of that name.
- ``session``, ``address``, ``token``: where to run (above).
- ``num_dynamic_buckets`` (1, at most 8) and ``bucket_size`` (128): TorchTPU's buckets of a
  ``mark_dynamic`` dimension: with ``max=``, that many buckets dividing ``(min, max]``;
  without, multiples of ``bucket_size``.
- ``async_compile`` (False), ``serializable``: TorchTPU's; only their defaults are accepted.

:func:`export` writes a model for ``tpubox serve``'s repository instead (StableHLO programs per
batch size, the weights, ``config.toml``), as :func:`tpubox.jax.export_model` does for JAX.

Needs ``torch`` and ``torch-mlir`` (``scripts/venvs/torch.txt`` pins a pair that works:
torch 2.15.0, torch-mlir 20261001, installed with ``--no-deps``).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np
import torch

from . import _export
from . import _lowering_cache
from . import session as _session
from .errors import TpuboxError, Unsupported
from .session import Executable, Session, Tensor

__all__ = [
    "backend",
    "Precision",
    "precision",
    "current_precision",
    "GraphInfo",
    "stats",
    "reset_stats",
    "BACKEND_NAME",
    "bucket_of",
    "MAX_DYNAMIC_BUCKETS",
    "export",
    # Eager tensors on the device (tpubox.torch_eager)
    "device",
    "is_device_tensor",
    "EagerMode",
    "eager_mode",
    "set_eager_mode",
    "mark_step",
    "max_fused_ops",
    "set_max_fused_ops",
    "eager_stats",
    "reset_eager_stats",
    "cpu_fallback_ops",
    "CpuFallbackWarning",
]

#: The name ``torch.compile`` takes: ``torch.compile(model, backend="tpubox")``.
BACKEND_NAME = "tpubox"

# ---------------------------------------------------------------------------------------------
# Precision


class Precision(enum.Enum):
    """Precision of f32 matrix products and convolutions on the device, TorchTPU's
    ``torch.tpu.Precision``: StableHLO's ``precision_config`` values. On a TPU, ``DEFAULT``
    is one bf16 pass, ``HIGH`` three, ``HIGHEST`` full f32; the CPU plugin computes all three
    alike."""

    DEFAULT = "DEFAULT"
    HIGH = "HIGH"
    HIGHEST = "HIGHEST"


# torch.set_float32_matmul_precision's names -> Precision (as TorchTPU maps them).
_TORCH_PRECISIONS = {
    "medium": Precision.DEFAULT,
    "high": Precision.HIGH,
    "highest": Precision.HIGHEST,
}

_PRECISION_LOCAL = threading.local()


def _as_precision(mode: Any) -> Precision:
    if isinstance(mode, Precision):
        return mode
    if isinstance(mode, str):
        key = mode.strip()
        if key.upper() in Precision.__members__:
            return Precision[key.upper()]
        if key.lower() in _TORCH_PRECISIONS:
            return _TORCH_PRECISIONS[key.lower()]
    raise ValueError(
        f"precision must be a tpubox.torch.Precision, 'default', 'high', 'highest' (or "
        f"torch's 'medium', 'high', 'highest'), not {mode!r}"
    )


@contextlib.contextmanager
def precision(mode: Precision | str) -> Iterator[Precision]:
    """Within the block, programs run with matmul/convolution precision MODE (a
    :class:`Precision` or its name, case-insensitive; ``"medium"`` is DEFAULT), in this thread,
    whatever ``torch.set_float32_matmul_precision`` says. Blocks nest; the innermost wins.
    TorchTPU's ``torch.tpu.precision(mode)``."""
    p = _as_precision(mode)
    stack = getattr(_PRECISION_LOCAL, "stack", None)
    if stack is None:
        stack = _PRECISION_LOCAL.stack = []
    stack.append(p)
    try:
        yield p
    finally:
        stack.pop()


def current_precision() -> Precision:
    """The precision a program launched now would run with: the innermost :func:`precision`
    block of this thread, else ``torch.get_float32_matmul_precision()`` mapped ("medium" ->
    DEFAULT, "high" -> HIGH, "highest" -> HIGHEST)."""
    stack = getattr(_PRECISION_LOCAL, "stack", None)
    if stack:
        return stack[-1]
    return _TORCH_PRECISIONS.get(torch.get_float32_matmul_precision(), Precision.HIGHEST)


# ---------------------------------------------------------------------------------------------
# Statistics


_STATS_LOCK = threading.Lock()
_STATS: dict[str, int] = {}
_STAT_NAMES = (
    "graphs",  # FX graphs lowered to StableHLO (forward and backward count apart)
    "compiles",  # Session.compile calls
    "executions",  # programs executed
    "device_executions",  # of those, on device tensors (a model moved to tpubox.torch.device())
    "weight_puts",  # parameters/buffers put on the device (first use, after an update)
    "weight_hits",  # parameters/buffers used where they were on the device
    "specializations",  # concrete signatures traced for graphs with symbolic sizes
    "session_restarts",  # times a call found its session gone and started over
    "lowering_cache_hits",  # StableHLO texts found in the lowering cache (no torch-mlir run)
    "lowering_cache_misses",  # texts looked up there and not found
    "lowerings",  # graphs lowered by torch-mlir
    "lowering_ms",  # milliseconds spent in those lowerings
)


def _count(name: str, n: int = 1) -> None:
    with _STATS_LOCK:
        _STATS[name] = _STATS.get(name, 0) + n


def stats() -> dict[str, int]:
    """Counters of this process since the last :func:`reset_stats`: ``graphs`` (FX graphs
    lowered), ``compiles`` (:meth:`Session.compile` calls), ``executions``, ``weight_puts``
    (parameters and buffers put on the device: first use, or after an in-place update),
    ``weight_hits`` (used where they were), ``device_executions`` (executions on device
    tensors: a model moved to :func:`device`), ``specializations`` (concrete signatures traced
    for graphs with symbolic sizes), ``session_restarts``, ``lowering_cache_hits`` and
    ``lowering_cache_misses`` (StableHLO texts found in the on-disk lowering cache or not),
    ``lowerings`` (graphs torch-mlir lowered) and ``lowering_ms`` (the milliseconds it took).
    The lowering counters include the programs of eager device tensors."""
    with _STATS_LOCK:
        return {k: _STATS.get(k, 0) for k in _STAT_NAMES}


def reset_stats() -> None:
    """Sets every counter of :func:`stats` to zero."""
    with _STATS_LOCK:
        _STATS.clear()


# ---------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class GraphInfo:
    """One program compiled in a session, as the ``debug_callback`` option gets it.

    Attributes:
        name: the backend's ``name`` option, the graph's number and kind (``mlp/3/forward``).
        kind: ``"forward"``, ``"backward"`` or ``"inference"``.
        graph: the ATen-level ``torch.fx.GraphModule`` it was lowered from.
        stablehlo: the program's text, as sent to the daemon.
        precision: the :class:`Precision` of its dots and convolutions.
        executable: the :class:`tpubox.Executable` (``tier`` says which cache tier served it).
    """

    name: str
    kind: str
    graph: Any
    stablehlo: str
    precision: Precision
    executable: Executable


_OPTIMIZATION_LEVELS = ("O0", "O1", "O2", "O3")
# TorchTPU's options that tpubox accepts only at their default value.
_DEFAULT_ONLY = {
    "async_compile": False,
    "serializable": True,
}
_KNOWN = {"xla_optimization_level", "name", "debug_callback", "session", "address", "token"}
_KNOWN |= set(_DEFAULT_ONLY) | {"num_dynamic_buckets", "bucket_size"}
#: TorchTPU's most buckets of one dynamic dimension.
MAX_DYNAMIC_BUCKETS = 8


class _Options:
    def __init__(self, options: Mapping[str, Any] | None):
        options = dict(options or {})
        unknown = sorted(set(options) - _KNOWN)
        if unknown:
            raise ValueError(
                f"tpubox backend: unknown option(s) {unknown}; known: {sorted(_KNOWN)}"
            )
        for k, default in _DEFAULT_ONLY.items():
            if k in options and options[k] != default and not (
                k == "serializable" and options[k] is False
            ):
                raise Unsupported(
                    "unsupported",
                    f"tpubox backend: option {k}={options[k]!r} is not supported (only "
                    f"{default!r})",
                )
        buckets = options.get("num_dynamic_buckets", 1)
        if not isinstance(buckets, int) or isinstance(buckets, bool) or not (
            1 <= buckets <= MAX_DYNAMIC_BUCKETS
        ):
            raise ValueError(
                f"num_dynamic_buckets must be an int in 1..{MAX_DYNAMIC_BUCKETS}, not {buckets!r}"
            )
        size = options.get("bucket_size", 128)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"bucket_size must be a positive int, not {size!r}")
        self.num_dynamic_buckets: int = buckets
        self.bucket_size: int = size
        level = options.get("xla_optimization_level")
        if level is not None and level not in _OPTIMIZATION_LEVELS:
            raise ValueError(
                f"xla_optimization_level must be one of {list(_OPTIMIZATION_LEVELS)}, "
                f"not {level!r}"
            )
        self.optimization_level: str | None = level
        self.name: str = str(options.get("name") or "graph")
        self.debug_callback: Callable[[GraphInfo], Any] | None = options.get("debug_callback")
        self.target = _Target(options.get("session"), options.get("address"), options.get("token"))


class _Target:
    """Where the programs run: a session, and how to get another when it ends."""

    def __init__(self, session: Any, address: Any, token: str | None):
        if session is not None and address is not None:
            raise ValueError("tpubox backend: give the option session or address, not both")
        self._given = session
        self._address = None if address is None else str(address)
        self._token = token
        self._own: Session | None = None
        self._lock = threading.Lock()

    def session(self) -> Session:
        """The session to run in now (a new one when the last one ended, where possible)."""
        given = self._given
        if isinstance(given, Session):
            if not given.closed:
                return given
            return _session.default_session()
        if callable(given):
            with self._lock:
                if self._own is None or self._own.closed:
                    s = given()
                    if not isinstance(s, Session):
                        raise TypeError(
                            f"tpubox backend: the session option returned {type(s).__name__}, "
                            "not a tpubox.Session"
                        )
                    self._own = s
                return self._own
        if self._address is not None:
            with self._lock:
                if self._own is None or self._own.closed:
                    self._own = _session.connect(
                        self._address, self._token, label="tpubox.torch"
                    )
                return self._own
        return _session.default_session()

    def wait(self, timeout: float) -> None:
        """Waits (up to TIMEOUT s) for the daemon to answer again, when its address is known."""
        address = self._address
        if address is None and isinstance(self._given, Session):
            address = self._given.address
        if address is not None:
            try:
                _session.wait_for_daemon(address, timeout=timeout, token=self._token)
            except TpuboxError:
                pass


# ---------------------------------------------------------------------------------------------
# Tensors: torch <-> NumPy (what the session takes and gives)


_NP_OF_TORCH = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}


def _spec(t: torch.Tensor) -> tuple:
    """T's (shape, stride, dtype)."""
    return (tuple(t.shape), tuple(t.stride()), t.dtype)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """T's values as a C-contiguous NumPy array (no copy where T is already one on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype not in _NP_OF_TORCH:
        raise Unsupported("unsupported", f"tpubox backend: tensors of {t.dtype} cannot travel")
    return t.numpy()


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor over A's memory (A is a fetched result: dense, writable)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


# ---------------------------------------------------------------------------------------------
# Weights kept on the device


class _Resident:
    """A session's device copies of parameters and buffers.

    An entry is keyed by the tensor's storage (data pointer, storage offset, shape, strides,
    dtype) and holds a weak reference to the tensor it was put from and the version counter
    it had then. While that tensor lives, no other tensor owns its memory, so a tensor with
    the same key is that one or an alias of it (a ``detach()``, a view of the same extent),
    whose version counter it shares: the entry is current while the version is unchanged.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple, tuple[weakref.ref, int, Tensor]] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def lookup(self, t: torch.Tensor) -> Tensor | None:
        """The current device copy of T, or None."""
        with self._lock:
            e = self._entries.get(self._key(t))
        if e is None:
            return None
        ref, version, dev = e
        if ref() is None or t._version != version or dev.freed:
            return None
        return dev

    def known(self, t: torch.Tensor) -> bool:
        """Whether T is (an alias of) a tensor with an entry, current or not."""
        with self._lock:
            e = self._entries.get(self._key(t))
        return e is not None and e[0]() is not None

    def put(self, session: Session, t: torch.Tensor) -> Tensor:
        """T's device copy: the entry's, or a new one put now."""
        dev = self.lookup(t)
        if dev is not None:
            _count("weight_hits")
            return dev
        key = self._key(t)
        version = t._version
        dev = session.tensor(_to_numpy(t))
        _count("weight_puts")
        entries = self._entries

        def dropped(_: Any, key: tuple = key) -> None:
            # The tensor is gone: its device copy goes with the entry (freed when dropped).
            entries.pop(key, None)

        with self._lock:
            old = entries.get(key)
            entries[key] = (weakref.ref(t, dropped), version, dev)
        if old is not None and old[2] is not dev:
            try:
                old[2].free()
            except TpuboxError:
                pass
        return dev


_RESIDENT: weakref.WeakKeyDictionary[Session, _Resident] = weakref.WeakKeyDictionary()
_RESIDENT_LOCK = threading.Lock()


def _resident(session: Session) -> _Resident:
    with _RESIDENT_LOCK:
        r = _RESIDENT.get(session)
        if r is None:
            r = _RESIDENT[session] = _Resident()
        return r


# ---------------------------------------------------------------------------------------------
# Lowering an ATen-level FX graph to StableHLO


def _torch_mlir() -> Any:
    try:
        from torch_mlir import fx as tm_fx
    except ImportError as e:
        raise Unsupported(
            "unsupported",
            "tpubox backend: torch-mlir is not installed (pip install --no-deps "
            "torch-mlir==20261001 beside torch 2.15; scripts/venvs/torch.txt)",
        ) from e
    return tm_fx


_DECOMPOSITIONS: dict | None = None


def _decompositions() -> dict:
    """The decomposition table aot_autograd applies: torch-mlir's (the ATen ops its importer
    lowers stay, the rest are decomposed into them)."""
    global _DECOMPOSITIONS
    if _DECOMPOSITIONS is None:
        # Only the table: torch-mlir's importer (a quarter of a second to import) is loaded when
        # a graph is lowered, not where the lowering cache has every text.
        try:
            from torch_mlir.extras.fx_decomp_util import get_decomposition_table
        except ImportError:
            _torch_mlir()  # Unsupported, saying what to install
            raise

        _DECOMPOSITIONS = {**_foreach_decompositions(), **dict(get_decomposition_table())}
    return _DECOMPOSITIONS


def _foreach_decompositions() -> dict:
    """Decompositions of ATen's ``_foreach_*`` ops (what PyTorch's optimizers call with
    ``foreach=True``, their default on accelerators) into the same op on each tensor of the
    lists, for a compiled ``opt.step()``: PyTorch's own table has none (Inductor lowers them
    itself), and torch-mlir lowers the per-tensor ops. The functional overloads (what
    aot_autograd's functionalization leaves) and the in-place ones (an eager trace's)."""
    table: dict[Any, Any] = {}
    for schema in torch._C._jit_get_all_schemas():
        name, overload = schema.name, schema.overload_name
        if not name.startswith("aten::_foreach_") or overload.endswith("out"):
            continue
        base = name[len("aten::_foreach_") :]
        inplace = base.endswith("_")
        if inplace:
            base = base[:-1]
        if base not in _FOREACH_BASES and not hasattr(torch.ops.aten, base):
            continue
        packet = getattr(torch.ops.aten, name[len("aten::") :])
        op = getattr(packet, overload or "default")
        table[op] = functools.partial(_foreach_apply, op, base, inplace)
    return table


def _foreach_apply(op: Any, base: str, inplace: bool, *args: Any, **kwargs: Any) -> Any:
    """OP (``aten._foreach_BASE[_]``) as BASE on each element: list arguments (``Tensor[]``,
    ``Scalar[]``) are taken element by element, the rest given to every call; an in-place
    overload writes each result into its ``self`` element."""
    aten = torch.ops.aten
    values: list[tuple[Any, Any]] = []
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            v = args[i]
        elif a.name in kwargs:
            v = kwargs[a.name]
        else:
            v = a.default_value
        values.append((a, v))
    n = next(len(v) for a, v in values if a.type.kind() == "ListType")
    outs = []
    for i in range(n):
        pos: list[Any] = []
        kw: dict[str, Any] = {}
        for a, v in values:
            if a.type.kind() == "ListType":
                v = v[i]
            elif a.name == "scalars" and isinstance(v, torch.Tensor):
                v = v[i]  # addcmul/addcdiv's per-element factors, as a 1-D tensor
            if a.kwarg_only:
                kw[a.name] = v
            else:
                pos.append(v)
        outs.append(_foreach_one(base, pos, kw))
    if inplace:
        for a, v in values:
            if a.name == "self":
                for dst, r in zip(v, outs):
                    aten.copy_(dst, r)
        return None
    return outs


def _foreach_one(base: str, pos: list[Any], kw: dict[str, Any]) -> Any:
    aten = torch.ops.aten
    if base in ("addcmul", "addcdiv") and len(pos) == 4:
        # The factor is positional here, keyword-only in ATen's op; a tensor's element is
        # no Scalar, so that form is written out.
        x, t1, t2, s = pos
        if not isinstance(s, torch.Tensor):
            return getattr(aten, base)(x, t1, t2, value=s)
        inner = aten.mul(t1, t2) if base == "addcmul" else aten.div(t1, t2)
        return aten.add(x, aten.mul(inner, s))
    special = _FOREACH_BASES.get(base)
    if special is not None:
        return special(*pos, **kw)
    return getattr(aten, base)(*pos, **kw)


def _scalar_or(tensor_op: str, scalar_op: str) -> Callable[..., Any]:
    def f(x: Any, y: Any) -> Any:
        op = tensor_op if isinstance(y, torch.Tensor) else scalar_op
        return getattr(torch.ops.aten, op)(x, y)

    return f


# The ``_foreach_*`` ops whose per-tensor op is not ATen's op of the same name.
_FOREACH_BASES: dict[str, Callable[..., Any]] = {
    "norm": lambda x, ord=2, dtype=None: torch.ops.aten.linalg_vector_norm(
        x, ord, None, False, dtype=dtype
    ),
    "powsum": lambda x, ord=2, dtype=None: torch.ops.aten.sum(
        torch.ops.aten.pow(torch.ops.aten.abs(x), ord), dtype=dtype
    ),
    "zero": lambda x: torch.ops.aten.zeros_like(x),
    "max": lambda x: torch.ops.aten.max.default(x),
    "maximum": _scalar_or("maximum", "clamp_min"),
    "minimum": _scalar_or("minimum", "clamp_max"),
}


def _attention_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` written with matmuls and a softmax, which autograd
    differentiates op by op. Masked-out scores become the dtype's lowest finite value (not
    -inf), so no infinity reaches the program."""
    if enable_gqa and key.size(-3) != query.size(-3):
        rep = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    if scale is None:
        scale = 1.0 / float(query.size(-1)) ** 0.5
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    lowest = torch.finfo(scores.dtype).min
    if is_causal:
        n, m = scores.size(-2), scores.size(-1)
        rows = torch.arange(n, device=scores.device).unsqueeze(-1)
        keep = rows >= torch.arange(m, device=scores.device)  # tril of ones(n, m)
        scores = scores.masked_fill(keep.logical_not(), lowest)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), lowest)
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return torch.matmul(probs, value)


def _unfuse_attention(gm: torch.fx.GraphModule) -> None:
    """Replaces, in Dynamo's graph GM, calls of ``scaled_dot_product_attention`` by
    :func:`_attention_math`, for graphs that need gradients. On the CPU, PyTorch would
    dispatch them to its fused kernel, whose backward
    (``_scaled_dot_product_flash_attention_for_cpu_backward``) torch-mlir does not lower; the
    math form's backward is plain ATen. Inference graphs keep the fused op, whose forward
    torch-mlir lowers."""
    import torch.nn.functional as F

    targets = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in targets:
            n.target = _attention_math
            changed = True
    if changed:
        gm.recompile()


_PRECISION_OPS = ("stablehlo.dot_general", "stablehlo.convolution", "stablehlo.dot")


def _set_precision(module: Any, p: Precision) -> None:
    """Sets ``precision_config`` of every dot and convolution of MODULE (torch-mlir's MLIR
    Python bindings) to P, for both operands."""
    from torch_mlir import ir

    attr = ir.Attribute.parse(
        f"[#stablehlo<precision {p.value}>, #stablehlo<precision {p.value}>]",
        context=module.context,
    )

    def visit(op: Any) -> Any:
        if op.name in _PRECISION_OPS:
            op.attributes["precision_config"] = attr
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)


# torch-mlir writes every constant tensor of more than one element (a `torch.tensor([...])` of
# the model's code, an index table) as `dense_resource<NAME>`, its bytes in the module's
# `{-# dialect_resources: {builtin: {NAME: "0x<alignment><data>"}} #-}` block; the XLA
# plugins read only `dense<...>` ("UNIMPLEMENTED: Only dense elements attr are supported").
_RESOURCE_BLOCK = re.compile(
    r"\s*\{-#\s*dialect_resources:\s*\{\s*builtin:\s*\{(?P<body>.*?)\}\s*\}\s*#-\}\s*$", re.S
)
_RESOURCE_ENTRY = re.compile(r'("(?:[^"\\]|\\.)*"|[^\s:,"]+)\s*:\s*"0x([0-9A-Fa-f]*)"')
_RESOURCE_USE = re.compile(
    r'dense_resource<("(?:[^"\\]|\\.)*"|[^>\s]+)>(?P<type>\s*:\s*tensor<(?P<dims>[^>]*)>)?'
)


def _dense_constants(text: str) -> str:
    """TEXT (a module's asm) with every ``dense_resource<NAME>`` constant written as
    ``dense<"0x...">`` (its bytes, little-endian as the blob holds them; booleans as a literal:
    ``dense``'s hex form packs i1 into bits) and the resource block dropped once unused."""
    block = _RESOURCE_BLOCK.search(text)
    if block is None or "dense_resource<" not in text:
        return text
    blobs = {name: data[8:] for name, data in _RESOURCE_ENTRY.findall(block.group("body"))}
    head = text[: block.start()]

    def dense(m: Any) -> str:
        data = blobs.get(m.group(1))
        if data is None:
            return m.group(0)
        if not data:  # no elements
            return f"dense<>{m.group('type') or ''}"
        dims = m.group("dims")
        if dims is not None and dims.split("x")[-1] == "i1":
            shape = [int(d) for d in dims.split("x")[:-1]]
            values = np.frombuffer(bytes.fromhex(data), np.uint8).astype(bool).reshape(shape)
            literal = str(values.tolist()).replace("True", "true").replace("False", "false")
            return f"dense<{literal}>{m.group('type')}"
        return f'dense<"0x{data}">{m.group("type") or ""}'

    head = _RESOURCE_USE.sub(dense, head)
    if "dense_resource<" in head:
        return head + text[block.start():]
    return head + "\n"


def _module_text(module: Any, p: Precision) -> str:
    """MODULE's StableHLO text, every dot and convolution at precision P, constants dense."""
    _set_precision(module, p)
    return _dense_constants(module.operation.get_asm(enable_debug_info=False))


class _Program:
    """One ATen-level FX graph lowered to StableHLO: its text per precision, its executables per
    session and precision, and how its inputs and outputs map to the program's."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str, name: str, opts: _Options):
        self.kind = kind
        self.name = name
        self.opts = opts
        self._lock = threading.Lock()
        self._texts: dict[Precision, str] = {}
        self._exes: weakref.WeakKeyDictionary[Session, dict[Precision, Executable]] = (
            weakref.WeakKeyDictionary()
        )
        graph = gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        (out_node,) = [n for n in graph.nodes if n.op == "output"]
        outs = out_node.args[0]
        self.tuple_out = isinstance(outs, (tuple, list))
        outs = list(outs) if self.tuple_out else [outs]
        # Each output: ("program", j) the program's j-th result, ("input", i) the i-th input as
        # it is, ("const", value) a Python value or None.
        self.out_map: list[tuple[str, Any]] = []
        prog_outs: list[Any] = []
        index_of_placeholder = {n: i for i, n in enumerate(placeholders)}
        for o in outs:
            if isinstance(o, torch.fx.Node) and o in index_of_placeholder:
                self.out_map.append(("input", index_of_placeholder[o]))
            elif isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
                if o in prog_outs:
                    self.out_map.append(("program", prog_outs.index(o)))
                else:
                    self.out_map.append(("program", len(prog_outs)))
                    prog_outs.append(o)
            elif isinstance(o, torch.fx.Node):
                raise Unsupported(
                    "unsupported",
                    f"tpubox backend: graph {name} returns a {type(o.meta.get('val')).__name__} "
                    f"({o.format_node()}); only tensors can come back",
                )
            else:
                self.out_map.append(("const", o))
        # Inputs: tensors are the program's parameters; Python numbers in the graph (static
        # shapes) must be those it was traced with.
        self.in_tensor: list[bool] = []
        for p in placeholders:
            v = p.meta.get("val")
            if isinstance(v, torch.Tensor):
                if any(not isinstance(d, int) for d in v.shape):
                    raise Unsupported(
                        "unsupported",
                        f"tpubox backend: graph {name} has symbolic sizes {tuple(v.shape)}",
                    )
                self.in_tensor.append(True)
            else:
                self.in_tensor.append(False)
        self.n_results = len(prog_outs)
        # (shape, stride, dtype) of each program result, for results that stay on the device.
        self.out_specs = [_spec(o.meta["val"]) for o in prog_outs]
        self._module: Any = None
        self.context_lock = threading.Lock()
        self._lower_lock = threading.Lock()
        # The graph torch-mlir lowers (until it has), and its digest in the lowering cache.
        self._to_lower: torch.fx.GraphModule | None = None
        self._digest: str | None = None
        self.gm = gm
        if self.n_results:
            self._to_lower = self._restricted(gm, prog_outs)
            if _lowering_cache.enabled():
                self._digest = _lowering_cache.graph_digest(
                    self._to_lower, (_Program, _set_precision, _module_text, _dense_constants)
                )
            # The text at the precision in force now: from the lowering cache, else lowered
            # here (so that a graph torch-mlir cannot lower fails when Dynamo compiles it).
            self.text(current_precision())
        _count("graphs")

    @property
    def module(self) -> Any:
        """The StableHLO module (torch-mlir's Python object) of the graph, lowered on first
        use; None for a program without results."""
        with self._lower_lock:
            if self._module is None and self._to_lower is not None:
                self._module = self._lower(self._to_lower)
                self._to_lower = None
            return self._module

    def _restricted(self, gm: torch.fx.GraphModule, prog_outs: list[Any]) -> torch.fx.GraphModule:
        """GM restricted to the tensor inputs and tensor results: the graph torch-mlir
        lowers."""
        g = torch.fx.Graph()
        env: dict[Any, Any] = {}
        for n in gm.graph.nodes:
            if n.op == "output":
                continue
            if n.op == "placeholder" and not isinstance(n.meta.get("val"), torch.Tensor):
                # A Python number: used as the constant it was traced with.
                env[n] = n.meta.get("val")
                continue
            new = g.node_copy(n, lambda x: env[x])
            env[n] = new
        g.output(tuple(env[o] for o in prog_outs))
        lowered = torch.fx.GraphModule(gm, g)
        lowered.graph.eliminate_dead_code()
        # Keep every tensor placeholder (eliminate_dead_code leaves placeholders).
        return lowered

    def _lower(self, lowered: torch.fx.GraphModule) -> Any:
        """The StableHLO module (torch-mlir's Python object) of LOWERED."""
        start = time.perf_counter()
        tm_fx = _torch_mlir()  # the first lowering of a process imports the importer
        try:
            return tm_fx.stateless_fx_import(lowered, output_type="stablehlo", model_name="main")
        except Exception as e:
            raise Unsupported(
                "unsupported",
                f"tpubox backend: torch-mlir could not lower {self.kind} graph {self.name} to "
                f"StableHLO: {type(e).__name__}: {str(e)[:2000]}",
            ) from e
        finally:
            _count("lowerings")
            _count("lowering_ms", round((time.perf_counter() - start) * 1000))

    def text(self, p: Precision) -> str:
        """The program's StableHLO text with every dot and convolution at precision P: from
        this object, else from the lowering cache (tpubox._lowering_cache), else lowered."""
        with self._lock:
            t = self._texts.get(p)
            if t is not None:
                return t
            key = None
            if self._digest is not None:
                key = _lowering_cache.entry_key(self._digest, self.kind, p.value)
                t = _lowering_cache.load(key, self.n_results)
                _count("lowering_cache_hits" if t is not None else "lowering_cache_misses")
            if t is None:
                module = self.module
                with self.context_lock:
                    t = _module_text(module, p)
                if key is not None:
                    _lowering_cache.store(key, t, self.n_results)
            self._texts[p] = t
            return t

    def executable(self, session: Session, p: Precision) -> Executable:
        """This program compiled in SESSION at precision P (compiled on first use)."""
        with self._lock:
            per = self._exes.get(session)
            exe = per.get(p) if per else None
        if exe is not None:
            return exe
        text = self.text(p)
        exe = session.compile(text, format="text", optimization_level=self.opts.optimization_level)
        _count("compiles")
        if self.opts.debug_callback is not None:
            self.opts.debug_callback(GraphInfo(self.name, self.kind, self.gm, text, p, exe))
        if len(exe.results) != self.n_results:
            raise TpuboxError(
                "internal",
                f"tpubox backend: graph {self.name} has {self.n_results} results, the daemon "
                f"compiled {len(exe.results)}",
            )
        with self._lock:
            self._exes.setdefault(session, {})[p] = exe
        return exe

    def __call__(self, args: Sequence[Any], weights: Callable[[Any], bool]) -> list[Any]:
        """Runs the program on ARGS (the graph's inputs); returns the graph's outputs."""
        outs: list[Any] = []
        if self.n_results:
            outs = self._run(args, weights)
        result = []
        for what, v in self.out_map:
            if what == "program":
                result.append(outs[v])
            elif what == "input":
                result.append(args[v])
            else:
                result.append(v)
        return result

    def _run(self, args: Sequence[Any], weights: Callable[[Any], bool]) -> list[Any]:
        if any(_eager.is_device_tensor(a) for a in args):
            return self._run_on_device(args)
        target = self.opts.target
        p = current_precision()
        for attempt in range(3):
            session = target.session()
            try:
                exe = self.executable(session, p)
                resident = _resident(session)
                call_args: list[Any] = []
                for a, is_tensor in zip(args, self.in_tensor):
                    if not is_tensor:
                        continue
                    if weights(a) or resident.known(a):
                        call_args.append(resident.put(session, a))
                    else:
                        call_args.append(_to_numpy(a))
                got = exe.call(*call_args, fetch=True)
                _count("executions")
                return [_from_numpy(np.asarray(r)) for r in got]
            except TpuboxError as e:
                if attempt == 2 or not _session_gone(session, e):
                    raise
                # The session ended (the daemon restarted, an idle timeout): start over in a
                # new one: its weights and executables are gone with it.
                _count("session_restarts")
                try:
                    session.close(timeout=2.0)
                except Exception:
                    pass
                target.wait(30.0)
        raise AssertionError("unreachable")


    def _run_on_device(self, args: Sequence[Any]) -> list[Any]:
        """Runs the program on device tensors (a model moved with ``model.to(device())``): in
        the device tensors' session, their device values as the arguments (nothing through the
        host), launched without waiting (the eager modes' ``launch``); the results are device
        tensors holding the launch's pending outputs. CPU tensors among ARGS travel inline."""
        session = _eager._current_session()
        exe = self.executable(session, current_precision())
        call_args: list[Any] = []
        for a, is_tensor in zip(args, self.in_tensor):
            if not is_tensor:
                continue
            if _eager.is_device_tensor(a):
                call_args.append(_eager._concrete(_eager._value(a)))
            else:
                call_args.append(_to_numpy(a))
        outs = _eager._launch(exe, call_args, send_now=True)
        if _eager.eager_mode() is _eager.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING and outs:
            session._wait([o.handle for o in outs], False, None)
        _count("executions")
        _count("device_executions")
        return [_eager._wrap(o, spec) for o, spec in zip(outs, self.out_specs)]


_GONE_KINDS = {"session-ended", "unavailable", "unauthenticated"}


def _session_gone(session: Session, e: TpuboxError) -> bool:
    return session.closed or e.kind in _GONE_KINDS


# ---------------------------------------------------------------------------------------------
# The backend


_GRAPH_IDS = itertools.count(1)


def _is_static_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and all(isinstance(d, int) for d in t.shape)


def _has_symbols(example_inputs: Sequence[Any]) -> bool:
    for x in example_inputs:
        if isinstance(x, torch.SymInt) or isinstance(x, torch.SymFloat):
            return True
        if isinstance(x, torch.Tensor) and not _is_static_tensor(x):
            return True
    return False


class _Weights:
    """Which runtime inputs are parameters or buffers: ``nn.Parameter`` s, and the tensors
    Dynamo lifted from modules (identity, through weak references)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
        self._refs: dict[int, weakref.ref] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for n, x in zip(placeholders, example_inputs):
            if not isinstance(x, torch.Tensor) or isinstance(x, torch.nn.Parameter):
                continue
            if _is_module_state(n):
                try:
                    self._refs[id(x)] = weakref.ref(x)
                except TypeError:
                    pass

    def __call__(self, t: Any) -> bool:
        if isinstance(t, torch.nn.Parameter):
            return True
        r = self._refs.get(id(t))
        return r is not None and r() is t


def _is_module_state(node: Any) -> bool:
    """Whether Dynamo took placeholder NODE from a module's parameters or buffers."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    name = ""
    if source is not None:
        try:
            name = source.name()
        except Exception:
            name = str(source)
    name = name or node.name
    return "_parameters" in name or "_buffers" in name or "parameters_" in name or (
        "buffers_" in name
    )


def _lift_device_state(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[Any]]:
    """A copy of GM whose attributes that are device tensors are its first inputs, and those
    tensors, in the order of the new placeholders (GM's graph is Dynamo's: left as it is);
    GM itself and no tensor when it has no such attribute.

    Dynamo installs the tensors a compiled function reads from outside its arguments as GM's
    attributes when it may (``opt.step()`` compiled: the optimizer's parameters). A device
    tensor has no inner tensors, which aot_autograd takes for already fake, so it cannot fake
    one found among GM's parameters; as an input, the backend fakes it (``_aot``), and
    aot_autograd writes the step's in-place updates back into it (a device value rebound, no
    copy)."""

    def device_attr(n: Any, owner: torch.fx.GraphModule) -> bool:
        return n.op == "get_attr" and _eager.is_device_tensor(_attr(owner, str(n.target)))

    if not any(device_attr(n, gm) for n in gm.graph.nodes):
        return gm, []
    graph = torch.fx.Graph()
    env: dict[Any, Any] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for old, new in env.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    gm = copied
    nodes = [n for n in gm.graph.nodes if device_attr(n, gm)]
    first = next(iter(gm.graph.nodes))
    sources = dict(getattr(gm, "_param_name_to_source", None) or {})
    lifted: list[Any] = []
    by_target: dict[str, Any] = {}
    for n in nodes:
        target = str(n.target)
        ph = by_target.get(target)
        if ph is None:
            with gm.graph.inserting_before(first):
                ph = gm.graph.placeholder(f"lifted_{len(lifted)}")
            ph.meta.update(n.meta)
            # aot_autograd reads each Dynamo placeholder's source (for its guards).
            ph._dynamo_source = sources.pop(target, None)  # type: ignore[attr-defined]
            by_target[target] = ph
            lifted.append(_attr(gm, target))
        n.replace_all_uses_with(ph)
        gm.graph.erase_node(n)
    for target in by_target:
        owner, _, leaf = target.rpartition(".")
        mod = gm.get_submodule(owner) if owner else gm
        if leaf in mod._parameters:
            del mod._parameters[leaf]
        elif leaf in mod._buffers:
            del mod._buffers[leaf]
        elif hasattr(mod, leaf):
            delattr(mod, leaf)
    if hasattr(gm, "_param_name_to_source"):
        gm._param_name_to_source = sources
    gm.graph.lint()
    gm.recompile()
    return gm, lifted


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    """GM's attribute at the dotted path TARGET (a ``get_attr`` node's), or None."""
    v: Any = gm
    for part in target.split("."):
        v = getattr(v, part, None)
        if v is None:
            return None
    return v


def _host_devices(gm: torch.fx.GraphModule) -> None:
    """Rewrites the tpubox device in GM's ops (a factory's ``device=`` in a graph traced from
    device tensors, ``scalar_tensor(0, device=tpubox)``) to the CPU, which is the device
    torch-mlir knows: where a value is computed is the program's, not the op's, business."""

    def fix(v: Any) -> Any:
        if isinstance(v, torch.device) and v.type == _eager._DEVICE.type:
            return torch.device("cpu")
        return v

    changed = False
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        args = tuple(fix(a) for a in n.args)
        kwargs = {k: fix(v) for k, v in n.kwargs.items()}
        if args != n.args or kwargs != n.kwargs:
            n.args, n.kwargs = args, kwargs
            changed = True
    if changed:
        gm.recompile()


def _aot(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: _Options, weights: _Weights
) -> Any:
    """GM through aot_autograd, with forward, backward and inference graphs lowered to
    StableHLO and run on the daemon."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    gid = next(_GRAPH_IDS)

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_graph(g: torch.fx.GraphModule, _inputs: Sequence[Any]) -> Any:
            _host_devices(g)
            prog = _Program(g, kind, f"{opts.name}/{gid}/{kind}", opts)

            def run(*args: Any) -> list[Any]:
                return prog(args, weights)

            return make_boxed_func(run)

        return compile_graph

    def forward_compiler(g: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
        return compiler("forward")(g, inputs)

    # Device tensors (a model moved with `model.to(device())`) have no inner tensors to fake,
    # which aot_autograd would take for already fake: fake each as a plain tensor of its spec
    # on the tpubox device (what Dynamo traced), in the fake mode of the trace.
    if any(_eager.is_device_tensor(x) for x in example_inputs):
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode()
        example_inputs = [
            _eager._fake_of(x, fake_mode) if _eager.is_device_tensor(x) else x
            for x in example_inputs
        ]
    return aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=_decompositions(),
        keep_inference_input_mutations=False,
    )(gm, example_inputs)


def _is_item(n: Any) -> bool:
    return (n.op == "call_method" and n.target == "item") or (
        n.op == "call_function"
        and n.target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
    )


def _scalar_inputs(gm: torch.fx.GraphModule) -> set[int]:
    """The indices of GM's placeholders that are Python numbers Dynamo did not specialize
    (``specialize_float=False``: with ``dynamic=True``, a module's ``dropout.p``): a tensor
    the graph reads only with ``.item()``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {
        i for i, n in enumerate(placeholders) if n.users and all(_is_item(u) for u in n.users)
    }


def _with_scalars(gm: torch.fx.GraphModule, values: Mapping[int, Any]) -> torch.fx.GraphModule:
    """GM with the ``.item()`` of each placeholder of VALUES (index -> number) replaced by the
    number: static programs are specialized on it, as on sizes (aot_autograd's fake mode of
    concrete inputs has no shape environment for a data-dependent scalar)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = {placeholders[i]: v for i, v in values.items()}
    g = torch.fx.Graph()
    env: dict[Any, Any] = {}
    for n in gm.graph.nodes:
        if _is_item(n) and n.args and n.args[0] in fixed:
            env[n] = fixed[n.args[0]]
            continue
        env[n] = g.node_copy(n, lambda x: env[x])
    return torch.fx.GraphModule(gm, g)


class _Specialized:
    """A Dynamo graph with symbolic sizes, run as static programs: one per concrete signature
    of its inputs (the values of the Python numbers Dynamo left unspecialized included), each
    traced by aot_autograd with those inputs."""

    def __init__(self, gm: torch.fx.GraphModule, opts: _Options, weights: _Weights):
        self.gm = gm
        self.opts = opts
        self.weights = weights
        self.scalars = _scalar_inputs(gm)
        self._lock = threading.Lock()
        self._by_sig: dict[tuple, Any] = {}

    def _signature(self, args: Sequence[Any]) -> tuple:
        sig = []
        for i, a in enumerate(args):
            if i in self.scalars and isinstance(a, torch.Tensor):
                sig.append(("s", a.dtype, a.item()))
            elif isinstance(a, torch.Tensor):
                sig.append(("t", tuple(a.shape), tuple(a.stride()), a.dtype, a.requires_grad))
            else:
                sig.append(("v", type(a).__name__, a))
        return tuple(sig)

    def __call__(self, *args: Any) -> Any:
        sig = self._signature(args)
        with self._lock:
            fn = self._by_sig.get(sig)
        if fn is None:
            # Outside Dynamo's compile: a tracing context of its own, so that aot_autograd
            # fakes these concrete inputs in a fake mode of its own (static sizes).
            gm = self.gm
            if self.scalars:
                values = {
                    i: args[i].item() for i in self.scalars if isinstance(args[i], torch.Tensor)
                }
                gm = _with_scalars(gm, values)
            with torch._guards.tracing(None):
                fn = _aot(gm, list(args), self.opts, self.weights)
            _count("specializations")
            with self._lock:
                self._by_sig[sig] = fn
        return fn(*args)


def bucket_of(size: int, lo: int | None, hi: int | None, buckets: int, bucket_size: int) -> int:
    """The bucket SIZE falls in, as the size its program is compiled for (TorchTPU's bounded
    dynamism): with an upper bound HI (``mark_dynamic(t, dim, min=LO, max=HI)``), BUCKETS
    buckets whose upper edges divide ``(LO, HI]`` evenly (rounded up; LO defaults to 0); without
    one, the next multiple of BUCKET_SIZE. A size above HI is its own bucket (Dynamo guards
    the bound, so it does not reach here marked).

    >>> bucket_of(20, 2, 64, 4, 128), bucket_of(3, None, None, 1, 8)
    (33, 8)
    """
    if hi is not None and size <= hi:
        lo = max(0, lo or 0)
        for k in range(1, buckets + 1):
            edge = lo + -(-(hi - lo) * k // buckets)
            if size <= edge:
                return edge
        return hi
    if hi is not None:
        return size
    return -(-size // bucket_size) * bucket_size


class _Buckets:
    """The dimensions of a graph's inputs marked dynamic with ``torch._dynamo.mark_dynamic``,
    run padded to their bucket (:func:`bucket_of`) and sliced back.

    Each marked dimension is a size symbol of Dynamo's graph. At a call, every input dimension
    and size argument that is that symbol is padded with zeros (or set) to the bucket's size,
    the program for that padded signature runs (one per bucket), and each output dimension is
    cut back to the size its symbolic shape gives for the real sizes. Padding is zeros: rows of
    a batch are independent, and a model that attends or reduces over a padded dimension must
    take a mask that is padded too (a Hugging Face ``attention_mask`` marked dynamic in the
    same dimension: its zeros keep the padding out).
    """

    def __init__(
        self,
        dims: dict[Any, list[tuple[int, int]]],
        sizes: dict[int, Any],
        marked: dict[Any, tuple[int | None, int | None]],
        outputs: list[list[Any] | None],
        opts: _Options,
    ):
        self.dims, self.sizes, self.marked, self.outputs = dims, sizes, marked, outputs
        self.opts = opts

    @classmethod
    def of(
        cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: _Options
    ) -> "_Buckets | None":
        """The buckets of GM, or None when no input dimension is marked dynamic (or a size
        is an expression the padding cannot follow)."""
        from torch._dynamo.decorators import _get_dim_range

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        dims: dict[Any, list[tuple[int, int]]] = {}
        sizes: dict[int, Any] = {}
        marked: dict[Any, tuple[int | None, int | None]] = {}
        for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
            if isinstance(x, torch.SymInt):
                if not x.node.expr.is_Symbol:
                    return None
                sizes[i] = x.node.expr
                continue
            if not isinstance(x, torch.Tensor):
                continue
            # Dynamo hands the backend real tensors; their symbolic sizes are on the graph's
            # placeholders (fake tensors).
            fake = node.meta.get("example_value")
            if not isinstance(fake, torch.Tensor):
                continue
            try:
                real = node.meta["grapharg"].example
            except (KeyError, AttributeError, AssertionError):
                real = x
            indices = getattr(real, "_dynamo_dynamic_indices", set())
            for d, n in enumerate(fake.shape):
                if not isinstance(n, torch.SymInt):
                    continue
                e = n.node.expr
                if not e.is_Symbol:
                    return None
                dims.setdefault(e, []).append((i, d))
                if d in indices:
                    r = _get_dim_range(real, d)
                    marked[e] = (r.min, r.max) if r is not None else (None, None)
        if not marked:
            return None
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        outputs: list[list[Any] | None] = []
        for o in out if isinstance(out, (tuple, list)) else (out,):
            v = o.meta.get("example_value") if isinstance(o, torch.fx.Node) else None
            if isinstance(v, torch.Tensor):
                outputs.append(
                    [n.node.expr if isinstance(n, torch.SymInt) else int(n) for n in v.shape]
                )
            else:
                outputs.append(None)
        return cls(dims, sizes, marked, outputs, opts)

    def pad(self, args: Sequence[Any]) -> tuple[list[Any], dict[Any, int]]:
        """ARGS padded to their buckets, and the real value of every size symbol."""
        values: dict[Any, int] = {}
        for sym, where in self.dims.items():
            i, d = where[0]
            values[sym] = int(args[i].shape[d])
        for i, sym in self.sizes.items():
            values.setdefault(sym, int(args[i]))
        padded = list(args)
        for sym, (lo, hi) in self.marked.items():
            v = values[sym]
            b = bucket_of(v, lo, hi, self.opts.num_dynamic_buckets, self.opts.bucket_size)
            if b == v:
                continue
            for i, d in self.dims.get(sym, []):
                t = padded[i]
                extra = list(t.shape)
                extra[d] = b - t.shape[d]
                padded[i] = torch.cat([t, t.new_zeros(extra)], dim=d)
            for i, s in self.sizes.items():
                if s == sym:
                    padded[i] = b
        return padded, values

    def cut(self, outs: Any, values: dict[Any, int]) -> Any:
        """Each output cut back to the shape its symbolic shape gives for VALUES."""
        import sympy

        subs = {k: sympy.Integer(v) for k, v in values.items()}
        cut = list(outs)
        for j, shape in enumerate(self.outputs):
            if shape is None or j >= len(cut) or not isinstance(cut[j], torch.Tensor):
                continue
            want = [int(e.xreplace(subs)) if not isinstance(e, int) else e for e in shape]
            if list(cut[j].shape) != want:
                cut[j] = cut[j][tuple(slice(0, n) for n in want)]
        return type(outs)(cut) if isinstance(outs, tuple) else cut


class _Bucketed:
    """A graph with ``mark_dynamic`` dimensions: run padded to buckets (:class:`_Buckets`),
    each bucket a static program of :class:`_Specialized`."""

    def __init__(self, inner: _Specialized, buckets: _Buckets):
        self.inner, self.buckets = inner, buckets

    def __call__(self, *args: Any) -> Any:
        padded, values = self.buckets.pad(args)
        return self.buckets.cut(self.inner(*padded), values)


def backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The TorchDynamo backend ``"tpubox"``: compiles Dynamo's graph GM for the tpubox
    daemon's device.

    Used through ``torch.compile(model, backend="tpubox", options={...})`` (see the module doc
    for the options); ``torch.compile(model, backend=tpubox.torch.backend)`` works too.

    Returns:
        A callable with GM's signature: forward (and, when gradients are needed, backward)
        run as StableHLO programs in the session; results are CPU tensors.

    Raises:
        ValueError: an unknown option or value; tpubox.Unsupported: a TorchTPU option at a
        value tpubox does not support, a graph torch-mlir cannot lower (at compile time), a
        graph output that is not a tensor.
    """
    if mode not in (None, "default"):
        raise Unsupported(
            "unsupported", f"tpubox backend: torch.compile mode={mode!r} is not supported"
        )
    opts = _Options(options)
    gm, lifted = _lift_device_state(gm)
    if lifted:
        # The live tensors go first, each call: their values change (an optimizer's step
        # rebinds them), the tensors themselves do not (Dynamo guards on them).
        inner = backend(gm, [*lifted, *example_inputs], options, mode)

        def with_state(*args: Any) -> Any:
            return inner(*lifted, *args)

        return with_state
    weights = _Weights(gm, example_inputs)
    if torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    ):
        _unfuse_attention(gm)
    if _has_symbols(example_inputs):
        buckets = _Buckets.of(gm, example_inputs, opts)
        inner = _Specialized(gm, opts, weights)
        return inner if buckets is None else _Bucketed(inner, buckets)
    return _aot(gm, example_inputs, opts, weights)


# ---------------------------------------------------------------------------------------------
# Exporting a model for `tpubox serve`'s model repository (docs/SERVING.md, "StableHLO models").


def _batched_like(x: Any, b: int | None) -> Any:
    """An input like example X with batch size B (zeros; only shapes and dtypes are traced)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"tpubox.torch.export: example inputs must be tensors, not {type(x).__name__}"
        )
    if b is None:
        return torch.zeros_like(x)
    if x.dim() == 0:
        raise ValueError("tpubox.torch.export: an example input without a batch dimension")
    return torch.zeros((b,) + tuple(x.shape[1:]), dtype=x.dtype)


def export(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    repo: Any,
    name: str,
    batch_sizes: Sequence[int] | None = (1, 2, 4, 8),
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    precision: Precision | str | None = None,
    instance_count: int = 1,
    max_queue_delay_microseconds: int = 1000,
    dynamic_batching: bool = True,
) -> Any:
    """Exports ``model(*inputs)`` as a StableHLO model that ``tpubox serve`` serves from the model
    repository REPO without a guest, as :func:`tpubox.jax.export_model` does for JAX: writes
    ``REPO/NAME/`` with one program per batch size (``model.b{N}.mlir``: StableHLO text lowered
    by torch-mlir from ``torch.export``'s ATen graph), the weights (``weights.safetensors``: the
    parameters, buffers and constant tensors the graph lifts, by their names in the module,
    ``fc1.weight``) and ``config.toml`` (Triton's field names, and the ``[tpubox.stablehlo]``
    table mapping the programs' parameters to weights and inputs, their results to outputs).

    The model is traced in the mode it is in: call ``model.eval()`` first for inference.

    Args:
        model: the module.
        example_inputs: one tensor per positional input, batch dimension first; only their
            shapes after the batch dimension and dtypes are used. With ``batch_sizes=None``
            the shapes are exported as they are (``max_batch_size = 0``, one program).
        repo: the model repository directory (created if missing).
        name: the model's name, its directory under REPO (must not exist yet, or be empty).
        batch_sizes: the batch sizes to export a program for; the largest is the model's
            ``max_batch_size``.
        input_names, output_names: the names in the protocol (default ``input_0``, ...,
            ``output_0``, ...; outputs are the model's tensors, flattened in order).
        precision: the matmul/convolution :class:`Precision` of the programs (default
            :func:`current_precision`).
        instance_count: instances of the model (``[[instance_group]] count``).
        max_queue_delay_microseconds: how long a request waits for others to batch with.
        dynamic_batching: write a ``[dynamic_batching]`` table (batching models only).

    Returns:
        The model directory (a ``pathlib.Path``).

    Raises:
        ValueError: a bad name, batch size or name count, an existing non-empty directory, an
            output without the batch dimension; tpubox.Unsupported: a dtype the protocol lacks,
            a graph torch-mlir cannot lower, a model that updates its buffers (training mode).
    """
    caller = "tpubox.torch.export"
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"{caller}: {name!r} cannot name a model directory")
    batched = batch_sizes is not None
    sizes: list[Any] = sorted({int(b) for b in batch_sizes}) if batched else [None]  # type: ignore
    if batched and (not sizes or sizes[0] < 1):
        raise ValueError(f"{caller}: batch sizes must be at least 1")
    example_inputs = list(example_inputs)
    in_names = list(input_names) if input_names is not None else [
        f"input_{i}" for i in range(len(example_inputs))
    ]
    if len(in_names) != len(example_inputs) or len(set(in_names)) != len(in_names):
        raise ValueError(
            f"{caller}: {len(in_names)} input names (distinct) for {len(example_inputs)} inputs"
        )
    p = _as_precision(precision) if precision is not None else current_precision()
    from torch.export.graph_signature import InputKind, OutputKind

    programs: list[tuple[int | None, str, list[Any], list[Any]]] = []
    weight_names: list[str] | None = None
    weights: dict[str, np.ndarray] = {}
    for b in sizes:
        args = tuple(_batched_like(x, b) for x in example_inputs)
        ep = torch.export.export(model, args, strict=False).run_decompositions(_decompositions())
        sig = ep.graph_signature
        if any(o.kind != OutputKind.USER_OUTPUT for o in sig.output_specs):
            raise Unsupported(
                "unsupported",
                f"{caller}: the model updates its buffers or inputs (training mode?); "
                "call model.eval() first",
            )
        names = []
        for spec in sig.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                continue
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                raise Unsupported("unsupported", f"{caller}: a graph input of kind {spec.kind}")
            t = ep.state_dict.get(spec.target)
            if t is None:
                t = ep.constants[spec.target]
            names.append(spec.target)
            weights[spec.target] = _to_numpy(t)
        kinds = [s.kind for s in sig.input_specs]
        if kinds != sorted(kinds, key=lambda k: k == InputKind.USER_INPUT):
            raise Unsupported(
                "unsupported", f"{caller}: weights and inputs interleave in the graph"
            )
        if weight_names is None:
            weight_names = names
        elif names != weight_names:
            raise Unsupported("unsupported", f"{caller}: batch size {b} lifts other weights")
        prog = _Program(ep.graph_module, "export", f"{name}/b{b}", _Options(None))
        if any(what != "program" for what, _ in prog.out_map) or not prog.n_results:
            raise Unsupported(
                "unsupported", f"{caller}: every output must be a tensor the program computes"
            )
        placeholders = [n for n in ep.graph_module.graph.nodes if n.op == "placeholder"]
        user_vals = [n.meta["val"] for n in placeholders[len(names):]]
        out_node = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
        outs = out_node.args[0]
        outs = outs if isinstance(outs, (tuple, list)) else [outs]
        out_vals = [o.meta["val"] for o in outs]
        with prog.context_lock:
            text = _module_text(prog.module, p)
        programs.append((b, text, user_vals, out_vals))
    assert weight_names is not None
    out_names = list(output_names) if output_names is not None else [
        f"output_{i}" for i in range(len(programs[0][3]))
    ]
    if len(out_names) != len(programs[0][3]) or len(set(out_names)) != len(out_names):
        raise ValueError(
            f"{caller}: {len(out_names)} output names for {len(programs[0][3])} outputs"
        )

    def dims(v: Any, b: int | None, what: str) -> list[int]:
        return _export.unbatched_dims(v.shape, b, what, caller)

    def triton_type(v: Any, what: str) -> str:
        dtype = _to_numpy(torch.empty((), dtype=v.dtype)).dtype
        return _export.export_dtype(dtype, what, caller)[1]

    b0, _, in_vals0, out_vals0 = programs[0]
    inputs = [
        (n, triton_type(v, f"input {n!r}"), dims(v, b0, f"input {n!r}"))
        for n, v in zip(in_names, in_vals0)
    ]
    outputs = [
        (n, triton_type(v, f"output {n!r}"), dims(v, b0, f"output {n!r}"))
        for n, v in zip(out_names, out_vals0)
    ]
    for b, _, _, out_vals in programs[1:]:
        for n, v in zip(out_names, out_vals):
            dims(v, b, f"output {n!r}")
    model_dir = _export.check_model_dir(repo, name, caller)
    _export.write_safetensors(
        model_dir / "weights.safetensors", {n: weights[n] for n in weight_names}, caller
    )
    files = []
    for b, text, _, _ in programs:
        file = f"model.b{b}.mlir" if b is not None else "model.mlir"
        (model_dir / file).write_text(text)
        files.append((b, file))
    config = _export.config_toml(
        writer=caller,
        name=name,
        max_batch_size=int(sizes[-1]) if batched else 0,
        inputs=inputs,
        outputs=outputs,
        weight_names=weight_names,
        programs=files,
        instance_count=instance_count,
        max_queue_delay_microseconds=(
            max_queue_delay_microseconds if batched and dynamic_batching else None
        ),
    )
    (model_dir / "config.toml").write_text(config)
    return model_dir


def _register() -> None:
    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    if registry._BACKENDS.get(BACKEND_NAME) is not None:
        # Dynamo found the entry point and is loading it (this import): it registers
        # `backend` itself once the import returns.
        return
    registry.register_backend(compiler_fn=backend, name=BACKEND_NAME)


_register()


# Eager tensors on the device, in TorchTPU's eager modes (tpubox.torch_eager; docs/PYTORCH.md).
from . import torch_eager as _eager  # noqa: E402
from .torch_eager import (  # noqa: E402
    CpuFallbackWarning,
    EagerMode,
    cpu_fallback_ops,
    device,
    eager_mode,
    eager_stats,
    is_device_tensor,
    mark_step,
    max_fused_ops,
    reset_eager_stats,
    set_eager_mode,
    set_max_fused_ops,
)

# The torch.distributed backend "tpubox" (tpubox.distributed; docs/DISTRIBUTED.md).
from . import distributed as _distributed  # noqa: E402

_distributed.register()
