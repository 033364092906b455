"""all-MiniLM-L6-v2 in JAX, exported as a StableHLO model for `tpubox serve` (the `exported`
benchmark, host/benches/exported.rs).

The encoder is the one examples/minilm-embed builds with the guest SDK's graph builder
(minilm_embed::build_encoder): BERT embeddings (word + token type 0 + position) and LayerNorm,
6 post-LayerNorm layers (12-head self-attention with 1/sqrt(d) applied to q and an additive
bias of finfo(f32).min on padded keys, GELU (erf) feed-forward), then mean pooling over the real
tokens and L2 normalisation, as sentence-transformers does. Its parameters are the tensors of
the model's own model.safetensors, under their names in that file: the params pytree is a flat
dict keyed by those names, so tpubox.jax.export_model maps each program parameter to the file's
tensor of the same name.

    python minilm_export.py MODEL_DIR REPO NAME [--seq 16] [--batch-sizes 1,8,32]
        [--weight-set minilm] [--delay-us 2000] [--preferred 16,32]
        [--reference IDS.json OUT.f32]

writes REPO/NAME/ with tpubox.jax.export_model (one program per batch size, inputs
`input_ids` and `attention_mask`, INT32 [seq] per row, output `embedding`, FP32 [384]), then
points the model at the weight file itself instead of the copy export_model writes: the copy
is removed, `files` links to MODEL_DIR and the config says `weights = "files/model.safetensors"`
and `weight_set = WEIGHT_SET`, so that the daemon loads the file once and shares it with the
guest model whose `[tpubox.weights]` names the same set and file. The dynamic batching gets the
guest example's settings (queue delay, preferred batch sizes).

With --reference, it also runs the encoder in JAX (on the CPU) on the token ids of IDS.json (a
list of lists of ints, each at most SEQ long) and writes the embeddings to OUT.f32 (row-major
little-endian float32, 384 per sentence).

Run it with the venv that has jax and this checkout's tpubox package (PYTHONPATH=python), with
JAX_PLATFORMS=cpu. Prints one JSON line: the model directory, the weights, the seconds taken.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import tpubox.jax as tj

HIDDEN, HEADS, LAYERS = 384, 12, 6
HEAD_DIM = HIDDEN // HEADS
LAYER_NORM_EPS = 1e-12  # config.json's layer_norm_eps
POOL_MIN_COUNT = 1e-9  # sentence-transformers clamps the token count to this
NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's eps
HI = jax.lax.Precision.HIGHEST

_ST_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors file PATH (name -> array), read with NumPy only."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    n = int(np.frombuffer(raw[:8].tobytes(), "<u8")[0])
    header = json.loads(raw[8 : 8 + n].tobytes())
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise SystemExit(f"{path}: tensor {name} has dtype {info['dtype']}, not handled here")
        lo, hi = info["data_offsets"]
        arr = np.frombuffer(raw[base + lo : base + hi].tobytes(), dtype=np.dtype(dtype).newbyteorder("<"))
        out[name] = arr.reshape(info["shape"])
    return out


def layer_norm(p, prefix, x):
    mean = x.mean(-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(-1, keepdims=True)
    return xc * jax.lax.rsqrt(var + LAYER_NORM_EPS) * p[prefix + ".weight"] + p[prefix + ".bias"]


def linear(p, prefix, x):
    """PyTorch's Linear: x @ W.T + b, W as [out, in]."""
    return jnp.einsum("...i,oi->...o", x, p[prefix + ".weight"], precision=HI) + p[prefix + ".bias"]


def minilm(p, input_ids, attention_mask):
    """Normalised sentence embeddings, f32 [B, 384], of token ids and mask, s32 [B, S]."""
    b, s = input_ids.shape
    x = jnp.take(p["embeddings.word_embeddings.weight"], input_ids, axis=0)
    x = x + p["embeddings.token_type_embeddings.weight"][0]
    x = x + p["embeddings.position_embeddings.weight"][:s]
    x = layer_norm(p, "embeddings.LayerNorm", x)
    maskf = attention_mask.astype(jnp.float32)
    bias = ((1.0 - maskf) * jnp.finfo(jnp.float32).min)[:, None, None, :]  # [B,1,1,S_key]
    for layer in range(LAYERS):
        pre = f"encoder.layer.{layer}."
        q = linear(p, pre + "attention.self.query", x) * float(1.0 / np.sqrt(HEAD_DIM))
        k = linear(p, pre + "attention.self.key", x)
        v = linear(p, pre + "attention.self.value", x)
        q, k, v = (t.reshape(b, s, HEADS, HEAD_DIM) for t in (q, k, v))
        scores = jnp.einsum("bihd,bjhd->bhij", q, k, precision=HI) + bias
        scores = scores - scores.max(-1, keepdims=True)
        e = jnp.exp(scores)
        probs = e / e.sum(-1, keepdims=True)
        ctx = jnp.einsum("bhij,bjhd->bihd", probs, v, precision=HI).reshape(b, s, HIDDEN)
        a = linear(p, pre + "attention.output.dense", ctx) + x
        x = layer_norm(p, pre + "attention.output.LayerNorm", a)
        h = linear(p, pre + "intermediate.dense", x)
        h = 0.5 * h * (1.0 + jax.lax.erf(h * float(1.0 / np.sqrt(2.0))))
        o = linear(p, pre + "output.dense", h) + x
        x = layer_norm(p, pre + "output.LayerNorm", o)
    summed = (x * maskf[:, :, None]).sum(1)
    count = jnp.maximum(maskf.sum(1, keepdims=True), POOL_MIN_COUNT)
    mean = summed / count
    norm = jnp.maximum(jnp.sqrt((mean * mean).sum(1, keepdims=True)), NORMALIZE_EPS)
    return {"embedding": mean / norm}


