"""Programs over several devices through the Python client (issue 45): a daemon with four CPU
devices (`--cpu-devices 4`, standing in for a TPU host's chips), sessions holding all four,
and a corpus of sharded JAX programs (data and tensor parallel, a 2x2 mesh, reductions over a
sharded axis, each shard_map collective, a data-parallel training step, attention sharded by
heads), each run

- through the session: `jax.export` of `jax.jit` with `NamedSharding`s over a 4-device mesh,
  `Session.compile(..., devices=s.devices)`, called with global arrays (split by the daemon)
  and with `ShardedTensor`s put by the program's input shardings;
- through `tpubox.jax.jit(f, in_shardings=..., out_shardings=...)`;

and compared with JAX's own results on 4 CPU devices (`jax_num_cpu_devices`, as JAX tests its
own multi-device code), each checked to have run on the session's 4 devices. Then the hostile
cases with their exact error classes (sharded puts that lie about sizes or devices, a program
over more devices than the session holds, a session closed while a 4-device execution runs),
each leaving nothing behind.
"""

from __future__ import annotations

import threading
import time

import jax

jax.config.update("jax_platforms", "cpu")
try:
    jax.config.update("jax_num_cpu_devices", 4)
except RuntimeError:
    pass  # the backend already started (conftest asks for 4 devices through the environment)

import grpc  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax import export, lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tpubox  # noqa: E402
import tpubox.jax as tj  # noqa: E402
from tpubox import _wire  # noqa: E402
from tpubox._proto import session_pb2 as pb  # noqa: E402
from tpubox_daemon import Daemon, binary, wait_until  # noqa: E402

if len(jax.devices()) < 4:
    pytest.skip(
        "JAX started with fewer than 4 CPU devices (set JAX_NUM_CPU_DEVICES=4)",
        allow_module_level=True,
    )

FOUR = "sharded-four-token"  # every device
PAIR = "sharded-pair-token"  # two devices only
SMALL = "sharded-small-token"  # 1 MiB of device memory

TENANTS = {
    "four": {"token": FOUR, "session": {"max_device_mib": 512}},
    "pair": {"token": PAIR, "session": {"devices": 2}},
    "small": {"token": SMALL, "session": {"max_device_mib": 1}},
}

rng = np.random.default_rng(45)
MESH = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
MESH2 = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def ns(mesh, *spec):
    return NamedSharding(mesh, P(*spec))


def mlp(x, w, b):
    return jax.nn.relu(x @ w + b)


def tensor_parallel(x, w1, w2):
    # w1 split by columns, w2 by rows: the second matmul sums partial products (an all-reduce).
    return jnp.tanh(x @ w1) @ w2


def reductions(x):
    return jnp.sum(x), jnp.mean(x, axis=0), jnp.max(x, axis=1)


def train_step(w, b, x, y):
    def loss(w, b):
        return jnp.mean((x @ w + b - y) ** 2)

    gw, gb = jax.grad(loss, argnums=(0, 1))(w, b)
    return w - 0.1 * gw, b - 0.1 * gb, loss(w, b)


def attention(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def smap(f, in_specs, out_specs):
    return jax.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs)


RING = [(i, (i + 1) % 4) for i in range(4)]

