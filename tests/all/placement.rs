//! Placement on a host of several devices (issue 44): sessions placed on devices of their own
//! (`tpubox_core::placement`), device bytes charged per device, each device's own fair-share
//! queue, weights replicated onto a session's device, and the hostile cases with their exact
//! error kinds. The CPU plugin stands in for a TPU host's chips with `cpu_device_count` 4, as
//! JAX tests its own multi-device code (`jax_num_cpu_devices`).

use std::sync::Arc;
use std::time::Duration;

use tpubox_core::placement::{Placement, PlacementRequest, TenantDevices};
use tpubox_core::session::{ProgramFormat, TensorHandle};
use tpubox_core::tenant::DeviceBytes;
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{DeviceService, ErrorKind, PrimitiveType, Session, Tenant};
use tpubox_core::{TenantLimits, TenantUsage};

use crate::support::read_f32 as get;

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

fn four() -> Arc<DeviceService> {
    crate::support::four_devices()
}

fn session(dev: &Arc<DeviceService>, tenant: &Arc<Tenant>, placement: Placement) -> Session {
    Session::new(
        Arc::clone(dev),
        Arc::new(WeightRegistry::new()),
        Arc::clone(tenant),
    )
    .with_placement(placement)
}

fn put(
    s: &Session,
    v: [f32; 4],
    device: Option<u32>,
) -> Result<TensorHandle, tpubox_core::DeviceError> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    s.tensor_from_bytes(PrimitiveType::F32, &[4], &bytes, device)
}

