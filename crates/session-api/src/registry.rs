//! The daemon's live sessions: opening them for a tenant, finding one by its token, the
//! handle tables that give a client numbers instead of objects, and every way a session ends
//! (close, idle timeout, its last attached client going away, the daemon stopping).
//!
//! Ending a session drops its handle tables, which returns every charge to its accounting
//! tenant (the session layer's RAII charges); a request still running holds what it uses
//! until it finishes, and what it would have added to the tables is dropped instead.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio::sync::watch;

use super::policy::{RequestedLimits, SessionLimits, SessionPolicy};
use tpubox_core::device::DeviceService;
use tpubox_core::error::{DeviceError, DeviceResult, ErrorKind};
use tpubox_core::placement::{PlacementRequest, TenantDevices};
use tpubox_core::session::{ExecutableHandle, Session, TensorHandle, position_mask};
use tpubox_core::tenant::{Charge, Tenant, TenantUsage};
use tpubox_core::weights::WeightRegistry;

/// Source of handle numbers, shared by every session so that no number is valid in two.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

/// Most handle numbers one [`LiveSession::reserve_handles`] reserves.
pub const MAX_RESERVED_HANDLES: u64 = 1 << 16;

/// Tokens of ended sessions remembered (to say "ended" rather than "unknown").
const ENDED_REMEMBERED: usize = 10_000;

/// Why a session call failed before reaching the session layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessError {
    /// No token, a malformed one, or one nobody issued: `unauthenticated`.
    Unauthenticated(String),
    /// The session this token opened has ended: `session-ended`, with the reason.
    Ended(String),
    /// A session-layer error (a limit, a permission).
    Device(DeviceError),
}

impl From<DeviceError> for AccessError {
    fn from(e: DeviceError) -> Self {
        AccessError::Device(e)
    }
}

/// A session call's result.
pub type AccessResult<T> = Result<T, AccessError>;

#[derive(Debug, Default)]
struct Tables {
    tensors: HashMap<u64, Arc<TensorHandle>>,
    executables: HashMap<u64, Arc<ExecutableHandle>>,
    /// The handle numbers this session reserved and has not used yet, `next..end`
    /// ([`LiveSession::reserve_handles`]).
    reserved: std::ops::Range<u64>,
    /// The memfds lent to the session's local-socket clients, by lease number
    /// ([`LiveSession::lend`]).
    lent: HashMap<u64, LentMemfd>,
    /// The next lease number.
    next_lease: u64,
}

/// A memfd the daemon lent a local-socket client (a `get`'s tensor, a `call`'s fetched
/// results), with the daemon's own descriptor of it and the charge of its bytes to the
/// tenant's transfer pool. Dropping it (the client released it, or the session ended)
/// truncates the memfd to nothing, which frees its pages whether or not the client still
/// holds a descriptor or a map of it (the client's map then faults with `SIGBUS`): so what
/// the daemon lends is bounded by the tenant's limits for as long as it is lent, without
/// trusting the client to give it back. The memfd is sealed against writing and growing,
/// and with `F_SEAL_SEAL`, but not against shrinking, so that the client cannot add that seal.
#[derive(Debug)]
struct LentMemfd {
    fd: std::os::fd::OwnedFd,
    _charge: Charge,
}

impl Drop for LentMemfd {
    fn drop(&mut self) {
        // Frees the pages (shmem truncation unmaps them from every process's map too).
        let _ = rustix::fs::ftruncate(&self.fd, 0);
    }
}

#[derive(Debug)]
struct Liveness {
    last_used: Instant,
    in_flight: u32,
    attached: u32,
}

/// One open session: its session-layer [`Session`], the handle tables, and its liveness.
#[derive(Debug)]
pub struct LiveSession {
    /// Its id (`s-` and 16 hex digits), for logs and clients.
    pub id: String,
    /// The tenant (of the tokens file) that opened it.
    pub tenant_name: String,
    /// What the client called it (e.g. a kernel id).
    pub label: String,
    /// The limits in force.
    pub limits: SessionLimits,
    /// Ends when its last attached client goes away.
    pub end_on_disconnect: bool,
    /// When it was opened.
    pub opened: Instant,
    /// When it was opened, by the wall clock (for operators).
    pub opened_at: std::time::SystemTime,
    session: Session,
    /// How many devices its tenant may use (the size a process group may have).
    tenant_devices: u32,
    key: [u8; 32],
    tables: Mutex<Option<Tables>>,
    live: Mutex<Liveness>,
    ended: watch::Sender<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Poisoning only means a panic elsewhere while it was held; the tables stay usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn ended_error(reason: &str) -> AccessError {
    AccessError::Ended(format!("the session has ended: {reason}"))
}

/// Keeps a session from being idle while a request runs; dropped when it finishes.
pub struct Activity {
    session: Arc<LiveSession>,
}

impl Drop for Activity {
    fn drop(&mut self) {
        let mut l = lock(&self.session.live);
        l.in_flight -= 1;
        l.last_used = Instant::now();
    }
}

impl LiveSession {
    /// The session layer's session (charges, checks, execution slots).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Its accounting tenant.
    pub fn tenant(&self) -> &Arc<Tenant> {
        self.session.tenant()
    }

    /// Why it ended; `None` while open.
    pub fn ended_reason(&self) -> Option<String> {
        self.ended.borrow().clone()
    }

    /// A receiver that sees the reason when the session ends.
    pub fn watch_end(&self) -> watch::Receiver<Option<String>> {
        self.ended.subscribe()
    }

    fn with_tables<T>(&self, f: impl FnOnce(&mut Tables) -> T) -> AccessResult<T> {
        let mut t = lock(&self.tables);
        match t.as_mut() {
            Some(t) => Ok(f(t)),
            None => Err(ended_error(
                &self.ended_reason().unwrap_or_else(|| "closed".into()),
            )),
        }
    }

    /// Lends `fd` (a memfd sealed against writing and growing, not shrinking) to the
    /// session's client until it is released ([`release`](Self::release)) or the session
    /// ends, when it is truncated; `charge` is the charge of its bytes to the tenant's
    /// transfer pool, taken before the memfd was made. Returns the lease number.
    ///
    /// Errors: [`AccessError::Ended`] (the memfd is truncated then); `internal` when the
    /// descriptor cannot be duplicated.
    pub fn lend(&self, fd: &std::os::fd::OwnedFd, charge: Charge) -> AccessResult<u64> {
        let own = fd.try_clone().map_err(|e| {
            DeviceError::new(
                ErrorKind::Internal,
                format!("duplicating a lent memfd: {e}"),
            )
        })?;
        let lent = LentMemfd {
            fd: own,
            _charge: charge,
        };
        self.with_tables(move |t| {
            t.next_lease += 1;
            let n = t.next_lease;
            t.lent.insert(n, lent);
            n
        })
    }

    /// Ends the leases `leases` ([`lend`](Self::lend)): each memfd is truncated and its
    /// charge returned. Returns how many were released and the numbers this session did not
    /// have (released already, or never lent).
    ///
    /// Errors: [`AccessError::Ended`].
    pub fn release(&self, leases: &[u64]) -> AccessResult<(u64, Vec<u64>)> {
        let (gone, unknown) = self.with_tables(|t| {
            let mut gone = Vec::with_capacity(leases.len().min(1024));
            let mut unknown = Vec::new();
            for l in leases {
                match t.lent.remove(l) {
                    Some(m) => gone.push(m),
                    None => unknown.push(*l),
                }
            }
            (gone, unknown)
        })?;
        // Truncated outside the tables' lock.
        let n = gone.len() as u64;
        drop(gone);
        Ok((n, unknown))
    }

