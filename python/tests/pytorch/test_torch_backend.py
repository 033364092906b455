"""torch.compile(model, backend="tpubox"): graphs lowered to StableHLO by torch-mlir, compiled
and run in a session of the test daemon, compared with the same models run by PyTorch eager.

Every test that compiles checks that the programs really ran on the daemon (the session's
executions, tpubox.torch.stats()), so a silent fallback to PyTorch would fail it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
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

from tpubox_daemon import Daemon  # noqa: E402

# The tenants of the shared daemon (python/tests/conftest.py, loaded by path: this directory has
# a conftest.py of its own).
_spec = importlib.util.spec_from_file_location("tpubox_tests_conftest", HERE.parent / "conftest.py")
_parent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parent)
ALICE, SMALL, TENANTS = _parent.ALICE, _parent.SMALL, _parent.TENANTS

RTOL = 1e-4
ATOL = 1e-4


def close(got, want, rtol=RTOL, atol=ATOL):
    """GOT (a tensor or a tuple/list of them) equals WANT to the tolerance, same shapes and
    dtypes."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want)
        for g, w in zip(got, want):
            close(g, w, rtol, atol)
        return
    assert isinstance(got, torch.Tensor), type(got)
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (got.shape, got.dtype, want)
    np.testing.assert_allclose(
        got.detach().float().numpy(), want.detach().float().numpy(), rtol=rtol, atol=atol
    )


class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)
        self.norm = nn.LayerNorm(d_hidden)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(F.gelu(self.fc1(x)))))


def executions(s: tpubox.Session) -> int:
    return s.usage().executions


def test_mlp_matches_eager_and_runs_on_the_daemon(alice):
    torch.manual_seed(0)
    model = MLP().eval()
    compiled = torch.compile(model, backend="tpubox", options={"session": alice})
    x = torch.randn(8, 16)
    before = executions(alice)
    with torch.no_grad():
        want = model(x)
        got = compiled(x)
        got2 = compiled(x + 1)
        want2 = model(x + 1)
    close(got, want)
    close(got2, want2)
    assert executions(alice) - before == 2
    st = tt.stats()
    assert st["executions"] == 2 and st["compiles"] == 1, st
    # Weights: put once (5 tensors: two Linear layers' weight and bias, LayerNorm's pair
    # makes 6), then found on the device.
    n_params = len(list(model.parameters()))
    assert st["weight_puts"] == n_params and st["weight_hits"] == n_params, st


def test_weights_are_parameters_not_constants(alice):
    """The program takes the weights as parameters: its text holds no dense constant of a
    weight's size, and its parameters are the weights' and the input's shapes."""
    torch.manual_seed(1)
    model = nn.Linear(64, 48).eval()
    infos = []
    compiled = torch.compile(
        model, backend="tpubox", options={"session": alice, "debug_callback": infos.append}
    )
    x = torch.randn(3, 64)
    with torch.no_grad():
        close(compiled(x), model(x))
    (info,) = infos
    assert info.kind == "inference"
    # Only splat constants (one value: dense<1.0>), no array (dense<[...]> or dense<"0x...">).
    assert 'dense<"' not in info.stablehlo and "dense<[" not in info.stablehlo, info.stablehlo
    params = info.stablehlo.split("@main(")[1].split(")")[0]
    for spec in ("tensor<48x64xf32>", "tensor<48xf32>", "tensor<3x64xf32>"):
        assert spec in params, params
    assert info.executable.parameters[0].shape in ((48, 64), (3, 64))


