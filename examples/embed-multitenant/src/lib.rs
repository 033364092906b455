//! embed-multitenant: a program that embeds the tpubox host library and lends one device to
//! many tenants at once.
//!
//! One [`Host`] (one PJRT client, one Wasm engine, the MiniLM weights loaded once) runs a guest
//! for each of N tenants concurrently, as tokio tasks. Every tenant is its own [`Tenant`] with
//! its own limits, and runs its guest several times with its own inputs:
//!
//! - **MiniLM** (`minilm-embed.wasm`), when the model is installed (`tpubox setup minilm`): each
//!   run embeds a sentence shared by all tenants plus sentences of its own. Checked: one
//!   384-float, unit-length embedding per sentence, and the shared sentence embeds the same for
//!   every tenant and run.
//! - **hello-matmul** (`hello-matmul.wasm`) otherwise: each run uses its own `--scale`. Checked:
//!   the device's `tanh(x·w + b)` against a host-side recomputation from the printed inputs,
//!   and that the inputs carry the tenant's scale.
//!
//! The result is a per-tenant usage table ([`Report::table`]) from [`Tenant::usage`].
//!
//! The binary (`src/main.rs`) is the command-line front end; [`run`] is the whole example.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use tpubox_core::{Tenant, TenantLimits, TenantUsage};
use tpubox_wasm::{Host, HostConfig, RunOptions, SandboxConfig};

/// Which guest the tenants run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestKind {
    /// `examples/hello-matmul`: one small matmul per run.
    Hello,
    /// `examples/minilm-embed`: sentence embeddings with shared weights.
    MiniLm,
}

impl GuestKind {
    /// The component's file name (without `.wasm`) and package name.
    pub fn package(self) -> &'static str {
        match self {
            GuestKind::Hello => "hello-matmul",
            GuestKind::MiniLm => "minilm-embed",
        }
    }
}

/// How to run the example.
#[derive(Debug, Clone)]
pub struct Config {
    /// Number of tenants running at once.
    pub tenants: usize,
    /// Guest runs per tenant, one after the other.
    pub runs: usize,
    /// The guest; `None` picks MiniLM when its model files are installed, else hello-matmul.
    pub guest: Option<GuestKind>,
    /// Directory holding the guests' `.wasm` files; `None` is `$CARGO_TARGET_DIR` (else the
    /// workspace's `target/`) + `wasm32-wasip2/release`.
    pub wasm_dir: Option<PathBuf>,
    /// Executions the device runs at once ([`HostConfig::execution_slots`]).
    pub execution_slots: usize,
    /// Limits given to every tenant.
    pub limits: TenantLimits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            tenants: 16,
            runs: 3,
            guest: None,
            wasm_dir: None,
            execution_slots: tpubox_core::device::DEFAULT_EXECUTION_SLOTS,
            limits: TenantLimits {
                max_device_bytes: 256 << 20,
                max_live_tensors: 1_000,
                max_live_executables: 16,
                max_compiles_per_minute: 120,
                max_guest_memory: 512 << 20,
                max_call_time: Some(Duration::from_secs(300)),
                ..TenantLimits::default()
            },
        }
    }
}

/// One tenant's line of the report.
#[derive(Debug, Clone)]
pub struct TenantReport {
    /// The tenant's name.
    pub name: String,
    /// Guest runs that finished and whose results checked out.
    pub runs: usize,
    /// The tenant's usage after its last run.
    pub usage: TenantUsage,
}

/// What [`run`] did.
#[derive(Debug, Clone)]
pub struct Report {
    /// The guest every tenant ran.
    pub guest: GuestKind,
    /// One line per tenant, in tenant order.
    pub tenants: Vec<TenantReport>,
    /// Wall time from the first run's start to the last run's end.
    pub wall: Duration,
    /// Device bytes of the shared weights (0 for hello-matmul).
    pub shared_weight_bytes: u64,
}

/// A sentence every MiniLM tenant embeds, to compare across tenants.
pub const SHARED_SENTENCE: &str = "Many tenants share one accelerator.";

/// Directory of the MiniLM model files, when installed.
pub fn minilm_dir() -> Option<PathBuf> {
    tpubox_core::plugin::known("minilm").and_then(|p| p.installed_library())
}

/// Default directory of the guests' `.wasm` files.
pub fn default_wasm_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"))
        .join("wasm32-wasip2/release")
}

fn guest_wasm(dir: &Path, guest: GuestKind) -> Result<PathBuf> {
    let p = dir.join(format!("{}.wasm", guest.package()));
    if !p.is_file() {
        bail!(
            "{} is missing: build it with `cargo build --release --target wasm32-wasip2 -p {}` \
             (or `bash scripts/dev.sh setup`)",
            p.display(),
            guest.package()
        );
    }
    Ok(p)
}

