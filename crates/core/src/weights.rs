//! Named weight sets: tensors on the device that many sessions share, read-only, by name.
//!
//! Two kinds of set share one namespace and one registry:
//!
//! - **Host sets**, loaded from a safetensors file (`--weights NAME=FILE`; the `safetensors`
//!   crate over a read-only memory map, see <https://github.com/huggingface/safetensors> for the
//!   format), offered to every tenant.
//! - **Published sets** ([`WeightRegistry::publish`]): a tenant's session makes a *version* of a
//!   named set from device tensors it holds. The version shares those PJRT buffers (no copy
//!   through the host, no second copy on the device) and marks them published: nobody may
//!   donate them from then on. Readers are the publisher's own sessions and the tenants it names
//!   (`"*"` for all); to anyone else the name does not exist (`not-found`, as for a name nobody
//!   used).
//!
//! **Versions.** Each name counts its versions 1, 2, 3, … (a host set's reload makes the next);
//! numbers are never reused while the process runs. The registry keeps the latest version of
//! each name; an older version lives while some reader holds it (an [`Arc<WeightSet>`], which
//! every tensor handle opened from it keeps) and is freed with its last holder. A version is
//! immutable: whoever opened it sees the same tensors until they let it go, so a reader never
//! mixes two versions.
//!
//! **Ledger.** A tenant's live published versions are charged, by tenant *name*, to a ledger
//! that outlives its sessions ([`PublishedUsage`]): `max-published-bytes` and
//! `max-published-versions` ([`crate::tenant::TenantLimits`]) bound what it holds, so closing a
//! session and opening another does not reset them. A version's charge returns when it is freed.
//! The ledger counts each version's dense bytes, also for buffers two versions share.
//!
//! Nothing here survives the process: after a restart published names are gone (`not-found`)
//! and numbering starts at 1 again.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock, Weak};

use pjrt::{MappedFile, PrimitiveType};
use safetensors::{Dtype, SafeTensors};

use crate::device::{DeviceService, DeviceTensor};
use crate::error::{DeviceError, DeviceResult, ErrorKind};

/// One version of a named set of read-only, device-resident tensors.
#[derive(Debug)]
pub struct WeightSet {
    name: String,
    version: u64,
    tensors: BTreeMap<String, Arc<DeviceTensor>>,
    device_bytes: u64,
    /// The publishing tenant; `None` for a host set.
    publisher: Option<String>,
    /// Tenants besides the publisher that may open it (`"*"`: all).
    readers: Vec<String>,
    /// The publisher's ledger charge, returned when the version is freed.
    _ledger: Option<LedgerCharge>,
    /// Copies of tensors on devices other than the one they were loaded on, made on first use
    /// by a session placed there ([`WeightSet::get_on`]) and shared like the originals.
    replicas: Mutex<BTreeMap<(String, u32), Arc<DeviceTensor>>>,
}

impl WeightSet {
    /// The set's name (as given to `--weights NAME=PATH`, or to `publish`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The version: 1 for a set's first load or publish, one more for each later one.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The tenant that published it; `None` for a host set.
    pub fn publisher(&self) -> Option<&str> {
        self.publisher.as_deref()
    }

