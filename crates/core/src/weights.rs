//! Named weight sets: tensors the host loads onto the device once and shares, read-only, with
//! every guest that opens them by name.
//!
//! A set is loaded from a safetensors file (the `safetensors` crate over a read-only memory map,
//! see <https://github.com/huggingface/safetensors> for the format). Guests receive
//! `Arc<DeviceTensor>` handles marked read-only, so all guests and tenants share one device copy
//! and none can donate or overwrite it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, RwLock};

use pjrt::{MappedFile, PrimitiveType};
use safetensors::{Dtype, SafeTensors};

use crate::device::{DeviceService, DeviceTensor};
use crate::error::{DeviceError, DeviceResult, ErrorKind};

/// One named set of read-only, device-resident tensors.
#[derive(Debug)]
pub struct WeightSet {
    name: String,
    tensors: BTreeMap<String, Arc<DeviceTensor>>,
    device_bytes: u64,
}

impl WeightSet {
    /// The set's name (as given to `--weights NAME=PATH`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the set holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Total dense size of the tensors on the device, in bytes.
    pub fn device_bytes(&self) -> u64 {
        self.device_bytes
    }

    /// The tensor `name`.
    ///
    /// Errors: `not-found` naming the set and the tensor.
    pub fn get(&self, name: &str) -> DeviceResult<&Arc<DeviceTensor>> {
        self.tensors.get(name).ok_or_else(|| {
            DeviceError::new(
                ErrorKind::NotFound,
                format!("weight set `{}` has no tensor `{name}`", self.name),
            )
        })
    }
}

/// The host's weight sets by name. Shared by all guests (`Arc`), `Send + Sync`.
#[derive(Debug, Default)]
pub struct WeightRegistry {
    sets: RwLock<BTreeMap<String, Arc<WeightSet>>>,
}

/// The XLA element type of a safetensors dtype; `None` for one XLA lacks (the F8 variants and
/// the other types safetensors has and XLA does not).
pub fn xla_type(d: Dtype) -> Option<PrimitiveType> {
    Some(match d {
        Dtype::BOOL => PrimitiveType::Pred,
        Dtype::U8 => PrimitiveType::U8,
        Dtype::I8 => PrimitiveType::S8,
        Dtype::I16 => PrimitiveType::S16,
        Dtype::U16 => PrimitiveType::U16,
        Dtype::I32 => PrimitiveType::S32,
        Dtype::U32 => PrimitiveType::U32,
        Dtype::I64 => PrimitiveType::S64,
        Dtype::U64 => PrimitiveType::U64,
        Dtype::F16 => PrimitiveType::F16,
        Dtype::BF16 => PrimitiveType::Bf16,
        Dtype::F32 => PrimitiveType::F32,
        Dtype::F64 => PrimitiveType::F64,
        // Two little-endian f32s, real part first: XLA's C64 layout.
        Dtype::C64 => PrimitiveType::C64,
        _ => return None,
    })
}

/// Reads the safetensors file at `path` onto device `device_index` as a set named `name`
/// (not registered).
fn read_set(
    device: &DeviceService,
    name: &str,
    path: &Path,
    device_index: u32,
) -> DeviceResult<WeightSet> {
    if name.is_empty() {
        return Err(DeviceError::invalid("a weight set needs a non-empty name"));
    }
    if path.is_dir() {
        return Err(DeviceError::invalid(format!(
            "{} is a directory; pass the .safetensors file inside it",
            path.display()
        )));
    }
    if !path.exists() {
        return Err(DeviceError::new(
            ErrorKind::NotFound,
            format!("{} does not exist", path.display()),
        ));
    }
    let map = MappedFile::open(path)
        .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::InvalidArgument))?;
    let st = SafeTensors::deserialize(map.as_slice()).map_err(|e| {
        DeviceError::invalid(format!(
            "{} is not a valid safetensors file: {e}",
            path.display()
        ))
    })?;
    let mut tensors = BTreeMap::new();
    let mut device_bytes = 0u64;
    for (tname, view) in st.tensors() {
        let ty = xla_type(view.dtype()).ok_or_else(|| {
            DeviceError::new(
                ErrorKind::Unsupported,
                format!(
                    "tensor `{tname}` has dtype {:?}, which has no XLA type here",
                    view.dtype()
                ),
            )
        })?;
        let dims: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = device.tensor_from_bytes(ty, &dims, view.data(), device_index)?;
        device_bytes += t.byte_size();
        tensors.insert(tname, Arc::new(t));
    }
    Ok(WeightSet {
        name: name.to_string(),
        tensors,
        device_bytes,
    })
}

impl WeightRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Loads every tensor of the safetensors file at `path` onto device `device` and registers
    /// the set as `name`.
    ///
    /// Errors: `invalid-argument` for an empty or already used name or a malformed file;
    /// `not-found` for a missing file; `unsupported` for a dtype XLA lacks (e.g. F8 variants);
    /// errors of [`DeviceService::tensor_from_bytes`].
    pub fn load_safetensors(
        &self,
        device: &DeviceService,
        name: &str,
        path: &Path,
        device_index: u32,
    ) -> DeviceResult<Arc<WeightSet>> {
        if self.sets.read().expect("registry lock").contains_key(name) {
            return Err(DeviceError::invalid(format!(
                "a weight set named `{name}` is already loaded"
            )));
        }
        let set = Arc::new(read_set(device, name, path, device_index)?);
        let mut sets = self.sets.write().expect("registry lock");
        if sets.contains_key(name) {
            return Err(DeviceError::invalid(format!(
                "a weight set named `{name}` is already loaded"
            )));
        }
        sets.insert(name.to_string(), Arc::clone(&set));
        Ok(set)
    }

    /// Loads the safetensors file at `path` again as the set `name`, replacing the set of that
    /// name if there is one (or registering it if not). The old set's tensors stay alive, and
    /// unchanged, for whoever opened them; every later [`WeightRegistry::get`] returns the new
    /// set. The registry keeps the old set until the new one has loaded, so a failed reload
    /// changes nothing.
    ///
    /// Errors: as [`WeightRegistry::load_safetensors`], except that the name may be in use.
    pub fn reload_safetensors(
        &self,
        device: &DeviceService,
        name: &str,
        path: &Path,
        device_index: u32,
    ) -> DeviceResult<Arc<WeightSet>> {
        let set = Arc::new(read_set(device, name, path, device_index)?);
        self.sets
            .write()
            .expect("registry lock")
            .insert(name.to_string(), Arc::clone(&set));
        Ok(set)
    }

    /// Names of the loaded sets, sorted.
    pub fn names(&self) -> Vec<String> {
        self.sets
            .read()
            .expect("registry lock")
            .keys()
            .cloned()
            .collect()
    }

    /// The set `name`.
    ///
    /// Errors: `not-found`, listing the names offered.
    pub fn get(&self, name: &str) -> DeviceResult<Arc<WeightSet>> {
        let sets = self.sets.read().expect("registry lock");
        sets.get(name).cloned().ok_or_else(|| {
            let offered: Vec<&str> = sets.keys().map(String::as_str).collect();
            DeviceError::new(
                ErrorKind::NotFound,
                if offered.is_empty() {
                    format!("no weight set named `{name}`: the host was started without weights (`--weights {name}=FILE.safetensors` on `tpubox run` or `tpubox serve`)")
                } else {
                    format!("no weight set named `{name}`; the host offers: {}", offered.join(", "))
                },
            )
        })
    }
}
