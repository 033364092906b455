"""`tpubox serve` (docs/SERVING.md) under test: one daemon for the whole session, serving a model
repository assembled here from the built guests:

    repo/dtypes/  config.toml (examples/serve-dtypes), model.wasm (serve_dtypes.wasm)
    repo/minilm/  config.toml (examples/minilm-serve), model.wasm (minilm_serve.wasm),
                  and every file of the MiniLM model directory (`tpubox setup minilm`)

with the tenants of serve_util.TENANTS. `bash scripts/dev.sh test` builds all of it first.

Environment: TPUBOX_BIN (default target/release/tpubox), CARGO_TARGET_DIR, TPUBOX_MINILM_DIR
(default: what `tpubox setup minilm` prints), TPUBOX_MINILM_REFERENCE, TPUBOX_LOG (default info).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_util  # noqa: E402
from serve_util import REPO, TENANTS  # noqa: E402

READY_TIMEOUT = 120.0  # start-up: models load (and MiniLM compiles) before /v2/health/ready
DRAIN_SECONDS = 30  # tpubox serve's default --drain-seconds

_SERVER = None  # for the failure summary


def _target_dir() -> Path:
    t = Path(os.environ.get("CARGO_TARGET_DIR") or "target")
    return t if t.is_absolute() else REPO / t


def _need(path: Path, hint: str) -> Path:
    if not path.exists():
        pytest.exit(f"{path} is missing: {hint}", returncode=1)
    return path


def _binary() -> Path:
    return _need(
        Path(os.environ.get("TPUBOX_BIN") or _target_dir() / "release" / "tpubox"),
        "cargo build --release -p tpubox (bash scripts/dev.sh setup does)",
    ).resolve()


def _minilm_dir(binary: Path) -> Path:
    env = os.environ.get("TPUBOX_MINILM_DIR")
    if env:
        return _need(Path(env), "TPUBOX_MINILM_DIR names no directory")
    out = subprocess.run(
        [str(binary), "setup", "minilm"], capture_output=True, text=True, timeout=900
    )
    for line in out.stdout.splitlines():
        if line.startswith("minilm: "):
            return _need(Path(line.removeprefix("minilm: ").strip()), "tpubox setup minilm")
    pytest.exit(
        f"`tpubox setup minilm` printed no `minilm: DIR` line (exit {out.returncode}):\n"
        f"{out.stdout}\n{out.stderr}",
        returncode=1,
    )


def _place(src: Path, dst: Path):
    """DST as a hard link to SRC (a copy across file systems); directories recreated.

    Not a symlink: the guest reads the model directory through WASI (cap-std), which refuses
    symlinks that lead outside the directory it was granted."""
    if src.is_dir():
        dst.mkdir()
        for child in src.iterdir():
            _place(child, dst / child.name)
        return
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copy2(src, dst)


def _tokens_toml() -> str:
    out = []
    for name, t in TENANTS.items():
        out.append("[[tenant]]")
        out.append(f'name = "{name}"')
        out.append(f'tokens = ["{t["token"]}"]')
        out.append("models = [" + ", ".join(f'"{m}"' for m in t["models"]) + "]")
        for key in ("max_in_flight", "max_requests_per_second"):
            if key in t:
                out.append(f"{key} = {t[key]}")
        if t.get("repository_control"):
            out.append("repository_control = true")
        if t.get("metrics"):
            out.append("metrics = true")
        out.append("")
    return "\n".join(out)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    host = "127.0.0.1"

    def __init__(self, root: Path, repo: Path, tokens: Path, log: Path, ports: list[int]):
        self.root = root
        self.repo = repo
        self.tokens = tokens
        self.log_path = log
        self.http_port, self.grpc_port, self.metrics_port = ports
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def ready_status(self) -> int | None:
        conn = HTTPConnection(self.host, self.http_port, timeout=2)
        try:
            conn.request("GET", "/v2/health/ready")
            resp = conn.getresponse()
            resp.read()
            return resp.status
        except OSError:
            return None
        finally:
            conn.close()



def _copy_headers_on_infer():
    """tritonclient.http's `infer` writes `Inference-Header-Content-Length` into the headers
    dict it is given, so a dict shared between calls would carry a stale length into the next
    plain-JSON request. Every test passes such shared dicts: give `infer` a copy."""
    import tritonclient.http as httpclient

    original = httpclient.InferenceServerClient.infer
    if getattr(original, "_copies_headers", False):
        return

    def infer(self, *args, headers=None, **kwargs):
        return original(self, *args, headers=dict(headers) if headers else headers, **kwargs)

    infer._copies_headers = True
    httpclient.InferenceServerClient.infer = infer


_copy_headers_on_infer()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    global _SERVER
    binary = _binary()
    target = _target_dir() / "wasm32-wasip2" / "release"
    build_hint = "cargo build --release --target wasm32-wasip2 -p {} (bash scripts/dev.sh setup does)"
    dtypes_wasm = _need(target / "serve_dtypes.wasm", build_hint.format("serve-dtypes"))
    minilm_wasm = _need(target / "minilm_serve.wasm", build_hint.format("minilm-serve"))
    dtypes_config = _need(REPO / "examples/serve-dtypes/config.toml", "the dtypes guest's config")
    minilm_config = _need(REPO / "examples/minilm-serve/config.toml", "the MiniLM guest's config")
    minilm_dir = _minilm_dir(binary)

    root = tmp_path_factory.mktemp("serve")
    repo = root / "repo"
    (repo / "dtypes").mkdir(parents=True)
    shutil.copy(dtypes_config, repo / "dtypes" / "config.toml")
    shutil.copy(dtypes_wasm, repo / "dtypes" / "model.wasm")
    (repo / "minilm").mkdir()
    # The config's `[tpubox] files = "files"`: the guest reads this directory at /model.
    (repo / "minilm" / "files").symlink_to(minilm_dir.resolve(), target_is_directory=True)
    shutil.copy(minilm_config, repo / "minilm" / "config.toml")
    shutil.copy(minilm_wasm, repo / "minilm" / "model.wasm")
    tokens = root / "tokens.toml"
    tokens.write_text(_tokens_toml())

    srv = Server(root, repo, tokens, root / "serve.log", _free_ports(3))
    _SERVER = srv
    cmd = [
        str(binary), "serve",
        "--model-repository", str(repo),
        "--tokens", str(tokens),
        "--host", srv.host,
        "--http-port", str(srv.http_port),
        "--grpc-port", str(srv.grpc_port),
        "--metrics-port", str(srv.metrics_port),
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("TPUBOX_LOG", "info")
    with open(srv.log_path, "wb") as log:
        srv.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env
        )
    served = False
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if srv.proc.poll() is not None:
                pytest.fail(
                    f"tpubox serve exited {srv.proc.returncode} before it was ready:\n"
                    f"{' '.join(cmd)}\n--- log ---\n{srv.log()}",
                    pytrace=False,
                )
            if srv.ready_status() == 200:
                break
            if time.monotonic() > deadline:
                pytest.fail(
                    f"tpubox serve not ready after {READY_TIMEOUT:.0f} s "
                    f"(GET /v2/health/ready: {srv.ready_status()}):\n{' '.join(cmd)}\n"
                    f"--- log ---\n{srv.log()}",
                    pytrace=False,
                )
            time.sleep(0.2)
        served = True
        yield srv
    finally:
        # SIGTERM: stop accepting, drain (nothing is in flight by now), exit 0.
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)
            try:
                rc = srv.proc.wait(timeout=DRAIN_SECONDS + 10)
            except subprocess.TimeoutExpired:
                srv.proc.kill()
                srv.proc.wait()
                rc = None
        else:
            rc = srv.proc.returncode
        if served:
            if rc is None:
                pytest.fail(
                    f"tpubox serve still running {DRAIN_SECONDS + 10} s after SIGTERM\n"
                    f"--- log ---\n{srv.log()}",
                    pytrace=False,
                )
            if rc != 0:
                pytest.fail(
                    f"tpubox serve exited {rc} after SIGTERM (want 0)\n--- log ---\n{srv.log()}",
                    pytrace=False,
                )


@pytest.fixture(name="http")
def http_fixture(server):
    """A tritonclient.http client (one per test: the client is not thread-safe)."""
    client = serve_util.http_client(server)
    yield client
    client.close()


@pytest.fixture(name="grpc")
def grpc_fixture(server):
    """A tritonclient.grpc client."""
    client = serve_util.grpc_client(server)
    yield client
    client.close()


@pytest.fixture(scope="session")
def reference():
    return serve_util.load_reference()


@pytest.fixture(scope="session")
def model_configs(server):
    """Each model's configuration as GET /v2/models/{m}/config returns it."""
    out = {}
    for m in ("dtypes", "minilm"):
        resp = serve_util.request(
            server, "GET", f"/v2/models/{m}/config", headers=serve_util.http_headers()
        )
        assert resp.status == 200, f"GET /v2/models/{m}/config: {resp!r}"
        out[m] = resp.json()
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _SERVER is not None and exitstatus != 0:
        tail = "\n".join(_SERVER.log().splitlines()[-200:])
        terminalreporter.section("tpubox serve log (last 200 lines)")
        terminalreporter.write_line(f"{_SERVER.log_path}")
        terminalreporter.write_line(tail)
