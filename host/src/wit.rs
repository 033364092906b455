//! Thin glue between the WIT interfaces in `wit/device.wit` and [`DeviceService`].
//!
//! Guest handles live in the store's [`ResourceTable`]; each entry points at an
//! `Arc<DeviceTensor>` or `Arc<DeviceExecutable>`, so a guest can only name resources it was
//! given. All validation and PJRT work happens in [`crate::device`]; this file converts types.

use std::sync::Arc;

use pjrt::PrimitiveType;
use wasmtime::component::{Resource, ResourceTable};

use crate::device::{
    Arg, DeviceExecutable, DeviceService, DeviceTensor, TensorSpec, dims_from_u64,
};
use crate::error::{DeviceError, ErrorKind};
use crate::weights::{WeightRegistry, WeightSet};

wasmtime::component::bindgen!({
    path: "../wit",
    world: "guest",
    imports: { default: async | trappable },
    with: {
        "tpubox:device/types.tensor": GuestTensor,
        "tpubox:device/types.executable": GuestExecutable,
        "tpubox:device/weights.weight-set": GuestWeightSet,
    },
});

use tpubox::device::client::{self, CompileOptions, ProgramFormat};
use tpubox::device::types::{self, Dtype, Error as WitError, ErrorKind as WitErrorKind};
use tpubox::device::weights;

/// A guest's handle to a device tensor, as stored in its [`ResourceTable`].
pub struct GuestTensor {
    /// `None` once the tensor was donated to an execution.
    tensor: Option<Arc<DeviceTensor>>,
    /// Spec and device, kept so they can still be asked after donation.
    spec: TensorSpec,
    device: u32,
    /// Shared tensors (weights held by the host) may be read but not donated.
    read_only: bool,
}

impl GuestTensor {
    /// Wraps a tensor the guest owns.
    pub fn owned(tensor: DeviceTensor) -> Self {
        Self::new(Arc::new(tensor), false)
    }

    /// Wraps a shared tensor the guest may read but not donate.
    pub fn shared(tensor: Arc<DeviceTensor>) -> Self {
        Self::new(tensor, true)
    }

    fn new(tensor: Arc<DeviceTensor>, read_only: bool) -> Self {
        GuestTensor {
            spec: tensor.spec().clone(),
            device: tensor.device(),
            tensor: Some(tensor),
            read_only,
        }
    }

    fn live(&self) -> Result<&Arc<DeviceTensor>, DeviceError> {
        self.tensor.as_ref().ok_or_else(|| {
            DeviceError::new(
                ErrorKind::FailedPrecondition,
                "this tensor was donated to an execution and can no longer be used",
            )
        })
    }
}

/// A guest's handle to a compiled executable.
pub struct GuestExecutable(pub Arc<DeviceExecutable>);

/// A guest's handle to an opened weight set.
pub struct GuestWeightSet(pub Arc<WeightSet>);

/// What the tpubox interfaces need from a store's data.
pub trait DeviceView: Send {
    /// The resource table holding the guest's handles.
    fn table(&mut self) -> &mut ResourceTable;
    /// The shared device service.
    fn device(&self) -> &Arc<DeviceService>;
    /// The weight sets this guest may open.
    fn weights(&self) -> &Arc<WeightRegistry>;
}

/// Adds the `tpubox:device` interfaces to `linker`.
///
/// Errors: a name already defined in `linker`.
pub fn add_to_linker<T: DeviceView + 'static>(
    linker: &mut wasmtime::component::Linker<T>,
) -> wasmtime::Result<()> {
    Guest::add_to_linker::<T, DeviceData<T>>(linker, |t| DeviceCtx(t))
}

/// Marker for [`wasmtime::component::HasData`] (borrows a store's data as [`DeviceCtx`]).
pub struct DeviceData<T>(std::marker::PhantomData<T>);

impl<T: 'static> wasmtime::component::HasData for DeviceData<T> {
    type Data<'a> = DeviceCtx<'a, T>;
}

/// Borrowed view of a store's data that implements the generated host traits.
pub struct DeviceCtx<'a, T>(&'a mut T);

