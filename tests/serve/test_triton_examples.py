"""Triton's own Python client examples, unchanged, against `tpubox serve`.

The 31 examples of triton-inference-server/client (`src/python/examples/`, all but the three
image ones) are vendored byte for byte in `triton_examples/` (see its README). Each runs here
as a user runs it, as a subprocess of this venv's Python with `-u host:port` (the gRPC or HTTP
port, as the example expects), and must exit 0 and print its `PASS` line where it has one.

The models they call are stand-ins: `triton_repository/` holds Triton's own `config.pbtxt`
files (and three of ours), copied to a temporary repository with the component of
`tests/guests/triton-standins` at `<model>/1/model.wasm` (Triton's version-directory layout)
and the file `<model>/standin` that tells it which model to be (`tests/guests/triton-repeat`
for the decoupled `repeat_int32`). One server, for the module, serves the ten of them.

The exceptions, asserted exactly rather than skipped:

- `simple_{http,grpc}_health_metadata.py` check that the server calls itself `triton`;
  tpubox does not, so each must fail there and only there: exit 1 with exactly
  `FAILED : get_server_metadata` on stdout (the checks before it passed).
- `simple_{http,grpc}_cudashm_client.py` need a CUDA device on the client side
  (`tritonclient.utils.cuda_shared_memory`): skipped, with the reason, where the client has
  none; where it has one, tpubox's refusal of CUDA shared memory is asserted instead.
- `simple_{http,grpc}_model_control.py` check the repository index's length (the HTTP one 7
  models, the gRPC one 8): they run against a second server whose repository holds 7 of the
  stand-ins (an 8th model directory added for the gRPC one). tpubox loads every model at
  start-up and lets a client load and unload at run time (no model-control mode to choose).
- `memory_growth_test.py` hard-codes `localhost:8000`/`8001`: it runs in a private network
  namespace (`unshare -n`, `lo` brought up) with a server on those ports, once per protocol,
  with a few repetitions.

The sequence examples run with and without `-d` (`simple_sequence`, or the dynamic
`simple_dyna_sequence` and `simple_string_dyna_sequence`), one after another: they share
sequence ids. So do the examples that use system shared memory (their keys and region names).

Environment: as conftest.py (TPUBOX_BIN, CARGO_TARGET_DIR for the built components).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import serve_util
from conftest import _binary, _need, _place, _target_dir

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE / "triton_examples"
TRITON_REPOSITORY = HERE / "triton_repository"

EXAMPLE_TIMEOUT = 120.0  # one example, start to exit

STANDINS_WASM = "tpubox_triton_standins.wasm"
REPEAT_WASM = "tpubox_triton_repeat.wasm"
# Model -> component; the stand-ins also get a `standin` file naming the model.
MODELS = {
    "simple": STANDINS_WASM,
    "simple_int8": STANDINS_WASM,
    "simple_string": STANDINS_WASM,
    "simple_identity": STANDINS_WASM,
    "custom_identity_int32": STANDINS_WASM,
    "simple_sequence": STANDINS_WASM,
    "simple_dyna_sequence": STANDINS_WASM,
    "simple_string_dyna_sequence": STANDINS_WASM,
    "densenet_onnx": STANDINS_WASM,
    "repeat_int32": REPEAT_WASM,
}
# The model-control server: 7 models for simple_http_model_control.py, and an 8th directory
# for simple_grpc_model_control.py.
CONTROL_MODELS = [
    "simple",
    "simple_int8",
    "simple_string",
    "simple_identity",
    "custom_identity_int32",
    "densenet_onnx",
    "repeat_int32",
]
CONTROL_EIGHTH = "simple_sequence"


def _component(wasm: str) -> Path:
    crate = {STANDINS_WASM: "tpubox-triton-standins", REPEAT_WASM: "tpubox-triton-repeat"}[wasm]
    return _need(
        _target_dir() / "wasm32-wasip2" / "release" / wasm,
        f"cargo build --release --target wasm32-wasip2 -p {crate} (bash scripts/dev.sh setup does)",
    )


def add_model(repo: Path, model: str):
    """Copies MODEL's directory of triton_repository/ into REPO, its component at
    `1/model.wasm`, and (a stand-in) its `standin` file."""
    wasm = MODELS[model]
    d = repo / model
    shutil.copytree(TRITON_REPOSITORY / model, d)
    (d / "1").mkdir()
    _place(_component(wasm), d / "1" / "model.wasm")
    if wasm == STANDINS_WASM:
        (d / "standin").write_text(model + "\n")


def make_repository(root: Path, models) -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True)
    for m in models:
        add_model(repo, m)
    return repo


def index(server) -> list[dict]:
    resp = serve_util.request(server, "POST", "/v2/repository/index", body={})
    assert resp.status == 200, f"POST /v2/repository/index: {resp!r}"
    return resp.json()


def assert_all_ready(server, models):
    rows = {r["name"]: r for r in index(server)}
    bad = {m: rows.get(m) for m in models if (rows.get(m) or {}).get("state") != "READY"}
    assert not bad, f"stand-ins not READY: {json.dumps(bad, indent=1)}\n--- log ---\n{server.log()}"


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    """One `tpubox serve` of all ten stand-ins."""
    root = tmp_path_factory.mktemp("triton")
    repo = make_repository(root, MODELS)
    with serve_util.serve_repository(root, repo) as s:
        yield s


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    """A second server, for the model-control examples: 7 stand-ins."""
    root = tmp_path_factory.mktemp("triton-control")
    repo = make_repository(root, CONTROL_MODELS)
    with serve_util.serve_repository(root, repo) as s:
        assert_all_ready(s, CONTROL_MODELS)
        yield s


def test_every_stand_in_loads(triton):
    """Every model of the main server is READY (a model that failed to load fails its
    examples too; this says why, from the repository index)."""
    assert_all_ready(triton, MODELS)


# ---------------------------------------------------------------------------------------------
# Running an example.


@dataclasses.dataclass
class Run:
    args: list[str]
    rc: int
    out: str
    err: str
    seconds: float

    def report(self, server=None) -> str:
        text = (
            f"$ {' '.join(self.args)}\nexit {self.rc} after {self.seconds:.1f} s\n"
            f"--- stdout (last 60 lines) ---\n" + "\n".join(self.out.splitlines()[-60:]) +
            f"\n--- stderr (last 60 lines) ---\n" + "\n".join(self.err.splitlines()[-60:])
        )  # fmt: skip
        if server is not None:
            text += "\n--- tpubox serve log (last 40 lines) ---\n"
            text += "\n".join(server.log().splitlines()[-40:])
        return text


def run_example(script: str, *args: str, timeout: float = EXAMPLE_TIMEOUT) -> Run:
    cmd = [sys.executable, str(EXAMPLES / script), *args]
    start = time.monotonic()
    try:
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        r = Run(cmd, -1, out or "", err or "", time.monotonic() - start)
        pytest.fail(f"timed out after {timeout:.0f} s\n{r.report()}", pytrace=False)
    return Run(cmd, p.returncode, p.stdout, p.stderr, time.monotonic() - start)


def assert_passed(r: Run, pass_line: str | None, server=None):
    assert r.rc == 0, f"the example failed\n{r.report(server)}"
    if pass_line is not None:
        lines = [l.strip() for l in r.out.splitlines()]
        assert pass_line in lines, f"no `{pass_line}` line\n{r.report(server)}"


# ---------------------------------------------------------------------------------------------
# The examples that must pass against the main server: (script, door, extra arguments,
# PASS line or None where the example prints none).

HTTP, GRPC = "http", "grpc"

PASSING = [
    ("grpc_client.py", GRPC, [], "PASS"),
    ("grpc_explicit_byte_content_client.py", GRPC, [], "PASS: explicit string"),
    ("grpc_explicit_int8_content_client.py", GRPC, [], "PASS: explicit int8"),
    ("grpc_explicit_int_content_client.py", GRPC, [], "PASS: explicit int"),
    ("simple_grpc_aio_infer_client.py", GRPC, [], "PASS: grpc aio infer"),
    ("simple_grpc_async_infer_client.py", GRPC, [], "PASS: Async infer"),
    ("simple_grpc_custom_args_client.py", GRPC, [], "PASS: CustomArgs"),
    ("simple_grpc_custom_repeat.py", GRPC, [], "PASS: Decoupled API"),
    ("simple_grpc_infer_client.py", GRPC, [], "PASS: infer"),
    ("simple_grpc_keepalive_client.py", GRPC, [], "PASS: KeepAlive"),
    ("simple_grpc_string_infer_client.py", GRPC, [], "PASS: string"),
    ("simple_http_aio_infer_client.py", HTTP, [], "PASS: infer"),
    ("simple_http_async_infer_client.py", HTTP, [], None),
    ("simple_http_infer_client.py", HTTP, [], None),
    ("simple_http_string_infer_client.py", HTTP, [], "PASS: string"),
    # System shared memory (one after another: they share keys and region names).
    ("simple_grpc_shm_client.py", GRPC, [], "PASS: system shared memory"),
    ("simple_grpc_shm_string_client.py", GRPC, [], "PASS: system shared memory"),
    ("simple_http_shm_client.py", HTTP, [], "PASS: system shared memory"),
    ("simple_http_shm_string_client.py", HTTP, [], "PASS: system shared memory"),
    ("reuse_infer_objects_client.py", HTTP, ["-i", "http"], None),
    ("reuse_infer_objects_client.py", GRPC, ["-i", "grpc"], None),
    # Sequences: simple_sequence, then (-d) simple_dyna_sequence and
    # simple_string_dyna_sequence.
    ("simple_grpc_sequence_sync_infer_client.py", GRPC, [], "PASS: Sequence"),
    ("simple_grpc_sequence_sync_infer_client.py", GRPC, ["-d"], "PASS: Sequence"),
    ("simple_http_sequence_sync_infer_client.py", HTTP, [], "PASS: Sequence"),
    ("simple_http_sequence_sync_infer_client.py", HTTP, ["-d"], "PASS: Sequence"),
    ("simple_grpc_sequence_stream_infer_client.py", GRPC, [], "PASS: Sequence"),
    ("simple_grpc_sequence_stream_infer_client.py", GRPC, ["-d"], "PASS: Sequence"),
    ("simple_grpc_aio_sequence_stream_infer_client.py", GRPC, [], "PASS: grpc aio sequence stream"),
    ("simple_grpc_aio_sequence_stream_infer_client.py", GRPC, ["-d"], "PASS: grpc aio sequence stream"),
]  # fmt: skip


def _url(server, door: str) -> str:
    return server.grpc_url if door == GRPC else server.http_url


@pytest.mark.parametrize(
    "script,door,extra,pass_line",
    PASSING,
    ids=[f"{s.removesuffix('.py')}{''.join(' ' + a for a in x)}" for s, _, x, _ in PASSING],
)
def test_example(triton, script, door, extra, pass_line):
    r = run_example(script, "-u", _url(triton, door), *extra)
    assert_passed(r, pass_line, triton)


# ---------------------------------------------------------------------------------------------
# The exceptions.


@pytest.mark.parametrize("door", [HTTP, GRPC])
def test_health_metadata_fails_only_on_the_server_name(triton, door):
    """The example checks `get_server_metadata().name == "triton"`; tpubox gives its own
    name. Everything before that check (live, ready, model ready) passed: the example printed
    nothing else."""
    resp = serve_util.request(triton, "GET", "/v2")
    assert resp.status == 200, resp
    name = resp.json()["name"]
    r = run_example(f"simple_{door}_health_metadata.py", "-u", _url(triton, door))
    assert name != "triton", (
        f"the server now calls itself {name!r}: the example should pass; move it to PASSING\n"
        f"{r.report(triton)}"
    )
    assert (r.rc, r.out.strip()) == (1, "FAILED : get_server_metadata"), (
        f"expected exit 1 with exactly `FAILED : get_server_metadata` (server name {name!r})\n"
        f"{r.report(triton)}"
    )


def _client_cuda() -> str | None:
    """None where tritonclient.utils.cuda_shared_memory can make a region on a CUDA device of
    this machine; else why not."""
    probe = (
        "import tritonclient.utils.cuda_shared_memory as c\n"
        "h = c.create_shared_memory_region('tpubox-probe', 64, 0)\n"
        "c.destroy_shared_memory_region(h)\n"
    )
    try:
        p = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return "probing CUDA timed out"
    if p.returncode == 0:
        return None
    last = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
    return last


@pytest.mark.parametrize("door", [HTTP, GRPC])
def test_cudashm(triton, door):
    """CUDA shared memory needs a CUDA device on the client; where there is one, tpubox
    refuses to share device memory (docs/SERVING.md) and the example fails on that refusal."""
    why = _client_cuda()
    if why is not None:
        pytest.skip(
            f"simple_{door}_cudashm_client.py needs a CUDA device on the client side "
            f"(tritonclient.utils.cuda_shared_memory): {why}"
        )
    r = run_example(f"simple_{door}_cudashm_client.py", "-u", _url(triton, door))
    assert r.rc != 0 and "CUDA shared memory is not supported" in r.out + r.err, (
        f"expected tpubox's refusal of CUDA shared memory\n{r.report(triton)}"
    )


def _model_dirs(server, n: int):
    """Makes the control server's repository index list N models: 7, then 8 (an 8th model
    directory, found by the index's rescan; the HTTP example runs first)."""
    if n == 8 and not (server.repo / CONTROL_EIGHTH).exists():
        add_model(server.repo, CONTROL_EIGHTH)
    rows = index(server)
    assert len(rows) == n, f"the repository index lists {len(rows)} models, not {n}: {rows}"


