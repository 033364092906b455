"""The ``torch.distributed`` backend ``"tpubox"``: one process per device, each a session of one
tpubox daemon, collectives run by the daemon as one program over the ranks' device buffers
(docs/DISTRIBUTED.md).

Registered when :mod:`tpubox.torch` is imported::

    import torch.distributed as dist, tpubox, tpubox.torch as tt
    rank = int(os.environ["RANK"])
    s = tpubox.connect("unix:/run/tpubox.sock", TOKEN, devices=[int(os.environ["LOCAL_RANK"])])
    dev = tt.device(session=s)
    dist.init_process_group("tpubox")          # torchrun's env:// rendezvous, or tcp://
    x = torch.ones(4).to(dev)
    dist.all_reduce(x)                         # on the daemon, device to device

Each rank's session is its eager session (``tt.device(session=...)``); without one, the backend
connects to ``TPUBOX_ADDRESS`` with ``TPUBOX_TOKEN`` on device ``LOCAL_RANK`` (or ``RANK``). Rank
0 asks the daemon for a group (its id goes to the other ranks through torch's store), every rank
joins it with its session's device, and the store's barrier waits until all have joined.

Collectives: ``all_reduce`` (sum, avg, product, min, max), ``all_gather`` and
``all_gather_into_tensor``, ``reduce_scatter`` and ``reduce_scatter_tensor``, ``broadcast``,
``all_to_all_single`` (equal splits), ``barrier``, and ``send``/``recv`` (a send is queued on the
daemon at once; the receive copies it device to device). Tensors on the tpubox device move device to
device; CPU tensors are put, reduced and read back. Work handles are complete when returned
(``async_op=True`` gives a finished work). Uneven ``all_to_all`` splits are refused
(``NotImplementedError``). A collective that waits longer than the group's
``timeout`` (``init_process_group(timeout=...)``) raises ``torch.distributed.DistBackendError``
and breaks the group, as does a rank whose process dies.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from .torch import eager as _eager
from .errors import TpuboxError
from .session import Session, connect

__all__ = ["BACKEND", "ProcessGroupTpubox"]

#: The backend's name for ``dist.init_process_group``.
BACKEND = "tpubox"

_REDUCE = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}


def _done(result: Any) -> Any:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _reduce_name(op: Any) -> str:
    name = _REDUCE.get(getattr(op, "op", op))  # a ReduceOp object holds its RedOpType
    if name is None:
        raise ValueError(f"tpubox process group: reduction {op} is not supported")
    return name


class ProcessGroupTpubox(dist.ProcessGroup):
    """A process group whose collectives run on the tpubox daemon (see the module doc)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        session: Session | None = None,
    ):
        super().__init__(rank, size)
        self._session = session or _rank_session(rank)
        seconds = max(1.0, timeout.total_seconds())
        if rank == 0:
            self._group = self._session.create_group(size, 0, timeout=seconds)
            store.set("tpubox/group", self._group)
        else:
            store.wait(["tpubox/group"])
            self._group = store.get("tpubox/group").decode()
            self._session.join_group(self._group, rank)
        store.set(f"tpubox/joined/{rank}", "1")
        store.wait([f"tpubox/joined/{r}" for r in range(size)])

    def getBackendName(self) -> str:  # noqa: N802 (PyTorch's name)
        return BACKEND

    # The daemon's side --------------------------------------------------------------------

    def _call(self, kind: str, t: torch.Tensor | None, **fields: Any) -> torch.Tensor | None:
        """Runs collective KIND on T (a device or CPU tensor; a 0-d one travels as dims [1]);
        the result as a tensor on T's device (a device tensor when T is one), None for a
        barrier or a send.

        Raises: torch.distributed.DistBackendError for the daemon's refusal (a timeout, a
        broken group, ranks that disagree)."""
        try:
            if t is None:
                self._session.collective(self._group, kind, None, **fields)
                return None
            if t.dim() == 0:
                t = t.reshape(1)
            on_device = _eager.is_device_tensor(t)
            if on_device:
                arg = _eager._concrete(_eager._value(t))
            else:
                arg = self._session.tensor(t.detach().contiguous().numpy())
            out = self._session.collective(self._group, kind, arg, **fields)
        except TpuboxError as e:
            raise dist.DistBackendError(f"tpubox {kind}: {e}") from e
        if out is None:  # a send
            return None
        if on_device:
            return _eager._wrap(out, (tuple(out.shape), _eager._contiguous(out.shape), t.dtype))
        return torch.from_numpy(out.numpy().copy()).to(t.dtype)

    def _into(self, dst: torch.Tensor, kind: str, src: torch.Tensor, **fields: Any) -> None:
        """Runs collective KIND on SRC and writes its result into DST (its dims)."""
        r = self._call(kind, src, **fields)
        assert r is not None
        with torch.no_grad():
            dst.copy_(r.reshape(dst.shape))

    # torch.distributed's calls ------------------------------------------------------------

    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for t in tensors:
            self._into(t, "all_reduce", t, reduce=op)
        return _done(list(tensors))

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        for t in tensors:
            self._into(t, "broadcast", t, root=root)
        return _done(list(tensors))

    def allgather(
        self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> Any:
        for outs, t in zip(outputs, inputs):
            gathered = self._call("all_gather", t)
            assert gathered is not None
            d0 = t.shape[0] if t.dim() else 1
            with torch.no_grad():
                for i, o in enumerate(outs):
                    o.copy_(gathered[i * d0 : (i + 1) * d0].reshape(o.shape))
        return _done(list(outputs))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._into(output, "all_gather", input)
        return _done([output])

    def allgather_into_tensor_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> Any:
        for o, i in zip(outputs, inputs):
            self._allgather_base(o, i, opts)
        return _done(list(outputs))

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        op = _reduce_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        self._into(output, "reduce_scatter", input, reduce=op)
        return _done([output])

    def reduce_scatter(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], opts: Any = None
    ) -> Any:
        for o, parts in zip(outputs, inputs):
            self._reduce_scatter_base(o, torch.cat([p.reshape(o.shape) for p in parts]), opts)
        return _done(list(outputs))

    def reduce_scatter_tensor_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> Any:
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_base(o, i, opts)
        return _done(list(outputs))

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> Any:
        n = self.size()
        even = input.shape[0] // n if input.dim() else 0
        for splits in (output_split_sizes, input_split_sizes):
            if splits and any(int(s) != even for s in splits):
                raise NotImplementedError(
                    "tpubox process group: all_to_all_single with uneven splits"
                )
        self._into(output, "all_to_all", input)
        return _done([output])

    def barrier(self, opts: Any = None) -> Any:
        self._call("barrier", None)
        return _done([])

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int = 0) -> Any:
        for t in tensors:
            self._call("send", t, peer=int(dst), tag=int(tag))
        return _done(list(tensors))

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int = 0) -> Any:
        for t in tensors:
            self._into(t, "recv", t, peer=int(src), tag=int(tag))
        return _done(list(tensors))


