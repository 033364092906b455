"""The former name of :mod:`tpubox.torch.eager` (eager tensors on the daemon's device): this
module is that one (``tpubox.torch_eager is tpubox.torch.eager``), for code that imports it by
its old name."""

import sys

from .torch import eager as _eager

sys.modules[__name__] = _eager
