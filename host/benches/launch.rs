//! Launching without waiting (issue 28): how long `launch` of a long-running program takes to
//! return, against how long waiting for it takes, from the host (`Session::launch`) and from a
//! guest (the probe's `launch timing`, timed by the guest). Also the per-call cost of
//! `execute` (launch + wait) against launching a batch and waiting once, for a tiny program.

use std::sync::Arc;
use std::time::Instant;

use tpubox_core::session::ProgramFormat;
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{PrimitiveType, Session, Tenant, TenantLimits};
use tpubox_wasm::{Host, HostConfig, RunOptions, SandboxConfig};

/// Trips of the long-running loop (a few element-wise ops over `f32[512,512]` per trip).
const TRIPS: u64 = 800;
/// Repetitions of each long measurement (median reported).
const ROUNDS: usize = 5;
/// Tiny executions per round for the per-call comparison.
const CALLS: usize = 2000;

fn long_program(trips: u64) -> String {
    format!(
        r#"func.func public @main(%a: tensor<512x512xf32>) -> tensor<512x512xf32> {{
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

const SCALAR_ADD: &str = r#"func.func public @main(%a: tensor<f32>, %b: tensor<f32>) -> tensor<f32> {
  %0 = stablehlo.add %a, %b : tensor<f32>
  return %0 : tensor<f32>
}
"#;

use crate::spine::median;

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
        let host = Arc::new(Host::new(config).unwrap());
        let dev = Arc::clone(host.device());
        let tenant = Tenant::new("bench-launch", TenantLimits::default());
        let s = Session::new(
            Arc::clone(&dev),
            Arc::new(WeightRegistry::new()),
            Arc::clone(&tenant),
        );

        // Host: the long program.
        let exe = s
            .compile(
                long_program(TRIPS).into_bytes(),
                ProgramFormat::MlirText,
                None,
            )
            .await
            .unwrap();
        let bytes: Vec<u8> = (0..512 * 512).flat_map(|_| 0.25f32.to_le_bytes()).collect();
        let x = s
            .tensor_from_bytes(PrimitiveType::F32, &[512, 512], &bytes, None)
            .unwrap();
        drop(s.execute(&exe, &[&x], &[]).await.unwrap());
        let (mut host_launch, mut host_wait) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let start = Instant::now();
            let l = s.launch(&exe, &[&x], &[]).await.unwrap();
            host_launch.push(start.elapsed().as_secs_f64() * 1e3);
            s.wait(&l.outputs[0]).await.unwrap();
            host_wait.push(start.elapsed().as_secs_f64() * 1e3);
        }

        // Host: a tiny program, execute per call against launching CALLS and waiting once.
        let add = s
            .compile(SCALAR_ADD.as_bytes().to_vec(), ProgramFormat::MlirText, None)
            .await
            .unwrap();
        let a = s
            .tensor_from_bytes(PrimitiveType::F32, &[], &1.5f32.to_le_bytes(), None)
            .unwrap();
        let (mut exec_us, mut launch_us) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let start = Instant::now();
            for _ in 0..CALLS {
                drop(s.execute(&add, &[&a, &a], &[]).await.unwrap());
            }
            exec_us.push(start.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
            let start = Instant::now();
            let mut held = Vec::with_capacity(200);
            for i in 0..CALLS {
                held.push(s.launch(&add, &[&a, &a], &[]).await.unwrap());
                // Stay under max-pending-launches (256).
                if i % 200 == 199 {
                    s.wait_all().await.unwrap();
                    held.clear();
                }
            }
            s.wait_all().await.unwrap();
            launch_us.push(start.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
        }

        // Guest: the probe's `launch timing`, timed inside the guest.
        let probe = host
            .load_component(&crate::guest_wasm("tpubox-probe"))
            .unwrap();
        let (mut guest_launch, mut guest_wait) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let opts = RunOptions {
                args: vec!["launch".into(), "timing".into(), TRIPS.to_string()],
                capture_output: true,
                allow_clock: true,
                stdin: Some(Vec::new()),
                ..RunOptions::default()
            };
            let o = host.run(&probe, "probe", &opts).await.unwrap();
            let out = String::from_utf8(o.stdout).unwrap();
            let line = out
                .lines()
                .find_map(|l| l.strip_prefix("timing: "))
                .unwrap_or_else(|| panic!("no timing line in {out:?}"));
            let field = |k: &str| -> f64 {
                line.split(' ')
                    .find_map(|f| f.strip_prefix(k))
                    .unwrap()
                    .parse::<f64>()
                    .unwrap()
                    / 1e6
            };
            guest_launch.push(field("launch_ns="));
            guest_wait.push(field("wait_ns="));
        }

        let p = dev.platform();
        println!(
            "tpubox launch benchmark — {} {} (PJRT C API {}.{})",
            p.name, p.version, p.pjrt_api_version.0, p.pjrt_api_version.1
        );
        println!(
            "long program: a {TRIPS}-trip while loop over f32[512,512] (tanh, exp, multiply); median of {ROUNDS}"
        );
        println!();
        println!("| measure | launch returns | wait returns (from the launch) |");
        println!("|---|---|---|");
        println!(
            "| host, `Session::launch` + `wait` | {:.3} ms | {:.1} ms |",
            median(host_launch),
            median(host_wait)
        );
        println!(
            "| guest (probe `launch timing`, guest-timed) | {:.3} ms | {:.1} ms |",
            median(guest_launch),
            median(guest_wait)
        );
        println!();
        println!("tiny program: scalar f32 add, inputs on device, {CALLS} calls × {ROUNDS} rounds (median)");
        println!();
        println!("| measure | per call |");
        println!("|---|---|");
        println!("| `Session::execute` (launch + wait) | {:.2} µs |", median(exec_us));
        println!(
            "| `Session::launch`, `wait_all` every 200 | {:.2} µs |",
            median(launch_us)
        );
        let u = tenant.usage();
        println!();
        println!(
            "tenant: {} executions, {:.3} device-seconds billed, {} pending",
            u.executions, u.device_seconds, u.pending_launches
        );
    });
}
