"""A trainer and a sampler sharing one device through the node's tpubox daemon, on Ray.

    python examples/ray-colocation/colocate.py [--steps 300] [--every 10] [--plugin cpu]

Starts a local Ray (loopback only) and the node actor (``tpubox.ray.node``) with two tenants:
``trainer``, which may publish weights (``publish_weights = true`` in its ``[tenant.session]``),
and ``sampler``. Then, at the same time:

- the **trainer** actor runs SGD steps of a bigram language model (``bigram.py``: W [32, 32],
  one StableHLO program per step, the corpus uploaded once) and publishes W as the weight set
  ``bigram`` every ``--every`` steps: the published version *is* the trainer's device tensor
  (no copy through the host, no second copy on the device). A published tensor is read-only, so
  the step after a publish computes W' into a new tensor instead of donating W; steps between
  publishes donate it. Old handles are freed as it goes.
- the **sampler** actor opens the latest version (``s.weights("bigram")``), greedily decodes
  ``--tokens`` tokens with it (a logits program on the device, argmax on the host), reads W of
  that version back, and reports ``(version, tokens, W)``; until the trainer is done.

The driver checks every sample against NumPy: the W the sampler read equals a NumPy replay of
the SGD steps that version stands for, and the tokens equal a greedy decode of that W. Neither
actor asks Ray for an accelerator: the daemon owns the device. Needs ``pip install
'./python[ray]'`` and the tpubox binary (``TPUBOX_BIN`` or ``PATH``). See README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray import cloudpickle  # noqa: E402

import bigram  # noqa: E402
import tpubox  # noqa: E402
import tpubox.ray  # noqa: E402

# The actors' code travels by value: Ray's workers do not have this directory on their path.
cloudpickle.register_pickle_by_value(bigram)

NAME = "bigram"
"""The published weight set's name."""

TENANTS: dict[str, dict[str, Any]] = {
    # May publish: its published versions are charged to it (max_published_mib, versions).
    "trainer": {
        "publish_weights": True,
        "max_device_mib": 256,
        "max_published_mib": 16,
        "max_published_versions": 8,
    },
    # Reads what the trainer publishes for it (readers=("sampler",)); publishes nothing.
    "sampler": {"max_device_mib": 64},
}
"""The node actor's tenants (``tpubox.ray.node(tenants=TENANTS)``)."""


def _daemon_pid() -> int | None:
    return ray.get(tpubox.ray.node().info.remote())["pid"]


@ray.remote(num_cpus=0.25, max_restarts=0)
class Trainer:
    """Trains the bigram model on the node's daemon and publishes W every few steps.

    Args:
        tenant: the node actor's tenant to open sessions as (it needs ``publish_weights``).
        name: the weight set to publish.
        readers: the tenants that may open it besides the trainer's own ("*": all).
        lr: the SGD learning rate.
        node_options: the node actor's options if this actor creates it.
    """

    def __init__(
        self,
        tenant: str = "trainer",
        name: str = NAME,
        readers: Sequence[str] = ("sampler",),
        lr: float = bigram.LR,
        node_options: Mapping[str, Any] | None = None,
    ):
        self.tenant, self.name, self.readers, self.lr = tenant, name, tuple(readers), lr
        self.node_options = dict(node_options or {})
        self.s: tpubox.Session | None = None

    def train(self, steps: int, every: int, pace: float = 0.0) -> dict[str, Any]:
        """Trains STEPS steps from the initial weights in a new session (the previous one,
        and what it published and still holds, is closed now), publishing W after every
        EVERY steps; sleeps PACE seconds between steps. The session stays open after the
        call (it holds the last published W) until the next call or :meth:`close`.

        Returns ``versions`` (``{"version", "steps", "time"}`` of each publish), ``step_ms``
        and ``publish_ms`` (each step's and publish's wall time), ``start`` and ``end``
        (``time.time()``), ``daemon_pid``, ``usage`` (the session's, as a dict).
        """
        self.close()
        s = self.s = tpubox.ray.session(self.tenant, node_options=self.node_options)
        x, y = bigram.batch()
        step = s.compile(bigram.train_step_program(bigram.VOCAB, x.shape[0], self.lr))
        xt, yt = s.tensor(x), s.tensor(y)  # the batch stays on the device
        w = s.tensor(bigram.initial_weights())
        published = False
        versions, step_ms, publish_ms = [], [], []
        start = time.time()
        for i in range(1, steps + 1):
            t0 = time.perf_counter()
            # W' into a new tensor; W is donated only while it is not published (a published
            # tensor is read-only), and its handle is freed by the same call either way.
            (nxt,) = step.call(
                w, xt, yt, fetch=False, donate=() if published else (0,), free=(w,)
            )
            step_ms.append((time.perf_counter() - t0) * 1e3)
            w, published = nxt, False
            if i % every == 0:
                t0 = time.perf_counter()
                v = s.publish_weights(self.name, {"w": w}, readers=self.readers)
                publish_ms.append((time.perf_counter() - t0) * 1e3)
                versions.append({"version": v, "steps": i, "time": time.time()})
                published = True
            if pace:
                time.sleep(pace)
        end = time.time()
        u = s.usage()
        return {
            "versions": versions,
            "step_ms": step_ms,
            "publish_ms": publish_ms,
            "start": start,
            "end": end,
            "daemon_pid": _daemon_pid(),
            "session": s.session_id,
            "usage": {k: getattr(u, k) for k in getattr(u, "__dataclass_fields__", {})},
        }

    def ready(self) -> bool:
        """True once the actor is up (its process started)."""
        return True

    def close(self) -> None:
        """Closes the session (a no-op on a daemon that is gone)."""
        if self.s is not None:
            self.s.close(timeout=5)
            self.s = None


