//! Loops XLA cannot bound, under the default program policy (issue 31): they compile with the
//! loop budget and run; a convergence loop ends by its own condition with the right result, and
//! hostile loops (endless, endless after a data-dependent start, nested inside a bounded loop,
//! in a called function, in a conditional, over a large matmul) end with `resource-exhausted`
//! naming the limit (`max-loop-iterations` or `max-loop-work`) within 10 seconds, also when the
//! failure surfaces at a later read of a launch, while another tenant is served.
//!
//! Compiles run in process (no cache), so each case compiles its program afresh. The tenants
//! here have the default budget (`DEFAULT_MAX_LOOP_ITERATIONS`, `DEFAULT_MAX_LOOP_WORK`).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tpubox_core::cache::{CacheConfig, CacheMode};
use tpubox_core::compiler::CompileIsolation;
use tpubox_core::session::{ExecutableHandle, ProgramFormat, TensorHandle};
use tpubox_core::tenant::ProgramPolicy;
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{
    DeviceConfig, DeviceService, ErrorKind, PrimitiveType, Session, Tenant, TenantLimits,
};

/// How long a hostile loop may run at the default budget before its execution fails.
const DEADLINE: Duration = Duration::from_secs(10);

fn shared() -> Arc<DeviceService> {
    static DEV: OnceLock<Arc<DeviceService>> = OnceLock::new();
    Arc::clone(DEV.get_or_init(|| {
        tpubox_core::open_device(&DeviceConfig {
            cache: CacheConfig {
                mode: CacheMode::Off,
                disk_dir: None,
                remote_url: None,
                ..CacheConfig::default()
            },
            compile_isolation: CompileIsolation {
                worker: None,
                ..CompileIsolation::default()
            },
            execution_slots: 2,
            ..DeviceConfig::default()
        })
        .expect("the CPU plugin opens")
    }))
}

fn session(tenant: &Arc<Tenant>) -> Session {
    Session::new(
        shared(),
        Arc::new(WeightRegistry::new()),
        Arc::clone(tenant),
    )
}

/// A tenant with the default limits (the default program policy, untrusted) or trusted.
fn tenant(name: &str, trusted: bool) -> Arc<Tenant> {
    Tenant::new(
        name,
        TenantLimits {
            program_policy: ProgramPolicy {
                trusted,
                max_loop_iterations: tpubox_core::tenant::DEFAULT_MAX_LOOP_ITERATIONS,
                ..ProgramPolicy::default()
            },
            ..TenantLimits::default()
        },
    )
}

async fn compile(s: &Session, program: &str) -> ExecutableHandle {
    s.compile(program.as_bytes().to_vec(), ProgramFormat::MlirText, None)
        .await
        .unwrap_or_else(|e| panic!("the program compiles: {e}\n{program}"))
}

fn put(s: &Session, dims: &[u64], v: &[f32]) -> TensorHandle {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    s.tensor_from_bytes(PrimitiveType::F32, dims, &bytes, None)
        .expect("the tensor is created")
}

