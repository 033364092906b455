//! The Wasm side of the host: engine settings, the on-disk component cache, per-guest stores
//! with memory caps and deadlines, and running WASI command components.
//!
//! Settings: epoch interruption always on (a ticker thread advances the epoch every
//! [`EPOCH_TICK`]; measured on wasmtime 48 it costs guests a few percent, where fuel metering
//! costs far more), the pooling allocator, a `StoreLimits` memory cap, and wasmtime's own
//! compilation cache, whose key covers the component's bytes, the wasmtime version and the
//! engine's compiler settings. Backtrace details are on: when a guest carries DWARF (line
//! tables), a trap's backtrace names source files and lines ([`GuestStopped`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{
    Cache, CacheConfig, Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store,
    StoreLimits, StoreLimitsBuilder, UpdateDeadline,
};
use wasmtime_wasi::p2::bindings::Command;
use wasmtime_wasi::p2::pipe::{MemoryInputPipe, MemoryOutputPipe};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::wit::DeviceState;
use tpubox_core::device::DeviceService;
use tpubox_core::session::Session;
use tpubox_core::tenant::{Tenant, TenantLimits, TenantUsage};
use tpubox_core::weights::WeightRegistry;

/// Interval at which the engine's epoch advances; deadlines are checked at this granularity.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Settings of the Wasm sandbox shared by all guests of one [`Sandbox`].
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Largest linear memory one guest store may grow to, in bytes (default 4 GiB).
    pub max_guest_memory: usize,
    /// Largest number of live resources (tensors, executables, WASI handles) in one guest's
    /// table (default 100 000).
    pub max_resources: usize,
    /// Directory of wasmtime's compilation cache; `None` disables it.
    pub cache_dir: Option<PathBuf>,
    /// How many guest instances may exist at once (pooling allocator slots; default 64).
    pub max_instances: u32,
    /// Turn on wasmtime fuel metering in the engine, so [`TenantLimits::fuel`] can be enforced
    /// (default off: metering costs every guest some speed).
    pub consume_fuel: bool,
    /// Limits of the tenant created for a run that names none ([`RunOptions::tenant`]).
    pub tenant_limits: TenantLimits,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            max_guest_memory: 4 << 30,
            max_resources: 100_000,
            cache_dir: tpubox_core::plugin::cache_root().map(|d| d.join("components")),
            max_instances: 64,
            consume_fuel: false,
            tenant_limits: TenantLimits::default(),
        }
    }
}

/// How one guest run is set up: its arguments and what it may reach beyond the device.
///
/// By default a guest has no filesystem, no environment variables, no network, stdin closed and
/// stdout/stderr inherited from the host.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// `argv[1..]` as the guest sees it (`argv[0]` is the component's file name).
    pub args: Vec<String>,
    /// Environment variables granted to the guest.
    pub env: Vec<(String, String)>,
    /// Host directories the guest may read, as (host path, guest path). Always read-only.
    pub dirs: Vec<(PathBuf, String)>,
    /// Bytes the guest reads on stdin; `None` inherits the host's stdin.
    pub stdin: Option<Vec<u8>>,
    /// Capture stdout and stderr instead of inheriting them.
    pub capture_output: bool,
    /// Wall-clock limit on the guest's own execution; `None` takes the tenant's
    /// [`TenantLimits::max_call_time`]. Checked every [`EPOCH_TICK`]; time spent waiting on the
    /// device counts too.
    pub deadline: Option<Duration>,
    /// The tenant to charge; `None` makes a new one named after the guest with
    /// [`SandboxConfig::tenant_limits`]. Pass one `Arc` to several runs to share an identity.
    pub tenant: Option<Arc<Tenant>>,
    /// Give the guest the host's wall and monotonic clocks. Without this (the default) both
    /// clocks read zero forever: a guest learns nothing about time it was not granted.
    pub allow_clock: bool,
    /// Send stdout and stderr, as the guest writes them, to these channels (takes precedence
    /// over [`capture_output`](Self::capture_output)).
    pub output_sink: Option<OutputSink>,
    /// The devices the guest may use, its default first (`None`: every device, device 0 by
    /// default). A call naming another device is `permission-denied`; `list-devices` still
    /// lists every device of the host ([`tpubox_core::placement`]).
    pub devices: Option<Vec<u32>>,
    /// Where `wasi:nn` finds ONNX converted and graphs by name; without one, a guest loads
    /// StableHLO graphs only ([`crate::nn`]).
    pub nn: Option<crate::nn::NnLoaderRef>,
}

