"""Versioned weights a tenant publishes from device tensors it holds (issue 34, part 3).

One daemon of this module's own (tokens with `publish_weights`, publish limits, a metrics
reader, a host weight set `tiny`): the ledger, the transfer counters and the live-bytes gauge
it checks are then this module's alone.

The reference values are exact: every weight, input and step is a small integer in f32, so
x @ w + b is computed without rounding on the device and in NumPy, and a read that mixed
two versions (w of one, b of another) could not equal the reference of either (every element
of the step's b differs from 0). Each tensor and result also says which versions it came from
(``Tensor.weights``: sorted (set, version) pairs; a set named twice would be a mix).

Device→host bytes while publishing are counted three ways in the big test: the publishing
session's own transfer counters (``Usage.device_to_host_bytes``) over the phase; the daemon's
counters (``tpubox_transfer_bytes_total{direction}`` on /metrics, which every copy between
host and device goes through) over the phase, equal to exactly the readers' results; and the
daemon's counters over a phase of publishes with no reader at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import TINY_WEIGHTS, write_safetensors
from tpubox_daemon import Daemon, binary, metric, wait_until

import tpubox

PUB = "pub-token"  # publishes the big test's set; reads /metrics
KEEPER = "keeper-token"  # publishes the sets of the smaller tests
READER = "reader-token"  # may not publish; listed in the publishers' `readers`
OUTSIDER = "outsider-token"  # may not publish; listed nowhere
THIEF = "thief-token"  # may publish, tries others' names
CAPPED = "capped-token"  # at most 2 live published versions
CAPBYTES = "capbytes-token"  # at most 1 MiB of live published versions
DIES = "dies-token"  # its publisher process is killed

TENANTS = {
    "pub": {
        "token": PUB,
        "session": {
            "publish_weights": True,
            "max_published_versions": 64,
            "max_device_mib": 1024,
            "max_sessions": 16,
        },
        "metrics": True,
    },
    "keeper": {"token": KEEPER, "session": {"publish_weights": True}},
    "reader": {"token": READER, "session": {"max_sessions": 32}},
    "outsider": {"token": OUTSIDER, "session": {}},
    "thief": {"token": THIEF, "session": {"publish_weights": True}},
    "capped": {"token": CAPPED, "session": {"publish_weights": True, "max_published_versions": 2}},
    "capbytes": {"token": CAPBYTES, "session": {"publish_weights": True, "max_published_mib": 1}},
    "dies": {"token": DIES, "session": {"publish_weights": True, "max_published_versions": 64}},
}

# The big test's set: y = x @ w + b.
M, K, N = 4, 16, 8
N_VERSIONS = 100  # published while the reads run
N_READS = 1000
N_READERS = 16  # threads, each with its own session

MATMUL_BIAS = f"""
func.func @main(%x: tensor<{M}x{K}xf32>, %w: tensor<{K}x{N}xf32>, %b: tensor<{N}xf32>)
    -> tensor<{M}x{N}xf32> {{
  %xw = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST]
      : (tensor<{M}x{K}xf32>, tensor<{K}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %bb = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<{N}xf32>) -> tensor<{M}x{N}xf32>
  %y = stablehlo.add %xw, %bb : tensor<{M}x{N}xf32>
  func.return %y : tensor<{M}x{N}xf32>
}}
"""

# The trainer's step, on the device: (w, b) + (dw, db).
STEP = f"""
func.func @main(%w: tensor<{K}x{N}xf32>, %b: tensor<{N}xf32>,
                %dw: tensor<{K}x{N}xf32>, %db: tensor<{N}xf32>)
    -> (tensor<{K}x{N}xf32>, tensor<{N}xf32>) {{
  %0 = stablehlo.add %w, %dw : tensor<{K}x{N}xf32>
  %1 = stablehlo.add %b, %db : tensor<{N}xf32>
  func.return %0, %1 : tensor<{K}x{N}xf32>, tensor<{N}xf32>
}}
"""

NEG = f"""
func.func @main(%w: tensor<{K}x{N}xf32>) -> tensor<{K}x{N}xf32> {{
  %0 = stablehlo.negate %w : tensor<{K}x{N}xf32>
  func.return %0 : tensor<{K}x{N}xf32>
}}
"""


def slow_step(n: int = 16, size: int = 1024) -> str:
    """STEP, made slow: it also runs N chained SIZE² matmuls (with tanh) and adds 0 × their sum
    (XLA does not fold a float multiply by 0), so its results are exactly STEP's, about a
    second later on the CPU plugin."""
    t = f"tensor<{size}x{size}xf32>"
    wt, bt = f"tensor<{K}x{N}xf32>", f"tensor<{N}xf32>"
    lines = [
        f"func.func @main(%w: {wt}, %b: {bt}, %dw: {wt}, %db: {bt}, %x: {t}) -> ({wt}, {bt}) {{"
    ]
    prev = "%x"
    for i in range(n):
        lines.append(
            f"  %y{i} = stablehlo.dot_general {prev}, %x, contracting_dims = [1] x [0]"
            f" : ({t}, {t}) -> {t}"
        )
        lines.append(f"  %t{i} = stablehlo.tanh %y{i} : {t}")
        prev = f"%t{i}"
    lines += [
        "  %zero = stablehlo.constant dense<0.0> : tensor<f32>",
        f"  %s = stablehlo.reduce({prev} init: %zero) applies stablehlo.add"
        f" across dimensions = [0, 1] : ({t}, tensor<f32>) -> tensor<f32>",
        "  %z = stablehlo.multiply %s, %zero : tensor<f32>",
        f"  %zw = stablehlo.broadcast_in_dim %z, dims = [] : (tensor<f32>) -> {wt}",
        f"  %zb = stablehlo.broadcast_in_dim %z, dims = [] : (tensor<f32>) -> {bt}",
        f"  %w1 = stablehlo.add %w, %dw : {wt}",
        f"  %w2 = stablehlo.add %w1, %zw : {wt}",
        f"  %b1 = stablehlo.add %b, %db : {bt}",
        f"  %b2 = stablehlo.add %b1, %zb : {bt}",
        f"  func.return %w2, %b2 : {wt}, {bt}",
        "}",
    ]
    return "\n".join(lines)


_rng = np.random.default_rng(34)
W1 = _rng.integers(-4, 5, (K, N)).astype(np.float32)
B1 = _rng.integers(-4, 5, N).astype(np.float32)
DW = _rng.integers(-2, 3, (K, N)).astype(np.float32)
DB = (_rng.integers(1, 3, N) * _rng.choice([-1, 1], N)).astype(np.float32)  # no zero
X = _rng.integers(-3, 4, (M, K)).astype(np.float32)
assert np.all(DB != 0)


def params(k: int) -> dict[str, np.ndarray]:
    """Version K of a set stepped from (W1, B1) by (DW, DB): W1 + (K-1)·DW, B1 + (K-1)·DB."""
    return {"w": W1 + (k - 1) * DW, "b": B1 + (k - 1) * DB}


def reference(k: int) -> np.ndarray:
    p = params(k)
    return X @ p["w"] + p["b"]




# What the daemon's /metrics say about device memory and transfers: (metric, labels).
DEVICE_METRICS = {
    "device_to_host": ("tpubox_transfer_bytes_total", {"direction": "device_to_host"}),
    "host_to_device": ("tpubox_transfer_bytes_total", {"direction": "host_to_device"}),
    "live_bytes": ("tpubox_device_live_bytes", {"at": "now"}),
}


def device_metrics(d: Daemon) -> dict[str, float | None]:
    text = d.metrics(PUB)
    return {k: metric(text, name, **labels) for k, (name, labels) in DEVICE_METRICS.items()}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """This module's daemon, holding the host weight set `tiny`."""
    try:
        binary()
    except FileNotFoundError as e:
        pytest.exit(str(e), returncode=1)
    root = tmp_path_factory.mktemp("publish-daemon")
    write_safetensors(root / "tiny.safetensors", TINY_WEIGHTS)
    d = Daemon(root, TENANTS, extra_args=("--weights", f"tiny={root / 'tiny.safetensors'}"))
    d.start()
    yield d
    rc = d.stop()
    assert rc == 0, f"tpubox serve exited {rc} after SIGTERM (want 0)\n{d.log()[-4000:]}"


