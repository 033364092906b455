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
import jax.scipy.optimize  # noqa: F401 (loaded lazily otherwise)
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
}


def f64(*shape):
    return rng.standard_normal(shape)


def c64(*shape):
    return (f32(*shape) + 1j * f32(*shape)).astype(np.complex64)


def hpd(n):
    a = c64(n, n)
    return (a @ a.conj().T + n * np.eye(n)).astype(np.complex64)


def tridiag_solve(dl, d, du, b):
    return lax.linalg.tridiagonal_solve(dl, d, du, b)


def lead_zero(v):
    v = v.copy()
    v[..., 0] = 0
    return v


def trail_zero(v):
    v = v.copy()
    v[..., -1] = 0
    return v


def schur_invariants(a):
    """What a Schur decomposition A = Q T Q^H fixes, whichever LAPACK build computes it: Q is
    unique only up to a diagonal unitary D (Q D gives D^H T D, so T's off-diagonal entries
    change phase, or sign for real input; two OpenBLAS builds on two CPUs were seen to differ
    so). Compared: |T|, T's diagonal, Q T Q^H (= A) and Q^H Q (= I)."""
    t, q = jax.scipy.linalg.schur(a)
    qh = q.conj().T
    return jnp.abs(t), jnp.diagonal(t), q @ t @ qh, qh @ q


# Linear algebra: JAX lowers these to LAPACK custom calls (lapack_*_ffi), which tpubox's own
# handlers (crates/pjrt-lapack) run. Tolerances as JAX's linalg tests use for f32 (looser than
# the elementwise cases: another LAPACK build may round differently); f64 cases are exported
# with x64 enabled.
LINALG = {
    "linalg_solve": (jnp.linalg.solve, [spd(4), f32(4, 2)]),
    "linalg_solve_batched": (jnp.linalg.solve, [np.stack([spd(4) for _ in range(3)]), f32(3, 4, 2)]),
    "linalg_solve_f64": (jnp.linalg.solve, [spd(5).astype(np.float64), f64(5, 3)]),
    "linalg_inv": (jnp.linalg.inv, [spd(5)]),
    "linalg_det_slogdet": (lambda a: (jnp.linalg.det(a), *jnp.linalg.slogdet(a)), [f32(4, 4)]),
    "linalg_lu": (jax.scipy.linalg.lu, [f32(5, 5)]),
    "linalg_lu_factor": (jax.scipy.linalg.lu_factor, [f32(4, 4)]),
    "linalg_cholesky": (jnp.linalg.cholesky, [spd(4)]),
    "linalg_cholesky_batched_f64": (jnp.linalg.cholesky, [np.stack([spd(3) for _ in range(2)]).astype(np.float64)]),
    "linalg_cholesky_c64": (jnp.linalg.cholesky, [hpd(4)]),
    "linalg_cho_solve": (lambda a, b: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a), b), [spd(4), f32(4, 2)]),
    "linalg_solve_triangular": (lambda a, b: jax.scipy.linalg.solve_triangular(jnp.tril(a), b, lower=True), [spd(4), f32(4, 3)]),
    "linalg_qr": (jnp.linalg.qr, [f32(5, 3)]),
    "linalg_qr_complete": (lambda a: jnp.linalg.qr(a, mode="complete"), [f32(5, 3)]),
    "linalg_qr_wide_c64": (jnp.linalg.qr, [c64(3, 5)]),
    "linalg_eigh": (jnp.linalg.eigh, [spd(4)]),
    "linalg_eigh_c64": (jnp.linalg.eigh, [hpd(4)]),
    "linalg_eigvalsh": (jnp.linalg.eigvalsh, [spd(4)]),
    "linalg_eigvalsh_f64_batched": (jnp.linalg.eigvalsh, [np.stack([spd(6) for _ in range(2)]).astype(np.float64)]),
    "linalg_svd": (jnp.linalg.svd, [f32(5, 3)]),
    "linalg_svd_thin": (lambda a: jnp.linalg.svd(a, full_matrices=False), [f32(3, 5)]),
    "linalg_svdvals": (lambda a: jnp.linalg.svd(a, compute_uv=False), [f32(4, 3)]),
    "linalg_svd_c64": (jnp.linalg.svd, [c64(4, 3)]),
    "linalg_svd_qr_algorithm": (lambda a: lax.linalg.svd(a, algorithm=lax.linalg.SvdAlgorithm.QR), [f32(4, 4)]),
    "linalg_pinv_lstsq": (lambda a, b: (jnp.linalg.pinv(a), jnp.linalg.lstsq(a, b)[0]), [f32(5, 3), f32(5, 2)]),
    "linalg_rank_cond_norm": (lambda a: (jnp.linalg.matrix_rank(a), jnp.linalg.cond(a), jnp.linalg.norm(a, 2)), [f32(4, 4)]),
    "linalg_eig": (jnp.linalg.eig, [f32(4, 4)]),
    "linalg_eigvals_c64": (jnp.linalg.eigvals, [c64(4, 4)]),
    "linalg_schur": (schur_invariants, [f32(4, 4)]),
    "linalg_schur_c64": (schur_invariants, [c64(4, 4)]),
    "linalg_hessenberg": (lambda a: jax.scipy.linalg.hessenberg(a, calc_q=True), [f32(5, 5)]),
    "linalg_tridiagonal": (lax.linalg.tridiagonal, [spd(4)]),
    "linalg_tridiagonal_solve": (tridiag_solve, [lead_zero(f32(6)), f32(6) + 4, trail_zero(f32(6)), f32(6, 2)]),
    "linalg_expm": (jax.scipy.linalg.expm, [f32(3, 3) * 0.5]),
}
# Targets jax.export refuses to serialize unless told (no compatibility guarantee yet), per case.
UNGUARANTEED = {"linalg_svd_qr_algorithm": ["lapack_sgesvd_ffi"]}
for _name, (_fn, _args) in LINALG.items():
    CASES[_name] = (_fn, _args, 2e-4, 2e-5, None)


