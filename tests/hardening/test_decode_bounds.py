"""Authenticated requests are bounded too: decoding a request costs at most a documented
multiple of its size (docs/SECURITY.md, "What a request costs to decode").

- REST: a request's JSON is decoded without a JSON tree, each input's `data` straight into a
  buffer of the tensor's size; at most 4 bytes per byte of JSON text, on top of the body.
  Duplicate keys are refused at every level.
- gRPC: `ModelInfer` is checked on the wire before prost decodes it: at most 1024 inputs,
  outputs, raw_input_contents and parameters, typed contents at most 8x the message.
"""

from __future__ import annotations

import json

import grpc

from hardening_util import ATTACKER, PROBE, TENANTS, bearer, dtypes_body, request, settle_rss

# The harness's tenants, without the flags these tests do not need (so that they also run
# against a daemon from before those flags).
TENANTS_HERE = {
    name: {k: v for k, v in t.items() if k != "metrics"} for name, t in TENANTS.items()
}

INFER = "/v2/models/dtypes/infer"
MIB = 1 << 20

# The documented bounds: the body, held twice while it is read, plus 4 bytes per byte of JSON
# (REST); the message, held twice while it arrives, plus 8 bytes per byte of typed contents and
# 8 more when they become tensor bytes (gRPC).
# SLACK_MIB covers allocator and thread-stack noise on a shared machine.
REST_MULTIPLE = 6
GRPC_MULTIPLE = 20
SLACK_MIB = 64


def zeros_body(datatype: str, name: str, shape: list[int], count: int) -> bytes:
    """A JSON inference request whose one input's data is COUNT zeros."""
    head = json.dumps({"name": name, "shape": shape, "datatype": datatype})[:-1]
    return (
        b'{"inputs":[' + head.encode() + b',"data":[' + b",".join([b"0"] * count) + b"]}]}"
    )


def post(d, body, token=ATTACKER):
    return request(d, "POST", INFER, body, {**bearer(token), "Content-Type": "application/json"}, timeout=120)


def attack_cost_mib(d, attack) -> tuple[object, float]:
    """Runs ATTACK; its result and the daemon's peak RSS increase over the RSS before, MiB."""
    before = d.rss_mib()
    d.reset_peak()
    result = attack()
    return result, d.peak_mib() - before


def test_rest_json_zeros_cost_a_bounded_multiple(daemon):
    d = daemon(tenants=TENANTS_HERE)
    baseline = d.rss_mib()
    # 16 Mi FP64 zeros (32 MiB of "0,"): every element decoded (8 bytes per 2 of text), then
    # refused by the model (its inputs are missing). The old decoder built a JSON tree of
    # about 22x the body.
    n = 16 * MIB
    body = zeros_body("FP64", "INPUT_FP32", [1, n], n)
    r, cost = attack_cost_mib(d, lambda: post(d, body))
    limit = REST_MULTIPLE * len(body) / MIB + SLACK_MIB
    assert cost <= limit, f"decoding {len(body) / MIB:.0f} MiB of JSON cost {cost:.0f} MiB (limit {limit:.0f})"
    assert r.status == 400 and "is missing" in r.json()["error"], r
    # The same zeros under a shape of 4 elements: refused on the element count, before any
    # element is stored.
    body = zeros_body("FP32", "INPUT_FP32", [1, 4], n)
    r, cost = attack_cost_mib(d, lambda: post(d, body))
    limit = 2 * len(body) / MIB + SLACK_MIB
    assert cost <= limit, f"refusing {len(body) / MIB:.0f} MiB of JSON cost {cost:.0f} MiB (limit {limit:.0f})"
    assert r.status == 400 and "needs 16" in r.json()["error"], r
    # Still serving, and the memory came back.
    assert post(d, dtypes_body(), PROBE).status == 200
    rss = settle_rss(d, baseline)
    assert rss <= baseline + 64, f"RSS {rss:.0f} MiB after the attack, baseline {baseline:.0f} MiB"


