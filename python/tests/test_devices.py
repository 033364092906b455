"""Placement through the Python client: a daemon with four CPU devices (`--cpu-devices 4`, the
CPU plugin standing in for a host's chips) and three tenants placed on them by the tokens file:

- `a` may use device 1 only, and holds it alone (no other tenant is planned on it);
- `b` may use two devices the daemon picks (never 1: `a` holds it);
- `c` has the default: every device no other tenant holds alone (0, 2 and 3).

Each test checks the exact error class of every refusal and that nothing is left behind: the
tenants' usage is back to zero and no session is left once the test's sessions are closed.
"""

from __future__ import annotations

import numpy as np
import pytest

import tpubox
from tpubox_daemon import Daemon, binary

A = "devices-a-token"
B = "devices-b-token"
C = "devices-c-token"

TENANTS = {
    "a": {"token": A, "session": {"devices": [1], "exclusive_devices": True}},
    "b": {"token": B, "session": {"devices": 2}},
    "c": {"token": C, "session": {}},
}

ADD = """
func.func @main(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.add %a, %b : tensor<2x3xf32>
  %1 = stablehlo.multiply %0, %b : tensor<2x3xf32>
  func.return %1 : tensor<2x3xf32>
}
"""


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A daemon of this module's own with four CPU devices and the tenants a, b, c."""
    try:
        binary()
    except FileNotFoundError as e:
        pytest.exit(str(e), returncode=1)
    d = Daemon(tmp_path_factory.mktemp("devices"), TENANTS, extra_args=("--cpu-devices", "4"))
    d.start()
    yield d
    rc = d.stop()
    assert rc == 0, f"tpubox serve exited {rc} after SIGTERM\n{d.log()[-4000:]}"


@pytest.fixture(autouse=True)
def nothing_left(host):
    """After each test: no tenant holds a session, a byte or a handle."""
    yield
    for token in (A, B, C):
        u = tpubox.tenant_usage(host.unix, token)
        assert u.sessions == 0 and u.usage.device_bytes == 0, u
        assert u.usage.live_tensors == 0 and u.usage.device_bytes_by_device == (), u


def refused(cls: type, fn, *args, **kwargs) -> tpubox.TpuboxError:
    """Calls FN and returns the error it raised, which must be exactly CLS."""
    with pytest.raises(tpubox.TpuboxError) as ei:
        fn(*args, **kwargs)
    assert type(ei.value) is cls, f"{type(ei.value).__name__}: {ei.value}"
    return ei.value


@pytest.mark.parametrize("local", [True, False], ids=["local", "grpc"])
def test_session_lands_on_its_tenants_device(host, local):
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    y = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    with tpubox.connect(host.unix, A, local=local) as s:
        assert s.transport == ("local" if local else "grpc")
        assert s.devices == (1,) and not s.exclusive_devices
        assert [d.index for d in s.platform.devices] == [0, 1, 2, 3]
        # A tensor that names no device lands on the session's device, not the host's 0.
        tx = s.tensor(x)
        ty = s.tensor(y, device=1)
        assert tx.device == 1 and ty.device == 1
        u = s.usage()
        assert u.device_bytes == 2 * x.nbytes
        assert u.device_bytes_by_device == (tpubox.DeviceBytes(1, 2 * x.nbytes, 2 * x.nbytes),)
        assert u.on_device(1).bytes == 2 * x.nbytes and u.on_device(0).bytes == 0

        # Compiled for the session's device (by default, and named), run there.
        for exe in (s.compile(ADD), s.compile(ADD, device=1)):
            (r,) = exe(tx, ty)
            assert r.device == 1
            np.testing.assert_array_equal(r.numpy(), (x + y) * y)
            (n,) = exe.call(x, y)  # inline arguments, one round trip
            np.testing.assert_array_equal(n, (x + y) * y)

        # Any other device is not the session's.
        refused(tpubox.PermissionDenied, s.tensor, x, device=0)
        refused(tpubox.PermissionDenied, s.tensor, x, device=2)
        refused(tpubox.PermissionDenied, s.compile, ADD, device=3)
        refused(tpubox.NotFound, s.tensor, x, device=9)  # a device the host lacks
        assert s.usage().device_bytes_by_device[0].device == 1


def test_tenant_usage_by_device(host):
    x = np.ones(100, np.float32)
    with tpubox.connect(host.unix, C, devices=[0]) as s0, tpubox.connect(host.unix, C) as s:
        held = [s0.tensor(x), s.tensor(x, device=3), s.tensor(x, device=3)]
        assert [t.device for t in held] == [0, 3, 3]
        u = tpubox.tenant_usage(host.unix, C).usage
        assert u.device_bytes == 3 * x.nbytes
        assert [(d.device, d.bytes) for d in u.device_bytes_by_device] == [
            (0, x.nbytes),
            (3, 2 * x.nbytes),
        ]


