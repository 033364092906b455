//! The adversarial suite: bad inputs and abuses from guests and from direct API calls, each
//! asserting the exact error kind (or, for traps, the host's one-line error), and after every
//! one the same host serving a fresh, well-behaved tenant (hello-matmul) with the right numbers
//! while the offending tenant holds nothing on the device any more.
//!
//! The guests are `tests/guests/probe` (its `check NAME` and `abuse NAME` cases) and
//! `examples/hello-matmul`, built for wasm32-wasip2 by `scripts/dev.sh`; the JavaScript case
//! needs `target/polyglot/js-mlp.wasm` (`bash scripts/dev.sh setup`).

use crate::support::{hello_expected, polyglot_wasm, test_host_config, wasm};

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tpubox_core::device::Arg;
use tpubox_core::session::{ExecutableHandle, TensorHandle};
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{DeviceService, ErrorKind, PrimitiveType, Session, Tenant, TenantLimits};
use tpubox_wasm::wit::generated::tpubox::device::client::{
    CompileOptions, Host as _, ProgramFormat,
};
use tpubox_wasm::wit::generated::tpubox::device::types::{Dtype, HostTensor};
use tpubox_wasm::wit::generated::tpubox::device::weights::{Host as _, HostWeightSet as _};
use tpubox_wasm::wit::{DeviceState, HostError, HostResult};
use tpubox_wasm::{Host, HostConfig, RunOptions, RunOutcome};
use wasmtime::component::{Component, Resource};

// ---------------------------------------------------------------------------------------------
// The host, its guests and the well-behaved tenant
// ---------------------------------------------------------------------------------------------

/// Largest program the host itself accepts (below every tenant's own limit in `wide()`).
const HOST_MAX_PROGRAM: usize = 4 << 20;

/// Compile-time limit of this suite's host (compile bombs stop here; generous enough for the
/// legitimate programs on a loaded CI machine).
const COMPILE_SECONDS: u64 = 10;

/// Compile stack of this suite's workers: enough for its legitimate programs, small enough
/// that runaway recursion overflows it in well under a second even on a loaded machine
/// (filling the default 1 GiB takes seconds there).
const COMPILE_STACK: usize = 64 << 20;

/// Small limits for the tenants of this suite.
fn limits() -> TenantLimits {
    TenantLimits {
        max_device_bytes: 1 << 20,
        max_live_tensors: 16,
        max_live_executables: 4,
        max_program_bytes: 16 << 10,
        max_compiles_per_minute: 30,
        max_guest_memory: 32 << 20,
        max_call_time: Some(Duration::from_secs(20)),
        fuel: None,
        program_policy: Default::default(),
        max_pending_launches: 64,
        max_running_executions: u64::MAX,
        ..TenantLimits::default()
    }
}

struct Env {
    host: Host,
    probe: Component,
    hello: Component,
    /// Number of well-behaved runs so far (varies hello's input).
    served: u32,
    /// `(case, summary)` of every case so far.
    cases: Vec<(String, String)>,
}

fn config(execution_slots: usize) -> HostConfig {
    let mut config = test_host_config();
    config.max_program_bytes = HOST_MAX_PROGRAM;
    config.compile_isolation.max_compile_time = Duration::from_secs(COMPILE_SECONDS);
    config.compile_isolation.stack_bytes = COMPILE_STACK;
    config.execution_slots = execution_slots;
    config.sandbox.consume_fuel = true;
    config.sandbox.tenant_limits = limits();
    config
}

fn env(execution_slots: usize) -> Env {
    let host = Host::new(config(execution_slots)).expect("host starts on the CPU plugin");
    host.load_weights("test", &test_weights_file())
        .expect("test weights load");
    let probe = host
        .load_component(&wasm("tpubox-probe"))
        .expect("probe loads");
    let hello = host
        .load_component(&wasm("hello-matmul"))
        .expect("hello loads");
    Env {
        host,
        probe,
        hello,
        served: 0,
        cases: Vec::new(),
    }
}

/// A safetensors file with `w`: f32[2,2] = [0.5, -1, 2, 8].
fn test_weights_file() -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let w: Vec<u8> = [0.5f32, -1.0, 2.0, 8.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let tensors = vec![("w", TensorView::new(Dtype::F32, vec![2, 2], &w).unwrap())];
    let path = std::env::temp_dir().join(format!(
        "tpubox-adversarial-weights-{}.safetensors",
        std::process::id()
    ));
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
    path
}

fn opts(args: &[&str], tenant: &Arc<Tenant>) -> RunOptions {
    RunOptions {
        args: args.iter().map(|s| s.to_string()).collect(),
        capture_output: true,
        stdin: Some(Vec::new()),
        deadline: Some(Duration::from_secs(20)),
        tenant: Some(Arc::clone(tenant)),
        ..RunOptions::default()
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The value of the line `KEY: VALUE`.
fn line<'a>(out: &'a str, key: &str) -> &'a str {
    let prefix = format!("{key}: ");
    out.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no `{key}:` line in output:\n{out}"))
}

/// Asserts that no usage is left on `t`'s books.
fn assert_nothing_held(case: &str, t: &Tenant) {
    let u = t.usage();
    assert_eq!(
        (u.device_bytes, u.live_tensors, u.live_executables),
        (0, 0, 0),
        "{case}: tenant `{}` still holds resources after its run ended: {u:?}",
        t.name()
    );
}

impl Env {
    /// Runs hello-matmul as a fresh tenant and checks its numbers against the reference.
    async fn serve_well_behaved(&mut self, after: &str) {
        self.served += 1;
        let scale = 0.5 * (self.served % 7) as f32 - 1.0;
        let tenant = Tenant::new(format!("good-after-{after}"), limits());
        let s = scale.to_string();
        let o = self
            .host
            .run(
                &self.hello,
                "hello-matmul",
                &opts(&["--scale", &s], &tenant),
            )
            .await
            .unwrap_or_else(|e| panic!("after {after}: the good tenant failed: {e:#}"));
        let out = text(&o.stdout);
        assert!(
            o.success,
            "after {after}: hello failed:\n{out}\n{}",
            text(&o.stderr)
        );
        let got: Vec<Vec<f32>> = serde_json::from_str(line(&out, "result")).unwrap();
        let want = hello_expected(scale);
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!(
                (g - w).abs() <= 1e-5,
                "after {after}: got {got:?}, want {want:?}"
            );
        }
        assert_eq!(got.len() * got[0].len(), 8);
        assert_nothing_held(after, &tenant);
        assert_eq!(o.usage.executions, 1);
    }

    /// Records a finished case: the offender holds nothing, and a good tenant is served.
    async fn done(&mut self, case: &str, offender: &Tenant, summary: String) {
        assert!(
            !self.cases.iter().any(|(c, _)| c == case),
            "case {case} listed twice"
        );
        assert_nothing_held(case, offender);
        self.serve_well_behaved(case).await;
        println!("case {:>3}  {case:<34} {summary}", self.cases.len() + 1);
        self.cases.push((case.to_string(), summary));
    }

    /// Records a case whose tenant still holds its other resources (a direct session that goes
    /// on); the caller checks the tenant holds nothing once the session ends.
    async fn step(&mut self, case: &str, summary: String) {
        assert!(
            !self.cases.iter().any(|(c, _)| c == case),
            "case {case} listed twice"
        );
        self.serve_well_behaved(case).await;
        println!("case {:>3}  {case:<34} {summary}", self.cases.len() + 1);
        self.cases.push((case.to_string(), summary));
    }

    /// Runs the probe with `args` as tenant `case` (limits tweaked by `lim`, options by `opt`).
    async fn probe(
        &self,
        case: &str,
        args: &[&str],
        lim: impl FnOnce(&mut TenantLimits),
        opt: impl FnOnce(&mut RunOptions),
    ) -> (Arc<Tenant>, anyhow::Result<RunOutcome>) {
        let mut l = limits();
        lim(&mut l);
        let tenant = Tenant::new(case, l);
        let mut o = opts(args, &tenant);
        opt(&mut o);
        let r = self.host.run(&self.probe, "tpubox-probe", &o).await;
        (tenant, r)
    }
}

