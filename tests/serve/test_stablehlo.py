"""StableHLO models (docs/SERVING.md, "StableHLO models"): programs exported with the pinned jax
by tpubox.jax.export_model, served from the repository without a guest, asked with tritonclient
over HTTP and gRPC and checked against JAX's own outputs.

The models are exported here, by make_stablehlo_models.py in the venv that has jax and the tpubox
package (TPUBOX_JAX_PYTHON, default $CACHE/venv-python/bin/python; PYTHONPATH=python, so this
checkout's tpubox.jax), into a fresh repository that a `tpubox serve` of this module serves:
`mlp` and `encoder`, and copies of `mlp` broken in each way a model directory can be, which
must fail their loads with a message naming the file and the parameter while the others serve.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import _binary  # noqa: E402
from serve_util import REPO, grpc_status, serve_repository  # noqa: E402

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("TPUBOX_CACHE_DIR") or Path.home() / ".cache" / "tpubox")
T = 120.0

# Each broken copy of `mlp`: what its load's reason (and `tpubox model check`) must say.
BROKEN = {
    "broken_missing_weight": [
        "model.b1.mlirbc: parameter 2 is weight `dense2/b`",
        "broken_missing_weight/weights.safetensors does not have (missing weight)",
    ],
    "broken_extra_weight": [
        "broken_extra_weight/weights.safetensors: weight(s) `dense3/w` are no parameter",
        "(extra weight",
    ],
    "broken_dtype": [
        "model.b1.mlirbc: parameter 1 (weight `dense1/w`) is F32 in the program, F16 in",
        "(dtype mismatch)",
    ],
    "broken_shape": [
        "model.b1.mlirbc: parameter 1 (weight `dense1/w`) is f32[4,8] in the program, f32[5,8] in",
        "(shape mismatch)",
    ],
    "broken_param_count": [
        "model.b1.mlirbc: the program has 5 parameters, [tpubox.stablehlo] parameters lists 4",
        "(parameter count mismatch)",
    ],
    "broken_program": ["model.b4.mlirbc: compile-failed"],
    "broken_symbolic": ["model.b4.mlirbc: compile-failed", "dimensions of unknown size"],
    # With the loop budget off (`[tpubox.limits] max_loop_iterations = 0`), a `while` the
    # compiler cannot bound is refused.
    "loop_no_budget": ["model.b2.mlirbc: permission-denied", "unbounded-loop"],
}


def _jax_python() -> Path:
    p = Path(os.environ.get("TPUBOX_JAX_PYTHON") or CACHE / "venv-python" / "bin" / "python")
    if not p.exists():
        pytest.exit(f"{p} is missing: bash scripts/dev.sh setup makes $CACHE/venv-python", returncode=1)
    return p


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("stablehlo")
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [str(_jax_python()), str(HERE / "make_stablehlo_models.py"), str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert r.returncode == 0, f"exporting the models failed:\n{r.stdout}\n{r.stderr}"
    return out


@pytest.fixture(scope="module")
def ref(exported):
    return dict(np.load(exported / "reference.npz"))


@pytest.fixture(scope="module")
def srv(exported):
    with serve_repository(exported, exported / "repo") as s:
        yield s


@pytest.fixture
def http(srv):
    c = httpclient.InferenceServerClient(srv.http_url, connection_timeout=10.0, network_timeout=T)
    yield c
    c.close()


@pytest.fixture
def grpc(srv):
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    yield c
    c.close()


def _close(got, want, what):
    # The same XLA CPU compiler as JAX's; the padded bucket may tile a matmul differently.
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=what)


def _mlp_http(http, x, binary=True):
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "prob")]
    r = http.infer("mlp", [inp], outputs=outs)
    return r.as_numpy("logits"), r.as_numpy("prob")


def _mlp_grpc(grpc, x):
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    r = grpc.infer("mlp", [inp], client_timeout=T)
    return r.as_numpy("logits"), r.as_numpy("prob")


def _stats(http, model):
    s = http.get_inference_statistics(model)["model_stats"][0]
    return int(s["inference_count"]), int(s["execution_count"])


# Batch sizes around the buckets 1, 4, 8: exact fits and ones padded up (2, 3 -> 4; 5, 7 -> 8).
SIZES = [1, 2, 3, 4, 5, 7, 8]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_mlp_http_matches_jax(http, ref, binary):
    x = ref["mlp_x"]
    for n in SIZES:
        logits, prob = _mlp_http(http, x[:n], binary)
        assert logits.shape == (n, 3) and prob.shape == (n, 3), (n, logits.shape, prob.shape)
        _close(logits, ref["mlp_logits"][:n], f"logits, batch {n}")
        _close(prob, ref["mlp_prob"][:n], f"prob, batch {n}")


def test_mlp_grpc_matches_jax(grpc, ref):
    x = ref["mlp_x"]
    for n in SIZES:
        logits, prob = _mlp_grpc(grpc, x[n : 2 * n])
        assert logits.shape == (n, 3), (n, logits.shape)
        _close(logits, ref["mlp_logits"][n : 2 * n], f"logits, batch {n}")
        _close(prob, ref["mlp_prob"][n : 2 * n], f"prob, batch {n}")


def test_padding_is_invisible(http, ref):
    """Rows padded into a bucket never leak: a batch of 3 (run in the program for 4) gives the
    same rows as each row alone (run in the program for 1), and only 3 of them; a row of
    huge values next to padding changes nothing in the others."""
    x = ref["mlp_x"][:3].copy()
    together, _ = _mlp_http(http, x)
    assert together.shape == (3, 3)
    for i in range(3):
        alone, _ = _mlp_http(http, x[i : i + 1])
        _close(together[i : i + 1], alone, f"row {i} alone vs in a padded batch")
    x[1] = 1e30
    mixed, _ = _mlp_http(http, x)
    _close(mixed[[0, 2]], together[[0, 2]], "rows beside a huge one")


def test_encoder_http_and_grpc_match_jax(http, grpc, ref):
    ids = ref["enc_ids"]
    for n in (1, 2, 3, 4):
        inp = httpclient.InferInput("ids", [n, 8], "INT32")
        inp.set_data_from_numpy(ids[:n])
        r = http.infer("encoder", [inp])
        assert r.as_numpy("embedding").shape == (n, 16)
        assert r.as_numpy("hidden").shape == (n, 8, 16)
        _close(r.as_numpy("embedding"), ref["enc_embedding"][:n], f"http embedding, batch {n}")
        _close(r.as_numpy("hidden"), ref["enc_hidden"][:n], f"http hidden, batch {n}")
        g = grpcclient.InferInput("ids", [n, 8], "INT32")
        g.set_data_from_numpy(ids[6 - n :])
        r = grpc.infer("encoder", [g], outputs=[grpcclient.InferRequestedOutput("embedding")], client_timeout=T)
        assert r.as_numpy("hidden") is None
        _close(r.as_numpy("embedding"), ref["enc_embedding"][6 - n :], f"grpc embedding, batch {n}")


def test_concurrent_clients_are_batched(srv, ref):
    """16 clients at once, HTTP and gRPC, batches of 1 to 3: every answer is JAX's, and the
    dynamic batcher ran fewer executions than it served inferences."""
    x, want = ref["mlp_x"], ref["mlp_logits"]
    stats_client = httpclient.InferenceServerClient(srv.http_url, network_timeout=T)
    items0, execs0 = _stats(stats_client, "mlp")
    errors: list[str] = []
    barrier = threading.Barrier(16)

    def client(k: int):
        try:
            use_grpc = k % 2 == 1
            c = (grpcclient if use_grpc else httpclient).InferenceServerClient(
                srv.grpc_url if use_grpc else srv.http_url
            )
            barrier.wait()
            for j in range(6):
                n = 1 + (k + j) % 3
                start = (k + 3 * j) % (len(x) - n)
                rows = x[start : start + n]
                got = _mlp_grpc(c, rows)[0] if use_grpc else _mlp_http(c, rows)[0]
                if got.shape != (n, 3) or not np.allclose(got, want[start : start + n], rtol=2e-5, atol=2e-6):
                    errors.append(f"client {k} request {j}: {got} != {want[start : start + n]}")
            c.close()
        except Exception as e:  # noqa: BLE001
            errors.append(f"client {k}: {e!r}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, "\n".join(errors)
    items, execs = _stats(stats_client, "mlp")
    stats_client.close()
    served = sum(1 + (k + j) % 3 for k in range(16) for j in range(6))
    assert items - items0 == served
    assert execs - execs0 < 16 * 6, f"{execs - execs0} executions for {16 * 6} requests: nothing was batched"


def test_wrong_shape_or_datatype_is_400(http, grpc, ref):
    x = ref["mlp_x"]
    bad = [
        ("x", [2, 5], "FP32", np.zeros((2, 5), np.float32), "has shape [2, 5]"),
        ("x", [2, 4], "FP64", np.zeros((2, 4), np.float64), "has datatype FP64"),
        ("x", [9, 4], "FP32", np.zeros((9, 4), np.float32), "a batch of 9"),
        ("x", [0, 4], "FP32", np.zeros((0, 4), np.float32), "a batch of 0"),
        ("x", [4], "FP32", x[0], "has shape [4]"),
        ("y", [1, 4], "FP32", x[:1], "has no input `y`"),
    ]
    for name, shape, dt, arr, msg in bad:
        inp = httpclient.InferInput(name, shape, dt)
        inp.set_data_from_numpy(arr)
        with pytest.raises(InferenceServerException) as e:
            http.infer("mlp", [inp])
        assert e.value.status() == "400", (shape, dt, e.value)
        assert msg in e.value.message(), (msg, e.value.message())
        g = grpcclient.InferInput(name, shape, dt)
        g.set_data_from_numpy(arr)
        with pytest.raises(InferenceServerException) as e:
            grpc.infer("mlp", [g], client_timeout=T)
        assert grpc_status(e.value) == "INVALID_ARGUMENT", (shape, dt, e.value)
    # The model still answers.
    _close(_mlp_http(http, x[:2])[0], ref["mlp_logits"][:2], "after the bad requests")


def test_metadata_and_config(http):
    m = http.get_model_metadata("mlp")
    assert [(i["name"], i["datatype"], i["shape"]) for i in m["inputs"]] == [("x", "FP32", [-1, 4])]
    assert [(o["name"], o["datatype"], o["shape"]) for o in m["outputs"]] == [
        ("logits", "FP32", [-1, 3]),
        ("prob", "FP32", [-1, 3]),
    ]
    c = http.get_model_config("encoder")
    assert c["max_batch_size"] == 4
    assert [(i["name"], i["data_type"], i["dims"]) for i in c["input"]] == [("ids", "TYPE_INT32", [8])]


def test_broken_directories_fail_their_loads_and_the_rest_serve(http, srv):
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["mlp"]["state"] == "READY" and index["encoder"]["state"] == "READY", index
    for name, wants in BROKEN.items():
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        for w in wants:
            assert w in index[name]["reason"], (name, w, index[name]["reason"])
        assert not http.is_model_ready(name)
    # A load at run time reports the same reason (Triton answers a failed load with 400).
    with pytest.raises(InferenceServerException) as e:
        http.load_model("broken_dtype")
    assert e.value.status() == "400" and BROKEN["broken_dtype"][0] in e.value.message()
    # The broken ones loaded nothing: no weight set under their names kept anything alive,
    # and a good model's reload still serves.
    http.load_model("mlp")
    assert http.is_model_ready("mlp")


def test_model_check_cli(srv):
    """`tpubox model check DIR` says what a load would, before the server loads it."""
    env = dict(os.environ, TPUBOX_COMPILE_CACHE_DIR=str(srv.root / "check-cache"))
    ok = subprocess.run(
        [str(_binary()), "model", "check", str(srv.repo / "mlp")], capture_output=True, text=True, timeout=300, env=env
    )
    assert ok.returncode == 0, ok.stderr
    for b in (1, 4, 8):
        assert f"model.b{b}.mlirbc: batch size {b}:" in ok.stdout, ok.stdout
    assert "f32[4,8]" in ok.stdout and ok.stdout.rstrip().endswith(": ok"), ok.stdout
    for name, wants in BROKEN.items():
        r = subprocess.run(
            [str(_binary()), "model", "check", str(srv.repo / name)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert r.returncode == 1, (name, r.returncode, r.stdout, r.stderr)
        for w in wants:
            assert w in r.stderr, (name, w, r.stderr)


def test_loops_run_on_the_budget_and_trusted_lifts_the_policy(http, grpc):
    """`loop` (a `while` XLA cannot bound) serves under the default program policy, on the
    loop budget, and gives what `loop_trusted` (`[tpubox.limits] trusted = true`) gives; an
    input on which the loop never ends fails with `max-loop-iterations` on both doors, and the
    model goes on serving."""
    x = np.array([[1.0, 2.0], [0.5, 3.0]], np.float32)
    want = x.copy()
    while want.max() < 100.0:
        want = want * 2.0 + 1.0
    for model in ("loop", "loop_trusted"):
        inp = httpclient.InferInput("x", [2, 2], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(http.infer(model, [inp]).as_numpy("y"), want)
    # -1 -> -1 * 2 + 1 = -1: the maximum never reaches 100.
    endless = np.array([[-1.0, -2.0], [-3.0, -4.0]], np.float32)
    inp = httpclient.InferInput("x", [2, 2], "FP32")
    inp.set_data_from_numpy(endless)
    with pytest.raises(InferenceServerException, match="max-loop-iterations"):
        http.infer("loop", [inp])
    ginp = grpcclient.InferInput("x", [2, 2], "FP32")
    ginp.set_data_from_numpy(endless)
    with pytest.raises(InferenceServerException, match="max-loop-iterations"):
        grpc.infer("loop", [ginp])
    inp = httpclient.InferInput("x", [2, 2], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(http.infer("loop", [inp]).as_numpy("y"), want)


def _weights(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file of F32 tensors, read with NumPy."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return {
        k: np.frombuffer(raw[8 + n + h["data_offsets"][0] : 8 + n + h["data_offsets"][1]], np.float32).reshape(
            h["shape"]
        )
        for k, h in header.items()
        if k != "__metadata__"
    }


def test_a_model_without_batch_dimension(http, grpc, srv, ref):
    """`flat` (max_batch_size = 0): one program, shapes as exported, nothing padded."""
    w = _weights(srv.repo / "flat" / "weights.safetensors")["w"]
    a = ref["mlp_x"][:2]
    inp = httpclient.InferInput("a", [2, 4], "FP32")
    inp.set_data_from_numpy(a)
    r = http.infer("flat", [inp])
    y, total = r.as_numpy("y"), r.as_numpy("total")
    assert y.shape == (2, 8) and total.shape == ()
    _close(y, a @ w, "y")
    _close(total, np.float32(a.sum(dtype=np.float64)), "total")
    g = grpcclient.InferInput("a", [2, 4], "FP32")
    g.set_data_from_numpy(a)
    r2 = grpc.infer("flat", [g], client_timeout=T)
    np.testing.assert_array_equal(r2.as_numpy("y"), y)
    m = http.get_model_metadata("flat")
    assert [(i["name"], i["shape"]) for i in m["inputs"]] == [("a", [2, 4])]
    for shape in ([1, 4], [2, 4, 1], [4]):
        bad = httpclient.InferInput("a", shape, "FP32")
        bad.set_data_from_numpy(np.zeros(shape, np.float32))
        with pytest.raises(InferenceServerException) as e:
            http.infer("flat", [bad])
        assert e.value.status() == "400", (shape, e.value)


def _flat_y(http, a):
    return _flat_y_version(http, a)[0]


def _flat_y_version(http, a):
    """y of model `flat` for A, and the version of its weight set `flat` the response names
    (the `tpubox_weight_versions` response parameter)."""
    inp = httpclient.InferInput("a", list(a.shape), "FP32")
    inp.set_data_from_numpy(a)
    r = http.infer("flat", [inp])
    (v,) = json.loads(r.get_response()["parameters"]["tpubox_weight_versions"])
    assert v["name"] == "flat", v
    return r.as_numpy("y"), int(v["version"])


def test_responses_name_the_weight_version_on_both_doors(http, grpc, ref):
    a = ref["mlp_x"][:2]
    _, v = _flat_y_version(http, a)
    inp = grpcclient.InferInput("a", list(a.shape), "FP32")
    inp.set_data_from_numpy(a)
    p = grpc.infer("flat", [inp]).get_response().parameters
    assert json.loads(p["tpubox_weight_versions"].string_param) == [
        {"name": "flat", "version": v}
    ]


def _rewrite_weight(path: Path, name: str, value: np.ndarray) -> None:
    """Writes VALUE over tensor NAME of the safetensors file PATH in place (same file, same
    size: only its contents and times change)."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    lo, hi = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    data = np.ascontiguousarray(value, "<f4").tobytes()
    assert len(data) == hi - lo
    raw[8 + n + lo : 8 + n + hi] = data
    with open(path, "r+b") as f:
        f.write(raw)