# ----------------------------------------------------------------------------------------------
# The criterion: 100 versions published while 1,000 reads run; each read equals the reference
# of the version it reports; no device→host bytes while publishing.


@pytest.mark.timeout(600)
def publisher_process(code: str, stdin: int) -> subprocess.Popen:
    """Runs CODE (a publishing client, dedented) in a child Python and waits for the first
    line it prints, which must be "1": its first version is published."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(os.environ),
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = child.stdout.readline().strip()
    if first != "1":
        child.kill()
        raise AssertionError(f"the publisher printed {first!r}: {child.stderr.read()}")
    return child


def test_reads_during_100_publishes_see_one_version_each_and_publishing_copies_nothing(pd):
    name = "policy"
    errors: list[BaseException] = []
    results: list[tuple[int, dict, dict, np.ndarray, float]] = []
    lock = threading.Lock()
    reads = {"started": 0, "done": 0}
    start = threading.Event()
    ready = threading.Barrier(N_READERS + 1, timeout=120)

    def reader(i: int) -> None:
        # A quarter of the readers are sessions of the publishing tenant, the rest of a tenant
        # listed in `readers`; half over the local socket, half all gRPC.
        token = PUB if i % 4 == 0 else READER
        try:
            with tpubox.connect(pd.unix, token, local=i % 2 == 0, label=f"reader {i}") as r:
                exe = r.compile(MATMUL_BIAS)
                x = r.tensor(X)
                ready.wait()
                start.wait()
                while True:
                    with lock:
                        if reads["started"] >= N_READS:
                            return
                        reads["started"] += 1
                    t0 = time.monotonic()
                    ws = r.weights(name)
                    v = ws.version
                    assert ws.name == name, ws.name
                    assert set(ws) == {"w", "b"}, set(ws)
                    tensor_versions = {k: t.weights for k, t in ws.items()}
                    (y,) = exe(x, ws["w"], ws["b"])
                    y_versions = y.weights
                    got = y.numpy()
                    r.free(y, *ws.values())
                    dt = time.monotonic() - t0
                    with lock:
                        results.append((v, tensor_versions, y_versions, got, dt))
                        reads["done"] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            try:
                ready.abort()
            except Exception:
                pass

    with tpubox.connect(pd.unix, PUB, label="publisher") as p:
        step = p.compile(STEP)
        # Everything the publisher uploads, it uploads now, before the publishing phase.
        w, b = p.tensor(W1), p.tensor(B1)
        dw, db = p.tensor(DW), p.tensor(DB)
        assert p.publish_weights(name, {"w": w, "b": b}, readers=("reader",)) == 1
        threads = [
            threading.Thread(target=reader, args=(i,), daemon=True) for i in range(N_READERS)
        ]
        for t in threads:
            t.start()
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            if errors:
                raise errors[0] from None
            raise

        # --- publishing phase: versions 2 .. N_VERSIONS + 1 while the reads run ----------------
        m_start = device_metrics(pd)
        u0 = p.usage()
        t_start = time.monotonic()
        start.set()
        published = []
        for k in range(2, N_VERSIONS + 2):
            # Spread the publishes over the reads (about 10 reads per version).
            target = (k - 2) * N_READS // N_VERSIONS
            deadline = time.monotonic() + 10
            while reads["done"] < target and not errors and time.monotonic() < deadline:
                time.sleep(0.001)
            w2, b2 = step(w, b, dw, db)
            published.append(p.publish_weights(name, {"w": w2, "b": b2}, readers=("reader",)))
            p.free(w, b)  # the trainer keeps only its newest params; the daemon keeps the version
            w, b = w2, b2
        u1 = p.usage()
        t_published = time.monotonic() - t_start
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a reader hung"
        if errors:
            raise errors[0]
        m_end = device_metrics(pd)

        assert published == list(range(2, N_VERSIONS + 2))
        # How the device→host bytes were counted (1): the publisher session's own transfer
        # counters did not move over the publishing phase (D and W1 went up before it).
        assert u1.device_to_host_bytes - u0.device_to_host_bytes == 0, (u0, u1)
        assert u1.host_to_device_bytes - u0.host_to_device_bytes == 0, (u0, u1)

        assert len(results) == N_READS
        versions = [v for v, *_ in results]
        assert all(1 <= v <= N_VERSIONS + 1 for v in versions), sorted(set(versions))
        for v, tensor_versions, y_versions, got, _ in results:
            # The set says one version, each of its tensors says it, and so does the result.
            assert tensor_versions == {"w": ((name, v),), "b": ((name, v),)}, (v, tensor_versions)
            assert y_versions == ((name, v),), (v, y_versions)
            np.testing.assert_array_equal(got, reference(v), err_msg=f"read of version {v}")
        seen = sorted(set(versions))
        # The reads overlapped the publishes: they saw most of the versions.
        assert len(seen) >= N_VERSIONS // 2, seen
        slowest = max(dt for *_, dt in results)
        assert slowest < 30, slowest
        # How the device→host bytes were counted (2): the daemon's own counters over the phase
        # (every copy it makes between host and device goes through them) moved by exactly
        # the readers' results, one M×N f32 each, and nothing else: publishing added 0.
        d2h = m_end["device_to_host"] - m_start["device_to_host"]
        h2d = m_end["host_to_device"] - m_start["host_to_device"]
        assert d2h == N_READS * M * N * 4, (d2h, m_start, m_end)
        assert h2d == 0, (h2d, m_start, m_end)
        print(
            f"\n{N_VERSIONS} versions published in {t_published:.2f} s while {N_READS} reads "
            f"from {N_READERS} sessions saw {len(seen)} distinct versions (slowest read "
            f"{slowest * 1e3:.0f} ms); publisher session device→host "
            f"{u1.device_to_host_bytes - u0.device_to_host_bytes} B, host→device "
            f"{u1.host_to_device_bytes - u0.host_to_device_bytes} B; daemon device→host "
            f"{d2h:.0f} B = {N_READS} results × {M * N * 4} B, host→device {h2d:.0f} B"
        )

        # --- publish-only phase: the daemon's own counters -----------------------------------
        # How the device→host bytes were counted (3): with no reader running, 20 steps and
        # publishes move neither of the daemon's transfer counters, and leave the device's live
        # bytes where they were (each superseded version is freed: nobody holds it).
        wait_until(
            lambda: tpubox.tenant_usage(pd.unix, READER).sessions == 0
            and tpubox.tenant_usage(pd.unix, PUB).sessions == 1,
            what="the readers' sessions ending",
        )
        before = device_metrics(pd)
        assert all(v is not None for v in before.values()), before
        for k in range(N_VERSIONS + 2, N_VERSIONS + 22):
            w2, b2 = step(w, b, dw, db)
            assert p.publish_weights(name, {"w": w2, "b": b2}, readers=("reader",)) == k
            p.free(w, b)
            w, b = w2, b2
        after = device_metrics(pd)
        assert after == before, (before, after)
        m1 = pd.metrics(PUB)
        # The ledger: one live version of w and b, also in the metrics.
        u = p.usage()
        assert u.published_versions == 1, u
        assert u.published_bytes == W1.nbytes + B1.nbytes, u
        assert metric(m1, "tpubox_published_weight_versions", tenant="pub") == 1
        assert metric(m1, "tpubox_published_weight_bytes", tenant="pub") == W1.nbytes + B1.nbytes
        # Only now does anything come back to the host: the last version is right.
        last = N_VERSIONS + 21
        ws = p.weights(name)
        assert ws.version == last
        for key, want in params(last).items():
            np.testing.assert_array_equal(ws[key].numpy(), want)
        p.free(*ws.values(), w, b)  # the last holders besides the daemon's own reference
        p.unpublish_weights(name)
        assert p.usage().published_versions == 0


# ----------------------------------------------------------------------------------------------
# Held versions


def _publish(p: tpubox.Session, name: str, arrays: dict[str, np.ndarray], **kw) -> int:
    """Publishes ARRAYS (uploaded for it) and drops the publisher's handles: from then on only
    the daemon (latest) and readers hold the version."""
    ts = {key: p.tensor(a) for key, a in arrays.items()}
    try:
        return p.publish_weights(name, ts, **kw)
    finally:
        p.free(*ts.values())


def _publish_arrays(p: tpubox.Session, name: str, k: int, readers=("reader",)) -> int:
    """Publishes version K of the stepped set (params(K)) as :func:`_publish` does."""
    return _publish(p, name, params(k), readers=readers)


def _ledger(s: tpubox.Session) -> tuple[int, int]:
    u = s.usage()
    return u.published_versions, u.published_bytes


def test_a_held_version_stays_readable_until_dropped(pd):
    name = "held"
    set_bytes = W1.nbytes + B1.nbytes
    with tpubox.connect(pd.unix, KEEPER) as p, tpubox.connect(pd.unix, READER) as r:
        base_n, base_b = _ledger(p)  # what the tenant's other tests left (nothing, normally)
        exe = r.compile(MATMUL_BIAS)
        assert _publish_arrays(p, name, 1) == 1
        ws1 = r.weights(name)
        assert ws1.name == name and ws1.version == 1
        assert _publish_arrays(p, name, 2) == 2
        assert _publish_arrays(p, name, 3) == 3

        latest = r.weights(name)
        assert latest.version == 3
        np.testing.assert_array_equal(latest["w"].numpy(), params(3)["w"])
        r.free(*latest.values())

        # Version 1 is held by r: still there, by number too, and still usable.
        (y,) = exe(X, ws1["w"], ws1["b"])
        assert y.weights == ((name, 1),)
        np.testing.assert_array_equal(y.numpy(), reference(1))
        again = r.weights(name, version=1)
        assert again.version == 1
        for key, want in params(1).items():
            np.testing.assert_array_equal(again[key].numpy(), want)
            assert again[key].weights == ((name, 1),)
        vs = r.weight_versions(name)
        assert vs.latest == 3
        assert 1 in vs.held and 2 not in vs.held, vs
        # Version 2 was superseded while nobody held it: freed. Version 4 was never made.
        with pytest.raises(tpubox.NotFound):
            r.weights(name, version=2)
        with pytest.raises(tpubox.NotFound):
            r.weights(name, version=4)
        # The ledger counts the held version and the latest.
        assert _ledger(p) == (base_n + 2, base_b + 2 * set_bytes)

        # Holding one tensor of a version holds all of it.
        r.free(*again.values(), ws1["w"])
        part = r.weights(name, version=1)
        np.testing.assert_array_equal(part["w"].numpy(), params(1)["w"])
        r.free(*part.values(), y)
        assert 1 in r.weight_versions(name).held

        # The last tensor of version 1 dropped: freed.
        r.free(ws1["b"])
        with pytest.raises(tpubox.NotFound):
            r.weights(name, version=1)
        assert 1 not in r.weight_versions(name).held
        assert _ledger(p) == (base_n + 1, base_b + set_bytes)

        # Unpublished: the daemon drops the latest; a reader that holds it keeps it.
        held3 = r.weights(name)
        p.unpublish_weights(name)
        with pytest.raises(tpubox.NotFound):
            p.weights(name)
        (y3,) = exe(X, held3["w"], held3["b"])
        np.testing.assert_array_equal(y3.numpy(), reference(3))
        assert y3.weights == ((name, 3),)
        assert _ledger(p) == (base_n + 1, base_b + set_bytes)  # r's v3
        r.free(y3, *held3.values())
        assert _ledger(p) == (base_n, base_b)


def test_a_dropped_reader_session_frees_what_it_held(pd):
    name = "held-by-a-session"
    with tpubox.connect(pd.unix, KEEPER) as p:
        base_n, _ = _ledger(p)
        assert _publish_arrays(p, name, 1) == 1
        r = tpubox.connect(pd.unix, READER)
        ws = r.weights(name)
        assert ws.version == 1
        assert _publish_arrays(p, name, 2) == 2
        assert _ledger(p)[0] == base_n + 2
        r.close()  # without freeing ws
        wait_until(lambda: _ledger(p)[0] == base_n + 1, what="version 1 freed")
        with pytest.raises(tpubox.NotFound):
            p.weights(name, version=1)
        p.unpublish_weights(name)
        assert _ledger(p)[0] == base_n


# ----------------------------------------------------------------------------------------------
# Read-only once published


def test_published_tensors_are_read_only_and_donated_ones_cannot_be_published(pd):
    name = "read-only"
    with tpubox.connect(pd.unix, KEEPER) as p, tpubox.connect(pd.unix, READER) as r:
        neg = p.compile(NEG)
        t = p.tensor(W1)
        assert p.publish_weights(name, {"w": t}, readers=("reader",)) == 1
        with pytest.raises(tpubox.PermissionDenied):
            neg(t, donate=[0])
        np.testing.assert_array_equal(t.numpy(), W1)  # not donated, still there
        (y,) = neg(t)
        np.testing.assert_array_equal(y.numpy(), -W1)
        assert t.read_only
        # A reader cannot donate it either.
        rneg = r.compile(NEG)
        ws = r.weights(name)
        assert ws["w"].read_only
        with pytest.raises(tpubox.PermissionDenied):
            rneg(ws["w"], donate=[0])
        np.testing.assert_array_equal(ws["w"].numpy(), W1)
        r.free(*ws.values())

        # A donated tensor cannot be published; nothing is published under the name.
        u = p.tensor(W1)
        neg(u, donate=[0])
        with pytest.raises(tpubox.FailedPrecondition):
            p.publish_weights("donated", {"w": u})
        with pytest.raises(tpubox.NotFound):
            p.weights("donated")
        # Nor a set one of whose tensors was donated: the other is not published either.
        good = p.tensor(B1)
        with pytest.raises(tpubox.FailedPrecondition):
            p.publish_weights("donated", {"b": good, "w": u})
        with pytest.raises(tpubox.NotFound):
            p.weights("donated")
        p.unpublish_weights(name)


# ----------------------------------------------------------------------------------------------
# Permissions and the ledger


def test_who_may_publish_and_read(pd):
    name = "owned"
    with (
        tpubox.connect(pd.unix, KEEPER) as p,
        tpubox.connect(pd.unix, READER) as r,
        tpubox.connect(pd.unix, OUTSIDER) as o,
        tpubox.connect(pd.unix, THIEF) as th,
    ):
        assert _publish_arrays(p, name, 1) == 1
        # A tenant without publish_weights may not publish at all.
        ot = o.tensor(W1)
        with pytest.raises(tpubox.PermissionDenied, match="publish_weights"):
            o.publish_weights("outsiders-own", {"w": ot})
        # Another tenant may not publish over the name, nor over a host weight set.
        tt = th.tensor(W1)
        with pytest.raises(tpubox.PermissionDenied):
            th.publish_weights(name, {"w": tt})
        with pytest.raises(tpubox.PermissionDenied):
            th.publish_weights("tiny", {"w": tt})
        with pytest.raises(tpubox.PermissionDenied):
            p.publish_weights("tiny", {"w": p.tensor(W1)})
        # Not listed in readers: as if the name did not exist.
        for s in (o, th):
            with pytest.raises(tpubox.NotFound):
                s.weights(name)
            with pytest.raises(tpubox.NotFound):
                s.weights(name, version=1)
            with pytest.raises(tpubox.NotFound):
                s.weight_versions(name)
        # The listed reader reads the owner's version 1, untouched by the attempts.
        ws = r.weights(name)
        assert ws.version == 1 and r.weight_versions(name).latest == 1
        np.testing.assert_array_equal(ws["w"].numpy(), params(1)["w"])
        r.free(*ws.values())
        # readers=("*",): every tenant.
        assert _publish_arrays(p, "public", 1, readers=("*",)) == 1
        for s in (o, th, r):
            pub = s.weights("public")
            assert pub.version == 1
            np.testing.assert_array_equal(pub["b"].numpy(), params(1)["b"])
            s.free(*pub.values())
        # Host weight sets are version 1 and their tensors say so.
        tiny = o.weights("tiny")
        assert tiny.version == 1
        assert tiny["w"].weights == (("tiny", 1),)
        o.free(*tiny.values())
        p.unpublish_weights(name)
        p.unpublish_weights("public")


def test_version_limit_outlives_sessions(pd):
    a = np.arange(16, dtype=np.float32)
    with tpubox.connect(pd.unix, CAPPED) as c:
        assert _publish(c, "cap-a", {"w": a}) == 1
        assert _publish(c, "cap-b", {"w": a + 1}) == 1
        with pytest.raises(tpubox.ResourceExhausted, match="max-published-versions"):
            _publish(c, "cap-c", {"w": a + 2})
        assert _ledger(c) == (2, 2 * a.nbytes)
    # A new session of the tenant: the same ledger, still full.
    with tpubox.connect(pd.unix, CAPPED) as c:
        assert _ledger(c) == (2, 2 * a.nbytes)
        with pytest.raises(tpubox.ResourceExhausted, match="max-published-versions"):
            _publish(c, "cap-c", {"w": a + 2})
        # The versions the closed session published are there.
        ws = c.weights("cap-b")
        assert ws.version == 1
        np.testing.assert_array_equal(ws["w"].numpy(), a + 1)
        # A new version of cap-b while cap-b v1 is held: three live versions, refused ...
        with pytest.raises(tpubox.ResourceExhausted, match="max-published-versions"):
            _publish(c, "cap-b", {"w": a + 3})
        c.free(*ws.values())
        # ... and once nobody holds v1, it is not counted: allowed.
        assert _publish(c, "cap-b", {"w": a + 3}) == 2
        assert _ledger(c) == (2, 2 * a.nbytes)
        c.unpublish_weights("cap-a")
        assert _ledger(c) == (1, a.nbytes)
        assert _publish(c, "cap-c", {"w": a + 2}) == 1
        ws = c.weights("cap-b")
        assert ws.version == 2
        np.testing.assert_array_equal(ws["w"].numpy(), a + 3)
        c.free(*ws.values())
        c.unpublish_weights("cap-b")
        c.unpublish_weights("cap-c")
        assert _ledger(c) == (0, 0)


def test_byte_limit_outlives_sessions(pd):
    a = np.ones(150_000, np.float32)  # 600,000 bytes; the limit is 1 MiB
    with tpubox.connect(pd.unix, CAPBYTES) as c:
        assert _publish(c, "big-a", {"w": a}) == 1
        with pytest.raises(tpubox.ResourceExhausted, match="max-published-bytes"):
            _publish(c, "big-b", {"w": a})
    with tpubox.connect(pd.unix, CAPBYTES) as c:
        assert _ledger(c) == (1, a.nbytes)
        with pytest.raises(tpubox.ResourceExhausted, match="max-published-bytes"):
            _publish(c, "big-b", {"w": a})
        # A new version of big-a replaces v1, which nobody holds.
        assert _publish(c, "big-a", {"w": 2 * a}) == 2
        assert _ledger(c) == (1, a.nbytes)
        ws = c.weights("big-a")
        np.testing.assert_array_equal(ws["w"].numpy(), 2 * a)
        c.free(*ws.values())
        c.unpublish_weights("big-a")
        assert _ledger(c) == (0, 0)


# ----------------------------------------------------------------------------------------------
# A publisher that dies


@pytest.mark.timeout(300)
def test_a_publisher_killed_while_publishing_leaves_the_previous_version(pd):
    name = "dying"
    # The child uploads W1, B1, DW, DB, publishes version 1, then steps and publishes as fast
    # as it can until it is killed (SIGKILL: no close, no atexit), likely inside a publish.
    code = f"""
        import sys, numpy as np, tpubox
        W1, B1, DW, DB = (np.array(a, np.float32) for a in
            ({W1.tolist()!r}, {B1.tolist()!r}, {DW.tolist()!r}, {DB.tolist()!r}))
        s = tpubox.connect({pd.unix!r}, {DIES!r}, label="dying publisher")
        step = s.compile({STEP!r})
        w, b, dw, db = s.tensor(W1), s.tensor(B1), s.tensor(DW), s.tensor(DB)
        print(s.publish_weights({name!r}, {{"w": w, "b": b}}, readers=("reader",)), flush=True)
        sys.stdin.readline()
        while True:
            w2, b2 = step(w, b, dw, db)
            s.publish_weights({name!r}, {{"w": w2, "b": b2}}, readers=("reader",))
            s.free(w, b)
            w, b = w2, b2
        """
    child = publisher_process(code, stdin=subprocess.PIPE)
    try:

        stop = threading.Event()
        errors: list[BaseException] = []
        reads: list[tuple[int, float]] = []

        def reader(i: int) -> None:
            try:
                with tpubox.connect(pd.unix, READER, local=i == 0) as r:
                    exe = r.compile(MATMUL_BIAS)
                    x = r.tensor(X)
                    while not stop.is_set():
                        t0 = time.monotonic()
                        ws = r.weights(name)
                        (y,) = exe(x, ws["w"], ws["b"])
                        got = y.numpy(timeout=30)
                        assert y.weights == ((name, ws.version),), (ws.version, y.weights)
                        np.testing.assert_array_equal(got, reference(ws.version))
                        r.free(y, *ws.values())
                        reads.append((ws.version, time.monotonic() - t0))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        child.stdin.write("go\n")
        child.stdin.flush()
        time.sleep(2.0)
        child.kill()
        child.wait(timeout=30)
        n_at_kill = len(reads)
        wait_until(
            lambda: tpubox.tenant_usage(pd.unix, DIES).sessions == 0,
            what="the killed publisher's session ending",
        )
        time.sleep(1.0)  # reads go on after the publisher is gone
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a reader hung"
        if errors:
            raise errors[0]
        assert len(reads) > n_at_kill, "no read after the publisher died"
        slowest = max(dt for _, dt in reads)
        assert slowest < 10, slowest

        # The last version published before the kill is in place, whole and right.
        with tpubox.connect(pd.unix, READER) as r:
            ws = r.weights(name)
            last = ws.version
            assert last >= 2, "the child published nothing after version 1"
            assert r.weight_versions(name).latest == last
            for key, want in params(last).items():
                np.testing.assert_array_equal(ws[key].numpy(), want)
            assert max(v for v, _ in reads) <= last
            r.free(*ws.values())
        # The tenant's next session goes on from there.
        with tpubox.connect(pd.unix, DIES) as s:
            assert _ledger(s)[0] == 1  # the version in place
            assert _publish_arrays(s, name, last + 1) == last + 1
            assert _ledger(s)[0] == 1  # the one it replaced was held by nobody
            s.unpublish_weights(name)
            assert _ledger(s) == (0, 0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.timeout(300)
def test_a_publisher_killed_inside_its_publish_call_publishes_nothing(pd):
    name = "dying-inside"
    # The child publishes version 1, launches the slow step (about a second) and publishes its
    # pending results: the daemon waits for the launch inside the publish call, and the child
    # is killed then, while its publish is certainly in flight.
    code = f"""
        import sys, time, numpy as np, tpubox
        W1, B1, DW, DB = (np.array(a, np.float32) for a in
            ({W1.tolist()!r}, {B1.tolist()!r}, {DW.tolist()!r}, {DB.tolist()!r}))
        s = tpubox.connect({pd.unix!r}, {DIES!r}, label="publisher killed inside publish")
        slow = s.compile({slow_step()!r})
        w, b, dw, db = s.tensor(W1), s.tensor(B1), s.tensor(DW), s.tensor(DB)
        x = s.tensor(np.random.default_rng(0).uniform(-0.05, 0.05, (1024, 1024)).astype("f4"))
        t0 = time.monotonic()
        slow(w, b, dw, db, x)
        took = time.monotonic() - t0
        print(s.publish_weights({name!r}, {{"w": w, "b": b}}, readers=("reader",)), flush=True)
        w2, b2 = slow.launch(w, b, dw, db, x)
        print(f"publishing {{took}}", flush=True)
        s.publish_weights({name!r}, {{"w": w2, "b": b2}}, readers=("reader",))
        print("published", flush=True)
        """
    child = publisher_process(code, stdin=subprocess.DEVNULL)
    try:
        stop = threading.Event()
        errors: list[BaseException] = []
        reads: list[tuple[int, float]] = []

        def reader() -> None:
            try:
                with tpubox.connect(pd.unix, READER) as r:
                    exe = r.compile(MATMUL_BIAS)
                    while not stop.is_set():
                        t0 = time.monotonic()
                        ws = r.weights(name)
                        (y,) = exe(X, ws["w"], ws["b"])
                        np.testing.assert_array_equal(y.numpy(), reference(ws.version))
                        r.free(y, *ws.values())
                        reads.append((ws.version, time.monotonic() - t0))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        line = child.stdout.readline().split()
        assert line and line[0] == "publishing", line
        took = float(line[1])
        time.sleep(min(0.3, took / 3))  # well inside the publish call, which waits ~took
        child.kill()
        child.wait(timeout=30)
        wait_until(
            lambda: tpubox.tenant_usage(pd.unix, DIES).sessions == 0,
            what="the killed publisher's session ending",
        )
        time.sleep(took + 1)  # past when the launch, and a publish that went on, would end
        stop.set()
        t.join(timeout=60)
        assert not t.is_alive(), "a reader hung"
        if errors:
            raise errors[0]
        assert reads and max(dt for _, dt in reads) < 10
        with tpubox.connect(pd.unix, READER) as r:
            vs = r.weight_versions(name)
            assert vs.latest == 1, f"the killed publish went on to make version {vs.latest}"
            ws = r.weights(name)
            assert ws.version == 1
            for key, want in params(1).items():
                np.testing.assert_array_equal(ws[key].numpy(), want)
            r.free(*ws.values())
        assert {v for v, _ in reads} == {1}
        with tpubox.connect(pd.unix, DIES) as s:
            assert _publish_arrays(s, name, 2) == 2  # numbering goes on
            s.unpublish_weights(name)
            assert _ledger(s) == (0, 0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_closed_publisher_session_leaves_its_latest_version(pd):
    name = "closed-publisher"
    p = tpubox.connect(pd.unix, KEEPER)
    assert _publish_arrays(p, name, 1) == 1
    w = p.tensor(params(2)["w"])
    b = p.tensor(params(2)["b"])
    p.close()
    # The closed session's handles are gone; its published version is not.
    with tpubox.connect(pd.unix, READER) as r:
        ws = r.weights(name)
        assert ws.version == 1
        np.testing.assert_array_equal(ws["b"].numpy(), params(1)["b"])
        r.free(*ws.values())
    with pytest.raises(tpubox.SessionEnded):
        p.publish_weights(name, {"w": w, "b": b})
    with tpubox.connect(pd.unix, KEEPER) as p2:
        assert _publish_arrays(p2, name, 2) == 2
        p2.unpublish_weights(name)


# ----------------------------------------------------------------------------------------------
# Restart


def test_published_versions_do_not_survive_a_daemon_restart(tmp_path):
    first = Daemon(tmp_path / "first", TENANTS)
    first.start()
    try:
        with tpubox.connect(first.unix, KEEPER) as p:
            assert _publish_arrays(p, "gone", 1) == 1
            assert _publish_arrays(p, "gone", 2) == 2
    finally:
        first.kill()
    # The daemon again (a new process): published versions lived in the old one's memory.
    second = Daemon(tmp_path / "second", TENANTS)
    second.start()
    try:
        with tpubox.connect(second.unix, KEEPER) as p:
            with pytest.raises(tpubox.NotFound):
                p.weights("gone")
            assert p.usage().published_versions == 0
            assert _publish_arrays(p, "gone", 1) == 1  # numbering starts again
    finally:
        assert second.stop() == 0
