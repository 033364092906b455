"""Hand-written protobuf encoding of the two bulk messages, ``PutTensorChunk`` (sent) and
``TensorChunk`` (received), so that tensor bytes are copied once on each side instead of
through a protobuf message (a bytes field of a protobuf message cannot take a memoryview: it
would be copied in, then serialised, then copied into gRPC).

The encoding is plain protobuf wire format: a message is a sequence of (tag, value) fields in
any order, a length-delimited field is ``tag varint(len) bytes``. The headers (``TensorSpec``,
``TensorInfo``) still go through the generated classes.
"""

from __future__ import annotations

from ._proto import session_pb2 as pb

# Tags (field number << 3 | wire type 2 = length-delimited).
_PUT_DATA_TAG = b"\x1a"  # PutTensorChunk.data = 3
_CHUNK_INFO_FIELD = 1  # TensorChunk.info
_CHUNK_DATA_FIELD = 2  # TensorChunk.data


def varint(n: int) -> bytes:
    """The protobuf base-128 varint of N >= 0."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def put_chunk(header: pb.PutTensorChunk | None, data: memoryview) -> bytes:
    """A serialised ``PutTensorChunk``: HEADER's fields (spec, device; only in the first
    message) followed by ``data`` = DATA. The one copy of DATA is the join."""
    head = header.SerializeToString() if header is not None else b""
    if len(data) == 0:
        return head
    return b"".join((head, _PUT_DATA_TAG, varint(len(data)), data))


_PUT_SHARDED_DATA_TAG = b"\x22"  # PutShardedChunk.data = 4


def put_sharded_chunk(header: pb.PutShardedChunk | None, data: memoryview) -> bytes:
    """A serialised ``PutShardedChunk``: HEADER's fields (spec, sharding, devices; only in the
    first message) followed by ``data`` = DATA, as :func:`put_chunk`."""
    head = header.SerializeToString() if header is not None else b""
    if len(data) == 0:
        return head
    return b"".join((head, _PUT_SHARDED_DATA_TAG, varint(len(data)), data))


def identity(b: bytes) -> bytes:
    """A request serialiser for messages that are already bytes."""
    return b


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = 0
    out = 0
    while True:
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, i
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint")


def parse_tensor_chunk(raw: bytes) -> tuple[pb.TensorInfo | None, memoryview]:
    """A received ``TensorChunk``: (its ``info``, or None when absent; a view of its ``data``
    inside RAW, no copy). Fields of other numbers are skipped, as protobuf does."""
    buf = memoryview(raw)
    info = None
    data = buf[0:0]
    i, n = 0, len(buf)
    while i < n:
        key, i = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 2:
            length, i = _read_varint(buf, i)
            value = buf[i : i + length]
            i += length
            if field == _CHUNK_INFO_FIELD:
                info = pb.TensorInfo.FromString(bytes(value))
            elif field == _CHUNK_DATA_FIELD:
                data = value
        elif wire == 0:
            _, i = _read_varint(buf, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unexpected wire type {wire} in a TensorChunk")
    return info, data