    /// Adds a tensor; returns its handle number and the handle. After the session ended the
    /// tensor is dropped (its charge returned) and the call fails with [`AccessError::Ended`].
    pub fn insert_tensor(&self, t: TensorHandle) -> AccessResult<(u64, Arc<TensorHandle>)> {
        let id = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        let t = Arc::new(t);
        self.with_tables(|tables| {
            tables.tensors.insert(id, Arc::clone(&t));
        })?;
        Ok((id, t))
    }

    /// Creates a tensor from dense little-endian bytes and adds it (both front doors' put).
    ///
    /// Errors: as [`Session::tensor_from_bytes`]; [`AccessError::Ended`].
    pub fn put(
        &self,
        ty: pjrt::PrimitiveType,
        dims: &[u64],
        data: &[u8],
        device: Option<u32>,
    ) -> AccessResult<(u64, Arc<TensorHandle>)> {
        let t = self.session.tensor_from_bytes(ty, dims, data, device)?;
        self.insert_tensor(t)
    }

    /// Adds tensors all at once: every one, or (after the session ended) none, the tensors
    /// dropped with their charges and [`AccessError::Ended`] returned.
    pub fn insert_tensors(
        &self,
        ts: Vec<TensorHandle>,
    ) -> AccessResult<Vec<(u64, Arc<TensorHandle>)>> {
        let out: Vec<(u64, Arc<TensorHandle>)> = ts
            .into_iter()
            .map(|t| (NEXT_HANDLE.fetch_add(1, Ordering::Relaxed), Arc::new(t)))
            .collect();
        self.with_tables(|tables| {
            for (id, t) in &out {
                tables.tensors.insert(*id, Arc::clone(t));
            }
        })?;
        Ok(out)
    }

    /// Puts a global array on `devices` as `sharding` lays it out and adds its shards, one
    /// handle per device in the order of `devices` (both front doors' sharded put); all or
    /// nothing.
    ///
    /// Errors: as [`admit_handles`](Self::admit_handles) and [`Session::put_global`];
    /// [`AccessError::Ended`].
    pub fn put_global(
        &self,
        ty: pjrt::PrimitiveType,
        dims: &[u64],
        data: &[u8],
        sharding: &pjrt::HloSharding,
        devices: &[u32],
    ) -> AccessResult<Vec<(u64, Arc<TensorHandle>)>> {
        self.admit_handles(devices.len())?;
        let shards = self.session.put_global(ty, dims, data, sharding, devices)?;
        self.insert_tensors(shards)
    }

    /// Reads the sharded array whose shards are the handles of `shards` (entry `k` the
    /// sharding's logical device `k`) back as its global array ([`Session::read_global`]
    /// over the devices the shards live on).
    ///
    /// Errors: `not-found` for a handle this session does not have; `invalid-argument` for no
    /// shards, or more than the host has devices; as [`Session::read_global`].
    pub async fn read_global(
        &self,
        ty: pjrt::PrimitiveType,
        dims: &[u64],
        sharding: &pjrt::HloSharding,
        shards: &[u64],
    ) -> AccessResult<Vec<u8>> {
        let max = self.session.device().device_count() as usize;
        if shards.is_empty() || shards.len() > max {
            return Err(DeviceError::invalid(format!(
                "a sharded array has one shard per device: 1 to {max} on this host, not {}",
                shards.len()
            ))
            .into());
        }
        let held = shards
            .iter()
            .map(|&h| self.tensor(h))
            .collect::<Result<Vec<_>, _>>()?;
        let devices: Vec<u32> = held.iter().map(|t| t.device()).collect();
        let refs: Vec<&TensorHandle> = held.iter().map(|t| t.as_ref()).collect();
        Ok(self
            .session
            .read_global(ty, dims, sharding, &devices, &refs)
            .await?)
    }

    /// Admits a call of an SPMD executable (both front doors' `CallSharded`), before any
    /// inline byte is made into a tensor: looks the executable and every shard handle up,
    /// checks the counts (one list per parameter, one handle per device of the executable),
    /// the `fetch` and `keep` positions and that each inline global array is the parameter's
    /// global spec; checks that the kept shards fit the handle table; charges
    /// each inline array's declared size ([`Session::admit_upload`]) and twice the fetched
    /// results' global bytes as transfers in flight. [`ShardedCallPlan::run`] runs it.
    ///
    /// Errors: `not-found` for a handle this session does not have; `invalid-argument` for an
    /// executable of one device, wrong counts, positions out of range or listed twice, an
    /// inline array of another dtype or dims than the parameter's global spec, or
    /// fetched results larger than [`MAX_CALL_FETCH_BYTES`] in all; `unsupported` when the
    /// executable's shardings have no global view; `resource-exhausted` naming
    /// `max-live-tensors` or `max-device-bytes`.
    pub fn plan_call_sharded(&self, call: ShardedCallSpec) -> AccessResult<ShardedCallPlan> {
        let exe = self.executable(call.executable)?;
        let program = exe.executable();
        if !program.is_spmd() {
            return Err(DeviceError::invalid(
                "the executable runs on one device: use Call or Execute",
            )
            .into());
        }
        let n = program.devices().len();
        let sh = program.shardings()?;
        let params = program.inputs().len();
        if call.arguments.len() != params {
            return Err(DeviceError::invalid(format!(
                "the program takes {params} argument(s), got {}",
                call.arguments.len()
            ))
            .into());
        }
        let outputs = program.outputs().len();
        let fetched = positions(outputs, &call.fetch, "fetch")?;
        let kept_fetched = positions(outputs, &call.keep, "keep")?;
        let kept: Vec<bool> = fetched
            .iter()
            .zip(&kept_fetched)
            .map(|(&f, &k)| !f || k)
            .collect();
        let mut args = Vec::with_capacity(params);
        let mut charges = Vec::new();
        let mut inline_sizes = Vec::new();
        for (i, a) in call.arguments.into_iter().enumerate() {
            args.push(match a {
                ShardedCallArg::Shards(handles) => {
                    if handles.len() != n {
                        return Err(DeviceError::invalid(format!(
                            "argument {i} has {} shard(s); the program runs on {n} devices",
                            handles.len()
                        ))
                        .into());
                    }
                    ShardedPlannedArg::Shards(
                        handles
                            .iter()
                            .map(|&h| self.tensor(h))
                            .collect::<Result<Vec<_>, _>>()?,
                    )
                }
                ShardedCallArg::Inline { ty, dims } => {
                    let global = &sh.global_inputs[i];
                    let idims = tpubox_core::types::dims_from_u64(&dims)?;
                    if ty != global.ty || idims != global.dims {
                        return Err(DeviceError::invalid(format!(
                            "argument {i}: the program takes a global {} (sharded {}), got {ty}{idims:?}",
                            tpubox_core::types::format_spec(global),
                            sh.params[i],
                        ))
                        .into());
                    }
                    let (bytes, charge) = self
                        .session
                        .admit_upload(ty, &dims, &format!("inline argument {i} of this CallSharded"))
                        .map_err(|e| {
                            DeviceError::new(e.kind, format!("argument {i}: {}", e.message))
                        })?;
                    charges.push(charge);
                    inline_sizes.push(bytes);
                    ShardedPlannedArg::Inline { ty, dims, bytes }
                }
            });
        }
        self.admit_handles(kept.iter().filter(|&&k| k).count().saturating_mul(n))?;
        let fetch_bytes = sh
            .global_outputs
            .iter()
            .zip(&fetched)
            .filter(|(_, f)| **f)
            .fold(0u64, |a, (spec, _)| {
                a.saturating_add(tpubox_core::types::spec_byte_size(spec))
            });
        if fetch_bytes > MAX_CALL_FETCH_BYTES {
            return Err(DeviceError::invalid(format!(
                "this CallSharded fetches {fetch_bytes} bytes of results, more than one reply carries ({MAX_CALL_FETCH_BYTES} bytes); keep the large results and read them with GetShardedTensor"
            ))
            .into());
        }
        let fetch_charge = self.tenant().charge_transfer(
            fetch_bytes.saturating_mul(2),
            "the fetched global results of this CallSharded (their shards' host copies and the reply)",
        )?;
        Ok(ShardedCallPlan {
            exe,
            args,
            inline_sizes,
            donate: call.donate,
            fetched,
            kept,
            free: call.free,
            _upload: charges,
            fetch_charge: Arc::new(fetch_charge),
        })
    }