def test_parameter_update_is_noticed(alice):
    torch.manual_seed(2)
    model = MLP().eval()
    compiled = torch.compile(model, backend="tpubox", options={"session": alice})
    x = torch.randn(4, 16)
    with torch.no_grad():
        close(compiled(x), model(x))
        puts = tt.stats()["weight_puts"]
        model.fc1.weight.mul_(0.5)  # in place: the version counter moves
        model.norm.bias.add_(0.25)
        close(compiled(x), model(x))
        # Exactly the two updated tensors went again.
        assert tt.stats()["weight_puts"] == puts + 2
        # A new Parameter object (load_state_dict copies in place; assignment replaces).
        model.fc2.bias = nn.Parameter(torch.randn(4))
        close(compiled(x), model(x))
    assert tt.stats()["compiles"] == 1


def test_buffers_stay_on_the_device_and_updates_are_seen(alice):
    """BatchNorm's running statistics are buffers: kept on the device like parameters; in
    training mode the program updates them and the new values are used by the next call."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tpubox", options={"session": alice})
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for _ in range(2):  # training mode: batch statistics, running stats updated
            close(compiled(x), ref(x))
        close(model[1].running_mean, ref[1].running_mean)
        close(model[1].running_var, ref[1].running_var)
        model.eval()
        ref.eval()
        close(compiled(x), ref(x))
    assert tt.stats()["executions"] >= 3


def test_training_step_matches_eager(alice):
    """Forward and backward compiled (aot_autograd's two graphs), SGD's step in PyTorch: the
    losses and the parameters after three steps match the same steps in eager, and each step's
    new weights are put before the next forward."""
    torch.manual_seed(4)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    infos = []
    compiled = torch.compile(
        model, backend="tpubox", options={"session": alice, "debug_callback": infos.append}
    )
    x, y = torch.randn(16, 16), torch.randn(16, 4)
    before = executions(alice)
    for step in range(3):
        loss = F.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        close(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters()):
        close(p, q)
    assert sorted(i.kind for i in infos) == ["backward", "forward"]
    assert executions(alice) - before == 6  # three forwards, three backwards
    st = tt.stats()
    n_params = len(list(model.parameters()))
    assert st["weight_puts"] >= 3 * n_params, st  # every step's update noticed


def test_precision_maps_to_dot_general_precision(alice):
    """torch.set_float32_matmul_precision and tpubox.torch.precision set precision_config of
    every dot_general and convolution of the program (the CPU plugin computes all alike, so
    the program text is what is checked), and each precision is its own compile."""
    torch.manual_seed(5)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3)
            self.fc = nn.Linear(4 * 6 * 6, 5)

        def forward(self, x):
            return self.fc(torch.flatten(F.relu(self.conv(x)), 1))

    model = M().eval()
    infos = []
    compiled = torch.compile(
        model, backend="tpubox", options={"session": alice, "debug_callback": infos.append}
    )
    x = torch.randn(2, 2, 8, 8)
    with torch.no_grad():
        want = model(x)
        assert tt.current_precision() is tt.Precision.HIGHEST  # PyTorch's default: "highest"
        close(compiled(x), want)
        torch.set_float32_matmul_precision("medium")
        close(compiled(x), want)
        torch.set_float32_matmul_precision("high")
        close(compiled(x), want)
        with tt.precision("default"):
            assert tt.current_precision() is tt.Precision.DEFAULT
            close(compiled(x), want)
            with tt.precision(tt.Precision.HIGHEST):
                close(compiled(x), want)
    got = [(i.precision, i.stablehlo) for i in infos]
    # Dynamo recompiles when the matmul precision changes between "highest" and the others
    # (its TF32 guard); a program of the same text and precision is then the daemon's tier 1.
    assert {p.value for p, _ in got} == {"HIGHEST", "DEFAULT", "HIGH"}
    assert [p.value for p, _ in got][:3] == ["HIGHEST", "DEFAULT", "HIGH"]
    tiers = {}
    for i in infos:
        tiers.setdefault(i.precision, []).append(i.executable.tier)
    for t in tiers.values():
        assert t[0] == "compiled" and all(x == "memory" for x in t[1:]), tiers
    for p, text in got:
        ops = [
            line
            for line in text.splitlines()
            if "stablehlo.dot_general" in line or "stablehlo.convolution" in line
        ]
        assert len(ops) >= 2, text
        for line in ops:
            # The printer's short form, or the attribute's generic one.
            short = f"precision = [{p.value}, {p.value}]"
            assert short in line or f"#stablehlo<precision {p.value}>" in line, line
    with pytest.raises(ValueError):
        with tt.precision("fast"):
            pass


def test_graph_break_falls_back_to_pytorch_between_graphs(alice):
    """A data-dependent branch breaks the graph: the pieces before and after compile and run
    on the daemon, the branch runs in Python, and the result is eager's."""
    torch.manual_seed(6)
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 3)

    def f(x):
        h = torch.relu(lin1(x))
        if h.sum() > 0:  # graph break: a tensor's value decides
            h = h * 2
        return lin2(h)

    compiled = torch.compile(f, backend="tpubox", options={"session": alice})
    x = torch.randn(5, 8)
    with torch.no_grad():
        close(compiled(x), f(x))
    assert tt.stats()["graphs"] >= 2
    assert tt.stats()["executions"] >= 2


