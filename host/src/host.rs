//! The embedding API: one [`Host`] owns the PJRT client and the Wasm sandbox, and runs guests.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use tpubox::{Host, HostConfig, RunOptions};
//! let host = Host::new(HostConfig::default())?;
//! let component = host.load_component("guest.wasm".as_ref())?;
//! let outcome = host.run(&component, "guest.wasm", &RunOptions::default()).await?;
//! assert!(outcome.success);
//! # Ok(()) }
//! ```

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use pjrt::{Client, NamedValue, Plugin};
use wasmtime::component::Component;

use crate::cache::{CacheConfig, CacheMode, CompileCache};
use crate::compiler::CompileIsolation;
use crate::device::{DEFAULT_MAX_PROGRAM_BYTES, DeviceService};
use crate::sandbox::{RunOptions, RunOutcome, Sandbox, SandboxConfig};
use crate::weights::{WeightRegistry, WeightSet};

/// How to build a [`Host`].
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Plugin name (`cpu`, `xla-cpu`, `tpu`, `cuda`) or path; `None` uses the lookup order of
    /// [`crate::plugin::resolve`].
    pub plugin: Option<String>,
    /// Options passed to `PJRT_Client_Create`, e.g. `("cpu_device_count", Int64(4))`.
    pub client_options: Vec<(String, NamedValue)>,
    /// Largest program a guest may compile, in bytes.
    pub max_program_bytes: usize,
    /// Executions that run on the device at once; more wait in a fair-share queue (default
    /// [`DEFAULT_EXECUTION_SLOTS`](crate::device::DEFAULT_EXECUTION_SLOTS)).
    pub execution_slots: usize,
    /// Wasm sandbox settings.
    pub sandbox: SandboxConfig,
    /// Compile cache settings.
    pub cache: CacheConfig,
    /// Where tenants' programs are compiled: in a contained worker process, or in this one.
    pub compile_isolation: CompileIsolation,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            plugin: None,
            client_options: Vec::new(),
            max_program_bytes: DEFAULT_MAX_PROGRAM_BYTES,
            execution_slots: crate::device::DEFAULT_EXECUTION_SLOTS,
            sandbox: SandboxConfig::default(),
            cache: CacheConfig::default(),
            compile_isolation: CompileIsolation::default(),
        }
    }
}

/// A process-wide host: one PJRT client shared by every guest it runs.
pub struct Host {
    device: Arc<DeviceService>,
    weights: Arc<WeightRegistry>,
    sandbox: Sandbox,
}

/// Loads the plugin `config.plugin` resolves to, creates a PJRT client with
/// `config.client_options`, and puts the compile cache `config.cache` in front of it.
///
/// Before loading an accelerator plugin (`tpu`, `cuda`) it checks that this machine has the
/// accelerator ([`crate::accelerator::check`]), so a wrong plugin fails at once, without the
/// plugin ever running. It does not set environment variables for the plugin: a process does
/// that with [`crate::plugin_env::prepare`] at the start of `main`, as `tpubox` does.
///
/// Errors: no plugin found (the message names the setup command), the plugin's accelerator is
/// missing ([`crate::accelerator::Missing`], one line), a plugin that fails to load or whose
/// PJRT API version is too old, or a client that cannot be created.
pub fn open_device(config: &HostConfig) -> Result<Arc<DeviceService>> {
    let path = crate::plugin::resolve(config.plugin.as_deref())?;
    crate::accelerator::check(&path)?;
    let plugin =
        Plugin::load(&path).with_context(|| format!("loading PJRT plugin {}", path.display()))?;
    let opts: Vec<(&str, NamedValue)> = config
        .client_options
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let client = Client::new(&plugin, &opts).context("creating the PJRT client")?;
    crate::compiler::register_custom_calls(&plugin, &client);
    let mut service = DeviceService::new(client, config.max_program_bytes)?
        .with_execution_slots(config.execution_slots)
        .with_compile_isolation(
            config.compile_isolation.clone(),
            config.client_options.clone(),
        );
    if config.cache.mode != CacheMode::Off {
        let cache = CompileCache::new(config.cache.clone()).context("opening the compile cache")?;
        service = service.with_cache(Arc::new(cache));
    }
    Ok(Arc::new(service))
}

impl Host {
    /// Loads the plugin, creates the PJRT client and the Wasm engine.
    ///
    /// Errors: see [`open_device`]; an engine that cannot be configured.
    pub fn new(config: HostConfig) -> Result<Self> {
        let device = open_device(&config)?;
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
