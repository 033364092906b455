"""Benchmark of published weight versions (issue 34, part 3) as the Python client sees them
(not run in CI).

    python python/bench/bench_publish.py [--publishes 20] [--warmup 3] [--poll-ms 0.5] [--json]

A MiniLM-sized weight set (all-MiniLM-L6-v2's 103 tensors and shapes: 30522×384 word
embeddings, 6 layers of 384×384 q/k/v/o, 384×1536, 1536×384, biases and layer norms, a
pooler; 22.7 M f32 parameters, 90.9 MB) is uploaded once by a *trainer* session (outside
everything measured); each round the trainer makes new parameters on the device (one program
over all 103 tensors, p + 0.001: a stand-in for a training step) and frees the previous ones.
Three runs, each in a `tpubox serve` of its own (python/tests/tpubox_daemon.Daemon: Unix
socket, the CPU plugin, no tokens: the anonymous tenant may publish), so that each has its own
peak gauge:

1. *trainer alone*: the steps, nothing published: the trainer's own footprint as the device
   sees it (``tpubox_device_live_bytes{at="peak"}``), and its step time;
2. *publishing*: after each step the trainer publishes the new parameters
   (``publish_weights``); a *reader*, another session in another process (a sampler), polls
   ``weight_versions`` every POLL_MS and, when it sees the new version, opens it (``weights``)
   and drops the one it held; the trainer frees its previous parameters once the reader has
   the new version;
3. *lagging*: as 2, plus a reader that keeps every version until two newer ones came (a slow
   sampler), so that readers hold one version the trainer has freed.

Measured over PUBLISHES rounds after WARMUP: the ``publish_weights`` call alone,
publish-to-visible (the publish call's start until the reader's ``weight_versions`` reports
the new version) and publish-to-opened (until its ``weights`` returned it), median and p90
(time.monotonic_ns, one clock for both processes); the device's live bytes
(``tpubox_device_live_bytes{at="now"}``) just before each publish and after the reader took
the new version; the daemon's transfer counters (``tpubox_transfer_bytes_total{direction}``)
over the rounds; and each run's peak of live device bytes, against the trainer's own footprint
(run 1) plus the versions readers hold that the trainer no longer does (none in run 2, one in
run 3). Last, for scale, what publishing through the host would cost: every tensor of the set
read back and uploaded again.

Prints a table; checks the last version's values against NumPy; exits 1 when a bound is
broken, a publish added device bytes or anything crossed between host and device.
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
from tpubox_daemon import metric as daemon_metric  # noqa: E402

NAME = "minilm"
DELTA = np.float32(1e-3)


def minilm_shapes() -> dict[str, tuple[int, ...]]:
    """The tensors of sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384,
    intermediate 1536, vocabulary 30522, 512 positions), by name."""
    h, i, layers = 384, 1536, 6
    s: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (30522, h),
        "embeddings.position_embeddings.weight": (512, h),
        "embeddings.token_type_embeddings.weight": (2, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for n in range(layers):
        p = f"encoder.layer.{n}"
        for m in ("query", "key", "value"):
            s[f"{p}.attention.self.{m}.weight"] = (h, h)
            s[f"{p}.attention.self.{m}.bias"] = (h,)
        s[f"{p}.attention.output.dense.weight"] = (h, h)
        s[f"{p}.attention.output.dense.bias"] = (h,)
        s[f"{p}.attention.output.LayerNorm.weight"] = (h,)
        s[f"{p}.attention.output.LayerNorm.bias"] = (h,)
        s[f"{p}.intermediate.dense.weight"] = (h, i)
        s[f"{p}.intermediate.dense.bias"] = (i,)
        s[f"{p}.output.dense.weight"] = (i, h)
        s[f"{p}.output.dense.bias"] = (h,)
        s[f"{p}.output.LayerNorm.weight"] = (h,)
        s[f"{p}.output.LayerNorm.bias"] = (h,)
    s["pooler.dense.weight"] = (h, h)
    s["pooler.dense.bias"] = (h,)
    return s


def ty(shape: tuple[int, ...]) -> str:
    return f"tensor<{'x'.join(str(d) for d in shape)}xf32>"


def step_program(shapes: list[tuple[int, ...]]) -> str:
    """StableHLO of one 'training step' over every tensor of the set: p + DELTA each."""
    args = ", ".join(f"%p{i}: {ty(s)}" for i, s in enumerate(shapes))
    results = ", ".join(ty(s) for s in shapes)
    lines = [f"func.func @main({args}) -> ({results}) {{"]
    for i, s in enumerate(shapes):
        lines.append(f"  %c{i} = stablehlo.constant dense<{float(DELTA):.9e}> : {ty(s)}")
        lines.append(f"  %r{i} = stablehlo.add %p{i}, %c{i} : {ty(s)}")
    lines.append(f"  func.return {', '.join(f'%r{i}' for i in range(len(shapes)))} : {results}")
    lines.append("}")
    return "\n".join(lines)


def metric(text: str, name: str, **labels: str) -> float:
    """As tpubox_daemon.metric, but KeyError when the daemon has no such sample."""
    v = daemon_metric(text, name, **labels)
    if v is None:
        raise KeyError(f"{name}{labels or ''} is not in /metrics")
    return v


# What the daemon's /metrics say about device memory and transfers: (metric, labels).
GAUGES = {
    "live": ("tpubox_device_live_bytes", {"at": "now"}),
    "peak": ("tpubox_device_live_bytes", {"at": "peak"}),
    "d2h": ("tpubox_transfer_bytes_total", {"direction": "device_to_host"}),
    "h2d": ("tpubox_transfer_bytes_total", {"direction": "host_to_device"}),
}


def gauges(d: Daemon) -> dict[str, float]:
    text = d.metrics()
    return {k: metric(text, name, **labels) for k, (name, labels) in GAUGES.items()}


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _reader_main(address: str, poll_s: float, out, stop) -> None:
    """The reader process: polls ``weight_versions`` every POLL_S seconds and, on a new
    version, opens it and drops the one it held; puts (version, seen_ns, opened_ns) on OUT
    (time.monotonic_ns, one clock for every process of the machine), then ("polls",
    median poll ns) when STOP is set, or ("error", text)."""
    try:
        with tpubox.connect(address, label="bench reader") as s:
            last, held, polls = 0, None, []
            while not stop.is_set():
                t0 = time.monotonic_ns()
                latest = s.weight_versions(NAME).latest
                t1 = time.monotonic_ns()
                polls.append(t1 - t0)
                if latest > last:
                    ws = s.weights(NAME)
                    t2 = time.monotonic_ns()
                    if held is not None:
                        s.free(*held.values())
                    held, last = ws, ws.version
                    out.put((ws.version, t1, t2))
                elif poll_s > 0:
                    time.sleep(poll_s)
            out.put(("polls", statistics.median(polls) if polls else 0))
    except BaseException as e:  # noqa: BLE001 - reported by the main process
        out.put(("error", repr(e)))


class Reader:
    """A reader in another process (:func:`_reader_main`); :meth:`wait` returns the times
    (time.monotonic_ns) it saw and opened a version."""

    def __init__(self, address: str, poll_s: float):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # no fork of a process that has gRPC channels
        self.out = ctx.Queue()
        self.stop_event = ctx.Event()
        self.proc = ctx.Process(
            target=_reader_main, args=(address, poll_s, self.out, self.stop_event), daemon=True
        )
        self.poll_ns = 0.0

    def start(self) -> None:
        self.proc.start()

    def wait(self, version: int, timeout: float = 60) -> tuple[int, int]:
        while True:
            msg = self.out.get(timeout=timeout)
            if msg[0] == "error":
                raise RuntimeError(f"the reader failed: {msg[1]}")
            if msg[0] == version:
                return msg[1], msg[2]
            if not (isinstance(msg[0], int) and msg[0] < version):
                raise RuntimeError(f"the reader reported {msg!r} while version {version} was due")

    def close(self) -> None:
        self.stop_event.set()
        msg = self.out.get(timeout=60)
        if msg[0] == "error":
            raise RuntimeError(f"the reader failed: {msg[1]}")
        self.poll_ns = float(msg[1])
        self.proc.join(timeout=30)


class Trainer:
    """A daemon of its own (so that its peak gauge is this run's alone) with a trainer session
    holding the set, uploaded once, and the step compiled."""

    def __init__(self, tmp: Path, init: dict[str, np.ndarray]):
        self.names = list(init)
        self.d = Daemon(tmp, None).start()
        self.s = tpubox.connect(self.d.unix, label="bench trainer")
        t0 = time.perf_counter()
        self.step = self.s.compile(step_program([init[n].shape for n in self.names]))
        self.compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.params = [self.s.tensor(init[n]) for n in self.names]
        self.upload_s = time.perf_counter() - t0
        self.steps = 0

    def next_params(self) -> tuple[list[tpubox.Tensor], float]:
        t0 = time.perf_counter()
        new = self.step(*self.params)
        self.steps += 1
        return new, time.perf_counter() - t0

    def close(self) -> None:
        self.s.close()
        self.d.stop()


def trainer_alone(tmp: Path, init: dict[str, np.ndarray], rounds: int) -> dict:
    """The trainer's own footprint as the device sees it: ROUNDS steps, each freeing the
    previous parameters, nothing published, nobody reading."""
    t = Trainer(tmp, init)
    try:
        times = []
        for _ in range(rounds):
            new, dt = t.next_params()
            times.append(dt)
            t.s.free(*t.params)
            t.params = new
        g = gauges(t.d)
        return {
            "step_s": times,
            "peak": g["peak"],
            "session_peak": t.s.usage().peak_device_bytes,
            "upload_s": t.upload_s,
        }
    finally:
        t.close()


def publishing(
    tmp: Path, init: dict[str, np.ndarray], args: argparse.Namespace, lag: bool
) -> dict:
    """The trainer publishing after every step while a reader in another process takes each
    version (and, with LAG, a reader that keeps every version until two newer ones came)."""
    t = Trainer(tmp, init)
    reader = Reader(t.d.unix, args.poll_ms / 1e3)
    lagging = tpubox.connect(t.d.unix, label="bench lagging reader") if lag else None
    lag_held: list = []
    out: dict = {}
    try:
        version = t.s.publish_weights(NAME, dict(zip(t.names, t.params)))
        reader.start()
        reader.wait(version)

        def round_() -> dict[str, float]:
            nonlocal version
            new, step_s = t.next_params()
            before = gauges(t.d)
            t0 = time.monotonic_ns()
            v = t.s.publish_weights(NAME, dict(zip(t.names, new)))
            t1 = time.monotonic_ns()
            assert v == version + 1, (v, version)
            seen, opened = reader.wait(v)
            after = gauges(t.d)
            if lagging is not None:
                # The slow sampler takes the new version and drops the one from two publishes
                # ago: it holds v and v-1 from here on, v-1 freed by the trainer.
                lag_held.append(lagging.weights(NAME))
                if len(lag_held) > 2:
                    lagging.free(*lag_held.pop(0).values())
            t.s.free(*t.params)
            t.params, version = new, v
            return {
                "step_s": step_s,
                "publish_s": (t1 - t0) / 1e9,
                "visible_s": (seen - t0) / 1e9,
                "opened_s": (opened - t0) / 1e9,
                "live_before": before["live"],
                "live_after": after["live"],
            }

        for _ in range(args.warmup):
            round_()
        g0 = gauges(t.d)
        rounds = [round_() for _ in range(args.publishes)]
        g1 = gauges(t.d)
        out.update(
            rounds=rounds,
            d2h=g1["d2h"] - g0["d2h"],
            h2d=g1["h2d"] - g0["h2d"],
            peak=g1["peak"],
            session_peak=t.s.usage().peak_device_bytes,
        )
        for ws in lag_held:
            lagging.free(*ws.values())
        reader.close()
        out["poll_ms"] = reader.poll_ns / 1e6

        # The last version's values, read back only now.
        check = [n for n in t.names if n.endswith("LayerNorm.bias")][0]
        want = init[check].copy()
        for _ in range(t.steps):
            want = want + DELTA
        got = t.s.weights(NAME)
        assert got.version == version
        np.testing.assert_array_equal(got[check].numpy(), want)
        t.s.free(*got.values())

        if not lag:
            # For scale: the set through the host (every tensor read back, then uploaded).
            t0 = time.perf_counter()
            host = [p.numpy() for p in t.params]
            t1 = time.perf_counter()
            again = [t.s.tensor(a) for a in host]
            t2 = time.perf_counter()
            t.s.free(*again)
            out["host_get_s"], out["host_put_s"] = t1 - t0, t2 - t1
        return out
    finally:
        if lagging is not None:
            lagging.close()
        if reader.proc.is_alive():
            reader.proc.kill()
        t.close()


def run(args: argparse.Namespace) -> dict:
    import tempfile

    shapes = minilm_shapes()
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    set_bytes = 4 * n_params
    rng = np.random.default_rng(0)
    init = {n: (rng.standard_normal(s, dtype=np.float32) * 0.02) for n, s in shapes.items()}
    res: dict = {"tensors": len(shapes), "params": n_params, "set_bytes": set_bytes}

    with tempfile.TemporaryDirectory() as tmp:
        alone = trainer_alone(Path(tmp) / "alone", init, args.warmup + args.publishes)
        pub = publishing(Path(tmp) / "publish", init, args, lag=False)
        lag = publishing(Path(tmp) / "lag", init, args, lag=True)

    def stats(xs: list[float]) -> dict[str, float]:
        ms = [x * 1e3 for x in xs]
        return {"median_ms": statistics.median(ms), "p90_ms": percentile(ms, 0.9)}

    rounds = pub["rounds"]
    res["rounds"] = len(rounds)
    res["upload_s"] = alone["upload_s"]
    res["step_alone"] = stats(alone["step_s"][args.warmup :])
    for key in ("step_s", "publish_s", "visible_s", "opened_s"):
        res[key.removesuffix("_s")] = stats([r[key] for r in rounds])
    res["poll_ms"] = pub["poll_ms"]
    res["poll_interval_ms"] = args.poll_ms
    res["live_delta_max"] = max(abs(r["live_after"] - r["live_before"]) for r in rounds)
    res["lag_live_delta_max"] = max(
        abs(r["live_after"] - r["live_before"]) for r in lag["rounds"]
    )
    res["device_to_host"], res["host_to_device"] = pub["d2h"], pub["h2d"]
    res["lag_device_to_host"], res["lag_host_to_device"] = lag["d2h"], lag["h2d"]
    res["host_get_s"], res["host_put_s"] = pub["host_get_s"], pub["host_put_s"]
    # The trainer's own footprint: the peak of the same steps with nothing published. Readers
    # hold no version the trainer does not in the publishing run (the reader drops version v
    # before the trainer frees it) and one in the lagging run (v-1).
    res["peak_alone"], res["session_peak_alone"] = alone["peak"], alone["session_peak"]
    res["peak_publish"], res["session_peak_publish"] = pub["peak"], pub["session_peak"]
    res["peak_lag"], res["session_peak_lag"] = lag["peak"], lag["session_peak"]
    res["bound_publish"] = alone["peak"]
    res["bound_lag"] = alone["peak"] + set_bytes
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--publishes", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--poll-ms", type=float, default=0.5, help="the reader's sleep between polls (0: none)"
    )
    p.add_argument("--json", action="store_true", help="print the numbers as JSON too")
    args = p.parse_args()
    r = run(args)

    mb = lambda b: f"{b / 1e6:.1f} MB"  # noqa: E731
    ms = lambda x: (f"{x['median_ms']:.2f} ms", f"{x['p90_ms']:.2f} ms")  # noqa: E731
    sets = lambda b: f"{b / r['set_bytes']:.2f} sets"  # noqa: E731
    rows = [
        ("weight set", f"{r['tensors']} tensors, {r['params'] / 1e6:.2f} M f32",
         mb(r["set_bytes"]), ""),
        ("upload of the set (once, not measured below)", f"{r['upload_s'] * 1e3:.0f} ms", "", ""),
        ("trainer step (p + 0.001, all tensors), alone", *ms(r["step_alone"]), ""),
        ("trainer step, publishing after each", *ms(r["step"]), ""),
        ("publish_weights call", *ms(r["publish"]), ""),
        ("publish → visible to a reader (weight_versions)", *ms(r["visible"]),
         f"poll {r['poll_ms']:.2f} ms every {r['poll_interval_ms']:g} ms"),
        ("publish → opened by the reader (weights)", *ms(r["opened"]), ""),
        ("device bytes a publish adds (live, max over rounds)", f"{r['live_delta_max']:.0f} B",
         "", f"lagging run: {r['lag_live_delta_max']:.0f} B"),
        (f"device→host / host→device bytes over {r['rounds']} publishes",
         f"{r['device_to_host']:.0f} / {r['host_to_device']:.0f} B", "",
         f"lagging run: {r['lag_device_to_host']:.0f} / {r['lag_host_to_device']:.0f} B"),
        ("peak device bytes, trainer alone (its footprint)", mb(r["peak_alone"]),
         sets(r["peak_alone"]), f"its session's own count: {sets(r['session_peak_alone'])}"),
        ("peak device bytes, publishing, reader keeps up", mb(r["peak_publish"]),
         sets(r["peak_publish"]), f"bound {sets(r['bound_publish'])} (footprint)"),
        ("peak device bytes, + a reader 2 versions behind", mb(r["peak_lag"]),
         sets(r["peak_lag"]), f"bound {sets(r['bound_lag'])} (footprint + 1 held)"),
        ("for scale: the set through the host (get / put)",
         f"{r['host_get_s'] * 1e3:.0f} / {r['host_put_s'] * 1e3:.0f} ms", "", ""),
    ]  # fmt: skip
    head = ("published weights, MiniLM-sized set", "median / value", "p90", "note")
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(4)]

    def line(row: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    print(f"tpubox published weights ({r['rounds']} publishes after {args.warmup} warm-up, "
          "in each run)")  # fmt: skip
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))
    ok = (
        r["peak_publish"] <= r["bound_publish"]
        and r["peak_lag"] <= r["bound_lag"]
        and r["device_to_host"] == 0
        and r["lag_device_to_host"] == 0
        and r["live_delta_max"] == 0
        and r["lag_live_delta_max"] == 0
    )
    print("within bounds, no transfers, publishes add no bytes:", "yes" if ok else "NO")
    if args.json:
        print(json.dumps(r, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
