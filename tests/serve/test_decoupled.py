"""Decoupled models (several responses per request) with the real clients: the serve-decoder
example (examples/serve-decoder: a small autoregressive decoder built with the guest SDK's
graph builder, random but reproducible weights) streams one token per response over gRPC
`ModelStreamInfer` (tritonclient, sync and asyncio) and over the generate extension's
`/generate_stream` (server-sent events). Every token is checked against a numpy decoder
computed here from the same weights. Then what a hostile or careless client does: goes away
mid-stream, never reads, floods a stream with requests, asks a unary call of a decoupled model,
sends bad inputs; and more streams at once than an instance runs."""

from __future__ import annotations

import asyncio
import json
import math
import queue
import re
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "hardening"))

import hardening_util  # noqa: E402
from hardening_util import PROBE  # noqa: E402
from tpubox_daemon import target_dir  # noqa: E402

REPO = HERE.parents[1]
CONFIG = REPO / "examples/serve-decoder/config.toml"
# A second copy of the decoder with tight bounds: one stream at a time, ended after 1 s
# without a response taken.
TIGHT = """
max_batch_size = 0
[model_transaction_policy]
decoupled = true
[tpubox.decoupled]
max_generations = 1
stall_seconds = 1.0
"""

# ---------------------------------------------------------------------------------------------
# The reference decoder (examples/serve-decoder/src/lib.rs, in numpy)

VOCAB, WIDTH, WINDOW = 95, 64, 64
HIDDEN = 4 * WIDTH
MATRICES = [
    ((VOCAB, WIDTH), 1.0),
    ((WINDOW, WIDTH), 0.5),
    ((WIDTH, WIDTH), 0.5),
    ((WIDTH, WIDTH), 0.5),
    ((WIDTH, WIDTH), 0.5),
    ((WIDTH, WIDTH), 0.5),
    ((WIDTH, HIDDEN), 0.5),
    ((HIDDEN, WIDTH), 0.25),
]


def splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def weights() -> list[np.ndarray]:
    out = []
    for m, (dims, scale) in enumerate(MATRICES):
        i = np.arange(dims[0] * dims[1], dtype=np.uint64)
        u = splitmix64((np.uint64(m) << np.uint64(32)) | i).astype(np.float64) / 2.0**64
        out.append((scale * (u - 0.5)).astype(np.float32).astype(np.float64).reshape(dims))
    return out


W = weights()
_erf = np.vectorize(math.erf)


def _norm(x):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5)


def logits(context: list[int]) -> np.ndarray:
    """The decoder's next-token logits after CONTEXT (token ids), in float64."""
    e, p, wq, wk, wv, wo, w1, w2 = W
    ids = context[-WINDOW:]
    n = len(ids)
    x = e[ids] + p[:n]
    h = _norm(x)
    q, k, v = h @ wq, h @ wk, h @ wv
    s = q @ k.T / math.sqrt(WIDTH)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    x = x + (s @ v) @ wo
    u = _norm(x) @ w1
    x = x + (0.5 * u * (1 + _erf(u / math.sqrt(2)))) @ w2
    return _norm(x[n - 1]) @ e.T


def token_of(b: int) -> int:
    return (b if 32 <= b < 127 else ord("?")) - 32


