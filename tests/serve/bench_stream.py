"""Benchmark (not run in CI): time to the first streamed token vs the full response, with the
real clients, in one run:
    python tests/serve/bench_stream.py [--tokens 256] [--reps 5]
The model is the serve-decoder example (a decoupled model: one token per response). For each
door (gRPC ModelStreamInfer with tritonclient; the generate extension's /generate_stream as
server-sent events, read with http.client) it prints the median time from sending the request to
the first token and to the last, their ratio, and tokens per second. Then the same with 4
streams at once on the one instance. Run with the serve venv
(`~/.cache/tpubox/venv-serve/bin/python`); the daemon is started here on loopback
(test_decoupled.DecoderDaemon, the adversarial tests' tenants).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "hardening"))
sys.path.insert(0, str(HERE))

import test_decoupled as td  # noqa: E402


def grpc_once(d, tokens: int) -> tuple[float, float]:
    s = td.Stream(d)
    try:
        t0 = time.perf_counter()
        s.send("Benchmark prompt", tokens)
        r, e = s.take()
        assert e is None, e
        first = time.perf_counter() - t0
        n = 1
        while True:
            r, e = s.take()
            assert e is None, e
            if td.final_flag(r):
                break
            n += 1
        full = time.perf_counter() - t0
        assert n == tokens, n
        return first, full
    finally:
        s.close()


def sse_once(d, tokens: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    conn, resp, events = td.sse(d, "decoder", {"text_input": "Benchmark prompt", "max_tokens": tokens})
    try:
        next(events)
        first = time.perf_counter() - t0
        n = 1 + sum(1 for _ in events)
        full = time.perf_counter() - t0
        assert n == tokens, n
        return first, full
    finally:
        conn.close()


def concurrent(d, tokens: int, streams: int, once) -> tuple[float, float]:
    out: list[tuple[float, float]] = []
    threads = [threading.Thread(target=lambda: out.append(once(d, tokens))) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(f for f, _ in out), statistics.median(f for _, f in out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    d = td.DecoderDaemon(root).start()
    try:
        sse_once(d, 4)  # warm-up: the decoder compiles here
        print(f"{args.tokens} tokens per request, median of {args.reps}")
        print("| door | streams | first token (ms) | full response (ms) | full / first | tokens/s per stream |")
        print("|---|---|---|---|---|---|")
        for name, once in (("gRPC ModelStreamInfer", grpc_once), ("generate_stream (SSE)", sse_once)):
            for streams in (1, 4):
                runs = [
                    concurrent(d, args.tokens, streams, once) if streams > 1 else once(d, args.tokens)
                    for _ in range(args.reps)
                ]
                first = statistics.median(f for f, _ in runs)
                full = statistics.median(f for _, f in runs)
                print(
                    f"| {name} | {streams} | {first * 1e3:.1f} | {full * 1e3:.0f} | {full / first:.0f} | "
                    f"{args.tokens / full:.0f} |"
                )
    finally:
        d.stop()


if __name__ == "__main__":
    main()
