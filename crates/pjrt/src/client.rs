//! [`Client`]: a PJRT client (`PJRT_Client`): devices, uploads, compilation.

use std::sync::Arc;

use pjrt_sys as sys;
use sys::Args;

use crate::api::{api_fn, slice_from, string_from};
use crate::buffer::{Buffer, HostHold};
use crate::compile_options::CompileOptions;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::executable::LoadedExecutable;
use crate::host_bytes::HostBytes;
use crate::named_value::{self, NamedValue};
use crate::plugin::Plugin;
use crate::program::Program;
use crate::types::{PrimitiveType, dense_byte_len};

/// A PJRT client. Cheap to clone (shared); destroyed (`PJRT_Client_Destroy`) when the last
/// clone and every device, buffer, executable and event made from it are dropped.
#[derive(Clone)]
pub struct Client(Arc<ClientInner>);

struct ClientInner {
    plugin: Plugin,
    raw: *mut sys::PJRT_Client,
}

// SAFETY: a PJRT_Client (xla::PjRtClient behind the C API) is used concurrently by its own
// worker threads and by JAX from arbitrary threads; this wrapper only passes the pointer to C
// API calls and destroys it exactly once, when the last reference is dropped.
unsafe impl Send for ClientInner {}
// SAFETY: as above; no `&self` method mutates Rust-side state.
unsafe impl Sync for ClientInner {}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let api = self.plugin.api();
        match api_fn!(api, PJRT_Client_Destroy) {
            Ok(f) => {
                let mut args = sys::PJRT_Client_Destroy_Args::new();
                args.client = self.raw;
                // SAFETY: the last reference is gone: no buffer, executable, device or event of
                // this client remains (they all hold a `Client`), so destroying is exclusive.
                if let Err(e) = api.check(unsafe { f(&mut args) }) {
                    tracing::warn!("PJRT_Client_Destroy: {e}");
                }
            }
            Err(e) => tracing::warn!("{e}"),
        }
    }
}

impl Client {
    /// Creates a client (`PJRT_Client_Create`) with platform-specific `options`, e.g.
    /// `[("cpu_device_count", NamedValue::Int64(4))]` for the CPU plugins. No key-value store
    /// callbacks are given (single-process use).
    ///
    /// Errors: the plugin's error (e.g. `InvalidArgument` for an unknown option).
    pub fn new(plugin: &Plugin, options: &[(&str, NamedValue)]) -> Result<Client> {
        let api = plugin.api();
        let f = api_fn!(api, PJRT_Client_Create)?;
        let raw_options = named_value::to_raw(options);
        let mut args = sys::PJRT_Client_Create_Args::new();
        args.create_options = raw_options.as_ptr();
        args.num_options = raw_options.len();
        // SAFETY: `raw_options` and the strings/lists it points into (`options`) outlive the
        // call; `args` has the header's struct_size; callbacks are null (allowed).
        api.check(unsafe { f(&mut args) })?;
        if args.client.is_null() {
            return Err(Error::internal("PJRT_Client_Create returned no client"));
        }
        Ok(Client(Arc::new(ClientInner {
            plugin: plugin.clone(),
            raw: args.client,
        })))
    }

    /// The plugin this client was created from.
    pub fn plugin(&self) -> &Plugin {
        &self.0.plugin
    }

    pub(crate) fn raw(&self) -> *mut sys::PJRT_Client {
        self.0.raw
    }

    /// True if both handles are the same client.
    pub fn same_as(&self, other: &Client) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Platform name (`PJRT_Client_PlatformName`), e.g. `"cpu"`, `"cuda"`, `"tpu"`.
    pub fn platform_name(&self) -> Result<String> {
        let api = self.plugin().api();
        let f = api_fn!(api, PJRT_Client_PlatformName)?;
        let mut args = sys::PJRT_Client_PlatformName_Args::new();
        args.client = self.raw();
        // SAFETY: live client; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: the string is owned by the client, alive here.
        Ok(unsafe { string_from(args.platform_name, args.platform_name_size) })
    }

    /// Platform version (`PJRT_Client_PlatformVersion`), e.g. `"cpu"` or a CUDA/libtpu version.
    pub fn platform_version(&self) -> Result<String> {
        let api = self.plugin().api();
        let f = api_fn!(api, PJRT_Client_PlatformVersion)?;
        let mut args = sys::PJRT_Client_PlatformVersion_Args::new();
        args.client = self.raw();
        // SAFETY: live client; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: the string is owned by the client, alive here.
        Ok(unsafe { string_from(args.platform_version, args.platform_version_size) })
    }

    /// Addressable devices (`PJRT_Client_AddressableDevices`), in the plugin's order.
    pub fn devices(&self) -> Result<Vec<Device>> {
        let api = self.plugin().api();
        let f = api_fn!(api, PJRT_Client_AddressableDevices)?;
        let mut args = sys::PJRT_Client_AddressableDevices_Args::new();
        args.client = self.raw();
        // SAFETY: live client; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: the array is owned by the client and alive while it is.
        let raw = unsafe { slice_from(args.addressable_devices, args.num_addressable_devices) };
        raw.iter().map(|&d| Device::from_raw(self, d)).collect()
    }

