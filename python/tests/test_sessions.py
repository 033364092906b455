"""Sessions: isolation, limits, freeing, ending (closed, process gone, daemon gone), tokens."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time

from pathlib import Path

import numpy as np
import pytest
from conftest import ALICE, BOB, BUDGET, EXITS, FEW, NO_SESSIONS, SMALL
from tpubox_daemon import Daemon, binary, wait_until

import tpubox

ADD = """
func.func @main(%a: tensor<2x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %0 = stablehlo.add %a, %b : tensor<2x2xf32>
  func.return %0 : tensor<2x2xf32>
}
"""



def test_open_info_usage(alice, daemon):
    assert alice.owned and alice.tenant == "alice"
    assert alice.platform.name == "cpu" and alice.platform.devices
    assert alice.limits.max_device_bytes == 1024 << 20
    info = alice.info()
    assert info.session_id == alice.session_id and info.tenant == "alice"
    assert info.limits == alice.limits
    assert info.usage == tpubox.Usage()
    assert "alice" in repr(alice) and alice.token not in repr(alice)


def test_tcp_and_unix_reach_the_same_daemon(daemon, alice, bob):
    assert bob.address == daemon.tcp and alice.address == daemon.unix
    t = bob.tensor(np.arange(3))
    np.testing.assert_array_equal(t.numpy(), np.arange(3))
    u = tpubox.tenant_usage(daemon.tcp, BOB)
    assert u.tenant == "bob" and u.sessions == 1 and u.usage.device_bytes == 24


def test_requested_limits_narrow_the_tenants(daemon):
    with tpubox.connect(daemon.unix, ALICE, limits={"max_device_bytes": 1000}) as s:
        assert s.limits.max_device_bytes == 1000
        with pytest.raises(tpubox.ResourceExhausted, match="max-device-bytes"):
            s.tensor(np.zeros(1001, np.uint8))
    with pytest.raises(tpubox.InvalidArgument):
        tpubox.connect(daemon.unix, ALICE, limits=tpubox.Limits(max_device_bytes=2 << 30))
    with pytest.raises(ValueError, match="unknown limits"):
        tpubox.connect(daemon.unix, ALICE, limits={"max_device_mib": 1})


def test_another_sessions_handle_is_not_found(daemon, alice, bob):
    a = alice.tensor(np.ones((2, 2), np.float32))
    with pytest.raises(tpubox.NotFound) as e:
        bob.get(a.handle)
    assert e.value.kind == "not-found"
    # Bob's executable given alice's tensor handle.
    exe = bob.compile(ADD)
    with pytest.raises(tpubox.NotFound):
        exe(a, a)
    # Bob cannot free it either: reported unknown, nothing freed.
    assert bob.free(a.handle) == 0
    np.testing.assert_array_equal(a.numpy(), np.ones((2, 2)))
    # Nor use alice's executable.
    alice_exe = alice.compile(ADD)
    with pytest.raises(tpubox.NotFound):
        tpubox.Executable.__call__(
            _rebind(alice_exe, bob), bob.tensor(np.ones((2, 2), np.float32)),
            bob.tensor(np.ones((2, 2), np.float32)),
        )  # fmt: skip


def _rebind(exe: tpubox.Executable, session: tpubox.Session) -> tpubox.Executable:
    """EXE's handle number, as if SESSION had it."""
    from tpubox._proto import session_pb2 as pb

    other = tpubox.Executable(session, pb.CompileResponse(executable=exe.handle))
    other._freed = True  # not ours to free
    return other


def test_device_byte_limit_then_free_and_go_on(small):
    assert small.limits.max_device_bytes == 1 << 20
    a = small.tensor(np.zeros(600_000, np.uint8))
    with pytest.raises(tpubox.ResourceExhausted) as e:
        small.tensor(np.zeros(600_000, np.uint8))
    assert e.value.kind == "resource-exhausted"
    assert e.value.limit == "max-device-bytes"
    assert "max-device-bytes" in str(e.value)
    u = small.usage()
    assert u.device_bytes == 600_000 and u.refused >= 1
    a.free()
    b = small.tensor(np.ones(900_000, np.uint8))
    assert int(b.numpy().sum()) == 900_000
    assert small.usage().device_bytes == 900_000


