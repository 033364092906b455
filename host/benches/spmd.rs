//! Programs over several devices (issue 45), each beside JAX on the same CPU devices in the
//! same run: one data-parallel training step of an MLP on 1, 2 and 4 devices, and an
//! all-reduce of 64 MiB over 4 devices inside a program against gathering the four 64 MiB
//! rows through the host (read, sum, put back). `spmd_jax.py` (the JAX venv's pinned jax)
//! exports the programs, writes their inputs and times JAX; this side compiles the same
//! artifacts over the session's devices and times `Session::execute_spmd` (inputs on the
//! devices, results waited for), median of the rounds.
//!
//! Run with `cargo bench -p tpubox --bench all -- spmd` after `bash scripts/dev.sh setup`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tpubox_core::npy::read_npy;
use tpubox_core::placement::Placement;
use tpubox_core::session::{ExecutableHandle, ProgramFormat, TensorHandle};
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{CompileSettings, DeviceConfig, NamedValue, Session, Tenant, TenantLimits};

const ROUNDS: usize = 20;

fn cache_dir() -> PathBuf {
    std::env::var_os("TPUBOX_CACHE_DIR").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/tpubox"),
        PathBuf::from,
    )
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64()
}

fn jax_side(dir: &Path) -> serde_json::Value {
    let python = cache_dir().join("venv-jax/bin/python");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/spmd_jax.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(dir)
        .args(["--rounds", &ROUNDS.to_string()])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running {} (bash scripts/dev.sh setup): {e}",
                python.display()
            )
        });
    assert!(
        out.status.success(),
        "spmd_jax.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or("{}")).expect("spmd_jax.py prints JSON")
}

async fn compile(s: &Session, dir: &Path, name: &str, n: u32) -> ExecutableHandle {
    let code = std::fs::read(dir.join(format!("{name}.mlirbc"))).unwrap();
    let devices: Vec<u32> = if n > 1 { (0..n).collect() } else { vec![] };
    s.compile_with(
        code,
        ProgramFormat::MlirBytecode,
        CompileSettings {
            devices,
            ..CompileSettings::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{name} compiles: {e}"))
}

/// The program's inputs, `[param][device]`.
fn put_all(s: &Session, exe: &ExecutableHandle, dir: &Path, name: &str) -> Vec<Vec<TensorHandle>> {
    (0..exe.executable().inputs().len())
        .map(|k| {
            let a = read_npy(&dir.join(format!("{name}.arg{k}.npy")), None).unwrap();
            let dims: Vec<u64> = a.dims.iter().map(|&d| d as u64).collect();
            if exe.executable().is_spmd() {
                s.put_sharded(exe, k, a.ty, &dims, &a.data).unwrap()
            } else {
                vec![s.tensor_from_bytes(a.ty, &dims, &a.data, None).unwrap()]
            }
        })
        .collect()
}

async fn run(
    s: &Session,
    exe: &ExecutableHandle,
    args: &[Vec<TensorHandle>],
) -> Vec<Vec<TensorHandle>> {
    if exe.executable().is_spmd() {
        let refs: Vec<Vec<&TensorHandle>> = args.iter().map(|a| a.iter().collect()).collect();
        s.execute_spmd(exe, &refs, &[]).await.unwrap()
    } else {
        let refs: Vec<&TensorHandle> = args.iter().map(|a| &a[0]).collect();
        s.execute(exe, &refs, &[])
            .await
            .unwrap()
            .into_iter()
            .map(|t| vec![t])
            .collect()
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn main() {
    let dir = tempfile::tempdir().unwrap();
    let jax = jax_side(dir.path());
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
        let tenant = Tenant::new(
            "bench",
            TenantLimits {
                max_device_bytes: 8 << 30,
                ..TenantLimits::default()
            },
        );
        let s = Session::new(Arc::clone(&dev), Arc::new(WeightRegistry::new()), tenant)
            .with_placement(Placement::fixed(vec![0, 1, 2, 3]));
        let mut rows = Vec::new();
        for n in [1u32, 2, 4] {
            let name = format!("mlp_step_d{n}");
            let exe = compile(&s, dir.path(), &name, n).await;
            let args = put_all(&s, &exe, dir.path(), &name);
            // Checked against JAX's first result (the updated w1).
            let out = run(&s, &exe, &args).await;
            let got = if exe.executable().is_spmd() {
                f32s(&s.read_sharded(&exe, 0, &out[0]).await.unwrap())
            } else {
                f32s(&s.read(&out[0][0]).await.unwrap())
            };
            let want = read_npy(&dir.path().join(format!("{name}.out0.npy")), None).unwrap();
            let diff = got
                .iter()
                .zip(f32s(&want.data))
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-4, "{name}: differs from JAX by {diff}");
            drop(out);
            let mut times = Vec::with_capacity(ROUNDS);
            for _ in 0..ROUNDS {
                let t = Instant::now();
                drop(run(&s, &exe, &args).await);
                times.push(t.elapsed());
            }
            rows.push((name.clone(), n, median(times), jax[&name]["jax_seconds"].as_f64().unwrap()));
        }

        let name = "allreduce_64mib";
        let exe = compile(&s, dir.path(), name, 4).await;
        let args = put_all(&s, &exe, dir.path(), name);
        drop(run(&s, &exe, &args).await);
        let rounds = ROUNDS / 4;
        let mut times = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            drop(run(&s, &exe, &args).await);
            times.push(t.elapsed());
        }
        let in_program = median(times);
        // The same sum through the host: read the four rows, add them, put the sum on every
        // device.
        let mut times = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            let mut sum = vec![0f32; 16 << 20];
            for h in &args[0] {
                for (acc, v) in sum.iter_mut().zip(f32s(&s.read(h).await.unwrap())) {
                    *acc += v;
                }
            }
            let bytes: Vec<u8> = sum.iter().flat_map(|v| v.to_le_bytes()).collect();
            let back: Vec<TensorHandle> = (0..4)
                .map(|d| {
                    s.tensor_from_bytes(
                        tpubox_core::PrimitiveType::F32,
                        &[1, 16 << 20],
                        &bytes,
                        Some(d),
                    )
                    .unwrap()
                })
                .collect();
            drop(back);
            times.push(t.elapsed());
        }
        let via_host = median(times);
        let jax_allreduce = jax[name]["jax_seconds"].as_f64().unwrap();

        println!(
            "tpubox SPMD benchmark — 4 CPU devices (cpu_device_count), JAX (venv-jax) on the same devices, median of {ROUNDS} rounds ({rounds} for the all-reduce)"
        );
        println!();
        println!("| program | devices | tpubox ms | JAX ms | tpubox / JAX |");
        println!("|---|---:|---:|---:|---:|");
        for (name, n, t, j) in rows {
            println!("| {name} | {n} | {:.2} | {:.2} | {:.2} |", t * 1e3, j * 1e3, t / j);
        }
        println!(
            "| all-reduce of 64 MiB, inside the program (psum) | 4 | {:.1} | {:.1} | {:.2} |",
            in_program * 1e3,
            jax_allreduce * 1e3,
            in_program / jax_allreduce
        );
        println!(
            "| the same through the host (read 4 × 64 MiB, add, put back 4 ×) | 4 | {:.1} | — | {:.2} × in-program |",
            via_host * 1e3,
            via_host / in_program
        );
    });
}
