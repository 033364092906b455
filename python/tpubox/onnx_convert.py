"""``python -m tpubox.onnx_convert``: an ONNX model (``model.onnx``, as Triton's
``onnxruntime_onnx`` platform serves it) converted into what a StableHLO model of
``tpubox serve`` is made of (docs/SERVING.md, "StableHLO models"): one StableHLO program per
batch size, the weights in a safetensors file, and the ``[stablehlo]`` table that ties them
together (issue 49).

    python -m tpubox.onnx_convert MODEL.onnx --out DIR [--batch-sizes 1,2,4,8]
                                  [--config-pbtxt config.pbtxt] [--dim NAME=SIZE ...]
                                  [--precision highest|high|default] [--format bytecode|text]
    python -m tpubox.onnx_convert MODEL.onnx --check [--batch-sizes ...] [--json]

It runs in its own pinned venv (``scripts/venvs/onnx.txt``: torch-mlir, onnx, NumPy; no
PyTorch), as a helper process: never inside the daemon.

**The path: torch-mlir's ONNX importer, then torch-mlir's lowering to StableHLO.** The graph is
imported with ``torch_mlir.extras.onnx_importer`` (each ONNX node becomes a
``torch.operator "onnx.<Op>"``), lowered by torch-mlir's ``torch-onnx-to-torch-backend-pipeline``
(the ``convert-torch-onnx-to-torch`` patterns, one per ONNX op, then torch-mlir's shape and
dtype refinement and decompositions) and by ``torch-backend-to-stablehlo-backend-pipeline``.
Why this one, and not ONNX -> PyTorch -> the existing ``torch.export`` path:

- it is maintained where the ONNX op coverage is: torch-mlir's ONNX front end is the one
  IREE/AMD's ONNX flow (SHARK-Turbine, ``iree-import-onnx``) uses, with conversion patterns for
  most of the ONNX standard op set; the ONNX -> PyTorch converters (``onnx2torch``,
  ``onnx2pytorch``) are small third-party projects that re-implement each op as a torch module
  and trail new opsets;
- it needs no PyTorch: the importer and the passes are torch-mlir's own MLIR build (its wheel
  asks only for NumPy and packaging, ``onnx`` for this importer), so the venv is about 450 MB,
  not the 6 GB of PyPI's CUDA torch;
- it is one hop: ONNX -> torch dialect -> StableHLO inside one MLIR context, with no Python
  model re-execution or tracing in between, and the ONNX node names survive as MLIR locations,
  so an op that does not convert is named by its node.

Measured with the pinned venv (torch-mlir 20261001, onnx 1.23.2; single-op graphs at batch
size 2, each program run on the CPU and compared with ONNX Runtime 1.32.0, rtol 1e-4): the
elementwise, comparison and logical ops, Cast, Clip, MatMul (broadcasting), Gemm, Einsum, Conv
(groups, dilation, strides), ConvTranspose, MaxPool, AveragePool, Global*Pool,
BatchNormalization, InstanceNormalization, GroupNormalization, LayerNormalization, LRN,
(Log)Softmax, Gelu, Reshape, Flatten, Transpose, (Un)Squeeze, Concat, Split, Slice, Gather,
GatherElements, GatherND, ScatterND, Expand, Tile, Pad (constant), the Reduce ops, ArgMax/Min,
TopK, CumSum, Range, Shape chains, Depth/SpaceToDepth, Trilu, OneHot, Dropout and Resize
(through the rewrite below) convert; Softsign, ScatterElements, Pad (reflect), NonZero, LSTM,
GRU, Attention (opset 23) and If do not (torch-mlir leaves them unlowered), and are named.

What this module adds around it (checked from outside, issue 49: the importer gives StableHLO
that ``tpubox exec`` runs, but only for static shapes, and with the weights as inline
constants):

- **one program per batch size.** A dynamic batch dimension (a ``dim_param`` or unknown first
  dimension of every graph input) is set to each batch size in turn and ONNX shape inference
  run again, so torch-mlir sees static shapes (with a dynamic one the lowering leaves
  ``shape``/``tensor``/``arith`` ops that XLA cannot compile). Other symbolic dimensions need a
  size: ``--dim NAME=SIZE`` or the input's ``dims`` in ``--config-pbtxt``. A model whose inputs
  have no dynamic first dimension (or ``max_batch_size: 0`` in its ``config.pbtxt``) has no
  batch dimension and gets one program.
- **weights lifted into a file.** Before the import every initializer (and every ``Constant``
  node's tensor) of more than ``--inline-max-elements`` elements (default 8) becomes a graph
  input fed from ``weights.safetensors`` (named by its ONNX name), so the programs hold no
  weights: a real model would otherwise meet the daemon's 64 MiB program limit and every batch
  size would carry its own copy. Small tensors, and any tensor an op reads as a shape, axes,
  pads, sizes or other operand torch-mlir needs as a constant (``Reshape``'s shape,
  ``Slice``'s starts, ...: ``_CONSTANT_OPERANDS``), stay inline constants.
- **the entry point is ``@main``**, every dot and convolution gets ``precision_config``
  ``HIGHEST`` by default (ONNX Runtime computes in f32; ``--precision default`` lets a TPU use
  its faster bf16 passes), and each program is written as portable VHLO bytecode for the
  StableHLO version of 12 weeks' compatibility (``--format text`` writes StableHLO text; the
  daemon's XLA may be older than torch-mlir's StableHLO).
- **Resize is rewritten** (torch-mlir lowers it to ``aten.__interpolate``, which has no
  StableHLO pattern): along each resized axis, gathers of the input at constant indices,
  weighted and summed (nearest: one, linear: two, cubic: four), the indices and weights
  computed from the ONNX spec's coordinate transformations (all but ``tf_crop_and_resize``;
  not ``antialias`` when shrinking). These index and weight tables (one entry per output
  position) stay inline constants: they are the op's arithmetic, not weights.
- **older opsets are upgraded once when ops do not convert**: a model below opset 18 whose
  ops do not convert is upgraded with ``onnx.version_converter`` and tried again (torch-mlir's
  patterns know the current forms of Softmax, Unsqueeze, Upsample, ...); ``opset_upgrade`` in
  the plan says so. If the upgraded model does not convert either, the first failure is
  reported.
- **ops that do not convert are named.** ``convert-torch-onnx-to-torch`` stops at the first
  op it has no pattern for: that op type's nodes are stubbed out and the pass re-run, so every
  such op type is named. Ops of other domains than ONNX's (``com.example.Foo``; torch-mlir's
  importer drops the domain, so they would get a standard op's meaning) are named without
  trying them, and what depends on them is not tried. If a later pass fails, the ops it left
  are traced back to their ONNX nodes by their locations (these passes stop at the first
  failure: ``--check`` says which ops it could not check). The error lists the op types and
  nodes: ``ops that do not convert to StableHLO at batch size 1: Det (determinant),
  com.example.Foo (foo) [the passes' message]``.

Outputs in DIR:

``model.b{N}.mlirbc`` (``model.mlirbc`` without a batch dimension; ``.mlir`` with
``--format text``)
    one program per batch size: parameters in ``stablehlo.parameters`` order, results in
    ``stablehlo.results`` order; every input and result has the batch dimension first.
``weights.safetensors``
    the lifted weights, by ONNX initializer name (dtypes as in the model).
``plan.json``
    what the daemon needs, in the terms of docs/SERVING.md::

        {"format": 1,
         "source": {"file": "model.onnx", "sha256": "...", "bytes": 1234,
                    "ir_version": 8, "opsets": {"": 17}, "producer": "pytorch 2.15.0"},
         "converter": {"path": "torch-mlir-onnx-importer", "torch_mlir": "20261001",
                       "onnx": "1.23.2", "program_format": "vhlo-bytecode",
                       "stablehlo_target": "1.15.0", "precision": "HIGHEST",
                       "inline_max_elements": 8},
         "max_batch_size": 8,                         # 0: no batch dimension
         "input":  [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, 8, 8]}],
         "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [16]}],
         "stablehlo": {                               # [tpubox.stablehlo], key for key
             "weights": "weights.safetensors",
             "parameters": [{"input": "x"}, {"weight": "conv.weight"}, ...],
             "results": ["y"],
             "program": [{"batch_size": 1, "file": "model.b1.mlirbc"}, ...]},
         "weights": {"count": 9, "bytes": 4660, "inline_constants": 3},
         "ops": {"Conv": 1, "Relu": 2, ...},          # op type (domain.Op outside ONNX's) -> nodes
         "dims": {"sequence": 5},                     # symbolic dims given a size
         "notes": [],                                 # e.g. batch sizes of an unbatched model
         "opset_upgrade": null,                       # or {"from": 11, "to": 18, "why": "..."}
         "seconds": {"load": 0.01, "lift": 0.0, "programs": {"1": 0.41, ...}, "total": 1.9}}

    ``input``/``output`` are Triton's fields (dims without the batch dimension, every dim
    static), the order of ``output`` is the order of ``results``.
``config.toml``
    the same as a complete StableHLO model configuration (Triton's fields and
    ``[tpubox.stablehlo]``, no ``name``), so DIR itself is a model directory that ``tpubox
    model check DIR`` checks and ``tpubox serve`` serves.

``--check`` converts nothing to disk: it imports and lowers the model at each batch size and
prints the ops it uses (type and node count), which convert at which batch sizes, and which do
not (``--json``: the same as one JSON object). Exit status 0 when every batch size converts,
1 otherwise; every error ends the command with status 1 and one message on stderr
(``tpubox.onnx_convert: error: ...``); 2 is a usage error.

Facts from outside this repository: ONNX's operator and ``TensorProto`` data types
(onnx/onnx docs/Operators.md, onnx.proto); Triton's datatype names and ``max_batch_size``
semantics (triton-inference-server/server docs/user_guide/model_configuration.md); torch-mlir's
importer API and pass pipeline names (torch-mlir's ``python/torch_mlir/tools/import_onnx`` and
``lib/Dialect/TorchConversion/Transforms/Passes.cpp``, as installed in the pinned wheel); the
safetensors layout (huggingface/safetensors README: 8-byte little-endian header length, JSON
header, data).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

PLAN_FORMAT = 1
PROG = "tpubox.onnx_convert"
DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
DEFAULT_INLINE_MAX_ELEMENTS = 8

# Operand positions (op type -> input indices) torch-mlir's ONNX patterns need as constants to
# lower with static shapes: shapes, axes, pads, sizes, scales, counts. An initializer read at
# one of them is never lifted, whatever its size. (From the ONNX operator specs: these inputs
# are the ones that decide an output's shape or an attribute-like parameter.)
_REDUCE_OPS = (
    "ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum "
    "ReduceLogSumExp ReduceSumSquare"
).split()
_CONSTANT_OPERANDS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}),
    "Expand": frozenset({1}),
    "Tile": frozenset({1}),
    "ConstantOfShape": frozenset({0}),
    "Slice": frozenset({1, 2, 3, 4}),
    "Pad": frozenset({1, 2, 3}),
    "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}),
    "Unsqueeze": frozenset({1}),
    "Squeeze": frozenset({1}),
    "TopK": frozenset({1}),
    "Range": frozenset({0, 1, 2}),
    "OneHot": frozenset({1}),
    "Split": frozenset({1}),
    "CumSum": frozenset({1}),
    "Trilu": frozenset({1}),
    "Clip": frozenset({1, 2}),
    "Compress": frozenset({1}),
    "Dropout": frozenset({1, 2}),
    "NonMaxSuppression": frozenset({2, 3, 4}),
    "MaxUnpool": frozenset({2}),
    "Col2Im": frozenset({1, 2}),
    "CenterCropPad": frozenset({1}),
    "DFT": frozenset({1, 2}),
    "STFT": frozenset({1, 2, 3}),
    "ReverseSequence": frozenset({1}),
    **{op: frozenset({1}) for op in _REDUCE_OPS},
}

# ONNX TensorProto.DataType -> (NumPy dtype name, Triton data_type, safetensors dtype).
_DTYPES: dict[int, tuple[str, str, str]] = {
    1: ("float32", "TYPE_FP32", "F32"),
    2: ("uint8", "TYPE_UINT8", "U8"),
    3: ("int8", "TYPE_INT8", "I8"),
    4: ("uint16", "TYPE_UINT16", "U16"),
    5: ("int16", "TYPE_INT16", "I16"),
    6: ("int32", "TYPE_INT32", "I32"),
    7: ("int64", "TYPE_INT64", "I64"),
    9: ("bool", "TYPE_BOOL", "BOOL"),
    10: ("float16", "TYPE_FP16", "F16"),
    11: ("float64", "TYPE_FP64", "F64"),
    12: ("uint32", "TYPE_UINT32", "U32"),
    13: ("uint64", "TYPE_UINT64", "U64"),
    16: ("bfloat16", "TYPE_BF16", "BF16"),
}
_ONNX_TYPE_NAMES = {
    0: "UNDEFINED", 1: "FLOAT", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32",
    7: "INT64", 8: "STRING", 9: "BOOL", 10: "FLOAT16", 11: "DOUBLE", 12: "UINT32",
    13: "UINT64", 14: "COMPLEX64", 15: "COMPLEX128", 16: "BFLOAT16",
}  # fmt: skip
_PRECISIONS = {"default": "DEFAULT", "high": "HIGH", "highest": "HIGHEST"}
# Dialects a lowered program may hold: what tpubox compiles (StableHLO and CHLO, func).
_LOWERED_DIALECTS = ("stablehlo.", "chlo.", "func.")
_DOT_OPS = ("stablehlo.dot_general", "stablehlo.convolution", "stablehlo.dot")


class ConversionError(Exception):
    """The model cannot be converted (or checked): the message says why.

    Attributes:
        ops: ONNX op types that do not convert (``"Det"``, ``"com.example.Foo"``), sorted;
            empty when the failure is not an op's (a corrupt file, a bad configuration).
        nodes: the names of the nodes of those ops.
    """

    def __init__(self, message: str, ops: Iterable[str] = (), nodes: Iterable[str] = ()):
        super().__init__(message)
        self.ops = sorted(set(ops))
        self.nodes = list(nodes)


# ---------------------------------------------------------------------------------------------
# Triton's config.pbtxt (protobuf text format), read without Triton's schema.


def parse_pbtxt(text: str, what: str = "config.pbtxt") -> dict[str, list[Any]]:
    """Parses protobuf text format TEXT into field name -> list of values (a repeated field has
    several; a message is a dict of the same form; scalars are str, int, float or bool;
    enum values are their names as str).

    Enough of the format for Triton's ``config.pbtxt``: ``name: value``, ``name { ... }``,
    ``name: { ... }``, ``name < ... >``, lists ``[a, b]``, strings in single or double quotes
    (adjacent ones concatenated), ``#`` comments, optional ``,``/``;`` separators.

    Raises:
        ConversionError: TEXT does not parse (the message names WHAT, the line and column).
    """
    tokens = list(_pbtxt_tokens(text, what))
    pos = 0

    def fail(msg: str, at: int | None = None) -> ConversionError:
        if not tokens:
            return ConversionError(f"{what}: {msg}")
        _, line, col = tokens[at if at is not None else min(pos, len(tokens) - 1)]
        return ConversionError(f"{what}:{line}:{col}: {msg}")

    def peek() -> str | None:
        return tokens[pos][0] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise fail("unexpected end of file")
        pos += 1
        return tokens[pos - 1][0]

    def scalar(tok: str) -> Any:
        if tok[0] in "\"'":
            return tok[1:-1]
        if tok in ("true", "True"):
            return True
        if tok in ("false", "False"):
            return False
        try:
            return int(tok, 0)
        except ValueError:
            pass
        try:
            return float(tok)
        except ValueError:
            return tok  # an enum value

    def value() -> Any:
        tok = take()
        if tok in ("{", "<"):
            return message("}" if tok == "{" else ">")
        if tok == "-":
            return -scalar(take())
        if tok[0] in "\"'":
            s = scalar(tok)
            while peek() is not None and peek()[0] in "\"'":  # type: ignore[index]
                s += scalar(take())
            return s
        return scalar(tok)

    def message(end: str | None) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        while True:
            tok = peek()
            if tok is None:
                if end is not None:
                    raise fail(f"missing {end!r}")
                return out
            if tok == end:
                take()
                return out
            if tok in (",", ";"):
                take()
                continue
            name = take()
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name):
                raise fail(f"expected a field name, found {name!r}", pos - 1)
            if peek() == ":":
                take()
            vals = out.setdefault(name, [])
            if peek() == "[":
                take()
                while peek() != "]":
                    if peek() == ",":
                        take()
                        continue
                    vals.append(value())
                take()
            else:
                vals.append(value())

    return message(None)


def _pbtxt_tokens(text: str, what: str) -> Iterable[tuple[str, int, int]]:
    """(token, line, column) of protobuf text format TEXT."""
    pattern = re.compile(
        r"""(?P<ws>\s+)|(?P<comment>\#[^\n]*)|(?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')"""
        r"""|(?P<punct>[{}<>\[\]:,;-])|(?P<word>[A-Za-z0-9_.+]+)"""
    )
    pos, line, line_start = 0, 1, 0
    while pos < len(text):
        m = pattern.match(text, pos)
        if m is None:
            raise ConversionError(
                f"{what}:{line}:{pos - line_start + 1}: unexpected character {text[pos]!r}"
            )
        kind, tok = m.lastgroup, m.group()
        if kind in ("str", "punct", "word"):
            if kind == "str":
                tok = tok[0] + bytes(tok[1:-1], "utf-8").decode("unicode_escape") + tok[-1]
            yield tok, line, pos - line_start + 1
        nl = tok.count("\n") if kind in ("ws", "comment") else 0
        if nl:
            line += nl
            line_start = pos + m.group().rfind("\n") + 1
        pos = m.end()