# name: (function, inputs, in_shardings, out_shardings (None: JAX's choice), rtol)
CASES = {
    "data_parallel": (mlp, [f32(8, 5), f32(5, 3), f32(3)],
                      (ns(MESH, "x"), ns(MESH), ns(MESH)), ns(MESH, "x"), 1e-6),
    "tensor_parallel": (tensor_parallel, [f32(4, 6), f32(6, 8), f32(8, 3)],
                        (ns(MESH), ns(MESH, None, "x"), ns(MESH, "x")), ns(MESH), 1e-5),
    "mesh_2x2": (lambda x, y: (x * y + 1.0, jnp.sum(x, axis=1)), [f32(4, 6), f32(4, 6)],
                 (ns(MESH2, "a", "b"), ns(MESH2, "a", "b")),
                 (ns(MESH2, "a", "b"), ns(MESH2, "a")), 1e-6),
    "mesh_2x2_transposed": (lambda x: x @ x.T, [f32(4, 6)], (ns(MESH2, "b", "a"),),
                            ns(MESH2, "b"), 1e-5),
    "half_replicated": (lambda x: jnp.exp(x), [f32(6, 2)], (ns(MESH2, "a"),), ns(MESH2, "a"),
                        1e-6),
    "reductions": (reductions, [f32(8, 4)], (ns(MESH, "x"),), None, 1e-5),
    "train_step": (train_step, [f32(5, 2), f32(2), f32(8, 5), f32(8, 2)],
                   (ns(MESH), ns(MESH), ns(MESH, "x"), ns(MESH, "x")), None, 1e-5),
    "attention_heads": (attention, [f32(2, 4, 3, 8), f32(2, 4, 3, 8), f32(2, 4, 3, 8)],
                        (ns(MESH, None, "x"),) * 3, ns(MESH, None, "x"), 1e-5),
    "psum": (smap(lambda x: lax.psum(x, "x"), P("x"), P()), [f32(8, 3)], (ns(MESH, "x"),),
             None, 1e-6),
    "all_gather": (smap(lambda x: lax.all_gather(x, "x", tiled=True) * 2.0, P("x"), P("x")),
                   [f32(8, 3)], (ns(MESH, "x"),), None, 0),
    "ppermute": (smap(lambda x: lax.ppermute(x, "x", RING), P("x"), P("x")), [f32(8, 3)],
                 (ns(MESH, "x"),), None, 0),
    "all_to_all": (smap(lambda x: lax.all_to_all(x, "x", 1, 0, tiled=True), P("x"), P("x")),
                   [f32(8, 8)], (ns(MESH, "x"),), None, 0),
}  # fmt: skip


def jitted(name):
    fn, _, in_s, out_s, _ = CASES[name]
    kw = {"in_shardings": in_s}
    if out_s is not None:
        kw["out_shardings"] = out_s
    return jax.jit(fn, **kw)


def reference(name):
    """JAX's own outputs on its 4 CPU devices, as a list of NumPy arrays."""
    _, inputs, in_s, _, _ = CASES[name]
    args = [jax.device_put(a, s) for a, s in zip(inputs, in_s)]
    outs = jitted(name)(*args)
    return [np.asarray(o) for o in (outs if isinstance(outs, (tuple, list)) else [outs])]


def exported(name):
    _, inputs, _, _, _ = CASES[name]
    exp = export.export(jitted(name))(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inputs])
    assert exp.nr_devices == 4
    return exp


def close(got, want, rtol):
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    if rtol == 0:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A daemon of this module's own with four CPU devices."""
    try:
        binary()
    except FileNotFoundError as e:
        pytest.exit(str(e), returncode=1)
    d = Daemon(tmp_path_factory.mktemp("sharded"), TENANTS, extra_args=("--cpu-devices", "4"))
    d.start()
    yield d
    rc = d.stop()
    assert rc == 0, f"tpubox serve exited {rc} after SIGTERM\n{d.log()[-4000:]}"


def usage_is_zero(host, token):
    u = tpubox.tenant_usage(host.unix, token)
    return u.sessions == 0 and u.usage.device_bytes == 0 and u.usage.live_tensors == 0 and (
        u.usage.transfer_bytes == 0 and u.usage.pending_launches == 0
    )


@pytest.fixture(autouse=True)
def nothing_left(host):
    """After each test: no tenant holds a session, a byte, a handle or a transfer."""
    yield
    for token in (FOUR, PAIR, SMALL):
        wait_until(lambda: usage_is_zero(host, token), 30, f"usage of {token} back to zero")


@pytest.fixture(params=["local", "grpc"])
def four(request, host):
    """A session on all four devices; its single-device traffic through the local socket or
    gRPC (sharded calls always go through gRPC)."""
    with tpubox.connect(host.unix, FOUR, local=request.param == "local") as s:
        assert s.devices == (0, 1, 2, 3)
        yield s


