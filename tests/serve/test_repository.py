"""The model repository extension: the index, and unloading and loading a model at run time,
over REST and gRPC."""

import json
import time

import pytest
from tritonclient.utils import InferenceServerException

from serve_util import (
    assert_error,
    assert_flipped,
    dtypes_data,
    grpc_headers,
    grpc_inputs,
    grpc_status,
    http_headers,
    http_inputs,
    json_infer_body,
    request,
)

HH = http_headers("alice")
GH = grpc_headers("alice")
T = 120


def _index_states(entries) -> dict:
    return {e["name"]: e.get("state") for e in entries}


def _ensure_loaded(http):
    """Leaves dtypes loaded for the tests after this one, whatever happened here."""
    if not http.is_model_ready("dtypes", headers=HH):
        http.load_model("dtypes", headers=HH)
    deadline = time.monotonic() + 60
    while not http.is_model_ready("dtypes", headers=HH):
        assert time.monotonic() < deadline, "dtypes did not load again"
        time.sleep(0.2)


def test_index(server, http):
    states = _index_states(http.get_model_repository_index(headers=HH))
    assert states.get("dtypes") == "READY" and states.get("minilm") == "READY", states
    # The same through a raw POST with a JSON body, and every entry has a version.
    resp = request(server, "POST", "/v2/repository/index", {}, headers=HH)
    assert resp.status == 200, resp
    for entry in resp.json():
        assert entry["name"] in ("dtypes", "minilm"), entry
        assert entry.get("version", "1") == "1", entry


def test_unload_load_http(server, http):
    data = dtypes_data(seed=70)
    try:
        http.unload_model("dtypes", headers=HH)
        resp = request(server, "GET", "/v2/models/dtypes/ready", headers=HH)
        assert resp.status != 200, resp
        assert not http.is_model_ready("dtypes", headers=HH)
        assert_error(request(server, "POST", "/v2/models/dtypes/infer", json_infer_body(data), headers=HH), 400)
        with pytest.raises(InferenceServerException) as e:
            http.infer("dtypes", http_inputs(data, binary=True), headers=HH)
        assert e.value.status() == "400"
        states = _index_states(http.get_model_repository_index(headers=HH))
        assert "dtypes" in states and states["dtypes"] != "READY", states
        assert states.get("minilm") == "READY", states
        # While dtypes is away the server stays live and the other model serves.
        assert http.is_server_live()
        assert http.is_model_ready("minilm", headers=HH)

        http.load_model("dtypes", headers=HH)  # returns once loaded, as Triton's does
        assert http.is_model_ready("dtypes", headers=HH)
        assert request(server, "GET", "/v2/models/dtypes/ready", headers=HH).status == 200
        assert_flipped(http.infer("dtypes", http_inputs(data, binary=True), headers=HH).as_numpy, data)
        assert _index_states(http.get_model_repository_index(headers=HH))["dtypes"] == "READY"
    finally:
        _ensure_loaded(http)


def test_load_unknown(server, http):
    with pytest.raises(InferenceServerException) as e:
        http.load_model("no-such-model", headers=HH)
    assert e.value.status() == "400"
    # Triton's words (its model-control examples look for "failed to load").
    assert e.value.message() == "failed to load 'no-such-model', failed to poll from model repository"
    assert_error(request(server, "POST", "/v2/repository/models/no-such-model/load", {}, headers=HH), 400)


def test_repository_needs_a_token(server):
    assert_error(request(server, "POST", "/v2/repository/index", {}, headers={}), 401)
    assert_error(request(server, "POST", "/v2/repository/models/dtypes/unload", {}, headers={}), 401)
    assert request(server, "GET", "/v2/models/dtypes/ready", headers=HH).status == 200


