//! embed-multitenant: runs N tenants' guests concurrently on one embedded tpubox host and prints
//! a per-tenant usage table (see the library docs).
//!
//! ```sh
//! cargo run --release -p embed-multitenant -- [--tenants 16] [--runs 3] [--guest auto|hello|minilm] [--slots 2]
//! ```

use std::process::ExitCode;

use embed_multitenant::{Config, GuestKind, run};

const USAGE: &str = "usage: embed-multitenant [--tenants N] [--runs R] [--guest auto|hello|minilm] [--slots S] [--wasm-dir DIR]";

fn parse(mut args: impl Iterator<Item = String>) -> Result<Config, String> {
    let mut c = Config::default();
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let num = |v: String, name: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{name}: `{v}` is not a number"))
        };
        match a.as_str() {
            "--tenants" => c.tenants = num(value("--tenants")?, "--tenants")?,
            "--runs" => c.runs = num(value("--runs")?, "--runs")?,
            "--slots" => c.execution_slots = num(value("--slots")?, "--slots")?,
            "--wasm-dir" => c.wasm_dir = Some(value("--wasm-dir")?.into()),
            "--guest" => {
                c.guest = match value("--guest")?.as_str() {
                    "auto" => None,
                    "hello" => Some(GuestKind::Hello),
                    "minilm" => Some(GuestKind::MiniLm),
                    g => return Err(format!("unknown guest `{g}`")),
                }
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if c.tenants == 0 {
        return Err("--tenants must be at least 1".into());
    }
    Ok(c)
}

fn main() -> ExitCode {
    let config = match parse(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("embed-multitenant: {msg}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("embed-multitenant: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(&config)) {
        Ok(report) => {
            let (runs, total) = report.totals();
            println!(
                "{} tenants × {} runs of {} on one host: {runs} runs checked in {:.2} s ({:.1} runs/s)",
                report.tenants.len(),
                config.runs,
                report.guest.package(),
                report.wall.as_secs_f64(),
                runs as f64 / report.wall.as_secs_f64()
            );
            if report.shared_weight_bytes > 0 {
                println!(
                    "shared weights: {} device bytes, held once for all tenants and charged to none",
                    report.shared_weight_bytes
                );
            }
            println!();
            print!("{}", report.table());
            if total.refused > 0 {
                println!("\n{} requests were refused by tenant limits", total.refused);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("embed-multitenant: {e:#}");
            ExitCode::FAILURE
        }
    }
}