def refused(cls, fn, *args, **kwargs):
    """Calls FN and returns the error it raised, which must be exactly CLS."""
    with pytest.raises(tpubox.TpuboxError) as ei:
        fn(*args, **kwargs)
    assert type(ei.value) is cls, f"{type(ei.value).__name__}: {ei.value}"
    return ei.value


def on_four(st, exe=None):
    """ST is a ShardedTensor with one shard on each of the session's 4 devices."""
    assert isinstance(st, tpubox.ShardedTensor), type(st)
    assert st.devices == (0, 1, 2, 3), st
    assert [t.device for t in st.shards] == [0, 1, 2, 3]
    if exe is not None:
        assert exe.devices == (0, 1, 2, 3) and exe.is_spmd


# ---------------------------------------------------------------------------------------------
# The corpus through the session


@pytest.mark.parametrize("name", list(CASES))
def test_corpus_through_the_session(four, name):
    _, inputs, _, _, rtol = CASES[name]
    want = reference(name)
    exe = four.compile(exported(name).mlir_module_serialized, devices=four.devices)
    assert exe.devices == (0, 1, 2, 3) and exe.is_spmd
    assert len(exe.parameter_shardings) == len(inputs)
    assert [tuple(g.shape) for g in exe.global_parameters] == [a.shape for a in inputs]
    assert [tuple(g.shape) for g in exe.global_results] == [w.shape for w in want]
    # Global arrays in, split by the daemon; ShardedTensors out, on the 4 devices.
    outs = exe(*inputs)
    assert len(outs) == len(want)
    for o, w in zip(outs, want):
        on_four(o, exe)
        assert o.shape == w.shape and o.dtype == w.dtype
        close(o.numpy(), w, rtol)
    # ShardedTensors put by the program's input shardings, fed back in.
    args = [four.put_sharded(a, sh) for a, sh in zip(inputs, exe.parameter_shardings)]
    for a, t in zip(args, exe.parameters):
        on_four(a)
        assert all(x.shape == t.shape for x in a.shards)
    again = exe(*args)
    for o, w in zip(again, want):
        close(o.numpy(), w, rtol)
    # One round trip, global arrays back.
    fetched = exe.call(*inputs)
    for o, w in zip(fetched, want):
        assert isinstance(o, np.ndarray)
        close(o, w, rtol)
    u = four.usage()
    assert {d.device for d in u.device_bytes_by_device if d.bytes} == {0, 1, 2, 3}, u


@pytest.mark.parametrize("name", list(CASES))
def test_corpus_through_tpubox_jax_jit(four, name):
    fn, inputs, in_s, out_s, rtol = CASES[name]
    want = reference(name)
    f = tj.jit(fn, session=four, in_shardings=in_s, out_shardings=out_s)
    got = f(*inputs)
    leaves = got if isinstance(got, (tuple, list)) else [got]
    assert len(leaves) == len(want)
    for o, w in zip(leaves, want):
        on_four(o, f.executable(*inputs))
        close(tj.device_get(o), w, rtol)
    assert f.compiles == 1
    # Its outputs fed back where the shapes allow: kept on the devices, same program.
    if name == "train_step":
        w, b, x, y = inputs
        w1, b1, _ = got
        w2, b2, loss2 = f(w1, b1, x, y)
        rw, rb = reference_train_steps(w, b, x, y, 2)
        close(w2.numpy(), rw, 1e-5)
        close(b2.numpy(), rb, 1e-5)
        assert f.compiles == 1


def reference_train_steps(w, b, x, y, n):
    step = jitted("train_step")
    _, _, in_s, _, _ = CASES["train_step"]
    args = [jax.device_put(a, s) for a, s in zip((w, b, x, y), in_s)]
    for _ in range(n):
        w2, b2, _ = step(*args)
        args = [w2, b2, args[2], args[3]]
    return np.asarray(args[0]), np.asarray(args[1])


