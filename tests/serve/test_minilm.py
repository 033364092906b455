"""MiniLM (examples/minilm-serve) served: embeddings of the reference texts (sentence-transformers,
PyTorch float32, shared/reference/minilm_public.json) over REST and gRPC, and concurrent clients
whose requests the server may batch together."""

import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from serve_util import (
    assert_embeddings,
    grpc_client,
    grpc_headers,
    http_client,
    http_headers,
    request,
    text_tensor,
)

T = 120


def chunks(cases, model_configs):
    n = model_configs["minilm"].get("max_batch_size", 0) or len(cases)
    return [cases[i : i + n] for i in range(0, len(cases), n)]


def http_embed(client, texts, binary=True):
    inp = httpclient.InferInput("text", [len(texts)], "BYTES")
    inp.set_data_from_numpy(text_tensor(texts), binary_data=binary)
    out = httpclient.InferRequestedOutput("embedding", binary_data=binary)
    result = client.infer("minilm", [inp], outputs=[out], headers=http_headers("alice"))
    return result.as_numpy("embedding")


def grpc_embed(client, texts):
    inp = grpcclient.InferInput("text", [len(texts)], "BYTES")
    inp.set_data_from_numpy(text_tensor(texts))
    result = client.infer("minilm", [inp], headers=grpc_headers("alice"), client_timeout=T)
    return result.as_numpy("embedding")


def test_reference_http_binary(http, reference, model_configs):
    for part in chunks(reference, model_configs):
        assert_embeddings(http_embed(http, [c["text"] for c in part]), part, "http binary")


def test_reference_http_json(http, reference):
    part = reference[:2]
    assert_embeddings(http_embed(http, [c["text"] for c in part], binary=False), part, "http json")


def test_reference_plain_json(server, reference):
    case = reference[0]
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [case["text"]]}]}
    resp = request(server, "POST", "/v2/models/minilm/infer", body, headers=http_headers("alice"))
    assert resp.status == 200, resp
    (out,) = resp.json()["outputs"]
    assert out["name"] == "embedding" and out["datatype"] == "FP32" and out["shape"] == [1, 384]
    assert_embeddings(np.array(out["data"], dtype=np.float32).reshape(1, 384), [case], "plain json")


def test_reference_grpc(grpc, reference, model_configs):
    for part in chunks(reference, model_configs):
        assert_embeddings(grpc_embed(grpc, [c["text"] for c in part]), part, "grpc")


def test_reference_one_by_one(grpc, reference):
    for case in reference:
        assert_embeddings(grpc_embed(grpc, [case["text"]]), [case], "grpc single")


def test_concurrent_clients(server, reference):
    """16 clients at once (half REST, half gRPC), each with 1-3 texts; every one gets its own
    texts' embeddings back. alice may have 8 requests in flight, so at most 8 are sent at a
    time; a 429 (a slot handed back a moment after its response) is retried."""
    rng = np.random.default_rng(60)
    jobs = []
    for i in range(16):
        k = int(rng.integers(1, 4))
        jobs.append([reference[int(j)] for j in rng.integers(0, len(reference), size=k)])
    barrier = threading.Barrier(16)
    slots = threading.Semaphore(8)
    errors = []
    retries = []

    def client(i):
        try:
            use_grpc = i % 2 == 1
            c = grpc_client(server) if use_grpc else http_client(server)
            try:
                texts = [case["text"] for case in jobs[i]]
                barrier.wait()
                for attempt in range(10):
                    with slots:
                        try:
                            got = grpc_embed(c, texts) if use_grpc else http_embed(c, texts)
                            break
                        except InferenceServerException as e:
                            if e.status() not in ("429", "StatusCode.RESOURCE_EXHAUSTED"):
                                raise
                            retries.append(i)
                    time.sleep(0.05 * (attempt + 1))
                else:
                    raise AssertionError(f"client {i}: refused 10 times")
                assert_embeddings(got, jobs[i], f"client {i} ({'grpc' if use_grpc else 'http'})")
            finally:
                c.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"client {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, "\n".join(errors)
    assert len(retries) <= 16, f"{len(retries)} retries on 429 with at most 8 in flight"


def test_a_bad_request_fails_alone(server, reference):
    """A blank sentence (which the guest refuses) sent at the same moment as good ones: it gets
    400, the good ones their embeddings, even when the batcher merged them (the server then
    runs the merged requests again one by one)."""
    cases = reference[:6]
    barrier = threading.Barrier(len(cases) + 1)
    results = {}

    def send(key, text):
        inp = httpclient.InferInput("text", [1], "BYTES")
        inp.set_data_from_numpy(text_tensor([text]), binary_data=True)
        c = http_client(server)
        try:
            barrier.wait()
            try:
                got = c.infer("minilm", [inp], headers=http_headers("load-a"))
                results[key] = got.as_numpy("embedding")
            except InferenceServerException as e:
                results[key] = e
        finally:
            c.close()

    threads = [threading.Thread(target=send, args=(i, c["text"])) for i, c in enumerate(cases)]
    threads.append(threading.Thread(target=send, args=("blank", "   ")))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = results["blank"]
    assert isinstance(bad, InferenceServerException) and bad.status() == "400", bad
    for i, case in enumerate(cases):
        assert not isinstance(results[i], Exception), results[i]
        assert_embeddings(results[i], [case], f"request {i} beside a bad one")
