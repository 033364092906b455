"""ONNX models served as a Triton repository has them (issue 49): `config.pbtxt` with
`platform: "onnxruntime_onnx"` and `1/model.onnx`, converted by the daemon's load (the converter's
venv as a child process, cached by the file's hash) and served as StableHLO models with batching,
asked by `tritonclient` over HTTP and gRPC; outputs equal ONNX Runtime's on the same inputs
(rtol 1e-4). A model with an op that does not convert and a truncated file each fail their own
load, naming the op or the damage, while the others serve.

Run with the venv that builds the models (torch, transformers, onnx, onnxruntime, tritonclient):
    TPUBOX_BIN=... $CACHE/venv-onnx-export/bin/python -m pytest python/tests/onnx -q
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

import onnx_models  # noqa: E402
import programs  # noqa: E402
from test_onnx_convert import converter_python  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
RTOL, ATOL = 1e-4, 1e-5

GRAPH_PBTXT = """
name: "graph"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "img" data_type: TYPE_FP32 dims: [ 3, 8, 8 ] },
  { name: "ids" data_type: TYPE_INT64 dims: [ 5 ] }
]
output [
  { name: "probs" data_type: TYPE_FP32 dims: [ 6, 6 ] },
  { name: "gr" data_type: TYPE_FP32 dims: [ 16 ] }
]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def _binary() -> Path:
    """The tpubox binary (TPUBOX_BIN, else $CARGO_TARGET_DIR/release/tpubox): serving needs it,
    so its absence fails the tests rather than skipping them."""
    b = programs.tpubox_bin()
    if b is None:
        pytest.fail("no tpubox binary: TPUBOX_BIN, or cargo build --release -p tpubox")
    return b


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Served:
    def __init__(self, root: Path, repo: Path):
        self.root, self.repo = root, repo
        self.http_port, self.grpc_port, self.metrics_port = _ports(3)
        self.log_path = root / "serve.log"
        self.cache = root / "onnx-cache"
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> "Served":
        env = dict(os.environ)
        env.update(
            TPUBOX_LOG="info",
            TPUBOX_ONNX_PYTHON=str(converter_python()),
            TPUBOX_ONNX_PYTHONPATH=str(REPO / "python"),
            TPUBOX_ONNX_CACHE_DIR=str(self.cache),
        )
        cmd = [
            str(_binary()), "serve", "--model-repository", str(self.repo), "--host", "127.0.0.1",
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
            "--metrics-port", str(self.metrics_port),
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        client = httpclient.InferenceServerClient(self.http_url)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                if client.is_server_ready():
                    return self
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                assert self.proc.wait(timeout=40) == 0, self.log()
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx-serve")
    build = root / "build"
    repo = root / "repo"

    def place(name: str, model: Path, pbtxt: str) -> None:
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(model, repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(pbtxt)

    graph, graph_feeds = onnx_models.helper_graph(build / "graph")
    place("graph", graph, GRAPH_PBTXT)
    bert, bert_feeds = onnx_models.tiny_bert(build / "bert")
    place("bert", bert, 'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n')
    torchnet, torchnet_feeds = onnx_models.torch_exported(build / "torchnet")
    place("torchnet", torchnet, 'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n')
    resnet, resnet_feeds = onnx_models.tiny_resnet(build / "resnet")
    place("resnet", resnet, 'backend: "onnxruntime"\nmax_batch_size: 2\n')
    place("unknown_op", onnx_models.unknown_op_graph(build / "unknown"), 'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n')
    place("truncated", graph, GRAPH_PBTXT.replace('"graph"', '"truncated"'))
    data = (repo / "truncated" / "1" / "model.onnx").read_bytes()
    (repo / "truncated" / "1" / "model.onnx").write_bytes(data[: len(data) // 2])
    s = Served(root, repo).start()
    s.feeds = {
        "graph": (graph, graph_feeds),
        "torchnet": (torchnet, torchnet_feeds),
        "bert": (bert, bert_feeds),
        "resnet": (resnet, resnet_feeds),
    }
    yield s
    s.stop()


def _reference(model: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def _infer(mod, client, model: str, feeds: dict[str, np.ndarray], outputs: list[str]):
    inputs = []
    for name, arr in feeds.items():
        i = mod.InferInput(name, list(arr.shape), {np.float32: "FP32", np.int64: "INT64"}[arr.dtype.type])
        i.set_data_from_numpy(arr)
        inputs.append(i)
    r = client.infer(model, inputs, outputs=[mod.InferRequestedOutput(o) for o in outputs])
    return {o: r.as_numpy(o) for o in outputs}


def test_models_load_or_fail_alone(served):
    index = {m["name"]: m for m in httpclient.InferenceServerClient(served.http_url).get_model_repository_index()}
    for m in ("graph", "torchnet", "bert", "resnet"):
        assert index[m]["state"] == "READY", index[m]
    assert index["unknown_op"]["state"] == "UNAVAILABLE"
    assert "FancyNorm" in index["unknown_op"]["reason"], index["unknown_op"]
    assert index["truncated"]["state"] == "UNAVAILABLE"
    assert "converting" in index["truncated"]["reason"], index["truncated"]


@pytest.mark.parametrize("model,batch", [("graph", 3), ("torchnet", 3), ("bert", 2), ("resnet", 2)])
@pytest.mark.parametrize("door", ["http", "grpc"])
def test_outputs_equal_onnxruntime(served, model, batch, door):
    path, feeds_of = served.feeds[model]
    feeds = feeds_of(batch)
    want = _reference(path, feeds)
    mod, url = (httpclient, served.http_url) if door == "http" else (grpcclient, served.grpc_url)
    got = _infer(mod, mod.InferenceServerClient(url), model, feeds, list(want))
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=RTOL, atol=ATOL, err_msg=f"{model}.{name}")


def test_concurrent_requests_batch_and_stay_right(served):
    """Sixteen single-item requests at once: dynamic batching merges them into the converted
    programs' batch sizes, and every answer is its own request's."""
    path, feeds_of = served.feeds["graph"]
    items = [{k: v[i : i + 1] for k, v in feeds_of(16).items()} for i in range(16)]
    client = grpcclient.InferenceServerClient(served.grpc_url)

    def one(f):
        return _infer(grpcclient, client, "graph", f, ["probs", "gr"])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, items))
    for f, got in zip(items, results):
        want = _reference(path, f)
        for name in ("probs", "gr"):
            np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL)
    stats = httpclient.InferenceServerClient(served.http_url).get_inference_statistics("graph")
    batches = stats["model_stats"][0]["batch_stats"]
    assert any(b["batch_size"] > 1 for b in batches), batches


def test_converted_once_and_weights_outside_the_programs(served):
    http = httpclient.InferenceServerClient(served.http_url)
    converted = served.log().count("ONNX model converted to StableHLO")
    http.load_model("bert")  # a reload reads the cache
    assert served.log().count("ONNX model converted to StableHLO") == converted
    plans = list(served.cache.glob("*/plan.json"))
    assert len(plans) == 4, plans  # graph, torchnet, bert, resnet
    for plan in plans:
        weights = plan.parent / "weights.safetensors"
        assert list(plan.parent.glob("model.b*.mlirbc")) and weights.stat().st_size > 0
    # The BERT's weights are in its file: each of its programs is far smaller than they are.
    bert = max(plans, key=lambda p: (p.parent / "weights.safetensors").stat().st_size).parent
    programs = list(bert.glob("model.b*.mlirbc"))
    assert len(programs) == 3  # batch sizes 1, 2, 4
    assert all(p.stat().st_size * 4 < (bert / "weights.safetensors").stat().st_size for p in programs)
    cfg = http.get_model_config("bert")
    assert cfg["max_batch_size"] == 4 and cfg["backend"] == "stablehlo", cfg


def test_model_check_explains_an_onnx_directory(served):
    """`tpubox model check` on a Triton model directory of an ONNX model: the converter's
    explanation (the ops, which convert at which batch sizes), then the converted programs
    checked; a model with an op that does not convert fails, naming it."""
    env = dict(os.environ, TPUBOX_ONNX_PYTHON=str(converter_python()),
               TPUBOX_ONNX_PYTHONPATH=str(REPO / "python"), TPUBOX_ONNX_CACHE_DIR=str(served.cache))  # fmt: skip
    r = subprocess.run([str(_binary()), "model", "check", str(served.repo / "graph")],
                       capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    for op in ("Conv", "Gemm", "LayerNormalization", "Gather"):
        assert op in r.stdout, r.stdout
    assert "batch size 8" in r.stdout and r.stdout.rstrip().endswith(": ok"), r.stdout
    r = subprocess.run([str(_binary()), "model", "check", str(served.repo / "unknown_op")],
                       capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert r.returncode != 0 and "FancyNorm" in r.stderr, r.stdout + r.stderr
