"""tpubox.torch's tests: torch.compile(backend="tpubox") against PyTorch eager, on the daemon of
python/tests/conftest.py (tpubox_daemon.Daemon, the CPU plugin).

They need torch, transformers and torch-mlir: `bash scripts/dev.sh test` runs them from
$CACHE/venv-torch (scripts/venvs/torch.txt) after installing ./python into it. The parent
conftest skips this directory where torch is not installed (the venv of the other Python
tests).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# The lowering cache (tpubox/_lowering_cache.py) of these tests is their own, not the user's
# ~/.cache/tpubox/torch-lowering; the processes the tests start inherit it.
os.environ.setdefault(
    "TPUBOX_TORCH_LOWERING_CACHE_DIR", tempfile.mkdtemp(prefix="tpubox-test-lowering-")
)

# Each test process computes with one thread per core of its own; the machine running the tests
# also runs the daemon's executions.
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 2) // 2)))

import tpubox.torch as tt  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch: Dynamo's caches and tpubox.torch's counters reset,
    PyTorch's matmul precision back to its default."""
    torch._dynamo.reset()
    tt.reset_stats()
    old = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(old)
    torch._dynamo.reset()