    /// Whether tenant `tenant` may open it: every tenant for a host set; for a published one
    /// the publisher and the readers it named (`"*"` for all).
    pub fn may_read(&self, tenant: &str) -> bool {
        match &self.publisher {
            None => true,
            Some(p) => p == tenant || self.readers.iter().any(|r| r == "*" || r == tenant),
        }
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

    /// The tensor `name` on device `device`: the loaded tensor when it is there, otherwise a
    /// copy made once per device (device to device, held by the set for every session placed
    /// there, charged to nobody, as the original is) and shared from then on.
    ///
    /// Errors: `not-found` naming the set and the tensor, or for an unknown device; plugin
    /// errors from the copy.
    pub fn get_on(
        &self,
        name: &str,
        device: u32,
        service: &DeviceService,
    ) -> DeviceResult<Arc<DeviceTensor>> {
        let t = self.get(name)?;
        if t.device() == device {
            return Ok(Arc::clone(t));
        }
        // The map holds finished copies only; consistent after any panic.
        let mut replicas = self.replicas.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = replicas.get(&(name.to_string(), device)) {
            return Ok(Arc::clone(r));
        }
        let copy = Arc::new(service.copy_to_device(t, device)?);
        replicas.insert((name.to_string(), device), Arc::clone(&copy));
        Ok(copy)
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

/// What a tenant's live published versions hold: the ledger entry that
/// `max-published-bytes` and `max-published-versions` bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublishedUsage {
    /// Dense device bytes of the live versions, summed per version.
    pub bytes: u64,
    /// Live versions (latest ones and those readers still hold).
    pub versions: u64,
}

type Ledger = Arc<Mutex<HashMap<String, PublishedUsage>>>;

fn lock_ledger(l: &Ledger) -> std::sync::MutexGuard<'_, HashMap<String, PublishedUsage>> {
    // The map holds plain counters, consistent after any panic.
    l.lock().unwrap_or_else(|p| p.into_inner())
}

/// One version's charge to its publisher's ledger, returned on drop.
#[derive(Debug)]
struct LedgerCharge {
    ledger: Ledger,
    tenant: String,
    bytes: u64,
}

impl Drop for LedgerCharge {
    fn drop(&mut self) {
        let mut l = lock_ledger(&self.ledger);
        if let Some(u) = l.get_mut(&self.tenant) {
            u.bytes = u.bytes.saturating_sub(self.bytes);
            u.versions = u.versions.saturating_sub(1);
            if u.versions == 0 {
                l.remove(&self.tenant);
            }
        }
    }
}

/// A name's versions.
#[derive(Debug)]
struct Entry {
    /// The version the registry keeps; `None` once unpublished.
    latest: Option<Arc<WeightSet>>,
    /// Every version made, while someone may hold it (dead entries are pruned as found).
    held: BTreeMap<u64, Weak<WeightSet>>,
    /// The number the next version gets.
    next_version: u64,
    /// The tenant that owns the name; `None` for a host set.
    publisher: Option<String>,
}

impl Entry {
    fn new(publisher: Option<String>) -> Self {
        Entry {
            latest: None,
            held: BTreeMap::new(),
            next_version: 1,
            publisher,
        }
    }

    fn install(&mut self, set: Arc<WeightSet>) -> Option<Arc<WeightSet>> {
        self.held.retain(|_, w| w.strong_count() > 0);
        self.held.insert(set.version, Arc::downgrade(&set));
        self.next_version = set.version + 1;
        self.latest.replace(set)
    }

    /// Whether `tenant` may see the name at all (host sets: everyone; published: as the
    /// latest version, or any held one, allows).
    fn visible_to(&self, tenant: &str) -> bool {
        match &self.publisher {
            None => true,
            Some(p) if p == tenant => true,
            Some(_) => self
                .latest
                .iter()
                .cloned()
                .chain(self.held.values().filter_map(Weak::upgrade))
                .any(|s| s.may_read(tenant)),
        }
    }
}

/// Longest name of a published set or of a tensor in it, in bytes.
pub const MAX_PUBLISHED_NAME_BYTES: usize = 256;
/// Most tensors in one published version.
pub const MAX_PUBLISHED_TENSORS: usize = 100_000;
/// Most reader tenants one version names.
pub const MAX_PUBLISHED_READERS: usize = 256;

/// The host's weight sets by name. Shared by all guests (`Arc`), `Send + Sync`.
#[derive(Debug, Default)]
pub struct WeightRegistry {
    sets: RwLock<BTreeMap<String, Entry>>,
    ledger: Ledger,
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
    version: u64,
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
        version,
        tensors,
        device_bytes,
        publisher: None,
        readers: Vec::new(),
        _ledger: None,
        replicas: Mutex::default(),
    })
}

impl WeightRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Entry>> {
        // Entries stay consistent after a panic elsewhere (each change is one insert/replace).
        self.sets.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Entry>> {
        self.sets.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Loads every tensor of the safetensors file at `path` onto device `device` and registers
    /// the set as `name`, version 1.
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
        let taken =
            || DeviceError::invalid(format!("a weight set named `{name}` is already loaded"));
        if self.read().contains_key(name) {
            return Err(taken());
        }
        let set = Arc::new(read_set(device, name, path, device_index, 1)?);
        let mut sets = self.write();
        if sets.contains_key(name) {
            return Err(taken());
        }
        sets.entry(name.to_string())
            .or_insert_with(|| Entry::new(None))
            .install(Arc::clone(&set));
        Ok(set)
    }

