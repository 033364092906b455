//! Value types shared by the device service, the compile cache and the session layer: device
//! tensors, executables, the facts a plugin reports, and the shape checks every front door
//! applies before a value reaches PJRT.
//!
//! This is a leaf module (it imports only [`crate::error`] and the PJRT wrapper), so the
//! dependency order inside the host is `types ← cache ← device ← session ← wit`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use pjrt::{Buffer, LoadedExecutable, PrimitiveType};

use crate::error::{DeviceError, DeviceResult, ErrorKind};

pub use pjrt::TensorSpec;

/// Largest rank a tensor may have. XLA itself has no small limit; this bounds host work and
/// rejects nonsense early.
pub const MAX_RANK: usize = 16;

/// A dense tensor resident on one device.
///
/// Shared through `Arc`: a session's handle, the shared-weights registry and in-flight
/// executions may all hold one. The device memory is freed when the last holder drops it.
#[derive(Debug)]
pub struct DeviceTensor {
    buffer: Buffer,
    spec: TensorSpec,
    device: u32,
    /// Set once the tensor is part of a published weight version: read-only from then on.
    published: AtomicBool,
}

/// Dense bytes of every [`DeviceTensor`] alive in the process now, and the most at once.
static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);
static PEAK_LIVE_BYTES: AtomicU64 = AtomicU64::new(0);

/// Dense bytes of all device tensors the process holds now (every PJRT buffer tpubox owns:
/// sessions' tensors, weight sets and published versions, outputs in flight), and the most
/// held at once since the process started, in bytes. Counted when a [`DeviceTensor`] is made
/// and dropped, so a buffer shared by several holders counts once.
pub fn live_device_bytes() -> (u64, u64) {
    (
        LIVE_BYTES.load(Ordering::Relaxed),
        PEAK_LIVE_BYTES.load(Ordering::Relaxed),
    )
}

impl Drop for DeviceTensor {
    fn drop(&mut self) {
        LIVE_BYTES.fetch_sub(self.byte_size(), Ordering::Relaxed);
    }
}

impl DeviceTensor {
    /// Wraps a PJRT buffer whose element type and dims are `spec`, on device index `device`.
    pub(crate) fn new(buffer: Buffer, spec: TensorSpec, device: u32) -> Self {
        let bytes = spec_byte_size(&spec);
        let now = LIVE_BYTES.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK_LIVE_BYTES.fetch_max(now, Ordering::Relaxed);
        DeviceTensor {
            buffer,
            spec,
            device,
            published: AtomicBool::new(false),
        }
    }

    /// Whether the tensor is part of a published weight version
    /// ([`crate::weights::WeightRegistry::publish`]): nobody may donate it any more.
    pub fn is_published(&self) -> bool {
        self.published.load(Ordering::Acquire)
    }

    /// Marks the tensor published (final).
    pub(crate) fn mark_published(&self) {
        self.published.store(true, Ordering::Release);
    }

    /// Element type and dims.
    pub fn spec(&self) -> &TensorSpec {
        &self.spec
    }

    /// Index of the device holding the tensor (into
    /// [`DeviceService::devices`](crate::DeviceService::devices)).
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Dense host size in bytes: element size × product of dims.
    pub fn byte_size(&self) -> u64 {
        spec_byte_size(&self.spec)
    }

    /// The PJRT buffer.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }
}

/// A compiled program plus the specs the host validates arguments against.
#[derive(Debug)]
pub struct DeviceExecutable {
    exe: LoadedExecutable,
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    device: u32,
    /// The devices of a program compiled for several (SPMD: its device assignment, as device
    /// indices, partition order); `[device]` otherwise.
    devices: Vec<u32>,
    fingerprint: String,
    memory: std::sync::OnceLock<Option<pjrt::CompiledMemoryStats>>,
    facts: std::sync::OnceLock<Result<pjrt::ProgramFacts, DeviceError>>,
    shardings: std::sync::OnceLock<Result<Shardings, DeviceError>>,
}