/// Where a guest's output goes as it is written: each write is one message on the channel.
/// The guest's writes fail (a broken pipe, as a closed terminal) once `max_bytes` were sent
/// on a stream, or once the receiver is gone.
#[derive(Debug, Clone)]
pub struct OutputSink {
    /// Receives stdout.
    pub stdout: tokio::sync::mpsc::UnboundedSender<Vec<u8>>,
    /// Receives stderr.
    pub stderr: tokio::sync::mpsc::UnboundedSender<Vec<u8>>,
    /// Most bytes sent on each stream.
    pub max_bytes: usize,
}

/// An `AsyncWrite` over one of an [`OutputSink`]'s channels.
struct ChannelWriter {
    tx: tokio::sync::mpsc::UnboundedSender<Vec<u8>>,
    left: usize,
}

impl tokio::io::AsyncWrite for ChannelWriter {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if buf.len() > self.left {
            return std::task::Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the output limit of this guest run was reached",
            )));
        }
        if self.tx.send(buf.to_vec()).is_err() {
            return std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
        }
        self.left -= buf.len();
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// How a guest run ended.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// `true` when `wasi:cli/run` returned `ok` (for Rust guests: `main` returned normally).
    pub success: bool,
    /// The guest's exit status: 0 on success, the code it passed to `exit`, or 1 when `run`
    /// returned `err` without calling `exit`.
    pub exit_code: i32,
    /// Captured stdout (empty unless [`RunOptions::capture_output`]).
    pub stdout: Vec<u8>,
    /// Captured stderr (empty unless [`RunOptions::capture_output`]).
    pub stderr: Vec<u8>,
    /// Wall time from instantiation to return.
    pub elapsed: Duration,
    /// The tenant's usage after the run (its handles from this run already returned).
    pub usage: TenantUsage,
}

/// Per-guest store data: WASI context, memory limits, and the tpubox state (resource table,
/// shared with WASI, and the guest's session).
pub struct GuestState {
    wasi: WasiCtx,
    limits: StoreLimits,
    device: DeviceState,
    nn: crate::nn::NnState,
    /// When the guest's current call must stop (checked every [`EPOCH_TICK`]).
    deadline: Option<Instant>,
}

impl GuestState {
    /// Sets when the guest's wasm code is interrupted; `None` for never. A long-lived
    /// instance sets it before each call.
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// The session the guest's device calls go through.
    pub fn session(&self) -> &Session {
        self.device.session()
    }
}

/// A guest's store, built by [`Sandbox::store`], with what the caller needs beside it.
pub struct GuestStore {
    /// The store; instantiate components in it with [`Sandbox::linker`].
    pub store: Store<GuestState>,
    /// The tenant it charges.
    pub tenant: Arc<Tenant>,
    /// The guest's linear-memory cap in bytes (the tenant's and the sandbox's, whichever is
    /// lower).
    pub max_memory: usize,
    out: MemoryOutputPipe,
    err: MemoryOutputPipe,
}

impl WasiView for GuestState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: self.device.table(),
        }
    }
}

/// A clock that always reads zero: what a guest sees without [`RunOptions::allow_clock`].
struct FrozenClock;

impl wasmtime_wasi::HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// A wasmtime engine configured for untrusted guests, with a linker that provides WASI p2 and
/// the `tpubox:device` interfaces.
pub struct Sandbox {
    engine: Engine,
    linker: Linker<GuestState>,
    config: SandboxConfig,
    cache: Option<Cache>,
    _ticker: EpochTicker,
}

