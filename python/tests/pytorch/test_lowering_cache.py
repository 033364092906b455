"""tpubox.torch's lowering cache (tpubox._lowering_cache): the StableHLO text torch-mlir lowered
a graph to, on disk across processes, keyed by the graph, its constants, kind and precision.

Every test points the cache at a directory of its own (TPUBOX_TORCH_LOWERING_CACHE_DIR), so
tests share no state with each other or with the user's ~/.cache/tpubox.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpubox._lowering_cache as lc
import tpubox.torch as tt

HERE = Path(__file__).resolve().parent

# The tenants of the shared daemon (python/tests/conftest.py, loaded by path: this directory has
# a conftest.py of its own).
_spec = importlib.util.spec_from_file_location("tpubox_tests_conftest", HERE.parent / "conftest.py")
_parent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parent)
ALICE = _parent.ALICE


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(F.gelu(self.fc1(x)))))


class Scaled(nn.Module):
    """A graph with a constant tensor (``torch.tensor`` in forward: a ``get_attr`` in the ATen
    graph, a ``dense<...>`` constant in the program; a scalar, because torch-mlir writes larger
    constants as ``dense_resource`` blobs, which the CPU plugin refuses)."""

    def __init__(self, c: float):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.c = c

    def forward(self, x):
        return self.fc(x) * torch.tensor(self.c)


def close(got, want, tol=1e-5):
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=tol, atol=tol)


def counts() -> tuple[int, int, int]:
    """tpubox.torch.stats()'s lowering-cache misses, hits and torch-mlir lowerings."""
    st = tt.stats()
    return st["lowering_cache_misses"], st["lowering_cache_hits"], st["lowerings"]


def entries(d: Path) -> list[Path]:
    return sorted(d.glob("*.stablehlo")) if d.is_dir() else []


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "lowering"
    monkeypatch.setenv("TPUBOX_TORCH_LOWERING_CACHE_DIR", str(d))
    monkeypatch.delenv("TPUBOX_TORCH_LOWERING_CACHE", raising=False)
    monkeypatch.delenv("TPUBOX_TORCH_LOWERING_CACHE_MAX_MB", raising=False)
    return d


