//! Launches without waiting (issue 28, items 1 and 2): `Session::launch`, `wait`, `wait_all`,
//! the blocking switch, `max-pending-launches`, donation at launch and sessions that end with
//! launches pending. Each case asserts exact error kinds and what the error names; none
//! asserts a duration (the timing facts are in the bench `launch`).
//!
//! A failure at execution is injected with the test-only custom call
//! `tpubox_test_fail` (`pjrt_kernels::TEST_FAIL`), registered because the device is opened
//! with `DeviceConfig::test_custom_calls` and compiled in process (compile workers do not
//! register it).
//!
//! The device's execution slots are held by the test itself where a case needs launches to
//! stay queued ([`FairShare::acquire`]): that keeps them pending deterministically, whatever
//! the machine's speed.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tpubox_core::cache::{CacheConfig, CacheMode};
use tpubox_core::compiler::CompileIsolation;
use tpubox_core::session::{ExecutableHandle, ProgramFormat};
use tpubox_core::tenant::ProgramPolicy;
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{DeviceConfig, DeviceService, ErrorKind, Session, Tenant, TenantLimits};

/// `f32[4] -> f32[4]`: x · 2.
const DOUBLE: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c = stablehlo.constant dense<2.0> : tensor<4xf32>
  %r = stablehlo.multiply %a, %c : tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

/// `f32[4], f32[4] -> f32[4]`: a + b.
const ADD: &str = r#"func.func public @main(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %r = stablehlo.add %a, %b : tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

/// `f32[4] -> f32[4]` that compiles and fails at execution (the test-only custom call).
const FAILS: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %r = stablehlo.custom_call @tpubox_test_fail(%a) {api_version = 4 : i32} : (tensor<4xf32>) -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

/// A device with two execution slots, in-process compiles, no compile cache and the
/// test-only custom call; `blocking` sets the host's launch-blocking switch.
fn device(blocking: bool) -> Arc<DeviceService> {
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
        launch_blocking: blocking,
        test_custom_calls: true,
        ..DeviceConfig::default()
    })
    .expect("the CPU plugin opens")
}

/// The shared device of this suite (the host's switch off).
fn shared() -> Arc<DeviceService> {
    static DEV: OnceLock<Arc<DeviceService>> = OnceLock::new();
    Arc::clone(DEV.get_or_init(|| device(false)))
}

/// Limits of this suite's tenants: small, with the test-only custom call allowed.
fn limits(max_pending_launches: u64) -> TenantLimits {
    let mut policy = ProgramPolicy::default();
    policy
        .allowed_custom_calls
        .push("tpubox_test_fail".to_string());
    TenantLimits {
        max_device_bytes: 1 << 20,
        max_live_tensors: 64,
        max_pending_launches,
        program_policy: policy,
        ..TenantLimits::default()
    }
}

fn session(dev: &Arc<DeviceService>, tenant: &Arc<Tenant>) -> Session {
    Session::new(
        Arc::clone(dev),
        Arc::new(WeightRegistry::new()),
        Arc::clone(tenant),
    )
}

async fn compile(s: &Session, program: &str) -> ExecutableHandle {
    s.compile(program.as_bytes().to_vec(), ProgramFormat::MlirText, None)
        .await
        .expect("the program compiles")
}

use crate::support::{put4 as put, read_f32 as get};

/// Polls `cond` every 10 ms; the bound (60 s) only keeps a broken host from hanging the suite.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..6000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened: {what}");
}

