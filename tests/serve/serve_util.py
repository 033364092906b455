"""Helpers shared by the `tpubox serve` tests: tenants, the dtypes model's tensors, raw HTTP,
Prometheus text, the MiniLM reference.

The tests drive the daemon with Triton's own clients (`tritonclient.http`, `tritonclient.grpc`)
and, where a client would refuse to send something malformed, with raw HTTP.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------
# A `tpubox serve` of a repository a test module wrote (no tokens file: loopback only).



@contextlib.contextmanager
def serve_repository(
    root: Path, repo: Path, ready_within: float = 180.0, extra_args: tuple[str, ...] = ()
) -> Iterator[Any]:
    """A `tpubox serve --model-repository REPO` on loopback ports of its own, without a tokens
    file, logging to ROOT/serve.log (conftest's `Server`): started (with EXTRA_ARGS, e.g.
    `("--cpu-devices", "4")`), waited for until `/v2/health/ready` answers 200 (READY_WITHIN
    seconds), yielded; on exit sent SIGTERM, and its exit asserted clean (status 0 within
    40 s)."""
    from conftest import Server, _binary, _free_ports

    s = Server(root, repo, None, root / "serve.log", _free_ports(3))
    cmd = [
        str(_binary()), "serve", "--model-repository", str(repo), "--host", s.host,
        "--http-port", str(s.http_port), "--grpc-port", str(s.grpc_port),
        "--metrics-port", str(s.metrics_port), *extra_args,
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("TPUBOX_LOG", "info")
    with open(s.log_path, "wb") as log:
        s.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + ready_within
        while s.ready_status() != 200:
            assert s.proc.poll() is None, f"tpubox serve exited {s.proc.returncode}:\n{s.log()}"
            assert time.monotonic() < deadline, f"tpubox serve not ready:\n{s.log()}"
            time.sleep(0.2)
        yield s
    finally:
        s.proc.send_signal(signal.SIGTERM)
        try:
            rc = s.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            rc = None
        assert rc == 0, f"tpubox serve exited {rc} after SIGTERM:\n{s.log()}"


# ---------------------------------------------------------------------------------------------
# Tenants (the tokens file conftest.py writes).

TENANTS = {
    # alice also reads /metrics (`metrics = true`).
    "alice": {"token": "alice-token", "models": ["*"], "max_in_flight": 8, "repository_control": True, "metrics": True},
    "bob": {"token": "bob-token", "models": ["dtypes"]},
    "slow": {"token": "slow-token", "models": ["*"], "max_requests_per_second": 2},
    "narrow": {"token": "narrow-token", "models": ["*"], "max_in_flight": 1},
    # The load test's two tenants (test_load.py): enough in flight for its 32 clients.
    "load-a": {"token": "load-a-token", "models": ["*"], "max_in_flight": 64},
    "load-b": {"token": "load-b-token", "models": ["dtypes"], "max_in_flight": 64},
}


def http_headers(tenant: str | None = "alice", token: str | None = None) -> dict:
    """HTTP headers for TENANT (or a literal TOKEN); {} for no token at all."""
    if token is None:
        if tenant is None:
            return {}
        token = TENANTS[tenant]["token"]
    return {"Authorization": f"Bearer {token}"}


def grpc_headers(tenant: str | None = "alice", token: str | None = None) -> dict:
    """gRPC metadata for TENANT. gRPC metadata keys must be lowercase: grpcio refuses
    `Authorization` locally ("Illegal header key") before anything is sent."""
    return {k.lower(): v for k, v in http_headers(tenant, token).items()}


# ---------------------------------------------------------------------------------------------
# Clients.

NETWORK_TIMEOUT = 120.0  # MiniLM compiles its buckets on first use


def http_client(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(
        server.http_url, connection_timeout=10.0, network_timeout=NETWORK_TIMEOUT
    )


def grpc_client(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def grpc_status(exc: InferenceServerException) -> str:
    """`StatusCode.INVALID_ARGUMENT` -> `INVALID_ARGUMENT` (tritonclient.grpc puts
    `str(grpc.StatusCode.X)` into `status()`)."""
    return (exc.status() or "").removeprefix("StatusCode.")


# ---------------------------------------------------------------------------------------------
# The dtypes model (examples/serve-dtypes): INPUT_<DT> -> OUTPUT_<DT> = flip along the last axis.

DTYPES = [
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "BF16", "FP32", "FP64", "BYTES",
]  # fmt: skip

NP_DTYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}

# Triton's model-configuration names for the protocol's datatypes.
CONFIG_TYPES = {dt: "TYPE_STRING" if dt == "BYTES" else f"TYPE_{dt}" for dt in DTYPES}

TRAP = b"trap!"  # INPUT_BYTES[0, 0] == TRAP makes the dtypes guest panic


def random_tensor(dt: str, shape, rng: np.random.Generator) -> np.ndarray:
    """Random values of datatype DT, exact in JSON too (finite floats, UTF-8 strings)."""
    if dt == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt.startswith(("UINT", "INT")):
        t = NP_DTYPES[dt]
        info = np.iinfo(t)
        return rng.integers(info.min, info.max, size=shape, dtype=t, endpoint=True)
    if dt in ("FP16", "BF16"):
        return (rng.standard_normal(shape) * 100).astype(np.float32).astype(NP_DTYPES[dt])
    if dt in ("FP32", "FP64"):
        return (rng.standard_normal(shape) * 1e6).astype(NP_DTYPES[dt])
    assert dt == "BYTES"
    alphabet = list("abcdefghijklmnopqrstuvwxyz0123456789 ") + ["é", "€", "日", "\u0000"]
    n = int(np.prod(shape))
    words = []
    for i in range(n):
        length = 0 if i == 1 else int(rng.integers(1, 12))  # one empty string
        words.append("".join(rng.choice(alphabet, size=length)).encode())
    out = np.empty(n, dtype=np.object_)
    out[:] = words
    return out.reshape(shape)


def dtypes_data(shape=(2, 5), seed=0, trap=False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = {dt: random_tensor(dt, shape, rng) for dt in DTYPES}
    if trap:
        data["BYTES"].flat[0] = TRAP
    else:
        assert data["BYTES"].flat[0] != TRAP
    return data


def http_inputs(data: dict, binary: bool) -> list:
    """tritonclient.http inputs. BF16 always goes binary: the client refuses BF16 in JSON."""
    inputs = []
    for dt, arr in data.items():
        inp = httpclient.InferInput(f"INPUT_{dt}", list(arr.shape), dt)
        inp.set_data_from_numpy(arr, binary_data=binary or dt == "BF16")
        inputs.append(inp)
    return inputs


def http_outputs(names, binary: bool) -> list:
    return [httpclient.InferRequestedOutput(n, binary_data=binary) for n in names]


def grpc_inputs(data: dict) -> list:
    inputs = []
    for dt, arr in data.items():
        inp = grpcclient.InferInput(f"INPUT_{dt}", list(arr.shape), dt)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


def as_bytes_list(arr) -> list[bytes]:
    """A BYTES tensor's elements as bytes (JSON results come back as str)."""
    return [x.encode() if isinstance(x, str) else bytes(x) for x in np.asarray(arr).flat]


