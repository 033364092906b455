//! Generates the gRPC services with tonic-prost-build: the Open Inference Protocol's
//! `inference.GRPCInferenceService` (`proto/grpc_service.proto`, server only) and the session
//! API `tpubox.v1.Session` (`proto/tpubox/v1/session.proto`, server and client: the client is
//! what the Rust tests and benchmarks drive it with). The protos are parsed by protox, a
//! protobuf compiler in Rust, so the build needs no `protoc` and downloads nothing.
//!
//! It also lists the files `tpubox new` and `tpubox wit` write (the guest templates, the Rust
//! guest SDK, the WIT package) into `$OUT_DIR/embedded.rs`, each as `include_str!`, so that a
//! file added to one of those directories is embedded without a list to keep up to date.

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    embed_files()?;
    let inference = "proto/grpc_service.proto";
    let session = "proto/tpubox/v1/session.proto";
    println!("cargo:rerun-if-changed={inference}");
    println!("cargo:rerun-if-changed={session}");
    let fds = protox::compile([inference], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .compile_fds(fds)?;
    let fds = protox::compile([session], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Tensor data and programs as `bytes::Bytes`: chunks are slices, not copies.
        .bytes(".tpubox.v1")
        .compile_fds(fds)?;
    Ok(())
}

/// Writes `$OUT_DIR/embedded.rs`: for each directory, a constant of `(relative path, text)`
/// pairs, sorted by path.
fn embed_files() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("..");
    let mut out = String::new();
    for (name, dir, doc) in [
        (
            "TEMPLATE_FILES",
            "host/templates",
            "The guest templates of `tpubox new`, under `LANG/`.",
        ),
        (
            "GUEST_SDK_FILES",
            "guest-sdk",
            "The Rust guest SDK (`Cargo.toml`, `src/`).",
        ),
        (
            "WIT_FILES",
            "wit",
            "The `tpubox:device` WIT package (`*.wit`).",
        ),
    ] {
        let dir = root.join(dir);
        println!("cargo:rerun-if-changed={}", dir.display());
        let mut files = Vec::new();
        collect(&dir, &dir, &mut files)?;
        files.sort();
        out += &format!("/// {doc}\npub(crate) const {name}: &[(&str, &str)] = &[\n");
        for (rel, abs) in files {
            out += &format!("    ({rel:?}, include_str!({abs:?})),\n");
        }
        out += "];\n";
    }
    std::fs::write(
        PathBuf::from(std::env::var("OUT_DIR")?).join("embedded.rs"),
        out,
    )?;
    Ok(())
}

/// Text files under `dir` (skipping build outputs and caches), as (path relative to `base`
/// with `/` separators, absolute path).
fn collect(
    base: &Path,
    dir: &Path,
    files: &mut Vec<(String, String)>,
) -> Result<(), Box<dyn std::error::Error>> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if matches!(name, "target" | "build" | "__pycache__") {
            continue;
        }
        if path.is_dir() {
            collect(base, &path, files)?;
        } else if !name.ends_with(".wasm") && !name.ends_with(".pyc") {
            let rel = path.strip_prefix(base)?.components();
            let rel: Vec<String> = rel
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            files.push((rel.join("/"), path.canonicalize()?.display().to_string()));
        }
    }
    Ok(())
}
