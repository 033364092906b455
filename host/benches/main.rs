//! tpubox's benchmarks, one binary (linked once, like the tests): `cargo bench -p tpubox
//! --bench all -- NAME...` runs the named ones in order; with no name it lists them. Each prints
//! its tables (recorded in `docs/BENCHMARKS.md`).

mod budget;
mod cache;
mod devices;
mod eager;
mod exported;
mod isolation;
mod launch;
mod loops;
mod minilm;
mod optlevel;
mod serve;
mod sessions;
mod spine;
mod spmd;
mod tenants;

/// Name, what it measures, entry point.
const BENCHES: &[(&str, &str, fn())] = &[
    (
        "spine",
        "the cost of the sandbox per host call",
        spine::main,
    ),
    (
        "minilm",
        "MiniLM: guest, native host and the anchors",
        minilm::main,
    ),
    (
        "cache",
        "compile cache: time to first result per tier",
        cache::main,
    ),
    ("tenants", "N tenants sharing one device", tenants::main),
    (
        "isolation",
        "compile isolation: worker processes vs in process",
        isolation::main,
    ),
    (
        "optlevel",
        "compile time at XLA optimisation levels O0-O3",
        optlevel::main,
    ),
    (
        "serve",
        "serving MiniLM over the Open Inference Protocol",
        serve::main,
    ),
    (
        "sessions",
        "the session API: tiny calls and large transfers",
        sessions::main,
    ),
    (
        "budget",
        "per-tenant budgets: a tenant's tiny calls beside another tenant's two heavy clients",
        budget::main,
    ),
    (
        "devices",
        "placement: a tenant's tiny calls beside another tenant's two heavy clients, on one device and on devices of their own",
        devices::main,
    ),
    (
        "spmd",
        "programs over several devices: a data-parallel MLP step on 1, 2, 4 devices and a 64 MiB all-reduce, beside JAX",
        spmd::main,
    ),
    (
        "eager",
        "the eager modes and a compiled graph side by side (guest-timed)",
        eager::main,
    ),
    (
        "loops",
        "the loop budget: per compile and per trip, against the same loop trusted",
        loops::main,
    ),
    (
        "exported",
        "an exported (JAX, StableHLO) MiniLM served natively vs the MiniLM guest, 16 clients",
        exported::main,
    ),
    (
        "launch",
        "launch without waiting: launch vs wait of a long program, host and guest",
        launch::main,
    ),
];

/// The guest component `name` built for wasm32-wasip2 in release (`scripts/dev.sh setup`
/// builds them), under `$CARGO_TARGET_DIR` or the workspace's `target/`.
pub fn guest_wasm(name: &str) -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join(format!("wasm32-wasip2/release/{name}.wasm"))
}

fn main() {
    // cargo passes `--bench` to a harness-less bench; flags are not bench names.
    let names: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if names.is_empty() {
        eprintln!("usage: cargo bench -p tpubox --bench all -- NAME...\n");
        for (name, what, _) in BENCHES {
            eprintln!("  {name:<10} {what}");
        }
        return;
    }
    for name in &names {
        let Some((_, _, run)) = BENCHES.iter().find(|(n, _, _)| n == name) else {
            eprintln!("no benchmark {name:?}; run without a name for the list");
            std::process::exit(2);
        };
        run();
    }
}