/// Runs `config.tenants` tenants concurrently on one host and checks every result.
///
/// Errors: no PJRT plugin, a missing guest `.wasm` (the message names the build command), a
/// guest that fails, or a result that does not check out.
pub async fn run(config: &Config) -> Result<Report> {
    ensure!(config.tenants >= 1, "at least one tenant");
    let model = minilm_dir();
    let guest = match config.guest {
        Some(g) => g,
        None if model.is_some() => GuestKind::MiniLm,
        None => GuestKind::Hello,
    };
    let wasm = guest_wasm(
        &config.wasm_dir.clone().unwrap_or_else(default_wasm_dir),
        guest,
    )?;
    let host = Host::new(HostConfig {
        execution_slots: config.execution_slots,
        sandbox: SandboxConfig {
            // One pooled instance slot per concurrent guest.
            max_instances: (config.tenants as u32).max(64),
            ..SandboxConfig::default()
        },
        ..HostConfig::default()
    })?;
    let mut shared_weight_bytes = 0;
    let mut dirs = Vec::new();
    if guest == GuestKind::MiniLm {
        let model = model.context("MiniLM model files are missing: run `tpubox setup minilm`")?;
        let set = host.load_weights("minilm", &model.join("model.safetensors"))?;
        shared_weight_bytes = set.device_bytes();
        dirs.push((model, "/model".to_string()));
    }
    let component = host.load_component(&wasm)?;
    let host = Arc::new(host);

    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..config.tenants {
        let tenant = Tenant::new(format!("tenant-{i:02}"), config.limits.clone());
        let (host, component, dirs, runs) = (
            Arc::clone(&host),
            component.clone(),
            dirs.clone(),
            config.runs,
        );
        tasks.push(tokio::spawn(async move {
            let mut shared = Vec::new();
            for r in 0..runs {
                let opts = RunOptions {
                    args: guest_args(guest, i, r),
                    dirs: dirs.clone(),
                    stdin: Some(Vec::new()),
                    capture_output: true,
                    tenant: Some(Arc::clone(&tenant)),
                    ..RunOptions::default()
                };
                let out = host
                    .run(&component, guest.package(), &opts)
                    .await
                    .with_context(|| format!("{} run {r}", tenant.name()))?;
                let stdout = String::from_utf8_lossy(&out.stdout);
                ensure!(
                    out.success,
                    "{} run {r} failed: {}",
                    tenant.name(),
                    String::from_utf8_lossy(&out.stderr)
                );
                match guest {
                    GuestKind::Hello => check_hello(&stdout, scale(i, r)),
                    GuestKind::MiniLm => check_minilm(&stdout, &opts.args[1..], &mut shared),
                }
                .with_context(|| format!("{} run {r}: wrong result", tenant.name()))?;
            }
            Ok::<_, anyhow::Error>((tenant, shared))
        }));
    }
    let mut tenants = Vec::new();
    let mut reference: Option<Vec<f64>> = None;
    for t in tasks {
        let (tenant, shared) = t.await.context("tenant task panicked")??;
        // The shared sentence must embed the same for every tenant and run.
        for e in shared {
            match &reference {
                None => reference = Some(e),
                Some(r) => {
                    let c = cosine(r, &e);
                    ensure!(
                        c > 0.9999,
                        "{}: the shared sentence embeds differently (cosine {c})",
                        tenant.name()
                    );
                }
            }
        }
        tenants.push(TenantReport {
            name: tenant.name().to_string(),
            runs: config.runs,
            usage: tenant.usage(),
        });
    }
    Ok(Report {
        guest,
        tenants,
        wall: start.elapsed(),
        shared_weight_bytes,
    })
}

/// The `--scale` of tenant `i`'s run `r` (hello-matmul): distinct for every run.
pub fn scale(i: usize, r: usize) -> f32 {
    1.0 + i as f32 * 0.25 + r as f32 * 0.03125
}

fn guest_args(guest: GuestKind, i: usize, r: usize) -> Vec<String> {
    match guest {
        GuestKind::Hello => vec!["--scale".into(), scale(i, r).to_string()],
        GuestKind::MiniLm => vec![
            "--json".into(),
            SHARED_SENTENCE.into(),
            format!("Tenant number {i} embeds its own sentence in run {r}."),
            format!("Run {r} of tenant {i} is one of many on the same device."),
        ],
    }
}

fn json_line<T: serde::de::DeserializeOwned>(stdout: &str, key: &str) -> Result<T> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .with_context(|| format!("no `{key}` line in the guest's output"))?;
    serde_json::from_str(line.trim()).with_context(|| format!("parsing the `{key}` line"))
}

/// Checks hello-matmul's output: the result against `tanh(x·w + b)` recomputed here from the
/// printed inputs, and that `x` carries `scale`.
pub fn check_hello(stdout: &str, scale: f32) -> Result<()> {
    let x: Vec<Vec<f64>> = json_line(stdout, "x:")?;
    let w: Vec<Vec<f64>> = json_line(stdout, "w:")?;
    let b: Vec<f64> = json_line(stdout, "b:")?;
    let got: Vec<Vec<f64>> = json_line(stdout, "result:")?;
    // hello-matmul's x[0][0] is 0.5 before scaling.
    let want_x00 = f64::from(0.5f32 * scale);
    ensure!(
        (x[0][0] - want_x00).abs() <= 1e-6 * want_x00.abs().max(1.0),
        "x[0][0] is {}, expected {want_x00} (scale {scale})",
        x[0][0]
    );
    ensure!(got.len() == x.len(), "result has {} rows", got.len());
    for (i, row) in x.iter().enumerate() {
        ensure!(got[i].len() == b.len(), "result row {i} has wrong length");
        for (j, g) in got[i].iter().enumerate() {
            let s: f64 = row.iter().zip(&w).map(|(xk, wk)| xk * wk[j]).sum::<f64>() + b[j];
            let want = s.tanh();
            ensure!(
                (g - want).abs() <= 1e-5,
                "result[{i}][{j}] = {g}, expected {want}"
            );
        }
    }
    Ok(())
}

