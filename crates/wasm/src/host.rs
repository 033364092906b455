//! The embedding API: one [`Host`] owns the PJRT client and the Wasm sandbox, and runs guests.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use tpubox_wasm::{Host, HostConfig, RunOptions};
//! let host = Host::new(HostConfig::default())?;
//! let component = host.load_component("guest.wasm".as_ref())?;
//! let outcome = host.run(&component, "guest.wasm", &RunOptions::default()).await?;
//! assert!(outcome.success);
//! # Ok(()) }
//! ```

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use tpubox_core::NamedValue;
use wasmtime::component::Component;

use crate::sandbox::{RunOptions, RunOutcome, Sandbox, SandboxConfig};
use tpubox_core::cache::CacheConfig;
use tpubox_core::compiler::CompileIsolation;
use tpubox_core::device::DeviceService;
use tpubox_core::weights::{WeightRegistry, WeightSet};
use tpubox_core::{DeviceConfig, open_device};

/// How to build a [`Host`].
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Plugin name (`cpu`, `xla-cpu`, `tpu`, `cuda`) or path; `None` uses the lookup order of
    /// [`tpubox_core::plugin::resolve`].
    pub plugin: Option<String>,
    /// Options passed to `PJRT_Client_Create`, e.g. `("cpu_device_count", Int64(4))`.
    pub client_options: Vec<(String, NamedValue)>,
    /// Largest program a guest may compile, in bytes.
    pub max_program_bytes: usize,
    /// Executions that run on the device at once; more wait in a fair-share queue (default
    /// [`DEFAULT_EXECUTION_SLOTS`](tpubox_core::device::DEFAULT_EXECUTION_SLOTS)).
    pub execution_slots: usize,
    /// Wasm sandbox settings.
    pub sandbox: SandboxConfig,
    /// Compile cache settings.
    pub cache: CacheConfig,
    /// Where tenants' programs are compiled: in a contained worker process, or in this one.
    pub compile_isolation: CompileIsolation,
    /// Makes every launch of every guest synchronous (`tpubox run --launch-blocking`; see
    /// [`DeviceConfig::launch_blocking`]).
    pub launch_blocking: bool,
    /// Registers the test-only failing custom call ([`DeviceConfig::test_custom_calls`]).
    pub test_custom_calls: bool,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig::from_device(DeviceConfig::default(), SandboxConfig::default())
    }
}

impl HostConfig {
    /// A host configuration from its two halves.
    pub fn from_device(device: DeviceConfig, sandbox: SandboxConfig) -> Self {
        HostConfig {
            plugin: device.plugin,
            client_options: device.client_options,
            max_program_bytes: device.max_program_bytes,
            execution_slots: device.execution_slots,
            sandbox,
            cache: device.cache,
            compile_isolation: device.compile_isolation,
            launch_blocking: device.launch_blocking,
            test_custom_calls: device.test_custom_calls,
        }
    }

    /// The device half: what [`open_device`] needs.
    pub fn device(&self) -> DeviceConfig {
        DeviceConfig {
            plugin: self.plugin.clone(),
            client_options: self.client_options.clone(),
            max_program_bytes: self.max_program_bytes,
            execution_slots: self.execution_slots,
            cache: self.cache.clone(),
            compile_isolation: self.compile_isolation.clone(),
            launch_blocking: self.launch_blocking,
            test_custom_calls: self.test_custom_calls,
        }
    }
}

/// A process-wide host: one PJRT client shared by every guest it runs.
pub struct Host {
    device: Arc<DeviceService>,
    weights: Arc<WeightRegistry>,
    sandbox: Sandbox,
}

impl Host {
    /// Loads the plugin, creates the PJRT client and the Wasm engine.
    ///
    /// Errors: see [`open_device`]; an engine that cannot be configured.
    pub fn new(config: HostConfig) -> Result<Self> {
        let device = open_device(&config.device())?;
        Self::with_device(device, config.sandbox)
    }

    /// Builds a host around an existing device service (to share one client between hosts).
    ///
    /// Errors: an engine that cannot be configured.
    pub fn with_device(device: Arc<DeviceService>, sandbox: SandboxConfig) -> Result<Self> {
        Ok(Host {
            device,
            weights: Arc::new(WeightRegistry::new()),
            sandbox: Sandbox::new(sandbox)?,
        })
    }

    /// The shared device service (for host-side work without a guest).
    pub fn device(&self) -> &Arc<DeviceService> {
        &self.device
    }

    /// The weight sets guests can open.
    pub fn weights(&self) -> &Arc<WeightRegistry> {
        &self.weights
    }

    /// Loads a safetensors file onto device 0 as the weight set `name`, shared read-only by
    /// every guest this host runs.
    ///
    /// Errors: see [`WeightRegistry::load_safetensors`].
    pub fn load_weights(&self, name: &str, path: &Path) -> Result<Arc<WeightSet>> {
        self.weights
            .load_safetensors(&self.device, name, path, 0)
            .with_context(|| format!("loading weights `{name}` from {}", path.display()))
    }

    /// The Wasm sandbox.
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    /// Loads a component from a `.wasm` file (compiled once, then cached on disk).
    ///
    /// Errors: unreadable file, or not a valid component.
    pub fn load_component(&self, path: &Path) -> Result<Component> {
        self.sandbox.load_component(path)
    }

    /// Runs a WASI command component to completion; `name` is its `argv[0]`.
    ///
    /// Errors: see [`Sandbox::run`].
    pub async fn run(
        &self,
        component: &Component,
        name: &str,
        opts: &RunOptions,
    ) -> Result<RunOutcome> {
        self.sandbox
            .run(&self.device, &self.weights, component, name, opts)
            .await
    }
}
