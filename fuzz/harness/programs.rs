//! The `programs` harness: structure-aware StableHLO programs compiled and run by an untrusted
//! tenant of one long-lived host.
//!
//! Shared by the cargo-fuzz target (`fuzz/fuzz_targets/programs.rs`) and the host tests that
//! replay `fuzz/regressions/programs/` and sweep fixed seeds (`tests/all/fuzz_regressions.rs`),
//! through `#[path]`. The generator is `program_gen.rs`.
//!
//! Each input becomes one module ([`program_gen::generate`]), which a fresh untrusted tenant
//! (default program policy, `max_loop_trips` 4096, 16 MiB of device bytes) compiles through a
//! [`Session`]; when it compiles, the tenant creates arguments of `@main`'s parameter types
//! from the input's remaining bytes and runs it twice.
//!
//! Programs compile in this process (as the host does without a worker) unless they contain a
//! function that calls itself or nesting deeper than 64: those go to a second device service
//! that compiles in `tpubox compile-worker` processes, and are generated only when
//! `TPUBOX_COMPILE_WORKER` names the `tpubox` binary (`dev.sh fuzz` sets it).
//!
//! Invariants checked:
//! - nothing panics, aborts or hangs (libFuzzer's `-timeout` catches an execution that never
//!   ends, which the policy must have refused);
//! - a refused compile carries `compile-failed`, `invalid-argument`, `resource-exhausted` or
//!   `permission-denied`; a program the generator calls clean ([`Facts::clean`]) compiles and
//!   runs;
//! - a compiled program that contained host transfers was not admitted for the untrusted
//!   tenant; a recursive one did not compile;
//! - results have exactly the types the generator derived for `@main`;
//! - two runs on the same arguments return the same bytes;
//! - the tenant never holds more than its limits and holds nothing afterwards.

use std::sync::{Arc, OnceLock};

use arbitrary::Unstructured;
use tpubox_core::DeviceConfig;
use tpubox_core::cache::CacheConfig;
use tpubox_core::compiler::CompileIsolation;
use tpubox_core::device::DeviceService;
use tpubox_core::session::ProgramFormat;
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{ErrorKind, Session, Tenant, TenantLimits};

#[path = "program_gen.rs"]
pub mod program_gen;

use program_gen::{Facts, GenOptions, Program, Ty};

/// The tenant's device-byte limit.
const DEVICE_BYTES: u64 = 16 << 20;
/// The tenant's `max_loop_trips`.
const LOOP_TRIPS: u64 = 4096;

struct Shared {
    rt: tokio::runtime::Runtime,
    device: Arc<DeviceService>,
    /// Compiles in worker processes; `None` without `TPUBOX_COMPILE_WORKER`.
    isolated: Option<Arc<DeviceService>>,
    weights: Arc<WeightRegistry>,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let worker = std::env::var_os("TPUBOX_COMPILE_WORKER").map(std::path::PathBuf::from);
        let config = |worker| DeviceConfig {
            cache: CacheConfig {
                disk_dir: None,
                remote_url: None,
                ..CacheConfig::default()
            },
            compile_isolation: CompileIsolation {
                worker,
                max_compile_time: std::time::Duration::from_secs(20),
                // Deep programs overflow a 64 MiB stack quickly and always.
                stack_bytes: 64 << 20,
                ..CompileIsolation::default()
            },
            ..DeviceConfig::default()
        };
        let device = tpubox_core::open_device(&config(None)).expect("open the PJRT CPU device");
        let isolated = worker.map(|w| {
            tpubox_core::open_device(&config(Some(w))).expect("open the isolated PJRT CPU device")
        });
        Shared {
            rt,
            device,
            isolated,
            weights: Arc::new(WeightRegistry::new()),
        }
    })
}

