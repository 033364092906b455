//! Triton's system shared-memory extension: a client on the daemon's machine registers a POSIX
//! shared-memory object (`shm_open(3)`: a file under `/dev/shm`) as a named region; inputs are
//! then read from, and outputs written to, slices of it named by the `shared_memory_region`,
//! `shared_memory_offset` and `shared_memory_byte_size` parameters instead of travelling in the
//! request and response.
//!
//! The client owns the object and may truncate or unlink it at any moment, so the daemon never
//! maps it: it reads and writes with `pread`/`pwrite` (bounded to the registered slice, a
//! short read is a 400), so a truncated object is an error for the one request and never a
//! `SIGBUS`. Unlinking is harmless: the daemon holds the descriptor it opened at registration.
//!
//! Regions belong to the tenant that registered them: names are per tenant (another tenant's
//! region is "unknown"), and with a tokens file a tenant may register only keys that start with
//! `/<tenant>-` (e.g. `/alice-input0`), so that no tenant can register, read or overwrite an
//! object another tenant's process created under its own prefix. At most
//! [`MAX_REGIONS_PER_TENANT`] regions per tenant (each holds a descriptor). CUDA shared memory
//! is refused: no device memory is shared with clients.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use super::error::{ServeError, ServeErrorKind, ServeResult};
use super::protocol::{InferRequest, InferResponse, RequestedOutput, ShmRef, bytes_element_count};

/// Most regions one tenant may have registered at once.
pub const MAX_REGIONS_PER_TENANT: usize = 64;

/// Where POSIX shared-memory objects live on Linux (`shm_overview(7)`).
pub const SHM_DIR: &str = "/dev/shm";

/// Longest region name and key, in bytes.
const MAX_NAME_BYTES: usize = 255;

/// One registered region.
#[derive(Debug)]
pub struct Region {
    /// Its name, as the tenant registered it.
    pub name: String,
    /// The shared-memory key (`/NAME` of `shm_open`).
    pub key: String,
    /// Where the region starts in the object, in bytes.
    pub offset: u64,
    /// Its size, in bytes.
    pub byte_size: u64,
    file: File,
}

/// A region as the status call lists it (Triton's field names).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RegionStatus {
    /// Its name.
    pub name: String,
    /// Its key.
    pub key: String,
    /// Its offset in the object, bytes.
    pub offset: u64,
    /// Its size, bytes.
    pub byte_size: u64,
}

fn unknown_region(name: &str) -> ServeError {
    ServeError::bad_request(format!(
        "Unable to find system shared memory region: '{name}'"
    ))
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME_BYTES
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

impl Region {
    /// The object's bytes `[at, at + len)` of the slice `r` of this region.
    ///
    /// Errors: bad request when the slice is not inside the region, or the object is now
    /// shorter than the slice (the client truncated it).
    fn read(&self, r: &ShmRef) -> ServeResult<Vec<u8>> {
        let start = self.slice_start(r)?;
        let len = usize::try_from(r.byte_size)
            .map_err(|_| ServeError::bad_request("shared-memory slice too large"))?;
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, start).map_err(|e| {
            ServeError::bad_request(format!(
                "shared-memory region '{}' ({}): cannot read {} bytes at {}: {e} (was the object truncated?)",
                self.name, self.key, r.byte_size, start
            ))
        })?;
        Ok(buf)
    }

    /// Writes `data` at the start of the slice `r`.
    ///
    /// Errors: bad request when `data` is longer than the slice or the slice is not inside
    /// the region; a write that fails (a truncated object grows again on write: that is the
    /// client's own object, never another's).
    fn write(&self, r: &ShmRef, data: &[u8]) -> ServeResult<()> {
        let start = self.slice_start(r)?;
        if data.len() as u64 > r.byte_size {
            return Err(ServeError::bad_request(format!(
                "output needs {} bytes, but its shared-memory slice of region '{}' has {}",
                data.len(),
                self.name,
                r.byte_size
            )));
        }
        // The object may have been truncated: never grow it past what was registered.
        let len = self.file.metadata().map(|m| m.len()).unwrap_or(0);
        if start.saturating_add(data.len() as u64) > len {
            return Err(ServeError::bad_request(format!(
                "shared-memory region '{}' ({}) is now {len} bytes, shorter than the slice written (was the object truncated?)",
                self.name, self.key
            )));
        }
        self.file.write_all_at(data, start).map_err(|e| {
            ServeError::bad_request(format!(
                "shared-memory region '{}' ({}): cannot write: {e}",
                self.name, self.key
            ))
        })
    }

    /// The object offset where the slice `r` starts.
    ///
    /// Errors: bad request for a slice that does not fit in the region.
    fn slice_start(&self, r: &ShmRef) -> ServeResult<u64> {
        let end = r.offset.checked_add(r.byte_size);
        if end.is_none_or(|e| e > self.byte_size) {
            return Err(ServeError::bad_request(format!(
                "shared-memory slice [{}, +{}) is outside region '{}' of {} bytes",
                r.offset, r.byte_size, self.name, self.byte_size
            )));
        }
        Ok(self.offset + r.offset)
    }
}

