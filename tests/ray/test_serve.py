"""tpubox.ray.serve_model end to end: Ray Serve (its HTTP proxy on an explicit loopback port) in
front of the node's `tpubox serve`, which serves the MiniLM model (examples/minilm-serve, the
guest minilm_serve.wasm and the files `tpubox setup minilm` installs).

Three replicas, each forwarding one request at a time; concurrent clients (threads) through
Serve's proxy get the reference embeddings back, and the daemon's statistics show fewer
executions than inferences: its dynamic batcher merged requests of different replicas.

Environment: as conftest.py, plus CARGO_TARGET_DIR (the guest), TPUBOX_MINILM_DIR (default:
what `tpubox setup minilm` prints) and TPUBOX_MINILM_REFERENCE (default: shared/reference/
minilm_public.json beside the checkout, else /work/shared/...), as tests/serve.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray

import tpubox.ray
from tpubox_daemon import binary, free_ports, guest_wasm

# Setting up (MiniLM loads in the daemon, Serve starts, the first requests compile MiniLM's
# buckets) takes longer than pytest.ini's 180 s on a loaded machine.
pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
MODEL = "minilm"
REPLICAS = 3
CLIENTS = 12
ROUNDS = 4  # requests per client


def _minilm_dir() -> Path:
    env = os.environ.get("TPUBOX_MINILM_DIR")
    if env:
        return Path(env)
    out = subprocess.run(
        [str(binary()), "setup", "minilm"], capture_output=True, text=True, timeout=900
    )
    for line in out.stdout.splitlines():
        if line.startswith("minilm: "):
            return Path(line.removeprefix("minilm: ").strip())
    pytest.fail(f"`tpubox setup minilm` printed no `minilm: DIR` line:\n{out.stdout}{out.stderr}")


def _reference() -> list[dict]:
    env = os.environ.get("TPUBOX_MINILM_REFERENCE")
    path = Path(env) if env else REPO.parent / "shared" / "reference" / "minilm_public.json"
    if not env and not path.is_file():
        path = Path("/work/shared/reference/minilm_public.json")
    cases = json.loads(path.read_text())["cases"]
    assert cases, path
    return cases


def _assert_embedding(got, case, what: str):
    got = np.asarray(got, dtype=np.float64).ravel()
    want = np.asarray(case["embedding"], dtype=np.float64).ravel()
    assert got.shape == (384,), f"{what}: shape {got.shape}"
    c = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert c >= 0.9999, f"{what}: cosine {c:.6f} for {case['text']!r}"


def _request(port: int, method: str, path: str, body=None, headers=None, timeout=120.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        h = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers={**h, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _infer_body(texts: list[str]) -> dict:
    return {
        "inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
        "outputs": [{"name": "embedding"}],
    }


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    """The node actor serving a repository with MiniLM (tenant `web` may call it, `other` no
    model), and Ray Serve's proxy on 127.0.0.1:<free port>."""
    from ray import serve

    root = tmp_path_factory.mktemp("ray-serve")
    repo = root / "repo" / MODEL
    repo.mkdir(parents=True)
    shutil.copy(REPO / "examples/minilm-serve/config.toml", repo / "config.toml")
    shutil.copy(guest_wasm("minilm_serve"), repo / "model.wasm")
    (repo / "files").symlink_to(_minilm_dir().resolve(), target_is_directory=True)
    serve_port, http_port = free_ports(2)
    opts = {
        "tenants": {"web": {"models": [MODEL], "max_in_flight": 16}, "other": {"models": []}},
        "cache_dir": cluster["cache_dir"],
        "model_repository": str(root / "repo"),
        "http_port": http_port,  # explicit; the gRPC port is picked
    }
    h = tpubox.ray.node(ready_timeout=180, **opts)
    serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
    try:
        app = tpubox.ray.serve_model(MODEL, tenant="web", num_replicas=REPLICAS)
        serve.run(app, name=MODEL, route_prefix=f"/{MODEL}")
        yield {"node": h, "serve_port": serve_port, "http_port": http_port, "opts": opts}
    finally:
        serve.shutdown()


def test_node_serves_the_repository(served):
    h = served["node"]
    info = ray.get(h.info.remote())
    doors = ray.get(h.inference_address.remote())
    assert doors["http"] == f"127.0.0.1:{served['http_port']}" == info["http"], (doors, info)
    assert doors["grpc"].startswith("127.0.0.1:") and doors["grpc"] == info["grpc"], doors
    assert info["model_repository"] == served["opts"]["model_repository"]
    port = served["http_port"]
    assert _request(port, "GET", "/v2/health/ready")[0] == 200
    web = ray.get(h.token.remote("web"))
    other = ray.get(h.token.remote("other"))
    # The tokens file's `models`: web may call minilm; other may not (400, as an unknown model).
    assert _request(port, "GET", f"/v2/models/{MODEL}", headers={"Authorization": f"Bearer {web}"})[0] == 200
    st, _, body = _request(
        port, "GET", f"/v2/models/{MODEL}", headers={"Authorization": f"Bearer {other}"}
    )
    assert st == 400 and b"unknown model" in body, (st, body)
    assert _request(port, "GET", f"/v2/models/{MODEL}")[0] == 401


