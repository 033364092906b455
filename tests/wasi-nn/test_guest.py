"""wasi-nn guests of our own under `tpubox run` (issue 52): tests/guests/wasi-nn, written with
plain `wit-bindgen` against the wasi-nn WIT (wit/wasi-nn/), no tpubox SDK.

- A tiny BERT (python/tests/onnx/onnx_models.py: 2 layers, hidden 32, from a transformers
  config, random weights) loaded from its ONNX bytes (`load`, encoding `onnx`) and by name
  (`--nn-graph bert=PATH`, `load-by-name`) computes what ONNX Runtime computes.
- Hostile guests get wasi-nn's own error codes, exactly, and the host is unharmed: graphs of
  lying bytes, encodings tpubox does not run, tensors whose dimensions disagree with their
  data, a context whose graph was dropped, ten thousand contexts, a hundred graphs.
- A result fed back as an input stays on the device (a chain of three computes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python" / "tests"))
sys.path.insert(0, str(REPO / "python" / "tests" / "onnx"))

import onnx_models  # noqa: E402  (python/tests/onnx)
from tpubox_daemon import binary, target_dir  # noqa: E402  (python/tests)

CACHE = Path(os.environ.get("TPUBOX_CACHE_DIR") or Path.home() / ".cache" / "tpubox")
TYPES = {"Fp32": np.float32, "I64": np.int64, "I32": np.int32, "Fp16": np.float16, "Fp64": np.float64, "U8": np.uint8}


def guest() -> Path:
    p = target_dir() / "wasm32-wasip2" / "release" / "tpubox-wasi-nn.wasm"
    if not p.is_file():
        pytest.fail(f"{p} is missing: bash scripts/dev.sh setup builds it")
    return p.resolve()


def run(*args: str, extra: tuple[str, ...] = (), timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        TPUBOX_ONNX_PYTHON=os.environ.get("TPUBOX_ONNX_PYTHON") or str(CACHE / "venv-onnx" / "bin" / "python"),
        TPUBOX_ONNX_PYTHONPATH=str(REPO / "python"),
    )
    cmd = [str(binary()), "run", *extra, str(guest()), "--", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def said(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\nstdout:\n{r.stdout[-6000:]}\nstderr:\n{r.stderr[-4000:]}"


def outputs(stdout: str) -> dict[str, np.ndarray]:
    """The guest's `output NAME TYPE DIMS` lines and their hex bytes."""
    lines = stdout.splitlines()
    got = {}
    for i, line in enumerate(lines):
        if line.startswith("output "):
            _, name, ty, dims = line.split(" ", 3)
            shape = [int(x) for x in dims.strip("[]").split(",") if x.strip()]
            ty = ty.removeprefix("TensorType::")
            got[name] = np.frombuffer(bytes.fromhex(lines[i + 1]), TYPES[ty]).reshape(shape)
    return got


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """The tiny BERT, its batch-1 inputs as raw files, and ONNX Runtime's outputs."""
    import onnxruntime as ort

    d = tmp_path_factory.mktemp("bert")
    path, feeds = onnx_models.tiny_bert(d / "model")
    x = feeds(1)
    args = []
    for name, a in x.items():
        (d / f"{name}.bin").write_bytes(np.ascontiguousarray(a).tobytes())
        args.append(f"{name}:i64:{'x'.join(map(str, a.shape))}:d/{name}.bin")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    ref = dict(zip(names, sess.run(names, x)))
    return d, path, args, ref


def _check_bert(r, ref):
    assert r.returncode == 0, said(r)
    got = outputs(r.stdout)
    assert set(got) == set(ref), (sorted(got), sorted(ref), said(r))
    for name, want in ref.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_tiny_bert_from_its_onnx_bytes_matches_onnx_runtime(bert):
    d, path, args, ref = bert
    r = run("run", f"d/{path.relative_to(d)}", *args, extra=("--dir", f"{d}::d"))
    _check_bert(r, ref)


def test_tiny_bert_by_name_matches_onnx_runtime(bert):
    d, path, args, ref = bert
    r = run("by-name", "bert", *args, extra=("--dir", f"{d}::d", "--nn-graph", f"bert={path}"))
    _check_bert(r, ref)


def lines_of(case: str) -> dict[str, str]:
    r = run("hostile", case, timeout=300)
    assert r.returncode == 0, said(r)
    out = {}
    for line in r.stdout.splitlines():
        k, _, v = line.partition(": ")
        out[k] = v
    return out


def test_lying_bytes_and_foreign_encodings_get_their_codes():
    got = lines_of("lying-bytes")
    for case in ("empty-onnx", "noise-onnx", "noise-autodetect", "header-onnx"):
        assert got[case] == "invalid-encoding", (case, got)
    assert got["bad-stablehlo"] == "invalid-encoding", got
    for enc in ("openvino", "tensorflow", "pytorch", "tensorflowlite", "ggml"):
        code, _, message = got[enc].partition(" ")
        assert code == "invalid-encoding" and f"does not run {enc} graphs" in message, (enc, got)
    assert got["two-parts"] == "invalid-argument", got
    assert got["by-name"] == "not-found", got


def test_tensors_that_lie_about_their_dimensions_get_invalid_argument():
    got = lines_of("dims")
    for case in ("short-data", "long-data", "huge-dims"):
        assert got[case] == "invalid-argument data-kept=true", (case, got)
    for case in ("wrong-shape", "wrong-type"):
        assert got[case].startswith("invalid-argument"), (case, got)
    for case in ("wrong-name", "missing", "twice"):
        assert got[case] == "invalid-argument", (case, got)
    # The context still computes afterwards: x + x.
    assert got["after"] == "[2.0, 4.0, 6.0, 8.0]", got


def test_a_context_whose_graph_was_dropped_gets_invalid_argument():
    assert lines_of("dropped-graph") == {"compute-after-drop": "invalid-argument"}


def test_ten_thousand_contexts_get_runtime_error_past_the_cap():
    got = lines_of("contexts")
    assert got["contexts"] == "ok 256, refused {\"runtime-error\": 9744}", got
    assert got["after-drop"] == "ok", got


def test_a_hundred_graphs_get_runtime_error_past_the_cap():
    assert lines_of("graphs") == {"graphs": "ok 16, refused {\"runtime-error\": 84}"}


def test_a_result_fed_back_stays_on_the_device():
    """Three computes, each fed the last one's result: the values are right, and only the first
    input (16 bytes) went to the device and only the last result (16 bytes) came back
    (`tpubox run --usage`: the tenant's transfer counters)."""
    r = run("hostile", "chain", extra=("--usage",), timeout=300)
    assert r.returncode == 0, said(r)
    assert r.stdout.splitlines() == ["chain: [8.0, 16.0, 24.0, 32.0]"], said(r)
    usage = json.loads(r.stderr.strip().splitlines()[-1])
    assert (usage["host_to_device_bytes"], usage["device_to_host_bytes"]) == (16, 16), usage
