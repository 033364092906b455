"""Writes the jax.export corpus into DIR: for each case NAME, the exported module as MLIR
bytecode (NAME.mlirbc, what `Exported.mlir_module_serialized` holds: portable VHLO), its inputs
(NAME.in0.npy, ...) and JAX's own outputs on the CPU (NAME.out0.npy, ...), plus cases.json
listing each case with its tolerance and whether it is expected to fail here (and why).

Run with the venv's python: python make_corpus.py DIR. Nothing it writes is committed."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import export, lax

jax.config.update("jax_platforms", "cpu")

rng = np.random.default_rng(0)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def spd(n):
    a = f32(n, n)
    return (a @ a.T + n * np.eye(n)).astype(np.float32)


def fori(x):
    return lax.fori_loop(0, 10, lambda i, v: v * 0.9 + jnp.sin(v), x)


def while_(x):
    return lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]


def cond(p, x):
    return lax.cond(p > 0, lambda v: v + 1.0, lambda v: v - 1.0, x)


def scan(x):
    return lax.scan(lambda c, v: (c + v, c * v), jnp.zeros(x.shape[1:], x.dtype), x)


def scatter_gather(x, idx):
    return x.at[idx].add(1.0)[::2], jnp.take(x, idx, axis=0)


def random(key):
    k = jax.random.wrap_key_data(key)
    return jax.random.normal(k, (4, 3)), jax.random.uniform(k, (5,))


def bf16(x, y):
    return (x * y + x).astype(jnp.bfloat16), jnp.sum(x, axis=0)


# name: (function, inputs, rtol, atol, expected failure or None)
CASES = {
    "fori_loop": (fori, [f32(3, 4)], 1e-6, 1e-6, None),
    "while_loop": (while_, [f32(5)], 0, 0, None),
    "cond": (cond, [np.float32(1.0), f32(4)], 0, 0, None),
    "scan": (scan, [f32(6, 3)], 1e-6, 1e-6, None),
    "sort": (lambda x: (jnp.sort(x, axis=-1), jnp.argsort(x, axis=0)), [f32(5, 7)], 0, 0, None),
    "top_k": (lambda x: lax.top_k(x, 3), [f32(4, 9)], 0, 0, None),
    "fft": (lambda x: (jnp.fft.fft(x), jnp.fft.rfft(x.real)), [f32(8).astype(np.complex64)], 1e-5, 1e-5, None),
    "scatter_gather": (scatter_gather, [f32(6, 3), np.array([0, 2, 2, 5], np.int32)], 0, 0, None),
    "random": (random, [np.array([0, 42], np.uint32)], 0, 0, None),
    "bf16": (bf16, [f32(4, 3).astype(ml_dtypes.bfloat16), f32(4, 3).astype(ml_dtypes.bfloat16)], 0, 0, None),
    "matmul_softmax": (lambda x, w: jax.nn.softmax(x @ w, axis=-1), [f32(3, 5), f32(5, 4)], 1e-6, 1e-6, None),
    "conv": (lambda x, k: lax.conv(x, k, (1, 1), "SAME"), [f32(1, 2, 6, 6), f32(3, 2, 3, 3)], 1e-5, 1e-5, None),
    "linalg_solve": (jnp.linalg.solve, [spd(4), f32(4, 2)], 1e-5, 1e-5, "lapack"),
    "linalg_cholesky": (jnp.linalg.cholesky, [spd(4)], 1e-5, 1e-5, "lapack"),
    "linalg_qr": (jnp.linalg.qr, [f32(5, 3)], 1e-5, 1e-5, "lapack"),
    "linalg_eigvalsh": (jnp.linalg.eigvalsh, [spd(4)], 1e-5, 1e-5, "lapack"),
    "linalg_svd": (lambda a: jnp.linalg.svd(a, compute_uv=False), [f32(4, 3)], 1e-5, 1e-5, "lapack"),
}


def main(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    listing = []
    for name, (fn, args, rtol, atol, expect) in CASES.items():
        exp = export.export(jax.jit(fn))(*args)
        (out / f"{name}.mlirbc").write_bytes(exp.mlir_module_serialized)
        for i, a in enumerate(args):
            np.save(out / f"{name}.in{i}.npy", np.asarray(a))
        results = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
        for i, r in enumerate(results):
            np.save(out / f"{name}.out{i}.npy", np.asarray(r))
        listing.append({"name": name, "inputs": len(args), "outputs": len(results),
                        "rtol": rtol, "atol": atol, "expect_failure": expect})  # fmt: skip
    # A symbolic batch dimension: the plugin compiles static shapes only.
    exp = export.export(jax.jit(lambda x: x * 2.0))(
        jax.ShapeDtypeStruct(export.symbolic_shape("b, 4"), np.float32)
    )
    (out / "symbolic.mlirbc").write_bytes(exp.mlir_module_serialized)
    np.save(out / "symbolic.in0.npy", f32(3, 4))
    listing.append({"name": "symbolic", "inputs": 1, "outputs": 1, "rtol": 0, "atol": 0,
                    "expect_failure": "symbolic"})  # fmt: skip
    (out / "cases.json").write_text(json.dumps(listing, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
