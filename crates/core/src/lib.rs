//! tpubox's device and session layer: owns an accelerator through the PJRT C API and lends it
//! to tenants. Every front door (the Wasm guests of `tpubox-wasm`, the inference server of
//! `tpubox-serve`, the session API of `tpubox-session-api`) reaches the device through a
//! [`Session`], which applies every tenant rule. This crate links neither wasmtime nor an
//! HTTP/gRPC stack; the compile cache's remote tier is a trait ([`cache::RemoteStore`]) whose
//! object-store implementation is the `tpubox-cache-remote` crate.
//!
//! Modules, one job each, in dependency order (each imports only those above it):
//! - [`error`]: the host's error type and kinds;
//! - [`protection`]: counts and logs each protection against callers that triggers;
//! - [`types`]: device tensors, executables, specs and the shape checks applied before PJRT;
//! - [`tenant`]: tenants, their limits, charges and usage;
//! - [`scheduler`]: fair sharing of a device's execution slots between tenants;
//! - [`accelerator`]: checking, before a plugin loads, that the machine has its accelerator;
//! - [`plugin`]: finding and installing PJRT plugins and model packages;
//! - [`plugin_env`]: the environment plugins start with (quiet logs, no metadata query);
//! - [`cache`]: the compile cache (in-process, host-disk and remote tiers) and its keys;
//! - [`compiler`]: running the XLA compiler, in process or contained in a worker process;
//! - [`device`]: the PJRT client shared by all tenants, with validation before every PJRT call;
//! - [`open`]: opening a device from a [`DeviceConfig`] ([`open_device`]);
//! - [`weights`]: named, read-only weight sets shared by all tenants;
//! - [`collective`]: process groups, whose collectives run as one program over the ranks'
//!   devices (what `torch.distributed` ranks call);
//! - [`session`]: one tenant connection; every tenant rule (charges, donation, read-only
//!   weights, handle ownership, execution slots) is decided here, for every front door;
//! - [`npy`] and [`exec`]: `tpubox exec`, running a StableHLO program on `.npy` files.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod accelerator;
pub mod cache;
pub mod collective;
pub mod compiler;
pub mod declared;
pub mod device;
pub mod error;
pub mod exec;
pub mod logsafe;
pub mod mlir_text;
pub mod npy;
pub mod open;
pub mod placement;
pub mod plugin;
pub mod plugin_env;
pub mod protection;
pub mod scheduler;
pub mod session;
pub mod tenant;
pub mod types;
pub mod weights;

pub use cache::CacheTier;
pub use device::{CompileOutcome, CompileSettings, DeviceService, TensorSpec};
pub use error::{DeviceError, ErrorKind};
pub use open::{DeviceConfig, open_device};
pub use pjrt::{NamedValue, OptimizationLevel, PrimitiveType};
pub use session::Session;
pub use tenant::{LoopBudgetLimits, Tenant, TenantLimits, TenantUsage};
