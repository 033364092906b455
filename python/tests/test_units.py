"""Pieces of the client that need no daemon: addresses, limits, error mapping, the bulk-message
codec, output sinks, the kernelspec command's parsing."""

from __future__ import annotations

import io
import os

import grpc
import numpy as np
import pytest

import tpubox
from tpubox import _dtypes, _wire, errors
from tpubox._proto import session_pb2 as pb
from tpubox.kernelspec import kernel_json, parse_limit
from tpubox.session import _Sink, _target


@pytest.mark.parametrize(
    "given, want",
    [
        ("unix:/run/tpubox.sock", "unix:/run/tpubox.sock"),
        ("/run/tpubox.sock", "unix:/run/tpubox.sock"),
        ("127.0.0.1:7070", "127.0.0.1:7070"),
        ("grpc://localhost:7070", "localhost:7070"),
        ("tcp://[::1]:7070", "[::1]:7070"),
    ],
)
def test_addresses(given, want):
    assert _target(given) == want


def test_limits_coerce():
    assert tpubox.Limits.coerce(None) == tpubox.Limits()
    lim = tpubox.Limits.coerce({"max_device_bytes": "1024", "max_call_seconds": 2})
    assert lim.max_device_bytes == 1024 and lim.max_call_seconds == 2.0
    assert isinstance(lim.max_call_seconds, float)
    with pytest.raises(ValueError, match="unknown limits"):
        tpubox.Limits.coerce({"max_device_mib": 1})
    # Byte limits take the units the kernelspec's --limit takes.
    lim = tpubox.Limits.coerce({"max_device_bytes": "8MiB", "max_program_bytes": "1.5 KiB"})
    assert (lim.max_device_bytes, lim.max_program_bytes) == (8 << 20, 1536)
    with pytest.raises(ValueError, match="max_device_bytes: 'lots' is not a size"):
        tpubox.Limits.coerce({"max_device_bytes": "lots"})
    with pytest.raises(ValueError):
        tpubox.Limits.coerce({"max_live_tensors": "8MiB"})


def test_a_socket_this_user_cannot_open_is_permission_denied(tmp_path, monkeypatch):
    sock = tmp_path / "session.sock"
    sock.touch(mode=0o600)
    # Another user's 0600 socket: os.access says no (faked: the tests may run as root).
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, m: False if os.fspath(p) == str(sock) else real_access(p, m)
    )
    for address in (f"unix:{sock}", str(sock)):
        e = errors.from_rpc_error(
            FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect: Permission denied"),
            address,
            "Open",
        )
        assert type(e) is tpubox.PermissionDenied, e
        assert str(sock) in str(e) and "mode 0600" in str(e) and "TCP" in str(e)
    # A socket that is not there, or open to this user, stays Unavailable.
    monkeypatch.setattr(os, "access", real_access)
    for address in (f"unix:{sock}", f"unix:{tmp_path}/missing.sock", "127.0.0.1:1"):
        e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "refused"), address, "Open")
        assert type(e) is tpubox.Unavailable, e


def test_run_of_a_missing_wasm_file_says_file_not_found():
    s = object.__new__(tpubox.Session)  # no daemon: the path is checked before any call
    for path in ("path/that/does/not/exist.wasm", "missing.wasm", "./x/y"):
        with pytest.raises(FileNotFoundError, match="no such component file"):
            tpubox.Session.run(s, path)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, kind=None):
        self._code, self._details, self._kind = code, details, kind

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return (("tpubox-error-kind", self._kind),) if self._kind else ()


