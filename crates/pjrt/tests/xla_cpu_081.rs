//! The OpenXLA `xla-cpu-pjrt` plugin (PJRT C API 0.81, the oldest supported version).

mod common;

use common::*;
use pjrt::{Client, CompileOptions, NamedValue, PrimitiveType, Program, TensorSpec};

#[test]
fn api_0_81_plugin_runs_add() {
    let p = load(xla_cpu_plugin_path());
    assert_eq!(p.api_version(), (0, 81));
    let c = Client::new(&p, &[("cpu_device_count", NamedValue::Int64(2))]).unwrap();
    assert_eq!(c.platform_name().unwrap(), "cpu");
    let devs = c.devices().unwrap();
    assert_eq!(devs.len(), 2);
    let exe = c
        .compile(&Program::mlir(ADD_2X2), &CompileOptions::new())
        .unwrap();
    let spec = TensorSpec {
        ty: PrimitiveType::F32,
        dims: vec![2, 2],
    };
    assert_eq!(
        exe.parameter_specs().unwrap(),
        vec![spec.clone(), spec.clone()]
    );
    assert_eq!(exe.output_specs().unwrap(), vec![spec]);
    let a = c
        .buffer_from_host(
            &f32_bytes(&[1.0, 2.0, 3.0, 4.0]),
            PrimitiveType::F32,
            &[2, 2],
            &devs[0],
        )
        .unwrap();
    let b = c
        .buffer_from_host_bytes(
            pjrt::HostBytes::from_slice(&f32_bytes(&[0.25; 4])),
            PrimitiveType::F32,
            &[2, 2],
            &devs[0],
        )
        .unwrap();
    let run = exe.execute(&[&a, &b], &[]).unwrap();
    run.done.wait_blocking().unwrap();
    assert_eq!(
        bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
        vec![1.25, 2.25, 3.25, 4.25]
    );
    let bytes = exe.serialize().unwrap();
    let loaded = c.deserialize_executable(&bytes).unwrap();
    let run = loaded.execute(&[&a, &b], &[]).unwrap();
    assert_eq!(
        bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
        vec![1.25, 2.25, 3.25, 4.25]
    );
    eprintln!("attributes: {:?}", p.attributes());
    // Device selection through the compile options' device assignment.
    let exe1 = c
        .compile(
            &Program::mlir(ADD_2X2),
            &CompileOptions::new().device_ordinal(1),
        )
        .unwrap();
    assert_eq!(exe1.addressable_devices().unwrap(), vec![devs[1].clone()]);
    let a1 = a.copy_to_device(&devs[1]).unwrap();
    let run = exe1.execute(&[&a1, &a1], &[]).unwrap();
    assert_eq!(
        bytes_f32(&run.outputs[0].to_host_blocking().unwrap()),
        vec![2.0, 4.0, 6.0, 8.0]
    );
    assert_eq!(run.outputs[0].device().unwrap(), devs[1]);
}