/// How a program compiled for several devices lays its parameters and results over them, as
/// the compiled program says (XLA's `spmd_parameters_shardings` and `spmd_output_sharding`,
/// [`pjrt::LoadedExecutable::parameter_shardings`]), with the global shapes.
#[derive(Debug, Clone)]
pub struct Shardings {
    /// Each parameter's sharding, in order.
    pub params: Vec<pjrt::HloSharding>,
    /// Each result's sharding, in order (tuple results flattened).
    pub outputs: Vec<pjrt::HloSharding>,
    /// Each parameter's global spec: its per-device spec times the tiles of its sharding.
    pub global_inputs: Vec<TensorSpec>,
    /// Each result's global spec.
    pub global_outputs: Vec<TensorSpec>,
}

fn global_spec(local: &TensorSpec, sharding: &pjrt::HloSharding) -> DeviceResult<TensorSpec> {
    let tiles = sharding
        .tiles_per_dim(local.dims.len())
        .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::Unsupported))?;
    let dims = local
        .dims
        .iter()
        .zip(&tiles)
        .map(|(&d, &t)| d.checked_mul(t.max(1)))
        .collect::<Option<Vec<i64>>>()
        .ok_or_else(|| DeviceError::invalid("a global dimension overflows"))?;
    Ok(TensorSpec { ty: local.ty, dims })
}

impl DeviceExecutable {
    /// Wraps a loaded executable with its parameter and (flattened) result specs.
    pub(crate) fn new(
        exe: LoadedExecutable,
        inputs: Vec<TensorSpec>,
        outputs: Vec<TensorSpec>,
        device: u32,
        fingerprint: String,
    ) -> Self {
        DeviceExecutable {
            exe,
            inputs,
            outputs,
            device,
            devices: vec![device],
            fingerprint,
            memory: std::sync::OnceLock::new(),
            facts: std::sync::OnceLock::new(),
            shardings: std::sync::OnceLock::new(),
        }
    }

    /// Marks it compiled for `devices` (several: an SPMD program; their order is the device
    /// assignment's, partition 0 first). The first is [`device`](Self::device).
    pub(crate) fn with_devices(mut self, devices: Vec<u32>) -> Self {
        if let Some(&first) = devices.first() {
            self.device = first;
            self.devices = devices;
        }
        self
    }

    /// The devices it runs on at once, in the order of its device assignment; one for a
    /// program of one device.
    pub fn devices(&self) -> &[u32] {
        &self.devices
    }

    /// Whether it runs on several devices at once (an SPMD program).
    pub fn is_spmd(&self) -> bool {
        self.devices.len() > 1
    }

