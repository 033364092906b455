"""One round trip per call: ``Executable.call`` (the session API's ``Call``) with inline inputs,
fetched and kept results and frees, on every transport (the local socket's memfds, gRPC over
the Unix socket, gRPC over TCP), against values NumPy computes independently; and the hostile
requests a client could send instead, each refused with its exact kind and the tenant's usage
unchanged."""

from __future__ import annotations

import fcntl
import os

import grpc
import ml_dtypes
import numpy as np
import pytest
from conftest import ALICE, SMALL
from test_programs import AFFINE, BF16_SCALE

import tpubox
from tpubox._proto import session_pb2 as pb
from tpubox.errors import from_rpc_error

ADD = """
func.func @main(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.add %a, %b : tensor<4xf32>
  func.return %0 : tensor<4xf32>
}
"""

RNG = np.random.default_rng(28)


@pytest.fixture(params=["local", "unix", "tcp"])
def t(request, daemon):
    """A session of tenant alice: through the local socket, gRPC over the Unix socket, and
    gRPC over TCP."""
    address = daemon.tcp if request.param == "tcp" else daemon.unix
    local = request.param == "local"
    with tpubox.connect(address, ALICE, local=local, label=f"pytest call {request.param}") as s:
        assert s.transport == ("local" if local else "grpc")
        yield s


def affine(x, w, b):
    y = np.tanh(x.astype(np.float64) @ w.astype(np.float64) + b)
    return y, (y > 0).astype(np.int32)


def held(s: tpubox.Session) -> tuple[int, int, int]:
    u = s.usage()
    return u.device_bytes, u.live_tensors, u.live_executables


def test_arrays_in_arrays_out(t):
    exe = t.compile(AFFINE)
    x = RNG.standard_normal((3, 4), dtype=np.float32)
    w = RNG.standard_normal((4, 2), dtype=np.float32)
    b = RNG.standard_normal(2, dtype=np.float32)
    before = held(t)
    y, i = exe.call(x, w, b)
    want_y, want_i = affine(x, w, b)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (3, 2)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    assert isinstance(i, np.ndarray) and i.dtype == np.int32
    np.testing.assert_array_equal(i, want_i)
    y[0, 0] = 42  # writable, and ours
    # Nothing stays on the device: no inline input, no result.
    assert held(t) == before
    assert t.usage().executions == 1


def test_python_scalars_and_bf16(t):
    exe = t.compile(BF16_SCALE)
    a = np.array([1, 2, 3, -4, 0.5], ml_dtypes.bfloat16)
    (r,) = exe.call(a, 2.0)  # 2.0 becomes a bf16 scalar (the parameter's dtype)
    assert r.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(r, (a.astype(np.float32) * 2).astype(ml_dtypes.bfloat16))


