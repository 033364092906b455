"""Crash consistency (issue 51, item 4; docs/SECURITY.md, "Crash consistency"): the daemon is
killed with SIGKILL at random moments while clients keep it busy, and restarted on the same
ports, socket and directories, again and again. After every restart:

- no temporary file is left by a killed writer (`.tmp-*` in the compile cache's directory,
  `tpubox-hlo-*` compiler dumps in the daemon's TMPDIR, plugin-hash memos under the cache
  root): any that exists is one a live writer holds locked;
- every entry of the compile cache's disk tier verifies (an independent checker of the entry
  format of crates/core/src/cache/disk.rs: magic, version, key, lengths, SHA-256, metadata);
- no `tpubox compile-worker` of the killed daemon is still alive;
- programs compiled before the kill are served from the disk tier and compute the right
  numbers; an entry damaged on purpose while the daemon is down (truncated or a byte flipped,
  every INJECT_EVERY-th kill) is detected, dropped and recompiled, never executed;
- every client (REST and gRPC inference, session API compiles, chained pending launches,
  weight publishes, repository loads and unloads) gets correct answers again, compared with
  NumPy. A client call that was in flight when the daemon died fails with a connection error
  of an expected kind; a call started after the restart does not fail.

TPUBOX_CRASH_KILLS sets the number of kills (default 50, the issue's acceptance: about 100 s
on 2 busy cores), TPUBOX_CRASH_SEED the seed of the kill moments and the damage (default:
random, printed). TPUBOX_CRASH_REPORT names a JSON file the counts are written to.
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import itertools
import json
import os
import random
import re
import shutil
import signal
import struct
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hardening_util import OPS, PROBE, REPO, Daemon, bearer, request

KILLS = int(os.environ.get("TPUBOX_CRASH_KILLS", "50"))
SEED = int(os.environ.get("TPUBOX_CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
INJECT_EVERY = 4
# A client must be served again within this long after the daemon reports ready.
RECONNECT_TIMEOUT = 60.0

PUBLISHER = "publisher-token"
CRASH_TENANTS = {
    "probe": {
        "token": PROBE,
        "models": ["*"],
        "session": {"max_device_mib": 256, "max_sessions": 16, "max_compiles_per_minute": 100000},
    },
    "publisher": {"token": PUBLISHER, "models": [], "session": {"publish_weights": True}},
    "ops": {"token": OPS, "models": ["*"], "repository_control": True, "metrics": True},
}

# The entry format of crates/core/src/cache/disk.rs, read independently of the Rust code.
MAGIC = b"TPBXEXE\0"
HEADER_LEN = 8 + 4 + 32 + 4 + 8 + 32
FORMAT_VERSION = int(
    re.search(
        r"pub const CACHE_FORMAT_VERSION: u32 = (\d+);",
        (REPO / "crates/core/src/cache/key.rs").read_text(),
    ).group(1)
)


def entry_problem(path: Path) -> str | None:
    """Why the tier-2 entry at PATH is not a whole, valid entry for its file name's key (None
    when it is)."""
    b = path.read_bytes()
    if len(b) < HEADER_LEN:
        return f"truncated: {len(b)} bytes"
    if b[:8] != MAGIC:
        return "bad magic"
    (version,) = struct.unpack_from("<I", b, 8)
    if version != FORMAT_VERSION:
        return f"format version {version}"
    if b[12:44].hex() != path.stem:
        return "holds another key"
    (meta_len,) = struct.unpack_from("<I", b, 44)
    (exe_len,) = struct.unpack_from("<Q", b, 48)
    if HEADER_LEN + meta_len + exe_len != len(b):
        return f"length mismatch: header says {HEADER_LEN + meta_len + exe_len}, file {len(b)}"
    if hashlib.sha256(b[HEADER_LEN:]).digest() != b[56:88]:
        return "checksum mismatch"
    meta = json.loads(b[HEADER_LEN : HEADER_LEN + meta_len])
    if not {"inputs", "outputs", "fingerprint", "compile_ms"} <= meta.keys() or exe_len == 0:
        return f"bad metadata {meta}"
    return None


def unlocked(path: Path) -> bool:
    """Whether nobody holds PATH (a file or directory) flock-ed: no live writer."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # gone: renamed or removed by its writer
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def stale_temporaries(dirs: list[tuple[Path, str]], since: float) -> list[str]:
    """Temporaries (names starting with a prefix, directly in a directory) that nobody holds
    locked, twice half a second apart (a writer locks its temporary just after creating it),
    and that were made after SINCE."""

    def scan() -> set[Path]:
        found = set()
        for d, prefix in dirs:
            if not d.is_dir():
                continue
            for p in d.iterdir():
                try:
                    young = p.lstat().st_mtime >= since
                except OSError:
                    continue
                if p.name.startswith(prefix) and young and unlocked(p):
                    found.add(p)
        return found

    first = scan()
    if not first:
        return []
    time.sleep(0.5)
    return sorted(str(p) for p in first & scan())