def pad_ids(ids: list[list[int]], seq: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask, s32 [len(ids), seq], padded with 0 ([PAD])."""
    tok = np.zeros((len(ids), seq), np.int32)
    mask = np.zeros((len(ids), seq), np.int32)
    for i, t in enumerate(ids):
        if len(t) > seq:
            raise SystemExit(f"sentence {i} has {len(t)} tokens, more than --seq {seq}")
        tok[i, : len(t)] = t
        mask[i, : len(t)] = 1
    return tok, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path, help="where `tpubox setup minilm` put the model")
    ap.add_argument("repo", type=Path, help="the model repository")
    ap.add_argument("name", help="the model's name (its directory under REPO)")
    ap.add_argument("--seq", type=int, default=16, help="tokens per row (the sequence bucket)")
    ap.add_argument("--batch-sizes", default="1,8,32", help="one program per batch size")
    ap.add_argument("--weight-set", default="minilm", help="the shared weight set's name")
    ap.add_argument("--delay-us", type=int, default=2000, help="max_queue_delay_microseconds")
    ap.add_argument("--preferred", default="16,32", help="preferred_batch_size ('' for none)")
    ap.add_argument("--reference", nargs=2, metavar=("IDS_JSON", "OUT_F32"))
    a = ap.parse_args()

    t0 = time.monotonic()
    weights_file = (a.model_dir / "model.safetensors").resolve()
    params = read_safetensors(weights_file)
    # Every tensor of the file is a parameter: the daemon refuses a weight file with tensors
    # the program does not take. Those the encoder does not read (if any) are kept as unused
    # parameters (export_model exports with keep_unused).
    if any(v.dtype != np.float32 for v in params.values()):
        jax.config.update("jax_enable_x64", True)
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    example = [np.zeros((1, a.seq), np.int32), np.ones((1, a.seq), np.int32)]
    model_dir = tj.export_model(
        minilm,
        params,
        example,
        a.repo,
        a.name,
        batch_sizes=batch_sizes,
        input_names=["input_ids", "attention_mask"],
        max_queue_delay_microseconds=a.delay_us,
    )
    export_s = time.monotonic() - t0

    # The weight file itself, not export_model's copy: one file, one weight set shared with
    # the guest model.
    (model_dir / "weights.safetensors").unlink()
    os.symlink(a.model_dir.resolve(), model_dir / "files")
    cfg = (model_dir / "config.toml").read_text()
    old = 'weights = "weights.safetensors"'
    assert old in cfg, "export_model's config changed: update minilm_export.py"
    cfg = cfg.replace(
        old,
        f'weights = "files/model.safetensors"\nweight_set = "{a.weight_set}"',
    )
    if a.preferred:
        delay = f"max_queue_delay_microseconds = {a.delay_us}"
        assert delay in cfg
        cfg = cfg.replace(delay, f"{delay}\npreferred_batch_size = [{a.preferred.replace(',', ', ')}]")
    (model_dir / "config.toml").write_text(cfg)

    result = {
        "model_dir": str(model_dir),
        "weights": str(weights_file),
        "tensors": len(params),
        "programs": [f"model.b{b}.mlirbc" for b in sorted(set(batch_sizes))],
        "export_s": round(export_s, 2),
    }
    if a.reference:
        ids = json.loads(Path(a.reference[0]).read_text())
        tok, mask = pad_ids(ids, a.seq)
        t1 = time.monotonic()
        emb = jax.jit(minilm)(params, tok, mask)["embedding"]
        np.asarray(emb, dtype="<f4").tofile(a.reference[1])
        result["reference_s"] = round(time.monotonic() - t1, 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
