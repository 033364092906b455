"""PyTorch on tpubox against PyTorch on the same CPU, in one run (issue 46; not run in CI).

    python python/bench/bench_torch_speed.py [--steps 20] [--warmup 3] [--json] [--quick]

Starts a `tpubox serve` session daemon (python/tests/tpubox_daemon.Daemon, the CPU plugin) and
times, with `torch.set_num_threads(2)` on both sides, median and p90 per step:

- an MLP 256 -> 512 -> 512 -> 10 (ReLU), cross-entropy, forward + backward + SGD with
  momentum, `loss.item()` at the end of each step, at batch 64 and 1024: PyTorch CPU eager;
  eager device tensors in DEFER_NEVER and DEFER_AND_FUSE; `torch.compile(backend="tpubox")`
  with the model on the CPU (parameters put again after each step); the same with the model
  on the device (`model.to(tpubox.torch.device())`; the optimizer's ops fused by
  DEFER_AND_FUSE): only the batch goes in and the loss out; the loss compiled with the
  model (`torch.compile` of a function returning it), which leaves only the optimizer eager;
  and the optimizer's step compiled as well (three programs a step). For reference, PyTorch's
  own compiled step on the CPU (`ref_aot_eager`: the same Dynamo and aot_autograd machinery,
  PyTorch's kernels in process; `ref_inductor`);
- a MiniLM-sized BERT (hidden 384, 6 layers, 12 heads; random weights) forward on 8 x 128
  tokens: PyTorch CPU eager, `torch.compile` with the model on the CPU and on the device;
- the same BERT's training step (AdamW, dropout 0): PyTorch CPU eager and `torch.compile` with
  the model on the device;
- one 4-float add then `.cpu()`, and 20 chained adds not read (DEFER_NEVER), against PyTorch.

Each row prints its ratio to PyTorch CPU eager (above 1: tpubox is faster). Needs the venv with
torch, transformers and torch-mlir ($CACHE/venv-torch).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import tpubox  # noqa: E402
import tpubox.torch as tt  # noqa: E402
from tpubox_daemon import Daemon  # noqa: E402

TOKEN = "bench-token"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertModel(cfg)


def timed(step: Callable[[int], Any], steps: int, warmup: int) -> dict[str, float]:
    """Median and p90 of STEP's wall time in ms, after WARMUP untimed calls."""
    for i in range(warmup):
        step(i)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(warmup + i)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))]}


