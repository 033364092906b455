"""Model instances placed on devices (docs/SERVING.md, "Instances on devices"; issue 44): a
Triton-style repository whose models have two instance groups, `gpus = [0]` and `gpus = [1]`,
served by a `tpubox serve --cpu-devices 4` (the CPU plugin standing in for a 4-chip host).

    repo/affine/      a StableHLO model written here (text programs for batch sizes 1 and 4,
                      weights in a safetensors file): x FP32[4] -> y FP32[3] = x @ w + b
    repo/dtypes/      the serve-dtypes guest (examples/serve-dtypes): every datatype reversed,
                      on the device for the 13 fixed-size ones
    repo/nowhere/     `affine` with `gpus = [7]`: its load fails naming the device

Requests go concurrently over HTTP and gRPC, with Triton's own clients, until both instances of
each model have run; every answer equals the reference, and the metrics count executions on
device 0 and on device 1 (`tpubox_device_executions_total{device, model}`).
"""

from __future__ import annotations

import json
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import _need, _target_dir  # noqa: E402
from serve_util import (  # noqa: E402
    REPO,
    assert_flipped,
    dtypes_data,
    grpc_inputs,
    http_inputs,
    http_outputs,
    metric,
    request,
    scrape,
    serve_repository,
)

T = 120.0
D_IN, D_OUT = 4, 3
BUCKETS = (1, 4)
CLIENTS = 8  # concurrent clients per door
ROUNDS = 200  # requests per client at most, until both devices have run the model

RNG = np.random.default_rng(44)
W = RNG.integers(-4, 5, size=(D_IN, D_OUT)).astype(np.float32)
B = RNG.integers(-4, 5, size=(D_OUT,)).astype(np.float32)


def _program(batch: int) -> str:
    x, y = f"tensor<{batch}x{D_IN}xf32>", f"tensor<{batch}x{D_OUT}xf32>"
    w, b = f"tensor<{D_IN}x{D_OUT}xf32>", f"tensor<{D_OUT}xf32>"
    return f"""module @affine_b{batch} {{
  func.func public @main(%w: {w}, %b: {b}, %x: {x}) -> {y} {{
    %xw = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : ({x}, {w}) -> {y}
    %bb = stablehlo.broadcast_in_dim %b, dims = [1] : ({b}) -> {y}
    %y = stablehlo.add %xw, %bb : {y}
    return %y : {y}
  }}
}}
"""


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header, data, off = {}, b"", 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


GROUPS = "[[instance_group]]\ncount = 1\ngpus = [0]\n\n[[instance_group]]\ncount = 1\ngpus = [1]\n"


