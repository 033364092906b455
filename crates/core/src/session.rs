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
//!   handles emptied at launch (final: they stay empty even if the execution later fails);
//! - **reads**: a tensor larger than what the front door can take ([`Session::with_max_read_bytes`],
//!   a guest's linear memory) is refused before anything is copied;
//! - **execution slots**: executions wait for the device in the fair-share queue and their
//!   device time is charged to the tenant ([`crate::scheduler`]);
//! - **launches**: [`Session::launch`] validates and charges at once and returns output handles
//!   while the device works; `max-pending-launches` bounds what a tenant may have queued or
//!   running ([`TenantLimits::max_pending_launches`](crate::tenant::TenantLimits)).
//!
//! # Launches
//!
//! Every execution is a launch: [`Session::execute`] is [`Session::launch`] followed by
//! [`Session::wait`] on its outputs. A launch is checked and charged in the caller (the same
//! checks, in the same order, with the same errors as an execution), charged one pending
//! launch, and put in the session's **ordered submit queue**: one task per session that takes
//! the launches in order, waits for a fair-share slot for each ([`crate::scheduler`]; only this
//! task waits, so a launch never blocks on a slot) and submits it. PJRT returns the output
//! buffers at submission; the launch's output handles resolve to them then (a handle of a
//! launch not yet submitted is *pending*), and a later launch of the session may take them as
//! arguments before the device finished (the queue submits it after, and the plugin orders
//! the two). At most [`FairShare::slots`](crate::scheduler::FairShare::slots) executions are
//! submitted to the device at once, whoever launched them, so a tenant cannot flood the
//! device's queue: its launches wait in its own queue, bounded by `max-pending-launches`.
//!
//! - **Errors.** A launch's own errors (handles, donation, argument specs, limits) are
//!   returned by `launch`. The device's error surfaces at the first [`Session::wait`] or
//!   [`Session::read`] of one of its outputs, or at [`Session::wait_all`], as
//!   `execution-failed` (or the kind the device's error maps to) whose message names the
//!   launch: `launch <id> of program <fingerprint> failed: ...`. A launch whose argument is
//!   an output of a launch that failed before submission fails too, naming both. Every later
//!   read of such an output fails the same way (the tensor has no value).
//! - **Device time** is billed as [`crate::scheduler`] says: from the later of the launch's
//!   submission and the previous completion on the device, not from queueing.
//! - **Donation** is final at launch: the donated handles are emptied when `launch` returns
//!   successfully, even if the execution later fails; their charges are credited against the
//!   outputs at once and returned when the device is done.
//! - **Blocking mode** ([`Session::set_launch_blocking`], or the host's
//!   [`DeviceService::with_launch_blocking`]): `launch` returns only once the device finished,
//!   so the device's error is returned by `launch` itself.
//! - **A session that ends** with launches pending leaks nothing: launches not yet submitted
//!   are dropped with their charges, submitted ones keep their slot, arguments and charges
//!   until the device finishes, then return them (tenant usage back to zero).
//!
//! **Fast path.** When nothing of the session is in its queue, every argument is submitted, the
//! program cannot keep the submitting thread (no loop, no host transfer) and a fair-share slot
//! is free with nobody waiting, `launch` submits on the caller's thread instead: the same order
//! and fairness, without the queue task's cross-thread wake-ups (tens of microseconds per call
//! on a busy 2-core machine; see docs/BENCHMARKS.md, spine).
//!
//! CPU plugins run cheap programs inside the submit call; the queue task submits programs
//! with loops or host transfers from tokio's blocking pool ([`DeviceService::submit_for`]),
//! so no shared async thread is held for as long as such a program runs.
//!
//! Front doors only look handles up, convert types and call a session; validation of values
//! against PJRT's rules happens below, in [`crate::device`] and [`crate::types`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use pjrt::PrimitiveType;

use crate::cache::CacheTier;
use crate::device::{CompileSettings, DeviceService};
use crate::error::{DeviceError, DeviceResult, ErrorKind};
use crate::placement::Placement;
use crate::tenant::{Charge, ChargeKind, Tenant, TenantUsage};
use crate::types::{
    ArgSpec, Call, DeviceExecutable, DeviceInfo, DeviceTensor, PlatformInfo, TensorSpec,
    check_tensor_bytes, dims_from_u64, spec_byte_size, validate_arg_specs,
};
use crate::weights::{WeightRegistry, WeightSet};

/// Source of session ids; 0 is never handed out.
static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// Source of launch ids (unique in the process); 0 is never handed out.
static NEXT_LAUNCH: AtomicU64 = AtomicU64::new(1);

/// One tenant connection to the shared device; see the module docs. `Send + Sync`: a front
/// door may serve several requests of one session at once.
#[derive(Debug)]
pub struct Session {
    id: u64,
    device: Arc<DeviceService>,
    weights: Arc<WeightRegistry>,
    tenant: Arc<Tenant>,
    /// The devices this session may use, its default first ([`crate::placement`]).
    placement: Placement,
    max_read_bytes: u64,
    launches: Launches,
    /// Weight-set versions of the tensors read since [`Session::take_weights_read`].
    weights_read: Mutex<Vec<WeightTag>>,
    /// The process groups this session is a rank of ([`crate::collective`]), by id: dropped
    /// with the session, which breaks each group for its other ranks.
    groups: Mutex<HashMap<String, Arc<crate::collective::Membership>>>,
    /// Where its tenant's process groups are found ([`with_groups`](Self::with_groups)).
    group_registry: Option<Arc<crate::collective::Groups>>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Launches still in the submit queue are dropped, not submitted (see the module docs).
        self.launches.closed.store(true, Ordering::Release);
    }
}

/// What [`Session::launch`] returns: the launch's id (unique in the process, named in its
/// errors) and one handle per result of the program, in order, pending until the launch is
/// submitted and valued once the device finished it (wait with [`Session::wait`]; a read
/// waits too).
#[derive(Debug)]
pub struct Launch {
    /// The launch's id, as errors name it (`launch <id> of program <fingerprint>`).
    pub id: u64,
    /// One handle per program result (dtype and dims of the executable's outputs).
    pub outputs: Vec<TensorHandle>,
}

/// A session's launches: its ordered submit queue and those not yet known finished.
#[derive(Debug, Default)]
struct Launches {
    /// Sender of the submit queue, whose task starts at the first launch.
    queue: Mutex<Option<tokio::sync::mpsc::UnboundedSender<Job>>>,
    /// Set when the session ends: the queue drops what it has not submitted.
    closed: Arc<AtomicBool>,
    /// Launches not finished, and failed launches no wait reported yet (for `wait_all`).
    tracked: Mutex<Vec<Arc<LaunchState>>>,
    /// [`Session::set_launch_blocking`].
    blocking: AtomicBool,
    /// Launches in the submit queue not yet submitted (while 0, a launch may be submitted by
    /// its caller: nothing of this session precedes it).
    queued: Arc<AtomicU64>,
}

/// What a launch's output handles and waiters share.
#[derive(Debug)]
struct LaunchState {
    id: u64,
    fingerprint: String,
    progress: Mutex<Progress>,
    /// The outcome, published once the launch was submitted and the device finished (or it
    /// failed before submission).
    result: OnceLock<DeviceResult<()>>,
    done: tokio::sync::watch::Sender<bool>,
    /// Whether a wait, read or `wait_all` reported its failure.
    reported: AtomicBool,
}

#[derive(Debug, Default)]
struct Progress {
    submitted: bool,
    status: Option<DeviceResult<()>>,
}

impl LaunchState {
    fn new(id: u64, fingerprint: &str) -> Self {
        LaunchState {
            id,
            fingerprint: fingerprint.to_string(),
            progress: Mutex::new(Progress::default()),
            result: OnceLock::new(),
            done: tokio::sync::watch::Sender::new(false),
            reported: AtomicBool::new(false),
        }
    }

    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that the outputs were handed to the handles.
    fn submitted(&self) {
        let status = {
            let mut p = self.progress();
            p.submitted = true;
            p.status.take()
        };
        if let Some(s) = status {
            self.publish(s);
        }
    }

    /// Records the device's status (possibly before [`submitted`](Self::submitted) ran).
    fn completed(&self, status: DeviceResult<()>) {
        let status = {
            let mut p = self.progress();
            if !p.submitted {
                p.status = Some(status);
                return;
            }
            status
        };
        self.publish(status);
    }

    /// Ends the launch: with the device's status, or an error before submission.
    fn publish(&self, status: DeviceResult<()>) {
        let status = status.map_err(|e| {
            DeviceError::new(
                e.kind,
                format!(
                    "launch {} of program {} failed: {}",
                    self.id, self.fingerprint, e.message
                ),
            )
        });
        let _ = self.result.set(status);
        self.done.send_replace(true);
    }

    fn is_done(&self) -> bool {
        self.result.get().is_some()
    }

    fn failed(&self) -> bool {
        matches!(self.result.get(), Some(Err(_)))
    }

