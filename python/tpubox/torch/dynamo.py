"""The TorchDynamo backend ``"tpubox"`` (``torch.compile(model, backend="tpubox")``): Dynamo's
graphs through aot_autograd, lowered (:mod:`tpubox.torch._lowering`), compiled and run in a
session; parameters kept on the device; symbolic sizes specialized or bucketed. The package's
doc (:mod:`tpubox.torch`) describes it.
"""

from __future__ import annotations

import itertools
import operator
import re
import threading
import weakref
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..errors import TpuboxError, Unsupported
from ..session import Session, Tensor
from . import eager as _eager
from ._lowering import (
    NotLowered,
    _count,
    _decompositions,
    _fell_back,
    _from_numpy,
    _op_name,
    _Options,
    _Program,
    _to_numpy,
    _unfuse_attention,
    current_precision,
)

#: The name ``torch.compile`` takes: ``torch.compile(model, backend="tpubox")``.
BACKEND_NAME = "tpubox"


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


class _GraphProgram(_Program):
    """A graph of the backend's: a :class:`_Program` run with the backend's tensors (CPU
    tensors, parameters kept on the device, or device tensors)."""

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


# ---------------------------------------------------------------------------------------------
# Graphs with nodes that do not lower: partitioned, the rest run in PyTorch on the CPU


def _compiled(
    g: torch.fx.GraphModule, kind: str, name: str, opts: _Options, weights: _Weights
) -> Callable[..., list[Any]]:
    """The function that runs ATen graph G: one program on the device; or, where torch-mlir
    cannot lower some of G's nodes (or lowers them to custom calls the daemon refuses), G
    partitioned (:class:`_Partitioned`): the nodes that lower run as programs, the others in
    PyTorch on the CPU."""
    try:
        prog = _GraphProgram(g, kind, name, opts)
        if prog.n_results and "custom_call" in prog.text(current_precision()):
            raise NotLowered(
                "unsupported",
                f"tpubox backend: {kind} graph {name}'s lowering holds a custom call",
            )
    except NotLowered as e:
        return _Partitioned(g, kind, name, opts, weights, e)

    def run(*args: Any) -> list[Any]:
        return prog(args, weights)

    return run


# (op, operand specs, constant arguments) -> None where the op lowers alone, else why not.
_LOWERS: dict[Any, str | None] = {}
_LOWERS_LOCK = threading.Lock()


def _value_key(v: Any) -> Any:
    if isinstance(v, torch.fx.Node):
        m = v.meta.get("val")
        if isinstance(m, torch.Tensor):
            return ("t", tuple(m.shape), tuple(m.stride()), m.dtype)
        return ("v", type(m).__name__, repr(m))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, dict):
        return tuple(sorted((k, _value_key(x)) for k, x in v.items()))
    return ("c", type(v).__name__, repr(v))


def _why_not_lowered(n: torch.fx.Node, owner: torch.fx.GraphModule, opts: _Options) -> str | None:
    """None where node N (a ``call_function`` of an ATen op) lowers to StableHLO on its own
    without a custom call; else why not. Memoized by the op, its operands' specs and its
    constant arguments."""
    key = (n.target, _value_key(n.args), _value_key(n.kwargs))
    with _LOWERS_LOCK:
        if key in _LOWERS:
            return _LOWERS[key]
    why = _probe(n, owner, opts)
    with _LOWERS_LOCK:
        _LOWERS[key] = why
    return why


def _probe(n: torch.fx.Node, owner: torch.fx.GraphModule, opts: _Options) -> str | None:
    g = torch.fx.Graph()
    env: dict[Any, Any] = {}
    for i, inp in enumerate(n.all_input_nodes):
        v = inp.meta.get("val")
        if v is None and inp.op == "get_attr":
            v = _attr(owner, inp.target)
        ph = g.placeholder(f"in{i}")
        ph.meta["val"] = v
        env[inp] = ph
    new = g.node_copy(n, lambda x: env[x])
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        outs = [new]
    elif isinstance(val, (tuple, list)):
        outs = []
        for j, v in enumerate(val):
            if isinstance(v, torch.Tensor):
                o = g.call_function(operator.getitem, (new, j))
                o.meta["val"] = v
                outs.append(o)
    else:
        return f"its result is a {type(val).__name__}, not a tensor"
    if not outs:
        return None  # nothing to compute on the device (its result is None or numbers)
    g.output(tuple(outs))
    try:
        prog = _Program(torch.fx.GraphModule(owner, g), "probe", f"probe/{_op_name(n.target)}", opts)
        _count("graphs", -1)  # a probe is not one of the backend's graphs
    except Unsupported as e:
        return _short_reason(e.message)
    if "custom_call" in prog.text(current_precision()):
        return "its lowering holds a custom call"
    return None


