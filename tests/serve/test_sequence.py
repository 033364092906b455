"""Sequence batching (stateful models) with the real client: the accumulator test model
(examples/serve-accumulator: a running sum per sequence, kept in the instance) driven by
tritonclient's `sequence_id` / `sequence_start` / `sequence_end` over HTTP and gRPC, two
sequences interleaved across two instances; then the failures: no id, no start, a control input
sent by the client, another tenant's sequence id, an instance that traps under live sequences,
a sequence left idle, and the same sequence id started twice at once."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import tomllib
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "hardening"))

import hardening_util  # noqa: E402
import serve_util  # noqa: E402
from hardening_util import ATTACKER, PROBE  # noqa: E402
from tpubox_daemon import target_dir  # noqa: E402

REPO = HERE.parents[1]
CONFIG = REPO / "examples/serve-accumulator/config.toml"


class SeqDaemon(hardening_util.Daemon):
    """The adversarial tests' daemon with the accumulator model in its repository too."""

    def _repo(self) -> Path:
        repo = super()._repo()
        wasm = target_dir() / "wasm32-wasip2" / "release" / "serve_accumulator.wasm"
        if not wasm.is_file():
            raise FileNotFoundError(
                f"{wasm} is missing: cargo build --release --target wasm32-wasip2 -p serve-accumulator"
            )
        (repo / "accumulator").mkdir(exist_ok=True)
        shutil.copy(CONFIG, repo / "accumulator" / "config.toml")
        shutil.copy(wasm, repo / "accumulator" / "model.wasm")
        return repo


# The adversarial tests' tenants, the attacker allowed the accumulator too.
TENANTS = {k: dict(v) for k, v in hardening_util.TENANTS.items()}
TENANTS["attacker"]["models"] = ["dtypes", "accumulator"]


@pytest.fixture
def d(tmp_path):
    daemon = SeqDaemon(tmp_path / "d", tenants=TENANTS).start()
    yield daemon
    alive = daemon.proc.poll() is None
    daemon.stop()
    assert alive, daemon.log()[-3000:]


def hh(token=PROBE):
    return {"Authorization": f"Bearer {token}"}


def gh(token=PROBE):
    return {"authorization": f"Bearer {token}"}


def step(client, value: int, seq, start=False, end=False, token=PROBE) -> int:
    """One request of sequence SEQ adding VALUE; the running sum the model returns."""
    grpc = isinstance(client, grpcclient.InferenceServerClient)
    mod = grpcclient if grpc else httpclient
    i = mod.InferInput("INPUT", [1, 1], "INT32")
    i.set_data_from_numpy(np.array([[value]], np.int32))
    r = client.infer(
        "accumulator",
        [i],
        sequence_id=seq,
        sequence_start=start,
        sequence_end=end,
        headers=gh(token) if grpc else hh(token),
    )
    return int(r.as_numpy("OUTPUT")[0, 0])


def clients(d):
    return (
        httpclient.InferenceServerClient(f"{d.host}:{d.http_port}", network_timeout=60),
        grpcclient.InferenceServerClient(d.grpc_url),
    )


def test_two_interleaved_sequences_keep_their_state_over_http_and_grpc(d):
    for client, (a, b) in zip(clients(d), ((101, 202), ("alpha", "beta"))):
        assert step(client, 1, a, start=True) == 1
        assert step(client, 10, b, start=True) == 10
        assert step(client, 2, a) == 3
        assert step(client, 20, b) == 30
        assert step(client, 3, a) == 6
        assert step(client, 30, b, end=True) == 60
        assert step(client, 4, a, end=True) == 10
        # Ended: the next request needs a start again.
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            step(client, 1, a)
    # Many sequences at once from threads (one gRPC client each), each summing its own.
    errors, sums = [], {}

    def run(k: int):
        try:
            c = grpcclient.InferenceServerClient(d.grpc_url)
            total = step(c, k, 1000 + k, start=True)
            for v in range(1, 6):
                total = step(c, v, 1000 + k, end=v == 5)
            sums[k] = total
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sums == {k: k + 15 for k in range(6)}, sums


