//! Programs over several devices at once (SPMD) and arrays sharded across devices: the WIT
//! `sharding` interface (since `tpubox:device@0.1.2`).
//!
//! A [`ShardedArray`] is one global array held as one [`Tensor`] per device, laid out by a
//! sharding in XLA's text form (`{devices=[4,1]<=[4]}`: dimension 0 split in four;
//! `{replicated}`: the whole array on every device), what JAX calls a `jax.Array` with a
//! `NamedSharding`. A [`ShardedExecutable`] is a program compiled for several devices: XLA
//! partitions it from the shardings its module declares (`mhlo.sharding` or Shardy
//! `sdy.sharding`, as `jax.export` writes them), collectives included.
//!
//! ```no_run
//! use tpubox_guest::sharded::ShardedExecutable;
//! # fn demo(program: &str) -> tpubox_guest::Result<()> {
//! let exe = ShardedExecutable::compile_mlir(program, &[0, 1, 2, 3])?;
//! let x = exe.put(0, &[1.0f32; 24])?; // parameter 0, split as the program says
//! let out = exe.call(&[&x])?;
//! let global: Vec<f32> = out[0].to_vec()?; // gathered
//! # Ok(()) }
//! ```

use crate::bindings::tpubox::device::sharding as raw;
use crate::bindings::tpubox::device::types as raw_types;
use crate::{Dtype, Element, Error, Executable, ProgramFormat, Result, Tensor, TensorSpec};

pub use raw::{ProgramLayout, ShardedSpec};

/// One global array held as one tensor per device, in the order of [`ShardedArray::devices`].
#[derive(Debug)]
pub struct ShardedArray {
    spec: TensorSpec,
    sharding: String,
    devices: Vec<u32>,
    shards: Vec<Tensor>,
}

impl ShardedArray {
    /// Puts the global array `values` (row-major, of `dims`) on `devices` as `sharding` lays
    /// it out: one tensor per device, in that order.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) when
    /// `values.len()` is not the product of `dims` (checked here) or for a sharding that does
    /// not parse, tile this rank or name exactly `devices.len()` devices;
    /// [`ErrorKind::PermissionDenied`](crate::ErrorKind::PermissionDenied) for a device the
    /// guest was not placed on; [`ErrorKind::ResourceExhausted`](crate::ErrorKind::ResourceExhausted)
    /// naming the limit.
    pub fn from_slice<T: Element>(
        values: &[T],
        dims: &[u64],
        sharding: &str,
        devices: &[u32],
    ) -> Result<Self> {
        let want = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if want != Some(values.len() as u64) {
            return Err(Error::invalid_argument(format!(
                "{} value(s) given for dims {dims:?}",
                values.len()
            )));
        }
        Self::from_bytes(T::DTYPE, dims, &crate::encode(values), sharding, devices)
    }

    /// Like [`ShardedArray::from_slice`], from row-major little-endian bytes of `dtype`.
    ///
    /// Errors: as [`ShardedArray::from_slice`], the byte length checked by the host.
    pub fn from_bytes(
        dtype: Dtype,
        dims: &[u64],
        bytes: &[u8],
        sharding: &str,
        devices: &[u32],
    ) -> Result<Self> {
        let raws = raw::put(dtype, dims, bytes, sharding, devices)?;
        Ok(ShardedArray {
            spec: TensorSpec {
                dtype,
                dims: dims.to_vec(),
            },
            sharding: sharding.to_string(),
            devices: devices.to_vec(),
            shards: raws.into_iter().map(Tensor::from_raw).collect(),
        })
    }

    /// Assembles a sharded array from tensors already on the devices: `shards[k]` holds
    /// logical device `k`'s part (on `devices[k]`, of the sharding's tile dims). Nothing is
    /// checked until the array is read or passed to a program, which check every shard.
    pub fn from_shards(
        global: TensorSpec,
        sharding: &str,
        devices: Vec<u32>,
        shards: Vec<Tensor>,
    ) -> Self {
        ShardedArray {
            spec: global,
            sharding: sharding.to_string(),
            devices,
            shards,
        }
    }

    /// The global array's dtype and dims.
    pub fn spec(&self) -> &TensorSpec {
        &self.spec
    }

    /// The sharding, in XLA's text form.
    pub fn sharding(&self) -> &str {
        &self.sharding
    }

    /// The devices the shards are on, in the sharding's logical order.
    pub fn devices(&self) -> &[u32] {
        &self.devices
    }

    /// The per-device tensors, in the order of [`ShardedArray::devices`].
    pub fn shards(&self) -> &[Tensor] {
        &self.shards
    }

    /// The per-device tensors, taken out.
    pub fn into_shards(self) -> Vec<Tensor> {
        self.shards
    }

