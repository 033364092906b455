"""One rank of the torch.distributed tests (test_distributed.py), started by torchrun.

    torchrun --nproc_per_node=4 dist_worker.py MODE OUT_DIR

Connects to the daemon at TPUBOX_ADDRESS with TPUBOX_TOKEN on device LOCAL_RANK, makes the
eager session its device's, then `dist.init_process_group("tpubox")` (torchrun's env://
rendezvous) and a gloo group over the same ranks, the reference. Writes OUT_DIR/rank{RANK}.json.

MODE:
- collectives: every collective on tpubox device tensors and on CPU tensors through gloo,
  same inputs; the largest relative difference of each.
- ddp: DistributedDataParallel of an MLP and of a tiny Hugging Face BERT over eager device
  tensors, 20 SGD steps each on this rank's quarter of each batch; the final parameters.
- straggler: rank WORLD_SIZE-1 never reaches the all_reduce; the others' error and how long
  it took.
- killed: rank WORLD_SIZE-1 is SIGKILLed while the others wait in an all_reduce (started
  without torchrun, which would stop the others: INIT_METHOD=tcp://..., RANK, WORLD_SIZE).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpubox
import tpubox.torch as tt
from tiny_models import STEPS, bert_batches, mlp, tiny_bert

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
MODE, OUT = sys.argv[1], sys.argv[2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the reference's largest magnitude (an element near
    zero of a sum makes element-wise ratios meaningless: the ranks' order of summation differs
    between the two backends)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if a.numel() else 0.0


def collectives(dev: torch.device, gloo: dist.ProcessGroup) -> dict:
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(100 + RANK)
    x = torch.randn(8, 3, generator=g) + 2.0

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.clone().to(dev)

    ops = {
        "sum": dist.ReduceOp.SUM,
        "product": dist.ReduceOp.PRODUCT,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
    }
    for name, op in ops.items():
        a = mine(x)
        dist.all_reduce(a, op=op)
        b = x.clone()
        dist.all_reduce(b, op=op, group=gloo)
        out[f"all_reduce_{name}"] = rel(a.cpu(), b)
    # gloo has no AVG: its sum over the world size.
    a = mine(x)
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    b = x.clone()
    dist.all_reduce(b, group=gloo)
    out["all_reduce_avg"] = rel(a.cpu(), b / WORLD)
    # A 0-d tensor (a loss), async.
    a = mine(x.sum())
    dist.all_reduce(a, async_op=True).wait()
    b = x.sum().clone()
    dist.all_reduce(b, group=gloo)
    out["all_reduce_scalar"] = rel(a.cpu(), b)
    # CPU tensors through the tpubox group too (put, reduced, read back).
    a = x.clone()
    dist.all_reduce(a)
    out["all_reduce_cpu_tensor"] = rel(a, _gloo_sum(x, gloo))

    for root in range(WORLD):
        a = mine(x)
        dist.broadcast(a, src=root)
        b = x.clone()
        dist.broadcast(b, src=root, group=gloo)
        out[f"broadcast_{root}"] = rel(a.cpu(), b)

    outs = [torch.zeros(8, 3).to(dev) for _ in range(WORLD)]
    dist.all_gather(outs, mine(x))
    ref = [torch.zeros(8, 3) for _ in range(WORLD)]
    dist.all_gather(ref, x.clone(), group=gloo)
    out["all_gather"] = max(rel(a.cpu(), b) for a, b in zip(outs, ref))

    a = torch.zeros(8 * WORLD, 3).to(dev)
    dist.all_gather_into_tensor(a, mine(x))
    b = torch.zeros(8 * WORLD, 3)
    dist.all_gather_into_tensor(b, x.clone(), group=gloo)
    out["all_gather_into_tensor"] = rel(a.cpu(), b)

    y = torch.randn(4 * WORLD, 3, generator=g)
    a = torch.zeros(4, 3).to(dev)
    dist.reduce_scatter_tensor(a, y.clone().to(dev))
    try:
        b = torch.zeros(4, 3)
        dist.reduce_scatter_tensor(b, y.clone(), group=gloo)
    except (RuntimeError, NotImplementedError):
        # gloo's reduce_scatter: its all_reduce, this rank's part.
        s = y.clone()
        dist.all_reduce(s, group=gloo)
        b = s[4 * RANK : 4 * (RANK + 1)]
    out["reduce_scatter_tensor"] = rel(a.cpu(), b)

    a = torch.zeros(4 * WORLD, 3).to(dev)
    dist.all_to_all_single(a, y.clone().to(dev))
    b = torch.zeros(4 * WORLD, 3)
    dist.all_to_all_single(b, y.clone(), group=gloo)
    out["all_to_all_single"] = rel(a.cpu(), b)

    # A ring: each rank sends to the next and receives from the one before (a send does not
    # wait for its receive, so every rank may send first), tagged.
    nxt, prev = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    a = torch.zeros(8, 3).to(dev)
    req = dist.isend(mine(x), nxt, tag=7)
    dist.recv(a, prev, tag=7)
    req.wait()
    b = torch.zeros(8, 3)
    req = dist.isend(x.clone(), nxt, group=gloo, tag=7)
    dist.recv(b, prev, group=gloo, tag=7)
    req.wait()
    out["send_recv"] = rel(a.cpu(), b)

    dist.barrier()
    out["barrier"] = 0.0
    return out


def _gloo_sum(x: torch.Tensor, gloo: dist.ProcessGroup) -> torch.Tensor:
    b = x.clone()
    dist.all_reduce(b, group=gloo)
    return b


def ddp(dev: torch.device) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(STEPS, 8 * WORLD, 16, generator=gen)
    ys = torch.randint(0, 4, (STEPS, 8 * WORLD), generator=gen)
    model = DDP(mlp().to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for i in range(STEPS):
        part = slice(8 * RANK, 8 * (RANK + 1))
        loss = F.cross_entropy(model(xs[i, part].to(dev)), ys[i, part].to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # A tiny Hugging Face BERT the same way: this rank's 4 sequences of each batch.
    ids, labels = bert_batches(WORLD)
    bert = DDP(tiny_bert().to(dev))
    bopt = torch.optim.SGD(bert.parameters(), lr=0.05, momentum=0.9)
    for i in range(STEPS):
        part = slice(4 * RANK, 4 * (RANK + 1))
        loss = bert(input_ids=ids[i, part].to(dev), labels=labels[i, part].to(dev)).loss
        bopt.zero_grad()
        loss.backward()
        bopt.step()
    return {
        "params": [p.detach().cpu().flatten().tolist() for p in model.module.parameters()],
        "bert_params": [p.detach().cpu().flatten().tolist() for p in bert.module.parameters()],
        "losses": losses,
    }


def timed_all_reduce(x: torch.Tensor) -> dict:
    """An all_reduce of X: the error's type and message, if any, and the seconds it took."""
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001 (the test reads the type)
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def straggler() -> dict:
    x = torch.ones(4).to(tt.device())
    if RANK == WORLD - 1:
        time.sleep(float(os.environ.get("STRAGGLE_SECONDS", "20")))
        return {"slept": True}
    return timed_all_reduce(x)


