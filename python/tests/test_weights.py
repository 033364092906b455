"""Shared weight sets (tpubox serve --weights NAME=FILE): read-only tensors, charged to nobody."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_WEIGHTS

import tpubox


def test_weights_open_read_and_use(s):
    assert "tiny" in s.info().weight_sets
    w = s.weights("tiny")
    assert set(w) == set(TINY_WEIGHTS)
    for name, want in TINY_WEIGHTS.items():
        t = w[name]
        assert t.read_only and "read_only" in repr(t)
        assert t.shape == want.shape and t.dtype == want.dtype
        assert t.numpy().tobytes() == want.tobytes()
    u = s.usage()
    assert u.live_tensors == 3 and u.device_bytes == 0  # counted, not charged
    scale = s.compile(
        """func.func @main(%w: tensor<2x3xf32>, %k: tensor<f32>) -> tensor<2x3xf32> {
             %kb = stablehlo.broadcast_in_dim %k, dims = [] : (tensor<f32>) -> tensor<2x3xf32>
             %0 = stablehlo.multiply %w, %kb : tensor<2x3xf32>
             func.return %0 : tensor<2x3xf32>
           }"""
    )
    (r,) = scale(w["w"], 2.0)
    np.testing.assert_array_equal(r.numpy(), TINY_WEIGHTS["w"] * 2)
    with pytest.raises(tpubox.PermissionDenied):
        scale(w["w"], 2.0, donate=[0])
    np.testing.assert_array_equal(w["w"].numpy(), TINY_WEIGHTS["w"])
    s.free(*w.values())
    assert s.usage().live_tensors == 1


def test_unknown_weight_set(s):
    with pytest.raises(tpubox.NotFound):
        s.weights("no-such-set")