struct EpochTicker {
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Sandbox {
    /// Builds the engine and linker.
    ///
    /// Errors: an engine setting the platform does not support, or an unusable cache directory.
    pub fn new(config: SandboxConfig) -> Result<Self> {
        let mut cfg = Config::new();
        cfg.epoch_interruption(true);
        cfg.consume_fuel(config.consume_fuel);
        cfg.wasm_component_model(true);
        // Source lines in trap backtraces, from the guest's DWARF when it has any.
        cfg.wasm_backtrace_details(wasmtime::WasmBacktraceDetails::Enable);
        let mut pool = PoolingAllocationConfig::default();
        let instances = config.max_instances.max(1);
        pool.total_component_instances(instances);
        // Interpreted guests (Python, JavaScript) carry several core instances and memories.
        pool.total_core_instances(instances * 16);
        pool.total_memories(instances * 4);
        pool.total_tables(instances * 8);
        pool.max_memories_per_component(16);
        pool.max_memory_size(config.max_guest_memory);
        cfg.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let mut cache = None;
        if let Some(dir) = &config.cache_dir {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the component cache dir {}", dir.display()))?;
            let mut cc = CacheConfig::new();
            cc.with_directory(dir);
            let c = Cache::new(cc)?;
            cfg.cache(Some(c.clone()));
            cache = Some(c);
        }
        let engine = Engine::new(&cfg)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        crate::wit::add_to_linker(&mut linker, |s: &mut GuestState| &mut s.device)?;
        crate::nn::add_to_linker(&mut linker, |s: &mut GuestState| {
            let (table, session) = s.device.parts();
            crate::nn::NnView {
                table,
                session,
                nn: &mut s.nn,
            }
        })?;

        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let weak = engine.weak();
        let flag = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("tpubox-epoch".into())
            .spawn(move || {
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    match weak.upgrade() {
                        Some(engine) => engine.increment_epoch(),
                        None => break,
                    }
                }
            })?;
        Ok(Sandbox {
            engine,
            linker,
            config,
            cache,
            _ticker: EpochTicker { stop },
        })
    }