/// The stdout of a run that must have returned normally.
fn ok_stdout(case: &str, r: &anyhow::Result<RunOutcome>) -> String {
    match r {
        Ok(o) => {
            let out = text(&o.stdout);
            assert!(
                o.success,
                "{case}: guest failed:\n{out}\n{}",
                text(&o.stderr)
            );
            out
        }
        Err(e) => panic!("{case}: run failed: {e:#}"),
    }
}

/// The host's one-line error of a run that must have been stopped.
fn trap_text(case: &str, r: &anyhow::Result<RunOutcome>) -> String {
    match r {
        Ok(o) => panic!(
            "{case}: the run was not stopped:\n{}\n{}",
            text(&o.stdout),
            text(&o.stderr)
        ),
        // The message, without the wasm backtrace that traps carry as context.
        Err(e) => e.root_cause().to_string(),
    }
}

/// Asserts the probe line `key` is `KIND (message)` with `kind`, the message containing `has`.
fn assert_kind(case: &str, out: &str, key: &str, kind: &str, has: &str) -> String {
    let l = line(out, key);
    assert_eq!(l.split(' ').next().unwrap(), kind, "{case}: {key}: {l}");
    assert!(l.contains(has), "{case}: {key}: {l:?} does not say {has:?}");
    l.to_string()
}

// ---------------------------------------------------------------------------------------------
// Direct calls: a store-less view for driving the WIT host traits
// ---------------------------------------------------------------------------------------------

struct Direct {
    state: DeviceState,
}

impl Direct {
    fn new(host: &(Arc<DeviceService>, Arc<WeightRegistry>), tenant: &Arc<Tenant>) -> Self {
        let session = Session::new(Arc::clone(&host.0), Arc::clone(&host.1), Arc::clone(tenant));
        Direct {
            state: DeviceState::new(session),
        }
    }

    fn ctx(&mut self) -> &mut DeviceState {
        &mut self.state
    }

    async fn tensor(&mut self, vals: [f32; 4]) -> Resource<TensorHandle> {
        let data = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.ctx()
            .from_bytes(Dtype::F32, vec![2, 2], data, None)
            .await
            .expect("a valid tensor")
    }

    async fn add(&mut self) -> Resource<ExecutableHandle> {
        self.ctx()
            .compile(
                ProgramFormat::MlirText,
                ADD.as_bytes().to_vec(),
                CompileOptions { device: None },
            )
            .await
            .expect("ADD compiles")
    }
}

const ADD: &str = r#"
func.func public @main(%a: tensor<2x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %0 = stablehlo.add %a, %b : tensor<2x2xf32>
  return %0 : tensor<2x2xf32>
}
"#;

/// A WIT call that must return the error `kind` (not trap).
fn wit_err<T>(case: &str, r: HostResult<T>, kind: ErrorKind) -> String {
    match r {
        Err(HostError::Device(e)) => {
            assert_eq!(e.kind, kind, "{case}: {}", e.message);
            format!("{} ({})", kind.as_str(), e.message)
        }
        Ok(_) => panic!("{case}: the call succeeded"),
        Err(HostError::Trap(e)) => panic!("{case}: trapped instead of returning {kind:?}: {e:#}"),
    }
}