@dataclass
class PbtxtTensor:
    """An ``input`` or ``output`` of a ``config.pbtxt``: name, Triton data_type (may be empty),
    dims as written (``-1`` for a variable one; None when the field is absent)."""

    name: str
    data_type: str
    dims: list[int] | None


@dataclass
class PbtxtConfig:
    """What the converter reads from a ``config.pbtxt``: ``max_batch_size`` (0 when absent, as
    protobuf reads it) and the inputs and outputs it declares (Triton's auto-complete fills them
    in when absent: then these lists are empty)."""

    max_batch_size: int
    inputs: list[PbtxtTensor]
    outputs: list[PbtxtTensor]


def read_config_pbtxt(path: str | os.PathLike[str]) -> PbtxtConfig:
    """The fields of Triton's ``config.pbtxt`` at PATH that decide the conversion.

    Raises:
        ConversionError: the file cannot be read or parsed, or a field has the wrong form.
    """
    what = str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"{what}: cannot read it: {e}") from None
    msg = parse_pbtxt(text, what)

    def one(m: dict[str, list[Any]], key: str, default: Any) -> Any:
        vals = m.get(key, [])
        return vals[-1] if vals else default

    def tensors(key: str) -> list[PbtxtTensor]:
        out = []
        for t in msg.get(key, []):
            if not isinstance(t, dict):
                raise ConversionError(f"{what}: `{key}` must be a message")
            name = one(t, "name", None)
            if not isinstance(name, str) or not name:
                raise ConversionError(f"{what}: an `{key}` has no name")
            dt = one(t, "data_type", "")
            dims = [int(d) for d in t["dims"]] if "dims" in t else None
            out.append(PbtxtTensor(name, str(dt), dims))
        return out

    mbs = one(msg, "max_batch_size", 0)
    if not isinstance(mbs, int) or mbs < 0:
        raise ConversionError(f"{what}: max_batch_size must be a count, not {mbs!r}")
    return PbtxtConfig(mbs, tensors("input"), tensors("output"))


# ---------------------------------------------------------------------------------------------
# The ONNX side: loading, describing, lifting the weights, specialising the shapes.


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ConversionError(
            "the onnx package is missing: run the converter in the venv of scripts/venvs/onnx.txt"
        ) from None
    return onnx


def load_model(path: str | os.PathLike[str]) -> Any:
    """The ``onnx.ModelProto`` of the ONNX file at PATH, external data (beside it) loaded,
    checked by ``onnx.checker``.

    Raises:
        ConversionError: the file is missing, empty, does not parse as an ONNX model
            (truncated or corrupt: "truncated or corrupt?"), or the ONNX checker refuses it
            ("an invalid or damaged model"); the message names PATH.
    """
    onnx = _onnx()
    from google.protobuf.message import DecodeError

    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as e:
        raise ConversionError(f"{p}: cannot read it: {e.strerror or e}") from None
    if size == 0:
        raise ConversionError(f"{p}: the file is empty, not an ONNX model")
    try:
        model = onnx.load(str(p))
    except DecodeError as e:
        raise ConversionError(
            f"{p}: not a readable ONNX model ({size} bytes: truncated or corrupt?): protobuf: {e}"
        ) from None
    except Exception as e:  # OSError, onnx's ValidationError for missing external data, ...
        raise ConversionError(
            f"{p}: cannot load the ONNX model or its external data: {_first_lines(str(e), 3)}"
        ) from None
    if not model.HasField("graph") or not model.graph.output:
        raise ConversionError(
            f"{p}: not a complete ONNX model ({size} bytes, no graph or no outputs: truncated "
            "or corrupt?)"
        )
    if model.functions:
        # Model-local functions (exporters' helpers): inlined, so that every node is an op.
        try:
            import onnx.inliner

            model = onnx.inliner.inline_local_functions(model)
        except Exception as e:
            raise ConversionError(f"{p}: inlining its local functions fails: {e}") from None
    try:
        if model.ByteSize() < 2**31 - 1:
            onnx.checker.check_model(model)
        else:
            onnx.checker.check_model(str(p))
    except Exception as e:  # onnx.checker.ValidationError, and C++ errors surfacing as others
        raise ConversionError(
            f"{p}: the ONNX checker refuses it (an invalid or damaged model): "
            f"{_first_lines(str(e), 6)}"
        ) from None
    return model


