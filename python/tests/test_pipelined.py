"""Pipelined launches on the local socket (issue 46): results named from a reservation, sent
without waiting for the reply, refusals raised by the next request; small tensors inline in
the messages; and the hostile cases (made-up, reused and other sessions' handle numbers, a
flood of launches never read)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ALICE

import tpubox
from tpubox import _local

ADD = """
func.func @main(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.add %a, %b : tensor<4xf32>
  func.return %0 : tensor<4xf32>
}
"""


@pytest.fixture
def s(daemon):
    with tpubox.connect(daemon.unix, ALICE, label="pytest pipelined") as s:
        assert s.transport == "local"
        yield s


def test_pipelined_launches_chain_and_match_the_launch(s):
    add = s.compile(ADD)
    x = s.tensor(np.arange(4, dtype=np.float32))
    (ref,) = add.launch(x, x)
    y = x
    for _ in range(3 * _local.PIPELINE_WINDOW + 5):  # several windows
        (y,) = s._launch_pipelined(add, [y, x], ())
    (z,) = s._launch_pipelined(add, [y, np.ones(4, np.float32)], ())  # an inline argument
    for a in ("shape", "dtype", "device", "nbytes", "read_only", "weights"):
        assert getattr(z, a) == getattr(ref, a), a
    n = 3 * _local.PIPELINE_WINDOW + 6
    np.testing.assert_array_equal(z.numpy(), np.arange(4) * n + 1)
    s.wait_all()


def test_small_tensors_travel_inline(s):
    a = np.arange(10, dtype=np.float32)
    t = s.tensor(a)  # put: after the header
    np.testing.assert_array_equal(t.numpy(), a)  # get: after the reply's JSON
    add = s.compile(ADD)
    r = add.call(np.ones(4, np.float32), np.full(4, 2, np.float32), fetch=[0])
    np.testing.assert_array_equal(r[0], np.full(4, 3))
    big = np.ones(_local.MAX_INLINE_BYTES // 4 + 1, np.float32)  # over the limit: a memfd
    np.testing.assert_array_equal(s.tensor(big).numpy(), big)


def test_a_refused_pipelined_launch_is_raised_by_the_next_request(s):
    add = s.compile(ADD)
    x = s.tensor(np.ones(4, np.float32))
    gone = s.tensor(np.ones(4, np.float32))
    gone.free()
    gone._freed = False  # a stale handle, as a buggy caller would hold
    (y,) = s._launch_pipelined(add, [gone, x], ())  # not raised here
    with pytest.raises(tpubox.NotFound, match="pipelined launch of executable"):
        s.wait_all()
    s.wait_all()  # raised once
    with pytest.raises(tpubox.NotFound):
        y.numpy()  # never made


def test_made_up_and_reused_handles_are_refused(daemon, s):
    add = s.compile(ADD)
    x = s.tensor(np.ones(4, np.float32))

    def launch(out, session=s):
        return session._local.request(
            "call",
            {
                "executable": add.handle,
                "arguments": [{"handle": x.handle}, {"handle": x.handle}],
                "launch": True,
                "out": out,
            },
            None,
            10,
        )

    with s._reserve_lock:
        first = s._out_handles(2)[0]
    launch([first])
    for out in ([first], [12345], [first + 5000]):
        with pytest.raises(tpubox.InvalidArgument, match="reserved"):
            launch(out)
    with tpubox.connect(daemon.unix, ALICE, label="pytest pipelined other") as other:
        with other._reserve_lock:
            theirs = other._out_handles(1)[0]
        with pytest.raises(tpubox.InvalidArgument, match="reserved"):
            launch([theirs])
        # And their tensors are not ours to use.
        with s._reserve_lock:
            mine = s._out_handles(1)[0]
        launch([mine])
        with pytest.raises(tpubox.NotFound):
            other.get(mine)


def test_a_flood_of_pipelined_launches_is_bounded(daemon):
    # More launches than the session may hold results for, none read: each past the limit is
    # refused by the daemon, and the refusal is raised by the next request, with its kind.
    with tpubox.connect(
        daemon.unix, ALICE, limits={"max_live_tensors": 16, "max_pending_launches": 8}
    ) as s:
        add = s.compile(ADD)
        x = s.tensor(np.ones(4, np.float32))
        outs = []
        with pytest.raises(tpubox.ResourceExhausted) as e:
            # (raised by the wait of a later window, or by wait_all)
            for _ in range(200):
                outs += s._launch_pipelined(add, [x, x], ())
            s.wait_all()
        assert "max-live-tensors" in str(e.value) or "max-pending-launches" in str(e.value)
        assert "pipelined launch" in str(e.value)
        u = s.usage()
        assert u.live_tensors <= 16 and u.pending_launches <= 8
        # What the refused launches were to free is freed again once their results go.
        del outs
        s.wait_all()
        s._flush_frees()
        assert s.usage().live_tensors == 1  # x


def test_batched_launches_go_out_with_a_read_or_when_sent(s):
    add = s.compile(ADD)
    x = s.tensor(np.ones(4, np.float32))
    (y,) = s._launch_pipelined(add, [x, x], ())  # batched, not written yet
    assert s._local._batched == (1 if _local.LAUNCH_BATCH > 1 else 0)
    s._send_launches()
    assert s._local._batched == 0 and not s._local._out
    (z,) = s._launch_pipelined(add, [y, y], ())
    np.testing.assert_array_equal(z.numpy(), np.full(4, 4))  # the read sends the batch first


def test_a_read_answered_with_the_launches_keeps_its_memfd(tmp_path):
    """A get sent in the same batch as pipelined launches, whose reply and memfd arrive in the
    same socket read as the launches' replies (a fake daemon sends them in one message): the
    memfd is the get's, not dropped with the launches' replies."""
    import json
    import os
    import socket
    import struct
    import threading

    path = str(tmp_path / "fake.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    payload = np.arange(20000, dtype=np.float32).tobytes()  # over the inline limit

    def frame(obj):
        body = json.dumps(obj).encode()
        return struct.pack("<I", len(body)) + body

    def fake_daemon():
        conn, _ = server.accept()
        with conn:
            buf = b""
            requests = []
            while len(requests) < 4:  # three launches and the get
                buf += conn.recv(1 << 16)
                while len(buf) >= 4:
                    (n,) = struct.unpack_from("<I", buf)
                    if len(buf) < 4 + n:
                        break
                    requests.append(json.loads(buf[4 : 4 + n]))
                    buf = buf[4 + n :]
            assert [r["op"] for r in requests] == ["call", "call", "call", "get"], requests
            fd = os.memfd_create("fake", os.MFD_CLOEXEC)
            os.write(fd, payload)
            replies = b"".join(frame({"ok": {"launch": i}}) for i in range(3))
            info = {"handle": 7, "dtype": "F32", "dims": [20000], "device": 0}
            replies += frame({"ok": dict(info, byte_size=len(payload))})
            socket.send_fds(conn, [replies], [fd])
            os.close(fd)

    t = threading.Thread(target=fake_daemon, daemon=True)
    t.start()
    ch = _local.LocalChannel(path, "token", "unix:fake")
    head = '{"executable":1,"arguments":[],"launch":true,"out":[%d]'
    for h in range(3):
        ch.launch(head % (100 + h), 1, [100 + h], 5.0)
    info, got = ch.get(7)
    t.join(5)
    assert info["byte_size"] == len(payload)
    np.testing.assert_array_equal(got.view(np.float32), np.frombuffer(payload, np.float32))
    ch.close()
    server.close()
