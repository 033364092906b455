"""Benchmark of the session API as the Python client sees it (not run in CI).

    python python/bench/bench_session.py [--calls 2000] [--json]

Starts a `tpubox serve` session daemon (python/tests/tpubox_daemon.Daemon: Unix socket and
TCP, the CPU plugin, no tokens) and measures, in one run:

- a tiny execute from a guest running in the daemon (tests/guests/probe `exec-loop`, through
  RunComponent), for the floor;
- a tiny execute (a 2-element f32 add, both arguments already on the device, the results
  freed in batches outside the timed calls) per call: through the daemon's local socket (what
  a Unix-socket session on the daemon's machine uses), through gRPC over the Unix socket, and
  through gRPC over TCP: median and p90 in µs over CALLS calls after a warm-up; and, for scale,
  a gRPC call that does no device work (Usage);
- a tiny forward pass from Python (the same add: 2 inputs from NumPy, 1 output back to NumPy)
  on each transport, before and after the one-round-trip ``Call``: put, put, execute, get and
  three frees (``Tensor.free`` each: 7 round trips), against ``exe.call(a, b)`` (1);
- a launch of a long-running program (eight chained 1024×1024 f32 matmuls, inputs on the
  device): how long ``exe.launch`` takes to return, how long ``wait`` then takes, against a
  synchronous execute of the same program (median of 5; local socket and gRPC over Unix);
- put and get of a 64 MiB f32 tensor (GiB/s, best of 5) through the local socket (sealed
  memfds) and through gRPC over the Unix socket, against numpy.copyto of 64 MiB on the same
  machine (the memcpy bound).

Prints a table with ratios. `bash scripts/dev.sh bench` runs it after the Rust benchmarks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import tpubox  # noqa: E402
from tpubox_daemon import Daemon  # noqa: E402

ADD = """
func.func @main(%a: tensor<2xf32>, %b: tensor<2xf32>) -> tensor<2xf32> {
  %0 = stablehlo.add %a, %b : tensor<2xf32>
  func.return %0 : tensor<2xf32>
}
"""

MIB64 = 64 << 20


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def per_call(fn, calls: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1000.0)
    return {"median_us": statistics.median(times), "p90_us": percentile(times, 0.9)}


def tiny_execute(s: tpubox.Session, calls: int, warmup: int) -> dict[str, float]:
    exe = s.compile(ADD)
    a = s.tensor(np.array([1, 2], np.float32))
    b = s.tensor(np.array([3, 4], np.float32))
    outs: list[tpubox.Tensor] = []

    def one():
        (r,) = exe(a, b)
        outs.append(r)
        if len(outs) >= 1000:  # free results in batches, outside the timed call
            return True
        return False

    times = []
    for i in range(warmup + calls):
        t0 = time.perf_counter_ns()
        full = one()
        dt = (time.perf_counter_ns() - t0) / 1000.0
        if i >= warmup:
            times.append(dt)
        if full:
            s.free(*outs)
            outs.clear()
    s.free(*outs, a, b, exe)
    return {"median_us": statistics.median(times), "p90_us": percentile(times, 0.9)}


def tiny_forward(s: tpubox.Session, calls: int, warmup: int) -> dict[str, dict[str, float]]:
    """A forward pass from NumPy to NumPy (2 inputs, 1 output), the old way and in one Call;
    both checked against NumPy first."""
    exe = s.compile(ADD)
    a = np.array([1, 2], np.float32)
    b = np.array([3, 4], np.float32)

    def before():
        ta, tb = s.tensor(a), s.tensor(b)
        (r,) = exe(ta, tb)
        out = r.numpy()
        ta.free()
        tb.free()
        r.free()
        return out

    def after():
        (out,) = exe.call(a, b)
        return out

    assert np.array_equal(before(), a + b) and np.array_equal(after(), a + b)
    res = {"before": per_call(before, calls, warmup), "after": per_call(after, calls, warmup)}
    assert s.usage().live_tensors == 0
    exe.free()
    return res


def long_program(n: int = 8, size: int = 1024) -> str:
    """StableHLO of N chained SIZE×SIZE f32 matmuls (y = x·w, N times)."""
    t = f"tensor<{size}x{size}xf32>"
    lines = [f"func.func @main(%x: {t}, %w: {t}) -> {t} {{"]
    prev = "%x"
    for i in range(n):
        lines.append(
            f"  %y{i} = stablehlo.dot_general {prev}, %w, contracting_dims = [1] x [0]"
            f" : ({t}, {t}) -> {t}"
        )
        prev = f"%y{i}"
    lines.append(f"  func.return {prev} : {t}")
    lines.append("}")
    return "\n".join(lines)


def launch_long(s: tpubox.Session, repeats: int = 5) -> dict[str, float]:
    """ms for `launch` to return and for `wait` after it, and for a synchronous execute."""
    exe = s.compile(long_program())
    x = s.tensor(np.full((1024, 1024), 1 / 1024, np.float32))
    w = s.tensor(np.eye(1024, dtype=np.float32))
    (r,) = exe(x, w)
    r.free()
    launch, wait, sync = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        (p,) = exe.launch(x, w)
        t1 = time.perf_counter()
        p.wait()
        t2 = time.perf_counter()
        launch.append((t1 - t0) * 1e3)
        wait.append((t2 - t1) * 1e3)
        p.free()
        t0 = time.perf_counter()
        (q,) = exe(x, w)
        sync.append((time.perf_counter() - t0) * 1e3)
        q.free()
    s.free(x, w, exe)
    return {
        "launch_ms": statistics.median(launch),
        "wait_ms": statistics.median(wait),
        "execute_ms": statistics.median(sync),
    }


def control_call(s: tpubox.Session, calls: int, warmup: int) -> dict[str, float]:
    return per_call(s.usage, calls, warmup)


def best_rate(fn, nbytes: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 2**30


def transfers(s: tpubox.Session) -> dict[str, float]:
    a = np.random.default_rng(0).standard_normal(MIB64 // 4, dtype=np.float32)
    held: list[tpubox.Tensor] = []

    def put():
        held.append(s.tensor(a))

    put_rate = best_rate(lambda: (put(), held.pop().free()), MIB64)
    t = s.tensor(a)
    got = t.numpy()
    assert np.array_equal(got, a)
    get_rate = best_rate(t.numpy, MIB64)
    t.free()
    dst = np.empty_like(a)
    copy_rate = best_rate(lambda: np.copyto(dst, a), MIB64)
    return {"put_gib_s": put_rate, "get_gib_s": get_rate, "memcpy_gib_s": copy_rate}


def probe_wasm() -> Path:
    """tests/guests/probe, built by `bash scripts/dev.sh setup` (honours CARGO_TARGET_DIR)."""
    import os

    target = Path(os.environ.get("CARGO_TARGET_DIR") or HERE.parent.parent / "target")
    return target / "wasm32-wasip2" / "release" / "tpubox-probe.wasm"


def guest_execute(s: tpubox.Session, calls: int) -> dict[str, float]:
    """µs per tiny execute from a guest in the daemon (probe `exec-loop N`: a scalar f32 add,
    inputs on the device), from the run times of N = CALLS and N = 0 (guests have no clock):
    median of 5 pairs."""
    wasm = probe_wasm().read_bytes()
    per = []
    for _ in range(5):
        t = {}
        for n in (0, calls):
            r = s.run(wasm, ["exec-loop", str(n)], stdout=False, stderr=False)
            assert r.ok, r
            assert r.stdout.strip().endswith(b" 3.75"), r.stdout
            t[n] = r.elapsed
        per.append((t[calls] - t[0]) * 1e6 / calls)
    return {"median_us": statistics.median(per), "p90_us": max(per)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--json", action="store_true", help="print the numbers as JSON too")
    args = p.parse_args()

    import tempfile

    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp), None) as d:
        res: dict[str, dict[str, float]] = {}
        with tpubox.connect(d.unix, local=True) as s:
            res["execute_local"] = tiny_execute(s, args.calls, args.warmup)
            res["forward_local"] = tiny_forward(s, args.calls, args.warmup)
            res["launch_local"] = launch_long(s)
            res["execute_guest"] = guest_execute(s, 10 * args.calls)
            res["transfer_local"] = transfers(s)
        with tpubox.connect(d.unix, local=False) as s:
            res["execute_unix"] = tiny_execute(s, args.calls, args.warmup)
            res["forward_unix"] = tiny_forward(s, args.calls, args.warmup)
            res["launch_unix"] = launch_long(s)
            res["control_unix"] = control_call(s, args.calls, args.warmup)
            res["transfer_unix"] = transfers(s)
        with tpubox.connect(d.tcp, local=False) as s:
            res["execute_tcp"] = tiny_execute(s, args.calls, args.warmup)
            res["forward_tcp"] = tiny_forward(s, args.calls, args.warmup)
            res["control_tcp"] = control_call(s, args.calls, args.warmup)

    el, eu, et = res["execute_local"], res["execute_unix"], res["execute_tcp"]
    cu, ct = res["control_unix"], res["control_tcp"]
    tl, tu = res["transfer_local"], res["transfer_unix"]
    mem = tu["memcpy_gib_s"]

    def us(r):
        return f"{r['median_us']:.0f} µs", f"{r['p90_us']:.0f} µs"

    def ratio(a, b, what):
        return f"{a / b:.2f} × {what}"

    def vs_local(r):
        return ratio(r["median_us"], el["median_us"], "local")

    def rate(r, key):
        return f"{r[key]:.2f} GiB/s", "best of 5", ratio(r[key], mem, "memcpy")

    eg = res["execute_guest"]

    def forward(name: str, key: str) -> list[tuple[str, ...]]:
        f = res[key]
        b, a = f["before"], f["after"]
        return [
            (f"forward 2 in 1 out, {name}: put×2 exec get free×3", *us(b), "1.00"),
            (f"forward 2 in 1 out, {name}: one Call", *us(a),
             ratio(a["median_us"], b["median_us"], "before")),
        ]  # fmt: skip

    def launched(name: str, key: str) -> list[tuple[str, ...]]:
        r = res[key]
        return [
            (f"8 × 1024² matmul, {name}: launch returns", f"{r['launch_ms']:.2f} ms", "median of 5",
             ratio(r["launch_ms"], r["execute_ms"], "execute")),
            (f"8 × 1024² matmul, {name}: then wait", f"{r['wait_ms']:.1f} ms", "median of 5", ""),
            (f"8 × 1024² matmul, {name}: execute", f"{r['execute_ms']:.1f} ms", "median of 5",
             "1.00"),
        ]  # fmt: skip

    rows = [
        ("execute f32 add, guest in the daemon", *us(eg), vs_local(eg)),
        ("execute 2xf32 add, local socket", *us(el), "1.00"),
        ("execute 2xf32 add, gRPC, Unix socket", *us(eu), vs_local(eu)),
        ("execute 2xf32 add, gRPC, TCP", *us(et), vs_local(et)),
        ("Usage (no device work), gRPC, Unix", *us(cu), vs_local(cu)),
        ("Usage (no device work), gRPC, TCP", *us(ct), vs_local(ct)),
        *forward("local socket", "forward_local"),
        *forward("gRPC, Unix socket", "forward_unix"),
        *forward("gRPC, TCP", "forward_tcp"),
        *launched("local socket", "launch_local"),
        *launched("gRPC, Unix socket", "launch_unix"),
        ("put 64 MiB f32, local socket (memfd)", *rate(tl, "put_gib_s")),
        ("get 64 MiB f32, local socket (memfd)", *rate(tl, "get_gib_s")),
        ("put 64 MiB f32, gRPC, Unix socket", *rate(tu, "put_gib_s")),
        ("get 64 MiB f32, gRPC, Unix socket", *rate(tu, "get_gib_s")),
        ("numpy.copyto 64 MiB (memcpy)", f"{mem:.2f} GiB/s", "best of 5", "1.00"),
    ]  # fmt: skip
    head = ("session API from Python", "median / rate", "p90", "ratio")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    print(f"tpubox session API, Python client ({args.calls} calls after {args.warmup} warm-up)")
    print(line(head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    if args.json:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
