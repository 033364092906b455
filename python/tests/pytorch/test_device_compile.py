"""torch.compile(backend="tpubox") of a model on the device (issue 46): `model.to(tt.device())`,
then `torch.compile`. The compiled graphs take and return device tensors, the optimizer's step
runs on the device as eager ops (fused into one program per step by DEFER_AND_FUSE), so a
training step moves only the batch in and the loss out. Checked against PyTorch training the
same model on the CPU for 20 steps (SGD with momentum and AdamW; an MLP and a tiny BERT), with
the transfer counters of every step and TorchDynamo's graph count.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpubox
import tpubox.torch as tt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models  # noqa: E402
_spec = importlib.util.spec_from_file_location("tpubox_tests_conftest", HERE.parent / "conftest.py")
_parent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parent)
ALICE = _parent.ALICE

STEPS = 20


@pytest.fixture(scope="module")
def dev(daemon):
    """The eager device in one session of tenant alice for the module."""
    with tpubox.connect(daemon.unix, ALICE, label="pytest device compile") as s:
        yield tt.device(session=s)
        tt.mark_step()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _optimizer(name: str, params, on_device: bool, eps: float = 1e-8):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # capturable: the step count lives on the device with the parameters (TorchTPU's advice).
    return torch.optim.AdamW(params, lr=1e-2, eps=eps, capturable=on_device)


def _state_tensors(opt: torch.optim.Optimizer) -> int:
    """How many tensors OPT's state holds (momentum buffers; AdamW's moments and step)."""
    return sum(isinstance(v, torch.Tensor) for st in opt.state.values() for v in st.values())


def _cpu_step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    """PyTorch's own training step on the CPU (the reference); the loss."""
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def _assert_params_equal(cpu: nn.Module, on_dev: nn.Module, atol: float = 1e-5) -> None:
    for (name, a), b in zip(cpu.named_parameters(), on_dev.parameters()):
        assert tt.is_device_tensor(b), name
        torch.testing.assert_close(
            b.detach().cpu(), a.detach(), rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}"
        )


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_compiled_mlp_trains_on_the_device_as_on_the_cpu(dev, opt_name):
    ref = _mlp()
    model = copy.deepcopy(ref).to(dev)
    ref_opt = _optimizer(opt_name, ref.parameters(), False)
    opt = _optimizer(opt_name, model.parameters(), True)
    compiled = torch.compile(model, backend="tpubox")
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, 8, 16, generator=gen)
    ys = torch.randint(0, 4, (STEPS, 8), generator=gen)
    tt.reset_stats()
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        for i in range(STEPS):
            ref_loss = _cpu_step(ref, ref_opt, xs[i], ys[i])

            tt.reset_eager_stats()
            loss = F.cross_entropy(compiled(xs[i].to(dev)), ys[i].to(dev))
            opt.zero_grad()
            loss.backward()
            opt.step()
            got = loss.item()
            stats = tt.eager_stats()
            # Only the batch (x, y) goes in and the loss comes out: parameters, gradients and
            # optimizer state stay on the device. (The first step also puts the optimizer's
            # new state: factories such as `zeros_like` compute on the host.)
            assert (stats["fetches"], stats["cpu_fallbacks"]) == (1, 0), stats
            assert stats["puts"] == 2 or (i == 0 and stats["puts"] <= 2 + _state_tensors(opt))
            assert got == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)
    _assert_params_equal(ref, model)
    s = tt.stats()
    # One forward and one backward program, each run once per step on device tensors.
    assert (s["graphs"], s["device_executions"]) == (2, 2 * STEPS), s
    assert s["weight_puts"] == 0, s