    /// Reads the global array back as row-major bytes (each part from the first device that
    /// holds it).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for shards
    /// that do not match the spec, sharding and devices;
    /// [`ErrorKind::ResourceExhausted`](crate::ErrorKind::ResourceExhausted) naming
    /// `max-guest-memory` for an array larger than the guest may read; a launch's error.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let raws: Vec<&raw_types::Tensor> = self.shards.iter().map(|t| t.as_raw()).collect();
        Ok(raw::read(&self.spec, &self.sharding, &self.devices, &raws)?)
    }

    /// Reads the global array back as values of `T`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) when `T` is
    /// not the array's dtype (checked here); as [`ShardedArray::to_bytes`].
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.spec.dtype {
            return Err(Error::invalid_argument(format!(
                "the array is {}, not {}",
                self.spec.dtype,
                T::DTYPE
            )));
        }
        crate::decode(&self.to_bytes()?)
    }
}

/// A program compiled for several devices at once, with its layout (devices, parameter and
/// result shardings).
#[derive(Debug)]
pub struct ShardedExecutable {
    exe: Executable,
    layout: ProgramLayout,
}

impl ShardedExecutable {
    /// Compiles `code` for `devices` (its logical order: entry `k` runs partition `k`); the
    /// module's `mhlo.num_partitions` must be `devices.len()`.
    ///
    /// Errors: [`ErrorKind::PermissionDenied`](crate::ErrorKind::PermissionDenied) for a device
    /// the guest was not placed on; [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument)
    /// for no devices, one given twice, or a module declaring another partition count;
    /// [`ErrorKind::CompileFailed`](crate::ErrorKind::CompileFailed) with the compiler's message,
    /// also for shardings that do not fit the number of devices.
    pub fn compile(format: ProgramFormat, code: &[u8], devices: &[u32]) -> Result<Self> {
        if code.is_empty() {
            return Err(Error::invalid_argument("program is empty"));
        }
        let raw_exe = raw::compile(format, code, devices)?;
        let layout = raw::describe(&raw_exe)?;
        Ok(ShardedExecutable {
            exe: Executable::from_raw(raw_exe),
            layout,
        })
    }

    /// [`ShardedExecutable::compile`] of MLIR text.
    ///
    /// Errors: as [`ShardedExecutable::compile`].
    pub fn compile_mlir(text: &str, devices: &[u32]) -> Result<Self> {
        Self::compile(ProgramFormat::MlirText, text.as_bytes(), devices)
    }

    /// The devices, and the global spec and sharding of each parameter and result.
    pub fn layout(&self) -> &ProgramLayout {
        &self.layout
    }

    /// The program on its first device (its per-device specs: [`Executable::inputs`],
    /// [`Executable::outputs`]; its fingerprint).
    pub fn executable(&self) -> &Executable {
        &self.exe
    }

    /// Puts the global array `values` as parameter `param` takes it: its global dims and
    /// sharding, over the program's devices.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for a
    /// parameter the program lacks or values of another dtype or count (checked here); as
    /// [`ShardedArray::from_slice`].
    pub fn put<T: Element>(&self, param: usize, values: &[T]) -> Result<ShardedArray> {
        let p = self.layout.parameters.get(param).ok_or_else(|| {
            Error::invalid_argument(format!(
                "the program has {} parameter(s), not {}",
                self.layout.parameters.len(),
                param + 1
            ))
        })?;
        if T::DTYPE != p.global.dtype {
            return Err(Error::invalid_argument(format!(
                "parameter {param} is {}, not {}",
                p.global.dtype,
                T::DTYPE
            )));
        }
        ShardedArray::from_slice(values, &p.global.dims, &p.sharding, &self.layout.devices)
    }

    /// Runs the program on all its devices at once with `args` (one sharded array per
    /// parameter, over the program's devices) and returns one sharded array per result.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for a wrong
    /// argument count (checked here) or a shard whose dtype or dims are not its partition's;
    /// [`ErrorKind::FailedPrecondition`](crate::ErrorKind::FailedPrecondition) for a donated
    /// shard or one on another device than its partition's;
    /// [`ErrorKind::ResourceExhausted`](crate::ErrorKind::ResourceExhausted) naming the limit;
    /// [`ErrorKind::ExecutionFailed`](crate::ErrorKind::ExecutionFailed).
    pub fn call(&self, args: &[&ShardedArray]) -> Result<Vec<ShardedArray>> {
        self.call_donating(args, &[])
    }

    /// Like [`ShardedExecutable::call`], donating every shard of the parameters at positions
    /// `donate`.
    ///
    /// Errors: as [`ShardedExecutable::call`].
    pub fn call_donating(
        &self,
        args: &[&ShardedArray],
        donate: &[u32],
    ) -> Result<Vec<ShardedArray>> {
        if args.len() != self.layout.parameters.len() {
            return Err(Error::invalid_argument(format!(
                "executable takes {} argument(s) but {} were given",
                self.layout.parameters.len(),
                args.len()
            )));
        }
        let raw_args: Vec<Vec<&raw_types::Tensor>> = args
            .iter()
            .map(|a| a.shards.iter().map(|t| t.as_raw()).collect())
            .collect();
        let outs = raw::execute(self.exe.as_raw(), &raw_args, donate)?;
        Ok(outs
            .into_iter()
            .zip(&self.layout.results)
            .map(|(shards, r)| ShardedArray {
                spec: r.global.clone(),
                sharding: r.sharding.clone(),
                devices: self.layout.devices.clone(),
                shards: shards.into_iter().map(Tensor::from_raw).collect(),
            })
            .collect())
    }
}