def _first_lines(text: str, n: int) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines[:n]) + (" / ..." if len(lines) > n else "")


def op_type_name(node: Any) -> str:
    """NODE's op type as reported: ``Conv`` for ONNX's default domain (``""``,
    ``ai.onnx``), ``domain.Op`` otherwise (``com.microsoft.FusedMatMul``)."""
    if node.domain in ("", "ai.onnx"):
        return node.op_type
    return f"{node.domain}.{node.op_type}"


def _all_nodes(graph: Any) -> Iterable[Any]:
    """Every node of GRAPH, those of subgraphs (If/Loop/Scan bodies) included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.g is not None and attr.HasField("g"):
                yield from _all_nodes(attr.g)
            for g in attr.graphs:
                yield from _all_nodes(g)


def op_counts(model: Any) -> dict[str, int]:
    """Op type (``op_type_name``) -> number of nodes, over MODEL's graph and subgraphs; sorted
    by op type."""
    counts: dict[str, int] = {}
    for node in _all_nodes(model.graph):
        k = op_type_name(node)
        counts[k] = counts.get(k, 0) + 1
    return dict(sorted(counts.items()))


@dataclass
class TensorDesc:
    """A graph input or output: name, ONNX element type, dims (int, or str for a symbolic
    one, None for an unknown one); ``dims`` is None for an unknown rank."""

    name: str
    elem_type: int
    dims: list[int | str | None] | None

    def triton_type(self, what: str) -> str:
        """Triton's ``data_type`` of the element type.

        Raises:
            ConversionError: a type the protocol's tensors lack (STRING, complex, float8):
                the message names WHAT.
        """
        if self.elem_type not in _DTYPES:
            t = _ONNX_TYPE_NAMES.get(self.elem_type, str(self.elem_type))
            raise ConversionError(
                f"{what} `{self.name}` has ONNX type {t}, which tpubox's StableHLO models do "
                "not take (no TYPE_STRING, complex or float8 tensors)"
            )
        return _DTYPES[self.elem_type][1]


def _desc(vi: Any) -> TensorDesc:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        raise ConversionError(
            f"`{vi.name}` is not a tensor (sequence, map or optional): StableHLO models take "
            "and give tensors only"
        )
    dims: list[int | str | None] | None = None
    if tt.HasField("shape"):
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                dims.append(None)
    return TensorDesc(vi.name, tt.elem_type, dims)


def graph_inputs(model: Any) -> list[TensorDesc]:
    """MODEL's inputs the caller feeds: graph inputs that no initializer gives a value (old
    exporters list the initializers among the inputs too)."""
    inits = {i.name for i in model.graph.initializer}
    return [_desc(vi) for vi in model.graph.input if vi.name not in inits]


def graph_outputs(model: Any) -> list[TensorDesc]:
    """MODEL's graph outputs, in order."""
    return [_desc(vi) for vi in model.graph.output]


def _is_dynamic(d: int | str | None) -> bool:
    return not isinstance(d, int) or d <= 0


@dataclass
class Layout:
    """How the converter shapes the model: whether it has a batch dimension, the sizes of the
    other symbolic dims, the inputs and outputs (with the pbtxt's names and order)."""

    batched: bool
    max_batch_size: int
    batch_sizes: list[int]
    dim_sizes: dict[str, int]
    inputs: list[TensorDesc]
    outputs: list[TensorDesc]
    notes: list[str] = field(default_factory=list)


def plan_layout(
    model: Any,
    batch_sizes: Sequence[int] | None,
    pbtxt: PbtxtConfig | None,
    dim_sizes: dict[str, int],
    what: str,
) -> Layout:
    """Decides the batch dimension, the batch sizes and the sizes of the other symbolic dims.

    Batched: with a PBTXT, when its ``max_batch_size`` > 0 (Triton's rule: the first dim of
    every input and output is then the batch); without, when the first dim of every input is
    symbolic or unknown. Batch sizes: BATCH_SIZES, else the powers of two up to the pbtxt's
    ``max_batch_size`` and it, else 1, 2, 4, 8. Other symbolic dims get their sizes from
    DIM_SIZES (by ``dim_param`` name) or the pbtxt's dims of that input.

    Raises:
        ConversionError: an input or output the pbtxt names that the model lacks, or whose
            type or dims differ; a symbolic dim without a size; a batched pbtxt on a model whose
            first dims are static; batch sizes that are not positive or do not reach
            ``max_batch_size``.
    """
    inputs = graph_inputs(model)
    outputs = graph_outputs(model)
    if not inputs:
        raise ConversionError(f"{what}: the graph has no inputs (all initializers)")
    notes: list[str] = []
    sizes = dict(dim_sizes)
    by_name_in = {t.name: t for t in inputs}
    by_name_out = {t.name: t for t in outputs}
    if pbtxt is not None:
        batched = pbtxt.max_batch_size > 0
        for pt in pbtxt.inputs:
            if pt.name not in by_name_in:
                raise ConversionError(
                    f"{what}: config.pbtxt's input `{pt.name}` is no input of the model "
                    f"(it has {', '.join(by_name_in)})"
                )
        if pbtxt.inputs and len(pbtxt.inputs) != len(inputs):
            missing = [t.name for t in inputs if t.name not in {p.name for p in pbtxt.inputs}]
            raise ConversionError(
                f"{what}: config.pbtxt does not declare the model's input(s) {', '.join(missing)}"
            )
        for pt in pbtxt.outputs:
            if pt.name not in by_name_out:
                raise ConversionError(
                    f"{what}: config.pbtxt's output `{pt.name}` is no output of the model "
                    f"(it has {', '.join(by_name_out)})"
                )
        if pbtxt.outputs:
            outputs = [by_name_out[pt.name] for pt in pbtxt.outputs]
        for kind, decl, descs in (
            ("input", pbtxt.inputs, by_name_in),
            ("output", pbtxt.outputs, by_name_out),
        ):
            for pt in decl:
                t = descs[pt.name]
                want = t.triton_type(f"{what}: {kind}")
                if pt.data_type and pt.data_type != want:
                    raise ConversionError(
                        f"{what}: config.pbtxt says {kind} `{pt.name}` is {pt.data_type}, the "
                        f"model has {want}"
                    )
                if pt.dims is None or t.dims is None:
                    continue
                model_dims = t.dims[1:] if batched else t.dims
                if len(pt.dims) != len(model_dims):
                    raise ConversionError(
                        f"{what}: config.pbtxt gives {kind} `{pt.name}` dims {pt.dims}, the "
                        f"model's are {_fmt_dims(model_dims)}"
                        + (" after the batch dimension" if batched else "")
                    )
                for cd, md in zip(pt.dims, model_dims):
                    if cd >= 0 and isinstance(md, int) and md > 0 and md != cd:
                        raise ConversionError(
                            f"{what}: config.pbtxt gives {kind} `{pt.name}` dims {pt.dims}, "
                            f"the model's are {_fmt_dims(model_dims)}"
                        )
                    if cd >= 0 and isinstance(md, str) and md not in sizes:
                        sizes[md] = cd
    else:
        batched = all(t.dims and _is_dynamic(t.dims[0]) for t in inputs)
    for t in inputs:
        if t.dims is None:
            raise ConversionError(
                f"{what}: input `{t.name}` has no shape in the model: give the model input "
                "shapes (tpubox's programs have static shapes)"
            )
    if batched:
        for t in inputs:
            if not t.dims:
                raise ConversionError(
                    f"{what}: input `{t.name}` is a scalar, so the model cannot have a batch "
                    "dimension (max_batch_size: 0 in config.pbtxt serves it unbatched)"
                )
            if not _is_dynamic(t.dims[0]):
                raise ConversionError(
                    f"{what}: input `{t.name}` has a static first dimension ({t.dims[0]}), not "
                    "a batch dimension; config.pbtxt's max_batch_size > 0 needs a dynamic one "
                    "(or set max_batch_size: 0)"
                )
        batch_params = {t.dims[0] for t in inputs if t.dims and isinstance(t.dims[0], str)}
        for p in batch_params:
            if p in sizes:
                raise ConversionError(
                    f"{what}: `{p}` is the batch dimension: its size comes from --batch-sizes, "
                    "not --dim"
                )
        max_bs = pbtxt.max_batch_size if pbtxt is not None else 0
        if batch_sizes:
            bss = sorted(set(int(b) for b in batch_sizes))
        elif max_bs:
            bss = sorted(
                {1 << i for i in range(max_bs.bit_length()) if 1 << i <= max_bs} | {max_bs}
            )
        else:
            bss = list(DEFAULT_BATCH_SIZES)
        if bss[0] < 1:
            raise ConversionError(f"{what}: batch sizes must be positive, not {bss[0]}")
        if max_bs and bss[-1] < max_bs:
            raise ConversionError(
                f"{what}: config.pbtxt's max_batch_size is {max_bs}, the largest batch size "
                f"asked for is {bss[-1]}: add {max_bs} to the batch sizes"
            )
        if max_bs and bss[-1] > max_bs:
            raise ConversionError(
                f"{what}: batch size {bss[-1]} is above config.pbtxt's max_batch_size {max_bs}"
            )
        max_bs = max_bs or bss[-1]
    else:
        if batch_sizes:
            notes.append(
                "the model has no batch dimension: one program, the batch sizes are not used"
            )
        bss, max_bs = [], 0
    skip = 1 if batched else 0
    for t in inputs:
        for i, d in enumerate(t.dims[skip:], start=skip):  # type: ignore[index]
            if isinstance(d, int) and d > 0:
                continue
            if isinstance(d, str) and d in sizes:
                continue
            name = f"`{d}`" if isinstance(d, str) else "unknown"
            hint = f"--dim {d}=SIZE" if isinstance(d, str) else "a static dimension in the model"
            raise ConversionError(
                f"{what}: input `{t.name}` dimension {i} is {name}: tpubox's programs have "
                f"static shapes; give its size ({hint}, or the input's dims in config.pbtxt)"
            )
    for k, v in sizes.items():
        if v < 1:
            raise ConversionError(f"{what}: --dim {k}={v}: sizes must be positive")
    named = {d for t in inputs for d in (t.dims or []) if isinstance(d, str)}
    for k in dim_sizes:
        if k not in named:
            notes.append(f"--dim {k}: no input has a dimension named `{k}`")
    return Layout(batched, max_bs, bss, sizes, inputs, outputs, notes)