    /// The settings this sandbox was built with.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// The wasmtime engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Compiles a component from a `.wasm` file, or loads it from the compilation cache.
    ///
    /// Errors: the file cannot be read, or is not a valid component.
    pub fn load_component(&self, path: &Path) -> Result<Component> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        self.load_component_bytes(&bytes)
            .with_context(|| format!("loading component {}", path.display()))
    }

    /// Compiles a component from bytes, or loads it from the compilation cache.
    ///
    /// Errors: the bytes are not a valid component.
    pub fn load_component_bytes(&self, bytes: &[u8]) -> Result<Component> {
        if !wasmparser_is_component(bytes) {
            bail!(
                "not a WebAssembly component (a core module or other file); build guests for wasm32-wasip2"
            );
        }
        Ok(Component::new(&self.engine, bytes)?)
    }

    /// `(hits, misses)` of the compilation cache since this sandbox was built.
    pub fn cache_stats(&self) -> (usize, usize) {
        self.cache
            .as_ref()
            .map(|c| (c.cache_hits(), c.cache_misses()))
            .unwrap_or((0, 0))
    }

    /// The linker that provides WASI p2 and the `tpubox:device` interfaces to components
    /// instantiated in stores from [`Sandbox::store`].
    pub fn linker(&self) -> &Linker<GuestState> {
        &self.linker
    }

    /// A store for one guest named `name`, set up as `opts` says (arguments, environment,
    /// directories, stdin, output capture, clocks, tenant), with the tenant's memory cap and
    /// fuel, and epoch interruption at the deadline set by [`GuestState::set_deadline`] (none
    /// yet: [`Sandbox::run`] sets it from `opts`, a long-lived instance before each call).
    ///
    /// Errors: a fuel limit on a sandbox without fuel metering, or a directory that cannot be
    /// opened.
    pub fn store(
        &self,
        device: &Arc<DeviceService>,
        weights: &Arc<WeightRegistry>,
        name: &str,
        opts: &RunOptions,
    ) -> Result<GuestStore> {
        let tenant = opts
            .tenant
            .clone()
            .unwrap_or_else(|| Tenant::new(name, self.config.tenant_limits.clone()));
        let fuel = tenant.limits().fuel;
        if fuel.is_some() && !self.config.consume_fuel {
            bail!(
                "tenant `{}` has a fuel limit, but the sandbox was built without fuel metering (SandboxConfig::consume_fuel)",
                tenant.name()
            );
        }
        let max_memory = tenant
            .limits()
            .max_guest_memory
            .min(self.config.max_guest_memory);
        let mut wasi = WasiCtxBuilder::new();
        if !opts.allow_clock {
            wasi.wall_clock(FrozenClock).monotonic_clock(FrozenClock);
        }
        let mut argv = vec![name.to_string()];
        argv.extend(opts.args.iter().cloned());
        wasi.args(&argv);
        for (k, v) in &opts.env {
            wasi.env(k, v);
        }
        for (host, guest) in &opts.dirs {
            wasi.preopened_dir(host, guest, FsPerms::ReadOnly)
                .map_err(anyhow::Error::from)
                .with_context(|| format!("granting directory {}", host.display()))?;
        }
        match &opts.stdin {
            Some(bytes) => {
                wasi.stdin(MemoryInputPipe::new(bytes.clone()));
            }
            None => {
                wasi.inherit_stdin();
            }
        }
        let (out, err) = (
            MemoryOutputPipe::new(64 << 20),
            MemoryOutputPipe::new(64 << 20),
        );
        if let Some(sink) = &opts.output_sink {
            let stream = |tx: &tokio::sync::mpsc::UnboundedSender<Vec<u8>>| {
                wasmtime_wasi::cli::AsyncStdoutStream::new(
                    64 << 10,
                    ChannelWriter {
                        tx: tx.clone(),
                        left: sink.max_bytes,
                    },
                )
            };
            wasi.stdout(stream(&sink.stdout))
                .stderr(stream(&sink.stderr));
        } else if opts.capture_output {
            wasi.stdout(out.clone()).stderr(err.clone());
        } else {
            wasi.inherit_stdout().inherit_stderr();
        }
        let limits = StoreLimitsBuilder::new()
            .memory_size(max_memory)
            .trap_on_grow_failure(false)
            .build();
        let mut table = ResourceTable::new();
        table.set_max_capacity(self.config.max_resources);
        let mut session =
            Session::new(Arc::clone(device), Arc::clone(weights), Arc::clone(&tenant))
                .with_max_read_bytes(max_memory as u64);
        if let Some(d) = &opts.devices {
            session = session.with_placement(tpubox_core::placement::Placement::fixed(d.clone()));
        }
        let state = GuestState {
            wasi: wasi.build(),
            limits,
            device: DeviceState::with_table(table, session),
            nn: crate::nn::NnState::new(opts.nn.as_ref().map(|l| Arc::clone(&l.0))),
            deadline: None,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        match fuel {
            Some(f) => {
                store.set_fuel(f)?;
                store.fuel_async_yield_interval(Some(100_000))?;
            }
            // A metering engine starts every store at zero fuel: no limit means all of it.
            None if self.config.consume_fuel => store.set_fuel(u64::MAX)?,
            None => {}
        }
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(|ctx| match ctx.data().deadline {
            Some(d) if Instant::now() >= d => Ok(UpdateDeadline::Interrupt),
            _ => Ok(UpdateDeadline::Yield(1)),
        });
        Ok(GuestStore {
            store,
            tenant,
            max_memory,
            out,
            err,
        })
    }

    /// Instantiates `component` as a WASI command and runs its `wasi:cli/run` export.
    ///
    /// Errors: instantiation failures (a missing import: the guest needs more than WASI p2 and
    /// `tpubox:device`), a trap (including the deadline and the memory cap), or a preopened dir
    /// that cannot be opened. A guest that returns an error from `run` is not an `Err`: see
    /// [`RunOutcome::success`].
    pub async fn run(
        &self,
        device: &Arc<DeviceService>,
        weights: &Arc<WeightRegistry>,
        component: &Component,
        name: &str,
        opts: &RunOptions,
    ) -> Result<RunOutcome> {
        let GuestStore {
            mut store,
            tenant,
            max_memory,
            out,
            err,
        } = self.store(device, weights, name, opts)?;
        let fuel = tenant.limits().fuel;
        let start = Instant::now();
        let limit = opts.deadline.or(tenant.limits().max_call_time);
        let deadline = limit.map(|d| start + d);
        store.data_mut().set_deadline(deadline);
        if deadline.is_some() {
            // The first epoch check of the run calls the deadline callback at once rather than a
            // tick later, so a deadline shorter than a tick still stops the guest.
            store.set_epoch_deadline(0);
        }
        // Instantiation runs guest code too (start functions, constructors), so the deadline can
        // interrupt it: its errors take the same path as the run's below.
        let run = async {
            let command = Command::instantiate_async(&mut store, component, &self.linker).await?;
            command.wasi_cli_run().call_run(&mut store).await
        };
        // Epoch interruption only stops wasm code; a guest blocked in a host call (a sleep, a
        // long execution) is stopped here, by dropping its call at the deadline.
        let result = match deadline {
            Some(d) => tokio::time::timeout_at(d.into(), run)
                .await
                .unwrap_or_else(|_| Err(wasmtime::Error::msg("deadline reached in a host call"))),
            None => run.await,
        };
        // Dropping the store drops the guest's handles, returning their charges to the tenant
        // however the run ended.
        drop(store);
        let elapsed = start.elapsed();
        let exit_code = match result {
            Ok(r) => i32::from(r.is_err()),
            // `exit(n)` from the guest arrives as an `I32Exit` error.
            Err(e) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
                Some(code) => code.0,
                None => {
                    // One line for people, with the guest's backtrace beside it.
                    tracing::debug!("guest {name} failed: {e:?}");
                    let trap = e.downcast_ref::<wasmtime::Trap>().copied();
                    let message = match (deadline, trap) {
                        (Some(d), _) if Instant::now() >= d => format!(
                            "guest exceeded its deadline of {:?} and was stopped (the limit is `tpubox run --timeout`, TenantLimits::max_call_time)",
                            limit.unwrap_or_default()
                        ),
                        (_, Some(wasmtime::Trap::OutOfFuel)) => format!(
                            "guest used up its fuel ({} units) and was stopped",
                            fuel.unwrap_or_default()
                        ),
                        (_, Some(wasmtime::Trap::UnreachableCodeReached)) => format!(
                            "guest aborted (a panic, or an allocation over its {} MiB memory limit; its stderr says which)",
                            max_memory >> 20
                        ),
                        (_, Some(t)) => format!("guest trapped: {t}"),
                        _ => match stale_handle(&e) {
                            Some(index) => format!(
                                "guest used a {} handle it had already dropped, or never had (unknown handle index {index})",
                                e.downcast_ref::<wasmtime::WasmBacktrace>()
                                    .and_then(stale_resource)
                                    .unwrap_or("resource (tensor, executable or weight set)")
                            ),
                            None => return Err(e.into()),
                        },
                    };
                    let backtrace = e
                        .downcast_ref::<wasmtime::WasmBacktrace>()
                        .map(render_backtrace)
                        .filter(|b| !b.trim().is_empty());
                    return Err(GuestStopped { message, backtrace }.into());
                }
            },
        };
        Ok(RunOutcome {
            success: exit_code == 0,
            exit_code,
            stdout: out.contents().to_vec(),
            stderr: err.contents().to_vec(),
            elapsed,
            usage: tenant.usage(),
        })
    }
}

