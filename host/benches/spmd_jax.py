"""The JAX side of the SPMD benchmark (host/benches/spmd.rs): exports the benchmark's programs
with the pinned jax of the JAX venv (scripts/venvs/jax.txt) on 4 CPU devices, writes them with
their inputs, and times JAX itself running them on the same CPU devices, in the same run.

    python spmd_jax.py OUT_DIR --rounds 20

Writes OUT_DIR/NAME.mlirbc (`Exported.mlir_module_serialized`), OUT_DIR/NAME.argK.npy (global
inputs) and OUT_DIR/NAME.out0.npy (JAX's first output), and prints one JSON object: per
program, the devices it runs on and JAX's median seconds per execution (inputs already on the
devices, `block_until_ready` after each).

Programs:
- mlp_step_dN (N = 1, 2, 4): one data-parallel training step of a 2-layer MLP (512 -> 1024 ->
  512, batch 256, tanh, mean squared error, SGD): the batch split over a mesh of N devices,
  the parameters replicated, the gradients all-reduced by XLA's partitioner.
- allreduce_64mib: `shard_map` psum of f32[4, 16 Mi] split by rows: each of the 4 devices sums
  its 64 MiB row with the three others' (an all-reduce of 64 MiB over 4 devices).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "")
import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:
    from jax import shard_map
except ImportError:  # older jax
    from jax.experimental.shard_map import shard_map


def mlp_step(w1, b1, w2, b2, x, y):
    def loss(params):
        w1, b1, w2, b2 = params
        h = jnp.tanh(x @ w1 + b1)
        out = h @ w2 + b2
        return jnp.mean((out - y) ** 2)

    params = (w1, b1, w2, b2)
    grads = jax.grad(loss)(params)
    return tuple(p - 0.01 * g for p, g in zip(params, grads))


def timed(f, args, rounds):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    report = {}

    params = [
        (rng.standard_normal((512, 1024)) * 0.05).astype(np.float32),
        np.zeros(1024, np.float32),
        (rng.standard_normal((1024, 512)) * 0.05).astype(np.float32),
        np.zeros(512, np.float32),
    ]
    x = rng.standard_normal((256, 512)).astype(np.float32)
    y = rng.standard_normal((256, 512)).astype(np.float32)
    for n in (1, 2, 4):
        mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
        rep = NamedSharding(mesh, P())
        batch = NamedSharding(mesh, P("data"))
        in_sh = (rep, rep, rep, rep, batch, batch)
        f = jax.jit(mlp_step, in_shardings=in_sh, out_shardings=(rep,) * 4)
        args = [jax.device_put(v, s) for v, s in zip(params + [x, y], in_sh)]
        name = f"mlp_step_d{n}"
        exp = jax.export.export(f)(*args)
        (out / f"{name}.mlirbc").write_bytes(exp.mlir_module_serialized)
        for k, v in enumerate(params + [x, y]):
            np.save(out / f"{name}.arg{k}.npy", v)
        np.save(out / f"{name}.out0.npy", np.asarray(f(*args)[0]))
        report[name] = {"devices": n, "jax_seconds": timed(f, args, a.rounds)}

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    rows = NamedSharding(mesh, P("x"))
    psum = jax.jit(
        shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    )
    big = rng.standard_normal((4, 16 << 20)).astype(np.float32)
    args = [jax.device_put(big, rows)]
    exp = jax.export.export(psum)(*args)
    (out / "allreduce_64mib.mlirbc").write_bytes(exp.mlir_module_serialized)
    np.save(out / "allreduce_64mib.arg0.npy", big)
    report["allreduce_64mib"] = {
        "devices": 4,
        "jax_seconds": timed(psum, args, max(3, a.rounds // 4)),
    }
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
