"""Eager tensors on the daemon (tpubox.torch.device(), tpubox.torch.eager) in TorchTPU's three
eager modes, against PyTorch on the CPU: op by op, a small training step (forward, backward,
SGD with momentum), a mode switch in the middle of training, the CPU fallback and its warning.

Every test checks where the ops ran (tpubox.torch.eager_stats(): launches, fused graphs, CPU
fallbacks), so a silent fallback to PyTorch would fail it.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpubox
import tpubox.torch as tt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

_spec = importlib.util.spec_from_file_location("tpubox_tests_conftest", HERE.parent / "conftest.py")
_parent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parent)
ALICE = _parent.ALICE

MODES = [
    tt.EagerMode.DEFER_NEVER,
    tt.EagerMode.DEFER_AND_FUSE,
    tt.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
]


@pytest.fixture(scope="module")
def dev(daemon):
    """The eager device, its ops running in one session of tenant alice for the module (so
    that the programs compiled by one test serve the next)."""
    with tpubox.connect(daemon.unix, ALICE, label="pytest eager") as s:
        yield tt.device(session=s)
        tt.mark_step()


@pytest.fixture(autouse=True)
def _counters():
    tt.reset_eager_stats()
    yield
    tt.mark_step()


def close(got, want, atol=1e-5, rtol=1e-5):
    assert isinstance(got, torch.Tensor) and got.device.type == "cpu", got
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (got.shape, got.dtype, want)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=rtol, atol=atol)


def test_names_and_environment(monkeypatch):
    assert tt.device() == torch.device("tpubox", 0)
    assert tt.EagerMode.DEFER_NEVER.name == "DEFER_NEVER"
    monkeypatch.delenv("TPUBOX_DEFER_AND_FUSE", raising=False)
    monkeypatch.delenv("TPUBOX_LAUNCH_BLOCKING", raising=False)
    assert tt.eager_mode() is tt.EagerMode.DEFER_NEVER
    monkeypatch.setenv("TPUBOX_DEFER_AND_FUSE", "1")
    assert tt.eager_mode() is tt.EagerMode.DEFER_AND_FUSE
    monkeypatch.setenv("TPUBOX_LAUNCH_BLOCKING", "1")  # wins over the other
    assert tt.eager_mode() is tt.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    monkeypatch.delenv("TPUBOX_LAUNCH_BLOCKING")
    with tt.set_eager_mode("defer_never"):
        assert tt.eager_mode() is tt.EagerMode.DEFER_NEVER
        with tt.set_eager_mode(tt.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
            assert tt.eager_mode() is tt.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
        assert tt.eager_mode() is tt.EagerMode.DEFER_NEVER
    assert tt.eager_mode() is tt.EagerMode.DEFER_AND_FUSE
    with pytest.raises(ValueError):
        tt.set_eager_mode("sometimes")


# Each case: a function of CPU-or-device tensors made from the inputs below.
def _inplace_view(x):
    y = x.clone()
    y[0] = 1.5  # a view written in place: its base changes
    y[:, 1].mul_(3.0)
    return y


def _view_after_base_write(x):
    y = x.clone()
    row = y[1]
    y.add_(1.0)  # the view reads its base again
    return row * 2


CASES = {
    "add_mul": lambda x, w, b: (x * 2.5 + 1) - x / 3,
    "matmul_bias": lambda x, w, b: x @ w + b,
    "activations": lambda x, w, b: torch.cat([F.gelu(x), torch.tanh(x), F.relu(x), x.exp()], 1),
    "softmax_logsumexp": lambda x, w, b: torch.softmax(x, -1) + x.logsumexp(1, keepdim=True),
    "reductions": lambda x, w, b: torch.stack([x.sum(1), x.mean(1), x.amax(1), x.var(1)]),
    "views": lambda x, w, b: (
        x.t().reshape(-1)[2:6] + x[1:, ::2].flatten() + x[0].unsqueeze(0).expand(4, 4)[1]
    ),
    "max_dim": lambda x, w, b: x.max(dim=1).values + x.max(dim=1).indices.float(),
    "compare_where": lambda x, w, b: torch.where(x > 0.1, x, -x).to(torch.float64),
    "layer_norm": lambda x, w, b: F.layer_norm(x @ w, (5,), None, b),
    "inplace_view": lambda x, w, b: _inplace_view(x),
    "view_after_base_write": lambda x, w, b: _view_after_base_write(x),
    "int_ops": lambda x, w, b: (x * 10).to(torch.int32) // 3 + torch.arange(4).int(),
}


@pytest.mark.parametrize("mode", MODES[:2], ids=lambda m: m.name)
@pytest.mark.parametrize("case", sorted(CASES))
def test_ops_match_cpu(dev, case, mode):
    torch.manual_seed(1)
    x, w, b = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    want = CASES[case](x, w, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tt.CpuFallbackWarning)
        with tt.set_eager_mode(mode):
            got = CASES[case](x.to(dev), w.to(dev), b.to(dev))
            assert got.device == dev and got.dtype == want.dtype and got.shape == want.shape
        close(got.cpu(), want)
    st = tt.eager_stats()
    assert st["cpu_fallbacks"] == 0
    if mode is tt.EagerMode.DEFER_AND_FUSE:
        assert st["fused_graphs"] >= 1 and st["launches"] == st["fused_graphs"], st
    else:
        assert st["launches"] >= 1 and st["fused_graphs"] == 0, st


def test_reads_item_numpy_print(dev):
    x = torch.tensor([[1.0, -2.0], [3.5, 4.0]])
    d = x.to(dev)
    s = (d * 2).sum()
    assert s.item() == 13.0 and isinstance(s.item(), float)
    assert (d + 1).tolist() == [[2.0, -1.0], [4.5, 5.0]]
    np.testing.assert_array_equal((d - 1).numpy(), x.numpy() - 1)
    text = repr(d * 1)
    assert "device='tpubox:0'" in text and "3.5000" in text, text
    assert bool((d > 3).any())
    host = torch.empty(2, 2)
    host.copy_(d)  # device -> host copy
    close(host, x)


def test_each_op_compiled_once_per_signature(dev):
    x = torch.randn(6, 7).to(dev)
    (x * 1.25 + x).cpu()
    first = tt.eager_stats()
    tt.reset_eager_stats()
    y = torch.randn(6, 7).to(dev)
    (y * 1.25 + y).cpu()
    again = tt.eager_stats()
    assert first["compiles"] >= 2 and first["launches"] == 2
    assert again["compiles"] == 0 and again["op_cache_hits"] == 2, again
    # Another attribute value is another program.
    (y * 1.5).cpu()
    assert tt.eager_stats()["compiles"] == 1


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(F.gelu(self.fc1(x)))))


def _train(model, opt, x, y, steps, modes=None):
    losses = []
    for i in range(steps):
        mode = modes[i] if modes else None
        with tt.set_eager_mode(mode) if mode else _nothing():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _setup(dev):
    torch.manual_seed(0)
    cpu = MLP()
    on_dev = copy.deepcopy(cpu).to(dev)
    assert all(p.device == dev for p in on_dev.parameters())
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    opt_dev = torch.optim.SGD(on_dev.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return cpu, on_dev, opt_cpu, opt_dev, x, y


def _check_params(cpu, on_dev):
    for (name, p), q in zip(cpu.named_parameters(), on_dev.parameters()):
        np.testing.assert_allclose(
            q.detach().cpu().numpy(), p.detach().numpy(), atol=1e-5, rtol=1e-5, err_msg=name
        )


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_training_step_matches_cpu(dev, mode):
    cpu, on_dev, opt_cpu, opt_dev, x, y = _setup(dev)
    want = _train(cpu, opt_cpu, x, y, 3)
    tt.reset_eager_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tt.CpuFallbackWarning)
        got = _train(on_dev, opt_dev, x.to(dev), y.to(dev), 3, [mode] * 3)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    _check_params(cpu, on_dev)
    for p in on_dev.parameters():
        assert p.grad is not None and p.grad.device == dev
    st = tt.eager_stats()
    assert st["cpu_fallbacks"] == 0, st
    if mode is tt.EagerMode.DEFER_AND_FUSE:
        # One graph per step: forward, backward and the optimizer's step, read by .item().
        assert st["fused_graphs"] == 3 and st["launches"] == 3, st
        assert st["fused_ops"] > 60, st
    else:
        assert st["fused_graphs"] == 0 and st["launches"] > 60, st


def test_mode_switch_in_the_middle_of_training(dev):
    cpu, on_dev, opt_cpu, opt_dev, x, y = _setup(dev)
    want = _train(cpu, opt_cpu, x, y, 4)
    tt.reset_eager_stats()
    xd, yd = x.to(dev), y.to(dev)
    got = []
    # Forward fused, backward and step one op at a time, then whole steps in each mode.
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        opt_dev.zero_grad()
        loss = F.cross_entropy(on_dev(xd), yd)
    assert tt.eager_stats()["fused_ops"] > 0
    with tt.set_eager_mode(tt.EagerMode.DEFER_NEVER):
        loss.backward()
        opt_dev.step()
    got.append(loss.item())
    got += _train(
        on_dev,
        opt_dev,
        xd,
        yd,
        3,
        [
            tt.EagerMode.DEFER_AND_FUSE,
            tt.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
            tt.EagerMode.DEFER_AND_FUSE,
        ],
    )
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    _check_params(cpu, on_dev)
    assert tt.eager_stats()["cpu_fallbacks"] == 0


def test_cpu_fallback_warns_with_the_op_name(dev):
    x = torch.tensor([[0.0, 1.5, -2.0], [3.0, 0.0, 0.25]])
    d = x.to(dev)
    tt._lowering._WARNED.discard("aten.nonzero")
    for mode in (tt.EagerMode.DEFER_NEVER, tt.EagerMode.DEFER_AND_FUSE):
        with tt.set_eager_mode(mode):
            with pytest.warns(tt.CpuFallbackWarning, match=r"aten\.nonzero") if (
                mode is tt.EagerMode.DEFER_NEVER
            ) else _nothing():
                idx = (d * 2).nonzero()  # data-dependent shape: no lowering
            assert idx.device == dev
            out = (idx + 1).cpu()  # the result is a device tensor again
        np.testing.assert_array_equal(out.numpy(), (x * 2).nonzero().numpy() + 1)
    assert tt.eager_stats()["cpu_fallbacks"] == 2
    assert tt.cpu_fallback_ops() == ["aten.nonzero"]
    tt.reset_eager_stats()
    assert tt.cpu_fallback_ops() == []


def test_random_factories_and_inplace_init(dev):
    torch.manual_seed(3)
    want = torch.randn(4, 3)
    torch.manual_seed(3)
    got = torch.randn(4, 3, device=dev)  # computed by the CPU generator, put on the device
    close(got.cpu(), want)
    z = torch.zeros(2, 3, device=dev)
    z += 2
    close(z.cpu(), torch.full((2, 3), 2.0))
    close(torch.arange(5, device=dev).cpu(), torch.arange(5))


@pytest.mark.parametrize("mode", MODES[:2], ids=lambda m: m.name)
def test_conv_batchnorm_adam_matches_cpu(dev, mode):
    """A convolution, BatchNorm in training mode (running statistics updated on the device),
    Adam's state in place; an embedding's gradient (index ops). (No convolution bias before
    the BatchNorm: its gradient is rounding noise, which Adam's normalisation magnifies.)"""
    torch.manual_seed(0)
    cpu = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )  # fmt: skip
    on_dev = copy.deepcopy(cpu).to(dev)
    opt = torch.optim.Adam(cpu.parameters(), 1e-2)
    opt_dev = torch.optim.Adam(on_dev.parameters(), 1e-2)
    x, y = torch.randn(2, 3, 6, 6), torch.tensor([0, 2])
    want = _train(cpu, opt, x, y, 2)
    tt.reset_eager_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tt.CpuFallbackWarning)
        got = _train(on_dev, opt_dev, x.to(dev), y.to(dev), 2, [mode] * 2)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        _check_params(cpu, on_dev)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            close(getattr(on_dev[1], name).cpu(), getattr(cpu[1], name))
        emb = nn.Embedding(10, 4)
        emb_dev = copy.deepcopy(emb).to(dev)
        idx = torch.tensor([[1, 2, 9], [0, 0, 3]])
        emb(idx).pow(2).sum().backward()
        with tt.set_eager_mode(mode):
            emb_dev(idx.to(dev)).pow(2).sum().backward()
        close(emb_dev.weight.grad.cpu(), emb.weight.grad)
    assert tt.eager_stats()["cpu_fallbacks"] == 0


