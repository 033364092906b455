//! tpubox's integration tests: one test binary (as wasmtime's `tests/all`), so that a test run
//! links once, not once per file. Each module is one suite; they drive the `tpubox` binary
//! (compile workers, `tpubox exec`, `tpubox new`, `tpubox serve`) and the crates below it.
//!
//! Run one suite with `cargo test --release -p tpubox --test all -- MODULE::`.

mod adversarial;
mod cache;
mod cache_remote;
mod compile_tiers;
mod compile_workers;
mod eager;
mod exec;
mod fuzz_regressions;
mod graph;
mod guests;
mod launch;
mod layering;
mod lists;
mod loop_budget;
mod minilm;
mod placement;
mod plugins;
mod polyglot;
mod publish;
mod sessions;
mod spmd;
mod support;
mod templates;
#[path = "../guests/test_data.rs"]
mod test_data;
