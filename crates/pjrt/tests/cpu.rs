//! Integration tests against the default CPU plugin (PJRT C API 0.115).

mod common;

use common::*;
use pjrt::{
    CompileOptions, ErrorCode, HostBytes, NamedValue, Plugin, PrimitiveType, Program, TensorSpec,
};

#[test]
fn plugin_loads_once_and_reports_version() {
    let p = plugin();
    let (major, minor) = p.api_version();
    assert_eq!(major, 0);
    assert!(minor >= 81, "minor {minor}");
    let again = Plugin::load(&plugin_path()).unwrap();
    assert_eq!(again.path(), p.path());
    assert_eq!(again.api_version(), p.api_version());
    let attrs = p.attributes().unwrap();
    eprintln!("attributes: {attrs:?}");
    assert!(attrs.iter().any(|(k, v)| k == "stablehlo_current_version"
        && matches!(v, NamedValue::Int64List(l) if l.len() == 3)));
}

#[test]
fn missing_plugin_is_not_found() {
    let e = Plugin::load(std::path::Path::new("/nonexistent/plugin.so")).unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
    let e = Plugin::load(std::path::Path::new("/etc/hostname")).unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument);
}

#[test]
fn client_and_devices() {
    let c = client();
    assert_eq!(c.platform_name().unwrap(), "cpu");
    let _ = c.platform_version().unwrap();
    let devs = c.devices().unwrap();
    assert_eq!(devs.len(), 2);
    assert_ne!(devs[0].id(), devs[1].id());
    assert_eq!(devs[0].kind(), "cpu");
    assert!(!devs[0].debug_string().is_empty());
    eprintln!(
        "{devs:?} hw ids {} {}",
        devs[0].local_hardware_id(),
        devs[1].local_hardware_id()
    );
    let c4 = pjrt::Client::new(&plugin(), &[("cpu_device_count", NamedValue::Int64(4))]).unwrap();
    assert_eq!(c4.devices().unwrap().len(), 4);
}

#[test]
fn round_trip_every_type() {
    let c = client();
    let d = dev0(&c);
    for ty in PrimitiveType::ALL {
        for dims in [vec![], vec![5], vec![2, 3], vec![0, 4]] {
            let n: i64 = dims.iter().product();
            let data = sample_bytes(ty, n as usize);
            let b = c.buffer_from_host(&data, ty, &dims, &d).unwrap();
            assert_eq!(b.element_type().unwrap(), ty);
            assert_eq!(b.dims().unwrap(), dims);
            assert_eq!(b.device().unwrap(), d);
            assert!(b.on_device_size_bytes().unwrap() >= data.len());
            assert_eq!(b.to_host_blocking().unwrap(), data, "{ty} {dims:?}");
            // Zero-copy path with the same data.
            let z = c
                .buffer_from_host_bytes(HostBytes::from_slice(&data), ty, &dims, &d)
                .unwrap();
            assert_eq!(
                z.to_host_blocking().unwrap(),
                data,
                "zero-copy {ty} {dims:?}"
            );
        }
    }
}

#[test]
fn primitive_type_names() {
    for ty in PrimitiveType::ALL {
        assert_eq!(PrimitiveType::from_name(ty.name()), Some(ty));
        assert_eq!(
            PrimitiveType::from_name(&ty.name().to_lowercase()),
            Some(ty)
        );
    }
    assert_eq!(PrimitiveType::Pred.byte_size(), 1);
    assert_eq!(PrimitiveType::C64.byte_size(), 8);
    assert_eq!(PrimitiveType::C128.byte_size(), 16);
    assert_eq!(PrimitiveType::Bf16.name(), "BF16");
    assert_eq!(PrimitiveType::U16.mlir_name(), "ui16");
    assert_eq!(PrimitiveType::C64.mlir_name(), "complex<f32>");
    assert_eq!(PrimitiveType::from_name("f8"), None);
}

