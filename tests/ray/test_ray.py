"""tpubox.ray end to end: the node actor starts `tpubox serve` once however many tasks race for
it, notices when the daemon dies and starts it again, and a task killed while it holds a
session gives its device memory back at once.

The tasks ask for no accelerator (num_cpus only): the daemon owns the device and its tenant
limits do the enforcement.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import time

import numpy as np
import pytest
import ray

import tpubox
import tpubox.ray
from tpubox_daemon import wait_until  # python/tests, on sys.path by conftest.py

ADD = """
func.func @main(%a: tensor<2x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %0 = stablehlo.add %a, %b : tensor<2x2xf32>
  func.return %0 : tensor<2x2xf32>
}
"""

# frank: one session at a time, 64 MiB for all his sessions: a second session of 48 MiB opens
# only once the first one's memory is back.
FRANK_MIB = 48


def node_options(cluster) -> dict:
    return {
        "tenants": {
            "alice": {"max_device_mib": 256, "max_sessions": 16},
            "frank": {"max_device_mib": 64, "max_sessions": 1},
        },
        "cache_dir": cluster["cache_dir"],
        "port": 0,
    }


@ray.remote(num_cpus=0.5, max_retries=0)
def add_on_device(i: int, opts: dict):
    """Opens a session of alice on this node's daemon and adds two 2x2 matrices there."""
    with tpubox.ray.session("alice", node_options=opts) as s:
        exe = s.compile(ADD)
        a = np.arange(4, dtype=np.float32).reshape(2, 2) * i
        b = np.full((2, 2), 0.5, np.float32)
        (y,) = exe(s.tensor(a), s.tensor(b))
        info = ray.get(tpubox.ray.node().info.remote())
        return {"i": i, "y": y.numpy().tolist(), "daemon_pid": info["pid"], "session": s.session_id}


@ray.remote(num_cpus=0.5, max_retries=0)
def hold_memory(path: str, mib: int):
    """Opens a session of frank, puts MIB MiB on the device, says so in PATH, and waits to be
    killed."""
    s = tpubox.ray.session("frank")
    t = s.tensor(np.ones(mib << 18, np.float32))
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "session": s.session_id, "handle": t.handle}, f)
    os.replace(path + ".tmp", path)
    time.sleep(600)