def test_error_kinds_from_the_trailer_then_the_status():
    e = errors.from_rpc_error(
        FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad MLIR", "compile-failed"), "a", "Compile"
    )
    assert type(e) is tpubox.CompileFailed and e.kind == "compile-failed"
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT
    e = errors.from_rpc_error(
        FakeRpcError(
            grpc.StatusCode.UNAUTHENTICATED, "the session has ended: idle", "session-ended"
        ),
        "a",
        "Usage",
    )
    assert isinstance(e, tpubox.SessionEnded)
    e = errors.from_rpc_error(
        FakeRpcError(grpc.StatusCode.UNAVAILABLE, "refused"), "unix:/x", "Info"
    )
    assert isinstance(e, tpubox.Unavailable) and "unix:/x" in str(e) and "Info" in str(e)
    e = errors.from_rpc_error(
        FakeRpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "holding 3 bytes, 9 more would exceed 10 (limit max-device-bytes)",
            "resource-exhausted",
        ),
        "a",
        "PutTensor",
    )
    assert e.limit == "max-device-bytes" and str(e).startswith("resource-exhausted: ")
    assert isinstance(e, tpubox.TpuboxError)
    # Unknown kinds still make a TpuboxError; pickling keeps the class.
    import pickle

    e = errors.error("something-new", "?")
    assert type(e) is tpubox.TpuboxError and e.kind == "something-new"
    e2 = pickle.loads(pickle.dumps(tpubox.NotFound("not-found", "handle 3")))
    assert type(e2) is tpubox.NotFound and e2.message == "handle 3"


def test_every_kind_has_its_class():
    for name in tpubox.__all__:
        obj = getattr(tpubox, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, tpubox.TpuboxError)
            and obj is not tpubox.TpuboxError
        ):
            assert type(errors.error(obj.KIND, "m")) is obj
            assert obj.__doc__


def test_wire_codec_matches_protobuf():
    data = np.arange(1000, dtype=np.uint8)
    head = pb.PutTensorChunk(spec=pb.TensorSpec(dtype=pb.U8, dims=[1000]), device=2)
    raw = _wire.put_chunk(head, memoryview(data))
    m = pb.PutTensorChunk.FromString(raw)
    assert m.spec.dims == [1000] and m.device == 2 and m.data == data.tobytes()
    assert _wire.put_chunk(None, memoryview(b"")) == b""
    for n in (0, 1, 127, 128, 300, 1 << 22, (1 << 35) + 7):
        assert _wire._read_varint(memoryview(_wire.varint(n)), 0) == (n, len(_wire.varint(n)))
    chunk = pb.TensorChunk(info=pb.TensorInfo(handle=7, byte_size=5), data=b"hello")
    info, view = _wire.parse_tensor_chunk(chunk.SerializeToString())
    assert info.handle == 7 and bytes(view) == b"hello"
    info, view = _wire.parse_tensor_chunk(pb.TensorChunk(data=b"xy").SerializeToString())
    assert info is None and bytes(view) == b"xy"


def test_dtype_table_is_complete():
    assert len(_dtypes.SUPPORTED) == 15
    for dt in _dtypes.SUPPORTED:
        assert _dtypes.from_wire(_dtypes.to_wire(dt)) == dt
        assert _dtypes.to_wire(dt.newbyteorder(">")) == _dtypes.to_wire(dt) or dt.itemsize == 1
    with pytest.raises(TypeError):
        _dtypes.to_wire(np.dtype("U3"))


def test_sinks_decode_across_chunks():
    text = io.StringIO()
    s = _Sink(text)
    snow = "snow ☃ man".encode()
    for i in range(len(snow)):  # one byte at a time: the snowman is split
        s.write(snow[i : i + 1])
    s.finish()
    assert text.getvalue() == "snow ☃ man"
    b = io.BytesIO()
    s = _Sink(b)
    s.write(b"\xff\x00")
    assert b.getvalue() == b"\xff\x00"
    _Sink(False).write(b"nothing")


