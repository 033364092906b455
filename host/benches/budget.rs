//! Per-tenant budgets on the fair-share queue (issue 33): tenant A runs two heavy clients
//! (sessions) at once, tenant B makes tiny calls; B's latency alone and beside A, with A's
//! two sessions sharing one budget (the session API's way: at most
//! `tenant_max_running_executions` slots, default slots - 1) and, for comparison, as two
//! tenants of their own (the old per-session accounting). Two execution slots, the CPU plugin,
//! all in one run.
//!
//! Run with `cargo bench -p tpubox --bench all -- budget`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tpubox_core::session::ProgramFormat;
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{DeviceConfig, PrimitiveType, Session, Tenant, TenantLimits};

/// Tiny calls measured per configuration.
pub(crate) const CALLS: usize = 400;

/// A heavy program: a 40-trip loop of a 256×256 matmul and tanh (tens of ms on 2 cores).
pub(crate) const HEAVY: &str = r#"func.func public @main(%a: tensor<256x256xf32>) -> tensor<256x256xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i64>
  %c1 = stablehlo.constant dense<1> : tensor<i64>
  %n = stablehlo.constant dense<40> : tensor<i64>
  %w:2 = stablehlo.while(%i = %c0, %v = %a) : tensor<i64>, tensor<256x256xf32>
    cond {
      %p = stablehlo.compare LT, %i, %n : (tensor<i64>, tensor<i64>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    } do {
      %j = stablehlo.add %i, %c1 : tensor<i64>
      %m = stablehlo.dot_general %v, %v, contracting_dims = [1] x [0] : (tensor<256x256xf32>, tensor<256x256xf32>) -> tensor<256x256xf32>
      %t = stablehlo.tanh %m : tensor<256x256xf32>
      stablehlo.return %j, %t : tensor<i64>, tensor<256x256xf32>
    }
  return %w#1 : tensor<256x256xf32>
}
"#;

pub(crate) const TINY: &str = r#"func.func public @main(%a: tensor<f32>, %b: tensor<f32>) -> tensor<f32> {
  %0 = stablehlo.add %a, %b : tensor<f32>
  return %0 : tensor<f32>
}
"#;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// B's tiny calls: (p50, p99) in ms.
pub(crate) async fn tiny_calls(s: &Session) -> (f64, f64) {
    let exe = s
        .compile(TINY.as_bytes().to_vec(), ProgramFormat::MlirText, None)
        .await
        .unwrap();
    let a = s
        .tensor_from_bytes(PrimitiveType::F32, &[], &1.5f32.to_le_bytes(), None)
        .unwrap();
    let mut ms = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let t = Instant::now();
        drop(s.execute(&exe, &[&a, &a], &[]).await.unwrap());
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        // A client that thinks between calls: B is not the one filling the queue.
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    ms.sort_by(f64::total_cmp);
    (percentile(&ms, 0.5), percentile(&ms, 0.99))
}

/// A heavy client: runs [`HEAVY`] back to back until `stop`.
pub(crate) async fn heavy_client(s: Session, stop: Arc<AtomicBool>) -> usize {
    let exe = s
        .compile(HEAVY.as_bytes().to_vec(), ProgramFormat::MlirText, None)
        .await
        .unwrap();
    let bytes: Vec<u8> = (0..256 * 256).flat_map(|_| 0.01f32.to_le_bytes()).collect();
    let x = s
        .tensor_from_bytes(PrimitiveType::F32, &[256, 256], &bytes, None)
        .unwrap();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        drop(s.execute(&exe, &[&x], &[]).await.unwrap());
        n += 1;
    }
    n
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dev = tpubox_core::open_device(&DeviceConfig::default()).unwrap();
        let weights = Arc::new(WeightRegistry::new());
        let session = |t: Arc<Tenant>| Session::new(Arc::clone(&dev), Arc::clone(&weights), t);
        let b_budget = Tenant::new_budget("b", TenantLimits::default());
        let b = session(Tenant::with_budget(
            "b",
            TenantLimits::default(),
            Arc::clone(&b_budget),
        ));
        // Warm-up: both programs compiled once.
        let _ = tiny_calls(&b).await;
        let (alone50, alone99) = tiny_calls(&b).await;

        let mut rows = Vec::new();
        for shared in [true, false] {
            let slots = dev.scheduler().slots() as u64;
            let a_budget = Tenant::new_budget(
                "a",
                TenantLimits {
                    max_running_executions: slots.saturating_sub(1).max(1),
                    ..TenantLimits::default()
                },
            );
            let a_tenant = |i: usize| {
                if shared {
                    Tenant::with_budget("a", TenantLimits::default(), Arc::clone(&a_budget))
                } else {
                    Tenant::new(format!("a{i}"), TenantLimits::default())
                }
            };
            let stop = Arc::new(AtomicBool::new(false));
            let heavy: Vec<_> = (0..2)
                .map(|i| tokio::spawn(heavy_client(session(a_tenant(i)), Arc::clone(&stop))))
                .collect();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (p50, p99) = tiny_calls(&b).await;
            stop.store(true, Ordering::Relaxed);
            let mut heavy_runs = 0;
            for h in heavy {
                heavy_runs += h.await.unwrap();
            }
            rows.push((shared, p50, p99, heavy_runs));
        }

        println!(
            "tpubox budget benchmark — {} slots, CPU plugin; B's tiny call (scalar add, inputs on the device), {CALLS} calls",
            dev.scheduler().slots()
        );
        println!();
        println!("| tenant A (two heavy clients) | B p50 (ms) | B p99 (ms) | p99 / alone | A's heavy runs meanwhile |");
        println!("|---|---:|---:|---:|---:|");
        println!("| absent (B alone) | {alone50:.3} | {alone99:.3} | 1.00 | — |");
        for (shared, p50, p99, runs) in rows {
            let how = if shared {
                "one budget, at most slots - 1 slots (session API default)"
            } else {
                "two tenants of their own (per-session accounting)"
            };
            println!(
                "| {how} | {p50:.3} | {p99:.3} | {:.2} | {runs} |",
                p99 / alone99
            );
        }
    });
}
