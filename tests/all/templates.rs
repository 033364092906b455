//! `tpubox new` and `tpubox wit`, as a guest author outside the repository uses them.
//!
//! Each language's template is created in a temporary directory outside the checkout, built
//! with its one command and the pinned tools (`bash scripts/dev.sh polyglot` installs them
//! under `~/.cache/tpubox/tools`; a missing tool fails the test with that command), run with
//! `tpubox run` on the CPU plugin, and its softmax checked against one computed here. Then its
//! program gets a typo: the uncaught `compile-failed` error must reach stderr with its kind and
//! the compiler's message, and the run must end with status 1.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const TPUBOX: &str = env!("CARGO_BIN_EXE_tpubox");

/// Where `scripts/dev.sh` installs the guest tools.
fn tools() -> PathBuf {
    std::env::var_os("TPUBOX_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| dirs::home_dir().map(|h| h.join(".cache/tpubox")))
        .expect("a home directory")
        .join("tools")
}

/// `tool` under [`tools`], which must exist.
fn tool(rel: &str) -> PathBuf {
    let p = tools().join(rel);
    assert!(
        p.exists(),
        "{} is missing: install the guest tools with `bash scripts/dev.sh polyglot` (or `bash scripts/dev.sh setup`)",
        p.display()
    );
    p
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `cmd`, panicking with its output when it fails.
fn check(what: &str, cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// `tpubox new --lang LANG DIR/NAME`, in a fresh temporary directory.
fn new_project(lang: &str, name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::Builder::new()
        .prefix("tpubox-new-")
        .tempdir()
        .unwrap();
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    assert!(
        !tmp.path().starts_with(checkout),
        "the temporary dir is inside the checkout"
    );
    let dir = tmp.path().join(name);
    let out = check(
        &format!("tpubox new --lang {lang}"),
        Command::new(TPUBOX).args(["new", "--lang", lang]).arg(&dir),
    );
    assert!(
        text(&out.stdout).contains(&format!("created the {lang} guest `{name}`")),
        "{}",
        text(&out.stdout)
    );
    (tmp, dir)
}

/// What a project's build wrote.
struct Built {
    /// The component.
    wasm: PathBuf,
}

/// Builds a Rust project with `cargo build --release` (offline: the SDK's dependencies are
/// the workspace's, already in cargo's cache). Its target dir is kept in the workspace's
/// target/ so that later runs build incrementally.
fn build_rust(dir: &Path, name: &str) -> Built {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join("tpubox-new-rust");
    check(
        "cargo build --release",
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "--release", "--offline", "--quiet"])
            .current_dir(dir)
            .env("CARGO_TARGET_DIR", &target),
    );
    Built {
        wasm: target.join(format!("wasm32-wasip2/release/{name}.wasm")),
    }
}

/// Builds a C, Python or JavaScript project with `sh build.sh`, its tools found where
/// scripts/dev.sh puts them.
fn build_script(dir: &Path, name: &str, lang: &str) -> Built {
    let mut cmd = Command::new("sh");
    cmd.arg("build.sh").current_dir(dir);
    match lang {
        "c" => {
            cmd.env("WIT_BINDGEN", tool("wit-bindgen-0.63.0/bin/wit-bindgen"))
                .env("WASM_TOOLS", tool("wasm-tools-1.263.0/bin/wasm-tools"))
                .env(
                    "WASI_ADAPTER",
                    tool("wasi-adapter-48.0.8/wasi_snapshot_preview1.command.wasm"),
                );
        }
        "python" => {
            cmd.env(
                "COMPONENTIZE_PY",
                tool("componentize-py-0.25.1/bin/componentize-py"),
            );
        }
        "js" => {
            cmd.env(
                "COMPONENTIZE_JS",
                tool("componentize-js-0.23.0/node_modules/.bin/componentize-js"),
            );
        }
        _ => unreachable!(),
    }
    check(&format!("{lang}: sh build.sh"), &mut cmd);
    let wasm = dir.join(format!("build/{name}.wasm"));
    assert!(
        wasm.is_file(),
        "{} is missing after build.sh",
        wasm.display()
    );
    Built { wasm }
}

fn build(lang: &str, dir: &Path, name: &str) -> Built {
    match lang {
        "rust" => build_rust(dir, name),
        _ => build_script(dir, name, lang),
    }
}

/// `tpubox run WASM -- ARGS` on the CPU plugin.
fn run(wasm: &Path, args: &[&str]) -> Output {
    Command::new(TPUBOX)
        .args(["run", "--timeout", "120"])
        .arg(wasm)
        .arg("--")
        .args(args)
        .output()
        .expect("tpubox runs")
}

/// Runs `wasm` with `args`, which must fail with exit status `status`; returns its stderr.
fn run_failing(wasm: &Path, args: &[&str], status: i32) -> String {
    let o = run(wasm, args);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(status), "{}: {err}", wasm.display());
    assert!(!text(&o.stdout).contains("softmax:"), "{}", wasm.display());
    err
}

