//! Structure checks, on every test run:
//! - between crates: each workspace crate depends only on the crates below it in the table of
//!   `docs/ARCHITECTURE.md` ([`CRATES`]), and the device and session layer (`tpubox-core`)
//!   links neither wasmtime nor an HTTP/gRPC stack, not even through another crate (checked
//!   on `Cargo.lock`);
//! - inside each of tpubox's crates above the PJRT binding: its modules import each other
//!   without cycles, in the order the crate's docs give; the WIT glue decides no tenant rule;
//! - profiles: every crate of the project keeps integer overflow checks in the release profile
//!   the tests run with.
//!
//! A module is a file `src/NAME.rs` or a directory `src/NAME/`; an edge A → B is a `crate::B`
//! path in A's code (comments and doc comments are not code).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The project's crates, bottom to top: (package, directory, the project crates it may
/// depend on). A crate may only name crates listed before it.
const CRATES: &[(&str, &str, &[&str])] = &[
    ("pjrt-sys", "crates/pjrt-sys", &[]),
    ("tpubox-pjrt", "crates/pjrt", &["pjrt-sys"]),
    (
        "pjrt-lapack",
        "crates/pjrt-lapack",
        &["tpubox-pjrt", "pjrt-sys"],
    ),
    (
        "pjrt-kernels",
        "crates/pjrt-kernels",
        &["tpubox-pjrt", "pjrt-sys"],
    ),
    (
        "tpubox-core",
        "crates/core",
        &["tpubox-pjrt", "pjrt-lapack", "pjrt-kernels"],
    ),
    (
        "tpubox-cache-remote",
        "crates/cache-remote",
        &["tpubox-core"],
    ),
    (
        "tpubox-wasm",
        "crates/wasm",
        &["tpubox-core", "tpubox-pjrt"],
    ),
    ("tpubox-net", "crates/net", &["tpubox-core"]),
    (
        "tpubox-session-api",
        "crates/session-api",
        &["tpubox-core", "tpubox-wasm", "tpubox-pjrt", "tpubox-net"],
    ),
    (
        "tpubox-serve",
        "crates/serve",
        &[
            "tpubox-core",
            "tpubox-wasm",
            "tpubox-session-api",
            "tpubox-pjrt",
            "tpubox-net",
        ],
    ),
    (
        "tpubox",
        "host",
        &[
            "tpubox-core",
            "tpubox-wasm",
            "tpubox-session-api",
            "tpubox-serve",
            "tpubox-cache-remote",
            "tpubox-net",
        ],
    ),
];

/// Packages the device and session layer must not link, directly or through another crate:
/// the Wasm runtime and every HTTP/gRPC stack (the reasons for the cut, `docs/ARCHITECTURE.md`).
const NOT_IN_CORE: &[&str] = &[
    "wasmtime",
    "cranelift-codegen",
    "hyper",
    "h2",
    "tonic",
    "axum",
    "reqwest",
    "object_store",
    "prometheus",
];

/// The code lines of every `.rs` file under `path` (a file or a directory).
fn code(path: &Path) -> String {
    let mut files = Vec::new();
    if path.is_dir() {
        let mut stack = vec![path.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    files.push(p);
                }
            }
        }
    } else {
        files.push(path.to_path_buf());
    }
    files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap()
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .map(|l| l.split(" // ").next().unwrap().to_string() + "\n")
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Module name → the modules its code names through `crate::`, for the crate whose sources
/// are in `src`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut modules = BTreeMap::new();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if ["lib", "main"].contains(&name.as_str())
            || !(p.is_dir() || p.extension().is_some_and(|x| x == "rs"))
        {
            continue;
        }
        modules.insert(name, p);
    }
    let names: BTreeSet<String> = modules.keys().cloned().collect();
    let ident = |s: &str| -> String {
        s.trim()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    modules
        .iter()
        .map(|(name, path)| {
            let text = code(path);
            let mut deps = BTreeSet::new();
            for (i, _) in text.match_indices("crate::") {
                let dep = ident(&text[i + "crate::".len()..]);
                if dep != *name && names.contains(&dep) {
                    deps.insert(dep);
                }
            }
            // `use crate::{a, b::C}` groups.
            for (i, _) in text.match_indices("crate::{") {
                let group = &text[i + "crate::{".len()..];
                let group = &group[..group.find('}').unwrap_or(group.len())];
                for item in group.split(',') {
                    let dep = ident(item);
                    if dep != *name && names.contains(&dep) {
                        deps.insert(dep);
                    }
                }
            }
            (name.clone(), deps)
        })
        .collect()
}

