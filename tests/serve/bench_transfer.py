"""Benchmark (not run in CI): one 64 MiB tensor through `tpubox serve` three ways, with the real
client, in one run:

    python tests/serve/bench_transfer.py [--mib 64] [--reps 5]

- system shared memory (`tritonclient.utils.shared_memory`: the input read from, the output
  written to registered regions; HTTP and gRPC),
- the binary tensor extension (HTTP) and `raw_input_contents` (gRPC),
- JSON (HTTP; the elements as decimal text, both ways).

The model is the dtypes test model: OUTPUT_FP32 = INPUT_FP32 reversed on the device, so each
call moves MIB in and MIB out, plus one device pass that is the same in every mode (a tiny
other input of each datatype rides along). Prints the median seconds per call and GiB/s of
payload (in + out), and each mode's ratio to shared memory. Run with the serve venv
(`~/.cache/tpubox/venv-serve/bin/python`); the daemon is started here on loopback
(tests/hardening/hardening_util.Daemon, no tokens file).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "hardening"))
sys.path.insert(0, str(HERE))

import hardening_util  # noqa: E402
import serve_util  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402


def _small_inputs(mod, binary: bool):
    out = []
    for dt, a in serve_util.dtypes_data(shape=(1, 2), seed=5).items():
        if dt == "FP32":
            continue
        i = mod.InferInput(f"INPUT_{dt}", list(a.shape), dt)
        if mod is httpclient:
            i.set_data_from_numpy(a, binary_data=binary or dt == "BF16")
        else:
            i.set_data_from_numpy(a)
        out.append(i)
    return out


def _time(fn, reps: int) -> float:
    fn()  # warm-up: the program for this shape compiles here
    return statistics.median(_one(fn) for _ in range(reps))


def _one(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json-reps", type=int, default=2)
    args = ap.parse_args()
    n = (args.mib << 20) // 4
    x = np.random.default_rng(0).standard_normal((1, n)).astype(np.float32)
    want = np.flip(x, axis=-1)
    root = Path(f"/tmp/tpubox-bench-transfer-{uuid.uuid4().hex[:8]}")
    d = hardening_util.Daemon(root, tenants=None, extra_args=("--max-request-mib", "1024")).start()
    try:
        url_h, url_g = f"{d.host}:{d.http_port}", d.grpc_url
        h = httpclient.InferenceServerClient(url_h, network_timeout=600, connection_timeout=600)
        g = grpcclient.InferenceServerClient(url_g)
        u = uuid.uuid4().hex[:8]
        r_in = shm.create_shared_memory_region("in", f"/bench-in-{u}", x.nbytes)
        r_out = shm.create_shared_memory_region("out", f"/bench-out-{u}", x.nbytes)
        shm.set_shared_memory_region(r_in, [x])
        h.register_system_shared_memory("in", f"/bench-in-{u}", x.nbytes)
        h.register_system_shared_memory("out", f"/bench-out-{u}", x.nbytes)

        def shm_call(mod, client):
            def call():
                i = mod.InferInput("INPUT_FP32", list(x.shape), "FP32")
                i.set_shared_memory("in", x.nbytes)
                o = (
                    mod.InferRequestedOutput("OUTPUT_FP32", binary_data=True)
                    if mod is httpclient
                    else mod.InferRequestedOutput("OUTPUT_FP32")
                )
                o.set_shared_memory("out", x.nbytes)
                client.infer("dtypes", [i, *_small_inputs(mod, True)], outputs=[o])
                # The client's view of the result: a NumPy array over the region.
                y = shm.get_contents_as_numpy(r_out, np.float32, list(x.shape))
                assert y[0, 0] == want[0, 0]

            return call

        def inband_call(mod, client, binary: bool):
            def call():
                i = mod.InferInput("INPUT_FP32", list(x.shape), "FP32")
                if mod is httpclient:
                    i.set_data_from_numpy(x, binary_data=binary)
                    o = mod.InferRequestedOutput("OUTPUT_FP32", binary_data=binary)
                else:
                    i.set_data_from_numpy(x)
                    o = mod.InferRequestedOutput("OUTPUT_FP32")
                r = client.infer("dtypes", [i, *_small_inputs(mod, binary)], outputs=[o])
                y = r.as_numpy("OUTPUT_FP32")
                assert y[0, 0] == want[0, 0]

            return call

        rows = [
            ("shared memory, HTTP", _time(shm_call(httpclient, h), args.reps)),
            ("shared memory, gRPC", _time(shm_call(grpcclient, g), args.reps)),
            ("binary extension, HTTP", _time(inband_call(httpclient, h, True), args.reps)),
            ("raw_input_contents, gRPC", _time(inband_call(grpcclient, g, False), args.reps)),
            ("JSON, HTTP", _time(inband_call(httpclient, h, False), args.json_reps)),
        ]
        base = rows[0][1]
        payload = 2 * x.nbytes / (1 << 30)
        print(f"\n{args.mib} MiB FP32 in and out per call (median of {args.reps}; JSON of {args.json_reps})")
        print(f"{'mode':<28} {'s/call':>9} {'GiB/s':>7} {'× shm (HTTP)':>13}")
        for name, t in rows:
            print(f"{name:<28} {t:>9.3f} {payload / t:>7.2f} {t / base:>13.1f}")
        h.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(r_in)
        shm.destroy_shared_memory_region(r_out)
    finally:
        d.stop()


if __name__ == "__main__":
    main()