def _cause(e: BaseException) -> BaseException:
    """The exception Dynamo wrapped (BackendCompilerFailed holds the backend's)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return getattr(e, "inner_exception", e)


def test_options(alice):
    torch.manual_seed(7)
    model = MLP().eval()
    x = torch.randn(2, 16)
    infos = []
    compiled = torch.compile(
        model,
        backend="tpubox",
        options={
            "session": alice,
            "xla_optimization_level": "O1",
            "name": "mlp",
            "debug_callback": infos.append,
            "async_compile": False,
        },
    )
    with torch.no_grad():
        close(compiled(x), model(x))
    (info,) = infos
    assert info.name.startswith("mlp/") and info.name.endswith("/inference"), info.name
    for bad, kind in (
        ({"session": alice, "no_such_option": 1}, ValueError),
        ({"session": alice, "xla_optimization_level": "O9"}, ValueError),
        ({"session": alice, "num_dynamic_buckets": 9}, ValueError),
        ({"session": alice, "bucket_size": 0}, ValueError),
        ({"session": alice, "async_compile": True}, tpubox.Unsupported),
    ):
        torch._dynamo.reset()
        c = torch.compile(nn.Linear(2, 2), backend="tpubox", options=bad)
        with pytest.raises(Exception) as e:
            c(torch.randn(1, 2))
        assert isinstance(_cause(e.value), kind), repr(e.value)


def test_new_shapes_compile_static_programs(alice):
    """Static shapes: a second batch size compiles a second program (Dynamo may hand over a
    graph with symbolic sizes after the second shape; it is specialised per concrete
    signature)."""
    torch.manual_seed(8)
    model = MLP().eval()
    compiled = torch.compile(model, backend="tpubox", options={"session": alice})
    with torch.no_grad():
        for n in (2, 3, 5, 3):
            x = torch.randn(n, 16)
            close(compiled(x), model(x))
    st = tt.stats()
    assert st["compiles"] == 3 and st["executions"] == 4, st


def test_mark_dynamic_compiles_one_program_per_bucket(alice):
    """`mark_dynamic` on the batch dimension: the sizes of one bucket share a program; inputs are
    padded to the bucket and outputs cut back, with eager's numbers (TorchTPU's bounded
    dynamism; without bounds the buckets are multiples of `bucket_size`)."""
    torch.manual_seed(9)
    model = MLP().eval()
    compiled = torch.compile(model, backend="tpubox", options={"session": alice, "bucket_size": 8})
    with torch.no_grad():
        for n in (3, 5, 8, 9, 16, 2):
            x = torch.randn(n, 16)
            torch._dynamo.mark_dynamic(x, 0)
            got = compiled(x)
            assert got.shape == (n, 4)
            close(got, model(x))
    st = tt.stats()
    # Two buckets (8 and 16); the first call may compile the static graph Dynamo traced.
    assert st["specializations"] == 2, st
    assert st["executions"] == 6, st


def test_mark_dynamic_with_bounds_and_a_mask_matches_eager(alice):
    """A tiny BERT with the sequence dimension of its ids and attention mask marked dynamic in
    [2, 32], 2 buckets: (2, 17] and (17, 32]. The padded mask keeps the padding out of
    attention, so the real positions get eager's numbers."""
    model, _ = _hf("bert")
    model.eval()
    compiled = torch.compile(
        model, backend="tpubox", options={"session": alice, "num_dynamic_buckets": 2}
    )
    with torch.no_grad():
        for n in (5, 12, 20, 31):
            ids = torch.randint(0, 200, (2, n))
            mask = torch.ones(2, n, dtype=torch.long)
            mask[1, n - 2 :] = 0
            for t in (ids, mask):
                torch._dynamo.mark_dynamic(t, 1, min=2, max=32)
            got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            assert got.shape == (2, n, 64)
            close(got, model(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert tt.stats()["specializations"] == 2, tt.stats()


# ---------------------------------------------------------------------------------------------
# Tiny Hugging Face models, randomly initialised from configs built here (nothing downloaded).


def _hf(name):
    import transformers as tf

    torch.manual_seed(0)
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    text = lambda: {  # noqa: E731
        "input_ids": torch.randint(0, 200, (2, 12)),
        "attention_mask": torch.ones(2, 12, dtype=torch.long),
    }
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=200, max_position_embeddings=64, **small)
        return tf.BertModel(cfg), text()
    if name == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=200, max_position_embeddings=64, num_key_value_heads=2, **small
        )
        return tf.LlamaModel(cfg), text()
    if name == "vit":
        cfg = tf.ViTConfig(image_size=32, patch_size=8, num_channels=3, **small)
        return tf.ViTModel(cfg), {"pixel_values": torch.randn(2, 3, 32, 32)}
    raise KeyError(name)


