"""tpubox.jax.export_model: what it writes into a model repository (the serving side is
tests/serve/test_stablehlo.py, which serves such exports and checks JAX's numbers)."""

from __future__ import annotations

import json
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpubox
import tpubox.jax as tj


def _params():
    rng = np.random.default_rng(1)
    return {"lin": {"w": rng.standard_normal((3, 2)).astype(np.float32), "b": np.arange(2, dtype=np.float32)},
            "scale": np.float32(2.0)}


def _fn(p, x, k):
    y = (x @ p["lin"]["w"] + p["lin"]["b"]) * p["scale"]
    return y, (k * 2).astype(jnp.int32)


def _read_safetensors(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        dt = {"F32": np.float32, "I32": np.int32}[h["dtype"]]
        out[name] = np.frombuffer(raw[8 + n + a : 8 + n + b], dt).reshape(h["shape"])
    return out


def test_writes_programs_weights_and_config(tmp_path):
    p = _params()
    d = tj.export_model(
        _fn, p, [np.zeros((1, 3), np.float32), np.zeros((1, 5), np.int32)], tmp_path, "lin",
        batch_sizes=[4, 1, 4], input_names=["x", "k"], output_names=["y", "k2"], instance_count=2,
    )  # fmt: skip
    assert d == tmp_path / "lin"
    c = tomllib.loads((d / "config.toml").read_text())
    assert c["name"] == "lin" and c["backend"] == "stablehlo" and c["max_batch_size"] == 4
    assert c["input"] == [
        {"name": "x", "data_type": "TYPE_FP32", "dims": [3]},
        {"name": "k", "data_type": "TYPE_INT32", "dims": [5]},
    ]
    assert c["output"] == [
        {"name": "y", "data_type": "TYPE_FP32", "dims": [2]},
        {"name": "k2", "data_type": "TYPE_INT32", "dims": [5]},
    ]
    assert c["instance_group"] == [{"count": 2}]
    s = c["tpubox"]["stablehlo"]
    # jax flattens dicts in key order; the weights come first, then the inputs.
    assert s["parameters"] == [{"weight": "lin/b"}, {"weight": "lin/w"}, {"weight": "scale"}, {"input": "x"}, {"input": "k"}]
    assert s["results"] == ["y", "k2"]
    assert s["program"] == [{"batch_size": 1, "file": "model.b1.mlirbc"}, {"batch_size": 4, "file": "model.b4.mlirbc"}]
    for b in (1, 4):
        assert (d / f"model.b{b}.mlirbc").read_bytes().startswith(b"ML\xefR")
    w = _read_safetensors(d / "weights.safetensors")
    assert sorted(w) == ["lin/b", "lin/w", "scale"]
    np.testing.assert_array_equal(w["lin/w"], p["lin"]["w"])
    assert w["scale"].shape == () and w["scale"] == np.float32(2.0)
    # (tests/serve/test_stablehlo.py serves such programs and checks JAX's numbers.)


def test_a_dict_result_names_the_outputs_and_none_means_no_batch(tmp_path):
    p = {"w": np.ones((2, 2), np.float32)}
    d = tj.export_model(lambda p, x: {"b": x @ p["w"], "a": x.sum()}, p, [np.zeros((2, 2), np.float32)],
                        tmp_path, "flat", batch_sizes=None)  # fmt: skip
    c = tomllib.loads((d / "config.toml").read_text())
    assert c["max_batch_size"] == 0 and "dynamic_batching" not in c
    assert [o["name"] for o in c["output"]] == ["a", "b"]
    assert c["output"][0]["dims"] == [] and c["output"][1]["dims"] == [2, 2]
    assert c["tpubox"]["stablehlo"]["program"] == [{"file": "model.mlirbc"}]


def test_refusals(tmp_path):
    p = {"w": np.ones((2, 2), np.float32)}
    x = [np.zeros((1, 2), np.float32)]
    with pytest.raises(ValueError, match="batch dimension first"):
        tj.export_model(lambda p, x: (x @ p["w"]).sum(0), p, x, tmp_path, "nobatch", batch_sizes=[1, 2])
    tj.export_model(lambda p, x: x @ p["w"], p, x, tmp_path, "once", batch_sizes=[1])
    with pytest.raises(ValueError, match="is not empty"):
        tj.export_model(lambda p, x: x @ p["w"], p, x, tmp_path, "once", batch_sizes=[1])
    with pytest.raises(ValueError, match="cannot name"):
        tj.export_model(lambda p, x: x @ p["w"], p, x, tmp_path, "../up", batch_sizes=[1])
    with pytest.raises(ValueError, match="at least 1"):
        tj.export_model(lambda p, x: x @ p["w"], p, x, tmp_path, "zero", batch_sizes=[0, 2])
    with pytest.raises(tpubox.Unsupported, match="complex64"):
        tj.export_model(lambda p, x: x.astype(jnp.complex64), p, x, tmp_path, "cplx", batch_sizes=[1])