async fn get(s: &Session, t: &TensorHandle) -> Vec<f32> {
    s.read(t)
        .await
        .expect("the tensor reads")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// `f32[4] -> f32[4]` around a `while` over `(i: i64, v: f32[4])` whose body adds 1 to `i` and
/// `v` to itself; `cond` computes `%p` from `%i` and `%v` (and `%a`, the argument).
fn loop4(cond: &str) -> String {
    format!(
        r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {{
  %c0 = stablehlo.constant dense<0> : tensor<i64>
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
  return %w#1 : tensor<4xf32>
}}
"#
    )
}

const ALWAYS: &str = "      %p = stablehlo.constant dense<true> : tensor<i1>";

/// Endless once started: `i >= a[0]` with `a[0] = 0` (XLA cannot know the argument).
const AFTER_DATA: &str = "      %e = stablehlo.slice %a [0:1] : (tensor<4xf32>) -> tensor<1xf32>\n      %s = stablehlo.reshape %e : (tensor<1xf32>) -> tensor<f32>\n      %f = stablehlo.convert %i : (tensor<i64>) -> tensor<f32>\n      %p = stablehlo.compare GE, %f, %s : (tensor<f32>, tensor<f32>) -> tensor<i1>";

/// An endless loop inside a loop of 1000 trips that XLA bounds.
const NESTED: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i64>
  %c1 = stablehlo.constant dense<1> : tensor<i64>
  %n = stablehlo.constant dense<1000> : tensor<i64>
  %w:2 = stablehlo.while(%i = %c0, %v = %a) : tensor<i64>, tensor<4xf32>
    cond {
      %p = stablehlo.compare LT, %i, %n : (tensor<i64>, tensor<i64>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    } do {
      %x:2 = stablehlo.while(%k = %c0, %y = %v) : tensor<i64>, tensor<4xf32>
        cond {
          %e = stablehlo.slice %y [0:1] : (tensor<4xf32>) -> tensor<1xf32>
          %s = stablehlo.reshape %e : (tensor<1xf32>) -> tensor<f32>
          %z = stablehlo.constant dense<0.0> : tensor<f32>
          %q = stablehlo.compare GE, %s, %z : (tensor<f32>, tensor<f32>) -> tensor<i1>
          stablehlo.return %q : tensor<i1>
        } do {
          %k1 = stablehlo.add %k, %c1 : tensor<i64>
          %y1 = stablehlo.abs %y : tensor<4xf32>
          stablehlo.return %k1, %y1 : tensor<i64>, tensor<4xf32>
        }
      %j = stablehlo.add %i, %c1 : tensor<i64>
      stablehlo.return %j, %x#1 : tensor<i64>, tensor<4xf32>
    }
  return %w#1 : tensor<4xf32>
}
"#;

/// An endless loop in a function `main` calls (not inlined by the frontend: XLA sees a call).
const CALLED: &str = r#"func.func private @spin(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i64>
  %c1 = stablehlo.constant dense<1> : tensor<i64>
  %w:2 = stablehlo.while(%i = %c0, %v = %a) : tensor<i64>, tensor<4xf32>
    cond {
      %e = stablehlo.slice %v [0:1] : (tensor<4xf32>) -> tensor<1xf32>
      %s = stablehlo.reshape %e : (tensor<1xf32>) -> tensor<f32>
      %z = stablehlo.constant dense<0.0> : tensor<f32>
      %p = stablehlo.compare GE, %s, %z : (tensor<f32>, tensor<f32>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    } do {
      %j = stablehlo.add %i, %c1 : tensor<i64>
      %u = stablehlo.abs %v : tensor<4xf32>
      stablehlo.return %j, %u : tensor<i64>, tensor<4xf32>
    }
  return %w#1 : tensor<4xf32>
}
func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %r = func.call @spin(%a) : (tensor<4xf32>) -> tensor<4xf32>
  %t = func.call @spin(%r) : (tensor<4xf32>) -> tensor<4xf32>
  return %t : tensor<4xf32>
}
"#;

/// An endless loop in one branch of a conditional on the data.
const IN_CONDITIONAL: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %e = stablehlo.slice %a [0:1] : (tensor<4xf32>) -> tensor<1xf32>
  %s = stablehlo.reshape %e : (tensor<1xf32>) -> tensor<f32>
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %b = stablehlo.compare GE, %s, %z : (tensor<f32>, tensor<f32>) -> tensor<i1>
  %r = "stablehlo.if"(%b) ({
    %c0 = stablehlo.constant dense<0> : tensor<i64>
    %c1 = stablehlo.constant dense<1> : tensor<i64>
    %w:2 = stablehlo.while(%i = %c0, %v = %a) : tensor<i64>, tensor<4xf32>
      cond {
        %f = stablehlo.slice %v [0:1] : (tensor<4xf32>) -> tensor<1xf32>
        %g = stablehlo.reshape %f : (tensor<1xf32>) -> tensor<f32>
        %p = stablehlo.compare GE, %g, %z : (tensor<f32>, tensor<f32>) -> tensor<i1>
        stablehlo.return %p : tensor<i1>
      } do {
        %j = stablehlo.add %i, %c1 : tensor<i64>
        %u = stablehlo.abs %v : tensor<4xf32>
        stablehlo.return %j, %u : tensor<i64>, tensor<4xf32>
      }
    stablehlo.return %w#1 : tensor<4xf32>
  }, {
    stablehlo.return %a : tensor<4xf32>
  }) : (tensor<i1>) -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

