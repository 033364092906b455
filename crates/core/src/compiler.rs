//! Running the XLA compiler on a tenant's program: in this process, or contained in a compile
//! worker process.
//!
//! XLA's MLIR parser and passes recurse over a program's structure, and some inputs make them
//! abort: a function that calls itself, types or regions nested thousands deep, or a long plain
//! chain of ops overflow the stack and take the whole process down; other programs make the
//! compiler run for minutes or use gigabytes. None of that can be validated away before PJRT.
//! A compile worker (`tpubox compile-worker`, the same binary) contains it: it loads the plugin
//! and creates its own client, sets its own limits (address space, CPU time, no core file),
//! compiles on a thread with a large stack, and returns the serialized executable, which the
//! host loads exactly like a tier-2 cache entry. A worker that crashes, runs out of memory or
//! passes the wall-clock limit is killed and the tenant gets one error naming what happened;
//! the host goes on. Cache hits never start a worker.
//!
//! Workers need a plugin whose client can be created beside the host's: true of the CPU
//! plugins. A TPU can be opened by one process only, so on other platforms the host compiles
//! in process (and logs that it does) until workers compile against a topology description.
//!
//! Wire format (worker stdin, then stdout): one JSON line (a `Request`, a `Response`) followed
//! by the bytes it announces (the program; the serialized executable).

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use pjrt::{Client, CompileOptions, LoadedExecutable, NamedValue, Plugin, Program, ProgramFormat};
use serde::{Deserialize, Serialize};

use crate::cache::{Entry, EntryMeta};
use crate::error::{DeviceError, DeviceResult, ErrorKind};
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
}

impl Default for CompileIsolation {
    fn default() -> Self {
        CompileIsolation {
            worker: std::env::var_os("TPUBOX_COMPILE_WORKER").map(PathBuf::from),
            max_compile_time: Duration::from_secs(120),
            max_memory_bytes: 16 << 30,
            stack_bytes: 1 << 30,
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
/// fingerprint.
///
/// Errors: `compile-failed` with the compiler's message; `unsupported` when the plugin cannot
/// describe the parameters or results.
pub(crate) fn compile_program(
    client: &Client,
    plugin_path: &str,
    code: Vec<u8>,
    options: &CompileOptions,
) -> DeviceResult<CompiledProgram> {
    let start = Instant::now();
    let program = Program {
        format: ProgramFormat::Mlir,
        code,
    };
    let exe = client.compile(&program, options).map_err(|e| {
        let mut err = DeviceError::from_pjrt(e, ErrorKind::CompileFailed);
        err.message = tidy_compile_message(&err.message);
        err
    })?;
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

/// What the host asks of a worker (the first line of its stdin; the program follows).
#[derive(Debug, Serialize, Deserialize)]
struct Request {
    plugin: PathBuf,
    client_options: Vec<(String, OptionValue)>,
    device_ordinal: i64,
    program_bytes: usize,
    max_memory_bytes: u64,
    max_cpu_seconds: u64,
    stack_bytes: usize,
}

/// What a worker answers (the first line of its stdout; the executable follows on success).
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

/// Compiles `code` for device `ordinal` in a worker process, within `limits`.
///
/// Errors: the compiler's own error (`compile-failed`, `unsupported`); `resource-exhausted`
/// naming `max-compile-seconds` when the worker passes the wall-clock or CPU-time limit;
/// `compile-failed` saying how the worker died when it crashed (a stack overflow: the program
/// is recursive or nested too deeply; an abort, possibly at the `max-compile-memory` limit);
/// `internal` when the worker cannot be started or answers nonsense.
pub(crate) async fn compile_in_worker(
    limits: &CompileIsolation,
    worker: &std::path::Path,
    target: &WorkerTarget,
    code: Vec<u8>,
    ordinal: i64,
) -> DeviceResult<Entry> {
    use tokio::io::AsyncWriteExt;
    let internal = |m: String| DeviceError::new(ErrorKind::Internal, m);
    let program_bytes = code.len();
    let request = Request {
        plugin: target.plugin.clone(),
        client_options: target
            .client_options
            .iter()
            .map(|(k, v)| (k.clone(), v.into()))
            .collect(),
        device_ordinal: ordinal,
        program_bytes,
        max_memory_bytes: limits.max_memory_bytes,
        max_cpu_seconds: limits.max_compile_time.as_secs().saturating_mul(4).max(1),
        stack_bytes: limits.stack_bytes,
    };
    let mut header = serde_json::to_vec(&request).expect("requests serialize");
    header.push(b'\n');
    let mut child = tokio::process::Command::new(worker)
        .arg("compile-worker")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            internal(format!(
                "starting the compile worker {}: {e}",
                worker.display()
            ))
        })?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let feed = async move {
        // A worker that dies early closes its stdin; its exit status says why.
        let _ = stdin.write_all(&header).await;
        let _ = stdin.write_all(&code).await;
    };
    let run = async {
        let ((), out) = tokio::join!(feed, child.wait_with_output());
        out
    };
    let out = match tokio::time::timeout(limits.max_compile_time, run).await {
        Ok(out) => out.map_err(|e| internal(format!("waiting for the compile worker: {e}")))?,
        // Dropping `run` drops the child, which kills it (`kill_on_drop`).
        Err(_) => {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "compiling this {program_bytes}-byte program took longer than {} s and was stopped (limit max-compile-seconds); large unrolled programs compile in time roughly quadratic in their op count: use loops, or split the program",
                    limits.max_compile_time.as_secs_f64()
                ),
            ));
        }
    };
    if !out.status.success() {
        return Err(worker_died(&out, limits, program_bytes));
    }
    parse_response(&out.stdout)
        .map_err(|m| internal(format!("the compile worker answered nonsense: {m}")))?
}