/// The generator's options for this process.
pub fn options() -> GenOptions {
    let worker = std::env::var_os("TPUBOX_COMPILE_WORKER").is_some();
    GenOptions {
        allow_recursion: worker,
        max_nesting: if worker { 20_000 } else { 64 },
        max_ops: 400,
        max_executed_trips: 1 << 12,
        policy_max_trips: LOOP_TRIPS,
    }
}

/// What happened to one program (for the seed sweep's statistics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The input did not decode.
    Skipped,
    /// Compiled and ran twice.
    Ran,
    /// Compiled; its execution was refused or failed (with the kind).
    ExecRefused(ErrorKind),
    /// Refused at compile (with the kind).
    CompileRefused(ErrorKind),
}

/// Runs one input, asserting the invariants in the module docs.
pub fn run_bytes(data: &[u8]) {
    let _ = run_input(data);
}

/// [`run_bytes`], returning what happened and the program's facts.
pub fn run_input(data: &[u8]) -> (Outcome, Facts) {
    let mut u = Unstructured::new(data);
    let Ok(program) = program_gen::generate(&mut u, options()) else {
        return (Outcome::Skipped, Facts::default());
    };
    let rest = u.take_rest();
    let facts = program.facts.clone();
    (run_program(&program, rest), facts)
}