/// A WIT call that must fail as a trap whose text contains `has`.
fn wit_trap<T, E: Into<HostError>>(case: &str, r: Result<T, E>, has: &str) -> String {
    match r.map_err(Into::into) {
        Err(HostError::Trap(e)) => {
            let t = format!("{e:#}");
            assert!(t.contains(has), "{case}: trap {t:?} does not say {has:?}");
            format!("trap ({t})")
        }
        Err(HostError::Device(e)) => panic!("{case}: returned {e} instead of trapping"),
        Ok(_) => panic!("{case}: the call did not trap"),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

// ---------------------------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------------------------

/// The bad calls of the probe's `errors`, one run each: (name, kind, message fragment).
const CHECKS: [(&str, &str, &str); 17] = [
    ("short-data", "invalid-argument", "needs 16 bytes"),
    ("long-data", "invalid-argument", "got 17"),
    ("dims-overflow", "invalid-argument", "more bytes than"),
    ("dim-over-i64", "invalid-argument", "exceeds i64::MAX"),
    ("rank-too-big", "invalid-argument", "rank 40"),
    ("bad-device", "not-found", "device 999"),
    ("empty-program", "invalid-argument", "empty"),
    ("not-utf8", "invalid-argument", "UTF-8"),
    ("garbage-mlir", "compile-failed", ""),
    ("bad-bytecode", "invalid-argument", "magic"),
    ("compile-bad-device", "not-found", "device 999"),
    (
        "arg-count",
        "invalid-argument",
        "takes 2 argument(s), got 1",
    ),
    ("arg-dtype", "invalid-argument", "expects f32[2,2]"),
    ("arg-dims", "invalid-argument", "expects f32[2,2]"),
    ("donate-out-of-range", "invalid-argument", "out of range"),
    ("donate-repeated", "invalid-argument", "listed twice"),
    ("same-tensor-donated", "invalid-argument", "donated"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adversarial_cases_each_leave_the_host_serving() {
    let mut e = env(2);

    // ---- validation before PJRT, one bad call per guest run ----
    for (name, kind, has) in CHECKS {
        let case = format!("guest:{name}");
        let (t, r) = e.probe(&case, &["check", name], |_| {}, |_| {}).await;
        let out = ok_stdout(&case, &r);
        let s = assert_kind(&case, &out, name, kind, has);
        e.done(&case, &t, s).await;
    }

    guest_limit_cases(&mut e).await;
    guest_ending_cases(&mut e).await;
    guest_handle_cases(&mut e).await;
    guest_sandbox_cases(&mut e).await;
    hostile_program_cases(&mut e).await;
    segment_attention_cases(&mut e).await;
    direct_service_cases(&mut e).await;
    direct_tenant_cases(&mut e).await;
    direct_wit_cases(&mut e).await;

    println!("{} adversarial cases", e.cases.len());
    let distinct: HashSet<&str> = e.cases.iter().map(|(c, _)| c.as_str()).collect();
    assert_eq!(distinct.len(), e.cases.len());
    assert!(e.cases.len() >= 50, "only {} cases", e.cases.len());
}

/// A change to a case's limits or run options.
type Tweak<T> = fn(&mut T);

/// A run that must be stopped: (case, probe abuse, host error fragment, limits, options).
type Ending = (
    &'static str,
    &'static str,
    &'static str,
    Tweak<TenantLimits>,
    Tweak<RunOptions>,
);

async fn guest_limit_cases(e: &mut Env) {
    // Bombs: refused at the limit, named; free and continue.
    let bombs: [(&str, &str, u64, Tweak<TenantLimits>); 3] = [
        ("tensor-bomb", "max-live-tensors", 16, |l| {
            l.max_live_tensors = 16
        }),
        ("bytes-bomb", "max-device-bytes", 16, |l| {
            l.max_device_bytes = 1 << 20;
            l.max_live_tensors = 1000;
        }),
        ("executable-bomb", "max-live-executables", 4, |l| {
            l.max_live_executables = 4
        }),
    ];
    for (name, limit, made, lim) in bombs {
        let case = format!("guest:{name}");
        let (t, r) = e.probe(&case, &["abuse", name], lim, |_| {}).await;
        let out = ok_stdout(&case, &r);
        let s = assert_kind(&case, &out, name, "resource-exhausted", limit);
        assert_eq!(line(&out, &format!("{name}-made")), made.to_string());
        assert_eq!(line(&out, &format!("{name}-after-free")), "ok");
        assert!(t.usage().refused >= 1);
        e.done(&case, &t, format!("{s}; made {made}, freed, made one more"))
            .await;
    }

    let case = "guest:compile-rate-bomb";
    let (t, r) = e
        .probe(
            case,
            &["abuse", "compile-rate"],
            |l| l.max_compiles_per_minute = 3,
            |_| {},
        )
        .await;
    let out = ok_stdout(case, &r);
    let s = assert_kind(
        case,
        &out,
        "compile-rate",
        "resource-exhausted",
        "max-compiles-per-minute",
    );
    assert_eq!(line(&out, "compile-rate-execute-still-works"), "ok");
    assert_eq!(t.usage().compiles, 3);
    e.done(case, &t, s).await;

    let case = "guest:enormous-program";
    let (t, r) = e
        .probe(
            case,
            &["abuse", "big-program", "4096"],
            |l| l.max_program_bytes = 4096,
            |_| {},
        )
        .await;
    let out = ok_stdout(case, &r);
    let s = assert_kind(
        case,
        &out,
        "big-program",
        "resource-exhausted",
        "max-program-bytes",
    );
    assert!(s.contains("4097"), "{s}");
    assert_eq!(line(&out, "big-program-at-limit"), "ok");
    e.done(case, &t, s).await;

    let case = "guest:program-over-host-limit";
    let limit = HOST_MAX_PROGRAM.to_string();
    let (t, r) = e
        .probe(
            case,
            &["abuse", "big-program", &limit],
            |l| l.max_program_bytes = 64 << 20,
            |_| {},
        )
        .await;
    let out = ok_stdout(case, &r);
    let s = assert_kind(
        case,
        &out,
        "big-program",
        "resource-exhausted",
        "max-program-bytes",
    );
    assert_eq!(line(&out, "big-program-at-limit"), "ok");
    e.done(case, &t, s).await;

    let case = "guest:output-bomb";
    let (t, r) = e
        .probe(case, &["abuse", "output-bomb"], |_| {}, |_| {})
        .await;
    let out = ok_stdout(case, &r);
    let s = assert_kind(
        case,
        &out,
        "output-bomb",
        "resource-exhausted",
        "max-device-bytes",
    );
    assert_eq!(line(&out, "output-bomb-small"), "ok");
    assert!(t.usage().peak_device_bytes < 1 << 20);
    e.done(case, &t, s).await;

    let case = "guest:memory-bomb";
    let (t, r) = e
        .probe(case, &["abuse", "memory-bomb"], |_| {}, |_| {})
        .await;
    let out = ok_stdout(case, &r);
    let l = line(&out, "memory-bomb");
    let mib: usize = l
        .strip_prefix("refused after ")
        .and_then(|s| s.strip_suffix(" MiB"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{case}: {l}"));
    assert!((1..32).contains(&mib), "{case}: {l} under a 32 MiB cap");
    assert_eq!(line(&out, "memory-bomb-after-free"), "ok 1048576");
    e.done(
        case,
        &t,
        format!("grow refused after {mib} MiB; freed and allocated again"),
    )
    .await;

    let case = "guest:memory-abort";
    let (t, r) = e
        .probe(case, &["abuse", "memory-abort"], |_| {}, |_| {})
        .await;
    let s = trap_text(case, &r);
    assert!(s.contains("32 MiB memory limit"), "{case}: {s}");
    assert_eq!(t.usage().peak_live_tensors, 4);
    e.done(case, &t, s).await;

    let case = "guest:read-bomb";
    let (t, r) = e
        .probe(
            case,
            &["abuse", "read-bomb", &(16u64 << 20).to_string()],
            |l| l.max_device_bytes = 128 << 20,
            |_| {},
        )
        .await;
    // Refused before the host copies 64 MiB out for a guest that can hold 32 MiB at most.
    let out = ok_stdout(case, &r);
    let s = assert_kind(
        case,
        &out,
        "read-bomb",
        "resource-exhausted",
        "max-guest-memory",
    );
    assert_eq!(t.usage().peak_device_bytes, (64 << 20) + 4);
    e.done(case, &t, s).await;
}

async fn guest_ending_cases(e: &mut Env) {
    let cases: [Ending; 5] = [
        (
            "infinite-loop",
            "infinite-loop",
            "deadline",
            |_| {},
            |o| o.deadline = Some(Duration::from_secs(1)),
        ),
        (
            "fuel-burn",
            "fuel-burn",
            "fuel",
            |l| l.fuel = Some(20_000_000),
            |_| {},
        ),
        ("panic-holding", "panic", "guest aborted", |_| {}, |_| {}),
        (
            "stack-overflow",
            "stack-overflow",
            "guest trapped: wasm trap: out of bounds memory access",
            |_| {},
            |_| {},
        ),
        (
            "sleep-past-deadline",
            "sleep",
            "deadline",
            |_| {},
            |o| o.deadline = Some(Duration::from_secs(1)),
        ),
    ];
    for (name, abuse, has, lim, opt) in cases {
        let case = format!("guest:{name}");
        // `sleep` blocks in a host call for an hour: only the deadline ends it.
        let args = ["abuse", abuse, "3600"];
        let (t, r) = e.probe(&case, &args, lim, opt).await;
        let s = trap_text(&case, &r);
        assert!(s.contains(has), "{case}: {s:?} does not say {has:?}");
        assert!(!s.contains('\n'), "{case}: not one line: {s}");
        if abuse != "fuel-burn" {
            assert_eq!(t.usage().peak_live_tensors, 4, "{case}");
        }
        e.done(&case, &t, s).await;
    }

    let case = "guest:exit-holding";
    let (t, r) = e.probe(case, &["abuse", "exit"], |_| {}, |_| {}).await;
    let o = r.unwrap_or_else(|err| panic!("{case}: {err:#}"));
    assert!(!o.success);
    assert_eq!(line(&text(&o.stdout), "holding"), "1 executable, 4 tensors");
    assert_eq!(o.usage.peak_live_tensors, 4);
    e.done(case, &t, "exit(3): failure, handles returned".into())
        .await;
}

async fn guest_handle_cases(e: &mut Env) {
    for (name, has) in [
        ("forge-handle", "never had (unknown handle index 12345)"),
        (
            "forge-dropped",
            "handle it had already dropped, or never had",
        ),
        ("forge-type", "handle index"),
    ] {
        let case = format!("guest:{name}");
        let (t, r) = e.probe(&case, &["abuse", name], |_| {}, |_| {}).await;
        let s = trap_text(&case, &r);
        assert!(s.contains(has), "{case}: {s:?} does not say {has:?}");
        e.done(&case, &t, s).await;
    }

    for (name, kind, has) in [
        ("read-after-donate", "failed-precondition", "donated"),
        ("execute-after-donate", "failed-precondition", "argument 0"),
        ("copy-after-donate", "failed-precondition", "donated"),
        ("donate-after-donate", "failed-precondition", "argument 0"),
        ("copy-bad-device", "not-found", "device 7"),
        ("missing-weights", "not-found", "offers: test"),
        ("missing-weight-tensor", "not-found", ""),
        ("no-main", "compile-failed", ""),
    ] {
        let case = format!("guest:{name}");
        let (t, r) = e.probe(&case, &["abuse", name], |_| {}, |_| {}).await;
        let out = ok_stdout(&case, &r);
        let s = assert_kind(&case, &out, name, kind, has);
        if name.ends_with("-after-donate") {
            assert_eq!(line(&out, "other-still-usable"), "ok");
        }
        e.done(&case, &t, s).await;
    }

    let case = "guest:donate-weight";
    let (t, r) = e
        .probe(case, &["abuse", "donate-weight"], |_| {}, |_| {})
        .await;
    let out = ok_stdout(case, &r);
    let s = assert_kind(
        case,
        &out,
        "donate-weight",
        "permission-denied",
        "read-only",
    );
    assert_eq!(line(&out, "weight-still-readable"), "[0.5, -1.0, 2.0, 8.0]");
    e.done(case, &t, s).await;
}

// ---------------------------------------------------------------------------------------------
// Hostile programs: each class in several sizes and shapes
// ---------------------------------------------------------------------------------------------

/// `@main(%a: tensor<4xf32>) -> tensor<4xf32>` with `body` (which must define `%r`) and extra
/// functions after it.
fn main4(body: &str, functions: &str) -> String {
    format!(
        "func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {{\n{body}\n  return %r : tensor<4xf32>\n}}\n{functions}"
    )
}

/// A cycle of `n` private functions, entered from `@main` (n = 0: `@main` calls itself).
fn recursion(n: usize) -> String {
    if n == 0 {
        return main4(
            "  %r = func.call @main(%a) : (tensor<4xf32>) -> tensor<4xf32>",
            "",
        );
    }
    let f: String = (0..n)
        .map(|i| {
            format!(
                "func.func private @f{i}(%a: tensor<4xf32>) -> tensor<4xf32> {{\n  %b = stablehlo.add %a, %a : tensor<4xf32>\n  %r = func.call @f{}(%b) : (tensor<4xf32>) -> tensor<4xf32>\n  return %r : tensor<4xf32>\n}}\n",
                (i + 1) % n
            )
        })
        .collect();
    main4(
        "  %r = func.call @f0(%a) : (tensor<4xf32>) -> tensor<4xf32>",
        &f,
    )
}

/// A parameter of `depth` nested one-element tuple types around `tensor<f32>`.
fn nested_tuple(depth: usize) -> String {
    let ty = format!("{}tensor<f32>{}", "tuple<".repeat(depth), ">".repeat(depth));
    format!(
        "func.func public @main(%t: {ty}) -> tensor<f32> {{\n  %c = stablehlo.constant dense<1.0> : tensor<f32>\n  return %c : tensor<f32>\n}}\n"
    )
}

/// `depth` `stablehlo.case` regions nested inside each other.
fn nested_case(depth: usize) -> String {
    let mut body = "stablehlo.return %a : tensor<4xf32>".to_string();
    for i in 0..depth {
        body = format!(
            "%x{i} = \"stablehlo.case\"(%i) ({{\n{body}\n}}) : (tensor<i32>) -> tensor<4xf32>\nstablehlo.return %x{i} : tensor<4xf32>"
        );
    }
    let body = format!(
        "  %i = stablehlo.constant dense<0> : tensor<i32>\n  %r = \"stablehlo.case\"(%i) ({{\n{body}\n}}) : (tensor<i32>) -> tensor<4xf32>"
    );
    main4(&body, "")
}

/// A plain chain of `n` element-wise adds (an unrolled program).
fn chain(n: usize) -> String {
    let mut body = String::with_capacity(n * 48);
    let mut prev = "%a".to_string();
    for i in 0..n {
        body.push_str(&format!(
            "  %v{i} = stablehlo.add {prev}, %a : tensor<4xf32>\n"
        ));
        prev = format!("%v{i}");
    }
    body.push_str(&format!("  %r = stablehlo.abs {prev} : tensor<4xf32>"));
    main4(&body, "")
}

/// Sorts an f32 temporary of `dims` built from nothing and returns one scalar.
fn sort_temp(dims: &[u64]) -> String {
    let shape: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    let t = format!("tensor<{}xf32>", shape.join("x"));
    let all: Vec<String> = (0..dims.len()).map(|d| d.to_string()).collect();
    format!(
        r#"func.func public @main(%x: tensor<f32>) -> tensor<f32> {{
  %b = stablehlo.broadcast_in_dim %x, dims = [] : (tensor<f32>) -> {t}
  %i = stablehlo.iota dim = 0 : {t}
  %s = stablehlo.add %b, %i : {t}
  %sorted = "stablehlo.sort"(%s) ({{
    ^bb0(%p: tensor<f32>, %q: tensor<f32>):
      %gt = stablehlo.compare GT, %p, %q : (tensor<f32>, tensor<f32>) -> tensor<i1>
      stablehlo.return %gt : tensor<i1>
  }}) {{dimension = {last} : i64, is_stable = false}} : ({t}) -> {t}
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %m = stablehlo.reduce(%sorted init: %z) applies stablehlo.maximum across dimensions = [{all}] : ({t}, tensor<f32>) -> tensor<f32>
  return %m : tensor<f32>
}}
"#,
        last = dims.len() - 1,
        all = all.join(", ")
    )
}

/// A `while` loop over `%a`: `cond` is the condition's body (defining `%p`, may use `%i` and
/// `%v`), and each trip adds one to the counter `%i`.
fn while_loop(cond: &str) -> String {
    main4(
        &format!(
            r#"  %c0 = stablehlo.constant dense<0> : tensor<i64>
  %c1 = stablehlo.constant dense<1> : tensor<i64>
  %w:2 = stablehlo.while(%i = %c0, %v = %a) : tensor<i64>, tensor<4xf32>
    cond {{
{cond}
      stablehlo.return %p : tensor<i1>
    }} do {{
      %j = stablehlo.add %i, %c1 : tensor<i64>
      %u = stablehlo.add %v, %v : tensor<4xf32>
      stablehlo.return %j, %u : tensor<i64>, tensor<4xf32>
    }}
  %r = stablehlo.abs %w#1 : tensor<4xf32>"#
        ),
        "",
    )
}

/// A loop of exactly `n` trips.
fn counted_loop(n: u64) -> String {
    while_loop(&format!(
        "      %n = stablehlo.constant dense<{n}> : tensor<i64>\n      %p = stablehlo.compare LT, %i, %n : (tensor<i64>, tensor<i64>) -> tensor<i1>"
    ))
}

const INFEED: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %tok = stablehlo.create_token : !stablehlo.token
  %v:2 = "stablehlo.infeed"(%tok) {infeed_config = "", layout = [[0]]} : (!stablehlo.token) -> (tensor<4xf32>, !stablehlo.token)
  return %v#0 : tensor<4xf32>
}
"#;

const OUTFEED: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %tok = stablehlo.create_token : !stablehlo.token
  %t = "stablehlo.outfeed"(%a, %tok) {outfeed_config = ""} : (tensor<4xf32>, !stablehlo.token) -> !stablehlo.token
  return %a : tensor<4xf32>
}
"#;

const CUSTOM_CALL: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %r = stablehlo.custom_call @lapack_sgetrf_ffi(%a) : (tensor<4xf32>) -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

/// A `tpubox_segment_attention` custom call of q, k: `[1, n, 1, d]`, v: `[1, n, 1, dv]`,
/// positions from an iota (one segment of `n` tokens), result `[1, n, 1, d]`; `operands`
/// limits how many of (q, k, v, positions) it passes. q, k and v are splat constants.
fn segment_attention_call(n: u64, d: u64, dv: u64, operands: usize) -> String {
    let qt = format!("tensor<1x{n}x1x{d}xf32>");
    let vt = format!("tensor<1x{n}x1x{dv}xf32>");
    let pt = format!("tensor<1x{n}xi32>");
    let names = ["%q", "%q", "%v", "%p"];
    let types = [qt.as_str(), qt.as_str(), vt.as_str(), pt.as_str()];
    format!(
        r#"func.func public @main() -> {qt} {{
  %q = stablehlo.constant dense<0.5> : {qt}
  %v = stablehlo.constant dense<0.25> : {vt}
  %p = stablehlo.iota dim = 1 : {pt}
  %r = stablehlo.custom_call @tpubox_segment_attention({}) {{api_version = 4 : i32}} : ({}) -> {qt}
  return %r : {qt}
}}
"#,
        names[..operands].join(", "),
        types[..operands].join(", ")
    )
}

