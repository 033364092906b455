//! Running the XLA compiler on a tenant's program: in this process, or contained in a compile
//! worker process.
//!
//! XLA's MLIR parser and passes recurse over a program's structure, and some inputs make them
//! abort: a function that calls itself, types or regions nested thousands deep, or a long plain
//! chain of ops overflow the stack and take the whole process down; other programs make the
//! compiler run for minutes or use gigabytes. None of that can be validated away before PJRT.
//! A compile worker (`tpubox compile-worker`, the same binary) contains it: it sets its own
//! limits (address space, CPU time, no core file), loads the plugin and creates its own
//! client, compiles on a thread with a large stack, and returns the serialized executable,
//! which the host loads exactly like a tier-2 cache entry. A worker that crashes, runs out of
//! memory, passes its resident-memory cap (read every [`RESIDENT_POLL`]) or the wall-clock
//! limit is killed and the tenant gets one error naming what happened; the host goes on. Cache
//! hits never start a worker.
//!
//! How many compile at once is capped ([`CompileIsolation::max_workers`] for the host,
//! [`CompileIsolation::max_workers_per_tenant`] per tenant; a tenant's extra compiles wait in
//! its own queue, so they never hold the host's slots against other tenants). Workers are
//! started ahead of need ([`CompileIsolation::prestarted_workers`]): plugin loaded and client
//! created before a program arrives. Each compiles one program and exits, so no state of one
//! tenant's compile reaches another's. The workers' processes and pipes are driven from a
//! thread of their own (`tpubox-compile-workers`), whatever runtime the caller uses.
//!
//! Workers need a plugin whose client can be created beside the host's: true of the CPU
//! plugins. A TPU can be opened by one process only, so on other platforms the host compiles
//! in process (and logs that it does) until workers compile against a topology description.
//!
//! Wire format: on the worker's stdin, a JSON `Setup` line as it starts, then a JSON `Request`
//! line and the program bytes it announces; on its stdout, `ready` once its client exists, then
//! a JSON `Response` line and the serialized executable it announces.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pjrt::{
    Client, CompileOptions, LoadedExecutable, NamedValue, OptimizationLevel, Plugin, Program,
    ProgramFormat,
};
use serde::{Deserialize, Serialize};
use tokio::io::BufReader;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::cache::{Entry, EntryMeta};
use crate::error::{DeviceError, DeviceResult, ErrorKind};
use crate::tenant::LoopBudgetLimits;
use crate::types::{TensorSpec, spec_list};

/// How tenant programs are compiled; part of [`DeviceConfig`](crate::DeviceConfig) (and of `tpubox_wasm::HostConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct CompileIsolation {
    /// The `tpubox` binary to run as `tpubox compile-worker`; `None` compiles in this process
    /// (no protection from programs that crash or exhaust the compiler). Default: the
    /// `TPUBOX_COMPILE_WORKER` environment variable; the `tpubox` command sets itself.
    pub worker: Option<PathBuf>,
    /// Wall-clock limit of one compile (default 120 s); the worker is killed when it passes
    /// it, and its CPU time is limited to four times as much. Named `max-compile-seconds` in
    /// errors.
    pub max_compile_time: Duration,
    /// Address-space limit of a worker, in bytes (default 16 GiB; the plugin's thread pools
    /// reserve much more virtual memory than they use). Named `max-compile-memory` in errors.
    pub max_memory_bytes: u64,
    /// Stack of the worker's compile thread, in bytes (default 1 GiB, reserved, touched only as
    /// deep as the compiler recurses): deep enough for a 30,000-op chain, which overflows a
    /// default 8 MiB thread stack.
    pub stack_bytes: usize,
    /// Resident-memory cap of a worker, in bytes (default 4 GiB): while a worker compiles, the
    /// host reads its resident set (`VmRSS` of `/proc/PID/status`) every [`RESIDENT_POLL`]
    /// and kills it above this; the tenant gets `resource-exhausted` naming
    /// `max-compile-resident`. It must exceed a started worker's own footprint (the plugin
    /// and its client, and a warm-up compile: 110–125 MiB with the CPU plugins). The address-space limit
    /// (`max_memory_bytes`) still applies.
    pub max_resident_bytes: u64,
    /// Compiles that run the compiler at once on this host, in workers or (without workers)
    /// in process (default [`default_max_workers`]: half the cores, at least 1); more wait
    /// for a slot, at most `max_compile_time`, then fail with `resource-exhausted` naming
    /// `max-compile-workers`. Cache hits take no slot.
    pub max_workers: usize,
    /// Compiles of one tenant (by name) that run at once (default 1); more wait in the
    /// tenant's own queue, before they ask for a host slot, so a flood from one tenant holds at
    /// most this many of the host's slots. At most [`MAX_WAITING_COMPILES_PER_TENANT`] wait;
    /// more, or one that waits longer than `max_compile_time`, fail with `resource-exhausted`
    /// naming `max-compile-workers-per-tenant`.
    pub max_workers_per_tenant: usize,
    /// Workers started ahead of need and kept idle (default 1): each has loaded the plugin and
    /// created its client before a program arrives, so a compile does not wait for a process
    /// start. A worker compiles one program and exits (no worker carries one compile's state
    /// into another's); taking one starts its replacement. 0 starts each worker when its
    /// compile needs it. Idle workers are not counted in `max_workers`.
    pub prestarted_workers: usize,
}

/// Default of [`CompileIsolation::max_workers`]: half of this machine's cores, at least 1.
pub fn default_max_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// How often the host reads a compiling worker's resident set (10 ms); a worker may pass
/// [`CompileIsolation::max_resident_bytes`] by what it allocates in that time before it is
/// stopped.
pub const RESIDENT_POLL: Duration = Duration::from_millis(10);

/// Compiles of one tenant that may wait for a compile slot beyond those running (16); more
/// are refused at once (`resource-exhausted`, `max-compile-workers-per-tenant`), so a tenant
/// cannot queue unbounded programs in the host's memory.
pub const MAX_WAITING_COMPILES_PER_TENANT: usize = 16;

/// Bytes of a worker's standard error the host keeps (the last 64 KiB), to explain its death.
const STDERR_TAIL: usize = 64 << 10;

impl Default for CompileIsolation {
    fn default() -> Self {
        CompileIsolation {
            worker: std::env::var_os("TPUBOX_COMPILE_WORKER").map(PathBuf::from),
            max_compile_time: Duration::from_secs(120),
            max_memory_bytes: 16 << 30,
            stack_bytes: 1 << 30,
            max_resident_bytes: 4 << 30,
            max_workers: default_max_workers(),
            max_workers_per_tenant: 1,
            prestarted_workers: 1,
        }
    }
}

/// A program compiled in this process.
pub(crate) struct CompiledProgram {
    pub exe: LoadedExecutable,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    pub fingerprint: String,
    pub compile_ms: f64,
}