/// Compiles and runs `program` as a fresh untrusted tenant; `fill` seeds the argument bytes.
pub fn run_program(program: &Program, fill: &[u8]) -> Outcome {
    let s = shared();
    let facts = &program.facts;
    let device = if facts.recursion || facts.deep {
        match &s.isolated {
            Some(d) => d,
            None => return Outcome::Skipped,
        }
    } else {
        &s.device
    };
    let mut limits = TenantLimits {
        max_device_bytes: DEVICE_BYTES,
        max_live_tensors: 64,
        max_live_executables: 4,
        ..TenantLimits::default()
    };
    limits.program_policy.max_loop_trips = LOOP_TRIPS;
    // Loops XLA cannot bound run on the loop budget: as many trips as a bounded loop may
    // have, and little work, so that an endless one ends in milliseconds.
    limits.program_policy.max_loop_iterations = LOOP_TRIPS;
    limits.program_policy.max_loop_work = 1 << 30;
    let tenant = Tenant::new("fuzz-programs", limits.clone());
    let session = Session::new(
        Arc::clone(device),
        Arc::clone(&s.weights),
        Arc::clone(&tenant),
    );
    let outcome = s.rt.block_on(async {
        let exe = match session
            .compile(
                program.text.clone().into_bytes(),
                ProgramFormat::MlirText,
                None,
            )
            .await
        {
            Ok(exe) => exe,
            Err(e) => {
                assert!(
                    matches!(
                        e.kind,
                        ErrorKind::CompileFailed
                            | ErrorKind::NotFound
                            | ErrorKind::Unsupported
                            | ErrorKind::InvalidArgument
                            | ErrorKind::ResourceExhausted
                            | ErrorKind::PermissionDenied
                    ),
                    "compile returned {:?}: {}\n{}",
                    e.kind,
                    e.message,
                    shown(&program.text)
                );
                assert!(
                    !facts.clean(),
                    "a clean program was refused ({:?}: {})\n{}",
                    e.kind,
                    e.message,
                    shown(&program.text)
                );
                if std::env::var_os("TPUBOX_FUZZ_VERBOSE").is_some() {
                    eprintln!(
                        "compile: {:?}: {}",
                        e.kind,
                        &e.message[..e.message.len().min(300)]
                    );
                }
                return Outcome::CompileRefused(e.kind);
            }
        };
        // What was admitted is what the policy allows, judged on the optimized program (XLA may
        // delete a loop or a transfer whose results nothing uses: then it never runs).
        let compiled = exe
            .executable()
            .program_facts()
            .expect("the facts of an admitted program");
        assert!(
            compiled.host_transfers.is_empty()
                && compiled.custom_call_targets.iter().all(|t| limits
                    .program_policy
                    .allowed_custom_calls
                    .contains(t)
                    || t == "tpubox_loop_budget")
                && compiled
                    .while_loops
                    .iter()
                    .all(|w| w.known_trip_count.is_none_or(|n| n <= LOOP_TRIPS)),
            "an untrusted tenant's program was admitted with {compiled:?}\n{}",
            shown(&program.text)
        );
        assert!(
            !facts.recursion,
            "a recursive program compiled\n{}",
            shown(&program.text)
        );
        // Arguments of the parameter types, filled from the input.
        let mut args = Vec::new();
        let mut fill = fill.iter().copied().cycle();
        for ty in &program.params {
            let n = ty.elems() as usize * ty.et.byte_size();
            let bytes: Vec<u8> = (0..n).map(|_| fill.next().unwrap_or(0)).collect();
            let dims: Vec<u64> = ty.dims.iter().map(|&d| d as u64).collect();
            match session.tensor_from_bytes(ty.et, &dims, &bytes, None) {
                Ok(t) => args.push(t),
                Err(e) => {
                    assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{}", e.message);
                    return Outcome::ExecRefused(e.kind);
                }
            }
        }
        let refs: Vec<_> = args.iter().collect();
        let mut runs = Vec::new();
        for _ in 0..2 {
            match session.execute(&exe, &refs, &[]).await {
                Ok(outs) => {
                    check_results(&outs, &program.results, &program.text);
                    let mut bytes = Vec::new();
                    for o in &outs {
                        match session.read(o).await {
                            Ok(b) => bytes.push(b),
                            Err(e) => panic!("reading a result: {:?}: {}", e.kind, e.message),
                        }
                    }
                    runs.push(bytes);
                }
                Err(e) => {
                    assert!(
                        matches!(
                            e.kind,
                            ErrorKind::ResourceExhausted | ErrorKind::ExecutionFailed
                        ),
                        "execute returned {:?}: {}\n{}",
                        e.kind,
                        e.message,
                        shown(&program.text)
                    );
                    assert!(
                        !(facts.clean() && e.kind == ErrorKind::ExecutionFailed),
                        "a clean program failed to run: {}\n{}",
                        e.message,
                        shown(&program.text)
                    );
                    return Outcome::ExecRefused(e.kind);
                }
            }
        }
        assert!(
            runs[0] == runs[1],
            "two runs of one program on the same arguments differ\n{}",
            shown(&program.text)
        );
        Outcome::Ran
    });
    let u = tenant.usage();
    assert!(u.peak_device_bytes <= limits.max_device_bytes, "{u:?}");
    assert!(u.peak_live_tensors <= limits.max_live_tensors, "{u:?}");
    drop(session);
    let u = tenant.usage();
    assert_eq!(
        (u.device_bytes, u.live_tensors, u.live_executables),
        (0, 0, 0),
        "the tenant still holds something afterwards: {u:?}"
    );
    outcome
}

/// The program for an assertion message: whole when short, else its head (the input that made
/// it is what libFuzzer keeps). With `TPUBOX_FUZZ_DUMP=FILE` the whole text goes to FILE.
fn shown(text: &str) -> &str {
    if let Some(path) = std::env::var_os("TPUBOX_FUZZ_DUMP") {
        let _ = std::fs::write(path, text);
    }
    match text.char_indices().nth(3000) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}

fn check_results(outs: &[tpubox_core::session::TensorHandle], want: &[Ty], text: &str) {
    // `shown` only on failure: it writes the dump file and cuts the text.
    assert_eq!(outs.len(), want.len(), "result count\n{}", shown(text));
    for (i, (o, w)) in outs.iter().zip(want).enumerate() {
        let spec = o.spec();
        assert_eq!(
            (spec.ty, spec.dims.as_slice()),
            (w.et, w.dims.as_slice()),
            "result {i} has the wrong type\n{}",
            shown(text)
        );
    }
}
