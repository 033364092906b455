"""The gRPC front door (inference.GRPCInferenceService) through tritonclient.grpc: health,
metadata, configuration, statistics, the dtypes round trip, bad requests, a guest that traps."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from serve_util import (
    CONFIG_TYPES,
    DTYPES,
    assert_flipped,
    dtypes_data,
    grpc_headers,
    grpc_inputs,
    grpc_status,
)

H = grpc_headers("alice")
T = 120  # client_timeout of each call (s)


def expect_status(call, *codes):
    with pytest.raises(InferenceServerException) as e:
        call()
    assert grpc_status(e.value) in codes, f"{e.value.status()}: {e.value.message()}"
    return e.value


def assert_serving(grpc):
    data = dtypes_data(seed=98)
    result = grpc.infer("dtypes", grpc_inputs(data), headers=H, client_timeout=T)
    assert_flipped(result.as_numpy, data)


def test_health(grpc):
    assert grpc.is_server_live(client_timeout=T)  # no token: health needs none
    assert grpc.is_server_ready(client_timeout=T)
    assert grpc.is_server_live(headers=H, client_timeout=T)


def test_server_metadata(grpc):
    md = grpc.get_server_metadata(headers=H, client_timeout=T)
    assert md.name and md.version
    as_json = grpc.get_server_metadata(headers=H, as_json=True, client_timeout=T)
    assert as_json["name"] == md.name


def test_model_metadata(grpc):
    md = grpc.get_model_metadata("minilm", headers=H, client_timeout=T)
    assert md.name == "minilm"
    assert [(t.name, t.datatype, list(t.shape)) for t in md.inputs] == [("text", "BYTES", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in md.outputs] == [
        ("embedding", "FP32", [-1, 384])
    ]
    md = grpc.get_model_metadata("dtypes", model_version="1", headers=H, client_timeout=T)
    assert md.name == "dtypes"
    assert {t.name: (t.datatype, list(t.shape)) for t in md.inputs} == {
        f"INPUT_{dt}": (dt, [-1, -1]) for dt in DTYPES
    }
    assert {t.name: (t.datatype, list(t.shape)) for t in md.outputs} == {
        f"OUTPUT_{dt}": (dt, [-1, -1]) for dt in DTYPES
    }


def test_model_metadata_unknown(grpc):
    expect_status(
        lambda: grpc.get_model_metadata("no-such-model", headers=H, client_timeout=T),
        "NOT_FOUND",
        "INVALID_ARGUMENT",
    )


def test_model_ready(grpc):
    for m in ("dtypes", "minilm"):
        assert grpc.is_model_ready(m, headers=H, client_timeout=T)
        assert grpc.is_model_ready(m, model_version="1", headers=H, client_timeout=T)
    try:
        ready = grpc.is_model_ready("no-such-model", headers=H, client_timeout=T)
    except InferenceServerException as e:
        assert grpc_status(e) in ("NOT_FOUND", "INVALID_ARGUMENT"), e
    else:
        assert not ready


@pytest.mark.parametrize("model", ["dtypes", "minilm"])
def test_model_config(grpc, model_configs, model):
    cfg = grpc.get_model_config(model, headers=H, client_timeout=T).config
    md = grpc.get_model_metadata(model, headers=H, client_timeout=T)
    assert cfg.name == model
    assert cfg.max_batch_size == model_configs[model]["max_batch_size"]  # same as REST
    batch = 1 if cfg.max_batch_size > 0 else 0
    for got, want in ((cfg.input, md.inputs), (cfg.output, md.outputs)):
        assert {t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in got} == {
            t.name: (CONFIG_TYPES[t.datatype], list(t.shape)[batch:]) for t in want
        }


def _stats(grpc, model):
    resp = grpc.get_inference_statistics(model, headers=H, client_timeout=T)
    entries = [s for s in resp.model_stats if s.name == model]
    assert len(entries) == 1, resp
    return entries[0]


def test_model_stats(grpc):
    before = _stats(grpc, "dtypes")
    assert before.version == "1"
    data = dtypes_data(seed=21)
    for _ in range(2):
        grpc.infer("dtypes", grpc_inputs(data), headers=H, client_timeout=T)
    after = _stats(grpc, "dtypes")
    assert after.inference_stats.success.count - before.inference_stats.success.count == 2
    assert after.inference_stats.fail.count == before.inference_stats.fail.count
    as_json = grpc.get_inference_statistics("dtypes", headers=H, as_json=True, client_timeout=T)
    assert as_json["model_stats"][0]["name"] == "dtypes"


def test_dtypes_round_trip(grpc):
    data = dtypes_data(seed=22)
    result = grpc.infer("dtypes", grpc_inputs(data), headers=H, client_timeout=T)
    response = result.get_response()
    assert response.model_name == "dtypes"
    assert {o.name for o in response.outputs} == {f"OUTPUT_{dt}" for dt in DTYPES}
    assert_flipped(result.as_numpy, data)


def test_dtypes_other_shapes(grpc):
    for shape in ((1, 5), (3, 4)):  # few shapes: each (dtype, shape) compiles once
        data = dtypes_data(seed=23, shape=shape)
        result = grpc.infer(
            "dtypes", grpc_inputs(data), model_version="1", headers=H, client_timeout=T
        )
        assert_flipped(result.as_numpy, data)


def test_dtypes_single_output(grpc):
    data = dtypes_data(seed=24)
    result = grpc.infer(
        "dtypes",
        grpc_inputs(data),
        outputs=[grpcclient.InferRequestedOutput("OUTPUT_FP32")],
        headers=H,
        client_timeout=T,
    )
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT_FP32"]
    assert_flipped(result.as_numpy, data, only={"FP32"})


def test_request_id(grpc):
    result = grpc.infer(
        "dtypes", grpc_inputs(dtypes_data(seed=25)), request_id="req-7", headers=H, client_timeout=T
    )
    assert result.get_response().id == "req-7"


# ---------------------------------------------------------------------------------------------
# Bad requests.


def test_unknown_model(grpc):
    inputs = grpc_inputs(dtypes_data(seed=26))
    expect_status(
        lambda: grpc.infer("no-such-model", inputs, headers=H, client_timeout=T),
        "NOT_FOUND",
        "INVALID_ARGUMENT",
    )
    expect_status(
        lambda: grpc.infer("dtypes", inputs, model_version="7", headers=H, client_timeout=T),
        "NOT_FOUND",
        "INVALID_ARGUMENT",
    )
    assert_serving(grpc)


def _replace(inputs, name, new):
    return [new if i.name() == name else i for i in inputs]


def test_wrong_datatype(grpc):
    data = dtypes_data(seed=27)
    wrong = grpcclient.InferInput("INPUT_FP32", [2, 5], "INT32")
    wrong.set_data_from_numpy(np.zeros((2, 5), dtype=np.int32))
    inputs = _replace(grpc_inputs(data), "INPUT_FP32", wrong)
    expect_status(lambda: grpc.infer("dtypes", inputs, headers=H, client_timeout=T), "INVALID_ARGUMENT")
    assert_serving(grpc)


def test_wrong_shape(grpc):
    data = dtypes_data(seed=28)
    rank1 = grpcclient.InferInput("INPUT_INT8", [10], "INT8")
    rank1.set_data_from_numpy(np.zeros(10, dtype=np.int8))
    inputs = _replace(grpc_inputs(data), "INPUT_INT8", rank1)
    expect_status(lambda: grpc.infer("dtypes", inputs, headers=H, client_timeout=T), "INVALID_ARGUMENT")

    # The shape says 12 elements, the raw contents hold 10.
    liar = grpcclient.InferInput("INPUT_INT32", [2, 5], "INT32")
    liar.set_data_from_numpy(np.zeros((2, 5), dtype=np.int32))
    liar.set_shape([2, 6])
    inputs = _replace(grpc_inputs(data), "INPUT_INT32", liar)
    expect_status(lambda: grpc.infer("dtypes", inputs, headers=H, client_timeout=T), "INVALID_ARGUMENT")
    assert_serving(grpc)


def test_missing_input(grpc):
    inputs = [i for i in grpc_inputs(dtypes_data(seed=29)) if i.name() != "INPUT_UINT16"]
    expect_status(lambda: grpc.infer("dtypes", inputs, headers=H, client_timeout=T), "INVALID_ARGUMENT")
    inputs = grpc_inputs(dtypes_data(seed=29))
    outputs = [grpcclient.InferRequestedOutput("OUTPUT_NOPE")]
    expect_status(
        lambda: grpc.infer("dtypes", inputs, outputs=outputs, headers=H, client_timeout=T),
        "INVALID_ARGUMENT",
    )
    assert_serving(grpc)


def test_trap(grpc):
    trap = grpc_inputs(dtypes_data(seed=30, trap=True))
    expect_status(lambda: grpc.infer("dtypes", trap, headers=H, client_timeout=T), "INTERNAL")
    assert_serving(grpc)
