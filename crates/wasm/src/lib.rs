//! tpubox's Wasm side: sandboxed WebAssembly component guests reach the device through the
//! `tpubox:device` WIT interfaces (`wit/device.wit`), glued to the session layer of
//! `tpubox-core`, which decides every tenant rule.
//!
//! Modules, in dependency order:
//! - [`wit`]: the thin glue from the WIT interfaces to [`tpubox_core::session`];
//! - [`sandbox`]: wasmtime engine, component cache, per-guest stores, limits and deadlines;
//! - [`host`]: the embedding API ([`Host`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod host;
pub mod sandbox;
pub mod wit;

pub use host::{Host, HostConfig};
pub use sandbox::{RunOptions, RunOutcome, SandboxConfig};
