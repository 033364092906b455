"""Guest components run in the daemon's sandbox from a session, output streamed back."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from tpubox_daemon import guest_wasm

import tpubox

# examples/hello-matmul: tanh(x·w + b), x scaled by --scale.
X = np.array([[0.5, -1.25, 2.0], [1.5, 0.25, -0.75]], np.float64)
W = np.array([[0.2, -0.4, 0.1, 0.3], [-0.3, 0.15, 0.25, -0.2], [0.05, 0.1, -0.35, 0.4]])
B = np.array([0.1, -0.2, 0.05, -0.15])


def hello_result(text: str) -> np.ndarray:
    m = re.search(r"^result: (.*)$", text, re.M)
    assert m, text
    return np.array(json.loads(m.group(1)))


@pytest.fixture(scope="module")
def hello():
    try:
        return guest_wasm("hello-matmul")
    except FileNotFoundError as e:
        pytest.fail(str(e))


def test_run_streams_stdout_and_returns_the_exit(alice, hello):
    out = io.StringIO()
    r = alice.run(hello, ["--scale", "2"], stdout=out, stderr=False)
    assert r.ok and r.exit_code == 0 and r.error == "" and r.elapsed > 0
    text = out.getvalue()
    assert text == r.stdout.decode()
    np.testing.assert_allclose(hello_result(text), np.tanh((X * 2) @ W + B), atol=1e-5)
    # The run's handles were the session's tenant's, and were freed when it ended.
    u = alice.usage()
    assert u.executions >= 1 and u.live_tensors == 0 and u.device_bytes == 0


def test_run_from_bytes_and_str_path_to_binary_stream(alice, hello):
    buf = io.BytesIO()
    r = alice.run(hello.read_bytes(), ["--scale", "-0.5"], stdout=buf)
    assert r.ok and buf.getvalue() == r.stdout
    np.testing.assert_allclose(
        hello_result(r.stdout.decode()), np.tanh((X * -0.5) @ W + B), atol=1e-5
    )
    r = alice.run(str(hello), stdout=False)
    assert r.ok and b"result:" in r.stdout


def test_run_writes_to_sys_stdout_by_default(alice, hello, capsys):
    r = alice.run(hello)
    assert r.ok
    captured = capsys.readouterr()
    assert "result: " in captured.out and captured.out == r.stdout.decode()


def test_guest_failure_is_an_exit_code(alice, hello):
    err = io.StringIO()
    r = alice.run(hello, ["--no-such-flag"], stdout=False, stderr=err)
    # (WASI preview 2 has only success and failure: status 1 for any error exit.)
    assert not r.ok and r.exit_code == 1
    assert "hello-matmul" in err.getvalue() and err.getvalue() == r.stderr.decode()


def test_unknown_component_name_and_bad_bytes(alice):
    with pytest.raises(tpubox.NotFound):
        alice.run("no-such-component", stdout=False)
    with pytest.raises(tpubox.TpuboxError) as e:
        alice.run(b"\0asm not really", stdout=False, stderr=False)
    assert e.value.kind == "invalid-argument", e.value


def test_run_by_name(alice):
    assert "hello-matmul" in alice.info().components
    out = io.StringIO()
    r = alice.run("hello-matmul", ["--scale", "1"], stdout=out)
    assert r.ok
    np.testing.assert_allclose(hello_result(out.getvalue()), np.tanh(X @ W + B), atol=1e-5)


def test_run_deadline(alice, hello):
    # A deadline the guest cannot meet: every run is stopped, and the result says why (the
    # deadline is checked at the run's first epoch check, instantiation included).
    wasm = hello.read_bytes()
    runs = [alice.run(wasm, timeout=1e-6, stdout=False, stderr=False) for _ in range(5)]
    for r in runs:
        assert r.exit_code != 0 and "deadline" in r.error, r
