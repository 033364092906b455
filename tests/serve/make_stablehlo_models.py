"""Exports the StableHLO models of tests/serve/test_stablehlo.py with the pinned jax, and JAX's
own outputs for their test inputs. Run by that test in the venv that has jax and the tpubox
package ($CACHE/venv-python, with PYTHONPATH=python so this checkout's tpubox.jax is used):

    python make_stablehlo_models.py OUT

writes OUT/repo/ (a model repository) and OUT/reference.npz. Random weights (fixed seeds); the
programs are exported for the CPU plugin.

    repo/mlp/        a 2-layer MLP, x FP32[4] -> logits FP32[3], prob FP32[3]; buckets 1, 4, 8
    repo/encoder/    a one-layer transformer encoder (token and position embeddings, 2-head
                     self-attention, layer norms, GELU feed-forward, mean pooling):
                     ids INT32[8] -> embedding FP32[16], hidden FP32[8,16]; buckets 1, 2, 4;
                     two instances
    repo/flat/       no batch dimension (max_batch_size = 0): a FP32[2,4] -> y FP32[2,8] = a @ w,
                     total FP32[] = sum(a)
    repo/broken_*/   copies of mlp, each broken in one way (see BROKEN in the test)
    repo/loop/       doubles x until it passes a threshold: a `while` XLA cannot bound, which
                     runs on the loop budget under the default program policy;
                     repo/loop_trusted/ is the same export with `[tpubox.limits] trusted =
                     true`, repo/loop_no_budget/ with `max_loop_iterations = 0` (refused)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

import tpubox.jax as tj

D_IN, HIDDEN, CLASSES = 4, 8, 3
VOCAB, SEQ, DIM, HEADS, FFN = 50, 8, 16, 2, 32


def mlp_params(rng):
    f = lambda *s: (rng.standard_normal(s) * 0.5).astype(np.float32)  # noqa: E731
    return {"dense1": {"w": f(D_IN, HIDDEN), "b": f(HIDDEN)}, "dense2": {"w": f(HIDDEN, CLASSES), "b": f(CLASSES)}}


def mlp(p, x):
    h = jax.nn.relu(x @ p["dense1"]["w"] + p["dense1"]["b"])
    logits = h @ p["dense2"]["w"] + p["dense2"]["b"]
    return {"logits": logits, "prob": jax.nn.softmax(logits, axis=-1)}


def encoder_params(rng):
    f = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    return {
        "embed": {"tokens": f(VOCAB, DIM), "positions": f(SEQ, DIM)},
        "attn": {"q": f(DIM, DIM), "k": f(DIM, DIM), "v": f(DIM, DIM), "o": f(DIM, DIM)},
        "ln1": {"scale": ones(DIM) + f(DIM), "bias": f(DIM)},
        "ffn": {"w1": f(DIM, FFN), "b1": f(FFN), "w2": f(FFN, DIM), "b2": f(DIM)},
        "ln2": {"scale": ones(DIM) + f(DIM), "bias": f(DIM)},
    }


def layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def encoder(p, ids):
    x = p["embed"]["tokens"][ids] + p["embed"]["positions"]
    b, s, _ = x.shape
    split = lambda t: t.reshape(b, s, HEADS, DIM // HEADS).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = (split(x @ p["attn"][n]) for n in "qkv")
    att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(DIM // HEADS), axis=-1)
    a = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, DIM) @ p["attn"]["o"]
    x = layer_norm(x + a, p["ln1"])
    f = jax.nn.gelu(x @ p["ffn"]["w1"] + p["ffn"]["b1"]) @ p["ffn"]["w2"] + p["ffn"]["b2"]
    h = layer_norm(x + f, p["ln2"])
    return {"embedding": h.mean(axis=1), "hidden": h}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    types = {"F32": np.float32, "F16": np.float16}
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a : 8 + n + b], types[h["dtype"]]).reshape(h["shape"])
    return out


def broken_copies(repo: Path, params) -> None:
    """One copy of repo/mlp per way of being broken."""
    good = repo / "mlp"
    weights = read_safetensors(good / "weights.safetensors")
    config = (good / "config.toml").read_text()

    def copy(name: str) -> Path:
        d = repo / name
        shutil.copytree(good, d)
        (d / "config.toml").write_text(config.replace('name = "mlp"', f'name = "{name}"'))
        return d

    d = copy("broken_missing_weight")
    tj.write_safetensors(d / "weights.safetensors", {k: v for k, v in weights.items() if k != "dense2/b"})
    d = copy("broken_extra_weight")
    tj.write_safetensors(d / "weights.safetensors", {**weights, "dense3/w": np.zeros((3, 3), np.float32)})
    d = copy("broken_dtype")
    tj.write_safetensors(
        d / "weights.safetensors", {**weights, "dense1/w": weights["dense1/w"].astype(np.float16)}
    )
    d = copy("broken_shape")
    tj.write_safetensors(d / "weights.safetensors", {**weights, "dense1/w": np.zeros((5, HIDDEN), np.float32)})
    d = copy("broken_param_count")
    (d / "config.toml").write_text(
        (d / "config.toml").read_text().replace('  { weight = "dense2/b" },\n', "")
    )
    tj.write_safetensors(d / "weights.safetensors", {k: v for k, v in weights.items() if k != "dense2/b"})
    d = copy("broken_program")
    (d / "model.b4.mlirbc").write_bytes(b"ML\xefR this is not MLIR bytecode")
    d = copy("broken_symbolic")
    flat = lambda b1, w1, b2, w2, x: mlp({"dense1": {"w": w1, "b": b1}, "dense2": {"w": w2, "b": b2}}, x)  # noqa: E731
    specs = [jax.ShapeDtypeStruct(weights[k].shape, np.float32) for k in ("dense1/b", "dense1/w", "dense2/b", "dense2/w")]
    (bdim,) = jax_export.symbolic_shape("b")
    exp = jax_export.export(jax.jit(flat), platforms=["cpu"])(
        *specs, jax.ShapeDtypeStruct((bdim, D_IN), np.float32)
    )
    (d / "model.b4.mlirbc").write_bytes(bytes(exp.mlir_module_serialized))


def main(out: Path) -> None:
    repo = out / "repo"
    repo.mkdir(parents=True)
    rng = np.random.default_rng(29)
    mp = mlp_params(rng)
    tj.export_model(
        mlp, mp, [np.zeros((1, D_IN), np.float32)], repo, "mlp",
        batch_sizes=[1, 4, 8], input_names=["x"], max_queue_delay_microseconds=20000,
    )  # fmt: skip
    ep = encoder_params(rng)
    tj.export_model(
        encoder, ep, [np.zeros((1, SEQ), np.int32)], repo, "encoder",
        batch_sizes=[1, 2, 4], input_names=["ids"], max_queue_delay_microseconds=20000,
        instance_count=2,
    )  # fmt: skip
    # No batch dimension: one program, exported for the shapes as they are.
    tj.export_model(lambda p, a: (a @ p["w"], a.sum()), {"w": mp["dense1"]["w"]},
                    [np.zeros((2, D_IN), np.float32)], repo, "flat", batch_sizes=None,
                    input_names=["a"], output_names=["y", "total"])  # fmt: skip
    broken_copies(repo, mp)

    def loop(p, x):
        def body(v):
            return v * p["factor"] + 1.0

        return {"y": jax.lax.while_loop(lambda v: jnp.max(v) < 100.0, body, x)}

    tj.export_model(loop, {"factor": np.float32(2.0)}, [np.zeros((1, 2), np.float32)], repo, "loop",
                    batch_sizes=[2], input_names=["x"])  # fmt: skip
    shutil.copytree(repo / "loop", repo / "loop_trusted")
    c = (repo / "loop" / "config.toml").read_text().replace('name = "loop"', 'name = "loop_trusted"')
    (repo / "loop_trusted" / "config.toml").write_text(c + "\n[tpubox.limits]\ntrusted = true\n")
    shutil.copytree(repo / "loop", repo / "loop_no_budget")
    c = (repo / "loop" / "config.toml").read_text().replace('name = "loop"', 'name = "loop_no_budget"')
    (repo / "loop_no_budget" / "config.toml").write_text(c + "\n[tpubox.limits]\nmax_loop_iterations = 0\n")

    x = rng.standard_normal((16, D_IN)).astype(np.float32)
    ids = rng.integers(0, VOCAB, (6, SEQ)).astype(np.int32)
    m = jax.jit(mlp)(mp, x)
    e = jax.jit(encoder)(ep, ids)
    np.savez(
        out / "reference.npz",
        mlp_x=x, mlp_logits=np.asarray(m["logits"]), mlp_prob=np.asarray(m["prob"]),
        enc_ids=ids, enc_embedding=np.asarray(e["embedding"]), enc_hidden=np.asarray(e["hidden"]),
    )  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))
