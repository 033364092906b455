//! [`LoadedExecutable`]: a compiled program loaded on devices (`PJRT_LoadedExecutable` and its
//! `PJRT_Executable`), and [`Execution`].

use std::ptr;
use std::sync::OnceLock;

use pjrt_sys as sys;
use sys::Args;

use crate::api::{api_fn, slice_from, string_from};
use crate::buffer::Buffer;
use crate::client::Client;
use crate::device::Device;
use crate::error::{Error, ErrorCode, Result};
use crate::event::Event;
use crate::hlo;
use crate::sharding::HloSharding;
use crate::types::{PrimitiveType, TensorSpec};

/// A compiled, loaded program. Destroyed when dropped; keeps its [`Client`] alive.
pub struct LoadedExecutable {
    client: Client,
    raw: *mut sys::PJRT_LoadedExecutable,
    /// From `PJRT_LoadedExecutable_GetExecutable`; owned, destroyed in `Drop`.
    exe: *mut sys::PJRT_Executable,
    params: OnceLock<Result<Vec<TensorSpec>>>,
    shardings: OnceLock<Result<hlo::EntryShardings>>,
    num_outputs: OnceLock<Result<usize>>,
    devices: OnceLock<Result<Vec<Device>>>,
}

// SAFETY: a PJRT_LoadedExecutable (xla::PjRtLoadedExecutable) supports concurrent Execute and
// queries (JAX dispatches from many threads); this type only issues C API calls through `&self`
// (the caches are `OnceLock`s) and destroys both handles exactly once, in `Drop`.
unsafe impl Send for LoadedExecutable {}
// SAFETY: as above.
unsafe impl Sync for LoadedExecutable {}

/// Memory an executable needs while it runs, in bytes (`xla::CompiledMemoryStats`). "Device"
/// fields are the default memory space (HBM on GPU and TPU; host RAM for the CPU plugin); the
/// `host_*` fields are host memory used alongside it. Negative values from a plugin read as 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompiledMemoryStats {
    /// Size of the generated code.
    pub generated_code_bytes: u64,
    /// Size of the arguments.
    pub argument_bytes: u64,
    /// Size of the outputs.
    pub output_bytes: u64,
    /// Argument bytes reused for outputs (donation / aliasing).
    pub alias_bytes: u64,
    /// Temporary buffers the program allocates while running.
    pub temp_bytes: u64,
    /// Host-memory counterpart of `generated_code_bytes`.
    pub host_generated_code_bytes: u64,
    /// Host-memory counterpart of `argument_bytes`.
    pub host_argument_bytes: u64,
    /// Host-memory counterpart of `output_bytes`.
    pub host_output_bytes: u64,
    /// Host-memory counterpart of `alias_bytes`.
    pub host_alias_bytes: u64,
    /// Host-memory counterpart of `temp_bytes`.
    pub host_temp_bytes: u64,
    /// Peak device memory, when the plugin reports it (0 otherwise).
    pub peak_bytes: u64,
}

/// Result of [`LoadedExecutable::execute`], and one device's part of the result of
/// [`LoadedExecutable::execute_sharded`].
#[derive(Debug)]
pub struct Execution {
    /// One buffer per program result, in order (on a device of a multi-device execution:
    /// that device's shard of each result). They become ready asynchronously.
    pub outputs: Vec<Buffer>,
    /// Ready when the device finished this execution (with its error status, if it failed).
    pub done: Event,
}

