"""The daemon under attack, and what the adversarial tests measure on it.

`Daemon` is one `tpubox serve` with every door open: REST, gRPC and metrics on loopback
ports, the session API on a Unix socket (and its local socket `PATH.local`) and a TCP port,
the dtypes model (examples/serve-dtypes) in a model repository, and three tenants:

- `probe`: a well-behaved client whose latency the tests watch while others attack;
- `attacker`: a tenant with a valid token that abuses what it is allowed to do;
- `ops`: repository control, metrics and the admin calls.

A test gives the daemon small limits (descriptors via RLIMIT_NOFILE, short timeouts via the
CLI flags in EXTRA_ARGS) so that each abuse fits in seconds. Environment: TPUBOX_BIN,
CARGO_TARGET_DIR, TPUBOX_LOG (default info).
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import resource
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "serve"))
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "python" / "tests"))

from tpubox_daemon import binary, free_ports, target_dir  # noqa: E402  (python/tests)

READY_TIMEOUT = 120.0
DRAIN_SECONDS = 5

PROBE = "probe-token"
ATTACKER = "attacker-token"
OPS = "ops-token"

TENANTS: dict[str, dict[str, Any]] = {
    "probe": {"token": PROBE, "models": ["*"], "session": {"max_device_mib": 64}},
    "attacker": {
        "token": ATTACKER,
        "models": ["dtypes"],
        "session": {"max_device_mib": 128, "max_sessions": 4},
    },
    "ops": {
        "token": OPS,
        "models": ["*"],
        "repository_control": True,
        "metrics": True,
        "admin": True,
    },
}


def tokens_toml(tenants: Mapping[str, Mapping[str, Any]]) -> str:
    """The tokens file for TENANTS (name -> token, models, flags, optional session table)."""
    out = []
    for name, t in tenants.items():
        out.append("[[tenant]]")
        out.append(f'name = "{name}"')
        out.append(f'tokens = ["{t["token"]}"]')
        out.append("models = [" + ", ".join(f'"{m}"' for m in t.get("models", [])) + "]")
        for k, v in t.items():
            if k in ("token", "models", "session"):
                continue
            out.append(f"{k} = {json.dumps(v)}")
        session = t.get("session")
        if session is not None:
            out.append("[tenant.session]")
            for k, v in session.items():
                out.append(f"{k} = {json.dumps(v)}")
        out.append("")
    return "\n".join(out)


class Daemon:
    """One `tpubox serve` with every door open (see the module docs).

    NOFILE: the daemon's descriptor limit (soft and hard), None to inherit.
    TENANTS: None for no tokens file (everyone is `anonymous`).
    TLS: certificates (certs.Certs) to serve every TCP door with TLS; CLIENT_AUTH then adds
    `--tls-client-ca` (the test CA) with that mode (`required` or `optional`).
    """

    def __init__(
        self,
        root: Path,
        *,
        extra_args: tuple[str, ...] = (),
        nofile: int | None = None,
        tenants: Mapping[str, Mapping[str, Any]] | None = TENANTS,
        repository: bool = True,
        env: Mapping[str, str] | None = None,
        bind: str | None = None,
        tls: Any = None,
        client_auth: str | None = None,
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.extra_args = tuple(extra_args)
        self.nofile = nofile
        self.tenants = tenants
        self.repository = repository
        self.env = dict(env or {})
        self.host = "127.0.0.1"
        self.bind = bind or self.host
        self.http_port, self.grpc_port, self.metrics_port, self.session_port = free_ports(4)
        self.socket_path = self.root / "session.sock"
        self.local_path = self.root / "session.sock.local"
        self.log_path = self.root / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.tls = tls
        self.client_auth = client_auth

    def client_ssl(self, with_cert: bool = True) -> ssl.SSLContext:
        """An SSL context that trusts the test CA (and presents the test client certificate
        when the daemon asks for one and WITH_CERT)."""
        ctx = ssl.create_default_context(cafile=str(self.tls.ca.cert))
        if with_cert and self.client_auth:
            ctx.load_cert_chain(str(self.tls.client.cert), str(self.tls.client.key))
        return ctx

    def connection(self, port: int, timeout: float = 30.0) -> http.client.HTTPConnection:
        """An HTTP (HTTPS with TLS) connection to PORT."""
        if self.tls is None:
            return http.client.HTTPConnection(self.host, port, timeout=timeout)
        return http.client.HTTPSConnection(self.host, port, timeout=timeout, context=self.client_ssl())

    # Addresses.
    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def session_tcp(self) -> str:
        return f"{self.host}:{self.session_port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _repo(self) -> Path:
        target = target_dir() / "wasm32-wasip2" / "release"
        repo = self.root / "repo"
        (repo / "dtypes").mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "examples/serve-dtypes/config.toml", repo / "dtypes" / "config.toml")
        wasm = target / "serve_dtypes.wasm"
        if not wasm.is_file():
            raise FileNotFoundError(
                f"{wasm} is missing: cargo build --release --target wasm32-wasip2 -p serve-dtypes"
            )
        shutil.copy(wasm, repo / "dtypes" / "model.wasm")
        return repo

    def command(self) -> list[str]:
        cmd = [
            str(binary()), "serve",
            "--host", self.bind,
            "--http-port", str(self.http_port),
            "--grpc-port", str(self.grpc_port),
            "--metrics-port", str(self.metrics_port),
            "--session-socket", str(self.socket_path),
            "--session-port", str(self.session_port),
            "--plugin", "cpu",
            "--cache-dir", str(self.root / "cache"),
            "--drain-seconds", str(DRAIN_SECONDS),
        ]  # fmt: skip
        if self.repository:
            cmd += ["--model-repository", str(self._repo())]
        if self.tenants is not None:
            tokens = self.root / "tokens.toml"
            tokens.write_text(tokens_toml(self.tenants))
            cmd += ["--tokens", str(tokens)]
        if self.tls is not None:
            cmd += ["--tls-cert", str(self.tls.server.cert), "--tls-key", str(self.tls.server.key)]
            if self.client_auth:
                cmd += ["--tls-client-ca", str(self.tls.ca.cert), "--tls-client-auth", self.client_auth]
        return cmd + list(self.extra_args)

    def start(self) -> Daemon:
        cmd = self.command()
        env = dict(os.environ)
        env.setdefault("TPUBOX_LOG", "info")
        env.update(self.env)
        nofile = self.nofile

        def limits():
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env=env,
                # Only when needed: Python code between fork and exec in a process whose gRPC
                # threads are busy (test_crash.py restarts a daemon under load) can abort the
                # child (gRPC's fork handlers); without it Popen uses vfork.
                preexec_fn=limits if nofile is not None else None,
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"tpubox serve exited {self.proc.returncode} before it was ready:\n"
                    f"{' '.join(cmd)}\n--- log ---\n{self.log()}"
                )
            if self._ready():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"tpubox serve not ready after {READY_TIMEOUT:.0f} s:\n{' '.join(cmd)}\n"
                    f"--- log ---\n{self.log()}"
                )
            time.sleep(0.1)

    def _ready(self) -> bool:
        if "session API listening" not in self.log():
            return False
        if not self.repository:
            return True
        try:
            return request(self, "GET", "/v2/health/ready", timeout=2).status == 200
        except OSError:
            return False

    def stop(self, timeout: float = DRAIN_SECONDS + 15) -> int | None:
        """SIGTERM, then SIGKILL after TIMEOUT; the exit status (None: it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    # What the tests measure.
    def rss_mib(self) -> float:
        """Resident memory now (VmRSS), MiB."""
        return _status_kib(self.pid, "VmRSS") / 1024

    def peak_mib(self) -> float:
        """Peak resident memory (VmHWM) since the last reset_peak(), MiB."""
        return _status_kib(self.pid, "VmHWM") / 1024

    def reset_peak(self) -> None:
        """Resets VmHWM to the current RSS (proc(5): writing 5 to clear_refs)."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def threads(self) -> int:
        return _status_kib(self.pid, "Threads")

    def cpu_seconds(self) -> float:
        """User + system CPU time the daemon has used, seconds."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metrics(self, token: str | None = OPS) -> str:
        """The /metrics text (with TOKEN, as a tenant allowed to read it)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn = self.connection(self.metrics_port, timeout=10)
        try:
            conn.request("GET", "/metrics", headers=headers)
            r = conn.getresponse()
            body = r.read().decode()
            assert r.status == 200, f"/metrics: {r.status} {body[:200]}"
            return body
        finally:
            conn.close()

    def protection_count(self, name: str) -> float:
        """tpubox_protection_triggered_total{protection=NAME} (0 when absent)."""
        for line in self.metrics().splitlines():
            if line.startswith("tpubox_protection_triggered_total{") and f'protection="{name}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class Response:
    def __init__(self, status: int, headers: dict, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"Response({self.status}, {self.body[:300]!r})"


def request(d: Daemon, method: str, path: str, body=None, headers=None, timeout=30.0, port=None) -> Response:
    """One HTTP/1.1 request on a fresh connection (BODY: bytes, str or JSON-able)."""
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
        headers = {"Content-Type": "application/json", **(headers or {})}
    if isinstance(body, str):
        body = body.encode()
    conn = d.connection(port or d.http_port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def admin(d: Daemon, *args: str, token: str | None = OPS, extra: tuple[str, ...] = ()):
    """`tpubox admin [EXTRA] ARGS` against D's metrics port, the token from the environment;
    returns (exit status, stdout, stderr)."""
    scheme = "https" if d.tls is not None else "http"
    env = dict(os.environ)
    env.pop("TPUBOX_ADMIN_TOKEN", None)
    if token is not None:
        env["TPUBOX_ADMIN_TOKEN"] = token
    r = subprocess.run(
        [str(binary()), "admin", "--url", f"{scheme}://{d.host}:{d.metrics_port}", *extra, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    return r.returncode, r.stdout, r.stderr


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def dtypes_body(n: int = 4) -> dict:
    """A JSON inference request for the dtypes model: every INPUT_<DT> of shape [1, N]."""
    import serve_util

    data = serve_util.dtypes_data(shape=(1, n), seed=1)
    inputs = []
    for dt, arr in data.items():
        if dt == "BF16":
            vals = [float(x) for x in arr.astype("float32").flat]
        else:
            vals = [serve_util.json_value(dt, x) for x in arr.flat]
        inputs.append({"name": f"INPUT_{dt}", "shape": list(arr.shape), "datatype": dt, "data": vals})
    return {"inputs": inputs}


def probe_infer(d: Daemon, timeout: float = 30.0) -> float:
    """One REST inference of the dtypes model as the probe tenant; its latency in seconds.
    Raises AssertionError unless it answers 200."""
    t = time.perf_counter()
    r = request(d, "POST", "/v2/models/dtypes/infer", _probe_body(), bearer(PROBE), timeout=timeout)
    dt = time.perf_counter() - t
    assert r.status == 200, f"the probe's inference failed: {r!r}"
    return dt


@functools.cache
def _probe_body() -> dict:
    return dtypes_body()


def p99(samples: list[float]) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


class Prober:
    """Runs the probe tenant's inference in a loop on a thread while an attack runs; the
    latencies land in `samples`, the failures in `errors`."""

    def __init__(self, d: Daemon, call: Callable[[Daemon], float] = probe_infer, pause: float = 0.02):
        self.d, self.call, self.pause = d, call, pause
        self.samples: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append(self.call(self.d))
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.errors.append(repr(e))
            time.sleep(self.pause)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)


def baseline_p99(d: Daemon, n: int = 60, call: Callable[[Daemon], float] = probe_infer) -> float:
    """The probe's p99 latency with nobody attacking (N calls after a warm-up)."""
    for _ in range(5):
        call(d)
    return p99([call(d) for _ in range(n)])


def assert_probe_held(base: float, prober: Prober, factor: float = 3.0, floor: float = 0.05):
    """The probe kept working under attack, with p99 within FACTOR x its baseline (a baseline
    under FLOOR seconds counts as FLOOR: on 2 shared cores a few ms is noise)."""
    assert not prober.errors, f"the probe failed under attack: {prober.errors[:5]}"
    assert len(prober.samples) >= 10, f"the probe ran only {len(prober.samples)} times"
    got = p99(prober.samples)
    limit = factor * max(base, floor)
    assert got <= limit, (
        f"the probe's p99 rose to {got * 1e3:.1f} ms under attack "
        f"(baseline {base * 1e3:.1f} ms, limit {limit * 1e3:.1f} ms; median "
        f"{statistics.median(prober.samples) * 1e3:.1f} ms)"
    )


def settle_rss(d: Daemon, baseline_mib: float, slack_mib: float = 64.0, wait: float = 15.0) -> float:
    """Waits up to WAIT s for RSS to come back within SLACK of BASELINE; returns the last RSS.
    (glibc returns freed memory lazily: the daemon trims its heap after large frees.)"""
    deadline = time.monotonic() + wait
    while True:
        rss = d.rss_mib()
        if rss <= baseline_mib + slack_mib or time.monotonic() > deadline:
            return rss
        time.sleep(0.25)
