"""torch.distributed's backend "tpubox" (docs/DISTRIBUTED.md): PyTorch's own launcher and calls,
against gloo on the same inputs and against one process training on the whole batch; and the
daemon's process groups through the session API: a world larger than the tenant's devices,
another tenant's join, ranks that disagree, a rank whose session ends, a rank that never comes.

A daemon of its own with four CPU devices (`--cpu-devices 4`, the CPU plugin's
`cpu_device_count`; JAX tests its multi-device code the same way) and two tenants: alice may
use every device, bob two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpubox

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tpubox_daemon import Daemon, free_ports  # noqa: E402

WORLD = 4
ALICE, BOB = "dist-alice-token", "dist-bob-token"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist-daemon")
    d = Daemon(
        root,
        {
            "alice": {"token": ALICE, "session": {"max_sessions": 16}},
            "bob": {"token": BOB, "session": {"devices": 2}},
        },
        extra_args=("--cpu-devices", str(WORLD)),
    )
    d.start()
    yield d
    assert d.stop() == 0, d.log()[-3000:]


def rank_env(daemon, **env: str) -> dict[str, str]:
    """The environment of a rank: the daemon's address and alice's token, this checkout's
    package first on the path, one thread of computation per process."""
    return dict(
        os.environ,
        TPUBOX_ADDRESS=daemon.unix,
        TPUBOX_TOKEN=ALICE,
        PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        **env,
    )


def torchrun(daemon, mode: str, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Runs dist_worker.py MODE under `torchrun --nproc_per_node=4`; the ranks' results."""
    out = tmp_path / mode
    out.mkdir()
    runner = Path(sys.executable).parent / "torchrun"
    full_env = rank_env(daemon, **env)
    p = subprocess.run(
        [
            str(runner),
            f"--nproc_per_node={WORLD}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_ports(1)[0]}",
            str(HERE / "dist_worker.py"),
            mode,
            str(out),
        ],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    return p, results


@pytest.mark.timeout(300)
def test_collectives_equal_gloo(daemon, tmp_path):
    p, results = torchrun(daemon, "collectives", tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    assert [r["rank"] for r in results] == list(range(WORLD))
    # Each rank's session is on its own device.
    assert [r["devices"] for r in results] == [[k] for k in range(WORLD)]
    for r in results:
        rel = r["rel"]
        for name in (
            "all_reduce_sum", "all_reduce_avg", "all_reduce_product", "all_reduce_min",
            "all_reduce_max", "all_reduce_scalar", "all_reduce_cpu_tensor", "all_gather",
            "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "barrier",
            "send_recv",
        ) + tuple(f"broadcast_{k}" for k in range(WORLD)):  # fmt: skip
            assert rel[name] <= 1e-6, (r["rank"], name, rel[name])


@pytest.mark.timeout(300)
def test_ddp_equals_one_process_on_the_whole_batch(daemon, tmp_path):
    pytest.importorskip("transformers")
    p, results = torchrun(daemon, "ddp", tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    # The reference: one process, the whole batch (each step's 4 x 8 rows), same model and
    # optimizer. DDP averages the ranks' gradients of their own mean losses: the gradient of
    # the whole batch's mean loss.
    sys.path.insert(0, str(HERE))
    import dist_worker_ref as ref  # noqa: PLC0415

    for key, want in (("params", ref.one_process(WORLD)), ("bert_params", ref.one_process_bert(WORLD))):
        for r in results:
            assert len(r[key]) == len(want)
            for k, (got, w) in enumerate(zip(r[key], want)):
                got, w = np.asarray(got), np.asarray(w)
                # Relative to the parameter's largest value; BERT's attention key biases get
                # gradients that are zero but for rounding (softmax ignores a per-row
                # constant), so they stay at rounding noise (1e-13) in both runs, and are
                # compared absolutely.
                scale = max(np.abs(w).max(), 1e-3)
                assert np.abs(got - w).max() <= 1e-5 * scale, (key, r["rank"], k)
        # Every rank ends with the same parameters.
        assert all(r[key] == results[0][key] for r in results), key


@pytest.mark.timeout(300)
def test_a_rank_that_never_arrives_times_out_and_breaks_the_group(daemon, tmp_path):
    p, results = torchrun(daemon, "straggler", tmp_path, PG_TIMEOUT="3", STRAGGLE_SECONDS="10")
    waiting = [r for r in results if r["rank"] != WORLD - 1]
    assert len(waiting) == WORLD - 1, p.stderr[-4000:]
    for r in waiting:
        # PyTorch's error for a backend's failure, naming the collective and the missing rank,
        # after the group's timeout (3 s) and well before the straggler wakes (10 s).
        assert r["error"] == "DistBackendError", r
        assert "all_reduce(sum)" in r["message"] and f"[{WORLD - 1}]" in r["message"], r
        assert 2.5 <= r["seconds"] <= 9.0, r


@pytest.mark.timeout(300)
def test_a_rank_killed_inside_a_collective_fails_the_others_at_once(daemon, tmp_path):
    """Four processes without torchrun (it would stop the others), meeting by `tcp://`; the
    last is SIGKILLed while the others wait in an all_reduce whose group timeout is 60 s."""
    out = tmp_path / "killed"
    out.mkdir()
    port = free_ports(1)[0]
    env = rank_env(
        daemon, INIT_METHOD=f"tcp://127.0.0.1:{port}", WORLD_SIZE=str(WORLD), PG_TIMEOUT="60"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "dist_worker.py"), "killed", str(out)],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    codes = [p.wait(timeout=200) for p in procs]
    logs = [p.stdout.read()[-2000:] for p in procs]
    assert codes[-1] == -9, logs[-1]
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert len(results) == WORLD - 1, logs
    for r in results:
        assert r["error"] == "DistBackendError", r
        assert f"rank {WORLD - 1}'s session ended" in r["message"], r
        assert r["seconds"] < 20, r  # the killed rank's session ends with its connection
    # The daemon keeps nothing of them.
    deadline = time.monotonic() + 10
    while tpubox.tenant_usage(daemon.unix, ALICE).sessions and time.monotonic() < deadline:
        time.sleep(0.2)
    usage = tpubox.tenant_usage(daemon.unix, ALICE)
    assert (usage.sessions, usage.usage.live_tensors) == (0, 0), usage


def _sessions(address: str, token: str, devices: list[int]) -> list[tpubox.Session]:
    return [tpubox.connect(address, token, devices=[d], label=f"group {d}") for d in devices]


def test_a_world_larger_than_the_tenants_devices_is_refused(daemon):
    (s,) = _sessions(daemon.unix, BOB, [0])
    with s:
        with pytest.raises(tpubox.ResourceExhausted) as e:
            s.create_group(WORLD, 0)
        assert f"a group of {WORLD} ranks" in str(e.value) and "may use 2 device(s)" in str(e.value)
        # Two is allowed.
        assert len(s.create_group(2, 0)) == 32


def test_another_tenant_learns_nothing_of_a_group(daemon):
    a0, b = _sessions(daemon.unix, ALICE, [0]) + _sessions(daemon.unix, BOB, [1])
    with a0, b:
        gid = a0.create_group(2, 0)
        with pytest.raises(tpubox.NotFound) as theirs:
            b.join_group(gid, 1)
        with pytest.raises(tpubox.NotFound) as nobodys:
            b.join_group("0" * 32, 1)
        # The same answer as for an id that never existed.
        assert str(theirs.value) == str(nobodys.value)


def _in_thread(fn):
    box: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            box["error"] = e
        box["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_ranks_that_disagree_all_fail(daemon):
    s0, s1 = _sessions(daemon.unix, ALICE, [0, 1])
    with s0, s1:
        gid = s0.create_group(2, 0, timeout=30)
        s1.join_group(gid, 1)
        t, box = _in_thread(lambda: s0.collective(gid, "all_reduce", s0.tensor(np.ones(4, np.float32))))
        with pytest.raises(tpubox.InvalidArgument) as e:
            s1.collective(gid, "all_reduce", s1.tensor(np.ones(5, np.float32)))
        t.join(10)
        assert isinstance(box.get("error"), tpubox.InvalidArgument), box
        assert "the ranks disagree" in str(e.value) and "F32[5]" in str(e.value)


def test_a_rank_whose_session_ends_breaks_the_group_at_once(daemon):
    s0, s1 = _sessions(daemon.unix, ALICE, [0, 1])
    with s0:
        gid = s0.create_group(2, 0, timeout=60)
        s1.join_group(gid, 1)
        # A collective that works first: the sum of both ranks' tensors.
        t, box = _in_thread(lambda: s0.collective(gid, "all_reduce", s0.tensor(np.full(3, 2, np.float32))))
        got = s1.collective(gid, "all_reduce", s1.tensor(np.full(3, 5, np.float32)))
        t.join(10)
        np.testing.assert_array_equal(got.numpy(), np.full(3, 7, np.float32))
        np.testing.assert_array_equal(box["value"].numpy(), np.full(3, 7, np.float32))
        # Rank 0 waits in the next one; rank 1's session ends (its process would have died).
        t, box = _in_thread(lambda: s0.collective(gid, "all_reduce", s0.tensor(np.ones(3, np.float32))))
        time.sleep(0.5)
        s1.close()
        t.join(10)
        assert isinstance(box.get("error"), tpubox.FailedPrecondition), box
        assert "rank 1's session ended" in str(box["error"]), box
        assert box["seconds"] < 5, box  # not the group's 60 s timeout
        # The group stays broken.
        with pytest.raises(tpubox.FailedPrecondition):
            s0.collective(gid, "barrier")
    # Nothing left behind: the tenant's sessions (each ended) hold no tensor.
    usage = tpubox.tenant_usage(daemon.unix, ALICE)
    assert usage.usage.live_tensors == 0, usage