def test_execution_results_count_against_the_limit(small):
    exe = small.compile(
        """func.func @main(%a: tensor<f32>) -> tensor<200000xf32> {
             %0 = stablehlo.broadcast_in_dim %a, dims = [] : (tensor<f32>) -> tensor<200000xf32>
             func.return %0 : tensor<200000xf32>
           }"""
    )
    (r,) = exe(np.float32(1))  # 800,000 bytes
    with pytest.raises(tpubox.ResourceExhausted, match="max-device-bytes"):
        exe(np.float32(2))
    r.free()
    (r,) = exe(np.float32(3))
    assert r.numpy()[0] == 3


def test_live_tensor_limit(small):
    ts = [small.tensor(np.int8(i)) for i in range(50)]
    with pytest.raises(tpubox.ResourceExhausted) as e:
        small.tensor(np.int8(0))
    assert e.value.limit == "max-live-tensors"
    small.free(*ts)
    assert small.usage().live_tensors == 0


def test_free_context_managers_and_del_return_usage_to_zero(alice):
    exe = alice.compile(ADD)
    with alice.tensor(np.ones((2, 2), np.float32)) as x:
        (y,) = exe(x, x)
        assert alice.usage().live_tensors == 2
    assert alice.usage().live_tensors == 1
    assert alice.free(y, exe) == 2
    assert alice.free(y) == 0  # already freed here: nothing sent
    u = alice.usage()
    assert (u.device_bytes, u.live_tensors, u.live_executables) == (0, 0, 0)
    # Dropped objects are freed with the next call.
    t = alice.tensor(np.zeros(1000, np.float32))
    e = alice.compile(ADD)
    del t, e
    gc.collect()
    u = alice.usage()
    assert (u.device_bytes, u.live_tensors, u.live_executables) == (0, 0, 0), u
    # Free by handle number.
    t = alice.tensor(np.zeros(3))
    assert alice.free(t.handle) == 1
    assert alice.usage().live_tensors == 0


def test_close_frees_everything(daemon):
    s = tpubox.connect(daemon.unix, ALICE)
    exe = s.compile(ADD)
    xs = [s.tensor(np.ones((2, 2), np.float32)) for _ in range(5)]
    exe(xs[0], xs[1])
    u = tpubox.tenant_usage(daemon.unix, ALICE)
    assert u.sessions == 1 and u.usage.live_tensors == 6 and u.usage.device_bytes == 96
    s.close()
    u = tpubox.tenant_usage(daemon.unix, ALICE)
    assert u.sessions == 0 and u.usage == tpubox.Usage(), u
    assert s.close() is False  # idempotent
    assert xs[0].freed
    with pytest.raises(tpubox.SessionEnded):
        s.tensor(np.ones(2))
    with pytest.raises(tpubox.SessionEnded):
        xs[0].numpy()
    del xs  # no error in __del__ after close


def test_metrics_show_the_tenant(daemon, alice):
    t = alice.tensor(np.zeros(1 << 16, np.uint8))

    def gauge(name):
        text = daemon.metrics()
        for line in text.splitlines():
            if line.startswith(f'{name}{{tenant="alice"}}'):
                return float(line.split()[-1])
        return None

    assert gauge("tpubox_sessions") == 1
    assert gauge("tpubox_tenant_device_bytes") == 1 << 16
    t.free()
    assert gauge("tpubox_tenant_device_bytes") == 0
    # Per-tenant totals over all of alice's sessions: an execution, its device time, a compile
    # the cache did not serve, a refusal.
    before = {
        k: gauge(k) or 0.0
        for k in (
            "tpubox_tenant_executions_total",
            "tpubox_tenant_device_seconds_total",
            "tpubox_tenant_compiles_total",
            "tpubox_tenant_refusals_total",
        )
    }
    exe = alice.compile(
        "func.func @main(%a: tensor<3xf32>) -> tensor<3xf32> {\n"
        "  %c = stablehlo.constant dense<2.71828> : tensor<3xf32>\n"
        "  %0 = stablehlo.multiply %a, %c : tensor<3xf32>\n"
        "  func.return %0 : tensor<3xf32>\n}\n"
    )
    exe.call(np.ones(3, np.float32))
    # An infeed nobody feeds: refused by the program policy, which counts as a refusal.
    with pytest.raises(tpubox.PermissionDenied, match="host-transfer"):
        alice.compile(
            "func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n"
            "  %tok = stablehlo.create_token : !stablehlo.token\n"
            '  %v:2 = "stablehlo.infeed"(%tok) {infeed_config = "", layout = [[0]]}'
            " : (!stablehlo.token) -> (tensor<4xf32>, !stablehlo.token)\n"
            "  func.return %v#0 : tensor<4xf32>\n}\n"
        )
    after = {k: gauge(k) for k in before}
    assert after["tpubox_tenant_executions_total"] == before["tpubox_tenant_executions_total"] + 1
    assert after["tpubox_tenant_device_seconds_total"] > before["tpubox_tenant_device_seconds_total"]
    # Both programs compiled (the policy checks the compiled program).
    assert after["tpubox_tenant_compiles_total"] == before["tpubox_tenant_compiles_total"] + 2
    assert after["tpubox_tenant_refusals_total"] >= before["tpubox_tenant_refusals_total"] + 1


