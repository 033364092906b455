"""Memory and descriptors a session can make the daemon hold (issue 27: "The local socket takes
descriptors before the token", "Memory a session uses that its limit never sees").

The bounds asserted here are the ones docs/SECURITY.md documents: a tenant's transfers in
flight (uploads being received, host copies of tensors being read, one queued message per
GetTensor stream, mapped memfds) hold at most its `max_device_bytes` (128 MiB for `attacker`),
beside the device bytes it holds (on the CPU plugin those are host memory too); a local-socket
request holds at most one descriptor before its token is checked.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import threading
import time

import grpc
import pytest

from hardening_util import (
    ATTACKER,
    Prober,
    assert_probe_held,
    baseline_p99,
    p99,
    settle_rss,
)
from tpubox._proto import session_pb2 as pb
from tpubox._proto import session_pb2_grpc as pbg

MIB = 1 << 20
ATTACKER_LIMIT_MIB = 128
# Protocol buffers, allocator slack and the probe's own requests, beside the documented bound.
SLACK_MIB = 64
# Chunks of up to 16 MiB come back (grpcio's default limit is 4 MiB).
RECEIVE = [("grpc.max_receive_message_length", 64 * MIB)]
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def triggered(d, name: str) -> float:
    """How often protection NAME triggered: its metric, or (on a daemon without the metric)
    the log lines naming it."""
    return d.protection_count(name) or float(d.log().count(f'protection="{name}"'))


def auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def open_session(d, token: str = ATTACKER, options=()) -> tuple[grpc.Channel, pbg.SessionStub, str]:
    ch = grpc.insecure_channel(d.session_tcp, options=[*RECEIVE, *options])
    stub = pbg.SessionStub(ch)
    r = stub.Open(pb.OpenRequest(label="hardening"), metadata=auth(token), timeout=30)
    return ch, stub, r.session_token


def f32_spec(n: int) -> pb.TensorSpec:
    return pb.TensorSpec(dtype=pb.F32, dims=[n])


def put(stub, token: str, data: bytes) -> pb.TensorInfo:
    step = 2 * MIB

    def chunks():
        yield pb.PutTensorChunk(spec=f32_spec(len(data) // 4), data=data[:step])
        for off in range(step, len(data), step):
            yield pb.PutTensorChunk(data=data[off : off + step])

    return stub.PutTensor(chunks(), metadata=auth(token), timeout=60)


def memfd(size: int, head: bytes, seals: int = SEALS) -> int:
    fd = os.memfd_create("hardening", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    os.pwrite(fd, head, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def local_request(path, header: dict, fds=()) -> dict:
    body = json.dumps(header).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        socket.send_fds(s, [struct.pack("<I", len(body)) + body], list(fds))
        data = b""
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            more, got, _, _ = socket.recv_fds(s, 1 << 16, 1)
            for fd in got:
                os.close(fd)
            if not more:
                break
            data += more
    return json.loads(data[4:])


def test_local_socket_descriptor_flood_is_bounded(daemon):
    """A client that declares a 64 KiB header and sends thousands of SCM_RIGHTS messages
    (4 descriptors each) on several connections: the daemon holds at most one descriptor per
    request before the token, closes the rest and the connection, and keeps serving."""
    d = daemon(nofile=256)
    base = baseline_p99(d)
    fds0 = d.open_fds()
    before = triggered(d, "local-socket-descriptors")
    spare = [os.memfd_create("spare") for _ in range(4)]
    stop = threading.Event()
    sent = [0]

    def flood():
        while not stop.is_set():
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(2)
                    s.connect(str(d.local_path))
                    s.sendall(struct.pack("<I", 64 << 10))
                    for _ in range(4000):
                        if stop.is_set():
                            break
                        socket.send_fds(s, [b"{"], spare)
                        sent[0] += 1
            except OSError:
                continue

    most = fds0
    with Prober(d) as p:
        threads = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            most = max(most, d.open_fds())
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join(timeout=10)
    for fd in spare:
        os.close(fd)
    print(f"descriptor flood: {sent[0]} messages; descriptors {fds0} -> at most {most}; "
          f"probe p99 {base * 1e3:.1f} -> {p99(p.samples) * 1e3:.1f} ms")
    assert sent[0] > 1000, f"the flood sent only {sent[0]} messages"
    # Four connections at a time, each: its socket and at most one descriptor.
    assert most <= fds0 + 16, f"the daemon's descriptors rose from {fds0} to {most}"
    assert_probe_held(base, p)
    assert triggered(d, "local-socket-descriptors") > before
    # The local socket still works: a put of a real tensor.
    _, _, token = open_session(d)
    fd = memfd(8, struct.pack("<2f", 1, 2))
    try:
        r = local_request(d.local_path, {"op": "put", "token": token, "dtype": "F32", "dims": [2]}, [fd])
    finally:
        os.close(fd)
    assert r["ok"]["byte_size"] == 8, r


def test_local_socket_accept_backs_off_out_of_descriptors(daemon):
    """Idle local-socket connections past what the daemon's descriptors allow: the connection
    cap (half of 96 descriptors, shared with every door) closes the extras at once, and an
    accept that still fails (EMFILE) backs off; either way the loop does not spin a core, and
    it serves again once the flood ends."""
    d = daemon(nofile=96)
    _, _, token = open_session(d)
    before = triggered(d, "accept-errors") + triggered(d, "connections-total")
    conns = []
    for _ in range(120):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(d.local_path))
        conns.append(s)
    time.sleep(1)
    cpu0 = d.cpu_seconds()
    time.sleep(2)
    spent = d.cpu_seconds() - cpu0
    print(f"out of descriptors ({d.open_fds()} open): {spent:.2f} s of CPU in 2 s")
    for s in conns:
        s.close()
    assert spent < 0.5, f"the daemon spent {spent:.2f} s of CPU in 2 s while out of descriptors"
    time.sleep(1.5)  # the longest back-off is 1 s
    assert triggered(d, "accept-errors") + triggered(d, "connections-total") > before
    fd = memfd(4, struct.pack("<f", 1))
    try:
        r = local_request(d.local_path, {"op": "put", "token": token, "dtype": "F32", "dims": [1]}, [fd])
    finally:
        os.close(fd)
    assert r["ok"]["byte_size"] == 4, r


def test_local_socket_closes_a_stalled_header(daemon):
    """A local-socket client that sends part of a header and stalls (and one that never sends
    anything) is closed after the header timeout (--header-timeout-seconds, 10 s), not held
    forever."""
    d = daemon()
    before = triggered(d, "header-timeout")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as partial, socket.socket(
        socket.AF_UNIX, socket.SOCK_STREAM
    ) as silent:
        partial.connect(str(d.local_path))
        silent.connect(str(d.local_path))
        partial.sendall(struct.pack("<I", 100) + b'{"op": "put"')
        for s in (partial, silent):
            s.settimeout(20)
            assert s.recv(16) == b"", "the daemon answered a request it never got"
    assert triggered(d, "header-timeout") > before


def test_local_put_maps_only_the_declared_size(daemon):
    """A sealed, sparse 1 GiB memfd sent for a [1] f32 put: the daemon maps 4 bytes, not 1 GiB."""
    d = daemon()
    _, _, token = open_session(d)
    fd = memfd(1 << 30, struct.pack("<f", 3.5))
    try:
        rss0 = d.rss_mib()
        d.reset_peak()
        r = local_request(d.local_path, {"op": "put", "token": token, "dtype": "F32", "dims": [1]}, [fd])
        peak = d.peak_mib()
    finally:
        os.close(fd)
    print(f"1 GiB memfd, [1] f32 put: RSS {rss0:.0f} MiB before, peak {peak:.0f} MiB")
    assert r["ok"]["byte_size"] == 4, r
    assert peak <= rss0 + 8, f"a 4-byte put from a 1 GiB memfd: peak RSS {peak:.0f} MiB, {rss0:.0f} before"


def test_uploads_in_flight_are_charged(daemon):
    """Eight PutTensor streams that declare 120 MiB, send 100 MiB and stall: each is charged
    its 120 MiB while in flight against the tenant's transfer pool (2 x its 128 MiB), so two
    are admitted and every other gets RESOURCE_EXHAUSTED at once."""
    d = daemon()
    ch, stub, token = open_session(d)
    base = baseline_p99(d)
    rss0 = d.rss_mib()
    d.reset_peak()
    release = threading.Event()
    block = b"\0" * (2 * MIB)
    declared = 120 * MIB

    def stalled():
        yield pb.PutTensorChunk(spec=f32_spec(declared // 4), data=block)
        for _ in range(49):  # 100 MiB in all
            yield pb.PutTensorChunk(data=block)
        release.wait(60)

    with Prober(d) as p:
        calls = []
        for _ in range(8):
            calls.append(stub.PutTensor.future(stalled(), metadata=auth(token), timeout=60))
            time.sleep(0.3)
        time.sleep(2)
        done = [c for c in calls if c.done()]
        codes = [c.code() for c in done]
        peak = d.peak_mib()
        release.set()
        for c in calls:
            c.cancel()
    ch.close()
    print(f"stalled uploads: RSS {rss0:.0f} MiB before, peak {peak:.0f} MiB; {len(done)} refused")
    assert len(done) == 6 and codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6, (
        f"{len(done)} of 8 stalled uploads ended, with {codes}; want 6, all RESOURCE_EXHAUSTED"
    )
    detail = done[0].exception().details()
    assert "max-device-bytes" in detail and "in flight" in detail, detail
    bound = rss0 + 2 * ATTACKER_LIMIT_MIB + SLACK_MIB
    assert peak <= bound, f"peak RSS {peak:.0f} MiB under stalled uploads (bound {bound:.0f})"
    assert_probe_held(base, p)
    rss = settle_rss(d, rss0)
    print(f"after the uploads: RSS {rss:.0f} MiB; probe p99 {base * 1e3:.1f} -> {p99(p.samples) * 1e3:.1f} ms")
    assert rss <= rss0 + 64, f"RSS {rss:.0f} MiB after the uploads ended ({rss0:.0f} before)"


@pytest.mark.parametrize("chunk_bytes, refused", [(0, 0), (1, 0)])
def test_slow_readers_hold_one_shared_copy(daemon, chunk_bytes, refused):
    """Twelve GetTensor streams of one 64 MiB tensor that nobody reads (BDP probing off, so the
    client's window stays small), and the same with `chunk_bytes = 1` (raised to 64 KiB): the
    daemon holds one shared host copy (64 MiB) and two queued chunks per stream, all charged to
    the tenant's transfer pool (2 x its 128 MiB): 64 + 12 x 8 MiB with 4 MiB chunks, all
    admitted, and the daemon's peak within that pool of what it held with the tensor."""
    d = daemon()
    rss0 = d.rss_mib()
    ch, stub, token = open_session(d)
    t = put(stub, token, b"\1" * (64 * MIB))
    base = baseline_p99(d)
    held = d.rss_mib()
    d.reset_peak()
    slow = grpc.insecure_channel(d.session_tcp, options=[("grpc.http2.bdp_probe", 0), *RECEIVE])
    slow_stub = pbg.SessionStub(slow)
    with Prober(d) as p:
        streams = []
        for _ in range(12):
            streams.append(
                slow_stub.GetTensor(
                    pb.GetTensorRequest(handle=t.handle, chunk_bytes=chunk_bytes),
                    metadata=auth(token),
                    timeout=60,
                )
            )
            time.sleep(0.2)
        time.sleep(2)
        peak = d.peak_mib()
        ended = [s for s in streams if s.done()]
        codes = [s.code() for s in ended]
        details = [s.details() for s in ended]
        for s in streams:
            s.cancel()
    slow.close()
    print(f"12 slow readers, chunk_bytes={chunk_bytes}: RSS {rss0:.0f} MiB at start, "
          f"{held:.0f} with the tensor, peak {peak:.0f} MiB; {len(ended)} refused; probe p99 "
          f"{base * 1e3:.1f} -> {p99(p.samples) * 1e3:.1f} ms")
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * refused, (codes, details)
    assert all("max-device-bytes" in m for m in details), details
    # The shared copy and the streams' queued messages: at most the tenant's transfer pool.
    bound = held + 2 * ATTACKER_LIMIT_MIB + SLACK_MIB
    assert peak <= bound, (
        f"peak RSS {peak:.0f} MiB with 12 slow readers of a 64 MiB tensor "
        f"(bound {bound:.0f}: {held:.0f} with the tensor)"
    )
    assert_probe_held(base, p)
    # Once the slow readers are gone, a full read works and gives the bytes back.
    time.sleep(0.5)
    req = pb.GetTensorRequest(handle=t.handle, chunk_bytes=chunk_bytes)
    got = b"".join(m.data for m in stub.GetTensor(req, metadata=auth(token), timeout=60))
    assert got == b"\1" * (64 * MIB)
    stub.Free(pb.FreeRequest(tensors=[t.handle]), metadata=auth(token), timeout=10)
    ch.close()
    rss = settle_rss(d, rss0)
    print(f"after the reads: RSS {rss:.0f} MiB")
    assert rss <= rss0 + 64, f"RSS {rss:.0f} MiB after the reads ended ({rss0:.0f} before)"


# ---------------------------------------------------------------------------------------------
# Memory the local socket lends (issue 51, item 2).


def _local_get_keep(path, token: str, handle: int, release=()) -> tuple[dict, list[int]]:
    """A local get whose memfd the caller keeps (as a hostile client would): the reply and the
    descriptors it carried."""
    header = {"op": "get", "token": token, "handle": handle}
    if release:
        header["release"] = list(release)
    body = json.dumps(header).encode()
    fds: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(path))
        s.sendall(struct.pack("<I", len(body)) + body)
        data = b""
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            more, got, _, _ = socket.recv_fds(s, 1 << 16, 1)
            fds += got
            if not more:
                break
            data += more
    return json.loads(data[4:]), fds