/// Waits until `tenant` holds nothing: no device bytes, tensors, executables, launches or
/// running executions.
async fn nothing_held(what: &str, tenant: &Tenant) {
    eventually(what, || {
        let u = tenant.usage();
        u.device_bytes == 0
            && u.live_tensors == 0
            && u.live_executables == 0
            && u.pending_launches == 0
            && u.executions_running == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_returns_outputs_whose_values_equal_execute() {
    let dev = shared();
    let tenant = Tenant::new("launch-values", limits(16));
    {
        let s = session(&dev, &tenant);
        let double = compile(&s, DOUBLE).await;
        let add = compile(&s, ADD).await;
        let x = put(&s, [1.0, -2.0, 0.5, 8.0]);
        // A chain of launches, each taking the previous one's (possibly pending) output.
        let y = s.launch(&double, &[&x], &[]).await.unwrap();
        assert_eq!(y.outputs.len(), 1);
        assert_eq!(y.outputs[0].spec().dims, vec![4]);
        let z = s.launch(&add, &[&y.outputs[0], &x], &[]).await.unwrap();
        assert!(z.id > y.id, "launch ids increase");
        // x·2 + x, read without an explicit wait (a read waits).
        let launched = get(&s, &z.outputs[0]).await;
        assert_eq!(launched, vec![3.0, -6.0, 1.5, 24.0]);
        assert!(!z.outputs[0].is_pending() && z.outputs[0].launch_id().is_none());
        // The same through execute.
        let e = s.execute(&double, &[&x], &[]).await.unwrap();
        let executed = s.execute(&add, &[&e[0], &x], &[]).await.unwrap();
        assert_eq!(get(&s, &executed[0]).await, launched);
        // wait and wait_all with nothing failed.
        s.wait(&y.outputs[0]).await.unwrap();
        s.wait_all().await.unwrap();
        assert_eq!(get(&s, &y.outputs[0]).await, vec![2.0, -4.0, 1.0, 16.0]);
        let u = tenant.usage();
        assert_eq!((u.pending_launches, u.executions), (0, 4), "{u:?}");
    }
    nothing_held("launch-values ends", &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_at_execution_surfaces_at_the_first_read_naming_the_launch() {
    let dev = shared();
    let tenant = Tenant::new("launch-fails", limits(16));
    {
        let s = session(&dev, &tenant);
        let fails = compile(&s, FAILS).await;
        let double = compile(&s, DOUBLE).await;
        let fingerprint = fails.executable().fingerprint().to_string();
        let x = put(&s, [1.0, 2.0, 3.0, 4.0]);
        // The launch itself succeeds: the program is valid, the device fails later.
        let first = s.launch(&fails, &[&x], &[]).await.unwrap();
        let second = s.launch(&fails, &[&x], &[]).await.unwrap();
        // A launch that takes the failed launch's output.
        let after = s.launch(&double, &[&first.outputs[0]], &[]).await.unwrap();

        let e = s.read(&first.outputs[0]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::ExecutionFailed, "{e}");
        let name = format!("launch {} of program {fingerprint}", first.id);
        assert!(e.message.contains(&name), "{e}");
        assert!(e.message.contains("tpubox_test_fail"), "{e}");
        // Every later wait or read of that output fails the same way.
        let again = s.wait(&first.outputs[0]).await.unwrap_err();
        assert_eq!(again, e);

        // wait_all reports the failures not yet reported: the second launch and the one
        // after the first, not the first (its read reported it).
        let all = s.wait_all().await.unwrap_err();
        assert_eq!(all.kind, ErrorKind::ExecutionFailed, "{all}");
        assert!(
            all.message.contains(&format!("launch {} ", second.id))
                && all.message.contains("1 later launch(es) failed too"),
            "{all}"
        );
        s.wait_all().await.unwrap();
        let dep = s.read(&after.outputs[0]).await.unwrap_err();
        assert_eq!(dep.kind, ErrorKind::ExecutionFailed, "{dep}");
        assert!(
            dep.message.contains(&format!("launch {} ", after.id)),
            "{dep}"
        );

        // execute is launch + wait: the error comes back from it, naming its launch.
        let e = s.execute(&fails, &[&x], &[]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::ExecutionFailed, "{e}");
        assert!(
            e.message.contains("launch ") && e.message.contains(&fingerprint),
            "{e}"
        );
        // The session goes on serving.
        let ok = s.execute(&double, &[&x], &[]).await.unwrap();
        assert_eq!(get(&s, &ok[0]).await, vec![2.0, 4.0, 6.0, 8.0]);
    }
    nothing_held("launch-fails ends", &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_blocking_switch_surfaces_the_failure_at_the_launch() {
    // Per session.
    let dev = shared();
    let tenant = Tenant::new("launch-blocking", limits(16));
    {
        let s = session(&dev, &tenant);
        let fails = compile(&s, FAILS).await;
        let double = compile(&s, DOUBLE).await;
        let x = put(&s, [1.0, 2.0, 3.0, 4.0]);
        assert!(!s.launch_blocking());
        s.set_launch_blocking(true);
        assert!(s.launch_blocking());
        let e = s.launch(&fails, &[&x], &[]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::ExecutionFailed, "{e}");
        assert!(
            e.message.contains("launch ") && e.message.contains("failed"),
            "{e}"
        );
        // Reported at the launch, so wait_all has nothing left to report.
        s.wait_all().await.unwrap();
        // A launch that succeeds returns finished outputs.
        let ok = s.launch(&double, &[&x], &[]).await.unwrap();
        assert!(!ok.outputs[0].is_pending());
        assert_eq!(get(&s, &ok.outputs[0]).await, vec![2.0, 4.0, 6.0, 8.0]);
        s.set_launch_blocking(false);
        // Off again: the launch succeeds and the failure waits for the read.
        let later = s.launch(&fails, &[&x], &[]).await.unwrap();
        let e = s.read(&later.outputs[0]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::ExecutionFailed, "{e}");
    }
    nothing_held("launch-blocking ends", &tenant).await;

    // The host's switch, for every session whatever its own says.
    let dev = device(true);
    let tenant = Tenant::new("launch-blocking-host", limits(16));
    {
        let s = session(&dev, &tenant);
        assert!(s.launch_blocking());
        s.set_launch_blocking(false);
        assert!(s.launch_blocking(), "the host's switch wins");
        let fails = compile(&s, FAILS).await;
        let x = put(&s, [1.0, 2.0, 3.0, 4.0]);
        let e = s.launch(&fails, &[&x], &[]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::ExecutionFailed, "{e}");
        assert!(e.message.contains("tpubox_test_fail"), "{e}");
    }
    nothing_held("launch-blocking-host ends", &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_that_never_waits_hits_max_pending_launches_and_others_are_served() {
    // A device of its own, so that holding its slots stalls no other test.
    let dev = device(false);
    let flooder = Tenant::new("launch-flooder", limits(4));
    let other = Tenant::new("launch-other", limits(4));
    let holder = Tenant::new("launch-holder", limits(4));
    let s = session(&dev, &flooder);
    let o = session(&dev, &other);
    let double = compile(&s, DOUBLE).await;
    let other_double = compile(&o, DOUBLE).await;
    let x = put(&s, [1.0, 2.0, 3.0, 4.0]);
    let y = put(&o, [0.5, 0.5, 0.5, 0.5]);
    // Hold every execution slot, so that the flooder's launches stay pending.
    let held: Vec<_> = futures_hold(&dev, &holder).await;
    let mut launched = Vec::new();
    let refused = loop {
        match s.launch(&double, &[&x], &[]).await {
            Ok(l) => launched.push(l),
            Err(e) => break e,
        }
        assert!(launched.len() <= 4, "the limit was not enforced");
    };
    assert_eq!(launched.len(), 4);
    assert_eq!(refused.kind, ErrorKind::ResourceExhausted, "{refused}");
    assert!(
        refused.message.contains("max-pending-launches")
            && refused.message.contains("launch-flooder"),
        "{refused}"
    );
    // Nothing was charged for the refused launch.
    assert_eq!(flooder.usage().pending_launches, 4);
    assert_eq!(flooder.usage().live_tensors, 1 + 4);
    assert!(launched.iter().all(|l| l.outputs[0].is_pending()));
    // The other tenant is served as soon as a slot is free, while the flooder still has
    // launches pending (its queue asks for one slot at a time).
    drop(held);
    let out = o.execute(&other_double, &[&y], &[]).await.unwrap();
    assert_eq!(get(&o, &out[0]).await, vec![1.0; 4]);
    // Waiting drains the flooder's queue, and then it may launch again.
    s.wait_all().await.unwrap();
    assert_eq!(flooder.usage().pending_launches, 0);
    for l in &launched {
        assert_eq!(get(&s, &l.outputs[0]).await, vec![2.0, 4.0, 6.0, 8.0]);
    }
    s.launch(&double, &[&x], &[]).await.unwrap();
    s.wait_all().await.unwrap();
}

/// Takes every execution slot of `dev` for `tenant`.
async fn futures_hold(
    dev: &Arc<DeviceService>,
    tenant: &Arc<Tenant>,
) -> Vec<tpubox_core::scheduler::Slot> {
    let mut v = Vec::new();
    for _ in 0..dev.scheduler().slots() {
        v.push(dev.scheduler().acquire(tenant).await);
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_ends_with_launches_pending_leaks_nothing() {
    let dev = device(false);
    let tenant = Tenant::new("launch-leaver", limits(32));
    let holder = Tenant::new("launch-holder-2", limits(4));
    let held = futures_hold(&dev, &holder).await;
    {
        let s = session(&dev, &tenant);
        let double = compile(&s, DOUBLE).await;
        let add = compile(&s, ADD).await;
        let x = put(&s, [1.0, 2.0, 3.0, 4.0]);
        let mut last = s.launch(&double, &[&x], &[]).await.unwrap();
        for i in 0..10 {
            // Chains of pending outputs, some donated.
            let donate: &[u32] = if i % 2 == 0 { &[0] } else { &[] };
            last = s
                .launch(&add, &[&last.outputs[0], &x], donate)
                .await
                .unwrap();
        }
        assert!(tenant.usage().pending_launches == 11);
        // The session, its handles and its executables end here, launches unsubmitted.
        drop(last);
    }
    drop(held);
    nothing_held("the pending launches of an ended session", &tenant).await;

    // And with launches submitted and running when it ends.
    {
        let s = session(&dev, &tenant);
        let double = compile(&s, DOUBLE).await;
        for _ in 0..8 {
            let x = put(&s, [1.0, 2.0, 3.0, 4.0]);
            let y = s.launch(&double, &[&x], &[]).await.unwrap();
            s.launch(&double, &[&y.outputs[0]], &[0]).await.unwrap();
        }
    }
    nothing_held("the running launches of an ended session", &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn donation_is_final_at_launch() {
    let dev = shared();
    let tenant = Tenant::new("launch-donor", limits(16));
    {
        let s = session(&dev, &tenant);
        let fails = compile(&s, FAILS).await;
        let double = compile(&s, DOUBLE).await;
        // Donated to a launch that will fail: emptied at once, and it stays emptied.
        let x = put(&s, [1.0, 2.0, 3.0, 4.0]);
        let l = s.launch(&fails, &[&x], &[0]).await.unwrap();
        assert!(x.is_donated());
        let e = s.read(&x).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::FailedPrecondition, "{e}");
        let e = s.wait(&l.outputs[0]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::ExecutionFailed, "{e}");
        assert!(
            x.is_donated(),
            "donation is final even though the execution failed"
        );
        // A donated handle cannot be launched again.
        let e = s.launch(&double, &[&x], &[]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::FailedPrecondition, "{e}");
        // Donating a pending output to the next launch of a chain.
        let y = put(&s, [1.0, 2.0, 3.0, 4.0]);
        let a = s.launch(&double, &[&y], &[0]).await.unwrap();
        let b = s.launch(&double, &[&a.outputs[0]], &[0]).await.unwrap();
        assert!(y.is_donated() && a.outputs[0].is_donated());
        assert_eq!(get(&s, &b.outputs[0]).await, vec![4.0, 8.0, 12.0, 16.0]);
        // The charges: only l's and b's outputs are held once the device is done.
        s.wait_all().await.unwrap();
        eventually("the donated inputs' charges come back", || {
            let u = tenant.usage();
            u.live_tensors == 2 && u.device_bytes == 32 && u.pending_launches == 0
        })
        .await;
        drop(l);
    }
    nothing_held("launch-donor ends", &tenant).await;
}

// ---------------------------------------------------------------------------------------------
// From guests: the probe's `launch` cases (WIT 0.1.1) and a guest built against WIT 0.1.0
// ---------------------------------------------------------------------------------------------

/// A Wasm host for the guest cases: in-process compiles (the test-only custom call is
/// registered in this process only), the test-only custom call allowed by default.
fn guest_host() -> tpubox_wasm::Host {
    let mut config = crate::support::test_host_config();
    config.compile_isolation.worker = None;
    config.test_custom_calls = true;
    config.cache.mode = CacheMode::Off;
    config.sandbox.tenant_limits = limits(8);
    tpubox_wasm::Host::new(config).expect("the host starts on the CPU plugin")
}

async fn run_guest(
    host: &tpubox_wasm::Host,
    component: &wasmtime::component::Component,
    args: &[&str],
    tenant: &Arc<Tenant>,
) -> String {
    crate::support::run_guest(host, component, args, tenant, None).await
}

use crate::support::line;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_launch_wait_and_see_failures_naming_the_launch() {
    let host = guest_host();
    let probe = host
        .load_component(&crate::support::wasm("tpubox-probe"))
        .expect("probe loads");
    let tenant = Tenant::new("guest-launch", limits(8));

    let out = run_guest(&host, &probe, &["launch", "chain"], &tenant).await;
    assert_eq!(
        line(&out, "chain"),
        "[32.0, -64.0, 16.0, 256.0] same-as-execute=true"
    );
    assert_eq!(line(&out, "chain-wait-all"), "ok");

    // The failure surfaces at the first read, naming the launch.
    let out = run_guest(&host, &probe, &["launch", "fail"], &tenant).await;
    let launched = line(&out, "fail-launch");
    let mut parts = launched.split(' ');
    assert_eq!(parts.next(), Some("ok"), "{out}");
    let (id, fingerprint) = (parts.next().unwrap(), parts.next().unwrap());
    let read = line(&out, "fail-read");
    let named = format!("execution-failed (launch {id} of program {fingerprint} failed: ");
    assert!(read.starts_with(&named), "{read}");
    assert!(line(&out, "fail-wait").starts_with(&named), "{out}");

    // With the blocking switch, at the launch.
    let out = run_guest(&host, &probe, &["launch", "blocking"], &tenant).await;
    let fingerprint = line(&out, "fail-fingerprint");
    let failed = line(&out, "fail-launch");
    assert!(
        failed.starts_with("execution-failed (launch ")
            && failed.contains(&format!("of program {fingerprint} failed: ")),
        "{out}"
    );
    nothing_held("the guest tenant after its runs", &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_never_waits_is_refused_at_max_pending_launches_and_leaks_nothing() {
    let host = guest_host();
    let probe = host
        .load_component(&crate::support::wasm("tpubox-probe"))
        .expect("probe loads");
    let flooder = Tenant::new("guest-flooder", limits(8));
    let holder = Tenant::new("guest-holder", limits(8));
    // Every slot held: the flooder's launches stay queued whatever the machine's speed.
    let held = futures_hold(host.device(), &holder).await;
    let out = run_guest(&host, &probe, &["launch", "flood"], &flooder).await;
    assert_eq!(line(&out, "flood-accepted"), "8", "{out}");
    let refused = line(&out, "flood-refused");
    assert!(
        refused.starts_with("resource-exhausted (")
            && refused.contains("max-pending-launches")
            && refused.contains("guest-flooder"),
        "{refused}"
    );
    drop(held);
    // The guest ended with 8 launches pending: all released.
    nothing_held("the flooder after its run ended", &flooder).await;
    // And the host serves another tenant.
    let other = Tenant::new("guest-other", limits(8));
    let out = run_guest(&host, &probe, &["launch", "chain"], &other).await;
    assert!(
        line(&out, "chain").ends_with("same-as-execute=true"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_built_against_wit_0_1_0_still_links_and_runs() {
    let host = guest_host();
    let old = host
        .load_component(&crate::support::wasm("tpubox-wit-0-1-0"))
        .expect("the 0.1.0 guest loads");
    let tenant = Tenant::new("guest-0-1-0", limits(8));
    let out = run_guest(&host, &old, &[], &tenant).await;
    assert_eq!(line(&out, "wit-0-1-0"), "[2.0, -4.0, 1.0, 16.0]");
}
