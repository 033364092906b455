from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    PRED: _ClassVar[DType]
    S8: _ClassVar[DType]
    S16: _ClassVar[DType]
    S32: _ClassVar[DType]
    S64: _ClassVar[DType]
    U8: _ClassVar[DType]
    U16: _ClassVar[DType]
    U32: _ClassVar[DType]
    U64: _ClassVar[DType]
    F16: _ClassVar[DType]
    F32: _ClassVar[DType]
    F64: _ClassVar[DType]
    C64: _ClassVar[DType]
    BF16: _ClassVar[DType]
    C128: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
PRED: DType
S8: DType
S16: DType
S32: DType
S64: DType
U8: DType
U16: DType
U32: DType
U64: DType
F16: DType
F32: DType
F64: DType
C64: DType
BF16: DType
C128: DType

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "dims")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_device_bytes", "max_live_tensors", "max_live_executables", "max_program_bytes", "max_compiles_per_minute", "max_call_seconds", "max_guest_memory_bytes", "idle_timeout_seconds", "max_pending_launches")
    MAX_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_LIVE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    MAX_LIVE_EXECUTABLES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROGRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPILES_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_CALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_GUEST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    max_device_bytes: int
    max_live_tensors: int
    max_live_executables: int
    max_program_bytes: int
    max_compiles_per_minute: int
    max_call_seconds: float
    max_guest_memory_bytes: int
    idle_timeout_seconds: float
    max_pending_launches: int
    def __init__(self, max_device_bytes: _Optional[int] = ..., max_live_tensors: _Optional[int] = ..., max_live_executables: _Optional[int] = ..., max_program_bytes: _Optional[int] = ..., max_compiles_per_minute: _Optional[int] = ..., max_call_seconds: _Optional[float] = ..., max_guest_memory_bytes: _Optional[int] = ..., idle_timeout_seconds: _Optional[float] = ..., max_pending_launches: _Optional[int] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("limits", "end_on_disconnect", "label", "devices", "device_ids", "exclusive_devices")
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    END_ON_DISCONNECT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    limits: Limits
    end_on_disconnect: bool
    label: str
    devices: int
    device_ids: _containers.RepeatedScalarFieldContainer[int]
    exclusive_devices: bool
    def __init__(self, limits: _Optional[_Union[Limits, _Mapping]] = ..., end_on_disconnect: bool = ..., label: _Optional[str] = ..., devices: _Optional[int] = ..., device_ids: _Optional[_Iterable[int]] = ..., exclusive_devices: bool = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("session_id", "session_token", "tenant", "limits", "platform", "local_socket", "session_devices", "exclusive_devices")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SESSION_DEVICES_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: str
    tenant: str
    limits: Limits
    platform: Platform
    local_socket: str
    session_devices: _containers.RepeatedScalarFieldContainer[int]
    exclusive_devices: bool
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[str] = ..., tenant: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., platform: _Optional[_Union[Platform, _Mapping]] = ..., local_socket: _Optional[str] = ..., session_devices: _Optional[_Iterable[int]] = ..., exclusive_devices: bool = ...) -> None: ...

class Platform(_message.Message):
    __slots__ = ("name", "version", "plugin", "devices")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    plugin: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., plugin: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("index", "kind", "description")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    index: int
    kind: str
    description: str
    def __init__(self, index: _Optional[int] = ..., kind: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("kind", "session_id", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[AttachEvent.Kind]
        ATTACHED: _ClassVar[AttachEvent.Kind]
        ENDED: _ClassVar[AttachEvent.Kind]
    KIND_UNSPECIFIED: AttachEvent.Kind
    ATTACHED: AttachEvent.Kind
    ENDED: AttachEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: AttachEvent.Kind
    session_id: str
    reason: str
    def __init__(self, kind: _Optional[_Union[AttachEvent.Kind, str]] = ..., session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: bool = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("session_id", "tenant", "limits", "platform", "usage", "weight_sets", "components", "local_socket", "launch_blocking", "session_devices", "exclusive_devices")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SETS_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_BLOCKING_FIELD_NUMBER: _ClassVar[int]
    SESSION_DEVICES_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    limits: Limits
    platform: Platform
    usage: UsageResponse
    weight_sets: _containers.RepeatedScalarFieldContainer[str]
    components: _containers.RepeatedScalarFieldContainer[str]
    local_socket: str
    launch_blocking: bool
    session_devices: _containers.RepeatedScalarFieldContainer[int]
    exclusive_devices: bool
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., platform: _Optional[_Union[Platform, _Mapping]] = ..., usage: _Optional[_Union[UsageResponse, _Mapping]] = ..., weight_sets: _Optional[_Iterable[str]] = ..., components: _Optional[_Iterable[str]] = ..., local_socket: _Optional[str] = ..., launch_blocking: bool = ..., session_devices: _Optional[_Iterable[int]] = ..., exclusive_devices: bool = ...) -> None: ...

class PutTensorChunk(_message.Message):
    __slots__ = ("spec", "device", "data")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    spec: TensorSpec
    device: int
    data: bytes
    def __init__(self, spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., device: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("handle", "spec", "device", "byte_size", "read_only", "weights")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    spec: TensorSpec
    device: int
    byte_size: int
    read_only: bool
    weights: _containers.RepeatedCompositeFieldContainer[WeightVersion]
    def __init__(self, handle: _Optional[int] = ..., spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., device: _Optional[int] = ..., byte_size: _Optional[int] = ..., read_only: bool = ..., weights: _Optional[_Iterable[_Union[WeightVersion, _Mapping]]] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetTensorRequest(_message.Message):
    __slots__ = ("handle", "chunk_bytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    chunk_bytes: int
    def __init__(self, handle: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("info", "data")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    info: TensorInfo
    data: bytes
    def __init__(self, info: _Optional[_Union[TensorInfo, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("tensors", "executables")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    EXECUTABLES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedScalarFieldContainer[int]
    executables: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tensors: _Optional[_Iterable[int]] = ..., executables: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("freed", "unknown")
    FREED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    freed: int
    unknown: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, freed: _Optional[int] = ..., unknown: _Optional[_Iterable[int]] = ...) -> None: ...

class CompileRequest(_message.Message):
    __slots__ = ("program", "format", "device", "optimization_level", "devices")
    class Format(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FORMAT_AUTO: _ClassVar[CompileRequest.Format]
        MLIR_TEXT: _ClassVar[CompileRequest.Format]
        MLIR_BYTECODE: _ClassVar[CompileRequest.Format]
    FORMAT_AUTO: CompileRequest.Format
    MLIR_TEXT: CompileRequest.Format
    MLIR_BYTECODE: CompileRequest.Format
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZATION_LEVEL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    program: bytes
    format: CompileRequest.Format
    device: int
    optimization_level: str
    devices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, program: _Optional[bytes] = ..., format: _Optional[_Union[CompileRequest.Format, str]] = ..., device: _Optional[int] = ..., optimization_level: _Optional[str] = ..., devices: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardingInfo(_message.Message):
    __slots__ = ("sharding", "global_spec")
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SPEC_FIELD_NUMBER: _ClassVar[int]
    sharding: str
    global_spec: TensorSpec
    def __init__(self, sharding: _Optional[str] = ..., global_spec: _Optional[_Union[TensorSpec, _Mapping]] = ...) -> None: ...

class CompileResponse(_message.Message):
    __slots__ = ("executable", "parameters", "results", "result_bytes", "temp_bytes", "fingerprint", "tier", "devices", "parameter_shardings", "result_shardings")
    EXECUTABLE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    RESULT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TEMP_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SHARDINGS_FIELD_NUMBER: _ClassVar[int]
    RESULT_SHARDINGS_FIELD_NUMBER: _ClassVar[int]
    executable: int
    parameters: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    results: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    result_bytes: int
    temp_bytes: int
    fingerprint: str
    tier: str
    devices: _containers.RepeatedScalarFieldContainer[int]
    parameter_shardings: _containers.RepeatedCompositeFieldContainer[ShardingInfo]
    result_shardings: _containers.RepeatedCompositeFieldContainer[ShardingInfo]
    def __init__(self, executable: _Optional[int] = ..., parameters: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., results: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., result_bytes: _Optional[int] = ..., temp_bytes: _Optional[int] = ..., fingerprint: _Optional[str] = ..., tier: _Optional[str] = ..., devices: _Optional[_Iterable[int]] = ..., parameter_shardings: _Optional[_Iterable[_Union[ShardingInfo, _Mapping]]] = ..., result_shardings: _Optional[_Iterable[_Union[ShardingInfo, _Mapping]]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("executable", "arguments", "donate")
    EXECUTABLE_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    DONATE_FIELD_NUMBER: _ClassVar[int]
    executable: int
    arguments: _containers.RepeatedScalarFieldContainer[int]
    donate: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, executable: _Optional[int] = ..., arguments: _Optional[_Iterable[int]] = ..., donate: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    def __init__(self, results: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ...) -> None: ...

class InlineTensor(_message.Message):
    __slots__ = ("spec", "data", "device")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    spec: TensorSpec
    data: bytes
    device: int
    def __init__(self, spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., data: _Optional[bytes] = ..., device: _Optional[int] = ...) -> None: ...

class CallArgument(_message.Message):
    __slots__ = ("handle", "tensor")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    handle: int
    tensor: InlineTensor
    def __init__(self, handle: _Optional[int] = ..., tensor: _Optional[_Union[InlineTensor, _Mapping]] = ...) -> None: ...

class CallRequest(_message.Message):
    __slots__ = ("executable", "arguments", "donate", "fetch", "keep", "free", "launch")
    EXECUTABLE_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    DONATE_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    executable: int
    arguments: _containers.RepeatedCompositeFieldContainer[CallArgument]
    donate: _containers.RepeatedScalarFieldContainer[int]
    fetch: _containers.RepeatedScalarFieldContainer[int]
    keep: _containers.RepeatedScalarFieldContainer[int]
    free: _containers.RepeatedScalarFieldContainer[int]
    launch: bool
    def __init__(self, executable: _Optional[int] = ..., arguments: _Optional[_Iterable[_Union[CallArgument, _Mapping]]] = ..., donate: _Optional[_Iterable[int]] = ..., fetch: _Optional[_Iterable[int]] = ..., keep: _Optional[_Iterable[int]] = ..., free: _Optional[_Iterable[int]] = ..., launch: bool = ...) -> None: ...

class CallResult(_message.Message):
    __slots__ = ("info", "fetched", "data")
    INFO_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    info: TensorInfo
    fetched: bool
    data: bytes
    def __init__(self, info: _Optional[_Union[TensorInfo, _Mapping]] = ..., fetched: bool = ..., data: _Optional[bytes] = ...) -> None: ...

class CallResponse(_message.Message):
    __slots__ = ("results", "freed", "unknown", "launch_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CallResult]
    freed: int
    unknown: _containers.RepeatedScalarFieldContainer[int]
    launch_id: int
    def __init__(self, results: _Optional[_Iterable[_Union[CallResult, _Mapping]]] = ..., freed: _Optional[int] = ..., unknown: _Optional[_Iterable[int]] = ..., launch_id: _Optional[int] = ...) -> None: ...

class PutShardedChunk(_message.Message):
    __slots__ = ("spec", "sharding", "devices", "data")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    spec: TensorSpec
    sharding: str
    devices: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., sharding: _Optional[str] = ..., devices: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ShardedTensorInfo(_message.Message):
    __slots__ = ("spec", "sharding", "shards", "byte_size")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    spec: TensorSpec
    sharding: str
    shards: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    byte_size: int
    def __init__(self, spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., sharding: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., byte_size: _Optional[int] = ...) -> None: ...

class GetShardedTensorRequest(_message.Message):
    __slots__ = ("spec", "sharding", "shards", "chunk_bytes")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    spec: TensorSpec
    sharding: str
    shards: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    def __init__(self, spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., sharding: _Optional[str] = ..., shards: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ShardHandles(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handles: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardedArgument(_message.Message):
    __slots__ = ("shards", "array")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    shards: ShardHandles
    array: InlineTensor
    def __init__(self, shards: _Optional[_Union[ShardHandles, _Mapping]] = ..., array: _Optional[_Union[InlineTensor, _Mapping]] = ...) -> None: ...

class CallShardedRequest(_message.Message):
    __slots__ = ("executable", "arguments", "donate", "fetch", "keep", "free")
    EXECUTABLE_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    DONATE_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    executable: int
    arguments: _containers.RepeatedCompositeFieldContainer[ShardedArgument]
    donate: _containers.RepeatedScalarFieldContainer[int]
    fetch: _containers.RepeatedScalarFieldContainer[int]
    keep: _containers.RepeatedScalarFieldContainer[int]
    free: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, executable: _Optional[int] = ..., arguments: _Optional[_Iterable[_Union[ShardedArgument, _Mapping]]] = ..., donate: _Optional[_Iterable[int]] = ..., fetch: _Optional[_Iterable[int]] = ..., keep: _Optional[_Iterable[int]] = ..., free: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardedResult(_message.Message):
    __slots__ = ("info", "fetched", "data")
    INFO_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    info: ShardedTensorInfo
    fetched: bool
    data: bytes
    def __init__(self, info: _Optional[_Union[ShardedTensorInfo, _Mapping]] = ..., fetched: bool = ..., data: _Optional[bytes] = ...) -> None: ...

class CallShardedResponse(_message.Message):
    __slots__ = ("results", "freed", "unknown")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ShardedResult]
    freed: int
    unknown: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, results: _Optional[_Iterable[_Union[ShardedResult, _Mapping]]] = ..., freed: _Optional[int] = ..., unknown: _Optional[_Iterable[int]] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("tensors", "all")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedScalarFieldContainer[int]
    all: bool
    def __init__(self, tensors: _Optional[_Iterable[int]] = ..., all: bool = ...) -> None: ...

class WaitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetLaunchBlockingRequest(_message.Message):
    __slots__ = ("on",)
    ON_FIELD_NUMBER: _ClassVar[int]
    on: bool
    def __init__(self, on: bool = ...) -> None: ...

class SetLaunchBlockingResponse(_message.Message):
    __slots__ = ("blocking",)
    BLOCKING_FIELD_NUMBER: _ClassVar[int]
    blocking: bool
    def __init__(self, blocking: bool = ...) -> None: ...

class OpenWeightsRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class OpenWeightsResponse(_message.Message):
    __slots__ = ("tensors", "version")
    class Entry(_message.Message):
        __slots__ = ("name", "tensor")
        NAME_FIELD_NUMBER: _ClassVar[int]
        TENSOR_FIELD_NUMBER: _ClassVar[int]
        name: str
        tensor: TensorInfo
        def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[TensorInfo, _Mapping]] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[OpenWeightsResponse.Entry]
    version: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[OpenWeightsResponse.Entry, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("name", "tensors", "readers")
    class Entry(_message.Message):
        __slots__ = ("name", "handle")
        NAME_FIELD_NUMBER: _ClassVar[int]
        HANDLE_FIELD_NUMBER: _ClassVar[int]
        name: str
        handle: int
        def __init__(self, name: _Optional[str] = ..., handle: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensors: _containers.RepeatedCompositeFieldContainer[PublishWeightsRequest.Entry]
    readers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[PublishWeightsRequest.Entry, _Mapping]]] = ..., readers: _Optional[_Iterable[str]] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("version", "byte_size")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    version: int
    byte_size: int
    def __init__(self, version: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class WeightVersionsRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class WeightVersionsResponse(_message.Message):
    __slots__ = ("latest", "held")
    LATEST_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    latest: int
    held: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, latest: _Optional[int] = ..., held: _Optional[_Iterable[int]] = ...) -> None: ...

class UnpublishWeightsRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnpublishWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunComponentRequest(_message.Message):
    __slots__ = ("wasm", "name", "args", "stdin", "timeout_seconds")
    WASM_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    wasm: bytes
    name: str
    args: _containers.RepeatedScalarFieldContainer[str]
    stdin: bytes
    timeout_seconds: float
    def __init__(self, wasm: _Optional[bytes] = ..., name: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., stdin: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RunComponentEvent(_message.Message):
    __slots__ = ("stdout", "stderr", "exit")
    class Exit(_message.Message):
        __slots__ = ("code", "error", "elapsed_seconds")
        CODE_FIELD_NUMBER: _ClassVar[int]
        ERROR_FIELD_NUMBER: _ClassVar[int]
        ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
        code: int
        error: str
        elapsed_seconds: float
        def __init__(self, code: _Optional[int] = ..., error: _Optional[str] = ..., elapsed_seconds: _Optional[float] = ...) -> None: ...
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit: RunComponentEvent.Exit
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit: _Optional[_Union[RunComponentEvent.Exit, _Mapping]] = ...) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UsageResponse(_message.Message):
    __slots__ = ("device_bytes", "peak_device_bytes", "live_tensors", "live_executables", "compiles", "executions", "device_seconds", "refused", "pending_launches", "executions_running", "transfer_bytes", "peak_live_tensors", "host_to_device_bytes", "device_to_host_bytes", "published_bytes", "published_versions", "device_bytes_by_device")
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    LIVE_EXECUTABLES_FIELD_NUMBER: _ClassVar[int]
    COMPILES_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PENDING_LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_LIVE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    HOST_TO_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TO_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_BY_DEVICE_FIELD_NUMBER: _ClassVar[int]
    device_bytes: int
    peak_device_bytes: int
    live_tensors: int
    live_executables: int
    compiles: int
    executions: int
    device_seconds: float
    refused: int
    pending_launches: int
    executions_running: int
    transfer_bytes: int
    peak_live_tensors: int
    host_to_device_bytes: int
    device_to_host_bytes: int
    published_bytes: int
    published_versions: int
    device_bytes_by_device: _containers.RepeatedCompositeFieldContainer[DeviceBytes]
    def __init__(self, device_bytes: _Optional[int] = ..., peak_device_bytes: _Optional[int] = ..., live_tensors: _Optional[int] = ..., live_executables: _Optional[int] = ..., compiles: _Optional[int] = ..., executions: _Optional[int] = ..., device_seconds: _Optional[float] = ..., refused: _Optional[int] = ..., pending_launches: _Optional[int] = ..., executions_running: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., peak_live_tensors: _Optional[int] = ..., host_to_device_bytes: _Optional[int] = ..., device_to_host_bytes: _Optional[int] = ..., published_bytes: _Optional[int] = ..., published_versions: _Optional[int] = ..., device_bytes_by_device: _Optional[_Iterable[_Union[DeviceBytes, _Mapping]]] = ...) -> None: ...

class DeviceBytes(_message.Message):
    __slots__ = ("device", "bytes", "peak_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: int
    bytes: int
    peak_bytes: int
    def __init__(self, device: _Optional[int] = ..., bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ...) -> None: ...

class TenantUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TenantUsageResponse(_message.Message):
    __slots__ = ("tenant", "sessions", "usage")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    sessions: int
    usage: UsageResponse
    def __init__(self, tenant: _Optional[str] = ..., sessions: _Optional[int] = ..., usage: _Optional[_Union[UsageResponse, _Mapping]] = ...) -> None: ...
