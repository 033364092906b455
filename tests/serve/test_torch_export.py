"""PyTorch models exported with `tpubox.torch.export` (issue 30), served by `tpubox serve` without
a guest and asked with tritonclient over HTTP and gRPC: the answers are PyTorch's numbers.

The models are exported here by make_torch_models.py in the venv that has torch, transformers and
torch-mlir (TPUBOX_TORCH_PYTHON, default $CACHE/venv-torch/bin/python; PYTHONPATH=python, so
this checkout's tpubox.torch), into a fresh repository that a `tpubox serve` of this module
serves: an MLP (three batch sizes; a request of 3 rows is padded to the program for 4) and a
tiny BERT encoder (two inputs, two outputs, INT64 token ids and mask).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_util import REPO, serve_repository  # noqa: E402

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("TPUBOX_CACHE_DIR") or Path.home() / ".cache" / "tpubox")
T = 120.0


def _torch_python() -> Path:
    p = Path(os.environ.get("TPUBOX_TORCH_PYTHON") or CACHE / "venv-torch" / "bin" / "python")
    if not p.exists():
        pytest.exit(f"{p} is missing: bash scripts/dev.sh setup makes $CACHE/venv-torch", returncode=1)
    return p


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch")
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    r = subprocess.run(
        [str(_torch_python()), str(HERE / "make_torch_models.py"), str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert r.returncode == 0, f"exporting the models failed:\n{r.stdout}\n{r.stderr}"
    return out


@pytest.fixture(scope="module")
def ref(exported):
    return dict(np.load(exported / "reference.npz"))


@pytest.fixture(scope="module")
def srv(exported):
    with serve_repository(exported, exported / "repo") as s:
        yield s.http_url, s.grpc_url


def _close(got, want, what):
    # PyTorch's CPU kernels against XLA's: float32 rounding apart.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=what)


def test_exported_mlp_answers_tritonclient_with_pytorchs_numbers(srv, ref):
    http_url, grpc_url = srv
    x = ref["mlp_x"]
    h = httpclient.InferenceServerClient(http_url, network_timeout=T)
    meta = h.get_model_metadata("torch_mlp")
    assert [i["name"] for i in meta["inputs"]] == ["input_0"]
    assert [o["name"] for o in meta["outputs"]] == ["output_0"]
    inp = httpclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    _close(h.infer("torch_mlp", [inp]).as_numpy("output_0"), ref["mlp_y"], "http")
    g = grpcclient.InferenceServerClient(grpc_url)
    ginp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    ginp.set_data_from_numpy(x)
    _close(g.infer("torch_mlp", [ginp], client_timeout=T).as_numpy("output_0"), ref["mlp_y"], "grpc")
    # One row at a time too (the program for batch size 1).
    inp = httpclient.InferInput("input_0", [1, 6], "FP32")
    inp.set_data_from_numpy(x[1:2])
    _close(h.infer("torch_mlp", [inp]).as_numpy("output_0"), ref["mlp_y"][1:2], "http, one row")


def test_exported_bert_answers_tritonclient_with_pytorchs_numbers(srv, ref):
    http_url, grpc_url = srv
    ids, mask = ref["bert_ids"], ref["bert_mask"]
    h = httpclient.InferenceServerClient(http_url, network_timeout=T)
    inputs = []
    for name, v in (("ids", ids), ("mask", mask)):
        i = httpclient.InferInput(name, list(v.shape), "INT64")
        i.set_data_from_numpy(v)
        inputs.append(i)
    r = h.infer("torch_bert", inputs)
    _close(r.as_numpy("hidden"), ref["bert_hidden"], "http hidden")
    _close(r.as_numpy("pooled"), ref["bert_pooled"], "http pooled")
    g = grpcclient.InferenceServerClient(grpc_url)
    ginputs = []
    for name, v in (("ids", ids), ("mask", mask)):
        i = grpcclient.InferInput(name, list(v.shape), "INT64")
        i.set_data_from_numpy(v)
        ginputs.append(i)
    r = g.infer("torch_bert", ginputs, client_timeout=T)
    _close(r.as_numpy("hidden"), ref["bert_hidden"], "grpc hidden")
    _close(r.as_numpy("pooled"), ref["bert_pooled"], "grpc pooled")
