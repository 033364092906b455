"""Models served by `tpubox serve` whose inference is a wasi-nn graph (issue 52): the
component tests/guests/wasi-nn-model loads, at its first request, `graph.onnx` from its model
directory (`load`, converted by the ONNX converter, on the daemon's device) or the repository's
ONNX model `lin` (`load-by-name`), and keeps the execution context for the next ones. Their REST
answers must equal ONNX Runtime's on the same graph.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python" / "tests"))

from tpubox_daemon import binary, free_ports, target_dir, wait_until  # noqa: E402  (python/tests)

CACHE = Path(os.environ.get("TPUBOX_CACHE_DIR") or Path.home() / ".cache" / "tpubox")


def _graph(path: Path) -> None:
    """y = tanh(x @ W + b): x f32 [1, 4], y f32 [1, 3] (opset 17, seeded weights)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    r = np.random.default_rng(52)
    w = numpy_helper.from_array(r.standard_normal((4, 3)).astype(np.float32), "W")
    b = numpy_helper.from_array(r.standard_normal(3).astype(np.float32), "b")
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])],
        "nn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        [w, b],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    onnx.save(m, str(path))


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_served_model_runs_its_wasi_nn_graph(tmp_path):
    import onnxruntime as ort

    wasm = target_dir() / "wasm32-wasip2" / "release" / "tpubox_wasi_nn_model.wasm"
    if not wasm.is_file():
        pytest.fail(f"{wasm} is missing: bash scripts/dev.sh setup builds it")
    repo = tmp_path / "repo"
    # nn: the graph's bytes in its own directory; by-name: the repository's ONNX model `lin`
    # (served by the daemon as an ONNX model too) through load-by-name.
    for name in ("nn", "by-name"):
        (repo / name).mkdir(parents=True)
        shutil.copy(wasm, repo / name / "model.wasm")
        (repo / name / "config.toml").write_text("max_batch_size = 0\n")
    model = repo / "nn"
    _graph(model / "graph.onnx")
    (repo / "by-name" / "graph.name").write_text("lin\n")
    (repo / "lin").mkdir()
    _graph(repo / "lin" / "model.onnx")
    (repo / "lin" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 0\n')

    http, grpc, metrics = free_ports(3)
    env = dict(
        os.environ,
        TPUBOX_LOG="info",
        TPUBOX_ONNX_PYTHON=os.environ.get("TPUBOX_ONNX_PYTHON") or str(CACHE / "venv-onnx" / "bin" / "python"),
        TPUBOX_ONNX_PYTHONPATH=str(REPO / "python"),
    )
    log = tmp_path / "serve.log"
    cmd = [
        str(binary()), "serve", "--model-repository", str(tmp_path / "repo"), "--host", "127.0.0.1",
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{http}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"tpubox serve exited {proc.returncode}:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=5) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(ready, timeout=180, what=f"tpubox serve ready (its log: {log})", every=0.2)
        sess = ort.InferenceSession(str(model / "graph.onnx"), providers=["CPUExecutionProvider"])
        for seed, served in [(0, "nn"), (1, "nn"), (2, "nn"), (3, "by-name"), (4, "by-name")]:
            x = np.random.default_rng(seed).standard_normal(4).astype(np.float32)
            status, body = _post(
                f"{base}/v2/models/{served}/infer",
                {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [4], "data": x.tolist()}]},
            )
            assert status == 200, (status, body, log.read_text()[-4000:])
            (out,) = body["outputs"]
            assert out["name"] == "OUTPUT" and out["shape"] == [3], out
            want = sess.run(["y"], {"x": x[None, :]})[0][0]
            np.testing.assert_allclose(np.array(out["data"], np.float32), want, rtol=1e-5, atol=1e-5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