impl LoadedExecutable {
    /// Takes ownership of `raw` (non-null from Compile/DeserializeAndLoad) and fetches its
    /// `PJRT_Executable`.
    pub(crate) fn from_raw(client: Client, raw: *mut sys::PJRT_LoadedExecutable) -> Result<Self> {
        if raw.is_null() {
            return Err(Error::internal("plugin returned no executable"));
        }
        let mut this = LoadedExecutable {
            client,
            raw,
            exe: ptr::null_mut(),
            params: OnceLock::new(),
            shardings: OnceLock::new(),
            num_outputs: OnceLock::new(),
            devices: OnceLock::new(),
        };
        // On error `this` is dropped, which destroys `raw`.
        let api = this.client.plugin().api();
        let f = api_fn!(api, PJRT_LoadedExecutable_GetExecutable)?;
        let mut args = sys::PJRT_LoadedExecutable_GetExecutable_Args::new();
        args.loaded_executable = raw;
        // SAFETY: `raw` is a live loaded executable we own; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        if args.executable.is_null() {
            return Err(Error::internal(
                "PJRT_LoadedExecutable_GetExecutable returned null",
            ));
        }
        this.exe = args.executable;
        Ok(this)
    }

    /// The client this executable is loaded on.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Executable name (`PJRT_Executable_Name`), usually the module name (e.g. `"main"` or
    /// `"jit_f"`).
    pub fn name(&self) -> Result<String> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Executable_Name)?;
        let mut args = sys::PJRT_Executable_Name_Args::new();
        args.executable = self.exe;
        // SAFETY: live executable; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: the name has the lifetime of the executable.
        Ok(unsafe { string_from(args.executable_name, args.executable_name_size) })
    }

    /// Number of outputs per device (`PJRT_Executable_NumOutputs`); cached.
    pub fn num_outputs(&self) -> Result<usize> {
        self.num_outputs
            .get_or_init(|| {
                let api = self.client.plugin().api();
                let f = api_fn!(api, PJRT_Executable_NumOutputs)?;
                let mut args = sys::PJRT_Executable_NumOutputs_Args::new();
                args.executable = self.exe;
                // SAFETY: live executable; header-sized args.
                api.check(unsafe { f(&mut args) })?;
                Ok(args.num_outputs)
            })
            .clone()
    }

    /// Element type and dimensions of each output (`PJRT_Executable_OutputElementTypes` +
    /// `PJRT_Executable_OutputDimensions`).
    ///
    /// Errors: `Unimplemented` for an output type outside [`PrimitiveType`] or a plugin without
    /// these functions; `Internal` if the two lists disagree in length.
    pub fn output_specs(&self) -> Result<Vec<TensorSpec>> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Executable_OutputElementTypes)?;
        let mut args = sys::PJRT_Executable_OutputElementTypes_Args::new();
        args.executable = self.exe;
        // SAFETY: live executable; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: the array is owned by the executable, alive during this call.
        let types = unsafe { slice_from(args.output_types, args.num_output_types) }.to_vec();

        let f = api_fn!(api, PJRT_Executable_OutputDimensions)?;
        let mut d = sys::PJRT_Executable_OutputDimensions_Args::new();
        d.executable = self.exe;
        // SAFETY: live executable; header-sized args.
        api.check(unsafe { f(&mut d) })?;
        // SAFETY: `dim_sizes` has length `num_outputs`, owned by the executable.
        let sizes = unsafe { slice_from(d.dim_sizes, d.num_outputs) }.to_vec();
        if sizes.len() != types.len() {
            return Err(Error::internal(format!(
                "plugin reports {} output types but {} output shapes",
                types.len(),
                sizes.len()
            )));
        }
        let total = sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        let total = total.ok_or_else(|| Error::internal("output dimension count overflows"))?;
        // SAFETY: `dims` has length sum(dim_sizes) (header), owned by the executable.
        let dims = unsafe { slice_from(d.dims, total) };
        let mut out = Vec::with_capacity(types.len());
        let mut at = 0;
        for (i, (&t, &n)) in types.iter().zip(&sizes).enumerate() {
            let ty = PrimitiveType::from_pjrt(t).ok_or_else(|| {
                Error::unimplemented(format!("output {i} has unsupported PJRT_Buffer_Type {t}"))
            })?;
            out.push(TensorSpec {
                ty,
                dims: dims[at..at + n].to_vec(),
            });
            at += n;
        }
        Ok(out)
    }

    /// Optimized program (`PJRT_Executable_OptimizedProgram`): `(format, code)`, where format
    /// is `"hlo"` (serialized `HloModuleProto`) or `"hlo_with_config"`
    /// (`HloModuleProtoWithConfig`, returned by API 0.115 plugins).
    pub fn optimized_program(&self) -> Result<(String, Vec<u8>)> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Executable_OptimizedProgram)?;
        let mut prog = sys::PJRT_Program::new();
        let mut args = sys::PJRT_Executable_OptimizedProgram_Args::new();
        args.executable = self.exe;
        args.program = &mut prog;
        // SAFETY: first call with null `code`: the plugin only sets `code_size` and `format`.
        api.check(unsafe { f(&mut args) })?;
        let mut code = vec![0u8; prog.code_size];
        prog.code = code.as_mut_ptr().cast();
        args.program = &mut prog;
        // SAFETY: second call: `code` points to `code_size` writable bytes owned by us.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: `format` is owned by the implementation (header) and alive here.
        let format = unsafe { string_from(prog.format, prog.format_size) };
        code.truncate(prog.code_size);
        Ok((format, code))
    }

    /// Element type and dimensions of each parameter, from the optimized program's
    /// `HloModuleProto.host_program_shape.parameters` (see
    /// [`LoadedExecutable::optimized_program`]); cached.
    ///
    /// Errors: `Unimplemented` if a parameter is a tuple or has a type outside
    /// [`PrimitiveType`], or the plugin cannot return the optimized program; `Internal` if it
    /// does not decode.
    pub fn parameter_specs(&self) -> Result<Vec<TensorSpec>> {
        self.params
            .get_or_init(|| {
                let (format, code) = self.optimized_program()?;
                hlo::parameter_specs(&format, &code)
            })
            .clone()
    }

    /// How each parameter is laid out on the executable's devices: for a program partitioned
    /// over several devices, what its module's shardings (`mhlo.sharding`, `sdy.sharding`)
    /// became after XLA's propagation; [`HloSharding::Replicated`] for a one-device program
    /// and wherever the program records none. The devices a sharding names are partitions:
    /// device `k` of [`addressable_devices`](Self::addressable_devices) runs replica
    /// `k / num_partitions`, partition `k % num_partitions` (replica-major; with one replica,
    /// partition `k`). Each device's argument is its [`HloSharding::shards`] part of the global
    /// array, of the per-device dims of [`parameter_specs`](Self::parameter_specs). Read from
    /// the optimized program (see [`crate::HloSharding`] and the `hlo` module's notes); cached.
    ///
    /// Errors: as [`parameter_specs`](Self::parameter_specs); `Internal` for a sharding that
    /// does not decode.
    pub fn parameter_shardings(&self) -> Result<Vec<HloSharding>> {
        Ok(self.entry_shardings()?.parameters.clone())
    }

    /// How each output is laid out on the executable's devices (as
    /// [`parameter_shardings`](Self::parameter_shardings)); each device's output buffer is its
    /// [`HloSharding::shards`] part of the global result, of the per-device dims of
    /// [`output_specs`](Self::output_specs). Cached.
    ///
    /// Errors: as [`parameter_shardings`](Self::parameter_shardings).
    pub fn output_shardings(&self) -> Result<Vec<HloSharding>> {
        Ok(self.entry_shardings()?.outputs.clone())
    }

    /// Per-device element type and dims of each output, from the optimized program's entry
    /// result shape (the same as [`output_specs`](Self::output_specs), which asks the plugin).
    ///
    /// Errors: as [`parameter_shardings`](Self::parameter_shardings); `Unimplemented` for an
    /// output type outside [`PrimitiveType`].
    pub fn local_output_specs(&self) -> Result<Vec<TensorSpec>> {
        Ok(self.entry_shardings()?.output_specs.clone())
    }

    fn entry_shardings(&self) -> Result<&hlo::EntryShardings> {
        let r = self.shardings.get_or_init(|| {
            let (format, code) = self.optimized_program()?;
            hlo::entry_shardings(&format, &code)
        });
        match r {
            Ok(s) => Ok(s),
            Err(e) => Err(e.clone()),
        }
    }

    /// Fingerprint of the executable (`PJRT_Executable_Fingerprint`): equal for executables
    /// compiled from identical inputs.
    ///
    /// Errors: `Unimplemented` if the plugin lacks it or returns none; the plugin's error.
    pub fn fingerprint(&self) -> Result<String> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Executable_Fingerprint)?;
        let mut args = sys::PJRT_Executable_Fingerprint_Args::new();
        args.executable = self.exe;
        // SAFETY: live executable; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        if args.executable_fingerprint.is_null() {
            return Err(Error::unimplemented(
                "plugin returned no executable fingerprint",
            ));
        }
        // SAFETY: the fingerprint has the lifetime of the executable.
        Ok(unsafe {
            string_from(
                args.executable_fingerprint,
                args.executable_fingerprint_size,
            )
        })
    }

    /// What the executable needs in memory while it runs
    /// (`PJRT_Executable_GetCompiledMemoryStats`; the fields mirror `xla::CompiledMemoryStats`,
    /// per the C API header).
    ///
    /// Errors: `Unimplemented` when the plugin lacks the call (API < 0.42) or does not implement
    /// it; the plugin's error.
    pub fn compiled_memory_stats(&self) -> Result<CompiledMemoryStats> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Executable_GetCompiledMemoryStats)?;
        let mut args = sys::PJRT_Executable_GetCompiledMemoryStats_Args::new();
        args.executable = self.exe;
        // SAFETY: live executable; header-sized args whose outputs are plain integers.
        api.check(unsafe { f(&mut args) })?;
        let b = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(CompiledMemoryStats {
            generated_code_bytes: b(args.generated_code_size_in_bytes),
            argument_bytes: b(args.argument_size_in_bytes),
            output_bytes: b(args.output_size_in_bytes),
            alias_bytes: b(args.alias_size_in_bytes),
            temp_bytes: b(args.temp_size_in_bytes),
            host_generated_code_bytes: b(args.host_generated_code_size_in_bytes),
            host_argument_bytes: b(args.host_argument_size_in_bytes),
            host_output_bytes: b(args.host_output_size_in_bytes),
            host_alias_bytes: b(args.host_alias_size_in_bytes),
            host_temp_bytes: b(args.host_temp_size_in_bytes),
            peak_bytes: b(args.peak_memory_in_bytes),
        })
    }

    /// The compiler's cost analysis of the executable (`PJRT_Executable_GetCostAnalysis`):
    /// named properties such as `"flops"` and `"bytes accessed"` (XLA's `HloCostAnalysis`,
    /// as `Float` values; which properties appear is the plugin's choice). XLA counts the body
    /// of a `while` loop once, whatever its trip count.
    ///
    /// Errors: `Unimplemented` when the plugin lacks the call; the plugin's error.
    pub fn cost_analysis(&self) -> Result<Vec<(String, crate::NamedValue)>> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Executable_GetCostAnalysis)?;
        let mut args = sys::PJRT_Executable_GetCostAnalysis_Args::new();
        args.executable = self.exe;
        // SAFETY: live executable; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        if args.properties.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin returned `num_properties` named values owned by the executable,
        // live while `self` is.
        let props = unsafe { slice_from(args.properties, args.num_properties) };
        Ok(props
            .iter()
            // SAFETY: each entry is a valid named value owned by the executable (above).
            .filter_map(|nv| unsafe { crate::named_value::from_raw(nv) })
            .collect())
    }

    /// What the optimized program does that a host may want to refuse before running it:
    /// `while` loops and their trip counts, host transfers, custom-call targets (decoded from
    /// [`optimized_program`](Self::optimized_program)).
    ///
    /// Errors: as [`optimized_program`](Self::optimized_program); `Internal` if it does not
    /// decode.
    pub fn program_facts(&self) -> Result<hlo::ProgramFacts> {
        let (format, code) = self.optimized_program()?;
        hlo::program_facts(&format, &code)
    }

    /// Platform-specific serialization (`PJRT_Executable_Serialize`), loadable with
    /// [`Client::deserialize_executable`] by the same plugin build. Serialize right after
    /// compiling: programs with `sort` failed to serialize after a first execution in trials.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Executable_Serialize)?;
        let mut args = sys::PJRT_Executable_Serialize_Args::new();
        args.executable = self.exe;
        // SAFETY: live executable; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: bytes live as long as `serialized_executable`, freed just below.
        let bytes = unsafe {
            slice_from(
                args.serialized_bytes.cast::<u8>(),
                args.serialized_bytes_size,
            )
            .to_vec()
        };
        if let Some(deleter) = args.serialized_executable_deleter {
            // SAFETY: called exactly once on the object the plugin returned (header).
            unsafe { deleter(args.serialized_executable) };
        }
        Ok(bytes)
    }

    /// Devices the executable runs on (`PJRT_LoadedExecutable_AddressableDevices`).
    pub fn addressable_devices(&self) -> Result<Vec<Device>> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_LoadedExecutable_AddressableDevices)?;
        let mut args = sys::PJRT_LoadedExecutable_AddressableDevices_Args::new();
        args.executable = self.raw;
        // SAFETY: live executable; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: array owned by the executable, alive during this call.
        let raw = unsafe { slice_from(args.addressable_devices, args.num_addressable_devices) };
        raw.iter()
            .map(|&d| self.client.device_from_raw(d))
            .collect()
    }

    /// [`addressable_devices`](Self::addressable_devices), cached.
    fn devices(&self) -> Result<&[Device]> {
        match self.devices.get_or_init(|| self.addressable_devices()) {
            Ok(d) => Ok(d),
            Err(e) => Err(e.clone()),
        }
    }

    fn num_devices(&self) -> Result<usize> {
        Ok(self.devices()?.len())
    }

    /// Runs the executable on its single addressable device with borrowed arguments
    /// (`PJRT_LoadedExecutable_Execute`). `donate` lists argument indices whose buffers the
    /// program may reuse for outputs (only effective where the program declares aliasing, e.g.
    /// `tf.aliasing_output`); every other index is passed in `non_donatable_input_indices`.
    /// A donated buffer is marked deleted afterwards.
    ///
    /// Validated before calling PJRT (`InvalidArgument`): argument count equals the number of
    /// parameters; each argument's element type and dims equal the parameter spec; every
    /// argument belongs to this client; `donate` indices are in range and unique; no buffer is
    /// passed twice when either position is donated. `Unimplemented` if the executable spans
    /// several devices. Returns immediately; outputs become ready asynchronously and
    /// [`Execution::done`] reports the device-side status.
    pub fn execute(&self, args: &[&Buffer], donate: &[usize]) -> Result<Execution> {
        let ndev = self.num_devices()?;
        if ndev != 1 {
            return Err(Error::unimplemented(format!(
                "execute supports single-device executables; this one has {ndev} devices \
                 (use execute_sharded)"
            )));
        }
        let params = self.parameter_specs()?;
        self.check_arguments(None, args, &params)?;
        let donated = donated_flags(donate, args.len())?;
        check_aliasing(&[args], &donated)?;
        let (mut outputs, mut events) = self.launch(&[args], &donated)?;
        match (outputs.pop(), events.pop()) {
            (Some(outputs), Some(done)) => Ok(Execution { outputs, done }),
            _ => Err(Error::internal(
                "PJRT_LoadedExecutable_Execute returned no outputs",
            )),
        }
    }

    /// Runs the executable on every one of its addressable devices at once
    /// (`PJRT_LoadedExecutable_Execute` with `num_devices` = their number): a program compiled
    /// for several replicas or partitions ([`crate::CompileOptions::spmd`]), whose collectives
    /// (all-reduce, all-gather, collective-permute, all-to-all) pass data between the devices.
    ///
    /// `args[k]` are the arguments of the `k`-th device of
    /// [`addressable_devices`](Self::addressable_devices), each a buffer on that device whose
    /// element type and dims are the per-device parameter spec
    /// ([`parameter_specs`](Self::parameter_specs); a sharded parameter's shard, see
    /// [`parameter_shardings`](Self::parameter_shardings)). `donate` lists argument indices
    /// donated on every device (as in [`execute`](Self::execute)).
    ///
    /// Validated before calling PJRT (`InvalidArgument`): one argument list per device; each
    /// list as [`execute`](Self::execute) checks it, and each buffer on its list's device; no
    /// buffer appears twice anywhere when either position is donated. Works for a one-device
    /// executable too (one list). Returns immediately with one [`Execution`] per device, in
    /// the same order: its outputs (the device's shard of each result) and its completion
    /// event. A failure on one device fails the others' events too, when the plugin reports
    /// it there (collectives wait for every participant).
    pub fn execute_sharded(
        &self,
        args: &[Vec<&Buffer>],
        donate: &[usize],
    ) -> Result<Vec<Execution>> {
        let devices = self.devices()?;
        if args.len() != devices.len() {
            return Err(Error::invalid_argument(format!(
                "expected one argument list per device of the executable ({}), got {}",
                devices.len(),
                args.len()
            )));
        }
        let params = self.parameter_specs()?;
        let nargs = params.len();
        for (k, (list, device)) in args.iter().zip(devices).enumerate() {
            self.check_arguments(Some(k), list, &params)?;
            for (i, a) in list.iter().enumerate() {
                let on = a.device()?;
                if on != *device {
                    return Err(Error::invalid_argument(format!(
                        "argument {i} of device {k} is on device {} but that list runs on \
                         device {}",
                        on.id(),
                        device.id()
                    )));
                }
            }
        }
        let donated = donated_flags(donate, nargs)?;
        let lists: Vec<&[&Buffer]> = args.iter().map(|l| l.as_slice()).collect();
        check_aliasing(&lists, &donated)?;
        let (outputs, events) = self.launch(&lists, &donated)?;
        Ok(outputs
            .into_iter()
            .zip(events)
            .map(|(outputs, done)| Execution { outputs, done })
            .collect())
    }

    /// Number of replicas the executable was compiled for (`PJRT_Executable_NumReplicas`).
    ///
    /// Errors: `Unimplemented` if the plugin lacks the call; the plugin's error.
    pub fn num_replicas(&self) -> Result<usize> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Executable_NumReplicas)?;
        let mut args = sys::PJRT_Executable_NumReplicas_Args::new();
        args.executable = self.exe;
        // SAFETY: live executable; header-sized args whose output is a plain integer.
        api.check(unsafe { f(&mut args) })?;
        Ok(args.num_replicas)
    }

    /// Number of partitions the executable was compiled for (`PJRT_Executable_NumPartitions`).
    ///
    /// Errors: `Unimplemented` if the plugin lacks the call; the plugin's error.
    pub fn num_partitions(&self) -> Result<usize> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Executable_NumPartitions)?;
        let mut args = sys::PJRT_Executable_NumPartitions_Args::new();
        args.executable = self.exe;
        // SAFETY: live executable; header-sized args whose output is a plain integer.
        api.check(unsafe { f(&mut args) })?;
        Ok(args.num_partitions)
    }

    /// Checks one device's argument list against the parameter specs; `device` names the list
    /// in messages (`None`: the single-device form of [`execute`](Self::execute)).
    fn check_arguments(
        &self,
        device: Option<usize>,
        args: &[&Buffer],
        params: &[TensorSpec],
    ) -> Result<()> {
        let of = device.map_or(String::new(), |k| format!(" of device {k}"));
        if args.len() != params.len() {
            return Err(Error::invalid_argument(format!(
                "expected {} arguments{of}, got {}",
                params.len(),
                args.len()
            )));
        }
        for (i, (a, p)) in args.iter().zip(params).enumerate() {
            if !a.client().same_as(&self.client) {
                return Err(Error::invalid_argument(format!(
                    "argument {i}{of} belongs to a different client"
                )));
            }
            let ty = a.element_type()?;
            let dims = a.dims()?;
            if ty != p.ty || dims != p.dims {
                return Err(Error::invalid_argument(format!(
                    "argument {i}{of} is {}, parameter expects {p}",
                    TensorSpec { ty, dims }
                )));
            }
        }
        Ok(())
    }

    /// `PJRT_LoadedExecutable_Execute` on `lists.len()` devices (the executable's addressable
    /// devices, in order) with validated argument lists of equal length; returns each device's
    /// outputs and completion event.
    fn launch(
        &self,
        lists: &[&[&Buffer]],
        donated: &[bool],
    ) -> Result<(Vec<Vec<Buffer>>, Vec<Event>)> {
        let ndev = lists.len();
        let nargs = donated.len();
        if lists.iter().any(|l| l.len() != nargs) {
            return Err(Error::internal("argument lists of unequal length"));
        }
        let non_donatable: Vec<i64> = (0..nargs)
            .filter(|&i| !donated[i])
            .map(|i| i as i64)
            .collect();
        let num_outputs = self.num_outputs()?;

        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_LoadedExecutable_Execute)?;
        let mut options = sys::PJRT_ExecuteOptions::new();
        options.non_donatable_input_indices = non_donatable.as_ptr();
        options.num_non_donatable_input_indices = non_donatable.len();
        // A launch id of its own for every execution (wrapping after 2^31): plugins that take
        // the execution's `xla::RunId` from it then give each execution a distinct run id,
        // which per-execution custom-call state (tpubox's loop budget) is keyed by. One id for
        // all devices of an execution: their collectives rendezvous by it.
        options.launch_id = next_launch_id();
        let arg_ptrs: Vec<Vec<*mut sys::PJRT_Buffer>> = lists
            .iter()
            .map(|l| l.iter().map(|b| b.raw()).collect())
            .collect();
        let arg_lists: Vec<*const *mut sys::PJRT_Buffer> =
            arg_ptrs.iter().map(|l| l.as_ptr()).collect();
        let mut outputs: Vec<Vec<*mut sys::PJRT_Buffer>> =
            vec![vec![ptr::null_mut(); num_outputs]; ndev];
        let output_lists: Vec<*mut *mut sys::PJRT_Buffer> =
            outputs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut events: Vec<*mut sys::PJRT_Event> = vec![ptr::null_mut(); ndev];
        let mut ex = sys::PJRT_LoadedExecutable_Execute_Args::new();
        ex.executable = self.raw;
        ex.options = &mut options;
        ex.argument_lists = arg_lists.as_ptr();
        ex.num_devices = ndev;
        ex.num_args = nargs;
        ex.output_lists = output_lists.as_ptr();
        ex.device_complete_events = events.as_mut_ptr();
        // SAFETY: every pointer array outlives the call and has the sizes announced
        // ([ndev][num_args] inputs, [ndev][num_outputs] outputs, ndev events; the inner output
        // arrays are not moved while `output_lists` points into them); all argument buffers
        // are live buffers of this client (checked by the callers) borrowed for the call;
        // `execute_device` null = the devices chosen at compile time, in the order of the
        // executable's addressable devices, one list each.
        api.check(unsafe { f(&mut ex) })?;
        // Take ownership of every returned buffer and event before checking any of them, so
        // that none leaks when the plugin returned fewer than announced.
        let outputs: Vec<Vec<Buffer>> = outputs
            .into_iter()
            .map(|l| {
                l.into_iter()
                    .filter(|p| !p.is_null())
                    .map(|p| Buffer::from_raw(self.client.clone(), p, None))
                    .collect()
            })
            .collect();
        let events: Vec<Event> = events
            .into_iter()
            .filter(|p| !p.is_null())
            .map(|p| Event::from_raw(self.client.clone(), p))
            .collect();
        if events.len() != ndev || outputs.iter().any(|l| l.len() != num_outputs) {
            return Err(Error::new(
                ErrorCode::Internal,
                "PJRT_LoadedExecutable_Execute returned missing outputs or events",
            ));
        }
        Ok((outputs, events))
    }
}

