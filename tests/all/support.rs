//! Helpers shared by the integration tests.

use std::path::PathBuf;

use std::sync::Arc;

use tpubox_core::device::Arg;
use tpubox_core::{DeviceError, DeviceService, PrimitiveType};
use tpubox_wasm::{HostConfig, SandboxConfig};

/// Path of the guest component `name`, built for wasm32-wasip2 in release mode.
///
/// Panics with the command that builds it when the file is missing.
pub fn wasm(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let p = target
        .join("wasm32-wasip2/release")
        .join(format!("{name}.wasm"));
    assert!(
        p.is_file(),
        "{} is missing: build the guests first (bash scripts/dev.sh test does)",
        p.display()
    );
    p
}

/// A host configuration for tests: 256 MiB guest memory cap, no component disk cache, and
/// programs compiled in `tpubox compile-worker` processes (this package's binary), as the
/// `tpubox` command does.
pub fn test_host_config() -> HostConfig {
    HostConfig {
        compile_isolation: tpubox_core::compiler::CompileIsolation {
            worker: Some(PathBuf::from(env!("CARGO_BIN_EXE_tpubox"))),
            ..Default::default()
        },
        sandbox: SandboxConfig {
            max_guest_memory: 256 << 20,
            cache_dir: None,
            ..SandboxConfig::default()
        },
        ..HostConfig::default()
    }
}

/// Path of the C, Python or JavaScript example guest `name` (`c-mlp`, `python-mlp`, `js-mlp`),
/// built by `scripts/dev.sh` into `target/polyglot/`.
///
/// Panics with the command that builds it when the file is missing.
pub fn polyglot_wasm(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let p = target.join("polyglot").join(format!("{name}.wasm"));
    assert!(
        p.is_file(),
        "{} is missing: build it with `bash scripts/dev.sh polyglot` (or `bash scripts/dev.sh setup`)",
        p.display()
    );
    p
}

// Inputs of examples/hello-matmul, restated here; the expected result is computed below.
const HELLO_X: [f32; 6] = [0.5, -1.25, 2.0, 1.5, 0.25, -0.75];
const HELLO_W: [f32; 12] = [
    0.2, -0.4, 0.1, 0.3, //
    -0.3, 0.15, 0.25, -0.2, //
    0.05, 0.1, -0.35, 0.4,
];
const HELLO_B: [f32; 4] = [0.1, -0.2, 0.05, -0.15];

/// `tanh(x · w + b)` for hello-matmul's inputs with x scaled by `scale`, in f64: 2 rows of 4.
pub fn hello_expected(scale: f32) -> Vec<Vec<f32>> {
    let x: Vec<f32> = HELLO_X.iter().map(|v| v * scale).collect();
    (0..2)
        .map(|i| {
            (0..4)
                .map(|j| {
                    let acc: f64 = (0..3)
                        .map(|k| f64::from(x[i * 3 + k]) * f64::from(HELLO_W[k * 4 + j]))
                        .sum();
                    (acc + f64::from(HELLO_B[j])).tanh() as f32
                })
                .collect()
        })
        .collect()
}

/// Compiles `program` (MLIR text of `f32[4] -> f32[4]` that multiplies by a constant), runs it
/// on `[1, -2, 0.5, 8]` and checks the result is `factor` times that (exactly: the factors used
/// are powers of two times small integers).
///
/// Errors: the service's compile, transfer or execute error.
pub async fn scale_and_check(
    svc: &Arc<DeviceService>,
    program: &str,
    factor: f32,
) -> Result<(), DeviceError> {
    let exe = svc.compile(program.as_bytes().to_vec(), true, 0).await?;
    let x = [1.0f32, -2.0, 0.5, 8.0];
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let t = svc.tensor_from_bytes(PrimitiveType::F32, &[4], &bytes, 0)?;
    let arg = Arg {
        tensor: &t,
        donate: false,
    };
    let out = svc.execute(&exe, &[arg]).await?;
    let got: Vec<f32> = svc
        .read(&out[0])
        .await?
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let want: Vec<f32> = x.iter().map(|v| v * factor).collect();
    assert_eq!(got, want);
    Ok(())
}

/// A session tensor `f32[4]` holding `v`.
pub fn put4(s: &tpubox_core::Session, v: [f32; 4]) -> tpubox_core::session::TensorHandle {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    s.tensor_from_bytes(PrimitiveType::F32, &[4], &bytes, None)
        .expect("the tensor is created")
}

/// A session tensor's values as f32s (read once its launch finished).
pub async fn read_f32(
    s: &tpubox_core::Session,
    t: &tpubox_core::session::TensorHandle,
) -> Vec<f32> {
    s.read(t)
        .await
        .expect("the tensor reads")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The CPU plugin with 4 devices (`cpu_device_count`, the stand-in for a TPU host's chips), two
/// execution slots each, compiling in process, no compile cache: one per test process, shared
/// by the placement, SPMD and exec suites.
pub fn four_devices() -> Arc<DeviceService> {
    static DEV: std::sync::OnceLock<Arc<DeviceService>> = std::sync::OnceLock::new();
    Arc::clone(DEV.get_or_init(|| {
        tpubox_core::open_device(&tpubox_core::DeviceConfig {
            client_options: vec![(
                "cpu_device_count".to_string(),
                tpubox_core::NamedValue::Int64(4),
            )],
            cache: tpubox_core::cache::CacheConfig {
                mode: tpubox_core::cache::CacheMode::Off,
                disk_dir: None,
                remote_url: None,
                ..Default::default()
            },
            compile_isolation: tpubox_core::compiler::CompileIsolation {
                worker: None,
                ..Default::default()
            },
            execution_slots: 2,
            ..Default::default()
        })
        .expect("the CPU plugin opens with 4 devices")
    }))
}

/// Runs `component` (a WASI command) on `host` with `args` (after argv 0) as `tenant`,
/// placed on `devices` (`None`: every device), its output captured; panics unless it exits
/// with 0, showing its output. Returns its stdout.
pub async fn run_guest(
    host: &tpubox_wasm::Host,
    component: &wasmtime::component::Component,
    args: &[&str],
    tenant: &std::sync::Arc<tpubox_core::Tenant>,
    devices: Option<Vec<u32>>,
) -> String {
    let opts = tpubox_wasm::RunOptions {
        args: args.iter().map(|a| a.to_string()).collect(),
        capture_output: true,
        stdin: Some(Vec::new()),
        tenant: Some(std::sync::Arc::clone(tenant)),
        devices,
        ..tpubox_wasm::RunOptions::default()
    };
    let o = host
        .run(component, "guest", &opts)
        .await
        .unwrap_or_else(|e| panic!("{args:?}: {e:#}"));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(
        o.exit_code,
        0,
        "{args:?}: {out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// The rest of the line `KEY: REST` of a guest's output; panics when there is none.
pub fn line<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(": ")))
        .unwrap_or_else(|| panic!("no `{key}:` line in {out:?}"))
}