    /// Waits until the launch is done; its error, if it failed. A wait longer than
    /// [`STUCK_AFTER`](crate::device::STUCK_AFTER) is logged once: PJRT cannot cancel an
    /// execution, so it keeps its slot until the device finishes.
    async fn wait(&self) -> DeviceResult<()> {
        let mut rx = self.done.subscribe();
        // The sender lives in `self`, so this ends only when the launch is done.
        let done = async {
            // The guard `wait_for` returns is dropped here, not held across an await.
            let _ = rx.wait_for(|d| *d).await;
        };
        tokio::pin!(done);
        tokio::select! {
            () = &mut done => {}
            () = tokio::time::sleep(crate::device::STUCK_AFTER) => {
                tracing::warn!(
                    target: "tpubox::device",
                    launch = self.id,
                    program = %self.fingerprint,
                    seconds = crate::device::STUCK_AFTER.as_secs(),
                    "a launch is still not finished; PJRT cannot cancel it, so it keeps its slot until the device finishes (usage: executions_running)"
                );
                done.await;
            }
        }
        self.result.get().cloned().unwrap_or_else(|| {
            Err(DeviceError::new(
                ErrorKind::Internal,
                format!("launch {} ended without a result", self.id),
            ))
        })
    }
}

/// An output of a launch, shared by its handle and by later launches that take it as an
/// argument; the queue fills it when the launch is submitted (if anyone still holds it).
#[derive(Debug)]
struct PendingTensor {
    launch: Arc<LaunchState>,
    tensor: OnceLock<Arc<DeviceTensor>>,
}

/// Where a handle's tensor is.
#[derive(Debug, Clone)]
enum Source {
    Ready(Arc<DeviceTensor>),
    Pending(Arc<PendingTensor>),
}

impl Source {
    /// The tensor, once its launch was submitted.
    ///
    /// Errors: the launch's error if it failed before submission; `failed-precondition`
    /// while it is not submitted yet.
    fn submitted(&self) -> DeviceResult<Arc<DeviceTensor>> {
        match self {
            Source::Ready(t) => Ok(Arc::clone(t)),
            Source::Pending(p) => match (p.tensor.get(), p.launch.result.get()) {
                (Some(t), _) => Ok(Arc::clone(t)),
                (None, Some(Err(e))) => Err(e.clone()),
                (None, _) => Err(DeviceError::new(
                    ErrorKind::FailedPrecondition,
                    format!(
                        "this tensor is an output of launch {}, which is not submitted yet; wait for it first",
                        p.launch.id
                    ),
                )),
            },
        }
    }
}

/// A launch in a session's submit queue.
struct Job {
    launch: Arc<LaunchState>,
    exe: Arc<DeviceExecutable>,
    args: Vec<(Source, bool)>,
    outputs: Vec<Weak<PendingTensor>>,
    /// Returned when the device is done (or the launch fails before submission): the pending
    /// launch, the temporaries, the donated inputs' device bytes.
    charges: Vec<Charge>,
    /// The donated inputs, kept until the device is done with them.
    donated: Vec<Source>,
}

impl Job {
    /// The call to submit, the record of its submission and its completion callback; `None`
    /// when the launch failed before submission (its error is published, its charges are
    /// returned).
    fn prepare(
        self,
    ) -> Option<(
        Call,
        Submission,
        impl FnOnce(DeviceResult<()>) + Send + 'static,
    )> {
        let call = job_call(&self.launch, self.exe, &self.args, self.donated)?;
        let on_done = job_done(&self.launch, self.charges);
        let submission = Submission {
            launch: self.launch,
            outputs: self.outputs,
        };
        Some((call, submission, on_done))
    }
}

/// A prepared launch's outputs, to be handed their buffers once it is submitted.
struct Submission {
    launch: Arc<LaunchState>,
    outputs: Vec<Weak<PendingTensor>>,
}

impl Submission {
    /// Records the submission's outcome ([`job_submitted`]).
    fn record(self, submitted: DeviceResult<Vec<DeviceTensor>>) {
        job_submitted(&self.launch, &self.outputs, submitted);
    }
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("launch", &self.launch.id)
            .finish()
    }
}