/// The host's own custom call, allowed by default, called by a hostile program: it checks
/// what XLA cannot (the call is opaque to XLA's shape checks) and bounds its work before it
/// runs, since XLA cannot interrupt it.
async fn segment_attention_cases(e: &mut Env) {
    let cases: Vec<Hostile> = vec![
        (
            "segment-attention-ok",
            segment_attention_call(4, 8, 8, 4),
            "execute",
            "ok",
            "",
        ),
        (
            "segment-attention-v-of-another-shape",
            segment_attention_call(4, 8, 4, 4),
            "execute",
            "invalid-argument",
            "v must be f32 [1, 4, 1, 8]",
        ),
        (
            "segment-attention-three-operands",
            segment_attention_call(4, 8, 8, 3),
            "execute",
            "invalid-argument",
            "takes 4 operands",
        ),
        // One segment of 2^19 tokens: about 2.2e12 operations from 2 MiB operands.
        (
            "segment-attention-over-the-work-limit",
            segment_attention_call(1 << 19, 1, 1, 4),
            "execute",
            "resource-exhausted",
            "TPUBOX_KERNEL_MAX_FLOP",
        ),
    ];
    // The work-limit case needs its 10 MiB of operands and result on the device.
    run_hostile_programs(e, cases, 64 << 20).await;
}