DUPLICATES = {
    "top level": '{"inputs": [], "inputs": []}',
    "tensor": '{"inputs": [{"name": "INPUT_FP32", "name": "INPUT_FP64", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}',
    "tensor data": '{"inputs": [{"name": "INPUT_FP32", "shape": [1, 1], "datatype": "FP32", "data": [1], "data": [2]}]}',
    "request parameters": '{"parameters": {"binary_data_output": true, "binary_data_output": false}, "inputs": []}',
    "input parameters": '{"inputs": [{"name": "INPUT_FP32", "shape": [1, 1], "datatype": "FP32", "data": [1], "parameters": {"x": 1, "x": 2}}]}',
    "output": '{"inputs": [], "outputs": [{"name": "OUTPUT_FP32", "name": "OUTPUT_FP64"}]}',
    "output parameters": '{"inputs": [], "outputs": [{"name": "OUTPUT_FP32", "parameters": {"binary_data": true, "binary_data": false}}]}',
    "nested in a parameter": '{"inputs": [], "parameters": {"extra": {"a": [{"k": 1, "k": 1}]}}}',
}


def test_rest_duplicate_keys_are_refused(daemon):
    d = daemon(tenants=TENANTS_HERE)
    for where, text in DUPLICATES.items():
        r = post(d, text)
        assert r.status == 400, (where, r)
        assert "duplicate key" in r.json()["error"], (where, r)
    assert post(d, dtypes_body(), PROBE).status == 200


def _infer_stub(d):
    channel = grpc.insecure_channel(
        d.grpc_url,
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    )
    call = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=None,
        response_deserializer=None,
    )
    return channel, call


def _grpc_code(call, payload: bytes) -> tuple[grpc.StatusCode, str]:
    try:
        call(payload, metadata=[("authorization", f"Bearer {ATTACKER}")], timeout=60)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _pb2():
    from tritonclient.grpc import service_pb2

    return service_pb2


def test_grpc_model_infer_decode_is_bounded(daemon):
    pb = _pb2()
    d = daemon(tenants=TENANTS_HERE)
    baseline = d.rss_mib()
    channel, call = _infer_stub(d)
    try:
        head = pb.ModelInferRequest(model_name="dtypes").SerializeToString()
        # 4 MiB of empty `inputs` entries (field 5, length 0): 2 Mi inputs. prost made each a
        # whole InferInputTensor (about 620 MiB); the wire check stops at the 1025th.
        payload = head + b"\x2a\x00" * (2 * MIB)
        (code, details), cost = attack_cost_mib(d, lambda: _grpc_code(call, payload))
        limit = GRPC_MULTIPLE * len(payload) / MIB + SLACK_MIB
        assert cost <= limit, f"{len(payload) / MIB:.0f} MiB of inputs cost {cost:.0f} MiB (limit {limit:.0f})"
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "more than 1024 inputs" in details, details

        # The same for outputs, raw_input_contents and parameters (4 KiB each).
        for field, what in [(b"\x32\x00", "outputs"), (b"\x3a\x00", "raw_input_contents"), (b"\x22\x00", "parameters")]:
            code, details = _grpc_code(call, head + field * 1025)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
            assert what in details, (what, details)

        # Typed BYTES contents of 1 Mi empty strings (2 MiB on the wire, 24 MiB decoded).
        contents = pb.InferTensorContents(bytes_contents=[b""] * MIB)
        req = pb.ModelInferRequest(model_name="dtypes")
        t = req.inputs.add(name="INPUT_BYTES", datatype="BYTES", shape=[1, MIB])
        t.contents.CopyFrom(contents)
        (code, details), cost = attack_cost_mib(d, lambda: _grpc_code(call, req.SerializeToString()))
        assert cost <= GRPC_MULTIPLE * 2 + SLACK_MIB, f"2 MiB of typed BYTES cost {cost:.0f} MiB"
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "typed contents" in details, details

        # A broken message is refused, not decoded.
        code, details = _grpc_code(call, head + b"\x2a\x05\x00")
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    finally:
        channel.close()
    assert post(d, dtypes_body(), PROBE).status == 200
    rss = settle_rss(d, baseline)
    assert rss <= baseline + 64, f"RSS {rss:.0f} MiB after the attack, baseline {baseline:.0f} MiB"
