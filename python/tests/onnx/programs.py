"""Running a converted StableHLO model directory on the CPU, for the converter's tests: each
program with the weights of ``weights.safetensors`` and the inputs, in the order of
``plan.json``'s ``stablehlo.parameters``.

Two runners: ``tpubox exec`` (the daemon's own PJRT CPU plugin: what ``tpubox serve`` would
run), used when the binary is there (``TPUBOX_BIN``, else ``target/release/tpubox`` of
``CARGO_TARGET_DIR`` or the repository), and JAX's CPU client otherwise (``jaxlib`` compiles
the VHLO bytecode or StableHLO text directly). ``TPUBOX_ONNX_RUNNER=exec|jax`` forces one.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[3]

_ST_DTYPES = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32,
    "U64": np.uint64, "BOOL": np.bool_,
}  # fmt: skip


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """name -> array of a safetensors file (BF16 as ml_dtypes.bfloat16)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        if h["dtype"] == "BF16":
            import ml_dtypes

            dt: Any = ml_dtypes.bfloat16
        else:
            dt = _ST_DTYPES[h["dtype"]]
        a, b = h["data_offsets"]
        out[name] = np.frombuffer(data[base + a : base + b], dtype=dt).reshape(h["shape"])
    return out


def tpubox_bin() -> Path | None:
    """The tpubox binary, or None."""
    env = os.environ.get("TPUBOX_BIN")
    if env:
        return Path(env) if Path(env).is_file() else None
    t = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    p = (t if t.is_absolute() else REPO / t) / "release" / "tpubox"
    return p if p.is_file() else None


def runner() -> str:
    """``exec`` or ``jax``."""
    forced = os.environ.get("TPUBOX_ONNX_RUNNER")
    if forced:
        return forced
    return "exec" if tpubox_bin() is not None else "jax"


def run_program(
    model_dir: Path, plan: dict[str, Any], batch_size: int | None, feeds: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Runs the program of BATCH_SIZE (None: the only one) of the converted MODEL_DIR on
    FEEDS (input name -> array); returns output name -> array."""
    s = plan["stablehlo"]
    prog = next(p for p in s["program"] if p.get("batch_size") == batch_size)
    weights = read_safetensors(model_dir / s["weights"])
    args = [feeds[p["input"]] if "input" in p else weights[p["weight"]] for p in s["parameters"]]
    path = model_dir / prog["file"]
    outs = _run_exec(path, args) if runner() == "exec" else _run_jax(path, args)
    return dict(zip(s["results"], outs))


def _run_exec(path: Path, args: list[np.ndarray]) -> list[np.ndarray]:
    binary = tpubox_bin()
    assert binary is not None, "tpubox exec: no binary (TPUBOX_BIN)"
    with tempfile.TemporaryDirectory(prefix="onnx-exec-") as tmp:
        cmd = [str(binary), "exec", str(path)]
        for i, a in enumerate(args):
            f = Path(tmp) / f"arg{i}.npy"
            np.save(f, np.ascontiguousarray(a))
            cmd += ["--arg", str(f)]
        cmd += ["--out", str(Path(tmp) / "out")]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"tpubox exec {path.name} failed: {r.stderr[-2000:]}"
        meta = json.loads((Path(tmp) / "out" / "outputs.json").read_text())
        n = len(meta) if isinstance(meta, list) else len(meta.get("outputs", meta))
        return [np.load(Path(tmp) / "out" / f"out{i}.npy") for i in range(n)]


_JAX_EXES: dict[Path, Any] = {}


def _run_jax(path: Path, args: list[np.ndarray]) -> list[np.ndarray]:
    import jax
    from jax._src import xla_bridge
    from jax._src.lib import xla_client

    jax.config.update("jax_enable_x64", True)  # int64 inputs stay int64
    backend = xla_bridge.get_backend("cpu")
    dev = backend.devices()[0]
    exe = _JAX_EXES.get(path)
    if exe is None:
        exe = backend.compile_and_load(
            path.read_bytes(), xla_client.DeviceList((dev,)), xla_client.CompileOptions()
        )
        _JAX_EXES[path] = exe
    bufs = [jax.device_put(np.ascontiguousarray(a), dev) for a in args]
    return [np.asarray(o) for o in exe.execute(bufs)]
