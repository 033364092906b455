//! A guest built against `tpubox:device@0.1.0` (the frozen copy in `wit/device.wit`, as
//! released before `launch` was added in 0.1.1), through wit-bindgen directly rather than the
//! guest SDK (which follows the current WIT). It compiles a program, executes it and prints
//! `wit-0-1-0: [values]`: `tests/all/launch.rs` checks that a host serving 0.1.1 still
//! instantiates and runs it (wasmtime's component linker resolves an import of a 0.1.0
//! interface to a semver-compatible 0.1.x definition).

wit_bindgen::generate!({
    path: "wit",
    world: "guest",
});

use tpubox::device::client::{self, CompileOptions, ProgramFormat};
use tpubox::device::types::{Dtype, Tensor};

const DOUBLE: &str = r#"
func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c = stablehlo.constant dense<2.0> : tensor<4xf32>
  %r = stablehlo.multiply %a, %c : tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

fn main() {
    let exe = client::compile(
        ProgramFormat::MlirText,
        DOUBLE.as_bytes(),
        CompileOptions { device: None },
    )
    .expect("DOUBLE compiles");
    let bytes: Vec<u8> = [1.0f32, -2.0, 0.5, 8.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let x = Tensor::from_bytes(Dtype::F32, &[4], &bytes, None).expect("tensor");
    let out = client::execute(&exe, &[&x], &[]).expect("execute");
    let values: Vec<f32> = out[0]
        .read()
        .expect("read")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    println!("wit-0-1-0: {values:?}");
}