/// One hostile program: (case, program, the probe line it decides, kind, message fragment).
type Hostile = (
    &'static str,
    String,
    &'static str,
    &'static str,
    &'static str,
);

async fn hostile_program_cases(e: &mut Env) {
    let stack = "overflowed its";
    let bytes = "max-device-bytes";
    let cases: Vec<Hostile> = vec![
        // Recursion: XLA's inliner follows calls without end.
        (
            "recursion-self",
            recursion(0),
            "compile",
            "compile-failed",
            stack,
        ),
        (
            "recursion-pair",
            recursion(2),
            "compile",
            "compile-failed",
            stack,
        ),
        (
            "recursion-cycle-7",
            recursion(7),
            "compile",
            "compile-failed",
            stack,
        ),
        // Nested types: refused by the compiler when shallow, overflow its stack when deep.
        (
            "nested-tuple-2000",
            nested_tuple(2000),
            "compile",
            "compile-failed",
            "array shapes",
        ),
        (
            "nested-tuple-60000",
            nested_tuple(60_000),
            "compile",
            "compile-failed",
            stack,
        ),
        // Nested regions: a thousand levels compile and run; thirty thousand overflow the stack.
        ("nested-case-1000", nested_case(1000), "execute", "ok", ""),
        (
            "nested-case-30000",
            nested_case(30_000),
            "compile",
            "compile-failed",
            stack,
        ),
        // Long unrolled chains: 2,000 ops compile and run (a chain past the compile-time limit is
        // `a_compile_past_the_time_limit_is_stopped_with_the_limit_named`).
        ("chain-2000", chain(2000), "execute", "ok", ""),
        // Temporaries against a 1 MiB tenant: refused at compile, whatever their shape.
        (
            "temp-sort-4096x4096",
            sort_temp(&[4096, 4096]),
            "compile",
            "resource-exhausted",
            bytes,
        ),
        (
            "temp-sort-2x2097152",
            sort_temp(&[2, 1 << 21]),
            "compile",
            "resource-exhausted",
            bytes,
        ),
        (
            "temp-sort-16^5",
            sort_temp(&[16, 16, 16, 16, 16]),
            "compile",
            "resource-exhausted",
            bytes,
        ),
        // XLA proves the max of a sorted [1, N] needs no sort (and no temporary): it runs.
        (
            "temp-sort-1x4194304-simplified",
            sort_temp(&[1, 1 << 22]),
            "execute",
            "ok",
            "",
        ),
        (
            "temp-sort-64x64x64",
            sort_temp(&[64, 64, 64]),
            "compile",
            "resource-exhausted",
            bytes,
        ),
        (
            "temp-sort-128x128",
            sort_temp(&[128, 128]),
            "execute",
            "ok",
            "",
        ),
        // Loops that may never end, and loops that end. One XLA cannot bound runs on the loop
        // budget (issue 31) until it is spent.
        (
            "loop-always-true",
            while_loop("      %p = stablehlo.constant dense<true> : tensor<i1>"),
            "execute",
            "resource-exhausted",
            "max-loop-iterations",
        ),
        (
            "loop-data-dependent",
            while_loop(
                "      %e = stablehlo.slice %v [0:1] : (tensor<4xf32>) -> tensor<1xf32>\n      %s = stablehlo.reshape %e : (tensor<1xf32>) -> tensor<f32>\n      %h = stablehlo.constant dense<1.0e+30> : tensor<f32>\n      %p = stablehlo.compare LT, %s, %h : (tensor<f32>, tensor<f32>) -> tensor<i1>",
            ),
            "execute",
            "resource-exhausted",
            "max-loop-iterations",
        ),
        (
            "loop-2^40-trips",
            counted_loop(1 << 40),
            "compile",
            "permission-denied",
            "max-loop-trips",
        ),
        ("loop-10-trips", counted_loop(10), "execute", "ok", ""),
        // Transfers nobody feeds, and code outside XLA.
        (
            "unfed-infeed",
            INFEED.to_string(),
            "compile",
            "permission-denied",
            "host-transfer",
        ),
        (
            "outfeed",
            OUTFEED.to_string(),
            "compile",
            "permission-denied",
            "host-transfer",
        ),
        (
            "custom-call",
            CUSTOM_CALL.to_string(),
            "compile",
            "not-found",
            "lapack_sgetrf_ffi",
        ),
    ];
    run_hostile_programs(e, cases, limits().max_device_bytes).await;
}

/// Runs each hostile program through the probe's `run-stdin` as a tenant of its own (this
/// suite's limits, programs up to `HOST_MAX_PROGRAM`, `max_device_bytes` on the device) and
/// checks the line it decides.
async fn run_hostile_programs(e: &mut Env, cases: Vec<Hostile>, max_device_bytes: u64) {
    for (name, program, key, kind, has) in cases {
        let case = format!("hostile:{name}");
        let (t, r) = e
            .probe(
                &case,
                &["abuse", "run-stdin"],
                |l| {
                    l.max_program_bytes = HOST_MAX_PROGRAM;
                    l.max_device_bytes = max_device_bytes;
                },
                |o| o.stdin = Some(program.into_bytes()),
            )
            .await;
        let out = ok_stdout(&case, &r);
        let s = if kind == "ok" {
            assert_eq!(line(&out, "compile"), "ok", "{case}");
            assert_eq!(line(&out, key), "ok", "{case}");
            format!("compiles and runs ({} executions)", t.usage().executions)
        } else {
            if key != "compile" {
                assert_eq!(line(&out, "compile"), "ok", "{case}: {out}");
            }
            assert_kind(&case, &out, key, kind, has)
        };
        if name == "temp-sort-128x128" {
            // The sort's 64 KiB temporary was charged while it ran.
            assert!(
                t.usage().peak_device_bytes >= 64 << 10,
                "{case}: {:?}",
                t.usage()
            );
        }
        e.done(&case, &t, s).await;
    }
}

async fn guest_sandbox_cases(e: &mut Env) {
    for (name, arg) in [
        ("network-connect", None),
        ("network-listen", None),
        ("network-udp", None),
        ("network-dns", None),
        ("fs-read", Some("/etc/passwd")),
        ("fs-list", Some("/")),
        ("fs-write", Some("/tmp/tpubox-adversarial-was-here")),
    ] {
        let case = format!("guest:{name}");
        let mut args = vec!["abuse", name];
        args.extend(arg);
        let (t, r) = e.probe(&case, &args, |_| {}, |_| {}).await;
        let out = ok_stdout(&case, &r);
        let l = line(&out, name);
        assert!(l.starts_with("err "), "{case}: {l}");
        e.done(&case, &t, l.to_string()).await;
    }
    assert!(!std::path::Path::new("/tmp/tpubox-adversarial-was-here").exists());

    // A granted directory is read-only and cannot be escaped.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data.txt"), b"hello").unwrap();
    for (name, abuse, path) in [
        ("fs-escape-grant", "fs-read", "/data/../../../etc/passwd"),
        ("fs-write-to-grant", "fs-write", "/data/new.txt"),
        ("fs-overwrite-grant", "fs-write", "/data/data.txt"),
    ] {
        let case = format!("guest:{name}");
        let grant = dir.path().to_path_buf();
        let (t, r) = e
            .probe(
                &case,
                &["abuse", abuse, path],
                |_| {},
                |o| o.dirs = vec![(grant, "/data".into())],
            )
            .await;
        let out = ok_stdout(&case, &r);
        let l = line(&out, abuse);
        assert!(l.starts_with("err "), "{case}: {l}");
        e.done(&case, &t, l.to_string()).await;
    }
    assert!(!dir.path().join("new.txt").exists());
    assert_eq!(
        std::fs::read(dir.path().join("data.txt")).unwrap(),
        b"hello"
    );

    let case = "guest:env-without-grant";
    let (t, r) = e.probe(case, &["abuse", "env"], |_| {}, |_| {}).await;
    let out = ok_stdout(case, &r);
    assert_eq!(line(&out, "env"), "0 ");
    e.done(case, &t, "no variables".into()).await;

    let case = "guest:clock-without-grant";
    let (t, r) = e.probe(case, &["abuse", "clock"], |_| {}, |_| {}).await;
    let out = ok_stdout(case, &r);
    assert_eq!(line(&out, "clock"), "wall 0 mono 0");
    // The control: with the grant, both clocks advance.
    let (_, r) = e
        .probe(
            "clock-control",
            &["abuse", "clock"],
            |_| {},
            |o| o.allow_clock = true,
        )
        .await;
    let granted = ok_stdout(case, &r);
    let v: Vec<u128> = line(&granted, "clock")
        .split(' ')
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(
        v.len() == 2 && v[0] > 1_600_000_000_000_000_000 && v[1] > 0,
        "{granted}"
    );
    e.done(case, &t, "wall 0 mono 0 (granted: both advance)".into())
        .await;
}