    /// Finds the [`Device`] handle for a raw device pointer of this client.
    pub(crate) fn device_from_raw(&self, raw: *mut sys::PJRT_Device) -> Result<Device> {
        Device::from_raw(self, raw)
    }

    fn check_device(&self, device: &Device) -> Result<()> {
        if !device.client().same_as(self) {
            return Err(Error::invalid_argument(
                "device belongs to a different client",
            ));
        }
        Ok(())
    }

    /// Copies `data` (dense, row-major, little-endian; `Pred` one byte per element) into a new
    /// buffer of element type `ty` and dimensions `dims` on `device`. The host data is only
    /// read during the call (`PJRT_HostBufferSemantics_kImmutableOnlyDuringCall`).
    ///
    /// Errors: `InvalidArgument` (before calling PJRT) if a dimension is negative,
    /// `data.len() != ty.byte_size() × product(dims)` (checked arithmetic), or the device
    /// belongs to another client; otherwise the plugin's error.
    pub fn buffer_from_host(
        &self,
        data: &[u8],
        ty: PrimitiveType,
        dims: &[i64],
        device: &Device,
    ) -> Result<Buffer> {
        validate_upload(data.len(), ty, dims)?;
        self.check_device(device)?;
        // SAFETY: `data` is borrowed for the whole call and ImmutableOnlyDuringCall forbids the
        // runtime from keeping a reference afterwards.
        let (raw, done) = unsafe {
            self.raw_upload(
                data.as_ptr(),
                ty,
                dims,
                device,
                sys::PJRT_HostBufferSemantics_kImmutableOnlyDuringCall,
            )
        }?;
        drop(done);
        Ok(Buffer::from_raw(self.clone(), raw, None))
    }

    /// Uploads `data` like [`Client::buffer_from_host`], without a copy when the data is
    /// 64-byte aligned and non-empty (`PJRT_HostBufferSemantics_kImmutableZeroCopy`; always
    /// the case for non-empty [`HostBytes`]). The bytes are moved into the returned buffer and
    /// released only after the buffer is destroyed and the plugin signalled
    /// `done_with_host_buffer` (never waited on synchronously: that deadlocked in trials).
    ///
    /// Errors: as [`Client::buffer_from_host`].
    pub fn buffer_from_host_bytes(
        &self,
        data: HostBytes,
        ty: PrimitiveType,
        dims: &[i64],
        device: &Device,
    ) -> Result<Buffer> {
        validate_upload(data.len(), ty, dims)?;
        self.check_device(device)?;
        let ptr = data.as_slice().as_ptr();
        if data.is_empty() || !(ptr as usize).is_multiple_of(64) {
            return self.buffer_from_host(data.as_slice(), ty, dims, device);
        }
        // SAFETY: the heap allocation behind `data` does not move when `data` is moved into the
        // buffer below; it is kept alive and unmodified (HostHold gives no access to it) until
        // the buffer is destroyed and `done_with_host_buffer` fires.
        let (raw, done) = unsafe {
            self.raw_upload(
                ptr,
                ty,
                dims,
                device,
                sys::PJRT_HostBufferSemantics_kImmutableZeroCopy,
            )
        }?;
        Ok(Buffer::from_raw(
            self.clone(),
            raw,
            Some(HostHold { bytes: data, done }),
        ))
    }

    /// `PJRT_Client_BufferFromHostBuffer` with dense layout.
    ///
    /// # Safety
    /// `data` must point to `ty.byte_size() × product(dims)` readable bytes that stay valid and
    /// unmodified for as long as `semantics` requires.
    unsafe fn raw_upload(
        &self,
        data: *const u8,
        ty: PrimitiveType,
        dims: &[i64],
        device: &Device,
        semantics: sys::PJRT_HostBufferSemantics,
    ) -> Result<(*mut sys::PJRT_Buffer, Option<Event>)> {
        let api = self.plugin().api();
        let f = api_fn!(api, PJRT_Client_BufferFromHostBuffer)?;
        let mut args = sys::PJRT_Client_BufferFromHostBuffer_Args::new();
        args.client = self.raw();
        args.data = data.cast();
        args.type_ = ty.to_pjrt();
        args.dims = dims.as_ptr();
        args.num_dims = dims.len();
        args.host_buffer_semantics = semantics;
        args.device = device.raw();
        // SAFETY: client and device are live (device checked to belong to this client); `dims`
        // outlives the call; data validity is the caller's contract; null strides/layout/memory
        // mean dense major-to-minor on the device's default memory.
        api.check(unsafe { f(&mut args) })?;
        let done = (!args.done_with_host_buffer.is_null())
            .then(|| Event::from_raw(self.clone(), args.done_with_host_buffer));
        if args.buffer.is_null() {
            return Err(Error::internal(
                "PJRT_Client_BufferFromHostBuffer returned no buffer",
            ));
        }
        Ok((args.buffer, done))
    }

