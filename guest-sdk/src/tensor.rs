//! [`Tensor`]: a dense array on one of the host's devices, created from guest data (on a chosen
//! device with [`Placement`]) and read back.

use std::cell::OnceCell;
use std::fmt;

use crate::bindings::tpubox::device::types as raw_types;
use crate::spec::{check_byte_len, check_len};
use crate::{Dtype, Element, Error, ErrorKind, Result, TensorSpec, decode, encode};

/// A dense, row-major array resident on one of the host's devices.
///
/// The data lives in device memory; it crosses into guest memory only when read back with
/// [`Tensor::to_vec`] or [`Tensor::to_bytes`]. Dropping the `Tensor` frees the device memory
/// (unless the host keeps it alive for other holders, e.g. shared weights).
///
/// The tensor's spec never changes, so the SDK fetches it from the host at most once.
pub struct Tensor {
    raw: raw_types::Tensor,
    spec: OnceCell<TensorSpec>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.spec.get() {
            Some(spec) => write!(f, "Tensor({spec})"),
            None => f.write_str("Tensor(..)"),
        }
    }
}

/// Creates tensors on a chosen device; see [`Tensor::on_device`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    device: Option<u32>,
}

impl Placement {
    /// The device index this placement targets (`None`: the host's default, device 0).
    pub fn device(self) -> Option<u32> {
        self.device
    }

    /// Like [`Tensor::from_slice`], on this placement's device.
    pub fn from_slice<T: Element>(self, data: &[T], dims: &[u64]) -> Result<Tensor> {
        check_len(T::DTYPE, dims, data.len())?;
        self.upload(T::DTYPE, dims, &encode(data))
    }

    /// Like [`Tensor::from_bytes`], on this placement's device.
    pub fn from_bytes(self, dtype: Dtype, dims: &[u64], bytes: &[u8]) -> Result<Tensor> {
        check_byte_len(dtype, dims, bytes.len())?;
        self.upload(dtype, dims, bytes)
    }

    /// Like [`Tensor::scalar`], on this placement's device.
    pub fn scalar<T: Element>(self, value: T) -> Result<Tensor> {
        self.from_slice(&[value], &[])
    }

    fn upload(self, dtype: Dtype, dims: &[u64], bytes: &[u8]) -> Result<Tensor> {
        let raw = raw_types::Tensor::from_bytes(dtype, dims, bytes, self.device)?;
        Ok(Tensor::with_spec(raw, Some(TensorSpec::new(dtype, dims))))
    }
}

impl Tensor {
    /// Creates a tensor of dtype `T::DTYPE` and shape `dims` on device 0 from row-major `data`.
    ///
    /// `dims` is empty for a scalar; `data.len()` must equal the product of `dims`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] (checked before calling the host) if `data.len()`
    /// does not match `dims` or the element count overflows; from the host,
    /// `invalid-argument` for a rank above its limit and `resource-exhausted` when a tenant
    /// limit or device memory is exceeded.
    ///
    /// ```no_run
    /// # use tpubox_guest::Tensor;
    /// let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(x.dims(), &[2, 3]);
    /// # Ok::<(), tpubox_guest::Error>(())
    /// ```
    pub fn from_slice<T: Element>(data: &[T], dims: &[u64]) -> Result<Tensor> {
        Placement::default().from_slice(data, dims)
    }

    /// Creates a tensor on device 0 from row-major bytes in the host layout of `dtype`
    /// (see [`Dtype`]; this is the only way to create `c64`/`c128` tensors).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] (checked before calling the host) if
    /// `bytes.len() != dtype.size_bytes() × product(dims)`; host errors as for
    /// [`Tensor::from_slice`].
    pub fn from_bytes(dtype: Dtype, dims: &[u64], bytes: &[u8]) -> Result<Tensor> {
        Placement::default().from_bytes(dtype, dims, bytes)
    }

    /// Creates a rank-0 tensor (no dims) holding `value`, on device 0.
    ///
    /// Errors: as for [`Tensor::from_slice`].
    pub fn scalar<T: Element>(value: T) -> Result<Tensor> {
        Placement::default().scalar(value)
    }

    /// Selects the device (index from [`devices`](crate::devices)) on which to create a tensor:
    /// `Tensor::on_device(1).from_slice(&data, &dims)`.
    ///
    /// An unknown index is reported by the host when the tensor is created, as
    /// [`ErrorKind::NotFound`].
    pub fn on_device(device: u32) -> Placement {
        Placement {
            device: Some(device),
        }
    }

    /// Wraps a raw handle from [`bindings`](crate::bindings).
    pub fn from_raw(raw: raw_types::Tensor) -> Tensor {
        Tensor::with_spec(raw, None)
    }

    /// Wraps a raw handle whose spec is already known (`None`: fetch it when first asked).
    pub(crate) fn with_spec(raw: raw_types::Tensor, spec: Option<TensorSpec>) -> Tensor {
        let cell = OnceCell::new();
        if let Some(spec) = spec {
            let _ = cell.set(spec);
        }
        Tensor { raw, spec: cell }
    }