@pytest.mark.parametrize("door,models", [(HTTP, 7), (GRPC, 8)])
def test_model_control(control, door, models):
    _model_dirs(control, models)
    r = run_example(f"simple_{door}_model_control.py", "-u", _url(control, door))
    assert_passed(r, "PASS: model control", control)


# ---------------------------------------------------------------------------------------------
# memory_growth_test.py: localhost:8000/8001, in a network namespace of its own.


def _unshare() -> list[str] | str:
    """The `unshare` command line that makes a private network namespace, or why none."""
    if shutil.which("unshare") is None:
        return "no `unshare` (util-linux)"
    cmd = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-r", "-n"]
    p = subprocess.run([*cmd, "true"], capture_output=True, text=True)
    if p.returncode != 0:
        return f"`{' '.join(cmd)} true` failed: {p.stderr.strip()}"
    return cmd


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_memory_growth(tmp_path, protocol):
    unshare = _unshare()
    if isinstance(unshare, str):
        pytest.skip(
            f"memory_growth_test.py needs ports 8000/8001 of a network namespace: {unshare}"
        )
    repo = make_repository(tmp_path, ["custom_identity_int32"])
    log = tmp_path / "serve.log"
    cmd = [
        *unshare, sys.executable, __file__, "--memory-growth-in-netns",
        str(_binary()), str(repo), str(log), protocol, "5",
    ]  # fmt: skip
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT + 60)
    r = Run(cmd, p.returncode, p.stdout, p.stderr, time.monotonic() - start)
    server_log = log.read_text(errors="replace") if log.exists() else ""
    assert r.rc == 0, f"{r.report()}\n--- tpubox serve log ---\n{server_log}"


