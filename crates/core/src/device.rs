//! The device service: one PJRT client shared by every guest, with every value validated before
//! it reaches the plugin.
//!
//! XLA aborts the whole process on some invalid inputs (a host buffer shorter than its dtype ×
//! dims, arguments whose shapes differ from the program's parameters, a buffer donated twice),
//! so this module checks byte lengths, dims, argument lists and donation before calling PJRT.
//! Tenant rules are not decided here: the session layer ([`crate::session`]) charges tenants and
//! checks handles, then calls this service; `tpubox exec` and embedders call it directly.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use pjrt::{Buffer, Client, CompileOptions, Device, NamedValue, OptimizationLevel, PrimitiveType};

use crate::cache::{CacheTier, CompileCache, Entry, PluginIdentity, cache_key};
use crate::compiler::{CompileIsolation, CompileStats, Compiles, WorkerTarget, compile_program};
use crate::error::{DeviceError, DeviceResult, ErrorKind};
use crate::scheduler::{FairShare, Slot};
use crate::tenant::{LoopBudgetLimits, Tenant};
pub use crate::types::{
    Arg, Call, Compiled, DeviceExecutable, DeviceInfo, DeviceTensor, MAX_RANK, PlatformInfo,
    TensorSpec, check_tensor_bytes, checked_byte_size, dims_from_u64, format_spec, parse_spec_list,
    validate_args,
};

/// Default largest program accepted by [`DeviceService::compile`], in bytes (64 MiB).
pub const DEFAULT_MAX_PROGRAM_BYTES: usize = 64 << 20;

/// How long an execution may run before the host logs it as possibly stuck (it cannot be
/// cancelled; its tenant's usage counts it in `executions_running`).
pub const STUCK_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// Executions that run on the device at once by default (see [`DeviceService::with_execution_slots`]).
pub const DEFAULT_EXECUTION_SLOTS: usize = 2;

/// What a compile is for, beside the program: the target device, the optimisation level and
/// the loop budget. All are part of the compile-cache key; the default (device 0, no level, no
/// budget) gives the same key as builds that had neither.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CompileSettings {
    /// Index of the device to compile for (default 0).
    pub device: u32,
    /// Compile one program for several devices at once (SPMD: one partition per device, in
    /// this order, XLA's partitioner with Shardy; what `jax.jit` over a mesh does). Empty or
    /// one device (the default): a program of `device` alone. Part of the cache key (the
    /// device assignment is in the compile options).
    pub devices: Vec<u32>,
    /// How hard XLA optimises ([`OptimizationLevel`], "O0"–"O3"); `None` (default) leaves the
    /// plugin's defaults. Honoured in process and by compile workers alike.
    pub optimization_level: Option<OptimizationLevel>,
    /// The budget given to `while` loops XLA cannot bound (`None`: none; such loops then run
    /// unchecked, and a tenant's program policy refuses them). [`DeviceService::compile_for`]
    /// sets it from the tenant's [`ProgramPolicy::loop_budget`](crate::tenant::ProgramPolicy::loop_budget).
    pub loop_budget: Option<LoopBudgetLimits>,
}

/// A compiled executable and the cache tier that served it.
#[derive(Debug, Clone)]
pub struct CompileOutcome {
    /// The executable.
    pub exe: Arc<DeviceExecutable>,
    /// Where it came from: tier 1 (memory), 2 (disk) or 3 (remote), a compile, or a compile
    /// with no cache in front.
    pub tier: CacheTier,
}

/// The process-wide owner of the PJRT client: creates tensors, compiles and executes, with
/// validation in front of every PJRT call. Cheap to share (`Arc`), `Send + Sync`.
pub struct DeviceService {
    client: Client,
    devices: Vec<Device>,
    platform: PlatformInfo,
    max_program_bytes: usize,
    cache: Option<Arc<CompileCache>>,
    identity: OnceLock<PluginIdentity>,
    /// One fair-share queue per device (same order as `devices`): tenants on different
    /// devices never wait for each other's slots.
    schedulers: Vec<FairShare>,
    /// Which sessions are placed on which device ([`crate::placement`]).
    leases: Arc<crate::placement::DeviceLeases>,
    isolation: CompileIsolation,
    /// The compile slots, and the worker pool when compiles go to workers (a worker is
    /// configured and the platform allows it).
    compiles: Compiles,
    /// [`with_launch_blocking`](Self::with_launch_blocking).
    launch_blocking: bool,
    /// Bytes copied host → device and device → host so far ([`Self::transferred_bytes`]).
    host_to_device: std::sync::atomic::AtomicU64,
    device_to_host: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for DeviceService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceService")
            .field("platform", &self.platform)
            .finish()
    }
}