def _short_reason(message: str) -> str:
    """Why a lowering failed, in a line: MLIR's diagnostic (``failed to legalize operation
    'torch.aten.erfinv'``) where the message has one, else torch-mlir's pass (``Lowering
    TorchFX IR -> Torch Backend IR failed``), else the message's first line."""
    for line in message.splitlines():
        if line.startswith("error:"):
            return re.sub(r": %.*", "", line[len("error:") :].strip())[:300]
    m = re.search(r"Lowering [^\n]*? failed", message)
    if m:
        return "torch-mlir: " + m.group(0)
    return message.splitlines()[0][:300] if message else "torch-mlir failed"


class _OnDevice(torch.nn.Module):
    """A partition of a graph, in the partitioned graph's place of its nodes: its program."""

    def __init__(self, prog: _GraphProgram, weights: _Weights):
        super().__init__()
        self.prog, self.weights = prog, weights

    def forward(self, *args: Any) -> Any:
        outs = self.prog(args, self.weights)
        return tuple(outs) if self.prog.tuple_out else outs[0]


class _Partitioned:
    """An ATen graph some of whose nodes torch-mlir does not lower: each node is probed alone
    (:func:`_why_not_lowered`), the nodes that lower are grouped into as few partitions as
    their dependencies allow (torch.fx's ``CapabilityBasedPartitioner``, as Dynamo backends
    partition for the ops they support), each partition runs as a program on the device and
    the other nodes run in PyTorch on the CPU between them, named in a
    :class:`CpuFallbackWarning` and in :func:`cpu_fallback_ops`. A partition that does not
    lower as a whole runs on the CPU too."""

    def __init__(
        self,
        g: torch.fx.GraphModule,
        kind: str,
        name: str,
        opts: _Options,
        weights: _Weights,
        why: NotLowered,
    ):
        from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
        from torch.fx.passes.operator_support import OperatorSupportBase

        for n in g.graph.nodes:
            # A constant becomes a partition's input: its value is what the program is traced
            # with.
            if n.op == "get_attr" and "val" not in n.meta:
                n.meta["val"] = _attr(g, n.target)
        on_cpu: dict[torch.fx.Node, str] = {}
        for n in g.graph.nodes:
            if n.op != "call_function" or n.target is operator.getitem:
                continue
            if not isinstance(n.target, torch._ops.OpOverload):
                on_cpu[n] = "not an ATen op"
                continue
            reason = _why_not_lowered(n, g, opts)
            if reason is not None:
                on_cpu[n] = reason
        if not on_cpu:
            # Every node lowers alone, the graph does not: it runs on the CPU as a whole.
            on_cpu = {
                n: _short_reason(why.message)
                for n in g.graph.nodes
                if n.op == "call_function" and n.target is not operator.getitem
            }

        class Support(OperatorSupportBase):
            def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
                if node.op != "call_function":
                    return False
                if node.target is operator.getitem:
                    return node.args[0] not in on_cpu
                return node not in on_cpu

        partitioner = CapabilityBasedPartitioner(
            g, Support(), allows_single_node_partition=True
        )
        fused = partitioner.fuse_partitions(partitioner.propose_partitions())
        k = 0
        for n in list(fused.graph.nodes):
            if n.op != "call_module":
                continue
            sub = getattr(fused, n.target)
            try:
                prog = _GraphProgram(sub, kind, f"{name}/part{k}", opts)
            except NotLowered as e:
                # Lowers node by node, not as a whole: left to PyTorch.
                for m in sub.graph.nodes:
                    if m.op == "call_function" and m.target is not operator.getitem:
                        on_cpu[m] = _short_reason(e.message)
                continue
            setattr(fused, n.target, _OnDevice(prog, weights))
            k += 1
        self.gm = fused
        self.cpu_ops = sorted({_op_name(n.target) for n in on_cpu})
        _count("partitioned_graphs")
        _count("cpu_fallback_nodes", len(on_cpu))
        seen: set[str] = set()
        for n, reason in on_cpu.items():
            op = _op_name(n.target)
            if op in seen:
                continue
            seen.add(op)
            _fell_back(
                op,
                f"tpubox backend: {op} in {kind} graph {name} does not lower to the device "
                f"({reason}); its nodes run in PyTorch on the CPU, the rest of the graph on the "
                "device",
                stacklevel=2,
            )

    def __call__(self, *args: Any) -> list[Any]:
        out = self.gm(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]


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
            return make_boxed_func(_compiled(g, kind, f"{opts.name}/{gid}/{kind}", opts, weights))

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
