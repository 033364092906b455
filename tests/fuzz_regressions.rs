//! Replays every fuzz regression input (`fuzz/regressions/wit_calls/*.hex`) through the
//! `wit_calls` harness as an ordinary test, so a fixed fuzzer find stays fixed in CI without
//! cargo-fuzz. Each input once crashed the host or broke an invariant (see `fuzz/README.md`).

#[path = "../fuzz/harness/wit_calls.rs"]
#[allow(dead_code)]
mod wit_calls;

use std::path::PathBuf;

#[test]
fn fuzz_regressions_pass() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions/wit_calls");
    let mut inputs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "hex"))
        .collect();
    inputs.sort();
    assert!(
        inputs.len() >= 4,
        "regression inputs missing from {}",
        dir.display()
    );
    for path in &inputs {
        let text = std::fs::read_to_string(path).unwrap();
        let bytes = hex::decode(text.trim())
            .unwrap_or_else(|e| panic!("{} is not hex: {e}", path.display()));
        eprintln!("replaying {} ({} bytes)", path.display(), bytes.len());
        wit_calls::run_bytes(&bytes);
    }
}