fn by_device(u: &TenantUsage) -> Vec<(u32, u64)> {
    u.device_bytes_by_device
        .iter()
        .map(|d: &DeviceBytes| (d.device, d.bytes))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placed_session_works_on_its_own_device_and_is_charged_there() {
    let dev = four();
    assert_eq!(dev.device_count(), 4);
    let tenant = Tenant::new("placed", TenantLimits::default());
    {
        let s = session(&dev, &tenant, Placement::fixed(vec![2, 3]));
        // Named nowhere: the session's first device.
        let x = put(&s, [1.0, -2.0, 0.5, 8.0], None).unwrap();
        assert_eq!(x.device(), 2);
        let double = s
            .compile(DOUBLE.as_bytes().to_vec(), ProgramFormat::MlirText, None)
            .await
            .unwrap();
        assert_eq!(double.executable().device(), 2);
        let y = s.execute(&double, &[&x], &[]).await.unwrap();
        assert_eq!(y[0].device(), 2);
        assert_eq!(get(&s, &y[0]).await, vec![2.0, -4.0, 1.0, 16.0]);
        // Its second device, by name.
        let z = put(&s, [1.0; 4], Some(3)).unwrap();
        assert_eq!(z.device(), 3);
        assert_eq!(by_device(&tenant.usage()), vec![(2, 32), (3, 16)]);
        let moved = s.copy_to_device(&y[0], 3).unwrap();
        let add3 = s
            .compile(ADD.as_bytes().to_vec(), ProgramFormat::MlirText, Some(3))
            .await
            .unwrap();
        let w = s.execute(&add3, &[&moved, &z], &[]).await.unwrap();
        assert_eq!(get(&s, &w[0]).await, vec![3.0, -3.0, 2.0, 17.0]);
        assert_eq!(tenant.usage().device_bytes, 80);
    }
    let u = tenant.usage();
    assert_eq!(
        (u.device_bytes, u.live_tensors, u.live_executables),
        (0, 0, 0)
    );
    assert!(by_device(&u).iter().all(|&(_, b)| b == 0), "{u:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_outside_the_sessions_devices_are_refused_with_exact_kinds() {
    let dev = four();
    let tenant = Tenant::new("fenced", TenantLimits::default());
    let s = session(&dev, &tenant, Placement::fixed(vec![1]));
    let e = put(&s, [0.0; 4], Some(0)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    assert!(
        e.message.contains("device 0") && e.message.contains("rule devices"),
        "{e}"
    );
    let e = put(&s, [0.0; 4], Some(9)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    let e = s
        .compile(DOUBLE.as_bytes().to_vec(), ProgramFormat::MlirText, Some(3))
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    let x = put(&s, [1.0; 4], None).unwrap();
    let e = s.copy_to_device(&x, 2).unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    // Nothing was charged for the refusals.
    let u = tenant.usage();
    assert_eq!(
        (u.device_bytes, u.live_tensors, u.live_executables),
        (16, 1, 0)
    );
    assert_eq!(by_device(&u), vec![(1, 16)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_device_limits_name_the_device_and_leave_other_devices_alone() {
    let dev = four();
    let tenant = Tenant::new(
        "per-device",
        TenantLimits {
            max_device_bytes: 1 << 20,
            max_device_bytes_per_device: 32,
            ..TenantLimits::default()
        },
    );
    let s = session(&dev, &tenant, Placement::fixed(vec![0, 1]));
    let a = put(&s, [1.0; 4], Some(0)).unwrap();
    let b = put(&s, [1.0; 4], Some(0)).unwrap();
    let e = put(&s, [1.0; 4], Some(0)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{e}");
    assert!(
        e.message.contains("device 0") && e.message.contains("max-device-bytes-per-device"),
        "{e}"
    );
    // Device 1 still has room.
    let c = put(&s, [1.0; 4], Some(1)).unwrap();
    // An execution's outputs are charged on the program's device.
    let double = s
        .compile(DOUBLE.as_bytes().to_vec(), ProgramFormat::MlirText, Some(0))
        .await
        .unwrap();
    let e = s.execute(&double, &[&a], &[]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{e}");
    assert!(e.message.contains("max-device-bytes-per-device"), "{e}");
    // Donating the input frees its bytes on that device first.
    let y = s.execute(&double, &[&b], &[0]).await.unwrap();
    assert_eq!(get(&s, &y[0]).await, vec![2.0; 4]);
    assert_eq!(by_device(&tenant.usage()), vec![(0, 32), (1, 16)]);
    drop((a, c, y));
    assert_eq!(tenant.usage().device_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_refuse_other_tenants_and_come_back_when_sessions_end() {
    let dev = four();
    let leases = dev.leases();
    let all = TenantDevices::all(4);
    let alone = PlacementRequest {
        devices: vec![3],
        exclusive: true,
        ..Default::default()
    };
    let owner = Tenant::new("owner", TenantLimits::default());
    let held = session(&dev, &owner, leases.place("owner", &all, &alone).unwrap());
    // Another tenant naming the held device: permission-denied; asking for every device while
    // one is held alone: resource-exhausted naming `devices`; a count of what is left works.
    let named = PlacementRequest {
        devices: vec![3],
        ..Default::default()
    };
    let e = leases.place("intruder", &all, &named).unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    let e = leases
        .place(
            "intruder",
            &all,
            &PlacementRequest {
                count: Some(4),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{e}");
    assert!(e.message.contains("(limit devices)"), "{e}");
    let three = leases
        .place(
            "intruder",
            &all,
            &PlacementRequest {
                count: Some(3),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(three.devices(), &[0, 1, 2]);
    // Devices the tenant may not use, or that do not exist.
    let mine = TenantDevices {
        devices: vec![0],
        exclusive: true,
    };
    let e = leases
        .place(
            "small",
            &mine,
            &PlacementRequest {
                devices: vec![1],
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    let e = leases
        .place(
            "small",
            &mine,
            &PlacementRequest {
                count: Some(2),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{e}");
    let e = leases
        .place(
            "small",
            &all,
            &PlacementRequest {
                count: Some(5),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    // The session's work stays on its device; when it ends, its lease comes back.
    let x = put(&held, [1.0; 4], None).unwrap();
    assert_eq!(x.device(), 3);
    drop(x);
    drop(held);
    drop(three);
    let snap = leases.snapshot();
    assert!(
        snap.iter().all(|d| d.sessions == 0 && d.held_by.is_none()),
        "{snap:?}"
    );
    assert_eq!(owner.usage().device_bytes, 0);
    let again = leases.place("intruder", &all, &named).unwrap();
    assert_eq!(again.devices(), &[3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_device_does_not_hold_up_a_tenant_on_another_device() {
    let dev = four();
    let busy = Tenant::new("busy", TenantLimits::default());
    // Every slot of device 0 held: a launch there would wait.
    let mut held = Vec::new();
    for _ in 0..dev.scheduler_for(0).slots() {
        held.push(dev.scheduler_for(0).acquire(&busy).await);
    }
    let other = Tenant::new("elsewhere", TenantLimits::default());
    let s = session(&dev, &other, Placement::fixed(vec![1]));
    let double = s
        .compile(DOUBLE.as_bytes().to_vec(), ProgramFormat::MlirText, None)
        .await
        .unwrap();
    let x = put(&s, [3.0; 4], None).unwrap();
    let y = tokio::time::timeout(Duration::from_secs(60), s.execute(&double, &[&x], &[]))
        .await
        .expect("device 1 has slots of its own")
        .unwrap();
    assert_eq!(get(&s, &y[0]).await, vec![6.0; 4]);
    // The same launch on device 0 stays queued until a slot there is given back.
    let s0 = session(&dev, &other, Placement::fixed(vec![0]));
    let double0 = s0
        .compile(DOUBLE.as_bytes().to_vec(), ProgramFormat::MlirText, None)
        .await
        .unwrap();
    let x0 = put(&s0, [1.0; 4], None).unwrap();
    let launch = s0.launch(&double0, &[&x0], &[]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        launch.outputs[0].is_pending(),
        "device 0's slots are all held"
    );
    held.clear();
    assert_eq!(get(&s0, &launch.outputs[0]).await, vec![2.0; 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_open_on_the_sessions_device_one_copy_per_device() {
    let dev = four();
    let weights = Arc::new(WeightRegistry::new());
    let publisher = Tenant::new(
        "publisher",
        TenantLimits {
            max_published_bytes: 1 << 20,
            ..TenantLimits::default()
        },
    );
    let p = Session::new(
        Arc::clone(&dev),
        Arc::clone(&weights),
        Arc::clone(&publisher),
    )
    .with_placement(Placement::fixed(vec![0]));
    let w = put(&p, [10.0, 20.0, 30.0, 40.0], None).unwrap();
    p.publish_weights("w", &[("bias".to_string(), &w)], &["*".to_string()])
        .await
        .unwrap();
    let reader = Tenant::new("reader", TenantLimits::default());
    let mut seen = Vec::new();
    for _ in 0..2 {
        let r = Session::new(Arc::clone(&dev), Arc::clone(&weights), Arc::clone(&reader))
            .with_placement(Placement::fixed(vec![3]));
        let set = r.open_weights("w").unwrap();
        let bias = r.weight(&set, "bias").unwrap();
        assert_eq!(bias.device(), 3);
        assert!(bias.is_read_only());
        let add = r
            .compile(ADD.as_bytes().to_vec(), ProgramFormat::MlirText, None)
            .await
            .unwrap();
        let x = put(&r, [1.0, 2.0, 3.0, 4.0], None).unwrap();
        let y = r.execute(&add, &[&x, &bias], &[]).await.unwrap();
        assert_eq!(get(&r, &y[0]).await, vec![11.0, 22.0, 33.0, 44.0]);
        // Donating the shared copy is refused, as for the original.
        let e = r.execute(&add, &[&x, &bias], &[1]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
        seen.push(Arc::as_ptr(&bias.tensor().unwrap()) as usize);
    }
    assert_eq!(
        seen[0], seen[1],
        "one copy on device 3, shared by both sessions"
    );
    // The reader was charged no bytes for the weights.
    assert_eq!(reader.usage().device_bytes, 0);
}
