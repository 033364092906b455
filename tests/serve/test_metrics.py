"""Prometheus metrics (--metrics-port, GET /metrics) with Triton's names and labels, and tpubox's
refusal counter, checked by their growth across requests this test makes."""

from serve_util import (
    assert_error,
    dtypes_data,
    grpc_headers,
    grpc_inputs,
    http_headers,
    http_inputs,
    json_infer_body,
    metric,
    request,
    scrape,
    wait_metric,
)

D = {"model": "dtypes", "version": "1"}
T = 120

TRITON_METRICS = [
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_pending_request_count",
]


def test_names_and_labels(server, http):
    http.infer("dtypes", http_inputs(dtypes_data(seed=80), binary=True), headers=http_headers())
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["metrics"]}]}
    resp = request(server, "POST", "/v2/models/minilm/infer", body, headers=http_headers())
    assert resp.status == 200, resp
    samples = scrape(server)
    for name in TRITON_METRICS:
        for model in ("dtypes", "minilm"):
            assert any(n == name and ls.get("model") == model and ls.get("version") == "1"
                       for n, ls, _ in samples), f"no {name}{{model={model!r},version=\"1\"}}"  # fmt: skip


def test_success_and_inference_count(server, http, grpc, model_configs):
    batched = model_configs["dtypes"].get("max_batch_size", 0) > 0
    before = scrape(server)
    shapes = [(2, 5), (1, 5), (2, 5), (1, 5)]  # batch sizes 2 and 1
    for i, shape in enumerate(shapes):
        data = dtypes_data(seed=81 + i, shape=shape)
        if i % 2 == 0:
            http.infer("dtypes", http_inputs(data, binary=True), headers=http_headers())
        else:
            grpc.infer("dtypes", grpc_inputs(data), headers=grpc_headers(), client_timeout=T)
    n = len(shapes)
    items = sum(s[0] for s in shapes) if batched else n

    s0 = metric(before, "nv_inference_request_success", **D)
    assert wait_metric(server, "nv_inference_request_success", s0 + n, **D) == s0 + n
    c0 = metric(before, "nv_inference_count", **D)
    assert wait_metric(server, "nv_inference_count", c0 + items, **D) == c0 + items
    after = scrape(server)
    e0, e1 = (metric(m, "nv_inference_exec_count", **D) for m in (before, after))
    assert e0 + 1 <= e1 <= e0 + n
    assert metric(after, "nv_inference_request_failure", **D) == metric(
        before, "nv_inference_request_failure", **D
    )
    assert metric(after, "nv_inference_request_duration_us", **D) > metric(
        before, "nv_inference_request_duration_us", **D
    )
    for name in ("nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us"):
        assert metric(after, name, **D) >= metric(before, name, **D), name
    assert metric(after, "nv_inference_pending_request_count", **D) == 0


def test_failure_counted(server):
    before = scrape(server)
    trap = json_infer_body(dtypes_data(seed=85, trap=True))
    assert_error(request(server, "POST", "/v2/models/dtypes/infer", trap, headers=http_headers()), 500)
    f0 = metric(before, "nv_inference_request_failure", **D)
    assert wait_metric(server, "nv_inference_request_failure", f0 + 1, **D) == f0 + 1
    after = scrape(server)
    assert metric(after, "nv_inference_request_success", **D) == metric(
        before, "nv_inference_request_success", **D
    )


def test_refusals_counted(server):
    before = scrape(server)
    body = json_infer_body(dtypes_data(seed=86))
    statuses = [
        request(server, "POST", "/v2/models/dtypes/infer", body, headers=http_headers("slow")).status
        for _ in range(10)
    ]
    refused = statuses.count(429)
    assert refused > 0, statuses
    r0 = metric(before, "tpubox_refused_requests_total", tenant="slow")
    got = wait_metric(server, "tpubox_refused_requests_total", r0 + refused, tenant="slow")
    assert got == r0 + refused, f"{refused} refused, counter grew by {got - r0}"
    samples = [ls for n, ls, _ in scrape(server) if n == "tpubox_refused_requests_total"]
    assert all(ls.get("limit") for ls in samples if ls.get("tenant") == "slow"), samples
    # Requests refused at the door never reached the model: not failures of dtypes.
    assert metric(scrape(server), "nv_inference_request_failure", **D) == metric(
        before, "nv_inference_request_failure", **D
    )



def test_metrics_need_a_metrics_tenant(server):
    """With a tokens file, /metrics (every model's and tenant's name) answers only a tenant with
    `metrics = true` (alice): 401 without a known token, 403 for bob."""
    import http.client

    def get(headers):
        conn = http.client.HTTPConnection(server.host, server.metrics_port, timeout=30)
        try:
            conn.request("GET", "/metrics", headers=headers)
            r = conn.getresponse()
            return r.status, r.read().decode()
        finally:
            conn.close()

    for headers in ({}, http_headers(token="mallory-token")):
        status, body = get(headers)
        assert status == 401 and "nv_inference" not in body, (status, body[:300])
    status, body = get(http_headers("bob"))
    assert status == 403 and "nv_inference" not in body, (status, body[:300])
    status, body = get(http_headers("alice"))
    assert status == 200 and "nv_inference_request_success" in body, (status, body[:300])