# Programs. Constants are multiples of 1/4 and inputs small integers, so float32 is exact.
def scale_program(c: float, n: int) -> str:
    return (
        f"func.func public @main(%a: tensor<{n}xf32>) -> tensor<{n}xf32> {{\n"
        f"  %c = stablehlo.constant dense<{c!r}> : tensor<{n}xf32>\n"
        f"  %0 = stablehlo.multiply %a, %c : tensor<{n}xf32>\n"
        f"  return %0 : tensor<{n}xf32>\n}}\n"
    )


DOUBLE = """func.func public @main(%a: tensor<64x64xf32>) -> tensor<64x64xf32> {
  %0 = stablehlo.add %a, %a : tensor<64x64xf32>
  return %0 : tensor<64x64xf32>
}
"""
CHAIN = 12

# Programs compiled once before the first kill, checked after every restart: from the disk tier.
KEPT = [(-(j + 1) * 0.5, 4) for j in range(6)]


def write_model(repo: Path, name: str, c: float) -> None:
    """A StableHLO model NAME: y = x * w + c, x FP32[4], the weight w = [1, 2, 3, 4]."""
    d = repo / name
    d.mkdir(parents=True)
    (d / "model.mlir").write_text(
        "func.func public @main(%w: tensor<4xf32>, %x: tensor<4xf32>) -> tensor<4xf32> {\n"
        f"  %c = stablehlo.constant dense<{c!r}> : tensor<4xf32>\n"
        "  %0 = stablehlo.multiply %x, %w : tensor<4xf32>\n"
        "  %1 = stablehlo.add %0, %c : tensor<4xf32>\n"
        "  return %1 : tensor<4xf32>\n}\n"
    )
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    header += b" " * (-len(header) % 8)
    w = np.arange(1, 5, dtype=np.float32)
    (d / "weights.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + w.tobytes())
    (d / "config.toml").write_text(
        f'name = "{name}"\nbackend = "stablehlo"\nmax_batch_size = 0\n\n'
        '[[input]]\nname = "x"\ndata_type = "TYPE_FP32"\ndims = [4]\n\n'
        '[[output]]\nname = "y"\ndata_type = "TYPE_FP32"\ndims = [4]\n\n'
        "[[instance_group]]\ncount = 1\n\n"
        '[tpubox.stablehlo]\nweights = "weights.safetensors"\n'
        'parameters = [{ weight = "w" }, { input = "x" }]\nresults = ["y"]\n\n'
        '[[tpubox.stablehlo.program]]\nfile = "model.mlir"\n'
    )


def model_answer(c: float, x: np.ndarray) -> np.ndarray:
    return x * np.arange(1, 5, dtype=np.float32) + np.float32(c)


SCALE_C = 0.75  # the `scale` model every inference client calls


class CrashDaemon(Daemon):
    """The hardening daemon with a repository of StableHLO models (no guest component) that
    persists across restarts, and a TMPDIR of its own."""

    def _repo(self) -> Path:
        repo = self.root / "repo"
        if not (repo / "scale").is_dir():
            write_model(repo, "scale", SCALE_C)
        return repo


class Life:
    """The daemon's life as the clients see it: `up` is set while a daemon serves (cleared just
    before each kill), `epoch` counts its starts."""

    def __init__(self):
        self.up = threading.Event()
        self.epoch = 0
        self.stop = threading.Event()


def kind_of(e: BaseException) -> str:
    from tpubox.errors import TpuboxError
    from tritonclient.utils import InferenceServerException

    if isinstance(e, TpuboxError):
        return f"session:{e.kind}"
    if isinstance(e, InferenceServerException):
        return f"grpc:{e.status()}"
    return type(e).__name__


# What a call in flight when the daemon died may see: the connection went away or was refused.
WINDOW_KINDS = {
    "ConnectionRefusedError",
    "ConnectionResetError",
    "RemoteDisconnected",
    "BrokenPipeError",
    "grpc:StatusCode.UNAVAILABLE",
    "session:unavailable",
}


class Client(threading.Thread):
    """One client: `connect(epoch)` makes its state for a daemon start, `step(state)` does one
    checked call. A failure of a call started while the daemon served and that failed while
    the same daemon still served is a finding (`errors`); one the kill interrupted is counted
    by kind in `window`. After a failure it reconnects once the next daemon serves."""

    def __init__(self, name: str, life: Life, d: CrashDaemon):
        super().__init__(name=name, daemon=True)
        self.life, self.d = life, d
        self.ok: Counter[int] = Counter()
        self.window: Counter[str] = Counter()
        self.errors: list[str] = []
        self.rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])

    def connect(self, epoch: int):
        return None

    def close(self, state) -> None:
        pass

    def step(self, state) -> None:
        raise NotImplementedError

    def run(self):
        state, state_epoch = None, -1
        while not self.life.stop.is_set():
            if not self.life.up.wait(timeout=0.2):
                continue
            epoch = self.life.epoch
            try:
                if state_epoch != epoch:
                    self.close(state)
                    state, state_epoch = None, -1
                    state = self.connect(epoch)
                    state_epoch = epoch
                self.step(state)
                self.ok[epoch] += 1
            except Exception as e:  # noqa: BLE001 - each failure is classified
                kind = kind_of(e)
                if self.life.up.is_set() and self.life.epoch == epoch:
                    self.errors.append(f"epoch {epoch}: {kind}: {e!r}"[:600])
                    time.sleep(0.2)
                else:
                    self.window[kind] += 1
                state_epoch = -1
            time.sleep(0.01)
        self.close(state)