def test_reload_reads_a_changed_weight_file_again(http, srv, ref):
    """A reload re-reads a weight file that changed on disk since its set was loaded (here
    rewritten in place, same size); until then the loaded set keeps serving, and a reload of an
    unchanged file shares the set."""
    path = srv.repo / "flat" / "weights.safetensors"
    original = path.read_bytes()
    w = _weights(path)["w"].copy()
    a = ref["mlp_x"][:2]
    y, v0 = _flat_y_version(http, a)
    _close(y, a @ w, "y before")
    w2 = (w * 2.0 + 1.0).astype(np.float32)
    try:
        _rewrite_weight(path, "w", w2)
        # Not read again until the model loads again.
        y, v = _flat_y_version(http, a)
        _close(y, a @ w, "y, file changed, model not reloaded")
        assert v == v0
        http.load_model("flat")
        y, v = _flat_y_version(http, a)
        _close(y, a @ w2, "y after the reload")
        assert v == v0 + 1, "the reloaded set is the next version, and responses say so"
        assert srv.log().count("the weight file changed on disk") == 1, srv.log()
        # An unchanged file is not read again.
        http.load_model("flat")
        y, v = _flat_y_version(http, a)
        _close(y, a @ w2, "y after a second reload")
        assert v == v0 + 1, "an unchanged file shares the set, and its version"
        assert srv.log().count("the weight file changed on disk") == 1, srv.log()
    finally:
        # The original back (the other tests read the file), and loaded again.
        path.write_bytes(original)
        http.load_model("flat")
    _close(_flat_y(http, a), a @ w, "y with the original weights")
    assert srv.log().count("the weight file changed on disk") == 2, srv.log()
