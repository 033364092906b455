"""The cost of one op and one call (issue 46; not run in CI).

    python python/bench/bench_op_cost.py [--reps 7] [--threads 2] [--json]
    python python/bench/bench_op_cost.py --jax      # from the JAX venv ($CACHE/venv-jax)

Starts a `tpubox serve` session daemon (python/tests/tpubox_daemon.Daemon, the CPU plugin, the
client on its Unix socket and so its local socket) and prints, measured side by side in one run
(REPS repetitions, medians):

- PyTorch on the CPU vs eager device tensors in DEFER_NEVER (``x.to(tpubox.torch.device())``):
  one 4-float add then ``.cpu()``, and 20 chained adds not read (in all and per op; the adds of
  the last repetition are read after the clock stops);
- with ``--jax``: ``tpubox.jax.jit`` of a tiny function (``x * 2 + 1`` on 4 floats, a Tensor in
  and out) vs ``jax.jit`` on the CPU, per call (calls not read; ``jax.jit`` dispatches
  asynchronously, so its number is dispatch only, and ``block_until_ready`` per call beside it).

Aims (issue 46): DEFER_NEVER at most 20 µs per op not read, an op plus its read at most 100 µs,
``tpubox.jax.jit`` at most 150 µs per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402

import tpubox  # noqa: E402
from tpubox_daemon import Daemon  # noqa: E402

TOKEN = "bench-token"
CHAIN = 20


def timed(fn: Callable[[], Any], n: int, reps: int) -> float:
    """Median over REPS repetitions of FN's time per call in µs (N calls a repetition)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(out)


def torch_rows(s: tpubox.Session, reps: int, threads: int) -> dict[str, float]:
    import torch

    import tpubox.torch as tt

    torch.set_num_threads(threads)
    dev = tt.device(session=s)
    res: dict[str, float] = {}
    x_cpu = torch.ones(4)
    with tt.set_eager_mode(tt.EagerMode.DEFER_NEVER):
        x_dev = x_cpu.to(dev)
        for name, x in (("cpu", x_cpu), ("never", x_dev)):

            def op_read(x: Any = x) -> None:
                (x + 1).cpu()

            def chain(x: Any = x) -> Any:
                y = x
                for _ in range(CHAIN):
                    y = y + 1
                return y

            for _ in range(20):  # warm: compile, caches
                op_read()
                chain().cpu()
            res[f"{name}_op_read_us"] = timed(op_read, 200, reps)
            res[f"{name}_chain_us"] = timed(chain, 20, reps)
            chain().cpu()  # what was launched is read (and waited for) before the next row
            res[f"{name}_per_op_us"] = res[f"{name}_chain_us"] / CHAIN
    return res


def jax_rows(s: tpubox.Session, reps: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    import tpubox.jax as tj

    def f(x: Any) -> Any:
        return x * 2 + 1

    res: dict[str, float] = {}
    x_host = np.ones(4, np.float32)
    xt = s.tensor(x_host)
    xj = jnp.asarray(x_host)
    tf = tj.jit(f, session=s)
    jf = jax.jit(f)
    for _ in range(20):
        tf(xt)
        jf(xj).block_until_ready()
    res["tpubox_jit_us"] = timed(lambda: tf(xt), 200, reps)
    res["tpubox_jit_read_us"] = timed(lambda: tf(xt).numpy(), 200, reps)
    res["jax_jit_us"] = timed(lambda: jf(xj), 200, reps)
    res["jax_jit_block_us"] = timed(lambda: jf(xj).block_until_ready(), 200, reps)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--jax", action="store_true", help="tpubox.jax.jit vs jax.jit (JAX venv)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"tpubox-bench-opcost-{os.getpid()}"
    daemon = Daemon(root, {"bench": {"token": TOKEN, "session": {"max_device_mib": 1024}}})
    daemon.start()
    try:
        with tpubox.connect(daemon.unix, TOKEN, label="bench op cost") as s:
            assert s.transport == "local", s.transport
            res = jax_rows(s, args.reps) if args.jax else torch_rows(s, args.reps, args.threads)
    finally:
        daemon.kill()
    if args.jax:
        print(f"tpubox.jax.jit vs jax.jit of x * 2 + 1 on 4 floats (median of {args.reps})")
        print(f"  jax.jit (CPU), dispatch only       {res['jax_jit_us']:8.1f} µs per call")
        print(f"  jax.jit (CPU), block_until_ready   {res['jax_jit_block_us']:8.1f} µs per call")
        print(f"  tpubox.jax.jit, Tensor out         {res['tpubox_jit_us']:8.1f} µs per call")
        print(f"  tpubox.jax.jit, then .numpy()      {res['tpubox_jit_read_us']:8.1f} µs per call")
        print(f"aim: tpubox.jax.jit at most 150 µs per call: {res['tpubox_jit_us'] <= 150}")
    else:
        print(f"one 4-float add (median of {args.reps}; torch threads {args.threads})")
        print(f"{'':34}{'PyTorch CPU':>14}{'DEFER_NEVER':>14}")
        for label, key in (
            ("add then .cpu()", "op_read_us"),
            (f"{CHAIN} chained adds, not read", "chain_us"),
            ("  per op", "per_op_us"),
        ):
            print(f"{label:34}{res['cpu_' + key]:11.1f} µs{res['never_' + key]:11.1f} µs")
        print(
            f"aims: per op not read <= 20 µs: {res['never_per_op_us'] <= 20}; "
            f"op + read <= 100 µs: {res['never_op_read_us'] <= 100}"
        )
    if args.json:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