class RestInfer(Client):
    def step(self, _):
        x = self.rng.integers(-8, 8, 4).astype(np.float32)
        body = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": x.tolist()}]}
        r = request(self.d, "POST", "/v2/models/scale/infer", body, bearer(PROBE), timeout=30)
        assert r.status == 200, r
        y = np.asarray(r.json()["outputs"][0]["data"], np.float32)
        np.testing.assert_array_equal(y, model_answer(SCALE_C, x))


class GrpcInfer(Client):
    def connect(self, epoch):
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(self.d.grpc_url)

    def close(self, client):
        if client is not None:
            client.close()

    def step(self, client):
        import tritonclient.grpc as grpcclient

        x = self.rng.integers(-8, 8, 4).astype(np.float32)
        inp = grpcclient.InferInput("x", [4], "FP32")
        inp.set_data_from_numpy(x)
        r = client.infer("scale", [inp], headers={"authorization": f"Bearer {PROBE}"}, client_timeout=30)
        np.testing.assert_array_equal(r.as_numpy("y"), model_answer(SCALE_C, x))


class Session(Client):
    token = PROBE

    def connect(self, epoch):
        import tpubox

        return tpubox.connect(f"unix:{self.d.socket_path}", self.token, label=self.name)

    def close(self, s):
        if s is not None:
            try:
                s.close(timeout=2)
            except Exception:  # noqa: BLE001 - the daemon it belonged to may be gone
                pass


_fresh = itertools.count(1)


