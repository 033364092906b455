"""Launches over the session API: ``Executable.launch`` returns pending Tensors while the device
works, ``Tensor.wait`` / ``Session.wait_all`` wait, a read of a pending output waits for it, and
the per-session blocking switch (``Session.set_launch_blocking``, ``TPUBOX_LAUNCH_BLOCKING=1``,
the daemon's ``--launch-blocking``). Values are checked against the synchronous path and against
NumPy, on the local socket, gRPC over the Unix socket and gRPC over TCP."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ALICE, TENANTS
from tpubox_daemon import Daemon

import tpubox

# A chain step: x·w then tanh, 64×64 (big enough that the device has work to do).
STEP = """
func.func @main(%x: tensor<64x64xf32>, %w: tensor<64x64xf32>) -> tensor<64x64xf32> {
  %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST]
      : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  %t = stablehlo.tanh %y : tensor<64x64xf32>
  func.return %t : tensor<64x64xf32>
}
"""

RNG = np.random.default_rng(2028)


@pytest.fixture(params=["local", "unix", "tcp"])
def t(request, daemon):
    address = daemon.tcp if request.param == "tcp" else daemon.unix
    local = request.param == "local"
    with tpubox.connect(address, ALICE, local=local, label=f"pytest launch {request.param}") as s:
        yield s


def chain(x, w, n):
    y = x.astype(np.float64)
    for _ in range(n):
        y = np.tanh(y @ w.astype(np.float64))
    return y


def test_launch_equals_the_synchronous_path(t):
    step = t.compile(STEP)
    x = RNG.standard_normal((64, 64), dtype=np.float32)
    w = (RNG.standard_normal((64, 64), dtype=np.float32) / 8).astype(np.float32)
    tw = t.tensor(w)
    # Ten launches, each on the previous one's pending output: nothing waits in between.
    outs = []
    h = x
    for _ in range(10):
        (h,) = step.launch(h, tw)
        assert isinstance(h, tpubox.Tensor)
        outs.append(h)
    # A read of a pending output waits for it.
    got = h.numpy()
    np.testing.assert_allclose(got, chain(x, w, 10), rtol=1e-4, atol=1e-5)
    # The synchronous path, step by step, gives the same bytes.
    s = x
    for _ in range(10):
        (s,) = step.call(s, tw)
    np.testing.assert_array_equal(got, s)
    for o in outs[:-1]:
        o.wait()
    t.wait_all()
    t.free(*outs, tw)
    assert t.usage().live_tensors == 0


def test_wait_and_wait_all_and_free_at_launch(t):
    step = t.compile(STEP)
    x = RNG.standard_normal((64, 64), dtype=np.float32)
    w = np.eye(64, dtype=np.float32)
    tx = t.tensor(x)
    # x is freed by the launch itself: the launch holds what it uses until the device is done.
    (a,) = step.launch(tx, w, free=[tx])
    assert tx.freed
    (b,) = step.launch(a, w)
    t.wait_all()
    a.wait()  # finished: at once
    np.testing.assert_allclose(b.numpy(), np.tanh(np.tanh(x)), rtol=1e-5, atol=1e-6)
    with pytest.raises(tpubox.NotFound):
        t.get(tx.handle)
    # Pending outputs may be donated to the next launch.
    (c,) = step.launch(b, w, donate=[0])
    assert b.donated
    with pytest.raises(tpubox.FailedPrecondition):
        b.wait()
    np.testing.assert_allclose(c.numpy(), np.tanh(np.tanh(np.tanh(x))), rtol=1e-5, atol=1e-6)


def test_launch_refusals_keep_usage(t):
    step = t.compile(STEP)
    x = np.zeros((64, 64), np.float32)
    before = t.usage()
    with pytest.raises(tpubox.InvalidArgument):
        step.launch(x, np.zeros((64, 63), np.float32))
    with pytest.raises(tpubox.InvalidArgument):
        step.launch(x)
    # A launch fetches nothing: refused as sent by a client that asks for it.
    if t.transport == "local":
        with pytest.raises(tpubox.InvalidArgument):
            t._local.request(
                "call",
                {
                    "executable": step.handle,
                    "arguments": [],
                    "fetch": [0],
                    "launch": True,
                },
                None,
                10,
            )
    after = t.usage()
    assert (after.device_bytes, after.live_tensors, after.executions) == (
        before.device_bytes,
        before.live_tensors,
        before.executions,
    )
    with pytest.raises(tpubox.NotFound):
        t._wait([10**12], False, 10)


def test_blocking_switch(t):
    assert t.info().launch_blocking is False
    assert t.set_launch_blocking(True) is True
    assert t.info().launch_blocking is True
    step = t.compile(STEP)
    x = RNG.standard_normal((64, 64), dtype=np.float32)
    w = np.eye(64, dtype=np.float32)
    (y,) = step.launch(x, w)
    np.testing.assert_allclose(y.numpy(), np.tanh(x), rtol=1e-5, atol=1e-6)
    assert t.set_launch_blocking(False) is False


def test_blocking_from_the_environment(daemon, monkeypatch):
    monkeypatch.setenv(tpubox.ENV_LAUNCH_BLOCKING, "1")
    with tpubox.connect(daemon.unix, ALICE) as s:
        assert s.info().launch_blocking is True
    monkeypatch.setenv(tpubox.ENV_LAUNCH_BLOCKING, "0")
    with tpubox.connect(daemon.unix, ALICE) as s:
        assert s.info().launch_blocking is False


def test_daemon_launch_blocking_flag(tmp_path):
    with Daemon(tmp_path / "blocking", TENANTS, extra_args=("--launch-blocking",)) as d:
        with tpubox.connect(d.unix, ALICE) as s:
            assert s.info().launch_blocking is True
            # The daemon's switch wins over the session's.
            assert s.set_launch_blocking(False) is True
            step = s.compile(STEP)
            (y,) = step.launch(np.ones((64, 64), np.float32), np.eye(64, dtype=np.float32))
            np.testing.assert_allclose(y.numpy(), np.tanh(np.ones((64, 64))), rtol=1e-6)


def test_pending_launches_are_bounded(daemon):
    # A session that only launches and never waits: each launch is admitted or refused with
    # resource-exhausted naming max-pending-launches; either way waiting drains them all.
    with tpubox.connect(daemon.unix, ALICE, limits={"max_pending_launches": 2}) as s:
        step = s.compile(STEP)
        w = s.tensor(np.eye(64, dtype=np.float32))
        x = s.tensor(np.ones((64, 64), np.float32))
        outs = []
        refused = 0
        for _ in range(200):
            try:
                outs += step.launch(x, w)
            except tpubox.ResourceExhausted as e:
                assert "max-pending-launches" in str(e)
                refused += 1
        assert s.usage().pending_launches <= 2
        s.wait_all()
        assert s.usage().pending_launches == 0
        for o in outs:
            np.testing.assert_allclose(o.numpy(), np.tanh(np.ones((64, 64))), rtol=1e-6)
        s.free(*outs)
        assert s.usage().live_tensors == 2


def test_a_session_that_ends_with_launches_pending(daemon):
    import time

    from conftest import BOB

    s = tpubox.connect(daemon.unix, BOB)
    step = s.compile(STEP)
    h = s.tensor(np.ones((64, 64), np.float32))
    w = s.tensor(np.eye(64, dtype=np.float32))
    for _ in range(50):
        (h,) = step.launch(h, w)
    s.close()  # without waiting
    # Launches not yet submitted are dropped; submitted ones return their charges when the
    # device is done with them. Poll (no timing is asserted: the deadline only ends a hang).
    deadline = time.monotonic() + 60
    while True:
        u = tpubox.tenant_usage(daemon.unix, BOB)
        if (
            u.sessions == 0
            and u.usage.device_bytes == 0
            and u.usage.live_tensors == 0
            and u.usage.pending_launches == 0
        ):
            break
        assert time.monotonic() < deadline, u
        time.sleep(0.05)
    # The daemon goes on serving the tenant (the core's tests/all/launch.rs checks the ended
    # session's own accounting returns to zero).
    with tpubox.connect(daemon.unix, BOB) as s2:
        step2 = s2.compile(STEP)
        (y,) = step2.call(np.ones((64, 64), np.float32), np.eye(64, dtype=np.float32))
        np.testing.assert_allclose(y, np.tanh(np.ones((64, 64))), rtol=1e-6)
