"""The CI slice of the Hugging Face zoo harness (python/tools/hf_zoo.py --slice ci): a dozen
(model type, head) rows of every kind (BERT, Llama, GPT-2, T5, ViT, ResNet, Mixtral, wav2vec2,
Swin, DeBERTa-v2, Qwen2, ConvNeXt) built from tiny generated configs, each in compile, fuse
(DEFER_AND_FUSE eager tensors) and train (one SGD step through torch.compile), against PyTorch
eager on the CPU, on the shared daemon.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TOOL = HERE.parents[1] / "tools" / "hf_zoo.py"
_spec = importlib.util.spec_from_file_location("tpubox_tests_conftest", HERE.parent / "conftest.py")
_parent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parent)
ALICE = _parent.ALICE

MODES = ("compile", "fuse", "train")

# (row, mode) pairs that fail today for a known reason, each with it; they are reported, not
# asserted, and the test fails when one of them starts to pass (so that the list shrinks).
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


@pytest.mark.timeout(330)
def test_ci_slice_matches_eager_in_every_mode(daemon, tmp_path):
    # Two rows at once: each child computes with one thread, and the 12 rows one after the
    # other take 5 minutes of a busy 2-core machine (most of it torch-mlir lowering the
    # training steps' backward graphs).
    out = tmp_path / "ci.json"
    cmd = [sys.executable, str(TOOL), "--slice", "ci", "--address", daemon.unix,
           "--token", ALICE, "--json", str(out), "--timeout", "200", "--jobs", "2"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.exists(), f"hf_zoo.py wrote no rows (exit {p.returncode})\n{p.stderr[-4000:]}"
    rows = json.loads(out.read_text())
    sys.path.insert(0, str(TOOL.parent))
    import hf_zoo

    assert [r["row"] for r in rows] == list(hf_zoo.CI_SLICE)
    assert not [r["row"] for r in rows if "skipped" in r], "PyTorch eager cannot build a row"
    report = hf_zoo.report(rows, list(MODES))
    bad, fixed = [], []
    for r in rows:
        for m in MODES:
            ok = bool(r[m].get("match"))
            if (r["row"], m) in KNOWN_FAILURES:
                if ok:
                    fixed.append(f"{r['row']} {m}")
            elif not ok:
                bad.append(f"{r['row']} {m}")
    assert not bad, f"rows not matching eager: {bad}\n{report}"
    assert not fixed, f"known failures that pass now (drop them from KNOWN_FAILURES): {fixed}"
    assert p.returncode == (1 if KNOWN_FAILURES else 0), report