    /// Compiles `program` (`PJRT_Client_Compile`) and loads it: on the devices of
    /// `options.device_assignment` if set, else on the device at index
    /// `options.device_ordinal` of [`Client::devices`] if set, else on the plugin's default
    /// (first) device.
    ///
    /// Errors: `InvalidArgument` (before calling PJRT) for invalid `options`, a device
    /// ordinal outside `0..devices().len()` or an assigned device id that is not one of
    /// [`Client::devices`]; the plugin's error for a program that does not parse, verify or
    /// compile (a module whose `mhlo.num_partitions` or `mhlo.num_replicas` differ from the
    /// options' is refused by the plugin).
    pub fn compile(&self, program: &Program, options: &CompileOptions) -> Result<LoadedExecutable> {
        let mut device_id = None;
        if let Some(d) = options.device_ordinal {
            let devices = self.devices()?;
            let n = devices.len();
            match usize::try_from(d).ok().and_then(|d| devices.get(d)) {
                Some(dev) => device_id = Some(i64::from(dev.id())),
                None => {
                    return Err(Error::invalid_argument(format!(
                        "device_ordinal {d} out of range: client has {n} devices"
                    )));
                }
            }
        }
        if let Some(a) = &options.device_assignment {
            let devices = self.devices()?;
            for &id in a.device_ids() {
                if !devices.iter().any(|d| i64::from(d.id()) == id) {
                    let ids: Vec<i32> = devices.iter().map(Device::id).collect();
                    return Err(Error::invalid_argument(format!(
                        "device id {id} in the device assignment is not a device of this \
                         client (ids {ids:?})"
                    )));
                }
            }
        }
        let opts = options.encode(device_id)?;
        let api = self.plugin().api();
        let f = api_fn!(api, PJRT_Client_Compile)?;
        let format = program.format.as_str();
        let mut prog = sys::PJRT_Program::new();
        // Some plugins' MLIR text lexers read past `code_size` until they meet a NUL byte (the
        // fuzzer found `lammps-jax-pjrt-cpu` 0.11.2 segfaulting on text that ends mid-token),
        // so the bytes handed over always end with a NUL that `code_size` does not count.
        let mut code = Vec::with_capacity(program.code.len() + 1);
        code.extend_from_slice(&program.code);
        code.push(0);
        // The C API takes `char*` but does not write through it for Compile.
        prog.code = code.as_mut_ptr().cast();
        prog.code_size = program.code.len();
        prog.format = format.as_ptr().cast();
        prog.format_size = format.len();
        let mut args = sys::PJRT_Client_Compile_Args::new();
        args.client = self.raw();
        args.program = &prog;
        args.compile_options = opts.as_ptr().cast();
        args.compile_options_size = opts.len();
        // SAFETY: program code, format and options bytes outlive the call ("only needs to stay
        // alive for the duration of the Compile call"); options were validated above so no XLA
        // CHECK can fire on them.
        api.check(unsafe { f(&mut args) })?;
        LoadedExecutable::from_raw(self.clone(), args.executable)
    }

    /// Loads an executable produced by [`LoadedExecutable::serialize`]
    /// (`PJRT_Executable_DeserializeAndLoad`), with the compile options stored in it.
    ///
    /// Only bytes from the same plugin build are meaningful: another build may load them and
    /// compute wrong numbers (seen in trials); key caches by plugin hash and API version.
    ///
    /// Errors: the plugin's error (truncated or garbage bytes give a clean error).
    pub fn deserialize_executable(&self, bytes: &[u8]) -> Result<LoadedExecutable> {
        let api = self.plugin().api();
        let f = api_fn!(api, PJRT_Executable_DeserializeAndLoad)?;
        let mut args = sys::PJRT_Executable_DeserializeAndLoad_Args::new();
        args.client = self.raw();
        args.serialized_executable = bytes.as_ptr().cast();
        args.serialized_executable_size = bytes.len();
        // SAFETY: `bytes` outlives the call; null overridden options mean "use the serialized
        // ones".
        api.check(unsafe { f(&mut args) })?;
        LoadedExecutable::from_raw(self.clone(), args.loaded_executable)
    }
}

/// Checks that `len == ty.byte_size() × product(dims)` with non-negative dims.
fn validate_upload(len: usize, ty: PrimitiveType, dims: &[i64]) -> Result<()> {
    if let Some(d) = dims.iter().find(|&&d| d < 0) {
        return Err(Error::invalid_argument(format!(
            "negative dimension {d} in {dims:?}"
        )));
    }
    let want = dense_byte_len(ty, dims).ok_or_else(|| {
        Error::invalid_argument(format!("{} array of dims {dims:?} is too large", ty.name()))
    })?;
    if want != len {
        return Err(Error::invalid_argument(format!(
            "{} array of dims {dims:?} needs {want} bytes, got {len}",
            ty.name()
        )));
    }
    Ok(())
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("plugin", &self.0.plugin)
            .finish_non_exhaustive()
    }
}
