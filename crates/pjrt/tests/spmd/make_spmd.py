"""Writes the sharded jax.export corpus of crates/pjrt/tests/spmd.rs into DIR.

Each case NAME is a function jitted over a mesh of 4 CPU devices (JAX's `jax_num_cpu_devices`):
NAME.mlirbc is `jax.export`'s module (portable VHLO bytecode, with Shardy's `sdy.sharding`
annotations, or GSPMD's `mhlo.sharding` for the cases exported with Shardy off),
NAME.in0.npy, ... its global inputs and NAME.out0.npy, ... JAX's own global outputs. cases.json
lists each case with the shardings XLA chose for its parameters and outputs when JAX compiled
it (XLA's text form, from the compiled executable) and a tolerance; cases.tsv holds the same
one case a line.

Run with the JAX venv's python: python make_spmd.py DIR. Nothing it writes is committed."""

import json
import sys
from functools import partial
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import export, lax  # noqa: E402
from jax._src.lib import xla_client as xc  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

rng = np.random.default_rng(45)
# Auto axes: XLA propagates shardings between the annotated inputs and outputs (jit's classic
# mode), rather than JAX's explicit-sharding types.
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
    "train_step": (train_step, [f32(5, 2), f32(2), f32(8, 5), f32(8, 2)],
                   (ns(MESH), ns(MESH), ns(MESH, "x"), ns(MESH, "x")), None, 1e-5, True),
    "attention_heads": (attention, [f32(2, 4, 3, 8), f32(2, 4, 3, 8), f32(2, 4, 3, 8)],
                        (ns(MESH, None, "x"),) * 3, ns(MESH, None, "x"), 1e-5, True),
    "psum": (smap(lambda x: lax.psum(x, "x"), P("x"), P()), [f32(8, 3)], (ns(MESH, "x"),), None, 1e-6,
             True),
    "all_gather": (smap(lambda x: lax.all_gather(x, "x", tiled=True) * 2.0, P("x"), P("x")),
                   [f32(8, 3)], (ns(MESH, "x"),), None, 0, True),
    "ppermute": (smap(lambda x: lax.ppermute(x, "x", RING), P("x"), P("x")), [f32(8, 3)],
                 (ns(MESH, "x"),), None, 0, True),
    "all_to_all": (smap(lambda x: lax.all_to_all(x, "x", 1, 0, tiled=True), P("x"), P("x")),
                   [f32(8, 8)], (ns(MESH, "x"),), None, 0, True),
    "gspmd_data_parallel": (mlp, [f32(8, 5), f32(5, 3), f32(3)],
                            (ns(MESH, "x"), ns(MESH), ns(MESH)), ns(MESH, "x"), 1e-6, False),
    "gspmd_psum": (smap(lambda x: lax.psum(x, "x"), P("x"), P()), [f32(8, 3)], (ns(MESH, "x"),), None,
                   1e-6, False),
}


def hlo_text(shardings):
    return [str(xc.HloSharding.from_proto(p)) for p in shardings]


def write_case(d: Path, name, fn, inputs, in_s, out_s, rtol, shardy):
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        kw = {"in_shardings": in_s}
        if out_s is not None:
            kw["out_shardings"] = out_s
        jitted = jax.jit(fn, **kw)
        args = [jax.device_put(a, s) for a, s in zip(inputs, in_s)]
        outs = jitted(*args)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        xla = jitted.lower(*args).compile()._executable.xla_executable
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
        "num_partitions": exported.nr_devices,
        "shardy": shardy,
        "in_shardings": hlo_text(xla.get_parameter_shardings()),
        "out_shardings": hlo_text(xla.get_output_shardings()),
        "rtol": rtol,
    }


def main(out):
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cases = [write_case(d, name, *spec) for name, spec in CASES.items()]
    (d / "cases.json").write_text(json.dumps(cases, indent=1))
    # The same, one case a line, for the Rust test (no JSON parser there): tab-separated name,
    # inputs, outputs, partitions, rtol, then the parameter and output shardings, each list
    # joined by ";".
    (d / "cases.tsv").write_text("".join(
        "\t".join([c["name"], str(c["inputs"]), str(c["outputs"]), str(c["num_partitions"]),
                   repr(c["rtol"]), ";".join(c["in_shardings"]), ";".join(c["out_shardings"])])
        + "\n" for c in cases))


if __name__ == "__main__":
    main(sys.argv[1])
