"""jax.export artifacts run with `tpubox exec` give JAX's own results.

The corpus is generated at test time by a pinned jax (make_corpus.py, in the set-up script's
virtual environment) into a temporary directory: portable VHLO bytecode, inputs and JAX's CPU
outputs as .npy. Each case runs through `tpubox exec` and is compared with JAX's outputs (exactly,
or within the case's tolerance). Linear algebra lowers to LAPACK custom calls, run by the
handlers tpubox registers with the CPU plugin. A symbolic dimension is refused with an error
naming it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))


def _binary() -> Path:
    env = os.environ.get("TPUBOX_BIN")
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    p = Path(env) if env else target / "release" / "tpubox"
    if not p.is_file():
        pytest.exit(f"{p} is missing: cargo build --release -p tpubox", returncode=1)
    return p.resolve()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    import make_corpus

    d = tmp_path_factory.mktemp("jax-corpus")
    make_corpus.main(d)
    return d


def _cases():
    import make_corpus

    return list(make_corpus.CASES) + ["symbolic"]


def _exec(corpus: Path, case: dict, out: Path):
    args = [str(_binary()), "exec", str(corpus / f"{case['name']}.mlirbc"), "--out", str(out)]
    for i in range(case["inputs"]):
        args += ["--arg", str(corpus / f"{case['name']}.in{i}.npy")]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", _cases())
def test_case(corpus, tmp_path, name):
    case = next(c for c in json.loads((corpus / "cases.json").read_text()) if c["name"] == name)
    r = _exec(corpus, case, tmp_path / "out")
    expect = case["expect_failure"]
    if expect == "symbolic":
        assert r.returncode != 0
        assert "of unknown size (tensor<?x4xf32>" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    for i in range(case["outputs"]):
        want = np.load(corpus / f"{name}.out{i}.npy")
        got = np.load(tmp_path / "out" / f"out{i}.npy")
        if want.dtype.kind == "V" or str(want.dtype) == "bfloat16":
            # bf16: compare the bit patterns tpubox wrote as raw two-byte records.
            assert got.tobytes() == want.tobytes(), f"{name} out{i}"
            continue
        assert got.shape == want.shape, f"{name} out{i}: {got.shape} vs {want.shape}"
        assert got.dtype == want.dtype, f"{name} out{i}: {got.dtype} vs {want.dtype}"
        if case["rtol"] == 0 and case["atol"] == 0:
            np.testing.assert_array_equal(got, want, err_msg=f"{name} out{i}")
        else:
            np.testing.assert_allclose(got, want, rtol=case["rtol"], atol=case["atol"], err_msg=f"{name} out{i}")