def test_shard_map_without_in_shardings_and_device_put(four):
    """A shard_map names its mesh itself; tpubox.jax.device_put lays arrays out as
    jax.device_put does, and the jitted function takes them where they are."""
    fn = smap(lambda x: lax.psum(x, "x"), P("x"), P())
    x = f32(8, 3)
    xs = tj.device_put(x, four, sharding=ns(MESH, "x"))
    on_four(xs)
    assert xs.sharding == "{devices=[4,1]<=[4]}"
    assert [t.shape for t in xs.shards] == [(2, 3)] * 4
    np.testing.assert_array_equal(xs.numpy(), x)
    f = tj.jit(fn, session=four)
    got = f(xs)
    on_four(got)
    close(got.numpy(), np.asarray(jax.jit(fn)(jax.device_put(x, ns(MESH, "x")))), 1e-6)
    # Passed as a global array, or laid out otherwise (resharded), the same.
    close(f(x).numpy(), got.numpy(), 0)
    other = tj.device_put(x, four, sharding=ns(MESH))
    assert other.sharding == "{replicated}"
    close(f(other).numpy(), got.numpy(), 0)


def test_a_mesh_of_explicit_axes(four):
    """make_mesh's default axes are Explicit (shardings in the types): in_shardings type the
    arguments, for a shard_map too."""
    mesh = jax.make_mesh((2, 2), ("a", "b"))
    assert all(t == AxisType.Explicit for t in mesh.axis_types)
    x, w = f32(8, 6), f32(6, 4)
    in_s = (NamedSharding(mesh, P("a")), NamedSharding(mesh, P(None, "b")))
    fn = lambda x, w: x @ w  # noqa: E731
    want = np.asarray(jax.jit(fn, in_shardings=in_s)(*[jax.device_put(a, s) for a, s in
                                                       zip((x, w), in_s)]))  # fmt: skip
    got = tj.jit(fn, session=four, in_shardings=in_s)(x, w)
    on_four(got)
    assert got.sharding == "{devices=[2,2]<=[4]}"
    close(got.numpy(), want, 1e-5)
    sm = jax.shard_map(lambda v: lax.psum(v, ("a", "b")), mesh=mesh, in_specs=P(("a", "b")),
                       out_specs=P())  # fmt: skip
    s = NamedSharding(mesh, P(("a", "b")))
    want = np.asarray(jax.jit(sm, in_shardings=s)(jax.device_put(x, s)))
    got = tj.jit(sm, session=four, in_shardings=s)(x)
    on_four(got)
    close(got.numpy(), want, 1e-6)


def test_sharded_tensors_replicated_uneven_and_freed(four):
    """put_sharded without an executable: replicated, a 2x2 grid, a split that does not divide
    the dimension (zero-padded shards), read back whole; charged per device; freed."""
    before = four.usage().device_bytes
    assert before == 0
    x = np.arange(30, dtype=np.float32).reshape(6, 5)
    r = four.put_sharded(x, "{replicated}")
    on_four(r)
    assert all(t.shape == (6, 5) for t in r.shards)
    np.testing.assert_array_equal(r.numpy(), x)
    np.testing.assert_array_equal(r.shards[3].numpy(), x)
    g = four.put_sharded(x, "{devices=[2,2]<=[4]}")
    assert [t.shape for t in g.shards] == [(3, 3)] * 4
    np.testing.assert_array_equal(g.shards[1].numpy(), np.pad(x[:3, 3:], ((0, 0), (0, 1))))
    np.testing.assert_array_equal(g.numpy(), x)
    u = four.put_sharded(x, "{devices=[4,1]<=[4]}")
    assert [t.shape for t in u.shards] == [(2, 5)] * 4
    np.testing.assert_array_equal(u.shards[3].numpy(), np.zeros((2, 5), np.float32))
    np.testing.assert_array_equal(u.numpy(), x)
    # Half the devices, named.
    h = four.put_sharded(x, "{devices=[2,1]<=[2]}", devices=[3, 1])
    assert h.devices == (3, 1)
    np.testing.assert_array_equal(h.shards[0].numpy(), x[:3])
    np.testing.assert_array_equal(h.numpy(), x)
    # Charged per shard on its device: 120 (replicated) + 36 (2x2) + 40 (uneven) on each,
    # and 60 more on devices 3 and 1.
    by = {d.device: d.bytes for d in four.usage().device_bytes_by_device}
    assert by == {0: before + 196, 1: before + 256, 2: before + 196, 3: before + 256}, by
    four.free(r, g, u, h)
    assert r.freed and g.freed
    assert four.usage().device_bytes == before


