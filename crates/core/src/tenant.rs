//! Tenants: the unit of isolation and accounting, their limits and their usage.
//!
//! A [`Tenant`] is one guest instance, or several that share an identity (pass the same
//! `Arc<Tenant>` in `tpubox_wasm::RunOptions::tenant`). Everything a tenant holds
//! on the device is charged to it *before* the plugin allocates it, through RAII guards
//! ([`Charge`]) kept beside each guest handle: when a handle is dropped — by the guest, or
//! because its store ended after a normal exit, a trap or a deadline — the charge is returned.
//! Device memory is accounted by tpubox itself from dtype × dims (the CPU plugins report no
//! memory statistics); shared weights are charged to nobody, but their handles count as live
//! tensors.
//!
//! Exceeding a limit returns `resource-exhausted` with the limit's name in the message; nothing
//! is allocated, and the tenant may free handles and continue.
//!
//! The order in which tenants get the device is [`crate::scheduler`]'s job.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{DeviceError, DeviceResult, ErrorKind};

/// How many times `max-device-bytes` a tenant's transfers in flight may hold in host memory
/// ([`Tenant::charge_transfer`]): 2, so that reading any tensor the tenant may hold fits (its
/// host copy, plus at most as much again in queued messages).
pub const TRANSFER_POOL_MULTIPLE: u64 = 2;

/// Default of [`TenantLimits::max_pending_launches`].
pub const DEFAULT_MAX_PENDING_LAUNCHES: u64 = 256;

/// Per-tenant limits. The defaults suit one trusted user; set them lower for untrusted guests.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantLimits {
    /// Device bytes held at once, summed over the tenant's tensors (dense dtype × dims);
    /// default 8 GiB.
    pub max_device_bytes: u64,
    /// Device bytes held at once on any one device (dense dtype × dims, the tensors and
    /// temporaries placed on that device); default `u64::MAX`, so that only
    /// [`max_device_bytes`](Self::max_device_bytes) applies. A refusal names the device and
    /// `max-device-bytes-per-device`.
    pub max_device_bytes_per_device: u64,
    /// Live tensor handles at once, shared weight handles included (default 10 000). This is
    /// what bounds a guest that only frees handles when its garbage collector runs.
    pub max_live_tensors: u64,
    /// Live executable handles at once (default 1 000).
    pub max_live_executables: u64,
    /// Largest program accepted by `compile`, in bytes (default 64 MiB).
    pub max_program_bytes: usize,
    /// Compiles in any 60-second window that the compile cache's tier 1 did not serve: real
    /// compiles and loads from tiers 2 and 3 count, tier-1 hits do not (default 600; see
    /// [`Tenant::admit_compile_rate`]).
    pub max_compiles_per_minute: u32,
    /// Largest guest linear memory, in bytes (default 4 GiB; the sandbox's own cap also
    /// applies).
    pub max_guest_memory: usize,
    /// Wall-clock limit of one guest run, enforced by epoch interruption (default 300 s;
    /// `None` for no limit).
    pub max_call_time: Option<Duration>,
    /// Wasm fuel (about one unit per instruction) for one run; `None` (default) for no fuel
    /// limit. Needs `tpubox_wasm::SandboxConfig::consume_fuel`.
    pub fuel: Option<u64>,
    /// What the tenant's programs may contain (checked on the compiled program).
    pub program_policy: ProgramPolicy,
    /// Launches ([`crate::session::Session::launch`], and every execution, which is a launch
    /// and a wait) not yet finished at once: queued for the device or running (default 256).
    /// A launch beyond it is refused with `resource-exhausted` naming `max-pending-launches`:
    /// the back-pressure that keeps a tenant that never waits from queueing without bound.
    pub max_pending_launches: u64,
    /// Executions of the tenant holding one of the device's execution slots at once
    /// (default `u64::MAX`: as many as there are slots). Counted on the tenant that the
    /// scheduler shares the device between: a session's budget tenant
    /// ([`Tenant::with_budget`]), so that one tenant's sessions together cannot take every
    /// slot while another tenant waits ([`crate::scheduler`]).
    pub max_running_executions: u64,
    /// Dense device bytes of the weight versions the tenant has published that are alive
    /// (the latest of each name and those readers still hold), counted by tenant name across
    /// all its sessions and surviving them ([`crate::weights`]); `max-published-bytes`. `0`
    /// (the default) means the tenant may not publish at all.
    pub max_published_bytes: u64,
    /// Live published versions of the tenant, all names together (default 8;
    /// `max-published-versions`).
    pub max_published_versions: u64,
}

