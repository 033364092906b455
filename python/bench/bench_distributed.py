"""torch.distributed's "tpubox" backend against gloo on the same machine, in one run (issue 47;
not run in CI).

    python python/bench/bench_distributed.py [--iters 10]

Starts a `tpubox serve` daemon with four CPU devices (`--cpu-devices 4`) and runs itself under
`torchrun --nproc_per_node=4`, each rank a session on its own device:

- all_reduce (sum) of 1, 16 and 64 MiB of float32 per rank: the tpubox group on device tensors
  (one program over the four devices on the daemon) against gloo on CPU tensors (the same
  ranks, `dist.new_group(backend="gloo")`); median ms per call, rank 0's clock, a barrier of
  each backend before each call;
- a DDP training step of an MLP 256 -> 1024 -> 1024 -> 10 (SGD, momentum) on 4 x 64 rows over
  eager device tensors (the batch put once; DEFER_NEVER, then DEFER_AND_FUSE), against one process training on the whole batch of 256 rows with
  PyTorch on the CPU (`torch.set_num_threads(2)`), measured first, alone.

Ratios above 1: tpubox is faster. Needs the venv with torch ($CACHE/venv-torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKEN = "bench-dist"


def mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def one_process(iters: int) -> float:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(2)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    return median_step(model, opt, x, y, iters, lambda: None)


def median_step(model, opt, x, y, iters: int, before) -> float:
    """Median ms of a training step (forward, cross-entropy, backward, step, `loss.item()`)
    on X, Y over ITERS steps after 3 untimed; BEFORE runs untimed before each."""
    import torch.nn.functional as F

    times = []
    for i in range(iters + 3):
        before()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rank_main(iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tpubox
    import tpubox.torch as tt

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    s = tpubox.connect(os.environ["TPUBOX_ADDRESS"], TOKEN, devices=[rank], label=f"bench {rank}")
    dev = tt.device(session=s)
    dist.init_process_group("tpubox")
    gloo = dist.new_group(backend="gloo")
    rows: dict[str, float] = {}
    for mib in (1, 16, 64):
        n = mib * (1 << 20) // 4
        x = torch.ones(n)
        xd = x.to(dev)
        for name, t, group in (("tpubox", xd, None), ("gloo", x, gloo)):
            times = []
            for i in range(iters + 2):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                dist.all_reduce(t, group=group)
                if name == "tpubox":
                    tt.mark_step()
                    s.wait_all()
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
            rows[f"all_reduce_{mib}MiB_{name}"] = statistics.median(times)
    model = DDP(mlp().to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    # The batch put once: the step's puts are what the one-process step does not pay either.
    rows["ddp_step_4_ranks"] = median_step(model, opt, x.to(dev), y.to(dev), iters, dist.barrier)
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        rows["ddp_step_4_ranks_fused"] = median_step(
            model, opt, x.to(dev), y.to(dev), iters, dist.barrier
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_out:
        rank_main(args.iters, args.rank_out)
        return
    sys.path.insert(0, str(HERE.parent / "tests"))
    from tpubox_daemon import Daemon, free_ports

    single = one_process(args.iters)
    root = Path(tempfile.mkdtemp(prefix="tpubox-bench-dist-"))
    limits = {"max_device_mib": 4096, "max_sessions": 8}
    d = Daemon(root, {"bench": {"token": TOKEN, "session": limits}}, extra_args=("--cpu-devices", "4"))
    d.start()
    out = root / "rows.json"
    try:
        env = dict(
            os.environ,
            TPUBOX_ADDRESS=d.unix,
            PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        )
        subprocess.run(
            [
                str(Path(sys.executable).parent / "torchrun"),
                "--nproc_per_node=4",
                f"--master_port={free_ports(1)[0]}",
                __file__,
                "--iters",
                str(args.iters),
                "--rank-out",
                str(out),
            ],
            env=env,
            check=True,
        )
    finally:
        d.stop()
    rows = json.loads(out.read_text())
    print("all_reduce (sum), 4 ranks, median ms per call")
    for mib in (1, 16, 64):
        t, g = rows[f"all_reduce_{mib}MiB_tpubox"], rows[f"all_reduce_{mib}MiB_gloo"]
        print(f"  {mib:3d} MiB  tpubox {t:9.2f}  gloo {g:9.2f}  ratio {g / t:5.2f}x")
    ddp = rows["ddp_step_4_ranks"]
    print("training step, 256 rows in all, median ms")
    print(f"  one process (PyTorch CPU)  {single:9.2f}")
    print(f"  DDP, 4 ranks (tpubox)      {ddp:9.2f}  ratio {single / ddp:5.2f}x")
    fused = rows["ddp_step_4_ranks_fused"]
    print(f"  the same, DEFER_AND_FUSE   {fused:9.2f}  ratio {single / fused:5.2f}x")


if __name__ == "__main__":
    main()