def test_donated_shards_and_kept_results(four):
    fn = lambda x: x * 2.0  # noqa: E731
    f = tj.jit(fn, session=four, in_shardings=ns(MESH, "x"), out_shardings=ns(MESH, "x"),
               donate_argnums=0)  # fmt: skip
    x = f32(8, 4)
    xs = tj.device_put(x, four, sharding=ns(MESH, "x"))
    y = f(xs)
    assert xs.donated and all(t.donated for t in xs.shards)
    close(y.numpy(), x * 2.0, 0)
    refused(tpubox.FailedPrecondition, f.executable(x), xs)
    # fetch and keep: the global array comes back and the shards stay.
    exe = f.executable(x)
    (kept,) = exe.call(x, keep=[0])
    on_four(kept)
    close(kept.numpy(), x * 2.0, 0)
    assert kept._host is not None  # answered from the fetched bytes
    close(kept.shards[1].numpy(), x[2:4] * 2.0, 0)
    kept.free()
    assert kept.freed
    refused(tpubox.NotFound, kept.shards[0].session.get, kept.shards[0].handle)


# ---------------------------------------------------------------------------------------------
# Hostile cases


def put_raw(s, messages):
    """PutShardedTensor with hand-made messages (what a hostile client may send)."""
    try:
        info = s._put_sharded(iter(messages), metadata=s._md, timeout=30)
    except grpc.RpcError as e:
        raise s._error(e, "PutShardedTensor") from None
    return tpubox.ShardedTensor._from_pb(s, info)


def header(dims, sharding="{devices=[4,1]<=[4]}", devices=(0, 1, 2, 3)):
    return pb.PutShardedChunk(
        spec=pb.TensorSpec(dtype=pb.F32, dims=list(dims)),
        sharding=sharding,
        devices=list(devices),
    )


def test_sharded_puts_that_lie_about_sizes(four):
    data = memoryview(np.ones(24, np.float32).tobytes())
    ok = put_raw(four, [_wire.put_sharded_chunk(header((8, 3)), data)])
    on_four(ok)
    ok.free()
    # More bytes than declared, in one message or across several; fewer; a second header.
    refused(tpubox.InvalidArgument, put_raw, four,
            [_wire.put_sharded_chunk(header((8, 3)), memoryview(bytes(100)))])  # fmt: skip
    refused(tpubox.InvalidArgument, put_raw, four, [
        _wire.put_sharded_chunk(header((8, 3)), data[:64]),
        _wire.put_sharded_chunk(None, data[:64]),
    ])  # fmt: skip
    refused(tpubox.InvalidArgument, put_raw, four,
            [_wire.put_sharded_chunk(header((8, 3)), data[:40])])  # fmt: skip
    refused(tpubox.InvalidArgument, put_raw, four, [
        _wire.put_sharded_chunk(header((8, 3)), data[:40]),
        _wire.put_sharded_chunk(header((8, 3)), data[40:]),
    ])  # fmt: skip
    # A declared size larger than the session may hold, refused before any data.
    refused(tpubox.ResourceExhausted, put_raw, four,
            [_wire.put_sharded_chunk(header((1 << 40, 4)), data)])  # fmt: skip
    # A sharding that does not tile the rank, does not parse, nests, or has no global view.
    refused(tpubox.InvalidArgument, four.put_sharded, np.ones((8, 3, 2), np.float32),
            "{devices=[4,1]<=[4]}")  # fmt: skip
    refused(tpubox.InvalidArgument, four.put_sharded, np.ones((8, 3), np.float32), "{tiles}")
    refused(tpubox.InvalidArgument, four.put_sharded, np.ones((8, 3), np.float32),
            "{" * 5000 + "}" * 5000)  # fmt: skip
    refused(tpubox.InvalidArgument, four.put_sharded, np.ones((8, 3), np.float32),
            "{devices=[4,1]<=[4]" + " " * (70 << 10) + "}")  # fmt: skip
    refused(tpubox.Unsupported, four.put_sharded, np.ones((8, 3), np.float32), "{manual}")