def test_sequence_errors_in_tritons_words(d):
    h, g = clients(d)
    i = httpclient.InferInput("INPUT", [1, 1], "INT32")
    i.set_data_from_numpy(np.array([[1]], np.int32))
    with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty correlation ID"):
        h.infer("accumulator", [i], headers=hh())
    with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty correlation ID"):
        step(g, 1, 0, start=True)
    with pytest.raises(InferenceServerException, match="sequence 77 to model 'accumulator' must specify the START flag"):
        step(h, 1, 77)
    # The control inputs are the server's to fill.
    s = httpclient.InferInput("START", [1, 1], "INT32")
    s.set_data_from_numpy(np.array([[1]], np.int32))
    with pytest.raises(InferenceServerException, match="sequence control input"):
        h.infer("accumulator", [i, s], sequence_id=5, sequence_start=True, headers=hh())
    # A batch of two rows is not one step of one sequence.
    i2 = httpclient.InferInput("INPUT", [2, 1], "INT32")
    i2.set_data_from_numpy(np.array([[1], [2]], np.int32))
    with pytest.raises(InferenceServerException, match="batch of 1"):
        h.infer("accumulator", [i2], sequence_id=6, sequence_start=True, headers=hh())


def test_sequences_belong_to_their_tenant(d):
    h, _ = clients(d)
    assert step(h, 5, 42, start=True) == 5
    # Another tenant cannot continue, end or read sequence 42: for it, 42 was never started.
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        step(h, 1, 42, token=ATTACKER)
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        step(h, 1, 42, end=True, token=ATTACKER)
    # Its own 42 is another sequence.
    assert step(h, 100, 42, start=True, token=ATTACKER) == 100
    assert step(h, 1, 42) == 6
    assert step(h, 1, 42, end=True, token=ATTACKER) == 101


def test_a_trapped_instance_fails_the_sequences_it_held_by_name(d):
    h, _ = clients(d)
    # Routing gives a new sequence the instance with the fewest: 1 -> 0, 2 -> 1, 3 -> 0.
    assert step(h, 1, 1, start=True) == 1
    assert step(h, 2, 2, start=True) == 2
    assert step(h, 3, 3, start=True) == 3
    with pytest.raises(InferenceServerException, match="instance was replaced"):
        step(h, -999, 1)  # the test hook: instance 0 traps
    with pytest.raises(InferenceServerException, match="sequence 3 of model 'accumulator' lost its state"):
        step(h, 1, 3)
    # Sequence 2 was on the other instance: untouched.
    assert step(h, 2, 2, end=True) == 4
    # Both start again, on the replaced instance too.
    assert step(h, 7, 3, start=True) == 7
    assert step(h, 1, 1, start=True) == 1
    assert h.is_server_live()


def test_an_idle_sequence_is_released(d):
    h, _ = clients(d)
    # The repository's config with a 300 ms idle limit, loaded as Triton's config override.
    cfg = tomllib.loads(CONFIG.read_text())
    cfg["sequence_batching"]["max_sequence_idle_microseconds"] = 300_000
    h.load_model("accumulator", config=json.dumps(cfg), headers=hh(hardening_util.OPS))
    assert step(h, 1, 9, start=True) == 1
    assert step(h, 1, 9) == 2
    import time

    time.sleep(0.8)
    with pytest.raises(InferenceServerException, match="sequence 9 to model 'accumulator' must specify the START flag"):
        step(h, 1, 9)


