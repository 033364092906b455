"""What a client sends costs the daemon's log (and its answers) a bounded number of bytes
(issue 51, item 3; docs/SECURITY.md, "Logs"):

- every client-controlled field is cut to 128 bytes with a marker (`…[+N bytes]`) before it
  is logged (`tpubox_core::logsafe::clip`), so a 1 MiB model name, label or path adds a few
  hundred bytes to the log, not 1 MiB (was: 1,048,685 bytes for one load request);
- error answers that echo a name (Triton's `Request for unknown model: 'X' is not found`) cut
  it the same way, so an echo is not a bandwidth amplifier;
- refusals a peer can repeat (bad tokens, connections over a cap) are logged at most a few
  times and then once a second per peer and kind, with `suppressed K similar messages from
  PEER` for the rest.
"""

from __future__ import annotations

import http.client
import re
import time

import grpc

from hardening_util import OPS, PROBE, bearer, request

MIB = 1 << 20
HUGE = "n" * MIB
# What one request may add to the log: one line with its timestamp, level, target, fields and
# a name of 128 bytes plus its marker.
PER_REQUEST = 500
# What an error answer that echoes a name may weigh.
ANSWER = 1024
OPTS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def _grown(d, before: int, wait: float = 0.3) -> int:
    time.sleep(wait)
    return d.log_path.stat().st_size - before


def _rpc(channel, path, payload: bytes, token: str):
    call = channel.unary_unary(path)
    try:
        call(payload, metadata=(("authorization", f"Bearer {token}"),), timeout=60)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _string_field(number: int, value: str) -> bytes:
    data = value.encode()
    out = bytearray([(number << 3) | 2])
    n = len(data)
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + data


def _request(d, method, path, body, headers):
    """`request`, or None when the daemon closes the connection (a head over its cap)."""
    try:
        return request(d, method, path, body, headers)
    except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
        return None


def test_a_huge_name_costs_the_log_a_bounded_line(daemon):
    import tpubox

    d = daemon()
    growth: dict[str, int] = {}
    answers: dict[str, int] = {}

    # REST: the longest path the door reads (its head is capped at 64 KiB) and a 1 MiB one
    # (refused by the head cap before any handler).
    for size in (60 << 10, MIB):
        name = "n" * size
        for op in ("load", "unload"):
            before = d.log_path.stat().st_size
            r = _request(d, "POST", f"/v2/repository/models/{name}/{op}", {}, bearer(OPS))
            growth[f"rest {op} {size >> 10} KiB"] = _grown(d, before)
            answers[f"rest {op} {size >> 10} KiB"] = len(r.body) if r else 0
        before = d.log_path.stat().st_size
        r = _request(d, "POST", f"/v2/models/{name}/infer", {"inputs": []}, bearer(PROBE))
        growth[f"rest infer {size >> 10} KiB"] = _grown(d, before)
        answers[f"rest infer {size >> 10} KiB"] = len(r.body) if r else 0
        if size < MIB:
            assert r.status == 400 and "is not found" in r.json()["error"], r
    # REST: a 60 KiB bad token (logged as a refusal, with the path).
    before = d.log_path.stat().st_size
    r = request(d, "GET", "/v2/models/" + "p" * (30 << 10), None, bearer("t" * (30 << 10)))
    assert r.status == 401, r
    growth["rest bad token 30 KiB"] = _grown(d, before)

    # gRPC: 1 MiB model names in messages, on the repository calls (logged) and inference calls
    # (echoed in NOT_FOUND).
    with grpc.insecure_channel(d.grpc_url, options=OPTS) as ch:
        svc = "/inference.GRPCInferenceService/"
        for method, token in (
            ("RepositoryModelLoad", OPS),
            ("RepositoryModelUnload", OPS),
            ("ModelMetadata", PROBE),
            ("ModelInfer", PROBE),
        ):
            # RepositoryModel*: model_name is field 2 (field 1 the repository name);
            # ModelMetadata and ModelInfer: field 1.
            field = 2 if method.startswith("Repository") else 1
            before = d.log_path.stat().st_size
            code, details = _rpc(ch, svc + method, _string_field(field, HUGE), token)
            growth[f"grpc {method}"] = _grown(d, before)
            answers[f"grpc {method}"] = len(details)
            assert code != grpc.StatusCode.OK, method

    # The session API: a 1 MiB label (logged when the session opens) and a 1 MiB bad token.
    before = d.log_path.stat().st_size
    with tpubox.connect(f"unix:{d.socket_path}", PROBE, label=HUGE) as s:
        s.info()
    growth["session label"] = _grown(d, before)
    before = d.log_path.stat().st_size
    with grpc.insecure_channel(d.session_tcp, options=OPTS) as ch:
        code, _ = _rpc(ch, "/tpubox.v1.Session/Open", b"", "t" * (60 << 10))
        assert code == grpc.StatusCode.UNAUTHENTICATED, code
    growth["session bad token 60 KiB"] = _grown(d, before)

    print("log bytes per request:", growth)
    print("answer bytes:", answers)
    over = {k: v for k, v in growth.items() if v > PER_REQUEST}
    assert not over, f"requests that grew the log by more than {PER_REQUEST} bytes: {over}"
    big = {k: v for k, v in answers.items() if v > ANSWER}
    assert not big, f"answers over {ANSWER} bytes: {big}"
    log = d.log()
    assert "…[+" in log, log[-2000:]
    # Still serving.
    assert request(d, "GET", "/v2/health/ready").status == 200


def test_bad_tokens_from_one_peer_cost_a_few_lines(daemon):
    d = daemon()
    before = len(d.log().splitlines())
    conn = http.client.HTTPConnection(d.host, d.http_port, timeout=30)
    refused = 0
    try:
        for i in range(1000):
            conn.request("GET", "/v2/models/dtypes", headers=bearer(f"bad-token-{i}"))
            r = conn.getresponse()
            r.read()
            refused += r.status == 401
    finally:
        conn.close()
    assert refused == 1000
    # The suppression line comes at the next flush (every 2 s, once the peer is quiet 1 s).
    deadline = time.monotonic() + 10
    while f"similar messages from {d.host}" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = d.log().splitlines()[before:]
    about = [ln for ln in lines if "unauthenticated" in ln]
    flushed = [ln for ln in about if f"similar messages from {d.host}" in ln]
    print(f"{len(about)} lines about 1000 bad tokens:", *about, sep="\n  ")
    # The burst (5), one a second while the flood lasts, the suppression line(s).
    assert len(about) <= 15, about
    assert flushed, about
    counted = sum(int(m) for ln in about for m in re.findall(r"suppressed (\d+) similar", ln))
    logged = len(about) - len(flushed)
    assert logged + counted >= 1000 - 20, (logged, counted)
    # A tenant from the same peer is still served.
    assert request(d, "GET", "/v2/models/dtypes", None, bearer(PROBE)).status == 200