def train_step(model: Any, opt: torch.optim.Optimizer, xs: torch.Tensor, ys: torch.Tensor, dev: Any):
    """One step on batch I % len(xs): forward, cross-entropy, backward, step, loss.item()."""

    def step(i: int) -> float:
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        if dev is not None:
            x, y = x.to(dev), y.to(dev)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def mlp_rows(dev: Any, batch: int, steps: int, warmup: int, modes: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(batch)
    xs = torch.randn(4, batch, 256, generator=gen)
    ys = torch.randint(0, 10, (4, batch), generator=gen)
    rows: dict[str, Any] = {}

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    m = mlp()
    rows["pytorch_cpu"] = timed(train_step(m, sgd(m), xs, ys, None), steps, warmup)
    # PyTorch's own compiled step on the CPU, for reference: the loss and `opt.step()` compiled
    # as below, by aot_eager (the Dynamo and aot_autograd machinery tpubox's backend also runs,
    # computing with PyTorch's kernels in this process) and Inductor.
    for ref_backend in ("aot_eager", "inductor"):
        m = mlp()
        rows[f"ref_{ref_backend}"] = timed(
            compiled_step(m, sgd(m), xs, ys, None, ref_backend), steps, warmup
        )
    if modes:
        for mode in (tt.EagerMode.DEFER_NEVER, tt.EagerMode.DEFER_AND_FUSE):
            m = mlp().to(dev)
            with tt.set_eager_mode(mode):
                rows[mode.name] = timed(train_step(m, sgd(m), xs, ys, dev), steps, warmup)
    m = mlp()
    c = torch.compile(m, backend="tpubox")
    rows["compile_cpu_params"] = timed(train_step(c, sgd(m), xs, ys, None), steps, warmup)
    m = mlp().to(dev)
    c = torch.compile(m, backend="tpubox")
    opt = sgd(m)
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        step = train_step(c, opt, xs, ys, dev)
        for i in range(warmup):
            step(i)
        tt.reset_eager_stats()
        rows["compile_on_device"] = timed(step, steps, 0)
        s = tt.eager_stats()
    rows["compile_on_device"]["puts_per_step"] = s["puts"] / steps
    rows["compile_on_device"]["fetches_per_step"] = s["fetches"] / steps
    rows["compile_on_device"]["launches_per_step"] = s["launches"] / steps
    # The loss inside the compiled function too: its forward and backward join the model's
    # programs, and only the optimizer's ops stay eager.
    m = mlp().to(dev)
    opt = sgd(m)
    loss_fn = torch.compile(lambda x, y: F.cross_entropy(m(x), y), backend="tpubox")

    def loss_step(i: int) -> float:
        x, y = xs[i % len(xs)].to(dev), ys[i % len(ys)].to(dev)
        loss = loss_fn(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        for i in range(warmup):
            loss_step(i)
        tt.reset_eager_stats()
        rows["compile_loss_on_device"] = timed(loss_step, steps, 0)
        s = tt.eager_stats()
    rows["compile_loss_on_device"]["eager_ops_per_step"] = s["ops"] / steps
    # The optimizer compiled too (PyTorch's idiom: `torch.compile` of a function calling
    # `opt.step()`): three programs a step, and the gradient seed as the one eager op.
    m = mlp().to(dev)
    step = compiled_step(m, sgd(m), xs, ys, dev, "tpubox")
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        for i in range(max(warmup, 3)):
            step(i)
        tt.reset_eager_stats()
        tt.reset_stats()
        rows["compile_step_on_device"] = timed(step, steps, 0)
        s, c = tt.eager_stats(), tt.stats()
    rows["compile_step_on_device"]["eager_launches_per_step"] = s["launches"] / steps
    rows["compile_step_on_device"]["programs_per_step"] = c["device_executions"] / steps
    return rows


def compiled_step(
    model: nn.Module, opt: torch.optim.Optimizer, xs: torch.Tensor, ys: torch.Tensor, dev: Any,
    backend: str,
) -> Callable[[int], float]:
    """A training step whose loss and optimizer step are compiled by BACKEND (the optimizer
    as PyTorch's tutorial compiles it: a function calling ``opt.step()``). Dynamo's caches
    are cleared first: every optimizer's step shares `step`'s code object, whose recompiles
    Dynamo limits (8), after which it runs the step uncompiled."""
    torch._dynamo.reset()
    loss_fn = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend=backend)

    @torch.compile(backend=backend)
    def opt_step() -> None:
        opt.step()

    def step(i: int) -> float:
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        if dev is not None:
            x, y = x.to(dev), y.to(dev)
        loss = loss_fn(x, y)
        opt.zero_grad()
        loss.backward()
        opt_step()
        return loss.item()

    return step


def bert_rows(dev: Any, steps: int, warmup: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 30000, (2, 8, 128), generator=gen)
    rows: dict[str, Any] = {}
    ref = bert().eval()
    with torch.no_grad():
        rows["forward_pytorch_cpu"] = timed(lambda i: ref(input_ids=ids[i % 2])[0], steps, warmup)
        c = torch.compile(copy.deepcopy(ref), backend="tpubox")
        rows["forward_compile_cpu_params"] = timed(
            lambda i: c(input_ids=ids[i % 2])[0], steps, warmup
        )
        on = copy.deepcopy(ref).to(dev)
        cd = torch.compile(on, backend="tpubox")
        rows["forward_compile_on_device"] = timed(
            lambda i: cd(input_ids=ids[i % 2].to(dev))[0].cpu(), steps, warmup
        )
    # A training step: a linear head on the [CLS] vector, cross-entropy, AdamW.
    labels = torch.randint(0, 2, (2, 8), generator=gen)

    def head_model(m: nn.Module) -> nn.Module:
        class Head(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = m
                self.out = nn.Linear(384, 2)

            def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
                return self.out(self.body(input_ids=input_ids)[0][:, 0])

        return Head()

    torch.manual_seed(1)
    cpu_model = head_model(bert().train())
    dev_model = copy.deepcopy(cpu_model).to(dev)
    opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-4)
    steps_t = max(3, steps // 2)
    rows["train_pytorch_cpu"] = timed(train_step(cpu_model, opt, ids, labels, None), steps_t, 1)
    dopt = torch.optim.AdamW(dev_model.parameters(), lr=1e-4, capturable=True)
    c = torch.compile(dev_model, backend="tpubox")
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        rows["train_compile_on_device"] = timed(train_step(c, dopt, ids, labels, dev), steps_t, 2)
    return rows


def op_rows(dev: Any, steps: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    a = torch.ones(4)
    b = torch.ones(4)
    rows["add_read_pytorch_cpu"] = timed(lambda i: (a + b).cpu(), steps * 50, 10)
    da, db = a.to(dev), b.to(dev)
    with tt.set_eager_mode(tt.EagerMode.DEFER_NEVER):
        rows["add_read_defer_never"] = timed(lambda i: (da + db).cpu(), steps * 5, 5)

        def chain(x: torch.Tensor) -> torch.Tensor:
            for _ in range(20):
                x = x + 1.0
            return x

        rows["chain20_pytorch_cpu"] = timed(lambda i: chain(a), steps * 50, 10)
        rows["chain20_defer_never"] = timed(lambda i: chain(da), steps * 5, 5)
        tt.mark_step()
        da.cpu()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the MLP at batch 64 and the ops only")
    args = ap.parse_args()
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="tpubox-bench-torch-"))
    limits = {"max_device_mib": 4096, "max_compiles_per_minute": 6000, "max_live_tensors": 100000}
    d = Daemon(root, {"bench": {"token": TOKEN, "session": limits}})
    d.start()
    results: dict[str, Any] = {}
    try:
        with tpubox.connect(d.unix, TOKEN, label="bench torch speed") as s:
            dev = tt.device(session=s)
            results["ops"] = op_rows(dev, args.steps)
            results["mlp_b64"] = mlp_rows(dev, 64, args.steps, args.warmup, True)
            if not args.quick:
                results["mlp_b1024"] = mlp_rows(dev, 1024, args.steps, args.warmup, True)
                results["bert"] = bert_rows(dev, args.steps, args.warmup)
    finally:
        d.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for group, rows in results.items():
        base = None
        print(f"\n{group}")
        for name, r in rows.items():
            if "pytorch_cpu" in name:
                base = r["median_ms"]
            ratio = f"{base / r['median_ms']:.2f}x" if base else ""
            extra = {k: v for k, v in r.items() if k not in ("median_ms", "p90_ms")}
            print(
                f"  {name:32s} median {r['median_ms']:9.3f} ms  p90 {r['p90_ms']:9.3f} ms  "
                f"{ratio:>8s} {extra if extra else ''}"
            )


if __name__ == "__main__":
    main()