    /// Loads the safetensors file at `path` again as the set `name`, as its next version,
    /// replacing the set of that name if there is one (or registering it if not). The old
    /// version's tensors stay alive, and unchanged, for whoever opened them; every later
    /// [`WeightRegistry::get`] returns the new one. The registry keeps the old version until
    /// the new one has loaded, so a failed reload changes nothing.
    ///
    /// Errors: as [`WeightRegistry::load_safetensors`], except that the name may be in use;
    /// `permission-denied` when a tenant published under the name.
    pub fn reload_safetensors(
        &self,
        device: &DeviceService,
        name: &str,
        path: &Path,
        device_index: u32,
    ) -> DeviceResult<Arc<WeightSet>> {
        let version = match self.read().get(name) {
            Some(e) if e.publisher.is_some() => return Err(published_by_tenant(name)),
            Some(e) => e.next_version,
            None => 1,
        };
        let mut set = read_set(device, name, path, device_index, version)?;
        let mut sets = self.write();
        let entry = sets
            .entry(name.to_string())
            .or_insert_with(|| Entry::new(None));
        if entry.publisher.is_some() {
            return Err(published_by_tenant(name));
        }
        // A concurrent reload may have taken the number.
        set.version = set.version.max(entry.next_version);
        let set = Arc::new(set);
        let old = entry.install(Arc::clone(&set));
        drop(sets);
        drop(old);
        Ok(set)
    }