def _hf_output(out):
    return out.last_hidden_state


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["bert", "llama", "vit"])
def test_tiny_hugging_face_models_match_eager(alice, name):
    model, inputs = _hf(name)
    model.eval()
    compiled = torch.compile(model, backend="tpubox", options={"session": alice})
    before = executions(alice)
    with torch.no_grad():
        want = _hf_output(model(**inputs))
        got = _hf_output(compiled(**inputs))
    close(got, want)
    assert executions(alice) > before


# Issue 50's two failing configs.


@pytest.mark.timeout(600)
def test_vit_compiled_with_dynamic_shapes_matches_eager(alice):
    """With dynamic=True Dynamo leaves dropout's p (a Python float) unspecialized: a tensor
    input the graph reads with .item(), which the static programs of a graph with symbolic
    sizes are specialized on (before: DataDependentOutputException in aot_autograd's fake
    mode of concrete inputs)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=32, patch_size=8,
    )
    model = tf.ViTModel(cfg).eval()
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(model, backend="tpubox", dynamic=True, options={"session": alice})
    before = executions(alice)
    with torch.no_grad():
        want = model(pixel_values=x).last_hidden_state
        got = compiled(pixel_values=x).last_hidden_state
    close(got, want)
    assert executions(alice) > before
    assert tt.stats()["specializations"] == 1


@pytest.mark.timeout(600)
def test_swin_constant_tensors_are_dense_and_match_eager(alice):
    """Swin's graph holds constant index tensors, which torch-mlir writes as dense_resource
    blobs; the program text has them as dense<...> (before: the CPU plugin's "UNIMPLEMENTED:
    Only dense elements attr are supported")."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
    )
    model = tf.SwinModel(cfg).eval()
    x = torch.randn(2, 3, 32, 32)
    texts = []
    compiled = torch.compile(
        model,
        backend="tpubox",
        options={"session": alice, "debug_callback": lambda info: texts.append(info.stablehlo)},
    )
    before = executions(alice)
    with torch.no_grad():
        want = model(pixel_values=x).last_hidden_state
        got = compiled(pixel_values=x).last_hidden_state
    close(got, want)
    assert executions(alice) > before
    assert texts and not any("dense_resource" in t or "{-#" in t for t in texts)