/// The task behind a session's submit queue: takes its launches in order, waits for a
/// fair-share slot for each and submits it. Once the session ended (`closed`), the launches
/// left are dropped with their charges, unsubmitted.
async fn run_submit_queue(
    device: Arc<DeviceService>,
    tenant: Arc<Tenant>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Job>,
    closed: Arc<AtomicBool>,
    queued: Arc<AtomicU64>,
) {
    while let Some(job) = rx.recv().await {
        if closed.load(Ordering::Acquire) {
            job.launch.publish(Err(DeviceError::new(
                ErrorKind::FailedPrecondition,
                "the session ended before it was submitted",
            )));
        } else {
            submit_job(&device, &tenant, job).await;
        }
        queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The call of a job whose arguments are all submitted; `None` (the launch failed, and says
/// why) when one is the output of a launch that failed before submission.
fn job_call(
    launch: &LaunchState,
    exe: Arc<DeviceExecutable>,
    args: &[(Source, bool)],
    donated: Vec<Source>,
) -> Option<Call> {
    let mut tensors = Vec::with_capacity(args.len());
    for (i, (source, donate)) in args.iter().enumerate() {
        match source.submitted() {
            Ok(t) => tensors.push((t, *donate)),
            Err(e) => {
                launch.publish(Err(DeviceError::new(
                    ErrorKind::ExecutionFailed,
                    format!("argument {i}: {}", e.message),
                )));
                return None;
            }
        }
    }
    match Call::new(exe, tensors) {
        Ok(mut call) => {
            call.hold_until_done(donated);
            Some(call)
        }
        Err(e) => {
            launch.publish(Err(e));
            None
        }
    }
}

/// The completion callback of a job: returns its charges, then ends the launch.
fn job_done(
    launch: &Arc<LaunchState>,
    charges: Vec<Charge>,
) -> impl FnOnce(DeviceResult<()>) + Send + 'static + use<> {
    let done = Arc::clone(launch);
    move |status| {
        // Charges first, so that a waiter woken below sees the tenant's usage without them.
        drop(charges);
        done.completed(status);
    }
}

/// Hands a submitted job's output buffers to the outputs still held, and marks it submitted.
fn job_submitted(
    launch: &LaunchState,
    outputs: &[Weak<PendingTensor>],
    submitted: DeviceResult<Vec<DeviceTensor>>,
) {
    match submitted {
        Ok(tensors) => {
            for (slot, t) in outputs.iter().zip(tensors) {
                if let Some(p) = slot.upgrade() {
                    let _ = p.tensor.set(Arc::new(t));
                }
            }
            launch.submitted();
        }
        Err(e) => launch.publish(Err(e)),
    }
}

async fn submit_job(device: &Arc<DeviceService>, tenant: &Arc<Tenant>, job: Job) {
    let Some((call, submission, on_done)) = job.prepare() else {
        return;
    };
    let slot = device
        .scheduler_for(call.executable().device())
        .acquire(tenant)
        .await;
    submission.record(device.submit_for(slot, call, on_done).await);
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
    /// The weight-set versions this tensor is, or was computed from ([`Self::weight_versions`]).
    lineage: Lineage,
    /// The weight-set version this handle was opened from, kept alive while the handle lives.
    _version: Option<Arc<WeightSet>>,
    /// `None` once donated.
    held: Mutex<Option<Held>>,
    /// The host copy concurrent readers share while any of them holds it
    /// ([`Session::read_shared`]).
    host_copy: tokio::sync::Mutex<Weak<HostCopy>>,
}

/// A weight-set version: the set's name and the version number.
pub type WeightTag = (Arc<str>, u64);

/// The weight-set versions a tensor is or came from, sorted, each name once (usually empty).
type Lineage = Arc<[WeightTag]>;

/// The union of `parts`, sorted by name then version.
/// The empty lineage, shared: most tensors come from no weight set, and a launch or an upload
/// should not allocate to say so.
fn no_lineage() -> Lineage {
    static EMPTY: OnceLock<Lineage> = OnceLock::new();
    Arc::clone(EMPTY.get_or_init(|| Arc::new([])))
}

/// The union of `parts`, sorted by name then version; a launch whose arguments carry at most
/// one lineage (the common case: none) shares it without allocating.
fn merge_lineage<'a>(parts: impl Iterator<Item = &'a Lineage>) -> Lineage {
    let mut non_empty = parts.filter(|p| !p.is_empty());
    let Some(first) = non_empty.next() else {
        return no_lineage();
    };
    let mut all: Vec<WeightTag> = first.to_vec();
    let mut merged = false;
    for p in non_empty {
        all.extend(p.iter().cloned());
        merged = true;
    }
    if !merged {
        return Arc::clone(first);
    }
    all.sort();
    all.dedup();
    all.into()
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
    source: Source,
    charge: Charge,
}

impl Held {
    /// Device bytes this holds against the tenant (0 for shared weights).
    fn charged_bytes(&self) -> u64 {
        match self.charge.kind() {
            ChargeKind::Tensor(b) => b,
            ChargeKind::Executable
            | ChargeKind::Scratch(_)
            | ChargeKind::Transfer(_)
            | ChargeKind::Launch => 0,
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
            lineage: no_lineage(),
            _version: None,
            held: Mutex::new(Some(Held {
                source: Source::Ready(tensor),
                charge,
            })),
            host_copy: tokio::sync::Mutex::new(Weak::new()),
        }
    }

    fn pending(
        session: u64,
        spec: TensorSpec,
        device: u32,
        tensor: Arc<PendingTensor>,
        charge: Charge,
        lineage: Lineage,
    ) -> Self {
        TensorHandle {
            session,
            spec,
            device,
            read_only: false,
            lineage,
            _version: None,
            held: Mutex::new(Some(Held {
                source: Source::Pending(tensor),
                charge,
            })),
            host_copy: tokio::sync::Mutex::new(Weak::new()),
        }
    }

    /// Whether this is an output of a launch not yet known finished ([`Session::wait`]).
    pub fn is_pending(&self) -> bool {
        matches!(
            self.lock().as_ref().map(|h| &h.source),
            Some(Source::Pending(p)) if !p.launch.is_done()
        )
    }

    /// The id of the launch whose output this is, while it is pending or failed; `None` for a
    /// tensor with a value (or donated).
    pub fn launch_id(&self) -> Option<u64> {
        match self.lock().as_ref().map(|h| &h.source) {
            Some(Source::Pending(p)) => Some(p.launch.id),
            _ => None,
        }
    }

    /// Where the tensor is, unless donated.
    fn source(&self) -> DeviceResult<Source> {
        self.lock()
            .as_ref()
            .map(|h| h.source.clone())
            .ok_or_else(donated_error)
    }

    /// Replaces a pending source whose launch finished well by its tensor.
    fn resolve(&self) {
        let mut held = self.lock();
        if let Some(h) = held.as_mut()
            && let Source::Pending(p) = &h.source
            && matches!(p.launch.result.get(), Some(Ok(())))
            && let Some(t) = p.tensor.get()
        {
            h.source = Source::Ready(Arc::clone(t));
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

    /// Whether this is a shared, read-only tensor (a weight), or a tensor of this session
    /// that it published ([`Session::publish_weights`]): either way it cannot be donated.
    pub fn is_read_only(&self) -> bool {
        self.read_only
            || matches!(
                self.lock().as_ref().map(|h| &h.source),
                Some(Source::Ready(t)) if t.is_published()
            )
    }

    /// The weight-set versions (set name, version; sorted by name) this tensor is a tensor of,
    /// or was computed from: a handle opened from a weight set carries its set's version, and
    /// an execution's results carry the union of its arguments' (so a result reached through
    /// several executions still names the versions it used). Empty for everything else.
    pub fn weight_versions(&self) -> &[WeightTag] {
        &self.lineage
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

    /// The tensor, unless donated. For an output of a launch: its PJRT buffer once the launch
    /// was submitted (ready when the device finished it; PJRT orders later uses after that).
    ///
    /// Errors: `failed-precondition` after donation, or while the launch is not submitted yet;
    /// the launch's error (`execution-failed` naming it) when it failed before submission.
    pub fn tensor(&self) -> DeviceResult<Arc<DeviceTensor>> {
        self.source()?.submitted()
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
    /// unbounded until [`with_max_read_bytes`](Self::with_max_read_bytes). It may use every
    /// device, device 0 by default, until [`with_placement`](Self::with_placement).
    pub fn new(
        device: Arc<DeviceService>,
        weights: Arc<WeightRegistry>,
        tenant: Arc<Tenant>,
    ) -> Self {
        Session {
            id: NEXT_SESSION.fetch_add(1, Ordering::Relaxed),
            placement: Placement::all(device.device_count()),
            device,
            weights,
            tenant,
            max_read_bytes: u64::MAX,
            launches: Launches::default(),
            weights_read: Mutex::new(Vec::new()),
            groups: Mutex::new(HashMap::new()),
            group_registry: None,
        }
    }

    /// Places the session on `placement`'s devices: a call naming another device is refused
    /// (`permission-denied`), and one naming none uses the placement's first device. The
    /// session keeps the placement (and its lease) until it ends.
    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Gives the session the daemon's process groups ([`crate::collective`]): the sessions
    /// given the same [`Groups`](crate::collective::Groups) meet in them. Without, its
    /// [`create_group`](Self::create_group) and [`join_group`](Self::join_group) are
    /// `unsupported`.
    pub fn with_groups(mut self, groups: Arc<crate::collective::Groups>) -> Self {
        self.group_registry = Some(groups);
        self
    }

    fn group_registry(&self) -> DeviceResult<&crate::collective::Groups> {
        self.group_registry.as_deref().ok_or_else(|| {
            DeviceError::new(
                ErrorKind::Unsupported,
                "this session has no process groups (a session of the daemon's session API has)",
            )
        })
    }

    /// The devices this session may use, its default first.
    pub fn placement(&self) -> &Placement {
        &self.placement
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

    /// Names of the weight sets this session may open, sorted: the host's and those
    /// published for its tenant.
    pub fn weight_sets(&self) -> Vec<String> {
        self.weights.names_for(self.tenant.name())
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

    /// Creates a tensor from dense row-major little-endian bytes on `device` (default: the
    /// session's default device), charged to the tenant.
    ///
    /// Errors: `invalid-argument` when the rank exceeds [`crate::types::MAX_RANK`], a dim
    /// exceeds `i64::MAX`, or `data.len()` is not element size × product of dims;
    /// `resource-exhausted` naming `max-live-tensors`, `max-device-bytes` or
    /// `max-device-bytes-per-device`; `not-found` for an unknown device; `permission-denied`
    /// for a device outside the session's placement; plugin errors.
    pub fn tensor_from_bytes(
        &self,
        ty: PrimitiveType,
        dims: &[u64],
        data: &[u8],
        device: Option<u32>,
    ) -> DeviceResult<TensorHandle> {
        let dims = dims_from_u64(dims)?;
        let bytes = check_tensor_bytes(ty, &dims, data.len())?;
        let device = self.place(device)?;
        let charge = self.charge_one(device, bytes as u64)?;
        let t = self.device.tensor_from_bytes(ty, &dims, data, device)?;
        self.tenant.count_transfer(data.len() as u64, 0);
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
        admit_dims(ty, dims, self.tenant.limits().max_device_bytes)
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

    fn charge_one(&self, device: u32, bytes: u64) -> DeviceResult<Charge> {
        let mut c = self.tenant.charge_tensors_on(device, &[bytes], 0)?;
        Ok(c.remove(0))
    }

    /// `device` (the default device when `None`) if it exists and the session may use it.
    ///
    /// Errors: `not-found` for a device the host does not have; `permission-denied` for one
    /// outside the session's placement.
    fn place(&self, device: Option<u32>) -> DeviceResult<u32> {
        if let Some(d) = device.filter(|&d| d >= self.device.device_count()) {
            return Err(DeviceError::new(
                ErrorKind::NotFound,
                format!(
                    "device {d} does not exist (this host has {} device(s))",
                    self.device.device_count()
                ),
            ));
        }
        self.placement.resolve(device)
    }

    /// Reads a tensor back as dense row-major bytes; an output of a launch is read once the
    /// launch finished ([`wait`](Self::wait)).
    ///
    /// Errors: `permission-denied` for another session's handle; `failed-precondition` after
    /// donation; `resource-exhausted` naming `max-guest-memory` when the tensor is larger than
    /// this session may read; the launch's error, naming it (as [`wait`](Self::wait)); plugin
    /// errors.
    pub async fn read(&self, t: &TensorHandle) -> DeviceResult<Vec<u8>> {
        let tensor = self.readable(t).await?;
        let bytes = self.device.read(&tensor).await?;
        self.tenant.count_transfer(0, bytes.len() as u64);
        self.note_read(t);
        Ok(bytes)
    }

    /// Remembers the weight-set versions of a tensor read ([`Session::take_weights_read`]).
    fn note_read(&self, t: &TensorHandle) {
        if !t.lineage.is_empty() {
            let mut read = self.weights_read.lock().unwrap_or_else(|p| p.into_inner());
            for tag in t.lineage.iter() {
                if !read.contains(tag) {
                    read.push(tag.clone());
                }
            }
        }
    }

    /// The weight-set versions (sorted) of the tensors this session read since the last call,
    /// and forgets them: what a served model's outputs were computed from, for its response.
    pub fn take_weights_read(&self) -> Vec<WeightTag> {
        let mut read =
            std::mem::take(&mut *self.weights_read.lock().unwrap_or_else(|p| p.into_inner()));
        read.sort();
        read
    }

    /// Reads a tensor back into a host copy that concurrent readers of the same handle share
    /// (a front door streaming it to several slow clients holds one copy, not one each). The
    /// copy is charged to the tenant as a transfer before it is made, and returned when the
    /// last reader drops it.
    ///
    /// Errors: as [`read`](Self::read); `resource-exhausted` naming `max-device-bytes` when the
    /// tenant's transfers in flight leave no room for the copy ([`Tenant::charge_transfer`]).
    pub async fn read_shared(&self, t: &TensorHandle) -> DeviceResult<Arc<HostCopy>> {
        let tensor = self.readable(t).await?;
        let mut slot = t.host_copy.lock().await;
        if let Some(copy) = slot.upgrade() {
            return Ok(copy);
        }
        let charge = self
            .tenant
            .charge_transfer(tensor.byte_size(), "the host copy of a tensor being read")?;
        let bytes = self.device.read(&tensor).await?;
        self.tenant.count_transfer(0, bytes.len() as u64);
        self.note_read(t);
        let copy = Arc::new(HostCopy {
            bytes,
            _charge: charge,
        });
        *slot = Arc::downgrade(&copy);
        Ok(copy)
    }

    /// The tensor of `t`, if this session may read it, once its launch finished.
    async fn readable(&self, t: &TensorHandle) -> DeviceResult<Arc<DeviceTensor>> {
        self.owns(t.session)?;
        t.source()?;
        if t.byte_size() > self.max_read_bytes {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "the tensor is {} bytes and cannot be read into guest memory of at most {} bytes (limit max-guest-memory)",
                    t.byte_size(),
                    self.max_read_bytes
                ),
            ));
        }
        self.wait(t).await?;
        t.tensor()
    }

    /// Copies a tensor to `device`; the copy is a new handle, charged to the tenant. An output
    /// of a launch may be copied once the launch was submitted (PJRT orders the copy after
    /// the execution).
    ///
    /// Errors: `permission-denied` for another session's handle; `failed-precondition` after
    /// donation or while the tensor's launch is not submitted yet ([`wait`](Self::wait) for
    /// it); the launch's error if it failed before submission; `resource-exhausted` naming a
    /// limit; `not-found` for an unknown device; plugin errors.
    pub fn copy_to_device(&self, t: &TensorHandle, device: u32) -> DeviceResult<TensorHandle> {
        self.owns(t.session)?;
        let device = self.place(Some(device))?;
        let tensor = t.tensor()?;
        let charge = self.charge_one(device, tensor.byte_size())?;
        let copy = self.device.copy_to_device(&tensor, device)?;
        let mut h = self.owned_tensor(copy, charge);
        h.lineage = Arc::clone(&t.lineage);
        Ok(h)
    }

    /// Compiles a program for `device` (default: the session's default device) at the plugin's
    /// default optimisation level:
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
            device: self.place(device)?,
            optimization_level: None,
            ..Default::default()
        };
        self.compile_with(code, format, settings).await
    }

    /// Compiles a program as `settings` say (device, optimisation level). In order: the program
    /// size is checked against `max-program-bytes`; a live executable is charged; MLIR text
    /// loses its source locations ([`crate::mlir_text::strip_locations`]: the same program
    /// from another notebook cell or file is the same text); the compile
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
        self.place(Some(settings.device))?;
        for &d in &settings.devices {
            self.place(Some(d))?;
        }
        self.tenant.admit_program_size(code.len())?;
        check_declared_partitions(&code, &settings)?;
        let charge = self.tenant.charge_executable()?;
        let text = format == ProgramFormat::MlirText;
        // Source locations (a notebook cell's file name, a line) make the same program
        // different text; without them it compiles once (crate::mlir_text).
        let stripped = match std::str::from_utf8(&code).ok().filter(|_| text) {
            Some(t) => match crate::mlir_text::strip_locations(t) {
                std::borrow::Cow::Owned(s) => Some(s.into_bytes()),
                std::borrow::Cow::Borrowed(_) => None,
            },
            None => None,
        };
        let code = stripped.unwrap_or(code);
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
    /// one new handle per result once the device finished: [`launch`](Self::launch), then
    /// [`wait`](Self::wait) for its outputs.
    ///
    /// Errors: as [`launch`](Self::launch) (donation is final once launched, even if the
    /// execution then fails); the device's error, naming the launch (`execution-failed`).
    pub async fn execute(
        &self,
        exe: &ExecutableHandle,
        args: &[&TensorHandle],
        donate: &[u32],
    ) -> DeviceResult<Vec<TensorHandle>> {
        let (launch, state) = self.launch_now(exe, args, donate)?;
        self.finish(&state, &launch.outputs).await?;
        Ok(launch.outputs)
    }

    /// Puts a global array (dense row-major bytes of `dims`) on the devices of an SPMD
    /// program as its parameter `param` is sharded: one handle per device, in the program's
    /// device order, each holding that device's shard (zero-padded to the per-device spec
    /// where the sharding splits a dimension unevenly), each charged on its device. What
    /// `jax.device_put(x, NamedSharding(...))` does: [`put_global`](Self::put_global) with
    /// the parameter's sharding and the program's devices.
    ///
    /// Errors: `invalid-argument` for a parameter the program lacks, dims or dtype other than
    /// its global spec, or a byte length that does not match; as
    /// [`put_global`](Self::put_global).
    pub fn put_sharded(
        &self,
        exe: &ExecutableHandle,
        param: usize,
        ty: PrimitiveType,
        dims: &[u64],
        data: &[u8],
    ) -> DeviceResult<Vec<TensorHandle>> {
        self.owns(exe.session)?;
        let program = &exe.exe;
        let sh = program.shardings()?;
        let (Some(sharding), Some(global)) = (sh.params.get(param), sh.global_inputs.get(param))
        else {
            return Err(DeviceError::invalid(format!(
                "the program has {} parameter(s), not {}",
                program.inputs().len(),
                param + 1
            )));
        };
        let idims = dims_from_u64(dims)?;
        if global.ty != ty || global.dims != idims {
            return Err(DeviceError::invalid(format!(
                "parameter {param} is {} globally, got {ty}{idims:?}",
                crate::types::format_spec(global)
            )));
        }
        self.put_global(ty, dims, data, sharding, program.devices())
    }

    /// Puts a global array (dense row-major little-endian bytes of `dims`) on `devices` as
    /// `sharding` lays it out: one handle per device, in the order of `devices` (entry `k` is
    /// the sharding's logical device `k`: an SPMD program's partition `k`), each holding that
    /// device's part of the array in a buffer of the sharding's tile dims
    /// ([`pjrt::HloSharding::tile_dims`]: `ceil(n / tiles)` along each dimension, zero-padded
    /// where the tiles do not divide it), each charged to the tenant on its device. The array
    /// needs no executable: what `jax.device_put(x, NamedSharding(mesh, spec))` does.
    ///
    /// Errors: `invalid-argument` when `data` is not element size × product of `dims` bytes,
    /// for no devices, a device given twice, or a sharding that does not cover exactly
    /// `devices.len()` logical devices or tile this rank; `unsupported` for a sharding with no
    /// global-array view (manual, unreduced, unknown, a tuple); `not-found` for a device the
    /// host lacks; `permission-denied` for one outside the session's placement; as
    /// [`tensor_from_bytes`](Self::tensor_from_bytes) for each shard (a failure drops, and so
    /// uncharges, the shards made so far).
    pub fn put_global(
        &self,
        ty: PrimitiveType,
        dims: &[u64],
        data: &[u8],
        sharding: &pjrt::HloSharding,
        devices: &[u32],
    ) -> DeviceResult<Vec<TensorHandle>> {
        let idims = dims_from_u64(dims)?;
        check_tensor_bytes(ty, &idims, data.len())?;
        let (shards, local) = self.layout(&idims, sharding, devices)?;
        let local_u: Vec<u64> = local.iter().map(|&d| d as u64).collect();
        let mut out = Vec::with_capacity(shards.len());
        for (shard, &device) in shards.iter().zip(devices) {
            let bytes = shard
                .extract(data, &idims, ty.byte_size(), &local)
                .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::InvalidArgument))?;
            out.push(self.tensor_from_bytes(ty, &local_u, &bytes, Some(device))?);
        }
        Ok(out)
    }

    /// Each device's part of a global array of `dims` under `sharding` over `devices`, and
    /// the dims of each device's buffer; checks the devices (placement, no repeats).
    fn layout(
        &self,
        dims: &[i64],
        sharding: &pjrt::HloSharding,
        devices: &[u32],
    ) -> DeviceResult<(Vec<pjrt::Shard>, Vec<i64>)> {
        if devices.is_empty() {
            return Err(DeviceError::invalid(
                "a sharded array needs at least one device",
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for &d in devices {
            if !seen.insert(d) {
                return Err(DeviceError::invalid(format!(
                    "device {d} is given twice for one sharded array"
                )));
            }
            self.place(Some(d))?;
        }
        let pjrt_error = |e: pjrt::Error| DeviceError::from_pjrt(e, ErrorKind::InvalidArgument);
        let shards = sharding.shards(dims, devices.len()).map_err(pjrt_error)?;
        let local = sharding.tile_dims(dims).map_err(pjrt_error)?;
        Ok((shards, local))
    }

    /// Reads result `result` of an SPMD program back as one global array (dense row-major
    /// bytes of its global spec) from its per-device `shards` (as
    /// [`execute_spmd`](Self::execute_spmd) returned them):
    /// [`read_global`](Self::read_global) with the result's sharding and the program's
    /// devices.
    ///
    /// Errors: `invalid-argument` for a result the program lacks; as
    /// [`read_global`](Self::read_global).
    pub async fn read_sharded(
        &self,
        exe: &ExecutableHandle,
        result: usize,
        shards: &[TensorHandle],
    ) -> DeviceResult<Vec<u8>> {
        self.owns(exe.session)?;
        let program = &exe.exe;
        let sh = program.shardings()?;
        let (Some(sharding), Some(global)) =
            (sh.outputs.get(result), sh.global_outputs.get(result))
        else {
            return Err(DeviceError::invalid(format!(
                "the program has {} result(s), not {}",
                program.outputs().len(),
                result + 1
            )));
        };
        let dims: Vec<u64> = global.dims.iter().map(|&d| d.max(0) as u64).collect();
        let refs: Vec<&TensorHandle> = shards.iter().collect();
        self.read_global(global.ty, &dims, sharding, program.devices(), &refs)
            .await
    }

    /// Reads a sharded array back as one global array (dense row-major little-endian bytes
    /// of `dims`) from its per-device `shards` (entry `k` on `devices[k]`, the sharding's
    /// logical device `k`, holding a buffer of the sharding's tile dims): each part of the
    /// array is read from the first device that holds it ([`pjrt::Shard::primary`]), so a
    /// replicated array is read once. Outputs of launches are waited for.
    ///
    /// Errors: `invalid-argument` for a number of shards other than of devices, a shard whose
    /// dtype or dims are not `ty` and the tile dims, or one not on its device, and as
    /// [`put_global`](Self::put_global) for the devices and the sharding; `resource-exhausted`
    /// naming `max-guest-memory` for a global array larger than this session may read;
    /// `permission-denied` for a device outside the session's placement or another session's
    /// handle; as [`read`](Self::read) for each shard read.
    pub async fn read_global(
        &self,
        ty: PrimitiveType,
        dims: &[u64],
        sharding: &pjrt::HloSharding,
        devices: &[u32],
        shards: &[&TensorHandle],
    ) -> DeviceResult<Vec<u8>> {
        let idims = dims_from_u64(dims)?;
        if shards.len() != devices.len() {
            return Err(DeviceError::invalid(format!(
                "{} shard(s) given for {} device(s)",
                shards.len(),
                devices.len()
            )));
        }
        let (parts, local) = self.layout(&idims, sharding, devices)?;
        for (k, (h, &device)) in shards.iter().zip(devices).enumerate() {
            self.owns(h.session)?;
            if h.spec().ty != ty || h.spec().dims != local {
                return Err(DeviceError::invalid(format!(
                    "shard {k} is {}; a {ty}{idims:?} array sharded {sharding} holds {ty}{local:?} on each device",
                    crate::types::format_spec(h.spec())
                )));
            }
            if h.device() != device {
                return Err(DeviceError::invalid(format!(
                    "shard {k} is on device {}, not on device {device}",
                    h.device()
                )));
            }
        }
        let total = crate::types::checked_byte_size(ty, &idims).ok_or_else(|| {
            DeviceError::invalid(format!(
                "a {ty} array of dims {idims:?} has more bytes than this host can address"
            ))
        })?;
        if total as u64 > self.max_read_bytes {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "the global array is {total} bytes and cannot be read into memory of at most {} bytes (limit max-guest-memory)",
                    self.max_read_bytes
                ),
            ));
        }
        let elem = ty.byte_size();
        let mut out = vec![0u8; total];
        for (part, h) in parts.iter().zip(shards) {
            if !part.primary {
                continue;
            }
            let bytes = self.read(h).await?;
            part.insert(&bytes, &local, &mut out, &idims, elem)
                .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::InvalidArgument))?;
        }
        Ok(out)
    }

    /// Runs a program compiled for several devices (SPMD: compiled with
    /// [`CompileSettings::devices`]) on all of them at once and waits for it: `args[p][k]` is
    /// parameter `p`'s shard on the program's `k`-th device
    /// ([`DeviceExecutable::devices`](crate::types::DeviceExecutable::devices); per-device
    /// specs [`DeviceExecutable::inputs`](crate::types::DeviceExecutable::inputs)), `donate`
    /// the parameters donated (every shard of each). Returns `[result][device]` handles, each
    /// charged on its own device. Outputs of earlier launches are waited for first.
    ///
    /// In order: the handles must be this session's and live; one execution slot of every
    /// device is taken (in ascending device order, so two programs over the same devices
    /// cannot each hold a slot the other waits for); the donated shards are taken out of
    /// their handles; the launch, each device's results and temporaries are charged on that
    /// device (crediting its donated shards). The execution then belongs to the device
    /// service ([`DeviceService::execute_spmd`]): if this session ends meanwhile, nothing the
    /// devices use is freed until they finish, and the charges come back then.
    ///
    /// Errors: `permission-denied` for another session's handle or a donated read-only shard;
    /// `invalid-argument` for a program of one device, wrong counts, a bad donate list or a
    /// shard whose dtype or dims differ from the per-device spec; `failed-precondition` for
    /// a donated handle, or a shard on another device than its partition's;
    /// `resource-exhausted` naming `max-pending-launches`, `max-live-tensors`,
    /// `max-device-bytes` or `max-device-bytes-per-device`; a launch's error for an argument
    /// that is a failed launch's output; the device's error (`execution-failed`).
    pub async fn execute_spmd(
        &self,
        exe: &ExecutableHandle,
        args: &[Vec<&TensorHandle>],
        donate: &[u32],
    ) -> DeviceResult<Vec<Vec<TensorHandle>>> {
        self.owns(exe.session)?;
        let program = Arc::clone(&exe.exe);
        if !program.is_spmd() {
            return Err(DeviceError::invalid(
                "the program was compiled for one device: use execute",
            ));
        }
        let devices = program.devices().to_vec();
        let n = devices.len();
        if args.len() != program.inputs().len() {
            return Err(DeviceError::invalid(format!(
                "the program takes {} argument(s), got {}",
                program.inputs().len(),
                args.len()
            )));
        }
        let donated = donation_mask(args.len(), donate)?;
        for (p, shards) in args.iter().enumerate() {
            if shards.len() != n {
                return Err(DeviceError::invalid(format!(
                    "argument {p} has {} shard(s); the program runs on {n} devices",
                    shards.len()
                )));
            }
            for (k, h) in shards.iter().enumerate() {
                self.owns(h.session)?;
                if donated[p] && h.is_read_only() {
                    return Err(DeviceError::new(
                        ErrorKind::PermissionDenied,
                        format!(
                            "argument {p}'s shard {k} is a shared, read-only tensor and cannot be donated"
                        ),
                    ));
                }
                if h.device() != devices[k] {
                    return Err(DeviceError::new(
                        ErrorKind::FailedPrecondition,
                        format!(
                            "argument {p}'s shard {k} is on device {}, and the program runs partition {k} on device {}",
                            h.device(),
                            devices[k]
                        ),
                    ));
                }
                self.wait(h).await.map_err(|e| {
                    DeviceError::new(e.kind, format!("argument {p}'s shard {k}: {}", e.message))
                })?;
            }
        }
        // Slots first (cancel-safe): nothing is taken or charged while waiting for them.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&k| devices[k]);
        let mut slots = Vec::with_capacity(n);
        for k in order {
            slots.push(
                self.device
                    .scheduler_for(devices[k])
                    .acquire(&self.tenant)
                    .await,
            );
        }
        let mut taken: Vec<(&TensorHandle, Held)> = Vec::new();
        let restore = |taken: Vec<(&TensorHandle, Held)>| {
            for (h, held) in taken {
                h.restore(held);
            }
        };
        let mut tensors: Vec<Vec<Arc<DeviceTensor>>> = vec![Vec::with_capacity(args.len()); n];
        for (p, shards) in args.iter().enumerate() {
            for (k, h) in shards.iter().enumerate() {
                let t = if donated[p] {
                    match h.take() {
                        Some(held) => {
                            let t = match &held.source {
                                Source::Ready(t) => Ok(Arc::clone(t)),
                                Source::Pending(pt) => {
                                    pt.tensor.get().cloned().ok_or_else(donated_error)
                                }
                            };
                            taken.push((h, held));
                            t
                        }
                        None => Err(DeviceError::new(
                            ErrorKind::FailedPrecondition,
                            format!(
                                "argument {p}'s shard {k} was donated by another execution meanwhile"
                            ),
                        )),
                    }
                } else {
                    h.tensor()
                };
                match t {
                    Ok(t) => tensors[k].push(t),
                    Err(e) => {
                        restore(taken);
                        return Err(e);
                    }
                }
            }
        }
        let mut held: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
        let mut charges: Vec<Vec<Charge>> = Vec::with_capacity(n);
        let charged = (|| -> DeviceResult<()> {
            held.push(Box::new(self.tenant.charge_launch()?));
            for &device in &devices {
                let credit = taken
                    .iter()
                    .filter(|(h, _)| h.device() == device)
                    .map(|(_, held)| held.charged_bytes())
                    .sum();
                let (out, scratch) = self.tenant.charge_execution(
                    device,
                    &program.output_bytes(),
                    credit,
                    program.temp_bytes(),
                )?;
                charges.push(out);
                held.push(Box::new(scratch));
            }
            Ok(())
        })();
        if let Err(e) = charged {
            restore(taken);
            return Err(e);
        }
        let lineage = merge_lineage(args.iter().flatten().map(|h| &h.lineage));
        for (_, h) in taken {
            held.push(Box::new(h));
        }
        let donate_positions: Vec<usize> = (0..args.len()).filter(|&p| donated[p]).collect();
        let outputs = self
            .device
            .execute_spmd(program, tensors, donate_positions, slots, held)
            .await?;
        // [device][result] → [result][device], each with its device's charge.
        let results = outputs.first().map_or(0, Vec::len);
        let mut by_result: Vec<Vec<TensorHandle>> =
            (0..results).map(|_| Vec::with_capacity(n)).collect();
        for (per_device, device_charges) in outputs.into_iter().zip(charges) {
            for (r, (t, c)) in per_device.into_iter().zip(device_charges).enumerate() {
                let mut h = self.owned_tensor(t, c);
                h.lineage = Arc::clone(&lineage);
                by_result[r].push(h);
            }
        }
        Ok(by_result)
    }

    /// Makes a process group of `size` ranks ([`crate::collective`]) and joins it as `rank`;
    /// returns its id, which the other ranks pass to [`join_group`](Self::join_group).
    /// `allowed_devices` is how many devices the tenant's sessions may use (the door knows).
    /// Each rank's device is its session's default device.
    ///
    /// Errors: as [`crate::collective::Groups::create`], then as
    /// [`join_group`](Self::join_group).
    pub fn create_group(
        &self,
        size: u32,
        allowed_devices: u32,
        timeout: std::time::Duration,
        rank: u32,
    ) -> DeviceResult<String> {
        let group = self
            .group_registry()?
            .create(&self.tenant, size, allowed_devices, timeout)?;
        let id = group.id().to_string();
        // The creator joins at once: a group always has a member whose end forgets it.
        let member = group.join(rank, self.placement.default_device())?;
        self.groups
            .lock()
            .expect("session groups lock")
            .insert(id.clone(), Arc::new(member));
        Ok(id)
    }

    /// Joins the process group `id` of this session's tenant as `rank`, on this session's
    /// default device.
    ///
    /// Errors: `not-found` for an unknown id (or another tenant's); `invalid-argument` for a
    /// rank outside the group; `failed-precondition` for a rank already joined, a device
    /// another rank has, a broken group, or a session that is a member already.
    pub fn join_group(&self, id: &str, rank: u32) -> DeviceResult<()> {
        let group = self.group_registry()?.find(&self.tenant, id)?;
        let mut mine = self.groups.lock().expect("session groups lock");
        if mine.contains_key(id) {
            return Err(DeviceError::new(
                ErrorKind::FailedPrecondition,
                "this session is a member of the group already",
            ));
        }
        let member = group.join(rank, self.placement.default_device())?;
        mine.insert(id.to_string(), Arc::new(member));
        Ok(())
    }

    /// Leaves the process group `id` (what ending the session does): the group breaks for
    /// its other ranks, and is forgotten after its last member. Returns whether this session
    /// was a member.
    pub fn leave_group(&self, id: &str) -> bool {
        self.groups
            .lock()
            .expect("session groups lock")
            .remove(id)
            .is_some()
    }

    /// Leaves every process group (what the session layer does when the session ends);
    /// returns how many.
    pub fn leave_all_groups(&self) -> usize {
        let mut mine = self.groups.lock().expect("session groups lock");
        let n = mine.len();
        mine.clear();
        n
    }

    /// Runs this rank's next collective of group `id` on `input` (none for a barrier) and
    /// returns its result as a new handle of this session, charged on this rank's device; see
    /// [`crate::collective`]. Pending inputs are waited for first.
    ///
    /// Errors: `not-found` when this session is no member of the group; `permission-denied`
    /// for another session's handle; as [`crate::collective::Membership`]'s collectives
    /// (`failed-precondition` for a timeout or a broken group, `invalid-argument` when the
    /// ranks disagree).
    pub async fn collective(
        &self,
        id: &str,
        what: crate::collective::Collective,
        input: Option<&TensorHandle>,
    ) -> DeviceResult<Option<TensorHandle>> {
        let member = self
            .groups
            .lock()
            .expect("session groups lock")
            .get(id)
            .cloned()
            .ok_or_else(|| {
                DeviceError::new(
                    ErrorKind::NotFound,
                    "this session is no member of that process group",
                )
            })?;
        let tensor = match input {
            Some(h) => {
                self.owns(h.session)?;
                self.wait(h).await?;
                Some(h.tensor()?)
            }
            None => None,
        };
        let out = member.run(&self.device, &self.tenant, what, tensor).await?;
        Ok(out.map(|(t, charge)| self.owned_tensor(t, charge)))
    }

    /// Launches `exe` on `args`, donating the arguments whose positions are in `donate`, and
    /// returns at once with one handle per result (dtype and dims of the executable's
    /// outputs), while the device works; see the module docs on launches. Arguments may be
    /// pending outputs of this session's earlier launches.
    ///
    /// In order: the handles must belong to this session and be live; `donate` must name each
    /// position at most once and no read-only tensor; the arguments must match the program
    /// (dtype, dims, device; a donated handle passed once); the launch is charged against
    /// `max-pending-launches`, the results and the program's temporaries
    /// ([`DeviceExecutable::temp_bytes`]) against the tenant's limits, crediting the donated
    /// inputs. Then the donated handles are emptied (final), and the launch goes to the
    /// session's submit queue. With launch blocking on ([`set_launch_blocking`](Self::set_launch_blocking)
    /// or the host's [`DeviceService::with_launch_blocking`]) it returns only once the device
    /// finished.
    ///
    /// Errors: `permission-denied` for another session's handle or a donated read-only tensor;
    /// `failed-precondition` for a donated (or concurrently donated) argument or one on another
    /// device; `invalid-argument` for a bad donate list or arguments that do not match;
    /// `resource-exhausted` naming `max-pending-launches`, `max-live-tensors` or
    /// `max-device-bytes`; `internal` outside a tokio runtime. In blocking mode also the
    /// device's error, naming the launch (`execution-failed`). Otherwise the device's error
    /// surfaces at the first [`wait`](Self::wait), [`read`](Self::read) or
    /// [`wait_all`](Self::wait_all).
    pub async fn launch(
        &self,
        exe: &ExecutableHandle,
        args: &[&TensorHandle],
        donate: &[u32],
    ) -> DeviceResult<Launch> {
        let (launch, state) = self.launch_now(exe, args, donate)?;
        if self.launch_blocking() {
            self.finish(&state, &launch.outputs).await?;
        }
        Ok(launch)
    }

    /// Makes every later [`launch`](Self::launch) of this session synchronous (`true`): it
    /// returns only once the device finished, with the device's error if it failed: the
    /// debugging mode of TorchTPU's `TORCH_TPU_LAUNCH_BLOCKING=1`. The host's switch
    /// ([`DeviceService::with_launch_blocking`], `tpubox run/serve --launch-blocking`) turns it
    /// on for every session, whatever this says.
    pub fn set_launch_blocking(&self, on: bool) {
        self.launches.blocking.store(on, Ordering::Relaxed);
    }

    /// Whether launches of this session are synchronous (its own switch or the host's).
    pub fn launch_blocking(&self) -> bool {
        self.launches.blocking.load(Ordering::Relaxed) || self.device.launch_blocking()
    }

    /// Waits until the launch whose output `t` is has finished (at once for a tensor with a
    /// value). Cancel-safe: the launch goes on.
    ///
    /// Errors: `permission-denied` for another session's handle; `failed-precondition` after
    /// donation; the launch's error, naming it (`launch <id> of program <fingerprint> failed:
    /// ...`; kind `execution-failed`, or what the device's error maps to), at every wait.
    pub async fn wait(&self, t: &TensorHandle) -> DeviceResult<()> {
        self.owns(t.session)?;
        if let Source::Pending(p) = t.source()? {
            if let Err(e) = p.launch.wait().await {
                p.launch.reported.store(true, Ordering::Relaxed);
                return Err(e);
            }
            t.resolve();
        }
        Ok(())
    }

    /// Waits until every launch of this session made so far has finished. Cancel-safe.
    ///
    /// Errors: the error of the first (lowest id) failed launch that no wait, read or earlier
    /// `wait_all` reported, naming it and how many others failed unreported; those are
    /// reported by this call too.
    pub async fn wait_all(&self) -> DeviceResult<()> {
        let tracked: Vec<Arc<LaunchState>> = self.tracked().clone();
        let mut first: Option<DeviceError> = None;
        let mut others = 0u64;
        for l in &tracked {
            if let Err(e) = l.wait().await
                && !l.reported.swap(true, Ordering::Relaxed)
            {
                match first {
                    None => first = Some(e),
                    Some(_) => others += 1,
                }
            }
        }
        self.prune();
        match first {
            None => Ok(()),
            Some(mut e) => {
                if others > 0 {
                    e.message
                        .push_str(&format!(" ({others} later launch(es) failed too)"));
                }
                Err(e)
            }
        }
    }

    fn tracked(&self) -> std::sync::MutexGuard<'_, Vec<Arc<LaunchState>>> {
        self.launches
            .tracked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets finished launches, keeping those failed unreported (at most one per pending
    /// launch allowed: beyond that the oldest are forgotten, counted as reported).
    fn prune(&self) {
        let mut t = self.tracked();
        t.retain(|l| !l.is_done() || (l.failed() && !l.reported.load(Ordering::Relaxed)));
        let cap = self.tenant.limits().max_pending_launches.max(1) as usize;
        let failed = t.iter().filter(|l| l.is_done()).count();
        if failed > cap {
            let mut drop_n = failed - cap;
            t.retain(|l| {
                if drop_n > 0 && l.is_done() {
                    drop_n -= 1;
                    false
                } else {
                    true
                }
            });
        }
    }

    /// Waits for `state` and resolves `outputs`, reporting its failure.
    async fn finish(&self, state: &LaunchState, outputs: &[TensorHandle]) -> DeviceResult<()> {
        if let Err(e) = state.wait().await {
            state.reported.store(true, Ordering::Relaxed);
            return Err(e);
        }
        for o in outputs {
            o.resolve();
        }
        Ok(())
    }

    /// [`launch`](Self::launch) without the blocking mode's wait.
    fn launch_now(
        &self,
        exe: &ExecutableHandle,
        args: &[&TensorHandle],
        donate: &[u32],
    ) -> DeviceResult<(Launch, Arc<LaunchState>)> {
        self.owns(exe.session)?;
        let donated = donation_mask(args.len(), donate)?;
        let mut sources = Vec::with_capacity(args.len());
        for (i, (h, &d)) in args.iter().zip(&donated).enumerate() {
            self.owns(h.session)?;
            let s = h
                .source()
                .map_err(|e| DeviceError::new(e.kind, format!("argument {i}: {}", e.message)))?;
            if d && h.read_only {
                return Err(DeviceError::new(
                    ErrorKind::PermissionDenied,
                    format!("argument {i} is a shared, read-only tensor and cannot be donated"),
                ));
            }
            sources.push((s, d));
        }
        check_launch_args(&exe.exe, args, &donated)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            DeviceError::new(
                ErrorKind::Internal,
                "a launch needs a tokio runtime for its submit queue",
            )
        })?;
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
                Some(held) if matches!(&held.source, Source::Ready(t) if t.is_published()) => {
                    taken.push((h, held));
                    restore(taken);
                    return Err(DeviceError::new(
                        ErrorKind::PermissionDenied,
                        format!(
                            "argument {i} is published as a weight version (read-only for everyone) and cannot be donated; pass it without donating, or donate a copy"
                        ),
                    ));
                }
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
        let pending = match self.tenant.charge_launch() {
            Ok(c) => c,
            Err(e) => {
                restore(taken);
                return Err(e);
            }
        };
        let credit = taken.iter().map(|(_, h)| h.charged_bytes()).sum();
        let charged = self.tenant.charge_execution(
            exe.exe.device(),
            &exe.exe.output_bytes(),
            credit,
            exe.exe.temp_bytes(),
        );
        let (charges, scratch) = match charged {
            Ok(c) => c,
            Err(e) => {
                restore(taken);
                return Err(e);
            }
        };
        // From here on the launch happens: donation is final.
        let id = NEXT_LAUNCH.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(LaunchState::new(id, exe.exe.fingerprint()));
        let outputs: Vec<Arc<PendingTensor>> = exe
            .exe
            .outputs()
            .iter()
            .map(|_| {
                Arc::new(PendingTensor {
                    launch: Arc::clone(&state),
                    tensor: OnceLock::new(),
                })
            })
            .collect();
        let mut job_charges = vec![pending, scratch];
        let mut kept = Vec::with_capacity(taken.len());
        for (_, held) in taken {
            job_charges.push(held.charge);
            kept.push(held.source);
        }
        let job = Job {
            launch: Arc::clone(&state),
            exe: Arc::clone(&exe.exe),
            args: sources,
            outputs: outputs.iter().map(Arc::downgrade).collect(),
            charges: job_charges,
            donated: kept,
        };
        self.prune();
        self.tracked().push(Arc::clone(&state));
        if let Some(job) = self.submit_here(job) {
            self.enqueue(job, &runtime);
        }
        let lineage = merge_lineage(args.iter().map(|h| &h.lineage));
        let handles = outputs
            .into_iter()
            .zip(exe.exe.outputs())
            .zip(charges)
            .map(|((p, spec), c)| {
                TensorHandle::pending(
                    self.id,
                    spec.clone(),
                    exe.exe.device(),
                    p,
                    c,
                    Arc::clone(&lineage),
                )
            })
            .collect();
        Ok((
            Launch {
                id,
                outputs: handles,
            },
            state,
        ))
    }

    /// The fast path of a launch: submits `job` on the calling thread when nothing of this
    /// session is in its submit queue, every argument is submitted, the program cannot keep
    /// the thread ([`DeviceService::may_block`]) and a fair-share slot is free with nobody
    /// waiting ([`crate::scheduler::FairShare::try_acquire`]). The same order and fairness as
    /// the queue, without its task's cross-thread wake-ups. Returns the job when it must go to
    /// the queue instead.
    fn submit_here(&self, job: Job) -> Option<Job> {
        if self.launches.queued.load(Ordering::Acquire) != 0
            || job.args.iter().any(|(s, _)| s.submitted().is_err())
        {
            return Some(job);
        }
        if DeviceService::may_block(&job.exe) {
            return Some(job);
        }
        let Some(slot) = self
            .device
            .scheduler_for(job.exe.device())
            .try_acquire(&self.tenant)
        else {
            return Some(job);
        };
        // A launch that fails here is published as failed: it is handled, like a submitted one.
        let (call, submission, on_done) = job.prepare()?;
        submission.record(self.device.submit_now(slot, call, on_done));
        None
    }

    /// Puts `job` in the submit queue, starting its task at the first launch.
    fn enqueue(&self, job: Job, runtime: &tokio::runtime::Handle) {
        let mut q = self
            .launches
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let tx = q.get_or_insert_with(|| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            runtime.spawn(run_submit_queue(
                Arc::clone(&self.device),
                Arc::clone(&self.tenant),
                rx,
                Arc::clone(&self.launches.closed),
                Arc::clone(&self.launches.queued),
            ));
            tx
        });
        self.launches.queued.fetch_add(1, Ordering::AcqRel);
        if let Err(tokio::sync::mpsc::error::SendError(job)) = tx.send(job) {
            self.launches.queued.fetch_sub(1, Ordering::AcqRel);
            // The task is gone (its runtime shut down): fail the launch, returning its charges.
            job.launch.publish(Err(DeviceError::new(
                ErrorKind::Internal,
                "the session's submit queue is gone (its runtime shut down)",
            )));
        }
    }

    /// Opens the latest version of the weight set `name`.
    ///
    /// Errors: `not-found` naming the set and those available.
    pub fn open_weights(&self, name: &str) -> DeviceResult<Arc<WeightSet>> {
        self.open_weights_version(name, None)
    }

    /// Opens version `version` of the weight set `name` (the latest when `None`): a host set,
    /// or a published one this session's tenant may read
    /// ([`WeightRegistry::open`](crate::weights::WeightRegistry::open)).
    ///
    /// Errors: `not-found` for a name the tenant may not see, and for a version not held.
    pub fn open_weights_version(
        &self,
        name: &str,
        version: Option<u64>,
    ) -> DeviceResult<Arc<WeightSet>> {
        self.weights.open(name, version, self.tenant.name())
    }

    /// The latest version of the weight set `name` (0 once unpublished) and the versions held
    /// now, ascending.
    ///
    /// Errors: `not-found` for a name the tenant may not see.
    pub fn weight_versions(&self, name: &str) -> DeviceResult<(u64, Vec<u64>)> {
        self.weights.versions(name, self.tenant.name())
    }

    /// What this session's tenant has published and is still alive (its ledger, across all its
    /// sessions).
    pub fn published_usage(&self) -> crate::weights::PublishedUsage {
        self.weights.published_usage(self.tenant.name())
    }

    /// A read-only handle to tensor `name` of `set`: no device bytes are charged (the host
    /// holds one copy for everyone), but the handle counts as a live tensor. The handle keeps
    /// the set's version alive, and says which it is ([`TensorHandle::weight_versions`]).
    ///
    /// Errors: `not-found` for a tensor the set lacks; `resource-exhausted` naming
    /// `max-live-tensors`.
    pub fn weight(&self, set: &Arc<WeightSet>, name: &str) -> DeviceResult<TensorHandle> {
        let device = self.placement.default_device();
        let tensor = set.get_on(name, device, &self.device)?;
        let charge = self.charge_one(device, 0)?;
        let mut h = TensorHandle::new(self.id, tensor, true, charge);
        h.lineage = Arc::new([(Arc::from(set.name()), set.version())]);
        h._version = Some(Arc::clone(set));
        Ok(h)
    }

    /// Publishes `tensors` (tensor name → a handle of this session) as the next version of the
    /// weight set `name`, readable by this session's tenant and by the tenants in `readers`
    /// (`"*"`: every tenant). Outputs of launches are waited for first. The version shares the
    /// tensors' device buffers (nothing is copied, on the device or to the host) and they
    /// become read-only for everyone, this session included: donating one is then
    /// `permission-denied`. The session keeps its handles and their charges; the version is
    /// charged to the tenant's ledger ([`crate::weights`]) until it is freed. Returns the
    /// version.
    ///
    /// The handles are held locked while the version is made, so a concurrent launch of this
    /// session cannot donate one of them meanwhile: either it donated first (and this fails
    /// with `failed-precondition`) or the publish did (and the launch fails with
    /// `permission-denied`).
    ///
    /// Errors: `permission-denied` for another session's handle, for a tenant without
    /// `max-published-bytes`, and for a name the host loaded or another tenant published;
    /// `failed-precondition` for a donated tensor; a launch's error for an output of a launch
    /// that failed; `resource-exhausted` naming `max-published-bytes` or
    /// `max-published-versions`; `invalid-argument` as
    /// [`WeightRegistry::publish`](crate::weights::WeightRegistry::publish).
    pub async fn publish_weights(
        &self,
        name: &str,
        tensors: &[(String, &TensorHandle)],
        readers: &[String],
    ) -> DeviceResult<Arc<WeightSet>> {
        // The registry checks the count too; checking it first bounds the work below (a
        // hostile list of handles costs at most this many waits and one lock each).
        if tensors.len() > crate::weights::MAX_PUBLISHED_TENSORS {
            return Err(DeviceError::invalid(format!(
                "{} tensors in one version; at most {}",
                tensors.len(),
                crate::weights::MAX_PUBLISHED_TENSORS
            )));
        }
        for (tname, h) in tensors {
            self.owns(h.session)?;
            self.wait(h).await.map_err(|e| {
                DeviceError::new(e.kind, format!("tensor `{tname}`: {}", e.message))
            })?;
        }
        // Lock each distinct handle once (a handle may be given under two names), in the
        // order given; a launch takes one handle lock at a time, so this cannot deadlock.
        let mut at: std::collections::HashMap<*const TensorHandle, usize> =
            std::collections::HashMap::with_capacity(tensors.len());
        let mut guards = Vec::with_capacity(tensors.len());
        for (_, h) in tensors {
            at.entry(std::ptr::from_ref(*h)).or_insert_with(|| {
                guards.push(h.lock());
                guards.len() - 1
            });
        }
        let mut named = Vec::with_capacity(tensors.len());
        for (tname, h) in tensors {
            let i = at[&std::ptr::from_ref(*h)];
            let tensor = match guards[i].as_ref().map(|held| &held.source) {
                None => {
                    return Err(DeviceError::new(
                        ErrorKind::FailedPrecondition,
                        format!(
                            "tensor `{tname}` was donated to an execution and cannot be published"
                        ),
                    ));
                }
                Some(Source::Ready(t)) => Arc::clone(t),
                Some(Source::Pending(p)) => match (p.launch.result.get(), p.tensor.get()) {
                    (Some(Ok(())), Some(t)) => Arc::clone(t),
                    _ => {
                        return Err(DeviceError::new(
                            ErrorKind::FailedPrecondition,
                            format!(
                                "tensor `{tname}` has no value (its launch did not finish well)"
                            ),
                        ));
                    }
                },
            };
            named.push((tname.clone(), tensor));
        }
        let set = self.weights.publish(
            self.tenant.name(),
            self.tenant.limits(),
            name,
            named,
            readers,
        );
        drop(guards);
        set
    }
}

