//! Structure checks over `host/src`: the modules import each other without cycles (the order
//! the library docs give), and the WIT glue decides no tenant rule.
//!
//! A module is a file `host/src/NAME.rs` or a directory `host/src/NAME/`; an edge A → B is a
//! `crate::B` path in A's code (comments and doc comments are not code).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

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

/// Module name → the modules its code names through `crate::`.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut modules = BTreeMap::new();
    for e in std::fs::read_dir(src()).unwrap() {
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
    modules
        .iter()
        .map(|(name, path)| {
            let text = code(path);
            let mut deps = BTreeSet::new();
            for (i, _) in text.match_indices("crate::") {
                let rest = &text[i + "crate::".len()..];
                let dep: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if dep != *name && names.contains(&dep) {
                    deps.insert(dep);
                }
            }
            // `use crate::{a, b::C}` groups.
            for (i, _) in text.match_indices("crate::{") {
                let group = &text[i + "crate::{".len()..];
                let group = &group[..group.find('}').unwrap_or(group.len())];
                for item in group.split(',') {
                    let dep: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if dep != *name && names.contains(&dep) {
                        deps.insert(dep);
                    }
                }
            }
            (name.clone(), deps)
        })
        .collect()
}

#[test]
fn host_modules_import_each_other_without_cycles() {
    let g = graph();
    assert!(g.len() >= 10, "found only {:?}", g.keys());
    // Kahn's algorithm: a module is placed once everything it imports is placed.
    let mut placed: Vec<String> = Vec::new();
    let mut left: BTreeMap<String, BTreeSet<String>> = g.clone();
    while !left.is_empty() {
        let ready: Vec<String> = left
            .iter()
            .filter(|(_, deps)| deps.iter().all(|d| placed.contains(d)))
            .map(|(n, _)| n.clone())
            .collect();
        assert!(
            !ready.is_empty(),
            "import cycle among {:?}",
            left.iter()
                .map(|(n, d)| format!("{n} -> {d:?}"))
                .collect::<Vec<_>>()
        );
        for n in ready {
            left.remove(&n);
            placed.push(n);
        }
    }
    println!("modules in dependency order: {}", placed.join(" <- "));
    // The order the issue asked for: types <- cache <- device <- session <- wit.
    let pos = |m: &str| {
        placed
            .iter()
            .position(|p| p == m)
            .unwrap_or_else(|| panic!("no module {m}"))
    };
    assert!(pos("types") < pos("cache") && pos("cache") < pos("device"));
    assert!(pos("device") < pos("session") && pos("session") < pos("wit"));
    assert!(!g["types"].contains("device") && !g["cache"].contains("device"));
    assert!(
        !g["tenant"].contains("scheduler"),
        "the scheduler is its own module"
    );
}

#[test]
fn the_wit_glue_decides_no_tenant_rule() {
    let wit = code(&src().join("wit.rs"));
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
            "wit.rs names `{rule}`: tenant rules belong in session.rs"
        );
    }
    let g = graph();
    assert!(
        !g["wit"].contains("tenant") && !g["wit"].contains("device"),
        "wit.rs reaches past the session layer: {:?}",
        g["wit"]
    );
}