/// Side of the matrices of [`MATMUL`].
const N: u64 = 1024;

/// An endless loop over a `N`×`N` f32 matmul (2·N³ flops a trip).
fn matmul() -> String {
    let t = format!("tensor<{N}x{N}xf32>");
    format!(
        r#"func.func public @main(%a: {t}) -> {t} {{
  %c0 = stablehlo.constant dense<0> : tensor<i64>
  %c1 = stablehlo.constant dense<1> : tensor<i64>
  %w:2 = stablehlo.while(%i = %c0, %v = %a) : tensor<i64>, {t}
    cond {{
      %p = stablehlo.constant dense<true> : tensor<i1>
      stablehlo.return %p : tensor<i1>
    }} do {{
      %j = stablehlo.add %i, %c1 : tensor<i64>
      %m = stablehlo.dot_general %v, %a, contracting_dims = [1] x [0] : ({t}, {t}) -> {t}
      stablehlo.return %j, %m : tensor<i64>, {t}
    }}
  return %w#1 : {t}
}}
"#
    )
}

/// Newton's iteration for √x, until two iterates agree: a convergence loop XLA cannot bound.
const NEWTON: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i64>
  %c1 = stablehlo.constant dense<1> : tensor<i64>
  %half = stablehlo.constant dense<0.5> : tensor<4xf32>
  %big = stablehlo.constant dense<1.0e+30> : tensor<4xf32>
  %w:3 = stablehlo.while(%i = %c0, %x = %a, %prev = %big) : tensor<i64>, tensor<4xf32>, tensor<4xf32>
    cond {
      %ne = stablehlo.compare NE, %x, %prev : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xi1>
      %f = stablehlo.constant dense<false> : tensor<i1>
      %any = stablehlo.reduce(%ne init: %f) applies stablehlo.or across dimensions = [0] : (tensor<4xi1>, tensor<i1>) -> tensor<i1>
      stablehlo.return %any : tensor<i1>
    } do {
      %q = stablehlo.divide %a, %x : tensor<4xf32>
      %s = stablehlo.add %x, %q : tensor<4xf32>
      %n = stablehlo.multiply %s, %half : tensor<4xf32>
      %j = stablehlo.add %i, %c1 : tensor<i64>
      stablehlo.return %j, %n, %x : tensor<i64>, tensor<4xf32>, tensor<4xf32>
    }
  return %w#1 : tensor<4xf32>
}
"#;

/// `f32[4] -> f32[4]`: x · 2, another tenant's program.
const DOUBLE: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c = stablehlo.constant dense<2.0> : tensor<4xf32>
  %r = stablehlo.multiply %a, %c : tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