fn to_wit_error(e: DeviceError) -> WitError {
    let kind = match e.kind {
        ErrorKind::InvalidArgument => WitErrorKind::InvalidArgument,
        ErrorKind::NotFound => WitErrorKind::NotFound,
        ErrorKind::FailedPrecondition => WitErrorKind::FailedPrecondition,
        ErrorKind::PermissionDenied => WitErrorKind::PermissionDenied,
        ErrorKind::ResourceExhausted => WitErrorKind::ResourceExhausted,
        ErrorKind::Unsupported => WitErrorKind::Unsupported,
        ErrorKind::CompileFailed => WitErrorKind::CompileFailed,
        ErrorKind::ExecutionFailed => WitErrorKind::ExecutionFailed,
        ErrorKind::Internal => WitErrorKind::Internal,
    };
    WitError {
        kind,
        message: e.message,
    }
}

/// Maps a WIT dtype to the XLA primitive type.
pub fn dtype_to_xla(d: Dtype) -> PrimitiveType {
    match d {
        Dtype::Pred => PrimitiveType::Pred,
        Dtype::S8 => PrimitiveType::S8,
        Dtype::S16 => PrimitiveType::S16,
        Dtype::S32 => PrimitiveType::S32,
        Dtype::S64 => PrimitiveType::S64,
        Dtype::U8 => PrimitiveType::U8,
        Dtype::U16 => PrimitiveType::U16,
        Dtype::U32 => PrimitiveType::U32,
        Dtype::U64 => PrimitiveType::U64,
        Dtype::F16 => PrimitiveType::F16,
        Dtype::Bf16 => PrimitiveType::Bf16,
        Dtype::F32 => PrimitiveType::F32,
        Dtype::F64 => PrimitiveType::F64,
        Dtype::C64 => PrimitiveType::C64,
        Dtype::C128 => PrimitiveType::C128,
    }
}

/// Maps an XLA primitive type to the WIT dtype.
pub fn xla_to_dtype(t: PrimitiveType) -> Dtype {
    match t {
        PrimitiveType::Pred => Dtype::Pred,
        PrimitiveType::S8 => Dtype::S8,
        PrimitiveType::S16 => Dtype::S16,
        PrimitiveType::S32 => Dtype::S32,
        PrimitiveType::S64 => Dtype::S64,
        PrimitiveType::U8 => Dtype::U8,
        PrimitiveType::U16 => Dtype::U16,
        PrimitiveType::U32 => Dtype::U32,
        PrimitiveType::U64 => Dtype::U64,
        PrimitiveType::F16 => Dtype::F16,
        PrimitiveType::Bf16 => Dtype::Bf16,
        PrimitiveType::F32 => Dtype::F32,
        PrimitiveType::F64 => Dtype::F64,
        PrimitiveType::C64 => Dtype::C64,
        PrimitiveType::C128 => Dtype::C128,
    }
}

fn to_wit_spec(s: &TensorSpec) -> types::TensorSpec {
    types::TensorSpec {
        dtype: xla_to_dtype(s.ty),
        dims: s.dims.iter().map(|&d| d as u64).collect(),
    }
}

impl<T: DeviceView> DeviceCtx<'_, T> {
    fn tensor(&mut self, r: &Resource<GuestTensor>) -> wasmtime::Result<&GuestTensor> {
        Ok(self.0.table().get(r)?)
    }

    fn push_tensor(&mut self, t: GuestTensor) -> wasmtime::Result<Resource<GuestTensor>> {
        Ok(self.0.table().push(t)?)
    }
}

impl<T: DeviceView> types::Host for DeviceCtx<'_, T> {}

