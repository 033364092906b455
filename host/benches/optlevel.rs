//! Optimisation-level benchmark: compile time of mid-size programs at each XLA optimisation
//! level ([`pjrt::OptimizationLevel`], TorchTPU's `xla_optimization_level`), side by side, and the
//! ratio of O3 to O0, on the CPU plugin the host opens by default. A 150-op element-wise chain on a
//! 512×512 f32 array (one XLA loop fusion: most of the work is LLVM's) and a 2-layer MLP (batch 32,
//! 512→2048→512, f32, tanh). Compiles go through `DeviceService::compile_with` with the compile
//! cache off, so every round compiles; rounds alternate the levels, median of `ROUNDS`. Also the
//! median execution time at each level (what the faster compile costs at run time). Run with
//! `cargo bench -p tpubox --bench all -- optlevel`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pjrt::OptimizationLevel;
use tpubox_core::DeviceService;
use tpubox_core::cache::CacheMode;
use tpubox_core::device::{Arg, CompileSettings, DeviceExecutable, DeviceTensor};
use tpubox_core::types::spec_byte_size;

const ROUNDS: usize = 5;

/// A chain of `n` element-wise ops on a `d`×`d` f32 array; every op keeps values in a small
/// range so the chain stays finite.
pub fn elementwise_chain(n: usize, d: usize) -> String {
    let ty = format!("tensor<{d}x{d}xf32>");
    let mut s = format!(
        "func.func public @main(%x: {ty}) -> {ty} {{\n  %half = stablehlo.constant dense<0.5> : {ty}\n  %v0 = stablehlo.add %x, %half : {ty}\n"
    );
    for i in 1..=n {
        let p = i - 1;
        let op = match i % 5 {
            0 => format!("stablehlo.tanh %v{p} : {ty}"),
            1 => format!("stablehlo.multiply %v{p}, %half : {ty}"),
            2 => format!("stablehlo.sine %v{p} : {ty}"),
            3 => format!("stablehlo.add %v{p}, %x : {ty}"),
            _ => format!("stablehlo.logistic %v{p} : {ty}"),
        };
        s.push_str(&format!("  %v{i} = {op}\n"));
    }
    s.push_str(&format!("  return %v{n} : {ty}\n}}\n"));
    s
}

/// A 2-layer MLP, `tanh(tanh(x·w1 + b1)·w2 + b2)`, batch `b`, widths `i`→`h`→`i`, f32.
pub fn mlp(b: usize, i: usize, h: usize) -> String {
    format!(
        r#"func.func public @main(%x: tensor<{b}x{i}xf32>, %w1: tensor<{i}x{h}xf32>, %b1: tensor<{h}xf32>, %w2: tensor<{h}x{i}xf32>, %b2: tensor<{i}xf32>) -> tensor<{b}x{i}xf32> {{
  %0 = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0] : (tensor<{b}x{i}xf32>, tensor<{i}x{h}xf32>) -> tensor<{b}x{h}xf32>
  %1 = stablehlo.broadcast_in_dim %b1, dims = [1] : (tensor<{h}xf32>) -> tensor<{b}x{h}xf32>
  %2 = stablehlo.add %0, %1 : tensor<{b}x{h}xf32>
  %3 = stablehlo.tanh %2 : tensor<{b}x{h}xf32>
  %4 = stablehlo.dot_general %3, %w2, contracting_dims = [1] x [0] : (tensor<{b}x{h}xf32>, tensor<{h}x{i}xf32>) -> tensor<{b}x{i}xf32>
  %5 = stablehlo.broadcast_in_dim %b2, dims = [1] : (tensor<{i}xf32>) -> tensor<{b}x{i}xf32>
  %6 = stablehlo.add %4, %5 : tensor<{b}x{i}xf32>
  %7 = stablehlo.tanh %6 : tensor<{b}x{i}xf32>
  return %7 : tensor<{b}x{i}xf32>
}}
"#
    )
}

use crate::isolation::{median, ms};

/// The CPU plugin, compiling in this process with the compile cache off (every compile runs).
fn service() -> Arc<DeviceService> {
    crate::isolation::service(false, CacheMode::Off)
}

/// Levels measured: the default (no level set), then O0–O3.
const LEVELS: [Option<OptimizationLevel>; 5] = [
    None,
    Some(OptimizationLevel::O0),
    Some(OptimizationLevel::O1),
    Some(OptimizationLevel::O2),
    Some(OptimizationLevel::O3),
];

fn name(l: Option<OptimizationLevel>) -> &'static str {
    l.map_or("default", |l| l.as_str())
}

/// Runs `exe` once on zero-filled inputs (after a warm-up run) and returns how long it took.
async fn time_execution(svc: &Arc<DeviceService>, exe: &Arc<DeviceExecutable>) -> Duration {
    let inputs: Vec<DeviceTensor> = exe
        .inputs()
        .iter()
        .map(|spec| {
            let bytes = vec![0u8; spec_byte_size(spec) as usize];
            svc.tensor_from_bytes(spec.ty, &spec.dims, &bytes, 0)
                .expect("an input tensor")
        })
        .collect();
    let args: Vec<Arg> = inputs
        .iter()
        .map(|t| Arg {
            tensor: t,
            donate: false,
        })
        .collect();
    svc.execute(exe, &args).await.expect("the program runs");
    let start = Instant::now();
    svc.execute(exe, &args).await.expect("the program runs");
    start.elapsed()
}

async fn run_case(svc: &Arc<DeviceService>, case: &str, program: &str) {
    let mut compile = vec![Vec::new(); LEVELS.len()];
    let mut exec = vec![Vec::new(); LEVELS.len()];
    for _ in 0..ROUNDS {
        for (k, &level) in LEVELS.iter().enumerate() {
            let settings = CompileSettings {
                device: 0,
                optimization_level: level,
                ..Default::default()
            };
            let start = Instant::now();
            let exe = svc
                .compile_with(program.as_bytes().to_vec(), true, settings, "")
                .await
                .expect("the program compiles")
                .exe;
            compile[k].push(start.elapsed());
            exec[k].push(time_execution(svc, &exe).await);
        }
    }
    let c: Vec<Duration> = compile.into_iter().map(median).collect();
    let e: Vec<Duration> = exec.into_iter().map(median).collect();
    println!("\n{case}");
    println!("| level | compile (ms) | execute (ms) |");
    println!("|---|---:|---:|");
    for (k, &level) in LEVELS.iter().enumerate() {
        println!("| {} | {:.1} | {:.2} |", name(level), ms(c[k]), ms(e[k]));
    }
    println!(
        "O3/O0 compile ratio: {:.2}; default/O0: {:.2}",
        ms(c[4]) / ms(c[1]),
        ms(c[0]) / ms(c[1])
    );
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let svc = service();
        println!(
            "optimisation level: compile time, median of {ROUNDS} (cache off, in process), plugin {}",
            svc.platform().plugin_path
        );
        run_case(
            &svc,
            "150-op element-wise chain, 512x512 f32",
            &elementwise_chain(150, 512),
        )
        .await;
        run_case(&svc, "2-layer MLP, batch 32, 512-2048-512 f32", &mlp(32, 512, 2048)).await;
    });
}
