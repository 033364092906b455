//! Programs over several devices through the session layer (issue 45): SPMD compiles
//! (`CompileSettings::devices`), global arrays put and read by the program's shardings,
//! `Session::execute_spmd` with a collective, charges per shard, and the hostile cases with
//! their exact error kinds. Four CPU devices stand in for a TPU host's chips (JAX tests its own
//! multi-device code the same way). The reference values are computed here with plain loops.

use std::sync::Arc;

use tpubox_core::placement::Placement;
use tpubox_core::session::{ExecutableHandle, ProgramFormat};
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{CompileSettings, DeviceService, ErrorKind};
use tpubox_core::{PrimitiveType, Session, Tenant, TenantLimits};

/// `a` split by rows over 4 devices (GSPMD annotations, as `jax.export` writes them without
/// Shardy), `b` replicated; returns `a + b` (split by rows) and the sum of `a` (replicated: an
/// all-reduce the partitioner inserts).
const GSPMD: &str = include_str!("../programs/spmd_gspmd4.mlir");

/// `shard_map(psum)` as Shardy writes it: each device sums the four row blocks of `x`.
const PSUM: &str = include_str!("../programs/spmd_psum4.mlir");

/// A row-split parameter donated to its row-split result (`x * x`).
const DONATE: &str = r#"
module @donate attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a: tensor<8xf32> {mhlo.sharding = "{devices=[4]<=[4]}", tf.aliasing_output = 0 : i32}) -> (tensor<8xf32> {mhlo.sharding = "{devices=[4]<=[4]}"}) {
    %0 = stablehlo.multiply %a, %a : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
"#;

fn four() -> Arc<DeviceService> {
    crate::support::four_devices()
}

fn session(tenant: &Arc<Tenant>, devices: Vec<u32>) -> Session {
    Session::new(four(), Arc::new(WeightRegistry::new()), Arc::clone(tenant))
        .with_placement(Placement::fixed(devices))
}

async fn compile(s: &Session, program: &str, devices: &[u32]) -> ExecutableHandle {
    s.compile_with(
        program.as_bytes().to_vec(),
        ProgramFormat::MlirText,
        CompileSettings {
            device: devices[0],
            devices: devices.to_vec(),
            ..CompileSettings::default()
        },
    )
    .await
    .expect("the program compiles for the devices")
}

/// Asserts that `tenant` holds nothing: no device bytes, tensors, executables or launches.
fn assert_nothing_held(tenant: &Tenant) {
    let u = tenant.usage();
    assert_eq!(
        (
            u.device_bytes,
            u.live_tensors,
            u.live_executables,
            u.pending_launches
        ),
        (0, 0, 0, 0),
        "{u:?}"
    );
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_program_runs_on_four_devices_with_its_collective() {
    let tenant = Tenant::new("spmd", TenantLimits::default());
    {
        let s = session(&tenant, vec![0, 1, 2, 3]);
        let exe = compile(&s, GSPMD, &[0, 1, 2, 3]).await;
        let program = exe.executable();
        assert_eq!(program.devices(), &[0, 1, 2, 3]);
        let sh = program.shardings().unwrap();
        assert_eq!(sh.params[0].to_string(), "{devices=[4,1]<=[4]}");
        assert_eq!(sh.global_inputs[0].dims, vec![8, 3]);
        assert_eq!(program.inputs()[0].dims, vec![2, 3]);
        let a: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..24).map(|i| 100.0 + i as f32).collect();
        let a_h = s
            .put_sharded(&exe, 0, PrimitiveType::F32, &[8, 3], &f32_bytes(&a))
            .unwrap();
        let b_h = s
            .put_sharded(&exe, 1, PrimitiveType::F32, &[8, 3], &f32_bytes(&b))
            .unwrap();
        // Charged per shard, on its device: a's shard (24 bytes) and b's replica (96 bytes).
        let by: Vec<(u32, u64)> = tenant
            .usage()
            .device_bytes_by_device
            .iter()
            .map(|d| (d.device, d.bytes))
            .collect();
        assert_eq!(by, vec![(0, 120), (1, 120), (2, 120), (3, 120)]);
        let out = s
            .execute_spmd(&exe, &[a_h.iter().collect(), b_h.iter().collect()], &[])
            .await
            .unwrap();
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|r| r.len() == 4));
        let sum = f32s(&s.read_sharded(&exe, 0, &out[0]).await.unwrap());
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_eq!(sum, want);
        let total = f32s(&s.read_sharded(&exe, 1, &out[1]).await.unwrap());
        assert_eq!(total, vec![a.iter().sum::<f32>()]);
        // Every device holds the replicated total.
        for h in &out[1] {
            assert_eq!(f32s(&s.read(h).await.unwrap()), vec![276.0]);
        }

        let psum = compile(&s, PSUM, &[0, 1, 2, 3]).await;
        let x_h = s
            .put_sharded(&psum, 0, PrimitiveType::F32, &[8, 3], &f32_bytes(&a))
            .unwrap();
        let r = s
            .execute_spmd(&psum, &[x_h.iter().collect()], &[])
            .await
            .unwrap();
        let got = f32s(&s.read_sharded(&psum, 0, &r[0]).await.unwrap());
        let want: Vec<f32> = (0..6)
            .map(|j| (0..4).map(|blk| a[blk * 6 + j]).sum())
            .collect();
        assert_eq!(got, want);
    }
    let u = tenant.usage();
    assert_eq!(
        (u.device_bytes, u.live_tensors, u.live_executables),
        (0, 0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn donation_is_per_shard_and_final() {
    let tenant = Tenant::new("spmd-donate", TenantLimits::default());
    let s = session(&tenant, vec![0, 1, 2, 3]);
    let exe = compile(&s, DONATE, &[0, 1, 2, 3]).await;
    let x: Vec<f32> = (1..=8).map(|i| i as f32).collect();
    let h = s
        .put_sharded(&exe, 0, PrimitiveType::F32, &[8], &f32_bytes(&x))
        .unwrap();
    let out = s
        .execute_spmd(&exe, &[h.iter().collect()], &[0])
        .await
        .unwrap();
    assert!(h.iter().all(|t| t.is_donated()));
    let sq = f32s(&s.read_sharded(&exe, 0, &out[0]).await.unwrap());
    assert_eq!(sq, x.iter().map(|v| v * v).collect::<Vec<_>>());
    // The donated shards are gone: a second run is refused before anything runs.
    let e = s
        .execute_spmd(&exe, &[h.iter().collect()], &[0])
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::FailedPrecondition, "{e}");
    drop((h, out));
    assert_eq!(tenant.usage().device_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_sharded_calls_get_exact_kinds_and_leak_nothing() {
    let tenant = Tenant::new("spmd-hostile", TenantLimits::default());
    {
        // A program compiled for more devices than the session holds.
        let two = session(&tenant, vec![0, 1]);
        let e = two
            .compile_with(
                GSPMD.as_bytes().to_vec(),
                ProgramFormat::MlirText,
                CompileSettings {
                    device: 0,
                    devices: vec![0, 1, 2, 3],
                    ..CompileSettings::default()
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
        let s = session(&tenant, vec![0, 1, 2, 3]);
        let exe = compile(&s, GSPMD, &[0, 1, 2, 3]).await;
        let a = f32_bytes(&[1.0; 24]);
        let good = s
            .put_sharded(&exe, 0, PrimitiveType::F32, &[8, 3], &a)
            .unwrap();
        let b = s
            .put_sharded(&exe, 1, PrimitiveType::F32, &[8, 3], &a)
            .unwrap();
        // A global array that lies about its size or shape.
        let e = s
            .put_sharded(&exe, 0, PrimitiveType::F32, &[8, 3], &a[..40])
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
        let e = s
            .put_sharded(&exe, 0, PrimitiveType::F32, &[4, 6], &a)
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
        // Shards that lie about their device: two swapped.
        let mut swapped: Vec<_> = good.iter().collect();
        swapped.swap(0, 1);
        let e = s
            .execute_spmd(&exe, &[swapped, b.iter().collect()], &[])
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::FailedPrecondition, "{e}");
        // A shard of the wrong size on its right device.
        let wrong = s
            .tensor_from_bytes(PrimitiveType::F32, &[3, 3], &f32_bytes(&[0.0; 9]), Some(0))
            .unwrap();
        let mut lying: Vec<_> = good.iter().collect();
        lying[0] = &wrong;
        let e = s
            .execute_spmd(&exe, &[lying, b.iter().collect()], &[])
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
        // Too few shards.
        let e = s
            .execute_spmd(&exe, &[good[..3].iter().collect(), b.iter().collect()], &[])
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
        // Nothing was charged for the refusals beyond what is held.
        assert_eq!(tenant.usage().pending_launches, 0);

        // The session ends while its execution runs: the caller's future is dropped at once,
        // the devices finish, and every charge comes back.
        let args = vec![good.iter().collect::<Vec<_>>(), b.iter().collect()];
        let run = s.execute_spmd(&exe, &args, &[]);
        drop(tokio::time::timeout(std::time::Duration::from_micros(1), run).await);
        drop(args);
        drop((good, b, wrong, exe));
        drop(s);
        drop(two);
    }
    for _ in 0..600 {
        let u = tenant.usage();
        if u.device_bytes == 0 && u.live_tensors == 0 && u.pending_launches == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_nothing_held(&tenant);
}

// ---------------------------------------------------------------------------------------------
// From guests: the WIT `sharding` interface (0.1.2), through the probe
// ---------------------------------------------------------------------------------------------

/// Runs the probe's `sharded CASE` on the four-device host as tenant `tenant`, placed on
/// `devices` (`None`: every device).
async fn probe_sharded(case: &str, tenant: &Arc<Tenant>, devices: Option<Vec<u32>>) -> String {
    let host = tpubox_wasm::Host::with_device(four(), crate::support::test_host_config().sandbox)
        .expect("a Wasm host over the four devices");
    let probe = host
        .load_component(&crate::support::wasm("tpubox-probe"))
        .expect("probe loads");
    crate::support::run_guest(&host, &probe, &["sharded", case], tenant, devices).await
}

use crate::support::line;

/// The first word of a `NAME: kind (message)` line.
fn kind<'a>(out: &'a str, key: &str) -> &'a str {
    line(out, key).split(' ').next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_run_sharded_programs_through_the_wit() {
    let tenant = Tenant::new("guest-spmd", TenantLimits::default());
    let out = probe_sharded("run", &tenant, None).await;
    assert_eq!(line(&out, "gspmd-devices"), "[0, 1, 2, 3]");
    assert_eq!(
        line(&out, "gspmd-parameters"),
        "f32[8, 3] {devices=[4,1]<=[4]}; f32[8, 3] {replicated}"
    );
    assert_eq!(
        line(&out, "gspmd-results"),
        "f32[8, 3] {devices=[4,1]<=[4]}; f32[] {replicated}"
    );
    assert_eq!(line(&out, "gspmd-shard-inputs"), "[2, 3]");
    assert_eq!(
        line(&out, "a-shards"),
        "[(0, [2, 3]), (1, [2, 3]), (2, [2, 3]), (3, [2, 3])]"
    );
    let a: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let sum: Vec<f32> = a.iter().map(|x| x + 1.0).collect();
    assert_eq!(line(&out, "gspmd-sum"), format!("{sum:?}"));
    assert_eq!(
        line(&out, "gspmd-total"),
        format!("{:?}", vec![a.iter().sum::<f32>()])
    );
    assert_eq!(line(&out, "gspmd-out-devices"), "[0, 1, 2, 3]");
    assert_eq!(line(&out, "shard-3"), format!("{:?}", &sum[18..]));
    let psum: Vec<f32> = (0..6)
        .map(|j| (0..4).map(|blk| a[blk * 6 + j]).sum())
        .collect();
    assert_eq!(line(&out, "psum"), format!("{psum:?}"));
    assert_eq!(line(&out, "psum-result-sharding"), "{replicated}");
    assert_eq!(kind(&out, "read-donated"), "failed-precondition");
    assert_eq!(
        line(&out, "by-hand"),
        "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0] on [2, 0]"
    );
    let u = tenant.usage();
    assert_eq!(
        (u.device_bytes, u.live_tensors, u.live_executables),
        (0, 0, 0),
        "the guest's ending gives everything back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_sharded_guest_calls_get_exact_kinds_and_leak_nothing() {
    let tenant = Tenant::new("guest-spmd-hostile", TenantLimits::default());
    let out = probe_sharded("hostile", &tenant, None).await;
    for (case, want) in [
        ("put-short-bytes", "invalid-argument"),
        ("put-bad-sharding", "invalid-argument"),
        ("put-nested-sharding", "invalid-argument"),
        ("put-device-twice", "invalid-argument"),
        ("put-too-few-devices", "invalid-argument"),
        ("put-unknown-device", "not-found"),
        ("put-no-devices", "invalid-argument"),
        ("read-lying-sizes", "invalid-argument"),
        ("execute-lying-sizes", "invalid-argument"),
        ("read-lying-devices", "invalid-argument"),
        ("execute-lying-devices", "failed-precondition"),
        ("execute-short-shards", "invalid-argument"),
        ("execute-arg-count", "invalid-argument"),
        ("execute-donate-range", "invalid-argument"),
        ("execute-one-device-program", "invalid-argument"),
        ("compile-partitions-differ", "invalid-argument"),
        ("compile-device-twice", "invalid-argument"),
        ("compile-unknown-device", "not-found"),
        ("compile-no-devices", "invalid-argument"),
    ] {
        assert_eq!(kind(&out, case), want, "{case}: {}", line(&out, case));
    }
    assert_eq!(line(&out, "after"), "[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]");
    // Placed on two devices, a program over four is refused before it compiles.
    let out = probe_sharded("outside", &tenant, Some(vec![0, 1])).await;
    assert_eq!(
        kind(&out, "compile-outside"),
        "permission-denied",
        "{}",
        line(&out, "compile-outside")
    );
    assert_nothing_held(&tenant);
}