/// Compiles MLIR (`code`, text or bytecode) with `client`; `plugin_path` goes into the fallback
/// fingerprint. With a `budget`, a program whose optimized form has `while` loops XLA cannot
/// bound is compiled a second time with those loops budgeted ([`compile_budgeted`]).
///
/// Errors: `compile-failed` with the compiler's message; `unsupported` when the plugin cannot
/// describe the parameters or results; `permission-denied` when, with a budget, the program
/// calls the loop budget's custom call itself.
pub(crate) fn compile_program(
    client: &Client,
    plugin_path: &str,
    code: Vec<u8>,
    options: &CompileOptions,
    budget: Option<LoopBudgetLimits>,
) -> DeviceResult<CompiledProgram> {
    let start = Instant::now();
    let program = Program {
        format: ProgramFormat::Mlir,
        code,
    };
    let compile_failed = |e: pjrt::Error| {
        let mut err = DeviceError::from_pjrt(e, ErrorKind::CompileFailed);
        err.message = tidy_compile_message(&err.message);
        err
    };
    let exe = match budget {
        None => client.compile(&program, options).map_err(compile_failed)?,
        Some(budget) => compile_budgeted(client, &program, options, budget, compile_failed)?,
    };
    let compile_ms = start.elapsed().as_secs_f64() * 1e3;
    let unsupported = |e: pjrt::Error| DeviceError::from_pjrt(e, ErrorKind::Unsupported);
    let inputs = exe.parameter_specs().map_err(unsupported)?;
    let outputs = exe.output_specs().map_err(unsupported)?;
    let fingerprint = match exe.fingerprint() {
        Ok(f) if !f.is_empty() => f,
        _ => {
            use sha2::{Digest, Sha256};
            let mut h = Sha256::new();
            h.update(b"mlir\0");
            h.update(&program.code);
            h.update(options.to_bytes().unwrap_or_default());
            h.update(plugin_path.as_bytes());
            hex::encode(h.finalize())
        }
    };
    Ok(CompiledProgram {
        exe,
        inputs,
        outputs,
        fingerprint,
        compile_ms,
    })
}

/// Compiles `program` for a tenant with a loop budget. The first compile dumps the module as
/// it was before XLA's passes ([`CompileOptions::dump_hlo_to`], into a private temporary
/// directory); when the optimized program has `while` loops XLA cannot bound, that module is
/// rewritten so that those loops' conditions ask the budget
/// ([`pjrt::loop_budget::budget_loops`]) and compiled again, as format `"hlo"`. The loops are
/// found in the earlier module by name, one trip of each costing the most work
/// ([`pjrt::WhileLoop::trip_work`]) of any of them; when a name is not there, or
/// the compiled result still has an unbounded loop without the budget (XLA renames
/// instructions in its passes, so a name may point at another loop), every loop of the module
/// is budgeted instead, one trip costing the most work of any loop. The program policy then
/// checks, on the program that will run, that each unbounded loop asks the budget
/// ([`crate::Tenant::admit_program`]).
///
/// Errors: `compile-failed` with the compiler's message; `permission-denied` when the program
/// calls the budget's custom call itself; `unsupported` when the plugin cannot return the
/// optimized program, did not dump the module, or the module does not decode.
fn compile_budgeted(
    client: &Client,
    program: &Program,
    options: &CompileOptions,
    budget: LoopBudgetLimits,
    compile_failed: impl Fn(pjrt::Error) -> DeviceError,
) -> DeviceResult<LoadedExecutable> {
    let unsupported = |e: pjrt::Error| DeviceError::from_pjrt(e, ErrorKind::Unsupported);
    let io = |what: &str, e: std::io::Error| {
        DeviceError::new(
            ErrorKind::Unsupported,
            format!("the loop budget cannot {what}: {e}"),
        )
    };
    sweep_stale_dumps();
    let dump = crate::cache::atomic::LockedTempDir::new(
        &std::env::temp_dir(),
        &format!("{DUMP_PREFIX}{}-", std::process::id()),
    )
    .map_err(|e| io("make a directory for the compiler's dump", e))?;
    let dumping = options
        .clone()
        .dump_hlo_to(Some(dump.path().to_string_lossy().into_owned()));
    let exe = client.compile(program, &dumping).map_err(&compile_failed)?;
    let facts = exe.program_facts().map_err(unsupported)?;
    let target = pjrt::loop_budget::LOOP_BUDGET_TARGET;
    if facts.custom_call_targets.iter().any(|t| t == target) {
        return Err(DeviceError::new(
            ErrorKind::PermissionDenied,
            format!("the program calls {target}, which only the host may"),
        ));
    }
    let unbounded: Vec<&pjrt::WhileLoop> = facts
        .while_loops
        .iter()
        .filter(|w| w.known_trip_count.is_none())
        .collect();
    if unbounded.is_empty() {
        return Ok(exe);
    }
    let names: Vec<String> = unbounded.iter().map(|w| w.name.clone()).collect();
    // One trip of a budgeted loop costs the most work of any loop picked.
    let named_step = unbounded.iter().map(|w| w.trip_work).max().unwrap_or(1);
    let all_step = facts
        .while_loops
        .iter()
        .map(|w| w.trip_work)
        .max()
        .unwrap_or(1);
    let before =
        before_optimizations(dump.path()).map_err(|e| io("read the compiler's dump", e))?;
    drop(exe);
    let budget_for = |step: u64| pjrt::loop_budget::LoopBudget {
        iterations: budget.max_loop_iterations,
        work: budget.max_loop_work,
        step: step.max(1),
    };
    // A plugin where the budget's handler is not found at compile (`xla-cpu-pjrt` 0.0.1
    // finds no FFI handler the host registers): such loops are refused there, as without a
    // budget.
    let compile_failed = |e: pjrt::Error| {
        let err = compile_failed(e);
        if err.message.contains(target) && err.message.contains("No FFI handler") {
            return DeviceError::new(
                ErrorKind::PermissionDenied,
                format!(
                    "the program has a while loop XLA cannot bound, and this plugin cannot run the loop budget ({}); it could run forever, and a running program cannot be stopped (policy rule unbounded-loop)",
                    err.message
                ),
            );
        }
        err
    };
    let rewrite =
        |select, b| match pjrt::loop_budget::budget_loops(pjrt::HLO_PROTO, &before, b, select) {
            Ok(r) => Ok(r),
            Err(e) if e.code == pjrt::ErrorCode::PermissionDenied => {
                Err(DeviceError::new(ErrorKind::PermissionDenied, e.message))
            }
            Err(e) => Err(unsupported(e)),
        };
    // First the loops XLA could not bound, found by name.
    let named = rewrite(
        pjrt::loop_budget::LoopSelection::Named(&names),
        budget_for(named_step),
    )?;
    if let Some(r) = named
        && r.loops.len() >= names.len()
    {
        let exe = client
            .compile(&Program::hlo(r.module), options)
            .map_err(&compile_failed)?;
        let facts = exe.program_facts().map_err(unsupported)?;
        if facts
            .while_loops
            .iter()
            .all(|w| w.known_trip_count.is_some() || w.budgeted)
        {
            return Ok(exe);
        }
    }
    // Else every loop, one trip costing the most work of any loop of the program.
    let all =
        rewrite(pjrt::loop_budget::LoopSelection::All, budget_for(all_step))?.ok_or_else(|| {
            DeviceError::new(
                ErrorKind::Unsupported,
                "the loop budget found no while loop in the program before optimization",
            )
        })?;
    client
        .compile(&Program::hlo(all.module), options)
        .map_err(compile_failed)
}

