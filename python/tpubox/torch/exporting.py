"""Exporting a PyTorch model for ``tpubox serve``'s model repository (docs/SERVING.md,
"StableHLO models"): :func:`export`, and its command line ``tpubox-torch-export``
(:func:`main`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .. import _export
from ..errors import Unsupported
from ._lowering import (
    Precision,
    _as_precision,
    _decompositions,
    _module_text,
    _Options,
    _Program,
    _to_numpy,
    current_precision,
)


def _batched_like(x: Any, b: int | None) -> Any:
    """An input like example X with batch size B (zeros; only shapes and dtypes are traced)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"tpubox.torch.export: example inputs must be tensors, not {type(x).__name__}"
        )
    if b is None:
        return torch.zeros_like(x)
    if x.dim() == 0:
        raise ValueError("tpubox.torch.export: an example input without a batch dimension")
    return torch.zeros((b,) + tuple(x.shape[1:]), dtype=x.dtype)


def export(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    repo: Any,
    name: str,
    batch_sizes: Sequence[int] | None = (1, 2, 4, 8),
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    precision: Precision | str | None = None,
    instance_count: int = 1,
    max_queue_delay_microseconds: int = 1000,
    dynamic_batching: bool = True,
) -> Any:
    """Exports ``model(*inputs)`` as a StableHLO model that ``tpubox serve`` serves from the model
    repository REPO without a guest, as :func:`tpubox.jax.export_model` does for JAX: writes
    ``REPO/NAME/`` with one program per batch size (``model.b{N}.mlir``: StableHLO text lowered
    by torch-mlir from ``torch.export``'s ATen graph), the weights (``weights.safetensors``: the
    parameters, buffers and constant tensors the graph lifts, by their names in the module,
    ``fc1.weight``) and ``config.toml`` (Triton's field names, and the ``[tpubox.stablehlo]``
    table mapping the programs' parameters to weights and inputs, their results to outputs).

    The model is traced in the mode it is in: call ``model.eval()`` first for inference.

    Args:
        model: the module.
        example_inputs: one tensor per positional input, batch dimension first; only their
            shapes after the batch dimension and dtypes are used. With ``batch_sizes=None``
            the shapes are exported as they are (``max_batch_size = 0``, one program).
        repo: the model repository directory (created if missing).
        name: the model's name, its directory under REPO (must not exist yet, or be empty).
        batch_sizes: the batch sizes to export a program for; the largest is the model's
            ``max_batch_size``.
        input_names, output_names: the names in the protocol (default ``input_0``, ...,
            ``output_0``, ...; outputs are the model's tensors, flattened in order).
        precision: the matmul/convolution :class:`Precision` of the programs (default
            :func:`current_precision`).
        instance_count: instances of the model (``[[instance_group]] count``).
        max_queue_delay_microseconds: how long a request waits for others to batch with.
        dynamic_batching: write a ``[dynamic_batching]`` table (batching models only).

    Returns:
        The model directory (a ``pathlib.Path``).

    Raises:
        ValueError: a bad name, batch size or name count, an existing non-empty directory, an
            output without the batch dimension; tpubox.Unsupported: a dtype the protocol lacks,
            a graph torch-mlir cannot lower, a model that updates its buffers (training mode).
    """
    caller = "tpubox.torch.export"
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"{caller}: {name!r} cannot name a model directory")
    batched = batch_sizes is not None
    sizes: list[Any] = sorted({int(b) for b in batch_sizes}) if batched else [None]  # type: ignore
    if batched and (not sizes or sizes[0] < 1):
        raise ValueError(f"{caller}: batch sizes must be at least 1")
    example_inputs = list(example_inputs)
    in_names = list(input_names) if input_names is not None else [
        f"input_{i}" for i in range(len(example_inputs))
    ]
    if len(in_names) != len(example_inputs) or len(set(in_names)) != len(in_names):
        raise ValueError(
            f"{caller}: {len(in_names)} input names (distinct) for {len(example_inputs)} inputs"
        )
    p = _as_precision(precision) if precision is not None else current_precision()
    from torch.export.graph_signature import InputKind, OutputKind

    programs: list[tuple[int | None, str, list[Any], list[Any]]] = []
    weight_names: list[str] | None = None
    weights: dict[str, np.ndarray] = {}
    for b in sizes:
        args = tuple(_batched_like(x, b) for x in example_inputs)
        ep = torch.export.export(model, args, strict=False).run_decompositions(_decompositions())
        sig = ep.graph_signature
        if any(o.kind != OutputKind.USER_OUTPUT for o in sig.output_specs):
            raise Unsupported(
                "unsupported",
                f"{caller}: the model updates its buffers or inputs (training mode?); "
                "call model.eval() first",
            )
        names = []
        for spec in sig.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                continue
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                raise Unsupported("unsupported", f"{caller}: a graph input of kind {spec.kind}")
            t = ep.state_dict.get(spec.target)
            if t is None:
                t = ep.constants[spec.target]
            names.append(spec.target)
            weights[spec.target] = _to_numpy(t)
        kinds = [s.kind for s in sig.input_specs]
        if kinds != sorted(kinds, key=lambda k: k == InputKind.USER_INPUT):
            raise Unsupported(
                "unsupported", f"{caller}: weights and inputs interleave in the graph"
            )
        if weight_names is None:
            weight_names = names
        elif names != weight_names:
            raise Unsupported("unsupported", f"{caller}: batch size {b} lifts other weights")
        prog = _Program(ep.graph_module, "export", f"{name}/b{b}", _Options(None))
        if any(what != "program" for what, _ in prog.out_map) or not prog.n_results:
            raise Unsupported(
                "unsupported", f"{caller}: every output must be a tensor the program computes"
            )
        placeholders = [n for n in ep.graph_module.graph.nodes if n.op == "placeholder"]
        user_vals = [n.meta["val"] for n in placeholders[len(names):]]
        out_node = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
        outs = out_node.args[0]
        outs = outs if isinstance(outs, (tuple, list)) else [outs]
        out_vals = [o.meta["val"] for o in outs]
        with prog.context_lock:
            text = _module_text(prog.module, p)
        programs.append((b, text, user_vals, out_vals))
    assert weight_names is not None
    out_names = list(output_names) if output_names is not None else [
        f"output_{i}" for i in range(len(programs[0][3]))
    ]
    if len(out_names) != len(programs[0][3]) or len(set(out_names)) != len(out_names):
        raise ValueError(
            f"{caller}: {len(out_names)} output names for {len(programs[0][3])} outputs"
        )

    def dims(v: Any, b: int | None, what: str) -> list[int]:
        return _export.unbatched_dims(v.shape, b, what, caller)

    def triton_type(v: Any, what: str) -> str:
        dtype = _to_numpy(torch.empty((), dtype=v.dtype)).dtype
        return _export.export_dtype(dtype, what, caller)[1]

    b0, _, in_vals0, out_vals0 = programs[0]
    inputs = [
        (n, triton_type(v, f"input {n!r}"), dims(v, b0, f"input {n!r}"))
        for n, v in zip(in_names, in_vals0)
    ]
    outputs = [
        (n, triton_type(v, f"output {n!r}"), dims(v, b0, f"output {n!r}"))
        for n, v in zip(out_names, out_vals0)
    ]
    for b, _, _, out_vals in programs[1:]:
        for n, v in zip(out_names, out_vals):
            dims(v, b, f"output {n!r}")
    model_dir = _export.check_model_dir(repo, name, caller)
    _export.write_safetensors(
        model_dir / "weights.safetensors", {n: weights[n] for n in weight_names}, caller
    )
    files = []
    for b, text, _, _ in programs:
        file = f"model.b{b}.mlir" if b is not None else "model.mlir"
        (model_dir / file).write_text(text)
        files.append((b, file))
    config = _export.config_toml(
        writer=caller,
        name=name,
        max_batch_size=int(sizes[-1]) if batched else 0,
        inputs=inputs,
        outputs=outputs,
        weight_names=weight_names,
        programs=files,
        instance_count=instance_count,
        max_queue_delay_microseconds=(
            max_queue_delay_microseconds if batched and dynamic_batching else None
        ),
    )
    (model_dir / "config.toml").write_text(config)
    return model_dir


