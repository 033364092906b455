"""The REST front door: health, metadata, configuration, statistics, the dtypes round trip in
JSON and in the binary tensor extension, bad requests, and a guest that traps."""

import json
import tomllib

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from serve_util import (
    CONFIG_TYPES,
    DTYPES,
    NP_DTYPES,
    REPO,
    assert_error,
    assert_flipped,
    assert_tensor_equal,
    binary_infer_parts,
    dtypes_data,
    http_headers,
    http_inputs,
    http_outputs,
    json_infer_body,
    raw_exchange,
    request,
)

H = http_headers("alice")
INFER = "/v2/models/dtypes/infer"


def toml_config(model: str) -> dict:
    directory = {"dtypes": "serve-dtypes", "minilm": "minilm-serve"}[model]
    return tomllib.loads((REPO / "examples" / directory / "config.toml").read_text())


def batch_items(model_configs, model: str, shape) -> int:
    """What one request of SHAPE adds to Triton's inference count: its batch size, or 1 for a
    model without a batch dimension."""
    return shape[0] if model_configs[model].get("max_batch_size", 0) > 0 else 1


def assert_serving(server):
    """The server still answers a plain dtypes request correctly."""
    data = dtypes_data(seed=99)
    resp = request(server, "POST", INFER, json_infer_body(data), headers=H)
    assert resp.status == 200, f"after the bad request: {resp!r}"
    outputs = {o["name"]: o for o in resp.json()["outputs"]}
    for dt in DTYPES:
        o = outputs[f"OUTPUT_{dt}"]
        got = np.array(o["data"], dtype=NP_DTYPES[dt]).reshape(o["shape"])
        assert_tensor_equal(dt, got, np.flip(data[dt], axis=-1), f"OUTPUT_{dt}")


# ---------------------------------------------------------------------------------------------
# Health, metadata, configuration, statistics.


def test_health_bodies(server):
    for path, key in (("/v2/health/live", "live"), ("/v2/health/ready", "ready")):
        resp = request(server, "GET", path)  # no token: health needs none
        assert resp.status == 200, f"{path}: {resp!r}"
        assert resp.json() == {key: True}, f"{path}: {resp!r}"


def test_health_client(http):
    assert http.is_server_live()
    assert http.is_server_ready()
    assert http.is_server_live(headers=H)


def test_server_metadata(http):
    md = http.get_server_metadata(headers=H)
    assert isinstance(md["name"], str) and md["name"]
    assert isinstance(md["version"], str) and md["version"]
    assert isinstance(md["extensions"], list)
    assert all(isinstance(e, str) for e in md["extensions"])


def test_model_metadata_minilm(http):
    for version in ("", "1"):
        md = http.get_model_metadata("minilm", model_version=version, headers=H)
        assert md["name"] == "minilm"
        assert "1" in md.get("versions", ["1"])
        tensors = [[(t["name"], t["datatype"], t["shape"]) for t in md[k]] for k in ("inputs", "outputs")]
        assert tensors == [[("text", "BYTES", [-1])], [("embedding", "FP32", [-1, 384])]]


def test_model_metadata_dtypes(http):
    md = http.get_model_metadata("dtypes", headers=H)
    assert md["name"] == "dtypes"
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in md["inputs"]}
    outputs = {t["name"]: (t["datatype"], t["shape"]) for t in md["outputs"]}
    assert inputs == {f"INPUT_{dt}": (dt, [-1, -1]) for dt in DTYPES}
    assert outputs == {f"OUTPUT_{dt}": (dt, [-1, -1]) for dt in DTYPES}
    assert len(md["inputs"]) == len(md["outputs"]) == len(DTYPES)


def test_model_ready(server, http):
    for m in ("dtypes", "minilm"):
        assert http.is_model_ready(m, headers=H)
        assert http.is_model_ready(m, model_version="1", headers=H)
    assert not http.is_model_ready("no-such-model", headers=H)
    resp = request(server, "GET", "/v2/models/no-such-model/ready", headers=H)
    assert resp.status == 400, resp


