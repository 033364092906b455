//! Fuzz target `programs`: structure-aware StableHLO programs compiled and run by an untrusted
//! tenant; the generator is `fuzz/harness/program_gen.rs`, the harness and its invariants are
//! in `fuzz/harness/programs.rs`.
//!
//! Run: `bash scripts/dev.sh fuzz [SECONDS] programs`.

#![no_main]

#[path = "../harness/programs.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run_bytes(data));