# ---------------------------------------------------------------------------------------------
# The command line: tpubox-torch-export (python -m tpubox.torch.exporting)





def _load(spec: str) -> Any:
    """The object SPEC (``module:attr`` or ``file.py:attr``) names."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise SystemExit(f"MODEL must be module:factory or file.py:factory, not {spec!r}")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise SystemExit(f"{where}: no such file")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"{where} has no {attr!r}") from None


def _example(spec: str) -> Any:
    """A zero tensor of SPEC (``2x16`` or ``2x16:int64``)."""
    import torch

    shape, _, dtype = spec.partition(":")
    try:
        dims = [int(d) for d in shape.lower().split("x")] if shape else []
    except ValueError:
        raise SystemExit(f"--input {spec!r}: the shape must be sizes joined by x (2x16)") from None
    dt = getattr(torch, dtype or "float32", None)
    if not isinstance(dt, torch.dtype):
        raise SystemExit(f"--input {spec!r}: unknown dtype {dtype!r}")
    return torch.zeros(dims, dtype=dt)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tpubox-torch-export",
        description="Export a PyTorch model as a StableHLO model for tpubox serve.",
    )
    ap.add_argument("model", help="module:factory or file.py:factory returning the nn.Module")
    ap.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]",
                    help="one per positional input, batch dimension first (1x16, 1x128:int64)")  # fmt: skip
    ap.add_argument("--repo", required=True, help="the model repository directory")
    ap.add_argument("--name", required=True, help="the model's name (its directory in REPO)")
    ap.add_argument("--batch-sizes", default="1,2,4,8", help="programs to export (default 1,2,4,8)")
    ap.add_argument("--no-batch", action="store_true", help="no batch dimension: shapes as given")
    ap.add_argument("--input-name", action="append", help="protocol name of each input, in order")
    ap.add_argument("--output-name", action="append", help="protocol name of each output, in order")
    ap.add_argument("--precision", choices=["DEFAULT", "HIGH", "HIGHEST"])
    args = ap.parse_args(argv)

    import tpubox.torch as tt

    factory = _load(args.model)
    model = factory()
    model.eval()
    if args.no_batch:
        sizes = None
    else:
        try:
            sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        except ValueError:
            raise SystemExit(f"--batch-sizes {args.batch_sizes!r}: comma-separated ints") from None
    out = tt.export(
        model,
        [_example(s) for s in args.input],
        args.repo,
        args.name,
        batch_sizes=sizes,
        input_names=args.input_name,
        output_names=args.output_name,
        precision=args.precision,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
