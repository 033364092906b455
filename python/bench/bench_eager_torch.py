"""Benchmark of eager PyTorch tensors on the daemon (tpubox.torch.device()) in each eager mode
(not run in CI).

    python python/bench/bench_eager_torch.py [--steps 30] [--warmup 3] [--json]

Starts a `tpubox serve` session daemon (python/tests/tpubox_daemon.Daemon, the CPU plugin) and
times a small MLP's training step (16 -> 64 -> GELU -> LayerNorm -> 64 -> 4, batch 32,
cross-entropy, ``loss.backward()``, SGD with momentum, ``loss.item()`` at the end of each step)
on device tensors in DEFER_NEVER, DEFER_AND_FUSE and DEFER_NEVER_AND_LAUNCH_BLOCKING, and the
same step in PyTorch on the CPU for scale. Each mode starts from the same weights; after the
warm-up steps (which compile), STEPS steps are timed one by one: median and p90 in ms, the
launches and fused graphs per step, and the speed-up of each mode over DEFER_NEVER. The aim
(issue 30): DEFER_AND_FUSE at least 1.5x faster than DEFER_NEVER.

Needs the venv with torch and torch-mlir ($CACHE/venv-torch).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import tpubox  # noqa: E402
import tpubox.torch as tt  # noqa: E402
from tpubox_daemon import Daemon  # noqa: E402

TOKEN = "bench-token"


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 64, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, warmup: int) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step() -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    tt.reset_eager_stats()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append((time.perf_counter() - t0) * 1e3)
    st = tt.eager_stats()
    return {
        "median_ms": statistics.median(times),
        "p90_ms": percentile(times, 0.9),
        "launches_per_step": st["launches"] / steps,
        "fused_graphs_per_step": st["fused_graphs"] / steps,
        "ops_per_step": st["ops"] / steps,
        "compiles": st["compiles"],
        "cpu_fallbacks": st["cpu_fallbacks"],
        "last_loss": losses[-1],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"tpubox-bench-eager-{os.getpid()}"
    daemon = Daemon(root, {"bench": {"token": TOKEN, "session": {"max_device_mib": 1024}}})
    daemon.start()
    res: dict[str, dict] = {}
    try:
        with tpubox.connect(daemon.unix, TOKEN, label="bench eager") as s:
            dev = tt.device(session=s)
            torch.manual_seed(0)
            base = MLP()
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            res["cpu"] = run(copy.deepcopy(base), x, y, args.steps, args.warmup)
            for mode in (
                tt.EagerMode.DEFER_NEVER,
                tt.EagerMode.DEFER_AND_FUSE,
                tt.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
            ):
                with tt.set_eager_mode(mode):
                    model = copy.deepcopy(base).to(dev)
                    res[mode.name] = run(model, x.to(dev), y.to(dev), args.steps, args.warmup)
    finally:
        daemon.kill()
    never = res["DEFER_NEVER"]["median_ms"]
    head = ("MLP training step", "median", "p90", "launches/step", "vs DEFER_NEVER")
    rows = []
    for name, r in res.items():
        rows.append(
            (
                name if name != "cpu" else "PyTorch on the CPU (scale)",
                f"{r['median_ms']:.2f} ms",
                f"{r['p90_ms']:.2f} ms",
                f"{r['launches_per_step']:.0f}" if name != "cpu" else "",
                f"{never / r['median_ms']:.2f} x faster",
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    print(
        f"eager MLP training step (16-64-64-4, batch 32, SGD momentum; {args.steps} steps after "
        f"{args.warmup} warm-up; {res['DEFER_NEVER']['ops_per_step']:.0f} ATen ops per step)"
    )
    print(line(head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    fuse = never / res["DEFER_AND_FUSE"]["median_ms"]
    print(f"DEFER_AND_FUSE vs DEFER_NEVER: {fuse:.2f}x (aim: at least 1.5x)")
    if args.json:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