/// The module XLA dumped into `dir` before its passes: the one
/// `*.before_optimizations.hlo.pb` file there (an `xla.HloProto`).
fn before_optimizations(dir: &std::path::Path) -> std::io::Result<Vec<u8>> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.to_string_lossy()
            .ends_with(".before_optimizations.hlo.pb")
        {
            found.push(p);
        }
    }
    match found.as_slice() {
        [one] => std::fs::read(one),
        other => Err(std::io::Error::other(format!(
            "expected one module dumped before optimization, found {}",
            other.len()
        ))),
    }
}

/// Longest compiler message passed on, in bytes: diagnostics can quote a whole (hostile) type
/// or program, and the message is copied into the guest.
pub const MAX_COMPILE_MESSAGE: usize = 4096;

/// Drops the plugin's generic "Failed to parse using StableHLO vX…" hint when the message holds
/// a real diagnostic, and blank lines; cuts it to [`MAX_COMPILE_MESSAGE`] bytes.
/// A sentence for a program with a dimension of unknown size (`tensor<?x4xf32>`, or a
/// `jax.export` made with `symbolic_shape`), which XLA refuses as "Unbounded dynamism is
/// disabled for instruction: %… = f32[?,4]{1,0} parameter(0)": it names the parameter and its
/// shape and says what to do. `None` for any other message.
fn explain_dynamic_shape(msg: &str) -> Option<String> {
    let Some(at) = msg.find("Unbounded dynamism is disabled for instruction:") else {
        // A `jax.export` with symbolic dimensions: its shape computations (e.g.
        // `stablehlo.dynamic_broadcast_in_dim`) do not translate.
        if !msg.contains("can't be translated to XLA HLO") {
            return None;
        }
        let ty = msg.find("tensor<?").map(|i| {
            let t = &msg[i..];
            t[..t.find('>').map_or(t.len(), |j| j + 1)].to_string()
        })?;
        return Some(format!(
            "the program has dimensions of unknown size ({ty}; a symbolic shape, e.g. jax.export with symbolic_shape): this plugin compiles static shapes only. Export the program for concrete shapes (one export per shape you need)."
        ));
    };
    let rest = &msg[at..];
    let line = rest.lines().next().unwrap_or(rest);
    let shape = line
        .split_whitespace()
        .find(|w| w.contains('?'))
        .map(|w| w.split('{').next().unwrap_or(w).to_string());
    let param = line
        .find("parameter(")
        .and_then(|i| line[i + "parameter(".len()..].split(')').next())
        .map(|n| format!("parameter {n} of `main`"));
    Some(format!(
        "{} has a dimension of unknown size{}: this plugin compiles static shapes only. Export the program for concrete shapes (for jax.export: without symbolic_shape, one export per shape you need).",
        param.unwrap_or_else(|| "a value of the program".into()),
        shape.map(|s| format!(" ({s})")).unwrap_or_default()
    ))
}

fn tidy_compile_message(msg: &str) -> String {
    let lines: Vec<&str> = msg.lines().filter(|l| !l.trim().is_empty()).collect();
    let real: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| !l.contains("Failed to parse using StableHLO"))
        .collect();
    let mut text = if real.is_empty() {
        lines.join("\n")
    } else {
        real.join("\n")
    };
    if let Some(why) = explain_dynamic_shape(&text) {
        text = format!("{why}\ncompiler: {text}");
    }
    if text.len() <= MAX_COMPILE_MESSAGE {
        return text;
    }
    let mut cut = MAX_COMPILE_MESSAGE;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}… ({} more bytes cut)", &text[..cut], text.len() - cut)
}

/// A client create option, as it travels to a worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum OptionValue {
    String(String),
    Int64(i64),
    Int64List(Vec<i64>),
    Float(f32),
    Bool(bool),
}

impl From<&NamedValue> for OptionValue {
    fn from(v: &NamedValue) -> Self {
        match v {
            NamedValue::String(s) => OptionValue::String(s.clone()),
            NamedValue::Int64(i) => OptionValue::Int64(*i),
            NamedValue::Int64List(l) => OptionValue::Int64List(l.clone()),
            NamedValue::Float(f) => OptionValue::Float(*f),
            NamedValue::Bool(b) => OptionValue::Bool(*b),
        }
    }
}

impl From<OptionValue> for NamedValue {
    fn from(v: OptionValue) -> Self {
        match v {
            OptionValue::String(s) => NamedValue::String(s),
            OptionValue::Int64(i) => NamedValue::Int64(i),
            OptionValue::Int64List(l) => NamedValue::Int64List(l),
            OptionValue::Float(f) => NamedValue::Float(f),
            OptionValue::Bool(b) => NamedValue::Bool(b),
        }
    }
}

/// What the host sends a worker as it starts (the first line of its stdin): everything the
/// worker can prepare before a program arrives. It answers `ready` (one line) once its client
/// exists.
#[derive(Debug, Serialize, Deserialize)]
struct Setup {
    plugin: PathBuf,
    client_options: Vec<(String, OptionValue)>,
    max_memory_bytes: u64,
    max_cpu_seconds: u64,
    stack_bytes: usize,
    /// Compile [`WARM_UP`] before saying `ready` (workers started ahead of need).
    warm_up: bool,
}

/// The worker's one compile (the second line of its stdin; the program follows).
#[derive(Debug, Serialize, Deserialize)]
struct Request {
    device_ordinal: i64,
    program_bytes: usize,
    /// The device ids of a program compiled for several devices at once (one partition
    /// each, [`CompileOptions::spmd`]); absent for one device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    spmd_device_ids: Option<Vec<i64>>,
    /// The optimisation level (`"O0"` … `"O3"`); absent for the plugin's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    optimization_level: Option<String>,
    /// The loop budget of an untrusted tenant; absent for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    loop_budget: Option<LoopBudgetLimits>,
}

/// The program a worker compiles before it says `ready`, to set the compiler up.
const WARM_UP: &str = "func.func public @main(%a: tensor<2x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {\n  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x2xf32>, tensor<2x2xf32>) -> tensor<2x2xf32>\n  %1 = stablehlo.add %0, %a : tensor<2x2xf32>\n  return %1 : tensor<2x2xf32>\n}\n";

/// The line a worker writes once its client exists (and, started ahead of need, it has
/// compiled [`WARM_UP`]).
const READY_LINE: &[u8] = b"ready\n";

/// What a worker answers (the line after `ready` on its stdout; the executable follows on
/// success).
#[derive(Debug, Serialize, Deserialize)]
enum Response {
    Compiled {
        meta: EntryMeta,
        executable_bytes: usize,
    },
    Failed {
        kind: String,
        message: String,
    },
}

/// Where the host's client came from, for workers to create theirs alike.
#[derive(Debug, Clone)]
pub(crate) struct WorkerTarget {
    pub plugin: PathBuf,
    pub client_options: Vec<(String, NamedValue)>,
}

/// Counters of one device service's compiles, as [`CompileStats`] reports them.
#[derive(Debug, Default)]
struct Counters {
    running: AtomicU64,
    peak_running: AtomicU64,
    waited_for_host: AtomicU64,
    waited_for_tenant: AtomicU64,
    refused: AtomicU64,
    workers_started: AtomicU64,
    workers_ready: AtomicU64,
    prestarted_used: AtomicU64,
    ready_used: AtomicU64,
    started_on_demand: AtomicU64,
    idle_workers: AtomicU64,
    resident_kills: AtomicU64,
    peak_resident_bytes: AtomicU64,
    last_worker_pid: AtomicU64,
}

