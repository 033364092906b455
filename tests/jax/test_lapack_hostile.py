"""Hostile programs against the LAPACK custom-call handlers (crates/pjrt-lapack).

A guest can write any `stablehlo.custom_call @lapack_*_ffi`, not only what JAX emits: wrong
result shapes, wrong element types, bad option characters, missing results, NaN data, huge
sizes. Each case is a hand-written StableHLO program run with `tpubox exec`; it must fail with
the exact error kind and a message naming the problem (never reach LAPACK's xerbla, which may
stop the process), or, for NaN input, return NaN with info = 1 instead of running LAPACK's
iterations."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from test_export import _binary

LAYOUT2 = "dense<[0, 1]> : tensor<2xindex>"
LAYOUT1 = "dense<0> : tensor<1xindex>"
LAYOUT0 = "dense<> : tensor<0xindex>"
LAYOUTS = [LAYOUT0, LAYOUT1, LAYOUT2]


def rank(tensor_type: str) -> int:
    """Rank of `tensor<4x3xf32>` (2), `tensor<3xcomplex<f32>>` (1), `tensor<i32>` (0)."""
    return sum(1 for part in tensor_type[len("tensor<"):].split("x")[:-1] if part.isdigit())


def program(target, operands, results, config="", layouts=None):
    """A `main` that returns every result of one custom call on its parameters, with
    column-major layouts for matrices as JAX writes them. Typed FFI custom calls
    (api_version 4) take their attributes as the `backend_config` dictionary."""
    params = ", ".join(f"%a{i}: {t}" for i, t in enumerate(operands))
    args = ", ".join(f"%a{i}" for i in range(len(operands)))
    rets = ", ".join(results)
    op_l, res_l = layouts or ([LAYOUTS[rank(t)] for t in operands], [LAYOUTS[rank(t)] for t in results])
    n = len(results)
    values = ", ".join(f"%0#{i}" for i in range(n)) if n > 1 else "%0"
    lhs = f"%0:{n}" if n > 1 else "%0"
    return f"""func.func @main({params}) -> ({rets}) {{
  {lhs} = stablehlo.custom_call @{target}({args}) {{api_version = 4 : i32, backend_config = {{{config}}}, operand_layouts = [{", ".join(op_l)}], result_layouts = [{", ".join(res_l)}]}} : ({", ".join(operands)}) -> ({rets})
  return {values} : {rets}
}}
"""


def run(tmp_path: Path, text: str, arrays, env=None):
    prog = tmp_path / "p.mlir"
    prog.write_text(text)
    args = [str(_binary()), "exec", str(prog), "--out", str(tmp_path / "out")]
    for i, a in enumerate(arrays):
        np.save(tmp_path / f"in{i}.npy", a)
        args += ["--arg", str(tmp_path / f"in{i}.npy")]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def eye(n, dtype="f4"):
    return np.eye(n, dtype=dtype)


# name: (target, operands, results, backend config, inputs, error kind, message part)
REFUSED = {
    "pivots_too_short": ("lapack_sgetrf_ffi", ["tensor<4x4xf32>"], ["tensor<4x4xf32>", "tensor<3xi32>", "tensor<i32>"], "",
                         [eye(4)], "invalid-argument", "pivots: expected s32[4], got s32[3]"),
    "missing_result": ("lapack_sgetrf_ffi", ["tensor<4x4xf32>"], ["tensor<4x4xf32>", "tensor<4xi32>"], "",
                       [eye(4)], "invalid-argument", "custom call has 2 results, result 2 was asked for"),
    "wrong_element_type": ("lapack_sgetrf_ffi", ["tensor<4x4xf64>"], ["tensor<4x4xf64>", "tensor<4xi32>", "tensor<i32>"], "",
                           [eye(4, "f8")], "invalid-argument", "element type f64 where f32 was expected"),
    "vector_operand": ("lapack_sgetrf_ffi", ["tensor<4xf32>"], ["tensor<4xf32>", "tensor<4xi32>", "tensor<i32>"], "",
                       [np.ones(4, "f4")], "invalid-argument", "a matrix needs at least 2 dimensions"),
    "bad_uplo": ("lapack_spotrf_ffi", ["tensor<3x3xf32>"], ["tensor<3x3xf32>", "tensor<i32>"], "uplo = 88 : ui8",
                 [eye(3)], "invalid-argument", "attribute uplo = 'X' is not one of \"LU\""),
    "uplo_wrong_type": ("lapack_spotrf_ffi", ["tensor<3x3xf32>"], ["tensor<3x3xf32>", "tensor<i32>"], "uplo = 76 : i32",
                        [eye(3)], "invalid-argument", "attribute uplo is not a ui8"),
    "missing_attribute": ("lapack_spotrf_ffi", ["tensor<3x3xf32>"], ["tensor<3x3xf32>", "tensor<i32>"], "",
                          [eye(3)], "invalid-argument", "attribute uplo is missing"),
    "not_square": ("lapack_ssyevd_ffi", ["tensor<3x4xf32>"], ["tensor<3x4xf32>", "tensor<3xf32>", "tensor<i32>"],
                   "mode = 86 : ui8, uplo = 76 : ui8", [np.ones((3, 4), "f4")], "invalid-argument", "a square matrix was expected"),
    "svd_u_shape": ("lapack_sgesdd_ffi", ["tensor<4x3xf32>"],
                    ["tensor<4x3xf32>", "tensor<3xf32>", "tensor<3x3xf32>", "tensor<3x3xf32>", "tensor<i32>"],
                    "mode = 65 : ui8", [np.ones((4, 3), "f4")], "invalid-argument", "mode A needs u m × m and vt n × n"),
    "hessenberg_bounds": ("lapack_sgehrd_ffi", ["tensor<4x4xf32>"], ["tensor<4x4xf32>", "tensor<3xf32>", "tensor<i32>"],
                          "high = 9 : i32, low = 0 : i32", [eye(4)], "invalid-argument", "need 1 ≤ low ≤ high ≤ n"),
    "orgqr_too_many_reflectors": ("lapack_sorgqr_ffi", ["tensor<4x2xf32>", "tensor<3xf32>"], ["tensor<4x2xf32>"], "",
                                  [np.ones((4, 2), "f4"), np.ones(3, "f4")], "invalid-argument", "rows ≥ columns ≥ reflectors"),
    "gees_sort": ("lapack_sgees_ffi", ["tensor<3x3xf32>"],
                  ["tensor<3x3xf32>", "tensor<3x3xf32>", "tensor<3xf32>", "tensor<3xf32>", "tensor<i32>", "tensor<i32>"],
                  "mode = 86 : ui8, sort = 83 : ui8", [eye(3)], "invalid-argument", "attribute sort = 'S'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused(tmp_path, name):
    target, operands, results, config, inputs, kind, part = REFUSED[name]
    r = run(tmp_path, program(target, operands, results, config), inputs)
    assert r.returncode != 0, r.stdout
    assert f"tpubox: {kind}: " in r.stderr, r.stderr
    assert part in r.stderr, r.stderr


def test_flop_limit(tmp_path):
    """A call above TPUBOX_LAPACK_MAX_FLOP fails before LAPACK runs (XLA cannot stop a custom
    call once it runs)."""
    text = program("lapack_sgetrf_ffi", ["tensor<32x32xf32>"], ["tensor<32x32xf32>", "tensor<32xi32>", "tensor<i32>"])
    ok = run(tmp_path, text, [eye(32)])
    assert ok.returncode == 0, ok.stderr
    r = run(tmp_path, text, [eye(32)], env={"TPUBOX_LAPACK_MAX_FLOP": "1000"})
    assert r.returncode != 0
    assert "tpubox: resource-exhausted: " in r.stderr, r.stderr
    assert "above the limit of 1.000e3 per custom call (TPUBOX_LAPACK_MAX_FLOP)" in r.stderr, r.stderr


@pytest.mark.parametrize("target,results,config", [
    ("lapack_ssyevd_ffi", ["tensor<3x3xf32>", "tensor<3xf32>", "tensor<i32>"], "mode = 86 : ui8, uplo = 76 : ui8"),
    ("lapack_sgesdd_ffi", ["tensor<3x3xf32>", "tensor<3xf32>", "tensor<3x3xf32>", "tensor<3x3xf32>", "tensor<i32>"], "mode = 65 : ui8"),
    ("lapack_sgeev_ffi", ["tensor<3xf32>", "tensor<3xf32>", "tensor<3x3xcomplex<f32>>", "tensor<3x3xcomplex<f32>>", "tensor<i32>"],
     "compute_left = 78 : ui8, compute_right = 86 : ui8"),
])
def test_nan_input_not_iterated(tmp_path, target, results, config):
    """NaN or infinity in a matrix: the iterative routines do not run on it (some LAPACK builds
    iterate for a long time); its results are NaN and info is 1, which JAX turns into NaN."""
    a = eye(3)
    a[1, 2] = np.nan
    a[2, 0] = np.inf
    r = run(tmp_path, program(target, ["tensor<3x3xf32>"], results, config), [a])
    assert r.returncode == 0, r.stderr
    info = np.load(tmp_path / "out" / f"out{len(results) - 1}.npy")
    assert info == 1
    values = np.load(tmp_path / "out" / ("out0.npy" if "geev" in target else "out1.npy"))
    assert np.isnan(values).all()


def test_unknown_custom_call_still_refused(tmp_path):
    """A look-alike target has no handler: the compile fails (not-found) and nothing runs. (A
    target with a handler but outside the tenant's allowed list is refused by the program
    policy, tests/all/adversarial.rs.)"""
    text = program("lapack_sgetrf_ffi_evil", ["tensor<2x2xf32>"], ["tensor<2x2xf32>"])
    r = run(tmp_path, text, [eye(2)])
    assert r.returncode != 0
    assert "tpubox: compiling" in r.stderr and "not-found: No FFI handler registered for lapack_sgetrf_ffi_evil" in r.stderr, r.stderr