/// The regions of every tenant.
#[derive(Debug, Default)]
pub struct Regions {
    by_tenant: Mutex<HashMap<String, BTreeMap<String, Arc<Region>>>>,
}

impl Regions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, BTreeMap<String, Arc<Region>>>> {
        self.by_tenant.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers the object `key` (`/NAME`) from `offset` for `byte_size` bytes as `tenant`'s
    /// region `name`. `key_prefix` is the prefix the tenant's keys must have (`None`: any
    /// key, for a daemon without a tokens file).
    ///
    /// Errors: bad request for a bad name or key, a key outside the tenant's prefix, an object
    /// that does not exist, is not a regular file (symbolic links are not followed) or is
    /// shorter than `offset + byte_size`, a name the tenant already registered; too many
    /// requests (limit `max-shared-memory-regions`) past [`MAX_REGIONS_PER_TENANT`].
    pub fn register(
        &self,
        tenant: &str,
        key_prefix: Option<&str>,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> ServeResult<()> {
        if !valid_name(name) {
            return Err(ServeError::bad_request(format!(
                "shared-memory region name `{}` must be 1 to {MAX_NAME_BYTES} letters, digits, `_`, `-` or `.`",
                name.chars().take(64).collect::<String>()
            )));
        }
        let object = key.strip_prefix('/').unwrap_or(key);
        if !valid_name(object) || object.starts_with('.') {
            return Err(ServeError::bad_request(format!(
                "shared-memory key `{}` must be `/` and a name of letters, digits, `_`, `-`, `.` (as shm_open takes it)",
                key.chars().take(64).collect::<String>()
            )));
        }
        if let Some(p) = key_prefix
            && !key.starts_with(p)
        {
            return Err(ServeError::new(
                ServeErrorKind::Forbidden,
                format!(
                    "tenant `{tenant}` may register only shared-memory keys that start with `{p}`, not `{key}`"
                ),
            ));
        }
        let end = offset
            .checked_add(byte_size)
            .ok_or_else(|| ServeError::bad_request("offset + byte_size overflows"))?;
        let path = PathBuf::from(SHM_DIR).join(object);
        let fd = rustix::fs::open(
            &path,
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(|e| {
            ServeError::bad_request(format!(
                "Unable to open shared memory region: '{}': {e}",
                tpubox_core::logsafe::clip(key)
            ))
        })?;
        let file = File::from(fd);
        let meta = file
            .metadata()
            .map_err(|e| ServeError::bad_request(format!("shared-memory key `{key}`: {e}")))?;
        if !meta.is_file() {
            return Err(ServeError::bad_request(format!(
                "shared-memory key `{key}` is not a shared-memory object"
            )));
        }
        if meta.len() < end {
            return Err(ServeError::bad_request(format!(
                "shared-memory key `{key}` is {} bytes, shorter than offset {offset} + byte_size {byte_size}",
                meta.len()
            )));
        }
        let mut all = self.lock();
        let mine = all.entry(tenant.to_string()).or_default();
        if mine.contains_key(name) {
            return Err(ServeError::bad_request(format!(
                "shared memory region '{name}' already in manager"
            )));
        }
        if mine.len() >= MAX_REGIONS_PER_TENANT {
            return Err(ServeError::limited(
                "max-shared-memory-regions",
                format!(
                    "tenant `{tenant}` has {MAX_REGIONS_PER_TENANT} shared-memory regions registered, the most it may; unregister one first"
                ),
            ));
        }
        mine.insert(
            name.to_string(),
            Arc::new(Region {
                name: name.to_string(),
                key: key.to_string(),
                offset,
                byte_size,
                file,
            }),
        );
        Ok(())
    }

    /// Unregisters `tenant`'s region `name`, or all of its regions. A request using one
    /// finishes with it (it holds its own reference).
    ///
    /// Errors: none (Triton's unregister of an unknown name succeeds).
    pub fn unregister(&self, tenant: &str, name: Option<&str>) {
        let mut all = self.lock();
        match name {
            Some(n) => {
                if let Some(m) = all.get_mut(tenant) {
                    m.remove(n);
                }
            }
            None => {
                all.remove(tenant);
            }
        }
    }

    /// `tenant`'s regions (or its region `name`).
    ///
    /// Errors: bad request for a name it has not registered.
    pub fn status(&self, tenant: &str, name: Option<&str>) -> ServeResult<Vec<RegionStatus>> {
        let all = self.lock();
        let empty = BTreeMap::new();
        let mine = all.get(tenant).unwrap_or(&empty);
        let row = |r: &Arc<Region>| RegionStatus {
            name: r.name.clone(),
            key: r.key.clone(),
            offset: r.offset,
            byte_size: r.byte_size,
        };
        match name {
            Some(n) => mine
                .get(n)
                .map(|r| vec![row(r)])
                .ok_or_else(|| unknown_region(n)),
            None => Ok(mine.values().map(row).collect()),
        }
    }

    fn get(&self, tenant: &str, name: &str) -> ServeResult<Arc<Region>> {
        self.lock()
            .get(tenant)
            .and_then(|m| m.get(name))
            .cloned()
            .ok_or_else(|| unknown_region(name))
    }

    /// Fills the inputs of `req` that are in shared memory, each read whole from `tenant`'s
    /// region; at most `budget` bytes in all (the request-size limit: a request is as large
    /// as the bytes it names).
    ///
    /// Errors: bad request for an unknown region, a slice outside its region, a truncated
    /// object, a slice whose size the input's shape and datatype do not match; payload too
    /// large past `budget`.
    pub fn read_inputs(
        &self,
        tenant: &str,
        req: &mut InferRequest,
        budget: usize,
    ) -> ServeResult<()> {
        let mut total: u64 = 0;
        for (i, r) in std::mem::take(&mut req.shm_inputs) {
            total = total.saturating_add(r.byte_size);
            if total > budget as u64 {
                return Err(ServeError::new(
                    ServeErrorKind::PayloadTooLarge,
                    format!(
                        "the request's shared-memory inputs add up to more than {budget} bytes (--max-request-mib)"
                    ),
                ));
            }
            let region = self.get(tenant, &r.region)?;
            let Some(t) = req.inputs.get_mut(i) else {
                continue;
            };
            t.data = region.read(&r)?;
            if t.datatype.element_size().is_none() {
                bytes_element_count(&t.data).map_err(|e| {
                    ServeError::bad_request(format!("input `{}` (shared memory): {e}", t.name))
                })?;
            }
            t.check()?;
        }
        Ok(())
    }

    /// Writes the outputs `outputs` asks into shared memory from `resp` into `tenant`'s
    /// regions, leaving their data empty in the response and recording each in
    /// `resp.shm_outputs` with the bytes written.
    ///
    /// Errors: bad request for an unknown region, a slice outside its region or smaller than
    /// the output, a truncated object.
    pub fn write_outputs(
        &self,
        tenant: &str,
        outputs: &[RequestedOutput],
        resp: &mut InferResponse,
    ) -> ServeResult<()> {
        for o in outputs {
            let Some(r) = &o.shm else {
                continue;
            };
            let Some(t) = resp.outputs.iter_mut().find(|t| t.name == o.name) else {
                continue;
            };
            let region = self.get(tenant, &r.region)?;
            region.write(r, &t.data)?;
            let written = t.data.len() as u64;
            t.data = Vec::new();
            resp.shm_outputs.push((
                t.name.clone(),
                ShmRef {
                    region: r.region.clone(),
                    offset: r.offset,
                    byte_size: written,
                },
            ));
        }
        Ok(())
    }
}