#[test]
fn compile_and_run_add() {
    let c = client();
    let d = dev0(&c);
    let exe = c
        .compile(&Program::mlir(ADD_2X2), &CompileOptions::new())
        .unwrap();
    eprintln!("name {:?} fingerprint {:?}", exe.name(), exe.fingerprint());
    let spec = TensorSpec {
        ty: PrimitiveType::F32,
        dims: vec![2, 2],
    };
    assert_eq!(
        exe.parameter_specs().unwrap(),
        vec![spec.clone(), spec.clone()]
    );
    assert_eq!(exe.output_specs().unwrap(), vec![spec]);
    assert_eq!(exe.num_outputs().unwrap(), 1);
    let devs = exe.addressable_devices().unwrap();
    assert_eq!(devs, vec![d.clone()]);

    let a = c
        .buffer_from_host(
            &f32_bytes(&[1.0, 2.0, 3.0, 4.0]),
            PrimitiveType::F32,
            &[2, 2],
            &d,
        )
        .unwrap();
    let b = c
        .buffer_from_host(
            &f32_bytes(&[10.0, 20.0, 30.0, 40.5]),
            PrimitiveType::F32,
            &[2, 2],
            &d,
        )
        .unwrap();
    let run = exe.execute(&[&a, &b], &[]).unwrap();
    run.done.wait_blocking().unwrap();
    assert_eq!(run.outputs.len(), 1);
    let out = &run.outputs[0];
    assert_eq!(out.element_type().unwrap(), PrimitiveType::F32);
    assert_eq!(out.dims().unwrap(), vec![2, 2]);
    assert_eq!(
        bytes_f32(&out.to_host_blocking().unwrap()),
        vec![11.0, 22.0, 33.0, 44.5]
    );
    // Inputs are untouched and reusable.
    let run2 = exe.execute(&[out, &a], &[]).unwrap();
    assert_eq!(
        bytes_f32(&run2.outputs[0].to_host_blocking().unwrap()),
        vec![12.0, 24.0, 36.0, 48.5]
    );

    // Fingerprint: either a non-empty string or a clean error.
    match exe.fingerprint() {
        Ok(f) => assert!(!f.is_empty()),
        Err(e) => eprintln!("fingerprint: {e}"),
    }
}

#[test]
fn compile_on_second_device() {
    let c = client();
    let devs = c.devices().unwrap();
    let exe = c
        .compile(
            &Program::mlir(ADD_2X2),
            &CompileOptions::new().device_ordinal(1),
        )
        .unwrap();
    let ed = exe.addressable_devices().unwrap();
    assert_eq!(ed, vec![devs[1].clone()]);
    let target = &devs[1];
    let a = c
        .buffer_from_host(&f32_bytes(&[1.0; 4]), PrimitiveType::F32, &[2, 2], &devs[0])
        .unwrap();
    let a = a.copy_to_device(target).unwrap();
    a.ready_event().unwrap().wait_blocking().unwrap();
    assert_eq!(a.device().unwrap(), *target);
    let run = exe.execute(&[&a, &a], &[]).unwrap();
    assert_eq!(
        bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
        vec![2.0; 4]
    );
    assert_eq!(run.outputs[0].device().unwrap(), *target);

    let e = c
        .compile(
            &Program::mlir(ADD_2X2),
            &CompileOptions::new().device_ordinal(7),
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument);
    let e = c
        .compile(
            &Program::mlir(ADD_2X2),
            &CompileOptions::new().num_replicas(0),
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument);
}

const TWO_OUTPUTS: &str = r#"
module @two {
  func.func public @main(%a: tensor<3xf32>, %b: tensor<3xi32>) -> (tensor<3xf32>, tensor<3xi32>) {
    %0 = stablehlo.multiply %a, %a : tensor<3xf32>
    %1 = stablehlo.add %b, %b : tensor<3xi32>
    return %0, %1 : tensor<3xf32>, tensor<3xi32>
  }
}
"#;

