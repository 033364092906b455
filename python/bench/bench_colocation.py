"""Benchmark: a trainer's step time alone vs with a sampler beside it on the same device
(issue 34; not run in CI).

    python python/bench/bench_colocation.py [--steps 200] [--rounds 4] [--every 10]
        [--vocab 128] [--batch 2048] [--tokens 24] [--json]

Starts a `tpubox serve` session daemon (python/tests/tpubox_daemon.Daemon: the CPU plugin, no
tokens, so both sessions are the tenant `anonymous`) and runs the colocation example's trainer
(examples/ray-colocation/bigram.py: one full-batch SGD step of a bigram model, W [V, V] and the
one-hot batch X, Y [B, V] on the device, W published as a weight set every EVERY steps, the step
after a publish not donating W) in this process, without Ray, and the example's sampler in a
second process with its own session: it opens the latest published version again and again and
greedily decodes TOKENS tokens with it (one logits program per token, [1, V] @ W, argmax on the
host), as fast as it can, whenever it is told to run.

In one run, ROUNDS rounds (after 50 warm-up steps), each of:

1. **trainer alone**: STEPS / ROUNDS timed steps, the sampler paused (idle, between samples);
2. **trainer beside the sampler**: as many steps, the sampler running;
3. **sampler alone**: the sampler running for as long as phase 2 took, the trainer idle.

The rounds interleave the conditions so that the machine's drift (other processes on a shared
machine) falls on both alike. A step is the trainer's one `Call` (W, X, Y in, W' kept on the
device, the old W freed); a publish is timed apart (not part of a step). Prints the median and
p90 of the steps of each condition over all rounds, their ratio, the publish time, and the
sampler's tokens per second with and without the trainer. W of the last version is checked
against NumPy's replay of the steps (1e-4 of W's scale) so that the numbers are of a correct
trainer.

On the CPU plugin the "device" is the host's cores, which the daemon, the trainer's and the
sampler's Python processes share: the ratio measures that contention as much as the device's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(REPO / "examples" / "ray-colocation"))

import bigram  # noqa: E402
import tpubox  # noqa: E402
from tpubox_daemon import Daemon  # noqa: E402

NAME = "bigram"
WARMUP = 50


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class Trainer:
    """The example's trainer on a plain session: W, X, Y on the device, one Call per step."""

    def __init__(self, s: tpubox.Session, vocab: int, batch: int, every: int):
        self.s, self.every = s, every
        self.x, self.y = bigram.batch(vocab, batch)
        self.lr = bigram.LR
        self.step = s.compile(bigram.train_step_program(vocab, batch, self.lr))
        self.xt, self.yt = s.tensor(self.x), s.tensor(self.y)
        self.w0 = bigram.initial_weights(vocab)
        self.w = s.tensor(self.w0)
        self.published = False
        self.steps = 0
        self.versions: dict[int, int] = {}  # version -> steps

    def run(self, n: int) -> tuple[list[float], list[float]]:
        """N steps; returns each step's and each publish's wall time in ms."""
        step_ms, publish_ms = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            (nxt,) = self.step.call(
                self.w,
                self.xt,
                self.yt,
                fetch=False,
                donate=() if self.published else (0,),
                free=(self.w,),
            )
            step_ms.append((time.perf_counter() - t0) * 1e3)
            self.w, self.published = nxt, False
            self.steps += 1
            if self.steps % self.every == 0:
                t0 = time.perf_counter()
                v = self.s.publish_weights(NAME, {"w": self.w})
                publish_ms.append((time.perf_counter() - t0) * 1e3)
                self.versions[v] = self.steps
                self.published = True
        return step_ms, publish_ms

    def check(self) -> float:
        """Relative max error of the latest published W against NumPy's replay."""
        ws = self.s.weights(NAME)
        got = ws["w"].numpy()
        self.s.free(*ws.values())
        ref = self.w0
        for _ in range(self.versions[ws.version]):
            ref = bigram.reference_step(ref, self.x, self.y, self.lr)
        return float(np.abs(got - ref).max() / np.abs(ref).max())


def sampler(address: str, vocab: int, tokens: int, go, idle, count, stop) -> None:
    """The sampler process: while GO is set, opens the latest version, decodes TOKENS greedy
    tokens, frees it, and adds them to COUNT (samples, tokens); otherwise sets IDLE and waits.
    Ends on STOP."""
    with tpubox.connect(address) as s:
        logits = s.compile(bigram.logits_program(vocab))
        while not stop.is_set():
            if not go.is_set():
                idle.set()
                go.wait(0.05)
                continue
            idle.clear()
            ws = s.weights(NAME)
            try:
                tok = bigram.START
                for _ in range(tokens):
                    (row,) = logits.call(bigram.one_hot([tok], vocab), ws["w"])
                    tok = int(np.argmax(row[0]))
            finally:
                s.free(*ws.values())
            with count.get_lock():
                count[0] += 1
                count[1] += tokens


