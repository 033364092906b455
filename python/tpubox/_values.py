"""The session API's plain values: frozen records of what the daemon reports
(:class:`TensorSpec`, :class:`Platform`, :class:`Usage`, :class:`RunResult`, ...) and of the
:class:`Limits` a new session asks for, with their protobuf conversions. They hold no handles
and make no calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Mapping

import numpy as np

from . import _dtypes
from ._proto import session_pb2 as pb

#: What an array argument may be: a ``numpy.ndarray`` or anything ``numpy.asarray`` takes.
ArrayLike = Any


@dataclass(frozen=True)
class TensorSpec:
    """The element type and shape of a tensor (an executable's parameter or result).

    Attributes:
        shape: dims, outermost first (``()`` for a scalar).
        dtype: the NumPy dtype (``ml_dtypes.bfloat16`` for BF16).
    """

    shape: tuple[int, ...]
    dtype: np.dtype

    @staticmethod
    def _from_pb(s: pb.TensorSpec) -> TensorSpec:
        return TensorSpec(tuple(int(d) for d in s.dims), _dtypes.from_wire(s.dtype))

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={self.dtype})"


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    for _suffix in (f"{_p}", f"{_p}b", f"{_p}ib", f"{_p}i"):
        _UNITS[_suffix] = 1024**_i


def parse_size(value: int | str) -> int:
    """A byte count: an int, or a string with an optional unit (``"64MiB"``, ``"4G"``,
    ``"1.5 GiB"``: powers of 1024). ValueError for anything else."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"{value!r} is not a size (e.g. 1073741824, 64MiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


@dataclass(frozen=True)
class Limits:
    """Limits of a session. In :func:`connect`, a field left 0 takes the tenant's value and a
    value above the tenant's is refused (:class:`tpubox.InvalidArgument`); from the daemon,
    the limits in force.

    Attributes:
        max_device_bytes: device bytes the session may hold (limit ``max-device-bytes``).
        max_live_tensors: tensor handles it may hold at once (``max-live-tensors``).
        max_live_executables: executable handles (``max-live-executables``).
        max_program_bytes: size of one program given to compile (``max-program-bytes``).
        max_compiles_per_minute: compiles per 60 s window (``max-compiles-per-minute``).
        max_call_seconds: wall-clock limit of one guest run (:meth:`Session.run`).
        max_guest_memory_bytes: linear memory of one guest run.
        idle_timeout_seconds: the session ends after this long without a call while nothing
            is attached.
        max_pending_launches: launches queued for the device or running at once
            (``max-pending-launches``).
    """

    max_device_bytes: int = 0
    max_live_tensors: int = 0
    max_live_executables: int = 0
    max_program_bytes: int = 0
    max_compiles_per_minute: int = 0
    max_call_seconds: float = 0.0
    max_guest_memory_bytes: int = 0
    idle_timeout_seconds: float = 0.0
    max_pending_launches: int = 0

    @staticmethod
    def coerce(value: Limits | Mapping[str, Any] | None) -> Limits:
        """VALUE as Limits: a Limits, a dict of its fields (unknown keys: ValueError), or None
        (all 0: the tenant's). Byte limits take a size with a unit too (``"64MiB"``,
        :func:`parse_size`)."""
        if value is None:
            return Limits()
        if isinstance(value, Limits):
            return value
        names = {f.name for f in fields(Limits)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown limits {unknown}; known: {sorted(names)}")
        kw: dict[str, Any] = {}
        for f in fields(Limits):
            if f.name in value:
                v = value[f.name]
                if f.type in ("float", float):
                    kw[f.name] = float(v)
                elif f.name.endswith("_bytes"):
                    try:
                        kw[f.name] = parse_size(v)
                    except ValueError as e:
                        raise ValueError(f"limit {f.name}: {e}") from None
                else:
                    kw[f.name] = int(v)
        return Limits(**kw)

    def _to_pb(self) -> pb.Limits:
        return pb.Limits(**{f.name: getattr(self, f.name) for f in fields(Limits)})

    @staticmethod
    def _from_pb(m: pb.Limits) -> Limits:
        return Limits(**{f.name: getattr(m, f.name) for f in fields(Limits)})


@dataclass(frozen=True)
class DeviceBytes:
    """Device memory held on one device (:attr:`Usage.device_bytes_by_device`).

    Attributes:
        device: the device index.
        bytes: device bytes held there now.
        peak_bytes: the most held there at once.
    """

    device: int
    bytes: int = 0
    peak_bytes: int = 0


@dataclass(frozen=True)
class Usage:
    """What a session holds and has done (or, in :class:`TenantUsage`, all live sessions of a
    tenant summed).

    Attributes:
        device_bytes: device bytes held now (dtype size × dims, counted by tpubox).
        peak_device_bytes: the most held at once.
        live_tensors: tensor handles held now (shared weights count).
        live_executables: executable handles held now.
        compiles: compile calls.
        executions: executions.
        device_seconds: device time used by executions.
        refused: requests refused over a limit.
        pending_launches: launches queued for the device or running now (charged at launch
            against ``max_pending_launches``, returned when the device finished).
        executions_running: executions holding an execution slot now.
        transfer_bytes: host bytes the daemon holds now for transfers in flight.
        peak_live_tensors: the most tensor handles held at once.
        host_to_device_bytes: tensor bytes copied to the device for it so far.
        device_to_host_bytes: tensor bytes copied from the device for it so far.
        published_bytes: device bytes of the tenant's live published weight versions (its
            ledger, all its sessions together; :meth:`Session.publish_weights`).
        published_versions: the tenant's live published versions.
        device_bytes_by_device: the device bytes held on each device that holds any, one
            :class:`DeviceBytes` per device, ascending (they sum to ``device_bytes``);
            :meth:`on_device` reads one.
    """

    device_bytes: int = 0
    peak_device_bytes: int = 0
    live_tensors: int = 0
    live_executables: int = 0
    compiles: int = 0
    executions: int = 0
    device_seconds: float = 0.0
    refused: int = 0
    pending_launches: int = 0
    executions_running: int = 0
    transfer_bytes: int = 0
    peak_live_tensors: int = 0
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    published_bytes: int = 0
    published_versions: int = 0
    device_bytes_by_device: tuple[DeviceBytes, ...] = ()

    def on_device(self, device: int) -> DeviceBytes:
        """What is held on DEVICE (zeros for a device that holds nothing)."""
        for d in self.device_bytes_by_device:
            if d.device == device:
                return d
        return DeviceBytes(device)

    @staticmethod
    def _from_pb(m: pb.UsageResponse) -> Usage:
        kw: dict[str, Any] = {
            f.name: getattr(m, f.name) for f in fields(Usage) if f.name != "device_bytes_by_device"
        }
        by_device = sorted(m.device_bytes_by_device, key=lambda d: d.device)
        kw["device_bytes_by_device"] = tuple(
            DeviceBytes(int(d.device), int(d.bytes), int(d.peak_bytes)) for d in by_device
        )
        return Usage(**kw)


@dataclass(frozen=True)
class WeightVersions:
    """What :meth:`Session.weight_versions` returns.

    Attributes:
        latest: the latest version of the set (0 once its publisher unpublished it).
        held: every version the daemon holds now (the latest included), ascending.
    """

    latest: int
    held: tuple[int, ...]

    def __iter__(self) -> Iterator[Any]:
        """``latest, held = s.weight_versions(name)``."""
        return iter((self.latest, self.held))


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's live sessions, summed (:func:`tenant_usage`).

    Attributes:
        tenant: the tenant's name.
        sessions: how many sessions it has open.
        usage: their :class:`Usage`, summed.
    """

    tenant: str
    sessions: int
    usage: Usage


@dataclass(frozen=True)
class Device:
    """One device of the daemon's platform: its index (the ``device`` of tensors and
    compiles), kind and description."""

    index: int
    kind: str
    description: str


@dataclass(frozen=True)
class Platform:
    """The daemon's PJRT platform.

    Attributes:
        name: ``"cpu"``, ``"cuda"``, ``"tpu"`` (what :func:`tpubox.jax.jit` exports for).
        version: the platform version the plugin reports.
        plugin: the plugin the daemon loaded.
        devices: its devices.
    """

    name: str
    version: str
    plugin: str
    devices: tuple[Device, ...]

    @staticmethod
    def _from_pb(m: pb.Platform) -> Platform:
        return Platform(
            m.name,
            m.version,
            m.plugin,
            tuple(Device(d.index, d.kind, d.description) for d in m.devices),
        )


@dataclass(frozen=True)
class SessionInfo:
    """What :meth:`Session.info` returns: the session's id, tenant, limits in force, platform,
    usage, the weight sets it may open (:meth:`Session.weights`), the components the daemon
    offers by name (:meth:`Session.run`), and whether its launches are synchronous
    (:meth:`Session.set_launch_blocking`, ``TPUBOX_LAUNCH_BLOCKING=1``, or the daemon's
    ``--launch-blocking``)."""

    session_id: str
    tenant: str
    limits: Limits
    platform: Platform
    usage: Usage
    weight_sets: tuple[str, ...]
    components: tuple[str, ...]
    launch_blocking: bool = False


@dataclass(frozen=True)
class RunResult:
    """The end of a guest run (:meth:`Session.run`).

    Attributes:
        exit_code: the guest's exit status (0: success).
        error: why the guest was stopped (a trap, its deadline); empty when it exited.
        elapsed: seconds the run took, as the daemon measured it.
        stdout: everything the guest wrote to stdout.
        stderr: everything it wrote to stderr.
    """

    exit_code: int
    error: str
    elapsed: float
    stdout: bytes = field(repr=False)
    stderr: bytes = field(repr=False)

    @property
    def ok(self) -> bool:
        """Whether the guest exited with status 0 and was not stopped."""
        return self.exit_code == 0 and not self.error
