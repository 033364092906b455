//! tpubox host library: owns an accelerator through the PJRT C API and lends it to sandboxed
//! WebAssembly component guests through the `tpubox:device` WIT interfaces (`wit/device.wit`).
//!
//! Modules, one job each, in dependency order (each imports only those above it):
//! - [`error`]: the host's error type and kinds;
//! - [`types`]: device tensors, executables, specs and the shape checks applied before PJRT;
//! - [`tenant`]: tenants, their limits, charges and usage;
//! - [`scheduler`]: fair sharing of a device's execution slots between tenants;
//! - [`cache`]: the compile cache (in-process, host-disk and remote tiers) and its keys;
//! - [`compiler`]: running the XLA compiler, in process or contained in a worker process;
//! - [`device`]: the PJRT client shared by all tenants, with validation before every PJRT call;
//! - [`weights`]: named, read-only weight sets shared by all tenants;
//! - [`session`]: one tenant connection; every tenant rule (charges, donation, read-only
//!   weights, handle ownership, execution slots) is decided here, for every front door;
//! - [`wit`]: the thin glue from the WIT interfaces to [`session`];
//! - [`sandbox`]: wasmtime engine, component cache, per-guest stores, limits and deadlines;
//! - [`accelerator`]: checking, before a plugin loads, that the machine has its accelerator;
//! - [`plugin_env`]: the environment plugins start with (quiet logs, no metadata query);
//! - [`host`]: the embedding API ([`Host`]);
//! - [`plugin`]: finding and installing PJRT plugins and model packages;
//! - [`npy`] and [`exec`]: `tpubox exec`, running a StableHLO program on `.npy` files;
//! - [`scaffold`]: `tpubox new` (guest projects from templates, WIT and SDK vendored) and
//!   `tpubox wit` (the WIT package as text and binary-encoded);
//! - [`session_api`]: the daemon's session API (`tpubox.v1.Session`, gRPC over a Unix socket
//!   and TCP) for notebook kernels and Python clients, over [`session`];
//! - [`serve`]: `tpubox serve`, the daemon serving guest models over the Open Inference
//!   Protocol (REST, gRPC, metrics), with the model repository and dynamic batching, and the
//!   session API.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod accelerator;
pub mod cache;
pub mod compiler;
pub mod device;
pub mod error;
pub mod exec;
pub mod host;
pub mod npy;
pub mod plugin;
pub mod plugin_env;
pub mod sandbox;
pub mod scaffold;
pub mod scheduler;
pub mod serve;
pub mod session;
pub mod session_api;
pub mod tenant;
pub mod types;
pub mod weights;
pub mod wit;

pub use device::{DeviceService, TensorSpec};
pub use error::{DeviceError, ErrorKind};
pub use host::{Host, HostConfig, open_device};
pub use pjrt::{NamedValue, PrimitiveType};
pub use sandbox::{RunOptions, RunOutcome, SandboxConfig};
pub use session::Session;
pub use tenant::{Tenant, TenantLimits, TenantUsage};