def test_no_graph_break_with_the_model_on_the_device(dev):
    model = _mlp().to(dev)
    x = torch.randn(8, 16).to(dev)
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    # The compiled model's results are device tensors, equal to the CPU model's.
    out = torch.compile(model, backend="tpubox")(x)
    assert tt.is_device_tensor(out)
    want = copy.deepcopy(model).cpu()(x.cpu())
    torch.testing.assert_close(out.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_compiled_tiny_bert_trains_on_the_device_as_on_the_cpu(dev, opt_name):
    pytest.importorskip("transformers")
    ref = tiny_models.tiny_bert()
    model = copy.deepcopy(ref).to(dev)
    # AdamW normalises each gradient by its own size, so it magnifies rounding where a
    # gradient is near zero: the attention key biases' gradients are zero but for rounding
    # (softmax ignores a per-row constant), and so are the rows of tokens a batch barely
    # uses. With eps=1e-8 their updates would be the sign of rounding noise on either side;
    # eps=1e-6 keeps them small, and AdamW's parameters are compared within 2e-4 (a fiftieth
    # of one step's update, lr = 1e-2) where SGD's are within 1e-5.
    ref_opt = _optimizer(opt_name, ref.parameters(), False, eps=1e-6)
    opt = _optimizer(opt_name, model.parameters(), True, eps=1e-6)
    compiled = torch.compile(model, backend="tpubox")
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 100, (STEPS, 4, 12), generator=gen)
    labels = torch.randint(0, 3, (STEPS, 4), generator=gen)
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        for i in range(STEPS):
            ref_loss = ref(input_ids=ids[i], labels=labels[i]).loss
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()

            tt.reset_eager_stats()
            loss = compiled(input_ids=ids[i].to(dev), labels=labels[i].to(dev)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)
            stats = tt.eager_stats()
            assert (stats["fetches"], stats["cpu_fallbacks"]) == (1, 0), stats
    _assert_params_equal(ref, model, atol=1e-5 if opt_name == "sgd" else 2e-4)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_compiled_optimizer_step_runs_as_one_program(dev, opt_name):
    """PyTorch's own idiom for a compiled optimizer (``torch.compile`` of a function calling
    ``opt.step()``), with the model and optimizer on the device: Dynamo lifts the parameters
    it reads from the optimizer as attributes of its graph, the backend takes them as inputs,
    and the ``_foreach_*`` ops of the step are decomposed and lowered into one program whose
    in-place updates rebind the device tensors. Each step is then three programs (forward,
    backward, optimizer) and one eager op; results equal PyTorch's on the CPU."""
    ref = _mlp()
    model = copy.deepcopy(ref).to(dev)
    ref_opt = _optimizer(opt_name, ref.parameters(), False)
    opt = _optimizer(opt_name, model.parameters(), True)
    loss_fn = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend="tpubox")

    @torch.compile(backend="tpubox")
    def opt_step() -> None:
        opt.step()

    gen = torch.Generator().manual_seed(3)
    xs = torch.randn(STEPS, 8, 16, generator=gen)
    ys = torch.randint(0, 4, (STEPS, 8), generator=gen)
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        for i in range(STEPS):
            ref_loss = _cpu_step(ref, ref_opt, xs[i], ys[i])

            tt.reset_eager_stats()
            tt.reset_stats()
            loss = loss_fn(xs[i].to(dev), ys[i].to(dev))
            opt.zero_grad()
            loss.backward()
            opt_step()
            got = loss.item()
            stats, s = tt.eager_stats(), tt.stats()
            assert got == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)
            if i < 2:
                continue  # the first steps compile (the optimizer's state is made at step 1)
            assert (stats["puts"], stats["fetches"], stats["cpu_fallbacks"]) == (2, 1, 0), stats
            # One eager op: the gradient seed `loss.backward()` makes (`ones_like(loss)`).
            assert stats["launches"] == 1, stats
            assert (s["device_executions"], s["graphs"]) == (3, 0), s
    _assert_params_equal(ref, model, atol=1e-5 if opt_name == "sgd" else 1e-4)
    for st in opt.state.values():
        for v in st.values():
            assert tt.is_device_tensor(v)


def test_foreach_decompositions_match_pytorch():
    """The backend's decompositions of ATen's ``_foreach_*`` ops, run on CPU tensors, against
    PyTorch's own kernels: list, scalar, scalar-list and tensor overloads, in place and not."""
    from tpubox.torch._lowering import _foreach_decompositions

    table = _foreach_decompositions()
    aten = torch.ops.aten
    gen = torch.Generator().manual_seed(5)
    xs = [torch.rand(3, 4, generator=gen) + 0.5, torch.rand(5, generator=gen) + 0.5]
    ys = [torch.rand(3, 4, generator=gen) + 0.5, torch.rand(5, generator=gen) + 0.5]
    zs = [torch.rand(3, 4, generator=gen) + 0.5, torch.rand(5, generator=gen) + 0.5]
    cases = [
        (aten._foreach_add.List, (xs, ys), {"alpha": -0.5}),
        (aten._foreach_add.Scalar, (xs, 2.0), {}),
        (aten._foreach_add.ScalarList, (xs, [1.0, -3.0]), {}),
        (aten._foreach_add.Tensor, (xs, torch.tensor(0.25)), {"alpha": 2}),
        (aten._foreach_mul.Scalar, (xs, 0.9), {}),
        (aten._foreach_mul.Tensor, (xs, torch.tensor(3.0)), {}),
        (aten._foreach_div.List, (xs, ys), {}),
        (aten._foreach_sub.ScalarList, (xs, [0.5, 2.0]), {}),
        (aten._foreach_addcmul.Scalar, (xs, ys, zs, 0.1), {}),
        (aten._foreach_addcdiv.ScalarList, (xs, ys, zs, [0.1, -0.2]), {}),
        (aten._foreach_addcdiv.Tensor, (xs, ys, zs, torch.tensor([0.3, -0.4])), {}),
        (aten._foreach_lerp.Scalar, (xs, ys, 0.25), {}),
        (aten._foreach_lerp.List, (xs, ys, zs), {}),
        (aten._foreach_sqrt.default, (xs,), {}),
        (aten._foreach_neg.default, (xs,), {}),
        (aten._foreach_pow.Scalar, (xs, 2.0), {}),
        (aten._foreach_pow.ScalarAndTensor, (2.0, xs), {}),
        (aten._foreach_maximum.List, (xs, ys), {}),
        (aten._foreach_maximum.Scalar, (xs, 0.9), {}),
        (aten._foreach_minimum.ScalarList, (xs, [0.9, 1.1]), {}),
        (aten._foreach_clamp_max.Scalar, (xs, 1.0), {}),
        (aten._foreach_norm.Scalar, (xs, 2), {}),
        (aten._foreach_reciprocal.default, (xs,), {}),
        (aten._foreach_zero.default, (xs,), {}),
        (aten._foreach_copy.default, (xs, ys), {}),
    ]
    for op, args, kwargs in cases:
        assert op in table, op
        got, want = table[op](*args, **kwargs), op(*args, **kwargs)
        assert len(got) == len(want), op
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, msg=lambda m: f"{op}: {m}")
    # In place: each `self` element written, as PyTorch's in-place kernel writes it.
    mine = [x.clone() for x in xs]
    theirs = [x.clone() for x in xs]
    table[aten._foreach_addcmul_.Scalar](mine, ys, zs, 0.5)
    torch._foreach_addcmul_(theirs, ys, zs, 0.5)
    for g, w in zip(mine, theirs):
        torch.testing.assert_close(g, w)
