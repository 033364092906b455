"""The ONNX converter's tests: ONNX models built offline (onnx_models.py) into one directory per
run, converted by ``python -m tpubox.onnx_convert`` in the converter's own venv (a helper
process, as the daemon will run it), and the programs checked against ONNX Runtime on the CPU
(programs.py: ``tpubox exec`` where the binary is built, JAX otherwise).

Interpreters:
- this one (pytest, the model building, ONNX Runtime, JAX): ``$CACHE/venv-onnx-export``, made
  from scripts/venvs/onnx-export.txt (torch, transformers, onnx, onnxscript, onnxruntime, jax);
- the converter's: ``TPUBOX_ONNX_PYTHON``, default ``$CACHE/venv-onnx/bin/python``, made from
  scripts/venvs/onnx.txt (torch-mlir, onnx; no torch). ``python/`` is put on its PYTHONPATH.

``$CACHE`` is ``~/.cache/tpubox``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

CACHE = Path(os.environ.get("TPUBOX_CACHE_DIR") or Path.home() / ".cache" / "tpubox")


def converter_python() -> Path:
    p = Path(os.environ.get("TPUBOX_ONNX_PYTHON") or CACHE / "venv-onnx" / "bin" / "python")
    if not p.exists():
        pytest.exit(
            f"{p} is missing: python3 -m venv {CACHE}/venv-onnx && {CACHE}/venv-onnx/bin/pip "
            "install --only-binary :all: -r scripts/venvs/onnx.txt (then the #no-deps lines "
            "with --no-deps), or set TPUBOX_ONNX_PYTHON",
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


@pytest.fixture(scope="session")
def converter() -> Converter:
    return Converter(converter_python())


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx-models")