/// The error for a worker that exited without answering.
fn worker_died(
    out: &std::process::Output,
    limits: &CompileIsolation,
    program_bytes: usize,
) -> DeviceError {
    use std::os::unix::process::ExitStatusExt;
    let stderr = String::from_utf8_lossy(&out.stderr);
    tracing::debug!(target: "tpubox::compile", status = %out.status, %stderr, "compile worker died");
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let signal = out.status.signal();
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
    DeviceError::new(
        ErrorKind::CompileFailed,
        format!(
            "the compiler failed on this {program_bytes}-byte program ({}): {last}",
            out.status
        ),
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

/// `tpubox compile-worker`: reads one `Request` and program from stdin, compiles it within the
/// request's limits, writes one `Response` (and the serialized executable) to stdout. Returns
/// the process exit status: 0 when it answered (even with a compile error), 2 when it could not.
pub fn worker_main() -> i32 {
    match serve_one() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("tpubox compile-worker: {e}");
            2
        }
    }
}

fn serve_one() -> Result<(), String> {
    let mut input = std::io::stdin().lock();
    let mut line = Vec::new();
    input
        .read_until(b'\n', &mut line)
        .map_err(|e| format!("reading the request: {e}"))?;
    let req: Request = serde_json::from_slice(&line).map_err(|e| format!("bad request: {e}"))?;
    let mut code = vec![0u8; req.program_bytes];
    input
        .read_exact(&mut code)
        .map_err(|e| format!("reading the program: {e}"))?;
    set_limits(&req)?;
    let stack = req.stack_bytes;
    let compiled = std::thread::Builder::new()
        .name("tpubox-compile".into())
        .stack_size(stack)
        .spawn(move || compile_for_worker(req, code))
        .map_err(|e| format!("starting the compile thread with a {stack}-byte stack: {e}"))?
        .join()
        .map_err(|_| "the compile thread panicked".to_string())?;
    let mut out = std::io::stdout().lock();
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
fn set_limits(req: &Request) -> Result<(), String> {
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
    set(Resource::Cpu, req.max_cpu_seconds)?;
    set(Resource::As, req.max_memory_bytes)
}

/// Registers the host's custom-call handlers with `plugin`: on a CPU plugin, the LAPACK
/// handlers of JAX's linear algebra ([`pjrt_lapack::register`]) and tpubox's own
/// ([`pjrt_kernels::register`]: segment attention); once per process. Every
/// process that compiles or loads executables calls it (the daemon and each compile worker).
///
/// Never fails: without a LAPACK library, or on a plugin that refuses handlers, it logs a
/// warning and programs with those custom calls fail to compile ("No FFI handler
/// registered"), as they did before.
pub(crate) fn register_custom_calls(plugin: &Plugin, client: &Client) {
    if client.platform_name().ok().as_deref() != Some("cpu") {
        return;
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

fn compile_for_worker(req: Request, code: Vec<u8>) -> DeviceResult<Entry> {
    let internal = |e: pjrt::Error| DeviceError::from_pjrt(e, ErrorKind::Internal);
    let plugin = Plugin::load(&req.plugin).map_err(internal)?;
    let options: Vec<(String, NamedValue)> = req
        .client_options
        .into_iter()
        .map(|(k, v)| (k, v.into()))
        .collect();
    let options: Vec<(&str, NamedValue)> = options
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let client = Client::new(&plugin, &options).map_err(internal)?;
    register_custom_calls(&plugin, &client);
    let compile_options = CompileOptions::new().device_ordinal(req.device_ordinal);
    let c = compile_program(
        &client,
        &req.plugin.display().to_string(),
        code,
        &compile_options,
    )?;
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