class Compiles(Session):
    """Compiles programs never seen before (each writes a tier-2 entry) and runs them."""

    def step(self, s):
        c = 1.0 + next(_fresh) * 0.25
        exe = s.compile(scale_program(c, 8))
        x = self.rng.integers(-8, 8, 8).astype(np.float32)
        (y,) = exe.call(x)
        np.testing.assert_array_equal(y, x * np.float32(c))
        s.free(exe)


class Launches(Session):
    """Chains of pending launches, read at the end: the kill finds some still queued."""

    def connect(self, epoch):
        s = super().connect(epoch)
        return s, s.compile(DOUBLE)

    def close(self, state):
        super().close(None if state is None else state[0])

    def step(self, state):
        s, exe = state
        x = self.rng.integers(-4, 4, (64, 64)).astype(np.float32)
        t = s.tensor(x)
        chain = [t]
        for _ in range(CHAIN):
            chain.append(exe.launch(chain[-1])[0])
        np.testing.assert_array_equal(chain[-1].numpy(), x * np.float32(2**CHAIN))
        s.free(*chain)


class Publishes(Session):
    """Publishes versions of a weight set and reads the latest back: always one whole
    version."""

    token = PUBLISHER

    values = itertools.count(1)

    def step(self, s):
        v = next(self.values)
        t = s.tensor(np.full(1024, v, np.float32))
        version = s.publish_weights("crash-w", {"w": t})
        ws = s.weights("crash-w")
        got = ws["w"].numpy()
        assert ws.version == version and (got == v).all(), (ws.version, version, v, got[:4])
        s.free(t, *ws.values())


class Repository(Client):
    """Writes a new model into the repository, loads it (a compile, a tier-2 write), infers,
    unloads it and deletes it; model directories a kill left behind are unloaded and deleted
    once the next daemon serves."""

    def __init__(self, *a):
        super().__init__(*a)
        self.made: list[str] = []

    def connect(self, epoch):
        for name in list(self.made):
            r = request(self.d, "POST", f"/v2/repository/models/{name}/unload", {}, bearer(OPS), timeout=60)
            assert r.status in (200, 400), r
            shutil.rmtree(self.d.root / "repo" / name, ignore_errors=True)
            self.made.remove(name)

    def step(self, _):
        n = next(_fresh)
        name, c = f"churn{n}", 0.25 * n
        write_model(self.d.root / "repo", name, c)
        self.made.append(name)
        r = request(self.d, "POST", f"/v2/repository/models/{name}/load", {}, bearer(OPS), timeout=120)
        assert r.status == 200, r
        x = self.rng.integers(-8, 8, 4).astype(np.float32)
        body = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": x.tolist()}]}
        r = request(self.d, "POST", f"/v2/models/{name}/infer", body, bearer(OPS), timeout=30)
        assert r.status == 200, r
        np.testing.assert_array_equal(np.asarray(r.json()["outputs"][0]["data"], np.float32), model_answer(c, x))
        r = request(self.d, "POST", f"/v2/repository/models/{name}/unload", {}, bearer(OPS), timeout=60)
        assert r.status == 200, r
        shutil.rmtree(self.d.root / "repo" / name)
        self.made.remove(name)


def _worker_state(p: Path) -> tuple[int, bool] | None:
    """(parent pid, started by TPUBOX_COMPILE_WORKER_PARENT=that daemon) of a live, not zombie,
    compile worker at P; None for anything else."""
    try:
        if b"compile-worker" not in (p / "cmdline").read_bytes():
            return None
        status = dict(ln.split(":", 1) for ln in (p / "status").read_text().splitlines() if ":" in ln)
        if "Z" in status["State"].split()[0]:
            return None
        env = (p / "environ").read_bytes().split(b"\0")
    except (OSError, KeyError):
        return None
    return int(status["PPid"]), env