def test_sharded_puts_that_lie_about_devices(host, four):
    x = np.ones((8, 3), np.float32)
    sh = "{devices=[4,1]<=[4]}"
    # A device twice, one the host lacks, more devices than the host has, none, and a count
    # other than the sharding's.
    refused(tpubox.InvalidArgument, four.put_sharded, x, sh, devices=[0, 1, 1, 2])
    refused(tpubox.NotFound, four.put_sharded, x, sh, devices=[0, 1, 2, 9])
    refused(tpubox.InvalidArgument, four.put_sharded, x, sh, devices=[0, 1, 2, 3, 4])
    refused(tpubox.InvalidArgument, four.put_sharded, x, "{replicated}", devices=[])
    refused(tpubox.InvalidArgument, four.put_sharded, x, sh, devices=[0, 1])
    # Devices the session does not hold.
    with tpubox.connect(host.unix, PAIR) as pair:
        assert len(pair.devices) == 2
        outside = [d for d in range(4) if d not in pair.devices]
        refused(tpubox.PermissionDenied, pair.put_sharded, x, sh, devices=[0, 1, 2, 3])
        refused(tpubox.PermissionDenied, pair.put_sharded, x, "{devices=[2,1]<=[2]}",
                devices=[pair.devices[0], outside[0]])  # fmt: skip
        ok = pair.put_sharded(x, "{devices=[2,1]<=[2]}")
        assert ok.devices == pair.devices
        assert pair.usage().live_tensors == 2
    # Shards that lie about their devices or sizes in a call: two swapped, one short.
    exe = four.compile(exported("psum").mlir_module_serialized, devices=four.devices)
    xs = four.put_sharded(f32(8, 3), exe.parameter_shardings[0])
    swapped = tpubox.ShardedTensor(four, xs.shape, xs.dtype, xs.sharding,
                                   [xs.shards[1], xs.shards[0], *xs.shards[2:]])  # fmt: skip
    refused(tpubox.FailedPrecondition, exe, swapped)
    short = tpubox.ShardedTensor(four, xs.shape, xs.dtype, xs.sharding, xs.shards[:3])
    refused(tpubox.InvalidArgument, exe, short)
    wrong = four.tensor(np.zeros((3, 3), np.float32), device=0)
    lying = tpubox.ShardedTensor(four, xs.shape, xs.dtype, xs.sharding, [wrong, *xs.shards[1:]])
    refused(tpubox.InvalidArgument, exe, lying)
    refused(tpubox.InvalidArgument, exe, np.ones((6, 3), np.float32))
    refused(tpubox.InvalidArgument, lying.numpy)
    # A program of one device is not called sharded, and the reverse.
    one = four.compile(
        export.export(jax.jit(lambda a: a + 1))(jax.ShapeDtypeStruct((2,), np.float32))
        .mlir_module_serialized
    )
    assert one.devices == (0,) and not one.is_spmd
    assert one.parameter_shardings == ("{replicated}",)
    with pytest.raises(TypeError):
        exe(four.tensor(np.ones((8, 3), np.float32)))


def test_a_program_over_more_devices_than_the_session_holds(host):
    with tpubox.connect(host.unix, PAIR) as pair:
        assert len(pair.devices) == 2
        code = exported("psum").mlir_module_serialized
        outside = [d for d in range(4) if d not in pair.devices]
        refused(tpubox.PermissionDenied, pair.compile, code,
                devices=[*pair.devices, *outside])  # fmt: skip
        refused(tpubox.InvalidArgument, pair.compile, code, devices=[0, 1, 2, 3, 4])
        # Its own two devices for a program of four partitions: refused before XLA sees it,
        # naming both counts.
        e = refused(tpubox.InvalidArgument, pair.compile, code, devices=pair.devices)
        assert "declares 4 partition(s)" in str(e) and "2 device(s)" in str(e), e
        # tpubox.jax.jit over a mesh of 4 with a session of 2.
        fn, inputs, in_s, out_s, _ = CASES["data_parallel"]
        f = tj.jit(fn, session=pair, in_shardings=in_s, out_shardings=out_s)
        refused(tpubox.PermissionDenied, f, *inputs)
        assert pair.usage().live_executables == 0


