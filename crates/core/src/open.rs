//! Opening the device: load a PJRT plugin, create its client, put the compile cache in front.

use std::sync::Arc;

use anyhow::{Context, Result};
use pjrt::{Client, NamedValue, Plugin};

use crate::cache::{CacheConfig, CacheMode, CompileCache};
use crate::compiler::CompileIsolation;
use crate::device::{DEFAULT_EXECUTION_SLOTS, DEFAULT_MAX_PROGRAM_BYTES, DeviceService};

/// How to open a [`DeviceService`] (the device half of the Wasm host's `HostConfig`).
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// Plugin name (`cpu`, `xla-cpu`, `tpu`, `cuda`) or path; `None` uses the lookup order of
    /// [`crate::plugin::resolve`].
    pub plugin: Option<String>,
    /// Options passed to `PJRT_Client_Create`, e.g. `("cpu_device_count", Int64(4))`.
    pub client_options: Vec<(String, NamedValue)>,
    /// Largest program a tenant may compile, in bytes.
    pub max_program_bytes: usize,
    /// Executions that run on the device at once; more wait in a fair-share queue (default
    /// [`DEFAULT_EXECUTION_SLOTS`]).
    pub execution_slots: usize,
    /// Compile cache settings.
    pub cache: CacheConfig,
    /// Where tenants' programs are compiled: in a contained worker process, or in this one.
    pub compile_isolation: CompileIsolation,
    /// Makes every launch of every session synchronous (default `false`;
    /// [`DeviceService::with_launch_blocking`], `--launch-blocking`).
    pub launch_blocking: bool,
    /// Registers the test-only custom call [`pjrt_kernels::TEST_FAIL`], which fails every
    /// execution (default `false`; for tests that inject a failure at execution). On CPU
    /// plugins only, in this process only: compile workers do not register it, so a program
    /// calling it compiles only with in-process compiles (`CompileIsolation::worker` `None`).
    pub test_custom_calls: bool,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            plugin: None,
            client_options: Vec::new(),
            max_program_bytes: DEFAULT_MAX_PROGRAM_BYTES,
            execution_slots: DEFAULT_EXECUTION_SLOTS,
            cache: CacheConfig::default(),
            compile_isolation: CompileIsolation::default(),
            launch_blocking: false,
            test_custom_calls: false,
        }
    }
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
pub fn open_device(config: &DeviceConfig) -> Result<Arc<DeviceService>> {
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
    crate::compiler::register_custom_calls(&plugin, &client, config.test_custom_calls);
    let mut service = DeviceService::new(client, config.max_program_bytes)?
        .with_execution_slots(config.execution_slots)
        .with_launch_blocking(config.launch_blocking)
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