/// Flags the donated argument indices.
///
/// Errors: `InvalidArgument` for an index out of range or listed twice.
fn donated_flags(donate: &[usize], nargs: usize) -> Result<Vec<bool>> {
    let mut donated = vec![false; nargs];
    for &d in donate {
        if d >= nargs {
            return Err(Error::invalid_argument(format!(
                "donate index {d} out of range for {nargs} arguments"
            )));
        }
        if donated[d] {
            return Err(Error::invalid_argument(format!(
                "donate index {d} listed twice"
            )));
        }
        donated[d] = true;
    }
    Ok(donated)
}

/// Refuses a buffer passed twice, on any device, when either position is donated.
fn check_aliasing(lists: &[&[&Buffer]], donated: &[bool]) -> Result<()> {
    let all: Vec<(usize, usize, *mut sys::PJRT_Buffer)> = lists
        .iter()
        .enumerate()
        .flat_map(|(k, l)| l.iter().enumerate().map(move |(i, b)| (k, i, b.raw())))
        .collect();
    let many = lists.len() > 1;
    for (x, &(k, i, a)) in all.iter().enumerate() {
        for &(l, j, b) in &all[x + 1..] {
            if a == b && (donated[i] || donated[j]) {
                return Err(Error::invalid_argument(if many {
                    format!(
                        "argument {i} of device {k} and argument {j} of device {l} are the \
                         same buffer and one of them is donated"
                    )
                } else {
                    format!("arguments {i} and {j} are the same buffer and one of them is donated")
                }));
            }
        }
    }
    Ok(())
}

