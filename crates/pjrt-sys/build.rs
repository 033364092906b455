//! Generates Rust bindings for the PJRT C API from an installed plugin's `pjrt_c_api.h`.
//!
//! Header lookup order:
//! 1. `PJRT_C_API_HEADER` (path to the header file);
//! 2. the first `include/pjrt_c_api.h` found (sorted walk) under `$TPUBOX_CACHE_DIR/plugins`
//!    if that variable is set, else under `$HOME/.cache/tpubox/plugins`.
//!
//! It also generates bindings for the XLA FFI C API (`xla/ffi/api/c_api.h`, the interface of
//! custom-call handlers), which ships in the `jaxlib` wheel's `include/` directory. Lookup order:
//! 1. `XLA_FFI_C_API_HEADER` (path to the header file);
//! 2. the first `include/xla/ffi/api/c_api.h` found (sorted walk) under
//!    `$TPUBOX_CACHE_DIR/headers`, else `$HOME/.cache/tpubox/headers`.
//!
//! Nothing is downloaded here: `bash scripts/dev.sh setup` installs both headers. The generated
//! code goes to `OUT_DIR` only.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

/// Oldest PJRT C API minor version these bindings accept (argument struct sizes of older
/// headers are rejected by current plugins).
const MIN_API_MINOR: u32 = 81;

fn main() {
    println!("cargo:rerun-if-env-changed=PJRT_C_API_HEADER");
    println!("cargo:rerun-if-env-changed=TPUBOX_CACHE_DIR");
    println!("cargo:rerun-if-env-changed=HOME");
    println!("cargo:rerun-if-changed=build.rs");

    let header = match find_header() {
        Some(h) => h,
        None => {
            eprintln!(
                "error: pjrt_c_api.h not found (set PJRT_C_API_HEADER or run `bash scripts/dev.sh setup`)"
            );
            std::process::exit(1);
        }
    };
    println!("cargo:rerun-if-changed={}", header.display());

    let text = match fs::read_to_string(&header) {
        Ok(t) => t,
        Err(e) => fail(&format!("cannot read {}: {e}", header.display())),
    };
    let (major, minor) = match (
        define_value(&text, "PJRT_API_MAJOR"),
        define_value(&text, "PJRT_API_MINOR"),
    ) {
        (Some(a), Some(b)) => (a, b),
        _ => fail(&format!(
            "{} has no PJRT_API_MAJOR/PJRT_API_MINOR defines; is it a PJRT C API header?",
            header.display()
        )),
    };
    if major != 0 || minor < MIN_API_MINOR {
        fail(&format!(
            "{} declares PJRT C API {major}.{minor}; need 0.{MIN_API_MINOR} or newer (run `bash scripts/dev.sh setup`)",
            header.display()
        ));
    }
    println!("cargo:rustc-env=PJRT_SYS_HEADER_PATH={}", header.display());

    let bindings = bindings(&header, "PJRT_.*");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default());
    let code = bindings.to_string();
    let args_impls = args_impls(&code);
    let out = out_dir.join("bindings.rs");
    if let Err(e) = fs::write(&out, format!("{code}\n{args_impls}")) {
        fail(&format!("cannot write {}: {e}", out.display()));
    }
    generate_xla_ffi(&out_dir);
}

/// Runs bindgen on `header`, keeping the items matching `allowlist`: enums as integer aliases
/// plus one const per enumerator, `Default` and `Debug` derived, doc comments kept. Exits with
/// the error if bindgen fails.
fn bindings(header: &Path, allowlist: &str) -> bindgen::Bindings {
    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_item(allowlist)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(false)
        .generate_comments(true)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate();
    match bindings {
        Ok(b) => b,
        Err(e) => fail(&format!("bindgen failed on {}: {e}", header.display())),
    }
}

/// Oldest XLA FFI C API minor version the handlers accept (major must be 0).
const MIN_FFI_API_MINOR: u32 = 1;

