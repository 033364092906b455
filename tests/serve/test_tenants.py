"""Tenants at the door (--tokens): 401 without a known token, a model the tenant may not call
answered as one that does not exist (400, gRPC NOT_FOUND), 429 over its rate or in-flight limit
while the other tenants are served; the gRPC codes."""

import threading
import time

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from serve_util import (
    assert_error,
    assert_flipped,
    dtypes_data,
    grpc_client,
    grpc_headers,
    grpc_inputs,
    grpc_status,
    http_client,
    http_headers,
    http_inputs,
    json_infer_body,
    request,
    text_tensor,
)

INFER = "/v2/models/dtypes/infer"
T = 120


def _dtypes(server, headers, seed=40):
    return request(server, "POST", INFER, json_infer_body(dtypes_data(seed=seed)), headers=headers)


def _minilm_body(texts):
    return {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}


def test_no_token(server):
    assert_error(_dtypes(server, {}), 401)
    assert_error(request(server, "GET", "/v2/models/dtypes", headers={}), 401)
    assert_error(request(server, "GET", "/v2", headers={}), 401)
    # Health needs none.
    assert request(server, "GET", "/v2/health/live").status == 200
    assert request(server, "GET", "/v2/health/ready").status == 200


def test_wrong_token(server):
    assert_error(_dtypes(server, http_headers(token="mallory-token")), 401)
    assert_error(_dtypes(server, {"Authorization": "alice-token"}), 401)  # no "Bearer"
    assert_error(_dtypes(server, {"Authorization": "Basic YWxpY2U6YWxpY2U="}), 401)


def test_model_not_allowed(server):
    """bob may call only dtypes: minilm answers him exactly as a model that does not exist."""
    body = _minilm_body(["hello"])
    forbidden = request(server, "POST", "/v2/models/minilm/infer", body, headers=http_headers("bob"))
    missing = request(server, "POST", "/v2/models/nosuch/infer", body, headers=http_headers("alice"))
    assert_error(forbidden, 400)
    assert forbidden.json() == {"error": "Request for unknown model: 'minilm' is not found"}, forbidden
    assert missing.json() == {"error": "Request for unknown model: 'nosuch' is not found"}, missing
    for path in ("/v2/models/{}", "/v2/models/{}/ready", "/v2/models/{}/config", "/v2/models/{}/stats"):
        forbidden = request(server, "GET", path.format("minilm"), headers=http_headers("bob"))
        missing = request(server, "GET", path.format("nosuch"), headers=http_headers("alice"))
        assert (forbidden.status, forbidden.json()) == (400, {"error": "Request for unknown model: 'minilm' is not found"}), (path, forbidden)
        assert (missing.status, missing.json()) == (400, {"error": "Request for unknown model: 'nosuch' is not found"}), (path, missing)
    resp = _dtypes(server, http_headers("bob"))
    assert resp.status == 200, resp


def test_http_client_statuses(http):
    data = dtypes_data(seed=41)
    for headers, status in ((None, "401"), (http_headers(token="nope"), "401")):
        with pytest.raises(InferenceServerException) as e:
            http.infer("dtypes", http_inputs(data, binary=True), headers=headers)
        assert e.value.status() == status
    with pytest.raises(InferenceServerException) as e:
        inp = httpclient.InferInput("text", [1], "BYTES")
        inp.set_data_from_numpy(text_tensor(["hello"]))
        http.infer("minilm", [inp], headers=http_headers("bob"))
    assert e.value.status() == "400"
    assert_flipped(http.infer("dtypes", http_inputs(data, binary=True), headers=http_headers("bob")).as_numpy, data)


def test_grpc_statuses(grpc):
    data = dtypes_data(seed=42)
    for headers in (None, grpc_headers(token="nope"), {"authorization": "alice-token"}):
        with pytest.raises(InferenceServerException) as e:
            grpc.infer("dtypes", grpc_inputs(data), headers=headers, client_timeout=T)
        assert grpc_status(e.value) == "UNAUTHENTICATED", e.value
    with pytest.raises(InferenceServerException) as e:
        grpc.get_model_metadata("dtypes", client_timeout=T)
    assert grpc_status(e.value) == "UNAUTHENTICATED", e.value

    inp = grpcclient.InferInput("text", [1], "BYTES")
    inp.set_data_from_numpy(text_tensor(["hello"]))
    with pytest.raises(InferenceServerException) as e:
        grpc.infer("minilm", [inp], headers=grpc_headers("bob"), client_timeout=T)
    assert grpc_status(e.value) == "NOT_FOUND", e.value
    assert "Request for unknown model: 'minilm' is not found" in str(e.value), e.value

    result = grpc.infer("dtypes", grpc_inputs(data), headers=grpc_headers("bob"), client_timeout=T)
    assert_flipped(result.as_numpy, data)
    assert grpc.is_server_live(client_timeout=T)  # health needs no token