/// What a device service's compiles have done since it opened
/// ([`DeviceService::compile_stats`](crate::DeviceService::compile_stats)). Counts compiles
/// that ran the compiler (cache misses); cache hits take no slot and start no worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CompileStats {
    /// Compiles holding a host slot now (compiling in a worker or in process).
    pub running: u64,
    /// Most compiles that held a host slot at once (at most `max_workers`).
    pub peak_running: u64,
    /// Compiles that found every host slot taken and waited (`max-compile-workers`).
    pub waited_for_host: u64,
    /// Compiles that found their tenant's slots taken and waited
    /// (`max-compile-workers-per-tenant`).
    pub waited_for_tenant: u64,
    /// Compiles refused for want of a slot (too many waiting, or waited past the time limit).
    pub refused: u64,
    /// Worker processes started (each compiles at most one program).
    pub workers_started: u64,
    /// Of those, the ones that said `ready` (plugin loaded, client created).
    pub workers_ready: u64,
    /// Compiles that took a worker started ahead of need.
    pub prestarted_used: u64,
    /// Of those, the ones whose worker had already created its client (the compile waited for
    /// no process start at all).
    pub ready_used: u64,
    /// Compiles that found no idle worker and started one.
    pub started_on_demand: u64,
    /// Workers started and waiting for a compile now.
    pub idle_workers: u64,
    /// Workers killed above `max-compile-resident`.
    pub resident_kills: u64,
    /// Highest resident set read from a compiling worker, in bytes.
    pub peak_resident_bytes: u64,
    /// Process id of the worker that took the latest compile (`None` before the first).
    pub last_worker_pid: Option<u32>,
}

impl Counters {
    fn snapshot(&self) -> CompileStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CompileStats {
            running: g(&self.running),
            peak_running: g(&self.peak_running),
            waited_for_host: g(&self.waited_for_host),
            waited_for_tenant: g(&self.waited_for_tenant),
            refused: g(&self.refused),
            workers_started: g(&self.workers_started),
            workers_ready: g(&self.workers_ready),
            prestarted_used: g(&self.prestarted_used),
            ready_used: g(&self.ready_used),
            started_on_demand: g(&self.started_on_demand),
            idle_workers: g(&self.idle_workers),
            resident_kills: g(&self.resident_kills),
            peak_resident_bytes: g(&self.peak_resident_bytes),
            last_worker_pid: match g(&self.last_worker_pid) {
                0 => None,
                p => u32::try_from(p).ok(),
            },
        }
    }
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// Tenants with a compile running or waiting: their slots and how many compiles use them.
type TenantSlots = Arc<Mutex<HashMap<String, (Arc<Semaphore>, usize)>>>;

/// The compile slots: `max_workers` for the host, `max_workers_per_tenant` per tenant; a
/// compile takes its tenant's slot first, then a host slot (both queues are FIFO).
struct CompileGate {
    host: Arc<Semaphore>,
    host_cap: usize,
    per_tenant: usize,
    tenants: TenantSlots,
}

/// One compile's slots, given back when it is dropped.
pub(crate) struct CompileSlot {
    _host: OwnedSemaphorePermit,
    _tenant: OwnedSemaphorePermit,
    _user: TenantUse,
    counters: Arc<Counters>,
}

impl Drop for CompileSlot {
    fn drop(&mut self) {
        self.counters.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One compile of a tenant, running or waiting; the tenant's entry goes when its last one does.
struct TenantUse {
    tenants: TenantSlots,
    name: String,
}

impl Drop for TenantUse {
    fn drop(&mut self) {
        let mut map = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = map.get_mut(&self.name) {
            e.1 -= 1;
            if e.1 == 0 {
                map.remove(&self.name);
            }
        }
    }
}

impl CompileGate {
    fn new(limits: &CompileIsolation) -> Self {
        let host_cap = limits.max_workers.max(1);
        CompileGate {
            host: Arc::new(Semaphore::new(host_cap)),
            host_cap,
            per_tenant: limits.max_workers_per_tenant.max(1),
            tenants: Arc::default(),
        }
    }

    /// Waits for a slot of `tenant` and then a host slot, `limit` at most in all.
    async fn acquire(
        &self,
        tenant: &str,
        limit: Duration,
        counters: &Arc<Counters>,
    ) -> DeviceResult<CompileSlot> {
        let deadline = tokio::time::Instant::now() + limit;
        let refuse = |message: String| {
            bump(&counters.refused);
            DeviceError::new(ErrorKind::ResourceExhausted, message)
        };
        let (slots, user) = {
            let mut map = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
            let e = map
                .entry(tenant.to_string())
                .or_insert_with(|| (Arc::new(Semaphore::new(self.per_tenant)), 0));
            if e.1 >= self.per_tenant + MAX_WAITING_COMPILES_PER_TENANT {
                let queued = e.1;
                drop(map);
                crate::protection::triggered(
                    "compile-workers-per-tenant",
                    "compiler",
                    format_args!(
                        "tenant {tenant:?} has {queued} compiles running or waiting; one more refused"
                    ),
                );
                return Err(refuse(format!(
                    "this tenant already has {queued} compiles running or waiting (limit max-compile-workers-per-tenant: {} at once, {MAX_WAITING_COMPILES_PER_TENANT} more waiting); try again when one ends",
                    self.per_tenant
                )));
            }
            e.1 += 1;
            (
                Arc::clone(&e.0),
                TenantUse {
                    tenants: Arc::clone(&self.tenants),
                    name: tenant.to_string(),
                },
            )
        };
        let tenant_slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                bump(&counters.waited_for_tenant);
                crate::protection::triggered(
                    "compile-workers-per-tenant",
                    "compiler",
                    format_args!(
                        "tenant {tenant:?} runs {} compiles at once; one more waits",
                        self.per_tenant
                    ),
                );
                match tokio::time::timeout_at(deadline, slots.acquire_owned()).await {
                    Ok(Ok(p)) => p,
                    _ => {
                        return Err(refuse(format!(
                            "waited {} s for a compile slot: this tenant's {} compiles at once were busy all that time (limit max-compile-workers-per-tenant)",
                            limit.as_secs_f64(),
                            self.per_tenant
                        )));
                    }
                }
            }
        };
        let host_slot = match Arc::clone(&self.host).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                bump(&counters.waited_for_host);
                crate::protection::triggered(
                    "compile-workers",
                    "compiler",
                    format_args!(
                        "the host runs {} compiles at once; one of tenant {tenant:?} waits",
                        self.host_cap
                    ),
                );
                match tokio::time::timeout_at(deadline, Arc::clone(&self.host).acquire_owned())
                    .await
                {
                    Ok(Ok(p)) => p,
                    _ => {
                        return Err(refuse(format!(
                            "waited {} s for a compile slot: the host's {} compiles at once were busy all that time (limit max-compile-workers)",
                            limit.as_secs_f64(),
                            self.host_cap
                        )));
                    }
                }
            }
        };
        let now = counters.running.fetch_add(1, Ordering::Relaxed) + 1;
        counters.peak_running.fetch_max(now, Ordering::Relaxed);
        Ok(CompileSlot {
            _host: host_slot,
            _tenant: tenant_slot,
            _user: user,
            counters: Arc::clone(counters),
        })
    }
}

