//! Lists the files `tpubox new` and `tpubox wit` write (the guest templates, the Rust guest
//! SDK, the WIT package) into `$OUT_DIR/embedded.rs`, each as `include_str!`, so that a file
//! added to one of those directories is embedded without a list to keep up to date.

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    embed_files()
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
