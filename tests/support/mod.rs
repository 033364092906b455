//! Helpers shared by the integration tests that run guests through the host.

use std::path::PathBuf;

use tpubox::{HostConfig, SandboxConfig};

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

/// A host configuration for tests: 256 MiB guest memory cap, no component disk cache.
pub fn test_host_config() -> HostConfig {
    HostConfig {
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
#[allow(dead_code)] // each test binary compiles this module; not all of them use every helper
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