/// How a device service compiles: its slots, and its worker pool when workers are in use.
pub(crate) struct Compiles {
    gate: CompileGate,
    pool: Option<WorkerPool>,
    counters: Arc<Counters>,
}

impl Compiles {
    /// Slots as `limits` say; a worker pool (and its thread) when `target` is given and
    /// `limits.worker` is set.
    pub(crate) fn new(limits: &CompileIsolation, target: Option<WorkerTarget>) -> Self {
        let counters = Arc::new(Counters::default());
        let pool = match (&limits.worker, target) {
            (Some(worker), Some(target)) => {
                match WorkerPool::start(worker.clone(), limits.clone(), target, &counters) {
                    Ok(pool) => Some(pool),
                    Err(e) => {
                        tracing::error!(
                            "starting the compile worker thread: {e}; compiling in process"
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        Compiles {
            gate: CompileGate::new(limits),
            pool,
            counters,
        }
    }

    /// Whether compiles go to workers.
    pub(crate) fn uses_workers(&self) -> bool {
        self.pool.is_some()
    }

    /// What the compiles have done so far.
    pub(crate) fn stats(&self) -> CompileStats {
        self.counters.snapshot()
    }

    /// Waits for a compile slot of `tenant` and of the host ([`CompileGate`]), `limit` at most.
    ///
    /// Errors: `resource-exhausted` naming `max-compile-workers-per-tenant` or
    /// `max-compile-workers`.
    pub(crate) async fn slot(&self, tenant: &str, limit: Duration) -> DeviceResult<CompileSlot> {
        self.gate.acquire(tenant, limit, &self.counters).await
    }

    /// Compiles `code` for device `ordinal` at optimisation level `level` (`None`: the
    /// plugin's default) in a worker of the pool.
    ///
    /// Errors: as [`run_in_worker`]; `internal` without workers.
    pub(crate) async fn in_worker(
        &self,
        code: Vec<u8>,
        ordinal: i64,
        spmd: Option<Vec<i64>>,
        level: Option<OptimizationLevel>,
        budget: Option<LoopBudgetLimits>,
    ) -> DeviceResult<Entry> {
        match &self.pool {
            Some(pool) => pool.compile(code, ordinal, spmd, level, budget).await,
            None => Err(DeviceError::new(
                ErrorKind::Internal,
                "no compile workers are in use",
            )),
        }
    }
}

/// A compile handed to the pool's thread.
struct Job {
    code: Vec<u8>,
    ordinal: i64,
    spmd: Option<Vec<i64>>,
    level: Option<OptimizationLevel>,
    budget: Option<LoopBudgetLimits>,
    reply: oneshot::Sender<DeviceResult<Entry>>,
}

/// The compile workers: a thread of its own, with its own tokio runtime (the workers' pipes
/// and exits live there, whatever runtime the caller uses), that keeps
/// [`CompileIsolation::prestarted_workers`] idle workers and drives each compile's worker.
/// Dropping it ends the thread and kills its workers.
struct WorkerPool {
    jobs: mpsc::UnboundedSender<Job>,
}

/// What the pool's tasks share.
struct PoolShared {
    worker: PathBuf,
    /// The [`Setup`] line of a worker started ahead of need (it compiles [`WARM_UP`]).
    setup_line: Vec<u8>,
    /// The [`Setup`] line of a worker started for a compile waiting for it (no warm-up).
    setup_line_now: Vec<u8>,
    limits: CompileIsolation,
    counters: Arc<Counters>,
    idle: Mutex<VecDeque<Idle>>,
    /// Workers being started to refill `idle`.
    starting: AtomicUsize,
}

/// A started worker waiting for its one compile.
struct Idle {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    /// Reads the worker's `ready` line: the stdout after it, and whether it came.
    ready: tokio::task::JoinHandle<(BufReader<tokio::process::ChildStdout>, bool)>,
    /// Set once the `ready` line came.
    is_ready: Arc<AtomicBool>,
    /// The last [`STDERR_TAIL`] bytes of its standard error, once it closes.
    stderr: tokio::task::JoinHandle<Vec<u8>>,
}

impl WorkerPool {
    fn start(
        worker: PathBuf,
        limits: CompileIsolation,
        target: WorkerTarget,
        counters: &Arc<Counters>,
    ) -> std::io::Result<Self> {
        let setup = Setup {
            plugin: target.plugin,
            client_options: target
                .client_options
                .iter()
                .map(|(k, v)| (k.clone(), v.into()))
                .collect(),
            max_memory_bytes: limits.max_memory_bytes,
            max_cpu_seconds: limits.max_compile_time.as_secs().saturating_mul(4).max(1),
            stack_bytes: limits.stack_bytes,
            warm_up: true,
        };
        let line = |setup: &Setup| {
            let mut l = serde_json::to_vec(setup).expect("setups serialize");
            l.push(b'\n');
            l
        };
        let setup_line = line(&setup);
        let setup_line_now = line(&Setup {
            warm_up: false,
            ..setup
        });
        let shared = Arc::new(PoolShared {
            worker,
            setup_line,
            setup_line_now,
            limits,
            counters: Arc::clone(counters),
            idle: Mutex::new(VecDeque::new()),
            starting: AtomicUsize::new(0),
        });
        sweep_stale_dumps();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (jobs, mut rx) = mpsc::unbounded_channel::<Job>();
        std::thread::Builder::new()
            .name("tpubox-compile-workers".into())
            .spawn(move || {
                runtime.block_on(async move {
                    top_up(&shared);
                    while let Some(job) = rx.recv().await {
                        tokio::spawn(run_job(Arc::clone(&shared), job));
                    }
                });
                // Dropping the runtime drops the idle and running workers, which kills them.
            })?;
        Ok(WorkerPool { jobs })
    }

    async fn compile(
        &self,
        code: Vec<u8>,
        ordinal: i64,
        spmd: Option<Vec<i64>>,
        level: Option<OptimizationLevel>,
        budget: Option<LoopBudgetLimits>,
    ) -> DeviceResult<Entry> {
        let internal = |m: &str| DeviceError::new(ErrorKind::Internal, m);
        let (reply, answer) = oneshot::channel();
        self.jobs
            .send(Job {
                code,
                ordinal,
                spmd,
                level,
                budget,
                reply,
            })
            .map_err(|_| internal("the compile worker thread has stopped"))?;
        // Dropping this future (the caller gave up) closes `answer`; the pool then kills the
        // worker.
        answer
            .await
            .map_err(|_| internal("the compile worker thread dropped the compile"))?
    }
}

/// Starts workers until `prestarted_workers` are idle or starting.
fn top_up(shared: &Arc<PoolShared>) {
    let have = shared.idle.lock().unwrap_or_else(|p| p.into_inner()).len()
        + shared.starting.load(Ordering::Relaxed);
    for _ in have..shared.limits.prestarted_workers {
        shared.starting.fetch_add(1, Ordering::Relaxed);
        let s = Arc::clone(shared);
        tokio::spawn(async move {
            match spawn_worker(&s, true).await {
                Ok(w) => {
                    let mut idle = s.idle.lock().unwrap_or_else(|p| p.into_inner());
                    idle.push_back(w);
                    s.counters
                        .idle_workers
                        .store(idle.len() as u64, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!(
                    target: "tpubox::compile",
                    "starting a compile worker ahead of need ({}): {e}",
                    s.worker.display()
                ),
            }
            s.starting.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// Starts a worker and sends it its [`Setup`]: with the warm-up when it is started `ahead` of
/// need.
async fn spawn_worker(shared: &PoolShared, ahead: bool) -> std::io::Result<Idle> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let mut child = tokio::process::Command::new(&shared.worker)
        .arg("compile-worker")
        .env(PARENT_ENV, std::process::id().to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    bump(&shared.counters.workers_started);
    let mut stdin = child.stdin.take().expect("piped stdin");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let counters = Arc::clone(&shared.counters);
    let is_ready = Arc::new(AtomicBool::new(false));
    let ready_flag = Arc::clone(&is_ready);
    let ready = tokio::spawn(async move {
        let mut out = BufReader::new(stdout);
        let mut line = Vec::new();
        let got = (&mut out)
            .take(READY_LINE.len() as u64)
            .read_until(b'\n', &mut line)
            .await;
        let ok = got.is_ok() && line == READY_LINE;
        if ok {
            ready_flag.store(true, Ordering::Release);
            bump(&counters.workers_ready);
        }
        (out, ok)
    });
    let stderr = tokio::spawn(async move {
        let mut tail = Vec::new();
        let mut buf = vec![0u8; 8192];
        while let Ok(n @ 1..) = stderr.read(&mut buf).await {
            tail.extend_from_slice(&buf[..n]);
            if tail.len() > STDERR_TAIL {
                tail.drain(..tail.len() - STDERR_TAIL);
            }
        }
        tail
    });
    // A worker that dies at once closes its stdin; its exit status says why, at its compile.
    let setup = if ahead {
        &shared.setup_line
    } else {
        &shared.setup_line_now
    };
    let _ = stdin.write_all(setup).await;
    Ok(Idle {
        child,
        stdin,
        ready,
        is_ready,
        stderr,
    })
}

/// Takes an idle worker (starting its replacement) or starts one, and compiles in it.
async fn run_job(shared: Arc<PoolShared>, mut job: Job) {
    let taken = shared
        .idle
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop_front();
    let worker = match taken {
        Some(w) => {
            bump(&shared.counters.prestarted_used);
            shared.counters.idle_workers.store(
                shared.idle.lock().unwrap_or_else(|p| p.into_inner()).len() as u64,
                Ordering::Relaxed,
            );
            Ok(w)
        }
        None => {
            bump(&shared.counters.started_on_demand);
            spawn_worker(&shared, false).await.map_err(|e| {
                DeviceError::new(
                    ErrorKind::Internal,
                    format!(
                        "starting the compile worker {}: {e}",
                        shared.worker.display()
                    ),
                )
            })
        }
    };
    top_up(&shared);
    let answer = match worker {
        Ok(w) => {
            run_in_worker(
                &shared,
                w,
                job.code,
                job.ordinal,
                job.spmd,
                job.level,
                job.budget,
                &mut job.reply,
            )
            .await
        }
        Err(e) => Some(Err(e)),
    };
    if let Some(answer) = answer {
        let _ = job.reply.send(answer);
    }
}

/// How a compile in a worker ended.
enum End {
    Exited(Vec<u8>, std::io::Result<std::process::ExitStatus>),
    Resident(u64),
    Timeout,
    Cancelled,
}

/// Sends `code` to worker `w` and waits for its answer, reading its resident set every
/// [`RESIDENT_POLL`]. `None` when the caller went away (the worker is killed).
///
/// Errors: the compiler's own error (`compile-failed`, `unsupported`); `resource-exhausted`
/// naming `max-compile-seconds` when the worker passes the wall-clock or CPU-time limit, or
/// `max-compile-resident` when its resident set passes the cap; `compile-failed` saying how
/// the worker died when it crashed (a stack overflow: the program is recursive or nested too
/// deeply; an abort, possibly at the `max-compile-memory` limit); `internal` when the worker
/// could not start or answers nonsense.
#[allow(clippy::too_many_arguments)] // one compile's request, field by field
async fn run_in_worker(
    shared: &PoolShared,
    w: Idle,
    code: Vec<u8>,
    ordinal: i64,
    spmd: Option<Vec<i64>>,
    level: Option<OptimizationLevel>,
    budget: Option<LoopBudgetLimits>,
    reply: &mut oneshot::Sender<DeviceResult<Entry>>,
) -> Option<DeviceResult<Entry>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let internal = |m: String| DeviceError::new(ErrorKind::Internal, m);
    let limits = &shared.limits;
    let counters = &shared.counters;
    let Idle {
        mut child,
        mut stdin,
        ready,
        is_ready,
        stderr,
    } = w;
    let was_ready = is_ready.load(Ordering::Acquire);
    let pid = child.id();
    counters
        .last_worker_pid
        .store(u64::from(pid.unwrap_or(0)), Ordering::Relaxed);
    let program_bytes = code.len();
    let mut header = serde_json::to_vec(&Request {
        device_ordinal: ordinal,
        program_bytes,
        spmd_device_ids: spmd,
        optimization_level: level.map(|l| l.as_str().to_string()),
        loop_budget: budget,
    })
    .expect("requests serialize");
    header.push(b'\n');
    let end = {
        let feed = async move {
            // A worker that dies early closes its stdin; its exit status says why.
            let _ = stdin.write_all(&header).await;
            let _ = stdin.write_all(&code).await;
        };
        let read = async {
            let mut out = Vec::new();
            if was_ready {
                bump(&counters.ready_used);
            }
            if let Ok((mut stdout, _)) = ready.await {
                let _ = stdout.read_to_end(&mut out).await;
            }
            out
        };
        let io = async {
            let ((), out) = tokio::join!(feed, read);
            let status = child.wait().await;
            (out, status)
        };
        tokio::pin!(io);
        // `biased`: the exit is looked at first, so the resident set is never read after the
        // worker was reaped (when its id may name another process).
        tokio::select! {
            biased;
            (out, status) = &mut io => End::Exited(out, status),
            rss = watch_resident(pid, limits.max_resident_bytes, counters) => End::Resident(rss),
            () = tokio::time::sleep(limits.max_compile_time) => End::Timeout,
            () = reply.closed() => End::Cancelled,
        }
    };
    let mib = |b: u64| b >> 20;
    match end {
        End::Exited(out, Ok(status)) => {
            if status.success() {
                stderr.abort();
                return Some(parse_response(&out).unwrap_or_else(|m| {
                    Err(internal(format!(
                        "the compile worker answered nonsense: {m}"
                    )))
                }));
            }
            let stderr = stderr.await.unwrap_or_default();
            remove_dump_of(pid);
            Some(Err(worker_died(status, &stderr, limits, program_bytes)))
        }
        End::Exited(_, Err(e)) => Some(Err(internal(format!(
            "waiting for the compile worker: {e}"
        )))),
        End::Resident(rss) => {
            let _ = child.kill().await;
            remove_dump_of(pid);
            bump(&counters.resident_kills);
            crate::protection::triggered(
                "compile-resident",
                "compiler",
                format_args!(
                    "compile worker {} reached {} MiB resident (cap {} MiB) on a {program_bytes}-byte program; killed",
                    pid.unwrap_or(0),
                    mib(rss),
                    mib(limits.max_resident_bytes)
                ),
            );
            Some(Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "compiling this {program_bytes}-byte program took more than {} MiB of memory ({} MiB resident when stopped) and was stopped (limit max-compile-resident)",
                    mib(limits.max_resident_bytes),
                    mib(rss)
                ),
            )))
        }
        End::Timeout => {
            let _ = child.kill().await;
            remove_dump_of(pid);
            Some(Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "compiling this {program_bytes}-byte program took longer than {} s and was stopped (limit max-compile-seconds); large unrolled programs compile in time roughly quadratic in their op count: use loops, or split the program",
                    limits.max_compile_time.as_secs_f64()
                ),
            )))
        }
        End::Cancelled => {
            let _ = child.kill().await;
            remove_dump_of(pid);
            None
        }
    }
}

/// Resolves, with the resident set read, when process `pid` holds more than `cap` bytes;
/// never without a pid.
async fn watch_resident(pid: Option<u32>, cap: u64, counters: &Counters) -> u64 {
    let Some(pid) = pid else {
        return std::future::pending().await;
    };
    let mut tick = tokio::time::interval(RESIDENT_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        if let Some(rss) = resident_bytes(pid) {
            counters
                .peak_resident_bytes
                .fetch_max(rss, Ordering::Relaxed);
            if rss > cap {
                return rss;
            }
        }
    }
}

/// The resident set of process `pid` in bytes (`VmRSS` of `/proc/PID/status`); `None` when it
/// cannot be read (the process is gone, or this is not Linux).
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib.saturating_mul(1024))
}

/// The error for a worker that exited without answering.
fn worker_died(
    status: std::process::ExitStatus,
    stderr: &[u8],
    limits: &CompileIsolation,
    program_bytes: usize,
) -> DeviceError {
    use std::os::unix::process::ExitStatusExt;
    let stderr = String::from_utf8_lossy(stderr);
    tracing::debug!(target: "tpubox::compile", %status, %stderr, "compile worker died");
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let signal = status.signal();
    const SIGABRT: i32 = 6;
    const SIGKILL: i32 = 9;
    const SIGSEGV: i32 = 11;
    const SIGXCPU: i32 = 24;
    let mib = |b: u64| b >> 20;
    if stderr.contains("has overflowed its stack") || signal == Some(SIGSEGV) {
        return DeviceError::new(
            ErrorKind::CompileFailed,
            format!(
                "the compiler overflowed its {} MiB stack on this {program_bytes}-byte program: it is recursive (a function that calls itself) or nested too deeply (types, regions or a chain of ops); the host is unaffected",
                mib(limits.stack_bytes as u64)
            ),
        );
    }
    if signal == Some(SIGXCPU) || signal == Some(SIGKILL) {
        return DeviceError::new(
            ErrorKind::ResourceExhausted,
            format!(
                "compiling this {program_bytes}-byte program used more CPU time than allowed and was stopped (limit max-compile-seconds)"
            ),
        );
    }
    if signal == Some(SIGABRT)
        || stderr.contains("bad_alloc")
        || stderr.contains("memory allocation")
    {
        return DeviceError::new(
            ErrorKind::CompileFailed,
            format!(
                "the compiler aborted on this {program_bytes}-byte program (it may have reached the compile memory limit of {} MiB, limit max-compile-memory): {last}",
                mib(limits.max_memory_bytes)
            ),
        );
    }
    if status.code() == Some(WORKER_FAILED) {
        return DeviceError::new(
            ErrorKind::Internal,
            format!("the compile worker failed: {last}"),
        );
    }
    DeviceError::new(
        ErrorKind::CompileFailed,
        format!("the compiler failed on this {program_bytes}-byte program ({status}): {last}"),
    )
}

fn parse_response(stdout: &[u8]) -> Result<DeviceResult<Entry>, String> {
    let nl = stdout
        .iter()
        .position(|&b| b == b'\n')
        .ok_or("no header line")?;
    let response: Response =
        serde_json::from_slice(&stdout[..nl]).map_err(|e| format!("bad header: {e}"))?;
    let body = &stdout[nl + 1..];
    match response {
        Response::Compiled {
            meta,
            executable_bytes,
        } => {
            if body.len() != executable_bytes {
                return Err(format!(
                    "announced {executable_bytes} executable bytes, sent {}",
                    body.len()
                ));
            }
            Ok(Ok(Entry {
                meta,
                executable: body.to_vec(),
            }))
        }
        Response::Failed { kind, message } => {
            let kind = ErrorKind::from_name(&kind).ok_or(format!("unknown error kind {kind}"))?;
            Ok(Err(DeviceError::new(kind, message)))
        }
    }
}

/// Prefix of the temporary directories the compiler dumps a module into for the loop budget.
const DUMP_PREFIX: &str = "tpubox-hlo-";

/// Removes, once per process, the compiler dumps in the temporary directory that compiles
/// killed with their process left (a worker past its resident cap or wall-clock limit, a
/// worker or host killed with the host): each dump directory is locked while its compile
/// lives ([`crate::cache::atomic::LockedTempDir`]), so another live process's is left alone.
/// Called by a host as its worker pool starts and by every process before its first dump.
fn sweep_stale_dumps() {
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(|| {
        crate::cache::atomic::remove_stale(&std::env::temp_dir(), DUMP_PREFIX);
    });
}

/// Removes the compiler dump a worker that did not finish (killed, crashed) left: its dumps
/// are named after its process id. Call it once the worker was reaped (its lock is gone).
fn remove_dump_of(pid: Option<u32>) {
    if let Some(pid) = pid {
        tokio::task::spawn_blocking(move || {
            crate::cache::atomic::remove_stale(
                &std::env::temp_dir(),
                &format!("{DUMP_PREFIX}{pid}-"),
            )
        });
    }
}

/// Exit status of a worker that could not do its job (bad input, a plugin or client that
/// fails, a closed pipe).
const WORKER_FAILED: i32 = 2;

/// The environment variable that gives a worker its host's process id.
const PARENT_ENV: &str = "TPUBOX_COMPILE_WORKER_PARENT";

/// Makes this worker die with its host: the kernel sends it SIGKILL when the host's thread that
/// started it ends (the pool's own thread, which lives as long as the pool, or the whole host,
/// killed by SIGKILL included), so no worker outlives a killed daemon compiling an orphaned
/// program for up to `max-compile-seconds`. A host that died before this ran is seen by the
/// parent process id that no longer matches [`PARENT_ENV`].
///
/// Errors: the host is already gone; the kernel refused the death signal.
fn die_with_host() -> Result<(), String> {
    #[cfg(target_os = "linux")]
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .map_err(|e| format!("prctl(PR_SET_PDEATHSIG): {e}"))?;
    let host = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|v| v.parse::<u32>().ok());
    match host {
        Some(pid) if std::os::unix::process::parent_id() != pid => Err(format!(
            "the host (process {pid}) that started this worker is gone"
        )),
        _ => Ok(()),
    }
}

/// `tpubox compile-worker`: arranges to die with its host, reads its `Setup` from stdin, sets
/// its limits, loads the plugin and creates its client, says `ready`; then reads one `Request` and program, compiles it, writes
/// one `Response` (and the serialized executable) to stdout and exits: a worker compiles one
/// program only. Returns the process exit status: 0 when it answered (even with a compile
/// error), 2 when it could not.
pub fn worker_main() -> i32 {
    match serve_one() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("tpubox compile-worker: {e}");
            WORKER_FAILED
        }
    }
}