def test_everything_listens_on_loopback(served):
    """The daemon's doors, Serve's proxy and controller and Ray's own processes (with ray[serve]
    installed, Ray also runs its agents) listen on loopback only; the replicas too, but for Ray
    Serve's own inter-deployment gRPC server."""
    from test_ray import is_loopback, listening

    seen = {"tpubox serve": ray.get(served["node"].info.remote())["pid"]}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            comm = open(f"/proc/{p}/comm").read().strip()
            cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ray_agent = "ray/dashboard/" in cmd or "ray/_private/runtime_env" in cmd
        if comm in ("raylet", "gcs_server") or cmd.startswith("ray::") or ray_agent:
            seen[f"{cmd[:80] or comm} ({p})"] = int(p)
    assert any("ProxyActor" in k for k in seen) and any("ServeReplica" in k for k in seen), seen
    wide = {}
    for what, pid in seen.items():
        addrs = [a for a in listening(pid) if not is_loopback(a)]
        if addrs:
            wide[what] = addrs
    # Ray Serve 2.60's replicas open an inter-deployment gRPC server on every interface
    # ("[::]:0", hard-coded in ray/serve/_private/replica.py): each replica has that one wildcard
    # listener, which tpubox cannot move (docs/RAY.md says to firewall it). Nothing else.
    for what, addrs in wide.items():
        assert "ServeReplica" in what and len(addrs) == 1 and addrs[0].startswith(":::"), wide
    assert f"127.0.0.1:{served['serve_port']}" in listening(
        next(pid for k, pid in seen.items() if "ProxyActor" in k)
    )


def _stats(served) -> tuple[int, int]:
    token = ray.get(served["node"].token.remote("web"))
    st, _, body = _request(
        served["http_port"], "GET", f"/v2/models/{MODEL}/stats",
        headers={"Authorization": f"Bearer {token}"},
    )  # fmt: skip
    assert st == 200, (st, body)
    s = json.loads(body)["model_stats"][0]
    return int(s["inference_count"]), int(s["execution_count"])


def test_replicas_batched_by_the_daemon(served):
    reference = _reference()
    port = served["serve_port"]
    # The route answers the model's metadata (and warms MiniLM's first bucket up).
    st, _, body = _request(port, "GET", f"/{MODEL}")
    assert st == 200 and json.loads(body)["name"] == MODEL, (st, body)
    st, _, body = _request(port, "POST", f"/{MODEL}", _infer_body([reference[0]["text"]]))
    assert st == 200, (st, body)
    inf0, exe0 = _stats(served)

    barrier = threading.Barrier(CLIENTS)
    errors: list[str] = []
    replicas: dict[str, int] = {}
    in_flight: set[str] = set()
    lock = threading.Lock()

    def client(i: int):
        try:
            barrier.wait()
            for r in range(ROUNDS):
                case = reference[(i * ROUNDS + r) % len(reference)]
                st, headers, body = _request(port, "POST", f"/{MODEL}", _infer_body([case["text"]]))
                assert st == 200, (st, body[:500])
                (out,) = json.loads(body)["outputs"]
                assert out["name"] == "embedding" and out["shape"] == [1, 384], out["shape"]
                _assert_embedding(out["data"], case, f"client {i} round {r}")
                with lock:
                    rep = headers["x-tpubox-replica"]
                    replicas[rep] = replicas.get(rep, 0) + 1
                    in_flight.add(headers["x-tpubox-in-flight"])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"client {i}: {type(e).__name__}: {e}")

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=170)
    elapsed = time.monotonic() - t0
    assert not errors, "\n".join(errors)
    assert sum(replicas.values()) == CLIENTS * ROUNDS
    assert len(replicas) == REPLICAS, replicas  # every replica answered
    assert in_flight == {"1"}, in_flight  # Serve gave each replica one request at a time
    inf1, exe1 = _stats(served)
    inferences, executions = inf1 - inf0, exe1 - exe0
    print(f"{CLIENTS * ROUNDS} requests in {elapsed:.2f} s: {inferences} inferences in "
          f"{executions} executions; per replica {sorted(replicas.values())}")  # fmt: skip
    assert inferences == CLIENTS * ROUNDS, (inferences, executions)
    # The daemon merged requests of different replicas (each replica sends one at a time).
    assert executions < inferences, (inferences, executions)


def test_binary_extension_passes_through(served):
    """A request with the binary tensor extension (the input as length-prefixed bytes after the
    JSON header, the output asked for in binary) goes through the replica as it is, and the
    answer's `Inference-Header-Content-Length` comes back with it."""
    case = _reference()[1]
    text = case["text"].encode()
    header = json.dumps({
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                    "parameters": {"binary_data_size": 4 + len(text)}}],
        "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}],
    }).encode()  # fmt: skip
    body = header + len(text).to_bytes(4, "little") + text
    conn = http.client.HTTPConnection("127.0.0.1", served["serve_port"], timeout=120)
    try:
        conn.request("POST", f"/{MODEL}", body=body, headers={
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        })  # fmt: skip
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, (resp.status, data[:500])
        n = int(resp.getheader("Inference-Header-Content-Length"))
    finally:
        conn.close()
    (out,) = json.loads(data[:n])["outputs"]
    assert out["shape"] == [1, 384] and out["parameters"]["binary_data_size"] == 384 * 4, out
    _assert_embedding(np.frombuffer(data[n:], dtype="<f4"), case, "binary")