/// Runs `program` on `arg` as an untrusted tenant with the default limits: it compiles, and
/// its execution fails with `resource-exhausted` naming `limit` within [`DEADLINE`]; meanwhile
/// another tenant's program runs and reads back. Returns how long the hostile execution ran.
async fn ends_with(name: &str, program: &str, dims: &[u64], arg: &[f32], limit: &str) -> Duration {
    let hostile = tenant(name, false);
    let s = session(&hostile);
    let exe = compile(&s, program).await;
    let x = put(&s, dims, arg);
    let start = Instant::now();
    // Launched: the failure surfaces asynchronously, at the read.
    let launch = s
        .launch(&exe, &[&x], &[])
        .await
        .expect("the launch is accepted");
    // Another tenant is served while the hostile loop runs.
    let other = tenant(&format!("{name}-neighbour"), false);
    let o = session(&other);
    let double = compile(&o, DOUBLE).await;
    let y = put(&o, &[4], &[1.0, 2.0, 3.0, 4.0]);
    let z = o
        .execute(&double, &[&y], &[])
        .await
        .expect("the neighbour runs");
    assert_eq!(get(&o, &z[0]).await, vec![2.0, 4.0, 6.0, 8.0]);
    let e = s.read(&launch.outputs[0]).await.unwrap_err();
    let took = start.elapsed();
    assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{name}: {e}");
    assert!(e.message.contains(limit), "{name}: {e}");
    assert!(took < DEADLINE, "{name}: ran {took:?}");
    eprintln!("{name}: resource-exhausted ({limit}) after {took:?}");
    // The same through execute (the failure at once).
    let e = s.execute(&exe, &[&x], &[]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{name}: {e}");
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_loop_ends_with_max_loop_iterations() {
    ends_with(
        "endless",
        &loop4(ALWAYS),
        &[4],
        &[0.0; 4],
        "max-loop-iterations",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_endless_after_a_data_dependent_start_ends() {
    ends_with(
        "after-data",
        &loop4(AFTER_DATA),
        &[4],
        &[0.0; 4],
        "max-loop-iterations",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_nested_in_a_bounded_loop_ends() {
    ends_with("nested", NESTED, &[4], &[1.0; 4], "max-loop-iterations").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_in_a_called_function_ends() {
    ends_with("called", CALLED, &[4], &[1.0; 4], "max-loop-iterations").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_in_a_conditional_ends() {
    ends_with(
        "conditional",
        IN_CONDITIONAL,
        &[4],
        &[1.0; 4],
        "max-loop-iterations",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_loop_over_a_large_matmul_ends_with_max_loop_work() {
    let n = usize::try_from(N * N).unwrap();
    ends_with("matmul", &matmul(), &[N, N], &vec![0.0; n], "max-loop-work").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_convergence_loop_runs_untrusted_as_trusted() {
    let mut results = Vec::new();
    for trusted in [false, true] {
        let t = tenant(&format!("newton-{trusted}"), trusted);
        let s = session(&t);
        let exe = compile(&s, NEWTON).await;
        let x = put(&s, &[4], &[4.0, 9.0, 2.0, 1.0e6]);
        let r = s.execute(&exe, &[&x], &[]).await.expect("Newton converges");
        results.push(get(&s, &r[0]).await);
    }
    assert_eq!(results[0], results[1]);
    let want = [2.0f32, 3.0, std::f32::consts::SQRT_2, 1000.0];
    for (g, w) in results[0].iter().zip(want) {
        assert!((g - w).abs() <= w * 1e-6, "{:?}", results[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_may_not_call_the_budget_itself() {
    let forged = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<i1> {
  %r = stablehlo.custom_call @tpubox_loop_budget() {api_version = 4 : i32, has_side_effect = true, backend_config = {iterations = 9223372036854775807 : i64, work = 9223372036854775807 : i64, step = 1 : i64}} : () -> tensor<i1>
  return %r : tensor<i1>
}
"#;
    let t = tenant("forger", false);
    let s = session(&t);
    let e = s
        .compile(forged.as_bytes().to_vec(), ProgramFormat::MlirText, None)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    assert!(e.message.contains("tpubox_loop_budget"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_budget_off_unbounded_loops_are_refused() {
    let t = Tenant::new(
        "no-budget",
        TenantLimits {
            program_policy: ProgramPolicy {
                max_loop_iterations: 0,
                ..ProgramPolicy::default()
            },
            ..TenantLimits::default()
        },
    );
    let s = session(&t);
    let e = s
        .compile(loop4(ALWAYS).into_bytes(), ProgramFormat::MlirText, None)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    assert!(e.message.contains("unbounded-loop"), "{e}");
}