    /// Its parameters' and results' shardings and global specs (for a program of one device:
    /// every one replicated, global = per-device). Decoded once, then kept.
    ///
    /// Errors: `unsupported` when the plugin cannot return the optimized program, or a
    /// sharding has no global-array view.
    pub fn shardings(&self) -> DeviceResult<&Shardings> {
        self.shardings
            .get_or_init(|| {
                let unsupported = |e: pjrt::Error| DeviceError::from_pjrt(e, ErrorKind::Unsupported);
                let (params, outputs) = if self.is_spmd() {
                    (
                        self.exe.parameter_shardings().map_err(unsupported)?,
                        self.exe.output_shardings().map_err(unsupported)?,
                    )
                } else {
                    (
                        vec![pjrt::HloSharding::Replicated; self.inputs.len()],
                        vec![pjrt::HloSharding::Replicated; self.outputs.len()],
                    )
                };
                if params.len() != self.inputs.len() || outputs.len() != self.outputs.len() {
                    return Err(DeviceError::new(
                        ErrorKind::Unsupported,
                        format!(
                            "the program records {} parameter and {} result sharding(s) for {} parameter(s) and {} result(s)",
                            params.len(),
                            outputs.len(),
                            self.inputs.len(),
                            self.outputs.len()
                        ),
                    ));
                }
                let global_inputs = self
                    .inputs
                    .iter()
                    .zip(&params)
                    .map(|(l, s)| global_spec(l, s))
                    .collect::<DeviceResult<Vec<_>>>()?;
                let global_outputs = self
                    .outputs
                    .iter()
                    .zip(&outputs)
                    .map(|(l, s)| global_spec(l, s))
                    .collect::<DeviceResult<Vec<_>>>()?;
                Ok(Shardings {
                    params,
                    outputs,
                    global_inputs,
                    global_outputs,
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// What the program needs in device memory while it runs, as the plugin reports it
    /// (`PJRT_Executable_GetCompiledMemoryStats`); `None` when the plugin does not. Asked
    /// once, then kept.
    pub fn memory_stats(&self) -> Option<pjrt::CompiledMemoryStats> {
        *self
            .memory
            .get_or_init(|| self.exe.compiled_memory_stats().ok())
    }

    /// Device bytes of temporaries one execution uses, from [`memory_stats`](Self::memory_stats).
    ///
    /// Where the plugin reports no statistics, the conservative rule is the size of the
    /// results again: a program's working set is at least comparable to what it returns, and
    /// counting it keeps a tenant that returns big tensors from also running big temporaries
    /// unaccounted.
    pub fn temp_bytes(&self) -> u64 {
        match self.memory_stats() {
            Some(m) => m.temp_bytes,
            None => self
                .output_bytes()
                .iter()
                .fold(0u64, |a, &b| a.saturating_add(b)),
        }
    }

    /// Loops, host transfers and custom calls of the optimized program (for the tenants'
    /// program policy). Decoded once, then kept.
    ///
    /// Errors: `unsupported` when the plugin cannot return the optimized program or it does
    /// not decode.
    pub fn program_facts(&self) -> DeviceResult<&pjrt::ProgramFacts> {
        self.facts
            .get_or_init(|| {
                self.exe
                    .program_facts()
                    .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::Unsupported))
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Parameter specs, in order.
    pub fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    /// Result specs, in order (tuple results flattened).
    pub fn outputs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    /// Dense byte size of each result, in order (`u64::MAX` for a size that overflows).
    pub fn output_bytes(&self) -> Vec<u64> {
        self.outputs.iter().map(spec_byte_size).collect()
    }

    /// Index of the device the executable runs on.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Hex fingerprint: the plugin's own when it has one, else SHA-256 of the program, its format
    /// and the serialized compile options.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The PJRT executable.
    pub fn loaded(&self) -> &LoadedExecutable {
        &self.exe
    }
}

/// What a compile produces for the cache: the executable, its serialized form (for tier 2),
/// and how long compiling took.
pub struct Compiled {
    /// The loaded executable.
    pub exe: std::sync::Arc<DeviceExecutable>,
    /// `PJRT_Executable_Serialize` output taken right after compiling; `None` when the plugin
    /// cannot serialize this executable (it is then cached in tier 1 only).
    pub serialized: Option<Vec<u8>>,
    /// Wall time of the compile, in milliseconds.
    pub compile_ms: f64,
}

/// Facts about the platform behind the service.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PlatformInfo {
    /// Platform name, e.g. `"cpu"`.
    pub name: String,
    /// Platform version string reported by the plugin.
    pub version: String,
    /// PJRT C API version of the plugin, (major, minor).
    pub pjrt_api_version: (u32, u32),
    /// Path of the plugin shared library.
    pub plugin_path: String,
}

/// Facts about one addressable device.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceInfo {
    /// Dense 0-based index used by tpubox calls.
    pub index: u32,
    /// PJRT device id.
    pub id: i32,
    /// Device kind, e.g. `"cpu"`.
    pub kind: String,
    /// The plugin's debug string.
    pub description: String,
}

/// Dense byte size of a `ty` tensor with `dims`, or `None` on overflow or a negative dim.
pub fn checked_byte_size(ty: PrimitiveType, dims: &[i64]) -> Option<usize> {
    dims.iter().try_fold(ty.byte_size(), |acc, &d| {
        usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
    })
}

/// Dense byte size of `spec`, saturating at `u64::MAX` when it overflows.
pub fn spec_byte_size(spec: &TensorSpec) -> u64 {
    checked_byte_size(spec.ty, &spec.dims).map_or(u64::MAX, |b| b as u64)
}

/// Formats a spec the way XLA prints shapes, e.g. `f32[2,3]`.
pub fn format_spec(spec: &TensorSpec) -> String {
    let dims: Vec<String> = spec.dims.iter().map(|d| d.to_string()).collect();
    format!("{}[{}]", spec.ty.name().to_lowercase(), dims.join(","))
}

/// Checks dims given as unsigned integers (as the WIT and npy files give them) and converts
/// them to PJRT's `i64`.
///
/// Errors: `invalid-argument` when the rank exceeds [`MAX_RANK`] or a dim exceeds `i64::MAX`.
pub fn dims_from_u64(dims: &[u64]) -> DeviceResult<Vec<i64>> {
    check_rank(dims.len())?;
    dims.iter()
        .map(|&d| {
            i64::try_from(d)
                .map_err(|_| DeviceError::invalid(format!("dimension {d} exceeds i64::MAX")))
        })
        .collect()
}

fn check_rank(rank: usize) -> DeviceResult<()> {
    if rank > MAX_RANK {
        return Err(DeviceError::invalid(format!(
            "rank {rank} exceeds the limit of {MAX_RANK}"
        )));
    }
    Ok(())
}

/// Checks that `len` bytes make a dense `ty` tensor of shape `dims` and returns `len`.
///
/// Errors: `invalid-argument` when the rank exceeds [`MAX_RANK`], a dim is negative, the size
/// overflows, or `len` differs from element size × product of `dims`.
pub fn check_tensor_bytes(ty: PrimitiveType, dims: &[i64], len: usize) -> DeviceResult<usize> {
    check_rank(dims.len())?;
    if let Some(d) = dims.iter().find(|&&d| d < 0) {
        return Err(DeviceError::invalid(format!(
            "dimension {d} is negative in dims {dims:?}"
        )));
    }
    let expected = checked_byte_size(ty, dims).ok_or_else(|| {
        DeviceError::invalid(format!(
            "{} with dims {dims:?} has more bytes than this host can address",
            ty.name()
        ))
    })?;
    if len != expected {
        return Err(DeviceError::invalid(format!(
            "{} with dims {dims:?} needs {expected} bytes ({} per element), got {len}",
            ty.name(),
            ty.byte_size(),
        )));
    }
    Ok(len)
}

/// One argument of an execution: a tensor and whether the caller donates it.
pub struct Arg<'a> {
    /// The tensor passed at this position.
    pub tensor: &'a DeviceTensor,
    /// Whether its device memory may be handed to the program (it is unusable afterwards).
    pub donate: bool,
}

/// Checks `args` against `exe`'s parameters: count, each argument's dtype, dims and device,
/// and that a tensor passed at two positions is donated at neither.
///
/// Errors: `invalid-argument` for count, dtype or dims mismatches and double donation;
/// `failed-precondition` for a tensor on another device than the executable's.
pub fn validate_args(exe: &DeviceExecutable, args: &[Arg<'_>]) -> DeviceResult<()> {
    let views: Vec<ArgSpec<'_>> = args
        .iter()
        .map(|a| ArgSpec {
            spec: &a.tensor.spec,
            device: a.tensor.device,
            identity: std::ptr::from_ref(a.tensor).cast(),
            donate: a.donate,
        })
        .collect();
    validate_arg_specs(exe, &views)
}

/// What [`validate_arg_specs`] knows of one argument: enough to check it before its tensor
/// exists (an output of a launch not yet submitted).
#[derive(Debug, Clone, Copy)]
pub struct ArgSpec<'a> {
    /// Element type and dims.
    pub spec: &'a TensorSpec,
    /// Index of the device holding it.
    pub device: u32,
    /// Equal for two positions that pass the same tensor (its address; never dereferenced).
    pub identity: *const (),
    /// Whether it is donated.
    pub donate: bool,
}

/// [`validate_args`] on argument specs: count, each argument's dtype, dims and device against
/// `exe`'s parameters, and that an argument passed at two positions (equal
/// [`ArgSpec::identity`]) is donated at neither.
///
/// Errors: as [`validate_args`].
pub fn validate_arg_specs(exe: &DeviceExecutable, args: &[ArgSpec<'_>]) -> DeviceResult<()> {
    if args.len() != exe.inputs.len() {
        return Err(DeviceError::invalid(format!(
            "the executable takes {} argument(s), got {}",
            exe.inputs.len(),
            args.len()
        )));
    }
    for (i, (arg, want)) in args.iter().zip(&exe.inputs).enumerate() {
        if arg.spec != want {
            return Err(DeviceError::invalid(format!(
                "argument {i} is {} but the executable expects {}",
                format_spec(arg.spec),
                format_spec(want)
            )));
        }
        if arg.device != exe.device {
            return Err(DeviceError::new(
                ErrorKind::FailedPrecondition,
                format!(
                    "argument {i} is on device {} but the executable runs on device {}; copy it first",
                    arg.device, exe.device
                ),
            ));
        }
    }
    for (i, a) in args.iter().enumerate() {
        for (j, b) in args.iter().enumerate().skip(i + 1) {
            if a.identity == b.identity && (a.donate || b.donate) {
                return Err(DeviceError::invalid(format!(
                    "the same tensor is passed as arguments {i} and {j} and donated; a donated tensor may appear once"
                )));
            }
        }
    }
    Ok(())
}

/// An execution whose arguments [`validate_args`] accepted: the only way to build one is
/// [`Call::new`], so arguments are validated once, before any tenant is charged, and never
/// again on the way to the device.
pub struct Call {
    exe: std::sync::Arc<DeviceExecutable>,
    args: Vec<(std::sync::Arc<DeviceTensor>, bool)>,
    /// Values released only when the device is done with this call (a tenant's charge for
    /// the program's temporaries).
    held: Vec<Box<dyn std::any::Any + Send>>,
}

impl std::fmt::Debug for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Call")
            .field("exe", &self.exe.fingerprint())
            .field("args", &self.args.len())
            .field("held", &self.held.len())
            .finish()
    }
}

impl Call {
    /// Validates `args` (each tensor paired with whether it is donated) against `exe`.
    ///
    /// Errors: as [`validate_args`].
    pub fn new(
        exe: std::sync::Arc<DeviceExecutable>,
        args: Vec<(std::sync::Arc<DeviceTensor>, bool)>,
    ) -> DeviceResult<Self> {
        validate_args(&exe, &borrowed(&args))?;
        Ok(Call {
            exe,
            args,
            held: Vec::new(),
        })
    }

    /// Keeps `value` alive until the device has finished this call, however the caller ends.
    pub fn hold_until_done(&mut self, value: impl Send + 'static) {
        self.held.push(Box::new(value));
    }

    /// The executable to run.
    pub fn executable(&self) -> &DeviceExecutable {
        &self.exe
    }

    /// The arguments as [`Arg`]s.
    pub fn args(&self) -> Vec<Arg<'_>> {
        borrowed(&self.args)
    }
}

fn borrowed(args: &[(std::sync::Arc<DeviceTensor>, bool)]) -> Vec<Arg<'_>> {
    args.iter()
        .map(|(t, donate)| Arg {
            tensor: t,
            donate: *donate,
        })
        .collect()
}

/// Specs as stored in cache entries: (XLA type name, dims).
pub fn spec_list(specs: &[TensorSpec]) -> Vec<(String, Vec<i64>)> {
    specs
        .iter()
        .map(|s| (s.ty.name().to_string(), s.dims.clone()))
        .collect()
}

/// Parses specs stored by [`spec_list`].
///
/// Errors: `internal` for an unknown type name (an entry from a newer tpubox).
pub fn parse_spec_list(specs: &[(String, Vec<i64>)]) -> DeviceResult<Vec<TensorSpec>> {
    specs
        .iter()
        .map(|(ty, dims)| {
            let ty = PrimitiveType::from_name(ty).ok_or_else(|| {
                DeviceError::new(
                    ErrorKind::Internal,
                    format!("cache entry names unknown type {ty}"),
                )
            })?;
            Ok(TensorSpec {
                ty,
                dims: dims.clone(),
            })
        })
        .collect()
}