def _fmt_dims(dims: Sequence[Any]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


@dataclass
class Lifted:
    """MODEL with its large initializers turned into graph inputs: ``weights`` (ONNX name ->
    array, in parameter order) and how many tensors stayed inline constants."""

    model: Any
    weights: dict[str, np.ndarray]
    inline_constants: int


def lift_weights(model: Any, inline_max_elements: int, keep_outputs: Sequence[str]) -> Lifted:
    """MODEL (changed in place: a model of gigabytes is not copied) with its initializers and
    ``Constant`` tensors of more than INLINE_MAX_ELEMENTS elements turned into graph inputs
    (after the model's own inputs, in initializer order), their values returned by name, and
    its graph outputs KEEP_OUTPUTS in that order. Tensors read at a ``_CONSTANT_OPERANDS``
    position stay constants; initializers no node reads are dropped. Unique names are given to
    unnamed nodes (``OpType_index``) so that the lowering's locations name them.

    Raises:
        ConversionError: a weight of a dtype the safetensors file cannot hold.
    """
    _onnx()
    from onnx import helper, numpy_helper

    m = model
    g = m.graph
    outs = {o.name: o for o in g.output}
    del g.output[:]
    g.output.extend([outs[n] for n in keep_outputs])

    seen: set[str] = set()
    for i, node in enumerate(_all_nodes(g)):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)

    # Which values are read where (subgraphs read outer values by name too).
    as_constant: set[str] = set()
    read: set[str] = set()
    for node in _all_nodes(g):
        positions = (
            _CONSTANT_OPERANDS.get(node.op_type, frozenset())
            if node.domain in ("", "ai.onnx")
            else frozenset()
        )
        for j, name in enumerate(node.input):
            read.add(name)
            if j in positions:
                as_constant.add(name)
    read.update(o.name for o in g.output)

    input_names = {vi.name for vi in g.input}
    weights: dict[str, np.ndarray] = {}
    new_inputs = []
    kept = []
    inline = 0
    for init in g.initializer:
        if init.name not in read:
            continue
        n = math.prod(init.dims)
        if n <= inline_max_elements or init.name in as_constant or init.data_type not in _DTYPES:
            kept.append(init)
            inline += 1
            continue
        weights[init.name] = _to_array(numpy_helper, init)
        if init.name not in input_names:
            new_inputs.append(
                helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    del g.initializer[:]
    g.initializer.extend(kept)
    # Constant nodes of the main graph holding a large tensor: lifted the same way.
    nodes = list(g.node)
    del g.node[:]
    for node in nodes:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
            t = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
            name = node.output[0]
            if (
                t is not None
                and math.prod(t.dims) > inline_max_elements
                and name not in as_constant
                and t.data_type in _DTYPES
                and name not in weights
            ):
                weights[name] = _to_array(numpy_helper, t)
                new_inputs.append(helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
                continue
            inline += 1
        g.node.append(node)
    g.input.extend(new_inputs)
    # Old-style models list initializers among the inputs: those lifted stay as inputs, those
    # kept inline are no input (the importer elides initialized inputs anyway).
    kept_names = {i.name for i in kept}
    ins = [vi for vi in g.input if vi.name not in kept_names]
    del g.input[:]
    g.input.extend(ins)
    for name, a in weights.items():
        if a.dtype.name not in {v[0] for v in _DTYPES.values()}:
            raise ConversionError(f"weight `{name}` has dtype {a.dtype}, which safetensors lacks")
    return Lifted(m, weights, inline)


def _to_array(numpy_helper: Any, tensor: Any) -> np.ndarray:
    a = numpy_helper.to_array(tensor)
    return np.ascontiguousarray(a)


def specialise(model: Any, layout: Layout, batch_size: int | None) -> Any:
    """A copy of (lifted) MODEL whose inputs have static shapes: the batch dimension set to
    BATCH_SIZE (None: the model has none), the other symbolic dims to their sizes; intermediate
    and output shapes inferred again by ONNX shape inference (with data propagation, so shapes
    computed by Shape/Gather/Concat chains become static)."""
    onnx = _onnx()
    m = copy.deepcopy(model)
    g = m.graph
    feed = {t.name for t in layout.inputs}
    for vi in g.input:
        if vi.name not in feed:
            continue
        dims = vi.type.tensor_type.shape.dim
        for i, d in enumerate(dims):
            if i == 0 and layout.batched:
                d.Clear()
                d.dim_value = int(batch_size)  # type: ignore[arg-type]
            elif d.HasField("dim_param") and d.dim_param in layout.dim_sizes:
                size = layout.dim_sizes[d.dim_param]
                d.Clear()
                d.dim_value = size
    # Shapes inferred for the symbolic sizes are stale: infer them again. The outputs' batch
    # dimension and sized symbols are set, as ONNX shape inference leaves the declared shapes of
    # some outputs (function ops such as GroupNormalization) as they are, and torch-mlir takes
    # them for the function's result types; other symbolic dims are cleared for it to fill.
    del g.value_info[:]
    for vi in g.output:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for i, d in enumerate(vi.type.tensor_type.shape.dim):
                if i == 0 and layout.batched:
                    # (whatever was declared: exporters write the example's batch, or a
                    # symbol of their own)
                    d.Clear()
                    d.dim_value = int(batch_size)  # type: ignore[arg-type]
                    continue
                if d.HasField("dim_value"):
                    continue
                sym = d.dim_param if d.HasField("dim_param") else None
                d.Clear()
                if sym in layout.dim_sizes:
                    d.dim_value = layout.dim_sizes[sym]
    try:
        m = onnx.shape_inference.infer_shapes(
            m, check_type=False, strict_mode=False, data_prop=True
        )
    except Exception as e:  # InferenceError
        raise ConversionError(f"ONNX shape inference fails: {_first_lines(str(e), 4)}") from None
    if _rewrite_resizes(m):
        try:
            m = onnx.shape_inference.infer_shapes(
                m, check_type=False, strict_mode=False, data_prop=True
            )
        except Exception as e:
            raise ConversionError(
                f"ONNX shape inference fails: {_first_lines(str(e), 4)}"
            ) from None
    return m


# Suffix of the nodes that stand for one node of the model (Resize's gathers): errors name the
# model's node.
_DERIVED = "/tpubox:"

_FLOAT_TYPES = {1, 10, 11, 16}  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


def _rewrite_resizes(model: Any) -> int:
    """Replaces, in MODEL (static shapes inferred; changed in place), every ``Resize`` that
    torch-mlir cannot lower (it leaves ``aten.__interpolate``) by what it computes along each
    resized axis: ``Gather``s of the input at constant indices, weighted by constant
    coefficients and summed (one gather for ``nearest``, two for ``linear``, four for
    ``cubic``); the indices and weights follow the ONNX Resize spec (opset 11-19:
    ``coordinate_transformation_mode`` half_pixel, half_pixel_symmetric, pytorch_half_pixel,
    align_corners, asymmetric; ``nearest_mode``; ``cubic_coeff_a``; ``exclude_outside``) and
    are checked against ONNX Runtime by the tests. Left as they are (and then named as not
    converting): ``tf_crop_and_resize``, ``antialias`` when shrinking, scales that are not
    constants, non-float inputs to ``linear``/``cubic``, unknown shapes. Returns how many
    were replaced."""
    from onnx import helper, numpy_helper

    g = model.graph
    if (_default_opset(model) or 0) < 11:
        return 0
    static: dict[str, list[int]] = {}
    types: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        types[vi.name] = tt.elem_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            static[vi.name] = [int(d.dim_value) for d in tt.shape.dim]
    consts: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    for node in g.node:
        if node.op_type == "Constant" and len(node.output) == 1:
            for a in node.attribute:
                if a.name == "value" and a.HasField("t"):
                    consts[node.output[0]] = numpy_helper.to_array(a.t)
    for i in g.initializer:
        types.setdefault(i.name, i.data_type)
        static.setdefault(i.name, list(i.dims))
    new_nodes: list[Any] = []
    new_inits: list[Any] = []
    count = 0
    for node in g.node:
        plan = _resize_plan(node, static, types, consts)
        if plan is None:
            new_nodes.append(node)
            continue
        count += 1
        cur = node.input[0]
        rank = len(static[cur])
        dtype = _DTYPES[types[cur]][0]
        for axis, (idx, w) in plan:
            base = f"{node.name}{_DERIVED}ax{axis}"
            terms = []
            for k in range(idx.shape[0]):
                iname = f"{base}/idx{k}"
                new_inits.append(numpy_helper.from_array(idx[k].astype(np.int64), iname))
                gname = f"{base}/g{k}"
                new_nodes.append(
                    helper.make_node("Gather", [cur, iname], [gname], axis=axis, name=gname)
                )
                if w is None:
                    terms.append(gname)
                    continue
                wname = f"{base}/w{k}"
                shape = [idx.shape[1]] + [1] * (rank - 1 - axis)
                arr = (
                    w[k]
                    .reshape(shape)
                    .astype(np.dtype(dtype) if dtype != "bfloat16" else np.float32)
                )
                new_inits.append(numpy_helper.from_array(arr, wname))
                if dtype == "bfloat16":  # (NumPy has no bfloat16: a float32 constant, cast)
                    cname = f"{wname}/cast"
                    new_nodes.append(helper.make_node("Cast", [wname], [cname], to=16, name=cname))
                    wname = cname
                mname = f"{base}/m{k}"
                new_nodes.append(helper.make_node("Mul", [gname, wname], [mname], name=mname))
                terms.append(mname)
            acc = terms[0]
            for k, t in enumerate(terms[1:], start=1):
                aname = f"{base}/s{k}"
                new_nodes.append(helper.make_node("Add", [acc, t], [aname], name=aname))
                acc = aname
            cur = acc
        new_nodes.append(
            helper.make_node("Identity", [cur], [node.output[0]], name=f"{node.name}{_DERIVED}out")
        )
    if count:
        del g.node[:]
        g.node.extend(new_nodes)
        g.initializer.extend(new_inits)
    return count


def _resize_plan(
    node: Any, static: dict[str, list[int]], types: dict[str, int], consts: dict[str, np.ndarray]
) -> list[tuple[int, tuple[np.ndarray, np.ndarray | None]]] | None:
    """For a ``Resize`` NODE that can be rewritten: per resized axis, (indices [K, n_out],
    weights [K, n_out] or None for nearest). None: leave the node."""
    if node.op_type != "Resize" or node.domain not in ("", "ai.onnx") or len(node.input) < 3:
        return None
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def text(name: str, default: str) -> str:
        v = attrs.get(name, default)
        return v.decode() if isinstance(v, bytes) else str(v)

    mode = text("mode", "nearest")
    ctm = text("coordinate_transformation_mode", "half_pixel")
    nearest_mode = text("nearest_mode", "round_prefer_floor")
    a = float(attrs.get("cubic_coeff_a", -0.75))
    exclude = bool(attrs.get("exclude_outside", 0))
    antialias = bool(attrs.get("antialias", 0))
    x, y = node.input[0], node.output[0]
    if mode not in ("nearest", "linear", "cubic") or ctm == "tf_crop_and_resize":
        return None
    if x not in static or y not in static or len(static[x]) != len(static[y]):
        return None
    if mode != "nearest" and types.get(x) not in _FLOAT_TYPES:
        return None
    if types.get(x) not in _DTYPES:
        return None
    rank = len(static[x])
    scales: list[float] | None = None
    sname = node.input[2]
    if sname:
        if sname not in consts:
            return None
        sv = consts[sname].astype(np.float32).reshape(-1)
        if sv.size:
            axes = [int(v) % rank for v in attrs.get("axes", list(range(rank)))]
            if len(axes) != sv.size:
                return None
            scales = [1.0] * rank
            for ax, s in zip(axes, sv):
                scales[ax] = float(s)
    out: list[tuple[int, tuple[np.ndarray, np.ndarray | None]]] = []
    for axis in range(rank):
        n_in, n_out = static[x][axis], static[y][axis]
        s = np.float32(scales[axis]) if scales is not None else np.float32(n_out) / np.float32(n_in)
        if n_in == n_out and s == 1:
            continue
        if antialias and mode != "nearest" and s < 1:
            return None
        taps = _resize_taps(n_in, n_out, s, mode, ctm, nearest_mode, a, exclude)
        if taps is None:
            return None
        out.append((axis, taps))
    return out


def _resize_taps(
    n_in: int,
    n_out: int,
    scale: Any,
    mode: str,
    ctm: str,
    nearest_mode: str,
    a: float,
    exclude: bool,
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Indices [K, n_out] into the input axis and weights [K, n_out] (None for nearest) of a
    1-D ONNX Resize from N_IN to N_OUT with SCALE (float32, as ONNX Runtime computes it)."""
    j = np.arange(n_out, dtype=np.float32)
    s = np.float32(scale)
    half = np.float32(0.5)
    if ctm == "half_pixel":
        xo = (j + half) / s - half
    elif ctm == "half_pixel_symmetric":
        adj = np.float32(n_out) / (np.float32(n_in) * s)
        center = np.float32(n_in) / np.float32(2)
        xo = center * (np.float32(1) - adj) + (j + half) / s - half
    elif ctm == "pytorch_half_pixel":
        xo = (j + half) / s - half if n_out > 1 else np.zeros_like(j)
    elif ctm == "align_corners":
        xo = j * np.float32(n_in - 1) / np.float32(n_out - 1) if n_out > 1 else np.zeros_like(j)
    elif ctm == "asymmetric":
        xo = j / s
    else:
        return None
    xo = xo.astype(np.float64)
    if mode == "nearest":
        fl = np.floor(xo)
        is_half = (xo - fl) == 0.5
        if nearest_mode == "round_prefer_floor":
            i = np.where(is_half, fl, np.floor(xo + 0.5))
        elif nearest_mode == "round_prefer_ceil":
            i = np.where(is_half, fl + 1, np.floor(xo + 0.5))
        elif nearest_mode == "floor":
            i = fl
        elif nearest_mode == "ceil":
            i = np.ceil(xo)
        else:
            return None
        return np.clip(i, 0, n_in - 1).astype(np.int64)[None, :], None
    x0 = np.floor(xo)
    t = xo - x0
    if mode == "linear":
        offs = np.array([0, 1])
        w = np.stack([1 - t, t])
    else:  # cubic, Keys' kernel with coefficient A
        offs = np.array([-1, 0, 1, 2])

        def kern(d: np.ndarray) -> np.ndarray:
            d = np.abs(d)
            return np.where(
                d <= 1,
                ((a + 2) * d - (a + 3)) * d * d + 1,
                np.where(d < 2, ((a * d - 5 * a) * d + 8 * a) * d - 4 * a, 0.0),
            )

        w = np.stack([kern(t - o) for o in offs])
    idx = x0[None, :] + offs[:, None]
    if exclude:
        inside = (idx >= 0) & (idx <= n_in - 1)
        w = np.where(inside, w, 0.0)
        w = w / w.sum(axis=0, keepdims=True)
    return np.clip(idx, 0, n_in - 1).astype(np.int64), w


# ---------------------------------------------------------------------------------------------
# The torch-mlir side: import, lower, name what does not convert.


def _torch_mlir() -> Any:
    try:
        import torch_mlir  # noqa: F401
        from torch_mlir.extras import onnx_importer  # noqa: F401
    except ImportError as e:
        raise ConversionError(
            f"torch-mlir's ONNX importer is missing ({e}): run the converter in the venv of "
            "scripts/venvs/onnx.txt"
        ) from None
    return torch_mlir


@dataclass
class Lowered:
    """One program: its bytes (VHLO bytecode or StableHLO text), its parameter and result
    types (``f32[2,4]``), the seconds it took."""

    data: bytes
    param_types: list[tuple[str, list[int]]]
    result_types: list[tuple[str, list[int]]]
    seconds: float


class _Unconverted(Exception):
    def __init__(self, ops: dict[str, list[str]], detail: str):
        super().__init__(detail)
        self.ops = ops  # op type -> node names
        self.detail = detail


def _diagnostics(e: Exception) -> str:
    diags = getattr(e, "error_diagnostics", None)
    if not diags:
        return _first_lines(str(e), 8)
    parts = []
    for d in diags[:6]:
        parts.append(f"{d.location}: {d.message}")
        for n in list(getattr(d, "notes", []))[:2]:
            parts.append(f"  note: {n.location}: {n.message}")
    return " / ".join(parts)


_LOC_NAME = re.compile(r'loc\("((?:[^"\\]|\\.)*)"')


def _node_names_of(loc: Any) -> list[str]:
    """The ONNX node names in an MLIR location (a node the converter derived from one of the
    model's, ``name/tpubox:...``, by that one's)."""
    return [n.split(_DERIVED)[0] for n in _LOC_NAME.findall(str(loc))]


def _ops(module: Any, pred: Any) -> list[Any]:
    """The operations of MODULE (walked in order) for which PRED(operation) holds."""
    from torch_mlir import ir

    found: list[Any] = []

    def visit(op: Any) -> Any:
        o = op.operation if hasattr(op, "operation") else op
        if pred(o):
            found.append(o)
        return ir.WalkResult.ADVANCE

    module.walk(visit)
    return found


def _onnx_op_of(o: Any) -> str:
    """The ONNX op type of a ``torch.operator`` (``onnx.Det`` -> ``Det``)."""
    from torch_mlir import ir

    name = str(ir.StringAttr(o.attributes["name"]).value)
    return name[5:] if name.startswith("onnx.") else name


def _import(model: Any) -> tuple[Any, Any, str]:
    """(context, module operation, entry function name) of MODEL imported by torch-mlir's
    ONNX importer."""
    _torch_mlir()
    import warnings

    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras import onnx_importer

    ctx = ir.Context()
    torch_d.register_dialect(ctx)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # untyped nodes: named by the conversion below
            info = onnx_importer.ModelInfo(model, config=onnx_importer.Config())
            module = info.create_module(context=ctx).operation
            onnx_importer.NodeImporter.define_function(info.main_graph, module).import_all()
    except Exception as e:  # OnnxImportError and what the bindings raise
        raise ConversionError(
            f"torch-mlir's ONNX importer: {type(e).__name__}: {_first_lines(str(e), 6)}"
        ) from None
    return ctx, module, info.main_graph.graph_proto.name


def _downstream(graph: Any, nodes: set[str]) -> set[str]:
    """NODES and the nodes of GRAPH's top level that read their results, transitively."""
    if not nodes:
        return set()
    out = set(nodes)
    tainted: set[str] = set()
    for node in graph.node:  # topological order
        if node.name in out or any(i in tainted for i in node.input):
            out.add(node.name)
            tainted.update(node.output)
    return out


def _onnx_to_torch(
    ctx: Any,
    module: Any,
    node_types: dict[str, str],
    skip: set[str] = frozenset(),  # type: ignore[assignment]
    known: dict[str, list[str]] | None = None,
) -> Any:
    """MODULE (as imported) with every ONNX op converted to torch ops by
    ``convert-torch-onnx-to-torch``, as a new module.

    The pass stops at the first op it cannot convert. To name every op type that does not
    convert, the failed op's type is noted, its ops in the imported module are replaced by
    ``builtin.unrealized_conversion_cast``s giving values of the same types, and the pass is
    run again, until it goes through.

    Raises:
        _Unconverted: op types that did not convert (-> the nodes named by the failures).
        ConversionError: the pass failed with no op to blame.
    """
    from torch_mlir.passmanager import PassManager

    failed: dict[str, list[str]] = {k: list(v) for k, v in (known or {}).items()}
    details: list[str] = ["ops of domains other than ONNX's have no conversion"] if known else []
    with ctx:
        if skip:
            _stub_out(module, nodes=skip)
        pm = "builtin.module(func.func(convert-torch-onnx-to-torch))"
        for _ in range(64):
            attempt = module.clone()
            try:
                PassManager.parse(pm).run(attempt)
            except Exception as e:
                detail = _diagnostics(e)
                blamed = _blamed_ops(e, node_types, module)
                if not blamed:
                    if failed:  # (what depends on a stubbed op may fail to verify)
                        break
                    raise ConversionError(f"convert-torch-onnx-to-torch: {detail}") from None
                details.append(detail)
                for op_type, nodes in blamed.items():
                    failed.setdefault(op_type, [])
                    failed[op_type] += [n for n in nodes if n not in failed[op_type]]
                    _stub_out(module, op_type=op_type)
                continue
            left = _ops(attempt, lambda o: o.name == "torch.operator")
            for o in left:  # (a pattern that leaves an op: not seen, but named if so)
                t = _onnx_op_of(o)
                failed.setdefault(t, [])
                failed[t] += [n for n in _node_names_of(o.location) if n in node_types]
            if failed:
                break
            return attempt
    raise _Unconverted(failed, details[0] if details else "no conversion pattern")


def _blamed_ops(e: Exception, node_types: dict[str, str], module: Any) -> dict[str, list[str]]:
    """Op type -> node names of the ONNX nodes the diagnostics of pass failure E point at."""
    out: dict[str, list[str]] = {}
    for d in getattr(e, "error_diagnostics", None) or []:
        for n in _node_names_of(d.location):
            if n in node_types:
                out.setdefault(node_types[n], [])
                if n not in out[node_types[n]]:
                    out[node_types[n]].append(n)
    return out


def _stub_out(module: Any, op_type: str | None = None, nodes: set[str] | None = None) -> None:
    """Replaces every ``torch.operator "onnx.OP_TYPE"`` of MODULE (or every one of the ONNX
    nodes NODES) by an ``unrealized_conversion_cast`` without operands giving values of its
    result types."""
    from torch_mlir import ir

    base = op_type.rsplit(".", 1)[-1] if op_type else None

    def hit(o: Any) -> bool:
        if o.name != "torch.operator":
            return False
        if nodes is not None:
            return any(n in nodes for n in _node_names_of(o.location))
        return _onnx_op_of(o) == base

    for o in _ops(module, hit):
        with ir.InsertionPoint(o), o.location:
            stub = ir.Operation.create(
                "builtin.unrealized_conversion_cast", results=[r.type for r in o.results]
            )
        for old, new in zip(o.results, stub.results):
            old.replace_all_uses_with(new)
        o.erase()


def _to_stablehlo_constants(module: Any) -> None:
    """``arith.constant``s of tensors (torch-mlir leaves them for scalar operands) rewritten
    as ``stablehlo.constant``s of the same value; a ``stablehlo.convert`` of a f64 constant
    folded into a constant of the converted type (a TPU has no f64)."""
    from torch_mlir import ir

    for o in _ops(module, lambda o: o.name == "arith.constant"):
        if not isinstance(o.results[0].type, ir.RankedTensorType):
            continue
        with ir.InsertionPoint(o), o.location:
            new = ir.Operation.create(
                "stablehlo.constant",
                results=[o.results[0].type],
                attributes={"value": o.attributes["value"]},
            )
        o.results[0].replace_all_uses_with(new.results[0])
        o.erase()
    for o in _ops(module, lambda o: o.name == "stablehlo.convert"):
        src = o.operands[0].owner
        src = src.operation if hasattr(src, "operation") else src
        if not isinstance(src, ir.Operation) or src.name != "stablehlo.constant":
            continue
        st = ir.RankedTensorType(src.results[0].type)
        rt = ir.RankedTensorType(o.results[0].type)
        if not isinstance(st.element_type, ir.F64Type):
            continue
        dtype = _NP_OF_MLIR.get(str(rt.element_type))
        if dtype is None:
            continue
        values = np.array(ir.DenseElementsAttr(src.attributes["value"]), dtype=np.float64)
        if values.size != math.prod(rt.shape):
            values = np.broadcast_to(values.reshape(-1)[:1], rt.shape)
        arr = np.ascontiguousarray(values.reshape(rt.shape).astype(dtype))
        with ir.InsertionPoint(o), o.location:
            attr = ir.DenseElementsAttr.get(arr, type=rt) if arr.dtype != np.bool_ else None
            if attr is None:
                continue
            new = ir.Operation.create(
                "stablehlo.constant", results=[rt], attributes={"value": attr}
            )
        o.results[0].replace_all_uses_with(new.results[0])
        o.erase()
        if not list(src.results[0].uses):
            src.erase()


_NP_OF_MLIR = {
    "f32": np.float32, "f16": np.float16, "i64": np.int64, "i32": np.int32, "i16": np.int16,
    "i8": np.int8, "ui8": np.uint8,
}  # fmt: skip


def lower_model(
    model: Any,
    node_types: dict[str, str],
    precision: str,
    fmt: str,
    target_version: str | None,
) -> Lowered:
    """MODEL (static shapes, weights as inputs) imported by torch-mlir's ONNX importer and
    lowered to StableHLO: ``@main`` taking the graph inputs in order and returning the graph
    outputs in order. NODE_TYPES maps node names to op types (``op_type_name``) for the
    errors; PRECISION (``DEFAULT``/``HIGH``/``HIGHEST``) is set on every dot and convolution;
    FMT ``bytecode`` gives portable VHLO bytecode for TARGET_VERSION (default: the StableHLO
    version of 12 weeks' compatibility), ``text`` StableHLO text.

    Raises:
        _Unconverted: ops did not convert (op type -> node names, and the passes' message).
        ConversionError: the importer or a pass failed for another reason, or the program
            still has dynamic shapes.
    """
    start = time.perf_counter()
    # torch-mlir's patterns are those of ONNX's default domain (the importer drops the domain:
    # a custom op named like a standard one would get the standard one's meaning). Such ops,
    # and the nodes that depend on their results (whose types ONNX cannot infer), are stubbed
    # out; the other nodes are still tried, to name every op that does not convert.
    custom: dict[str, list[str]] = {}
    for n, t in node_types.items():
        if "." in t:
            custom.setdefault(t, []).append(n)
    skip = _downstream(model.graph, {n for ns in custom.values() for n in ns})
    ctx, imported, entry = _import(model)
    module = _onnx_to_torch(ctx, imported, node_types, skip, custom)

    from torch_mlir import ir
    from torch_mlir.passmanager import PassManager

    with ctx:
        for pipeline in (
            "torch-onnx-to-torch-backend-pipeline",
            "torch-backend-to-stablehlo-backend-pipeline",
        ):
            try:
                PassManager.parse(f"builtin.module({pipeline})").run(module)
            except Exception as e:
                detail = _diagnostics(e)
                blamed = _blamed_ops(e, node_types, module)
                if not blamed:
                    # The diagnostic may point at a constant (its location lost to CSE) left
                    # by an op without a pattern: the ops the failed pass left (the passes
                    # before it stay applied) carry their nodes' locations.
                    left = _ops(
                        module,
                        lambda o: (
                            o.name.startswith("torch.")
                            and not o.name.startswith(
                                ("torch.constant.", "torch.prim.ListConstruct")
                            )
                        ),
                    )
                    for o in left:
                        for n in _node_names_of(o.location):
                            if n in node_types:
                                blamed.setdefault(node_types[n], [])
                                if n not in blamed[node_types[n]]:
                                    blamed[node_types[n]].append(n)
                    if left:
                        names = sorted({o.name for o in left})
                        detail = f"left unconverted: {', '.join(names[:8])}; {detail}"
                if blamed:
                    raise _Unconverted(blamed, f"{pipeline}: {detail}") from None
                raise ConversionError(f"{pipeline}: {detail}") from None
        _to_stablehlo_constants(module)
        left = _ops(
            module,
            lambda o: not o.name.startswith(_LOWERED_DIALECTS) and o.name != "builtin.module",
        )
        if left:
            names = sorted({o.name for o in left})
            if any(n.split(".")[0] in ("shape", "tensor", "arith") for n in names):
                raise ConversionError(
                    "the lowered program still computes shapes at run time ("
                    + ", ".join(names)
                    + "): a dimension stayed dynamic"
                )
            blamed: dict[str, list[str]] = {}
            for o in left:
                for n in _node_names_of(o.location):
                    if n in node_types:
                        blamed.setdefault(node_types[n], []).append(n)
            if blamed:
                raise _Unconverted(blamed, "ops left outside StableHLO: " + ", ".join(names))
            raise ConversionError("ops left outside StableHLO: " + ", ".join(names))

        # @main, precision, signature.
        funcs = [o for o in _ops(module, lambda o: o.name == "func.func")]

        def sym(f: Any) -> str:
            return str(ir.StringAttr(f.attributes["sym_name"]).value)

        main = next((f for f in funcs if sym(f) == entry), funcs[0] if len(funcs) == 1 else None)
        if main is None:
            raise ConversionError(f"the lowered module has no function @{entry}")
        if entry != "main":
            for f in funcs:
                if sym(f) == "main":  # (a private helper of that name: out of the way)
                    f.attributes["sym_name"] = ir.StringAttr.get("main_")
            main.attributes["sym_name"] = ir.StringAttr.get("main")
        attr = ir.Attribute.parse(
            f"[#stablehlo<precision {precision}>, #stablehlo<precision {precision}>]"
        )
        for o in _ops(module, lambda o: o.name in _DOT_OPS):
            o.attributes["precision_config"] = attr
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        params = [_tensor_type(t) for t in ftype.inputs]
        results = [_tensor_type(t) for t in ftype.results]
        for kind, types in (("parameter", params), ("result", results)):
            for i, (dt, dims) in enumerate(types):
                if any(d < 0 for d in dims):
                    raise ConversionError(
                        f"the lowered program's {kind} {i} has a dynamic shape "
                        f"({dt}{_fmt_dims(['?' if d < 0 else d for d in dims])})"
                    )
        text = module.get_asm(enable_debug_info=False)
        if fmt == "text":
            data = text.encode()
        else:
            from torch_mlir._mlir_libs import _stablehlo as shlo

            version = target_version or _stablehlo_target()
            try:
                data = bytes(shlo.serialize_portable_artifact_str(text, version))
            except Exception as e:
                raise ConversionError(
                    f"serializing the program as VHLO {version}: {_first_lines(str(e), 4)} "
                    "(--format text writes StableHLO text)"
                ) from None
    return Lowered(data, params, results, time.perf_counter() - start)


def _tensor_type(t: Any) -> tuple[str, list[int]]:
    from torch_mlir import ir

    rt = ir.RankedTensorType(t)
    dims = [-1 if rt.is_dynamic_dim(i) else rt.get_dim_size(i) for i in range(rt.rank)]
    return str(rt.element_type), dims


def _stablehlo_target() -> str:
    from torch_mlir._mlir_libs import _stablehlo as shlo

    return str(
        shlo.get_version_from_compatibility_requirement(
            shlo.StablehloCompatibilityRequirement.WEEK_12
        )
    )


# ---------------------------------------------------------------------------------------------
# Writing the directory.


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, np.ndarray]) -> int:
    """Writes TENSORS (name -> array) to PATH in the safetensors format (an 8-byte
    little-endian header length, the JSON header padded to 8 bytes, the data little-endian in C
    order, in the order of TENSORS). Returns the data's bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for name, a in tensors.items():
        st = next(v[2] for v in _DTYPES.values() if v[0] == a.dtype.name)
        nbytes = a.size * a.dtype.itemsize
        header[name] = {
            "dtype": st,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for a in tensors.values():
            b = np.ascontiguousarray(a)
            if b.dtype.byteorder == ">":
                b = b.astype(b.dtype.newbyteorder("<"))
            f.write(b.tobytes())
    os.replace(tmp, path)
    return offset


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a TOML basic string is a JSON string for these names


def config_toml(plan: dict[str, Any]) -> str:
    """The ``config.toml`` of a StableHLO model directory holding PLAN's files: Triton's
    fields (``max_batch_size``, ``[[input]]``, ``[[output]]``) and ``[tpubox.stablehlo]``."""
    lines = [
        "# Written by python -m tpubox.onnx_convert from "
        + plan["source"]["file"]
        + f" (sha256 {plan['source']['sha256']}).",
        'backend = "stablehlo"',
        f"max_batch_size = {plan['max_batch_size']}",
        "",
    ]
    for kind in ("input", "output"):
        for t in plan[kind]:
            lines += [
                f"[[{kind}]]",
                f"name = {_toml_str(t['name'])}",
                f"data_type = {_toml_str(t['data_type'])}",
                f"dims = {json.dumps(t['dims'])}",
                "",
            ]
    s = plan["stablehlo"]
    lines += ["[tpubox.stablehlo]", f"weights = {_toml_str(s['weights'])}", "parameters = ["]
    for p in s["parameters"]:
        ((k, v),) = p.items()
        lines.append(f"  {{ {k} = {_toml_str(v)} }},")
    lines += ["]", "results = [" + ", ".join(_toml_str(r) for r in s["results"]) + "]", ""]
    for prog in s["program"]:
        lines.append("[[tpubox.stablehlo.program]]")
        if "batch_size" in prog:
            lines.append(f"batch_size = {prog['batch_size']}")
        lines += [f"file = {_toml_str(prog['file'])}", ""]
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist, key in (("torch-mlir", "torch_mlir"), ("onnx", "onnx")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = "unknown"
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class _Prepared:
    model: Any
    layout: Layout
    lifted: Lifted
    node_types: dict[str, str]
    ops: dict[str, int]
    seconds: dict[str, float]
    upgrade_tried: bool = False
    opset_upgrade: dict[str, Any] | None = None


# Models of an older default-domain opset whose ops do not convert are upgraded to this one with
# onnx.version_converter and tried again: torch-mlir's patterns follow the current forms of the
# ops (Softmax over one axis since opset 13, Unsqueeze's axes as an input, ...).
UPGRADE_OPSET = 18


def _default_opset(model: Any) -> int | None:
    return next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def _lower_one(
    prep: _Prepared, bs: int | None, precision: str, fmt: str, target_version: str | None
) -> Lowered:
    """The program of batch size BS. When ops do not convert and the model's opset is below
    ``UPGRADE_OPSET``, the (lifted) model is upgraded once and tried again; if that converts,
    PREP holds the upgraded model from then on (and ``opset_upgrade`` says so), else the first
    failure stands.

    Raises:
        _Unconverted, ConversionError: as :func:`lower_model`.
    """
    m = specialise(prep.lifted.model, prep.layout, bs)
    try:
        return lower_model(m, prep.node_types, precision, fmt, target_version)
    except _Unconverted as u:
        old = _default_opset(prep.lifted.model)
        if prep.upgrade_tried or old is None or old >= UPGRADE_OPSET:
            raise
        prep.upgrade_tried = True
        try:
            from onnx import version_converter

            up = version_converter.convert_version(prep.lifted.model, UPGRADE_OPSET)
        except Exception:
            raise u from None
        seen: set[str] = set()
        for i, node in enumerate(_all_nodes(up.graph)):
            if not node.name or node.name in seen:
                node.name = f"{node.op_type}_u{i}"
            seen.add(node.name)
        node_types = {n.name: op_type_name(n) for n in _all_nodes(up.graph)}
        try:
            low = lower_model(
                specialise(up, prep.layout, bs), node_types, precision, fmt, target_version
            )
        except (_Unconverted, ConversionError):
            raise u from None
        prep.lifted.model = up
        prep.node_types = node_types
        prep.opset_upgrade = {
            "from": old,
            "to": UPGRADE_OPSET,
            "why": f"at opset {old}: " + ", ".join(sorted(u.ops)) + " do not convert",
        }
        return low


def _prepare(
    path: Path,
    batch_sizes: Sequence[int] | None,
    config_pbtxt: str | os.PathLike[str] | None,
    dims: dict[str, int] | None,
    inline_max_elements: int,
) -> _Prepared:
    t0 = time.perf_counter()
    model = load_model(path)
    t1 = time.perf_counter()
    pbtxt = read_config_pbtxt(config_pbtxt) if config_pbtxt is not None else None
    layout = plan_layout(model, batch_sizes, pbtxt, dims or {}, str(path))
    for kind, ts in (("input", layout.inputs), ("output", layout.outputs)):
        for t in ts:
            t.triton_type(f"{path}: {kind}")
    ops = op_counts(model)
    lifted = lift_weights(model, inline_max_elements, [t.name for t in layout.outputs])
    node_types = {n.name: op_type_name(n) for n in _all_nodes(lifted.model.graph)}
    t2 = time.perf_counter()
    return _Prepared(model, layout, lifted, node_types, ops, {"load": t1 - t0, "lift": t2 - t1})


def _unconverted_error(path: Path, where: str, u: _Unconverted) -> ConversionError:
    ops = sorted(u.ops)
    nodes = [n for k in ops for n in u.ops[k]]
    shown = ", ".join(
        f"{k} ({', '.join(u.ops[k][:3])}{', ...' if len(u.ops[k]) > 3 else ''})" if u.ops[k] else k
        for k in ops
    )
    return ConversionError(
        f"{path}: ops that do not convert to StableHLO{where}: {shown} "
        f"[{_first_lines(u.detail, 3)[:600]}]",
        ops,
        nodes,
    )


def convert(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    batch_sizes: Sequence[int] | None = None,
    config_pbtxt: str | os.PathLike[str] | None = None,
    dims: dict[str, int] | None = None,
    precision: str = "highest",
    fmt: str = "bytecode",
    inline_max_elements: int = DEFAULT_INLINE_MAX_ELEMENTS,
    target_version: str | None = None,
) -> dict[str, Any]:
    """Converts the ONNX model at PATH into OUT_DIR (created if missing): one program per batch
    size, ``weights.safetensors``, ``plan.json`` and ``config.toml`` (the module docstring
    describes them). Returns the plan.

    BATCH_SIZES: the programs' batch sizes (ignored for a model without a batch dimension).
    CONFIG_PBTXT: Triton's ``config.pbtxt`` of the model, whose ``max_batch_size``, inputs and
    outputs (names, data types, dims; a subset of the model's outputs selects those) decide
    the layout. DIMS: sizes of symbolic dims other than the batch, by ``dim_param`` name.
    PRECISION: ``highest`` (default), ``high`` or ``default``, set on every dot and
    convolution. FMT: ``bytecode`` (portable VHLO, ``.mlirbc``) or ``text`` (``.mlir``).

    Raises:
        ConversionError: the file is unreadable, truncated or corrupt; the configuration does
            not fit the model; ops do not convert (``.ops`` names them); a program is left
            with dynamic shapes.
    """
    p = Path(path)
    out = Path(out_dir)
    start = time.perf_counter()
    prec = _check_precision(precision)
    if fmt not in ("bytecode", "text"):
        raise ConversionError(f"format must be bytecode or text, not {fmt!r}")
    prep = _prepare(p, batch_sizes, config_pbtxt, dims, inline_max_elements)
    layout = prep.layout
    ext = "mlirbc" if fmt == "bytecode" else "mlir"
    programs = []
    files: dict[str, bytes] = {}
    prog_seconds: dict[str, float] = {}
    first: Lowered | None = None
    for bs in layout.batch_sizes if layout.batched else [None]:
        where = f" at batch size {bs}" if bs is not None else ""
        try:
            low = _lower_one(prep, bs, prec, fmt, target_version)
        except _Unconverted as u:
            raise _unconverted_error(p, where, u) from None
        except ConversionError as e:
            raise ConversionError(f"{p}{where}: {e}") from None
        _check_signature(p, layout, prep.lifted, low, bs)
        if first is not None and _io(layout, low) != _io(layout, first):
            raise ConversionError(
                f"{p}{where}: the inputs and outputs after the batch dimension differ from "
                f"those at batch size {layout.batch_sizes[0]}: {_io(layout, low)} vs "
                f"{_io(layout, first)}"
            )
        first = first or low
        name = f"model.b{bs}.{ext}" if bs is not None else f"model.{ext}"
        files[name] = low.data
        prog = {"batch_size": bs, "file": name} if bs is not None else {"file": name}
        programs.append(prog)
        prog_seconds[str(bs) if bs is not None else "all"] = round(low.seconds, 3)
    assert first is not None
    inputs, outputs = _io(layout, first)
    params = [{"input": t.name} for t in layout.inputs] + [
        {"weight": n} for n in prep.lifted.weights
    ]
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        tmp = out / (name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, out / name)
    nbytes = write_safetensors(out / "weights.safetensors", prep.lifted.weights)
    plan: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "source": {
            "file": p.name,
            "sha256": _sha256(p),
            "bytes": p.stat().st_size,
            "ir_version": int(prep.model.ir_version),
            "opsets": {o.domain or "": int(o.version) for o in prep.model.opset_import},
            "producer": f"{prep.model.producer_name} {prep.model.producer_version}".strip(),
        },
        "converter": {
            "path": "torch-mlir-onnx-importer",
            **_versions(),
            "program_format": "vhlo-bytecode" if fmt == "bytecode" else "stablehlo-text",
            **(
                {"stablehlo_target": target_version or _stablehlo_target()}
                if fmt == "bytecode"
                else {}
            ),
            "precision": prec,
            "inline_max_elements": inline_max_elements,
        },
        "max_batch_size": layout.max_batch_size,
        "input": inputs,
        "output": outputs,
        "stablehlo": {
            "weights": "weights.safetensors",
            "parameters": params,
            "results": [t.name for t in layout.outputs],
            "program": programs,
        },
        "weights": {
            "count": len(prep.lifted.weights),
            "bytes": nbytes,
            "inline_constants": prep.lifted.inline_constants,
        },
        "ops": prep.ops,
        "dims": layout.dim_sizes,
        "notes": layout.notes,
        "opset_upgrade": prep.opset_upgrade,
        "seconds": {
            "load": round(prep.seconds["load"], 3),
            "lift": round(prep.seconds["lift"], 3),
            "programs": prog_seconds,
            "total": round(time.perf_counter() - start, 3),
        },
    }
    (out / "config.toml").write_text(config_toml(plan))
    tmp = out / "plan.json.tmp"
    tmp.write_text(json.dumps(plan, indent=2) + "\n")
    os.replace(tmp, out / "plan.json")
    return plan


def _check_precision(precision: str) -> str:
    try:
        return _PRECISIONS[precision.lower()]
    except KeyError:
        raise ConversionError(
            f"precision must be one of {', '.join(_PRECISIONS)}, not {precision!r}"
        ) from None


def _check_signature(p: Path, layout: Layout, lifted: Lifted, low: Lowered, bs: int | None) -> None:
    """The lowered program takes the inputs then the weights, and gives the outputs with the
    batch dimension first."""
    where = f" at batch size {bs}" if bs is not None else ""
    n_params = len(layout.inputs) + len(lifted.weights)
    if len(low.param_types) != n_params or len(low.result_types) != len(layout.outputs):
        raise ConversionError(
            f"{p}{where}: the lowered program has {len(low.param_types)} parameters and "
            f"{len(low.result_types)} results, expected {n_params} and {len(layout.outputs)}"
        )
    for (dt, dims), (name, w) in zip(low.param_types[len(layout.inputs) :], lifted.weights.items()):
        if list(w.shape) != dims:
            raise ConversionError(
                f"{p}{where}: weight `{name}` is {dt}{dims} in the program, "
                f"{w.dtype}{list(w.shape)} in the model"
            )
    if bs is not None:
        for t, (dt, dims) in zip(layout.inputs, low.param_types):
            if not dims or dims[0] != bs:
                raise ConversionError(
                    f"{p}{where}: input `{t.name}` is {dt}{dims} in the program: its first "
                    f"dimension is not the batch ({bs})"
                )
        for t, (dt, dims) in zip(layout.outputs, low.result_types):
            if not dims or dims[0] != bs:
                raise ConversionError(
                    f"{p}{where}: output `{t.name}` has shape {dt}{dims}: its first dimension "
                    f"is not the batch ({bs}), so the model cannot be served batched (set "
                    "max_batch_size: 0 in config.pbtxt)"
                )


def _io(layout: Layout, low: Lowered) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Triton's input and output entries (dims without the batch dimension) from the lowered
    program's types."""
    skip = 1 if layout.batched else 0
    ins = [
        {"name": t.name, "data_type": t.triton_type("input"), "dims": dims[skip:]}
        for t, (_, dims) in zip(layout.inputs, low.param_types)
    ]
    outs = [
        {"name": t.name, "data_type": t.triton_type("output"), "dims": dims[skip:]}
        for t, (_, dims) in zip(layout.outputs, low.result_types)
    ]
    return ins, outs


def check(
    path: str | os.PathLike[str],
    batch_sizes: Sequence[int] | None = None,
    config_pbtxt: str | os.PathLike[str] | None = None,
    dims: dict[str, int] | None = None,
    inline_max_elements: int = DEFAULT_INLINE_MAX_ELEMENTS,
) -> dict[str, Any]:
    """Explains the ONNX model at PATH without writing anything: imports and lowers it at each
    batch size (arguments as for :func:`convert`). Returns::

        {"file": ..., "ok": bool, "batched": bool, "max_batch_size": 8,
         "inputs": [{"name", "data_type", "dims"}],  # dims as in the model ("batch" symbolic)
         "outputs": [...],
         "ops": {"Conv": {"nodes": 1, "converts": [1, 2, 4, 8], "fails": [], "unchecked": []},
                 ...},
         "batch_sizes": {"1": {"ok": true, "seconds": 0.4}, "2": {"ok": false, "error": ...,
                         "ops": ["Det"]}},   # "all" for a model without a batch dimension
         "weights": {"count", "bytes", "inline_constants"}, "notes": [...]}

    ``converts`` lists the batch sizes at which the whole program lowered (``[null]`` for an
    unbatched model), ``fails`` those at which a node of that op did not, ``unchecked`` those
    at which the lowering stopped at another op first (torch-mlir's later passes stop at the
    first failure; the first, ONNX -> torch, is re-run past each failed op type, so that every
    op type without a conversion pattern is named).

    Raises:
        ConversionError: the file cannot be read or checked, or the configuration does not fit
            the model (nothing could be tried).
    """
    p = Path(path)
    prep = _prepare(p, batch_sizes, config_pbtxt, dims, inline_max_elements)
    layout = prep.layout
    ops: dict[str, dict[str, Any]] = {
        k: {"nodes": v, "converts": [], "fails": [], "unchecked": []} for k, v in prep.ops.items()
    }
    per: dict[str, Any] = {}
    for bs in layout.batch_sizes if layout.batched else [None]:
        key = str(bs) if bs is not None else "all"
        where = f" at batch size {bs}" if bs is not None else ""
        failed: set[str] = set()
        ok = False
        try:
            low = _lower_one(prep, bs, "HIGHEST", "text", None)
            _check_signature(p, layout, prep.lifted, low, bs)
            per[key] = {"ok": True, "seconds": round(low.seconds, 3)}
            ok = True
        except _Unconverted as u:
            failed = set(u.ops)
            e = _unconverted_error(p, where, u)
            per[key] = {"ok": False, "error": str(e), "ops": e.ops, "nodes": e.nodes}
        except ConversionError as e:
            msg = str(e) if str(e).startswith(str(p)) else f"{p}{where}: {e}"
            per[key] = {"ok": False, "error": msg, "ops": []}
        for k, v in ops.items():
            # A failed program says nothing of the ops not blamed: the lowering stopped early.
            (v["converts"] if ok else v["fails"] if k in failed else v["unchecked"]).append(bs)
    return {
        "file": str(p),
        "ok": all(v["ok"] for v in per.values()),
        "batched": layout.batched,
        "max_batch_size": layout.max_batch_size,
        "inputs": [_model_io(t) for t in layout.inputs],
        "outputs": [_model_io(t) for t in layout.outputs],
        "ops": ops,
        "batch_sizes": per,
        "weights": {
            "count": len(prep.lifted.weights),
            "bytes": int(sum(a.nbytes for a in prep.lifted.weights.values())),
            "inline_constants": prep.lifted.inline_constants,
        },
        "dims": layout.dim_sizes,
        "notes": layout.notes,
        "opset_upgrade": prep.opset_upgrade,
    }


def _model_io(t: TensorDesc) -> dict[str, Any]:
    dt = _DTYPES.get(t.elem_type, (None, _ONNX_TYPE_NAMES.get(t.elem_type, "?")))[1]
    return {"name": t.name, "data_type": dt, "dims": t.dims}


def _check_text(report: dict[str, Any]) -> str:
    """The human-readable form of a :func:`check` report."""
    lines = [f"{report['file']}:"]
    mbs = report["max_batch_size"]
    lines.append(
        "  batch dimension: "
        + (f"yes, max_batch_size {mbs}" if report["batched"] else "none (one program)")
    )
    for kind in ("inputs", "outputs"):
        for t in report[kind]:
            lines.append(
                f"  {kind[:-1]} {t['name']}: {t['data_type']} {_fmt_dims(t['dims'] or [])}"
            )
    w = report["weights"]
    lines.append(
        f"  weights: {w['count']} lifted into weights.safetensors ({w['bytes']} bytes), "
        f"{w['inline_constants']} small constants inline"
    )
    lines.append("  ops:")
    width = max((len(k) for k in report["ops"]), default=0)
    for k, v in report["ops"].items():
        conv = ", ".join("all" if b is None else str(b) for b in v["converts"])
        fails = ", ".join("all" if b is None else str(b) for b in v["fails"])
        status = []
        if v["converts"]:
            status.append(f"converts at {conv}" if report["batched"] else "converts")
        if v["fails"]:
            status.append(
                f"does not convert at {fails}" if report["batched"] else "does not convert"
            )
        if v["unchecked"]:
            unk = ", ".join("all" if b is None else str(b) for b in v["unchecked"])
            status.append(
                f"not checked at {unk} (the lowering stopped at another op)"
                if report["batched"]
                else "not checked (the lowering stopped at another op)"
            )
        lines.append(f"    {k:<{width}}  x{v['nodes']:<3} {'; '.join(status)}")
    for key, v in report["batch_sizes"].items():
        label = f"batch size {key}" if key != "all" else "program"
        lines.append(f"  {label}: " + (f"ok ({v['seconds']} s)" if v["ok"] else v["error"]))
    for n in report["notes"]:
        lines.append(f"  note: {n}")
    up = report.get("opset_upgrade")
    if up:
        lines.append(
            f"  note: converted after upgrading opset {up['from']} to {up['to']} with "
            f"onnx.version_converter ({up['why']})"
        )
    lines.append("ok" if report["ok"] else "does not convert")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The command line.


def _parse_batch_sizes(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"batch sizes are counts joined by commas, not {s!r}"
        ) from None
    if not out or any(b < 1 for b in out):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive counts, not {s!r}")
    return out


def _parse_dim(s: str) -> tuple[str, int]:
    name, sep, size = s.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, int(size)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dim takes NAME=SIZE, not {s!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring). Returns the exit status: 0 done (for ``--check``:
    every batch size converts), 1 an error or ops that do not convert (one line on stderr,
    ``tpubox.onnx_convert: error: ...``; an unexpected exception too, its traceback only with
    ``TPUBOX_ONNX_CONVERT_TRACEBACK=1``), 2 a usage error (argparse's)."""
    ap = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Convert an ONNX model into a StableHLO model directory for tpubox serve "
        "(one program per batch size, weights.safetensors, plan.json, config.toml), or explain "
        "it with --check.",
    )
    ap.add_argument("model", help="the ONNX file (model.onnx); external data beside it")
    ap.add_argument("--out", help="the directory to write (created if missing)")
    ap.add_argument("--check", action="store_true", help="explain the model, write nothing")
    ap.add_argument("--json", action="store_true", help="with --check: print the report as JSON")
    ap.add_argument(
        "--batch-sizes",
        type=_parse_batch_sizes,
        help="programs' batch sizes, e.g. 1,2,4,8 (default: powers of two up to config.pbtxt's "
        "max_batch_size and it, else 1,2,4,8)",
    )
    ap.add_argument("--config-pbtxt", help="Triton's config.pbtxt of the model")
    ap.add_argument(
        "--dim",
        action="append",
        type=_parse_dim,
        default=[],
        metavar="NAME=SIZE",
        help="size of a symbolic dimension other than the batch (repeatable)",
    )
    ap.add_argument("--precision", default="highest", choices=sorted(_PRECISIONS))
    ap.add_argument("--format", default="bytecode", choices=["bytecode", "text"])
    ap.add_argument(
        "--inline-max-elements",
        type=int,
        default=DEFAULT_INLINE_MAX_ELEMENTS,
        help="tensors of at most this many elements stay inline constants (default %(default)s)",
    )
    ap.add_argument("--target-version", help="StableHLO version of the VHLO bytecode")
    args = ap.parse_args(argv)
    if not args.check and not args.out:
        ap.error("--out DIR is required (or --check)")
    dims = dict(args.dim)
    try:
        if args.check:
            report = check(
                args.model, args.batch_sizes, args.config_pbtxt, dims, args.inline_max_elements
            )
            print(json.dumps(report, indent=2) if args.json else _check_text(report))
            return 0 if report["ok"] else 1
        plan = convert(
            args.model,
            args.out,
            args.batch_sizes,
            args.config_pbtxt,
            dims,
            args.precision,
            args.format,
            args.inline_max_elements,
            args.target_version,
        )
    except ConversionError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: one line for the caller, the traceback on request
        if os.environ.get("TPUBOX_ONNX_CONVERT_TRACEBACK"):
            import traceback

            traceback.print_exc()
        print(
            f"{PROG}: error: {args.model}: internal error of the converter: "
            f"{type(e).__name__}: {_first_lines(str(e), 4)} (TPUBOX_ONNX_CONVERT_TRACEBACK=1 "
            "prints the traceback)",
            file=sys.stderr,
        )
        return 1
    progs = ", ".join(p["file"] for p in plan["stablehlo"]["program"])
    print(
        f"{args.out}: {progs}; {plan['weights']['count']} weights "
        f"({plan['weights']['bytes']} bytes); {plan['seconds']['total']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