fn read_json_line<T: serde::de::DeserializeOwned>(what: &str) -> Result<T, String> {
    let mut line = Vec::new();
    std::io::stdin()
        .lock()
        .read_until(b'\n', &mut line)
        .map_err(|e| format!("reading the {what}: {e}"))?;
    serde_json::from_slice(&line).map_err(|e| format!("bad {what}: {e}"))
}

fn serve_one() -> Result<(), String> {
    die_with_host()?;
    let setup: Setup = read_json_line("setup")?;
    set_limits(&setup)?;
    let stack = setup.stack_bytes;
    // Everything from the plugin on runs on the large stack: the compiler recurses there.
    std::thread::Builder::new()
        .name("tpubox-compile".into())
        .stack_size(stack)
        .spawn(move || prepare_and_compile(setup))
        .map_err(|e| format!("starting the compile thread with a {stack}-byte stack: {e}"))?
        .join()
        .map_err(|_| "the compile thread panicked".to_string())?
}

fn prepare_and_compile(setup: Setup) -> Result<(), String> {
    let plugin = Plugin::load(&setup.plugin)
        .map_err(|e| format!("loading the plugin {}: {e}", setup.plugin.display()))?;
    let options: Vec<(String, NamedValue)> = setup
        .client_options
        .into_iter()
        .map(|(k, v)| (k, v.into()))
        .collect();
    let options: Vec<(&str, NamedValue)> = options
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let client = Client::new(&plugin, &options).map_err(|e| format!("creating the client: {e}"))?;
    register_custom_calls(&plugin, &client, false);
    // A first compile in a process pays for the compiler's one-time set-up (its passes and
    // code generator); a worker started ahead of need pays it here, before the tenant's
    // program arrives. A fixed program: no tenant's state is involved.
    let plugin_path = setup.plugin.display().to_string();
    if setup.warm_up {
        let _ = compile_for_worker(
            &client,
            &plugin_path,
            WARM_UP.as_bytes().to_vec(),
            0,
            None,
            None,
            None,
        );
    }
    let mut out = std::io::stdout().lock();
    out.write_all(READY_LINE)
        .and_then(|()| out.flush())
        .map_err(|e| format!("saying ready: {e}"))?;
    let req: Request = read_json_line("request")?;
    let mut code = vec![0u8; req.program_bytes];
    std::io::stdin()
        .lock()
        .read_exact(&mut code)
        .map_err(|e| format!("reading the program: {e}"))?;
    let level = match req.optimization_level.as_deref().map(str::parse) {
        None => None,
        Some(Ok(l)) => Some(l),
        Some(Err(e)) => return Err(format!("reading the request: {e}")),
    };
    let compiled = compile_for_worker(
        &client,
        &plugin_path,
        code,
        req.device_ordinal,
        req.spmd_device_ids.as_deref(),
        level,
        req.loop_budget,
    );
    let (response, body) = match compiled {
        Ok(entry) => (
            Response::Compiled {
                meta: entry.meta,
                executable_bytes: entry.executable.len(),
            },
            entry.executable,
        ),
        Err(e) => (
            Response::Failed {
                kind: e.kind.as_str().to_string(),
                message: e.message,
            },
            Vec::new(),
        ),
    };
    let mut header = serde_json::to_vec(&response).expect("responses serialize");
    header.push(b'\n');
    out.write_all(&header)
        .and_then(|()| out.write_all(&body))
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing the answer: {e}"))
}