def workers_of(pid: int, known: list[int] = ()) -> list[int]:
    """Live compile workers of daemon PID: its children, those whose environment names it as
    their host, and those of KNOWN still alive (after the daemon died, they were reparented)."""
    mark = f"TPUBOX_COMPILE_WORKER_PARENT={pid}".encode()
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        st = _worker_state(p)
        if st is not None and (st[0] == pid or mark in st[1] or int(p.name) in known):
            found.append(int(p.name))
    return found


def compile_kept(d: CrashDaemon) -> list[str]:
    """Compiles and runs every KEPT program in a new session; returns each one's tier."""
    import tpubox

    tiers = []
    with tpubox.connect(f"unix:{d.socket_path}", PROBE, label="verify") as s:
        for c, n in KEPT:
            exe = s.compile(scale_program(c, n))
            x = np.arange(n, dtype=np.float32) - 2
            (y,) = exe.call(x)
            np.testing.assert_array_equal(y, x * np.float32(c), err_msg=f"kept program c={c}")
            tiers.append(exe.tier)
    return tiers


def damage(path: Path, rng: random.Random) -> str:
    b = bytearray(path.read_bytes())
    if rng.random() < 0.5:
        cut = rng.randrange(len(b))
        path.write_bytes(bytes(b[:cut]))
        return f"truncated to {cut} of {len(b)} bytes"
    i = rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(b))
    return f"flipped a bit of byte {i} of {len(b)}"


