"""Fixtures of the adversarial tests: `daemon(...)` starts a `tpubox serve` of its own (see
hardening_util.Daemon) and stops it at the end of the test, failing the test if it crashed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hardening_util  # noqa: E402


@pytest.fixture
def daemon(tmp_path):
    started = []

    def start(**kwargs) -> hardening_util.Daemon:
        d = hardening_util.Daemon(tmp_path / f"d{len(started)}", **kwargs).start()
        started.append(d)
        return d

    yield start
    for d in started:
        alive = d.proc.poll() is None
        rc = d.stop()
        assert alive, f"tpubox serve died during the test (exit {d.proc.returncode}):\n{d.log()[-4000:]}"
        assert rc == 0, f"tpubox serve exited {rc} after SIGTERM (want 0):\n{d.log()[-4000:]}"