def run_compiled(session, model, x, **options):
    """MODEL compiled afresh (Dynamo's caches reset) and run once on X without gradients; the
    result and PyTorch eager's."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpubox", options={"session": session, **options})
    with torch.no_grad():
        return compiled(x), model(x)


# ---------------------------------------------------------------------------------------------
# Two processes: the second lowers nothing.

# The child: this module's MLP (its source), compiled, run and compared with eager.
_CHILD_HEAD = textwrap.dedent(
    """
    import json, sys, time, torch
    from torch import nn
    import torch.nn.functional as F
    import tpubox.torch as tt
    address, token = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    """
)
_CHILD_BODY = textwrap.dedent(
    """
    model = MLP().eval()
    x = torch.randn(8, 16)
    compiled = torch.compile(model, backend="tpubox", options={"address": address, "token": token})
    start = time.perf_counter()
    with torch.no_grad():
        got = compiled(x)  # the inference graph
    first_call_s = time.perf_counter() - start
    with torch.no_grad():
        want = model(x)
    err = float((got - want).abs().max())
    # A training step: the forward and backward graphs.
    compiled(x).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).pow(2).mean().backward()
    grad_err = max(float((g - p.grad).abs().max()) for g, p in zip(grads, model.parameters()))
    print(json.dumps({"stats": tt.stats(), "err": err, "grad_err": grad_err,
                      "first_call_s": first_call_s,
                      "importer_loaded": "torch_mlir.extras.fx_importer" in sys.modules}))
    """
)
_CHILD = _CHILD_HEAD + inspect.getsource(MLP) + _CHILD_BODY


def _child(daemon, cache: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parents[1])] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["TPUBOX_TORCH_LOWERING_CACHE_DIR"] = str(cache)
    env.pop("TPUBOX_TORCH_LOWERING_CACHE", None)
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, daemon.unix, ALICE],
        capture_output=True,
        text=True,
        env=env,
        timeout=500,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_a_second_process_lowers_nothing(daemon, tmp_path):
    """Two processes, one after the other, compile and run the same MLP (inference, then a
    training step's forward and backward): the first lowers its three graphs and stores them,
    the second finds all three and runs torch-mlir not once (nor imports its importer); both
    match eager within 1e-5."""
    cache = tmp_path / "lowering"
    first = _child(daemon, cache)
    second = _child(daemon, cache)
    s1, s2 = first["stats"], second["stats"]
    assert s1["lowering_cache_misses"] == 3 and s1["lowering_cache_hits"] == 0, s1
    assert s1["lowerings"] == 3 and s1["lowering_ms"] > 0, s1
    assert len(entries(cache)) == 3
    assert s2["lowering_cache_hits"] == 3 and s2["lowering_cache_misses"] == 0, s2
    assert s2["lowerings"] == 0 and s2["lowering_ms"] == 0, s2
    assert first["importer_loaded"] and not second["importer_loaded"]
    assert s2["graphs"] == s1["graphs"] == 3 and s2["executions"] == s1["executions"], s2
    for o in (first, second):
        assert o["err"] < 1e-5 and o["grad_err"] < 1e-5, o
    assert len(entries(cache)) == 3


# ---------------------------------------------------------------------------------------------
# What must miss: another precision, another constant.


def test_another_precision_misses_and_lowers_then(alice, cache_dir):
    """The text differs per precision: a graph found in the cache at HIGHEST is lowered (only
    then) when it runs at DEFAULT, and that text is stored under a key of its own."""
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(8, 16)
    got, want = run_compiled(alice, model, x)
    close(got, want)
    assert counts() == (1, 0, 1)
    tt.reset_stats()
    infos = []
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="tpubox", options={"session": alice, "debug_callback": infos.append}
    )
    with torch.no_grad():
        close(compiled(x), want)
        assert counts() == (0, 1, 0)
        with tt.precision("default"):
            close(compiled(x), want, tol=1e-4)
    assert counts() == (1, 1, 1)
    assert [i.precision for i in infos] == [tt.Precision.HIGHEST, tt.Precision.DEFAULT]
    # precision_config prints as `precision = [HIGHEST, HIGHEST]`.
    assert "HIGHEST" in infos[0].stablehlo and "DEFAULT" not in infos[0].stablehlo
    assert "DEFAULT" in infos[1].stablehlo and "HIGHEST" not in infos[1].stablehlo
    assert len(entries(cache_dir)) == 2
    # Both texts are found now.
    tt.reset_stats()
    torch._dynamo.reset()
    with torch.no_grad(), tt.precision("default"):
        close(run_compiled(alice, model, x)[0], want, tol=1e-4)
    assert counts() == (0, 1, 0)


def test_another_constant_misses(alice, cache_dir):
    """The same graph code with another constant tensor is another key (the constant's bytes
    are in it): a miss, eager's numbers; the first constant's text is still found."""
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    a, b = Scaled(1.0).eval(), Scaled(5.0).eval()
    b.load_state_dict(a.state_dict())
    for model, misses, hits in ((a, 1, 0), (b, 2, 0), (a, 2, 1)):
        got, want = run_compiled(alice, model, x)
        close(got, want)
        assert counts() == (misses, hits, misses)
    texts = [p.read_text() for p in entries(cache_dir)]
    assert len(texts) == 2
    assert sum("dense<5.000000e+00>" in t for t in texts) == 1, texts


# ---------------------------------------------------------------------------------------------
# A cache that does not check out, cannot be written, or is off.


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "other-key"])
def test_a_corrupt_entry_is_a_miss_and_is_replaced(alice, cache_dir, damage):
    torch.manual_seed(2)
    model = MLP().eval()
    x = torch.randn(8, 16)
    close(*run_compiled(alice, model, x))
    (path,) = entries(cache_dir)
    good = path.read_bytes()
    if damage == "truncated":
        bad = good[: len(good) // 2]
    elif damage == "flipped":
        bad = good[:-10] + bytes([good[-10] ^ 1]) + good[-9:]
    elif damage == "empty":
        bad = b""
    else:  # a sound entry of another key under this key's name
        bad = good.replace(path.stem.encode(), b"0" * len(path.stem))
    path.write_bytes(bad)
    tt.reset_stats()
    close(*run_compiled(alice, model, x))
    assert counts() == (1, 0, 1)
    assert entries(cache_dir) == [path] and path.read_bytes().split(b"\n", 2)[2] == (
        good.split(b"\n", 2)[2]
    )
    tt.reset_stats()
    close(*run_compiled(alice, model, x))
    assert counts() == (0, 1, 0)


@pytest.mark.parametrize("how", ["unwritable", "off"])
def test_an_unwritable_or_disabled_cache_only_lowers(alice, cache_dir, monkeypatch, how):
    """A cache directory that cannot be created (under a regular file) breaks nothing, and
    TPUBOX_TORCH_LOWERING_CACHE=0 turns the cache off: every compile lowers."""
    if how == "unwritable":
        blocker = cache_dir.parent / "a-file"
        blocker.write_text("not a directory")
        monkeypatch.setenv("TPUBOX_TORCH_LOWERING_CACHE_DIR", str(blocker / "lowering"))
    else:
        monkeypatch.setenv("TPUBOX_TORCH_LOWERING_CACHE", "0")
    torch.manual_seed(3)
    model = MLP().eval()
    x = torch.randn(8, 16)
    for n in (1, 2):
        close(*run_compiled(alice, model, x))
        assert counts() == (n if how == "unwritable" else 0, 0, n)
    assert not cache_dir.exists()


# ---------------------------------------------------------------------------------------------
# The module alone: the directory's bound, keys.


def test_the_directory_stays_within_its_bound_least_recently_used_first(cache_dir, monkeypatch):
    monkeypatch.setenv("TPUBOX_TORCH_LOWERING_CACHE_MAX_MB", str(10_000 / (1 << 20)))
    text = "x" * 3000
    keys = [f"{i:064x}" for i in range(6)]

    def store(i: int, t: float) -> None:
        lc.store(keys[i], text, 1)
        os.utime(cache_dir / f"{keys[i]}.stablehlo", (t, t))

    store(0, 1000)
    store(1, 1001)
    store(2, 1002)  # three entries: about 9.8 kB
    assert lc.load(keys[0], 1) == text  # used: now the most recent
    lc.store(keys[3], text, 1)  # over 10 kB: the least recently used go (1, then 2)
    names = {p.stem for p in entries(cache_dir)}
    assert names == {keys[0], keys[3]}, names
    assert sum(p.stat().st_size for p in entries(cache_dir)) <= 10_000
    assert lc.load(keys[1], 1) is None
    # A text larger than the bound is not stored.
    lc.store(keys[4], "y" * 20_000, 1)
    assert lc.load(keys[4], 1) is None
    # A sound entry asked for with another number of results is not one.
    assert lc.load(keys[3], 2) is None


def test_the_digest_covers_code_shapes_and_constants():
    def graph(shape=(2, 3), c=(1.0, 2.0, 3.0), op=torch.ops.aten.mul.Tensor):
        from torch._subclasses.fake_tensor import FakeTensorMode

        g = torch.fx.Graph()
        root = nn.Module()
        root.register_buffer("_c", torch.tensor(c))
        x = g.placeholder("x")
        x.meta["val"] = FakeTensorMode().from_tensor(torch.empty(shape))
        k = g.get_attr("_c")
        g.output((g.call_function(op, (x, k)),))
        return torch.fx.GraphModule(root, g)

    d = lc.graph_digest(graph())
    assert d is not None and d == lc.graph_digest(graph())
    assert lc.graph_digest(graph(shape=(4, 3))) != d
    assert lc.graph_digest(graph(c=(1.0, 2.0, 3.5))) != d
    assert lc.graph_digest(graph(op=torch.ops.aten.add.Tensor)) != d
    kinds, precisions = ("forward", "inference"), ("HIGH", "DEFAULT")
    assert len({lc.entry_key(d, k, p) for k in kinds for p in precisions}) == 4
    # A submodule call: the code does not say what it computes; no key.
    g = torch.fx.Graph()
    root = nn.Module()
    root.sub = nn.Linear(3, 3)
    g.output((g.call_module("sub", (g.placeholder("x"),)),))
    assert lc.graph_digest(torch.fx.GraphModule(root, g)) is None