    /// Names of the sets that have a latest version, sorted (host sets and published ones
    /// alike; for what one tenant may see, [`WeightRegistry::names_for`]).
    pub fn names(&self) -> Vec<String> {
        self.read()
            .iter()
            .filter(|(_, e)| e.latest.is_some())
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Names of the sets tenant `tenant` may open that have a latest version, sorted.
    pub fn names_for(&self, tenant: &str) -> Vec<String> {
        self.read()
            .iter()
            .filter(|(_, e)| e.latest.as_ref().is_some_and(|s| s.may_read(tenant)))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The latest version of the set `name`, whoever published it (for the host's own use;
    /// sessions use [`WeightRegistry::open`]).
    ///
    /// Errors: `not-found`, listing the names offered.
    pub fn get(&self, name: &str) -> DeviceResult<Arc<WeightSet>> {
        let sets = self.read();
        match sets.get(name).and_then(|e| e.latest.clone()) {
            Some(s) => Ok(s),
            None => Err(not_found(name, sets.keys().map(String::as_str))),
        }
    }

    /// Version `version` of the set `name` (the latest when `None`), for tenant `reader`.
    ///
    /// Errors: `not-found` for a name `reader` may not see (exactly as for one nobody used,
    /// listing the names it may see), for a set unpublished, and for a version that is freed
    /// (nobody held it after a newer one came) or was never made (the message lists the
    /// versions held now).
    pub fn open(
        &self,
        name: &str,
        version: Option<u64>,
        reader: &str,
    ) -> DeviceResult<Arc<WeightSet>> {
        let sets = self.read();
        let entry = match sets.get(name) {
            Some(e) if e.visible_to(reader) => e,
            _ => {
                let visible = sets
                    .iter()
                    .filter(|(_, e)| e.visible_to(reader))
                    .map(|(n, _)| n.as_str());
                return Err(not_found(name, visible));
            }
        };
        let found = match version {
            None => entry.latest.clone(),
            Some(v) => entry.held.get(&v).and_then(Weak::upgrade),
        };
        match found {
            Some(s) if s.may_read(reader) => Ok(s),
            _ => {
                let held = held_versions(entry);
                let list = if held.is_empty() {
                    "none".to_string()
                } else {
                    held.iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                Err(DeviceError::new(
                    ErrorKind::NotFound,
                    match version {
                        None => format!(
                            "weight set `{name}` has no latest version (it was unpublished); versions held now: {list}"
                        ),
                        Some(v) => format!(
                            "version {v} of weight set `{name}` is not held (a version is freed once no reader holds it and a newer one exists); versions held now: {list}"
                        ),
                    },
                ))
            }
        }
    }

    /// The latest version of `name` (0 once unpublished) and every version held now (the
    /// latest included), ascending, for tenant `reader`.
    ///
    /// Errors: `not-found` as [`WeightRegistry::open`] for a name `reader` may not see.
    pub fn versions(&self, name: &str, reader: &str) -> DeviceResult<(u64, Vec<u64>)> {
        let sets = self.read();
        match sets.get(name) {
            Some(e) if e.visible_to(reader) => {
                Ok((e.latest.as_ref().map_or(0, |s| s.version), held_versions(e)))
            }
            _ => Err(not_found(
                name,
                sets.iter()
                    .filter(|(_, e)| e.visible_to(reader))
                    .map(|(n, _)| n.as_str()),
            )),
        }
    }

    /// Publishes `tensors` (name → device tensor) as the next version of the set `name`, owned
    /// by tenant `publisher` and readable by it and by `readers` (`"*"`: every tenant). The
    /// tensors are shared, not copied, and marked published: read-only for everyone from now
    /// on (donating one is `permission-denied`). The new version becomes the latest at once;
    /// the previous one is freed when no reader holds it.
    ///
    /// The publisher's ledger must stay within `max_published_bytes` and
    /// `max_published_versions` of `limits`, counting the new version and not counting the
    /// previous latest when nobody but the registry holds it (it is freed by this publish).
    ///
    /// Errors: `permission-denied` when `limits.max_published_bytes` is 0 (the tenant may not
    /// publish), for the name of a host set or of another tenant's set; `invalid-argument` for
    /// an empty or over-long name, no tensors, a tensor name empty, over-long or given twice,
    /// too many readers; `resource-exhausted` naming `max-published-bytes` or
    /// `max-published-versions`. On error nothing changed and no tensor was marked.
    pub fn publish(
        &self,
        publisher: &str,
        limits: &crate::tenant::TenantLimits,
        name: &str,
        tensors: Vec<(String, Arc<DeviceTensor>)>,
        readers: &[String],
    ) -> DeviceResult<Arc<WeightSet>> {
        if limits.max_published_bytes == 0 {
            return Err(DeviceError::new(
                ErrorKind::PermissionDenied,
                format!(
                    "tenant `{publisher}` may not publish weights (limit max-published-bytes is 0; the operator allows it with `publish_weights = true` in the tenant's [tenant.session] table)"
                ),
            ));
        }
        check_published_name(name, "a published weight set's name")?;
        if tensors.is_empty() {
            return Err(DeviceError::invalid("publishing needs at least one tensor"));
        }
        if tensors.len() > MAX_PUBLISHED_TENSORS {
            return Err(DeviceError::invalid(format!(
                "{} tensors in one version; at most {MAX_PUBLISHED_TENSORS}",
                tensors.len()
            )));
        }
        if readers.len() > MAX_PUBLISHED_READERS {
            return Err(DeviceError::invalid(format!(
                "{} readers named; at most {MAX_PUBLISHED_READERS}",
                readers.len()
            )));
        }
        for r in readers {
            check_published_name(r, "a reader tenant's name")?;
        }
        let mut map = BTreeMap::new();
        let mut bytes = 0u64;
        for (tname, t) in tensors {
            check_published_name(&tname, "a tensor name")?;
            bytes = bytes.saturating_add(t.byte_size());
            if map.insert(tname.clone(), t).is_some() {
                return Err(DeviceError::invalid(format!(
                    "tensor name `{tname}` is given twice"
                )));
            }
        }
        let mut sets = self.write();
        let entry = sets
            .entry(name.to_string())
            .or_insert_with(|| Entry::new(Some(publisher.to_string())));
        match &entry.publisher {
            None => {
                return Err(DeviceError::new(
                    ErrorKind::PermissionDenied,
                    format!("`{name}` is a weight set the host loaded; publish under another name"),
                ));
            }
            Some(p) if p != publisher => return Err(published_by_tenant(name)),
            Some(_) => {}
        }
        // The previous latest goes with this publish when only the registry holds it.
        let (freed_bytes, freed_versions) = match &entry.latest {
            Some(old) if Arc::strong_count(old) == 1 => (old.device_bytes, 1),
            _ => (0, 0),
        };
        let charge = {
            let mut ledger = lock_ledger(&self.ledger);
            let u = ledger.entry(publisher.to_string()).or_default();
            let after_bytes = u.bytes.saturating_sub(freed_bytes).saturating_add(bytes);
            let after_versions = u.versions.saturating_sub(freed_versions) + 1;
            let refusal = if after_bytes > limits.max_published_bytes {
                Some(format!(
                    "publishing {bytes} bytes would make tenant `{publisher}`'s published versions hold {after_bytes} bytes, over its {} (limit max-published-bytes); readers still hold {} version(s) of {} bytes",
                    limits.max_published_bytes, u.versions, u.bytes
                ))
            } else if after_versions > limits.max_published_versions {
                Some(format!(
                    "tenant `{publisher}` would hold {after_versions} published versions, over its {} (limit max-published-versions): older versions are freed once no reader holds them",
                    limits.max_published_versions
                ))
            } else {
                None
            };
            if let Some(message) = refusal {
                if u.versions == 0 {
                    ledger.remove(publisher);
                }
                drop(ledger);
                if entry.latest.is_none() && entry.held.is_empty() {
                    sets.remove(name);
                }
                return Err(DeviceError::new(ErrorKind::ResourceExhausted, message));
            }
            u.bytes = u.bytes.saturating_add(bytes);
            u.versions += 1;
            LedgerCharge {
                ledger: Arc::clone(&self.ledger),
                tenant: publisher.to_string(),
                bytes,
            }
        };
        for t in map.values() {
            t.mark_published();
        }
        let set = Arc::new(WeightSet {
            name: name.to_string(),
            version: entry.next_version,
            tensors: map,
            device_bytes: bytes,
            publisher: Some(publisher.to_string()),
            readers: readers.to_vec(),
            _ledger: Some(charge),
            replicas: Mutex::default(),
        });
        let old = entry.install(Arc::clone(&set));
        drop(sets);
        // Dropped outside the registry's lock: its ledger charge takes the ledger's.
        drop(old);
        Ok(set)
    }

    /// Ends `publisher`'s set `name`: the registry lets go of its latest version (readers keep
    /// what they hold; the ledger charge returns once they let go). The name stays the
    /// publisher's, and a later publish continues its numbering.
    ///
    /// Errors: `not-found` for a name the tenant cannot see; `permission-denied` for a host set
    /// or another tenant's set.
    pub fn unpublish(&self, publisher: &str, name: &str) -> DeviceResult<()> {
        let mut sets = self.write();
        let old = match sets.get_mut(name) {
            Some(e) if e.publisher.as_deref() == Some(publisher) => e.latest.take(),
            Some(e) if e.visible_to(publisher) => {
                return Err(if e.publisher.is_none() {
                    DeviceError::new(
                        ErrorKind::PermissionDenied,
                        format!("`{name}` is a weight set the host loaded"),
                    )
                } else {
                    published_by_tenant(name)
                });
            }
            _ => {
                let visible: Vec<String> = sets
                    .iter()
                    .filter(|(_, e)| e.visible_to(publisher))
                    .map(|(n, _)| n.clone())
                    .collect();
                return Err(not_found(name, visible.iter().map(String::as_str)));
            }
        };
        drop(sets);
        drop(old);
        Ok(())
    }

    /// What tenant `tenant`'s live published versions hold (its ledger).
    pub fn published_usage(&self, tenant: &str) -> PublishedUsage {
        lock_ledger(&self.ledger)
            .get(tenant)
            .copied()
            .unwrap_or_default()
    }

    /// Every tenant's ledger that holds something, sorted by tenant.
    pub fn published_usages(&self) -> Vec<(String, PublishedUsage)> {
        let mut v: Vec<_> = lock_ledger(&self.ledger)
            .iter()
            .map(|(t, u)| (t.clone(), *u))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

fn held_versions(e: &Entry) -> Vec<u64> {
    e.held
        .iter()
        .filter(|(_, w)| w.strong_count() > 0)
        .map(|(v, _)| *v)
        .collect()
}

fn published_by_tenant(name: &str) -> DeviceError {
    DeviceError::new(
        ErrorKind::PermissionDenied,
        format!("weight set `{name}` is published by another tenant"),
    )
}

/// Checks a name a tenant gives: 1..=[`MAX_PUBLISHED_NAME_BYTES`] bytes with no control
/// characters.
fn check_published_name(name: &str, what: &str) -> DeviceResult<()> {
    if name.is_empty() || name.len() > MAX_PUBLISHED_NAME_BYTES {
        return Err(DeviceError::invalid(format!(
            "{what} must be 1 to {MAX_PUBLISHED_NAME_BYTES} bytes long"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(DeviceError::invalid(format!(
            "{what} may not contain control characters"
        )));
    }
    Ok(())
}

fn not_found<'a>(name: &str, offered: impl Iterator<Item = &'a str>) -> DeviceError {
    let offered: Vec<&str> = offered.collect();
    DeviceError::new(
        ErrorKind::NotFound,
        if offered.is_empty() {
            format!(
                "no weight set named `{name}`: the host was started without weights (`--weights {name}=FILE.safetensors` on `tpubox run` or `tpubox serve`) and nothing is published under that name"
            )
        } else {
            format!(
                "no weight set named `{name}`; the host offers: {}",
                offered.join(", ")
            )
        },
    )
}