def killed() -> dict:
    """The last rank is SIGKILLed as the others enter an all_reduce; they must fail at once
    (its session ends with its connection), not after the group's timeout."""
    x = torch.ones(4).to(tt.device())
    if RANK == WORLD - 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    return timed_all_reduce(x)


def main() -> None:
    s = tpubox.connect(
        os.environ["TPUBOX_ADDRESS"],
        os.environ.get("TPUBOX_TOKEN"),
        devices=[int(os.environ["LOCAL_RANK"])],
        label=f"dist test rank {RANK}",
    )
    dev = tt.device(session=s)
    timeout = datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "120")))
    init = os.environ.get("INIT_METHOD")  # tcp://HOST:PORT; else torchrun's env://
    if init:
        dist.init_process_group(
            "tpubox", init_method=init, rank=RANK, world_size=WORLD, timeout=timeout
        )
    else:
        dist.init_process_group("tpubox", timeout=timeout)
    result: dict = {"rank": RANK, "devices": list(s.devices)}
    if MODE == "collectives":
        gloo = dist.new_group(backend="gloo")
        result["rel"] = collectives(dev, gloo)
    elif MODE == "ddp":
        # The reducer's copies and the optimizer's ops fused into a program a step.
        with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
            result.update(ddp(dev))
    elif MODE == "straggler":
        result.update(straggler())
    elif MODE == "killed":
        result.update(killed())
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(result, f)
    if MODE not in ("straggler", "killed"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