def _lo_up():
    """Brings the namespace's loopback interface up (`ip link set lo up`, else the ioctl)."""
    if shutil.which("ip"):
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        return
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = fcntl.ioctl(s, siocgifflags, struct.pack("16sH14s", b"lo", 0, b""))
        flags = struct.unpack("16sH14s", ifr)[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b""))


def _memory_growth_in_netns(binary: str, repo: str, log: str, protocol: str, reps: str) -> int:
    """Inside the namespace: a server on 127.0.0.1:8000/8001/8002, the example against it,
    then SIGTERM. Exit status: the example's, or 3 when the server did not start or stop
    cleanly."""
    _lo_up()
    cmd = [
        binary, "serve", "--model-repository", repo, "--host", "127.0.0.1",
        "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002",
    ]  # fmt: skip
    with open(log, "wb") as f:
        server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):
                c = http.client.HTTPConnection("127.0.0.1", 8000, timeout=2)
                c.request("GET", "/v2/health/ready")
                if c.getresponse().status == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"tpubox serve did not get ready (exit {server.poll()})", flush=True)
                return 3
            time.sleep(0.2)
        example = [
            sys.executable, str(EXAMPLES / "memory_growth_test.py"), "-i", protocol, "-r", reps,
        ]  # fmt: skip
        print(f"$ {' '.join(example)}", flush=True)
        rc = subprocess.run(example, stdin=subprocess.DEVNULL, timeout=EXAMPLE_TIMEOUT).returncode
        print(f"exit {rc}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            src = server.wait(timeout=40)
        except subprocess.TimeoutExpired:
            server.kill()
            src = None
    if src != 0:
        print(f"tpubox serve exited {src} after SIGTERM", flush=True)
        return rc or 3
    return rc


if __name__ == "__main__" and sys.argv[1:2] == ["--memory-growth-in-netns"]:
    sys.exit(_memory_growth_in_netns(*sys.argv[2:7]))