/// What an untrusted tenant's programs may contain. PJRT cannot cancel an execution, so a
/// program that never ends holds an execution slot and device cores until the host restarts;
/// these rules refuse, at `compile`, what could do that. Errors name the rule
/// (`permission-denied`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProgramPolicy {
    /// Skip every rule below (default `false`): for tenants whose programs the operator trusts.
    pub trusted: bool,
    /// Largest trip count of one `while` loop, as XLA proves it on the optimized program
    /// (default 1 048 576; rule `max-loop-trips`). A loop XLA cannot bound
    /// (`known_trip_count` missing) runs on the loop budget (next two fields), or is refused
    /// (rule `unbounded-loop`) when the budget is off.
    pub max_loop_trips: u64,
    /// Most trips of loops XLA cannot bound in one execution, all such loops of the program
    /// together (nested, in called computations and conditionals alike; default
    /// [`DEFAULT_MAX_LOOP_ITERATIONS`], 1 048 576, the same number as `max_loop_trips`;
    /// `max-loop-iterations`). Such a loop is compiled with a budget instead of refused: a
    /// custom call in its condition counts each evaluation, and the execution fails with
    /// `resource-exhausted` naming the limit once the budget is spent ([`LoopBudgetLimits`];
    /// docs/SECURITY.md). `0` turns the budget off: such loops are refused again (rule
    /// `unbounded-loop`).
    pub max_loop_iterations: u64,
    /// Most work of loops XLA cannot bound in one execution (default
    /// [`DEFAULT_MAX_LOOP_WORK`], 10^11; `max-loop-work`): each trip counts the work of one
    /// trip of the loop, estimated from the optimized program
    /// ([`pjrt::WhileLoop::trip_work`]: operations plus bytes written), so that
    /// a few trips over a large matmul end the execution as surely as many cheap ones.
    pub max_loop_work: u64,
    /// Custom-call targets allowed (default [`default_custom_calls`]: [`XLA_CUSTOM_CALLS`],
    /// which XLA implements itself, and the LAPACK and tpubox targets whose handlers the host
    /// registers on CPU plugins, which check their operands; rule `custom-call`). Other custom calls run
    /// code outside XLA that nothing here can inspect.
    pub allowed_custom_calls: Vec<String>,
}

/// Default [`ProgramPolicy::max_loop_iterations`]: 1 048 576 trips per execution, the trip
/// limit of loops XLA can bound (`max_loop_trips`). Measured (docs/BENCHMARKS.md, "Loop
/// budget"): JAX's `igamma`, `betainc`, `random.gamma`/`poisson`, Newton `while_loop`s, BFGS
/// and `sqrtm` finish far below it, and an endless loop of cheap trips reaches it in well
/// under a second on the CPU plugin.
pub const DEFAULT_MAX_LOOP_ITERATIONS: u64 = 1 << 20;

/// Default [`ProgramPolicy::max_loop_work`]: 10^11 units (flops plus bytes accessed), a few
/// seconds of a CPU core's work.
pub const DEFAULT_MAX_LOOP_WORK: u64 = 100_000_000_000;

/// The budget of loops XLA cannot bound, given to a compile of an untrusted tenant's program
/// ([`ProgramPolicy::loop_budget`]); part of the compile-cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
pub struct LoopBudgetLimits {
    /// [`ProgramPolicy::max_loop_iterations`], at least 1.
    pub max_loop_iterations: u64,
    /// [`ProgramPolicy::max_loop_work`].
    pub max_loop_work: u64,
}

impl ProgramPolicy {
    /// The budget compiles for this policy give loops XLA cannot bound: `None` for a trusted
    /// tenant (nothing is checked) or with `max_loop_iterations` 0 (such loops are refused).
    pub fn loop_budget(&self) -> Option<LoopBudgetLimits> {
        (!self.trusted && self.max_loop_iterations > 0).then_some(LoopBudgetLimits {
            max_loop_iterations: self.max_loop_iterations,
            max_loop_work: self.max_loop_work,
        })
    }
}

/// Custom-call targets XLA implements itself (no code from outside XLA runs), allowed by
/// default: `TopK` (what `jax.lax.top_k` lowers to; XLA expands it into a sort).
pub const XLA_CUSTOM_CALLS: [&str; 1] = ["TopK"];

/// Custom-call targets allowed by default: [`XLA_CUSTOM_CALLS`], every LAPACK target of
/// [`pjrt_lapack::targets`] (`lapack_sgetrf_ffi`, ...; 52) and tpubox's own of
/// [`pjrt_kernels::targets`] (`tpubox_segment_attention`). On a plugin where the host has not
/// registered those handlers (not a CPU plugin) such a program fails to compile instead.
pub fn default_custom_calls() -> Vec<String> {
    XLA_CUSTOM_CALLS
        .iter()
        .copied()
        .chain(pjrt_lapack::targets())
        .chain(pjrt_kernels::targets())
        .map(String::from)
        .collect()
}

impl Default for ProgramPolicy {
    fn default() -> Self {
        ProgramPolicy {
            trusted: false,
            max_loop_trips: 1 << 20,
            max_loop_iterations: DEFAULT_MAX_LOOP_ITERATIONS,
            max_loop_work: DEFAULT_MAX_LOOP_WORK,
            allowed_custom_calls: default_custom_calls(),
        }
    }
}

impl Default for TenantLimits {
    fn default() -> Self {
        TenantLimits {
            max_device_bytes: 8 << 30,
            max_device_bytes_per_device: u64::MAX,
            max_live_tensors: 10_000,
            max_live_executables: 1_000,
            max_program_bytes: 64 << 20,
            max_compiles_per_minute: 600,
            max_guest_memory: 4 << 30,
            max_call_time: Some(Duration::from_secs(300)),
            fuel: None,
            program_policy: ProgramPolicy::default(),
            max_pending_launches: DEFAULT_MAX_PENDING_LAUNCHES,
            max_running_executions: u64::MAX,
            max_published_bytes: 0,
            max_published_versions: DEFAULT_MAX_PUBLISHED_VERSIONS,
        }
    }
}

/// Default [`TenantLimits::max_published_versions`].
pub const DEFAULT_MAX_PUBLISHED_VERSIONS: u64 = 8;