/// The modules of `g` in an order where each comes after every module it imports; panics
/// naming the cycle's modules when there is none.
fn dependency_order(krate: &str, g: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    // Kahn's algorithm: a module is placed once everything it imports is placed.
    let mut placed: Vec<String> = Vec::new();
    let mut left = g.clone();
    while !left.is_empty() {
        let ready: Vec<String> = left
            .iter()
            .filter(|(_, deps)| deps.iter().all(|d| placed.contains(d)))
            .map(|(n, _)| n.clone())
            .collect();
        assert!(
            !ready.is_empty(),
            "{krate}: import cycle among {:?}",
            left.iter()
                .map(|(n, d)| format!("{n} -> {d:?}"))
                .collect::<Vec<_>>()
        );
        for n in ready {
            left.remove(&n);
            placed.push(n);
        }
    }
    placed
}

/// The crates whose modules must form a layered order: tpubox's own, above the PJRT binding.
/// The binding crates are left out on purpose: a C API's handle types refer to each other (a
/// client makes buffers, a buffer names its client), so their modules cannot be layered.
const LAYERED_CRATES: &[&str] = &[
    "tpubox-core",
    "tpubox-cache-remote",
    "tpubox-wasm",
    "tpubox-session-api",
    "tpubox-serve",
    "tpubox",
];

#[test]
fn modules_of_every_crate_import_each_other_without_cycles() {
    for (krate, dir, _) in CRATES.iter().filter(|(k, _, _)| LAYERED_CRATES.contains(k)) {
        let g = graph(&root().join(dir).join("src"));
        let order = dependency_order(krate, &g);
        println!("{krate}: {}", order.join(" <- "));
    }
}

#[test]
fn the_device_and_session_layer_keeps_its_order() {
    let g = graph(&root().join("crates/core/src"));
    assert!(g.len() >= 10, "found only {:?}", g.keys());
    let placed = dependency_order("tpubox-core", &g);
    let pos = |m: &str| {
        placed
            .iter()
            .position(|p| p == m)
            .unwrap_or_else(|| panic!("no module {m}"))
    };
    // types <- cache <- device <- session: the cache stores executables without knowing how
    // they are compiled, the device service compiles through the cache without knowing about
    // tenants, the session decides what a tenant may do before anything reaches the device.
    assert!(pos("types") < pos("cache") && pos("cache") < pos("device"));
    assert!(pos("device") < pos("session"));
    assert!(!g["types"].contains("device") && !g["cache"].contains("device"));
    assert!(
        !g["tenant"].contains("scheduler"),
        "the scheduler is its own module"
    );
}

#[test]
fn the_wit_glue_decides_no_tenant_rule() {
    let wit = code(&root().join("crates/wasm/src/wit.rs"));
    for rule in [
        "Tenant",
        "Charge",
        "charge_",
        "admit_compile",
        "read_only",
        "max_read_bytes",
        "execute_for",
        "scheduler",
        "credit",
    ] {
        assert!(
            !wit.contains(rule),
            "wit.rs names `{rule}`: tenant rules belong in the session layer (tpubox-core's session.rs)"
        );
    }
    for past in ["tpubox_core::tenant", "tpubox_core::device"] {
        assert!(
            !wit.contains(past),
            "wit.rs reaches past the session layer: it names `{past}`"
        );
    }
}

/// The `[dependencies]` (and `[build-dependencies]`) package names of a manifest; dev
/// dependencies are not linked into the crate and are left out.
fn manifest_dependencies(manifest: &str) -> BTreeSet<String> {
    let mut deps = BTreeSet::new();
    let mut in_deps = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]" || line == "[build-dependencies]";
            continue;
        }
        if in_deps && let Some((name, _)) = line.split_once('=') {
            let name = name.trim();
            if !name.is_empty() && !name.starts_with('#') {
                deps.insert(name.to_string());
            }
        }
    }
    deps
}