async fn direct_service_cases(e: &mut Env) {
    let dev = Arc::clone(e.host.device());
    let nobody = Tenant::new("direct-service", limits());
    let expect =
        |case: &str, r: tpubox_core::error::DeviceResult<()>, kind: ErrorKind, has: &str| {
            let err = r.expect_err(case);
            assert_eq!(err.kind, kind, "{case}: {}", err.message);
            assert!(err.message.contains(has), "{case}: {}", err.message);
            format!("{} ({})", kind.as_str(), err.message)
        };

    let r = dev
        .tensor_from_bytes(PrimitiveType::F32, &[-1, 4], &[], 0)
        .map(drop);
    let s = expect(
        "direct:negative-dim",
        r,
        ErrorKind::InvalidArgument,
        "negative",
    );
    e.done("direct:negative-dim", &nobody, s).await;

    let r = dev
        .tensor_from_bytes(PrimitiveType::U8, &[1; 17], &[0], 0)
        .map(drop);
    let s = expect("direct:rank-17", r, ErrorKind::InvalidArgument, "rank 17");
    e.done("direct:rank-17", &nobody, s).await;

    let r = dev
        .tensor_from_bytes(PrimitiveType::F32, &[i64::MAX, 2], &[], 0)
        .map(drop);
    let s = expect(
        "direct:i64-dims-overflow",
        r,
        ErrorKind::InvalidArgument,
        "",
    );
    e.done("direct:i64-dims-overflow", &nobody, s).await;

    let r = dev
        .compile(vec![b' '; HOST_MAX_PROGRAM + 1], true, 0)
        .await
        .map(drop);
    let s = expect(
        "direct:program-over-host-limit",
        r,
        ErrorKind::ResourceExhausted,
        "max-program-bytes",
    );
    e.done("direct:program-over-host-limit", &nobody, s).await;

    let exe = dev
        .compile(ADD.as_bytes().to_vec(), true, 0)
        .await
        .expect("ADD compiles");
    let a = dev
        .tensor_from_bytes(PrimitiveType::F32, &[2, 2], &f32_bytes(&[1.0; 4]), 0)
        .unwrap();
    let b = dev
        .tensor_from_bytes(PrimitiveType::F32, &[2, 2], &f32_bytes(&[2.0; 4]), 0)
        .unwrap();
    let arg = |t, donate| Arg { tensor: t, donate };
    let r = dev.execute(&exe, &[arg(&a, false)]).await.map(drop);
    let s = expect(
        "direct:execute-arg-count",
        r,
        ErrorKind::InvalidArgument,
        "got 1",
    );
    e.done("direct:execute-arg-count", &nobody, s).await;

    let r = dev
        .execute(&exe, &[arg(&a, true), arg(&a, true)])
        .await
        .map(drop);
    let s = expect(
        "direct:execute-double-donation",
        r,
        ErrorKind::InvalidArgument,
        "donated",
    );
    e.done("direct:execute-double-donation", &nobody, s).await;

    let owned = |v: f32| {
        Arc::new(
            dev.tensor_from_bytes(PrimitiveType::F32, &[2, 2], &f32_bytes(&[v; 4]), 0)
                .unwrap(),
        )
    };
    let (a2, b2) = (owned(1.0), owned(2.0));
    let r = tpubox_core::types::Call::new(
        Arc::clone(&exe),
        vec![(Arc::clone(&a2), false), (a2, false), (b2, false)],
    )
    .map(drop);
    let s = expect(
        "direct:execute-too-many-args",
        r,
        ErrorKind::InvalidArgument,
        "got 3",
    );
    e.done("direct:execute-too-many-args", &nobody, s).await;

    // Still usable after all that.
    let out = dev
        .execute(&exe, &[arg(&a, false), arg(&b, false)])
        .await
        .unwrap();
    let sum = dev.read(&out[0]).await.unwrap();
    assert_eq!(sum, f32_bytes(&[3.0; 4]));
}

async fn direct_tenant_cases(e: &mut Env) {
    let t = Tenant::new("direct-tenant", limits());

    let err = t.charge_tensors(&[u64::MAX, u64::MAX], 0).unwrap_err();
    assert_eq!(err.kind, ErrorKind::ResourceExhausted);
    assert!(err.message.contains("max-device-bytes"), "{}", err.message);
    e.done("tenant:byte-size-overflow", &t, err.to_string())
        .await;

    let held = t.charge_tensors(&[0; 16], 0).unwrap();
    let err = t.charge_tensors(&[0], 0).unwrap_err();
    assert_eq!(err.kind, ErrorKind::ResourceExhausted);
    assert!(err.message.contains("max-live-tensors"), "{}", err.message);
    drop(held);
    drop(t.charge_tensors(&[0; 16], 0).unwrap());
    e.done("tenant:live-tensors-then-free", &t, err.to_string())
        .await;

    let held: Vec<_> = (0..4).map(|_| t.charge_executable().unwrap()).collect();
    let err = t.charge_executable().unwrap_err();
    assert_eq!(err.kind, ErrorKind::ResourceExhausted);
    assert!(
        err.message.contains("max-live-executables"),
        "{}",
        err.message
    );
    drop(held);
    drop(t.charge_executable().unwrap());
    e.done("tenant:live-executables-then-free", &t, err.to_string())
        .await;

    let err = t.admit_compile(usize::MAX).unwrap_err();
    assert_eq!(err.kind, ErrorKind::ResourceExhausted);
    assert!(err.message.contains("max-program-bytes"), "{}", err.message);
    e.done("tenant:program-usize-max", &t, err.to_string())
        .await;

    let rate = Tenant::new(
        "direct-rate",
        TenantLimits {
            max_compiles_per_minute: 2,
            ..limits()
        },
    );
    rate.admit_compile(1).unwrap();
    rate.admit_compile(1).unwrap();
    let err = rate.admit_compile(1).unwrap_err();
    assert_eq!(err.kind, ErrorKind::ResourceExhausted);
    assert!(
        err.message.contains("max-compiles-per-minute"),
        "{}",
        err.message
    );
    assert_eq!(rate.usage().compiles, 2);
    e.done("tenant:compile-rate", &rate, err.to_string()).await;
}