def _held_mib(fds: list[int]) -> float:
    """The memory the memfds FDS hold now (allocated blocks), in MiB."""
    return sum(os.fstat(fd).st_blocks * 512 for fd in fds) / MIB


def test_memfds_a_client_keeps_are_bounded_by_its_transfer_pool(daemon):
    """Was: 24 local gets of a 32 MiB tensor left 768 MiB of shared memory alive in the
    client's memfds, for a tenant limited to 128 MiB. Now each lent memfd is charged to the
    tenant's transfer pool (2 x 128 MiB) until released: a client that keeps every memfd gets
    resource-exhausted once the pool is full; releasing leases (or ending the session) frees
    the pages even though the client still holds the descriptors (the daemon truncates them)."""
    d = daemon()
    ch, stub, token = open_session(d)
    data = os.urandom(32 * MIB)
    info = put(stub, token, data)
    kept: list[int] = []
    leases: list[int] = []
    refusals = []
    try:
        for _ in range(24):
            r, fds = _local_get_keep(d.local_path, token, info.handle)
            if "ok" in r:
                assert len(fds) == 1
                assert os.pread(fds[0], 64, 1000) == data[1000:1064]
                leases.append(r["ok"]["lease"])
                kept += fds
            else:
                assert not fds
                refusals.append(r["error"])
        held = _held_mib(kept)
        print(f"24 gets of 32 MiB kept: {len(kept)} lent ({held:.0f} MiB held), {len(refusals)} refused")
        assert 4 <= len(kept) <= 2 * ATTACKER_LIMIT_MIB // 32, len(kept)
        assert held <= 2 * ATTACKER_LIMIT_MIB, held
        assert refusals and all(e["kind"] == "resource-exhausted" for e in refusals), refusals[:2]
        assert "max-device-bytes" in refusals[0]["message"]
        # Releasing two leases frees their pages (the client still holds the descriptors)
        # and makes room for another get.
        r = local_request(d.local_path, {"op": "release", "token": token, "leases": leases[:2]})
        assert r["ok"] == {"released": 2, "unknown": []}, r
        assert _held_mib(kept[:2]) == 0 and os.fstat(kept[0]).st_size == 0
        r, fds = _local_get_keep(d.local_path, token, info.handle, release=[leases[0]])
        assert "ok" in r, r
        kept += fds
        # Ending the session frees every lent memfd, held or not.
        stub.Close(pb.CloseRequest(), metadata=auth(token), timeout=30)
        assert _held_mib(kept) == 0, _held_mib(kept)
    finally:
        for fd in kept:
            os.close(fd)
        ch.close()


def test_python_client_holds_any_number_of_gets(daemon):
    """The Python client copies each lent memfd into its own array and releases the lease
    with its next request: 24 gets of a 32 MiB tensor, all kept, all succeed and are right,
    and the tenant's transfers in flight come back to nothing."""
    import numpy as np
    import tpubox

    d = daemon()
    x = np.random.default_rng(1).standard_normal(8 * MIB).astype(np.float32)
    with tpubox.connect(f"unix:{d.socket_path}", ATTACKER, label="holder") as s:
        t = s.tensor(x)
        got = [s.get(t) for _ in range(24)]
        for g in got:
            np.testing.assert_array_equal(g, x)
        got[0][0] = 7.0  # the arrays are the client's own, writable
        s.get(t)
        assert s.usage().transfer_bytes <= 32 * MIB, s.usage()
