"""NumPy dtypes <-> the session API's ``DType`` (XLA primitive types), and the array
normalisation every upload goes through (contiguous, little-endian)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ._proto import session_pb2 as pb

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

_TO_WIRE: dict[np.dtype, pb.DType] = {
    np.dtype(np.bool_): pb.PRED,
    np.dtype(np.int8): pb.S8,
    np.dtype(np.int16): pb.S16,
    np.dtype(np.int32): pb.S32,
    np.dtype(np.int64): pb.S64,
    np.dtype(np.uint8): pb.U8,
    np.dtype(np.uint16): pb.U16,
    np.dtype(np.uint32): pb.U32,
    np.dtype(np.uint64): pb.U64,
    np.dtype(np.float16): pb.F16,
    np.dtype(np.float32): pb.F32,
    np.dtype(np.float64): pb.F64,
    np.dtype(np.complex64): pb.C64,
    np.dtype(np.complex128): pb.C128,
    BFLOAT16: pb.BF16,
}
_FROM_WIRE: dict[pb.DType, np.dtype] = {v: k for k, v in _TO_WIRE.items()}

#: The dtypes tpubox tensors may have.
SUPPORTED = tuple(_TO_WIRE)


def to_wire(dtype: np.dtype) -> pb.DType:
    """The wire ``DType`` of a NumPy dtype (any byte order); TypeError if tpubox lacks it."""
    dt = np.dtype(dtype)
    if dt.byteorder not in ("=", "|", "<"):
        dt = dt.newbyteorder("<")
    if dt.byteorder == "<":
        dt = dt.newbyteorder("=")
    try:
        return _TO_WIRE[dt]
    except KeyError:
        names = ", ".join(str(d) for d in SUPPORTED)
        raise TypeError(
            f"tpubox tensors cannot hold dtype {dtype!s} (supported: {names})"
        ) from None


def from_wire(dtype: int) -> np.dtype:
    """The NumPy dtype of a wire ``DType``; tpubox.Internal if the daemon sent an unknown one."""
    try:
        return _FROM_WIRE[dtype]  # type: ignore[index]
    except KeyError:
        from .errors import Internal

        raise Internal("internal", f"the daemon sent a tensor of unknown dtype {dtype}") from None


def dtype_name(dtype: int) -> str:
    """The wire name of a ``DType`` (``F32``, ``BF16``, ...)."""
    return pb.DType.Name(dtype)


def as_device_array(x: Any, dtype: Any = None) -> np.ndarray:
    """X as an array the daemon can take as it is: a supported dtype, C-contiguous, native
    (little-endian) byte order. Copies only when X is not already such an array."""
    a = np.asarray(x, dtype=dtype)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not _LITTLE):
        a = a.astype(a.dtype.newbyteorder("<"))
    to_wire(a.dtype)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a


_LITTLE = np.little_endian
