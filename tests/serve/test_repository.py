"""The model repository extension: the index, and unloading and loading a model at run time,
over REST and gRPC."""

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


def test_load_refuses_a_config_override(server):
    """Triton's `config` / `file:` load parameters would bypass the model directory: refused."""
    for params in ({"config": "{}"}, {"file:1/model.wasm": "AAAA"}):
        resp = request(server, "POST", "/v2/repository/models/dtypes/load", {"parameters": params}, headers=HH)
        assert_error(resp, 400)
        assert "not supported" in resp.json()["error"]
    assert request(server, "GET", "/v2/models/dtypes/ready", headers=HH).status == 200