    /// Runs executable `executable` on the tensors of `arguments`, donating the positions in
    /// `donate`, and adds the results (both front doors' execute).
    ///
    /// Errors: `not-found` for a handle this session does not have; `invalid-argument` for an
    /// executable of several devices; as [`admit_handles`](Self::admit_handles) and
    /// [`Session::execute`].
    pub async fn execute(
        &self,
        executable: u64,
        arguments: &[u64],
        donate: &[u32],
    ) -> AccessResult<Vec<(u64, Arc<TensorHandle>)>> {
        let exe = self.executable(executable)?;
        one_device(&exe)?;
        let args = arguments
            .iter()
            .map(|&h| self.tensor(h))
            .collect::<Result<Vec<_>, _>>()?;
        self.admit_handles(exe.executable().outputs().len())?;
        let refs: Vec<&TensorHandle> = args.iter().map(|a| a.as_ref()).collect();
        let outputs = self.session.execute(&exe, &refs, donate).await?;
        outputs.into_iter().map(|o| self.insert_tensor(o)).collect()
    }

    /// Admits a one-round-trip call (both front doors' `Call`), before any inline byte is
    /// read into a tensor: looks the executable and the handle arguments up, checks the
    /// `fetch` and `keep` positions, checks that the kept results fit the handle table
    /// ([`admit_handles`](Self::admit_handles)), and charges the tenant, as transfers in
    /// flight, for each inline argument's declared size ([`Session::admit_upload`], as
    /// `PutTensor`) and for twice the fetched results' bytes (their host copies and the reply
    /// that carries them, as `GetTensor`). The charges are held by the returned plan until the
    /// call ends; [`CallPlan::run`] runs it.
    ///
    /// Errors: `not-found` for a handle this session does not have; `invalid-argument` for an
    /// executable of several devices, a `fetch`/`keep` position out of range or listed twice,
    /// an inline tensor `admit_upload` refuses, or fetched results larger than
    /// [`MAX_CALL_FETCH_BYTES`] in all;
    /// `resource-exhausted` naming `max-live-tensors` or `max-device-bytes`.
    pub fn plan_call(&self, call: CallSpec) -> AccessResult<CallPlan> {
        let exe = self.executable(call.executable)?;
        one_device(&exe)?;
        let outputs = exe.executable().outputs().len();
        if call.launch && !call.fetch.is_empty() {
            return Err(DeviceError::invalid(
                "a launch fetches nothing (its results are pending handles): read them later, or call without `launch`",
            )
            .into());
        }
        let fetched = positions(outputs, &call.fetch, "fetch")?;
        let kept_fetched = positions(outputs, &call.keep, "keep")?;
        let kept: Vec<bool> = fetched
            .iter()
            .zip(&kept_fetched)
            .map(|(&f, &k)| !f || k)
            .collect();
        let mut args = Vec::with_capacity(call.arguments.len());
        let mut charges = Vec::new();
        let mut inline_sizes = Vec::new();
        for (i, a) in call.arguments.into_iter().enumerate() {
            args.push(match a {
                CallArg::Handle(h) => PlannedArg::Handle(self.tensor(h)?),
                CallArg::Inline { ty, dims, device } => {
                    let (bytes, charge) = self
                        .session
                        .admit_upload(ty, &dims, &format!("inline argument {i} of this Call"))
                        .map_err(|e| {
                            DeviceError::new(e.kind, format!("argument {i}: {}", e.message))
                        })?;
                    charges.push(charge);
                    inline_sizes.push(bytes);
                    PlannedArg::Inline {
                        ty,
                        dims,
                        device,
                        bytes,
                    }
                }
            });
        }
        let n_kept = kept.iter().filter(|&&k| k).count();
        self.admit_handles(n_kept)?;
        let sizes = exe.executable().output_bytes();
        let fetch_bytes = sizes
            .iter()
            .zip(&fetched)
            .filter(|(_, f)| **f)
            .fold(0u64, |a, (&b, _)| a.saturating_add(b));
        if fetch_bytes > MAX_CALL_FETCH_BYTES {
            return Err(DeviceError::invalid(format!(
                "this Call fetches {fetch_bytes} bytes of results, more than one reply carries ({MAX_CALL_FETCH_BYTES} bytes); keep the large results and read them with GetTensor"
            ))
            .into());
        }
        let fetch_charge = self.tenant().charge_transfer(
            fetch_bytes.saturating_mul(2),
            "the fetched results of this Call (their host copies and the reply)",
        )?;
        if !call.out.is_empty() {
            if call.out.len() != n_kept {
                return Err(DeviceError::invalid(format!(
                    "this call names {} result handles (`out`) and keeps {n_kept} results",
                    call.out.len()
                ))
                .into());
            }
            self.take_reserved(&call.out)?;
        }
        Ok(CallPlan {
            exe,
            args,
            inline_sizes,
            donate: call.donate,
            fetched,
            kept,
            free: call.free,
            launch: call.launch,
            out: call.out,
            _upload: charges,
            fetch_charge: Arc::new(fetch_charge),
        })
    }

    /// Waits for the launches that make the tensors of `tensors` ([`Session::wait`]), or, with
    /// `all`, for every launch of the session so far ([`Session::wait_all`]).
    ///
    /// Errors: `not-found` for a handle this session does not have; as [`Session::wait`] and
    /// [`Session::wait_all`] (a failed launch's error, naming it).
    pub async fn wait(&self, tensors: &[u64], all: bool) -> AccessResult<()> {
        let ts = tensors
            .iter()
            .map(|&h| self.tensor(h))
            .collect::<Result<Vec<_>, _>>()?;
        for t in &ts {
            self.session.wait(t).await?;
        }
        if all {
            self.session.wait_all().await?;
        }
        Ok(())
    }

    /// Makes a process group of `size` ranks (one device each, at most as many as the
    /// tenant may use) and joins it as `rank`; its id. See [`tpubox_core::collective`].
    ///
    /// Errors: as [`Session::create_group`]; [`AccessError::Ended`].
    pub fn create_group(
        &self,
        size: u32,
        timeout: std::time::Duration,
        rank: u32,
    ) -> AccessResult<String> {
        self.with_tables(|_| ())?;
        Ok(self
            .session
            .create_group(size, self.tenant_devices, timeout, rank)?)
    }

