"""The tpubox Python client against a real `tpubox serve` session daemon.

One daemon for the whole run (tpubox_daemon.Daemon: the session API on a Unix socket and a TCP
port, the CPU plugin, a private compile cache) with the tenants of TENANTS; tests that kill a
daemon start their own. `bash scripts/dev.sh test` builds the daemon and the guests, makes the
venv ($CACHE/venv-python) and installs ./python into it first.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# JAX in this process gets 4 CPU devices, whichever test module imports it first: the sharded
# tests (test_sharded.py) compare with JAX over a mesh of 4, as JAX tests its own multi-device
# code (`jax_num_cpu_devices`); programs of one device are unaffected.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import tpubox  # noqa: E402
from tpubox_daemon import Daemon, binary, guest_wasm  # noqa: E402

ALICE = "alice-token"  # room for the 64 MiB round trip
BOB = "bob-token"  # the tenant's default limits
SMALL = "carol-token"  # 1 MiB of device memory
NO_SESSIONS = "dave-token"  # no [tenant.session]: may not open sessions
FEW = "erin-token"  # at most 2 sessions at once
EXITS = "frank-token"  # used only by the tests of sessions whose process goes away
BUDGET = "grace-token"  # 4 MiB per session, 6 MiB for all her sessions together

TENANTS = {
    # alice also reads /metrics.
    "alice": {
        "token": ALICE,
        "session": {"max_device_mib": 1024, "max_sessions": 8},
        "metrics": True,
    },
    "bob": {"token": BOB, "session": {}},
    "carol": {"token": SMALL, "session": {"max_device_mib": 1, "max_live_tensors": 50}},
    "dave": {"token": NO_SESSIONS, "session": None},
    "erin": {"token": FEW, "session": {"max_sessions": 2}},
    "frank": {"token": EXITS, "session": {"max_device_mib": 64}},
    "grace": {"token": BUDGET, "session": {"max_device_mib": 4, "tenant_max_device_mib": 6}},
}

_DAEMON: Daemon | None = None

# tpubox.torch's tests (python/tests/pytorch) run from the venv that has PyTorch
# ($CACHE/venv-torch); elsewhere they are not collected.
collect_ignore = [] if importlib.util.find_spec("torch") else ["pytorch"]


def _tpubox_bin_or_exit() -> None:
    try:
        binary()
    except FileNotFoundError as e:
        pytest.exit(str(e), returncode=1)


# The weight set `tiny` the shared daemon holds (--weights tiny=FILE): name -> array.
TINY_WEIGHTS = {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3) / 4,
    "b": np.array([1.5, -2, 0.25, 8], ml_dtypes.bfloat16),
    "n": np.array(7, np.int32),
}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A .safetensors file: an 8-byte little-endian header length, the JSON header (dtype,
    shape, data_offsets of each tensor), then the tensors' bytes."""
    names = {"float32": "F32", "bfloat16": "BF16", "int32": "I32"}
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": names[a.dtype.name],
            "shape": list(a.shape),
            "data_offsets": [off, off + len(raw)],
        }
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    """The shared daemon (Daemon: .unix, .tcp, .metrics_url, .log()), holding the weight set
    `tiny` and offering the component `hello-matmul` by name."""
    global _DAEMON
    _tpubox_bin_or_exit()
    root = tmp_path_factory.mktemp("daemon")
    write_safetensors(root / "tiny.safetensors", TINY_WEIGHTS)
    extra = ["--weights", f"tiny={root / 'tiny.safetensors'}"]
    try:
        hello = guest_wasm("hello-matmul")
        (root / "components").mkdir()
        shutil.copy(hello, root / "components" / "hello-matmul.wasm")
        extra += ["--components", str(root / "components")]
    except FileNotFoundError:
        pass  # test_run says what is missing
    d = Daemon(root, TENANTS, extra_args=tuple(extra))
    d.start()
    _DAEMON = d
    yield d
    rc = d.stop()
    assert rc == 0, f"tpubox serve exited {rc} after SIGTERM (want 0)\n{d.log()[-4000:]}"


@pytest.fixture
def own_daemon(tmp_path):
    """A daemon of the test's own (to kill)."""
    _tpubox_bin_or_exit()
    d = Daemon(tmp_path / "own-daemon", TENANTS)
    d.start()
    yield d
    d.kill()


@pytest.fixture
def alice(daemon):
    """A session of tenant alice over the Unix socket, closed after the test."""
    with tpubox.connect(daemon.unix, ALICE, label="pytest alice") as s:
        yield s


@pytest.fixture(params=["local", "grpc"])
def s(request, daemon):
    """A session of tenant alice over the Unix socket, once with tensor data, executions and
    frees through the daemon's local socket and once all through gRPC."""
    local = request.param == "local"
    with tpubox.connect(daemon.unix, ALICE, local=local, label=f"pytest {request.param}") as s:
        assert s.transport == request.param
        yield s


@pytest.fixture
def bob(daemon):
    """A session of tenant bob over TCP."""
    with tpubox.connect(daemon.tcp, BOB, label="pytest bob") as s:
        yield s


@pytest.fixture(params=["local", "grpc"])
def small(request, daemon):
    """A session of tenant carol (1 MiB of device memory), local socket or gRPC."""
    with tpubox.connect(daemon.unix, SMALL, local=request.param == "local") as s:
        assert s.transport == request.param
        yield s


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _DAEMON is not None and exitstatus != 0:
        tail = "\n".join(_DAEMON.log().splitlines()[-100:])
        terminalreporter.section("tpubox serve log (last 100 lines)")
        terminalreporter.write_line(str(_DAEMON.log_path))
        terminalreporter.write_line(tail)
