"""Programs: StableHLO compiled on the daemon and executed on tensors held there."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import tpubox

ADD = """
func.func @main(%a: tensor<2x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %0 = stablehlo.add %a, %b : tensor<2x2xf32>
  func.return %0 : tensor<2x2xf32>
}
"""

# Two results of different dtypes: tanh(x·w + b) (f32), and its sign as i32.
AFFINE = """
func.func public @main(%x: tensor<3x4xf32>, %w: tensor<4x2xf32>, %b: tensor<2xf32>)
    -> (tensor<3x2xf32>, tensor<3x2xi32>) {
  %xw = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST]
      : (tensor<3x4xf32>, tensor<4x2xf32>) -> tensor<3x2xf32>
  %bb = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<2xf32>) -> tensor<3x2xf32>
  %y = stablehlo.add %xw, %bb : tensor<3x2xf32>
  %t = stablehlo.tanh %y : tensor<3x2xf32>
  %z = stablehlo.constant dense<0.0> : tensor<3x2xf32>
  %p = stablehlo.compare GT, %t, %z : (tensor<3x2xf32>, tensor<3x2xf32>) -> tensor<3x2xi1>
  %i = stablehlo.convert %p : (tensor<3x2xi1>) -> tensor<3x2xi32>
  func.return %t, %i : tensor<3x2xf32>, tensor<3x2xi32>
}
"""

BF16_SCALE = """
func.func @main(%a: tensor<5xbf16>, %s: tensor<bf16>) -> tensor<5xbf16> {
  %sb = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<bf16>) -> tensor<5xbf16>
  %0 = stablehlo.multiply %a, %sb : tensor<5xbf16>
  func.return %0 : tensor<5xbf16>
}
"""

INT_OPS = """
func.func @main(%a: tensor<6xi64>, %b: tensor<6xi64>) -> (tensor<6xi64>, tensor<i64>) {
  %m = stablehlo.multiply %a, %b : tensor<6xi64>
  %zero = stablehlo.constant dense<0> : tensor<i64>
  %s = stablehlo.reduce(%m init: %zero) applies stablehlo.add across dimensions = [0]
      : (tensor<6xi64>, tensor<i64>) -> tensor<i64>
  func.return %m, %s : tensor<6xi64>, tensor<i64>
}
"""


def test_add_matches_numpy(s):
    exe = s.compile(ADD)
    assert exe.parameters == (tpubox.TensorSpec((2, 2), np.dtype(np.float32)),) * 2
    assert exe.results == (tpubox.TensorSpec((2, 2), np.dtype(np.float32)),)
    assert exe.fingerprint and exe.result_bytes == 16
    a = np.array([[1, 2], [3, 4]], np.float32)
    b = np.array([[0.5, -1], [10, 0.25]], np.float32)
    x, y = s.tensor(a), s.tensor(b)
    (z,) = exe(x, y)
    assert isinstance(z, tpubox.Tensor) and z.shape == (2, 2) and z.dtype == np.float32
    np.testing.assert_array_equal(z.numpy(), a + b)
    # Arrays are put for the call and freed after: only x, y, z stay.
    (w,) = exe(a, z)
    np.testing.assert_array_equal(w.numpy(), a + a + b)
    u = s.usage()
    assert u.live_tensors == 4 and u.live_executables == 1 and u.executions == 2
    assert "float32[2, 2]" in repr(exe)


def test_two_results_and_mixed_dtypes(s):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4), dtype=np.float32)
    w = rng.standard_normal((4, 2), dtype=np.float32)
    b = rng.standard_normal(2, dtype=np.float32)
    with s.compile(AFFINE) as exe:
        t, i = exe(x, w, b)
        want = np.tanh(x.astype(np.float64) @ w + b)
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-5, atol=1e-6)
        assert i.dtype == np.int32
        np.testing.assert_array_equal(i.numpy(), (want > 0).astype(np.int32))


def test_bf16_and_python_scalars_take_the_parameter_dtype(s):
    exe = s.compile(BF16_SCALE.encode())  # bytes of MLIR text
    a = np.array([1, 2, 3, -4, 0.5], ml_dtypes.bfloat16)
    (r,) = exe(a, 2.0)  # 2.0 becomes a bf16 scalar (the parameter's dtype)
    assert r.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(r.numpy(), (a.astype(np.float32) * 2).astype(ml_dtypes.bfloat16))


def test_int64(s, tmp_path):
    path = tmp_path / "int_ops.mlir"
    path.write_text(INT_OPS)
    exe = s.compile(path, format="text")  # a path
    a = np.array([1, -2, 3, 2**40, 5, 6], np.int64)
    b = np.array([7, 8, -9, 3, 0, 1], np.int64)
    m, s = exe(a, b)
    np.testing.assert_array_equal(m.numpy(), a * b)
    assert s.shape == () and s.numpy() == (a * b).sum()


def test_donation(s):
    exe = s.compile(ADD)
    x = s.tensor(np.ones((2, 2), np.float32))
    y = s.tensor(np.full((2, 2), 2, np.float32))
    (z,) = exe(x, y, donate=[0])
    np.testing.assert_array_equal(z.numpy(), np.full((2, 2), 3))
    assert x.donated and "donated" in repr(x)
    with pytest.raises(tpubox.FailedPrecondition) as e:
        x.numpy()
    assert e.value.kind == "failed-precondition"
    with pytest.raises(tpubox.FailedPrecondition):
        exe(x, y)
    # The donated handle holds no device memory, but stays a handle until freed.
    assert s.usage().device_bytes == 32  # y and z
    assert s.free(x) == 1
    with pytest.raises(tpubox.NotFound):
        s.get(x.handle)
    np.testing.assert_array_equal(y.numpy(), np.full((2, 2), 2))


def test_bad_calls(s):
    exe = s.compile(ADD)
    x = s.tensor(np.ones((2, 2), np.float32))
    with pytest.raises(tpubox.InvalidArgument):
        exe(x)  # one argument of two
    with pytest.raises(tpubox.InvalidArgument):
        exe(x, np.ones((3, 2), np.float32))  # wrong shape
    with pytest.raises(tpubox.InvalidArgument):
        exe(x, np.ones((2, 2), np.float64))  # wrong dtype
    u = s.usage()
    assert u.live_tensors == 1, u  # the arrays put for the failed calls were freed


def test_compile_errors(s):
    with pytest.raises(tpubox.TpuboxError) as e:
        s.compile("func.func @main( this is not MLIR")
    assert e.value.kind in ("compile-failed", "invalid-argument"), e.value
    with pytest.raises(ValueError, match="format"):
        s.compile(ADD, format="hlo")


def test_unbounded_loop_runs_on_the_loop_budget(s):
    # `while v > 0: v += 1`: XLA cannot bound it. It compiles under the default policy; it
    # ends at once for v <= 0, and runs until the loop budget is spent for v > 0.
    loop = """
    func.func @main(%x: tensor<f32>) -> tensor<f32> {
      %r = stablehlo.while(%v = %x) : tensor<f32>
        cond {
          %z = stablehlo.constant dense<0.0> : tensor<f32>
          %c = stablehlo.compare GT, %v, %z : (tensor<f32>, tensor<f32>) -> tensor<i1>
          stablehlo.return %c : tensor<i1>
        } do {
          %o = stablehlo.constant dense<1.0> : tensor<f32>
          %n = stablehlo.add %v, %o : tensor<f32>
          stablehlo.return %n : tensor<f32>
        }
      func.return %r : tensor<f32>
    }"""
    exe = s.compile(loop)
    assert exe(np.float32(-2.5))[0].numpy() == np.float32(-2.5)
    with pytest.raises(tpubox.ResourceExhausted, match="max-loop-iterations"):
        exe(np.float32(1.0))
    # The session is still served.
    assert exe(np.float32(0.0))[0].numpy() == np.float32(0.0)


def test_executables_free_and_context_managers(s):
    with s.compile(ADD) as exe:
        assert s.usage().live_executables == 1
    assert s.usage().live_executables == 0
    exe.free()  # a no-op
    with pytest.raises(tpubox.NotFound):
        exe(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    assert s.usage().live_tensors == 0


def test_optimization_level_and_tier(s):
    # A program no other test compiles (the daemon's tier 1 holds it after the first of this
    # test's transports); only compiles tier 1 does not serve are charged against
    # max-compiles-per-minute.
    program = AFFINE.replace("%t = stablehlo.tanh", "%t = stablehlo.logistic")
    before = s.usage().compiles
    exes = {level: s.compile(program, optimization_level=level) for level in ("O0", "O3")}
    assert {e.tier for e in exes.values()} <= {"compiled", "disk", "memory"}, exes
    charged = sum(e.tier != "memory" for e in exes.values())
    x = np.array([[1, -2, 3, 0.5], [0, 1, -1, 2], [4, 0, 0, -3]], np.float32)
    w = np.array([[0.5, -1], [2, 0.25], [-0.5, 1], [1, 1]], np.float32)
    b = np.array([0.1, -0.2], np.float32)
    want = 1 / (1 + np.exp(-(x.astype(np.float64) @ w + b)))
    outs = {level: exe(x, w, b)[0].numpy() for level, exe in exes.items()}
    for got in outs.values():
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(outs["O0"], outs["O3"], rtol=4 * np.finfo(np.float32).eps)
    again = s.compile(program, optimization_level="O0")
    assert again.tier == "memory"
    assert s.usage().compiles == before + charged
    with pytest.raises(ValueError, match="optimization_level"):
        s.compile(program, optimization_level="O4")