class WithUnlowerableOps(nn.Module):
    """Linear layers around ops torch-mlir does not lower (median over a dimension: no
    lowering; erfinv: no StableHLO pattern), so the graph is partitioned."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.fc3 = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        m = h.median(dim=1, keepdim=True).values  # aten.median.dim: runs on the CPU
        h = self.fc2(h - m)
        h = torch.erfinv(torch.tanh(h) * 0.5)  # aten.erfinv: on the CPU too
        return self.fc3(F.gelu(h))


def test_nodes_that_do_not_lower_run_on_the_cpu_and_the_rest_on_the_device(alice):
    """A graph with nodes torch-mlir cannot lower is partitioned, as Dynamo backends do with
    ops they do not support: the other nodes run as programs in the session, those nodes in
    PyTorch on the CPU, named in a CpuFallbackWarning and in cpu_fallback_ops()."""
    torch.manual_seed(0)
    model = WithUnlowerableOps().eval()
    x = torch.randn(6, 16)
    with torch.no_grad():
        want = model(x)
    tt.reset_stats()
    compiled = torch.compile(model, backend="tpubox", options={"session": alice})
    before = executions(alice)
    with pytest.warns(tt.CpuFallbackWarning) as caught, torch.no_grad():
        tt.dynamo._LOWERS.clear()
        tt._lowering._WARNED.difference_update({"aten.median.dim", "aten.erfinv"})
        got = compiled(x)
    close(got, want)
    said = " ".join(str(w.message) for w in caught)
    assert "aten.median.dim" in said and "erfinv" in said, said
    assert {"aten.median.dim", "aten.erfinv"} <= set(tt.cpu_fallback_ops())
    s = tt.stats()
    assert s["partitioned_graphs"] == 1 and s["cpu_fallback_nodes"] >= 2, s
    # fc1 (and tanh), fc2 (and the subtraction, tanh, the scale) and gelu with fc3: three
    # programs, each run once.
    assert executions(alice) - before == 3
    assert s["compiles"] == 3

    # Again: the same programs, nothing lowered or compiled.
    x2 = torch.randn(6, 16)
    with torch.no_grad():
        close(compiled(x2), model(x2))
    assert tt.stats()["compiles"] == 3


def test_a_partitioned_graph_trains(alice):
    """The forward and backward graphs of a model with an op that does not lower (erfinv;
    its derivative lowers) are partitioned; an SGD step gives PyTorch's parameters."""
    torch.manual_seed(0)
    model = WithUnlowerableOps()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 16)
    compiled = torch.compile(model, backend="tpubox", options={"session": alice})
    for m, run in ((ref, ref), (model, compiled)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        run(x).pow(2).mean().backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p, q, rtol=1e-4, atol=1e-5)
    assert "aten.erfinv" in tt.cpu_fallback_ops()


def test_negative_indices_count_from_the_end(alice):
    """Advanced indexing with negative indices (a constant list, a tensor input, a write) gives
    PyTorch's rows, compiled and on eager device tensors: torch-mlir's gather took them as they
    were and XLA clamped them to row 0 (Falcon's multi-query heads, ``qkv[..., [-2], :]``, came
    out wrong by the output's scale)."""

    def read_const(x):
        return x[..., [-2], :] * 2

    def read_tensor(x, i):
        return x[i] + 1

    def write(x, i):
        y = x.clone()
        y[i] = -1.0
        return y

    x = torch.randn(3, 5, 4)
    i = torch.tensor([-1, 0, -3])
    for f, args in ((read_const, (x,)), (read_tensor, (x, i)), (write, (x, i))):
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="tpubox", options={"session": alice})
        close(compiled(*args), f(*args))
        dev = tt.device(session=alice)
        close(f(*(a.to(dev) for a in args)).cpu(), f(*args))