    /// Joins process group `id` as `rank`. Errors: as [`Session::join_group`].
    pub fn join_group(&self, id: &str, rank: u32) -> AccessResult<()> {
        self.with_tables(|_| ())?;
        Ok(self.session.join_group(id, rank)?)
    }

    /// Runs this rank's next collective of group `id` on tensor handle `input` (none for a
    /// barrier); the result's handle number and handle. Errors: as
    /// [`Session::collective`]; `not-found` for an unknown handle; [`AccessError::Ended`].
    pub async fn collective(
        &self,
        id: &str,
        what: tpubox_core::collective::Collective,
        input: Option<u64>,
    ) -> AccessResult<Option<(u64, Arc<TensorHandle>)>> {
        let input = input.map(|h| self.tensor(h)).transpose()?;
        match self.session.collective(id, what, input.as_deref()).await? {
            Some(t) => Ok(Some(self.insert_tensor(t)?)),
            None => Ok(None),
        }
    }

    /// Adds an executable; as [`insert_tensor`](Self::insert_tensor).
    pub fn insert_executable(&self, e: ExecutableHandle) -> AccessResult<u64> {
        let id = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        let e = Arc::new(e);
        self.with_tables(move |tables| {
            tables.executables.insert(id, e);
            id
        })
    }

    /// Reserves `count` handle numbers for this session's client to name the results of its
    /// own calls with ([`CallSpec::out`]: a launch then needs no reply before its results are
    /// used); returns the first, the others following it. The numbers come from the source
    /// every session's handles come from, so none is another session's; a new reservation
    /// replaces the unused rest of the previous one. Nothing is allocated or charged: a result
    /// is charged when its call runs, as any other.
    ///
    /// Errors: `invalid-argument` for a count of 0 or over [`MAX_RESERVED_HANDLES`];
    /// [`AccessError::Ended`].
    pub fn reserve_handles(&self, count: u64) -> AccessResult<u64> {
        if count == 0 || count > MAX_RESERVED_HANDLES {
            return Err(DeviceError::invalid(format!(
                "a reservation is of 1 to {MAX_RESERVED_HANDLES} handle numbers, not {count}"
            ))
            .into());
        }
        let first = NEXT_HANDLE.fetch_add(count, Ordering::Relaxed);
        self.with_tables(|t| t.reserved = first..first + count)?;
        Ok(first)
    }

    /// Takes `ids` out of this session's reservation, all or none: each must be reserved and
    /// unused, and each larger than the one before (a number is used once, even when its call
    /// then fails).
    ///
    /// Errors: `invalid-argument` naming the first number that is not reserved or used already
    /// (made up, another session's, or reused); [`AccessError::Ended`].
    fn take_reserved(&self, ids: &[u64]) -> AccessResult<()> {
        self.with_tables(|t| {
            let mut next = t.reserved.start;
            for &id in ids {
                if id < next || id >= t.reserved.end {
                    return Err(DeviceError::invalid(format!(
                        "handle {id} is not one this session reserved and has not used (each reserved number names one result, in increasing order; this session's next is {}, its reservation ends before {})",
                        t.reserved.start, t.reserved.end
                    ))
                    .into());
                }
                next = id + 1;
            }
            t.reserved.start = next;
            Ok(())
        })?
    }

    /// The tensor of handle `id`.
    ///
    /// Errors: `not-found` for a number this session does not have (never made, freed, or
    /// another session's: a handle means nothing outside its session).
    pub fn tensor(&self, id: u64) -> AccessResult<Arc<TensorHandle>> {
        self.with_tables(|t| t.tensors.get(&id).cloned())?
            .ok_or_else(|| {
                DeviceError::new(
                    ErrorKind::NotFound,
                    format!("this session has no tensor handle {id} (freed, or never made here)"),
                )
                .into()
            })
    }

    /// The executable of handle `id`; errors as [`tensor`](Self::tensor).
    pub fn executable(&self, id: u64) -> AccessResult<Arc<ExecutableHandle>> {
        self.with_tables(|t| t.executables.get(&id).cloned())?
            .ok_or_else(|| {
                DeviceError::new(
                    ErrorKind::NotFound,
                    format!(
                        "this session has no executable handle {id} (freed, or never made here)"
                    ),
                )
                .into()
            })
    }

    /// Checks that `n` more tensor handles fit in the table before an execution adds them.
    /// Live tensors are bounded by the session layer's charges; this bounds the handles of
    /// donated tensors, which hold no charge but stay in the table (so that using one says
    /// "donated") until the client frees them.
    ///
    /// Errors: `resource-exhausted` naming `max-live-tensors`.
    pub fn admit_handles(&self, n: usize) -> AccessResult<()> {
        let max = self.limits.tenant.max_live_tensors;
        let held = self.with_tables(|t| t.tensors.len())?;
        if (held + n) as u64 > max {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "this session holds {held} tensor handles, donated ones included, and may hold at most {max} (limit max-live-tensors); free the handles it no longer needs"
                ),
            )
            .into());
        }
        Ok(())
    }

    /// Frees handles; returns how many were freed and the numbers it did not have.
    pub fn free(&self, tensors: &[u64], executables: &[u64]) -> AccessResult<(u32, Vec<u64>)> {
        // The handles are dropped outside the lock (dropping returns charges).
        let mut dropped_t = Vec::new();
        let mut dropped_e = Vec::new();
        let unknown = self.with_tables(|t| {
            let mut unknown = Vec::new();
            for id in tensors {
                match t.tensors.remove(id) {
                    Some(h) => dropped_t.push(h),
                    None => unknown.push(*id),
                }
            }
            for id in executables {
                match t.executables.remove(id) {
                    Some(h) => dropped_e.push(h),
                    None => unknown.push(*id),
                }
            }
            unknown
        })?;
        let freed = (dropped_t.len() + dropped_e.len()) as u32;
        drop(dropped_t);
        drop(dropped_e);
        Ok((freed, unknown))
    }

    /// Live handles: (tensors, executables).
    pub fn handle_counts(&self) -> (usize, usize) {
        lock(&self.tables)
            .as_ref()
            .map_or((0, 0), |t| (t.tensors.len(), t.executables.len()))
    }

    /// Marks a request as running (the session is not idle) until the guard drops.
    fn activity(self: &Arc<Self>) -> Activity {
        let mut l = lock(&self.live);
        l.in_flight += 1;
        l.last_used = Instant::now();
        Activity {
            session: Arc::clone(self),
        }
    }

    /// What its clients are doing now, for operators: (calls in flight, attached clients,
    /// time since its last call ended or began).
    pub fn liveness(&self, now: Instant) -> (u32, u32, Duration) {
        let l = lock(&self.live);
        (
            l.in_flight,
            l.attached,
            now.saturating_duration_since(l.last_used),
        )
    }

    fn idle_for(&self, now: Instant) -> Option<Duration> {
        let l = lock(&self.live);
        (l.in_flight == 0 && l.attached == 0).then(|| now.saturating_duration_since(l.last_used))
    }
}

