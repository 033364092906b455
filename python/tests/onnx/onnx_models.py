"""ONNX models of the converter's tests (test_onnx_convert.py), built offline: graphs written with
``onnx.helper``, a module exported by ``torch.onnx.export``, and a tiny BERT and a tiny ResNet
from Hugging Face ``transformers`` configs (random weights, nothing downloaded).

Each builder writes ``model.onnx`` under a directory and returns (path, feeds): feeds is a
function of the batch size giving the inputs, name -> array, for ONNX Runtime and the
converted programs alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

Feeds = Callable[[int], dict[str, np.ndarray]]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def helper_graph(d: Path) -> tuple[Path, Feeds]:
    """Gemm, Conv, Relu, Softmax, Reshape, Concat, Gather, LayerNormalization, a broadcasting
    MatMul (rank 3 by rank 2, and a batched rank-3 pair) and a dynamic batch dimension (``N``),
    two inputs (an image and token ids) and two outputs, opset 17."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    r = _rng(1)

    def w(name: str, *shape: int, scale: float = 0.3) -> Any:
        return numpy_helper.from_array((r.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [
        w("conv.w", 4, 3, 3, 3),
        w("conv.b", 4),
        numpy_helper.from_array(np.array([0, -1], np.int64), "flat_shape"),
        w("fc.w", 16, 64),  # Gemm with transB
        w("fc.b", 16),
        w("emb", 10, 16),
        w("ln.scale", 16, scale=1.0),
        w("ln.bias", 16),
        w("proj", 16, 16),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    nodes = [
        # image branch: [N,3,8,8] -> conv(stride 2) [N,4,4,4] -> relu -> [N,64] -> gemm [N,16]
        helper.make_node(
            "Conv", ["img", "conv.w", "conv.b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]
        ),
        helper.make_node("Relu", ["c"], ["cr"]),
        helper.make_node("Reshape", ["cr", "flat_shape"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["g"], transB=1, alpha=0.5),
        helper.make_node("Relu", ["g"], ["gr"], name="relu_gemm"),
        # token branch: ids [N,5] -> gather [N,5,16] -> layernorm -> matmul [N,5,16]
        helper.make_node("Gather", ["emb", "ids"], ["e"], axis=0),
        helper.make_node(
            "LayerNormalization", ["e", "ln.scale", "ln.bias"], ["ln"], axis=-1, epsilon=1e-5
        ),
        helper.make_node("MatMul", ["ln", "proj"], ["lp"]),
        # join: [N,1,16] ++ [N,5,16] -> [N,6,16]; scores [N,6,6] = x @ x^T; softmax
        helper.make_node("Unsqueeze", ["gr", "axis1"], ["gu"]),
        helper.make_node("Concat", ["gu", "lp"], ["cat"], axis=1),
        helper.make_node("Transpose", ["cat"], ["catT"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["cat", "catT"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "helper_graph",
        [
            helper.make_tensor_value_info("img", TensorProto.FLOAT, ["N", 3, 8, 8]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 5]),
        ],
        [
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 6, 6]),
            helper.make_tensor_value_info("gr", TensorProto.FLOAT, ["N", 16]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    onnx.save(model, path)

    def feeds(bs: int) -> dict[str, np.ndarray]:
        g = _rng(100 + bs)
        return {
            "img": g.standard_normal((bs, 3, 8, 8)).astype(np.float32),
            "ids": g.integers(0, 10, (bs, 5)).astype(np.int64),
        }

    return path, feeds


def static_graph(d: Path) -> tuple[Path, Feeds]:
    """No batch dimension: x f32[3,4] @ W[4,5] + b, then Softmax: one program."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    r = _rng(2)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Add", ["h", "b"], ["a"]),
            helper.make_node("Softmax", ["a"], ["y"], axis=1),
        ],
        "static_graph",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        [
            numpy_helper.from_array(r.standard_normal((4, 5)).astype(np.float32), "W"),
            numpy_helper.from_array(r.standard_normal((5,)).astype(np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    onnx.save(model, path)
    return path, lambda bs: {"x": _rng(7).standard_normal((3, 4)).astype(np.float32)}


def unknown_op_graph(d: Path) -> Path:
    """A batched graph with an op of a custom domain (``com.example.FancyNorm``, node
    ``fancy``) between supported ones, and a ``Det``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("FancyNorm", ["h"], ["n"], domain="com.example", name="fancy"),
            helper.make_node("Relu", ["n"], ["r"]),
            helper.make_node("Det", ["sq"], ["det"], name="determinant"),
        ],
        "unknown_op_graph",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("sq", TensorProto.FLOAT, ["N", 3, 3]),
        ],
        [
            helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("det", TensorProto.FLOAT, ["N"]),
        ],
        [numpy_helper.from_array(np.ones((4, 4), np.float32), "W")],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
    )
    model.ir_version = 8
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    onnx.save(model, path)
    return path


def det_graph(d: Path) -> Path:
    """A standard ONNX op torch-mlir converts to torch but not to StableHLO (``Det``, node
    ``determinant``) beside a Relu."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Det", ["sq"], ["det"], name="determinant"),
        ],
        "det_graph",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("sq", TensorProto.FLOAT, ["N", 3, 3]),
        ],
        [
            helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("det", TensorProto.FLOAT, ["N"]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    onnx.save(model, path)
    return path


def two_dynamic_dims(d: Path) -> tuple[Path, Feeds]:
    """x f32[N, S, 4] (batch ``N`` and sequence ``S`` both symbolic) @ W[4, 6] -> Softmax over
    the last axis, then ReduceMean over S: y f32[N, 6]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Softmax", ["h"], ["p"], axis=-1),
            helper.make_node("ReduceMean", ["p", "axes"], ["y"], keepdims=0),
        ],
        "two_dynamic_dims",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6])],
        [
            numpy_helper.from_array(_rng(3).standard_normal((4, 6)).astype(np.float32), "W"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    onnx.save(model, path)
    return path, lambda bs: {"x": _rng(500 + bs).standard_normal((bs, 5, 4)).astype(np.float32)}


def old_opset_graph(d: Path) -> tuple[Path, Feeds]:
    """Opset 11 forms torch-mlir has no pattern for: Softmax over axis 1 of a rank-3 tensor
    (before opset 13 it flattens the axes from 1 on into one), Unsqueeze with an ``axes``
    attribute; then ReduceMean and Split with attributes and a Clip. x f32[N, 5, 4] ->
    y1 f32[N, 5, 2], y2 f32[N, 5, 4]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Softmax", ["h"], ["s"], axis=1),
            helper.make_node("Unsqueeze", ["s"], ["u"], axes=[1]),
            helper.make_node("ReduceMean", ["u"], ["m"], axes=[1], keepdims=0),
            helper.make_node("Split", ["m"], ["a", "y2"], axis=2, split=[2, 4]),
            helper.make_node("Clip", ["a", "lo", "hi"], ["y1"]),
        ],
        "old_opset_graph",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, 4])],
        [
            helper.make_tensor_value_info("y1", TensorProto.FLOAT, ["N", 5, 2]),
            helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["N", 5, 4]),
        ],
        [
            numpy_helper.from_array(_rng(4).standard_normal((4, 6)).astype(np.float32), "W"),
            numpy_helper.from_array(np.array(0.02, np.float32), "lo"),
            numpy_helper.from_array(np.array(0.05, np.float32), "hi"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    onnx.save(model, path)
    return path, lambda bs: {"x": _rng(600 + bs).standard_normal((bs, 5, 4)).astype(np.float32)}


def resize_graph(d: Path) -> tuple[Path, Feeds]:
    """Three Resizes of img f32[N, 3, 8, 8] (opset 19), which the converter rewrites into
    gathers: nearest x2 (asymmetric, floor: what PyTorch's ``interpolate(mode="nearest")``
    exports) -> near f32[N, 3, 16, 16]; linear to sizes 12 x 20 (``axes`` 2, 3; half_pixel) -> lin
    f32[N, 3, 12, 20]; cubic x1.5 / x0.5 (A = -0.5, exclude_outside) -> cub f32[N, 3, 12, 4]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node(
                "Resize",
                ["img", "", "s2"],
                ["near"],
                mode="nearest",
                coordinate_transformation_mode="asymmetric",
                nearest_mode="floor",
            ),
            helper.make_node(
                "Resize", ["img", "", "", "size"], ["lin"], mode="linear", axes=[2, 3]
            ),
            helper.make_node(
                "Resize",
                ["img", "", "s3"],
                ["cub"],
                mode="cubic",
                cubic_coeff_a=-0.5,
                exclude_outside=1,
            ),
        ],  # fmt: skip
        "resize_graph",
        [helper.make_tensor_value_info("img", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [
            helper.make_tensor_value_info("near", TensorProto.FLOAT, ["N", 3, 16, 16]),
            helper.make_tensor_value_info("lin", TensorProto.FLOAT, ["N", 3, 12, 20]),
            helper.make_tensor_value_info("cub", TensorProto.FLOAT, ["N", 3, 12, 4]),
        ],
        [
            numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "s2"),
            numpy_helper.from_array(np.array([1, 1, 1.5, 0.5], np.float32), "s3"),
            numpy_helper.from_array(np.array([12, 20], np.int64), "size"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    onnx.save(model, path)
    return path, lambda bs: {
        "img": _rng(700 + bs).standard_normal((bs, 3, 8, 8)).astype(np.float32)
    }


class _TorchNet:
    """Built lazily: torch is imported only by the tests that export from PyTorch."""

    @staticmethod
    def make() -> Any:
        import torch

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
                self.bn = torch.nn.BatchNorm2d(8)
                self.fc = torch.nn.Linear(8 * 4 * 4, 10)
                self.emb = torch.nn.Embedding(20, 10)

            def forward(self, img: Any, ids: Any) -> Any:
                h = torch.nn.functional.gelu(self.bn(self.conv(img)))
                h = torch.nn.functional.interpolate(h, scale_factor=2, mode="bilinear")
                h = torch.nn.functional.max_pool2d(h, 4)
                h = self.fc(h.flatten(1))
                t = self.emb(ids).mean(dim=1)
                return torch.softmax(h + t, dim=-1), torch.tanh(h) * 2

        torch.manual_seed(0)
        net = Net().eval()
        with torch.no_grad():  # BatchNorm statistics that are not the identity
            net.bn.running_mean.uniform_(-0.5, 0.5)
            net.bn.running_var.uniform_(0.5, 1.5)
        return net


def torch_exported(d: Path) -> tuple[Path, Feeds]:
    """A small conv + BatchNorm + GELU + bilinear upsampling + max-pool + Linear + Embedding
    module exported by ``torch.onnx.export`` (the dynamo exporter, onnxscript) with a dynamic
    batch dimension."""
    import torch

    net = _TorchNet.make()
    img = torch.randn(2, 3, 8, 8)
    ids = torch.randint(0, 20, (2, 6))
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.onnx.export(
        net,
        (img, ids),
        str(path),
        input_names=["img", "ids"],
        output_names=["probs", "act"],
        dynamic_shapes={"img": {0: batch}, "ids": {0: batch}},
        dynamo=True,
        external_data=False,
        verbose=False,
    )

    def feeds(bs: int) -> dict[str, np.ndarray]:
        g = _rng(200 + bs)
        return {
            "img": g.standard_normal((bs, 3, 8, 8)).astype(np.float32),
            "ids": g.integers(0, 20, (bs, 6)).astype(np.int64),
        }

    return path, feeds


def tiny_bert(d: Path) -> tuple[Path, Feeds]:
    """A 2-layer BERT (hidden 32, 4 heads, vocab 100) from ``transformers.BertConfig``, random
    weights, exported with inputs ``input_ids``, ``attention_mask``, ``token_type_ids``
    (int64 [batch, seq], batch dynamic) and outputs ``last_hidden_state``, ``pooler_output``."""
    import torch
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = BertModel(cfg).eval()

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            o = self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                return_dict=True,
            )
            return o.last_hidden_state, o.pooler_output

    seq = BERT_SEQ
    ids = torch.randint(0, 100, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.int64)
    tt = torch.zeros(2, seq, dtype=torch.int64)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.onnx.export(
        Wrap().eval(),
        (ids, mask, tt),
        str(path),
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["last_hidden_state", "pooler_output"],
        dynamic_shapes={
            "input_ids": {0: batch},
            "attention_mask": {0: batch},
            "token_type_ids": {0: batch},
        },
        dynamo=True,
        external_data=False,
        verbose=False,
    )

    return path, tiny_bert_feeds


BERT_SEQ = 8


def tiny_bert_feeds(bs: int, seq: int = BERT_SEQ) -> dict[str, np.ndarray]:
    """Inputs of :func:`tiny_bert` for batch size BS: random ids, a mask with some padding in
    the last two positions, two token types."""
    g = _rng(300 + bs)
    mask = np.ones((bs, seq), np.int64)
    mask[:, seq - 2 :] = g.integers(0, 2, (bs, 2))
    return {
        "input_ids": g.integers(0, 100, (bs, seq)).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": (np.arange(seq)[None, :] >= seq // 2).astype(np.int64).repeat(bs, 0),
    }


def tiny_resnet(d: Path) -> tuple[Path, Feeds]:
    """A ResNet (2 stages, widths 8/16, depths 1/1, basic blocks) from
    ``transformers.ResNetConfig``, random weights, ``pixel_values`` f32[batch, 3, 32, 32]
    (batch dynamic) -> ``pooler_output`` f32[batch, 16, 1, 1]."""
    import torch
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        hidden_act="relu",
    )
    torch.manual_seed(0)
    model = ResNetModel(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, pixel_values: Any) -> Any:
            return self.m(pixel_values=pixel_values, return_dict=True).pooler_output

    x = torch.randn(2, 3, 32, 32)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.onnx.export(
        Wrap().eval(),
        (x,),
        str(path),
        input_names=["pixel_values"],
        output_names=["pooler_output"],
        dynamic_shapes={"pixel_values": {0: batch}},
        dynamo=True,
        external_data=False,
        verbose=False,
    )
    return path, lambda bs: {
        "pixel_values": _rng(400 + bs).standard_normal((bs, 3, 32, 32)).astype(np.float32)
    }