impl DeviceService {
    /// Wraps a PJRT client. `max_program_bytes` bounds [`compile`](Self::compile) input.
    ///
    /// Errors: `internal` when the plugin cannot list its devices or name its platform, or has
    /// no addressable device.
    pub fn new(client: Client, max_program_bytes: usize) -> DeviceResult<Self> {
        let internal = |e: pjrt::Error| DeviceError::from_pjrt(e, ErrorKind::Internal);
        let devices = client.devices().map_err(internal)?;
        if devices.is_empty() {
            return Err(DeviceError::new(
                ErrorKind::Internal,
                "the PJRT client has no addressable device",
            ));
        }
        let platform = PlatformInfo {
            name: client.platform_name().map_err(internal)?,
            version: client.platform_version().map_err(internal)?,
            pjrt_api_version: client.plugin().api_version(),
            plugin_path: client.plugin().path().display().to_string(),
        };
        let isolation = CompileIsolation {
            worker: None,
            ..CompileIsolation::default()
        };
        let leases = crate::placement::DeviceLeases::new(devices.len() as u32);
        let schedulers = (0..devices.len())
            .map(|_| FairShare::new(DEFAULT_EXECUTION_SLOTS))
            .collect();
        Ok(DeviceService {
            compiles: Compiles::new(&isolation, None),
            isolation,
            client,
            devices,
            platform,
            max_program_bytes,
            cache: None,
            identity: OnceLock::new(),
            leases,
            schedulers,
            launch_blocking: false,
            host_to_device: Default::default(),
            device_to_host: Default::default(),
        })
    }

    /// Makes every launch of every session synchronous (`true`; default `false`): a
    /// [`crate::session::Session::launch`] returns only once the device finished, with the
    /// device's error if it failed (the host's `--launch-blocking`, the analogue of TorchTPU's
    /// `TORCH_TPU_LAUNCH_BLOCKING=1`, for debugging guests in any language).
    pub fn with_launch_blocking(mut self, on: bool) -> Self {
        self.launch_blocking = on;
        self
    }

    /// Whether every launch is synchronous ([`with_launch_blocking`](Self::with_launch_blocking)).
    pub fn launch_blocking(&self) -> bool {
        self.launch_blocking
    }

    /// Puts `cache` in front of [`compile`](Self::compile).
    pub fn with_cache(mut self, cache: Arc<CompileCache>) -> Self {
        self.cache = Some(cache);
        self
    }

    /// Lets `slots` executions run on each device at once; more wait, and the waiting tenant
    /// with the least device time used on that device goes first ([`FairShare`]; each device
    /// has its own queue). Default [`DEFAULT_EXECUTION_SLOTS`].
    pub fn with_execution_slots(mut self, slots: usize) -> Self {
        self.schedulers = (0..self.devices.len())
            .map(|_| FairShare::new(slots))
            .collect();
        self
    }

    /// Compiles tenants' programs as `isolation` says ([`crate::compiler`]); workers create
    /// their clients with `client_options`, as this service's was. Workers are used only on
    /// platforms whose client a second process may create (the CPU plugins); elsewhere
    /// programs compile in this process, and a warning says so. With workers, it starts the
    /// worker thread and `isolation.prestarted_workers` workers at once.
    pub fn with_compile_isolation(
        mut self,
        isolation: CompileIsolation,
        client_options: Vec<(String, NamedValue)>,
    ) -> Self {
        let target = match &isolation.worker {
            Some(_) if self.platform.name.eq_ignore_ascii_case("cpu") => Some(WorkerTarget {
                plugin: self.client.plugin().path().to_path_buf(),
                client_options,
            }),
            Some(_) => {
                tracing::warn!(
                    platform = %self.platform.name,
                    "compile workers need a second client of the plugin, which this platform does not allow; compiling in process"
                );
                None
            }
            None => None,
        };
        self.compiles = Compiles::new(&isolation, target);
        self.isolation = isolation;
        self
    }

    /// How programs are compiled, and whether workers are in use.
    pub fn compile_isolation(&self) -> (&CompileIsolation, bool) {
        (&self.isolation, self.compiles.uses_workers())
    }

    /// What this service's compiles have done: slots taken and waited for, workers started
    /// and used, resident-memory kills ([`CompileStats`]).
    pub fn compile_stats(&self) -> CompileStats {
        self.compiles.stats()
    }

    /// The execution scheduler of device 0 ([`scheduler_for`](Self::scheduler_for) names a
    /// device).
    pub fn scheduler(&self) -> &FairShare {
        &self.schedulers[0]
    }