/// Refuses an executable of several devices where a call runs on one (`Execute`, `Call`).
///
/// Errors: `invalid-argument` naming `CallSharded`.
fn one_device(exe: &ExecutableHandle) -> AccessResult<()> {
    let n = exe.executable().devices().len();
    if n > 1 {
        return Err(DeviceError::invalid(format!(
            "the executable runs on {n} devices at once: call it with CallSharded (one handle per device for each argument, or global arrays)"
        ))
        .into());
    }
    Ok(())
}

/// Most bytes of results one `Call` fetches (256 MiB, a quarter of the reply size the session
/// API encodes): larger results are kept and read with `GetTensor`, which streams them.
pub const MAX_CALL_FETCH_BYTES: u64 = 256 << 20;

/// Which of `n` results `list` names ([`tpubox_core::session::position_mask`]).
///
/// Errors: `invalid-argument` for a position out of range or listed twice.
fn positions(n: usize, list: &[u32], what: &str) -> AccessResult<Vec<bool>> {
    Ok(position_mask(
        n,
        list,
        &format!("{what} position"),
        "result(s)",
    )?)
}

/// One argument of a one-round-trip call ([`LiveSession::plan_call`]).
#[derive(Debug, Clone)]
pub enum CallArg {
    /// A tensor handle of this session.
    Handle(u64),
    /// A fresh tensor whose bytes come with the call (given to [`CallPlan::run`]): its element
    /// type, dims and device (default: the session's default device).
    Inline {
        /// Element type.
        ty: pjrt::PrimitiveType,
        /// Dims, outermost first.
        dims: Vec<u64>,
        /// Device index (default: the session's default device).
        device: Option<u32>,
    },
}

/// A one-round-trip call as a front door received it (the fields of `CallRequest`).
#[derive(Debug, Clone, Default)]
pub struct CallSpec {
    /// The executable's handle.
    pub executable: u64,
    /// One per parameter, in order.
    pub arguments: Vec<CallArg>,
    /// Positions in `arguments` donated.
    pub donate: Vec<u32>,
    /// Positions of results whose bytes come back.
    pub fetch: Vec<u32>,
    /// Positions of fetched results also kept as handles (results not fetched always are).
    pub keep: Vec<u32>,
    /// Tensor handles freed after the execution succeeded (after the launch, with `launch`).
    pub free: Vec<u64>,
    /// Launch without waiting ([`Session::launch`]): every result a pending handle, nothing
    /// fetched.
    pub launch: bool,
    /// The handle numbers of the kept results, in order, from the session's reservation
    /// ([`LiveSession::reserve_handles`]); empty: the daemon numbers them.
    pub out: Vec<u64>,
}

#[derive(Debug)]
enum PlannedArg {
    Handle(Arc<TensorHandle>),
    Inline {
        ty: pjrt::PrimitiveType,
        dims: Vec<u64>,
        device: Option<u32>,
        bytes: usize,
    },
}

/// An admitted one-round-trip call ([`LiveSession::plan_call`]): holds its charges until it
/// is run or dropped.
#[derive(Debug)]
pub struct CallPlan {
    exe: Arc<ExecutableHandle>,
    args: Vec<PlannedArg>,
    inline_sizes: Vec<usize>,
    donate: Vec<u32>,
    fetched: Vec<bool>,
    kept: Vec<bool>,
    free: Vec<u64>,
    launch: bool,
    out: Vec<u64>,
    _upload: Vec<Charge>,
    fetch_charge: Arc<Charge>,
}

/// The bytes of a fetched result, holding (a share of) their transfer charge until dropped:
/// a front door hands them to the reply, which drops them once it is written.
#[derive(Debug)]
pub struct Fetched {
    bytes: Vec<u8>,
    _charge: Arc<Charge>,
}

impl AsRef<[u8]> for Fetched {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// One result of a one-round-trip call.
#[derive(Debug)]
pub struct CallOutput {
    /// Its handle when kept, else 0 (never a handle).
    pub handle: u64,
    /// The tensor (its spec, device and size for the reply).
    pub tensor: Arc<TensorHandle>,
    /// Its bytes (dense, row-major, little-endian) when fetched.
    pub data: Option<Fetched>,
}

/// What a one-round-trip call did.
#[derive(Debug)]
pub struct CallOutcome {
    /// One per result, in order.
    pub results: Vec<CallOutput>,
    /// How many handles of `free` were freed.
    pub freed: u32,
    /// The handles of `free` this session does not have.
    pub unknown: Vec<u64>,
    /// The launch's id (0 unless the call was a launch).
    pub launch_id: u64,
}

impl CallPlan {
    /// The declared sizes of the inline arguments, in bytes, in argument order: what the front
    /// door must hand [`run`](Self::run).
    pub fn inline_sizes(&self) -> &[usize] {
        &self.inline_sizes
    }

