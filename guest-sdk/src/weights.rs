//! Read-only weights the host loaded once and shares between guests.
//!
//! The host is started with named weight sets (`tpubox run --weights NAME=FILE.safetensors`).
//! [`WeightSet::open`] opens one; [`WeightSet::get`] returns a device-resident [`Tensor`] without
//! copying anything through guest memory. Weight tensors are read-only: passing them to
//! [`Executable::call`](crate::Executable::call) is free, donating them fails with
//! [`ErrorKind::PermissionDenied`](crate::ErrorKind::PermissionDenied).
//!
//! ```no_run
//! use tpubox_guest::weights::WeightSet;
//! let w = WeightSet::open("minilm")?;
//! let emb = w.get("embeddings.word_embeddings.weight")?; // f32[30522,384], on the device
//! assert_eq!(emb.dims(), &[30522, 384]);
//! # Ok::<(), tpubox_guest::Error>(())
//! ```

use crate::bindings::tpubox::device::weights as raw;
use crate::{Result, Tensor, TensorSpec};

/// An opened weight set.
pub struct WeightSet {
    raw: raw::WeightSet,
    name: String,
}

/// Names of the weight sets the host offers, sorted.
pub fn available() -> Vec<String> {
    raw::available()
}

/// The latest version of the weight set `name` (0 once unpublished) and every version the
/// host holds now, ascending.
///
/// Errors: [`ErrorKind::NotFound`](crate::ErrorKind::NotFound) for an unknown name.
pub fn versions(name: &str) -> Result<(u64, Vec<u64>)> {
    Ok(raw::versions(name)?)
}

/// Publishes `tensors` (name, tensor) as the next version of the weight set `name`, readable
/// by this guest's tenant and the tenants in `readers` (`"*"`: every tenant); returns the
/// version. Nothing is copied: the version shares the tensors' device buffers, and they become
/// read-only for everyone (donating one fails with
/// [`ErrorKind::PermissionDenied`](crate::ErrorKind::PermissionDenied)).
///
/// Errors: `PermissionDenied` when the tenant may not publish or the name is taken by the
/// host or another tenant; `ResourceExhausted` naming `max-published-bytes` or
/// `max-published-versions`; `FailedPrecondition` for a donated tensor; `InvalidArgument`.
pub fn publish(name: &str, tensors: &[(&str, &Tensor)], readers: &[&str]) -> Result<u64> {
    let list: Vec<(String, &crate::bindings::tpubox::device::types::Tensor)> = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), t.as_raw()))
        .collect();
    let readers: Vec<String> = readers.iter().map(|r| r.to_string()).collect();
    Ok(raw::publish(name, &list, &readers)?)
}

impl WeightSet {
    /// Opens the weight set `name`.
    ///
    /// Errors: [`ErrorKind::NotFound`](crate::ErrorKind::NotFound) when the host has no such set
    /// (the message lists the names it offers).
    pub fn open(name: &str) -> Result<WeightSet> {
        Ok(WeightSet {
            raw: raw::open(name)?,
            name: name.to_string(),
        })
    }

    /// Opens version `version` of the weight set `name`.
    ///
    /// Errors: [`ErrorKind::NotFound`](crate::ErrorKind::NotFound) for an unknown name or a
    /// version the host no longer holds.
    pub fn open_version(name: &str, version: u64) -> Result<WeightSet> {
        Ok(WeightSet {
            raw: raw::open_version(name, version)?,
            name: name.to_string(),
        })
    }

    /// The version this handle opened (1 for a set's first load or publish).
    pub fn version(&self) -> u64 {
        self.raw.version()
    }

    /// The name the set was opened with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Names of the tensors in the set, sorted.
    pub fn names(&self) -> Vec<String> {
        self.raw.names()
    }

    /// Element type and dims of tensor `name`.
    ///
    /// Errors: [`ErrorKind::NotFound`](crate::ErrorKind::NotFound) for an unknown tensor name.
    pub fn spec(&self, name: &str) -> Result<TensorSpec> {
        Ok(self.raw.spec(name)?)
    }

    /// A read-only, device-resident handle to tensor `name`.
    ///
    /// Errors: [`ErrorKind::NotFound`](crate::ErrorKind::NotFound) for an unknown tensor name.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        Ok(Tensor::from_raw(self.raw.get(name)?))
    }

    /// The raw WIT resource.
    pub fn as_raw(&self) -> &raw::WeightSet {
        &self.raw
    }
}
