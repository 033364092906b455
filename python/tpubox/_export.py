"""What a StableHLO model directory of ``tpubox serve``'s repository is made of (docs/SERVING.md,
"StableHLO models"): the weights file and ``config.toml``. Shared by ``tpubox.jax.export_model``
and ``tpubox.torch.export``; NumPy only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import Unsupported

# NumPy dtype name -> (safetensors dtype, Triton data_type).
EXPORT_DTYPES = {
    "bool": ("BOOL", "TYPE_BOOL"),
    "uint8": ("U8", "TYPE_UINT8"),
    "uint16": ("U16", "TYPE_UINT16"),
    "uint32": ("U32", "TYPE_UINT32"),
    "uint64": ("U64", "TYPE_UINT64"),
    "int8": ("I8", "TYPE_INT8"),
    "int16": ("I16", "TYPE_INT16"),
    "int32": ("I32", "TYPE_INT32"),
    "int64": ("I64", "TYPE_INT64"),
    "float16": ("F16", "TYPE_FP16"),
    "bfloat16": ("BF16", "TYPE_BF16"),
    "float32": ("F32", "TYPE_FP32"),
    "float64": ("F64", "TYPE_FP64"),
}


def export_dtype(dtype: Any, what: str, caller: str) -> tuple[str, str]:
    """(safetensors dtype, Triton data_type) of DTYPE, or tpubox.Unsupported naming WHAT."""
    name = np.dtype(dtype).name
    if name not in EXPORT_DTYPES:
        raise Unsupported(
            "unsupported", f"{caller}: {what} has dtype {name}, which the protocol lacks"
        )
    return EXPORT_DTYPES[name]


def unbatched_dims(shape: Any, batch: int | None, what: str, caller: str) -> list[int]:
    """The dims of SHAPE after its batch dimension (all of them when BATCH is None: the model
    does not batch), as a model config declares them.

    Raises:
        ValueError: SHAPE's first dimension is not BATCH.
    """
    dims = [int(d) for d in shape]
    if batch is None:
        return dims
    if not dims or dims[0] != batch:
        raise ValueError(
            f"{caller}: {what} has shape {tuple(dims)} for batch size {batch}: every input and "
            "output needs the batch dimension first"
        )
    return dims[1:]


def write_safetensors(path: Any, tensors: dict[str, np.ndarray], caller: str) -> None:
    """Writes TENSORS (name -> array) to PATH in the safetensors format (little-endian, C
    order, names sorted)."""
    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name], order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        st, _ = export_dtype(a.dtype, f"weight {name!r}", caller)
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        end = offset + len(data)
        header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [offset, end]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def toml_str(s: str) -> str:
    """S as a TOML basic string."""
    return json.dumps(s)


def check_model_dir(repo: Any, name: str, caller: str) -> Path:
    """REPO/NAME, created, after checking NAME can name a model directory and it is empty."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"{caller}: {name!r} cannot name a model directory")
    model_dir = Path(repo) / name
    if model_dir.exists() and any(model_dir.iterdir()):
        raise ValueError(f"{caller}: {model_dir} exists and is not empty")
    model_dir.mkdir(parents=True, exist_ok=True)
    return model_dir


def config_toml(
    *,
    writer: str,
    name: str,
    max_batch_size: int,
    inputs: Sequence[tuple[str, str, list[int]]],
    outputs: Sequence[tuple[str, str, list[int]]],
    weight_names: Sequence[str],
    programs: Sequence[tuple[int | None, str]],
    instance_count: int,
    max_queue_delay_microseconds: int | None,
) -> str:
    """The ``config.toml`` of a StableHLO model: INPUTS and OUTPUTS as (name, Triton data_type,
    dims without the batch dimension); the programs' parameters are WEIGHT_NAMES then the
    inputs, their results the outputs; PROGRAMS as (batch size or None, file);
    ``[dynamic_batching]`` when MAX_QUEUE_DELAY_MICROSECONDS is not None."""
    lines = [
        f"# Written by {writer}: a StableHLO model (docs/SERVING.md).",
        f"name = {toml_str(name)}",
        'backend = "stablehlo"',
        f"max_batch_size = {max_batch_size}",
        "",
    ]
    for what, tensors in (("input", inputs), ("output", outputs)):
        for n, t, d in tensors:
            lines += [f"[[{what}]]", f"name = {toml_str(n)}", f'data_type = "{t}"']
            lines += [f"dims = {d}", ""]
    lines += ["[[instance_group]]", f"count = {int(instance_count)}", ""]
    if max_queue_delay_microseconds is not None:
        lines += [
            "[dynamic_batching]",
            f"max_queue_delay_microseconds = {int(max_queue_delay_microseconds)}",
            "",
        ]
    lines += ["[tpubox.stablehlo]", 'weights = "weights.safetensors"']
    params_toml = [f"{{ weight = {toml_str(n)} }}" for n in weight_names]
    params_toml += [f"{{ input = {toml_str(n)} }}" for n, _, _ in inputs]
    lines.append("parameters = [\n  " + ",\n  ".join(params_toml) + ",\n]")
    lines.append("results = [" + ", ".join(toml_str(n) for n, _, _ in outputs) + "]")
    lines.append("")
    for b, file in programs:
        lines += ["[[tpubox.stablehlo.program]]"]
        if b is not None:
            lines.append(f"batch_size = {b}")
        lines += [f'file = "{file}"', ""]
    return "\n".join(lines)