@ray.remote(num_cpus=0.25, max_restarts=0)
class Sampler:
    """Generates with the latest published version of the trainer's weights.

    Args:
        tenant: the node actor's tenant to open sessions as (a reader of NAME).
        name: the weight set to read.
        node_options: the node actor's options if this actor creates it.
    """

    def __init__(
        self,
        tenant: str = "sampler",
        name: str = NAME,
        node_options: Mapping[str, Any] | None = None,
    ):
        self.tenant, self.name = tenant, name
        self.node_options = dict(node_options or {})

    def ready(self) -> bool:
        """True once the actor is up (its process started)."""
        return True

    def sample(
        self,
        until: Sequence[Any] = (),
        tokens: int = 24,
        timeout: float = 60.0,
        pause: float = 0.0,
        read_back: bool = True,
    ) -> list[dict[str, Any]]:
        """Samples again and again in a new session: opens the latest version, decodes TOKENS
        tokens from ``bigram.START`` with it, frees it. Stops after the first sample taken
        once every Ray object of UNTIL (e.g. ``[trainer.train.remote(...)]``, in a list so
        that Ray does not wait for it before the call) is ready; with no UNTIL, after one
        sample. Waits (polling) while NAME is not published yet.

        Returns one record per sample: ``version``, ``tokens``, ``time`` (``time.time()`` when
        the version was opened), ``result_weights`` (``Tensor.weights`` of the first logits
        as a dict, set name -> version: which version the daemon says it computed them from), ``w`` (the version's W read back,
        when READ_BACK) and ``daemon_pid``.

        Raises:
            TimeoutError: no end within TIMEOUT seconds.
        """
        until = list(until)
        deadline = time.monotonic() + timeout
        out: list[dict[str, Any]] = []
        with tpubox.ray.session(self.tenant, node_options=self.node_options) as s:
            pid = _daemon_pid()
            logits = s.compile(bigram.logits_program(bigram.VOCAB))
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sampler: no end after {timeout} s ({len(out)} samples)")
                last = not until or not ray.wait(until, num_returns=len(until), timeout=0)[1]
                try:
                    ws = s.weights(self.name)  # the latest version, whole
                except tpubox.NotFound:
                    time.sleep(0.005)  # not published yet
                    continue
                try:
                    rec = {"version": ws.version, "time": time.time(), "daemon_pid": pid}
                    w = ws["w"]
                    (first,) = logits(bigram.one_hot([bigram.START]), w)
                    rec["result_weights"] = dict(first.weights)
                    toks = [int(np.argmax(first.numpy()[0]))]
                    first.free()
                    while len(toks) < tokens:
                        (row,) = logits.call(bigram.one_hot([toks[-1]]), w)
                        toks.append(int(np.argmax(row[0])))
                    rec["tokens"] = toks
                    if read_back:
                        rec["w"] = w.numpy()
                finally:
                    s.free(*ws.values())
                out.append(rec)
                if last:
                    return out
                if pause:
                    time.sleep(pause)


