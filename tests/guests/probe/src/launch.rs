//! `launch NAME [ARG]`: launches without waiting (WIT 0.1.1 `client.launch`, `wait`,
//! `wait-all`, `set-launch-blocking`), one line per fact, asserted by `tests/all/launch.rs`
//! and timed by the bench `launch`.
//!
//! - `chain`: a chain of launches each taking the previous one's pending output, read once;
//!   prints the values and whether they equal those of `execute`.
//! - `fail`: launches the test-only failing custom call (the host must register it and allow
//!   it): prints the launch's result, then the first read's error kind and message.
//! - `blocking`: the same with `set-launch-blocking(true)`: the launch itself fails.
//! - `flood`: launches without ever waiting until refused; prints how many were accepted and
//!   the refusal (the test holds the device's slots, so that none finishes meanwhile).
//! - `timing TRIPS`: launches a loop of TRIPS trips over a `f32[512,512]` tensor and prints the
//!   guest-measured time of the launch and of the wait (ns).

use tpubox_guest::{Tensor, compile_mlir, set_launch_blocking, wait_all};

const DOUBLE: &str = r#"
func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c = stablehlo.constant dense<2.0> : tensor<4xf32>
  %r = stablehlo.multiply %a, %c : tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

const FAILS: &str = r#"
func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %r = stablehlo.custom_call @tpubox_test_fail(%a) {api_version = 4 : i32} : (tensor<4xf32>) -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

/// A loop of `trips` trips, each a few element-wise ops over `f32[512,512]`.
pub fn long_program(trips: u64) -> String {
    format!(
        r#"
func.func public @main(%a: tensor<512x512xf32>) -> tensor<512x512xf32> {{
  %c0 = stablehlo.constant dense<0> : tensor<i64>
  %c1 = stablehlo.constant dense<1> : tensor<i64>
  %n = stablehlo.constant dense<{trips}> : tensor<i64>
  %h = stablehlo.constant dense<0.5> : tensor<512x512xf32>
  %w:2 = stablehlo.while(%i = %c0, %v = %a) : tensor<i64>, tensor<512x512xf32>
    cond {{
      %p = stablehlo.compare LT, %i, %n : (tensor<i64>, tensor<i64>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    }} do {{
      %j = stablehlo.add %i, %c1 : tensor<i64>
      %t = stablehlo.tanh %v : tensor<512x512xf32>
      %e = stablehlo.exponential %t : tensor<512x512xf32>
      %u = stablehlo.multiply %e, %h : tensor<512x512xf32>
      stablehlo.return %j, %u : tensor<i64>, tensor<512x512xf32>
    }}
  return %w#1 : tensor<512x512xf32>
}}
"#
    )
}

fn err_line(name: &str, e: &tpubox_guest::Error) {
    println!("{name}: {} ({})", e.kind().name(), e.message());
}

pub fn run(name: &str, arg: Option<&str>) {
    match name {
        "chain" => chain(),
        "fail" => fail(false),
        "blocking" => fail(true),
        "flood" => flood(),
        "timing" => timing(arg.and_then(|a| a.parse().ok()).unwrap_or(400)),
        _ => {
            eprintln!("usage: probe launch chain|fail|blocking|flood|timing [TRIPS]");
            std::process::exit(2);
        }
    }
}

fn chain() {
    let exe = compile_mlir(DOUBLE).expect("DOUBLE compiles");
    let x = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 8.0], &[4]).unwrap();
    let mut last = exe.launch(&[&x], &[]).expect("launch");
    for _ in 0..4 {
        last = exe.launch(&[&last.outputs[0]], &[0]).expect("launch");
    }
    let launched: Vec<f32> = last.outputs[0].to_vec().unwrap();
    let mut y = exe.call(&[&x]).unwrap();
    for _ in 0..4 {
        y = exe.call_donating(&[&y[0]], &[0]).unwrap();
    }
    let executed: Vec<f32> = y[0].to_vec().unwrap();
    println!(
        "chain: {launched:?} same-as-execute={}",
        launched == executed
    );
    match wait_all() {
        Ok(()) => println!("chain-wait-all: ok"),
        Err(e) => err_line("chain-wait-all", &e),
    }
}

fn fail(blocking: bool) {
    set_launch_blocking(blocking);
    let exe = compile_mlir(FAILS).expect("FAILS compiles (the host must allow it)");
    let x = Tensor::from_slice(&[1.0f32; 4], &[4]).unwrap();
    match exe.launch(&[&x], &[]) {
        Ok(l) => {
            println!("fail-launch: ok {} {}", l.id, exe.fingerprint());
            match l.outputs[0].to_vec::<f32>() {
                Ok(v) => println!("fail-read: ok {v:?}"),
                Err(e) => err_line("fail-read", &e),
            }
            match l.outputs[0].wait() {
                Ok(()) => println!("fail-wait: ok"),
                Err(e) => err_line("fail-wait", &e),
            }
        }
        Err(e) => {
            println!("fail-fingerprint: {}", exe.fingerprint());
            err_line("fail-launch", &e);
        }
    }
}

fn flood() {
    let exe = compile_mlir(DOUBLE).expect("DOUBLE compiles");
    let x = Tensor::from_slice(&[0.25f32; 4], &[4]).unwrap();
    let mut held = Vec::new();
    loop {
        match exe.launch(&[&x], &[]) {
            Ok(l) => held.push(l),
            Err(e) => {
                println!("flood-accepted: {}", held.len());
                err_line("flood-refused", &e);
                break;
            }
        }
        if held.len() > 100_000 {
            println!("flood-accepted: {} (never refused)", held.len());
            break;
        }
    }
    // Ends with every launch pending: the host must release them all.
}

fn timing(trips: u64) {
    let exe = compile_mlir(&long_program(trips)).expect("the loop compiles");
    let x = Tensor::from_slice(&vec![0.25f32; 512 * 512], &[512, 512]).unwrap();
    // Warm up once (first execution).
    exe.call(&[&x]).unwrap();
    let start = std::time::Instant::now();
    let l = exe.launch(&[&x], &[]).expect("launch");
    let launched = start.elapsed().as_nanos();
    l.outputs[0].wait().expect("wait");
    let waited = start.elapsed().as_nanos();
    println!("timing: launch_ns={launched} wait_ns={waited} trips={trips}");
}
