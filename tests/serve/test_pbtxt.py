"""Triton's `config.pbtxt`: models configured as Triton configures them, read against Triton's own
`model_config.proto`, beside models whose configuration is broken, names a field Triton does not
define, disagrees with the model, or sets a field tpubox refuses: each of those fails its own
load with a clear reason while the others serve. A sequence model configured as Triton's
`simple_sequence` is (the control inputs only in `sequence_batching.control_input`), and a
config override in protobuf's JSON spellings (`{"maxBatchSize": "2"}`) reloads a model and keeps
its tpubox settings (`tpubox.toml`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import _need, _target_dir
from serve_util import assert_flipped, dtypes_data, grpc_inputs, http_inputs, serve_repository

# The accumulator (examples/serve-accumulator) as Triton configures a stateful model: only the
# data input in `input`, the controls in `sequence_batching`; with Triton fields tpubox ignores.
ACCUMULATOR = """
name: "acc"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 1000 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
parameters [ { key: "execute_delay_ms" value: { string_value: "3" } } ]
optimization { input_pinned_memory { enable: true } }
"""

# The dtypes model, its component found by default_model_filename in the latest version
# directory, its tenant limits in tpubox.toml.
DTYPES = """
# A comment, as Triton's files have.
name: "dt"
backend: "tpubox"
max_batch_size: 4
default_model_filename: "dtypes.wasm"
dynamic_batching { max_queue_delay_microseconds: 100 preserve_ordering: true }
version_policy: { latest: { num_versions: 1 } }
"""

BROKEN = {
    # A syntax error (line 3: a list without its closing bracket).
    "syntax": ('name: "syntax"\nmax_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 1 }\n', "line 3, column"),
    "unknown_field": ("max_batch_size: 8\nmax_batch_sizes: 4\n", "field 'max_batch_sizes' not found for message 'inference.ModelConfig'"),
    "bad_enum": ('input [ { name: "x" data_type: TYPE_FLOAT32 dims: [ 1 ] } ]\n', "TYPE_FLOAT32"),
    # Inputs that disagree with what the component declares.
    "disagree": (
        'input [ { name: "INPUT_FP32" data_type: TYPE_INT32 dims: [ -1 ] } ]\n',
        "input `INPUT_FP32`: the config says INT32 [-1], the model declares FP32 [-1]",
    ),
    "refused": ('input [ { name: "INPUT_FP32" data_type: TYPE_FP32 dims: [ -1 ] optional: true } ]\n', "`input[INPUT_FP32].optional` is set"),
    "wrong_name": ('name: "other"\n', "name `other` differs from the directory's name `wrong_name`"),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target = _target_dir() / "wasm32-wasip2" / "release"
    hint = "cargo build --release --target wasm32-wasip2 -p {} (bash scripts/dev.sh setup does)"
    dtypes_wasm = _need(target / "serve_dtypes.wasm", hint.format("serve-dtypes"))
    acc_wasm = _need(target / "serve_accumulator.wasm", hint.format("serve-accumulator"))
    root = tmp_path_factory.mktemp("pbtxt")
    repo = root / "repo"
    (repo / "acc" / "1").mkdir(parents=True)
    (repo / "acc" / "config.pbtxt").write_text(ACCUMULATOR)
    shutil.copy(acc_wasm, repo / "acc" / "1" / "model.wasm")
    for v in ("1", "3"):
        (repo / "dt" / v).mkdir(parents=True)
    (repo / "dt" / "config.pbtxt").write_text(DTYPES)
    (repo / "dt" / "tpubox.toml").write_text("[limits]\nmax_device_mib = 64\nmax_call_seconds = 30\n")
    shutil.copy(dtypes_wasm, repo / "dt" / "3" / "dtypes.wasm")
    (repo / "dt" / "1" / "dtypes.wasm").write_bytes(b"not a component: version 1 is not the latest")
    for name, (text, _) in BROKEN.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(text)
        shutil.copy(dtypes_wasm, repo / name / "1" / "model.wasm")
    (repo / "two_files").mkdir()
    (repo / "two_files" / "config.pbtxt").write_text("")
    (repo / "two_files" / "config.toml").write_text("")
    with serve_repository(root, repo) as s:
        yield s


def _index(http) -> dict[str, dict]:
    return {m["name"]: m for m in http.get_model_repository_index()}


def test_each_broken_configuration_fails_its_own_load(served):
    http = httpclient.InferenceServerClient(served.http_url)
    index = _index(http)
    assert index["acc"]["state"] == "READY" and index["dt"]["state"] == "READY", index
    for name, (_, reason) in BROKEN.items():
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        assert reason in index[name]["reason"], (name, index[name]["reason"])
    assert "has both config.pbtxt and config.toml: keep one" in index["two_files"]["reason"]
    # The ignored Triton fields are named in the log, per model.
    log = served.log()
    for field in ("parameters (execute_delay_ms)", "optimization", "sequence_batching.oldest.max_candidate_sequences"):
        assert field in log, field
    assert "dynamic_batching.preserve_ordering, version_policy" in log


def test_a_sequence_model_configured_as_triton_configures_it(served):
    http = httpclient.InferenceServerClient(served.http_url)
    # The client sees the configured input only; the server fills the controls.
    assert [i["name"] for i in http.get_model_metadata("acc")["inputs"]] == ["INPUT"]
    cfg = http.get_model_config("acc")
    assert [i["name"] for i in cfg["input"]] == ["INPUT"] and cfg["max_batch_size"] == 8, cfg
    grpc = grpcclient.InferenceServerClient(served.grpc_url)
    sums = []
    for k, v in enumerate([3, 4, 5]):
        i = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        i.set_data_from_numpy(np.array([[v]], np.int32))
        r = grpc.infer("acc", [i], sequence_id=77, sequence_start=k == 0, sequence_end=k == 2)
        sums.append(int(r.as_numpy("OUTPUT")[0, 0]))
    assert sums == [3, 7, 12]


def test_defaults_and_overrides_in_protobufs_spellings(served):
    http = httpclient.InferenceServerClient(served.http_url)
    grpc = grpcclient.InferenceServerClient(served.grpc_url)
    data = dtypes_data(shape=(4, 3), seed=5)
    assert http.get_model_config("dt")["max_batch_size"] == 4
    assert_flipped(http.infer("dt", http_inputs(data, binary=True)).as_numpy, data)
    with pytest.raises(InferenceServerException, match="the model takes 1 to 4"):
        http.infer("dt", http_inputs(dtypes_data(shape=(5, 3), seed=5), binary=True))
    try:
        # Protobuf's JSON: camelCase names, quoted numbers. The tpubox settings stay.
        http.load_model("dt", config=json.dumps({"maxBatchSize": "2", "defaultModelFilename": "dtypes.wasm"}))
        assert http.get_model_config("dt")["max_batch_size"] == 2
        small = dtypes_data(shape=(2, 3), seed=6)
        assert_flipped(grpc.infer("dt", grpc_inputs(small)).as_numpy, small)
        # Triton's example's invalid override, and a field Triton does not define.
        for bad in ('"parameters": {"config": {{"max_batch_size": "16"}}}', json.dumps({"max_batch_size": 2, "bogus": 1})):
            with pytest.raises(InferenceServerException, match="failed to load 'dt'"):
                http.load_model("dt", config=bad)
        assert http.is_model_ready("dt")
    finally:
        http.load_model("dt")
    assert http.get_model_config("dt")["max_batch_size"] == 4


def test_a_fixed_configuration_loads(served, tmp_path):
    """The broken model, once its file is fixed, loads on the next load request."""
    http = httpclient.InferenceServerClient(served.http_url)
    cfg = Path(served.repo) / "unknown_field" / "config.pbtxt"
    cfg.write_text('max_batch_size: 8\ninput [ { name: "INPUT_FP32" data_type: TYPE_FP32 dims: [ -1 ] } ]\n')
    try:
        # Only some inputs declared: the rest of the model's are not in the configuration.
        with pytest.raises(InferenceServerException, match="the config declares 1 inputs, the model 14"):
            http.load_model("unknown_field")
        cfg.write_text("max_batch_size: 8\n")
        http.load_model("unknown_field")
        assert http.is_model_ready("unknown_field")
    finally:
        http.unload_model("unknown_field")
