//! tpubox host library: owns an accelerator through the PJRT C API and lends it to sandboxed
//! WebAssembly component guests through the `tpubox:device` WIT interfaces (`wit/device.wit`).
//!
//! Modules, one job each:
//! - [`device`]: the PJRT client shared by all guests, with validation before every PJRT call;
//! - [`cache`]: the compile cache (in-process, host-disk and remote tiers) and its keys;
//! - [`wit`]: the thin glue from the WIT interfaces to [`device`];
//! - [`sandbox`]: wasmtime engine, component cache, per-guest stores, limits and deadlines;
//! - [`tenant`]: tenants, their limits and usage, and fair sharing of execution slots;
//! - [`host`]: the embedding API ([`Host`]);
//! - [`weights`]: named, read-only weight sets shared by all guests;
//! - [`plugin`]: finding and installing PJRT plugins and model packages;
//! - [`npy`] and [`exec`]: `tpubox exec`, running a StableHLO program on `.npy` files.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cache;
pub mod device;
pub mod error;
pub mod exec;
pub mod host;
pub mod npy;
pub mod plugin;
pub mod sandbox;
pub mod tenant;
pub mod weights;
pub mod wit;

pub use device::{DeviceService, TensorSpec};
pub use error::{DeviceError, ErrorKind};
pub use host::{Host, HostConfig, open_device};
pub use pjrt::{NamedValue, PrimitiveType};
pub use sandbox::{RunOptions, RunOutcome, SandboxConfig};
pub use tenant::{Tenant, TenantLimits, TenantUsage};
