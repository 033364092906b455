"""A bounded load test on loopback: 20,000 requests from 32 concurrent clients, mixed models
(dtypes, minilm) and tenants (load-a, load-b), over keep-alive HTTP connections with the binary
tensor extension. Every request must succeed with exactly the right result, and the server's
resident memory must stay flat between a warm-up and the end."""

import http.client
import json
import os
import random
import struct
import threading
import time

import numpy as np

from serve_util import (
    binary_bytes,
    binary_infer_parts,
    cosine,
    dtypes_data,
    http_headers,
    load_reference,
    text_tensor,
)

REQUESTS = int(os.environ.get("TPUBOX_LOAD_REQUESTS", "20000"))
CLIENTS = 32
WARMUP = 2000
# Resident memory may grow this much between the warm-up and the end (allocator noise), MiB.
RSS_SLACK_MIB = 64


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def dtypes_payload(seed: int):
    """(path, body, header length, expected binary output) of one dtypes request."""
    shape = [(1, 5), (2, 5), (3, 4)][seed % 3]
    data = dtypes_data(shape=shape, seed=1000 + seed)
    header, chunks = binary_infer_parts(data)
    head = json.dumps(header).encode()
    expected = b"".join(binary_bytes(dt, np.flip(arr, axis=-1)) for dt, arr in data.items())
    return "/v2/models/dtypes/infer", head + b"".join(chunks), len(head), ("dtypes", expected)


def minilm_payload(case: dict):
    text = case["text"].encode()
    raw = struct.pack("<I", len(text)) + text
    header = {
        "inputs": [
            {"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}}
        ],
        "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}],
    }
    head = json.dumps(header).encode()
    return "/v2/models/minilm/infer", head + raw, len(head), ("minilm", np.array(case["embedding"]))


def check(kind, expected, body: bytes, header_len: int):
    head = json.loads(body[:header_len])
    binary = body[header_len:]
    if kind == "dtypes":
        assert binary == expected, "dtypes outputs differ from np.flip of the inputs"
        assert [o["name"] for o in head["outputs"]][0] == "OUTPUT_BOOL"
    else:
        got = np.frombuffer(binary, dtype="<f4")
        assert got.shape == (384,), got.shape
        assert cosine(got, expected) >= 0.9999


def test_load(server):
    rng = random.Random(7)
    dtypes = [dtypes_payload(i) for i in range(12)]
    minilm = [minilm_payload(c) for c in load_reference()]
    # 85% dtypes as load-a, 10% dtypes as load-b, 5% minilm as load-a.
    plan = []
    for _ in range(REQUESTS):
        r = rng.random()
        if r < 0.05:
            plan.append(("load-a", rng.choice(minilm)))
        else:
            plan.append(("load-a" if r < 0.90 else "load-b", rng.choice(dtypes)))
    next_index = iter(range(REQUESTS))
    lock = threading.Lock()
    done = [0]
    failures = []
    rss = {}
    pid = server.proc.pid

    def client():
        conn = http.client.HTTPConnection(server.host, server.http_port, timeout=120)
        try:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                tenant, (path, body, head_len, (kind, expected)) = plan[i]
                headers = {
                    **http_headers(tenant),
                    "Content-Type": "application/octet-stream",
                    "Inference-Header-Content-Length": str(head_len),
                }
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    failures.append((i, resp.status, data[:200]))
                    continue
                n = int(resp.getheader("Inference-Header-Content-Length"))
                try:
                    check(kind, expected, data, n)
                except AssertionError as e:
                    failures.append((i, "wrong result", str(e)))
                with lock:
                    done[0] += 1
                    if done[0] == WARMUP:
                        rss["warm"] = rss_mib(pid)
        finally:
            conn.close()

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    rss["end"] = rss_mib(pid)
    print(
        f"\nload: {REQUESTS} requests from {CLIENTS} clients in {elapsed:.1f} s "
        f"({REQUESTS / elapsed:.0f}/s); RSS {rss.get('warm', 0):.0f} MiB after {WARMUP}, "
        f"{rss['end']:.0f} MiB at the end"
    )
    assert not failures, f"{len(failures)} requests failed, first: {failures[:3]}"
    assert done[0] == REQUESTS
    assert rss["end"] - rss["warm"] < RSS_SLACK_MIB, rss