/// A snapshot of what a tenant holds and has done.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TenantUsage {
    /// Device bytes held now.
    pub device_bytes: u64,
    /// Most device bytes held at once.
    pub peak_device_bytes: u64,
    /// Device bytes held now on each device that holds any, by device index (ascending);
    /// they sum to [`device_bytes`](Self::device_bytes).
    pub device_bytes_by_device: Vec<DeviceBytes>,
    /// Live tensor handles now.
    pub live_tensors: u64,
    /// Most live tensor handles held at once.
    pub peak_live_tensors: u64,
    /// Live executable handles now.
    pub live_executables: u64,
    /// Compiles charged against `max-compiles-per-minute` (those tier 1 did not serve).
    pub compiles: u64,
    /// Executions finished.
    pub executions: u64,
    /// Device time of those executions, in seconds: each billed from the later of its
    /// submission and the previous completion on the device to its completion
    /// ([`crate::scheduler`]).
    pub device_seconds: f64,
    /// Requests refused because a limit was reached.
    pub refused: u64,
    /// Executions holding an execution slot now (submitted or about to be, not yet done).
    pub executions_running: u64,
    /// Host bytes held now for the tenant's transfers in flight: uploads being received,
    /// host copies of tensors being read, mapped memfds ([`Tenant::charge_transfer`]).
    pub transfer_bytes: u64,
    /// Launches queued for the device or running now (charged at launch, returned when the
    /// device finished or the launch failed before it was submitted; see
    /// [`TenantLimits::max_pending_launches`]).
    pub pending_launches: u64,
    /// Tensor bytes copied from the host to the device for the tenant so far (uploads,
    /// inline arguments).
    pub host_to_device_bytes: u64,
    /// Tensor bytes copied from the device to the host for the tenant so far (reads, fetched
    /// results).
    pub device_to_host_bytes: u64,
}

/// Device bytes a tenant holds on one device ([`TenantUsage::device_bytes_by_device`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DeviceBytes {
    /// Device index (as in [`crate::device::DeviceService::devices`]).
    pub device: u32,
    /// Dense bytes held there now.
    pub bytes: u64,
    /// Most bytes held there at once.
    pub peak_bytes: u64,
}

#[derive(Debug, Default)]
struct Held {
    device_bytes: u64,
    /// Bytes and peak bytes held per device index (entries stay once created, at most one per
    /// device of the host).
    by_device: BTreeMap<u32, (u64, u64)>,
    peak_device_bytes: u64,
    live_tensors: u64,
    peak_live_tensors: u64,
    live_executables: u64,
    transfer_bytes: u64,
    pending_launches: u64,
    compile_times: VecDeque<Instant>,
}

/// One tenant: a name, its limits and its usage. Shared through `Arc`.
///
/// A tenant may have a **budget**: another `Tenant` that stands for all of one identity's
/// accounting tenants together (the session API gives every session a tenant of its own with
/// the per-session limits, and all sessions of one token's tenant one budget). Device bytes
/// are charged to both and must fit both; executions, device time and the scheduler's fair
/// share count on the budget too.
#[derive(Debug)]
pub struct Tenant {
    name: String,
    limits: TenantLimits,
    budget: Option<Arc<Tenant>>,
    /// Whether this tenant is some tenants' budget (error messages say "all its sessions").
    is_budget: bool,
    held: Mutex<Held>,
    compiles: AtomicU64,
    executions: AtomicU64,
    device_ns: AtomicU64,
    refused: AtomicU64,
    running: AtomicU64,
    host_to_device: AtomicU64,
    device_to_host: AtomicU64,
}

/// What a [`Charge`] holds back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChargeKind {
    /// A tensor handle of this many device bytes (0 for shared weights).
    Tensor(u64),
    /// An executable handle.
    Executable,
    /// Device bytes an execution uses for its temporaries while it runs (no handle).
    Scratch(u64),
    /// Host bytes the daemon holds for a transfer in flight (an upload being received, a
    /// tensor's host copy being read, a mapped memfd); see [`Tenant::charge_transfer`].
    Transfer(u64),
    /// A launch not yet finished ([`Tenant::charge_launch`]).
    Launch,
}

/// A charge against a tenant's limits, returned when dropped.
#[derive(Debug)]
pub struct Charge {
    tenant: Arc<Tenant>,
    kind: ChargeKind,
    /// The device a `Tensor` or `Scratch` charge's bytes are on.
    device: u32,
}

impl Held {
    fn on_device(&mut self, device: u32) -> &mut (u64, u64) {
        self.by_device.entry(device).or_insert((0, 0))
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let (Some(b), ChargeKind::Tensor(bytes) | ChargeKind::Scratch(bytes)) =
            (&self.tenant.budget, self.kind)
        {
            let mut bh = b.held.lock().expect("tenant lock");
            bh.device_bytes -= bytes;
            bh.on_device(self.device).0 -= bytes;
        }
        let mut h = self.tenant.held.lock().expect("tenant lock");
        match self.kind {
            ChargeKind::Tensor(bytes) => {
                h.device_bytes -= bytes;
                h.on_device(self.device).0 -= bytes;
                h.live_tensors -= 1;
            }
            ChargeKind::Executable => h.live_executables -= 1,
            ChargeKind::Scratch(bytes) => {
                h.device_bytes -= bytes;
                h.on_device(self.device).0 -= bytes;
            }
            ChargeKind::Transfer(bytes) => h.transfer_bytes -= bytes,
            ChargeKind::Launch => h.pending_launches -= 1,
        }
    }
}

impl Charge {
    /// What this charge holds.
    pub fn kind(&self) -> ChargeKind {
        self.kind
    }

    /// The device index a tensor or scratch charge's bytes are on (0 for other kinds).
    pub fn device(&self) -> u32 {
        self.device
    }
}

impl Tenant {
    /// A new tenant with nothing held.
    pub fn new(name: impl Into<String>, limits: TenantLimits) -> Arc<Self> {
        Tenant::make(name.into(), limits, None, false)
    }