#[test]
fn multiple_outputs_and_serialize_round_trip() {
    let c = client();
    let d = dev0(&c);
    let exe = c
        .compile(&Program::mlir(TWO_OUTPUTS), &CompileOptions::new())
        .unwrap();
    let f3 = TensorSpec {
        ty: PrimitiveType::F32,
        dims: vec![3],
    };
    let i3 = TensorSpec {
        ty: PrimitiveType::S32,
        dims: vec![3],
    };
    assert_eq!(exe.parameter_specs().unwrap(), vec![f3.clone(), i3.clone()]);
    assert_eq!(exe.output_specs().unwrap(), vec![f3, i3]);
    let bytes = exe.serialize().unwrap();
    assert!(!bytes.is_empty());

    let a = c
        .buffer_from_host(&f32_bytes(&[1.5, -2.0, 3.0]), PrimitiveType::F32, &[3], &d)
        .unwrap();
    let b = c
        .buffer_from_host(&i32_bytes(&[7, -8, 1 << 20]), PrimitiveType::S32, &[3], &d)
        .unwrap();
    let check = |exe: &pjrt::LoadedExecutable| {
        let run = exe.execute(&[&a, &b], &[]).unwrap();
        run.done.wait_blocking().unwrap();
        assert_eq!(run.outputs.len(), 2);
        assert_eq!(
            bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
            vec![2.25, 4.0, 9.0]
        );
        assert_eq!(
            bytes_i32(&run.outputs[1].to_host_blocking().unwrap()),
            vec![14, -16, 1 << 21]
        );
    };
    check(&exe);
    let loaded = c.deserialize_executable(&bytes).unwrap();
    assert_eq!(
        loaded.parameter_specs().unwrap(),
        exe.parameter_specs().unwrap()
    );
    assert_eq!(loaded.output_specs().unwrap(), exe.output_specs().unwrap());
    check(&loaded);
    drop(exe);
    check(&loaded);

    let e = c
        .deserialize_executable(&bytes[..bytes.len() / 2])
        .unwrap_err();
    eprintln!("truncated executable: {e}");
    let e = c.deserialize_executable(b"garbage").unwrap_err();
    eprintln!("garbage executable: {e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_download_and_event_wait() {
    let c = client();
    let d = dev0(&c);
    let exe = c
        .compile(&Program::mlir(ADD_2X2), &CompileOptions::new())
        .unwrap();
    let a = c
        .buffer_from_host(
            &f32_bytes(&[1.0, 2.0, 3.0, 4.0]),
            PrimitiveType::F32,
            &[2, 2],
            &d,
        )
        .unwrap();
    for _ in 0..50 {
        let run = exe.execute(&[&a, &a], &[]).unwrap();
        run.done.wait().await.unwrap();
        let host = run.outputs[0].to_host().await.unwrap();
        assert_eq!(bytes_f32(&host), vec![2.0, 4.0, 6.0, 8.0]);
    }
    // Ready events of finished buffers.
    let ev = a.ready_event().unwrap();
    ev.wait().await.unwrap();
    assert!(a.ready_event().unwrap().is_ready().unwrap());
    // A dropped (cancelled) download future must not corrupt anything.
    let run = exe.execute(&[&a, &a], &[]).unwrap();
    let fut = run.outputs[0].to_host();
    drop(fut);
    let out = &run.outputs[0];
    let (r1, r2) = tokio::join!(out.to_host(), a.to_host());
    assert_eq!(bytes_f32(&r1.unwrap()), vec![2.0, 4.0, 6.0, 8.0]);
    assert_eq!(bytes_f32(&r2.unwrap()), vec![1.0, 2.0, 3.0, 4.0]);
}

const DONATE: &str = r#"
module @donate {
  func.func public @main(%a: tensor<4xf32> {tf.aliasing_output = 0 : i32}, %b: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %a, %b : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"#;

#[test]
fn donation() {
    let c = client();
    let d = dev0(&c);
    let exe = c
        .compile(&Program::mlir(DONATE), &CompileOptions::new())
        .unwrap();
    let up = |v: &[f32]| {
        c.buffer_from_host(&f32_bytes(v), PrimitiveType::F32, &[4], &d)
            .unwrap()
    };
    let a = up(&[1.0, 2.0, 3.0, 4.0]);
    let b = up(&[0.5; 4]);

    // Not donated: `a` stays valid.
    let run = exe.execute(&[&a, &b], &[]).unwrap();
    assert_eq!(
        bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
        vec![1.5, 2.5, 3.5, 4.5]
    );
    assert!(!a.is_deleted().unwrap());
    assert_eq!(
        bytes_f32(&a.to_host_blocking().unwrap()),
        vec![1.0, 2.0, 3.0, 4.0]
    );

    // Donated: `a` is consumed.
    let run = exe.execute(&[&a, &b], &[0]).unwrap();
    run.done.wait_blocking().unwrap();
    assert_eq!(
        bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
        vec![1.5, 2.5, 3.5, 4.5]
    );
    assert!(a.is_deleted().unwrap());
    let e = a.to_host_blocking().unwrap_err();
    eprintln!("reading a donated buffer: {e}");
    let e = exe.execute(&[&a, &b], &[]).unwrap_err();
    eprintln!("executing with a donated buffer: {e}");

    // Zero-copy input, donated.
    let z = c
        .buffer_from_host_bytes(
            HostBytes::from_slice(&f32_bytes(&[9.0; 4])),
            PrimitiveType::F32,
            &[4],
            &d,
        )
        .unwrap();
    let run = exe.execute(&[&z, &b], &[0]).unwrap();
    assert_eq!(
        bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
        vec![9.5; 4]
    );
    drop(z);
    drop(run);
}

#[test]
fn zero_copy_upload() {
    let c = client();
    let d = dev0(&c);
    let exe = c
        .compile(&Program::mlir(ADD_2X2), &CompileOptions::new())
        .unwrap();
    let mut hb = HostBytes::zeroed(16);
    assert_eq!(hb.as_slice().as_ptr() as usize % 64, 0);
    hb.as_mut_slice()
        .copy_from_slice(&f32_bytes(&[1.0, 2.0, 3.0, 4.0]));
    let a = c
        .buffer_from_host_bytes(hb, PrimitiveType::F32, &[2, 2], &d)
        .unwrap();
    let run = exe.execute(&[&a, &a], &[]).unwrap();
    // Drop the input before the execution is known to be complete.
    drop(a);
    assert_eq!(
        bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
        vec![2.0, 4.0, 6.0, 8.0]
    );
    // Many short-lived zero-copy buffers.
    for i in 0..200 {
        let v = [i as f32; 4];
        let b = c
            .buffer_from_host_bytes(
                HostBytes::from_slice(&f32_bytes(&v)),
                PrimitiveType::F32,
                &[2, 2],
                &d,
            )
            .unwrap();
        let run = exe.execute(&[&b, &b], &[]).unwrap();
        drop(b);
        assert_eq!(
            bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
            vec![2.0 * i as f32; 4]
        );
    }
    let e = c
        .buffer_from_host_bytes(HostBytes::zeroed(15), PrimitiveType::F32, &[2, 2], &d)
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument);
}

#[test]
fn validation_errors() {
    let c = client();
    let d = dev0(&c);
    let f = PrimitiveType::F32;
    let inv = |r: pjrt::Result<()>| {
        let e = r.unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{e}");
        e.message
    };
    // Upload validation.
    inv(c.buffer_from_host(&[0u8; 15], f, &[2, 2], &d).map(drop));
    inv(c.buffer_from_host(&[0u8; 17], f, &[2, 2], &d).map(drop));
    inv(c.buffer_from_host(&[], f, &[-1, 0], &d).map(drop));
    inv(c
        .buffer_from_host(&[], f, &[i64::MAX, i64::MAX], &d)
        .map(drop));
    inv(c
        .buffer_from_host(&[0u8; 4], PrimitiveType::C128, &[], &d)
        .map(drop));

    // Execute validation.
    let exe = c
        .compile(&Program::mlir(DONATE), &CompileOptions::new())
        .unwrap();
    let a = c.buffer_from_host(&[0u8; 16], f, &[4], &d).unwrap();
    let b = c.buffer_from_host(&[0u8; 16], f, &[4], &d).unwrap();
    let wrong_dims = c.buffer_from_host(&[0u8; 16], f, &[2, 2], &d).unwrap();
    let wrong_ty = c
        .buffer_from_host(&[0u8; 16], PrimitiveType::S32, &[4], &d)
        .unwrap();
    let ex = |args: &[&pjrt::Buffer], donate: &[usize]| exe.execute(args, donate).map(drop);
    let m = inv(ex(&[&a], &[]));
    assert!(m.contains("expected 2 arguments"), "{m}");
    inv(ex(&[&a, &b, &b], &[]));
    let m = inv(ex(&[&a, &wrong_dims], &[]));
    assert!(m.contains("argument 1"), "{m}");
    inv(ex(&[&wrong_ty, &b], &[]));
    let m = inv(ex(&[&a, &b], &[0, 0]));
    assert!(m.contains("twice"), "{m}");
    inv(ex(&[&a, &b], &[2]));
    let m = inv(ex(&[&a, &a], &[0]));
    assert!(m.contains("same buffer"), "{m}");
    // Nothing above reached the plugin: the buffers are intact and usable.
    assert!(!a.is_deleted().unwrap());
    let run = exe.execute(&[&a, &a], &[]).unwrap();
    run.done.wait_blocking().unwrap();

    // A buffer from another client.
    let c2 = client();
    let other = c2
        .buffer_from_host(&[0u8; 16], f, &[4], &dev0(&c2))
        .unwrap();
    inv(ex(&[&a, &other], &[]));
    inv(c
        .buffer_from_host(&[0u8; 16], f, &[4], &dev0(&c2))
        .map(drop));
}

#[test]
fn compile_errors_are_errors() {
    let c = client();
    let e = c
        .compile(&Program::mlir("this is not mlir"), &CompileOptions::new())
        .unwrap_err();
    eprintln!("bad mlir: {e}");
    assert!(!e.message.is_empty());
    let bad_types = r#"
func.func @main(%a: tensor<2xf32>) -> tensor<3xf32> {
  %0 = stablehlo.add %a, %a : tensor<2xf32>
  return %0 : tensor<2xf32>
}"#;
    let e = c
        .compile(&Program::mlir(bad_types), &CompileOptions::new())
        .unwrap_err();
    eprintln!("ill-typed mlir: {e}");
    let e = c
        .compile(
            &Program::hlo(b"\x01\x02garbage".to_vec()),
            &CompileOptions::new(),
        )
        .unwrap_err();
    eprintln!("garbage hlo: {e}");
    // The client still works afterwards.
    assert!(
        c.compile(&Program::mlir(ADD_2X2), &CompileOptions::new())
            .is_ok()
    );
}

#[test]
fn handles_are_send_and_sync_and_work_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<pjrt::Plugin>();
    assert_send_sync::<pjrt::Client>();
    assert_send_sync::<pjrt::Device>();
    assert_send_sync::<pjrt::Buffer>();
    assert_send_sync::<pjrt::LoadedExecutable>();
    assert_send_sync::<pjrt::Event>();
    assert_send_sync::<pjrt::HostBytes>();

    let c = client();
    let d = dev0(&c);
    let exe = std::sync::Arc::new(
        c.compile(&Program::mlir(ADD_2X2), &CompileOptions::new())
            .unwrap(),
    );
    let a = std::sync::Arc::new(
        c.buffer_from_host(
            &f32_bytes(&[1.0, 2.0, 3.0, 4.0]),
            PrimitiveType::F32,
            &[2, 2],
            &d,
        )
        .unwrap(),
    );
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let exe = exe.clone();
            let a = a.clone();
            std::thread::spawn(move || {
                for _ in 0..50 {
                    let run = exe.execute(&[&a, &a], &[]).unwrap();
                    assert_eq!(
                        bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
                        vec![2.0, 4.0, 6.0, 8.0]
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // The client outlives its last handle owner.
    drop(c);
    let run = exe.execute(&[&a, &a], &[]).unwrap();
    run.done.wait_blocking().unwrap();
}