/// Why a guest run was stopped before `wasi:cli/run` returned: a trap, its deadline, its fuel,
/// or a handle it had dropped. [`Sandbox::run`] returns it inside its `anyhow::Error`
/// (`err.downcast_ref::<GuestStopped>()`).
#[derive(Debug)]
pub struct GuestStopped {
    /// One line for people, e.g. `guest trapped: wasm trap: out of bounds memory access`.
    pub message: String,
    /// The guest's wasm backtrace, innermost frame first, as wasmtime renders its frames
    /// (function names, and source files and lines where the guest carries DWARF), at most
    /// [`BACKTRACE_LINES`] lines, when one was taken.
    pub backtrace: Option<String>,
}

impl std::fmt::Display for GuestStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GuestStopped {}

/// The most lines of a backtrace [`GuestStopped`] keeps (an interpreter's stack is deep).
pub const BACKTRACE_LINES: usize = 60;

/// wasmtime's rendering of `bt` without its heading line, cut to [`BACKTRACE_LINES`].
fn render_backtrace(bt: &wasmtime::WasmBacktrace) -> String {
    let text = bt.to_string();
    let lines: Vec<&str> = text.lines().skip(1).collect();
    let mut out = lines[..lines.len().min(BACKTRACE_LINES)].join("\n");
    if lines.len() > BACKTRACE_LINES {
        out += &format!("\n  ... ({} more lines)", lines.len() - BACKTRACE_LINES);
    }
    out
}

/// The index in wasmtime's `unknown handle index N`: the guest lowered a handle that is not in
/// its table (dropped, or never created).
fn stale_handle(e: &wasmtime::Error) -> Option<u32> {
    e.chain().find_map(|c| {
        c.to_string()
            .strip_prefix("unknown handle index ")?
            .parse()
            .ok()
    })
}

/// The kind of resource behind a stale handle, when the innermost frames name the import
/// that was called: C and the language runtimes call imports through shims named after them
/// (`indirect-tpubox:device/types@0.1.2-[method]tensor.read`); `execute` takes both kinds.
fn stale_resource(bt: &wasmtime::WasmBacktrace) -> Option<&'static str> {
    bt.frames().iter().take(2).find_map(|f| {
        let name = f.func_name()?;
        [
            ("]tensor.", "tensor"),
            ("]executable.", "executable"),
            ("]weight-set.", "weight set"),
        ]
        .into_iter()
        .find_map(|(pat, kind)| name.contains(pat).then_some(kind))
    })
}

/// Whether `bytes` start with the component-model preamble (`\0asm`, layer 1).
fn wasmparser_is_component(bytes: &[u8]) -> bool {
    bytes.len() >= 8 && &bytes[0..4] == b"\0asm" && bytes[6..8] == [1, 0]
}
