//! The session layer: every tenant rule, in one place, for every front door.
//!
//! A [`Session`] is what a front door holds for one tenant connection: a Wasm guest's store
//! (through `tpubox_wasm::wit`), and later a server connection or a notebook kernel. It owns the
//! rules that decide what a tenant may do with the shared device:
//!
//! - **charges**: every tensor and executable a tenant holds is charged to its [`Tenant`]
//!   before the plugin allocates it, and credited back when the handle is dropped (or donated);
//! - **compile admission**: program size, checked first ([`Tenant::admit_program_size`]), and
//!   compile rate, charged only when the compile cache's tier 1 does not serve the program
//!   ([`Tenant::admit_compile_rate`]);
//! - **handle checks**: a handle is used only by the session that made it, a donated tensor is
//!   gone, a shared weight is read-only and can be neither donated nor overwritten;
//! - **donation**: indices checked, inputs credited against the outputs' charge, and the donated
//!   handles emptied only when the execution succeeded;
//! - **reads**: a tensor larger than what the front door can take ([`Session::with_max_read_bytes`],
//!   a guest's linear memory) is refused before anything is copied;
//! - **execution slots**: executions wait for the device in the fair-share queue and their
//!   device time is charged to the tenant ([`DeviceService::execute_for`]).
//!
//! Front doors only look handles up, convert types and call a session; validation of values
//! against PJRT's rules happens below, in [`crate::device`] and [`crate::types`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use pjrt::PrimitiveType;

use crate::cache::CacheTier;
use crate::device::{CompileSettings, DeviceService};
use crate::error::{DeviceError, DeviceResult, ErrorKind};
use crate::tenant::{Charge, ChargeKind, Tenant, TenantUsage};
use crate::types::{
    Call, DeviceExecutable, DeviceInfo, DeviceTensor, PlatformInfo, TensorSpec, check_tensor_bytes,
    dims_from_u64, spec_byte_size,
};
use crate::weights::{WeightRegistry, WeightSet};

/// Source of session ids; 0 is never handed out.
static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// One tenant connection to the shared device; see the module docs. `Send + Sync`: a front
/// door may serve several requests of one session at once.
#[derive(Debug)]
pub struct Session {
    id: u64,
    device: Arc<DeviceService>,
    weights: Arc<WeightRegistry>,
    tenant: Arc<Tenant>,
    max_read_bytes: u64,
}

/// A session's handle to a device tensor.
///
/// Holds the tensor and its [`Charge`] until the handle is dropped, or until the tensor is
/// donated to an execution; the spec and device stay readable after donation.
#[derive(Debug)]
pub struct TensorHandle {
    session: u64,
    spec: TensorSpec,
    device: u32,
    read_only: bool,
    /// `None` once donated.
    held: Mutex<Option<Held>>,
    /// The host copy concurrent readers share while any of them holds it
    /// ([`Session::read_shared`]).
    host_copy: tokio::sync::Mutex<Weak<HostCopy>>,
}

/// A tensor's bytes copied to the host for readers ([`Session::read_shared`]), charged to the
/// tenant as a transfer ([`Tenant::charge_transfer`]) for as long as any reader holds it.
#[derive(Debug)]
pub struct HostCopy {
    bytes: Vec<u8>,
    _charge: Charge,
}

impl HostCopy {
    /// The tensor's dense row-major little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl AsRef<[u8]> for HostCopy {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

#[derive(Debug)]
struct Held {
    tensor: Arc<DeviceTensor>,
    charge: Charge,
}

impl Held {
    /// Device bytes this holds against the tenant (0 for shared weights).
    fn charged_bytes(&self) -> u64 {
        match self.charge.kind() {
            ChargeKind::Tensor(b) => b,
            ChargeKind::Executable | ChargeKind::Scratch(_) | ChargeKind::Transfer(_) => 0,
        }
    }
}

impl TensorHandle {
    fn new(session: u64, tensor: Arc<DeviceTensor>, read_only: bool, charge: Charge) -> Self {
        TensorHandle {
            session,
            spec: tensor.spec().clone(),
            device: tensor.device(),
            read_only,
            held: Mutex::new(Some(Held { tensor, charge })),
            host_copy: tokio::sync::Mutex::new(Weak::new()),
        }
    }

    /// Element type and dims (also after donation).
    pub fn spec(&self) -> &TensorSpec {
        &self.spec
    }