@pytest.mark.parametrize("model", ["dtypes", "minilm"])
def test_model_config(http, model):
    cfg = http.get_model_config(model, headers=H)
    md = http.get_model_metadata(model, headers=H)
    want = toml_config(model)
    assert cfg["name"] == model
    assert cfg["max_batch_size"] == want.get("max_batch_size", 0)
    batch = [-1] if cfg["max_batch_size"] > 0 else []
    for kind, md_kind in (("input", "inputs"), ("output", "outputs")):
        got = {t["name"]: (t["data_type"], [int(d) for d in t["dims"]]) for t in cfg[kind]}
        # Triton's convention: configuration dims exclude the batch dimension, metadata
        # shapes include it.
        expected = {
            t["name"]: (CONFIG_TYPES[t["datatype"]], t["shape"][len(batch) :])
            for t in md[md_kind]
        }
        assert got == expected, f"{model} {kind}"


def test_model_config_unknown(server):
    assert_error(request(server, "GET", "/v2/models/no-such-model/config", headers=H), 400)


def _stats(http, model):
    stats = http.get_inference_statistics(model, headers=H)
    entries = [s for s in stats["model_stats"] if s["name"] == model]
    assert len(entries) == 1, stats
    return entries[0]


def test_model_stats(http, model_configs):
    before = _stats(http, "dtypes")
    assert before["version"] == "1"
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert {"count", "ns"} <= set(before["inference_stats"][key]), key
    data = dtypes_data(seed=5)
    for _ in range(3):
        http.infer("dtypes", http_inputs(data, binary=True), headers=H)
    after = _stats(http, "dtypes")
    success = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    assert success == 3
    items = batch_items(model_configs, "dtypes", [2, 5])
    assert after["inference_count"] - before["inference_count"] == 3 * items
    assert 1 <= after["execution_count"] - before["execution_count"] <= 3
    assert after["inference_stats"]["success"]["ns"] > before["inference_stats"]["success"]["ns"]
    # Per batch size: these three ran as batches of 2 (sequential requests of batch 2).
    by_size = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    was = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
    assert by_size.get(2, 0) - was.get(2, 0) == 3, after["batch_stats"]
    assert sum(by_size.values()) == after["execution_count"]

    everything = http.get_inference_statistics(headers=H)
    names = {s["name"] for s in everything["model_stats"]}
    assert {"dtypes", "minilm"} <= names


# ---------------------------------------------------------------------------------------------
# The dtypes round trip.


def test_dtypes_json(http):
    data = dtypes_data(seed=1)
    names = [f"OUTPUT_{dt}" for dt in DTYPES]
    result = http.infer(
        "dtypes", http_inputs(data, binary=False), outputs=http_outputs(names, binary=False), headers=H
    )
    response = result.get_response()
    assert {o["name"] for o in response["outputs"]} == set(names)
    for o in response["outputs"]:
        assert "data" in o, f"{o['name']} asked for in JSON"
        assert o["datatype"] == o["name"].removeprefix("OUTPUT_")
        assert o["shape"] == [2, 5]
    assert_flipped(result.as_numpy, data)


def test_dtypes_binary(http):
    data = dtypes_data(seed=2)
    names = [f"OUTPUT_{dt}" for dt in DTYPES]
    result = http.infer(
        "dtypes", http_inputs(data, binary=True), outputs=http_outputs(names, binary=True), headers=H
    )
    for o in result.get_response()["outputs"]:
        assert "binary_data_size" in o.get("parameters", {}), f"{o['name']} asked for in binary"
    assert_flipped(result.as_numpy, data)


def test_dtypes_binary_default_outputs(http):
    # No outputs named: tritonclient asks for every output in binary (binary_data_output).
    data = dtypes_data(seed=3, shape=(3, 4))
    result = http.infer("dtypes", http_inputs(data, binary=True), headers=H, model_version="1")
    assert len(result.get_response()["outputs"]) == len(DTYPES)
    assert_flipped(result.as_numpy, data)


def test_dtypes_plain_json(server):
    # Only the core protocol: every tensor, BF16 and FP16 included, as JSON numbers; outputs
    # not named, so all of them come back in JSON.
    data = dtypes_data(seed=4)
    resp = request(server, "POST", INFER, json_infer_body(data), headers=H)
    assert resp.status == 200, resp
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    body = resp.json()
    assert body["model_name"] == "dtypes"
    outputs = {o["name"]: o for o in body["outputs"]}
    assert set(outputs) == {f"OUTPUT_{dt}" for dt in DTYPES}
    for dt in DTYPES:
        o = outputs[f"OUTPUT_{dt}"]
        assert o["datatype"] == dt and o["shape"] == [2, 5]
        got = np.array(o["data"], dtype=NP_DTYPES[dt]).reshape(o["shape"])
        assert_tensor_equal(dt, got, np.flip(data[dt], axis=-1), f"OUTPUT_{dt}")