impl Drop for LoadedExecutable {
    fn drop(&mut self) {
        let api = self.client.plugin().api();
        if !self.exe.is_null()
            && let Ok(f) = api_fn!(api, PJRT_Executable_Destroy)
        {
            let mut args = sys::PJRT_Executable_Destroy_Args::new();
            args.executable = self.exe;
            // SAFETY: `exe` came from GetExecutable, is owned by us, destroyed once here.
            if let Err(e) = api.check(unsafe { f(&mut args) }) {
                tracing::warn!("PJRT_Executable_Destroy: {e}");
            }
        }
        if let Ok(f) = api_fn!(api, PJRT_LoadedExecutable_Destroy) {
            let mut args = sys::PJRT_LoadedExecutable_Destroy_Args::new();
            args.executable = self.raw;
            // SAFETY: `raw` is owned by us and destroyed exactly once, here; running executions
            // keep their own references inside the runtime.
            if let Err(e) = api.check(unsafe { f(&mut args) }) {
                tracing::warn!("PJRT_LoadedExecutable_Destroy: {e}");
            }
        }
    }
}

impl std::fmt::Debug for LoadedExecutable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedExecutable")
            .field("raw", &self.raw)
            .finish_non_exhaustive()
    }
}

/// A fresh positive launch id (`PJRT_ExecuteOptions.launch_id`) for each call in this process.
fn next_launch_id() -> i32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) & 0x7fff_ffff;
    i32::try_from(n.max(1)).unwrap_or(1)
}
