"""What tpubox.torch's jobs share (the Dynamo backend, eager tensors, export): the lowering of
an ATen-level FX graph to StableHLO by torch-mlir (:class:`_Program`: its text per precision,
its executables per session), the precision of dots and convolutions, the backend's options and
statistics, and tensors to and from NumPy. It imports none of the other modules of the package.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import re
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes
import numpy as np
import torch

from .. import _lowering_cache
from .. import session as _session
from ..errors import TpuboxError, Unsupported
from ..session import Executable, Session

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
    "partitioned_graphs",  # graphs split because some of their nodes do not lower
    "cpu_fallback_nodes",  # nodes of those run in PyTorch on the CPU
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
    ``lowerings`` (graphs torch-mlir lowered) and ``lowering_ms`` (the milliseconds it took),
    ``partitioned_graphs`` (graphs split because some nodes do not lower) and
    ``cpu_fallback_nodes`` (their nodes run on the CPU; :func:`cpu_fallback_ops` names the ops).
    The lowering counters include the programs of eager device tensors."""
    with _STATS_LOCK:
        return {k: _STATS.get(k, 0) for k in _STAT_NAMES}


def reset_stats() -> None:
    """Sets every counter of :func:`stats` to zero and forgets :func:`cpu_fallback_ops`."""
    with _STATS_LOCK:
        _STATS.clear()
    _forget_fallbacks()


# ---------------------------------------------------------------------------------------------
# Ops run on the CPU for lack of a lowering (the backend's partitions and eager tensors)


class CpuFallbackWarning(UserWarning):
    """An ATen op without a lowering to the device ran on the CPU (named in the message): in
    the Dynamo backend, the graph's nodes of that op run in PyTorch between the programs of the
    rest; on eager device tensors, the op's operands are copied to the host and back."""


_FALLBACK_LOCK = threading.Lock()
_WARNED: set[str] = set()
_FELL_BACK: set[str] = set()


def _op_name(func: Any) -> str:
    """FUNC's name as :func:`cpu_fallback_ops` lists it: ``aten.nonzero``, ``aten.add.Scalar``."""
    try:
        return f"aten.{func._schema.name.split('::')[-1]}" + (
            f".{func._overloadname}" if func._overloadname != "default" else ""
        )
    except AttributeError:
        return getattr(func, "__name__", None) or str(func)


def cpu_fallback_ops() -> list[str]:
    """The distinct ATen ops (``aten.nonzero``) that ran on the CPU for lack of a lowering since
    :func:`reset_eager_stats` or :func:`reset_stats`, sorted: nodes the Dynamo backend left out
    of its programs (``stats()["cpu_fallback_nodes"]`` counts them) and eager ops
    (``eager_stats()["cpu_fallbacks"]``). Each warns (:class:`CpuFallbackWarning`) the first
    time in the process."""
    with _FALLBACK_LOCK:
        return sorted(_FELL_BACK)


def _fell_back(name: str, message: str, stacklevel: int = 3) -> None:
    """Notes that op NAME runs on the CPU; warns MESSAGE the first time in the process."""
    with _FALLBACK_LOCK:
        _FELL_BACK.add(name)
        if name in _WARNED:
            return
        _WARNED.add(name)
    warnings.warn(message, CpuFallbackWarning, stacklevel=stacklevel + 1)


def _forget_fallbacks() -> None:
    with _FALLBACK_LOCK:
        _FELL_BACK.clear()


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


_EMPTY = re.compile(
    r'^(?P<lhs>\s*%[\w.$#-]+ = )(?:tensor\.empty\(\)|"tensor\.empty"\(\) <?\{?\}?>?)'
    r"\s*:\s*(?:\(\)\s*->\s*)?tensor<(?P<dims>[^>?]*)>\s*$",
    re.M,
)