def assert_tensor_equal(dt: str, got, expected: np.ndarray, what: str):
    assert got is not None, f"{what}: missing from the response"
    got = np.asarray(got)
    assert list(got.shape) == list(expected.shape), f"{what}: shape {got.shape} != {expected.shape}"
    if dt == "BYTES":
        assert as_bytes_list(got) == as_bytes_list(expected), what
        return
    got = got.astype(NP_DTYPES[dt], copy=False)
    expected = np.ascontiguousarray(expected)
    if dt in ("FP16", "BF16", "FP32", "FP64"):
        # Bit for bit: the guest only moves elements.
        width = {"FP16": np.uint16, "BF16": np.uint16, "FP32": np.uint32, "FP64": np.uint64}[dt]
        ok = np.array_equal(np.ascontiguousarray(got).view(width), expected.view(width))
    else:
        ok = np.array_equal(got, expected)
    assert ok, f"{what}:\n got      {got!r}\n expected {expected!r}"


def assert_flipped(as_numpy, data: dict, only=None):
    """Every OUTPUT_<DT> (or those in ONLY) equals flip(INPUT_<DT>, last axis)."""
    for dt, arr in data.items():
        if only is not None and dt not in only:
            continue
        assert_tensor_equal(dt, as_numpy(f"OUTPUT_{dt}"), np.flip(arr, axis=-1), f"OUTPUT_{dt}")


def json_value(dt: str, x):
    """One element as the JSON tensor encoding carries it."""
    if dt == "BYTES":
        return x.decode()
    if dt == "BOOL":
        return bool(x)
    if dt in ("FP16", "BF16", "FP32", "FP64"):
        return float(x)
    return int(x)


def json_infer_body(data: dict, drop=(), override=None) -> dict:
    """A pure-JSON inference request (no binary extension): each input's data row-major flat.
    OVERRIDE maps DT to fields replacing the generated ones (e.g. a wrong datatype)."""
    inputs = []
    for dt, arr in data.items():
        if dt in drop:
            continue
        t = {
            "name": f"INPUT_{dt}",
            "shape": list(arr.shape),
            "datatype": dt,
            "data": [json_value(dt, x) for x in arr.flat],
        }
        t.update((override or {}).get(dt, {}))
        inputs.append(t)
    return {"inputs": inputs}


def binary_bytes(dt: str, arr: np.ndarray) -> bytes:
    """A tensor in the binary tensor extension's layout: little-endian elements, BOOL one byte,
    BYTES as 4-byte little-endian length + bytes per element."""
    if dt == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in as_bytes_list(arr))
    return np.ascontiguousarray(arr, dtype=np.dtype(NP_DTYPES[dt]).newbyteorder("<")).tobytes()


