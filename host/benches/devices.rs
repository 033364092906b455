//! Placement on several devices (issue 44): tenant A runs two heavy clients (sessions) while
//! tenant B makes tiny calls, with both on one device and with each on a device of its own, on
//! a host of 4 CPU devices (`cpu_device_count`, the stand-in for a TPU host's chips). B's
//! latency alone is measured in the same run; the ratio is B's p99 beside A over B's p99
//! alone. The programs and clients are the `budget` bench's.
//!
//! Run with `cargo bench -p tpubox --bench all -- devices`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tpubox_core::NamedValue;
use tpubox_core::placement::Placement;
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{DeviceConfig, Session, Tenant, TenantLimits};

use crate::budget::{CALLS, heavy_client, tiny_calls};

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dev = tpubox_core::open_device(&DeviceConfig {
            client_options: vec![("cpu_device_count".to_string(), NamedValue::Int64(4))],
            ..DeviceConfig::default()
        })
        .unwrap();
        let weights = Arc::new(WeightRegistry::new());
        let session = |t: Arc<Tenant>, device: u32| {
            Session::new(Arc::clone(&dev), Arc::clone(&weights), t)
                .with_placement(Placement::fixed(vec![device]))
        };
        let b_tenant = Tenant::new("b", TenantLimits::default());
        let b = session(Arc::clone(&b_tenant), 1);
        // Warm-up: both programs compiled once per device used.
        let _ = tiny_calls(&b).await;
        let (alone50, alone99) = tiny_calls(&b).await;
        let b0 = session(Arc::clone(&b_tenant), 0);
        let _ = tiny_calls(&b0).await;

        let mut rows = Vec::new();
        for (how, b_device) in [
            ("one device: A and B on device 0", 0),
            ("devices of their own: A on device 0, B on device 1", 1),
        ] {
            let a = Tenant::new_budget("a", TenantLimits::default());
            let stop = Arc::new(AtomicBool::new(false));
            let heavy: Vec<_> = (0..2)
                .map(|_| {
                    let t = Tenant::with_budget("a", TenantLimits::default(), Arc::clone(&a));
                    tokio::spawn(heavy_client(session(t, 0), Arc::clone(&stop)))
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let s = if b_device == 0 { &b0 } else { &b };
            let window = std::time::Instant::now();
            let (p50, p99) = tiny_calls(s).await;
            let seconds = window.elapsed().as_secs_f64();
            stop.store(true, Ordering::Relaxed);
            let mut heavy_runs = 0;
            for h in heavy {
                heavy_runs += h.await.unwrap();
            }
            // Runs over the whole time A ran (its 0.5 s head start included).
            rows.push((how, p50, p99, heavy_runs as f64 / (seconds + 0.5)));
        }

        println!(
            "tpubox devices benchmark — 4 CPU devices, {} slots each; B's tiny call (scalar add, inputs on the device), {CALLS} calls, 0.5 ms apart",
            dev.scheduler().slots()
        );
        println!();
        println!(
            "| placement | B p50 (ms) | B p99 (ms) | p99 / alone | A's heavy runs per second |"
        );
        println!("|---|---:|---:|---:|---:|");
        println!("| B alone (device 1) | {alone50:.3} | {alone99:.3} | 1.00 | — |");
        for (how, p50, p99, runs) in rows {
            println!(
                "| {how} | {p50:.3} | {p99:.3} | {:.2} | {runs:.1} |",
                p99 / alone99
            );
        }
    });
}
