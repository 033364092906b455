"""``tpubox-torch-export`` (``python -m tpubox.torch_export``): the command-line form of
:func:`tpubox.torch.export`, writing a StableHLO model directory that ``tpubox serve`` serves
from its model repository (docs/PYTORCH.md, "Export for tpubox serve").

    tpubox-torch-export MODEL --input SHAPE[:DTYPE] ... --repo REPO --name NAME
                        [--batch-sizes 1,4,8 | --no-batch] [--input-name N ...]
                        [--output-name N ...] [--precision DEFAULT|HIGH|HIGHEST]

MODEL names a callable that returns the ``torch.nn.Module``: ``package.module:factory`` (an
importable module) or ``path/to/file.py:factory``; a class works too (called with no
arguments). It is put in ``eval()`` mode. Each ``--input`` is one positional input's shape
with the batch dimension first (``1x16``, ``1x128:int64``; dtype default float32); only shapes
after the batch dimension and dtypes matter. Prints the directory written.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Sequence


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