async fn direct_wit_cases(e: &mut Env) {
    let host = &(Arc::clone(e.host.device()), Arc::clone(e.host.weights()));
    let t = Tenant::new("direct-wit", limits());
    let mut d = Direct::new(host, &t);

    let r = d.ctx().read(Resource::new_own(12345)).await;
    let s = wit_trap("wit:forged-tensor-read", r, "resource not present");
    e.done("wit:forged-tensor-read", &t, s).await;

    let r = HostTensor::drop(&mut d.ctx(), Resource::new_own(12345)).await;
    let s = wit_trap("wit:forged-tensor-drop", r, "resource not present");
    e.done("wit:forged-tensor-drop", &t, s).await;

    let r = HostTensor::spec(&mut d.ctx(), Resource::new_borrow(7)).await;
    let s = wit_trap("wit:forged-tensor-spec", r, "resource not present");
    e.done("wit:forged-tensor-spec", &t, s).await;

    let r = d
        .ctx()
        .execute(Resource::new_borrow(12345), vec![], vec![])
        .await;
    let s = wit_trap("wit:forged-executable", r, "resource not present");
    e.done("wit:forged-executable", &t, s).await;

    let exe = d.add().await;
    let a = d.tensor([1.0, 2.0, 3.0, 4.0]).await;
    let exe_b = Resource::<ExecutableHandle>::new_borrow(exe.rep());
    let a_b = Resource::<TensorHandle>::new_borrow(a.rep());
    let r = d
        .ctx()
        .execute(exe_b, vec![a_b, Resource::new_borrow(12345)], vec![])
        .await;
    let s = wit_trap("wit:forged-argument", r, "resource not present");
    assert_eq!(t.usage().live_tensors, 1, "the forged call charged nothing");
    drop(d);
    e.done("wit:forged-argument", &t, s).await;

    // An executable's handle used as a tensor.
    let mut d = Direct::new(host, &t);
    let exe = d.add().await;
    let r = d.ctx().read(Resource::new_borrow(exe.rep())).await;
    let s = wit_trap("wit:type-confusion", r, "another type");
    drop(d);
    e.done("wit:type-confusion", &t, s).await;

    // Dropping one handle twice.
    let mut d = Direct::new(host, &t);
    let a = d.tensor([1.0; 4]).await;
    let rep = a.rep();
    HostTensor::drop(&mut d.ctx(), a).await.unwrap();
    assert_eq!(t.usage().live_tensors, 0);
    let r = HostTensor::drop(&mut d.ctx(), Resource::new_own(rep)).await;
    let s = wit_trap("wit:double-drop", r, "resource not present");
    drop(d);
    e.done("wit:double-drop", &t, s).await;

    // A full handle table: the tensor made for the refused handle is not left charged.
    let mut d = Direct::new(host, &t);
    d.ctx().table().set_max_capacity(2);
    let _a = d.tensor([1.0; 4]).await;
    let _b = d.tensor([2.0; 4]).await;
    let r = d
        .ctx()
        .from_bytes(Dtype::F32, vec![2, 2], f32_bytes(&[3.0; 4]), None)
        .await;
    let s = wit_trap("wit:table-full", r, "no free keys");
    assert_eq!(t.usage().live_tensors, 2);
    assert_eq!(t.usage().device_bytes, 32);
    drop(d);
    e.done("wit:table-full", &t, s).await;

    let mut d = Direct::new(host, &t);
    let r = d
        .ctx()
        .from_bytes(Dtype::F64, vec![u64::MAX / 2, 4], vec![], None)
        .await;
    let s = wit_err("wit:dims-overflow", r, ErrorKind::InvalidArgument);
    e.done("wit:dims-overflow", &t, s).await;

    let r = d
        .ctx()
        .from_bytes(Dtype::U8, vec![1 << 21], vec![0; 1 << 21], None)
        .await;
    let s = wit_err(
        "wit:tensor-over-byte-limit",
        r,
        ErrorKind::ResourceExhausted,
    );
    assert!(s.contains("max-device-bytes"), "{s}");
    e.done("wit:tensor-over-byte-limit", &t, s).await;

    let a = d.tensor([1.0; 4]).await;
    let r = d
        .ctx()
        .copy_to_device(Resource::new_borrow(a.rep()), 9)
        .await;
    let s = wit_err("wit:copy-bad-device", r, ErrorKind::NotFound);
    assert_eq!(t.usage().live_tensors, 1, "the refused copy is not charged");
    drop(d);
    e.done("wit:copy-bad-device", &t, s).await;

    // Donation: of a weight, twice, and use after.
    let mut d = Direct::new(host, &t);
    let exe = d.add().await;
    let set = d.ctx().open("test".into()).await.expect("weights `test`");
    let w = d
        .ctx()
        .get(Resource::new_borrow(set.rep()), "w".into())
        .await
        .unwrap();
    let a = d.tensor([10.0, 20.0, 30.0, 40.0]).await;
    let b = |r: &Resource<TensorHandle>| Resource::<TensorHandle>::new_borrow(r.rep());
    let xb = || Resource::<ExecutableHandle>::new_borrow(exe.rep());
    let r = d.ctx().execute(xb(), vec![b(&w), b(&a)], vec![0]).await;
    let s = wit_err("wit:donate-weight", r, ErrorKind::PermissionDenied);
    e.step("wit:donate-weight", s).await;

    let r = d.ctx().execute(xb(), vec![b(&a), b(&w)], vec![0, 0]).await;
    let s = wit_err("wit:donate-listed-twice", r, ErrorKind::InvalidArgument);
    e.step("wit:donate-listed-twice", s).await;

    let out = d
        .ctx()
        .execute(xb(), vec![b(&a), b(&w)], vec![0])
        .await
        .expect("donating call");
    let sum = d.ctx().read(b(&out[0])).await.unwrap();
    assert_eq!(sum, f32_bytes(&[10.5, 19.0, 32.0, 48.0]));
    let r = d.ctx().read(b(&a)).await;
    let s = wit_err("wit:read-after-donate", r, ErrorKind::FailedPrecondition);
    e.step("wit:read-after-donate", s).await;

    let r = d.ctx().execute(xb(), vec![b(&a), b(&w)], vec![]).await;
    let s = wit_err("wit:execute-after-donate", r, ErrorKind::FailedPrecondition);
    e.step("wit:execute-after-donate", s).await;

    let r = d
        .ctx()
        .get(Resource::new_borrow(set.rep()), "nope".into())
        .await;
    let s = wit_err("wit:missing-weight-tensor", r, ErrorKind::NotFound);
    e.step("wit:missing-weight-tensor", s).await;

    let r = d.ctx().open("../test".into()).await;
    let s = wit_err("wit:missing-weight-set", r, ErrorKind::NotFound);
    assert_eq!(
        t.usage().live_tensors,
        2,
        "w and the sum (the donated handle gave its charge back)"
    );
    drop(d);
    e.done("wit:missing-weight-set", &t, s).await;
    assert_eq!(
        host.1.get("test").unwrap().device_bytes(),
        16,
        "the shared weights are intact"
    );
}

// ---------------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------------