def test_rate_limit(server):
    """`slow` (2 requests/s, burst 2) sends 10 requests back to back: some are refused with 429,
    while alice, sending at the same time, is always served."""
    alice_results = []
    stop = threading.Event()

    def alice():
        i = 0
        while not stop.is_set() and i < 50:
            alice_results.append(_dtypes(server, http_headers("alice"), seed=43).status)
            i += 1

    t = threading.Thread(target=alice)
    t.start()
    try:
        slow = [_dtypes(server, http_headers("slow"), seed=44) for _ in range(10)]
    finally:
        stop.set()
        t.join()
    refused = [r for r in slow if r.status == 429]
    assert refused, f"no 429 among {[r.status for r in slow]}"
    for r in refused:
        assert_error(r, 429)
    assert all(r.status in (200, 429) for r in slow), [r.status for r in slow]
    assert alice_results and all(s == 200 for s in alice_results), alice_results

    # The bucket refills: a second later slow is served again.
    time.sleep(1.1)
    resp = _dtypes(server, http_headers("slow"), seed=45)
    assert resp.status == 200, resp


def test_rate_limit_grpc(server):
    client = grpc_client(server)
    try:
        data = dtypes_data(seed=46)
        codes = []
        for _ in range(10):
            try:
                client.infer("dtypes", grpc_inputs(data), headers=grpc_headers("slow"), client_timeout=T)
                codes.append("OK")
            except InferenceServerException as e:
                codes.append(grpc_status(e))
        assert "RESOURCE_EXHAUSTED" in codes, codes
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    finally:
        client.close()


def test_in_flight_limit(server, model_configs, reference):
    """`narrow` (max_in_flight 1) sends 4 MiniLM requests at once: at least one is refused with
    429, the others are served; alice, meanwhile, is served."""
    longest = max(reference, key=lambda c: len(c["input_ids"]))["text"]
    per_request = max(1, min(16, model_configs["minilm"].get("max_batch_size", 0) or 16))
    body = _minilm_body([longest] * per_request)
    statuses = []
    for _attempt in range(3):
        barrier = threading.Barrier(4)
        results = [None] * 4

        def send(i):
            barrier.wait()
            results[i] = request(
                server, "POST", "/v2/models/minilm/infer", body, headers=http_headers("narrow")
            )

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses += [r.status for r in results]
        for r in results:
            if r.status == 429:
                assert_error(r, 429)
            else:
                assert r.status == 200, r
        if 429 in statuses:
            break
    assert 429 in statuses, f"no 429 among {statuses}"
    assert 200 in statuses, statuses
    resp = request(server, "POST", "/v2/models/minilm/infer", _minilm_body(["still served"]),
                   headers=http_headers("alice"))  # fmt: skip
    assert resp.status == 200, resp


def test_in_flight_limit_released(server):
    """After its requests finished, narrow is served again (in-flight slots are given back,
    failures included)."""
    for seed in (47, 48, 49):
        resp = _dtypes(server, http_headers("narrow"), seed=seed)
        assert resp.status == 200, resp
    trap = json_infer_body(dtypes_data(seed=50, trap=True))
    assert_error(request(server, "POST", INFER, trap, headers=http_headers("narrow")), 500)
    resp = _dtypes(server, http_headers("narrow"), seed=51)
    assert resp.status == 200, resp


def test_http_client_429(server):
    client = http_client(server)
    try:
        data = dtypes_data(seed=52)
        statuses = []
        for _ in range(10):
            try:
                client.infer("dtypes", http_inputs(data, binary=True), headers=http_headers("slow"))
                statuses.append("200")
            except InferenceServerException as e:
                statuses.append(e.status())
        assert "429" in statuses, statuses
    finally:
        client.close()