def _zero_literal(element: str) -> str | None:
    if element == "i1":
        return "false"
    if re.fullmatch(r"u?i\d+|si\d+", element):
        return "0"
    if re.fullmatch(r"f\d+|bf16|f\d+E\w+", element):
        return "0.000000e+00"
    if element.startswith("complex<"):
        return "(0.000000e+00,0.000000e+00)"
    return None


def _empty_tensors(text: str) -> str:
    """TEXT with each static ``tensor.empty()`` (what torch-mlir emits for ``aten.empty`` and
    the buffers some backward graphs start from; an uninitialized tensor, which the plugin's
    StableHLO import refuses: "'tensor.empty' op unsupported op for export to XLA") written as
    a ``stablehlo.constant`` of zeros: any value is a valid one for an uninitialized tensor."""
    if "tensor.empty" not in text:
        return text

    def zeros(m: Any) -> str:
        dims = m.group("dims")
        zero = _zero_literal(dims.split("x")[-1])
        if zero is None:
            return m.group(0)
        return f"{m.group('lhs')}stablehlo.constant dense<{zero}> : tensor<{dims}>"

    return _EMPTY.sub(zeros, text)


def _module_text(module: Any, p: Precision) -> str:
    """MODULE's StableHLO text, every dot and convolution at precision P, constants dense,
    no uninitialized tensors."""
    _set_precision(module, p)
    return _empty_tensors(_dense_constants(module.operation.get_asm(enable_debug_info=False)))


_STDERR_LOCK = threading.Lock()


@contextlib.contextmanager
def _mlir_diagnostics(into: list[str]) -> Iterator[None]:
    """Collects into INTO the ``error:`` lines MLIR's diagnostic handler writes to file
    descriptor 2 while the block runs (torch-mlir reports which op failed to legalize there,
    not in its exception); what else was written there is written back to it afterwards."""
    import os
    import sys
    import tempfile

    with _STDERR_LOCK:
        try:
            sys.stderr.flush()
        except Exception:
            pass
        saved = os.dup(2)
        with tempfile.TemporaryFile(mode="w+b") as f:
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                try:
                    sys.stderr.flush()
                except Exception:
                    pass
                os.dup2(saved, 2)
                os.close(saved)
                f.seek(0)
                text = f.read(1 << 20).decode("utf-8", "replace")
                rest = []
                for line in text.splitlines():
                    if line.startswith("error:") or line.lstrip().startswith("note:"):
                        into.append(line.strip()[:400])
                    elif line.strip():
                        rest.append(line)
                if rest:
                    os.write(2, ("\n".join(rest) + "\n").encode())


_INDEXING_OPS = ("index.Tensor", "index_put.default", "_unsafe_index.Tensor",
                 "_unsafe_index_put.default", "index_put_.default")  # fmt: skip


def _wrap_negative_indices(gm: torch.fx.GraphModule) -> None:
    """Rewrites GM so that the integer index tensors of ``aten.index`` and ``aten.index_put``
    (``x[..., [-2], :]``, ``x[idx] = v``) count from the end where negative, as PyTorch's
    kernels do: each becomes ``where(i < 0, i + size, i)`` with the size of the dimension it
    indexes. torch-mlir lowers them to a gather (scatter) that takes the index as it is, and
    XLA clamps an index out of range, so a negative one read the first row (Falcon's multi-query
    attention takes its key and value heads with ``[-2]`` and ``[-1]``)."""
    targets = set()
    for name in _INDEXING_OPS:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            targets.add(op)
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in targets or len(n.args) < 2:
            continue
        wrapped = False
        x, indices = n.args[0], n.args[1]
        xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not isinstance(xv, torch.Tensor) or not isinstance(indices, (list, tuple)):
            continue
        new_indices = list(indices)
        for d, i in enumerate(indices):
            iv = i.meta.get("val") if isinstance(i, torch.fx.Node) else None
            if not isinstance(iv, torch.Tensor) or iv.dtype in (torch.bool, torch.uint8):
                continue
            if iv.is_floating_point() or d >= xv.dim() or not isinstance(xv.shape[d], int):
                continue
            size = xv.shape[d]
            with gm.graph.inserting_before(n):
                neg = gm.graph.call_function(torch.ops.aten.lt.Scalar, (i, 0))
                neg.meta["val"] = torch.ops.aten.lt.Scalar(iv, 0)
                up = gm.graph.call_function(torch.ops.aten.add.Scalar, (i, size))
                up.meta["val"] = torch.ops.aten.add.Scalar(iv, size)
                w = gm.graph.call_function(torch.ops.aten.where.self, (neg, up, i))
                w.meta["val"] = torch.ops.aten.where.self(neg.meta["val"], up.meta["val"], iv)
            new_indices[d] = w
            wrapped = True
        if wrapped:
            n.args = (x, list(new_indices), *n.args[2:])
            changed = True
    if changed:
        gm.recompile()