impl<T: DeviceView> types::HostTensor for DeviceCtx<'_, T> {
    async fn from_bytes(
        &mut self,
        dtype: Dtype,
        dims: Vec<u64>,
        data: Vec<u8>,
        device: Option<u32>,
    ) -> wasmtime::Result<Result<Resource<GuestTensor>, WitError>> {
        let made = dims_from_u64(&dims).and_then(|dims| {
            self.0.device().tensor_from_bytes(
                dtype_to_xla(dtype),
                &dims,
                &data,
                device.unwrap_or(0),
            )
        });
        match made {
            Ok(t) => Ok(Ok(self.push_tensor(GuestTensor::owned(t))?)),
            Err(e) => Ok(Err(to_wit_error(e))),
        }
    }

    async fn spec(&mut self, r: Resource<GuestTensor>) -> wasmtime::Result<types::TensorSpec> {
        Ok(to_wit_spec(&self.tensor(&r)?.spec))
    }

    async fn device(&mut self, r: Resource<GuestTensor>) -> wasmtime::Result<u32> {
        Ok(self.tensor(&r)?.device)
    }

    async fn byte_size(&mut self, r: Resource<GuestTensor>) -> wasmtime::Result<u64> {
        let spec = &self.tensor(&r)?.spec;
        Ok(crate::device::checked_byte_size(spec.ty, &spec.dims).unwrap_or(0) as u64)
    }

    async fn read(
        &mut self,
        r: Resource<GuestTensor>,
    ) -> wasmtime::Result<Result<Vec<u8>, WitError>> {
        let t = match self.tensor(&r)?.live() {
            Ok(t) => Arc::clone(t),
            Err(e) => return Ok(Err(to_wit_error(e))),
        };
        Ok(self.0.device().read(&t).await.map_err(to_wit_error))
    }

    async fn copy_to_device(
        &mut self,
        r: Resource<GuestTensor>,
        device: u32,
    ) -> wasmtime::Result<Result<Resource<GuestTensor>, WitError>> {
        let t = match self.tensor(&r)?.live() {
            Ok(t) => Arc::clone(t),
            Err(e) => return Ok(Err(to_wit_error(e))),
        };
        match self.0.device().copy_to_device(&t, device) {
            Ok(c) => Ok(Ok(self.push_tensor(GuestTensor::owned(c))?)),
            Err(e) => Ok(Err(to_wit_error(e))),
        }
    }

    async fn drop(&mut self, r: Resource<GuestTensor>) -> wasmtime::Result<()> {
        self.0.table().delete(r)?;
        Ok(())
    }
}

impl<T: DeviceView> types::HostExecutable for DeviceCtx<'_, T> {
    async fn inputs(
        &mut self,
        r: Resource<GuestExecutable>,
    ) -> wasmtime::Result<Vec<types::TensorSpec>> {
        let e = self.0.table().get(&r)?;
        Ok(e.0.inputs().iter().map(to_wit_spec).collect())
    }

    async fn outputs(
        &mut self,
        r: Resource<GuestExecutable>,
    ) -> wasmtime::Result<Vec<types::TensorSpec>> {
        let e = self.0.table().get(&r)?;
        Ok(e.0.outputs().iter().map(to_wit_spec).collect())
    }

    async fn device(&mut self, r: Resource<GuestExecutable>) -> wasmtime::Result<u32> {
        Ok(self.0.table().get(&r)?.0.device())
    }

    async fn fingerprint(&mut self, r: Resource<GuestExecutable>) -> wasmtime::Result<String> {
        Ok(self.0.table().get(&r)?.0.fingerprint().to_string())
    }

    async fn drop(&mut self, r: Resource<GuestExecutable>) -> wasmtime::Result<()> {
        self.0.table().delete(r)?;
        Ok(())
    }
}

