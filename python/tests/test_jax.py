"""tpubox.jax.jit: JAX functions exported once per signature, compiled and run on the daemon,
compared with the same functions run by JAX itself on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import tpubox
import tpubox.jax as tj

jax.config.update("jax_platforms", "cpu")

RNG = np.random.default_rng(11)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def reference(fun, *args, **kwargs):
    """FUN run by JAX on the CPU, as NumPy arrays."""
    return jax.tree_util.tree_map(np.asarray, jax.jit(fun)(*args, **kwargs))


def close(got, want, rtol=1e-6, atol=1e-6):
    got_leaves, got_tree = jax.tree_util.tree_flatten(tj.device_get(got))
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, (got_tree, want_tree)
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        if w.dtype == ml_dtypes.bfloat16:
            g, w = g.astype(np.float32), w.astype(np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def test_matmul_tanh(alice):
    fn = lambda x, w, b: jnp.tanh(x @ w + b)  # noqa: E731
    args = (f32(8, 16), f32(16, 4), f32(4))
    got = tj.jit(fn, session=alice)(*args)
    assert isinstance(got, tpubox.Tensor) and got.shape == (8, 4) and got.dtype == np.float32
    close(got, reference(fn, *args), rtol=1e-5, atol=1e-6)


def test_pytree_in_and_out(alice):
    def mlp(params, x):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        y = h @ params["w2"]
        return {"y": y, "stats": (jnp.mean(y), jnp.max(h)), "none": None}

    params = {"w1": f32(5, 7), "b1": f32(7), "w2": f32(7, 3)}
    x = f32(4, 5)
    got = tj.jit(mlp, session=alice)(params, x)
    assert set(got) == {"y", "stats", "none"} and got["none"] is None
    assert isinstance(got["stats"][0], tpubox.Tensor) and got["stats"][0].shape == ()
    close(got, reference(mlp, params, x), rtol=1e-5, atol=1e-6)


def test_reductions(alice):
    def red(x):
        return (
            jnp.sum(x**2, axis=1),
            jnp.max(x, axis=0),
            jax.nn.logsumexp(x),
            jnp.argmax(x, axis=1),
            jnp.cumsum(x, axis=0),
        )

    x = f32(6, 9)
    close(tj.jit(red, session=alice)(x), reference(red, x), rtol=1e-5, atol=1e-5)


def test_bounded_loops(alice):
    def loops(x):
        a = lax.fori_loop(0, 10, lambda i, v: v * 0.9 + jnp.sin(v), x)
        n, b = lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))
        s = lax.scan(lambda c, v: (c + v, c * v), jnp.zeros(x.shape[1:], x.dtype), x)
        return a, n, b, s

    x = f32(3, 4)
    close(tj.jit(loops, session=alice)(x), reference(loops, x), rtol=1e-6, atol=1e-6)


# Convergence loops XLA cannot bound (issue 31), with their inputs: the same cases the
# jax.export corpus runs through `tpubox exec` (tests/jax/make_corpus.py, LOOPS). Under the
# default program policy they run on the loop budget and end by their own conditions.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "jax"))
from make_corpus import LOOPS  # noqa: E402


@pytest.mark.parametrize("name", list(LOOPS))
def test_convergence_loops_run_on_the_loop_budget(alice, name):
    fn, args = LOOPS[name]
    close(tj.jit(fn, session=alice)(*args), reference(fn, *args), rtol=1e-4, atol=1e-5)


def test_sort_and_argsort(alice):
    fn = lambda x: (jnp.sort(x, axis=-1), jnp.argsort(x, axis=0), lax.top_k(x, 3))  # noqa: E731
    x = f32(5, 7)
    close(tj.jit(fn, session=alice)(x), reference(fn, x), rtol=0, atol=0)


def test_integer_dtypes(alice):
    def ints(a, b, c):
        return (a * b + 3) // 2, a % 5, jnp.bitwise_xor(a, b), (c + 1).astype(jnp.uint8), a > b

    a = RNG.integers(-1000, 1000, (4, 6), dtype=np.int32)
    b = RNG.integers(1, 1000, (4, 6), dtype=np.int32)
    c = RNG.integers(0, 255, (9,), dtype=np.uint8)
    close(tj.jit(ints, session=alice)(a, b, c), reference(ints, a, b, c), rtol=0, atol=0)


def test_bf16(alice):
    def bf(x, y):
        return (x * y + x).astype(jnp.bfloat16), jnp.sum(x.astype(jnp.float32), axis=0), x @ y.T

    x = f32(4, 3).astype(ml_dtypes.bfloat16)
    y = f32(4, 3).astype(ml_dtypes.bfloat16)
    got = tj.jit(bf, session=alice)(x, y)
    assert got[0].dtype == ml_dtypes.bfloat16
    close(got, reference(bf, x, y), rtol=1e-2, atol=1e-2)


def test_python_scalars_are_weakly_typed(alice):
    fn = lambda x, s: x * s + 1  # noqa: E731
    x = f32(5).astype(np.float16)
    got = tj.jit(fn, session=alice)(x, 2.5)
    assert got.dtype == np.float16
    close(got, reference(fn, x, 2.5), rtol=1e-3, atol=1e-3)


def test_same_signature_compiles_once_new_shape_compiles_again(alice):
    fn = tj.jit(lambda x, y: x @ y, session=alice)
    a, b = f32(3, 4), f32(4, 2)
    close(fn(a, b), reference(lambda x, y: x @ y, a, b), rtol=1e-5)
    fn(f32(3, 4), f32(4, 2))
    assert fn.compiles == 1
    assert alice.usage().compiles == 1
    fn(f32(6, 4), f32(4, 2))  # a new shape
    assert fn.compiles == 2
    fn(f32(6, 4).astype(ml_dtypes.bfloat16), f32(4, 2).astype(ml_dtypes.bfloat16))  # a new dtype
    assert fn.compiles == 3
    fn(f32(6, 4), f32(4, 2))
    assert fn.compiles == 3 and alice.usage().compiles == 3
    assert alice.usage().live_executables == 3
    fn.clear_cache()
    assert alice.usage().live_executables == 0


def test_chaining_stays_on_the_device(alice, monkeypatch):
    step = tj.jit(lambda x, w: jnp.tanh(x @ w), session=alice)
    x, w = f32(4, 4), f32(4, 4)
    w_t = alice.tensor(w)
    y = step(x, w_t)
    puts = []
    real = tpubox.Session.tensor
    monkeypatch.setattr(tpubox.Session, "tensor", lambda *a, **k: puts.append(a) or real(*a, **k))
    z = step(y, w_t)
    z = step(z, w_t)
    assert puts == [], "a Tensor argument was uploaded again"
    want = x
    for _ in range(3):
        want = reference(lambda x, w: jnp.tanh(x @ w), want, w)
    close(z, want, rtol=1e-5, atol=1e-6)
    assert step.compiles == 1


def test_static_argnums_kwargs_and_unused_arguments(alice):
    def f(x, n, unused, *, scale):
        return x * n * scale

    fn = tj.jit(f, session=alice, static_argnums=1)
    x = f32(3)
    close(
        fn(x, 3, f32(100), scale=np.float32(2)), reference(lambda x, s: x * 3 * s, x, np.float32(2))
    )
    close(
        fn(x, 4, f32(100), scale=np.float32(2)), reference(lambda x, s: x * 4 * s, x, np.float32(2))
    )
    assert fn.compiles == 2
    exp = fn.export(x, 4, f32(100), scale=np.float32(2))
    assert len(exp.module_kept_var_idx) == 2  # `unused` is not a parameter of the module
    assert len(fn.executable(x, 4, f32(100), scale=np.float32(2)).parameters) == 2
    with pytest.raises(TypeError, match="not hashable"):
        fn(x, [1], f32(1), scale=np.float32(1))


def test_donate_argnums(alice):
    fn = tj.jit(lambda x: x + 1, session=alice, donate_argnums=0)
    t = alice.tensor(f32(8))
    r = fn(t)
    assert t.donated
    with pytest.raises(tpubox.FailedPrecondition):
        t.numpy()
    assert r.shape == (8,)


def test_linear_algebra_runs_on_the_daemon(alice):
    # JAX lowers these to LAPACK custom calls; the daemon's CPU plugin has tpubox's handlers.
    a = f32(5, 5)
    spd = a @ a.T + 5 * np.eye(5, dtype=np.float32)
    b = f32(5, 2)

    def linalg(spd, a, b):
        w, v = jnp.linalg.eigh(spd)
        q, r = jnp.linalg.qr(a)
        return {
            "solve": jnp.linalg.solve(spd, b),
            "cholesky": jnp.linalg.cholesky(spd),
            "eigh": (w, v),
            "qr": (q, r),
            "svdvals": jnp.linalg.svd(a, compute_uv=False),
            "det": jnp.linalg.det(a),
        }

    got = tj.jit(linalg, session=alice)(spd, a, b)
    close(got, reference(linalg, spd, a, b), rtol=2e-4, atol=2e-5)


def test_float64_follows_jax(alice):
    fn = tj.jit(lambda x: x * 2, session=alice)
    r = fn(np.arange(3, dtype=np.float64))  # float32 unless jax_enable_x64
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r.numpy(), [0, 2, 4])
    with pytest.raises(TypeError, match="jax_enable_x64"):
        fn(alice.tensor(np.arange(3, dtype=np.float64)))


def test_device_put_and_get(alice):
    tree = {"a": f32(2, 2), "b": [np.arange(3, dtype=np.int32), 1.5]}
    on_device = tj.device_put(tree, session=alice)
    assert isinstance(on_device["a"], tpubox.Tensor)
    assert on_device["b"][1].dtype == np.float32  # JAX's dtype for a Python float
    back = tj.device_get(on_device)
    np.testing.assert_array_equal(back["a"], tree["a"])
    np.testing.assert_array_equal(back["b"][0], tree["b"][0])


def test_default_session_is_the_last_connected(alice):
    fn = tj.jit(lambda x: -x)
    assert tpubox.default_session() is alice
    np.testing.assert_array_equal(fn(np.ones(2, np.float32)).numpy(), [-1, -1])


def test_refused_what_cannot_run(alice):
    def printing(x):
        jax.debug.print("x = {}", x)
        return x

    with pytest.raises(tpubox.Unsupported):
        tj.jit(printing, session=alice)(f32(2))

    def callback(x):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    with pytest.raises(tpubox.Unsupported):
        tj.jit(callback, session=alice)(f32(2))
    assert alice.usage().compiles == 0


def test_a_call_launches_without_waiting_and_a_refusal_comes_with_the_next_read(alice):
    # Issue 46: on the local socket a call that donates nothing is a pipelined launch.
    fn = tj.jit(lambda x: x * 2, session=alice)
    a = f32(4)
    t = alice.tensor(a)
    np.testing.assert_array_equal(fn(t).numpy(), a * 2)
    t.free()
    r = fn(t)  # the daemon's not-found is not waited for here
    with pytest.raises(tpubox.NotFound, match="pipelined launch"):
        r.numpy()