def test_a_session_closed_while_a_four_device_call_runs(host):
    """The call's devices finish; the daemon keeps serving; the tenant's usage returns to
    zero."""

    def chain(x, w):
        for _ in range(12):
            x = jnp.tanh(x @ w)
        return x

    in_s = (ns(MESH, "x"), ns(MESH))
    x, w = f32(4 * 1024, 1024), f32(1024, 1024) / 32
    s = tpubox.connect(host.unix, FOUR)
    # Another client of the same session (as a kernel and its provisioner) ends it on the
    # daemon while this one's call runs.
    other = tpubox.session._join(host.unix, s.token, 30.0)
    f = tj.jit(chain, session=s, in_shardings=in_s, out_shardings=ns(MESH, "x"))
    exe = f.executable(x, w)
    xs = s.put_sharded(x, exe.parameter_shardings[0])
    ws = s.put_sharded(w, exe.parameter_shardings[1])
    t0 = time.monotonic()
    exe(xs, ws)[0].free()
    once = time.monotonic() - t0
    outcome: list[object] = []

    def run():
        try:
            outcome.append(exe(xs, ws))
        except tpubox.TpuboxError as e:
            outcome.append(e)

    th = threading.Thread(target=run)
    th.start()
    wait_until(lambda: s.usage().executions_running > 0 or outcome, 30, "the call running")
    running = not outcome
    assert other.close(end=True)
    th.join(60 + 10 * once)
    assert outcome, "the call did not return"
    print(f"one call: {once:.3f} s; ended while running: {running}; outcome: {outcome[0]!r}")
    assert running, f"the call ended before the session ({once:.3f} s a call)"
    assert isinstance(outcome[0], tpubox.SessionEnded), outcome[0]
    s.close()
    wait_until(lambda: usage_is_zero(host, FOUR), 60, "usage back to zero")
    # The daemon serves on.
    with tpubox.connect(host.unix, FOUR) as again:
        g = tj.jit(lambda a: a + 1.0, session=again, in_shardings=ns(MESH, "x"))
        close(g(np.zeros((8,), np.float32)).numpy(), np.ones((8,), np.float32), 0)


def test_transfers_and_fetches_are_charged_before_allocation(host):
    """A session of 1 MiB: a sharded put larger than it may hold is refused before any data;
    a replicated put of 4 copies of 300 KiB exceeds it on the devices; nothing is left."""
    with tpubox.connect(host.unix, SMALL) as s:
        refused(tpubox.ResourceExhausted, s.put_sharded, np.zeros((1 << 19,), np.float32),
                "{devices=[4]<=[4]}")  # fmt: skip
        refused(tpubox.ResourceExhausted, s.put_sharded, np.zeros((300 << 8,), np.float32),
                "{replicated}")  # fmt: skip
        ok = s.put_sharded(np.zeros((300 << 8,), np.float32), "{devices=[4]<=[4]}")
        on_four(ok)
        assert s.usage().transfer_bytes == 0


def test_a_program_over_several_devices_is_not_called_as_one(four):
    """Execute, Call and launches (gRPC or the local socket) refuse an SPMD executable at
    once, naming CallSharded, and leave nothing behind."""
    exe = four.compile(exported("psum").mlir_module_serialized, devices=four.devices)
    x = four.tensor(np.ones((2, 3), np.float32))
    e = refused(tpubox.InvalidArgument, four._execute, exe.handle, [x.handle], (), None)
    assert "CallSharded" in str(e)
    refused(tpubox.InvalidArgument, four._call, exe.handle, [np.ones((2, 3), np.float32)], (),
            [0], [], [], None)  # fmt: skip
    refused(tpubox.InvalidArgument, four._call, exe.handle, [x], (), [], [], [], None, True)
    with pytest.raises(ValueError):
        exe.launch(np.ones((8, 3), np.float32))
    u = four.usage()
    assert u.live_tensors == 1 and u.executions == 0 and u.pending_launches == 0, u