/// The JSON list of the output line `KEY: [...]`.
fn list(out: &str, key: &str) -> Vec<f64> {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}: ")))
        .unwrap_or_else(|| panic!("no `{key}:` line in\n{out}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("`{key}: {line}` is not a list: {e}"))
}

/// Softmax in f64 of the f32 values of `x`.
fn softmax(x: &[f64]) -> Vec<f64> {
    let x: Vec<f64> = x.iter().map(|&v| f64::from(v as f32)).collect();
    let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-6, "{what}: got {got:?}, want {want:?}");
    }
}

/// Replaces the one occurrence of `from` in the file `path` by `to`; returns the old text.
fn edit(path: &Path, from: &str, to: &str) -> String {
    let code = std::fs::read_to_string(path).unwrap();
    assert_eq!(
        code.matches(from).count(),
        1,
        "{}: {from:?}",
        path.display()
    );
    std::fs::write(path, code.replace(from, to)).unwrap();
    code
}

/// Creates, builds and runs the `lang` template, checks its numbers, then breaks its program
/// and checks the uncaught error. Returns the project (kept alive) for further checks.
fn template_round_trip(lang: &str, source: &str) -> (tempfile::TempDir, PathBuf) {
    let name = format!("softmax-{lang}");
    let (tmp, dir) = new_project(lang, &name);
    let built = build(lang, &dir, &name);

    // Default input, against hand-computed values: e^(i-4) / (e^-3 + e^-2 + e^-1 + 1).
    let o = run(&built.wasm, &[]);
    let out = text(&o.stdout);
    assert!(o.status.success(), "{lang}: {out}\n{}", text(&o.stderr));
    assert_close(
        &format!("{lang} input"),
        &list(&out, "input"),
        &[1.0, 2.0, 3.0, 4.0],
    );
    assert_close(
        &format!("{lang} default"),
        &list(&out, "softmax"),
        &[0.032058604, 0.087144319, 0.236882818, 0.643914260],
    );
    // Arguments, against the f64 reference (negative, fractional, repeated values).
    let args = ["0.5", "-1.25", "3", "3", "-7.5", "0"];
    let o = run(&built.wasm, &args);
    let out = text(&o.stdout);
    assert!(o.status.success(), "{lang}: {out}\n{}", text(&o.stderr));
    let x: Vec<f64> = args.iter().map(|a| a.parse().unwrap()).collect();
    assert_close(&format!("{lang} input"), &list(&out, "input"), &x);
    let y = list(&out, "softmax");
    assert_close(&format!("{lang} softmax"), &y, &softmax(&x));
    assert!((y.iter().sum::<f64>() - 1.0).abs() < 1e-6);

    // A typo in the program: the compile error nobody catches names its kind and the op.
    let path = dir.join(source);
    let code = edit(&path, "stablehlo.exponential", "stablehlo.exponentail");
    // A guest's error is exit status 1 (a trap or a host failure would be 2).
    let err = run_failing(&build(lang, &dir, &name).wasm, &[], 1);
    assert!(
        err.to_lowercase().contains("error: compile-failed: ") && err.contains("exponentail"),
        "{lang}: stderr does not name the kind and the compiler's message:\n{err}"
    );
    std::fs::write(&path, code).unwrap();
    (tmp, dir)
}