def test_mixed_handles_inline_keep_and_free(t):
    exe = t.compile(AFFINE)
    x = RNG.standard_normal((3, 4), dtype=np.float32)
    w = RNG.standard_normal((4, 2), dtype=np.float32)
    b = RNG.standard_normal(2, dtype=np.float32)
    tx = t.tensor(x)
    tb = t.tensor(b)
    spare = t.tensor(np.zeros(8, np.float32))
    # x and b as handles, w inline; result 0 fetched and kept, result 1 kept only; x and the
    # spare freed by the call.
    y, i = exe.call(tx, w, tb, fetch=[0], keep=[0], free=[tx, spare])
    want_y, want_i = affine(x, w, b)
    assert isinstance(y, tpubox.Tensor) and isinstance(i, tpubox.Tensor)
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-6)
    # The kept handles are real tensors on the device.
    np.testing.assert_allclose(t.get(y.handle), want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(i.numpy(), want_i)
    assert tx.freed and spare.freed and not tb.freed
    with pytest.raises(tpubox.NotFound):
        t.get(tx.handle)
    with pytest.raises(tpubox.NotFound):
        t.get(spare.handle)
    u = t.usage()
    assert u.live_tensors == 3, u  # b, y, i
    assert u.device_bytes == 8 + 24 + 24, u
    # Kept results feed the next call by handle, with fresh inputs inline.
    z, zi = exe.call(x, w, tb, fetch=[0])
    np.testing.assert_allclose(z, want_y, rtol=1e-5, atol=1e-6)
    assert isinstance(zi, tpubox.Tensor)  # not fetched: kept
    np.testing.assert_array_equal(zi.numpy(), want_i)


def test_default_call_keeps_and_donates(t):
    add = t.compile(ADD)
    a = np.arange(4, dtype=np.float32)
    h = t.tensor(np.full(4, 10, np.float32))
    # __call__ with an array: one Call, results kept, the inline input never a handle.
    (r,) = add(a, h)
    assert isinstance(r, tpubox.Tensor)
    np.testing.assert_array_equal(r.numpy(), a + 10)
    assert t.usage().live_tensors == 2
    # Donating a handle and an inline tensor.
    (d,) = add.call(a, h, donate=[0, 1], fetch=False)
    np.testing.assert_array_equal(d.numpy(), a + 10)
    assert h.donated
    with pytest.raises(tpubox.FailedPrecondition):
        h.numpy()
    with pytest.raises(tpubox.FailedPrecondition):
        add.call(a, h)


def test_refusals_keep_usage_and_free_nothing(t):
    exe = t.compile(AFFINE)
    x = RNG.standard_normal((3, 4), dtype=np.float32)
    w = RNG.standard_normal((4, 2), dtype=np.float32)
    b = RNG.standard_normal(2, dtype=np.float32)
    keep_me = t.tensor(b)
    ghost = tpubox.Tensor(t, 10**12, (4, 2), np.dtype(np.float32))  # a handle never made
    ghost._freed = True
    before = held(t)
    executions = t.usage().executions
    cases = [
        # wrong shape, wrong dtype, wrong count: the program's parameters
        (tpubox.InvalidArgument, lambda: exe.call(x, w, np.zeros(3, np.float32), free=[keep_me])),
        (tpubox.InvalidArgument, lambda: exe.call(x, w.astype(np.float64), b, free=[keep_me])),
        (tpubox.InvalidArgument, lambda: exe.call(x, w, free=[keep_me])),
        # fetch and keep positions
        (tpubox.InvalidArgument, lambda: exe.call(x, w, b, fetch=[2], free=[keep_me])),
        (tpubox.InvalidArgument, lambda: exe.call(x, w, b, fetch=[0, 0], free=[keep_me])),
        (tpubox.InvalidArgument, lambda: exe.call(x, w, b, keep=[5], free=[keep_me])),
        # donation
        (tpubox.InvalidArgument, lambda: exe.call(x, w, b, donate=[3], free=[keep_me])),
        # a handle this session does not have
        (tpubox.NotFound, lambda: exe.call(x, ghost, b, free=[keep_me])),
    ]
    for want, f in cases:
        with pytest.raises(want):
            f()
        assert held(t) == before, (want, t.usage())
    # A shared weight cannot be donated.
    wt = t.weights("tiny")["w"]
    add = t.compile(ADD)
    before = held(t)
    with pytest.raises(tpubox.PermissionDenied):
        add.call(np.zeros(4, np.float32), wt, donate=[1], free=[keep_me])
    assert held(t) == before
    assert not keep_me.freed
    np.testing.assert_array_equal(keep_me.numpy(), b)
    assert t.usage().executions == executions
    assert t.usage().device_bytes == before[0]


def raw_call(s: tpubox.Session, fields: dict, inline: list[bytes]) -> tpubox.TpuboxError:
    """Sends a hand-made call (lying as a hostile client would) and returns its error."""
    if s.transport == "local":
        fd = None
        if inline:
            fd = os.memfd_create("lie", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.write(fd, b"".join(inline))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK)
        try:
            with pytest.raises(tpubox.TpuboxError) as e:
                s._local.request("call", fields, fd, 10)
        finally:
            if fd is not None:
                os.close(fd)
        return e.value
    req = pb.CallRequest(executable=fields["executable"], free=fields.get("free", []))
    it = iter(inline)
    for a in fields["arguments"]:
        if "handle" in a:
            req.arguments.add(handle=a["handle"])
        else:
            dtype = a["dtype"] if isinstance(a["dtype"], int) else pb.DType.Value(a["dtype"])
            spec = pb.TensorSpec(dtype=dtype, dims=a["dims"])
            req.arguments.add(tensor=pb.InlineTensor(spec=spec, data=next(it)))
    with pytest.raises(grpc.RpcError) as e:
        s._stub.Call(req, metadata=s._md, timeout=10)
    return from_rpc_error(e.value, s.address, "Call")


def test_lying_requests_are_refused_with_their_kind(t):
    exe = t.compile(ADD)
    keep_me = t.tensor(np.ones(4, np.float32))
    before = held(t)
    four = np.arange(4, dtype=np.float32).tobytes()
    f32 = lambda dims: {"dtype": "F32", "dims": dims}  # noqa: E731
    h = {"handle": keep_me.handle}
    cases = [
        # 12 bytes for a tensor<4xf32> (16): too few
        ("invalid-argument", [f32([4]), h], [four[:12]]),
        # a declared [1000] f32 with 16 bytes sent
        ("invalid-argument", [f32([1000]), h], [four]),
        # 16 bytes declared as [4] f64 (32)
        ("invalid-argument", [{"dtype": "F64", "dims": [4]}, h], [four]),
        # more than max-device-bytes (1 GiB): refused before anything is read or allocated
        ("resource-exhausted", [f32([1 << 29]), h], [four]),
        # a rank no tensor has
        ("invalid-argument", [f32([1] * 100), h], [four]),
    ]
    if t.transport == "local":
        cases += [
            ("invalid-argument", [{"dtype": "F33", "dims": [4]}, h], [four]),
            ("invalid-argument", [{"handle": keep_me.handle, "dtype": "F32"}, h], []),
        ]
    else:
        cases += [
            ("invalid-argument", [{"dtype": 99, "dims": [4]}, h], [four]),
            ("invalid-argument", [{"dtype": 0, "dims": [4]}, h], [four]),
        ]
    for kind, arguments, inline in cases:
        fields = {"executable": exe.handle, "arguments": arguments, "free": [keep_me.handle]}
        err = raw_call(t, fields, inline)
        assert err.kind == kind, (arguments, err)
        assert held(t) == before, (arguments, t.usage())
    np.testing.assert_array_equal(keep_me.numpy(), np.ones(4, np.float32))


def test_small_tenant_is_charged_before_allocation(daemon):
    for local in (True, False):
        with tpubox.connect(daemon.unix, SMALL, local=local) as s:
            add = s.compile(ADD)
            before = held(s)
            # 2 MiB inline for a 1 MiB tenant: refused at admission, whatever the program.
            with pytest.raises(tpubox.ResourceExhausted, match="max-device-bytes"):
                add.call(np.zeros(1 << 19, np.float32), np.zeros(4, np.float32))
            assert held(s) == before
            (r,) = add.call(np.ones(4, np.float32), np.ones(4, np.float32))
            np.testing.assert_array_equal(r, np.full(4, 2, np.float32))
            assert held(s) == before


def test_large_arrays_over_grpc_go_by_put_and_are_freed(daemon):
    big = """
    func.func @main(%a: tensor<1048576xf32>, %b: tensor<1048576xf32>) -> tensor<1048576xf32> {
      %0 = stablehlo.add %a, %b : tensor<1048576xf32>
      func.return %0 : tensor<1048576xf32>
    }"""
    with tpubox.connect(daemon.tcp, ALICE) as s:
        exe = s.compile(big)
        a = RNG.standard_normal(1 << 20, dtype=np.float32)
        b = RNG.standard_normal(1 << 20, dtype=np.float32)
        before = held(s)
        # 8 MiB of arrays: more than one request carries inline; one is put first and
        # freed by the call.
        (r,) = exe.call(a, b)
        np.testing.assert_array_equal(r, a + b)
        assert held(s) == before
