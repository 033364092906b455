"""tpubox.onnx_convert (issue 49): ONNX models converted into StableHLO model directories, each
program's outputs equal to ONNX Runtime's on the same inputs (rtol 1e-4), the weights in
weights.safetensors and not in the programs, and the failures named (ops that do not convert,
truncated and corrupt files, configurations that do not fit).

The ONNX models are built offline (onnx_models.py) into one directory per run, converted by
``python -m tpubox.onnx_convert`` in the converter's own venv (a helper process, as the daemon
will run it), and the programs checked against ONNX Runtime on the CPU (programs.py: ``tpubox
exec`` where the binary is built, JAX otherwise).

Interpreters (``$CACHE`` is ``~/.cache/tpubox``):
- this one (pytest, the model building, ONNX Runtime, JAX): ``$CACHE/venv-onnx-export``, made
  from scripts/venvs/onnx-export.txt (torch, transformers, onnx, onnxscript, onnxruntime, jax):
  ``$CACHE/venv-onnx-export/bin/python -m pytest python/tests/onnx -q`` (this directory's
  pytest.ini makes it the rootdir: python/tests/conftest.py and its daemon are not loaded);
- the converter's: ``TPUBOX_ONNX_PYTHON``, default ``$CACHE/venv-onnx/bin/python``, made from
  scripts/venvs/onnx.txt (torch-mlir, onnx; no torch). ``python/`` is put on its PYTHONPATH.

Where onnx or onnxruntime is missing (the venv of the other Python tests, which collects this
directory too), the module is skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

# (onnx.helper, not onnx: from python/tests, this directory itself imports as a namespace
# package `onnx` where the real one is missing.)
pytest.importorskip("onnx.helper")
ort = pytest.importorskip("onnxruntime")
import onnx  # noqa: E402

import onnx_models  # noqa: E402
import programs  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("TPUBOX_CACHE_DIR") or Path.home() / ".cache" / "tpubox")


def converter_python() -> Path:
    p = Path(os.environ.get("TPUBOX_ONNX_PYTHON") or CACHE / "venv-onnx" / "bin" / "python")
    if not p.exists():
        pytest.exit(
            f"{p} is missing: python3 -m venv {CACHE}/venv-onnx && {CACHE}/venv-onnx/bin/pip "
            "install --only-binary :all: -r scripts/venvs/onnx.txt, or set TPUBOX_ONNX_PYTHON",
            returncode=1,
        )
    return p


class Converter:
    """Runs ``python -m tpubox.onnx_convert`` in the converter's venv."""

    def __init__(self, python: Path):
        self.python = python

    def run(self, *args: Any, ok: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO / "python")
        r = subprocess.run(
            [str(self.python), "-m", "tpubox.onnx_convert", *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        if ok:
            assert r.returncode == 0, (
                f"onnx_convert {args} failed ({r.returncode}):\n{r.stderr[-4000:]}"
            )
        return r

    def convert(self, model: Path, out: Path, *args: Any) -> dict[str, Any]:
        """Converts MODEL into OUT; returns plan.json."""
        self.run(model, "--out", out, *args)
        return json.loads((out / "plan.json").read_text())


@pytest.fixture(scope="module")
def converter() -> Converter:
    return Converter(converter_python())


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx-models")


RTOL = 1e-4
ATOL = 1e-5  # for outputs near zero (softmax tails, centred activations)


def _onnxruntime(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def _check_against_onnxruntime(
    model: Path, out: Path, plan: dict[str, Any], feeds: Callable[[int], dict[str, np.ndarray]]
) -> None:
    """Every program of OUT against ONNX Runtime on MODEL, on the same inputs."""
    for prog in plan["stablehlo"]["program"]:
        bs = prog.get("batch_size")
        f = feeds(bs or 1)
        want = _onnxruntime(model, f)
        got = programs.run_program(out, plan, bs, f)
        assert list(got) == plan["stablehlo"]["results"]
        for name, g in got.items():
            np.testing.assert_allclose(
                g, want[name], rtol=RTOL, atol=ATOL,
                err_msg=f"{model.parent.name} batch size {bs} output {name} "
                f"({programs.runner()})",
            )  # fmt: skip


def _check_weights(model: Path, out: Path, plan: dict[str, Any], inline_max: int = 8) -> None:
    """weights.safetensors holds every initializer of MODEL with more than INLINE_MAX elements
    (its ONNX name, its value), the plan's weight parameters are exactly those, and the
    programs hold no weight: no constant of theirs has more than INLINE_MAX elements but
    splats and index ranges."""
    m = onnx.load(str(model))
    from onnx import numpy_helper

    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    weights = programs.read_safetensors(out / "weights.safetensors")
    params = [p["weight"] for p in plan["stablehlo"]["parameters"] if "weight" in p]
    assert sorted(params) == sorted(weights)
    big = {k for k, v in inits.items() if v.size > inline_max}
    assert big <= set(weights), f"initializers not lifted: {sorted(big - set(weights))}"
    for k, v in weights.items():
        if k in inits:
            np.testing.assert_array_equal(v, inits[k])
    assert plan["weights"]["count"] == len(weights)
    total = sum(v.size for v in weights.values())
    for prog in plan["stablehlo"]["program"]:
        size = (out / prog["file"]).stat().st_size
        assert size < max(64 * 1024, total), f"{prog['file']} is {size} bytes"


def _dense_constants(text: str) -> list[tuple[str, int]]:
    """(values, element count) of every non-splat dense constant of a StableHLO text."""
    out = []
    for m in re.finditer(r"dense<(\[[^>]*\])> : tensor<([0-9x]*)x?[a-z]+[0-9]*>", text):
        dims = [int(d) for d in m.group(2).split("x") if d]
        out.append((m.group(1), int(np.prod(dims)) if dims else 1))
    return out


# ---------------------------------------------------------------------------------------------
# Conversions (each model converted once per run).


@pytest.fixture(scope="module")
def helper_graph(models_dir: Path, converter) -> tuple[Path, Path, dict[str, Any], Any]:
    model, feeds = onnx_models.helper_graph(models_dir / "helper_graph")
    out = models_dir / "helper_graph.out"
    plan = converter.convert(model, out, "--batch-sizes", "1,2,4,8")
    return model, out, plan, feeds


def test_helper_graph_matches_onnxruntime(helper_graph) -> None:
    model, out, plan, feeds = helper_graph
    _check_against_onnxruntime(model, out, plan, feeds)


def test_helper_graph_plan(helper_graph) -> None:
    model, out, plan, _ = helper_graph
    assert plan["format"] == 1
    assert plan["max_batch_size"] == 8
    assert plan["input"] == [
        {"name": "img", "data_type": "TYPE_FP32", "dims": [3, 8, 8]},
        {"name": "ids", "data_type": "TYPE_INT64", "dims": [5]},
    ]
    assert plan["output"] == [
        {"name": "probs", "data_type": "TYPE_FP32", "dims": [6, 6]},
        {"name": "gr", "data_type": "TYPE_FP32", "dims": [16]},
    ]
    s = plan["stablehlo"]
    assert s["weights"] == "weights.safetensors"
    assert s["results"] == ["probs", "gr"]
    assert s["parameters"][:2] == [{"input": "img"}, {"input": "ids"}]
    assert {p["weight"] for p in s["parameters"][2:]} == {
        "conv.w", "fc.w", "fc.b", "emb", "ln.scale", "ln.bias", "proj",
    }  # fmt: skip
    assert s["program"] == [{"batch_size": b, "file": f"model.b{b}.mlirbc"} for b in (1, 2, 4, 8)]
    assert plan["ops"] == {
        "Concat": 1, "Conv": 1, "Gather": 1, "Gemm": 1, "LayerNormalization": 1, "MatMul": 2,
        "Relu": 2, "Reshape": 1, "Softmax": 1, "Transpose": 1, "Unsqueeze": 1,
    }  # fmt: skip
    assert plan["source"]["sha256"] and plan["converter"]["path"] == "torch-mlir-onnx-importer"
    assert plan["converter"]["program_format"] == "vhlo-bytecode"
    for prog in s["program"]:  # portable VHLO bytecode (MLIR bytecode magic "ML\xefR")
        assert (out / prog["file"]).read_bytes()[:4] == b"ML\xefR"
    # config.toml: the same configuration, as tpubox serve reads a StableHLO model directory.
    cfg = tomllib.loads((out / "config.toml").read_text())
    assert cfg["max_batch_size"] == 8
    assert cfg["input"] == plan["input"] and cfg["output"] == plan["output"]
    assert cfg["tpubox"]["stablehlo"] == s
    _check_weights(model, out, plan)


def test_helper_graph_check(helper_graph, converter) -> None:
    """--check explains the model: ops, batch sizes, weights; nothing written."""
    model = helper_graph[0]
    r = converter.run(model, "--check", "--batch-sizes", "2,4", "--json")
    report = json.loads(r.stdout)
    assert report["ok"] and report["batched"] and report["max_batch_size"] == 4
    assert report["ops"]["LayerNormalization"] == {
        "nodes": 1,
        "converts": [2, 4],
        "fails": [],
        "unchecked": [],
    }
    assert set(report["batch_sizes"]) == {"2", "4"}
    assert report["inputs"][0] == {"name": "img", "data_type": "TYPE_FP32", "dims": ["N", 3, 8, 8]}
    assert report["weights"]["count"] == 7
    text = converter.run(model, "--check", "--batch-sizes", "2,4").stdout
    assert re.search(r"Gemm\s+x1\s+converts at 2, 4", text), text
    assert text.rstrip().endswith("ok")


def test_weights_not_in_program_text(models_dir: Path, converter) -> None:
    """StableHLO text of the tiny BERT: no constant holds a weight (what is left are splats and
    position indices)."""
    pytest.importorskip("transformers")
    model, _ = _bert(models_dir)
    out = models_dir / "bert.text"
    plan = converter.convert(model, out, "--batch-sizes", "2", "--format", "text")
    text = (out / "model.b2.mlir").read_text()
    assert text.lstrip().startswith("module")
    assert "func.func public @main(" in text or "func.func @main(" in text
    assert "dense_resource" not in text
    consts = _dense_constants(text)
    assert all(n <= 8 for _, n in consts), [c for c in consts if c[1] > 8]
    assert plan["weights"]["count"] >= 16 and plan["weights"]["bytes"] > 80_000
    assert len(text) < plan["weights"]["bytes"] / 2
    # Every dot is at HIGHEST precision (the default), as ONNX Runtime computes in f32.
    dots = re.findall(r"stablehlo\.dot_general[^\n]*", text)
    assert dots and all("precision = [HIGHEST, HIGHEST]" in d for d in dots), dots[:2]


def test_static_graph_one_program(models_dir: Path, converter) -> None:
    model, feeds = onnx_models.static_graph(models_dir / "static_graph")
    out = models_dir / "static_graph.out"
    plan = converter.convert(model, out, "--batch-sizes", "1,2")
    assert plan["max_batch_size"] == 0
    assert plan["stablehlo"]["program"] == [{"file": "model.mlirbc"}]
    assert plan["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, 4]}]
    assert plan["stablehlo"]["parameters"] == [{"input": "x"}, {"weight": "W"}]  # b: 5 elements
    assert any("no batch dimension" in n for n in plan["notes"])
    cfg = tomllib.loads((out / "config.toml").read_text())
    assert (
        cfg["max_batch_size"] == 0 and "batch_size" not in cfg["tpubox"]["stablehlo"]["program"][0]
    )
    _check_against_onnxruntime(model, out, plan, feeds)


def test_symbolic_dims_need_a_size(models_dir: Path, converter) -> None:
    model, feeds = onnx_models.two_dynamic_dims(models_dir / "two_dims")
    r = converter.run(model, "--out", models_dir / "two_dims.bad", ok=False)
    assert r.returncode == 1
    assert "input `x` dimension 1 is `S`" in r.stderr and "--dim S=SIZE" in r.stderr
    out = models_dir / "two_dims.out"
    plan = converter.convert(model, out, "--batch-sizes", "1,3", "--dim", "S=5")
    assert plan["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [5, 4]}]
    assert plan["dims"] == {"S": 5}
    assert [p["batch_size"] for p in plan["stablehlo"]["program"]] == [1, 3]
    _check_against_onnxruntime(model, out, plan, feeds)


def test_resize(models_dir: Path, converter) -> None:
    """Resize (nearest, linear, cubic), which torch-mlir leaves unlowered, rewritten into
    gathers: equal to ONNX Runtime."""
    model, feeds = onnx_models.resize_graph(models_dir / "resize")
    out = models_dir / "resize.out"
    plan = converter.convert(model, out, "--batch-sizes", "1,2")
    assert plan["ops"] == {"Resize": 3}
    _check_against_onnxruntime(model, out, plan, feeds)


def test_old_opset_upgraded(models_dir: Path, converter) -> None:
    """Opset-11 ops without a torch-mlir pattern: the model is upgraded to opset 18 with
    onnx.version_converter and converts; the plan says so."""
    model, feeds = onnx_models.old_opset_graph(models_dir / "old_opset")
    out = models_dir / "old_opset.out"
    plan = converter.convert(model, out, "--batch-sizes", "1,3")
    up = plan["opset_upgrade"]
    assert up["from"] == 11 and up["to"] == 18
    assert "Softmax" in up["why"] and "Unsqueeze" in up["why"]
    _check_against_onnxruntime(model, out, plan, feeds)


def test_config_pbtxt(helper_graph, models_dir: Path, converter) -> None:
    """Triton's config.pbtxt decides max_batch_size, the default batch sizes, and which outputs
    the programs return; its names, types and dims are checked against the model."""
    model, _, _, feeds = helper_graph
    pbtxt = models_dir / "config.pbtxt"
    pbtxt.write_text(
        """
        name: "helper"   # as Triton writes it
        platform: "onnxruntime_onnx"
        max_batch_size: 4
        input [
          { name: "img" data_type: TYPE_FP32 dims: [ 3, 8, 8 ] },
          { name: "ids", data_type: TYPE_INT64, dims: [ -1 ] }
        ]
        output [ { name: "probs" data_type: TYPE_FP32 dims: [ 6, 6 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 100 }
        instance_group [ { kind: KIND_CPU count: 1 } ]
        """
    )
    out = models_dir / "helper.pbtxt.out"
    plan = converter.convert(model, out, "--config-pbtxt", pbtxt)
    assert plan["max_batch_size"] == 4
    assert [p["batch_size"] for p in plan["stablehlo"]["program"]] == [1, 2, 4]
    assert plan["stablehlo"]["results"] == ["probs"]
    assert plan["output"] == [{"name": "probs", "data_type": "TYPE_FP32", "dims": [6, 6]}]
    # only the weights the selected output needs: the Gemm branch feeds probs too
    _check_against_onnxruntime(model, out, plan, feeds)

    bad = models_dir / "bad.pbtxt"
    bad.write_text('max_batch_size: 8 input [{ name: "img" data_type: TYPE_FP16 dims: [3, 8, 8] }]')
    r = converter.run(model, "--out", models_dir / "bad.out", "--config-pbtxt", bad, ok=False)
    assert (
        r.returncode == 1 and "config.pbtxt does not declare the model's input(s) ids" in r.stderr
    )
    bad.write_text(
        'max_batch_size: 8 input [{ name: "img" data_type: TYPE_FP16 dims: [3, 8, 8] },'
        '{ name: "ids" data_type: TYPE_INT64 dims: [5] }]'
    )
    r = converter.run(model, "--out", models_dir / "bad.out", "--config-pbtxt", bad, ok=False)
    assert "config.pbtxt says input `img` is TYPE_FP16, the model has TYPE_FP32" in r.stderr
    bad.write_text('max_batch_size: 8 output [{ name: "logits" }]')
    r = converter.run(model, "--out", models_dir / "bad.out", "--config-pbtxt", bad, ok=False)
    assert "config.pbtxt's output `logits` is no output of the model" in r.stderr
    bad.write_text("max_batch_size: 8 input [{ name: ")
    r = converter.run(model, "--out", models_dir / "bad.out", "--config-pbtxt", bad, ok=False)
    assert r.returncode == 1 and "bad.pbtxt:1:" in r.stderr
    assert not (models_dir / "bad.out").exists()


# ---------------------------------------------------------------------------------------------
# Models exported from PyTorch.


def _bert(models_dir: Path) -> tuple[Path, Any]:
    d = models_dir / "tiny_bert"
    if not (d / "model.onnx").exists():
        return onnx_models.tiny_bert(d)
    return d / "model.onnx", onnx_models.tiny_bert_feeds


def test_torch_onnx_export(models_dir: Path, converter) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    model, feeds = onnx_models.torch_exported(models_dir / "torch_exported")
    out = models_dir / "torch_exported.out"
    plan = converter.convert(model, out, "--batch-sizes", "1,2,5")
    assert [p["batch_size"] for p in plan["stablehlo"]["program"]] == [1, 2, 5]
    assert plan["input"][1] == {"name": "ids", "data_type": "TYPE_INT64", "dims": [6]}
    assert "Resize" in plan["ops"]  # the bilinear upsampling
    _check_against_onnxruntime(model, out, plan, feeds)
    _check_weights(model, out, plan)


def test_tiny_bert(models_dir: Path, converter) -> None:
    pytest.importorskip("transformers")
    model, feeds = _bert(models_dir)
    out = models_dir / "tiny_bert.out"
    plan = converter.convert(model, out, "--batch-sizes", "1,3,4")
    assert plan["stablehlo"]["results"] == ["last_hidden_state", "pooler_output"]
    assert plan["output"][0] == {
        "name": "last_hidden_state",
        "data_type": "TYPE_FP32",
        "dims": [8, 32],
    }
    assert {"LayerNormalization", "MatMul", "Softmax", "Gather"} <= set(plan["ops"])
    _check_against_onnxruntime(model, out, plan, feeds)
    _check_weights(model, out, plan)


def test_tiny_resnet(models_dir: Path, converter) -> None:
    pytest.importorskip("transformers")
    model, feeds = onnx_models.tiny_resnet(models_dir / "tiny_resnet")
    out = models_dir / "tiny_resnet.out"
    plan = converter.convert(model, out, "--batch-sizes", "1,2")
    assert plan["output"] == [
        {"name": "pooler_output", "data_type": "TYPE_FP32", "dims": [16, 1, 1]}
    ]
    assert {"Conv", "MaxPool", "Relu"} <= set(plan["ops"])
    _check_against_onnxruntime(model, out, plan, feeds)
    _check_weights(model, out, plan)


# ---------------------------------------------------------------------------------------------
# Failures.


def test_unknown_op_is_named(models_dir: Path, converter) -> None:
    model = onnx_models.unknown_op_graph(models_dir / "unknown_op")
    out = models_dir / "unknown_op.out"
    r = converter.run(model, "--out", out, ok=False)
    assert r.returncode == 1
    assert r.stderr.startswith("tpubox.onnx_convert: error: ")
    assert "ops that do not convert to StableHLO" in r.stderr
    assert "com.example.FancyNorm (fancy)" in r.stderr
    assert "Relu" not in r.stderr.split("[")[0]  # downstream of the custom op: not blamed
    assert not out.exists()
    r = converter.run(model, "--check", "--json", "--batch-sizes", "2", ok=False)
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert not report["ok"]
    assert report["ops"]["com.example.FancyNorm"]["fails"] == [2]
    assert report["ops"]["MatMul"]["unchecked"] == [2]
    assert report["batch_sizes"]["2"]["ops"] == ["com.example.FancyNorm"]


def test_unconvertible_standard_op_is_named(models_dir: Path, converter) -> None:
    model = onnx_models.det_graph(models_dir / "det")
    r = converter.run(model, "--out", models_dir / "det.out", "--batch-sizes", "2", ok=False)
    assert r.returncode == 1
    assert "ops that do not convert to StableHLO at batch size 2: Det (determinant)" in r.stderr
    r = converter.run(model, "--check", "--batch-sizes", "2", ok=False)
    assert re.search(r"Det\s+x1\s+does not convert at 2", r.stdout), r.stdout
    assert re.search(r"Relu\s+x1\s+not checked at 2", r.stdout), r.stdout


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "missing"])
def test_damaged_file(helper_graph, models_dir: Path, converter, damage: str) -> None:
    src = helper_graph[0]
    bad = models_dir / f"damaged-{damage}" / "model.onnx"
    bad.parent.mkdir(exist_ok=True)
    data = src.read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "empty":
        bad.write_bytes(b"")
    elif damage == "garbage":
        bad.write_bytes(b"\xff\xfe not a protobuf at all \x00\x01" * 10)
    for args in (("--out", bad.parent / "out"), ("--check",)):
        r = converter.run(bad, *args, ok=False)
        assert r.returncode == 1, r.stdout
        assert r.stderr.startswith(f"tpubox.onnx_convert: error: {bad}: "), r.stderr
        assert "Traceback" not in r.stderr
        want = {
            "truncated": "truncated or corrupt",
            "empty": "the file is empty",
            "garbage": "truncated or corrupt",
            "missing": "cannot read it",
        }[damage]
        assert want in r.stderr, r.stderr
    assert not (bad.parent / "out").exists()


def test_external_data(helper_graph, models_dir: Path, converter) -> None:
    """Weights in an external data file beside the model (as exporters write models over
    2 GB): read and lifted as from the model itself; a missing file is named."""
    src, out0, _, feeds = helper_graph
    d = models_dir / "external"
    d.mkdir(exist_ok=True)
    m = onnx.load(str(src))
    onnx.save(
        m,
        str(d / "model.onnx"),
        save_as_external_data=True,
        location="weights.bin",
        size_threshold=64,
    )
    assert (d / "weights.bin").is_file()
    plan = converter.convert(d / "model.onnx", d / "out", "--batch-sizes", "2")
    assert (d / "out" / "weights.safetensors").read_bytes() == (
        out0 / "weights.safetensors"
    ).read_bytes()
    _check_against_onnxruntime(src, d / "out", plan, feeds)
    (d / "weights.bin").rename(d / "elsewhere.bin")
    r = converter.run(d / "model.onnx", "--out", d / "out2", ok=False)
    assert r.returncode == 1
    assert (
        "cannot load the ONNX model or its external data" in r.stderr and "weights.bin" in r.stderr
    )


def test_usage_errors(helper_graph, converter) -> None:
    model = helper_graph[0]
    r = converter.run(model, ok=False)
    assert r.returncode == 2 and "--out DIR is required" in r.stderr
    r = converter.run(model, "--check", "--batch-sizes", "0,2", ok=False)
    assert r.returncode == 2 and "positive" in r.stderr
    r = converter.run(model, "--check", "--dim", "N=3", ok=False)
    assert r.returncode == 1 and "`N` is the batch dimension" in r.stderr


# ---------------------------------------------------------------------------------------------
# The daemon's own check, where the binary is built.


def test_tpubox_model_check(helper_graph, models_dir: Path) -> None:
    """The converted directory is a StableHLO model directory `tpubox model check` accepts."""
    binary = programs.tpubox_bin()
    if binary is None:
        pytest.skip("no tpubox binary (TPUBOX_BIN or target/release/tpubox)")
    out = helper_graph[1]
    d = models_dir / "helper_checked"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(out, d)
    r = subprocess.run(
        [str(binary), "model", "check", str(d)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "batch size 8" in r.stdout and r.stdout.rstrip().endswith("ok")
