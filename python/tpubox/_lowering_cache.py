"""tpubox.torch's lowering cache: the StableHLO text torch-mlir lowered an ATen-level FX graph
to, kept on disk across processes and keyed by the graph.

torch-mlir's lowering of a graph takes a good part of a second to seconds, in every process that
compiles a model, even where the daemon already holds the compiled program. With this cache a
second process (a restarted notebook kernel, the next run of a script) that compiles the same
model finds the text on disk and goes straight to the daemon's compile cache.

Key: SHA-256 over a canonical description of the graph torch-mlir would lower (its Python code
without comments; every node's op, name, target and the dtype, shape and strides of its
``val``/``tensor_meta``; the dtype, shape and bytes of every tensor it reads through
``get_attr``), the program's kind and precision, and the versions of torch, torch-mlir and
tpubox, :data:`FORMAT` and a digest of the source of tpubox's lowering code. A graph whose
description this module cannot vouch for (a submodule call, a ``get_attr`` of something other
than a tensor, a tensor without data) gets no key and is not cached.

Where: ``$TPUBOX_TORCH_LOWERING_CACHE_DIR``, else ``$TPUBOX_CACHE_DIR/torch-lowering``, else
``~/.cache/tpubox/torch-lowering``; one file per key, written atomically (a temporary file,
then a rename), each holding its key, the number of the program's results and the text's
SHA-256, so a truncated or corrupt entry is a miss (and is removed). The directory is kept
under ``$TPUBOX_TORCH_LOWERING_CACHE_MAX_MB`` (256) MiB, the least recently used entries
removed first. ``TPUBOX_TORCH_LOWERING_CACHE=0`` turns the cache off. A cache that cannot be
read or written (a read-only directory, a full disk) is a miss: the graph is lowered.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

#: The entry format and the meaning of keys; bump it when what a key covers changes.
FORMAT = 1

_MAGIC = f"tpubox-torch-lowering {FORMAT}\n".encode()
_SUFFIX = ".stablehlo"
_DEFAULT_MAX_MB = 256
# A temporary file older than this is a writer that died: removed when the directory is swept.
_STALE_TMP_S = 3600.0

_LOG = logging.getLogger(__name__)
_LOCK = threading.Lock()
# Bytes each directory holds, as this process last counted them plus what it wrote since (absent:
# not counted yet). Other processes write too: the directory is counted again before evicting.
_SIZE: dict[Path, int] = {}


def enabled() -> bool:
    """Whether the cache is on (``TPUBOX_TORCH_LOWERING_CACHE`` is not ``0``, ``false``, ``off``
    or ``no``)."""
    v = os.environ.get("TPUBOX_TORCH_LOWERING_CACHE", "1").strip().lower()
    return v not in ("0", "false", "off", "no")


def directory() -> Path:
    """The cache's directory (created on the first write)."""
    d = os.environ.get("TPUBOX_TORCH_LOWERING_CACHE_DIR")
    if d:
        return Path(d)
    root = os.environ.get("TPUBOX_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "tpubox"
    return base / "torch-lowering"


def max_bytes() -> int:
    """The bound on the directory's size (``TPUBOX_TORCH_LOWERING_CACHE_MAX_MB``, MiB)."""
    try:
        mb = float(os.environ.get("TPUBOX_TORCH_LOWERING_CACHE_MAX_MB", _DEFAULT_MAX_MB))
    except ValueError:
        mb = _DEFAULT_MAX_MB
    return max(0, int(mb * (1 << 20)))


# ---------------------------------------------------------------------------------------------
# Keys


@functools.lru_cache(maxsize=None)
def _environment(code: tuple[Callable[..., Any], ...]) -> bytes:
    """The versions a lowering depends on, and a digest of CODE's source (tpubox's lowering
    code: an edit of it in a checkout must not find texts the old code wrote)."""
    import torch

    from . import __version__

    try:
        from importlib.metadata import version

        tm_version = version("torch-mlir")
    except Exception:
        tm_version = "unknown"
    src = hashlib.sha256()
    for obj in code:
        try:
            src.update(inspect.getsource(obj).encode())
        except (OSError, TypeError):
            src.update(getattr(obj, "__qualname__", repr(obj)).encode())
    return json.dumps(
        {
            "format": FORMAT,
            "torch": torch.__version__,
            "torch-mlir": tm_version,
            "tpubox": __version__,
            "code": src.hexdigest(),
        },
        sort_keys=True,
    ).encode()


class _NoKey(Exception):
    """The graph holds something the key cannot describe faithfully."""


def _describe(v: Any) -> Any:
    """A canonical, JSON-able description of a node's ``val`` / ``tensor_meta`` (or a part)."""
    import torch

    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    if isinstance(v, torch.Tensor):
        return ["T", str(v.dtype), [str(d) for d in v.shape], [str(s) for s in v.stride()]]
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ["S", type(v).__name__, str(v)]
    if isinstance(v, (torch.dtype, torch.device, torch.memory_format)):
        return ["V", str(v)]
    # torch.fx.passes.shape_prop.TensorMetadata (a NamedTuple).
    if all(hasattr(v, a) for a in ("dtype", "shape", "stride", "is_quantized")):
        return [
            "M",
            str(v.dtype),
            [str(d) for d in v.shape],
            [str(s) for s in v.stride],
            bool(v.is_quantized),
        ]
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [_describe(x) for x in v]]
    if isinstance(v, dict):
        return ["dict", [[repr(k), _describe(x)] for k, x in v.items()]]
    return ["?", type(v).__qualname__]


