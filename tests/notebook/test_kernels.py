"""Kernels started through the tpubox provisioner: each gets a session of its own tenant,
tensors live across cells, kernels are isolated and limited, shutdown and restart give the
device back, and a daemon that goes away makes the next cell fail at once."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import time

import pytest
from conftest import ALICE, ALICE_KERNEL_LIMIT, BOB, TENANTS, install_kernelspec, kernel_spec_json
from jupyter_client.manager import start_new_kernel
from tpubox_daemon import Daemon

import tpubox

CELL_TIMEOUT = 120


class Kernel:
    """A started kernel (its manager and client) and a way to run cells in it."""

    def __init__(self, name: str):
        self.km, self.kc = start_new_kernel(kernel_name=name, startup_timeout=120)
        self.provisioner_after = None

    @property
    def provisioner(self):
        return self.km.provisioner if self.km is not None else self.provisioner_after

    def run(self, code: str, timeout: float = CELL_TIMEOUT) -> dict:
        """Runs CODE as a cell: {"status", "stdout", "stderr", "error": (ename, evalue) or None,
        "result": text/plain or None}."""
        out = {"stdout": "", "stderr": "", "error": None, "result": None}

        def hook(msg):
            t, c = msg["msg_type"], msg["content"]
            if t == "stream":
                out[c["name"]] += c["text"]
            elif t == "error":
                out["error"] = (c["ename"], c["evalue"])
            elif t == "execute_result":
                out["result"] = c["data"].get("text/plain")

        reply = self.kc.execute_interactive(
            textwrap.dedent(code), timeout=timeout, output_hook=hook, allow_stdin=False
        )
        out["status"] = reply["content"]["status"]
        return out

    def ok(self, code: str, timeout: float = CELL_TIMEOUT) -> str:
        """Runs CODE, which must succeed; returns its stdout."""
        r = self.run(code, timeout)
        assert r["status"] == "ok", (
            f"cell failed: {r['error']}\n{r['stderr']}\n--- cell ---\n{code}"
        )
        return r["stdout"]

    def shutdown(self) -> None:
        """Shuts the kernel down (as Jupyter does: a shutdown request, then cleanup); again: a
        no-op."""
        if self.km is None:
            return
        km, self.km = self.km, None
        self.provisioner_after = km.provisioner
        self.kc.stop_channels()
        km.shutdown_kernel(now=False)


@pytest.fixture(scope="module")
def kernel_a(kernelspecs):
    k = Kernel("tpubox-alice")
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def kernel_b(kernelspecs):
    k = Kernel("tpubox-bob")
    yield k
    k.shutdown()


def usage(daemon, token):
    return tpubox.tenant_usage(daemon.unix, token)



def test_kernelspecs(kernelspecs, daemon):
    a = kernel_spec_json(kernelspecs["alice"])
    assert a["argv"] == [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    assert a["display_name"] == "Python (tpubox, alice)"
    prov = a["metadata"]["kernel_provisioner"]
    assert prov["provisioner_name"] == "tpubox-provisioner"
    assert prov["config"]["address"] == daemon.unix
    assert prov["config"]["limits"] == {"max_device_bytes": ALICE_KERNEL_LIMIT}
    assert "token" not in prov["config"] and prov["config"]["token_file"].endswith("/{user}.token")
    # A kernelspec holding a token is its owner's only.
    b = kernelspecs["bob"]
    assert kernel_spec_json(b)["metadata"]["kernel_provisioner"]["config"]["token"] == BOB
    assert stat.S_IMODE(os.stat(b / "kernel.json").st_mode) == 0o600
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().find_kernel_specs()
    assert {"tpubox-alice", "tpubox-bob"} <= set(specs)


def test_tensors_live_across_cells(kernel_a, daemon):
    s_id = kernel_a.provisioner.session.session_id
    out = kernel_a.ok(
        """
        import numpy as np, tpubox
        s = tpubox.connect()
        x = s.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
        print(s.session_id, s.tenant, s.owned, s.transport, x.handle)
        """
    )
    sid, tenant, owned, transport, handle = out.split()
    # Over the Unix socket, on the daemon's machine: tensor data through the local socket.
    assert (sid, tenant, owned, transport) == (s_id, "alice", "False", "local")
    # A later cell uses the tensor, compiles a program, runs tpubox.jax.jit on it.
    out = kernel_a.ok(
        """
        add = s.compile('''func.func @main(%a: tensor<2x3xf32>) -> tensor<2x3xf32> {
            %0 = stablehlo.add %a, %a : tensor<2x3xf32>
            func.return %0 : tensor<2x3xf32> }''')
        (y,) = add(x)
        print(y.numpy().tolist())
        """
    )
    assert json.loads(out) == [[0, 2, 4], [6, 8, 10]]
    out = kernel_a.ok(
        """
        import jax.numpy as jnp, tpubox.jax
        f = tpubox.jax.jit(lambda v: jnp.sum(jnp.tanh(v) * 0 + v))
        print(float(f(y).numpy()), f.compiles)
        """
    )
    assert out.split() == ["30.0", "1"]
    u = usage(daemon, ALICE)
    assert u.sessions == 1 and u.usage.live_tensors >= 3 and u.usage.compiles == 2
    kernel_a.ok("print(x.handle)")  # still there
    pytest.handle_a = int(handle)  # for the isolation test


def test_the_same_cell_in_two_kernels_compiles_once(kernel_a, kernel_b):
    # Each kernel's cell has its own file name (it holds the kernel's pid); tpubox.jax exports
    # without source locations, so the second kernel's program is the first one's bytes and
    # the daemon's in-memory tier serves it: nothing is charged to the second session.
    cell = """
        import numpy as np, jax.numpy as jnp, tpubox, tpubox.jax
        s = tpubox.connect()
        def cell_fn(x, y):
            return jnp.tanh(x @ y) * 0.8125 + 0.1875
        before = s.usage().compiles
        out = tpubox.jax.jit(cell_fn)(np.full((8, 8), 0.5, np.float32), np.eye(8, dtype=np.float32))
        want = np.tanh(np.full((8, 8), 0.5)) * 0.8125 + 0.1875
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
        print("charged", s.usage().compiles - before)
        out.free()  # the module's later tests expect the kernels to hold nothing
        """
    assert kernel_a.ok(cell).split() == ["charged", "1"]
    assert kernel_b.ok(cell).split() == ["charged", "0"]


def test_kernel_environment_hides_accelerators(kernel_a, kernel_b):
    for k in (kernel_a, kernel_b):
        env = json.loads(k.ok("import os, json; print(json.dumps(dict(os.environ)))"))
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["JAX_PLATFORMS"] == "cpu"
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert env["TPU_VISIBLE_CHIPS"] == "" and env["PJRT_DEVICE"] == "CPU"
        assert env["TPUBOX_SESSION_ID"] == k.provisioner.session.session_id
        assert env["TPUBOX_SESSION_TOKEN"] == k.provisioner.session.token
        # The tenant token stays with the provisioner.
        assert ALICE not in json.dumps(env) and BOB not in json.dumps(env)


def test_kernel_b_cannot_use_kernel_a_handle(kernel_a, kernel_b):
    handle = getattr(pytest, "handle_a", None)
    if handle is None:
        handle = int(kernel_a.ok("print(x.handle)"))
    assert (
        kernel_b.ok("import numpy as np, tpubox\ns = tpubox.connect()\nprint(s.transport)")
        == "grpc\n"
    )
    r = kernel_b.run(f"s.get({handle})")
    assert r["status"] == "error"
    assert r["error"][0] == "NotFound", r["error"]
    # Kernel A still has it.
    assert kernel_a.ok(f"print(s.get({handle}).sum())").strip() == "15.0"


def test_limit_in_one_kernel_does_not_stop_the_other(kernel_a, kernel_b, daemon):
    r = kernel_a.run(
        """
        import numpy as np, tpubox
        s = tpubox.connect()
        print(s.limits.max_device_bytes)
        big = s.tensor(np.zeros(20 << 20, np.uint8))
        """
    )
    assert r["stdout"].strip() == str(ALICE_KERNEL_LIMIT)
    assert r["status"] == "error" and r["error"][0] == "ResourceExhausted", r
    assert "max-device-bytes" in r["error"][1]
    # Bob's kernel carries on, with more than alice may hold.
    out = kernel_b.ok(
        """
        t = s.tensor(np.ones(20 << 20, np.uint8))
        print(int(t.numpy().sum()))
        t.free()
        """
    )
    assert out.strip() == str(20 << 20)
    # And alice's kernel goes on after the refusal.
    assert kernel_a.ok("print(s.tensor(np.ones(3)).numpy().sum())").strip() == "3.0"


def test_guest_output_streams_into_the_cell(kernel_b):
    from tpubox_daemon import guest_wasm

    wasm = guest_wasm("hello-matmul")
    r = kernel_b.run(f"r = s.run({str(wasm)!r}, ['--scale', '2'])\nprint('exit', r.exit_code)")
    assert r["status"] == "ok", r
    assert "result: [[" in r["stdout"] and r["stdout"].rstrip().endswith("exit 0")


def test_shutdown_and_restart_give_the_device_back(kernelspecs, daemon):
    assert usage(daemon, BOB).sessions == 1  # kernel_b's (module scope), if it ran
    k = Kernel("tpubox-bob")
    try:
        first = k.provisioner.session.session_id
        k.ok("import numpy as np, tpubox\ns = tpubox.connect()\nt = s.tensor(np.ones(1 << 20))")
        assert usage(daemon, BOB).usage.device_bytes >= 8 << 20
        k.km.restart_kernel(now=True)  # what Jupyter's "Restart kernel" does
        k.kc.wait_for_ready(timeout=120)
        second = k.provisioner.session.session_id
        assert second != first
        out = k.ok(
            "import os, tpubox\nprint(os.environ['TPUBOX_SESSION_ID'], tpubox.connect().session_id)"
        )
        assert out.split() == [second, second]
        # The first session ended with the old kernel: only the new kernel's (empty) session
        # and kernel_b's remain.
        assert f"session={first}" in daemon.log() and "session ended" in daemon.log()
        u = usage(daemon, BOB)
        assert u.sessions == 2 and u.usage.device_bytes == 0, u
    finally:
        k.shutdown()
    u = usage(daemon, BOB)
    assert u.sessions == 1, u  # kernel_b's


def test_shutdown_returns_tenant_usage_to_zero(kernel_a, daemon):
    # kernel_a is alice's only kernel; it holds tensors from the earlier cells.
    assert usage(daemon, ALICE).usage.device_bytes > 0
    kernel_a.shutdown()
    u = usage(daemon, ALICE)
    assert u.sessions == 0 and u.usage == tpubox.Usage(), u
    assert kernel_a.provisioner is None or kernel_a.provisioner.session is None


def test_daemon_loss_makes_the_next_cell_fail_at_once(jupyter_dirs, tmp_path):
    d = Daemon(tmp_path / "daemon", TENANTS).start()
    try:
        install_kernelspec(jupyter_dirs, "tpubox-doomed", "--address", d.unix, "--token", ALICE)
        k = Kernel("tpubox-doomed")
        try:
            k.ok("import numpy as np, tpubox\ns = tpubox.connect()\nx = s.tensor(np.ones(4))")
            d.kill()
            t0 = time.monotonic()
            r = k.run("x.numpy()", timeout=30)
            assert time.monotonic() - t0 < 10
            assert r["status"] == "error" and r["error"][0] == "Unavailable", r
            assert d.unix in r["error"][1]
        finally:
            k.shutdown()  # closing a session on a dead daemon does not fail the shutdown
    finally:
        d.kill()