class Sampler:
    """Drives the sampler process: :meth:`run` starts it sampling (returns once it sampled
    once), :meth:`pause` stops it between two samples; :meth:`tokens` counts."""

    def __init__(self, ctx, address: str, vocab: int, tokens: int):
        self.go, self.idle, self.stop = ctx.Event(), ctx.Event(), ctx.Event()
        self.count = ctx.Array("q", 2)
        self.proc = ctx.Process(
            target=sampler,
            args=(address, vocab, tokens, self.go, self.idle, self.count, self.stop),
            daemon=True,
        )
        self.proc.start()
        if not self.idle.wait(120):
            raise RuntimeError("the sampler did not start in 120 s")

    def counts(self) -> tuple[int, int]:
        with self.count.get_lock():
            return self.count[0], self.count[1]

    def run(self) -> None:
        n = self.counts()[0]
        self.go.set()
        deadline = time.monotonic() + 60
        while self.counts()[0] == n:  # it is sampling (and no longer idle)
            if time.monotonic() > deadline:
                raise RuntimeError("the sampler did not sample in 60 s")
            time.sleep(0.001)

    def pause(self) -> None:
        self.go.clear()
        if not self.idle.wait(60):
            raise RuntimeError("the sampler did not pause in 60 s")

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        self.proc.join(30)


def stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"median_ms": float("nan"), "p90_ms": float("nan"), "n": 0}
    return {"median_ms": statistics.median(xs), "p90_ms": percentile(xs, 0.9), "n": len(xs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="timed steps per condition")
    p.add_argument("--rounds", type=int, default=4, help="rounds the steps are split into")
    p.add_argument("--every", type=int, default=10, help="publish every this many steps")
    p.add_argument("--vocab", type=int, default=128, help="V (>= 32)")
    p.add_argument("--batch", type=int, default=2048, help="B (the corpus's pairs repeated)")
    p.add_argument("--tokens", type=int, default=24, help="tokens per sample")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON too")
    args = p.parse_args()
    if args.vocab < bigram.VOCAB:
        p.error(f"--vocab must be at least {bigram.VOCAB}")
    per_round = max(1, args.steps // args.rounds)

    ctx = mp.get_context("spawn")
    step = {"alone": [], "beside": []}
    publish = {"alone": [], "beside": []}
    tokens = {"beside": 0, "alone": 0}
    seconds = {"beside": 0.0, "alone": 0.0}
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp), None) as d:
        with tpubox.connect(d.unix) as s:
            tr = Trainer(s, args.vocab, args.batch, args.every)
            tr.run(max(WARMUP, args.every))  # warm-up; publishes a first version
            smp = Sampler(ctx, d.unix, args.vocab, args.tokens)
            try:
                for _ in range(args.rounds):
                    # 1. the trainer alone (the sampler idle)
                    st, pu = tr.run(per_round)
                    step["alone"] += st
                    publish["alone"] += pu
                    # 2. the trainer beside the sampler
                    smp.run()
                    t0, n0 = time.perf_counter(), smp.counts()[1]
                    st, pu = tr.run(per_round)
                    took = time.perf_counter() - t0
                    tokens["beside"] += smp.counts()[1] - n0
                    seconds["beside"] += took
                    step["beside"] += st
                    publish["beside"] += pu
                    # 3. the sampler alone, as long
                    t0, n0 = time.perf_counter(), smp.counts()[1]
                    time.sleep(took)
                    tokens["alone"] += smp.counts()[1] - n0
                    seconds["alone"] += time.perf_counter() - t0
                    smp.pause()
            finally:
                smp.close()
            check = {"rel_err": tr.check(), "steps": tr.steps, "versions": len(tr.versions)}
            assert check["rel_err"] <= 1e-4, check

    res = {
        "alone": {**stats(step["alone"]), "publish_median_ms": statistics.median(publish["alone"])},
        "beside": {
            **stats(step["beside"]),
            "publish_median_ms": statistics.median(publish["beside"]),
        },
        "sampler_tokens_per_s": {k: tokens[k] / seconds[k] for k in tokens},
        "check": check,
        "args": vars(args),
    }
    alone = res["alone"]["median_ms"]
    rate = res["sampler_tokens_per_s"]

    def row(name: str, r: dict[str, float]) -> str:
        cells = [
            name,
            f"{r['median_ms']:.3f} ms",
            f"{r['p90_ms']:.3f} ms",
            f"{r['median_ms'] / alone:.2f}",
            f"{r['publish_median_ms']:.3f} ms",
        ]
        return "| " + " | ".join(cells) + " |"

    print(
        f"trainer step of a bigram model, V={args.vocab}, B={args.batch}: {per_round * args.rounds}"
        f" steps per condition in {args.rounds} interleaved rounds, publish every {args.every};"
        f" sampler {args.tokens} tokens per sample"
    )
    print()
    print("| trainer step | median | p90 | ratio | publish median |")
    print("|---|---|---|---|---|")
    print(row("alone", res["alone"]))
    print(row("beside the sampler", res["beside"]))
    print()
    print(
        f"sampler: {rate['alone']:.0f} tokens/s alone, {rate['beside']:.0f} tokens/s beside the "
        f"trainer ({rate['beside'] / rate['alone']:.2f})"
    )
    print()
    print(
        f"last version ({check['versions']} published) vs NumPy's replay of {check['steps']} "
        f"steps: {check['rel_err']:.1e} of W's scale"
    )
    if args.json:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