def _backend(script_pg: Any) -> "ProcessGroupTpubox":
    """The tpubox backend of the process group a c10d op names (a TorchScript object)."""
    pg = dist.ProcessGroup.unbox(script_pg)
    if isinstance(pg, ProcessGroupTpubox):
        return pg
    backend = None
    for device in (_eager.DEVICE_TYPE, "cpu"):
        try:
            backend = pg._get_backend(torch.device(device))
            break
        except RuntimeError:
            continue
    if not isinstance(backend, ProcessGroupTpubox):
        raise RuntimeError(
            f"a tpubox device tensor in a collective of a {pg.name()} process group, whose "
            "backend is not tpubox's: use a "
            "group of the tpubox backend (dist.init_process_group('tpubox'))"
        )
    return backend


def _reduce(script_op: Any) -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.unbox(script_op)
    return opts


def _scatter_opts(script_op: Any) -> Any:
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.unbox(script_op)
    return opts


def c10d_ops() -> dict[Any, Any]:
    """How device tensors run torch.distributed's ATen-level collectives (the ``c10d`` ops
    ``dist.all_reduce`` and friends call): a device tensor's ``__torch_dispatch__`` sees
    them first, and each calls its group's tpubox backend with the device tensors as they
    are, returning what the op returns (the work boxed for TorchScript)."""
    c10d = torch.ops.c10d

    def bcast_opts(root: int, root_tensor: int) -> Any:
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = int(root), int(root_tensor)
        return o

    table = {
        c10d.allreduce_.default: lambda t, pg, op, *_: (
            t,
            _backend(pg).allreduce(t, _reduce(op)).boxed(),
        ),
        c10d.allreduce_coalesced_.default: lambda t, pg, op, *_: _backend(pg)
        .allreduce(t, _reduce(op))
        .boxed(),
        c10d.broadcast_.default: lambda t, pg, root, root_t, *_: (
            t,
            _backend(pg).broadcast(t, bcast_opts(root, root_t)).boxed(),
        ),
        c10d.allgather_.default: lambda outs, ins, pg, *_: (
            outs,
            _backend(pg).allgather(outs, ins).boxed(),
        ),
        c10d._allgather_base_.default: lambda out, inp, pg, *_: (
            out,
            _backend(pg)._allgather_base(out, inp).boxed(),
        ),
        c10d.allgather_into_tensor_coalesced_.default: lambda outs, ins, pg, *_: _backend(pg)
        .allgather_into_tensor_coalesced(outs, ins)
        .boxed(),
        c10d.reduce_scatter_.default: lambda outs, ins, pg, op, *_: (
            outs,
            _backend(pg).reduce_scatter(outs, ins, _scatter_opts(op)).boxed(),
        ),
        c10d._reduce_scatter_base_.default: lambda out, inp, pg, op, *_: (
            out,
            _backend(pg)._reduce_scatter_base(out, inp, _scatter_opts(op)).boxed(),
        ),
        c10d.reduce_scatter_tensor_coalesced_.default: lambda outs, ins, pg, op, *_: _backend(pg)
        .reduce_scatter_tensor_coalesced(outs, ins, _scatter_opts(op))
        .boxed(),
        c10d.alltoall_base_.default: lambda out, inp, pg, osz, isz, *_: _backend(pg)
        .alltoall_base(out, inp, osz, isz)
        .boxed(),
        c10d.barrier.default: lambda t, pg, *_: _backend(pg).barrier().boxed(),
        c10d.send.default: lambda t, pg, dst, tag: _backend(pg).send(t, dst, tag).boxed(),
        c10d.recv_.default: lambda t, pg, src, tag: _backend(pg).recv(t, src, tag).boxed(),
    }
    return {op: (lambda f: lambda func, args, kwargs: f(*args, *kwargs.values()))(f) for op, f in table.items()}