def listening(pid: int) -> list[str]:
    """The local addresses (``IP:PORT``, IPv4 or IPv6 hex as /proc has them, decoded) of the
    TCP sockets process PID listens on."""
    try:
        inodes = {
            os.readlink(f"/proc/{pid}/fd/{fd}")[len("socket:["):-1]
            for fd in os.listdir(f"/proc/{pid}/fd")
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
        }
    except FileNotFoundError:
        return []
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                ip_hex, port_hex = cols[1].split(":")
                raw = bytes.fromhex(ip_hex)
                # /proc writes each 32-bit word in host (little-endian) order.
                ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.append(f"{ipaddress.ip_address(ip)}:{int(port_hex, 16)}")
    return out


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.rsplit(":", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback



def expected(i: int) -> list:
    return (np.arange(4, dtype=np.float32).reshape(2, 2) * i + 0.5).tolist()


def test_racing_tasks_start_one_daemon(cluster):
    assert tpubox.ray.nodes() == {}
    opts = node_options(cluster)
    results = ray.get([add_on_device.remote(i, opts) for i in range(8)], timeout=120)
    for r in results:
        assert r["y"] == expected(r["i"]), r
    assert len({r["session"] for r in results}) == 8
    actors = tpubox.ray.nodes()
    assert list(actors) == [cluster["node_id"]]
    info = ray.get(actors[cluster["node_id"]].info.remote())
    assert {r["daemon_pid"] for r in results} == {info["pid"]}
    assert info["restarts"] == 0 and info["ready"], info
    assert sorted(info["tenants"]) == ["alice", "frank"]
    assert info["tcp"] and info["tcp"].startswith("127.0.0.1:"), info
    log = ray.get(actors[cluster["node_id"]].log_tail.remote(1000))
    assert log.count("session API listening") == 1, log
    # Nothing listens beyond loopback: the daemon, Ray's raylet and GCS, the node actor.
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    actor_pid = ray.get(actors[cluster["node_id"]].pid.remote())
    pids = {"tpubox serve": info["pid"], "node actor": actor_pid}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                comm = open(f"/proc/{p}/comm").read().strip()
            except OSError:
                continue
            if comm in ("raylet", "gcs_server"):
                pids[comm] = int(p)
    assert {"raylet", "gcs_server"} <= set(pids), pids
    for what, pid in pids.items():
        addrs = listening(pid)
        assert addrs and all(is_loopback(a) for a in addrs), (what, addrs)
    # All their sessions ended with the tasks.
    token = ray.get(actors[cluster["node_id"]].token.remote("alice"))
    u = tpubox.tenant_usage(info["address"], token)
    assert u.sessions == 0 and u.usage.device_bytes == 0, u


def test_killed_daemon_is_restarted(cluster):
    h = tpubox.ray.node(**node_options(cluster))
    before = ray.get(h.info.remote())
    assert before["pid"] is not None
    t0 = time.monotonic()
    os.kill(before["pid"], signal.SIGKILL)
    after = wait_until(
        lambda: (i := ray.get(h.info.remote()))["ready"] and i["pid"] != before["pid"] and i,
        timeout=10,
        what="a new daemon answering",
    )
    took = time.monotonic() - t0
    assert after["restarts"] == before["restarts"] + 1, after
    assert after["last_exit"] == -signal.SIGKILL, after
    assert took < 5, f"the daemon took {took:.2f} s to come back"
    # A new session works, from a task and from the driver.
    r = ray.get(add_on_device.remote(3, node_options(cluster)), timeout=60)
    assert r["y"] == expected(3) and r["daemon_pid"] == after["pid"], r
    with tpubox.ray.session("alice") as s:
        np.testing.assert_array_equal(s.tensor(np.arange(5)).numpy(), np.arange(5))
    assert ray.get(h.info.remote())["restarts"] == after["restarts"]


def test_killed_task_frees_its_memory(cluster, tmp_path):
    h = tpubox.ray.node(**node_options(cluster))
    info = ray.get(h.info.remote())
    token = ray.get(h.token.remote("frank"))
    path = str(tmp_path / "holder.json")
    ref = hold_memory.remote(path, FRANK_MIB)
    wait_until(lambda: os.path.exists(path), timeout=60, what="the task holding memory")
    with open(path) as f:
        held = json.load(f)
    u = tpubox.tenant_usage(info["address"], token)
    assert u.sessions == 1 and u.usage.device_bytes == FRANK_MIB << 20, u
    # frank may have one session: while the task's lives, another is refused.
    with pytest.raises(tpubox.ResourceExhausted):
        tpubox.ray.session("frank")

    t0 = time.monotonic()
    os.kill(held["pid"], signal.SIGKILL)
    s = None
    while s is None:
        try:
            s = tpubox.ray.session("frank")
        except tpubox.ResourceExhausted:
            assert time.monotonic() - t0 < 1.0, "no new session of frank within 1 s of the kill"
            time.sleep(0.01)
    opened = time.monotonic() - t0
    with s:
        assert s.session_id != held["session"]
        u = tpubox.tenant_usage(info["address"], token)
        assert u.sessions == 1 and u.usage.device_bytes == 0, u
        # The whole budget is back: the same 48 MiB fit again.
        t = s.tensor(np.ones(FRANK_MIB << 18, np.float32))
        assert tpubox.tenant_usage(info["address"], token).usage.device_bytes == FRANK_MIB << 20
        t.free()
    assert opened < 1.0
    with pytest.raises(ray.exceptions.RayError):
        ray.get(ref, timeout=30)
    u = tpubox.tenant_usage(info["address"], token)
    assert u.sessions == 0 and u.usage == tpubox.Usage(), u
    assert ray.get(h.info.remote())["pid"] == info["pid"]  # the daemon itself lived on


def test_tenant_added_without_restart(cluster):
    h = tpubox.ray.node(**node_options(cluster))
    before = ray.get(h.info.remote())
    with tpubox.ray.session("alice") as alive:
        with pytest.raises(KeyError):
            ray.get(h.token.remote("zoe"))
        ray.get(h.add_tenant.remote("zoe", {"max_device_mib": 1}))
        with tpubox.ray.session("zoe") as z:
            assert z.tenant == "zoe" and z.limits.max_device_bytes == 1 << 20
            with pytest.raises(tpubox.ResourceExhausted):
                z.tensor(np.zeros(2 << 20, np.uint8))
        # alice's session lived through the reload.
        np.testing.assert_array_equal(alive.tensor(np.arange(3)).numpy(), np.arange(3))
    after = ray.get(h.info.remote())
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"]
    assert "zoe" in after["tenants"]