def test_unload_load_grpc(grpc, http):
    data = dtypes_data(seed=71)
    try:
        index = grpc.get_model_repository_index(headers=GH, client_timeout=T)
        assert {m.name: m.state for m in index.models} == {"dtypes": "READY", "minilm": "READY"}

        grpc.unload_model("dtypes", headers=GH, client_timeout=T)
        assert not grpc.is_model_ready("dtypes", headers=GH, client_timeout=T)
        with pytest.raises(InferenceServerException) as e:
            grpc.infer("dtypes", grpc_inputs(data), headers=GH, client_timeout=T)
        assert grpc_status(e.value) in ("UNAVAILABLE", "NOT_FOUND", "INVALID_ARGUMENT"), e.value
        index = grpc.get_model_repository_index(headers=GH, client_timeout=T)
        states = {m.name: m.state for m in index.models}
        assert "dtypes" in states and states["dtypes"] != "READY", states

        grpc.load_model("dtypes", headers=GH, client_timeout=T)
        assert grpc.is_model_ready("dtypes", headers=GH, client_timeout=T)
        result = grpc.infer("dtypes", grpc_inputs(data), headers=GH, client_timeout=T)
        assert_flipped(result.as_numpy, data)
    finally:
        _ensure_loaded(http)


def test_repository_control_is_a_permission(server, grpc):
    """Loading and unloading needs `repository_control` and permission for the model; the index
    lists only the models the caller may call."""
    bob = http_headers("bob")
    for m in ("dtypes", "minilm"):
        for op in ("unload", "load"):
            assert_error(request(server, "POST", f"/v2/repository/models/{m}/{op}", {}, headers=bob), 403)
    with pytest.raises(InferenceServerException) as e:
        grpc.unload_model("minilm", headers=grpc_headers("bob"), client_timeout=T)
    assert grpc_status(e.value) == "PERMISSION_DENIED"
    resp = request(server, "POST", "/v2/repository/index", {}, headers=bob)
    assert resp.status == 200
    assert [e["name"] for e in resp.json()] == ["dtypes"]
    # Nothing was unloaded.
    for m in ("dtypes", "minilm"):
        assert request(server, "GET", f"/v2/models/{m}/ready", headers=HH).status == 200


def test_load_with_a_config_override(server, http, grpc):
    """Triton's `config` load parameter: the JSON replaces the directory's configuration for
    that load (over REST and gRPC); an invalid one fails with "failed to load" and the version
    serving stays; `file:` parameters stay refused; a load without it reads the file again."""
    data = dtypes_data(shape=(1, 3), seed=71)
    override = {
        "max_batch_size": 4,
        "instance_group": [{"count": 1}],
        "dynamic_batching": {"max_queue_delay_microseconds": 1000},
    }
    try:
        http.load_model("dtypes", config=json.dumps(override), headers=HH)
        assert http.get_model_config("dtypes", headers=HH)["max_batch_size"] == 4
        r = http.infer("dtypes", http_inputs(data, binary=True), headers=HH)
        assert_flipped(r.as_numpy, data)
        grpc.load_model("dtypes", config=json.dumps({"max_batch_size": 2}), headers=GH, client_timeout=T)
        cfg = grpc.get_model_config("dtypes", headers=GH, as_json=True)["config"]
        assert int(cfg["max_batch_size"]) == 2 and "dynamic_batching" not in cfg, cfg
        r = grpc.infer("dtypes", grpc_inputs(data), headers=GH)
        assert_flipped(r.as_numpy, data)

        bad = (
            "{not json",
            json.dumps({"max_batch_size": 64}),  # more than the guest accepts
            json.dumps({"name": "minilm"}),  # another model's name
            json.dumps({"max_batch_size": 4, "no_such_field": 1}),
        )
        for config in bad:
            with pytest.raises(InferenceServerException) as e:
                http.load_model("dtypes", config=config, headers=HH)
            assert e.value.message().startswith("failed to load 'dtypes', "), e.value.message()
            with pytest.raises(InferenceServerException) as e:
                grpc.load_model("dtypes", config=config, headers=GH, client_timeout=T)
            assert "failed to load 'dtypes', " in e.value.message(), e.value.message()
        # The version the last good load made is still serving.
        assert int(grpc.get_model_config("dtypes", headers=GH, as_json=True)["config"]["max_batch_size"]) == 2
        r = http.infer("dtypes", http_inputs(data, binary=True), headers=HH)
        assert_flipped(r.as_numpy, data)
        # A config that is not a string, and model files sent with the request: refused.
        resp = request(server, "POST", "/v2/repository/models/dtypes/load", {"parameters": {"config": {"max_batch_size": 1}}}, headers=HH)
        assert_error(resp, 400)
        assert resp.json()["error"].startswith("failed to load 'dtypes', "), resp
        # Model files sent with the request: refused with Triton's status and words (its
        # simple_grpc_model_control.py checks both).
        resp = request(server, "POST", "/v2/repository/models/dtypes/load", {"parameters": {"file:1/model.wasm": "AAAA"}}, headers=HH)
        assert_error(resp, 500)
        assert resp.json()["error"].startswith("failed to load 'dtypes', failed to poll from model repository: "), resp
        assert "not supported" in resp.json()["error"]
    finally:
        http.load_model("dtypes", headers=HH)
        _ensure_loaded(http)
    assert http.get_model_config("dtypes", headers=HH)["max_batch_size"] == 8