impl<T: DeviceView> client::Host for DeviceCtx<'_, T> {
    async fn platform(&mut self) -> wasmtime::Result<types::PlatformInfo> {
        let p = self.0.device().platform();
        Ok(types::PlatformInfo {
            name: p.name.clone(),
            version: p.version.clone(),
            pjrt_api_version: p.pjrt_api_version,
        })
    }

    async fn list_devices(&mut self) -> wasmtime::Result<Vec<types::DeviceInfo>> {
        Ok(self
            .0
            .device()
            .devices()
            .into_iter()
            .map(|d| types::DeviceInfo {
                index: d.index,
                id: d.id,
                kind: d.kind,
                description: d.description,
            })
            .collect())
    }

    async fn compile(
        &mut self,
        format: ProgramFormat,
        code: Vec<u8>,
        options: CompileOptions,
    ) -> wasmtime::Result<Result<Resource<GuestExecutable>, WitError>> {
        let text = matches!(format, ProgramFormat::MlirText);
        let service = Arc::clone(self.0.device());
        match service
            .compile(code, text, options.device.unwrap_or(0))
            .await
        {
            Ok(exe) => Ok(Ok(self.0.table().push(GuestExecutable(exe))?)),
            Err(e) => Ok(Err(to_wit_error(e))),
        }
    }

    async fn execute(
        &mut self,
        exe: Resource<GuestExecutable>,
        args: Vec<Resource<GuestTensor>>,
        donate: Vec<u32>,
    ) -> wasmtime::Result<Result<Vec<Resource<GuestTensor>>, WitError>> {
        let exe = Arc::clone(&self.0.table().get(&exe)?.0);
        let mut donated = vec![false; args.len()];
        for &d in &donate {
            let Some(slot) = donated.get_mut(d as usize) else {
                return Ok(Err(to_wit_error(DeviceError::invalid(format!(
                    "donate index {d} is out of range for {} argument(s)",
                    args.len()
                )))));
            };
            if *slot {
                return Ok(Err(to_wit_error(DeviceError::invalid(format!(
                    "donate index {d} is listed twice"
                )))));
            }
            *slot = true;
        }
        let mut tensors = Vec::with_capacity(args.len());
        for (i, r) in args.iter().enumerate() {
            let g = self.tensor(r)?;
            let t = match g.live() {
                Ok(t) => Arc::clone(t),
                Err(e) => {
                    return Ok(Err(to_wit_error(DeviceError::new(
                        e.kind,
                        format!("argument {i}: {}", e.message),
                    ))));
                }
            };
            if donated[i] && g.read_only {
                return Ok(Err(to_wit_error(DeviceError::new(
                    ErrorKind::PermissionDenied,
                    format!("argument {i} is a shared, read-only tensor and cannot be donated"),
                ))));
            }
            tensors.push(t);
        }
        let call_args: Vec<Arg<'_>> = tensors
            .iter()
            .zip(&donated)
            .map(|(t, &donate)| Arg {
                tensor: t.as_ref(),
                donate,
            })
            .collect();
        let service = Arc::clone(self.0.device());
        let outputs = match service.execute(&exe, &call_args).await {
            Ok(o) => o,
            Err(e) => return Ok(Err(to_wit_error(e))),
        };
        drop(call_args);
        for (r, &d) in args.iter().zip(&donated) {
            if d {
                self.0.table().get_mut(r)?.tensor = None;
            }
        }
        let mut handles = Vec::with_capacity(outputs.len());
        for o in outputs {
            handles.push(self.push_tensor(GuestTensor::owned(o))?);
        }
        Ok(Ok(handles))
    }
}

impl<T: DeviceView> weights::Host for DeviceCtx<'_, T> {
    async fn available(&mut self) -> wasmtime::Result<Vec<String>> {
        Ok(self.0.weights().names())
    }

    async fn open(
        &mut self,
        name: String,
    ) -> wasmtime::Result<Result<Resource<GuestWeightSet>, WitError>> {
        match self.0.weights().get(&name) {
            Ok(set) => Ok(Ok(self.0.table().push(GuestWeightSet(set))?)),
            Err(e) => Ok(Err(to_wit_error(e))),
        }
    }
}

impl<T: DeviceView> weights::HostWeightSet for DeviceCtx<'_, T> {
    async fn names(&mut self, r: Resource<GuestWeightSet>) -> wasmtime::Result<Vec<String>> {
        Ok(self
            .0
            .table()
            .get(&r)?
            .0
            .names()
            .map(String::from)
            .collect())
    }

    async fn spec(
        &mut self,
        r: Resource<GuestWeightSet>,
        name: String,
    ) -> wasmtime::Result<Result<types::TensorSpec, WitError>> {
        let set = &self.0.table().get(&r)?.0;
        Ok(set
            .get(&name)
            .map(|t| to_wit_spec(t.spec()))
            .map_err(to_wit_error))
    }

    async fn get(
        &mut self,
        r: Resource<GuestWeightSet>,
        name: String,
    ) -> wasmtime::Result<Result<Resource<GuestTensor>, WitError>> {
        let found = self.0.table().get(&r)?.0.get(&name).map(Arc::clone);
        match found {
            Ok(t) => Ok(Ok(self.push_tensor(GuestTensor::shared(t))?)),
            Err(e) => Ok(Err(to_wit_error(e))),
        }
    }

    async fn drop(&mut self, r: Resource<GuestWeightSet>) -> wasmtime::Result<()> {
        self.0.table().delete(r)?;
        Ok(())
    }
}