/// Limits the worker itself: address space, CPU time, and no core file when it crashes.
fn set_limits(setup: &Setup) -> Result<(), String> {
    use rustix::process::{Resource, Rlimit, setrlimit};
    let set = |r: Resource, v: u64| {
        setrlimit(
            r,
            Rlimit {
                current: Some(v),
                maximum: Some(v),
            },
        )
        .map_err(|e| format!("setrlimit({r:?}, {v}): {e}"))
    };
    set(Resource::Core, 0)?;
    set(Resource::Cpu, setup.max_cpu_seconds)?;
    set(Resource::As, setup.max_memory_bytes)
}

/// Registers the host's custom-call handlers with `plugin`: on a CPU plugin, the LAPACK
/// handlers of JAX's linear algebra ([`pjrt_lapack::register`]) and tpubox's own
/// ([`pjrt_kernels::register`]: segment attention); once per process. Every
/// process that compiles or loads executables calls it (the daemon and each compile worker).
///
/// Never fails: without a LAPACK library, or on a plugin that refuses handlers, it logs a
/// warning and programs with those custom calls fail to compile ("No FFI handler
/// registered"), as they did before.
pub(crate) fn register_custom_calls(plugin: &Plugin, client: &Client, test_only: bool) {
    if client.platform_name().ok().as_deref() != Some("cpu") {
        return;
    }
    if test_only && let Err(e) = pjrt_kernels::register_test_fail(plugin) {
        tracing::warn!("the test-only custom call is unavailable: {e}");
    }
    match pjrt_lapack::register(plugin) {
        Ok(r) => tracing::debug!(
            handlers = r.targets.len(),
            library = %r.library,
            "registered the LAPACK custom-call handlers"
        ),
        Err(e) => tracing::warn!("linear algebra custom calls are unavailable: {e}"),
    }
    if let Err(e) = pjrt_kernels::register(plugin) {
        tracing::warn!("tpubox's own custom calls (segment attention) are unavailable: {e}");
    }
}