fn donated_error() -> DeviceError {
    DeviceError::new(
        ErrorKind::FailedPrecondition,
        "this tensor was donated to an execution and can no longer be used",
    )
}

/// Checks a launch's arguments against `exe`'s parameters by their specs (an argument may be
/// pending), with [`crate::types::validate_arg_specs`]: the same checks and errors as
/// [`crate::types::validate_args`], a handle standing for its tensor.
fn check_launch_args(
    exe: &DeviceExecutable,
    args: &[&TensorHandle],
    donated: &[bool],
) -> DeviceResult<()> {
    let views: Vec<ArgSpec<'_>> = args
        .iter()
        .zip(donated)
        .map(|(h, &donate)| ArgSpec {
            spec: &h.spec,
            device: h.device,
            identity: std::ptr::from_ref::<TensorHandle>(h).cast(),
            donate,
        })
        .collect();
    validate_arg_specs(exe, &views)
}

/// Refuses a program whose module declares another partition count (`mhlo.num_partitions`,
/// read by [`crate::declared::declared_devices`] from MLIR text or bytecode) than the devices it
/// is compiled for: XLA does not check the count it is given against the module's (it fails
/// in its verifier on some programs, and compiles a replicated one for any count). A module
/// whose attributes cannot be read is left to the compiler.
///
/// Errors: `invalid-argument` naming both counts.
fn check_declared_partitions(code: &[u8], settings: &CompileSettings) -> DeviceResult<()> {
    let devices = settings.devices.len().max(1) as u64;
    let Ok(declared) = crate::declared::declared_devices(code) else {
        return Ok(());
    };
    match declared.partitions {
        Some(n) if n != devices => Err(DeviceError::invalid(format!(
            "the program declares {n} partition(s) (mhlo.num_partitions) and is compiled for {devices} device(s){}",
            if devices == 1 {
                "; compile it for that many devices"
            } else {
                ""
            }
        ))),
        _ => Ok(()),
    }
}

