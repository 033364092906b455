//! tpubox's Wasm side: sandboxed WebAssembly component guests reach the device through the
//! `tpubox:device` WIT interfaces (`wit/device.wit`), glued to the session layer of
//! `tpubox-core`, which decides every tenant rule.
//!
//! Modules, in dependency order:
//! - [`wit`]: the thin glue from the WIT interfaces to [`tpubox_core::session`];
//! - [`nn`]: `wasi:nn` (`wit/wasi-nn/`) on the same session: graphs, tensors, contexts;
//! - [`sandbox`]: wasmtime engine, component cache, per-guest stores, limits and deadlines;
//! - [`host`]: the embedding API ([`Host`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod host;
pub mod nn;
pub mod sandbox;
pub mod wit;

pub use host::{Host, HostConfig};
pub use sandbox::{RunOptions, RunOutcome, SandboxConfig};
