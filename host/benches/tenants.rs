//! N-tenant benchmark: N = 1, 4, 16, 64 tenants run the MiniLM guest concurrently on one host
//! that holds the MiniLM weights once, measured side by side in one run.
//!
//! Each tenant is its own [`Tenant`] and runs the guest [`RUNS`] times in a row, each run
//! embedding [`SENTENCES`] short sentences of its own (one padded bucket, compiled once during
//! the warm-up, so the table measures sharing, not compiling). Reported per N: device bytes held
//! (the weights once, plus the sum of the tenants' peak device bytes: an upper bound of what they
//! held at once), throughput in embeddings per second over the wall time of the whole N-tenant
//! round, p50 and p99 of the per-run latency (instantiate → result, which includes waiting for
//! the device), and ratios against N = 1.
//!
//! The pooling allocator's instance slots (`SandboxConfig::max_instances`) must be at least the
//! largest N. Run with `cargo bench -p tpubox --bench all -- tenants` after
//! `bash scripts/dev.sh setup`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tpubox_core::{Tenant, TenantLimits};
use tpubox_wasm::{Host, HostConfig, RunOptions, SandboxConfig};

const TENANT_COUNTS: [usize; 4] = [1, 4, 16, 64];
const RUNS: usize = 8;
const SENTENCES: usize = 4;

fn model_dir() -> PathBuf {
    tpubox_core::plugin::known("minilm")
        .and_then(|p| p.installed_library())
        .expect("run `tpubox setup minilm` first")
}

fn sentences(tenant: usize, run: usize) -> Vec<String> {
    (0..SENTENCES)
        .map(|k| format!("Tenant {tenant} embeds sentence {k} of run {run} on a shared device."))
        .collect()
}

struct Row {
    n: usize,
    device_bytes: u64,
    tenant_bytes: u64,
    throughput: f64,
    p50: Duration,
    p99: Duration,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn one_run(
    host: &Host,
    component: &wasmtime::component::Component,
    tenant: &Arc<Tenant>,
    texts: Vec<String>,
) -> Duration {
    let mut args = vec!["--json".to_string()];
    args.extend(texts);
    let opts = RunOptions {
        args,
        dirs: vec![(model_dir(), "/model".into())],
        stdin: Some(Vec::new()),
        capture_output: true,
        tenant: Some(Arc::clone(tenant)),
        ..RunOptions::default()
    };
    let start = Instant::now();
    let o = host.run(component, "minilm-embed", &opts).await.unwrap();
    let took = start.elapsed();
    assert!(o.success, "{}", String::from_utf8_lossy(&o.stderr));
    let records: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(records.len(), SENTENCES);
    took
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let max_n = *TENANT_COUNTS.iter().max().unwrap();
    let config = HostConfig {
        sandbox: SandboxConfig {
            max_instances: max_n as u32,
            ..SandboxConfig::default()
        },
        ..HostConfig::default()
    };
    let host = Arc::new(Host::new(config).unwrap());
    let set = host
        .load_weights("minilm", &model_dir().join("model.safetensors"))
        .unwrap();
    let weight_bytes = set.device_bytes();
    let wasm = crate::guest_wasm("minilm-embed");
    let wasm = std::env::var_os("CARGO_TARGET_DIR")
        .map(|t| PathBuf::from(t).join("wasm32-wasip2/release/minilm-embed.wasm"))
        .filter(|p| p.is_file())
        .unwrap_or(wasm);
    let component = host.load_component(&wasm).unwrap();
    let limits = TenantLimits {
        max_device_bytes: 256 << 20,
        max_guest_memory: 512 << 20,
        ..TenantLimits::default()
    };

    let rows: Vec<Row> = rt.block_on(async {
        // Warm-up: compiles the one bucket every run uses.
        let warm = Tenant::new("warm-up", limits.clone());
        one_run(&host, &component, &warm, sentences(0, 0)).await;
        let mut rows = Vec::new();
        for &n in &TENANT_COUNTS {
            let start = Instant::now();
            let mut tasks = Vec::new();
            for t in 0..n {
                let tenant = Tenant::new(format!("t{t}"), limits.clone());
                let (host, component) = (Arc::clone(&host), component.clone());
                tasks.push(tokio::spawn(async move {
                    let mut lat = Vec::with_capacity(RUNS);
                    for r in 0..RUNS {
                        lat.push(one_run(&host, &component, &tenant, sentences(t, r)).await);
                    }
                    (lat, tenant.usage())
                }));
            }
            let mut lat = Vec::new();
            let mut peak_sum = 0u64;
            for task in tasks {
                let (l, usage) = task.await.unwrap();
                assert_eq!(usage.device_bytes, 0, "a tenant still holds device bytes");
                assert_eq!(usage.refused, 0, "a tenant was refused: {usage:?}");
                lat.extend(l);
                peak_sum += usage.peak_device_bytes;
            }
            let wall = start.elapsed();
            lat.sort();
            rows.push(Row {
                n,
                device_bytes: weight_bytes + peak_sum,
                tenant_bytes: peak_sum,
                throughput: (n * RUNS * SENTENCES) as f64 / wall.as_secs_f64(),
                p50: percentile(&lat, 0.50),
                p99: percentile(&lat, 0.99),
            });
        }
        rows
    });

    let base = &rows[0];
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "tpubox N-tenant benchmark — MiniLM guest, {RUNS} runs × {SENTENCES} sentences per tenant, one host, weights loaded once ({:.1} MiB), {} execution slots",
        mib(weight_bytes),
        host.device().scheduler().slots()
    );
    println!();
    println!(
        "| tenants | device bytes held: weights + Σ tenant peaks | throughput | p50 latency / run | p99 latency / run | bytes vs N=1 | throughput vs N=1 | p50 vs N=1 | p99 vs N=1 |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.2} MiB ({weight_bytes} + {} B) | {:.1} emb/s | {:.0} ms | {:.0} ms | {:.3} | {:.2} | {:.2} | {:.2} |",
            r.n,
            mib(r.device_bytes),
            r.tenant_bytes,
            r.throughput,
            ms(r.p50),
            ms(r.p99),
            r.device_bytes as f64 / base.device_bytes as f64,
            r.throughput / base.throughput,
            ms(r.p50) / ms(base.p50),
            ms(r.p99) / ms(base.p99),
        );
    }
}