def _rank_session(rank: int) -> Session:
    """The rank's session: the eager session (``tt.device(session=...)``), else a new one on
    ``TPUBOX_ADDRESS`` with ``TPUBOX_TOKEN`` on device ``LOCAL_RANK`` (or RANK), made the eager
    session."""
    if _eager._SESSION is not None and not _eager._SESSION.closed:
        return _eager._SESSION
    address = os.environ.get("TPUBOX_ADDRESS")
    if not address:
        raise RuntimeError(
            "tpubox process group: no session; call tpubox.torch.device(session=...) first, "
            "or set TPUBOX_ADDRESS (and TPUBOX_TOKEN)"
        )
    local = int(os.environ.get("LOCAL_RANK", rank))
    s = connect(
        address, os.environ.get("TPUBOX_TOKEN"), devices=[local], label=f"torch.distributed rank {rank}"
    )
    _eager.device(session=s)
    return s


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupTpubox:
    return ProcessGroupTpubox(store, rank, size, timeout)


def register() -> None:
    """Registers the backend ``"tpubox"`` with ``torch.distributed`` (once; what importing
    :mod:`tpubox.torch` does), for CPU tensors and the tpubox device."""
    if hasattr(dist.Backend, BACKEND.upper()):
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", _eager.DEVICE_TYPE])
    _eager._SPECIAL.update(c10d_ops())