def test_dtypes_raw_binary(server):
    # The binary extension spelled out by hand: what tritonclient sends, checked independently.
    data = dtypes_data(seed=6)
    header, chunks = binary_infer_parts(data, binary_outputs=False)
    head = json.dumps(header).encode()
    resp = request(
        server,
        "POST",
        INFER,
        head + b"".join(chunks),
        headers={
            **H,
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert resp.status == 200, resp
    outputs = {o["name"]: o for o in resp.json()["outputs"]}
    for dt in DTYPES:
        o = outputs[f"OUTPUT_{dt}"]
        got = np.array(o["data"], dtype=NP_DTYPES[dt]).reshape(o["shape"])
        assert_tensor_equal(dt, got, np.flip(data[dt], axis=-1), f"OUTPUT_{dt}")


@pytest.mark.parametrize("binary", [True, False])
def test_dtypes_single_output(http, binary):
    data = dtypes_data(seed=7)
    result = http.infer(
        "dtypes",
        http_inputs(data, binary=binary),
        outputs=[httpclient.InferRequestedOutput("OUTPUT_FP32", binary_data=binary)],
        headers=H,
    )
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT_FP32"]
    assert_flipped(result.as_numpy, data, only={"FP32"})


def test_dtypes_request_id(server):
    body = json_infer_body(dtypes_data(seed=8))
    body["id"] = "req-42"
    resp = request(server, "POST", INFER, body, headers=H)
    assert resp.status == 200, resp
    assert resp.json().get("id") == "req-42"


# ---------------------------------------------------------------------------------------------
# Bad requests: Triton's status and `{"error": ...}`, and the server serves on.


def _json_post(server, body):
    return request(server, "POST", INFER, body, headers={**H, "Content-Type": "application/json"})


def test_malformed_json(server):
    assert_error(_json_post(server, '{"inputs": [{"name": "INPUT_FP32", '), 400)
    assert_error(_json_post(server, "not json at all"), 400)
    assert_error(_json_post(server, '{"inputs": 7}'), 400)
    assert_serving(server)


def test_unknown_model(server, http):
    body = json_infer_body(dtypes_data(seed=10))
    assert_error(request(server, "POST", "/v2/models/no-such-model/infer", body, headers=H), 400)
    assert_error(request(server, "POST", "/v2/models/dtypes/versions/7/infer", body, headers=H), 400)
    with pytest.raises(InferenceServerException) as e:
        http.infer("no-such-model", http_inputs(dtypes_data(seed=10), binary=True), headers=H)
    assert e.value.status() == "400"
    assert_serving(server)


def test_wrong_datatype(server):
    data = dtypes_data(seed=11)
    body = json_infer_body(data, override={"FP32": {"datatype": "INT32", "data": [1] * 10}})
    assert_error(_json_post(server, body), 400)
    body = json_infer_body(data, override={"BYTES": {"datatype": "NOPE"}})
    assert_error(_json_post(server, body), 400)
    assert_serving(server)


def test_wrong_shape(server):
    data = dtypes_data(seed=12)
    # Rank 1 where the model declares [-1, -1].
    assert_error(_json_post(server, json_infer_body(data, override={"INT8": {"shape": [10]}})), 400)
    # A shape that disagrees with the number of elements.
    assert_error(_json_post(server, json_infer_body(data, override={"INT8": {"shape": [2, 6]}})), 400)
    assert_error(
        _json_post(server, json_infer_body(data, override={"FP64": {"data": [0.5] * 9}})), 400
    )
    # A negative dimension.
    assert_error(_json_post(server, json_infer_body(data, override={"INT8": {"shape": [-2, -5]}})), 400)
    assert_serving(server)


def test_missing_input(server):
    data = dtypes_data(seed=13)
    assert_error(_json_post(server, json_infer_body(data, drop={"INT16"})), 400)
    # An input the model does not have.
    body = json_infer_body(data)
    body["inputs"].append({"name": "INPUT_NOPE", "shape": [1], "datatype": "INT32", "data": [1]})
    assert_error(_json_post(server, body), 400)
    # An output the model does not have.
    body = json_infer_body(data)
    body["outputs"] = [{"name": "OUTPUT_NOPE"}]
    assert_error(_json_post(server, body), 400)
    assert_serving(server)


def _binary_post(server, head: bytes, payload: bytes, header_length: int):
    return request(
        server,
        "POST",
        INFER,
        head + payload,
        headers={
            **H,
            "Inference-Header-Content-Length": str(header_length),
            "Content-Type": "application/octet-stream",
        },
    )


def test_binary_sizes_disagree(server):
    data = dtypes_data(seed=14)
    header, chunks = binary_infer_parts(data)
    payload = b"".join(chunks)

    # binary_data_size of one input one byte short: the sizes add up to less than the body.
    short = json.loads(json.dumps(header))
    short["inputs"][3]["parameters"]["binary_data_size"] -= 1
    head = json.dumps(short).encode()
    assert_error(_binary_post(server, head, payload, len(head)), 400)

    # Trailing bytes after the last tensor.
    head = json.dumps(header).encode()
    assert_error(_binary_post(server, head, payload + b"\0\0\0\0", len(head)), 400)

    # Inference-Header-Content-Length past the end of the body, and cutting the JSON short.
    assert_error(_binary_post(server, head, payload, len(head) + len(payload) + 1), 400)
    assert_error(_binary_post(server, head, payload, len(head) - 5), 400)
    assert_error(_binary_post(server, head, payload, -1), 400)
    assert_serving(server)


def test_binary_size_larger_than_body(server):
    data = dtypes_data(seed=15)
    header, chunks = binary_infer_parts(data)
    header["inputs"][-1]["parameters"]["binary_data_size"] += 1000
    head = json.dumps(header).encode()
    assert_error(_binary_post(server, head, b"".join(chunks), len(head)), 400)

    header["inputs"][-1]["parameters"]["binary_data_size"] = 2**62
    head = json.dumps(header).encode()
    assert_error(_binary_post(server, head, b"".join(chunks), len(head)), 400)
    assert_serving(server)


def test_binary_size_wrong_for_shape(server):
    # Sizes that add up, but an FP32 [2, 5] tensor of 36 bytes and a BYTES tensor whose
    # length prefixes run past its chunk.
    data = dtypes_data(seed=16)
    header, chunks = binary_infer_parts(data)
    i = DTYPES.index("FP32")
    chunks[i] = chunks[i][:-4]
    header["inputs"][i]["parameters"]["binary_data_size"] -= 4
    head = json.dumps(header).encode()
    assert_error(_binary_post(server, head, b"".join(chunks), len(head)), 400)

    header, chunks = binary_infer_parts(data)
    j = DTYPES.index("BYTES")
    chunks[j] = b"\xff\xff\xff\x7f" + chunks[j][4:]
    head = json.dumps(header).encode()
    assert_error(_binary_post(server, head, b"".join(chunks), len(head)), 400)
    assert_serving(server)


def test_absurd_content_length(server):
    req = (
        f"POST {INFER} HTTP/1.1\r\n"
        f"Host: {server.http_url}\r\n"
        "Authorization: Bearer alice-token\r\n"
        "Content-Type: application/json\r\n"
        "Content-Length: 100000000000\r\n"
        "\r\n"
        '{"inputs": ['
    ).encode()
    out = raw_exchange(server.host, server.http_port, req)
    status_line = out.split(b"\r\n", 1)[0].decode(errors="replace")
    parts = status_line.split()
    assert len(parts) >= 2 and parts[0].startswith("HTTP/"), f"no HTTP response: {out[:300]!r}"
    assert 400 <= int(parts[1]) < 500, status_line
    assert server.proc.poll() is None, "tpubox serve died"
    assert_serving(server)


# ---------------------------------------------------------------------------------------------
# A guest that traps: that request fails with 500, the next one is served.


def test_trap(server, http):
    trap = dtypes_data(seed=17, trap=True)
    assert_error(request(server, "POST", INFER, json_infer_body(trap), headers=H), 500)
    assert_serving(server)

    with pytest.raises(InferenceServerException) as e:
        http.infer("dtypes", http_inputs(trap, binary=True), headers=H)
    assert e.value.status() == "500"
    data = dtypes_data(seed=18)
    assert_flipped(http.infer("dtypes", http_inputs(data, binary=True), headers=H).as_numpy, data)