#[test]
fn crates_depend_only_on_the_crates_below_them() {
    let project: BTreeSet<&str> = CRATES.iter().map(|(p, _, _)| *p).collect();
    for (i, (krate, dir, allowed)) in CRATES.iter().enumerate() {
        let manifest = std::fs::read_to_string(root().join(dir).join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains(&format!("name = \"{krate}\"")),
            "{dir}/Cargo.toml is not the package {krate}"
        );
        let below: BTreeSet<&str> = CRATES[..i].iter().map(|(p, _, _)| *p).collect();
        for dep in manifest_dependencies(&manifest) {
            if project.contains(dep.as_str()) {
                assert!(
                    allowed.contains(&dep.as_str()) && below.contains(dep.as_str()),
                    "{krate} depends on {dep}, which is not in its allowed list {allowed:?} \
                     (tests/all/layering.rs CRATES, docs/ARCHITECTURE.md)"
                );
            }
        }
    }
    // Every workspace crate of the host side is in the table.
    let workspace = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    for (_, dir, _) in CRATES {
        assert!(
            workspace.contains(&format!("\"{dir}\"")),
            "{dir} is not a workspace member"
        );
    }
}

/// `Cargo.lock` as package name → the names of its dependencies (all versions merged).
fn lockfile() -> BTreeMap<String, BTreeSet<String>> {
    let text = std::fs::read_to_string(root().join("Cargo.lock")).unwrap();
    let mut packages: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for block in text.split("[[package]]").skip(1) {
        let mut name = None;
        let mut deps = BTreeSet::new();
        let mut in_deps = false;
        for line in block.lines() {
            let line = line.trim();
            if let Some(n) = line.strip_prefix("name = ") {
                name = Some(n.trim_matches('"').to_string());
            } else if line.starts_with("dependencies = [") {
                in_deps = true;
            } else if in_deps && line == "]" {
                in_deps = false;
            } else if in_deps {
                let dep = line.trim_matches(|c| c == '"' || c == ',');
                // "name", "name version" or "name version (source)".
                deps.insert(dep.split(' ').next().unwrap().to_string());
            }
        }
        packages
            .entry(name.expect("a [[package]] without a name"))
            .or_default()
            .extend(deps);
    }
    packages
}

#[test]
fn the_device_and_session_layer_links_no_wasm_runtime_and_no_http_stack() {
    let lock = lockfile();
    let mut seen = BTreeSet::new();
    let mut path: BTreeMap<String, String> = BTreeMap::new();
    let mut stack = vec!["tpubox-core".to_string()];
    while let Some(p) = stack.pop() {
        if !seen.insert(p.clone()) {
            continue;
        }
        for d in lock.get(&p).into_iter().flatten() {
            path.entry(d.clone()).or_insert_with(|| p.clone());
            stack.push(d.clone());
        }
    }
    assert!(seen.len() > 20, "Cargo.lock has no tpubox-core: {seen:?}");
    for banned in NOT_IN_CORE {
        if seen.contains(*banned) {
            // Walk back to tpubox-core to say how it got in.
            let mut chain = vec![banned.to_string()];
            while let Some(p) = path.get(chain.last().unwrap()) {
                chain.push(p.clone());
                if p == "tpubox-core" {
                    break;
                }
            }
            chain.reverse();
            panic!("tpubox-core links {banned}: {}", chain.join(" -> "));
        }
    }
}

#[test]
fn every_project_crate_keeps_overflow_checks_in_the_release_profile() {
    let workspace = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    // The crates of this table, and every other workspace member that is not a guest (guests
    // are built for wasm32 by their own profile and the SDK has its own entry below).
    let mut crates: Vec<&str> = CRATES.iter().map(|(p, _, _)| *p).collect();
    crates.push("tpubox-guest");
    crates.push("tpubox-guest-decoupled");
    for krate in crates {
        let header = format!("[profile.release.package.{krate}]");
        let at = workspace.find(&header).unwrap_or_else(|| {
            panic!("Cargo.toml has no {header} with overflow-checks = true for {krate}")
        });
        let body = &workspace[at + header.len()..];
        let body = &body[..body.find("\n[").unwrap_or(body.len())];
        assert!(
            body.contains("overflow-checks = true"),
            "{header} does not turn overflow checks on"
        );
    }
    // A crate directory under crates/ that the table does not list is a crate nobody checked.
    for e in std::fs::read_dir(root().join("crates")).unwrap() {
        let dir = format!("crates/{}", e.unwrap().file_name().to_string_lossy());
        assert!(
            CRATES.iter().any(|(_, d, _)| *d == dir),
            "{dir} is not in tests/all/layering.rs CRATES (its layer and its profile entry)"
        );
    }
}
