"""Notebook kernels on a tpubox daemon, end to end: the real jupyter_client and ipykernel
(pinned in scripts/venvs/python.txt), kernelspecs installed with `python -m tpubox.kernelspec
install` into a private Jupyter data directory, kernels started through the
`tpubox-provisioner` kernel provisioner, cells run over the kernel protocol.

The daemon is python/tests/tpubox_daemon.Daemon (the session API on a Unix socket and a TCP
port, the CPU plugin). `bash scripts/dev.sh test` builds it and installs ./python first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "tests"))

from tpubox_daemon import Daemon, binary  # noqa: E402

ALICE = "alice-notebook-token"
BOB = "bob-notebook-token"
# alice's tenant allows 64 MiB; her kernelspec narrows it to 16 MiB.
ALICE_KERNEL_LIMIT = 16 << 20

TENANTS = {
    "alice": {"token": ALICE, "session": {"max_device_mib": 64}},
    "bob": {"token": BOB, "session": {"max_device_mib": 256}},
}

_DAEMON: Daemon | None = None


@pytest.fixture(scope="session")
def jupyter_dirs(tmp_path_factory):
    """A private Jupyter world: kernelspecs under PREFIX/share/jupyter, runtime and config dirs
    of its own, an IPython dir of its own; nothing written under ~."""
    root = tmp_path_factory.mktemp("jupyter")
    env = {
        "JUPYTER_PATH": str(root / "prefix" / "share" / "jupyter"),
        "JUPYTER_DATA_DIR": str(root / "data"),
        "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
        "JUPYTER_CONFIG_DIR": str(root / "config"),
        "IPYTHONDIR": str(root / "ipython"),
        "JUPYTER_PLATFORM_DIRS": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        # What `{user}` in a token file path stands for (else the login name).
        "TPUBOX_USER": "alice",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield root


def install_kernelspec(root: Path, name: str, *args: str) -> Path:
    """Runs the install command; returns the kernelspec directory."""
    out = subprocess.run(
        [sys.executable, "-m", "tpubox.kernelspec", "install", "--name", name,
         "--prefix", str(root / "prefix"), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    d = root / "prefix" / "share" / "jupyter" / "kernels" / name
    assert (d / "kernel.json").is_file(), out.stdout
    return d


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    global _DAEMON
    try:
        binary()
    except FileNotFoundError as e:
        pytest.exit(str(e), returncode=1)
    d = Daemon(tmp_path_factory.mktemp("daemon"), TENANTS)
    d.start()
    _DAEMON = d
    yield d
    rc = d.stop()
    assert rc == 0, f"tpubox serve exited {rc} after SIGTERM (want 0)\n{d.log()[-4000:]}"


@pytest.fixture(scope="session")
def kernelspecs(jupyter_dirs, daemon):
    """tpubox-alice (token file, over the Unix socket, 16 MiB) and tpubox-bob (token, TCP)."""
    (jupyter_dirs / "alice.token").write_text(ALICE + "\n")
    a = install_kernelspec(
        jupyter_dirs, "tpubox-alice",
        "--address", daemon.unix, "--token-file", str(jupyter_dirs / "{user}.token"),
        "--limit", f"max_device_bytes={ALICE_KERNEL_LIMIT >> 20}MiB",
        "--display-name", "Python (tpubox, alice)",
    )  # fmt: skip
    b = install_kernelspec(
        jupyter_dirs, "tpubox-bob", "--address", daemon.tcp, "--token", BOB,
        "--label", "bob {kernel_id}",
    )  # fmt: skip
    return {"alice": a, "bob": b}


def kernel_spec_json(d: Path) -> dict:
    return json.loads((d / "kernel.json").read_text())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _DAEMON is not None and exitstatus != 0:
        tail = "\n".join(_DAEMON.log().splitlines()[-80:])
        terminalreporter.section("tpubox serve log (last 80 lines)")
        terminalreporter.write_line(tail)