/// Longest sharding text a client or guest may send (XLA's text form of any sharding of a
/// host's devices is far shorter): 64 KiB.
pub const MAX_SHARDING_TEXT: usize = 64 << 10;

/// Most devices a sharding a client or guest sends may name (a host has far fewer; without
/// this bound an iota tile assignment of a few bytes lists up to 2^20).
pub const MAX_SHARDING_DEVICES: i64 = 4096;

/// The dense size of a `ty` tensor of `dims` (as a client sends them) that a session allowed
/// `max_device_bytes` may hold: what [`Session::admit_tensor`] checks, without a session.
///
/// Errors: `invalid-argument` for a rank above [`crate::types::MAX_RANK`], a dim above
/// `i64::MAX` or a size this host cannot address; `resource-exhausted` naming
/// `max-device-bytes` for a tensor larger than the limit.
pub fn admit_dims(ty: PrimitiveType, dims: &[u64], max_device_bytes: u64) -> DeviceResult<usize> {
    let idims = dims_from_u64(dims)?;
    let bytes = crate::types::checked_byte_size(ty, &idims).ok_or_else(|| {
        DeviceError::invalid(format!(
            "a {ty} tensor of dims {dims:?} has more bytes than this host can address"
        ))
    })?;
    if bytes as u64 > max_device_bytes {
        return Err(DeviceError::new(
            ErrorKind::ResourceExhausted,
            format!(
                "a tensor of {bytes} bytes is larger than this session may hold, {max_device_bytes} bytes (limit max-device-bytes)"
            ),
        ));
    }
    Ok(bytes)
}