def test_triton_wording_of_the_errors_clients_parse(server, http, grpc):
    """An unknown model, a version that is not a number, an unknown version, and gRPC typed
    contents mixed with raw contents, in Triton's words (crates/serve/src/wording.rs)."""
    with pytest.raises(InferenceServerException) as e:
        http.get_model_metadata("nosuch", headers=HH)
    assert e.value.message() == "Request for unknown model: 'nosuch' is not found"
    with pytest.raises(InferenceServerException) as e:
        grpc.get_model_metadata("nosuch", headers=GH)
    assert e.value.message() == "Request for unknown model: 'nosuch' is not found"
    for client, headers in ((http, HH), (grpc, GH)):
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata("dtypes", model_version="x1", headers=headers)
        assert e.value.message().startswith(
            "failed to get model version from specified version string 'x1'"
        ), e.value.message()
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata("dtypes", model_version="3", headers=headers)
        assert e.value.message() == "Request for unknown model: 'dtypes' version 3 is not found"
        assert client.get_model_metadata("dtypes", model_version="1", headers=headers)
    # typed contents next to raw_input_contents.
    import tritonclient.grpc.service_pb2 as pb
    import tritonclient.grpc.service_pb2_grpc as pb_grpc
    import grpc as grpc_lib

    req = pb.ModelInferRequest(model_name="dtypes")
    inp = req.inputs.add(name="INPUT_FP32", datatype="FP32", shape=[1, 1])
    inp.contents.fp32_contents.append(1.0)
    req.raw_input_contents.append(b"\0\0\x80?")
    with grpc_lib.insecure_channel(f"{server.host}:{server.grpc_port}") as ch:
        with pytest.raises(grpc_lib.RpcError) as e:
            pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, metadata=tuple(GH.items()), timeout=30)
    assert e.value.details() == (
        "contents field must not be specified when using raw_input_contents for 'INPUT_FP32' "
        "for model 'dtypes'"
    ), e.value.details()


def test_a_reload_keeps_the_model_tenants_counters(server, http):
    """`tpubox_tenant_executions_total{tenant="model:dtypes"}` goes on across a reload (the new
    model has a new tenant; the old one's count is kept when the old model is dropped)."""
    from serve_util import metric, scrape, wait_metric

    data = dtypes_data()
    http.infer("dtypes", http_inputs(data, binary=True), headers=HH)
    name, label = "tpubox_tenant_executions_total", {"tenant": "model:dtypes"}
    before = metric(scrape(server), name, **label)
    assert before >= 1
    try:
        http.load_model("dtypes", headers=HH)
        _ensure_loaded(http)
        # The replaced model is dropped once nothing holds it; from then on its count is in.
        assert wait_metric(server, name, before, timeout=15, **label) >= before
        http.infer("dtypes", http_inputs(data, binary=True), headers=HH)
        assert wait_metric(server, name, before + 1, timeout=15, **label) >= before + 1
    finally:
        _ensure_loaded(http)