    /// The execution scheduler of device `device` (device 0's for an index past the last:
    /// executables and tensors are checked against the device list before they get here).
    pub fn scheduler_for(&self, device: u32) -> &FairShare {
        self.schedulers
            .get(device as usize)
            .unwrap_or(&self.schedulers[0])
    }

    /// The sessions placed on each device, and those holding devices alone
    /// ([`crate::placement::DeviceLeases::place`]).
    pub fn leases(&self) -> &Arc<crate::placement::DeviceLeases> {
        &self.leases
    }

    /// Number of addressable devices.
    pub fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    /// The compile cache, if any.
    pub fn cache(&self) -> Option<&Arc<CompileCache>> {
        self.cache.as_ref()
    }

    /// What identifies this client's compiler and target in cache keys (computed once; hashes
    /// the plugin file).
    ///
    /// Errors: `internal` when the plugin file cannot be read.
    pub fn identity(&self) -> DeviceResult<&PluginIdentity> {
        if let Some(i) = self.identity.get() {
            return Ok(i);
        }
        let first = &self.devices[0];
        let id = PluginIdentity::new(
            self.client.plugin().path(),
            &self.platform.name,
            &self.platform.version,
            self.platform.pjrt_api_version,
            &first.kind(),
            self.devices.len(),
        )
        .map_err(|e| {
            DeviceError::new(ErrorKind::Internal, format!("hashing the plugin file: {e}"))
        })?;
        Ok(self.identity.get_or_init(|| id))
    }

    /// The PJRT client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Platform name, version and plugin.
    pub fn platform(&self) -> &PlatformInfo {
        &self.platform
    }

