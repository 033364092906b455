"""Writes the sharded jax.export corpus of test_sharded.py into DIR.

Each case NAME is a function jitted over a mesh of CPU devices (JAX's `jax_num_cpu_devices`,
4 here: JAX tests its own multi-device code the same way): NAME.mlirbc is what
`Exported.mlir_module_serialized` holds (portable VHLO bytecode with Shardy's `sdy.sharding`
annotations and `mhlo.num_partitions = N`; GSPMD's `mhlo.sharding` for the cases exported with
Shardy off), NAME.in0.npy, ... its global inputs and NAME.out0.npy, ... JAX's own global
outputs on the same devices. cases.json lists each case with the devices it was exported for
and its tolerance.

Run in its own process with the JAX venv's python (python make_sharded.py DIR): the device
count must be set before JAX starts its CPU backend, which the single-device corpus
(make_corpus.py) starts in the test process. Nothing it writes is committed."""

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax import export, lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

rng = np.random.default_rng(45)
# Auto axes: XLA propagates shardings between the annotated inputs and outputs (jit's classic
# mode), rather than JAX's explicit-sharding types.
MESH = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
MESH2 = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
# Two devices of the four: a program for 2 devices (run on the first two, or on --devices).
PAIR = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",), axis_types=(AxisType.Auto,))


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


def smap(f, in_specs, out_specs, mesh=MESH):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def int_stats(x):
    return jnp.sum(x, axis=0), jnp.cumsum(x, axis=1), jnp.max(x)


def mesh_collectives(x):
    # psum over one axis of a 2x2 mesh (split along the other), pmax over both.
    return lax.psum(x, "a"), lax.pmax(x, ("a", "b"))


RING = [(i, (i + 1) % 4) for i in range(4)]

# name: (function, inputs, in_shardings, out_shardings (None: JAX's choice), rtol, shardy)
CASES = {
    "data_parallel": (mlp, [f32(8, 5), f32(5, 3), f32(3)],
                      (ns(MESH, "x"), ns(MESH), ns(MESH)), ns(MESH, "x"), 1e-6, True),
    "tensor_parallel": (tensor_parallel, [f32(4, 6), f32(6, 8), f32(8, 3)],
                        (ns(MESH), ns(MESH, None, "x"), ns(MESH, "x")), ns(MESH), 1e-5, True),
    "mesh_2x2": (lambda x, y: (x * y + 1.0, jnp.sum(x, axis=1)), [f32(4, 6), f32(4, 6)],
                 (ns(MESH2, "a", "b"), ns(MESH2, "a", "b")), (ns(MESH2, "a", "b"), ns(MESH2, "a")),
                 1e-6, True),
    "mesh_2x2_transposed": (lambda x: x @ x.T, [f32(4, 6)], (ns(MESH2, "b", "a"),),
                            ns(MESH2, "b"), 1e-5, True),
    "half_replicated": (lambda x: jnp.exp(x), [f32(6, 2)], (ns(MESH2, "a"),), ns(MESH2, "a"), 1e-6,
                        True),
    "reductions": (reductions, [f32(8, 4)], (ns(MESH, "x"),), None, 1e-5, True),
    "int_reductions": (int_stats, [rng.integers(-50, 50, (8, 6)).astype(np.int32)],
                       (ns(MESH, "x", None),), None, 0, True),
    "train_step": (train_step, [f32(5, 2), f32(2), f32(8, 5), f32(8, 2)],
                   (ns(MESH), ns(MESH), ns(MESH, "x"), ns(MESH, "x")), None, 1e-5, True),
    "attention_heads": (attention, [f32(2, 4, 3, 8), f32(2, 4, 3, 8), f32(2, 4, 3, 8)],
                        (ns(MESH, None, "x"),) * 3, ns(MESH, None, "x"), 1e-5, True),
    "bf16_data_parallel": (lambda x, w: (x @ w).astype(jnp.bfloat16),
                           [f32(8, 4).astype(ml_dtypes.bfloat16), f32(4, 3).astype(ml_dtypes.bfloat16)],
                           (ns(MESH, "x"), ns(MESH)), ns(MESH, "x"), 0, True),
    "psum": (smap(lambda x: lax.psum(x, "x"), P("x"), P()), [f32(8, 3)], (ns(MESH, "x"),), None, 1e-6,
             True),
    "all_gather": (smap(lambda x: lax.all_gather(x, "x", tiled=True) * 2.0, P("x"), P("x")),
                   [f32(8, 3)], (ns(MESH, "x"),), None, 0, True),
    "ppermute": (smap(lambda x: lax.ppermute(x, "x", RING), P("x"), P("x")), [f32(8, 3)],
                 (ns(MESH, "x"),), None, 0, True),
    "all_to_all": (smap(lambda x: lax.all_to_all(x, "x", 1, 0, tiled=True), P("x"), P("x")),
                   [f32(8, 8)], (ns(MESH, "x"),), None, 0, True),
    "psum_scatter": (smap(lambda x: lax.psum_scatter(x, "x", tiled=True), P("x"), P("x")),
                     [f32(16, 3)], (ns(MESH, "x"),), None, 1e-6, True),
    "mesh_2x2_collectives": (smap(mesh_collectives, P("a", "b"), (P(None, "b"), P()), mesh=MESH2),
                             [f32(4, 6)], (ns(MESH2, "a", "b"),), None, 1e-6, True),
    "gspmd_data_parallel": (mlp, [f32(8, 5), f32(5, 3), f32(3)],
                            (ns(MESH, "x"), ns(MESH), ns(MESH)), ns(MESH, "x"), 1e-6, False),
    "gspmd_psum": (smap(lambda x: lax.psum(x, "x"), P("x"), P()), [f32(8, 3)], (ns(MESH, "x"),), None,
                   1e-6, False),
    # One device (no shardings: jit without a mesh): runs as before, on device 0.
    "single_device": (lambda x: jnp.cumsum(x, axis=0) * 2.0, [f32(8, 3)], None, None, 1e-6, True),
    # For 2 devices: the first two of four, or those --devices names.
    "pair_data_parallel": (mlp, [f32(6, 5), f32(5, 3), f32(3)],
                           (ns(PAIR, "x"), ns(PAIR), ns(PAIR)), ns(PAIR, "x"), 1e-6, True),
}


def write_case(d: Path, name, fn, inputs, in_s, out_s, rtol, shardy):
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        kw = {} if in_s is None else {"in_shardings": in_s}
        if out_s is not None:
            kw["out_shardings"] = out_s
        jitted = jax.jit(fn, **kw)
        args = inputs if in_s is None else [jax.device_put(a, s) for a, s in zip(inputs, in_s)]
        outs = jitted(*args)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        exported = export.export(jitted)(*args)
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)
    (d / f"{name}.mlirbc").write_bytes(exported.mlir_module_serialized)
    for i, a in enumerate(inputs):
        np.save(d / f"{name}.in{i}.npy", a)
    for i, o in enumerate(outs):
        np.save(d / f"{name}.out{i}.npy", np.asarray(o))
    return {
        "name": name,
        "inputs": len(inputs),
        "outputs": len(outs),
        "devices": exported.nr_devices,
        "shardy": shardy,
        "rtol": rtol,
    }


def main(out):
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cases = [write_case(d, name, *spec) for name, spec in CASES.items()]
    (d / "cases.json").write_text(json.dumps(cases, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