    /// A budget: the tenant that all of one identity's accounting tenants are charged to as
    /// well ([`Tenant::with_budget`]); of its limits, `max_device_bytes` and
    /// `max_running_executions` apply to them together.
    pub fn new_budget(name: impl Into<String>, limits: TenantLimits) -> Arc<Self> {
        Tenant::make(name.into(), limits, None, true)
    }

    /// A new accounting tenant with its own `limits`, whose device bytes are also charged to
    /// `budget` (and must fit it) and whose executions and device time also count there.
    pub fn with_budget(
        name: impl Into<String>,
        limits: TenantLimits,
        budget: Arc<Tenant>,
    ) -> Arc<Self> {
        Tenant::make(name.into(), limits, Some(budget), false)
    }

    /// The budget this tenant is charged to as well, if any.
    pub fn budget(&self) -> Option<&Arc<Tenant>> {
        self.budget.as_ref()
    }

    /// The tenant the device's fair share counts: the budget, or this tenant.
    pub(crate) fn share_identity(self: &Arc<Self>) -> &Arc<Tenant> {
        self.budget.as_ref().unwrap_or(self)
    }

    fn make(
        name: String,
        limits: TenantLimits,
        budget: Option<Arc<Tenant>>,
        is_budget: bool,
    ) -> Arc<Self> {
        Arc::new(Tenant {
            name,
            limits,
            budget,
            is_budget,
            held: Mutex::new(Held::default()),
            compiles: AtomicU64::new(0),
            executions: AtomicU64::new(0),
            device_ns: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            host_to_device: AtomicU64::new(0),
            device_to_host: AtomicU64::new(0),
            running: AtomicU64::new(0),
        })
    }

    /// The tenant's name (used in logs and reports).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tenant's limits.
    pub fn limits(&self) -> &TenantLimits {
        &self.limits
    }

    /// A snapshot of its usage.
    pub fn usage(&self) -> TenantUsage {
        let h = self.held.lock().expect("tenant lock");
        TenantUsage {
            device_bytes: h.device_bytes,
            peak_device_bytes: h.peak_device_bytes,
            device_bytes_by_device: h
                .by_device
                .iter()
                .filter(|(_, (b, p))| *b > 0 || *p > 0)
                .map(|(&device, &(bytes, peak_bytes))| DeviceBytes {
                    device,
                    bytes,
                    peak_bytes,
                })
                .collect(),
            live_tensors: h.live_tensors,
            peak_live_tensors: h.peak_live_tensors,
            live_executables: h.live_executables,
            compiles: self.compiles.load(Ordering::Relaxed),
            executions: self.executions.load(Ordering::Relaxed),
            device_seconds: self.device_ns.load(Ordering::Relaxed) as f64 / 1e9,
            refused: self.refused.load(Ordering::Relaxed),
            executions_running: self.running.load(Ordering::Relaxed),
            transfer_bytes: h.transfer_bytes,
            pending_launches: h.pending_launches,
            host_to_device_bytes: self.host_to_device.load(Ordering::Relaxed),
            device_to_host_bytes: self.device_to_host.load(Ordering::Relaxed),
        }
    }

    /// Counts `host_to_device` and `device_to_host` tensor bytes moved for this tenant (and
    /// its budget): [`TenantUsage::host_to_device_bytes`], [`TenantUsage::device_to_host_bytes`].
    pub fn count_transfer(&self, host_to_device: u64, device_to_host: u64) {
        for t in std::iter::once(self).chain(self.budget.as_deref()) {
            t.host_to_device
                .fetch_add(host_to_device, Ordering::Relaxed);
            t.device_to_host
                .fetch_add(device_to_host, Ordering::Relaxed);
        }
    }