    /// The addressable devices, ordered by index.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.devices
            .iter()
            .enumerate()
            .map(|(i, d)| DeviceInfo {
                index: i as u32,
                id: d.id(),
                kind: d.kind(),
                description: d.debug_string(),
            })
            .collect()
    }

    fn device(&self, index: u32) -> DeviceResult<&Device> {
        self.devices.get(index as usize).ok_or_else(|| {
            DeviceError::new(
                ErrorKind::NotFound,
                format!(
                    "device {index} does not exist (this host has {} device(s), indices 0 to {})",
                    self.devices.len(),
                    self.devices.len().saturating_sub(1)
                ),
            )
        })
    }

    /// Creates a tensor on device `device` from dense row-major little-endian bytes.
    ///
    /// Errors: `invalid-argument` when `data.len()` differs from element size × product of
    /// `dims`, a dim is negative, the size overflows, or the rank exceeds [`MAX_RANK`];
    /// `not-found` for an unknown device; `resource-exhausted` or `internal` from the plugin.
    pub fn tensor_from_bytes(
        &self,
        ty: PrimitiveType,
        dims: &[i64],
        data: &[u8],
        device: u32,
    ) -> DeviceResult<DeviceTensor> {
        check_tensor_bytes(ty, dims, data.len())?;
        let dev = self.device(device)?;
        let buffer = self
            .client
            .buffer_from_host(data, ty, dims, dev)
            .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::Internal))?;
        self.host_to_device
            .fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let spec = TensorSpec {
            ty,
            dims: dims.to_vec(),
        };
        Ok(DeviceTensor::new(buffer, spec, device))
    }

    /// Reads a tensor back as dense row-major bytes, awaiting the transfer without blocking the
    /// async runtime.
    ///
    /// Errors: `failed-precondition` when the buffer was donated or deleted; `internal` from the
    /// plugin.
    pub async fn read(&self, tensor: &DeviceTensor) -> DeviceResult<Vec<u8>> {
        let bytes = tensor
            .buffer()
            .to_host()
            .await
            .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::Internal))?;
        self.device_to_host
            .fetch_add(bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(bytes)
    }

    /// Bytes copied so far from the host to the device (every [`Self::tensor_from_bytes`]:
    /// uploads, inline arguments, weight files) and from the device to the host (every
    /// [`Self::read`]: reads, fetched results, served outputs), in that order. These two
    /// functions are the only places the service moves tensor bytes between host and device.
    pub fn transferred_bytes(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.host_to_device.load(Relaxed),
            self.device_to_host.load(Relaxed),
        )
    }

    /// Copies a tensor to device `device`.
    ///
    /// Errors: `not-found` for an unknown device; `internal` from the plugin.
    pub fn copy_to_device(&self, tensor: &DeviceTensor, device: u32) -> DeviceResult<DeviceTensor> {
        let dev = self.device(device)?;
        let buffer = tensor
            .buffer()
            .copy_to_device(dev)
            .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::Internal))?;
        Ok(DeviceTensor::new(buffer, tensor.spec().clone(), device))
    }

    /// Compiles an MLIR program (text or bytecode; entry function `main`) for device `device`.
    ///
    /// Runs the compiler on a blocking thread so async callers keep making progress. With a
    /// compile cache ([`with_cache`](Self::with_cache)), equal requests are answered from it.
    ///
    /// Errors: `invalid-argument` for an empty program, one over the size limit, or MLIR text
    /// that is not UTF-8; `not-found` for an unknown device; `compile-failed` with the
    /// compiler's message; `unsupported` when the plugin cannot describe the parameters;
    /// `resource-exhausted` naming a compile limit (as [`compile_as`](Self::compile_as)).
    pub async fn compile(
        self: &Arc<Self>,
        code: Vec<u8>,
        text: bool,
        device: u32,
    ) -> DeviceResult<Arc<DeviceExecutable>> {
        self.compile_as(code, text, device, "").await.map(|o| o.exe)
    }

    /// [`compile`](Self::compile) on behalf of tenant `tenant` (its name; `""` for the host's
    /// own callers), reporting the cache tier that served it: a cache miss takes one of the
    /// tenant's compile slots, then one of the host's
    /// ([`CompileIsolation::max_workers_per_tenant`], [`CompileIsolation::max_workers`]),
    /// waiting at most `max_compile_time` for them. No compile-rate limit is charged (see
    /// [`compile_for`](Self::compile_for)).
    ///
    /// Errors: as [`compile`](Self::compile); `resource-exhausted` naming
    /// `max-compile-workers-per-tenant` or `max-compile-workers` when no slot came in time,
    /// `max-compile-seconds` or `max-compile-resident` when a worker passed those limits.
    pub async fn compile_as(
        self: &Arc<Self>,
        code: Vec<u8>,
        text: bool,
        device: u32,
        tenant: &str,
    ) -> DeviceResult<CompileOutcome> {
        let settings = CompileSettings {
            device,
            ..CompileSettings::default()
        };
        self.compile_inner(code, text, settings, tenant, None).await
    }

    /// [`compile_as`](Self::compile_as) with [`CompileSettings`] (device and optimisation
    /// level).
    ///
    /// Errors: as [`compile_as`](Self::compile_as).
    pub async fn compile_with(
        self: &Arc<Self>,
        code: Vec<u8>,
        text: bool,
        settings: CompileSettings,
        tenant: &str,
    ) -> DeviceResult<CompileOutcome> {
        self.compile_inner(code, text, settings, tenant, None).await
    }

    /// [`compile_with`](Self::compile_with) on behalf of `tenant`, charging its compile rate
    /// ([`Tenant::admit_compile_rate`]) unless the compile cache's tier 1 serves the request:
    /// the charge is taken when tier 1 misses, before tiers 2 and 3 are read or a compile
    /// starts (also when there is no cache, or the cache is off). The program-size limit is the
    /// caller's to check first ([`Tenant::admit_program_size`]).
    ///
    /// Errors: as [`compile_as`](Self::compile_as); `resource-exhausted` naming
    /// `max-compiles-per-minute`.
    pub async fn compile_for(
        self: &Arc<Self>,
        code: Vec<u8>,
        text: bool,
        settings: CompileSettings,
        tenant: &Tenant,
    ) -> DeviceResult<CompileOutcome> {
        let settings = CompileSettings {
            loop_budget: tenant.limits().program_policy.loop_budget(),
            ..settings
        };
        self.compile_inner(code, text, settings, tenant.name(), Some(tenant))
            .await
    }

    async fn compile_inner(
        self: &Arc<Self>,
        code: Vec<u8>,
        text: bool,
        settings: CompileSettings,
        tenant: &str,
        charge: Option<&Tenant>,
    ) -> DeviceResult<CompileOutcome> {
        let device = settings.device;
        let admit = || charge.map_or(Ok(()), |t| t.admit_compile_rate());
        if code.is_empty() {
            return Err(DeviceError::invalid("the program is empty"));
        }
        if code.len() > self.max_program_bytes {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "program is {} bytes; the limit (max-program-bytes) is {}",
                    code.len(),
                    self.max_program_bytes
                ),
            ));
        }
        if text && std::str::from_utf8(&code).is_err() {
            return Err(DeviceError::invalid("MLIR text is not valid UTF-8"));
        }
        if !text && !code.starts_with(b"ML\xefR") {
            return Err(DeviceError::invalid(
                "MLIR bytecode must start with the magic bytes 'ML\\xefR'",
            ));
        }
        let device_id = self.device(device)?.id();
        let spmd = self.spmd_ids(&settings.devices)?;
        // The ordinal is an index into the client's devices; the wrapper turns it into a
        // one-device assignment with that device's id. Several devices: one partition each.
        let options = match &spmd {
            None => CompileOptions::new().device_ordinal(i64::from(device)),
            Some(ids) => CompileOptions::spmd(ids)
                .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::InvalidArgument))?,
        }
        .optimization_level(settings.optimization_level);
        let devices = match &spmd {
            None => vec![device],
            Some(_) => settings.devices.clone(),
        };
        let mut options_bytes = options
            .to_bytes()
            .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::InvalidArgument))?;
        let budget = settings.loop_budget;
        if let Some(b) = budget {
            // The budget is compiled into the program: part of the key (nothing is added
            // without one, so keys of programs compiled without a budget stay as they were).
            options_bytes.extend_from_slice(b"\0tpubox-loop-budget\0");
            options_bytes.extend_from_slice(&b.max_loop_iterations.to_le_bytes());
            options_bytes.extend_from_slice(&b.max_loop_work.to_le_bytes());
        }
        let Some(cache) = self.cache.clone() else {
            admit()?;
            return self
                .compile_somewhere(code, options, budget, devices, tenant)
                .await
                .map(|c| CompileOutcome {
                    exe: c.exe,
                    tier: CacheTier::CompiledWithoutCache,
                });
        };
        let this = Arc::clone(self);
        let identity = tokio::task::spawn_blocking(move || this.identity().cloned())
            .await
            .map_err(|e| {
                DeviceError::new(ErrorKind::Internal, format!("hashing task failed: {e}"))
            })??;
        let key = cache_key(&identity, "mlir", &code, &options_bytes, device_id);
        let this = Arc::clone(self);
        let load_devices = devices.clone();
        let (exe, tier) = cache
            .get_or_compile(
                key,
                admit,
                move |entry| this.load_entry(entry, &load_devices),
                || self.compile_somewhere(code, options, budget, devices, tenant),
            )
            .await?;
        Ok(CompileOutcome { exe, tier })
    }

    /// The device ids of an SPMD compile over `devices` (device indices); `None` for a
    /// program of one device (none or one given).
    ///
    /// Errors: `not-found` for an unknown device; `invalid-argument` for a device given twice.
    fn spmd_ids(&self, devices: &[u32]) -> DeviceResult<Option<Vec<i64>>> {
        if devices.len() <= 1 {
            return Ok(None);
        }
        let mut seen = std::collections::BTreeSet::new();
        let mut ids = Vec::with_capacity(devices.len());
        for &d in devices {
            if !seen.insert(d) {
                return Err(DeviceError::invalid(format!(
                    "device {d} is given twice for one program"
                )));
            }
            ids.push(i64::from(self.device(d)?.id()));
        }
        Ok(Some(ids))
    }

    /// The executable's devices as indices, in its addressable devices' order (the order of
    /// its argument lists), checked against the `devices` it was compiled for.
    fn placed(&self, exe: DeviceExecutable, devices: &[u32]) -> DeviceResult<DeviceExecutable> {
        if devices.len() <= 1 {
            return Ok(exe);
        }
        let found = exe
            .loaded()
            .addressable_devices()
            .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::Internal))?;
        let mut order = Vec::with_capacity(found.len());
        for d in &found {
            let id = d.id();
            let index = self
                .devices
                .iter()
                .position(|x| x.id() == id)
                .ok_or_else(|| {
                    DeviceError::new(
                        ErrorKind::Internal,
                        format!("the executable runs on device id {id}, which the client lacks"),
                    )
                })?;
            order.push(index as u32);
        }
        let mut a = order.clone();
        let mut b = devices.to_vec();
        a.sort_unstable();
        b.sort_unstable();
        if a != b {
            return Err(DeviceError::new(
                ErrorKind::Internal,
                format!("compiled for devices {devices:?}, the executable runs on {order:?}"),
            ));
        }
        Ok(exe.with_devices(order))
    }

    async fn compile_on_compile_thread(
        self: &Arc<Self>,
        code: Vec<u8>,
        options: CompileOptions,
        budget: Option<LoopBudgetLimits>,
        devices: Vec<u32>,
    ) -> DeviceResult<Compiled> {
        // A thread of its own with the isolation settings' stack (1 GiB by default, reserved,
        // touched only as deep as the compiler recurses): the compiler's recursion over long
        // or deeply nested programs overflows the blocking pool's 2 MiB stacks, and a stack
        // overflow here aborts the host.
        let this = Arc::clone(self);
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("tpubox-compile".into())
            .stack_size(self.isolation.stack_bytes)
            .spawn(move || {
                let _ = tx.send(this.compile_blocking(code, options, budget, &devices));
            })
            .map_err(|e| {
                DeviceError::new(
                    ErrorKind::Internal,
                    format!("starting a compile thread: {e}"),
                )
            })?;
        rx.await
            .map_err(|_| DeviceError::new(ErrorKind::Internal, "the compile thread panicked"))?
    }

    fn compile_blocking(
        &self,
        code: Vec<u8>,
        options: CompileOptions,
        budget: Option<LoopBudgetLimits>,
        devices: &[u32],
    ) -> DeviceResult<Compiled> {
        let c = compile_program(
            &self.client,
            &self.platform.plugin_path,
            code,
            &options,
            budget,
        )?;
        // Serialize right away: on the CPU plugin, an executable containing `sort` fails
        // `PJRT_Executable_Serialize` once it has run.
        let serialized = match self.cache {
            Some(_) => c.exe.serialize().ok(),
            None => None,
        };
        let exe = DeviceExecutable::new(c.exe, c.inputs, c.outputs, devices[0], c.fingerprint);
        Ok(Compiled {
            exe: Arc::new(self.placed(exe, devices)?),
            serialized,
            compile_ms: c.compile_ms,
        })
    }

    /// Loads what a worker compiled ([`crate::compiler`]) like a cache entry.
    async fn load_from_worker(
        self: &Arc<Self>,
        entry: Entry,
        devices: Vec<u32>,
    ) -> DeviceResult<Compiled> {
        let compile_ms = entry.meta.compile_ms;
        let serialized = entry.executable.clone();
        let this = Arc::clone(self);
        let exe = tokio::task::spawn_blocking(move || this.load_entry(entry, &devices))
            .await
            .map_err(|e| {
                DeviceError::new(ErrorKind::Internal, format!("loading task failed: {e}"))
            })??;
        Ok(Compiled {
            exe,
            serialized: Some(serialized),
            compile_ms,
        })
    }

    /// Compiles where the isolation settings say, once `tenant` has a compile slot: in a
    /// worker when one is configured and this platform allows a second client, else on a
    /// compile thread of this process.
    async fn compile_somewhere(
        self: &Arc<Self>,
        code: Vec<u8>,
        options: CompileOptions,
        budget: Option<LoopBudgetLimits>,
        devices: Vec<u32>,
        tenant: &str,
    ) -> DeviceResult<Compiled> {
        let _slot = self
            .compiles
            .slot(tenant, self.isolation.max_compile_time)
            .await?;
        if !self.compiles.uses_workers() {
            return self
                .compile_on_compile_thread(code, options, budget, devices)
                .await;
        }
        let spmd = self.spmd_ids(&devices)?;
        let entry = self
            .compiles
            .in_worker(
                code,
                i64::from(devices[0]),
                spmd,
                options.optimization_level,
                budget,
            )
            .await?;
        self.load_from_worker(entry, devices).await
    }

    /// Loads a tier-2 cache entry as an executable for `devices` (one, or an SPMD program's).
    fn load_entry(&self, entry: Entry, devices: &[u32]) -> DeviceResult<Arc<DeviceExecutable>> {
        let start = Instant::now();
        let exe = self
            .client
            .deserialize_executable(&entry.executable)
            .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::Internal))?;
        tracing::debug!(
            target: "tpubox::cache",
            bytes = entry.executable.len(),
            ms = start.elapsed().as_secs_f64() * 1e3,
            "deserialized a cached executable"
        );
        let exe = DeviceExecutable::new(
            exe,
            parse_spec_list(&entry.meta.inputs)?,
            parse_spec_list(&entry.meta.outputs)?,
            devices[0],
            entry.meta.fingerprint,
        );
        Ok(Arc::new(self.placed(exe, devices)?))
    }

    /// Submits a validated [`Call`] holding the execution slot `slot` (from
    /// [`FairShare::acquire`] on [`scheduler`](Self::scheduler)) and returns its outputs at
    /// once: PJRT hands out an execution's output buffers when it is submitted, ready when its
    /// completion event fires; later executions may take them as arguments, and the plugin
    /// orders them after this one (PJRT C API, `PJRT_LoadedExecutable_Execute`). When the
    /// device is done, the slot is released (recording the device time), `on_done` runs with
    /// the status (`execution-failed` from the device), and the call (its arguments and what
    /// it holds, [`Call::hold_until_done`]) is dropped on tokio's blocking pool, not on the
    /// plugin's thread. `on_done` may run on a plugin thread, or before this returns: it must
    /// not block.
    ///
    /// The CPU plugin runs programs its cost model calls cheap inline, inside the submitting
    /// call. Its cost model counts a loop body once, so a program with a `while` loop (or a
    /// host transfer, which waits) can keep the submitting thread for as long as it runs:
    /// those are submitted from tokio's blocking pool, never from an async thread that other
    /// tenants' requests share. Programs without loops are submitted directly (a few
    /// microseconds).
    ///
    /// Errors: `execution-failed` when the plugin refuses the submission (then `on_done` is
    /// not called, and the slot and call are dropped); `internal` if the submitting task
    /// failed.
    pub async fn submit_for(
        self: &Arc<Self>,
        slot: Slot,
        call: Call,
        on_done: impl FnOnce(DeviceResult<()>) + Send + 'static,
    ) -> DeviceResult<Vec<DeviceTensor>> {
        if !Self::may_block(call.executable()) {
            return self.submit_now(slot, call, on_done);
        }
        let svc = Arc::clone(self);
        tokio::task::spawn_blocking(move || svc.submit_now(slot, call, on_done))
            .await
            .map_err(|e| DeviceError::new(ErrorKind::Internal, format!("submitting failed: {e}")))?
    }

    /// Whether submitting `exe` may keep the submitting thread for as long as the program
    /// runs (on the CPU plugin: a `while` loop or a host transfer, or facts the plugin cannot
    /// give; see [`submit_for`](Self::submit_for)). Such programs must not be submitted from
    /// an async thread.
    pub fn may_block(exe: &DeviceExecutable) -> bool {
        exe.program_facts().map_or(true, |f| {
            !f.while_loops.is_empty() || !f.host_transfers.is_empty()
        })
    }

    /// [`submit_for`](Self::submit_for) on the calling thread, for a call that does not
    /// [`may_block`](Self::may_block) (or from a thread that may block).
    ///
    /// Errors: as [`submit_for`](Self::submit_for).
    pub fn submit_now(
        &self,
        slot: Slot,
        call: Call,
        on_done: impl FnOnce(DeviceResult<()>) + Send + 'static,
    ) -> DeviceResult<Vec<DeviceTensor>> {
        let (outputs, done) = self.submit(call.executable(), &call.args())?;
        let runtime = tokio::runtime::Handle::try_current().ok();
        done.on_ready(move |status| {
            drop(slot);
            on_done(status.map_err(|e| DeviceError::from_pjrt(e, ErrorKind::ExecutionFailed)));
            // Completed inside the submit call, on a thread of the runtime: drop the arguments
            // here. On the plugin's callback thread: on the blocking pool instead.
            if tokio::runtime::Handle::try_current().is_ok() {
                drop(call);
            } else if let Some(rt) = runtime {
                drop(rt.spawn_blocking(move || drop(call)));
            } else {
                drop(call);
            }
        });
        Ok(outputs)
    }

    /// Runs a program compiled for several devices (SPMD, [`CompileSettings::devices`]) on
    /// all of them at once: `args[k]` is the argument list of the k-th of
    /// [`DeviceExecutable::devices`] (each argument that device's shard, with the per-device
    /// specs of [`DeviceExecutable::inputs`]), `donate` the argument positions donated on every
    /// device. The caller holds one execution slot of each device (`slots`, any order) and
    /// whatever must outlive the execution (`held`: charges, donated tensors). The execution
    /// runs in a task of its own that keeps the arguments, slots and `held` until every device
    /// finished, so a caller that goes away meanwhile (a session ending) frees nothing the
    /// devices still use. Returns each device's results, `[device][result]`.
    ///
    /// Errors: `invalid-argument` for a program of one device, a wrong number of argument
    /// lists or arguments, a shard whose dtype or dims differ from the per-device spec, or a
    /// donation PJRT refuses; `failed-precondition` for a shard on another device than its
    /// list's; `execution-failed` from any device (the first failure); `internal` if the
    /// execution's task failed.
    pub async fn execute_spmd(
        &self,
        exe: Arc<DeviceExecutable>,
        args: Vec<Vec<Arc<DeviceTensor>>>,
        donate: Vec<usize>,
        slots: Vec<Slot>,
        held: Vec<Box<dyn std::any::Any + Send>>,
    ) -> DeviceResult<Vec<Vec<DeviceTensor>>> {
        if !exe.is_spmd() {
            return Err(DeviceError::invalid(
                "the program runs on one device; execute it, not as a program of several",
            ));
        }
        let devices = exe.devices().to_vec();
        if args.len() != devices.len() {
            return Err(DeviceError::invalid(format!(
                "the program runs on {} devices, got {} argument lists",
                devices.len(),
                args.len()
            )));
        }
        for (k, (list, &device)) in args.iter().zip(&devices).enumerate() {
            if list.len() != exe.inputs().len() {
                return Err(DeviceError::invalid(format!(
                    "device {device}'s list has {} argument(s); the program takes {}",
                    list.len(),
                    exe.inputs().len()
                )));
            }
            for (i, (t, want)) in list.iter().zip(exe.inputs()).enumerate() {
                if t.spec() != want {
                    return Err(DeviceError::invalid(format!(
                        "argument {i} on device {device} (partition {k}) is {}, the program's shard is {}",
                        format_spec(t.spec()),
                        format_spec(want)
                    )));
                }
                if t.device() != device {
                    return Err(DeviceError::new(
                        ErrorKind::FailedPrecondition,
                        format!(
                            "argument {i} of partition {k} is on device {}, and partition {k} runs on device {device}",
                            t.device()
                        ),
                    ));
                }
            }
        }
        let task = tokio::spawn(async move {
            let run_exe = Arc::clone(&exe);
            let run_args = args.clone();
            let runs = tokio::task::spawn_blocking(move || {
                let lists: Vec<Vec<&Buffer>> = run_args
                    .iter()
                    .map(|l| l.iter().map(|t| t.buffer()).collect())
                    .collect();
                run_exe.loaded().execute_sharded(&lists, &donate)
            })
            .await
            .map_err(|e| DeviceError::new(ErrorKind::Internal, format!("submitting failed: {e}")))?
            .map_err(|e| {
                let kind = match e.code {
                    pjrt::ErrorCode::InvalidArgument => ErrorKind::InvalidArgument,
                    _ => ErrorKind::ExecutionFailed,
                };
                DeviceError::from_pjrt(e, kind)
            })?;
            let mut outputs = Vec::with_capacity(runs.len());
            let mut first_error = None;
            for (run, &device) in runs.into_iter().zip(&devices) {
                if let Err(e) = run.done.wait().await
                    && first_error.is_none()
                {
                    first_error = Some(DeviceError::from_pjrt(e, ErrorKind::ExecutionFailed));
                }
                outputs.push(
                    run.outputs
                        .into_iter()
                        .zip(exe.outputs())
                        .map(|(b, spec)| DeviceTensor::new(b, spec.clone(), device))
                        .collect::<Vec<_>>(),
                );
            }
            // Every device finished: the slots (device time), the arguments and what the
            // caller held go now.
            drop((slots, held, args));
            match first_error {
                Some(e) => Err(e),
                None => Ok(outputs),
            }
        });
        task.await.map_err(|e| {
            DeviceError::new(
                ErrorKind::Internal,
                format!("the execution's task failed: {e}"),
            )
        })?
    }

    /// Executes `exe` with borrowed arguments, donating those marked, and awaits completion.
    ///
    /// Validation before PJRT: argument count and each argument's dtype, dims and device against
    /// `exe`; a tensor passed twice may not be donated at either position.
    ///
    /// Errors: `invalid-argument` for count, dtype or dims mismatches and double donation;
    /// `failed-precondition` for a tensor on another device; `execution-failed` from the device.
    pub async fn execute(
        &self,
        exe: &DeviceExecutable,
        args: &[Arg<'_>],
    ) -> DeviceResult<Vec<DeviceTensor>> {
        validate_args(exe, args)?;
        self.execute_validated(exe, args).await
    }

    /// [`execute`](Self::execute) for arguments [`validate_args`] already accepted.
    async fn execute_validated(
        &self,
        exe: &DeviceExecutable,
        args: &[Arg<'_>],
    ) -> DeviceResult<Vec<DeviceTensor>> {
        let (outputs, done) = self.submit(exe, args)?;
        done.wait()
            .await
            .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::ExecutionFailed))?;
        Ok(outputs)
    }

    /// Submits an execution of validated arguments; returns its outputs (ready once `Event`
    /// is) and the completion event.
    fn submit(
        &self,
        exe: &DeviceExecutable,
        args: &[Arg<'_>],
    ) -> DeviceResult<(Vec<DeviceTensor>, pjrt::Event)> {
        let buffers: Vec<&Buffer> = args.iter().map(|a| a.tensor.buffer()).collect();
        let donate: Vec<usize> = args
            .iter()
            .enumerate()
            .filter(|(_, a)| a.donate)
            .map(|(i, _)| i)
            .collect();
        let run = exe
            .loaded()
            .execute(&buffers, &donate)
            .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::ExecutionFailed))?;
        let outputs = run
            .outputs
            .into_iter()
            .zip(exe.outputs())
            .map(|(buffer, spec)| DeviceTensor::new(buffer, spec.clone(), exe.device()))
            .collect();
        Ok((outputs, run.done))
    }
}
