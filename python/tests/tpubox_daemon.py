"""Starts and stops a `tpubox serve` session daemon for tests and benchmarks (python/tests,
tests/notebook, python/bench).

The daemon serves the session API on a Unix socket and a TCP port, with a tokens file made
from a dict of tenants, the CPU plugin (`--plugin cpu`: what `tpubox setup cpu` installed), a
private compile cache in its directory, and no model repository. Environment: TPUBOX_BIN
(default $CARGO_TARGET_DIR/release/tpubox, else target/release/tpubox), TPUBOX_LOG (default
info).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 60.0
DRAIN_SECONDS = 5


def wait_until(pred, timeout: float = 10.0, what: str = "condition", every: float = 0.02):
    """Polls PRED every EVERY seconds until it returns something true, and returns that;
    AssertionError naming WHAT (and PRED's last value) after TIMEOUT seconds. The bound only
    keeps a broken daemon from hanging a suite; no test asserts a duration with it."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout} s (last: {v!r})")
        time.sleep(every)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of metric NAME in the Prometheus text TEXT (a daemon's
    ``GET /metrics``) whose labels include LABELS; None when there is none."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, rest = head.partition("{")
        if metric_name != name or any(f'{k}="{v}"' not in rest for k, v in labels.items()):
            continue
        total += float(value)
        seen = True
    return total if seen else None


def target_dir() -> Path:
    t = Path(os.environ.get("CARGO_TARGET_DIR") or "target")
    return t if t.is_absolute() else REPO / t


def binary() -> Path:
    """The tpubox binary, or FileNotFoundError saying how to build it."""
    p = Path(os.environ.get("TPUBOX_BIN") or target_dir() / "release" / "tpubox")
    if not p.is_file():
        raise FileNotFoundError(
            f"{p} is missing: cargo build --release -p tpubox (bash scripts/dev.sh setup does)"
        )
    return p.resolve()


def guest_wasm(name: str) -> Path:
    """A guest component built by `bash scripts/dev.sh setup` (e.g. hello-matmul)."""
    p = target_dir() / "wasm32-wasip2" / "release" / f"{name}.wasm"
    if not p.is_file():
        raise FileNotFoundError(
            f"{p} is missing: cargo build --release --target wasm32-wasip2 -p {name}"
        )
    return p.resolve()


def free_ports(n: int) -> list[int]:
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


def tokens_toml(tenants: Mapping[str, Mapping[str, Any]]) -> str:
    """The tokens file for TENANTS: name -> {"token": str, "session": {limits} or None,
    "metrics": bool (may read /metrics; default False)}."""
    out = []
    for name, t in tenants.items():
        out.append("[[tenant]]")
        out.append(f'name = "{name}"')
        out.append(f'tokens = ["{t["token"]}"]')
        if t.get("metrics"):
            out.append("metrics = true")
        session = t.get("session")
        if session is not None:
            out.append("[tenant.session]")
            for k, v in session.items():
                out.append(f"{k} = {str(v).lower() if isinstance(v, bool) else v}")
        out.append("")
    return "\n".join(out)


class Daemon:
    """One `tpubox serve` process with the session API on `socket_path` and `port`.

    Attributes:
        unix: the Unix-socket address (``unix:/...``).
        tcp: the TCP address (``127.0.0.1:PORT``).
        metrics_url: ``http://127.0.0.1:PORT/metrics``.
    """

    def __init__(
        self,
        root: Path,
        tenants: Mapping[str, Mapping[str, Any]] | None,
        *,
        extra_args: tuple[str, ...] = (),
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.tenants = tenants
        self.socket_path = self.root / "session.sock"
        self.port, self.metrics_port = free_ports(2)
        self.log_path = self.root / "serve.log"
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def unix(self) -> str:
        return f"unix:{self.socket_path}"

    @property
    def tcp(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def command(self) -> list[str]:
        cmd = [
            str(binary()), "serve",
            "--session-socket", str(self.socket_path),
            "--session-port", str(self.port),
            "--metrics-port", str(self.metrics_port),
            "--plugin", "cpu",
            "--cache-dir", str(self.root / "cache"),
            "--drain-seconds", str(DRAIN_SECONDS),
        ]  # fmt: skip
        if self.tenants is not None:
            tokens = self.root / "tokens.toml"
            tokens.write_text(tokens_toml(self.tenants))
            cmd += ["--tokens", str(tokens)]
        return cmd + list(self.extra_args)

    def start(self) -> Daemon:
        cmd = self.command()
        env = dict(os.environ)
        env.setdefault("TPUBOX_LOG", "info")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env=env,
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"tpubox serve exited {self.proc.returncode} before it was ready:\n"
                    f"{' '.join(cmd)}\n--- log ---\n{self.log()}"
                )
            if "session API listening" in self.log() and self.socket_path.exists():
                if self._tcp_open():
                    return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"tpubox serve not ready after {READY_TIMEOUT:.0f} s:\n{' '.join(cmd)}\n"
                    f"--- log ---\n{self.log()}"
                )
            time.sleep(0.05)

    def _tcp_open(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self, timeout: float = DRAIN_SECONDS + 15) -> int | None:
        """SIGTERM, then SIGKILL after TIMEOUT; returns the exit status (None: killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL (the daemon dies at once, as in a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def metrics(self, token: str | None = None) -> str:
        """The /metrics text, read with TOKEN (default: the first tenant with `metrics`; with
        a tokens file /metrics answers only such a tenant, 401 or 403 to others)."""
        from urllib.request import Request, urlopen

        if token is None and self.tenants is not None:
            token = next((t["token"] for t in self.tenants.values() if t.get("metrics")), None)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with urlopen(Request(self.metrics_url, headers=headers), timeout=5) as r:
            return r.read().decode()

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
