"""A device of its own per Ray task: the node's daemon runs on four CPU devices
(`cpu_devices=4`, the CPU plugin standing in for a host's four chips) and the cluster has a Ray
custom resource per device (`tpubox_device: 4`), as docs/RAY.md says to set it up.

Four tasks, each `tpubox.ray.session(devices=1)` and `resources={"tpubox_device": 1}`, hold
their sessions at once (a barrier actor keeps them until the test lets them go) and get four
different devices; a fifth task that Ray was not told about (no `tpubox_device`) is refused at
once with `device_wait_s=0`, and with a wait it gets the device of the first task that
finishes.
"""

from __future__ import annotations

import time

import numpy as np
import ray

import tpubox
import tpubox.ray
from tpubox_daemon import wait_until  # python/tests, on sys.path by conftest.py

DEVICES = 4
# The cluster fixture (conftest.py) gives the node this custom resource: one unit per device.
RAY_RESOURCES = {tpubox.ray.DEVICE_RESOURCE: DEVICES}

SCALE = """
func.func @main(%a: tensor<3xf32>, %b: tensor<3xf32>) -> tensor<3xf32> {
  %0 = stablehlo.multiply %a, %b : tensor<3xf32>
  func.return %0 : tensor<3xf32>
}
"""


def node_options(cluster) -> dict:
    return {"cpu_devices": DEVICES, "cache_dir": cluster["cache_dir"]}


@ray.remote(num_cpus=0)
class Barrier:
    """Where the tasks say which device they got, and wait until the test lets each go."""

    def __init__(self):
        self.arrived: dict[str, dict] = {}
        self.released: set[str] = set()

    def arrive(self, who: str, what: dict) -> None:
        self.arrived[who] = what

    def seen(self) -> dict[str, dict]:
        return dict(self.arrived)

    def release(self, who: str) -> None:
        self.released.add(who)

    def may_go(self, who: str) -> bool:
        return who in self.released


def use_device(who: str, barrier, opts: dict, wait_s: float) -> dict:
    """Opens a session with a device of its own, computes there, tells BARRIER which device it
    has and holds the session until BARRIER releases WHO."""
    t0 = time.monotonic()
    with tpubox.ray.session(devices=1, device_wait_s=wait_s, node_options=opts) as s:
        waited = time.monotonic() - t0
        a = np.array([1, 2, 3], np.float32)
        x = s.tensor(a)
        (y,) = s.compile(SCALE)(x, x)
        got = {
            "devices": list(s.devices),
            "exclusive": s.exclusive_devices,
            "tensor_device": x.device,
            "result_device": y.device,
            "result": y.numpy().tolist(),
            "waited": waited,
        }
        ray.get(barrier.arrive.remote(who, got))
        while not ray.get(barrier.may_go.remote(who)):
            time.sleep(0.05)
    return got


@ray.remote(num_cpus=0.5, max_retries=0, resources={tpubox.ray.DEVICE_RESOURCE: 1})
def device_task(who: str, barrier, opts: dict) -> dict:
    """A task Ray schedules on a node's device (one unit of tpubox_device)."""
    return use_device(who, barrier, opts, wait_s=0)


@ray.remote(num_cpus=0.5, max_retries=0)
def untold_task(who: str, barrier, opts: dict, wait_s: float) -> dict:
    """A task that asks tpubox for a device without telling Ray: tpubox refuses or waits."""
    t0 = time.monotonic()
    try:
        return use_device(who, barrier, opts, wait_s)
    except tpubox.TpuboxError as e:
        return {"error": type(e).__name__, "message": e.message, "after": time.monotonic() - t0}


def test_four_tasks_get_four_devices_a_fifth_waits_or_is_refused(cluster):
    opts = node_options(cluster)
    h = tpubox.ray.node(**opts)
    devices = ray.get(h.devices.remote())
    assert [d.index for d in devices] == list(range(DEVICES)), devices
    assert all(isinstance(d, tpubox.Device) for d in devices)
    info = ray.get(h.info.remote())
    assert info["devices"] == list(range(DEVICES)) and info["cpu_devices"] == DEVICES, info
    assert ray.available_resources().get(tpubox.ray.DEVICE_RESOURCE) == DEVICES

    barrier = Barrier.remote()
    names = [f"task{i}" for i in range(DEVICES)]
    refs = {n: device_task.remote(n, barrier, opts) for n in names}
    seen = wait_until(
        lambda: len(s := ray.get(barrier.seen.remote())) == DEVICES and s,
        timeout=150,
        what="four tasks holding a device each",
        every=0.1,
    )
    # Four at once, on four devices, each held alone; everything computed on the task's device.
    assert sorted(g["devices"][0] for g in seen.values()) == list(range(DEVICES)), seen
    for g in seen.values():
        assert len(g["devices"]) == 1 and g["exclusive"], g
        assert g["tensor_device"] == g["devices"][0] == g["result_device"], g
        assert g["result"] == [1.0, 4.0, 9.0], g
    token = ray.get(h.token.remote(tpubox.ray.DEFAULT_TENANT))
    assert tpubox.tenant_usage(info["address"], token).sessions == DEVICES

    # A fifth without a wait: refused at once, naming the devices rule.
    r = ray.get(untold_task.remote("refused", barrier, opts, 0.0), timeout=120)
    assert r.get("error") == "ResourceExhausted", r
    assert "(limit devices)" in r["message"], r
    # From the driver too, and a count above the node's devices is never waited for.
    t0 = time.monotonic()
    try:
        tpubox.ray.session(devices=1, device_wait_s=0)
        raise AssertionError("a fifth session got a device of its own")
    except tpubox.ResourceExhausted as e:
        assert "(limit devices)" in e.message
    try:
        tpubox.ray.session(devices=DEVICES + 1)
        raise AssertionError("a session got more devices than the node has")
    except tpubox.InvalidArgument:
        pass
    assert time.monotonic() - t0 < 10

    # A fifth with a wait gets a device once a task lets one go: the first task's.
    waiting = untold_task.remote("waiting", barrier, opts, 120.0)
    time.sleep(2.0)
    ready, _ = ray.wait([waiting], timeout=0)
    assert not ready, ray.get(waiting)
    assert "waiting" not in ray.get(barrier.seen.remote())
    first = names[0]
    ray.get(barrier.release.remote(first))
    done = ray.get(refs[first], timeout=60)
    got = wait_until(
        lambda: ray.get(barrier.seen.remote()).get("waiting"),
        timeout=60,
        what="the waiting task holding a device",
        every=0.1,
    )
    assert got["devices"] == done["devices"], (got, done)
    assert got["waited"] >= 1.5 and got["result"] == [1.0, 4.0, 9.0], got

    for n in names[1:] + ["waiting"]:
        ray.get(barrier.release.remote(n))
    results = ray.get([refs[n] for n in names[1:]] + [waiting], timeout=60)
    assert all("error" not in r for r in results), results
    # Every lease came back: all four devices free for a session holding them alone.
    u = wait_until(
        lambda: (u := tpubox.tenant_usage(info["address"], token)).sessions == 0 and u,
        timeout=10,
        what="no session left",
    )
    assert u.usage.device_bytes == 0, u
    with tpubox.ray.session(devices=DEVICES, device_wait_s=0) as s:
        assert sorted(s.devices) == list(range(DEVICES)) and s.exclusive_devices
