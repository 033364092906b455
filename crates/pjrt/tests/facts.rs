//! Compiled memory statistics and program facts on the CPU plugin.

mod common;

use pjrt::{CompileOptions, Program, ProgramFormat};

fn compile(code: &str) -> pjrt::LoadedExecutable {
    let c = common::client();
    let p = Program {
        format: ProgramFormat::Mlir,
        code: code.as_bytes().to_vec(),
    };
    c.compile(&p, &CompileOptions::new().device_ordinal(0))
        .unwrap_or_else(|e| panic!("compile: {e}"))
}

const COUNTED: &str = r#"
func.func public @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %c1 = stablehlo.constant dense<1> : tensor<i32>
  %n = stablehlo.constant dense<10> : tensor<i32>
  %r:2 = stablehlo.while(%i = %c0, %v = %x) : tensor<i32>, tensor<4xf32>
    cond {
      %p = stablehlo.compare LT, %i, %n : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    } do {
      %j = stablehlo.add %i, %c1 : tensor<i32>
      %w = stablehlo.add %v, %v : tensor<4xf32>
      stablehlo.return %j, %w : tensor<i32>, tensor<4xf32>
    }
  return %r#1 : tensor<4xf32>
}
"#;

const ENDLESS: &str = r#"
func.func public @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %r = stablehlo.while(%v = %x) : tensor<4xf32>
    cond {
      %t = stablehlo.constant dense<true> : tensor<i1>
      stablehlo.return %t : tensor<i1>
    } do {
      %w = stablehlo.add %v, %v : tensor<4xf32>
      stablehlo.return %w : tensor<4xf32>
    }
  return %r : tensor<4xf32>
}
"#;

const BIG_TEMP: &str = r#"
func.func public @main(%x: tensor<f32>) -> tensor<f32> {
  %b = stablehlo.broadcast_in_dim %x, dims = [] : (tensor<f32>) -> tensor<1024x1024xf32>
  %i = stablehlo.iota dim = 0 : tensor<1024x1024xf32>
  %s = stablehlo.add %b, %i : tensor<1024x1024xf32>
  %sorted = "stablehlo.sort"(%s) ({
    ^bb0(%a: tensor<f32>, %c: tensor<f32>):
      %lt = stablehlo.compare GT, %a, %c : (tensor<f32>, tensor<f32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
  }) {dimension = 1 : i64, is_stable = false} : (tensor<1024x1024xf32>) -> tensor<1024x1024xf32>
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %m = stablehlo.reduce(%sorted init: %z) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<1024x1024xf32>, tensor<f32>) -> tensor<f32>
  return %m : tensor<f32>
}
"#;

#[test]
fn while_loops_report_their_proven_trip_count() {
    let counted = compile(COUNTED).program_facts().unwrap();
    assert_eq!(counted.while_loops.len(), 1, "{counted:?}");
    assert_eq!(counted.while_loops[0].known_trip_count, Some(10));
    let endless = compile(ENDLESS).program_facts().unwrap();
    assert_eq!(endless.while_loops.len(), 1, "{endless:?}");
    assert_eq!(endless.while_loops[0].known_trip_count, None);
    assert!(endless.host_transfers.is_empty() && endless.custom_call_targets.is_empty());
}

#[test]
fn temporaries_are_reported() {
    let stats = compile(BIG_TEMP).compiled_memory_stats().unwrap();
    // The sort works on a 1024×1024 f32 temporary (4 MiB) that is neither argument nor output.
    assert!(stats.temp_bytes >= 4 << 20, "{stats:?}");
    assert_eq!(
        (stats.argument_bytes, stats.output_bytes),
        (4, 4),
        "{stats:?}"
    );
}

const INFEED: &str = r#"
func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %tok = stablehlo.create_token : !stablehlo.token
  %v:2 = "stablehlo.infeed"(%tok) {infeed_config = "", layout = [[0]]} : (!stablehlo.token) -> (tensor<4xf32>, !stablehlo.token)
  return %v#0 : tensor<4xf32>
}
"#;

#[test]
fn infeed_is_a_host_transfer() {
    let exe = compile(INFEED);
    let facts = exe.program_facts().unwrap();
    println!("{facts:?}");
    println!("{:?}", exe.compiled_memory_stats());
    assert_eq!(
        facts.host_transfers,
        vec!["infeed".to_string()],
        "{facts:?}"
    );
}

#[test]
#[ignore]
fn print_stats() {
    let code = std::fs::read_to_string(std::env::var("PROGRAM").unwrap()).unwrap();
    let exe = compile(&code);
    println!("{:?}", exe.compiled_memory_stats());
    println!("{:?}", exe.program_facts());
}