def test_a_write_into_an_open_ended_slice_from_a_broadcast(alice):
    """DeepSeek-V3's key: ``k[..., n:].copy_(rot.expand(...))`` into a new tensor. Its
    functional form is a ``slice_scatter`` ending at 2**63 - 1, which torch-mlir's lowering ran
    out of memory on (the op fell back to the CPU, whose copy into the expanded layout
    failed); compiled and on eager device tensors in both modes."""

    def f(kv, rot):
        k = kv.new_empty(2, 4, 8, 12)
        k[..., :8].copy_(kv)
        k[..., 8:].copy_(rot.expand(2, 4, 8, 4))
        return k * 1

    kv, rot = torch.randn(2, 4, 8, 8), torch.randn(2, 1, 8, 4)
    want = f(kv, rot)
    compiled = torch.compile(f, backend="tpubox", options={"session": alice})
    close(compiled(kv, rot), want)
    dev = tt.device(session=alice)
    tt.reset_eager_stats()
    for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
        with tt.set_eager_mode(mode):
            close(f(kv.to(dev), rot.to(dev)).cpu(), want)
    assert tt.cpu_fallback_ops() == []


def test_dense_resource_constants_are_rewritten_as_dense():
    """tpubox.torch._dense_constants: each blob's bytes (after the 4-byte alignment) as
    dense<"0x...">, booleans as a literal, no elements as dense<>; the text parses to the same
    values."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith, func  # noqa: F401  (registers the dialects)

    from tpubox.torch import _dense_constants

    cases = [
        (np.arange(6, dtype=np.int64).reshape(2, 3), "i64", "[[0, 1, 2], [3, 4, 5]]"),
        (
            np.array([0.5, -2.0, 3.25], np.float32),
            "f32",
            "[5.000000e-01, -2.000000e+00, 3.250000e+00]",
        ),
        (np.array([[True, False, True]]), "i1", "[[true, false, true]]"),
        (np.zeros((0,), np.int64), "i64", ""),
    ]
    for a, el, want in cases:
        ty = f"tensor<{'x'.join(map(str, a.shape))}x{el}>"
        blob = (8).to_bytes(4, "little").hex() + a.tobytes().hex()
        text = (
            f"module {{\n  func.func @main() -> {ty} {{\n"
            f"    %c = arith.constant dense_resource<torch_tensor_x.int64_1> : {ty}\n"
            f"    return %c : {ty}\n  }}\n}}\n\n{{-#\n  dialect_resources: {{\n"
            f"    builtin: {{\n      torch_tensor_x.int64_1: \"0x{blob}\"\n    }}\n  }}\n#-}}\n"
        )
        out = _dense_constants(text)
        assert "dense_resource" not in out and "{-#" not in out, out
        with ir.Context() as ctx:
            ctx.allow_unregistered_dialects = True
            m = ir.Module.parse(out)
            const = m.body.operations[0].regions[0].blocks[0].operations[0]
            assert str(const.attributes["value"]) == f"dense<{want}> : {ty}"
    # A text without resources is left as it is.
    plain = "module {\n}\n"
    assert _dense_constants(plain) == plain


@pytest.mark.timeout(600)
def test_tiny_bert_training_step_matches_eager(alice):
    """A Hugging Face encoder's forward and backward (attention traced in its math form, whose
    backward torch-mlir lowers), dropout off: every parameter's gradient matches eager's."""
    import transformers as tf

    torch.manual_seed(10)
    cfg = tf.BertConfig(
        vocab_size=200, max_position_embeddings=64, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = tf.BertModel(cfg).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 200, (2, 12))
    compiled = torch.compile(model, backend="tpubox", options={"session": alice})
    before = executions(alice)
    loss = compiled(input_ids=ids).last_hidden_state.pow(2).mean()
    loss.backward()
    ref_loss = ref(input_ids=ids).last_hidden_state.pow(2).mean()
    ref_loss.backward()
    close(loss, ref_loss)
    n = 0
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            close(p.grad, q.grad)
            n += 1
    assert n > 20
    assert executions(alice) - before >= 2  # forward and backward on the daemon


# ---------------------------------------------------------------------------------------------
# Sessions: the entry point, two tenants at once, a daemon restart.

_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    address, token, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    # No `import tpubox.torch` where the package is installed: the backend comes from the
    # torch_dynamo_backends entry point.
    from importlib.metadata import entry_points
    entry_point = "tpubox" in entry_points(group="torch_dynamo_backends").names
    if not entry_point:
        import tpubox.torch
    compiled = torch.compile(model, backend="tpubox", options={"address": address, "token": token})
    x = torch.randn(16, 32)
    errs = []
    with torch.no_grad():
        for i in range(20):
            xi = x + i
            errs.append(float((compiled(xi) - model(xi)).abs().max()))
    import tpubox, tpubox.torch as tt
    u = tpubox.tenant_usage(address, token)
    print(json.dumps({"max_err": max(errs), "executions": u.usage.executions,
                      "peak_device_bytes": u.usage.peak_device_bytes,
                      "entry_point": entry_point,
                      "tenant": u.tenant, "stats": tt.stats(),
                      "sum": float(compiled(x).sum()), "want": float(model(x).sum())}))
    """
)