def _slice_bounds(gm: torch.fx.GraphModule) -> None:
    """Writes the start and end of GM's ``aten.slice`` and ``aten.slice_scatter`` nodes as
    the indices they mean, within the dimension (``x[..., 8:]`` ends at ``2**63 - 1``; a
    negative bound counts from the end): torch-mlir's lowering of a ``slice_scatter`` whose end
    is ``2**63 - 1`` runs out of memory (``std::bad_alloc``; functionalized writes into a slice,
    as DeepSeek-V3's ``key_states[..., n:].copy_(...)``)."""
    ops = {torch.ops.aten.slice.Tensor: 1, torch.ops.aten.slice_scatter.default: 2}
    changed = False
    for n in gm.graph.nodes:
        first = ops.get(n.target) if n.op == "call_function" else None
        if first is None:
            continue
        xv = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
        if not isinstance(xv, torch.Tensor) or xv.dim() == 0:
            continue
        names = ("dim", "start", "end", "step")
        given = dict(zip(names, n.args[first:]))
        given.update({k: v for k, v in n.kwargs.items() if k in names})
        dim, start, end = given.get("dim", 0), given.get("start"), given.get("end")
        if not all(isinstance(v, int) or v is None for v in (dim, start, end)):
            continue
        dim = dim % xv.dim()
        size = xv.shape[dim]
        if not isinstance(size, int):
            continue

        def bound(v: int | None, default: int) -> int:
            if v is None:
                return default
            if v < 0:
                v += size
            return min(max(v, 0), size)

        s, e = bound(start, 0), bound(end, size)
        e = max(e, s)
        if (dim, s, e) == (given.get("dim", 0), start, end):
            continue
        n.args = (*n.args[:first], dim, s, e, given.get("step", 1))
        n.kwargs = {}
        changed = True
    if changed:
        gm.recompile()


class NotLowered(Unsupported):
    """torch-mlir could not lower a graph to StableHLO (the message says why), or its lowering
    holds a program the daemon's default policy refuses (a custom call)."""


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
            _wrap_negative_indices(self._to_lower)
            _slice_bounds(self._to_lower)
            if _lowering_cache.enabled():
                self._digest = _lowering_cache.graph_digest(
                    self._to_lower,
                    (
                        _Program,
                        _set_precision,
                        _module_text,
                        _dense_constants,
                        _empty_tensors,
                        _wrap_negative_indices,
                        _slice_bounds,
                    ),
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
        diagnostics: list[str] = []
        try:
            with _mlir_diagnostics(diagnostics):
                return tm_fx.stateless_fx_import(
                    lowered, output_type="stablehlo", model_name="main"
                )
        except Exception as e:
            said = "".join(f"\n{d}" for d in diagnostics[:8])
            raise NotLowered(
                "unsupported",
                f"tpubox backend: torch-mlir could not lower {self.kind} graph {self.name} to "
                f"StableHLO: {type(e).__name__}: {str(e)[:2000]}{said}",
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
