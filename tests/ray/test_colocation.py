"""The colocation example (examples/ray-colocation) on a real Ray: a trainer actor and a sampler
actor share the node's daemon at the same time; every sample equals a NumPy reference computed
from the weight version it reports; a daemon restart loses the published versions (NotFound,
and numbering starts at 1 again).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from ray import cloudpickle

import tpubox
import tpubox.ray
from tpubox_daemon import wait_until  # python/tests, on sys.path by conftest.py

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray-colocation"


def _load_example():
    sys.path.insert(0, str(EXAMPLE))
    spec = importlib.util.spec_from_file_location("colocate", EXAMPLE / "colocate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["colocate"] = mod
    spec.loader.exec_module(mod)
    # The workers cannot import the example: its actors and bigram travel by value.
    cloudpickle.register_pickle_by_value(mod)
    return mod


colocate = _load_example()
import bigram  # noqa: E402  (examples/ray-colocation, on sys.path now)

EVERY = 10
STEPS = 200
PACE = 0.01  # the trainer's pause between steps: ~2 s of training for the sampler to overlap


def node_options(cluster) -> dict:
    return {
        # the example's tenants, and one that the trainer does not name as a reader
        "tenants": {**colocate.TENANTS, "other": {"max_device_mib": 16}},
        "cache_dir": cluster["cache_dir"],
    }



@pytest.fixture(scope="module")
def actors(cluster):
    opts = node_options(cluster)
    h = tpubox.ray.node(**opts)
    trainer = colocate.Trainer.remote(node_options=opts)
    sampler = colocate.Sampler.remote(node_options=opts)
    # Both actors' processes up before the trainer starts, so that the sampler overlaps it.
    ray.get([trainer.ready.remote(), sampler.ready.remote()], timeout=120)
    yield {"node": h, "trainer": trainer, "sampler": sampler, "options": opts}
    try:
        ray.get(trainer.close.remote(), timeout=30)
    finally:
        ray.kill(trainer)
        ray.kill(sampler)


def run_both(actors, steps: int, every: int, pace: float):
    train = actors["trainer"].train.remote(steps, every, pace)
    samples = ray.get(actors["sampler"].sample.remote([train], tokens=24), timeout=120)
    return ray.get(train, timeout=60), samples


def test_sampler_output_equals_reference_of_its_version(actors):
    info = ray.get(actors["node"].info.remote())
    t, samples = run_both(actors, STEPS, EVERY, PACE)

    versions = [v["version"] for v in t["versions"]]
    assert versions == list(range(1, STEPS // EVERY + 1)), versions
    assert [v["steps"] for v in t["versions"]] == list(range(EVERY, STEPS + 1, EVERY))

    # One device, one daemon, both at once.
    assert t["daemon_pid"] == info["pid"]
    assert {r["daemon_pid"] for r in samples} == {info["pid"]}
    during = [r for r in samples if t["start"] <= r["time"] <= t["end"]]
    assert len(during) >= 3, [(r["version"], r["time"]) for r in samples]
    assert len({r["version"] for r in during}) >= 3, [r["version"] for r in during]

    # The versions a sampler sees never go back, and the last one is the final version.
    seen = [r["version"] for r in samples]
    assert seen == sorted(seen), seen
    assert seen[-1] == versions[-1], seen

    # Every sample is its version's: W read back == NumPy's replay of version*EVERY steps
    # (1e-4 of W's scale), tokens == greedy decode of that W, logits tagged with the version.
    colocate.check(samples, t["versions"], colocate.References())
    assert all(r["result_weights"] == {colocate.NAME: r["version"]} for r in samples), samples[0]
    # Training did something the samples show: the last version's loss is below the first
    # one's, and W changed between every two versions seen.
    first, last = samples[0], samples[-1]
    assert last["version"] > first["version"]
    assert bigram.loss(last["w"]) < bigram.loss(first["w"]), (first["version"], last["version"])
    by_version = {r["version"]: r["w"] for r in samples}
    vs = sorted(by_version)
    for a, b in zip(vs, vs[1:]):
        assert not np.array_equal(by_version[a], by_version[b]), (a, b)

    # Publishing copied nothing through the host: the trainer's session read nothing back and
    # uploaded only the batch and the initial W, once. Its tenant's ledger holds whole
    # versions (the latest, and one the sampler may still hold).
    u = t["usage"]
    x, y = bigram.batch()
    w_bytes = bigram.VOCAB * bigram.VOCAB * 4
    assert u["device_to_host_bytes"] == 0, u
    assert u["host_to_device_bytes"] == x.nbytes + y.nbytes + w_bytes, u
    assert 1 <= u["published_versions"] <= 2, u
    assert u["published_bytes"] == u["published_versions"] * w_bytes, u


def test_readers_and_publishers(actors):
    """The sampler's tenant reads what the trainer published for it; a tenant not named as a
    reader gets NotFound, as for a name that does not exist; the sampler may not publish."""
    h = actors["node"]
    if not ray.get(actors["trainer"].train.remote(EVERY, EVERY))["versions"]:
        pytest.fail("the trainer published nothing")
    with tpubox.ray.session("sampler") as s:
        ws = s.weights(colocate.NAME)
        assert ws.name == colocate.NAME and set(ws) == {"w"}
        held = s.weight_versions(colocate.NAME)
        assert held.latest == ws.version and ws.version in held.held, held
        np.testing.assert_allclose(
            ws["w"].numpy(), colocate.References().weights(EVERY), rtol=1e-4, atol=1e-5
        )
        w = s.tensor(np.zeros((bigram.VOCAB, bigram.VOCAB), np.float32))
        with pytest.raises(tpubox.PermissionDenied):
            s.publish_weights("sampler-own", {"w": w})
    with tpubox.ray.session("other") as s:
        with pytest.raises(tpubox.NotFound):
            s.weights(colocate.NAME)
    assert ray.get(h.info.remote())["restarts"] == 0


def test_daemon_restart_loses_published_versions(actors):
    h = actors["node"]
    t, _ = run_both(actors, 3 * EVERY, EVERY, 0.0)
    assert t["versions"][-1]["version"] >= 3
    with tpubox.ray.session("sampler") as s:
        assert s.weights(colocate.NAME).version == t["versions"][-1]["version"]

    before = ray.get(h.info.remote())
    os.kill(before["pid"], signal.SIGKILL)
    wait_until(
        lambda: (i := ray.get(h.info.remote()))["ready"] and i["pid"] != before["pid"],
        timeout=15,
        what="a new daemon answering",
    )
    # Published versions lived in the dead daemon's memory: gone for every tenant.
    for tenant in ("sampler", "trainer"):
        with tpubox.ray.session(tenant) as s:
            with pytest.raises(tpubox.NotFound):
                s.weights(colocate.NAME)
            with pytest.raises(tpubox.NotFound):
                s.weights(colocate.NAME, version=1)
    # The trainer (whose session died with the daemon) trains again: numbering starts at 1.
    t, samples = run_both(actors, 2 * EVERY, EVERY, PACE)
    assert [v["version"] for v in t["versions"]] == [1, 2], t["versions"]
    assert t["daemon_pid"] != before["pid"]
    assert samples and samples[-1]["version"] == 2
    colocate.check(samples, t["versions"], colocate.References())