def _child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parents[1])] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return env


def test_entry_point_is_declared():
    """python/pyproject.toml declares the torch_dynamo_backends entry point Dynamo looks up."""
    text = (HERE.parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points.torch_dynamo_backends]\ntpubox = "tpubox.torch:backend"' in text
    eps = {e.name: e.value for e in entry_points(group="torch_dynamo_backends")}
    if "tpubox" not in eps:
        pytest.skip("tpubox is not installed in this venv (only on PYTHONPATH)")
    assert eps["tpubox"] == "tpubox.torch:backend"
    assert "tpubox" in torch._dynamo.list_backends()


@pytest.mark.timeout(600)
def test_two_tenants_compile_at_once(daemon):
    """Two processes of two tenants compile and run their own models at the same time: each
    gets its own numbers, each tenant's session did the executions, and each stayed within its
    limits (carol may hold 1 MiB of device memory)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, daemon.unix, token, str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        for token, seed in ((ALICE, 1), (SMALL, 2))
    ]
    installed = "tpubox" in entry_points(group="torch_dynamo_backends").names
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=500)
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    limits = {"alice": TENANTS["alice"]["session"]["max_device_mib"] << 20,
              "carol": TENANTS["carol"]["session"]["max_device_mib"] << 20}  # fmt: skip
    for o, tenant in zip(outs, ("alice", "carol")):
        assert o["tenant"] == tenant
        assert 0 < o["peak_device_bytes"] <= limits[tenant], o
        assert o["entry_point"] == installed
        assert o["max_err"] < 1e-4, o
        assert o["executions"] >= 20 and o["stats"]["executions"] == 20, o
        assert abs(o["sum"] - o["want"]) < 1e-3, o
    # Different seeds, different models: the two did not get each other's results.
    assert abs(outs[0]["want"] - outs[1]["want"]) > 1e-3


@pytest.mark.timeout(300)
def test_daemon_restart_puts_and_compiles_again(tmp_path):
    """The daemon goes away under a compiled model and comes back on the same socket: the next
    call opens a new session, puts the weights and compiles again, and gives eager's numbers."""
    root = tmp_path / "restart"
    d = Daemon(root, TENANTS).start()
    try:
        torch.manual_seed(9)
        model = MLP().eval()
        compiled = torch.compile(
            model, backend="tpubox", options={"address": d.unix, "token": ALICE}
        )
        x = torch.randn(4, 16)
        with torch.no_grad():
            close(compiled(x), model(x))
            d.kill()
            d = Daemon(root, TENANTS).start()
            close(compiled(x), model(x))
            close(compiled(x + 1), model(x + 1))
        st = tt.stats()
        assert st["session_restarts"] >= 1 and st["compiles"] == 2, st
        assert st["weight_puts"] == 2 * len(list(model.parameters())), st
    finally:
        d.kill()


