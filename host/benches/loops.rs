//! Loop-budget benchmark (issue 31): what the budget of a loop XLA cannot bound costs, against
//! the same program compiled without it (as for a trusted tenant). The program counts to a
//! number it reads from its argument (`while i < n`, so XLA cannot bound it) and updates a
//! `f32[16]` each trip, a convergence loop's shape. Per compile: the median of `ROUNDS`
//! compiles (cache off, in process; with the budget a program compiles twice, the second time
//! from the module XLA dumped before its passes, with its loop budgeted). Per trip: the median execution of `TRIPS` trips, minus
//! that of a 1-trip run, divided by the trips. Run with
//! `cargo bench -p tpubox --bench all -- loops`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tpubox_core::cache::CacheMode;
use tpubox_core::device::{Arg, CompileSettings, DeviceExecutable};
use tpubox_core::{DeviceService, PrimitiveType};

use crate::isolation::{median, ms};

const ROUNDS: usize = 7;
const TRIPS: i64 = 100_000;

/// `(n: s64[], x: f32[16]) -> f32[16]`: `n` trips of `x = x * 0.5 + 1`.
const COUNT_TO_N: &str = r#"func.func public @main(%n: tensor<i64>, %x: tensor<16xf32>) -> tensor<16xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i64>
  %c1 = stablehlo.constant dense<1> : tensor<i64>
  %h = stablehlo.constant dense<0.5> : tensor<16xf32>
  %o = stablehlo.constant dense<1.0> : tensor<16xf32>
  %w:2 = stablehlo.while(%i = %c0, %v = %x) : tensor<i64>, tensor<16xf32>
    cond {
      %p = stablehlo.compare LT, %i, %n : (tensor<i64>, tensor<i64>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    } do {
      %j = stablehlo.add %i, %c1 : tensor<i64>
      %m = stablehlo.multiply %v, %h : tensor<16xf32>
      %a = stablehlo.add %m, %o : tensor<16xf32>
      stablehlo.return %j, %a : tensor<i64>, tensor<16xf32>
    }
  return %w#1 : tensor<16xf32>
}
"#;

async fn run(svc: &Arc<DeviceService>, exe: &Arc<DeviceExecutable>, n: i64) -> Duration {
    let nt = svc
        .tensor_from_bytes(PrimitiveType::S64, &[], &n.to_le_bytes(), 0)
        .expect("n");
    let xt = svc
        .tensor_from_bytes(PrimitiveType::F32, &[16], &[0u8; 64], 0)
        .expect("x");
    let args = [
        Arg {
            tensor: &nt,
            donate: false,
        },
        Arg {
            tensor: &xt,
            donate: false,
        },
    ];
    let start = Instant::now();
    svc.execute(exe, &args).await.expect("the loop runs");
    start.elapsed()
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let svc = crate::isolation::service(false, CacheMode::Off);
        // The default budget (docs/SECURITY.md).
        let budget = Some(tpubox_core::LoopBudgetLimits {
            max_loop_iterations: tpubox_core::tenant::DEFAULT_MAX_LOOP_ITERATIONS,
            max_loop_work: tpubox_core::tenant::DEFAULT_MAX_LOOP_WORK,
        });
        println!(
            "loop budget: a {TRIPS}-trip counting loop, median of {ROUNDS} (cache off, in process), plugin {}",
            svc.platform().plugin_path
        );
        println!("| compiled | compile (ms) | {TRIPS} trips (ms) | per trip (ns) |");
        println!("|---|---:|---:|---:|");
        let mut rows = Vec::new();
        for (what, loop_budget) in [
            ("trusted (no budget)", None),
            ("default budget", budget),
        ] {
            let settings = CompileSettings {
                loop_budget,
                ..CompileSettings::default()
            };
            let (mut compile, mut long, mut short) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                let start = Instant::now();
                let exe = svc
                    .compile_with(COUNT_TO_N.as_bytes().to_vec(), true, settings.clone(), "")
                    .await
                    .expect("the program compiles")
                    .exe;
                compile.push(start.elapsed());
                run(&svc, &exe, 1).await;
                short.push(run(&svc, &exe, 1).await);
                long.push(run(&svc, &exe, TRIPS).await);
            }
            let (c, l, s) = (median(compile), median(long), median(short));
            let per = (l.saturating_sub(s)).as_secs_f64() * 1e9 / TRIPS as f64;
            println!("| {what} | {:.1} | {:.2} | {per:.0} |", ms(c), ms(l));
            rows.push((c, per));
        }
        println!(
            "the budget costs {:.1} ms a compile and {:.0} ns a trip",
            ms(rows[1].0) - ms(rows[0].0),
            rows[1].1 - rows[0].1
        );
    });
}