def _tensor_bytes(t: Any) -> bytes:
    import torch

    # A plain tensor (or parameter): not a module, a script object or a fake tensor.
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise _NoKey(f"get_attr of a {type(t).__name__}")
    if t.is_meta or t.layout != torch.strided or t.is_quantized:
        raise _NoKey("a constant without plain data")
    # Outside the fake mode Dynamo compiles under: the constant's real bytes.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        flat = t.detach().cpu().contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes()


def _attr(gm: Any, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def graph_digest(gm: Any, code: tuple[Callable[..., Any], ...] = ()) -> str | None:
    """SHA-256 (hex) of the canonical description of GM (a ``torch.fx.GraphModule``, the graph
    exactly as it will be lowered) and of the environment (versions, CODE's source); None when
    GM holds something the description cannot cover (it is then not cached)."""
    h = hashlib.sha256()
    h.update(_environment(code))
    # The code FX generates (names, targets, argument values and constants in order), without
    # comments (stack traces of the user's source, where a version adds them).
    lines = [ln for ln in gm.code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    h.update(b"\0code\0" + "\n".join(lines).encode())
    try:
        nodes = []
        for n in gm.graph.nodes:
            if n.op == "call_module":
                raise _NoKey("a submodule call")
            meta = [_describe(n.meta.get("val")), _describe(n.meta.get("tensor_meta"))]
            nodes.append([n.op, n.name, str(n.target), meta])
            if n.op == "get_attr":
                t = _attr(gm, n.target)
                data = _tensor_bytes(t)
                h.update(f"\0attr {n.target} {t.dtype} {list(t.shape)} {len(data)}\0".encode())
                h.update(data)
        h.update(b"\0nodes\0" + json.dumps(nodes).encode())
    except Exception as e:
        # _NoKey, or anything unexpected in a graph (an attribute that does not resolve, ...).
        _LOG.debug("tpubox.torch lowering cache: graph not cached: %s", e)
        return None
    return h.hexdigest()


def entry_key(digest: str, kind: str, precision: str) -> str:
    """The key of one text: the graph's digest, the program's kind and its precision."""
    return hashlib.sha256(f"{digest}\0{kind}\0{precision}".encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Entries


def _path(key: str) -> Path:
    return directory() / f"{key}{_SUFFIX}"


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def load(key: str, n_results: int) -> str | None:
    """The text stored under KEY, if there is a sound entry for a program of N_RESULTS results;
    None otherwise (an entry that does not check out is removed)."""
    if not enabled():
        return None
    path = _path(key)
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    text = _parse(raw, key, n_results)
    if text is None:
        _remove(path)
        return None
    try:
        os.utime(path)  # recently used: evicted last
    except OSError:
        pass
    return text


def _parse(raw: bytes, key: str, n_results: int) -> str | None:
    try:
        if not raw.startswith(_MAGIC):
            return None
        head_end = raw.index(b"\n", len(_MAGIC))
        head = json.loads(raw[len(_MAGIC) : head_end])
        body = raw[head_end + 1 :]
        if (
            head.get("key") != key
            or head.get("n_results") != n_results
            or head.get("bytes") != len(body)
            or head.get("sha256") != hashlib.sha256(body).hexdigest()
        ):
            return None
        return body.decode()
    except Exception:
        return None


def store(key: str, text: str, n_results: int) -> None:
    """Writes TEXT under KEY (atomically), then keeps the directory within its bound. Never
    raises: a cache that cannot be written is only a cache that misses."""
    if not enabled():
        return
    try:
        body = text.encode()
        head = {
            "key": key,
            "n_results": n_results,
            "bytes": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
            "written": time.time(),
        }
        data = _MAGIC + json.dumps(head, sort_keys=True).encode() + b"\n" + body
        bound = max_bytes()
        if len(data) > bound:
            return
        d = directory()
        d.mkdir(parents=True, exist_ok=True)
        path = _path(key)
        tmp = d / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        with _LOCK:
            size = _SIZE.get(d)
            size = _total(d) if size is None else size + len(data)
            _SIZE[d] = size
            if size > bound:
                _SIZE[d] = _evict(d, bound)
    except Exception as e:
        _LOG.debug("tpubox.torch lowering cache: not written: %s", e)


def _entries(d: Path) -> list[tuple[float, int, Path]]:
    """(mtime, size, path) of D's entries; stale temporary files are removed on the way."""
    out = []
    now = time.time()
    try:
        it = list(os.scandir(d))
    except OSError:
        return out
    for e in it:
        try:
            st = e.stat()
        except OSError:
            continue
        if e.name.endswith(_SUFFIX):
            out.append((st.st_mtime, st.st_size, Path(e.path)))
        elif e.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
            _remove(Path(e.path))
    return out


def _total(d: Path) -> int:
    return sum(size for _, size, _ in _entries(d))


def _evict(d: Path, bound: int) -> int:
    """Removes D's least recently used entries until it holds at most 90% of BOUND (so that the
    next writes do not evict again at once); returns what it then holds."""
    entries = sorted(_entries(d))
    total = sum(size for _, size, _ in entries)
    target = bound * 9 // 10
    for _, size, path in entries:
        if total <= target:
            break
        _remove(path)
        total -= size
    return total