    /// Runs the call on `session` (the one that planned it): makes the inline tensors from
    /// `inline` (one slice per inline argument, in order), executes
    /// ([`Session::execute`]; [`Session::launch`] for a launch, which returns pending
    /// handles at once), reads the fetched results, adds the kept ones to the handle
    /// table and then frees `free`. On any error nothing is added or freed: the inline tensors
    /// and the results are dropped with their charges.
    ///
    /// Errors: `invalid-argument` when a slice is not its argument's declared size (element
    /// size × product of dims); as [`Session::tensor_from_bytes`], [`Session::execute`] and
    /// [`Session::read`]; [`AccessError::Ended`].
    pub async fn run(self, session: &LiveSession, inline: &[&[u8]]) -> AccessResult<CallOutcome> {
        if inline.len() != self.inline_sizes.len() {
            return Err(DeviceError::invalid(format!(
                "{} inline tensors were declared and {} sent",
                self.inline_sizes.len(),
                inline.len()
            ))
            .into());
        }
        let s = &session.session;
        let mut held = Vec::with_capacity(self.args.len());
        let mut next = inline.iter();
        for (i, a) in self.args.iter().enumerate() {
            held.push(match a {
                PlannedArg::Handle(h) => Arc::clone(h),
                PlannedArg::Inline { ty, dims, device, bytes } => {
                    let data = next.next().copied().unwrap_or_default();
                    if data.len() != *bytes {
                        return Err(DeviceError::invalid(format!(
                            "argument {i}: a {ty} tensor of dims {dims:?} holds {bytes} bytes, {} were sent",
                            data.len()
                        ))
                        .into());
                    }
                    let t = s
                        .tensor_from_bytes(*ty, dims, data, *device)
                        .map_err(|e| DeviceError::new(e.kind, format!("argument {i}: {}", e.message)))?;
                    Arc::new(t)
                }
            });
        }
        let refs: Vec<&TensorHandle> = held.iter().map(|a| a.as_ref()).collect();
        let (outputs, launch_id) = if self.launch {
            let l = s.launch(&self.exe, &refs, &self.donate).await?;
            (l.outputs, l.id)
        } else {
            (s.execute(&self.exe, &refs, &self.donate).await?, 0)
        };
        drop(refs);
        drop(held);
        let mut results = Vec::with_capacity(outputs.len());
        for (i, o) in outputs.into_iter().enumerate() {
            let data = if self.fetched[i] {
                Some(Fetched {
                    bytes: s.read(&o).await?,
                    _charge: Arc::clone(&self.fetch_charge),
                })
            } else {
                None
            };
            results.push((Arc::new(o), data));
        }
        let mut out = Vec::with_capacity(results.len());
        let mut named = self.out.iter();
        for (i, (tensor, data)) in results.into_iter().enumerate() {
            let handle = if self.kept[i] {
                let id = match named.next() {
                    Some(&id) => id,
                    None => NEXT_HANDLE.fetch_add(1, Ordering::Relaxed),
                };
                session.with_tables(|t| {
                    t.tensors.insert(id, Arc::clone(&tensor));
                })?;
                id
            } else {
                0
            };
            out.push(CallOutput {
                handle,
                tensor,
                data,
            });
        }
        let (freed, unknown) = session.free(&self.free, &[])?;
        Ok(CallOutcome {
            results: out,
            freed,
            unknown,
            launch_id,
        })
    }
}

/// One argument of a call of an SPMD executable ([`LiveSession::plan_call_sharded`]).
#[derive(Debug, Clone)]
pub enum ShardedCallArg {
    /// One tensor handle per device of the executable, in its device order.
    Shards(Vec<u64>),
    /// A global array whose bytes come with the call (given to [`ShardedCallPlan::run`]),
    /// split by the parameter's sharding.
    Inline {
        /// Element type.
        ty: pjrt::PrimitiveType,
        /// Global dims, outermost first.
        dims: Vec<u64>,
    },
}

/// A call of an SPMD executable as a front door received it (the fields of
/// `CallShardedRequest`).
#[derive(Debug, Clone, Default)]
pub struct ShardedCallSpec {
    /// The executable's handle.
    pub executable: u64,
    /// One per parameter, in order.
    pub arguments: Vec<ShardedCallArg>,
    /// Positions in `arguments` donated (every shard).
    pub donate: Vec<u32>,
    /// Positions of results whose gathered global arrays come back.
    pub fetch: Vec<u32>,
    /// Positions of fetched results also kept (results not fetched always are).
    pub keep: Vec<u32>,
    /// Tensor handles freed after the execution succeeded.
    pub free: Vec<u64>,
}

#[derive(Debug)]
enum ShardedPlannedArg {
    Shards(Vec<Arc<TensorHandle>>),
    Inline {
        ty: pjrt::PrimitiveType,
        dims: Vec<u64>,
        bytes: usize,
    },
}

/// An admitted call of an SPMD executable ([`LiveSession::plan_call_sharded`]): holds its
/// charges until it is run or dropped.
#[derive(Debug)]
pub struct ShardedCallPlan {
    exe: Arc<ExecutableHandle>,
    args: Vec<ShardedPlannedArg>,
    inline_sizes: Vec<usize>,
    donate: Vec<u32>,
    fetched: Vec<bool>,
    kept: Vec<bool>,
    free: Vec<u64>,
    _upload: Vec<Charge>,
    fetch_charge: Arc<Charge>,
}

/// One result of a call of an SPMD executable.
#[derive(Debug)]
pub struct ShardedOutput {
    /// Its global spec.
    pub global: tpubox_core::types::TensorSpec,
    /// Its sharding.
    pub sharding: pjrt::HloSharding,
    /// One per device, in the executable's device order: its handle when kept (else 0) and
    /// the tensor.
    pub shards: Vec<(u64, Arc<TensorHandle>)>,
    /// The gathered global array when fetched.
    pub data: Option<Fetched>,
}

/// What a call of an SPMD executable did.
#[derive(Debug)]
pub struct ShardedCallOutcome {
    /// One per result, in order.
    pub results: Vec<ShardedOutput>,
    /// How many handles of `free` were freed.
    pub freed: u32,
    /// The handles of `free` this session does not have.
    pub unknown: Vec<u64>,
}

impl ShardedCallPlan {
    /// The declared sizes of the inline global arrays, in bytes, in argument order.
    pub fn inline_sizes(&self) -> &[usize] {
        &self.inline_sizes
    }

