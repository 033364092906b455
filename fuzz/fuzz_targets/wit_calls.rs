//! Fuzz target `wit_calls`; the harness and its invariants are in `fuzz/harness/wit_calls.rs`.
//!
//! Run: `bash scripts/dev.sh fuzz [SECONDS]`.

#![no_main]

#[path = "../harness/wit_calls.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run_bytes(data));
