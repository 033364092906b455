"""Run PyTorch models on the tpubox daemon's device: ``torch.compile(model, backend="tpubox")``.

``import tpubox.torch`` registers the TorchDynamo backend ``"tpubox"`` (it is also found
without the import, through the ``torch_dynamo_backends`` entry point of the installed
package). Each graph Dynamo captures goes through ``aot_autograd``, which turns it into
ATen-level forward and backward graphs with the parameters and buffers lifted to inputs; each
of those is lowered to one StableHLO function by torch-mlir's FX importer, compiled through
the session's :meth:`tpubox.Session.compile` (so every tier of the daemon's compile cache
applies) and executed there. A training step (forward, backward, optimizer step) compiles too;
graph breaks run in PyTorch, as Dynamo does with any backend. A graph with nodes torch-mlir
cannot lower (or lowers to a custom call the daemon refuses) is partitioned: its other nodes
run as programs, those nodes in PyTorch on the CPU between them, each op named once in a
:class:`CpuFallbackWarning` and listed by :func:`cpu_fallback_ops`.

What travels, and what stays:

- Parameters and buffers are put on the device once per session and kept there. They are
  found by identity (an ``nn.Parameter``, or a tensor Dynamo took from a module) and keyed by
  their storage, shape, dtype and version counter (``tensor._version``), so an in-place update
  (``optimizer.step()``, ``p.add_()``, ``copy_``) is noticed and the new values are put again
  before the next execution. Writes through ``tensor.data`` bypass the version counter and are
  not noticed (as with any cache keyed on versions).
- Activations (the user's inputs, what the forward saves for the backward, gradients) travel
  with each execution, in the same round trip (the session API's ``Call``), and the results
  come back as CPU tensors.
- Programs never hold the weights as constants; a program is compiled once per session, per
  input signature and per matmul precision.

Shapes are static: a graph compiles one program per concrete signature of its inputs. When
Dynamo hands over a graph with symbolic sizes (``dynamic=True``, or automatic dynamic shapes
after a second shape), each concrete signature met at run time is traced and compiled on its
own, as ``dynamic=False`` would. Dimensions marked with ``torch._dynamo.mark_dynamic(t, dim,
min=, max=)`` are bucketed instead, as TorchTPU does: one program per bucket, the inputs
padded with zeros to the bucket's size and the outputs cut back (:func:`bucket_of`; options
``num_dynamic_buckets``, ``bucket_size``).

Precision of f32 matrix products and convolutions, TorchTPU's names: :class:`Precision`
``DEFAULT`` / ``HIGH`` / ``HIGHEST`` is StableHLO's ``precision_config`` of every
``dot_general`` and ``convolution`` in the program. :func:`precision` sets it for a block;
outside one it follows ``torch.set_float32_matmul_precision``: ``"medium"`` -> DEFAULT,
``"high"`` -> HIGH, ``"highest"`` (PyTorch's default) -> HIGHEST.

Which session: the backend option ``session`` (a :class:`tpubox.Session`, or a callable that
returns one), else options ``address`` and ``token`` (the backend connects, and connects again
when the session ends), else :func:`tpubox.default_session` at each call (the last session
:func:`tpubox.connect` returned, or a notebook kernel's). When the session ends under a
running program (the daemon restarted, an idle timeout), the next call gets a session again,
puts the weights again, compiles again (the daemon's disk cache usually answers) and goes on.

Backend options (``torch.compile(model, backend="tpubox", options={...})``):

- ``xla_optimization_level``: ``"O0"`` ... ``"O3"``, TorchTPU's compiler option (part of the
  compile-cache key; default the plugin's).
- ``name``: a name for the compiled graphs in :func:`stats` and errors (TorchTPU's ``name``).
- ``debug_callback``: called with a :class:`GraphInfo` for every program compiled (its kind,
  FX graph, StableHLO text, precision, executable), TorchTPU's option of that name.
- ``session``, ``address``, ``token``: where to run (above).
- ``num_dynamic_buckets`` (1, at most 8) and ``bucket_size`` (128): TorchTPU's buckets of a
  ``mark_dynamic`` dimension: with ``max=``, that many buckets dividing ``(min, max]``;
  without, multiples of ``bucket_size``.
- ``async_compile`` (False), ``serializable``: TorchTPU's; only their defaults are accepted.

:func:`export` writes a model for ``tpubox serve``'s repository instead (StableHLO programs per
batch size, the weights, ``config.toml``), as :func:`tpubox.jax.export_model` does for JAX.

Needs ``torch`` and ``torch-mlir`` (``scripts/venvs/torch.txt`` pins a pair that works:
torch 2.15.0, torch-mlir 20261001, installed with ``--no-deps``).
"""


from __future__ import annotations

__all__ = [
    "backend",
    "Precision",
    "precision",
    "current_precision",
    "GraphInfo",
    "stats",
    "reset_stats",
    "BACKEND_NAME",
    "bucket_of",
    "MAX_DYNAMIC_BUCKETS",
    "export",
    # Eager tensors on the device (tpubox.torch.eager)
    "device",
    "is_device_tensor",
    "EagerMode",
    "eager_mode",
    "set_eager_mode",
    "mark_step",
    "max_fused_ops",
    "set_max_fused_ops",
    "eager_stats",
    "reset_eager_stats",
    "cpu_fallback_ops",
    "CpuFallbackWarning",
]

# The package, by job: _lowering (what the others share: torch-mlir's lowering of an FX graph to
# StableHLO, precision, options, statistics), dynamo (the Dynamo backend), eager (eager tensors on
# the device, TorchTPU's eager modes; docs/PYTORCH.md), exporting (models for tpubox serve).
from .. import distributed as _distributed  # noqa: E402
from . import eager as _eager  # noqa: E402, F401
from ._lowering import (  # noqa: E402
    MAX_DYNAMIC_BUCKETS,
    GraphInfo,
    Precision,
    _dense_constants,  # noqa: F401  (tests read it here)
    current_precision,
    precision,
    reset_stats,
    stats,
)
from .dynamo import BACKEND_NAME, _register, backend, bucket_of  # noqa: E402
from .eager import (  # noqa: E402
    CpuFallbackWarning,
    EagerMode,
    cpu_fallback_ops,
    device,
    eager_mode,
    eager_stats,
    is_device_tensor,
    mark_step,
    max_fused_ops,
    reset_eager_stats,
    set_eager_mode,
    set_max_fused_ops,
)
from .exporting import export  # noqa: E402

_register()
# transformers' device maps onto the tpubox device, without accelerate (tpubox.torch.hf).
from . import hf as _hf  # noqa: E402

_hf.install()
# The torch.distributed backend "tpubox" (tpubox.distributed; docs/DISTRIBUTED.md).
_distributed.register()
