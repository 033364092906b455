"""The daemon's own state under abuse (docs/SECURITY.md): concurrent reloads leave no model
instance behind, the log escapes what clients send, /metrics needs a metrics tenant's token,
and a model a tenant may not call answers exactly as one that does not exist."""

from __future__ import annotations

import http.client
import shutil
import threading
import time

import pytest

from hardening_util import (
    ATTACKER,
    OPS,
    PROBE,
    REPO,
    TENANTS,
    bearer,
    dtypes_body,
    probe_infer,
    request,
    target_dir,
)

RELOADS_AT_ONCE = 12
RELOAD_ROUNDS = 6


def model_instances(d, model: str = "dtypes") -> float | None:
    """tpubox_model_instances{model=MODEL}, None when the series is absent."""
    for line in d.metrics().splitlines():
        if line.startswith("tpubox_model_instances{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_instances(d, want: float, timeout: float = 15.0) -> float | None:
    deadline = time.monotonic() + timeout
    while True:
        got = model_instances(d)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def load(d, model: str = "dtypes", token: str = OPS, timeout: float = 120.0):
    return request(d, "POST", f"/v2/repository/models/{model}/load", {}, bearer(token), timeout=timeout)


def session_run_works(d) -> None:
    """The probe tenant opens a session and runs hello-matmul in the daemon's sandbox."""
    import tpubox

    wasm = target_dir() / "wasm32-wasip2" / "release" / "hello-matmul.wasm"
    if not wasm.is_file():
        pytest.fail(f"{wasm} is missing: cargo build --release --target wasm32-wasip2 -p hello-matmul")
    with tpubox.connect(f"unix:{d.socket_path}", PROBE, label="state probe") as s:
        r = s.run(wasm.read_bytes(), ["--scale", "2"], stdout=False, stderr=False)
        assert r.ok and r.exit_code == 0 and r.error == "", r
        assert b"result:" in r.stdout, r.stdout


def test_concurrent_reloads_leave_no_instance_behind(daemon):
    """Twelve concurrent loads of one model, six times over: each is served in turn, every
    replaced model's instance ends, and the instance pool (16 slots here) stays usable for
    later loads, the probe's inferences and other tenants' RunComponent."""
    d = daemon(extra_args=("--max-instances", "16"))
    statuses: list[int] = []
    lock = threading.Lock()

    def one():
        r = load(d)
        with lock:
            statuses.append(r.status if r.status == 200 else (r.status, r.body[:200]))

    for _ in range(RELOAD_ROUNDS):
        threads = [threading.Thread(target=one) for _ in range(RELOADS_AT_ONCE)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert statuses == [200] * (RELOADS_AT_ONCE * RELOAD_ROUNDS), statuses
    # The model's config has one instance: only the current version's is left.
    assert wait_instances(d, 1) == 1
    assert load(d).status == 200
    assert wait_instances(d, 1) == 1
    probe_infer(d)
    session_run_works(d)
    # An unload ends the last one.
    r = request(d, "POST", "/v2/repository/models/dtypes/unload", {}, bearer(OPS))
    assert r.status == 200, r
    assert wait_instances(d, 0) == 0
    assert load(d).status == 200
    assert wait_instances(d, 1) == 1
    probe_infer(d)


def test_reloads_and_unloads_interleaved_settle(daemon):
    """Loads and unloads of one model at once are serialised: whatever order they ran in, the
    model ends in a state one of them left, with as many instances as that state has."""
    d = daemon(extra_args=("--max-instances", "16"))
    ops = bearer(OPS)
    results: list[tuple[str, int]] = []
    lock = threading.Lock()

    def op(kind):
        r = request(d, "POST", f"/v2/repository/models/dtypes/{kind}", {}, ops, timeout=120)
        with lock:
            results.append((kind, r.status))

    threads = [threading.Thread(target=op, args=("load" if i % 3 else "unload",)) for i in range(18)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    # A load always succeeds; an unload fails with 400 only when the model was not loaded.
    assert all(s == 200 for k, s in results if k == "load"), results
    assert all(s in (200, 400) for k, s in results if k == "unload"), results
    ready = request(d, "GET", "/v2/models/dtypes/ready", headers=ops).status == 200
    assert wait_instances(d, 1 if ready else 0) == (1 if ready else 0)
    assert load(d).status == 200
    assert wait_instances(d, 1) == 1
    probe_infer(d)


# Text a client controls, with a line of its own and escape sequences for the terminal.
FORGED = "FORGED-LINE ERROR tpubox: the daemon was compromised"
EVIL_LABEL = f"kernel-7\n{FORGED}\x1b[2J\x1b]0;owned\x07\r\x9b31m"


def test_log_escapes_control_characters(daemon):
    """A session label and a model name from a REST URL (ops may name every model) reach the
    log with their control characters escaped: no raw ESC, BEL, CR or C1 byte, no line of the
    client's."""
    import tpubox

    d = daemon()
    with tpubox.connect(f"unix:{d.socket_path}", PROBE, label=EVIL_LABEL) as s:
        s.info()
    # %0a: newline, %1b: ESC, %0d: CR, %c2%9b: the C1 CSI.
    name = "x%0aFORGED-LINE%20ERROR%20model%1b%5b31m%0d%c2%9b"
    r = request(d, "POST", f"/v2/repository/models/{name}/load", {}, bearer(OPS))
    assert r.status == 400, r
    r = request(d, "POST", f"/v2/repository/models/{name}/unload", {}, bearer(OPS))
    assert r.status == 400, r
    deadline = time.monotonic() + 10
    while "unload requested" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    raw = d.log_path.read_bytes()
    for byte in (b"\x1b", b"\x07", b"\r", b"\xc2\x9b"):
        assert byte not in raw, f"raw {byte!r} in the log:\n{raw[-2000:]!r}"
    lines = raw.decode().splitlines()
    assert not [ln for ln in lines if ln.startswith("FORGED-LINE")], lines[-20:]
    opened = [ln for ln in lines if "session opened" in ln]
    assert len(opened) == 1 and "kernel-7\\n" + FORGED + "\\u{1b}[2J" in opened[0], opened
    for op in ("load", "unload"):
        requested = [ln for ln in lines if f": {op} requested" in ln]
        want = "model=x\\nFORGED-LINE ERROR model\\u{1b}[31m\\r\\u{9b} tenant=ops"
        assert len(requested) == 1 and want in requested[0], requested


def metrics_status(d, headers: dict) -> tuple[int, dict, str]:
    conn = http.client.HTTPConnection(d.host, d.metrics_port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


def test_metrics_need_a_metrics_tenant(daemon):
    """With a tokens file, /metrics (which names every model and tenant) answers only a tenant
    with `metrics = true`: 401 without a token or with an unknown one, 403 for another tenant;
    the refusals name no model and no tenant. Without a tokens file it needs none."""
    d = daemon()
    probe_infer(d)
    for headers in ({}, bearer("nobody-token"), {"Authorization": OPS}):
        status, h, body = metrics_status(d, headers)
        assert status == 401 and h.get("www-authenticate") == "Bearer", (status, body)
        assert "dtypes" not in body and "probe" not in body and "nv_" not in body, body
    for token in (PROBE, ATTACKER):
        status, _, body = metrics_status(d, bearer(token))
        assert status == 403, (status, body)
        assert "dtypes" not in body and "nv_" not in body, body
    status, _, body = metrics_status(d, bearer(OPS))
    assert status == 200 and 'nv_inference_request_success{model="dtypes",version="1"} 1' in body, body

    open_d = daemon(tenants=None)
    status, _, body = metrics_status(open_d, {})
    assert status == 200 and 'tpubox_model_instances{model="dtypes"} 1' in body, (status, body[:300])


KEEPER = "keeper-token"
STATE_TENANTS = dict(
    TENANTS,
    # Repository control over its own model only.
    keeper={"token": KEEPER, "models": ["dtypes"], "repository_control": True},
)


def add_model(d, name: str) -> None:
    """Copies the dtypes model to NAME in the repository and loads it (as ops)."""
    repo = d.root / "repo"
    shutil.copytree(repo / "dtypes", repo / name)
    r = load(d, name)
    assert r.status == 200, r


def same_answer(a, b, a_name: str, b_name: str) -> None:
    """Two REST answers are the same but for the model's name."""
    assert a.status == b.status, (a, b)
    assert a.body.replace(a_name.encode(), b"M") == b.body.replace(b_name.encode(), b"M"), (a, b)
    drop = {"date", "content-length"}
    ha = {k: v for k, v in a.headers.items() if k not in drop}
    hb = {k: v for k, v in b.headers.items() if k not in drop}
    assert ha == hb, (ha, hb)


def test_forbidden_model_answers_as_missing(daemon):
    """`secret` exists and is ready, but the attacker may call only dtypes: every endpoint that
    names a model answers the attacker for `secret` exactly as it answers for `ghost`, which
    does not exist, and as it answers the probe (allowed every model) for `ghost`; the same on
    load and unload for a tenant with repository control over dtypes only, against ops."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    d = daemon(tenants=STATE_TENANTS)
    add_model(d, "secret")
    assert request(d, "GET", "/v2/models/secret/ready", headers=bearer(PROBE)).status == 200

    body = dtypes_body()
    endpoints = [
        ("GET", "/v2/models/{}", None),
        ("GET", "/v2/models/{}/versions/1", None),
        ("GET", "/v2/models/{}/versions/2", None),
        ("GET", "/v2/models/{}/ready", None),
        ("GET", "/v2/models/{}/versions/1/ready", None),
        ("GET", "/v2/models/{}/config", None),
        ("GET", "/v2/models/{}/versions/1/config", None),
        ("GET", "/v2/models/{}/stats", None),
        ("GET", "/v2/models/{}/versions/1/stats", None),
        ("POST", "/v2/models/{}/infer", body),
        ("POST", "/v2/models/{}/versions/1/infer", body),
        ("POST", "/v2/models/{}/versions/2/infer", body),
        ("POST", "/v2/models/{}/infer", {"inputs": []}),
    ]
    for method, path, b in endpoints:
        secret = request(d, method, path.format("secret"), b, bearer(ATTACKER))
        assert secret.status == 400, (path, secret)
        for token in (ATTACKER, PROBE):
            ghost = request(d, method, path.format("ghost"), b, bearer(token))
            same_answer(secret, ghost, "secret", "ghost")
    for op in ("load", "unload"):
        secret = request(d, "POST", f"/v2/repository/models/secret/{op}", {}, bearer(KEEPER))
        assert secret.status == 400, (op, secret)
        for token in (KEEPER, OPS):
            ghost = request(d, "POST", f"/v2/repository/models/ghost/{op}", {}, bearer(token))
            same_answer(secret, ghost, "secret", "ghost")
    # The index and the statistics list only what the tenant may call.
    rows = request(d, "POST", "/v2/repository/index", {}, bearer(KEEPER)).json()
    assert [r["name"] for r in rows] == ["dtypes"], rows
    stats = request(d, "GET", "/v2/models/stats", headers=bearer(ATTACKER)).json()
    assert [m["name"] for m in stats["model_stats"]] == ["dtypes"], stats

    client = grpcclient.InferenceServerClient(d.grpc_url)
    inp = grpcclient.InferInput("INPUT_FP32", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    calls = {
        "metadata": lambda n, h: client.get_model_metadata(n, headers=h),
        "metadata v2": lambda n, h: client.get_model_metadata(n, "2", headers=h),
        "ready": lambda n, h: client.is_model_ready(n, headers=h),
        "config": lambda n, h: client.get_model_config(n, headers=h),
        "stats": lambda n, h: client.get_inference_statistics(n, headers=h),
        "infer": lambda n, h: client.infer(n, [inp], headers=h),
        "load": lambda n, h: client.load_model(n, headers=h),
        "unload": lambda n, h: client.unload_model(n, headers=h),
    }
    control = ("load", "unload")

    def answer(what, name, token):
        try:
            got = calls[what](name, {"authorization": f"Bearer {token}"})
        except InferenceServerException as e:
            return (e.status(), (e.message() or "").replace(name, "M"))
        return ("OK", repr(got))

    try:
        for what in calls:
            caller, allowed = (KEEPER, OPS) if what in control else (ATTACKER, PROBE)
            secret = answer(what, "secret", caller)
            assert secret[0] == "StatusCode.NOT_FOUND", (what, secret)
            assert answer(what, "ghost", caller) == secret, what
            assert answer(what, "ghost", allowed) == secret, what
    finally:
        client.close()
    # The model is still there for those who may call it.
    assert request(d, "GET", "/v2/models/secret/ready", headers=bearer(PROBE)).status == 200
