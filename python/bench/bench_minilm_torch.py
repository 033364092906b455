"""MiniLM's forward pass through `torch.compile(backend="tpubox")` against PyTorch eager and
`torch.compile` with inductor, all on the CPU, in one run (not run in CI).

    python python/bench/bench_minilm_torch.py [--batch 8] [--seq 128] [--calls 20] [--json]

The model is the real all-MiniLM-L6-v2 (`tpubox setup minilm`; Hugging Face's `BertModel`,
mean pooling over the attention mask, L2 normalisation), on a batch of BATCH sentences of SEQ
tokens. For each path: the first call (Dynamo, the backend's lowering and the compile), cold
(inductor: an empty `TORCHINDUCTOR_CACHE_DIR`; tpubox: a daemon started on an empty compile
cache) and warm (after `torch._dynamo.reset()`, the same caches: inductor's FX graph cache,
the daemon's tier 1); then the median and p90 of CALLS calls after 3 warm-up calls, and the
largest difference from eager's embeddings. The aim (issue 30): the backend at least as fast as
PyTorch eager. PyTorch uses as many threads as the machine has cores, as the daemon's XLA does.

Needs the venv with torch, transformers and torch-mlir ($CACHE/venv-torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Inductor's caches: a fresh directory, so that its first compile is cold.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="tpubox-bench-inductor-"))

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests" / "pytorch"))

import torch  # noqa: E402

import tpubox  # noqa: E402
import tpubox.torch as tt  # noqa: E402
from minilm_torch import load  # noqa: E402
from tpubox_daemon import Daemon  # noqa: E402

TOKEN = "bench-token"


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def timed(fn, *args) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = fn(*args)
    return (time.perf_counter() - t0) * 1e3, out


def steady(fn, args, calls: int) -> tuple[float, float]:
    for _ in range(3):
        fn(*args)
    times = [timed(fn, *args)[0] for _ in range(calls)]
    return statistics.median(times), percentile(times, 0.9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = load()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    mask[args.batch // 2 :, args.seq * 3 // 4 :] = 0  # some padding
    inputs = (ids, mask)
    res: dict[str, dict] = {}
    with torch.no_grad():
        want = model(*inputs)
        med, p90 = steady(model, inputs, args.calls)
        res["PyTorch eager"] = {"median_ms": med, "p90_ms": p90, "max_abs_diff": 0.0}

        def compiled_path(name: str, make) -> None:
            torch._dynamo.reset()
            cold, out = timed(make(), *inputs)
            torch._dynamo.reset()
            fn = make()
            warm, out = timed(fn, *inputs)
            med, p90 = steady(fn, inputs, args.calls)
            diff = float((out - want).abs().max())
            res[name] = {"first_cold_ms": cold, "first_warm_ms": warm, "median_ms": med, "p90_ms": p90,
                         "max_abs_diff": diff}  # fmt: skip

        compiled_path("torch.compile, inductor", lambda: torch.compile(model, backend="inductor"))
        root = Path(tempfile.mkdtemp(prefix="tpubox-bench-minilm-"))
        daemon = Daemon(root, {"bench": {"token": TOKEN, "session": {"max_device_mib": 2048}}})
        daemon.start()
        try:
            with tpubox.connect(daemon.unix, TOKEN, label="bench minilm") as s:
                before = s.usage().executions
                compiled_path(
                    'torch.compile, backend="tpubox"',
                    lambda: torch.compile(model, backend="tpubox", options={"session": s}),
                )
                ran = s.usage().executions - before
                assert ran >= args.calls + 5, f"only {ran} executions on the daemon"
        finally:
            daemon.kill()
    eager = res["PyTorch eager"]["median_ms"]
    head = ("MiniLM forward", "first call, cold", "first call, warm", "median", "p90", "vs eager", "max |diff|")
    rows = []
    for name, r in res.items():
        rows.append((
            name,
            f"{r['first_cold_ms'] / 1e3:.2f} s" if "first_cold_ms" in r else "",
            f"{r['first_warm_ms'] / 1e3:.2f} s" if "first_warm_ms" in r else "",
            f"{r['median_ms']:.1f} ms",
            f"{r['p90_ms']:.1f} ms",
            f"{eager / r['median_ms']:.2f} x",
            f"{r['max_abs_diff']:.1e}",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    print(f"all-MiniLM-L6-v2 forward, batch {args.batch} x {args.seq} tokens, f32, CPU "
          f"({args.calls} calls after 3 warm-up; torch {torch.__version__}, {os.cpu_count()} threads)")  # fmt: skip
    print(line(head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    ratio = eager / res['torch.compile, backend="tpubox"']["median_ms"]
    print(f'backend="tpubox" vs PyTorch eager: {ratio:.2f}x (aim: at least 1x)')
    if args.json:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