fn compile_for_worker(
    client: &Client,
    plugin_path: &str,
    code: Vec<u8>,
    device_ordinal: i64,
    spmd: Option<&[i64]>,
    level: Option<OptimizationLevel>,
    budget: Option<LoopBudgetLimits>,
) -> DeviceResult<Entry> {
    let compile_options = match spmd {
        Some(ids) => CompileOptions::spmd(ids)
            .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::InvalidArgument))?,
        None => CompileOptions::new().device_ordinal(device_ordinal),
    }
    .optimization_level(level);
    let c = compile_program(client, plugin_path, code, &compile_options, budget)?;
    let executable = c
        .exe
        .serialize()
        .map_err(|e| DeviceError::from_pjrt(e, ErrorKind::Unsupported))?;
    Ok(Entry {
        meta: EntryMeta {
            inputs: spec_list(&c.inputs),
            outputs: spec_list(&c.outputs),
            fingerprint: c.fingerprint,
            compile_ms: c.compile_ms,
        },
        executable,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_dynamic_dimension_is_named() {
        let msg = "during context [hlo verifier]: Unbounded dynamism is disabled for instruction: %Arg_0.1 = f32[?,4]{1,0} parameter(0)\nFailed after pipeline-start";
        let t = super::tidy_compile_message(msg);
        assert!(
            t.starts_with("parameter 0 of `main` has a dimension of unknown size (f32[?,4])"),
            "{t}"
        );
        assert!(t.contains("compiler: during context"), "{t}");
        assert_eq!(super::explain_dynamic_shape("some other error"), None);
        let jax = "loc: error: 'stablehlo.dynamic_broadcast_in_dim' op can't be translated to XLA HLO\n %0 = ... -> tensor<?x4xf32>";
        let t = super::tidy_compile_message(jax);
        assert!(
            t.starts_with("the program has dimensions of unknown size (tensor<?x4xf32>"),
            "{t}"
        );
    }
}