@pytest.mark.timeout(120 + 40 * KILLS)
def test_sigkill_under_load_leaves_a_consistent_daemon(tmp_path):
    print(f"\ntest_crash: {KILLS} kills, TPUBOX_CRASH_SEED={SEED}", flush=True)
    rng = random.Random(SEED)
    started = time.time()
    root = tmp_path / "d"
    (root / "tmp").mkdir(parents=True)
    d = CrashDaemon(root, tenants=CRASH_TENANTS, env={"TMPDIR": str(root / "tmp")})
    cache = root / "cache"
    cache_root = Path(os.environ.get("TPUBOX_CACHE_DIR") or Path.home() / ".cache" / "tpubox")
    temp_dirs = [(cache, ".tmp-"), (root / "tmp", "tpubox-hlo-"), (cache_root / "file-hashes", ".tmp-")]
    life = Life()
    clients: list[Client] = []
    report: Counter[str] = Counter()
    findings: list[str] = []
    restart_s: list[float] = []
    logs = root / "logs"
    logs.mkdir()
    d.start()
    try:
        # Before any kill: every kept program compiled once, its entry known by its file.
        kept_files: list[Path] = []
        for c, n in KEPT:
            before = set(cache.glob("*.tpbx"))
            assert compile_kept_one(d, c, n) == "compiled"
            new = set(cache.glob("*.tpbx")) - before
            assert len(new) == 1, new
            kept_files.append(new.pop())
        life.up.set()
        clients = [
            RestInfer("rest", life, d),
            GrpcInfer("grpc", life, d),
            Compiles("compiles", life, d),
            Compiles("compiles2", life, d),
            Launches("launches", life, d),
            Publishes("publishes", life, d),
            Repository("repository", life, d),
        ]
        for c in clients:
            c.start()
        for kill in range(1, KILLS + 1):
            # Every client served by this daemon, then a random moment.
            deadline = time.monotonic() + RECONNECT_TIMEOUT
            while not all(c.ok[life.epoch] for c in clients):
                assert time.monotonic() < deadline, (
                    f"kill {kill}: clients not served {RECONNECT_TIMEOUT:.0f} s after the restart: "
                    f"{[c.name for c in clients if not c.ok[life.epoch]]}; errors "
                    f"{[e for c in clients for e in c.errors][:5]}\n{d.log()[-3000:]}"
                )
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            pid = d.pid
            workers = workers_of(pid)
            life.up.clear()
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            report["workers alive at a kill"] += len(workers)
            shutil.copy(d.log_path, logs / f"serve.{life.epoch}.log")
            # Its compile workers die with it.
            deadline = time.monotonic() + 5
            while (orphans := workers_of(pid, workers)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if orphans:
                findings.append(f"kill {kill}: compile workers {orphans} outlived daemon {pid}")
                for o in orphans:
                    os.kill(o, signal.SIGKILL)
            assert d.socket_path.exists() and d.local_path.exists(), "the killed daemon's sockets stay"
            report["temporaries left by a kill"] += sum(
                1 for dd, prefix in temp_dirs[:2] if dd.is_dir() for p in dd.iterdir() if p.name.startswith(prefix)
            )
            injected = None
            if kill % INJECT_EVERY == 0:
                j = rng.randrange(len(KEPT))
                injected = (j, damage(kept_files[j], rng))
            t0 = time.monotonic()
            d.start()
            restart_s.append(time.monotonic() - t0)
            life.epoch += 1
            # Checked before the clients come back.
            tiers = compile_kept(d)
            for j, tier in enumerate(tiers):
                want = "compiled" if injected and injected[0] == j else "disk"
                if tier != want:
                    findings.append(f"kill {kill}: kept program {j} came from {tier}, want {want} (damage: {injected})")
            corrupt_logged = d.log().count("corrupt tier-2 entry removed")
            if corrupt_logged != (1 if injected else 0):
                findings.append(f"kill {kill}: {corrupt_logged} corrupt entries logged (damage: {injected})")
            report["damaged entries recompiled"] += bool(injected)
            life.up.set()
            bad = {p.name: why for p in cache.glob("*.tpbx") if (why := entry_problem(p))}
            if bad:
                findings.append(f"kill {kill}: entries that do not verify: {bad}")
            stale = stale_temporaries(temp_dirs, started)
            if stale:
                findings.append(f"kill {kill}: temporaries left after the restart: {stale}")
            assert not findings, "\n".join(findings)
        # The last daemon serves every client again.
        deadline = time.monotonic() + RECONNECT_TIMEOUT
        while not all(c.ok[life.epoch] >= 2 for c in clients) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(c.ok[life.epoch] >= 2 for c in clients), [(c.name, c.ok[life.epoch]) for c in clients]
        # (Before the stop: stopping kills the compile workers, whose dumps the next start sweeps.)
        assert stale_temporaries(temp_dirs, started) == []
    finally:
        life.stop.set()
        for c in clients:
            c.join(timeout=30)
        alive = d.proc is not None and d.proc.poll() is None
        rc = d.stop()
    errors = [e for c in clients for e in c.errors]
    window = sum((c.window for c in clients), Counter())
    entries = list(cache.glob("*.tpbx"))
    summary = {
        "seed": SEED,
        "kills": KILLS,
        "seconds": round(time.time() - started, 1),
        "restart_seconds_mean": round(sum(restart_s) / max(1, len(restart_s)), 2),
        "restart_seconds_max": round(max(restart_s, default=0), 2),
        "calls_served": {c.name: sum(c.ok.values()) for c in clients},
        "calls_cut_by_a_kill": dict(window),
        "errors_after_restart": len(errors),
        "entries_on_disk": len(entries),
        **report,
    }
    print("test_crash:", json.dumps(summary), flush=True)
    if os.environ.get("TPUBOX_CRASH_REPORT"):
        Path(os.environ["TPUBOX_CRASH_REPORT"]).write_text(json.dumps(summary, indent=1) + "\n")
    assert alive and rc == 0, f"the last daemon did not stop cleanly ({rc}):\n{d.log()[-3000:]}"
    assert not errors, f"calls failed while a daemon served: {errors[:10]}"
    assert set(window) <= WINDOW_KINDS, f"unexpected errors of calls a kill cut: {window}"
    assert not [p for p in entries if entry_problem(p)]
    assert stale_temporaries(temp_dirs[:1], started) == []


def compile_kept_one(d: CrashDaemon, c: float, n: int) -> str:
    import tpubox

    with tpubox.connect(f"unix:{d.socket_path}", PROBE, label="kept") as s:
        exe = s.compile(scale_program(c, n))
        x = np.arange(n, dtype=np.float32)
        (y,) = exe.call(x)
        np.testing.assert_array_equal(y, x * np.float32(c))
        return exe.tier