    /// The raw handle, e.g. to pass to `bindings::tpubox::device::client::execute`.
    pub fn as_raw(&self) -> &raw_types::Tensor {
        &self.raw
    }

    /// Unwraps the raw handle.
    pub fn into_raw(self) -> raw_types::Tensor {
        self.raw
    }

    /// Element type and dims (fetched from the host once, then cached).
    pub fn spec(&self) -> &TensorSpec {
        self.spec.get_or_init(|| self.raw.spec())
    }

    /// Dimensions, row-major (empty for a scalar).
    pub fn dims(&self) -> &[u64] {
        &self.spec().dims
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.spec().dtype
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.spec().rank()
    }

    /// Number of elements (product of dims; 1 for a scalar).
    ///
    /// Panics only if the count overflows `usize`, which the host prevents for tensors it
    /// created.
    pub fn len(&self) -> usize {
        self.spec()
            .element_count()
            .expect("host tensor element count fits in usize")
    }

    /// Whether the tensor has no elements (some dim is 0).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Index of the device holding this tensor.
    pub fn device(&self) -> u32 {
        self.raw.device()
    }

    /// Size of the dense host representation in bytes.
    pub fn byte_size(&self) -> u64 {
        self.raw.byte_size()
    }

    /// Waits until the launch computing this tensor ([`Executable::launch`](crate::Executable::launch))
    /// has finished; at once for a tensor with a value.
    ///
    /// Errors: [`ErrorKind::FailedPrecondition`] if the tensor was donated; the launch's error
    /// ([`ErrorKind::ExecutionFailed`], its message naming the launch's id and program
    /// fingerprint) if the device failed, at every wait.
    pub fn wait(&self) -> Result<()> {
        Ok(crate::bindings::tpubox::device::client::wait(&self.raw)?)
    }

    /// Copies the tensor back into guest memory as row-major bytes in the host layout; an
    /// output of a launch is read once the launch finished.
    ///
    /// Errors: [`ErrorKind::FailedPrecondition`] if the tensor was donated; the launch's error
    /// ([`ErrorKind::ExecutionFailed`] naming it) if the device failed.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        Ok(self.raw.read()?)
    }

    /// Copies the tensor back into guest memory as row-major values of `T`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `T::DTYPE` differs from [`Tensor::dtype`]
    /// (checked before reading); [`ErrorKind::FailedPrecondition`] if the tensor was donated.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        check_dtype::<T>(self.spec())?;
        let bytes = self.to_bytes()?;
        check_byte_len(T::DTYPE, self.dims(), bytes.len())
            .map_err(|e| Error::new(ErrorKind::Internal, format!("host returned {e}")))?;
        decode(&bytes)
    }

    /// Reads a single-element tensor (e.g. a scalar) as a value of `T`.
    ///
    /// Errors: as for [`Tensor::to_vec`], plus [`ErrorKind::InvalidArgument`] if the tensor
    /// does not hold exactly one element.
    pub fn to_scalar<T: Element>(&self) -> Result<T> {
        check_dtype::<T>(self.spec())?;
        if self.len() != 1 {
            return Err(Error::invalid_argument(format!(
                "{} does not hold exactly one element",
                self.spec()
            )));
        }
        Ok(self.to_vec::<T>()?[0])
    }

    /// Copies the tensor to device `device` and returns the copy (this tensor is unchanged).
    ///
    /// Errors: [`ErrorKind::NotFound`] for an unknown device; `failed-precondition` if this
    /// tensor was donated; `resource-exhausted` when a limit is reached.
    pub fn copy_to_device(&self, device: u32) -> Result<Tensor> {
        let raw = self.raw.copy_to_device(device)?;
        Ok(Tensor::with_spec(raw, self.spec.get().cloned()))
    }
}

fn check_dtype<T: Element>(spec: &TensorSpec) -> Result<()> {
    if spec.dtype != T::DTYPE {
        return Err(Error::invalid_argument(format!(
            "tensor is {spec}, cannot read it as {} ({})",
            std::any::type_name::<T>(),
            T::DTYPE
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // These never reach the host: the guest-side checks fail first (off wasm the host imports
    // are stubs that would panic).
    #[test]
    fn from_slice_checks_len_before_host() {
        let e = Tensor::from_slice(&[1.0f32; 5], &[2, 3]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("f32[2,3]"), "{e}");
        let e = Tensor::from_slice::<i32>(&[], &[]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let e = Tensor::on_device(1)
            .from_slice(&[1u8, 2], &[u64::MAX, u64::MAX])
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn from_bytes_checks_len_before_host() {
        let e = Tensor::from_bytes(Dtype::F32, &[2], &[0; 7]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("8 bytes"), "{e}");
        let e = Tensor::from_bytes(Dtype::C128, &[1], &[0; 8]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn dtype_check_for_reads() {
        let spec = TensorSpec::new(Dtype::F32, &[2]);
        assert!(check_dtype::<f32>(&spec).is_ok());
        let e = check_dtype::<i32>(&spec).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("f32[2]"), "{e}");
    }
}
