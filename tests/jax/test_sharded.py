"""Sharded jax.export artifacts run with `tpubox exec --cpu-devices 4` give JAX's own results.

The corpus is generated at test time by the pinned jax on 4 CPU devices (make_sharded.py, in
its own process) into a temporary directory: each case is a `jax.jit` over a mesh
(`NamedSharding`; Shardy's `sdy.sharding`, or GSPMD's `mhlo.sharding` for the gspmd_ cases)
or a `shard_map` with a collective, exported with `mhlo.num_partitions = 4`, with its global
inputs and JAX's global outputs on the same 4 devices. `tpubox exec` reads the partition count
from the bytecode, compiles for 4 devices, splits each global input by the program's input
shardings, runs all 4 at once and gathers the outputs; outputs.json must name the 4 devices.
The hostile cases check the exact error kind when the devices do not fit the program."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_export import _binary

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def sharded(tmp_path_factory):
    d = tmp_path_factory.mktemp("jax-sharded")
    # Its own process: JAX's CPU device count is fixed when its backend starts.
    r = subprocess.run([sys.executable, str(HERE / "make_sharded.py"), str(d)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"make_sharded.py failed:\n{r.stderr[-4000:]}")
    return d


def _case(corpus: Path, name: str) -> dict:
    return next(c for c in json.loads((corpus / "cases.json").read_text()) if c["name"] == name)


# The cases of make_sharded.py by the devices they were exported for (make_sharded.py is not
# imported here: it fixes JAX's device count at import). test_sharded_corpus_size checks that
# these lists are the generated corpus.
FOUR = ["data_parallel", "tensor_parallel", "mesh_2x2", "mesh_2x2_transposed", "half_replicated",
        "reductions", "int_reductions", "train_step", "attention_heads", "bf16_data_parallel",
        "psum", "all_gather", "ppermute", "all_to_all", "psum_scatter", "mesh_2x2_collectives",
        "gspmd_data_parallel", "gspmd_psum"]
TWO = ["pair_data_parallel"]
ONE = ["single_device"]


def _exec(corpus: Path, name: str, out: Path, *extra: str, cpu_devices: int = 4):
    case = _case(corpus, name)
    args = [str(_binary()), "exec", "--cpu-devices", str(cpu_devices), *extra,
            str(corpus / f"{name}.mlirbc"), "--out", str(out)]
    for i in range(case["inputs"]):
        args += ["--arg", str(corpus / f"{name}.in{i}.npy")]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def _check_outputs(corpus: Path, name: str, out: Path, devices: list):
    case = _case(corpus, name)
    listed = json.loads((out / "outputs.json").read_text())
    assert len(listed) == case["outputs"]
    for i in range(case["outputs"]):
        entry = listed[i]
        assert entry["devices"] == devices, f"{name} out{i}: {entry}"
        assert ("sharding" in entry) == (len(devices) > 1), entry
        want = np.load(corpus / f"{name}.out{i}.npy")
        got = np.load(out / f"out{i}.npy")
        assert list(got.shape) == entry["dims"] == list(want.shape), f"{name} out{i}"
        if want.dtype.kind == "V" or str(want.dtype) == "bfloat16":
            # bf16: compare the bit patterns tpubox wrote as raw two-byte records.
            assert got.tobytes() == want.tobytes(), f"{name} out{i}"
            continue
        assert got.dtype == want.dtype, f"{name} out{i}: {got.dtype} vs {want.dtype}"
        if case["rtol"] == 0:
            np.testing.assert_array_equal(got, want, err_msg=f"{name} out{i}")
        else:
            np.testing.assert_allclose(got, want, rtol=case["rtol"], atol=1e-6, err_msg=f"{name} out{i}")


@pytest.mark.parametrize("name", FOUR)
def test_sharded_case(sharded, tmp_path, name):
    assert _case(sharded, name)["devices"] == 4
    r = _exec(sharded, name, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    _check_outputs(sharded, name, tmp_path / "out", [0, 1, 2, 3])
    assert "on devices [0, 1, 2, 3]" in r.stdout, r.stdout


def test_sharded_corpus_size(sharded):
    # The corpus: at least 12 programs over 4 devices.
    assert len(FOUR) >= 12
    cases = {c["name"]: c["devices"] for c in json.loads((sharded / "cases.json").read_text())}
    assert cases == {**{n: 4 for n in FOUR}, **{n: 2 for n in TWO}, **{n: 1 for n in ONE}}


def test_sharded_device_order_is_the_partition_order(sharded, tmp_path):
    # Partition k runs on the k-th device listed; the global results do not change.
    for name in ("ppermute", "mesh_2x2", "psum_scatter"):
        out = tmp_path / name
        r = _exec(sharded, name, out, "--devices", "3,2,1,0")
        assert r.returncode == 0, r.stderr
        _check_outputs(sharded, name, out, [3, 2, 1, 0])


def test_sharded_program_for_two_devices(sharded, tmp_path):
    # Exported for 2 devices: the first two of the host's four, or those --devices names.
    r = _exec(sharded, "pair_data_parallel", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    _check_outputs(sharded, "pair_data_parallel", tmp_path / "a", [0, 1])
    r = _exec(sharded, "pair_data_parallel", tmp_path / "b", "--devices", "3,1")
    assert r.returncode == 0, r.stderr
    _check_outputs(sharded, "pair_data_parallel", tmp_path / "b", [3, 1])


def test_sharded_single_device_program_is_unchanged(sharded, tmp_path):
    # mhlo.num_partitions = 1: device 0 as before (or the one --devices names), no sharding.
    r = _exec(sharded, "single_device", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    _check_outputs(sharded, "single_device", tmp_path / "a", [0])
    assert r.stdout.strip() == "out0.npy: F32[8, 3]"
    r = _exec(sharded, "single_device", tmp_path / "b", "--devices", "2")
    assert r.returncode == 0, r.stderr
    _check_outputs(sharded, "single_device", tmp_path / "b", [2])


def _assert_refused(r, out: Path, kind: str, *needles: str):
    # Refused cleanly: tpubox's own exit status (not a signal), one error line, no outputs.
    assert r.returncode == 2, (r.returncode, r.stderr)
    line = r.stderr.strip().splitlines()[-1]
    assert "panicked" not in r.stderr and "RUST_BACKTRACE" not in r.stderr, r.stderr
    assert f": {kind}: " in line, line
    for n in needles:
        assert n in line, line
    assert not (out / "outputs.json").exists()


def test_sharded_hostile_too_few_devices(sharded, tmp_path):
    # Exported for 4 devices, run where the CPU plugin exposes 2: invalid-argument naming
    # both numbers, before anything is compiled.
    for name in ("psum", "data_parallel", "all_to_all"):
        r = _exec(sharded, name, tmp_path / name, cpu_devices=2)
        _assert_refused(r, tmp_path / name, "invalid-argument",
                        f"{name}.mlirbc is a program for 4 devices (mhlo.num_partitions = 4)",
                        "only 2 device(s) are available ([0, 1]")


def test_sharded_hostile_devices_that_do_not_fit(sharded, tmp_path):
    out = tmp_path / "out"
    r = _exec(sharded, "psum", out, "--devices", "0,1")
    _assert_refused(r, out, "invalid-argument", "a program for 4 devices (mhlo.num_partitions = 4)",
                    "--devices lists 2 ([0, 1])")
    r = _exec(sharded, "single_device", out, "--devices", "0,1")
    _assert_refused(r, out, "invalid-argument", "a program for 1 device (mhlo.num_partitions = 1)",
                    "--devices lists 2")
    r = _exec(sharded, "psum", out, "--devices", "0,1,2,7")
    _assert_refused(r, out, "not-found", "device 7 does not exist")
    r = _exec(sharded, "psum", out, "--devices", "0,1,1,2")
    _assert_refused(r, out, "invalid-argument", "device 1 is given twice")


def test_sharded_hostile_inputs(sharded, tmp_path):
    out = tmp_path / "out"
    # A shard instead of the global array: the message names the global spec and the split.
    shard = tmp_path / "shard.npy"
    np.save(shard, np.load(sharded / "psum.in0.npy")[:2])
    args = [str(_binary()), "exec", "--cpu-devices", "4", str(sharded / "psum.mlirbc"),
            "--arg", str(shard), "--out", str(out)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "is f32[2,3] but" in r.stderr and "expects f32[8,3]" in r.stderr, r.stderr
    assert "{devices=[4,1]<=[4]} splits into f32[2,3] per device" in r.stderr, r.stderr
    assert not (out / "outputs.json").exists()
    # Too few arguments: the global specs are named.
    r = subprocess.run(args[:5] + ["--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "takes 1 argument(s) (f32[8,3]), got 0 --arg" in r.stderr, r.stderr
