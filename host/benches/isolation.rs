//! Compile isolation benchmark: what compiling in a contained worker process costs, side by
//! side with compiling in the host's own process, for a small program and for MiniLM bucket
//! programs, and what a compile-cache hit costs with and without workers configured.
//!
//! Compile rows: medians over alternating rounds (in process, a worker started for the compile,
//! a worker started ahead of need, in process, …) with the compile cache off, so every round
//! compiles. Before each round of the third kind the bench waits until the idle worker has
//! created its client, as it has on a host whose compiles are not back to back. Cache-hit rows:
//! 2 000 `compile` calls of a program already in tier 1, median per call. Run with
//! `cargo bench -p tpubox --bench all -- isolation`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tpubox_core::DeviceConfig;
use tpubox_core::DeviceService;
use tpubox_core::cache::{CacheConfig, CacheMode};
use tpubox_core::compiler::CompileIsolation;

/// `prestarted` workers kept idle (with `worker`).
pub(crate) fn service(worker: bool, mode: CacheMode) -> Arc<DeviceService> {
    service_with(worker, 1, mode)
}

fn service_with(worker: bool, prestarted: usize, mode: CacheMode) -> Arc<DeviceService> {
    tpubox_core::open_device(&DeviceConfig {
        cache: CacheConfig {
            mode,
            disk_dir: None,
            remote_url: None,
            ..CacheConfig::default()
        },
        compile_isolation: CompileIsolation {
            worker: worker.then(|| PathBuf::from(env!("CARGO_BIN_EXE_tpubox"))),
            prestarted_workers: prestarted,
            ..CompileIsolation::default()
        },
        ..DeviceConfig::default()
    })
    .expect("the CPU plugin opens")
}

pub(crate) fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Waits until every worker `svc` started has created its client (the idle one is ready).
async fn idle_worker_ready(svc: &DeviceService) {
    loop {
        let s = svc.compile_stats();
        if s.idle_workers >= 1 && s.workers_ready == s.workers_started {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn compile_time(svc: &Arc<DeviceService>, program: &str) -> Duration {
    let start = Instant::now();
    svc.compile(program.as_bytes().to_vec(), true, 0)
        .await
        .expect("the program compiles");
    start.elapsed()
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let inproc = service(false, CacheMode::Off);
        let worker = service_with(true, 0, CacheMode::Off);
        let warm = service_with(true, 1, CacheMode::Off);
        assert!(
            worker.compile_isolation().1,
            "workers are in use on the CPU plugin"
        );
        let small = std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/programs/matmul_bias.mlir"),
        )
        .unwrap();
        let mut programs = vec![(
            "small: matmul + bias (f32[2,3]·f32[3,4])".to_string(),
            small,
            11,
        )];
        for (b, s) in [(1, 16), (8, 64), (32, 128)] {
            programs.push((
                format!("MiniLM encoder bucket {b}×{s}"),
                minilm_embed::build_encoder_mlir(b, s).unwrap(),
                3,
            ));
        }
        println!(
            "tpubox compile isolation benchmark — {}",
            inproc.platform().version
        );
        println!();
        println!(
            "| program | in process | worker started for the compile | − in process | worker started ahead | − in process | ratio |"
        );
        println!("|---|---|---|---|---|---|---|");
        for (name, program, rounds) in &programs {
            // Warm every path once (plugin pages, allocator), then alternate.
            compile_time(&inproc, program).await;
            compile_time(&worker, program).await;
            idle_worker_ready(&warm).await;
            compile_time(&warm, program).await;
            let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..*rounds {
                a.push(compile_time(&inproc, program).await);
                b.push(compile_time(&worker, program).await);
                idle_worker_ready(&warm).await;
                c.push(compile_time(&warm, program).await);
            }
            let (a, b, c) = (median(a), median(b), median(c));
            println!(
                "| {name} | {:.1} ms | {:.1} ms | {:+.1} ms | {:.1} ms | {:+.1} ms | {:.2} |",
                ms(a),
                ms(b),
                ms(b) - ms(a),
                ms(c),
                ms(c) - ms(a),
                c.as_secs_f64() / a.as_secs_f64()
            );
        }
        let s = warm.compile_stats();
        println!();
        println!(
            "worker started ahead: {} compiles, {} found a ready worker, {} started one",
            s.prestarted_used + s.started_on_demand,
            s.ready_used,
            s.started_on_demand
        );
        println!();
        println!(
            "| compile-cache hit (tier 1), per call | without workers | with workers | ratio |"
        );
        println!("|---|---|---|---|");
        let hit_in = service(false, CacheMode::ReadWrite);
        let hit_w = service(true, CacheMode::ReadWrite);
        let program = &programs[1].1;
        compile_time(&hit_in, program).await;
        compile_time(&hit_w, program).await;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..2000 {
            a.push(compile_time(&hit_in, program).await);
            b.push(compile_time(&hit_w, program).await);
        }
        let (a, b) = (median(a), median(b));
        println!(
            "| MiniLM bucket 8×64 | {:.1} µs | {:.1} µs | {:.2} |",
            a.as_secs_f64() * 1e6,
            b.as_secs_f64() * 1e6,
            b.as_secs_f64() / a.as_secs_f64()
        );
    });
}