def test_parse_limit_and_kernel_json():
    assert parse_limit("max_device_bytes=64MiB") == ("max_device_bytes", 64 << 20)
    assert parse_limit("max-device-bytes=2G") == ("max_device_bytes", 2 << 30)
    assert parse_limit("max_device_bytes=1000") == ("max_device_bytes", 1000)
    assert parse_limit("max_live_tensors=12") == ("max_live_tensors", 12)
    assert parse_limit("idle_timeout_seconds=1.5") == ("idle_timeout_seconds", 1.5)
    for bad in ("max_device_mib=3", "max_device_bytes", "max_device_bytes=lots"):
        with pytest.raises(ValueError):
            parse_limit(bad)
    spec = kernel_json(address="unix:/s", token_file="~/t", limits={"max_live_tensors": 5})
    assert spec["argv"][1:] == ["-m", "ipykernel_launcher", "-f", "{connection_file}"]
    prov = spec["metadata"]["kernel_provisioner"]
    assert prov == {
        "provisioner_name": "tpubox-provisioner",
        "config": {"address": "unix:/s", "token_file": "~/t", "limits": {"max_live_tensors": 5}},
    }


def test_tls_option_forms(tmp_path, monkeypatch):
    from tpubox import _transport

    ca = str(tmp_path / "ca.pem")
    assert tpubox.TLS.coerce(None) is None and tpubox.TLS.coerce(False) is None
    assert tpubox.TLS.coerce(True) == tpubox.TLS()
    assert tpubox.TLS.coerce(ca) == tpubox.TLS(ca=ca)
    assert tpubox.TLS.coerce(tmp_path / "ca.pem") == tpubox.TLS(ca=ca)
    assert tpubox.TLS.coerce({"ca": tmp_path / "ca.pem", "server_name": "box"}) == tpubox.TLS(
        ca=ca, server_name="box"
    )
    with pytest.raises(ValueError, match="unknown fields"):
        tpubox.TLS.coerce({"cafile": ca})
    with pytest.raises(ValueError, match="both cert and key"):
        tpubox.TLS(cert="c.pem")
    with pytest.raises(TypeError):
        tpubox.TLS.coerce(3)
    # Which TLS a connection gets: tls=, then the environment (TCP only), then the scheme.
    for k in ("TPUBOX_TLS_CA", "TPUBOX_TLS_CERT", "TPUBOX_TLS_KEY", "TPUBOX_TLS_SERVER_NAME"):
        monkeypatch.delenv(k, raising=False)
    assert _transport.resolve_tls("127.0.0.1:7070", None) is None
    assert _transport.resolve_tls("grpcs://127.0.0.1:7070", None) == tpubox.TLS()
    assert _transport.grpc_target("grpcs://box:7070") == "box:7070"
    assert _transport.resolve_tls("box:7070", ca) == tpubox.TLS(ca=ca)
    monkeypatch.setenv("TPUBOX_TLS_CA", ca)
    assert _transport.resolve_tls("box:7070", None) == tpubox.TLS(ca=ca)
    assert _transport.resolve_tls("unix:/run/tpubox.sock", None) is None
    with pytest.raises(ValueError, match="Unix socket"):
        _transport.resolve_tls("/run/tpubox.sock", True)
    # What a provisioner hands a kernel reads back into the same TLS.
    t = tpubox.TLS(ca=ca, cert="c.pem", key="k.pem")
    for k, v in t.env().items():
        monkeypatch.setenv(k, v)
    assert tpubox.TLS.from_env() == tpubox.TLS(
        ca=ca, cert=os.path.abspath("c.pem"), key=os.path.abspath("k.pem")
    )
    # A missing CA file is the caller's mistake, said as such.
    with pytest.raises(FileNotFoundError):
        tpubox.connect("127.0.0.1:1", "t", tls=str(tmp_path / "absent.pem"))


def test_kernel_json_carries_tls_files():
    spec = kernel_json(address="box:7070", tls_ca="/etc/ca.pem", tls_cert="~/{user}.pem")
    config = spec["metadata"]["kernel_provisioner"]["config"]
    assert config["tls_ca"] == "/etc/ca.pem" and config["tls_cert"] == "~/{user}.pem"
    assert "tls_key" not in config
