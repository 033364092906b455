"""wasmtime's own wasi-nn ONNX classification example, unchanged, under `tpubox run` (issue 52).

The component is built from wasmtime/crates/wasi-nn/examples/classification-component-onnx
(vendored byte for byte, see wasmtime/README.md) by `bash scripts/dev.sh setup` into
$CARGO_TARGET_DIR/wasi-nn/classification-component-onnx.wasm. It reads its model, labels and
image from the preopened directory `fixture`; the fixture here is make_fixture.py's small
offline stand-in of SqueezeNet, and the expected top three come from reference.py (ONNX
Runtime on the same preprocessing):

    tpubox run --dir FIXTURE::fixture classification-component-onnx.wasm

    Read ONNX model, size in bytes: 157114
    No execution target specified, defaulting to CPU
    Usage: <program> [cpu|gpu|cuda]
    Loaded graph into wasi-nn with ExecutionTarget::Cpu target
    Created wasi-nn execution context.
    Read ONNX Labels, # of labels: 1000
    Executed graph inference
    Retrieved output data with length: 4000
    Index: n90000632 synthetic class 632, label 632 - Probability: 0.25832587
    ...

Run with the venv that has ONNX Runtime (`bash scripts/dev.sh test` does):
`$CACHE/venv-onnx-export/bin/python -m pytest tests/wasi-nn -q`. Environment: TPUBOX_BIN
(default $CARGO_TARGET_DIR/release/tpubox, else target/release/tpubox), CARGO_TARGET_DIR,
TPUBOX_WASI_NN_EXAMPLE (the component, default as above), TPUBOX_ONNX_PYTHON (the ONNX
converter's Python, default $CACHE/venv-onnx/bin/python; passed on to tpubox too).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "python" / "tests"))

import make_fixture  # noqa: E402
import reference  # noqa: E402
from tpubox_daemon import binary, target_dir  # noqa: E402  (python/tests)

CACHE = Path(os.environ.get("TPUBOX_CACHE_DIR") or Path.home() / ".cache" / "tpubox")
TOLERANCE = 1e-4  # |printed probability - reference|
INDEX_LINE = re.compile(r"^Index: (?P<label>.*) - Probability: (?P<p>\S+)$")


def example_wasm() -> Path:
    p = Path(
        os.environ.get("TPUBOX_WASI_NN_EXAMPLE")
        or target_dir() / "wasi-nn" / "classification-component-onnx.wasm"
    )
    if not p.is_file():
        pytest.fail(f"{p} is missing: bash scripts/dev.sh setup builds it (build_wasi_nn_example)")
    return p.resolve()


def converter_python() -> Path:
    p = Path(os.environ.get("TPUBOX_ONNX_PYTHON") or CACHE / "venv-onnx" / "bin" / "python")
    if not p.exists():
        pytest.fail(
            f"{p} is missing: bash scripts/dev.sh setup makes it (scripts/venvs/onnx.txt), "
            "or set TPUBOX_ONNX_PYTHON"
        )
    return p


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    return make_fixture.write_fixture(tmp_path_factory.mktemp("wasi-nn") / "fixture")


@pytest.fixture(scope="module")
def expected(fixture_dir) -> list[tuple[str, float]]:
    return reference.reference_top3(fixture_dir)


def test_reference_is_unambiguous(fixture_dir, expected):
    """The top three stand apart by much more than the tolerance, so their order is the
    model's, not rounding's; the image decodes to the intended levels."""
    assert len(expected) == 3
    margins = reference.reference_margins(fixture_dir)
    assert min(margins) > 10 * TOLERANCE, margins
    gray = make_fixture.decode_gray_jpeg((fixture_dir / make_fixture.IMAGE).read_bytes())
    assert (gray == make_fixture.image_levels()).all()


def test_fixture_model_converts(fixture_dir, tmp_path):
    """The fixture's model converts with tpubox's ONNX converter (python -m tpubox.onnx_convert),
    keeping the example's input and output names and shapes."""
    r = subprocess.run(
        [str(converter_python()), "-m", "tpubox.onnx_convert",
         str(fixture_dir / make_fixture.MODEL), "--check", "--json"],
        env=dict(os.environ, PYTHONPATH=str(REPO / "python")),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert '"squeezenet0_flatten0_reshape0"' in r.stdout and '"data"' in r.stdout, r.stdout


def test_wasmtime_example_classifies(fixture_dir, expected):
    """`tpubox run --dir FIXTURE::fixture` of the unchanged example prints what wasmtime's
    wasi-nn (ONNX Runtime) would: every line, the top three labels in order, and their
    probabilities within TOLERANCE of ONNX Runtime's."""
    # Should the host convert the model with tpubox's ONNX converter, as `tpubox serve` does.
    onnx_python = os.environ.get("TPUBOX_ONNX_PYTHON") or CACHE / "venv-onnx" / "bin" / "python"
    env = dict(
        os.environ,
        TPUBOX_ONNX_PYTHON=str(onnx_python),
        TPUBOX_ONNX_PYTHONPATH=str(REPO / "python"),
    )
    cmd = [str(binary()), "run", "--dir", f"{fixture_dir}::fixture", str(example_wasm())]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    said = (
        f"$ {' '.join(cmd)}\nexit {r.returncode}\n"
        f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    )
    assert r.returncode == 0, said

    lines = r.stdout.splitlines()
    model_bytes = (fixture_dir / make_fixture.MODEL).stat().st_size
    assert lines[:8] == [
        f"Read ONNX model, size in bytes: {model_bytes}",
        "No execution target specified, defaulting to CPU",
        "Usage: <program> [cpu|gpu|cuda]",
        "Loaded graph into wasi-nn with ExecutionTarget::Cpu target",
        "Created wasi-nn execution context.",
        "Read ONNX Labels, # of labels: 1000",
        "Executed graph inference",
        "Retrieved output data with length: 4000",
    ], said
    assert len(lines) == 11, said
    got = []
    for line in lines[8:]:
        m = INDEX_LINE.match(line)
        assert m, f"not an Index line: {line!r}\n{said}"
        got.append((m["label"], float(m["p"])))
    assert [label for label, _ in got] == [label for label, _ in expected], (got, expected, said)
    for (label, p), (_, want) in zip(got, expected):
        assert abs(p - want) <= TOLERANCE, f"{label}: {p} (reference {want})\n{said}"