/// Parses a sharding a client or guest sent, in XLA's text form (`HloSharding::ToString`:
/// `{replicated}`, `{devices=[4,1]<=[4]}`, ...). Only the forms an array can have are taken:
/// braces nest at most twice (`{devices=[2,2]0,1,2,3 last_tile_dims={manual}}`), so a hostile
/// tuple nested thousands deep never reaches the recursive parser.
///
/// Errors: `invalid-argument` for text over [`MAX_SHARDING_TEXT`], nested deeper, or that
/// does not parse.
pub fn parse_sharding(text: &str) -> DeviceResult<pjrt::HloSharding> {
    if text.len() > MAX_SHARDING_TEXT {
        return Err(DeviceError::invalid(format!(
            "a sharding is at most {MAX_SHARDING_TEXT} bytes of text, this one {}",
            text.len()
        )));
    }
    let mut depth = 0usize;
    for c in text.bytes() {
        match c {
            b'{' => {
                depth += 1;
                if depth > 2 {
                    return Err(DeviceError::invalid(
                        "a sharding's braces nest at most twice (a tuple sharding is not an array's)",
                    ));
                }
            }
            b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    pjrt::HloSharding::parse_bounded(text, MAX_SHARDING_DEVICES).map_err(|e| {
        let shown: String = text.chars().take(200).collect();
        DeviceError::invalid(format!(
            "`{shown}` is not a sharding in XLA's text form: {}",
            e.message
        ))
    })
}

/// Which of `n` arguments `donate` names.
///
/// Errors: `invalid-argument` for an index out of range or listed twice.
fn donation_mask(n: usize, donate: &[u32]) -> DeviceResult<Vec<bool>> {
    position_mask(n, donate, "donate index", "argument(s)")
}

/// Which of `n` positions `list` names, for a front door's lists of positions (donated
/// arguments, fetched results): `mask[i]` is whether `i` is listed. `what` names a listed
/// position and `of` the `n` things in the errors ("donate index 5 is out of range for 3
/// argument(s)").
///
/// Errors: `invalid-argument` for a position out of range or listed twice.
pub fn position_mask(n: usize, list: &[u32], what: &str, of: &str) -> DeviceResult<Vec<bool>> {
    let mut mask = vec![false; n];
    for &p in list {
        let Some(slot) = mask.get_mut(p as usize) else {
            return Err(DeviceError::invalid(format!(
                "{what} {p} is out of range for {n} {of}"
            )));
        };
        if *slot {
            return Err(DeviceError::invalid(format!("{what} {p} is listed twice")));
        }
        *slot = true;
    }
    Ok(mask)
}