class References:
    """NumPy references of W after N steps (replayed once, incrementally)."""

    def __init__(self, lr: float = bigram.LR):
        self.lr = lr
        self.x, self.y = bigram.batch()
        self.ws = [bigram.initial_weights()]

    def weights(self, steps: int) -> np.ndarray:
        while len(self.ws) <= steps:
            self.ws.append(bigram.reference_step(self.ws[-1], self.x, self.y, self.lr))
        return self.ws[steps]


def check(
    samples: Sequence[Mapping[str, Any]],
    versions: Sequence[Mapping[str, Any]],
    refs: References,
    name: str = NAME,
    rtol: float = 1e-4,
) -> None:
    """Asserts that every sample is what its version gives: the W it read back equals the NumPy
    replay of the steps of that version (VERSIONS: the trainer's ``versions``) within RTOL of
    W's largest entry, its tokens equal the greedy decode of that W, and its logits came from
    that version (``Tensor.weights``)."""
    steps_of = {v["version"]: v["steps"] for v in versions}
    for r in samples:
        assert r["version"] in steps_of, (r["version"], sorted(steps_of))
        assert r["result_weights"] == {name: r["version"]}, r["result_weights"]
        if "w" in r:
            ref = refs.weights(steps_of[r["version"]])
            err = float(np.abs(r["w"] - ref).max() / np.abs(ref).max())
            assert err <= rtol, f"version {r['version']}: W differs from NumPy by {err:.2e}"
            assert r["tokens"] == bigram.greedy(r["w"], len(r["tokens"])), r["version"]
        else:
            ref = refs.weights(steps_of[r["version"]])
            assert r["tokens"] == bigram.greedy(ref, len(r["tokens"])), r["version"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps")
    ap.add_argument("--every", type=int, default=10, help="publish every this many steps")
    ap.add_argument("--pace", type=float, default=0.01, help="seconds between steps")
    ap.add_argument("--tokens", type=int, default=24, help="tokens per sample")
    ap.add_argument("--plugin", default="cpu", help="the daemon's --plugin (cpu, tpu, cuda)")
    args = ap.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        node = tpubox.ray.node(tenants=TENANTS, plugin=args.plugin)
        print("daemon pid", ray.get(node.info.remote())["pid"])
        trainer, sampler = Trainer.remote(), Sampler.remote()
        ray.get([trainer.ready.remote(), sampler.ready.remote()])  # both processes up
        train = trainer.train.remote(args.steps, args.every, args.pace)
        samples = ray.get(sampler.sample.remote([train], tokens=args.tokens))
        t = ray.get(train)
        refs = References()
        check(samples, t["versions"], refs)

        steps_of = {v["version"]: v["steps"] for v in t["versions"]}
        err = max(
            float(np.abs(r["w"] - (ref := refs.weights(steps_of[r["version"]]))).max())
            / float(np.abs(ref).max())
            for r in samples
        )
        print(f"{len(t['versions'])} versions published, {len(samples)} samples, each equal to "
              f"NumPy's replay of its version (W within {err:.1e} of its scale, same tokens)")
        print(f"trainer step: median {statistics.median(t['step_ms']):.2f} ms; publish: median "
              f"{statistics.median(t['publish_ms']):.2f} ms")
        print(" version  steps  loss    sampled after 't'")
        seen = set()
        for r in samples:
            if r["version"] in seen:
                continue
            seen.add(r["version"])
            loss = bigram.loss(r["w"])
            print(f" {r['version']:7d}  {steps_of[r['version']]:5d}  {loss:.3f}  "
                  f"{bigram.decode(r['tokens'])!r}")
        ray.get(trainer.close.remote())
    finally:
        tpubox.ray.shutdown_node()
        ray.shutdown()


if __name__ == "__main__":
    main()