/// Bindings for the XLA FFI C API into `OUT_DIR/xla_ffi.rs`.
fn generate_xla_ffi(out_dir: &Path) {
    println!("cargo:rerun-if-env-changed=XLA_FFI_C_API_HEADER");
    let header = match find_ffi_header() {
        Some(h) => h,
        None => fail(
            "xla/ffi/api/c_api.h not found (set XLA_FFI_C_API_HEADER or run `bash scripts/dev.sh setup`)",
        ),
    };
    println!("cargo:rerun-if-changed={}", header.display());
    let text = match fs::read_to_string(&header) {
        Ok(t) => t,
        Err(e) => fail(&format!("cannot read {}: {e}", header.display())),
    };
    match (
        define_value(&text, "XLA_FFI_API_MAJOR"),
        define_value(&text, "XLA_FFI_API_MINOR"),
    ) {
        (Some(0), Some(minor)) if minor >= MIN_FFI_API_MINOR => {}
        _ => fail(&format!(
            "{} is not an XLA FFI C API header of version 0.{MIN_FFI_API_MINOR} or newer",
            header.display()
        )),
    }
    println!(
        "cargo:rustc-env=XLA_FFI_SYS_HEADER_PATH={}",
        header.display()
    );
    let bindings = bindings(&header, "XLA_FFI_.*");
    let out = out_dir.join("xla_ffi.rs");
    if let Err(e) = fs::write(&out, bindings.to_string()) {
        fail(&format!("cannot write {}: {e}", out.display()));
    }
}

fn find_ffi_header() -> Option<PathBuf> {
    if let Some(p) = env::var_os("XLA_FFI_C_API_HEADER") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
        fail(&format!(
            "XLA_FFI_C_API_HEADER={} is not a file",
            p.display()
        ));
    }
    let root = match env::var_os("TPUBOX_CACHE_DIR") {
        Some(d) => PathBuf::from(d).join("headers"),
        None => PathBuf::from(env::var_os("HOME")?).join(".cache/tpubox/headers"),
    };
    println!("cargo:rerun-if-changed={}", root.display());
    walk_for(&root, Path::new("include/xla/ffi/api/c_api.h"), 0)
}

/// Emits `impl Args for S` for every struct `S` that has both a `S_STRUCT_SIZE` constant and a
/// leading `struct_size` field (the argument-struct convention of the C API).
fn args_impls(code: &str) -> String {
    let mut out = String::new();
    for line in code.lines() {
        let Some(rest) = line.trim().strip_prefix("pub const ") else {
            continue;
        };
        let Some((name, _)) = rest.split_once(':') else {
            continue;
        };
        let Some(sname) = name.strip_suffix("_STRUCT_SIZE") else {
            continue;
        };
        let head = format!("pub struct {sname} {{");
        let Some(pos) = code.find(&head) else {
            continue;
        };
        let body = &code[pos + head.len()..];
        let first_field = body.split(',').next().unwrap_or("").trim();
        if first_field != "pub struct_size: usize" {
            continue;
        }
        out.push_str(&format!(
            "impl Args for {sname} {{\n    const STRUCT_SIZE: usize = {name} as usize;\n    fn new() -> Self {{\n        Self {{ struct_size: {name} as usize, ..Default::default() }}\n    }}\n}}\n"
        ));
    }
    out
}

fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1);
}

/// Value of `#define NAME <integer>` in the header text.
fn define_value(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        if it.next()? == "#define" && it.next()? == name {
            it.next()?.parse().ok()
        } else {
            None
        }
    })
}

fn find_header() -> Option<PathBuf> {
    if let Some(p) = env::var_os("PJRT_C_API_HEADER") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
        fail(&format!("PJRT_C_API_HEADER={} is not a file", p.display()));
    }
    let root = match env::var_os("TPUBOX_CACHE_DIR") {
        Some(d) => PathBuf::from(d).join("plugins"),
        None => PathBuf::from(env::var_os("HOME")?).join(".cache/tpubox/plugins"),
    };
    println!("cargo:rerun-if-changed={}", root.display());
    walk(&root, 0)
}

/// Depth-first, name-sorted search for `include/pjrt_c_api.h` under `dir`.
fn walk(dir: &Path, depth: usize) -> Option<PathBuf> {
    walk_for(dir, Path::new("include/pjrt_c_api.h"), depth)
}

/// Depth-first, name-sorted search for `dir/**/relative`.
fn walk_for(dir: &Path, relative: &Path, depth: usize) -> Option<PathBuf> {
    if depth > 8 {
        return None;
    }
    let candidate = dir.join(relative);
    if candidate.is_file() {
        return Some(candidate);
    }
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    entries.sort();
    entries
        .into_iter()
        .find_map(|p| walk_for(&p, relative, depth + 1))
}
