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
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpubox
import tpubox.torch as tt

HERE = Path(__file__).resolve().parent
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
            ref_loss = F.cross_entropy(ref(xs[i]), ys[i])
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()

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
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    torch.manual_seed(0)
    ref = transformers.BertForSequenceClassification(cfg).train()
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
