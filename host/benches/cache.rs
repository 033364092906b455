//! Compile-cache benchmark: time to first result of the MiniLM guest (one sentence) with a cold
//! cache, a warm tier 1 (same host, second run), a warm tier 2 (a fresh host — new PJRT
//! client, empty tier 1 — over the same cache directory), and tier 3 only (a fresh host with an
//! empty disk directory and a `file://` remote store that the cold host uploaded to; the local
//! compile races the fetch, as in production), side by side in one run.
//!
//! Times are the guest's run (instantiate → result printed), medians of 3 rounds, each round
//! with a new empty cache directory. Run with `cargo bench -p tpubox --bench all -- cache`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tpubox_core::cache::CacheConfig;
use tpubox_wasm::{Host, HostConfig, RunOptions, SandboxConfig};

const ROUNDS: usize = 3;

fn model_dir() -> PathBuf {
    tpubox_core::plugin::known("minilm")
        .and_then(|p| p.installed_library())
        .expect("run `tpubox setup minilm` first")
}

fn host(cache_dir: &Path, remote: Option<&Path>) -> Host {
    let config = HostConfig {
        sandbox: SandboxConfig {
            cache_dir: None,
            ..SandboxConfig::default()
        },
        cache: CacheConfig {
            disk_dir: Some(cache_dir.to_path_buf()),
            remote_url: remote.map(|r| format!("file://{}", r.display())),
            remote_opener: Some(tpubox_cache_remote::open),
            ..CacheConfig::default()
        },
        ..HostConfig::default()
    };
    let h = Host::new(config).unwrap();
    h.load_weights("minilm", &model_dir().join("model.safetensors"))
        .unwrap();
    h
}

async fn first_result(h: &Host) -> (Duration, u64) {
    let wasm = crate::guest_wasm("minilm-embed");
    let component = h.load_component(&wasm).unwrap();
    let opts = RunOptions {
        args: vec!["--json".into(), "The cat sat on the mat.".into()],
        dirs: vec![(model_dir(), "/model".into())],
        stdin: Some(Vec::new()),
        capture_output: true,
        ..RunOptions::default()
    };
    let before = h.device().cache().unwrap().stats().compiles;
    let o = h.run(&component, "minilm-embed", &opts).await.unwrap();
    assert!(o.success, "{}", String::from_utf8_lossy(&o.stderr));
    let compiles = h.device().cache().unwrap().stats().compiles - before;
    (o.elapsed, compiles)
}

/// Runs the hello-matmul guest once (another program, another component).
async fn warm_up(h: &Host) {
    let wasm = crate::guest_wasm("hello-matmul");
    let component = h.load_component(&wasm).unwrap();
    let opts = RunOptions {
        stdin: Some(Vec::new()),
        capture_output: true,
        ..RunOptions::default()
    };
    let o = h.run(&component, "hello-matmul", &opts).await.unwrap();
    assert!(o.success, "{}", String::from_utf8_lossy(&o.stderr));
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (mut cold, mut t1, mut t2, mut t2w, mut t3) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let dir = tempfile::tempdir().unwrap();
            let remote = tempfile::tempdir().unwrap();
            let a = host(dir.path(), Some(remote.path()));
            let (d, n) = first_result(&a).await;
            assert_eq!(n, 1, "cold: one bucket compiled");
            cold.push(d.as_secs_f64() * 1e3);
            let (d, n) = first_result(&a).await;
            assert_eq!(n, 0, "warm tier 1 compiles nothing");
            t1.push(d.as_secs_f64() * 1e3);
            a.device().cache().unwrap().flush_uploads().await;
            let b = host(dir.path(), None);
            let (d, n) = first_result(&b).await;
            assert_eq!(n, 0, "warm tier 2 compiles nothing");
            assert_eq!(b.device().cache().unwrap().stats().disk.hits, 1);
            t2.push(d.as_secs_f64() * 1e3);
            // The same, on a fresh host that has already run another guest (hello-matmul):
            // separates the cache's cost from a new host's first-use costs.
            let w = host(dir.path(), None);
            warm_up(&w).await;
            let (d, n) = first_result(&w).await;
            assert_eq!(n, 0, "warm tier 2 compiles nothing");
            t2w.push(d.as_secs_f64() * 1e3);
            let empty = tempfile::tempdir().unwrap();
            let c = host(empty.path(), Some(remote.path()));
            let (d, _) = first_result(&c).await;
            let s = c.device().cache().unwrap().stats();
            assert_eq!((s.disk.hits, s.remote.hits), (0, 1), "tier 3 answered: {s:?}");
            t3.push(d.as_secs_f64() * 1e3);
        }
        let (cold, t1, t2, t2w, t3) = (median(cold), median(t1), median(t2), median(t2w), median(t3));
        println!("tpubox compile-cache benchmark — MiniLM guest, one sentence (batch 1 × seq 16), median of {ROUNDS} rounds");
        println!();
        println!("| cache state | time to first result | vs cold |");
        println!("|---|---|---|");
        println!("| cold (compiles the bucket) | {cold:.0} ms | 1.000 |");
        println!("| warm tier 1 (same host, second run) | {t1:.0} ms | {:.3} |", t1 / cold);
        println!("| warm tier 2 (fresh host, same disk cache) | {t2:.0} ms | {:.3} |", t2 / cold);
        println!("| warm tier 2, fresh host that already ran another guest | {t2w:.0} ms | {:.3} |", t2w / cold);
        println!("| tier 3 only (fresh host, empty disk, file:// store) | {t3:.0} ms | {:.3} |", t3 / cold);
    });
}
