"""Tensors: every dtype round-trips exactly (put, then get), whatever the array's layout."""

from __future__ import annotations

import io

import ml_dtypes
import numpy as np
import pytest

import tpubox

RNG = np.random.default_rng(7)

DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3, 4)]


def sample(dtype, shape) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt == np.bool_:
        a = RNG.integers(0, 2, n).astype(np.bool_)
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        a = RNG.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    elif dt.kind == "c":
        a = (RNG.standard_normal(n) + 1j * RNG.standard_normal(n)).astype(dt)
    else:
        a = (RNG.standard_normal(n) * 100).astype(dt)
    return a.reshape(shape)


def same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    # Bit for bit (NaN-safe, -0.0 distinct).
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip(s, dtype, shape):
    a = sample(dtype, shape)
    with s.tensor(a) as t:
        assert t.shape == a.shape
        assert t.dtype == np.dtype(dtype)
        assert t.nbytes == a.nbytes
        got = t.numpy()
    same(got, a)
    assert got.flags.writeable and got.flags.c_contiguous


def test_special_floats_round_trip(s):
    a = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, np.finfo(np.float32).max],
                 np.float32)  # fmt: skip
    with s.tensor(a) as t:
        same(t.numpy(), a)
    b = a.astype(ml_dtypes.bfloat16)
    with s.tensor(b) as t:
        same(t.numpy(), b)


@pytest.mark.parametrize("dtype", [">i4", ">f8", ">c8", ">u2", ">f2"])
def test_big_endian_arrays_are_converted(s, dtype):
    a = sample(np.dtype(dtype).newbyteorder("="), (3, 5)).astype(dtype)
    assert a.dtype.byteorder == ">"
    with s.tensor(a) as t:
        assert t.dtype == a.dtype.newbyteorder("=")
        got = t.numpy()
    np.testing.assert_array_equal(got, a)
    assert got.dtype.isnative


def test_non_contiguous_arrays_are_converted(s):
    base = sample(np.float32, (6, 8))
    for view in (base.T, base[::2, 1::3], base[:, ::-1], np.broadcast_to(base[0], (4, 8))):
        assert not view.flags.c_contiguous
        with s.tensor(view) as t:
            assert t.shape == view.shape
            np.testing.assert_array_equal(t.numpy(), view)


def test_scalars_lists_and_dtype_argument(s):
    with s.tensor(3.5) as t:
        assert t.shape == () and t.dtype == np.float64
        assert t.numpy() == 3.5
    with s.tensor([[1, 2], [3, 4]], dtype=np.int8) as t:
        assert t.dtype == np.int8
        np.testing.assert_array_equal(t.numpy(), [[1, 2], [3, 4]])
    with s.tensor(True) as t:
        assert t.dtype == np.bool_ and t.numpy()[()]
    with s.tensor(np.float16(2.5)) as t:
        assert t.dtype == np.float16
    with s.tensor([1.5, 2.5], dtype=ml_dtypes.bfloat16) as t:
        assert t.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(t.numpy().astype(np.float32), [1.5, 2.5])


@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([object()]), np.zeros(2, "M8[s]")])
def test_unsupported_dtypes_are_refused_here(s, bad):
    with pytest.raises(TypeError, match="cannot hold dtype"):
        s.tensor(bad)
    assert s.usage().live_tensors == 0


def test_array_protocol_repr_and_properties(s):
    a = sample(np.int32, (2, 3))
    t = s.tensor(a)
    np.testing.assert_array_equal(np.asarray(t), a)
    assert t.ndim == 2 and t.size == 6 and t.spec == tpubox.TensorSpec((2, 3), np.dtype(np.int32))
    r = repr(t)
    assert f"handle={t.handle}" in r and "shape=(2, 3)" in r and "int32" in r
    t.free()
    assert "freed" in repr(t)
    t.free()  # twice: a no-op


def test_get_by_handle_number(s):
    a = sample(np.float32, (4,))
    t = s.tensor(a)
    np.testing.assert_array_equal(s.get(t.handle), a)
    t.free()
    with pytest.raises(tpubox.NotFound) as e:
        s.get(t.handle)
    assert e.value.kind == "not-found"


def test_64_mib_round_trip_is_exact(s):
    a = np.random.default_rng(1).standard_normal(16 << 20, dtype=np.float32).reshape(4096, 4096)
    assert a.nbytes == 64 << 20
    with s.tensor(a) as t:
        assert s.usage().device_bytes >= a.nbytes
        got = t.numpy()
    assert np.array_equal(got, a)
    # Not a multiple of the chunk size, and bytes that are not float-aligned at chunk edges.
    b = np.random.default_rng(2).integers(0, 255, (4 << 20) * 3 + 12345, dtype=np.uint8)
    with s.tensor(b) as t:
        assert np.array_equal(t.numpy(), b)


def test_device_argument(s):
    n = len(s.platform.devices)
    last = n - 1
    with s.tensor(np.ones(3, np.float32), device=last) as t:
        assert t.device == last
        np.testing.assert_array_equal(t.numpy(), np.ones(3))
    with pytest.raises(tpubox.NotFound, match=f"device {n + 5} does not exist"):
        s.tensor(np.ones(3, np.float32), device=n + 5)
    assert s.usage().live_tensors == 0


def test_stdout_untouched(s, capsys):
    # Tensors print nothing.
    with s.tensor(np.zeros(2)) as t:
        t.numpy()
    assert capsys.readouterr().out == ""
    assert isinstance(io.StringIO(), io.TextIOBase)