def test_count_tenant_gets_two_devices_never_the_exclusive_one(host):
    x = np.ones((4, 4), np.float32)
    with tpubox.connect(host.unix, B) as s:
        assert len(s.devices) == 2 and 1 not in s.devices, s.devices
        assert set(s.devices) <= {0, 2, 3}
        first, second = s.devices
        t0 = s.tensor(x)
        assert t0.device == first
        t = s.tensor(x * 3, device=second)
        assert t.device == second
        u = s.usage()
        assert u.on_device(first).bytes == x.nbytes and u.on_device(second).bytes == x.nbytes
        assert [d.device for d in u.device_bytes_by_device] == sorted(s.devices)
        exe = s.compile(ADD.replace("2x3", "4x4"), device=second)
        (r,) = exe(t, t)
        assert r.device == second
        np.testing.assert_array_equal(r.numpy(), (x * 3 + x * 3) * (x * 3))
        # One of them, the one with the fewest sessions.
        with tpubox.connect(host.unix, B, devices=1) as one:
            assert len(one.devices) == 1 and one.devices[0] in s.devices
        refused(tpubox.PermissionDenied, s.tensor, x, device=1)


def test_default_tenant_has_every_device_but_the_one_held_alone(host):
    with tpubox.connect(host.unix, C) as s:
        assert s.devices == (0, 2, 3)
        assert s.tensor(np.zeros(3, np.int32)).device == 0
    # Naming a device another tenant holds alone: permission-denied, as for one it may not use.
    e = refused(tpubox.PermissionDenied, tpubox.connect, host.unix, C, devices=[1])
    assert "device 1" in e.message
    refused(tpubox.PermissionDenied, tpubox.connect, host.unix, B, devices=[1])
    refused(tpubox.PermissionDenied, tpubox.connect, host.unix, A, devices=[0])
    with tpubox.connect(host.unix, C, devices=[3, 0]) as s:
        assert s.devices == (3, 0)
        assert s.tensor(np.zeros(3, np.int32)).device == 3


def test_devices_the_host_lacks_or_the_tenant_cannot_have(host):
    for token in (A, B, C):
        e = refused(tpubox.NotFound, tpubox.connect, host.unix, token, devices=[7])
        assert "device 7" in e.message
        refused(tpubox.InvalidArgument, tpubox.connect, host.unix, token, devices=5)
    e = refused(tpubox.ResourceExhausted, tpubox.connect, host.unix, B, devices=3)
    assert "limit devices" in e.message, e
    e = refused(tpubox.ResourceExhausted, tpubox.connect, host.unix, A, devices=2)
    assert "limit devices" in e.message, e
    refused(tpubox.InvalidArgument, tpubox.connect, host.unix, C, devices=[2, 2])
    # Checked before anything is sent.
    for bad in (0, -1, [], True, "1", [0, -1], [1.5]):
        with pytest.raises(ValueError):
            tpubox.connect(host.unix, C, devices=bad)


def test_exclusive_session_holds_its_device_until_it_closes(host):
    x = np.arange(1 << 16, dtype=np.float32)
    first = tpubox.connect(host.unix, C, devices=[2], exclusive_devices=True)
    try:
        assert first.devices == (2,) and first.exclusive_devices
        t = first.tensor(x)
        assert t.device == 2 and first.usage().on_device(2).bytes == x.nbytes
        # Another session of the same tenant on that device: not now.
        e = refused(tpubox.ResourceExhausted, tpubox.connect, host.unix, C, devices=[2])
        assert "limit devices" in e.message and "device 2" in e.message, e
        # Every device of c (2 among them): not now either.
        refused(tpubox.ResourceExhausted, tpubox.connect, host.unix, C)
        # A count leaves the held device out.
        with tpubox.connect(host.unix, C, devices=2) as s:
            assert 2 not in s.devices and set(s.devices) == {0, 3}
    finally:
        first.close()
    # The lease came back with the session: the device is c's to take again, alone.
    with tpubox.connect(host.unix, C, devices=[2], exclusive_devices=True) as again:
        assert again.devices == (2,)
        assert again.usage().device_bytes == 0


def test_exclusive_needs_a_device_nobody_uses(host):
    with tpubox.connect(host.unix, C, devices=[3]) as shared:
        assert shared.devices == (3,) and not shared.exclusive_devices
        e = refused(
            tpubox.ResourceExhausted,
            tpubox.connect,
            host.unix,
            C,
            devices=[3],
            exclusive_devices=True,
        )
        assert "limit devices" in e.message
        # A count of one held alone takes a device with no session.
        with tpubox.connect(host.unix, C, devices=1, exclusive_devices=True) as alone:
            assert alone.devices[0] in (0, 2) and alone.exclusive_devices
            # ... and then a plain session of c (all of its devices) must wait.
            refused(tpubox.ResourceExhausted, tpubox.connect, host.unix, C)
        with tpubox.connect(host.unix, C) as again:
            assert again.devices == (0, 2, 3)


def test_other_tenant_cannot_enter_a_device_held_alone(host):
    with tpubox.connect(host.unix, B) as b:
        b_devices = b.devices
    shared = next(d for d in b_devices if d in (0, 2, 3))
    with tpubox.connect(host.unix, C, devices=[shared], exclusive_devices=True) as held:
        assert held.devices == (shared,)
        e = refused(tpubox.PermissionDenied, tpubox.connect, host.unix, B, devices=[shared])
        assert f"device {shared}" in e.message
        # b's count cannot be met while one of its two devices is held alone.
        e = refused(tpubox.ResourceExhausted, tpubox.connect, host.unix, B)
        assert "limit devices" in e.message
        with tpubox.connect(host.unix, B, devices=1) as one:
            assert one.devices != (shared,)