# Loops XLA cannot bound (convergence loops): run under the default program policy with the
# loop budget (issue 31), which lets them end by their own conditions.
def newton_sqrt(x):
    def body(c):
        i, v, _ = c
        return i + 1, 0.5 * (v + x / v), v

    def go_on(c):
        i, v, prev = c
        return (jnp.max(jnp.abs(v - prev) / v) > 1e-6) & (i < 100)

    return lax.while_loop(go_on, body, (0, x, x + 1.0))[1]


def bfgs(x0):
    target = jnp.arange(x0.shape[0], dtype=x0.dtype)
    return jax.scipy.optimize.minimize(
        lambda x: jnp.sum((x - target) ** 2) + 0.01 * jnp.sum(x**4), x0, method="BFGS"
    ).x


def gamma(key):
    return jax.random.gamma(jax.random.wrap_key_data(key), jnp.array([0.5, 1.0, 2.5, 7.0]), (3, 4))


def poisson(key):
    return jax.random.poisson(jax.random.wrap_key_data(key), jnp.array([0.5, 3.0, 12.0, 40.0]), (3, 4))


def positive(*shape):
    return (np.abs(f32(*shape)) * 3 + 0.1).astype(np.float32)


LOOPS = {
    "loop_igamma": (lax.igamma, [positive(8), positive(8)]),
    "loop_igammac": (lax.igammac, [positive(8), positive(8)]),
    "loop_betainc": (lax.betainc, [positive(8), positive(8), rng.uniform(0.05, 0.95, 8).astype(np.float32)]),
    "loop_random_gamma": (gamma, [np.array([0, 7], np.uint32)]),
    "loop_random_poisson": (poisson, [np.array([0, 9], np.uint32)]),
    "loop_newton": (newton_sqrt, [positive(6)]),
    "loop_bfgs": (bfgs, [f32(3)]),
    "loop_sqrtm": (jax.scipy.linalg.sqrtm, [spd(4)]),
}
for _name, (_fn, _args) in LOOPS.items():
    CASES[_name] = (_fn, _args, 1e-4, 1e-5, None)


def main(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    listing = []
    for name, (fn, args, rtol, atol, expect) in CASES.items():
        x64 = any(np.asarray(a).dtype in (np.float64, np.complex128) for a in args)
        with jax.enable_x64(x64):
            checks = [export.DisabledSafetyCheck.custom_call(t) for t in UNGUARANTEED.get(name, [])]
            exp = export.export(jax.jit(fn), disabled_checks=checks)(*args)
            results = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
        (out / f"{name}.mlirbc").write_bytes(exp.mlir_module_serialized)
        for i, a in enumerate(args):
            np.save(out / f"{name}.in{i}.npy", np.asarray(a))
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