/// Checks minilm-embed's `--json` output for `sentences`: one unit-length 384-float embedding
/// each; the embeddings of [`SHARED_SENTENCE`] are appended to `shared`.
pub fn check_minilm(stdout: &str, sentences: &[String], shared: &mut Vec<Vec<f64>>) -> Result<()> {
    let records: Vec<serde_json::Value> =
        serde_json::from_str(stdout.trim()).context("parsing the guest's JSON output")?;
    ensure!(
        records.len() == sentences.len(),
        "{} embeddings for {} sentences",
        records.len(),
        sentences.len()
    );
    for (rec, want) in records.iter().zip(sentences) {
        ensure!(rec["text"] == want.as_str(), "records out of order");
        let e: Vec<f64> = serde_json::from_value(rec["embedding"].clone())?;
        ensure!(e.len() == 384, "embedding of length {}", e.len());
        let norm = e.iter().map(|v| v * v).sum::<f64>().sqrt();
        ensure!((norm - 1.0).abs() < 1e-3, "embedding norm {norm}");
        if want == SHARED_SENTENCE {
            shared.push(e);
        }
    }
    Ok(())
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

impl Report {
    /// Sum of every tenant's usage (peaks summed too: an upper bound of what was held at once).
    pub fn totals(&self) -> (usize, TenantUsage) {
        let mut runs = 0;
        let mut t = TenantUsage::default();
        for r in &self.tenants {
            let u = &r.usage;
            runs += r.runs;
            t.device_bytes += u.device_bytes;
            t.peak_device_bytes += u.peak_device_bytes;
            t.live_tensors += u.live_tensors;
            t.peak_live_tensors += u.peak_live_tensors;
            t.live_executables += u.live_executables;
            t.compiles += u.compiles;
            t.executions += u.executions;
            t.device_seconds += u.device_seconds;
            t.refused += u.refused;
        }
        (runs, t)
    }

    /// The per-tenant usage table with a totals row, as markdown.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "| tenant | runs | executions | device s | peak device bytes | peak live tensors | compiles | refused |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
        let mut line = |name: &str, runs: usize, u: &TenantUsage| {
            let _ = writeln!(
                s,
                "| {name} | {runs} | {} | {:.3} | {} | {} | {} | {} |",
                u.executions,
                u.device_seconds,
                u.peak_device_bytes,
                u.peak_live_tensors,
                u.compiles,
                u.refused
            );
        };
        for t in &self.tenants {
            line(&t.name, t.runs, &t.usage);
        }
        let (runs, total) = self.totals();
        line("**total**", runs, &total);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four hello-matmul tenants, two runs each: every number of the table is known exactly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_hello_tenants_account_exactly() {
        let config = Config {
            tenants: 4,
            runs: 2,
            guest: Some(GuestKind::Hello),
            ..Config::default()
        };
        let report = run(&config).await.expect("the example runs");
        assert_eq!(report.tenants.len(), 4);
        for t in &report.tenants {
            let u = &t.usage;
            assert_eq!(t.runs, 2);
            // One execution per run. Only compiles tier 1 did not serve are charged: a tenant's
            // second run hits the in-memory tier, and so may its first when another tenant
            // compiled the same program before it looked.
            assert_eq!((u.executions, u.refused), (2, 0), "{u:?}");
            assert!(u.compiles <= 1, "{u:?}");
            // x f32[2,3] + w f32[3,4] + b f32[4] + result f32[2,4], all held at once.
            assert_eq!(u.peak_device_bytes, 24 + 48 + 16 + 32, "{u:?}");
            assert_eq!(u.peak_live_tensors, 4, "{u:?}");
            assert_eq!(
                (u.device_bytes, u.live_tensors, u.live_executables),
                (0, 0, 0)
            );
            assert!(u.device_seconds > 0.0);
        }
        let charged: u64 = report.tenants.iter().map(|t| t.usage.compiles).sum();
        assert!((1..=4).contains(&charged), "{charged} compiles charged");
        let (runs, total) = report.totals();
        assert_eq!((runs, total.executions), (8, 8));
        assert!(report.table().contains("| **total** | 8 | 8 |"));
    }

    #[test]
    fn a_missing_guest_names_the_build_command() {
        let err = guest_wasm(Path::new("/nonexistent"), GuestKind::Hello).unwrap_err();
        assert!(
            err.to_string()
                .contains("cargo build --release --target wasm32-wasip2 -p hello-matmul"),
            "{err}"
        );
    }
}
