"""Junk protobuf on the session API is the client's error: every method of
`tpubox.v1.Session` (read from host/proto/tpubox/v1/session.proto, so a new method is covered
as soon as it is declared) answers each malformed message with INVALID_ARGUMENT, in the
request of a unary or server-streaming call and in the first and a later message of a client
stream (issue 51, item 5; was: tonic's INTERNAL for every decode error, UNKNOWN for some).
"""

from __future__ import annotations

import random
import re

import grpc
from google.protobuf import empty_pb2
from google.protobuf.message import DecodeError

from hardening_util import PROBE, REPO

PROTO = REPO / "host" / "proto" / "tpubox" / "v1" / "session.proto"
SERVICE = "tpubox.v1.Session"
# Methods that take a tenant token (the others take the session token `Open` returns).
TENANT_TOKEN = {"Open", "TenantUsage"}


def methods() -> list[tuple[str, bool, bool]]:
    """(name, client streaming, server streaming) of every rpc of the Session service."""
    text = re.sub(r"//[^\n]*", "", PROTO.read_text())
    body = re.search(r"service\s+Session\s*\{(.*?)\n\}", text, re.S).group(1)
    rpcs = re.findall(r"rpc\s+(\w+)\s*\(\s*(stream\s+)?[\w.]+\s*\)\s*returns\s*\(\s*(stream\s+)?[\w.]+\s*\)", body)
    assert len(rpcs) == body.count("rpc "), "an rpc the pattern does not read"
    return [(name, bool(cs), bool(ss)) for name, cs, ss in rpcs]


def _malformed(b: bytes) -> bool:
    """Whether B is not a protobuf message at all (malformed at the wire level, whatever the
    message type: protobuf's own parser refuses it as an empty message with unknown fields)."""
    try:
        empty_pb2.Empty.FromString(b)
    except DecodeError:
        return True
    return False


def junk() -> dict[str, bytes]:
    cases = {
        "tag 0": b"\x00",
        "wire type 6": b"\x0e\x00",
        "wire type 7": b"\x0f",
        "truncated varint": b"\x08\xff\xff",
        "varint of 11 bytes": b"\x08" + b"\xff" * 10 + b"\x01",
        "key over 32 bits": b"\x80\x80\x80\x80\x10\x00",
        "length past the end": b"\x0a\x7f" + b"xyz",
        "length of 4 GiB": b"\x0a\xff\xff\xff\xff\x0f" + b"x",
        "group never ended": b"\x0b",
        "end of a group never started": b"\x0c",
        "fixed32 cut short": b"\x0d\x01\x02",
        "fixed64 cut short": b"\x09\x01\x02\x03",
        "valid field then junk": b"\x08\x01\x0f",
    }
    rng = random.Random(51)
    n = 0
    while n < 8:
        b = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 48)))
        if _malformed(b):
            cases[f"random {n}"] = b
            n += 1
    for name, b in cases.items():
        assert _malformed(b), name
    return cases


# A valid first message of each client stream: a 64-byte u8 tensor (PutTensor), the same as
# one replicated shard on device 0 (PutShardedTensor).
SPEC = b"\x0a\x05\x08\x06\x12\x01\x40"  # spec { dtype: U8, dims: [64] }
FIRST = {
    "PutTensor": SPEC,
    "PutShardedTensor": SPEC + b"\x12\x0c{replicated}" + b"\x1a\x01\x00",
}
# The data as a later message (field 3 of PutTensorChunk, 4 of PutShardedChunk).
DATA = {"PutTensor": b"\x1a\x40" + b"\x01" * 64, "PutShardedTensor": b"\x22\x40" + b"\x01" * 64}


def _open(channel) -> str:
    """A session's token (OpenResponse field 2)."""
    out = channel.unary_unary("/tpubox.v1.Session/Open")(
        b"\x1a\x06decode", metadata=(("authorization", f"Bearer {PROBE}"),), timeout=60
    )
    i = 0
    while i < len(out):
        key = out[i]
        i += 1
        length = 0
        shift = 0
        while True:
            byte = out[i]
            i += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        if key == 0x12:
            return out[i : i + length].decode()
        assert key & 7 == 2, key
        i += length
    raise AssertionError("no session token")


def _call(channel, name, cs, ss, messages: list[bytes], token: str) -> grpc.StatusCode:
    path = f"/{SERVICE}/{name}"
    md = (("authorization", f"Bearer {token}"),)
    try:
        if cs and ss:
            for _ in channel.stream_stream(path)(iter(messages), metadata=md, timeout=30):
                pass
        elif cs:
            channel.stream_unary(path)(iter(messages), metadata=md, timeout=30)
        elif ss:
            for _ in channel.unary_stream(path)(messages[0], metadata=md, timeout=30):
                pass
        else:
            channel.unary_unary(path)(messages[0], metadata=md, timeout=30)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_method_answers_junk_with_invalid_argument(daemon):
    d = daemon()
    table = methods()
    assert len(table) >= 20 and any(cs for _, cs, _ in table) and any(ss for _, _, ss in table)
    cases = junk()
    got: dict[tuple[str, str, str], grpc.StatusCode] = {}
    with grpc.insecure_channel(d.session_tcp) as ch:
        session = _open(ch)
        # The later-message cases reach their junk: the same stream with valid data succeeds.
        for name, first in FIRST.items():
            code = _call(ch, name, True, False, [first, DATA[name]], session)
            assert code == grpc.StatusCode.OK, (name, code)
        for name, cs, ss in table:
            token = PROBE if name in TENANT_TOKEN else session
            for case, b in cases.items():
                got[(name, case, "first")] = _call(ch, name, cs, ss, [b], token)
                if cs:
                    assert name in FIRST, f"no valid first message for the client stream {name}"
                    got[(name, case, "later")] = _call(ch, name, cs, ss, [FIRST[name], b], token)
    codes: dict[str, int] = {}
    for code in got.values():
        codes[code.name] = codes.get(code.name, 0) + 1
    print(f"{len(got)} cases over {len(table)} methods:", codes)
    wrong = {k: v.name for k, v in got.items() if v != grpc.StatusCode.INVALID_ARGUMENT}
    sample = dict(list(wrong.items())[:12])
    assert not wrong, f"{len(wrong)} of {len(got)} cases not INVALID_ARGUMENT ({codes}), e.g. {sample}"
