//! Spine benchmark: what the sandbox costs, measured side by side in one run.
//!
//! Prints a table of:
//! - per-call cost of executing a tiny program (scalar f32 add, inputs kept on the device) from a
//!   guest (`tests/guests/probe exec-loop`) and from the host directly, and their ratio;
//! - component load time: Cranelift compile (cold cache) vs wasmtime's on-disk cache (warm);
//! - component instantiation plus an empty `main`.
//!
//! Run with `cargo bench -p tpubox --bench all -- spine` after `bash scripts/dev.sh setup`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tpubox_core::PrimitiveType;
use tpubox_core::device::Arg;
use tpubox_wasm::{Host, HostConfig, RunOptions, SandboxConfig};

const SCALAR_ADD: &str = r#"
func.func public @main(%a: tensor<f32>, %b: tensor<f32>) -> tensor<f32> {
  %0 = stablehlo.add %a, %b : tensor<f32>
  return %0 : tensor<f32>
}
"#;

const CALLS: u32 = 20_000;
const ROUNDS: usize = 5;

fn probe_wasm() -> PathBuf {
    let p = crate::guest_wasm("tpubox-probe");
    assert!(
        p.is_file(),
        "{} missing: run `bash scripts/dev.sh setup` first",
        p.display()
    );
    p
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

async fn host_per_call_us(host: &Host) -> f64 {
    let dev = host.device();
    let exe = dev
        .compile(SCALAR_ADD.as_bytes().to_vec(), true, 0)
        .await
        .unwrap();
    let a = dev
        .tensor_from_bytes(PrimitiveType::F32, &[], &1.5f32.to_le_bytes(), 0)
        .unwrap();
    let b = dev
        .tensor_from_bytes(PrimitiveType::F32, &[], &2.25f32.to_le_bytes(), 0)
        .unwrap();
    let args = [
        Arg {
            tensor: &a,
            donate: false,
        },
        Arg {
            tensor: &b,
            donate: false,
        },
    ];
    let mut rounds = Vec::new();
    for _ in 0..ROUNDS {
        let start = Instant::now();
        for _ in 0..CALLS {
            let out = dev.execute(&exe, &args).await.unwrap();
            drop(out);
        }
        rounds.push(start.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
    }
    median(rounds)
}

async fn guest_per_call_us(host: &Host, component: &wasmtime::component::Component) -> f64 {
    let mut rounds = Vec::new();
    for _ in 0..ROUNDS {
        let opts = RunOptions {
            args: vec!["exec-loop".into(), CALLS.to_string()],
            capture_output: true,
            // The guest times its own loop.
            allow_clock: true,
            stdin: Some(Vec::new()),
            ..RunOptions::default()
        };
        let o = host.run(component, "probe", &opts).await.unwrap();
        let out = String::from_utf8(o.stdout).unwrap();
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix("exec-loop: "))
            .expect("exec-loop line");
        let parts: Vec<&str> = line.split(' ').collect();
        assert_eq!(parts[2], "3.75", "the guest's result is 1.5 + 2.25");
        let ns: f64 = parts[1].parse().unwrap();
        rounds.push(ns / 1e3 / CALLS as f64);
    }
    median(rounds)
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cache = tempfile::tempdir().unwrap();
        let config = HostConfig {
            sandbox: SandboxConfig {
                cache_dir: Some(cache.path().to_path_buf()),
                ..SandboxConfig::default()
            },
            ..HostConfig::default()
        };
        let host = Arc::new(Host::new(config.clone()).unwrap());
        let wasm = probe_wasm();

        let t = Instant::now();
        let component = host.load_component(&wasm).unwrap();
        let cold_ms = t.elapsed().as_secs_f64() * 1e3;
        // A second host with the same settings reads the on-disk cache instead of compiling.
        let host2 = Host::with_device(Arc::clone(host.device()), config.sandbox.clone()).unwrap();
        let t = Instant::now();
        let _warm = host2.load_component(&wasm).unwrap();
        let warm_ms = t.elapsed().as_secs_f64() * 1e3;
        let (hits, _) = host2.sandbox().cache_stats();

        let mut inst = Vec::new();
        for _ in 0..50 {
            let opts = RunOptions {
                args: vec!["noop".into()],
                capture_output: true,
                stdin: Some(Vec::new()),
                ..RunOptions::default()
            };
            let o = host.run(&component, "probe", &opts).await.unwrap();
            inst.push(o.elapsed.as_secs_f64() * 1e6);
        }
        let inst_us = median(inst);

        let host_us = host_per_call_us(&host).await;
        let guest_us = guest_per_call_us(&host, &component).await;

        let p = host.device().platform();
        println!(
            "tpubox spine benchmark — {} {} (PJRT C API {}.{})",
            p.name, p.version, p.pjrt_api_version.0, p.pjrt_api_version.1
        );
        println!(
            "execute: scalar f32 add, inputs on device, {CALLS} calls × {ROUNDS} rounds (median)"
        );
        println!();
        println!("| measure | value | ratio |");
        println!("|---|---|---|");
        println!("| execute per call, host direct | {host_us:.2} µs | 1.00 |");
        println!(
            "| execute per call, from a guest | {guest_us:.2} µs | {:.2} |",
            guest_us / host_us
        );
        println!("| component load, cold (Cranelift) | {cold_ms:.1} ms | 1.00 |");
        println!(
            "| component load, warm (disk cache, {hits} hit) | {warm_ms:.1} ms | {:.3} |",
            warm_ms / cold_ms
        );
        println!("| instantiate + empty main (median of 50) | {inst_us:.0} µs | |");
    });
}