    /// Counts a refusal on this tenant and its budget.
    fn count_refusal(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        if let Some(b) = &self.budget {
            b.refused.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn refuse(&self, limit: &str, message: String) -> DeviceError {
        self.count_refusal();
        let who = if self.is_budget {
            format!("tenant `{}` (all its sessions together)", self.name)
        } else if self.budget.is_some() {
            format!("tenant `{}`, this session", self.name)
        } else {
            format!("tenant `{}`", self.name)
        };
        DeviceError::new(
            ErrorKind::ResourceExhausted,
            format!("{who}: {message} (limit {limit})"),
        )
    }

    /// Charges tensors of the given device-byte sizes (one handle each) at once, on device 0,
    /// after crediting `credit_bytes` that the caller is about to give back (donated inputs):
    /// [`charge_tensors_on`](Self::charge_tensors_on) for device 0.
    ///
    /// Errors: as [`charge_tensors_on`](Self::charge_tensors_on).
    pub fn charge_tensors(
        self: &Arc<Self>,
        sizes: &[u64],
        credit_bytes: u64,
    ) -> DeviceResult<Vec<Charge>> {
        self.charge_tensors_on(0, sizes, credit_bytes)
    }

    /// Charges tensors of the given device-byte sizes (one handle each) on device `device`,
    /// after crediting `credit_bytes` of that device that the caller is about to give back.
    ///
    /// Errors: `resource-exhausted` naming `max-live-tensors`, `max-device-bytes` or
    /// `max-device-bytes-per-device` (with the device).
    pub fn charge_tensors_on(
        self: &Arc<Self>,
        device: u32,
        sizes: &[u64],
        credit_bytes: u64,
    ) -> DeviceResult<Vec<Charge>> {
        self.charge_execution(device, sizes, credit_bytes, 0)
            .map(|(c, _)| c)
    }

    /// Charges an execution on device `device`: its results (`sizes`, one handle each) and
    /// `scratch_bytes` of temporaries it uses on the device while it runs, after crediting
    /// `credit_bytes` (of that device) the caller gives back when it succeeds (donated
    /// inputs). Returns the results' charges and the temporaries' charge, to be dropped when
    /// the device is done. Bytes count against `max-device-bytes` (all devices together) and
    /// `max-device-bytes-per-device` (this device), on the tenant and on its budget.
    ///
    /// Errors: `resource-exhausted` naming `max-live-tensors`, `max-device-bytes` or
    /// `max-device-bytes-per-device` (with the device).
    pub fn charge_execution(
        self: &Arc<Self>,
        device: u32,
        sizes: &[u64],
        credit_bytes: u64,
        scratch_bytes: u64,
    ) -> DeviceResult<(Vec<Charge>, Charge)> {
        let mut h = self.held.lock().expect("tenant lock");
        let count = sizes.len() as u64;
        if h.live_tensors.saturating_add(count) > self.limits.max_live_tensors {
            let live = h.live_tensors;
            drop(h);
            return Err(self.refuse(
                "max-live-tensors",
                format!(
                    "{live} live tensors plus {count} new would exceed {}; drop tensors you no longer need",
                    self.limits.max_live_tensors
                ),
            ));
        }
        let total: u64 = sizes
            .iter()
            .fold(scratch_bytes, |a, &s| a.saturating_add(s));
        let after = h
            .device_bytes
            .saturating_sub(credit_bytes)
            .saturating_add(total);
        let temps = if scratch_bytes > 0 {
            format!(" ({scratch_bytes} of them the program's temporaries)")
        } else {
            String::new()
        };
        if after > self.limits.max_device_bytes {
            let held = h.device_bytes;
            drop(h);
            return Err(self.refuse(
                "max-device-bytes",
                format!(
                    "holding {held} device bytes, {total} more{temps} would exceed {}",
                    self.limits.max_device_bytes
                ),
            ));
        }
        let on = h.by_device.get(&device).map_or(0, |d| d.0);
        let on_after = on.saturating_sub(credit_bytes).saturating_add(total);
        if on_after > self.limits.max_device_bytes_per_device {
            drop(h);
            return Err(self.refuse(
                "max-device-bytes-per-device",
                format!(
                    "holding {on} bytes on device {device}, {total} more{temps} there would exceed {}",
                    self.limits.max_device_bytes_per_device
                ),
            ));
        }
        if let Some(b) = &self.budget {
            // Lock order: an accounting tenant, then its budget (a budget has none).
            let mut bh = b.held.lock().expect("tenant lock");
            let b_after = bh
                .device_bytes
                .saturating_sub(credit_bytes)
                .saturating_add(total);
            let b_on = bh.by_device.get(&device).map_or(0, |d| d.0);
            let b_on_after = b_on.saturating_sub(credit_bytes).saturating_add(total);
            let refusal = if b_after > b.limits.max_device_bytes {
                Some((
                    "max-device-bytes",
                    format!(
                        "its sessions hold {} device bytes, {total} more would exceed {}",
                        bh.device_bytes, b.limits.max_device_bytes
                    ),
                ))
            } else if b_on_after > b.limits.max_device_bytes_per_device {
                Some((
                    "max-device-bytes-per-device",
                    format!(
                        "its sessions hold {b_on} bytes on device {device}, {total} more there would exceed {}",
                        b.limits.max_device_bytes_per_device
                    ),
                ))
            } else {
                None
            };
            if let Some((limit, message)) = refusal {
                drop(bh);
                drop(h);
                // Counted on the budget by its own refusal.
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err(b.refuse(limit, message));
            }
            bh.device_bytes += total;
            bh.peak_device_bytes = bh.peak_device_bytes.max(b_after);
            let d = bh.on_device(device);
            d.0 += total;
            d.1 = d.1.max(b_on_after);
        }
        h.live_tensors += count;
        h.peak_live_tensors = h.peak_live_tensors.max(h.live_tensors);
        // Until the caller drops the donated inputs' charges both are counted; the peak records
        // the state after that, which is what the limit was checked against.
        h.device_bytes += total;
        h.peak_device_bytes = h.peak_device_bytes.max(after);
        let d = h.on_device(device);
        d.0 += total;
        d.1 = d.1.max(on_after);
        drop(h);
        let charge = |kind| Charge {
            tenant: Arc::clone(self),
            kind,
            device,
        };
        Ok((
            sizes
                .iter()
                .map(|&s| charge(ChargeKind::Tensor(s)))
                .collect(),
            charge(ChargeKind::Scratch(scratch_bytes)),
        ))
    }

    /// Refuses a program that could never run within the limits: its results and
    /// temporaries alone need more than `max-device-bytes`.
    ///
    /// Errors: `resource-exhausted` naming `max-device-bytes`.
    pub fn admit_program_memory(&self, output_bytes: u64, temp_bytes: u64) -> DeviceResult<()> {
        let need = output_bytes.saturating_add(temp_bytes);
        if need > self.limits.max_device_bytes {
            return Err(self.refuse(
                "max-device-bytes",
                format!(
                    "the program needs {need} device bytes to run ({output_bytes} for its results, {temp_bytes} for temporaries), more than {}",
                    self.limits.max_device_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a program the tenant's [`ProgramPolicy`] does not allow.
    ///
    /// Errors: `permission-denied` naming the rule (`unbounded-loop`, `max-loop-trips`,
    /// `host-transfer`, `custom-call`).
    pub fn admit_program(&self, facts: &pjrt::ProgramFacts) -> DeviceResult<()> {
        let p = &self.limits.program_policy;
        if p.trusted {
            return Ok(());
        }
        let deny = |rule: &str, message: String| {
            self.count_refusal();
            DeviceError::new(
                ErrorKind::PermissionDenied,
                format!(
                    "tenant `{}`: {message} (policy rule {rule}; an operator can mark the tenant trusted: `tpubox run --trusted`, `trusted = true` in the tokens file's [tenant.session] for sessions, `ProgramPolicy::trusted`)",
                    self.name
                ),
            )
        };
        let budgeted = p.loop_budget().is_some();
        for w in &facts.while_loops {
            match w.known_trip_count {
                // Compiled with the loop budget (`DeviceService::compile_for` gives it to every
                // compile of a tenant with one, and the cache key holds it), and the compiled
                // loop's condition asks it: checked here on the program that will run, not
                // taken on trust from the rewrite.
                None if budgeted && w.budgeted => {}
                None if budgeted => {
                    return Err(deny(
                        "unbounded-loop",
                        format!(
                            "the program has a while loop ({}) whose trip count XLA cannot bound, and the loop budget could not be put into it",
                            w.name
                        ),
                    ));
                }
                None => {
                    return Err(deny(
                        "unbounded-loop",
                        format!(
                            "the program has a while loop ({}) whose trip count XLA cannot bound; it could run forever, and a running program cannot be stopped",
                            w.name
                        ),
                    ));
                }
                Some(n) if n > p.max_loop_trips => {
                    return Err(deny(
                        "max-loop-trips",
                        format!(
                            "the program has a while loop ({}) of {n} trips, more than {}",
                            w.name, p.max_loop_trips
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        if let Some(op) = facts.host_transfers.first() {
            return Err(deny(
                "host-transfer",
                format!(
                    "the program uses {op}, which waits for a transfer nobody may feed; infeed, outfeed, send and recv are not allowed"
                ),
            ));
        }
        if let Some(t) = facts.custom_call_targets.iter().find(|t| {
            let ours = budgeted && t.as_str() == pjrt::loop_budget::LOOP_BUDGET_TARGET;
            !(ours || p.allowed_custom_calls.contains(t))
        }) {
            return Err(deny(
                "custom-call",
                format!("the program calls the custom-call target `{t}`, which is not allowed"),
            ));
        }
        Ok(())
    }

    /// Charges `bytes` of host memory the daemon is about to allocate (or map) for one of the
    /// tenant's transfers — an upload being received, the host copy of a tensor being read, a
    /// mapped memfd — until the returned charge is dropped (when the transfer completes,
    /// fails or is cancelled). Transfers have a pool of their own,
    /// [`TRANSFER_POOL_MULTIPLE`] × `max-device-bytes` and separate from the device bytes: a
    /// tenant can always move a tensor it may hold (a read needs the tensor's host copy and
    /// at most as much again in queued messages), and the daemon holds at most that much host
    /// memory for one tenant's transfers at once, however many it starts. `what` names the
    /// transfer in the error.
    ///
    /// Errors: `resource-exhausted` naming `max-device-bytes`.
    pub fn charge_transfer(self: &Arc<Self>, bytes: u64, what: &str) -> DeviceResult<Charge> {
        let mut h = self.held.lock().expect("tenant lock");
        let after = h.transfer_bytes.saturating_add(bytes);
        let pool = self
            .limits
            .max_device_bytes
            .saturating_mul(TRANSFER_POOL_MULTIPLE);
        if after > pool {
            let held = h.transfer_bytes;
            drop(h);
            return Err(self.refuse(
                "max-device-bytes",
                format!(
                    "{what} needs {bytes} bytes of host memory; with the {held} bytes the tenant's transfers in flight (uploads, reads, mapped memfds) hold, that would exceed {pool} ({TRANSFER_POOL_MULTIPLE} x max-device-bytes)"
                ),
            ));
        }
        h.transfer_bytes = after;
        drop(h);
        Ok(Charge {
            tenant: Arc::clone(self),
            kind: ChargeKind::Transfer(bytes),
            device: 0,
        })
    }

    /// Charges one launch until the returned charge is dropped (when the device finished it,
    /// or it failed before it was submitted).
    ///
    /// Errors: `resource-exhausted` naming `max-pending-launches`.
    pub fn charge_launch(self: &Arc<Self>) -> DeviceResult<Charge> {
        let mut h = self.held.lock().expect("tenant lock");
        if h.pending_launches >= self.limits.max_pending_launches {
            let n = h.pending_launches;
            drop(h);
            return Err(self.refuse(
                "max-pending-launches",
                format!(
                    "{n} launches are pending (queued or running), the most allowed; wait for some before launching more"
                ),
            ));
        }
        h.pending_launches += 1;
        drop(h);
        Ok(Charge {
            tenant: Arc::clone(self),
            kind: ChargeKind::Launch,
            device: 0,
        })
    }

    /// Charges one executable handle.
    ///
    /// Errors: `resource-exhausted` naming `max-live-executables`.
    pub fn charge_executable(self: &Arc<Self>) -> DeviceResult<Charge> {
        let mut h = self.held.lock().expect("tenant lock");
        if h.live_executables >= self.limits.max_live_executables {
            let n = h.live_executables;
            drop(h);
            return Err(self.refuse(
                "max-live-executables",
                format!(
                    "{n} live executables plus 1 new would exceed {}; drop executables you no longer need",
                    self.limits.max_live_executables
                ),
            ));
        }
        h.live_executables += 1;
        Ok(Charge {
            tenant: Arc::clone(self),
            kind: ChargeKind::Executable,
            device: 0,
        })
    }

    /// Admits one compile of a `program_bytes`-byte program that is known to need real work:
    /// [`admit_program_size`](Self::admit_program_size), then
    /// [`admit_compile_rate`](Self::admit_compile_rate).
    ///
    /// Errors: `resource-exhausted` naming `max-program-bytes` or `max-compiles-per-minute`.
    pub fn admit_compile(&self, program_bytes: usize) -> DeviceResult<()> {
        self.admit_program_size(program_bytes)?;
        self.admit_compile_rate()
    }

    /// Checks a `program_bytes`-byte program against `max-program-bytes`, before anything is
    /// done with it (every compile request, also one the compile cache's tier 1 will serve).
    ///
    /// Errors: `resource-exhausted` naming `max-program-bytes`.
    pub fn admit_program_size(&self, program_bytes: usize) -> DeviceResult<()> {
        if program_bytes > self.limits.max_program_bytes {
            return Err(self.refuse(
                "max-program-bytes",
                format!(
                    "program is {program_bytes} bytes, more than {}",
                    self.limits.max_program_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Charges one compile against `max-compiles-per-minute` (a sliding window of 60 s) and
    /// counts it in [`TenantUsage::compiles`].
    ///
    /// [`crate::session::Session::compile_with`] charges only requests that the compile
    /// cache's tier 1 (this process's loaded executables) does not serve: a tier-1 hit costs
    /// microseconds, so an eager guest that compiles the same small op again and again is not
    /// throttled. Loads from tier 2 (disk) and tier 3 (remote) are charged like compiles: they
    /// are real work (reading and deserializing an executable, milliseconds to hundreds of
    /// milliseconds, on shared threads), and the charge must be taken before the lookup starts
    /// (a refusal must reach only the tenant over its limit, not others waiting on the same
    /// lookup), when it is not yet known which tier will answer.
    ///
    /// Errors: `resource-exhausted` naming `max-compiles-per-minute`.
    pub fn admit_compile_rate(&self) -> DeviceResult<()> {
        let now = Instant::now();
        let mut h = self.held.lock().expect("tenant lock");
        while h
            .compile_times
            .front()
            .is_some_and(|t| now.duration_since(*t) >= Duration::from_secs(60))
        {
            h.compile_times.pop_front();
        }
        if self.limits.max_compiles_per_minute == 0 {
            drop(h);
            return Err(self.refuse(
                "max-compiles-per-minute",
                "this tenant may not compile (its limit is 0)".to_string(),
            ));
        }
        if h.compile_times.len() as u64 >= u64::from(self.limits.max_compiles_per_minute) {
            // Empty when the limit is 0: then no compile is ever allowed.
            let wait = h
                .compile_times
                .front()
                .map_or(Duration::from_secs(60), |t| {
                    Duration::from_secs(60).saturating_sub(now.duration_since(*t))
                });
            drop(h);
            return Err(self.refuse(
                "max-compiles-per-minute",
                format!(
                    "{} compiles in the last minute; the next is allowed in {:.1} s (keep executables instead of recompiling)",
                    self.limits.max_compiles_per_minute,
                    wait.as_secs_f64()
                ),
            ));
        }
        h.compile_times.push_back(now);
        self.compiles.fetch_add(1, Ordering::Relaxed);
        if let Some(b) = &self.budget {
            b.compiles.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Device time of the tenant's finished executions so far, in nanoseconds.
    pub(crate) fn device_ns(&self) -> u64 {
        self.device_ns.load(Ordering::Relaxed)
    }

    /// Counts an execution that got a slot and has not finished (on the budget too).
    pub(crate) fn execution_started(&self) {
        self.running.fetch_add(1, Ordering::Relaxed);
        if let Some(b) = &self.budget {
            b.execution_started();
        }
    }

    /// Counts one finished execution that kept the device for `took` (on the budget too).
    pub(crate) fn record_execution(&self, took: Duration) {
        self.running.fetch_sub(1, Ordering::Relaxed);
        self.executions.fetch_add(1, Ordering::Relaxed);
        self.device_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        if let Some(b) = &self.budget {
            b.record_execution(took);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> TenantLimits {
        TenantLimits {
            max_device_bytes: 1000,
            max_live_tensors: 3,
            max_live_executables: 1,
            max_program_bytes: 10,
            max_compiles_per_minute: 2,
            ..TenantLimits::default()
        }
    }

    #[test]
    fn transfers_have_a_pool_of_their_own_and_are_returned_on_drop() {
        let t = Tenant::new("a", small());
        let held = t.charge_tensors(&[900], 0).unwrap();
        // The device bytes held do not count against transfers, nor the reverse.
        let up = t.charge_transfer(800, "an upload").unwrap();
        let u = t.usage();
        assert_eq!((u.device_bytes, u.transfer_bytes), (900, 800));
        // The pool is twice max-device-bytes (1000 here).
        let e = t.charge_transfer(1201, "a second upload").unwrap_err();
        assert_eq!(e.kind, ErrorKind::ResourceExhausted);
        assert!(
            e.message.contains("a second upload") && e.message.contains("max-device-bytes"),
            "{}",
            e.message
        );
        let fits = t.charge_transfer(1200, "a read").unwrap();
        drop((up, fits, held));
        let u = t.usage();
        assert_eq!((u.device_bytes, u.transfer_bytes, u.refused), (0, 0, 1));
    }

    #[test]
    fn charges_are_returned_on_drop_and_limits_name_themselves() {
        let t = Tenant::new("a", small());
        let c = t.charge_tensors(&[400, 500], 0).unwrap();
        assert_eq!(t.usage().device_bytes, 900);
        let e = t.charge_tensors(&[200], 0).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ResourceExhausted);
        assert!(e.message.contains("max-device-bytes"), "{}", e.message);
        // Crediting a donated input makes room.
        let d = t.charge_tensors(&[200], 400).unwrap();
        let e = t.charge_tensors(&[0, 0], 0).unwrap_err();
        assert!(e.message.contains("max-live-tensors"), "{}", e.message);
        drop(c);
        drop(d);
        let u = t.usage();
        assert_eq!(
            (u.device_bytes, u.live_tensors, u.peak_device_bytes),
            (0, 0, 900)
        );
        assert_eq!(u.refused, 2);
        let x = t.charge_executable().unwrap();
        assert!(
            t.charge_executable()
                .unwrap_err()
                .message
                .contains("max-live-executables")
        );
        drop(x);
        t.charge_executable().unwrap();
    }

    #[test]
    fn temporaries_count_while_they_are_held_and_donations_are_credited_first() {
        let t = Tenant::new("a", small());
        let input = t.charge_tensors(&[400], 0).unwrap();
        // 400 held, the donated input credited: 100 out + 500 temporaries fit in 1000.
        let (out, temps) = t.charge_execution(0, &[100], 400, 500).unwrap();
        assert_eq!(t.usage().device_bytes, 1000);
        let e = t.charge_execution(0, &[0], 0, 1).unwrap_err();
        assert!(
            e.message.contains("max-device-bytes") && e.message.contains("temporaries"),
            "{}",
            e.message
        );
        drop(input);
        drop(temps);
        assert_eq!(t.usage().device_bytes, 100);
        assert_eq!(t.usage().peak_device_bytes, 600);
        drop(out);
        assert_eq!(t.usage().device_bytes, 0);
    }

    #[test]
    fn compile_admission() {
        let t = Tenant::new("a", small());
        assert!(
            t.admit_compile(11)
                .unwrap_err()
                .message
                .contains("max-program-bytes")
        );
        let none = Tenant::new(
            "b",
            TenantLimits {
                max_compiles_per_minute: 0,
                ..small()
            },
        );
        assert!(
            none.admit_compile(1)
                .unwrap_err()
                .message
                .contains("max-compiles-per-minute")
        );
        t.admit_compile(10).unwrap();
        t.admit_compile(1).unwrap();
        let e = t.admit_compile(1).unwrap_err();
        assert!(
            e.message.contains("max-compiles-per-minute"),
            "{}",
            e.message
        );
        assert_eq!(t.usage().compiles, 2);
    }

    #[test]
    fn custom_call_rule_allows_the_lapack_targets_by_default_and_only_what_is_listed() {
        let facts = |targets: &[&str]| pjrt::ProgramFacts {
            custom_call_targets: targets.iter().map(|t| t.to_string()).collect(),
            ..Default::default()
        };
        let t = Tenant::new("a", small());
        t.admit_program(&facts(&["TopK", "lapack_sgetrf_ffi", "lapack_zheevd_ffi"]))
            .unwrap();
        let e = t.admit_program(&facts(&["my_kernel"])).unwrap_err();
        assert_eq!(e.kind, ErrorKind::PermissionDenied);
        assert!(e.message.contains("`my_kernel`") && e.message.contains("custom-call"));
        // An operator who narrows the list refuses LAPACK like any other target.
        let narrow = Tenant::new(
            "b",
            TenantLimits {
                program_policy: ProgramPolicy {
                    allowed_custom_calls: vec!["TopK".into()],
                    ..ProgramPolicy::default()
                },
                ..small()
            },
        );
        let e = narrow
            .admit_program(&facts(&["lapack_sgetrf_ffi"]))
            .unwrap_err();
        assert!(e.message.contains("lapack_sgetrf_ffi"), "{}", e.message);
        assert_eq!(default_custom_calls().len(), 54);
    }

    #[test]
    fn a_budget_holds_the_device_bytes_of_all_its_sessions() {
        let budget = Tenant::new_budget("alice", small());
        let s1 = Tenant::with_budget(
            "alice",
            TenantLimits {
                max_device_bytes: 800,
                ..small()
            },
            Arc::clone(&budget),
        );
        let s2 = Tenant::with_budget(
            "alice",
            TenantLimits {
                max_device_bytes: 800,
                ..small()
            },
            Arc::clone(&budget),
        );
        let held = s1.charge_tensors(&[600], 0).unwrap();
        // Within its session's 800, over the tenant's 1000 with the other session's 600.
        let e = s2.charge_tensors(&[600], 0).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ResourceExhausted);
        assert!(
            e.message.starts_with("tenant `alice` (all its sessions together): its sessions hold 600 device bytes, 600 more would exceed 1000 (limit max-device-bytes)"),
            "{}",
            e.message
        );
        assert_eq!((s2.usage().refused, s2.usage().device_bytes), (1, 0));
        // A session's own limit names the session.
        let e = s1.charge_tensors(&[300], 0).unwrap_err();
        assert!(
            e.message.starts_with("tenant `alice`, this session: "),
            "{}",
            e.message
        );
        // Donated bytes are credited on both; dropping a charge returns it to both.
        let c = s2.charge_tensors(&[600], 600).unwrap();
        drop(held);
        assert_eq!(budget.usage().device_bytes, 600);
        assert_eq!(budget.usage().peak_device_bytes, 600);
        drop(c);
        assert_eq!(
            (
                budget.usage().device_bytes,
                s1.usage().device_bytes,
                s2.usage().device_bytes
            ),
            (0, 0, 0)
        );
    }
}