def test_fused_graph_runs_at_the_size_threshold(dev):
    old = tt.max_fused_ops()
    tt.set_max_fused_ops(4)
    try:
        x = torch.ones(3).to(dev)
        with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
            for _ in range(10):
                x = x * 2
            assert tt.eager_stats()["fused_graphs"] == 2  # after 4 and 8 ops
            tt.mark_step()
            assert tt.eager_stats()["fused_graphs"] == 3
            close(x.cpu(), torch.full((3,), 1024.0))
            assert tt.eager_stats()["fused_graphs"] == 3  # nothing pending: no program
    finally:
        tt.set_max_fused_ops(old)


def test_module_conversion_copy_and_save(dev):
    import io

    torch.manual_seed(2)
    cpu = nn.Linear(3, 2)
    on_dev = copy.deepcopy(cpu).to(dev).double()  # parameters swapped, not `.data`-set
    assert on_dev.weight.dtype == torch.float64 and isinstance(on_dev.weight, nn.Parameter)
    close(on_dev.weight.detach().cpu(), cpu.weight.detach().double())
    twin = copy.deepcopy(on_dev)
    with torch.no_grad():
        twin.weight.mul_(2)  # the copy has a storage of its own
    close(on_dev.weight.detach().cpu(), cpu.weight.detach().double())
    close(twin.weight.detach().cpu(), cpu.weight.detach().double() * 2)
    buf = io.BytesIO()
    torch.save(on_dev.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["bias"].device == dev
    close(loaded["bias"].cpu(), cpu.bias.detach().double())
    assert f"{on_dev.bias.sum():.4f}" == f"{cpu.bias.sum().item():.4f}"


@pytest.mark.parametrize("mode", MODES[:2], ids=lambda m: m.name)
def test_adam_capturable_compiles_no_more_after_the_first_steps(dev, mode):
    """Adam's bias corrections are Python numbers (new programs each step) unless
    capturable=True keeps its step count on the device: then the steady state compiles
    nothing, op by op or fused (the fused graph of each step is the same program)."""
    cpu, on_dev, _, _, x, y = _setup(dev)
    opt = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    opt_dev = torch.optim.Adam(on_dev.parameters(), lr=1e-2, capturable=True)
    want = _train(cpu, opt, x, y, 5)
    xd, yd = x.to(dev), y.to(dev)
    got = _train(on_dev, opt_dev, xd, yd, 2, [mode] * 2)
    tt.reset_eager_stats()
    got += _train(on_dev, opt_dev, xd, yd, 3, [mode] * 3)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    _check_params(cpu, on_dev)
    st = tt.eager_stats()
    assert st["compiles"] == 0 and st["cpu_fallbacks"] == 0, st
