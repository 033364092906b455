"""``tpubox-torch-export`` (``python -m tpubox.torch_export``, the former name of ``python -m tpubox.torch.exporting``): the command-line form of
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

import sys

from .torch.exporting import main

if __name__ == "__main__":
    sys.exit(main())