# ---------------------------------------------------------------------------------------------
# tpubox.torch.export: a StableHLO model directory for tpubox serve's repository.


def test_export_writes_a_model_tpubox_serve_checks_and_runs(alice, tmp_path):
    """export() writes one StableHLO program per batch size, the weights and config.toml;
    `tpubox model check` accepts the directory, and each program, run in a session with the
    weights of weights.safetensors in the order config.toml names them, gives eager's numbers."""
    import tomllib

    from tpubox_daemon import binary

    torch.manual_seed(11)
    model = MLP(d_in=6, d_hidden=16, d_out=3).eval()
    d = tt.export(model, [torch.randn(2, 6)], tmp_path / "repo", "mlp", batch_sizes=[1, 4])
    cfg = tomllib.loads((d / "config.toml").read_text())
    assert cfg["max_batch_size"] == 4 and cfg["backend"] == "stablehlo"
    assert cfg["input"] == [{"name": "input_0", "data_type": "TYPE_FP32", "dims": [6]}]
    assert cfg["output"] == [{"name": "output_0", "data_type": "TYPE_FP32", "dims": [3]}]
    check = subprocess.run(
        [str(binary()), "model", "check", str(d)], capture_output=True, text=True, timeout=300
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "model.b4.mlir: batch size 4" in check.stdout
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = cfg["tpubox"]["stablehlo"]["parameters"]
    assert [p.get("weight") for p in params[:-1]] == list(state)  # every weight, in order
    for prog in cfg["tpubox"]["stablehlo"]["program"]:
        b = prog["batch_size"]
        text = (d / prog["file"]).read_text()
        assert 'dense<"' not in text and "dense<[" not in text  # weights are not constants
        exe = alice.compile(text)
        x = torch.randn(b, 6)
        (got,) = exe.call(*[state[p["weight"]] for p in params[:-1]], x.numpy())
        with torch.no_grad():
            np.testing.assert_allclose(got, model(x).numpy(), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError):
        tt.export(model, [torch.randn(2, 6)], tmp_path / "repo", "mlp")  # not empty


def test_export_command_writes_a_model_that_checks(tmp_path):
    """`tpubox-torch-export` (python -m tpubox.torch_export): a model factory in a file, its
    inputs as shapes; the directory passes `tpubox model check` and its config names the
    inputs and batch sizes asked for."""
    import tomllib

    from tpubox_daemon import binary

    (tmp_path / "mymodel.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def build():
                torch.manual_seed(3)
                return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, "-m", "tpubox.torch_export", str(tmp_path / "mymodel.py") + ":build",
         "--input", "1x6", "--repo", str(tmp_path / "repo"), "--name", "cli_mlp",
         "--batch-sizes", "1,4", "--input-name", "x", "--output-name", "y"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    d = Path(r.stdout.strip().splitlines()[-1])
    assert d == tmp_path / "repo" / "cli_mlp"
    cfg = tomllib.loads((d / "config.toml").read_text())
    assert cfg["max_batch_size"] == 4
    assert cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [6]}]
    assert cfg["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}]
    check = subprocess.run([str(binary()), "model", "check", str(d)], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    bad = subprocess.run([sys.executable, "-m", "tpubox.torch_export", "nomodule", "--input", "1x6",
                          "--repo", str(tmp_path / "r2"), "--name", "m"],
                         capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert bad.returncode != 0 and "module:factory" in bad.stderr, bad.stderr