/// Waits (yielding) until `cond` holds; panics if it never does. Not a timing assertion: the
/// bound only keeps a broken host from hanging the suite.
async fn wait_until<T>(
    what: &str,
    task: &tokio::task::JoinHandle<T>,
    mut cond: impl FnMut() -> bool,
) {
    for _ in 0..6000 {
        if cond() {
            return;
        }
        assert!(
            !task.is_finished(),
            "the background run ended before: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened: {what}");
}

/// Starts the probe as tenant `name` in the background with a long deadline.
fn spawn_probe(
    e: &Arc<Env>,
    name: &str,
    args: &[&str],
) -> (
    Arc<Tenant>,
    tokio::task::JoinHandle<anyhow::Result<RunOutcome>>,
) {
    let tenant = Tenant::new(name, limits());
    let mut o = opts(args, &tenant);
    o.deadline = Some(Duration::from_secs(120));
    let e = Arc::clone(e);
    let task = tokio::spawn(async move { e.host.run(&e.probe, "tpubox-probe", &o).await });
    (tenant, task)
}

/// Runs hello three times as tenant `b`, checking the numbers (through a scratch `Env`
/// borrowing the same host is not possible, so this repeats `serve_well_behaved`'s checks).
async fn three_hellos(e: &Env, b: &Arc<Tenant>) {
    for scale in [1.0f32, 2.0, -0.5] {
        let s = scale.to_string();
        let o = e
            .host
            .run(&e.hello, "hello-matmul", &opts(&["--scale", &s], b))
            .await
            .expect("hello runs");
        let out = text(&o.stdout);
        assert!(o.success, "{out}\n{}", text(&o.stderr));
        let got: Vec<Vec<f32>> = serde_json::from_str(line(&out, "result")).unwrap();
        let want = hello_expected(scale);
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((g - w).abs() <= 1e-5, "got {got:?}, want {want:?}");
        }
    }
    assert_eq!(b.usage().executions, 3);
    assert_nothing_held("tenant B", b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_tenant_does_not_block_others() {
    let e = Arc::new(env(2));
    // A holds an executable and four tensors, then spins until its deadline.
    let (a, task) = spawn_probe(&e, "spinner", &["abuse", "infinite-loop"]);
    wait_until("A holds its tensors", &task, || a.usage().live_tensors == 4).await;
    let b = Tenant::new("B", limits());
    three_hellos(&e, &b).await;
    assert!(!task.is_finished(), "A is still spinning after B finished");
    assert_eq!(a.usage().live_tensors, 4);
    // Ending A however (here: the embedder drops its run) returns its handles.
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_nothing_held("spinner", &a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_executing_in_a_loop_shares_one_slot_fairly() {
    let e = Arc::new(env(1));
    assert_eq!(e.host.device().scheduler().slots(), 1);
    // A executes a scalar add over and over, wanting the only execution slot all the time.
    let (a, task) = spawn_probe(&e, "busy", &["exec-loop", "100000000"]);
    wait_until("A is executing", &task, || a.usage().executions >= 100).await;
    let b = Tenant::new("B", limits());
    three_hellos(&e, &b).await;
    assert!(!task.is_finished(), "A is still executing after B finished");
    let before = a.usage().executions;
    wait_until("A keeps executing", &task, || a.usage().executions > before).await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_nothing_held("busy", &a);
}

// ---------------------------------------------------------------------------------------------
// The JavaScript guest under a live-tensor limit
// ---------------------------------------------------------------------------------------------

/// js-mlp's result for the 2-row table `a,b,c / 1,2,3 / 3,2,1`, from its specification
/// (docs/guests/): normalised rows are [-1, 0, 1] and [1, 0, -1].
fn js_expected() -> Vec<Vec<f64>> {
    let w1 = |k: usize, j: usize| f64::from((((3 * k + 5 * j) % 11) as f32 - 5.0) / 8.0);
    let b1 = |j: usize| f64::from((((j % 3) as f64 - 1.0) / 10.0) as f32);
    let w2 = |j: usize, m: usize| f64::from(((((7 * j + 3 * m) % 13) as f64 - 6.0) / 10.0) as f32);
    let b2 = |m: usize| f64::from((0.25 - 0.5 * m as f64) as f32);
    [[-1.0, 0.0, 1.0], [1.0, 0.0, -1.0]]
        .iter()
        .map(|x: &[f64; 3]| {
            let h: Vec<f64> = (0..8)
                .map(|j| (b1(j) + (0..3).map(|k| x[k] * w1(k, j)).sum::<f64>()).max(0.0))
                .collect();
            (0..2)
                .map(|m| b2(m) + (0..8).map(|j| h[j] * w2(j, m)).sum::<f64>())
                .collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_guest_runs_within_its_live_tensor_limit() {
    let mut config = config(2);
    // The JavaScript component carries a whole engine: keep its compiled code between runs.
    config.sandbox.cache_dir = Some(
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
            .join("tmp/adversarial-components"),
    );
    config.sandbox.tenant_limits.max_guest_memory = 256 << 20;
    let host = Host::new(config).expect("host starts");
    let js = tokio::task::block_in_place(|| host.load_component(&polyglot_wasm("js-mlp")))
        .expect("js-mlp loads");
    let csv = "a,b,c\n1,2,3\n3,2,1\n";
    let run = |max_live_tensors: u64| {
        let tenant = Tenant::new(
            format!("js-{max_live_tensors}"),
            TenantLimits {
                max_live_tensors,
                max_guest_memory: 256 << 20,
                ..limits()
            },
        );
        let mut o = opts(&["--csv", csv], &tenant);
        o.deadline = Some(Duration::from_secs(120));
        let host = &host;
        let js = &js;
        async move {
            let r = host.run(js, "js-mlp", &o).await.expect("js-mlp runs");
            assert_nothing_held("js-mlp", &tenant);
            r
        }
    };
    let o = run(1000).await;
    assert!(o.success, "{}", text(&o.stderr));
    let peak = o.usage.peak_live_tensors;
    // Five inputs and one output, each disposed of as soon as it is done with.
    assert_eq!(peak, 6);
    for limit in [peak + 1, peak] {
        let o = run(limit).await;
        let out = text(&o.stdout);
        assert!(o.success, "limit {limit}: {out}\n{}", text(&o.stderr));
        let got: Vec<Vec<f64>> = serde_json::from_str(line(&out, "result")).unwrap();
        let want = js_expected();
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs() + 1e-6,
                "got {got:?}, want {want:?}"
            );
        }
        assert_eq!(got.len(), 2);
        assert_eq!(o.usage.peak_live_tensors, peak);
    }
    // One below the peak: refused with the limit named, and the guest says so on one line.
    let o = run(peak - 1).await;
    let err = text(&o.stderr);
    assert!(!o.success);
    assert!(
        err.starts_with("js-mlp: error: ")
            && err.contains("resource-exhausted")
            && err.contains("max-live-tensors"),
        "{err}"
    );
    assert_eq!(o.usage.refused, 1);
}

// ---------------------------------------------------------------------------------------------
// The command line: a stopped guest ends `tpubox run`, whatever the device is doing
// ---------------------------------------------------------------------------------------------

/// Runs `tpubox run … tpubox-probe abuse run-stdin` with `program` on stdin; returns the exit
/// code, stderr and how long the process took. Panics if it has not exited after 120 s (the
/// bug this guards against is a process that never exits).
fn cli_run_stdin(flags: &[&str], program: &str) -> (Option<i32>, String, Duration) {
    use std::io::Write;
    let start = std::time::Instant::now();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tpubox"))
        .arg("run")
        .args(flags)
        .args(["--cache-mode", "off"])
        .arg(wasm("tpubox-probe"))
        .args(["--", "abuse", "run-stdin"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("tpubox starts");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(program.as_bytes())
        .unwrap();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            return (status.code(), err, start.elapsed());
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("tpubox run {flags:?} did not exit 120 s after its guest's deadline");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_stopped_guest_ends_tpubox_run_while_the_device_or_compiler_is_busy() {
    let endless = while_loop("      %p = stablehlo.constant dense<true> : tensor<i1>");
    let cases: [(&str, &[&str], String); 3] = [
        // The device runs a loop that never ends (a trusted tenant may compile it).
        ("endless-loop", &["--trusted", "--timeout", "2"], endless),
        // The device waits for an infeed nobody feeds.
        (
            "unfed-infeed",
            &["--trusted", "--timeout", "2"],
            INFEED.to_string(),
        ),
        // The compiler runs in this process and cannot be stopped (a chain that compiles for
        // several seconds without overflowing a thread's stack).
        (
            "compile-in-process",
            &["--compile-in-process", "--timeout", "2"],
            chain(6000),
        ),
    ];
    for (name, flags, program) in cases {
        let (code, err, took) = cli_run_stdin(flags, &program);
        println!(
            "{name}: exit {code:?} after {:.1} s: {}",
            took.as_secs_f64(),
            err.trim()
        );
        assert_eq!(code, Some(2), "{name}: {err}");
        assert!(err.contains("deadline"), "{name}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{name}: one line: {err}");
    }
}

/// A compile bomb meets the compile-time limit: a 20,000-op scalar chain (about 4 s to compile
/// on this project's 2-core machine) under a 0.5 s limit, through `tpubox exec`.
#[test]
fn a_compile_past_the_time_limit_is_stopped_with_the_limit_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut body = String::new();
    let mut prev = "%x".to_string();
    for i in 0..20_000 {
        body.push_str(&format!(
            "  %v{i} = stablehlo.add {prev}, %x : tensor<f32>\n"
        ));
        prev = format!("%v{i}");
    }
    let program = dir.path().join("chain.mlir");
    std::fs::write(
        &program,
        format!("func.func public @main(%x: tensor<f32>) -> tensor<f32> {{\n{body}  return {prev} : tensor<f32>\n}}\n"),
    )
    .unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_tpubox"))
        .args([
            "exec",
            "--cache-mode",
            "off",
            "--max-compile-seconds",
            "0.5",
        ])
        .arg(&program)
        .arg("--out")
        .arg(dir.path().join("out"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("resource-exhausted") && err.contains("max-compile-seconds"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
