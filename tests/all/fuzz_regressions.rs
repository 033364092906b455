//! Replays every fuzz regression input (`fuzz/regressions/<target>/*.hex`) through its harness
//! as an ordinary test, so a fixed fuzzer find stays fixed in CI without cargo-fuzz, and sweeps
//! fixed seeds through the structure-aware program generator. Each regression input once
//! crashed the host or broke an invariant (see `fuzz/README.md`).

#[path = "../../fuzz/harness/wit_calls.rs"]
#[allow(dead_code)]
mod wit_calls;

#[path = "../../fuzz/harness/programs.rs"]
#[allow(dead_code)]
mod programs;

#[path = "../../fuzz/harness/doors.rs"]
#[allow(dead_code)]
mod doors;

use std::collections::BTreeMap;
use std::path::PathBuf;

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/regressions")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "hex"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let bytes = hex::decode(text.trim())
                .unwrap_or_else(|e| panic!("{} is not hex: {e}", path.display()));
            (path, bytes)
        })
        .collect()
}

#[test]
fn fuzz_regressions_pass() {
    let wit = inputs("wit_calls");
    assert!(wit.len() >= 4, "wit_calls regression inputs missing");
    for (path, bytes) in &wit {
        eprintln!("replaying {} ({} bytes)", path.display(), bytes.len());
        wit_calls::run_bytes(bytes);
    }
    for (path, bytes) in &inputs("programs") {
        eprintln!("replaying {} ({} bytes)", path.display(), bytes.len());
        programs::run_bytes(bytes);
    }
    // The doors harness without the fuzz target's counting allocator: its allocation bound
    // is not checked here (the counters stay 0), everything else is.
    for (path, bytes) in &inputs("doors") {
        eprintln!("replaying {} ({} bytes)", path.display(), bytes.len());
        doors::run_bytes(bytes);
    }
}

/// A splitmix64 stream: the sweep's inputs, the same on every machine.
fn seed_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

/// The generator's programs are mostly valid: of 300 fixed seeds, every clean program compiles
/// and runs (the harness asserts it), most programs run, and every class of outcome occurs.
#[test]
fn generated_programs_compile_run_and_are_refused_by_class() {
    let mut outcomes: BTreeMap<String, u32> = BTreeMap::new();
    let mut clean = 0;
    for seed in 0..300u64 {
        let bytes = seed_bytes(seed, 4096);
        let (outcome, facts) = programs::run_input(&bytes);
        clean += u32::from(facts.clean());
        *outcomes.entry(format!("{outcome:?}")).or_default() += 1;
    }
    eprintln!("clean programs: {clean}; outcomes: {outcomes:?}");
    let ran = outcomes.get("Ran").copied().unwrap_or(0);
    assert!(
        ran >= 100,
        "only {ran} of 300 generated programs ran: {outcomes:?}"
    );
    // The policy refuses some (loops, host transfers, custom calls); the device limit refuses
    // some (large results or temporaries).
    for kind in [
        "CompileRefused(PermissionDenied)",
        "CompileRefused(ResourceExhausted)",
    ] {
        assert!(outcomes.contains_key(kind), "no {kind} among {outcomes:?}");
    }
}