def _child(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("how", ["exit", "os._exit", "SIGKILL"])
def test_session_ends_when_its_process_goes_away(daemon, how):
    # The child opens a session, makes a tensor, waits for a line on stdin, then goes away
    # without closing: a normal exit (atexit runs), os._exit (no atexit: only the Attach
    # stream's end tells the daemon), or SIGKILL.
    code = f"""
        import os, sys, numpy as np, tpubox
        s = tpubox.connect({daemon.unix!r}, {EXITS!r})
        t = s.tensor(np.ones(1 << 20, np.float32))
        print(s.session_id, flush=True)
        sys.stdin.readline()
        if {how!r} == "os._exit":
            os._exit(0)
        sys.stdin.readline()  # SIGKILL comes while it waits here
        """
    p = _child(code)
    sid = p.stdout.readline().strip()
    assert sid.startswith("s-"), p.stderr.read() if p.poll() is not None else sid
    u = tpubox.tenant_usage(daemon.unix, EXITS)
    assert u.sessions == 1 and u.usage.device_bytes == 4 << 20, u
    if how == "SIGKILL":
        p.kill()
    else:
        p.stdin.write("go\n" if how == "os._exit" else "go\ngo\n")
        p.stdin.flush()
    p.wait(timeout=30)
    wait_until(
        lambda: tpubox.tenant_usage(daemon.unix, EXITS).sessions == 0,
        timeout=5,
        what="the child's session ending",
    )
    u = tpubox.tenant_usage(daemon.unix, EXITS)
    assert u.usage == tpubox.Usage(), u
    assert f"session={sid}" in daemon.log()


def test_joined_session_from_the_environment(daemon, alice):
    t = alice.tensor(np.arange(4, dtype=np.int32))
    code = f"""
        import numpy as np, tpubox
        s = tpubox.connect()
        assert not s.owned and s.session_id == {alice.session_id!r}, s
        print(s.get({t.handle}).tolist())
        u = s.tensor(np.ones(2, np.int8))
        with s:  # a joined session's context manager does not end it
            pass
        print(u.handle)
        """
    p = _child(code, TPUBOX_ADDRESS=daemon.unix, TPUBOX_SESSION_TOKEN=alice.token)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert lines[0] == "[0, 1, 2, 3]"
    # The child exited; the session (alice's) lives on with the child's tensor in it.
    assert alice.usage().live_tensors == 2
    np.testing.assert_array_equal(alice.get(int(lines[1])), [1, 1])


def test_connect_without_address_or_environment(monkeypatch):
    monkeypatch.delenv("TPUBOX_ADDRESS", raising=False)
    monkeypatch.delenv("TPUBOX_SESSION_TOKEN", raising=False)
    with pytest.raises(ValueError, match="TPUBOX_ADDRESS"):
        tpubox.connect()


def test_bad_tokens(daemon, alice):
    with pytest.raises(tpubox.Unauthenticated) as e:
        tpubox.connect(daemon.unix, "not-a-token")
    assert e.value.kind == "unauthenticated"
    with pytest.raises(tpubox.Unauthenticated):
        tpubox.connect(daemon.unix, None)
    with pytest.raises(tpubox.PermissionDenied):
        tpubox.connect(daemon.unix, NO_SESSIONS)
    # A session token is not a tenant token, and the other way round.
    with pytest.raises(tpubox.Unauthenticated):
        tpubox.tenant_usage(daemon.unix, alice.token)
    with pytest.raises(tpubox.Unauthenticated):
        tpubox.session._join(daemon.unix, ALICE, 5.0)


def test_max_sessions(daemon):
    a = tpubox.connect(daemon.unix, FEW)
    b = tpubox.connect(daemon.tcp, FEW)
    with pytest.raises(tpubox.ResourceExhausted, match="max-sessions"):
        tpubox.connect(daemon.unix, FEW)
    a.close()
    c = tpubox.connect(daemon.unix, FEW)
    b.close()
    c.close()
    assert tpubox.tenant_usage(daemon.unix, FEW).sessions == 0


def test_a_tenants_sessions_share_its_device_budget(daemon):
    # grace: 4 MiB per session, 6 MiB for all of her sessions together.
    mib = 1 << 20
    with tpubox.connect(daemon.unix, BUDGET) as a, tpubox.connect(daemon.tcp, BUDGET) as b:
        x = a.tensor(np.zeros(3 * mib, np.uint8))
        y = b.tensor(np.zeros(3 * mib, np.uint8))
        # Within b's own 4 MiB, over grace's 6.
        with pytest.raises(tpubox.ResourceExhausted) as e:
            b.tensor(np.zeros(mib, np.uint8))
        assert e.value.limit == "max-device-bytes"
        assert "tenant `grace` (all its sessions together)" in str(e.value), e.value
        # Over a's own 4 MiB: the message says the session.
        with pytest.raises(tpubox.ResourceExhausted, match="this session") as e:
            a.tensor(np.zeros(2 * mib, np.uint8))
        assert e.value.limit == "max-device-bytes"
        x.free()
        z = b.tensor(np.ones(mib, np.uint8))
        assert tpubox.tenant_usage(daemon.unix, BUDGET).usage.device_bytes == 4 * mib
        assert int(z.numpy().sum()) == mib and y.shape == (3 * mib,)
    # Without tenant_max_device_mib the tenant's sessions together get one session's worth:
    # carol's second session cannot double her 1 MiB.
    with tpubox.connect(daemon.unix, SMALL) as a, tpubox.connect(daemon.unix, SMALL) as b:
        held = a.tensor(np.zeros(600_000, np.uint8))
        with pytest.raises(tpubox.ResourceExhausted, match="all its sessions together"):
            b.tensor(np.zeros(600_000, np.uint8))
        held.free()


def test_sighup_reloads_the_tokens_file_without_ending_sessions(own_daemon):
    import signal

    from tpubox_daemon import tokens_toml

    d = own_daemon
    bob = tpubox.connect(d.unix, BOB)
    x = bob.tensor(np.arange(4, dtype=np.float32))
    erin = tpubox.connect(d.unix, FEW)
    with pytest.raises(tpubox.Unauthenticated):
        tpubox.connect(d.unix, "henry-token")

    def hup_and_wait(tenants, line):
        (d.root / "tokens.toml").write_text(tokens_toml(tenants))
        before = d.log().count(line)
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while d.log().count(line) == before:
            assert d.proc.poll() is None, d.log()[-2000:]
            assert time.monotonic() < deadline, d.log()[-2000:]
            time.sleep(0.05)

    # henry is added, erin removed, bob's limits change.
    tenants = {k: v for k, v in d.tenants.items() if k != "erin"}
    tenants["henry"] = {"token": "henry-token", "session": {}}
    tenants["bob"] = {"token": BOB, "session": {"max_device_mib": 2}}
    hup_and_wait(tenants, "reloaded (SIGHUP)")
    with tpubox.connect(d.unix, "henry-token") as henry:
        assert henry.tenant == "henry"
    # bob's live session goes on with its tensor and its old limits; a new one gets the new.
    np.testing.assert_array_equal(x.numpy(), np.arange(4, dtype=np.float32))
    assert bob.limits.max_device_bytes != 2 << 20
    with tpubox.connect(d.unix, BOB) as bob2:
        assert bob2.limits.max_device_bytes == 2 << 20
    # erin's session ended, and her token opens nothing any more.
    with pytest.raises((tpubox.SessionEnded, tpubox.Unauthenticated)):
        erin.usage()
    with pytest.raises(tpubox.Unauthenticated):
        tpubox.connect(d.unix, FEW)
    # A broken file is reported and the one in use kept.
    (d.root / "tokens.toml").write_text("[[tenant]]\nname = 'x'\ntokens = [")
    before = d.log().count("was not reloaded")
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while d.log().count("was not reloaded") == before:
        assert time.monotonic() < deadline, d.log()[-2000:]
        time.sleep(0.05)
    with tpubox.connect(d.unix, "henry-token") as henry:
        assert henry.tenant == "henry"
    assert bob.usage().live_tensors == 1
    bob.close()


def test_socket_mode_and_group_options(tmp_path):
    import grp
    import stat

    from conftest import TENANTS

    group = grp.getgrnam("users") if "users" in {g.gr_name for g in grp.getgrall()} else None
    gid = group.gr_gid if group else os.getgid()
    args = ("--session-socket-mode", "0660", "--session-socket-group", group.gr_name if group else str(gid))
    with Daemon(tmp_path / "d", TENANTS, extra_args=args) as d:
        for path in (d.socket_path, Path(str(d.socket_path) + ".local")):
            st = os.stat(path)
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid, (path, oct(st.st_mode))
        with tpubox.connect(d.unix, BOB) as s:
            assert s.tenant == "bob"
    # A mode with more than read and write bits is refused before anything starts.
    r = subprocess.run(
        [str(binary()), "serve", "--session-socket", str(tmp_path / "x.sock"), "--session-socket-mode", "0777"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "at most 0666" in r.stderr, r.stderr


def test_unreachable_daemon_is_unavailable_at_once(tmp_path):
    for address in (f"unix:{tmp_path}/nothing.sock", "127.0.0.1:1"):
        t0 = time.monotonic()
        with pytest.raises(tpubox.Unavailable) as e:
            tpubox.connect(address, ALICE)
        assert time.monotonic() - t0 < 5
        assert address in str(e.value) and e.value.kind == "unavailable"


@pytest.mark.parametrize("door", ["local", "unix", "tcp"])
def test_daemon_killed_means_unavailable_promptly(own_daemon, door):
    address = own_daemon.tcp if door == "tcp" else own_daemon.unix
    s = tpubox.connect(address, ALICE, local=door == "local")
    assert s.transport == ("local" if door == "local" else "grpc")
    t = s.tensor(np.ones(4, np.float32))
    exe = s.compile(ADD)
    own_daemon.kill()
    for call in (t.numpy, s.usage, lambda: s.tensor(np.ones(2)), lambda: exe(t, t)):
        t0 = time.monotonic()
        with pytest.raises(tpubox.Unavailable) as e:
            call()
        assert time.monotonic() - t0 < 5, call
        assert address in str(e.value)
    s.close()  # does not raise


def test_daemon_stopping_ends_attached_sessions(own_daemon):
    s = tpubox.connect(own_daemon.tcp, BOB)
    s.tensor(np.ones(2))
    assert own_daemon.stop() == 0
    wait_until(lambda: s._attachment.done.is_set(), what="the Attach stream ending")
    with pytest.raises((tpubox.SessionEnded, tpubox.Unavailable)):
        s.usage()


def test_transport_choice(daemon):
    with tpubox.connect(daemon.unix, BOB) as s:
        assert s.transport == "local"  # a Unix-socket session on the daemon's machine
    with tpubox.connect(daemon.tcp, BOB) as s:
        assert s.transport == "grpc"  # TCP: the local socket only when asked for
    with tpubox.connect(daemon.tcp, BOB, local=True) as s:
        assert s.transport == "local"
        np.testing.assert_array_equal(s.tensor(np.arange(3)).numpy(), np.arange(3))
    assert tpubox.tenant_usage(daemon.unix, BOB).sessions == 0


def test_closing_a_joined_session_only_disconnects(daemon, alice):
    # A joined Session object has no Attach stream of its own; the owner's holds the session.
    joined = tpubox.session._join(daemon.unix, alice.token, 5.0)
    joined.close()  # disconnects only
    assert alice.usage() == tpubox.Usage()
    assert joined.closed and not alice.closed