#[test]
fn rust_template_builds_runs_and_reports_errors() {
    let (_tmp, dir) = template_round_trip("rust", "src/main.rs");
    // What `fn main() -> Result<(), Error>` prints: the Display form, not the struct.
    let name = "softmax-rust";
    let err = run_failing(&build_rust(&dir, name).wasm, &["1", "x"], 1);
    assert_eq!(
        err.trim_end(),
        "Error: invalid-argument: not a number: \"x\""
    );

    // A panic: the SDK's hook prints where, the host the backtrace with source lines.
    let anchor = "    let exe = compile_mlir(";
    edit(
        &dir.join("src/main.rs"),
        anchor,
        &format!("    assert!(x.len() < 3, \"too many numbers\");\n{anchor}"),
    );
    let err = run_failing(&build_rust(&dir, name).wasm, &["1", "2", "3"], 2);
    assert!(
        err.contains("panicked at src/main.rs:") && err.contains(": too many numbers"),
        "{err}"
    );
    assert!(!err.contains("RUST_BACKTRACE"), "{err}");
    assert!(err.contains("tpubox: guest aborted"), "{err}");
    assert!(
        err.contains("guest backtrace (innermost call first):")
            && err.contains(" - main\n")
            && err.contains("/src/main.rs:"),
        "no backtrace with source lines:\n{err}"
    );
}

#[test]
fn c_template_builds_runs_and_reports_errors() {
    let (_tmp, dir) = template_round_trip("c", "main.c");
    // A handle used after it was dropped: the host says so, with the C source line.
    let anchor = "    guest_list_u8_t bytes;\n";
    edit(
        &dir.join("main.c"),
        anchor,
        &format!("{anchor}    tpubox_device_types_tensor_drop_own(outputs.ptr[0]);\n"),
    );
    let err = run_failing(&build_script(&dir, "softmax-c", "c").wasm, &[], 2);
    assert!(
        err.contains("guest used a tensor handle it had already dropped"),
        "{err}"
    );
    assert!(err.contains("main.c:"), "no source line:\n{err}");
}

#[test]
fn python_template_builds_runs_and_reports_errors() {
    let (_tmp, dir) = template_round_trip("python", "app.py");
    // A plain Python exception: a traceback, status 1.
    let err = run_failing(&dir.join("build/softmax-python.wasm"), &["1", "x"], 1);
    assert!(
        err.contains("Traceback")
            && err.contains("ValueError: could not convert string to float: 'x'"),
        "{err}"
    );
}

#[test]
fn js_template_builds_runs_and_reports_errors() {
    let (_tmp, dir) = template_round_trip("js", "app.js");
    let err = run_failing(&dir.join("build/softmax-js.wasm"), &["1", "x"], 1);
    assert!(err.contains("not a number: 'x'"), "{err}");
}

#[test]
fn tpubox_wit_writes_the_package_as_text_and_binary() {
    let tmp = tempfile::tempdir().unwrap();
    let out = check(
        "tpubox wit",
        Command::new(TPUBOX).args(["wit", "--out"]).arg(tmp.path()),
    );
    let listed = text(&out.stdout);
    for f in ["device.wit", "model.wit", "tpubox-device-0.1.2.wasm"] {
        assert!(tmp.path().join(f).is_file(), "{f} missing: {listed}");
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../wit/device.wit");
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("device.wit")).unwrap(),
        std::fs::read_to_string(repo).unwrap()
    );
    // The pinned wasm-tools reads the binary package back as WIT.
    let wasm_tools = tool("wasm-tools-1.263.0/bin/wasm-tools");
    let printed = check(
        "wasm-tools component wit",
        Command::new(&wasm_tools)
            .args(["component", "wit"])
            .arg(tmp.path().join("tpubox-device-0.1.2.wasm")),
    );
    let wit = text(&printed.stdout);
    for want in [
        "package tpubox:device@0.1.2;",
        "interface client {",
        "compile: func(format: program-format, code: list<u8>, options: compile-options) -> result<executable, error>;",
        "world guest {",
        "world served-model {",
    ] {
        assert!(wit.contains(want), "no {want:?} in\n{wit}");
    }
}
