"""Hugging Face transformers' own entry points on the tpubox device.

``AutoModel.from_pretrained(path, device_map="tpubox")`` (or ``device_map={"": "tpubox"}``,
``device_map=torch.device("tpubox")``, ``pipeline(..., device_map="tpubox")``, or
``from_pretrained`` inside ``with torch.device("tpubox"):``) loads each weight
from the checkpoint straight onto the device: transformers builds the model on the ``meta``
device, reads each tensor from the (memory-mapped) safetensors file and moves it with
``tensor.to("tpubox")``, one put into the session per tensor, without a CPU copy of the whole
model. ``pipeline(..., device="tpubox")`` loads the model on the CPU and calls
``model.to("tpubox")``, as for any device.

transformers 5 refuses every ``device_map`` unless ``accelerate`` is installed
(``check_and_set_device_map``), although a map onto one device never calls accelerate: the
weights are loaded by transformers itself. :func:`install` (run by ``import tpubox.torch``)
wraps that check so that a map whose every device is the tpubox device goes through without
accelerate; any other map is left to transformers (and needs accelerate, as before). It
patches ``transformers.modeling_utils`` when that module is imported, or at once when it
already is.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Any

import torch

__all__ = ["install", "onto_device"]

_TARGET = "transformers.modeling_utils"
_DEVICE_TYPE = "tpubox"
_LOCK = threading.Lock()
_INSTALLED = [False]


def _is_tpubox(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == _DEVICE_TYPE
    if isinstance(d, str):
        return d.split(":")[0] == _DEVICE_TYPE
    return False


def onto_device(device_map: Any) -> dict | None:
    """DEVICE_MAP as transformers' full map (``{module name: device}``) when it places
    everything on the tpubox device (``"tpubox"``, ``"tpubox:0"``, ``torch.device("tpubox")``,
    or a dict whose values all are such), else None."""
    if isinstance(device_map, (str, torch.device)) and _is_tpubox(device_map):
        return {"": torch.device(device_map)}
    if isinstance(device_map, dict) and device_map and all(map(_is_tpubox, device_map.values())):
        return dict(device_map)
    return None


def _patch(module: Any) -> None:
    """Wraps MODULE's (transformers.modeling_utils) ``check_and_set_device_map``."""
    original = getattr(module, "check_and_set_device_map", None)
    if original is None or getattr(original, "_tpubox", False):
        return

    def check_and_set_device_map(device_map: Any) -> Any:
        if device_map is None:
            # `with torch.device("tpubox"):` or torch.set_default_device("tpubox") around
            # from_pretrained: transformers makes that device the map.
            context = getattr(module, "get_torch_context_manager_or_global_device", None)
            if context is not None:
                device = context()
                if device is not None and _is_tpubox(device):
                    return {"": device}
        mapped = onto_device(device_map)
        if mapped is not None:
            return mapped
        return original(device_map)

    check_and_set_device_map._tpubox = True  # type: ignore[attr-defined]
    check_and_set_device_map.__wrapped__ = original  # type: ignore[attr-defined]
    check_and_set_device_map.__doc__ = original.__doc__
    module.check_and_set_device_map = check_and_set_device_map


class _Hook(importlib.abc.MetaPathFinder):
    """Patches transformers.modeling_utils right after it is executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Lets transformers take a ``device_map`` onto the tpubox device without accelerate
    (see the module doc): patches ``transformers.modeling_utils`` now if it is imported, else
    when it is. Idempotent; does not import transformers."""
    with _LOCK:
        module = sys.modules.get(_TARGET)
        if module is not None:
            _patch(module)
        if not _INSTALLED[0]:
            sys.meta_path.insert(0, _Hook())
            _INSTALLED[0] = True