    /// Index of the device holding the tensor.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Dense size in bytes: element size × product of dims.
    pub fn byte_size(&self) -> u64 {
        spec_byte_size(&self.spec)
    }

    /// Whether this is a shared, read-only tensor (a weight).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Whether the tensor was donated to an execution (the handle then holds nothing).
    pub fn is_donated(&self) -> bool {
        self.lock().is_none()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Held>> {
        // A poisoned lock only means a panic elsewhere while it was held; the state is a
        // plain Option and stays consistent.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The tensor, unless donated.
    ///
    /// Errors: `failed-precondition` after donation.
    pub fn tensor(&self) -> DeviceResult<Arc<DeviceTensor>> {
        self.lock()
            .as_ref()
            .map(|h| Arc::clone(&h.tensor))
            .ok_or_else(|| {
                DeviceError::new(
                    ErrorKind::FailedPrecondition,
                    "this tensor was donated to an execution and can no longer be used",
                )
            })
    }

    fn take(&self) -> Option<Held> {
        self.lock().take()
    }

    fn restore(&self, held: Held) {
        *self.lock() = Some(held);
    }
}

/// A session's handle to a compiled executable, with its charge.
#[derive(Debug)]
pub struct ExecutableHandle {
    session: u64,
    exe: Arc<DeviceExecutable>,
    tier: CacheTier,
    _charge: Charge,
}

impl ExecutableHandle {
    /// The executable (parameter and result specs, device, fingerprint).
    pub fn executable(&self) -> &Arc<DeviceExecutable> {
        &self.exe
    }

    /// The compile-cache tier that served the compile that made this handle (memory, disk,
    /// remote, compiled, or compiled without a cache).
    pub fn tier(&self) -> CacheTier {
        self.tier
    }
}

/// How a program's bytes are to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgramFormat {
    /// MLIR text (StableHLO, CHLO, VHLO dialects).
    MlirText,
    /// MLIR bytecode, e.g. a portable `jax.export` artifact.
    MlirBytecode,
}

impl Session {
    /// A session of `tenant` on `device`, that may open the weight sets in `weights`. Reads are
    /// unbounded until [`with_max_read_bytes`](Self::with_max_read_bytes).
    pub fn new(
        device: Arc<DeviceService>,
        weights: Arc<WeightRegistry>,
        tenant: Arc<Tenant>,
    ) -> Self {
        Session {
            id: NEXT_SESSION.fetch_add(1, Ordering::Relaxed),
            device,
            weights,
            tenant,
            max_read_bytes: u64::MAX,
        }
    }

    /// Refuses reads of tensors larger than `bytes` (for a guest: its linear memory limit, as
    /// a read that cannot fit there would only trap after the host copied it).
    pub fn with_max_read_bytes(mut self, bytes: u64) -> Self {
        self.max_read_bytes = bytes;
        self
    }

    /// The tenant this session charges.
    pub fn tenant(&self) -> &Arc<Tenant> {
        &self.tenant
    }

    /// The shared device service.
    pub fn device(&self) -> &Arc<DeviceService> {
        &self.device
    }

    /// A snapshot of the tenant's usage.
    pub fn usage(&self) -> TenantUsage {
        self.tenant.usage()
    }

    /// Platform name, version and plugin.
    pub fn platform(&self) -> &PlatformInfo {
        self.device.platform()
    }

    /// The addressable devices, ordered by index.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.device.devices()
    }

    /// Names of the weight sets this session may open, sorted.
    pub fn weight_sets(&self) -> Vec<String> {
        self.weights.names()
    }

    /// Errors: `permission-denied` for a handle another session made.
    fn owns(&self, session: u64) -> DeviceResult<()> {
        if session != self.id {
            return Err(DeviceError::new(
                ErrorKind::PermissionDenied,
                "this handle belongs to another session",
            ));
        }
        Ok(())
    }

    fn owned_tensor(&self, tensor: DeviceTensor, charge: Charge) -> TensorHandle {
        TensorHandle::new(self.id, Arc::new(tensor), false, charge)
    }