    /// Runs the call on `session` (the one that planned it): splits the inline global arrays
    /// onto the executable's devices ([`Session::put_global`] with each parameter's
    /// sharding), runs it on all of them ([`Session::execute_spmd`], which waits), gathers
    /// the fetched results ([`Session::read_global`]), adds the kept shards to the handle
    /// table and then frees `free`. On any error nothing is added or freed.
    ///
    /// Errors: `invalid-argument` when a slice is not its argument's declared size; as
    /// [`Session::put_global`], [`Session::execute_spmd`] and [`Session::read_global`];
    /// [`AccessError::Ended`].
    pub async fn run(
        self,
        session: &LiveSession,
        inline: &[&[u8]],
    ) -> AccessResult<ShardedCallOutcome> {
        if inline.len() != self.inline_sizes.len() {
            return Err(DeviceError::invalid(format!(
                "{} inline arrays were declared and {} sent",
                self.inline_sizes.len(),
                inline.len()
            ))
            .into());
        }
        let s = &session.session;
        let program = Arc::clone(self.exe.executable());
        let sh = program.shardings()?;
        let devices = program.devices();
        let mut made: Vec<Vec<TensorHandle>> = Vec::new();
        let mut next = inline.iter();
        for (i, a) in self.args.iter().enumerate() {
            if let ShardedPlannedArg::Inline { ty, dims, bytes } = a {
                let data = next.next().copied().unwrap_or_default();
                if data.len() != *bytes {
                    return Err(DeviceError::invalid(format!(
                        "argument {i}: a global {ty} array of dims {dims:?} holds {bytes} bytes, {} were sent",
                        data.len()
                    ))
                    .into());
                }
                made.push(
                    s.put_global(*ty, dims, data, &sh.params[i], devices)
                        .map_err(|e| {
                            DeviceError::new(e.kind, format!("argument {i}: {}", e.message))
                        })?,
                );
            }
        }
        let mut made_iter = made.iter();
        let args: Vec<Vec<&TensorHandle>> = self
            .args
            .iter()
            .map(|a| match a {
                ShardedPlannedArg::Shards(hs) => hs.iter().map(|h| h.as_ref()).collect(),
                ShardedPlannedArg::Inline { .. } => made_iter
                    .next()
                    .map(|v| v.iter().collect())
                    .unwrap_or_default(),
            })
            .collect();
        let outputs = s.execute_spmd(&self.exe, &args, &self.donate).await?;
        drop(args);
        drop(made);
        let mut results = Vec::with_capacity(outputs.len());
        for (r, shards) in outputs.into_iter().enumerate() {
            let global = sh.global_outputs[r].clone();
            let data = if self.fetched[r] {
                let dims: Vec<u64> = global.dims.iter().map(|&d| d.max(0) as u64).collect();
                let refs: Vec<&TensorHandle> = shards.iter().collect();
                Some(Fetched {
                    bytes: s
                        .read_global(global.ty, &dims, &sh.outputs[r], devices, &refs)
                        .await?,
                    _charge: Arc::clone(&self.fetch_charge),
                })
            } else {
                None
            };
            results.push((global, shards, data));
        }
        let mut out = Vec::with_capacity(results.len());
        for (r, (global, shards, data)) in results.into_iter().enumerate() {
            let shards: Vec<(u64, Arc<TensorHandle>)> = if self.kept[r] {
                session.insert_tensors(shards)?
            } else {
                shards.into_iter().map(|t| (0, Arc::new(t))).collect()
            };
            out.push(ShardedOutput {
                global,
                sharding: sh.outputs[r].clone(),
                shards,
                data,
            });
        }
        let (freed, unknown) = session.free(&self.free, &[])?;
        Ok(ShardedCallOutcome {
            results: out,
            freed,
            unknown,
        })
    }
}

/// An attached client: while any exists the session is not idle; when the last of a session
/// opened with `end_on_disconnect` drops, the session ends.
pub struct Attachment {
    session: Arc<LiveSession>,
    registry: Arc<Registry>,
}

impl Drop for Attachment {
    fn drop(&mut self) {
        let last = {
            let mut l = lock(&self.session.live);
            l.attached -= 1;
            l.last_used = Instant::now();
            l.attached == 0
        };
        if last && self.session.end_on_disconnect {
            self.registry
                .close(&self.session, "its client disconnected (end_on_disconnect)");
        }
    }
}

/// Ended sessions' token hashes with the reason, and their order (oldest first, for
/// forgetting past [`ENDED_REMEMBERED`]).
type EndedTokens = (
    HashMap<[u8; 32], String>,
    std::collections::VecDeque<[u8; 32]>,
);

/// What a tenant is allowed, as the registry needs it.
#[derive(Debug, Clone)]
pub struct OpenGrant {
    /// The tenant's name.
    pub tenant: String,
    /// Its `[tenant.session]` table.
    pub policy: SessionPolicy,
    /// The devices it may use, as the daemon planned them from every tenant's `devices`
    /// ([`tpubox_core::placement::plan`]).
    pub devices: TenantDevices,
}

/// The live sessions of a daemon.
#[derive(Debug)]
pub struct Registry {
    device: Arc<DeviceService>,
    weights: Arc<WeightRegistry>,
    sessions: Mutex<HashMap<[u8; 32], Arc<LiveSession>>>,
    ended: Mutex<EndedTokens>,
    tenants_seen: Mutex<BTreeSet<String>>,
    /// Each tenant's budget (all its sessions together), made at its first session and made
    /// again when its policy's budget limits change.
    budgets: Mutex<HashMap<String, Arc<Tenant>>>,
    stopping: Mutex<Option<String>>,
    /// The process groups its sessions meet in (`torch.distributed`'s ranks).
    groups: Arc<tpubox_core::collective::Groups>,
}

fn key_of(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn random_hex(bytes: usize) -> DeviceResult<String> {
    let mut b = vec![0u8; bytes];
    getrandom::fill(&mut b).map_err(|e| {
        DeviceError::new(
            ErrorKind::Internal,
            format!("no randomness for a session token: {e}"),
        )
    })?;
    Ok(hex::encode(b))
}

impl Registry {
    /// No sessions yet, on `device`, able to open the weight sets of `weights`.
    pub fn new(device: Arc<DeviceService>, weights: Arc<WeightRegistry>) -> Arc<Self> {
        Arc::new(Registry {
            device,
            weights,
            sessions: Mutex::new(HashMap::new()),
            ended: Mutex::new(Default::default()),
            tenants_seen: Mutex::new(BTreeSet::new()),
            budgets: Mutex::new(HashMap::new()),
            stopping: Mutex::new(None),
            groups: Arc::default(),
        })
    }

    /// The shared device.
    pub fn device(&self) -> &Arc<DeviceService> {
        &self.device
    }

    /// The shared weight sets.
    pub fn weights(&self) -> &Arc<WeightRegistry> {
        &self.weights
    }

    /// `grant`'s tenant's budget: all its sessions together hold at most
    /// [`SessionPolicy::budget_limits`] (device bytes, execution slots).
    pub fn budget(&self, grant: &OpenGrant) -> Arc<Tenant> {
        let want = grant.policy.budget_limits(self.device.scheduler().slots());
        let mut budgets = lock(&self.budgets);
        match budgets.get(&grant.tenant) {
            Some(b) if *b.limits() == want => Arc::clone(b),
            _ => {
                // New, or its limits changed: sessions opened before keep the old budget.
                let b = Tenant::new_budget(grant.tenant.clone(), want);
                budgets.insert(grant.tenant.clone(), Arc::clone(&b));
                b
            }
        }
    }

    /// Opens a session for `grant`'s tenant; returns it and its token (64 hex digits from
    /// the OS's random source; only its SHA-256 is kept).
    ///
    /// The session is placed on its tenant's devices as `placement` asks
    /// ([`tpubox_core::placement::DeviceLeases::place`]).
    ///
    /// Errors: `resource-exhausted` naming `max-sessions` or `devices`; `invalid-argument` for
    /// requested limits above the tenant's; `not-found` and `permission-denied` for devices
    /// the host lacks or the tenant may not use (see `place`); `unavailable`-like
    /// `failed-precondition` while the daemon stops.
    pub fn open(
        &self,
        grant: &OpenGrant,
        requested: &RequestedLimits,
        placement: &PlacementRequest,
        end_on_disconnect: bool,
        label: &str,
    ) -> DeviceResult<(Arc<LiveSession>, String)> {
        if let Some(why) = lock(&self.stopping).clone() {
            return Err(DeviceError::new(ErrorKind::FailedPrecondition, why));
        }
        let limits = grant.policy.limits().narrowed(requested)?;
        let token = random_hex(32)?;
        let id = format!("s-{}", random_hex(8)?);
        let key = key_of(&token);
        let mut sessions = lock(&self.sessions);
        let open = sessions
            .values()
            .filter(|s| s.tenant_name == grant.tenant)
            .count();
        if open >= grant.policy.max_sessions as usize {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "tenant `{}` has {open} sessions open, its limit (limit max-sessions); close one first",
                    grant.tenant
                ),
            ));
        }
        let placed = self
            .device
            .leases()
            .place(&grant.tenant, &grant.devices, placement)?;
        let budget = self.budget(grant);
        let tenant = Tenant::with_budget(grant.tenant.clone(), limits.tenant.clone(), budget);
        let session = Session::new(Arc::clone(&self.device), Arc::clone(&self.weights), tenant)
            .with_placement(placed)
            .with_groups(Arc::clone(&self.groups));
        let label: String = label.chars().take(200).collect();
        let live = Arc::new(LiveSession {
            id: id.clone(),
            tenant_name: grant.tenant.clone(),
            label,
            limits,
            end_on_disconnect,
            opened: Instant::now(),
            opened_at: std::time::SystemTime::now(),
            session,
            tenant_devices: grant.devices.devices.len() as u32,
            key,
            tables: Mutex::new(Some(Tables::default())),
            live: Mutex::new(Liveness {
                last_used: Instant::now(),
                in_flight: 0,
                attached: 0,
            }),
            ended: watch::Sender::new(None),
        });
        sessions.insert(key, Arc::clone(&live));
        drop(sessions);
        lock(&self.tenants_seen).insert(grant.tenant.clone());
        tracing::info!(
            session = %id,
            tenant = %grant.tenant,
            label = %tpubox_core::logsafe::clip(&live.label),
            "session opened"
        );
        Ok((live, token))
    }

    /// The session of `token`, marked active until the returned guard drops.
    ///
    /// Errors: [`AccessError::Ended`] for a session that has ended (while remembered),
    /// [`AccessError::Unauthenticated`] for a token nobody issued.
    pub fn get(&self, token: &str) -> AccessResult<(Arc<LiveSession>, Activity)> {
        let key = key_of(token);
        if let Some(s) = lock(&self.sessions).get(&key).cloned() {
            let a = s.activity();
            return Ok((s, a));
        }
        if let Some(reason) = lock(&self.ended).0.get(&key) {
            return Err(ended_error(reason));
        }
        // A token of the form Open returns that nobody here issued: most likely a session of
        // an earlier run of the daemon (sessions do not survive a restart).
        if token.len() == 64 && token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ended_error(
                "no session has this token: it ended long ago, or the daemon restarted since it was opened (sessions do not survive a restart); open a new session (in a notebook: restart the kernel)",
            ));
        }
        Err(AccessError::Unauthenticated(
            "unknown session token (Open returns one; a tenant token does not work here)".into(),
        ))
    }

    /// Attaches a client to `session`; see [`Attachment`].
    pub fn attach(self: &Arc<Self>, session: &Arc<LiveSession>) -> Attachment {
        let mut l = lock(&session.live);
        l.attached += 1;
        l.last_used = Instant::now();
        Attachment {
            session: Arc::clone(session),
            registry: Arc::clone(self),
        }
    }

    /// Ends `session`, freeing everything it holds; returns `false` when it had already
    /// ended.
    pub fn close(&self, session: &Arc<LiveSession>, reason: &str) -> bool {
        let removed = lock(&self.sessions).remove(&session.key).is_some();
        let tables = lock(&session.tables).take();
        if !removed && tables.is_none() {
            return false;
        }
        {
            let mut ended = lock(&self.ended);
            if ended.0.insert(session.key, reason.to_string()).is_none() {
                ended.1.push_back(session.key);
            }
            while ended.1.len() > ENDED_REMEMBERED {
                if let Some(k) = ended.1.pop_front() {
                    ended.0.remove(&k);
                }
            }
        }
        let (tensors, executables) = tables
            .as_ref()
            .map_or((0, 0), |t| (t.tensors.len(), t.executables.len()));
        // Dropping the tables returns their charges; leaving its process groups breaks them
        // for their other ranks at once (they do not wait out their timeout).
        drop(tables);
        session.session.leave_all_groups();
        session.ended.send_replace(Some(reason.to_string()));
        tracing::info!(
            session = %session.id,
            tenant = %session.tenant_name,
            tensors,
            executables,
            "session ended: {reason}"
        );
        true
    }

    /// Ends every session idle past its timeout; returns how many.
    pub fn reap(&self, now: Instant) -> usize {
        let idle: Vec<Arc<LiveSession>> = lock(&self.sessions)
            .values()
            .filter(|s| s.idle_for(now).is_some_and(|d| d > s.limits.idle_timeout))
            .cloned()
            .collect();
        for s in &idle {
            self.close(
                s,
                &format!(
                    "idle for longer than its idle timeout of {:?} (idle_timeout_seconds)",
                    s.limits.idle_timeout
                ),
            );
        }
        idle.len()
    }

    /// Ends every session of `tenant` with `reason` (its tokens-file entry is gone); returns
    /// how many.
    pub fn close_tenant(&self, tenant: &str, reason: &str) -> usize {
        let of: Vec<Arc<LiveSession>> = lock(&self.sessions)
            .values()
            .filter(|s| s.tenant_name == tenant)
            .cloned()
            .collect();
        for s in &of {
            self.close(s, reason);
        }
        lock(&self.budgets).remove(tenant);
        of.len()
    }

    /// Refuses new sessions from now on and ends every session with `reason`.
    pub fn close_all(&self, reason: &str) {
        *lock(&self.stopping) = Some(reason.to_string());
        let all: Vec<Arc<LiveSession>> = lock(&self.sessions).values().cloned().collect();
        for s in &all {
            self.close(s, reason);
        }
    }

    /// Every tenant's budget usage since its first session (its sessions' executions, device
    /// time, compiles and refusals counted for good; bytes and slots held now), by tenant name.
    pub fn budgets(&self) -> Vec<(String, TenantUsage)> {
        let mut v: Vec<(String, TenantUsage)> = lock(&self.budgets)
            .iter()
            .map(|(n, b)| (n.clone(), b.usage()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The live session whose id is `id` (`s-` and 16 hex digits), if any.
    pub fn by_id(&self, id: &str) -> Option<Arc<LiveSession>> {
        lock(&self.sessions).values().find(|s| s.id == id).cloned()
    }

    /// Live sessions, in no order.
    pub fn sessions(&self) -> Vec<Arc<LiveSession>> {
        lock(&self.sessions).values().cloned().collect()
    }

    /// Live sessions of `tenant` and their usage summed.
    pub fn tenant_usage(&self, tenant: &str) -> (u32, TenantUsage) {
        let mut n = 0;
        let mut u = TenantUsage::default();
        for s in self.sessions().iter().filter(|s| s.tenant_name == tenant) {
            n += 1;
            add_usage(&mut u, &s.tenant().usage());
        }
        (n, u)
    }

    /// Every tenant that opened a session since start, with its live session count and usage
    /// (for metrics: a tenant whose sessions all ended reads zero, not absent).
    pub fn tenants(&self) -> Vec<(String, u32, TenantUsage)> {
        let names: Vec<String> = lock(&self.tenants_seen).iter().cloned().collect();
        names
            .into_iter()
            .map(|n| {
                let (c, u) = self.tenant_usage(&n);
                (n, c, u)
            })
            .collect()
    }
}

/// Adds `b` into `a` (current values summed; peaks summed as an upper bound).
pub fn add_usage(a: &mut TenantUsage, b: &TenantUsage) {
    a.device_bytes += b.device_bytes;
    a.peak_device_bytes += b.peak_device_bytes;
    a.live_tensors += b.live_tensors;
    a.peak_live_tensors += b.peak_live_tensors;
    a.live_executables += b.live_executables;
    a.compiles += b.compiles;
    a.executions += b.executions;
    a.device_seconds += b.device_seconds;
    a.refused += b.refused;
    a.executions_running += b.executions_running;
    a.transfer_bytes += b.transfer_bytes;
    a.pending_launches += b.pending_launches;
    a.host_to_device_bytes += b.host_to_device_bytes;
    a.device_to_host_bytes += b.device_to_host_bytes;
    for d in &b.device_bytes_by_device {
        match a
            .device_bytes_by_device
            .iter_mut()
            .find(|x| x.device == d.device)
        {
            Some(x) => {
                x.bytes += d.bytes;
                x.peak_bytes += d.peak_bytes;
            }
            None => a.device_bytes_by_device.push(*d),
        }
    }
    a.device_bytes_by_device.sort_by_key(|x| x.device);
}

/// Ends idle sessions once a second while `registry` is alive.
pub fn spawn_reaper(registry: &Arc<Registry>) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(registry);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(r) = weak.upgrade() else { break };
            r.reap(Instant::now());
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(r: AccessResult<Vec<bool>>) -> String {
        match r {
            Err(AccessError::Device(e)) => e.kind.as_str().to_string(),
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn call_positions_are_checked() {
        assert_eq!(
            positions(3, &[2, 0], "fetch").ok().unwrap(),
            vec![true, false, true]
        );
        assert_eq!(positions(0, &[], "keep").ok().unwrap(), Vec::<bool>::new());
        assert_eq!(kind(positions(3, &[3], "fetch")), "invalid-argument");
        assert_eq!(kind(positions(3, &[1, 1], "keep")), "invalid-argument");
        assert_eq!(kind(positions(2, &[u32::MAX], "fetch")), "invalid-argument");
    }
}
