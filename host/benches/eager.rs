//! The eager modes side by side (issue 28): the workloads of the eager test guest's `bench`
//! case (`tests/guests/eager/src/bench.rs`: a 150-op element-wise chain on `f32[2048,2048]`,
//! a 2-layer MLP at batch 1, 32 and 256, one MiniLM encoder layer from the shared weights, a
//! stream of 200 bounded-length inputs), each run in DEFER_NEVER_AND_LAUNCH_BLOCKING,
//! DEFER_NEVER, DEFER_AND_FUSE and as one compiled graph, in one process, timed inside the
//! guest, in [`ROUNDS`] rounds (median). Each (workload, mode) is a fresh guest run with a fresh tenant (its peak device bytes
//! are that run's), on a host whose compile cache is off, so that every mode's first step pays
//! for its own compiles.
//!
//! Run with `cargo bench -p tpubox --bench all -- eager` after `bash scripts/dev.sh setup`
//! (the MiniLM weights: `tpubox setup minilm`).

use std::collections::HashMap;

use tpubox_core::cache::{CacheConfig, CacheMode};
use tpubox_wasm::{Host, HostConfig, RunOptions, SandboxConfig};

/// Modes in the order they run, with the column names of the tables.
const MODES: [(&str, &str); 4] = [
    ("blocking", "LAUNCH_BLOCKING"),
    ("never", "DEFER_NEVER"),
    ("fuse", "DEFER_AND_FUSE"),
    ("graph", "compiled graph"),
];

/// Workloads: guest name, table name, steps.
const WORKLOADS: [(&str, &str, usize); 7] = [
    ("chain", "150-op chain, f32[2048,2048]", 8),
    ("mlp1", "MLP 512→2048→512, batch 1", 30),
    ("mlp32", "MLP, batch 32", 30),
    ("mlp256", "MLP, batch 256", 20),
    ("encoder32", "MiniLM encoder layer, 32 tokens", 30),
    ("encoder128", "MiniLM encoder layer, 128 tokens", 20),
    ("stream", "200 bounded lengths 1..=128 (per input)", 200),
];

/// Rounds of every (workload, mode) run.
const ROUNDS: usize = 5;

/// One `bench:` line, parsed, with the run's peak device bytes.
struct Row {
    fields: HashMap<String, String>,
    peak_bytes: u64,
}

impl Row {
    fn f(&self, k: &str) -> f64 {
        self.fields
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let config = HostConfig {
            sandbox: SandboxConfig {
                cache_dir: None,
                ..SandboxConfig::default()
            },
            cache: CacheConfig {
                mode: CacheMode::Off,
                disk_dir: None,
                remote_url: None,
                ..CacheConfig::default()
            },
            ..HostConfig::default()
        };
        let host = Host::new(config).unwrap();
        let model = tpubox_core::plugin::known("minilm")
            .and_then(|p| p.installed_library())
            .expect("run `tpubox setup minilm` first");
        host.load_weights("minilm", &model.join("model.safetensors"))
            .unwrap();
        let guest = host
            .load_component(&crate::guest_wasm("tpubox-eager"))
            .unwrap();

        let p = host.device().platform();
        println!(
            "tpubox eager benchmark — {} {} (PJRT C API {}.{}); compile cache off; times in ms, guest-timed; median of {ROUNDS} rounds",
            p.name, p.version, p.pjrt_api_version.0, p.pjrt_api_version.1
        );
        // Rounds alternate the modes (and the workloads), so that a slower minute of a shared
        // machine falls on every column; each cell is the median over the rounds.
        let mut runs: HashMap<(&str, &str), Vec<Row>> = HashMap::new();
        for round in 0..ROUNDS {
            for (w, _, steps) in WORKLOADS {
                for (m, _) in MODES {
                    let opts = RunOptions {
                        args: vec![m.into(), "bench".into(), w.into(), steps.to_string()],
                        capture_output: true,
                        allow_clock: true,
                        stdin: Some(Vec::new()),
                        ..RunOptions::default()
                    };
                    let o = host.run(&guest, "tpubox-eager", &opts).await.unwrap();
                    let out = String::from_utf8_lossy(&o.stdout);
                    let line = out
                        .lines()
                        .find_map(|l| l.strip_prefix("bench: "))
                        .unwrap_or_else(|| {
                            panic!(
                                "{w}/{m}: no bench line in {out:?} {:?}",
                                String::from_utf8_lossy(&o.stderr)
                            )
                        });
                    assert!(!line.starts_with("ERROR"), "{w}/{m}: {line}");
                    let fields = line
                        .split(' ')
                        .filter_map(|kv| kv.split_once('='))
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect();
                    eprintln!("round {round} {w}/{m}: {line} peak={}", o.usage.peak_device_bytes);
                    runs.entry((w, m)).or_default().push(Row {
                        fields,
                        peak_bytes: o.usage.peak_device_bytes,
                    });
                }
            }
        }
        // Per cell: the round with the median steady-state step (its other fields with it).
        let rows: HashMap<(&str, &str), Row> = runs
            .into_iter()
            .map(|(k, mut v)| {
                v.sort_by(|a, b| a.f("step_ms").total_cmp(&b.f("step_ms")));
                let mid = v.len() / 2;
                (k, v.swap_remove(mid))
            })
            .collect();

        let cols: Vec<&str> = MODES.iter().map(|(_, c)| *c).collect();
        let table = |title: &str, cell: &dyn Fn(&Row) -> String| {
            println!();
            println!("{title}");
            println!();
            println!("| workload | {} |", cols.join(" | "));
            println!("|---|{}", "---:|".repeat(cols.len()));
            for (w, name, _) in WORKLOADS {
                let cells: Vec<String> = MODES.iter().map(|(m, _)| cell(&rows[&(w, *m)])).collect();
                println!("| {name} | {} |", cells.join(" | "));
            }
        };
        table("steady-state step (median, ms)", &|r| format!("{:.2}", r.f("step_ms")));
        table("first step (compiles included, ms)", &|r| format!("{:.1}", r.f("first_ms")));
        table("executions per step (after the first)", &|r| {
            format!("{:.1}", r.f("launches_per_step"))
        });
        table("compiles: first step / per later step", &|r| {
            format!("{} / {:.2}", r.f("compiles_first"), r.f("compiles_per_step"))
        });
        table("peak device bytes of the run (MiB)", &|r| format!("{:.1}", mib(r.peak_bytes)));

        println!();
        println!("ratios (steady state)");
        println!();
        println!("| workload | DEFER_AND_FUSE / compiled graph | DEFER_NEVER / DEFER_AND_FUSE | LAUNCH_BLOCKING / DEFER_NEVER | checksums agree (max rel. diff) |");
        println!("|---|---:|---:|---:|---:|");
        for (w, name, _) in WORKLOADS {
            let s = |m: &str| rows[&(w, m)].f("step_ms");
            let sums: Vec<f64> = MODES.iter().map(|(m, _)| rows[&(w, *m)].f("checksum")).collect();
            let reference = sums[3];
            let diff = sums
                .iter()
                .map(|c| (c - reference).abs() / reference.abs().max(1e-30))
                .fold(0.0, f64::max);
            println!(
                "| {name} | {:.2} | {:.2} | {:.2} | {diff:.1e} |",
                s("fuse") / s("graph"),
                s("never") / s("fuse"),
                s("blocking") / s("never"),
            );
        }
    });
}
