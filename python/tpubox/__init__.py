"""tpubox: the Python client of the tpubox daemon's session API.

The daemon (``tpubox serve --session-socket PATH``) owns the accelerator through PJRT; this
package holds a *session* on it over gRPC: tensors that stay on the device between calls,
StableHLO programs compiled through the daemon's compile cache, shared weight sets, and guest
components run in the daemon's sandbox, all within the session's tenant limits. It is pure
Python (grpcio, protobuf, NumPy, ml_dtypes): nothing here links the accelerator runtime.

    import tpubox, numpy as np
    with tpubox.connect("unix:/run/tpubox/session.sock", token) as s:
        x = s.tensor(np.ones((2, 2), np.float32))
        add = s.compile(PROGRAM_TEXT)
        (y,) = add(x, x)
        print(y.numpy())

In a Jupyter kernel started by the tpubox provisioner, ``tpubox.connect()`` joins the kernel's
session. ``tpubox.jax.jit`` runs JAX functions on the daemon's device. See docs/NOTEBOOKS.md.
"""

from .errors import (
    CompileFailed,
    DeadlineExceeded,
    ExecutionFailed,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SessionEnded,
    TpuboxError,
    Unauthenticated,
    Unavailable,
    Unsupported,
)
from .session import (
    ENV_ADDRESS,
    ENV_LAUNCH_BLOCKING,
    ENV_SESSION_ID,
    ENV_SESSION_TOKEN,
    Device,
    DeviceBytes,
    Executable,
    Limits,
    Platform,
    RunResult,
    Session,
    SessionInfo,
    ShardedTensor,
    Tensor,
    TensorSpec,
    TenantUsage,
    Usage,
    WeightSet,
    WeightVersions,
    connect,
    default_session,
    tenant_usage,
    wait_for_daemon,
)
from ._transport import TLS

__version__ = "0.1.0"

__all__ = [
    "connect",
    "default_session",
    "tenant_usage",
    "wait_for_daemon",
    "TLS",
    "Session",
    "Tensor",
    "ShardedTensor",
    "Executable",
    "TensorSpec",
    "Limits",
    "Usage",
    "TenantUsage",
    "Platform",
    "Device",
    "DeviceBytes",
    "SessionInfo",
    "RunResult",
    "WeightSet",
    "WeightVersions",
    "ENV_ADDRESS",
    "ENV_SESSION_TOKEN",
    "ENV_SESSION_ID",
    "ENV_LAUNCH_BLOCKING",
    "TpuboxError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "PermissionDenied",
    "ResourceExhausted",
    "Unsupported",
    "CompileFailed",
    "ExecutionFailed",
    "Internal",
    "Unauthenticated",
    "SessionEnded",
    "Unavailable",
    "DeadlineExceeded",
]