def _affine(dir: Path, gpus: str):
    dir.mkdir(parents=True)
    for b in BUCKETS:
        (dir / f"model.b{b}.mlir").write_text(_program(b))
    (dir / "weights.safetensors").write_bytes(_safetensors({"w": W, "b": B}))
    programs = "".join(
        f'[[tpubox.stablehlo.program]]\nbatch_size = {b}\nfile = "model.b{b}.mlir"\n' for b in BUCKETS
    )
    (dir / "config.toml").write_text(
        f'backend = "stablehlo"\nmax_batch_size = {max(BUCKETS)}\n\n'
        f'[[input]]\nname = "x"\ndata_type = "TYPE_FP32"\ndims = [{D_IN}]\n\n'
        f'[[output]]\nname = "y"\ndata_type = "TYPE_FP32"\ndims = [{D_OUT}]\n\n'
        f"{gpus}\n"
        "[dynamic_batching]\nmax_queue_delay_microseconds = 500\n\n"
        '[tpubox.stablehlo]\nparameters = [{ weight = "w" }, { weight = "b" }, { input = "x" }]\n'
        f'results = ["y"]\n{programs}'
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    repo = root / "repo"
    _affine(repo / "affine", GROUPS)
    _affine(repo / "nowhere", "[[instance_group]]\ngpus = [7]\n")
    wasm = _need(
        _target_dir() / "wasm32-wasip2" / "release" / "serve_dtypes.wasm",
        "cargo build --release --target wasm32-wasip2 -p serve-dtypes (bash scripts/dev.sh setup does)",
    )
    (repo / "dtypes").mkdir()
    (repo / "dtypes" / "model.wasm").write_bytes(wasm.read_bytes())
    config = (REPO / "examples/serve-dtypes/config.toml").read_text()
    (repo / "dtypes" / "config.toml").write_text(config.replace("[[instance_group]]\ncount = 1\n", GROUPS))
    assert "gpus = [1]" in (repo / "dtypes" / "config.toml").read_text()
    with serve_repository(root, repo, extra_args=("--cpu-devices", "4")) as s:
        yield s


def _executions(srv, model: str) -> dict[int, float]:
    samples = scrape(srv)
    return {d: metric(samples, "tpubox_device_executions_total", device=d, model=model) for d in range(4)}


def _affine_http(srv, x: np.ndarray) -> np.ndarray:
    c = httpclient.InferenceServerClient(srv.http_url, connection_timeout=10.0, network_timeout=T)
    try:
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return c.infer("affine", [inp]).as_numpy("y")
    finally:
        c.close()


def _affine_grpc(srv, x: np.ndarray) -> np.ndarray:
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        inp = grpcclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return c.infer("affine", [inp], client_timeout=T).as_numpy("y")
    finally:
        c.close()


def _until_both_devices_ran(srv, model: str, one_request):
    """CLIENTS clients on each door send ONE_REQUEST(door, client, round) at once, round after
    round, until the model has executed on device 0 and device 1 (at least two rounds)."""
    done = threading.Event()
    errors: list[BaseException] = []

    def client(door: str, i: int):
        try:
            for r in range(ROUNDS):
                if done.is_set() and r >= 2:
                    return
                one_request(door, i, r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            done.set()

    with ThreadPoolExecutor(2 * CLIENTS) as pool:
        futures = [pool.submit(client, door, i) for door in ("http", "grpc") for i in range(CLIENTS)]
        while not all(f.done() for f in futures):
            e = _executions(srv, model)
            if e[0] > 0 and e[1] > 0:
                done.set()
            time.sleep(0.2)
    if errors:
        raise errors[0]
    return _executions(srv, model)


def test_stablehlo_instances_run_on_devices_0_and_1(srv):
    def one(door, i, r):
        rows = 1 + (i + r) % 4
        x = np.arange(rows * D_IN, dtype=np.float32).reshape(rows, D_IN) - 3 * i + r % 7
        got = (_affine_http if door == "http" else _affine_grpc)(srv, x)
        want = x @ W + B
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5, err_msg=f"{door} client {i} round {r}")

    e = _until_both_devices_ran(srv, "affine", one)
    assert e[0] > 0 and e[1] > 0, f"executions per device: {e}"
    assert e[2] == 0 and e[3] == 0, f"no instance is on devices 2 and 3: {e}"
    samples = scrape(srv)
    assert sum(e.values()) == metric(samples, "nv_inference_exec_count", model="affine")
    # Each instance's tensors were charged on its own device (the model's tenant).
    held = {
        ls["device"]
        for n, ls, _ in samples
        if n == "tpubox_tenant_device_bytes_by_device" and ls.get("tenant") == "model:affine"
    }
    assert {"0", "1"} <= held, held


def test_guest_instances_run_on_devices_0_and_1(srv):
    def one(door, i, r):
        data = dtypes_data(shape=(1 + (i + r) % 3, 5), seed=1000 * i + r)
        if door == "http":
            c = httpclient.InferenceServerClient(srv.http_url, connection_timeout=10.0, network_timeout=T)
            try:
                outputs = http_outputs([f"OUTPUT_{d}" for d in data], True)
                res = c.infer("dtypes", http_inputs(data, True), outputs=outputs)
            finally:
                c.close()
        else:
            c = grpcclient.InferenceServerClient(srv.grpc_url)
            try:
                res = c.infer("dtypes", grpc_inputs(data), client_timeout=T)
            finally:
                c.close()
        assert_flipped(res.as_numpy, data)

    e = _until_both_devices_ran(srv, "dtypes", one)
    assert e[0] > 0 and e[1] > 0, f"executions per device: {e}"
    assert e[2] == 0 and e[3] == 0, f"no instance is on devices 2 and 3: {e}"


def test_config_shows_the_gpus(srv):
    want = [
        {"name": "affine_0", "kind": "KIND_GPU", "count": 1, "gpus": [0]},
        {"name": "affine_1", "kind": "KIND_GPU", "count": 1, "gpus": [1]},
    ]
    resp = request(srv, "GET", "/v2/models/affine/config")
    assert resp.status == 200, resp
    assert resp.json()["instance_group"] == want
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        groups = c.get_model_config("affine", as_json=True)["config"]["instance_group"]
    finally:
        c.close()
    assert [(g["name"], g["kind"], g["count"], [int(d) for d in g["gpus"]]) for g in groups] == [
        (w["name"], w["kind"], w["count"], w["gpus"]) for w in want
    ]


def test_a_device_the_host_lacks_fails_the_load_naming_it(srv):
    resp = request(srv, "POST", "/v2/repository/index", body={})
    assert resp.status == 200, resp
    by_name = {m["name"]: m for m in resp.json()}
    assert by_name["affine"]["state"] == "READY"
    assert by_name["dtypes"]["state"] == "READY"
    bad = by_name["nowhere"]
    assert bad["state"] == "UNAVAILABLE", bad
    want = "gpus names device 7, which this host does not have: it has 4 device(s), 0 to 3"
    assert want in bad["reason"], bad
