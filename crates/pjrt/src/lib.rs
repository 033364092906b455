//! Safe Rust wrapper over the PJRT C API (`xla/pjrt/c/pjrt_c_api.h`, version 0.81 or newer).
//!
//! A PJRT *plugin* is a shared library (`pjrt_c_api_cpu_plugin.so`, `libtpu.so`, ...) exporting
//! `GetPjrtApi`. This crate loads plugins ([`Plugin`]), creates clients ([`Client`]), moves data
//! between host and device ([`Buffer`], [`HostBytes`]), compiles StableHLO/HLO programs
//! ([`Program`], [`CompileOptions`], [`LoadedExecutable`]) and runs them ([`Execution`],
//! [`Event`]). [`set_unset_vars`] sets the environment variables a plugin reads when it loads,
//! while that is sound (the process has one thread).
//!
//! # Programs over several devices
//!
//! A module of several partitions (SPMD: `mhlo.num_partitions`, with GSPMD `mhlo.sharding` or
//! Shardy `sdy.sharding` annotations, as `jax.export` writes them) compiles for a
//! [`DeviceAssignment`] with [`CompileOptions::spmd`], and runs on all its devices at once
//! with [`LoadedExecutable::execute_sharded`] (one argument list per device, one
//! [`Execution`] per device; collectives pass data between them). The C API has no sharding
//! query, so [`LoadedExecutable::parameter_shardings`] and
//! [`LoadedExecutable::output_shardings`] read them from the optimized program; an
//! [`HloSharding`] gives each device's [`Shard`] of a global array, which
//! [`Shard::extract`] and [`Shard::insert`] copy out of and back into it.
//!
//! All `unsafe` code of the tpubox project lives in this crate; every `unsafe` block carries a
//! `// SAFETY:` comment. Plugin failures come back as [`Error`] values (never panics), and
//! arguments are validated before they reach the plugin, because XLA `CHECK` failures abort the
//! whole process.
//!
//! # Thread safety
//!
//! Every handle type is `Send + Sync`. The C API header does not spell out a threading contract;
//! the handles are thin wrappers over `xla::PjRtClient`, `PjRtDevice`, `PjRtBuffer` and
//! `PjRtLoadedExecutable`, whose implementations are designed for concurrent use (JAX calls them
//! from arbitrary threads, and the plugins run their own thread pools and invoke event callbacks
//! on them). This crate never exposes mutable access to plugin-owned state through `&self`, and
//! each handle is destroyed exactly once, in `Drop`, when nothing else can use it.
//!
//! # Lifetimes
//!
//! Plugins are never unloaded (`dlclose` crashed at process exit in trials). A [`Client`] is
//! destroyed when its last clone and the last [`Device`], [`Buffer`], [`LoadedExecutable`] and
//! [`Event`] created from it are dropped.

#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

mod api;
mod buffer;
mod client;
mod compile_options;
mod device;
mod error;
mod event;
mod executable;
pub mod ffi;
mod hlo;
mod host_bytes;
pub mod loop_budget;
mod mapped_file;
mod named_value;
mod plugin;
mod process_env;
mod program;
mod sharding;
mod types;

pub use buffer::Buffer;
pub use client::Client;
pub use compile_options::{CompileOptions, DeviceAssignment, OptimizationLevel};
pub use device::Device;
pub use error::{Error, ErrorCode, Result};
pub use event::Event;
pub use executable::{CompiledMemoryStats, Execution, LoadedExecutable};
pub use hlo::{HLO_PROTO, ProgramFacts, WhileLoop};
pub use host_bytes::HostBytes;
pub use mapped_file::MappedFile;
pub use named_value::NamedValue;
pub use plugin::Plugin;
pub use process_env::set_unset_vars;
pub use program::{Program, ProgramFormat};
pub use sharding::{HloSharding, Shard, Subgroup, TileAssignment};
pub use types::{PrimitiveType, TensorSpec};

/// Oldest PJRT C API minor version accepted from a plugin (major must be 0).
pub const MIN_API_MINOR: u32 = 81;