    /// Creates a tensor from dense row-major little-endian bytes on `device` (default 0),
    /// charged to the tenant.
    ///
    /// Errors: `invalid-argument` when the rank exceeds [`crate::types::MAX_RANK`], a dim
    /// exceeds `i64::MAX`, or `data.len()` is not element size × product of dims;
    /// `resource-exhausted` naming `max-live-tensors` or `max-device-bytes`; `not-found` for an
    /// unknown device; plugin errors.
    pub fn tensor_from_bytes(
        &self,
        ty: PrimitiveType,
        dims: &[u64],
        data: &[u8],
        device: Option<u32>,
    ) -> DeviceResult<TensorHandle> {
        let dims = dims_from_u64(dims)?;
        let bytes = check_tensor_bytes(ty, &dims, data.len())?;
        let charge = self.charge_one(bytes as u64)?;
        let t = self
            .device
            .tensor_from_bytes(ty, &dims, data, device.unwrap_or(0))?;
        Ok(self.owned_tensor(t, charge))
    }

    /// Checks a tensor a client is about to send, before its data is read: returns its dense
    /// size in bytes (element size × product of dims).
    ///
    /// Errors: `invalid-argument` for a rank over [`crate::types::MAX_RANK`], a dim over
    /// `i64::MAX` or a size this host cannot address; `resource-exhausted` naming
    /// `max-device-bytes` when the tensor alone is larger than the tenant may hold (nothing
    /// held yet is counted: the charge at [`tensor_from_bytes`](Self::tensor_from_bytes)
    /// does that).
    pub fn admit_tensor(&self, ty: PrimitiveType, dims: &[u64]) -> DeviceResult<usize> {
        let idims = dims_from_u64(dims)?;
        let bytes = crate::types::checked_byte_size(ty, &idims).ok_or_else(|| {
            DeviceError::invalid(format!(
                "a {ty} tensor of dims {dims:?} has more bytes than this host can address"
            ))
        })?;
        let limit = self.tenant.limits().max_device_bytes;
        if bytes as u64 > limit {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "a tensor of {bytes} bytes is larger than this session may hold, {limit} bytes (limit max-device-bytes)"
                ),
            ));
        }
        Ok(bytes)
    }

    /// Admits an upload a client is about to send ([`admit_tensor`](Self::admit_tensor)) and
    /// charges its declared size to the tenant as a transfer in flight
    /// ([`Tenant::charge_transfer`]) before any buffer for it is allocated; the front door
    /// holds the returned charge until the upload is done, failed or cancelled. Returns the
    /// dense size in bytes and the charge.
    ///
    /// Errors: as [`admit_tensor`](Self::admit_tensor); `resource-exhausted` naming
    /// `max-device-bytes` when the tenant's transfers in flight leave no room for this one.
    pub fn admit_upload(
        &self,
        ty: PrimitiveType,
        dims: &[u64],
        what: &str,
    ) -> DeviceResult<(usize, Charge)> {
        let bytes = self.admit_tensor(ty, dims)?;
        let charge = self.tenant.charge_transfer(bytes as u64, what)?;
        Ok((bytes, charge))
    }

    fn charge_one(&self, bytes: u64) -> DeviceResult<Charge> {
        let mut c = self.tenant.charge_tensors(&[bytes], 0)?;
        Ok(c.remove(0))
    }

    /// Reads a tensor back as dense row-major bytes.
    ///
    /// Errors: `permission-denied` for another session's handle; `failed-precondition` after
    /// donation; `resource-exhausted` naming `max-guest-memory` when the tensor is larger than
    /// this session may read; plugin errors.
    pub async fn read(&self, t: &TensorHandle) -> DeviceResult<Vec<u8>> {
        let tensor = self.readable(t)?;
        self.device.read(&tensor).await
    }

    /// Reads a tensor back into a host copy that concurrent readers of the same handle share
    /// (a front door streaming it to several slow clients holds one copy, not one each). The
    /// copy is charged to the tenant as a transfer before it is made, and returned when the
    /// last reader drops it.
    ///
    /// Errors: as [`read`](Self::read); `resource-exhausted` naming `max-device-bytes` when the
    /// tenant's transfers in flight leave no room for the copy ([`Tenant::charge_transfer`]).
    pub async fn read_shared(&self, t: &TensorHandle) -> DeviceResult<Arc<HostCopy>> {
        let tensor = self.readable(t)?;
        let mut slot = t.host_copy.lock().await;
        if let Some(copy) = slot.upgrade() {
            return Ok(copy);
        }
        let charge = self
            .tenant
            .charge_transfer(tensor.byte_size(), "the host copy of a tensor being read")?;
        let bytes = self.device.read(&tensor).await?;
        let copy = Arc::new(HostCopy {
            bytes,
            _charge: charge,
        });
        *slot = Arc::downgrade(&copy);
        Ok(copy)
    }

    /// The tensor of `t`, if this session may read it.
    fn readable(&self, t: &TensorHandle) -> DeviceResult<Arc<DeviceTensor>> {
        self.owns(t.session)?;
        let tensor = t.tensor()?;
        if tensor.byte_size() > self.max_read_bytes {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "the tensor is {} bytes and cannot be read into guest memory of at most {} bytes (limit max-guest-memory)",
                    tensor.byte_size(),
                    self.max_read_bytes
                ),
            ));
        }
        Ok(tensor)
    }

    /// Copies a tensor to `device`; the copy is a new handle, charged to the tenant.
    ///
    /// Errors: `permission-denied` for another session's handle; `failed-precondition` after
    /// donation; `resource-exhausted` naming a limit; `not-found` for an unknown device;
    /// plugin errors.
    pub fn copy_to_device(&self, t: &TensorHandle, device: u32) -> DeviceResult<TensorHandle> {
        self.owns(t.session)?;
        let tensor = t.tensor()?;
        let charge = self.charge_one(tensor.byte_size())?;
        let copy = self.device.copy_to_device(&tensor, device)?;
        Ok(self.owned_tensor(copy, charge))
    }

    /// Compiles a program for `device` (default 0) at the plugin's default optimisation level:
    /// [`compile_with`](Self::compile_with) with those [`CompileSettings`].
    ///
    /// Errors: as [`compile_with`](Self::compile_with).
    pub async fn compile(
        &self,
        code: Vec<u8>,
        format: ProgramFormat,
        device: Option<u32>,
    ) -> DeviceResult<ExecutableHandle> {
        let settings = CompileSettings {
            device: device.unwrap_or(0),
            optimization_level: None,
        };
        self.compile_with(code, format, settings).await
    }

    /// Compiles a program as `settings` say (device, optimisation level). In order: the program
    /// size is checked against `max-program-bytes`; a live executable is charged; the compile
    /// cache is asked, and only when its tier 1 (this process's loaded executables) does not
    /// hold the program is the tenant's compile rate charged (`max-compiles-per-minute`; a
    /// tier-2 or tier-3 load counts, see [`Tenant::admit_compile_rate`]); once compiled, its
    /// loops, host transfers and custom calls are checked against the tenant's program policy,
    /// its results and temporaries against `max-device-bytes`. The handle reports which tier
    /// served it ([`ExecutableHandle::tier`]).
    ///
    /// Errors: `resource-exhausted` naming `max-program-bytes`, `max-compiles-per-minute`,
    /// `max-live-executables` or `max-device-bytes`; `permission-denied` naming the policy rule
    /// ([`Tenant::admit_program`]); otherwise as [`DeviceService::compile_for`].
    pub async fn compile_with(
        &self,
        code: Vec<u8>,
        format: ProgramFormat,
        settings: CompileSettings,
    ) -> DeviceResult<ExecutableHandle> {
        self.tenant.admit_program_size(code.len())?;
        let charge = self.tenant.charge_executable()?;
        let text = format == ProgramFormat::MlirText;
        let outcome = self
            .device
            .compile_for(code, text, settings, &self.tenant)
            .await?;
        let (exe, tier) = (outcome.exe, outcome.tier);
        self.tenant.admit_program(exe.program_facts()?)?;
        let outputs = exe
            .output_bytes()
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b));
        self.tenant
            .admit_program_memory(outputs, exe.temp_bytes())?;
        Ok(ExecutableHandle {
            session: self.id,
            exe,
            tier,
            _charge: charge,
        })
    }

    /// Runs `exe` on `args`, donating the arguments whose positions are in `donate`; returns
    /// one new handle per result.
    ///
    /// In order: the handles must belong to this session and be live; `donate` must name each
    /// position at most once and no read-only tensor; the arguments must match the program
    /// ([`crate::types::validate_args`]); the results are charged, crediting the donated
    /// inputs, and so are the program's temporaries until the device is done with them
    /// ([`DeviceExecutable::temp_bytes`]); then the execution waits for a slot and runs.
    /// Donated handles are emptied only when the execution succeeds.
    ///
    /// Errors: `permission-denied` for another session's handle or a donated read-only tensor;
    /// `failed-precondition` for a donated (or concurrently donated) argument or one on another
    /// device; `invalid-argument` for a bad donate list or arguments that do not match;
    /// `resource-exhausted` naming `max-live-tensors` or `max-device-bytes`;
    /// `execution-failed` from the device.
    pub async fn execute(
        &self,
        exe: &ExecutableHandle,
        args: &[&TensorHandle],
        donate: &[u32],
    ) -> DeviceResult<Vec<TensorHandle>> {
        self.owns(exe.session)?;
        let donated = donation_mask(args.len(), donate)?;
        let mut tensors = Vec::with_capacity(args.len());
        for (i, (h, &d)) in args.iter().zip(&donated).enumerate() {
            self.owns(h.session)?;
            let t = h
                .tensor()
                .map_err(|e| DeviceError::new(e.kind, format!("argument {i}: {}", e.message)))?;
            if d && h.read_only {
                return Err(DeviceError::new(
                    ErrorKind::PermissionDenied,
                    format!("argument {i} is a shared, read-only tensor and cannot be donated"),
                ));
            }
            tensors.push((t, d));
        }
        let call = Call::new(Arc::clone(&exe.exe), tensors)?;
        // Take the donated inputs out of their handles now, so no concurrent request of this
        // session can use them; they go back if anything below fails.
        let mut taken: Vec<(&TensorHandle, Held)> = Vec::new();
        let restore = |taken: Vec<(&TensorHandle, Held)>| {
            for (h, held) in taken {
                h.restore(held);
            }
        };
        for (i, (h, _)) in args
            .iter()
            .zip(&donated)
            .enumerate()
            .filter(|(_, (_, d))| **d)
        {
            match h.take() {
                Some(held) => taken.push((h, held)),
                None => {
                    restore(taken);
                    return Err(DeviceError::new(
                        ErrorKind::FailedPrecondition,
                        format!("argument {i} was donated by another execution meanwhile"),
                    ));
                }
            }
        }
        let credit = taken.iter().map(|(_, h)| h.charged_bytes()).sum();
        let charged =
            self.tenant
                .charge_execution(&exe.exe.output_bytes(), credit, exe.exe.temp_bytes());
        let (charges, scratch) = match charged {
            Ok(c) => c,
            Err(e) => {
                restore(taken);
                return Err(e);
            }
        };
        let mut call = call;
        // The temporaries are the device's until it finishes, even if this caller gives up.
        call.hold_until_done(scratch);
        match self.device.execute_for(&self.tenant, call).await {
            Ok(outputs) => {
                // The donated inputs' charges are returned here.
                drop(taken);
                Ok(outputs
                    .into_iter()
                    .zip(charges)
                    .map(|(o, c)| self.owned_tensor(o, c))
                    .collect())
            }
            Err(e) => {
                restore(taken);
                Err(e)
            }
        }
    }

    /// Opens the weight set `name`.
    ///
    /// Errors: `not-found` naming the set and those available.
    pub fn open_weights(&self, name: &str) -> DeviceResult<Arc<WeightSet>> {
        self.weights.get(name)
    }

    /// A read-only handle to tensor `name` of `set`: no device bytes are charged (the host
    /// holds one copy for everyone), but the handle counts as a live tensor.
    ///
    /// Errors: `not-found` for a tensor the set lacks; `resource-exhausted` naming
    /// `max-live-tensors`.
    pub fn weight(&self, set: &WeightSet, name: &str) -> DeviceResult<TensorHandle> {
        let tensor = Arc::clone(set.get(name)?);
        let charge = self.charge_one(0)?;
        Ok(TensorHandle::new(self.id, tensor, true, charge))
    }
}

/// Which of `n` arguments `donate` names.
///
/// Errors: `invalid-argument` for an index out of range or listed twice.
fn donation_mask(n: usize, donate: &[u32]) -> DeviceResult<Vec<bool>> {
    let mut donated = vec![false; n];
    for &d in donate {
        let Some(slot) = donated.get_mut(d as usize) else {
            return Err(DeviceError::invalid(format!(
                "donate index {d} is out of range for {n} argument(s)"
            )));
        };
        if *slot {
            return Err(DeviceError::invalid(format!(
                "donate index {d} is listed twice"
            )));
        }
        *slot = true;
    }
    Ok(donated)
}