def test_one_sequence_id_started_twice_at_once(d):
    """Two clients race to start sequence 500 and feed it: every request is answered (a start
    of a live sequence restarts it on its instance) and the daemon stays consistent."""
    errors, results = [], []

    def run(v: int):
        try:
            c = grpcclient.InferenceServerClient(d.grpc_url)
            results.append(step(c, v, 500, start=True))
            for _ in range(10):
                results.append(step(c, v, 500))
        except InferenceServerException as e:
            errors.append(e.message())

    threads = [threading.Thread(target=run, args=(v,)) for v in (1, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 22
    # Every answer is a sum of what was sent to 500 since some start: never garbage.
    assert all(0 < r <= 11 * 1001 for r in results), results
    h, _ = clients(d)
    assert step(h, 1, 500, end=True) > 0


def test_stream_infer_answers_each_request_in_order(d):
    """tritonclient's gRPC stream (`start_stream` / `async_stream_infer`): two sequences
    interleaved on one stream, each request answered with its id, an error answered on the
    stream without ending it."""
    import queue

    g = grpcclient.InferenceServerClient(d.grpc_url)
    results: queue.Queue = queue.Queue()
    g.start_stream(callback=lambda result, error: results.put((result, error)), headers=gh())
    plan = [(1, 11, True, False), (10, 22, True, False), (2, 11, False, False), (20, 22, False, True)]
    plan += [(3, 11, False, True)]
    try:
        for k, (v, seq, start, end) in enumerate(plan):
            i = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            i.set_data_from_numpy(np.array([[v]], np.int32))
            g.async_stream_infer(
                "accumulator", [i], request_id=str(k), sequence_id=seq, sequence_start=start, sequence_end=end
            )
        g.async_stream_infer("accumulator", [i], request_id="bad", sequence_id=999)
        g.async_stream_infer("accumulator", [i], request_id="5", sequence_id=33, sequence_start=True)
        got = [results.get(timeout=60) for _ in range(len(plan) + 2)]
    finally:
        g.stop_stream()
    ok = {r.get_response().id: int(r.as_numpy("OUTPUT")[0, 0]) for r, e in got if e is None}
    assert ok == {"0": 1, "1": 10, "2": 3, "3": 30, "4": 6, "5": 3}, ok
    errors = [e.message() for r, e in got if e is not None]
    assert len(errors) == 1 and "sequence 999 to model 'accumulator' must specify the START flag" in errors[0]


def test_a_flooded_stream_whose_client_never_reads_is_bounded(d):
    """A client streams requests as fast as it can and reads no response: the daemon holds a
    few responses, stops reading the stream (HTTP/2 flow control pushes back), keeps serving
    others, and frees everything when the client goes away."""
    import grpc as grpc_lib
    import tritonclient.grpc.service_pb2 as pb
    import tritonclient.grpc.service_pb2_grpc as pb_grpc

    def requests():
        req = pb.ModelInferRequest(model_name="dtypes", id="flood")
        for dt, a in serve_util.dtypes_data(shape=(1, 256), seed=3).items():
            req.inputs.add(name=f"INPUT_{dt}", datatype=dt, shape=list(a.shape))
            if dt == "BYTES":
                req.raw_input_contents.append(b"".join(len(x).to_bytes(4, "little") + x for x in a.flat))
            else:
                req.raw_input_contents.append(np.ascontiguousarray(a).tobytes())
        for _ in range(100_000):
            yield req

    import time

    rss0 = d.rss_mib()
    ch = grpc_lib.insecure_channel(d.grpc_url)
    call = pb_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(requests(), metadata=tuple(gh().items()))
    time.sleep(5)
    # Others are served meanwhile, and the daemon did not buffer the flood.
    for _ in range(5):
        hardening_util.probe_infer(d)
    assert d.rss_mib() - rss0 < 256, (rss0, d.rss_mib())
    call.cancel()
    ch.close()
    hardening_util.probe_infer(d)


def test_generate_and_generate_stream_for_a_model_with_one_response(d):
    """Triton's generate extension: input names as keys, outputs by name (a scalar for one
    element); the sequence parameters pass through; generate_stream answers as one
    server-sent event."""
    import http.client

    def post(path: str, body: dict, token=PROBE):
        c = http.client.HTTPConnection(d.host, d.http_port, timeout=30)
        try:
            c.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {token}"})
            r = c.getresponse()
            return r.status, r.getheader("content-type"), r.read().decode()
        finally:
            c.close()

    st, ct, text = post(
        "/v2/models/accumulator/generate",
        {"INPUT": 5, "id": "g1", "parameters": {"sequence_id": 8, "sequence_start": True}},
    )
    assert st == 200 and ct == "application/json", text
    assert json.loads(text) == {"model_name": "accumulator", "model_version": "1", "id": "g1", "OUTPUT": 5}
    st, ct, text = post(
        "/v2/models/accumulator/generate_stream",
        {"INPUT": [2], "parameters": {"sequence_id": 8, "sequence_end": True}},
    )
    assert st == 200 and ct == "text/event-stream", text
    assert text.startswith("data: ") and text.endswith("\n\n"), text
    assert json.loads(text[len("data: "):])["OUTPUT"] == 7
    # An input the model does not have; a model the tenant may not call (as unknown).
    st, _, text = post("/v2/models/accumulator/generate", {"text_input": "hi"})
    assert st == 400 and "has no input `text_input`" in text, text
    st, _, text = post("/v2/models/accumulator/generate", {"INPUT": 1}, token=hardening_util.ATTACKER + "x")
    assert st == 401, text
    st, _, text = post("/v2/models/minilm/generate", {"text": ["a"]})
    assert st == 400 and "Request for unknown model: 'minilm' is not found" in text, text