def binary_infer_parts(data: dict, binary_outputs=True) -> tuple[dict, list[bytes]]:
    """The JSON header (as a dict, with each input's binary_data_size) and the binary chunks of
    an all-binary request."""
    header = {"inputs": [], "outputs": []}
    chunks = []
    for dt, arr in data.items():
        raw = binary_bytes(dt, arr)
        header["inputs"].append(
            {
                "name": f"INPUT_{dt}",
                "shape": list(arr.shape),
                "datatype": dt,
                "parameters": {"binary_data_size": len(raw)},
            }
        )
        header["outputs"].append(
            {"name": f"OUTPUT_{dt}", "parameters": {"binary_data": binary_outputs}}
        )
        chunks.append(raw)
    return header, chunks


# ---------------------------------------------------------------------------------------------
# Raw HTTP.


class Response:
    def __init__(self, status: int, headers: dict, body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"<{self.status} {self.body[:300]!r}>"


def request(server, method: str, path: str, body=None, headers=None, timeout=NETWORK_TIMEOUT):
    """One HTTP request on a fresh connection. BODY: bytes, str, or a JSON-able object."""
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
        headers = {"Content-Type": "application/json", **(headers or {})}
    if isinstance(body, str):
        body = body.encode()
    conn = http.client.HTTPConnection(server.host, server.http_port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def assert_error(resp: Response, status: int):
    """RESP has STATUS and Triton's error body `{"error": "..."}`."""
    assert resp.status == status, f"expected {status}, got {resp!r}"
    try:
        body = resp.json()
    except ValueError as e:
        raise AssertionError(f"error body is not JSON: {resp!r}") from e
    assert isinstance(body, dict) and isinstance(body.get("error"), str), f"no error: {resp!r}"
    assert body["error"], f"empty error message: {resp!r}"


def raw_exchange(host: str, port: int, data: bytes, wait=5.0, total=20.0) -> bytes:
    """Sends DATA on a raw socket and returns what comes back. When nothing has come back
    after WAIT seconds, half-closes the connection (the server then sees the body end early)
    and keeps reading until TOTAL."""
    s = socket.create_connection((host, port), timeout=total)
    try:
        s.sendall(data)
        s.settimeout(wait)
        out = b""
        deadline = time.monotonic() + total
        half_closed = False
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                if not half_closed:
                    s.shutdown(socket.SHUT_WR)
                    half_closed = True
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out:
                head, _, rest = out.partition(b"\r\n\r\n")
                m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if m and len(rest) >= int(m.group(1)):
                    break
        return out
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------
# Prometheus text.

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)(?:\s+\d+)?$"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        samples.append((m.group("name"), labels, float(m.group("value"))))
    return samples


def metric(samples, name: str, **labels) -> float:
    """Sum of NAME's samples whose labels include LABELS (other labels, e.g. Triton's `reason`
    on failures, summed over); 0 when there is none."""
    return sum(
        v
        for n, ls, v in samples
        if n == name and all(ls.get(k) == str(want) for k, want in labels.items())
    )


def scrape(server) -> list[tuple[str, dict, float]]:
    conn = http.client.HTTPConnection(server.host, server.metrics_port, timeout=30)
    try:
        # With a tokens file /metrics needs a tenant with `metrics = true`: alice.
        conn.request("GET", "/metrics", headers=http_headers("alice"))
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200, f"GET /metrics: {resp.status} {body[:300]!r}"
        return parse_metrics(body.decode())
    finally:
        conn.close()


def wait_metric(server, name: str, want: float, timeout=5.0, **labels) -> float:
    """Scrapes until NAME{LABELS} reaches WANT (metrics may trail the responses by a moment);
    returns the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric(scrape(server), name, **labels)
        if value >= want or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# MiniLM.


def reference_path() -> Path:
    """$TPUBOX_MINILM_REFERENCE, else `shared/` beside the checkout, else /work/shared (the
    same search as tests/all/minilm.rs)."""
    env = os.environ.get("TPUBOX_MINILM_REFERENCE")
    if env:
        return Path(env)
    beside = REPO.parent / "shared" / "reference" / "minilm_public.json"
    if beside.is_file():
        return beside
    return Path("/work/shared/reference/minilm_public.json")


def load_reference() -> list[dict]:
    path = reference_path()
    cases = json.loads(path.read_text())["cases"]
    assert cases, f"{path}: no cases"
    return cases


def cosine(a, b) -> float:
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def text_tensor(texts) -> np.ndarray:
    arr = np.empty(len(texts), dtype=np.object_)
    arr[:] = [t.encode() for t in texts]
    return arr


def assert_embeddings(got, cases, what=""):
    got = np.asarray(got)
    assert got.shape == (len(cases), 384), f"{what} embedding shape {got.shape}"
    assert got.dtype == np.float32, f"{what} embedding dtype {got.dtype}"
    for row, case in zip(got, cases):
        c = cosine(row, case["embedding"])
        assert c >= 0.9999, f"{what} cosine {c:.6f} for {case['text']!r}"