def check_tokens(prompt: str, tokens: list[int]):
    """Each streamed token is the decoder's choice after the prompt and the tokens before it
    (teacher-forced: a near tie between two logits may go either way in float32)."""
    context = [token_of(b) for b in prompt.encode()]
    exact = 0
    for i, t in enumerate(tokens):
        lg = logits(context)
        best = int(np.argmax(lg))
        assert lg[t] >= lg[best] - 1e-3, (
            f"token {i} of {prompt!r}: the server chose {t} (logit {lg[t]:.5f}), "
            f"the reference {best} ({lg[best]:.5f})"
        )
        exact += t == best
        context.append(t)
    assert exact >= len(tokens) - max(1, len(tokens) // 20), (exact, len(tokens))


def reference_tokens(prompt: str, n: int) -> list[int]:
    context = [token_of(b) for b in prompt.encode()]
    out = []
    for _ in range(n):
        t = int(np.argmax(logits(context)))
        out.append(t)
        context.append(t)
    return out


# ---------------------------------------------------------------------------------------------
# The daemon


class DecoderDaemon(hardening_util.Daemon):
    """The adversarial tests' daemon with the decoder in its repository, twice: `decoder`
    (its example configuration) and `decoder_tight` (one stream at a time, 1 s stall limit)."""

    def _repo(self) -> Path:
        repo = super()._repo()
        wasm = target_dir() / "wasm32-wasip2" / "release" / "serve_decoder.wasm"
        if not wasm.is_file():
            raise FileNotFoundError(
                f"{wasm} is missing: cargo build --release --target wasm32-wasip2 -p serve-decoder"
            )
        for name, config in (("decoder", CONFIG.read_text()), ("decoder_tight", TIGHT)):
            (repo / name).mkdir(exist_ok=True)
            (repo / name / "config.toml").write_text(config)
            shutil.copy(wasm, repo / name / "model.wasm")
        return repo


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    daemon = DecoderDaemon(tmp_path_factory.mktemp("decoupled")).start()
    yield daemon
    alive = daemon.proc.poll() is None
    daemon.stop()
    assert alive, daemon.log()[-3000:]


def gh(token=PROBE):
    return {"authorization": f"Bearer {token}"}


def hh(token=PROBE):
    return {"Authorization": f"Bearer {token}"}


def counter(d, name: str, **labels) -> float:
    """The value of metric NAME with LABELS (0 when absent)."""
    total = 0.0
    for line in d.metrics().splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def grpc_inputs(prompt: str, max_tokens: int):
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    n = grpcclient.InferInput("max_tokens", [1], "INT32")
    n.set_data_from_numpy(np.array([max_tokens], np.int32))
    return [t, n]


def final_flag(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


class Stream:
    """A tritonclient gRPC stream whose callback puts (result, error) on a queue."""

    def __init__(self, d, token=PROBE):
        self.q: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(d.grpc_url)
        self.client.start_stream(
            callback=lambda result, error: self.q.put((result, error)), headers=gh(token)
        )

    def send(self, prompt: str, max_tokens: int, model="decoder", request_id=""):
        self.client.async_stream_infer(
            model,
            grpc_inputs(prompt, max_tokens),
            request_id=request_id,
            enable_empty_final_response=True,
        )

    def take(self, timeout=60.0):
        return self.q.get(timeout=timeout)

    def collect(self, timeout=60.0) -> tuple[list[int], str, list]:
        """One request's responses up to its empty final one: token ids, text, results."""
        ids, text, results = [], "", []
        while True:
            r, e = self.take(timeout)
            assert e is None, e
            results.append(r)
            if final_flag(r):
                assert r.get_response().outputs == [], "the final response is empty"
                return ids, text, results
            ids.append(int(r.as_numpy("token_id")[0]))
            text += r.as_numpy("text_output")[0].decode()

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def sse(d, model: str, body: dict, token=PROBE, timeout=60.0):
    """POST MODEL's generate_stream with BODY; the open socket and a reader of its events."""
    conn = d.connection(d.http_port, timeout=timeout)
    conn.request(
        "POST",
        f"/v2/models/{model}/generate_stream",
        body=json.dumps(body),
        headers={**hh(token), "Content-Type": "application/json"},
    )
    resp = conn.getresponse()

    def events():
        buf = b""
        while True:
            line = resp.readline()
            if not line:
                return
            if line in (b"\n", b"\r\n"):
                if buf:
                    yield json.loads(buf)
                buf = b""
            elif line.startswith(b"data: "):
                buf += line[6:].rstrip(b"\r\n")

    return conn, resp, events()


# ---------------------------------------------------------------------------------------------
# Streams that work


def test_grpc_stream_sends_each_token_then_an_empty_final_response(d):
    s = Stream(d)
    try:
        for prompt, n in (("Hello, tpubox", 24), ("x", 5), ("A longer prompt " * 6, 12)):
            s.send(prompt, n, request_id=f"r{n}")
            ids, text, results = s.collect()
            assert len(ids) == n
            assert text == "".join(chr(32 + t) for t in ids)
            assert all(not final_flag(r) for r in results[:-1])
            assert all(r.get_response().id == f"r{n}" for r in results)
            check_tokens(prompt, ids)
        # Zero tokens: only the final response.
        s.send("nothing", 0)
        ids, _, results = s.collect()
        assert ids == [] and len(results) == 1
    finally:
        s.close()


def test_asyncio_stream_two_requests_in_order(d):
    async def run():
        client = grpcaio.InferenceServerClient(d.grpc_url)

        async def requests():
            for i, (prompt, n) in enumerate((("first", 6), ("second", 4))):
                t = grpcaio.InferInput("text_input", [1], "BYTES")
                t.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
                m = grpcaio.InferInput("max_tokens", [1], "INT32")
                m.set_data_from_numpy(np.array([n], np.int32))
                # The asyncio client has no enable_empty_final_response: the stream's end is
                # known by count.
                yield {"model_name": "decoder", "inputs": [t, m], "request_id": str(i)}

        got: dict[str, list[int]] = {"0": [], "1": []}
        flags, order = [], []
        try:
            async for result, error in client.stream_infer(requests(), headers=gh()):
                assert error is None, error
                flags.append(final_flag(result))
                order.append(result.get_response().id)
                got[result.get_response().id].append(int(result.as_numpy("token_id")[0]))
                if len(flags) == 10:
                    break
        finally:
            await client.close()
        assert order == ["0"] * 6 + ["1"] * 4, order
        return got, flags

    got, flags = asyncio.run(run())
    assert not any(flags), "no response but an empty one is final"
    assert len(got["0"]) == 6 and len(got["1"]) == 4
    check_tokens("first", got["0"])
    check_tokens("second", got["1"])


def test_generate_stream_server_sent_events_and_generate(d):
    conn, resp, events = sse(d, "decoder", {"text_input": "Stream me", "max_tokens": 16, "id": "g1"})
    try:
        assert resp.status == 200
        assert resp.getheader("Content-Type") == "text/event-stream"
        got = list(events)
    finally:
        conn.close()
    assert len(got) == 16
    assert all(e["model_name"] == "decoder" and e["id"] == "g1" for e in got)
    ids = [e["token_id"] for e in got]
    assert "".join(e["text_output"] for e in got) == "".join(chr(32 + t) for t in ids)
    check_tokens("Stream me", ids)
    # Plain generate: a decoupled model must answer exactly once.
    r = hardening_util.request(
        d, "POST", "/v2/models/decoder/generate", {"text_input": "one", "max_tokens": 1}, headers=hh()
    )
    assert r.status == 200, r
    check_tokens("one", [r.json()["token_id"]])
    r = hardening_util.request(
        d, "POST", "/v2/models/decoder/generate", {"text_input": "two", "max_tokens": 2}, headers=hh()
    )
    assert r.status == 400 and "more than one response" in r.json()["error"], r


def test_the_first_token_arrives_before_the_decoder_has_finished(d):
    before = counter(d, "tpubox_stream_responses_total", model="decoder")
    conn, resp, events = sse(d, "decoder", {"text_input": "first!", "max_tokens": 3000})
    try:
        first = next(events)
        done = counter(d, "tpubox_stream_responses_total", model="decoder") - before
        assert "token_id" in first
        assert done < 3000, f"the decoder had computed all {done} tokens before the first arrived"
        rest = sum(1 for _ in events)
    finally:
        conn.close()
    assert rest == 2999


def test_unary_calls_to_a_decoupled_model_are_refused_in_tritons_words(d):
    h = httpclient.InferenceServerClient(f"{d.host}:{d.http_port}")
    inputs = []
    for name, dt, arr in (
        ("text_input", "BYTES", np.array([b"hi"], dtype=np.object_)),
        ("max_tokens", "INT32", np.array([3], np.int32)),
    ):
        i = httpclient.InferInput(name, [1], dt)
        i.set_data_from_numpy(arr)
        inputs.append(i)
    with pytest.raises(InferenceServerException) as e:
        h.infer("decoder", inputs, headers=hh())
    assert "HTTP end point doesn't support models with decoupled transaction policy" in str(e.value)
    r = hardening_util.request(
        d,
        "POST",
        "/v2/models/decoder/infer",
        {"inputs": [{"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [1]},
                    {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
        headers=hh(),
    )
    assert r.status == 501, r
    g = grpcclient.InferenceServerClient(d.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        g.infer("decoder", grpc_inputs("hi", 3), headers=gh())
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in str(e.value)
    assert "UNIMPLEMENTED" in str(e.value.status())
    cfg = h.get_model_config("decoder", headers=hh())
    assert cfg["model_transaction_policy"] == {"decoupled": True}
    cfg = g.get_model_config("decoder", headers=gh(), as_json=True)["config"]
    assert cfg["model_transaction_policy"] == {"decoupled": True}


def test_more_streams_than_an_instance_runs_each_keep_their_own_state(d):
    """12 concurrent SSE clients on one instance that runs 8 streams at a time: every stream's
    tokens are its own prompt's."""
    prompts = [f"client {i}: {'ab' * i}" for i in range(12)]
    results: dict[int, list[int]] = {}
    errors: list[str] = []

    def run(i):
        try:
            conn, resp, events = sse(d, "decoder", {"text_input": prompts[i], "max_tokens": 20})
            results[i] = [e["token_id"] for e in events]
            conn.close()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i, p in enumerate(prompts):
        assert len(results[i]) == 20
        check_tokens(p, results[i])


# ---------------------------------------------------------------------------------------------
# Hostile and careless clients


def wait_for(pred, timeout=15.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def cancelled_and_stopped(d, gone: float, at_close: float) -> float:
    """Waits for the decoder's stream to be cancelled (the count of client-gone cancels past
    GONE) and for its responses to stop; the responses computed after AT_CLOSE."""
    wait_for(
        lambda: counter(d, "tpubox_streams_cancelled_total", model="decoder", reason="client gone") > gone,
        what="the stream's cancellation",
    )
    after = counter(d, "tpubox_stream_responses_total", model="decoder")
    time.sleep(0.5)
    assert counter(d, "tpubox_stream_responses_total", model="decoder") == after, "still decoding"
    return after - at_close


def test_an_sse_client_that_goes_away_stops_the_decoder_within_a_few_tokens(d):
    gone = counter(d, "tpubox_streams_cancelled_total", model="decoder", reason="client gone")
    conn, resp, events = sse(d, "decoder", {"text_input": "bye", "max_tokens": 1_000_000})
    for _ in range(3):
        next(events)
    at_close = counter(d, "tpubox_stream_responses_total", model="decoder")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    extra = cancelled_and_stopped(d, gone, at_close)
    assert extra <= 16, f"{extra} tokens computed after the client closed"


def test_a_grpc_client_that_cancels_mid_stream_stops_the_decoder(d):
    gone = counter(d, "tpubox_streams_cancelled_total", model="decoder", reason="client gone")
    s = Stream(d)
    s.send("cancel me", 1_000_000)
    for _ in range(3):
        r, e = s.take()
        assert e is None
    at_close = counter(d, "tpubox_stream_responses_total", model="decoder")
    s.close(cancel=True)
    extra = cancelled_and_stopped(d, gone, at_close)
    # gRPC: HTTP/2 windows hold responses the client has not read (64 KiB by default).
    assert extra <= 2048, f"{extra} tokens computed after the cancel"


def test_a_generate_client_that_never_reads_is_held_back_then_ended(d):
    """A client that sends a generate_stream request and never reads: the decoder stops when
    the connection's buffers are full (back-pressure), the stream is ended after
    stall_seconds, and the instance's only stream slot serves the next client."""
    model = "decoder_tight"
    stalled = counter(d, "tpubox_streams_cancelled_total", model=model, reason="stalled")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((d.host, d.http_port))
    body = json.dumps({"text_input": "never read", "max_tokens": 1_000_000}).encode()
    sock.sendall(
        f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {PROBE}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    try:
        wait_for(
            lambda: counter(d, "tpubox_streams_cancelled_total", model=model, reason="stalled") > stalled,
            timeout=60,
            what="the stalled stream to be ended",
        )
        made = counter(d, "tpubox_stream_responses_total", model=model)
        assert made < 1_000_000
        # The slot is free: another client streams to the end.
        conn, resp, events = sse(d, model, {"text_input": "next", "max_tokens": 8})
        ids = [e["token_id"] for e in events]
        conn.close()
        check_tokens("next", ids)
        assert len(ids) == 8
    finally:
        sock.close()


def test_a_stream_flooded_with_requests_answers_them_in_order(d):
    s = Stream(d)
    try:
        n = 100
        for i in range(n):
            s.send(f"flood {i % 7}", 2, request_id=str(i))
        for i in range(n):
            ids, _, results = s.collect()
            assert {r.get_response().id for r in results} == {str(i)}
            assert len(ids) == 2
            check_tokens(f"flood {i % 7}", ids)
    finally:
        s.close()


def test_bad_requests_fail_alone_and_the_stream_goes_on(d):
    s = Stream(d)
    try:
        s.send("x", -1)
        r, e = s.take()
        assert e is not None and "max_tokens is -1" in str(e)
        s.send("", 3)
        r, e = s.take()
        assert e is not None and "text_input is empty" in str(e)
        s.send("fine", 3)
        ids, _, _ = s.collect()
        check_tokens("fine", ids)
    finally:
        s.close()
    # A plain model over generate_stream: one event.
    r = hardening_util.request(
        d, "POST", "/v2/models/decoder/generate_stream", {"text_input": "x", "max_tokens": "two"}, headers=hh()
    )
    assert r.status == 400, r


def test_the_statistics_count_streams(d):
    h = httpclient.InferenceServerClient(f"{d.host}:{d.http_port}")
    stats = h.get_inference_statistics("decoder", headers=hh())["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] > 0
    assert re.fullmatch(r"\d+", str(stats["execution_count"]))


def test_streams_need_a_token_like_every_call(d):
    r = hardening_util.request(
        d, "POST", "/v2/models/decoder/generate_stream", {"text_input": "x", "max_tokens": 1}
    )
    assert r.status == 401, r
    # gRPC: the whole stream is refused before any request is read.
    s = Stream(d, token="not-a-token")
    try:
        try:
            s.send("x", 1)
        except InferenceServerException:
            pass  # the stream already failed: the error went to the callback
        r, e = s.take(timeout=10)
        assert r is None and e is not None, (r, e)
        assert "UNAUTHENTICATED" in str(e.status()) or "unauthenticated" in str(e).lower(), e
    finally:
        s.close()
