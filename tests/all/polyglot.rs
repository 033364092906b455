//! The C, Python and JavaScript example guests (`examples/{c,python,js}-mlp`) run through the
//! host on the CPU plugin.
//!
//! `scripts/dev.sh` builds them into `target/polyglot/`. Each reads a CSV table, normalises its
//! columns, runs a small MLP on the device and prints `result: [[..],..]`. The expected numbers
//! are computed here in plain Rust from the same CSV text and weight formulas, not taken from the
//! guests.

use crate::support::{polyglot_wasm, test_host_config};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tpubox_wasm::{Host, RunOptions, RunOutcome};
use wasmtime::component::Component;

const GUESTS: [&str; 3] = ["c-mlp", "python-mlp", "js-mlp"];

fn host() -> &'static Arc<Host> {
    static HOST: OnceLock<Arc<Host>> = OnceLock::new();
    HOST.get_or_init(|| {
        // The Python and JavaScript components are 12-18 MB; compiling them takes most of this
        // test's time, so keep wasmtime's content-keyed component cache on.
        let mut config = test_host_config();
        config.sandbox.cache_dir = tpubox_wasm::SandboxConfig::default().cache_dir;
        Arc::new(Host::new(config).expect("host starts"))
    })
}

/// Compiles each component once per test binary. Python and JavaScript components carry a
/// whole interpreter (12–18 MB), so every language gets its own slot and they compile in
/// parallel instead of behind one lock.
fn component(name: &str) -> Component {
    static SLOTS: OnceLock<Mutex<HashMap<String, Arc<OnceLock<Component>>>>> = OnceLock::new();
    let slot = SLOTS
        .get_or_init(Default::default)
        .lock()
        .unwrap()
        .entry(name.to_string())
        .or_default()
        .clone();
    slot.get_or_init(|| {
        host()
            .load_component(&polyglot_wasm(name))
            .unwrap_or_else(|e| panic!("{name} loads: {e:#}"))
    })
    .clone()
}

async fn run(name: &str, args: &[&str], stdin: &str) -> RunOutcome {
    let opts = RunOptions {
        args: args.iter().map(|s| s.to_string()).collect(),
        capture_output: true,
        stdin: Some(stdin.as_bytes().to_vec()),
        deadline: Some(Duration::from_secs(120)),
        ..RunOptions::default()
    };
    let comp = tokio::task::block_in_place(|| component(name));
    host()
        .run(&comp, name, &opts)
        .await
        .unwrap_or_else(|e| panic!("{name} did not run to completion: {e:#}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The JSON rows of the line `result: ...`.
fn result_rows(name: &str, o: &RunOutcome) -> Vec<Vec<f64>> {
    let out = text(&o.stdout);
    assert!(
        o.success,
        "{name} failed:\nstdout:\n{out}\nstderr:\n{}",
        text(&o.stderr)
    );
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("result: "))
        .unwrap_or_else(|| panic!("{name}: no `result:` line in\n{out}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{name}: result is not JSON rows: {e}"))
}

// ---- The reference, written from the guests' specification (docs/guests/) ----

const IN: usize = 3;
const HIDDEN: usize = 8;
const OUT: usize = 2;

/// Data rows of a well-formed CSV text (first non-blank line is the header).
fn parse(csv: &str) -> Vec<[f64; IN]> {
    csv.lines()
        .filter(|l| !l.trim().is_empty())
        .skip(1)
        .map(|l| {
            let v: Vec<f64> = l.split(',').map(|f| f.trim().parse().unwrap()).collect();
            [v[0], v[1], v[2]]
        })
        .collect()
}

/// Per-column z-scores (population standard deviation) in f64, rounded to f32.
fn normalise(rows: &[[f64; IN]]) -> Vec<[f32; IN]> {
    let n = rows.len() as f64;
    let mut out = vec![[0f32; IN]; rows.len()];
    for c in 0..IN {
        let mean = rows.iter().map(|r| r[c]).sum::<f64>() / n;
        let var = rows
            .iter()
            .map(|r| (r[c] - mean) * (r[c] - mean))
            .sum::<f64>()
            / n;
        let std = var.sqrt();
        for (o, r) in out.iter_mut().zip(rows) {
            o[c] = if std > 0.0 {
                ((r[c] - mean) / std) as f32
            } else {
                0.0
            };
        }
    }
    out
}

fn w1(k: usize, j: usize) -> f32 {
    (((3 * k + 5 * j) % 11) as f64 - 5.0) as f32 / 8.0
}
fn b1(j: usize) -> f32 {
    (((j % 3) as f64 - 1.0) / 10.0) as f32
}
fn w2(j: usize, m: usize) -> f32 {
    ((((7 * j + 3 * m) % 13) as f64 - 6.0) / 10.0) as f32
}
fn b2(m: usize) -> f32 {
    (0.25 - 0.5 * m as f64) as f32
}

/// `relu(x · W1 + b1) · W2 + b2`, accumulated in f64 from the f32 inputs and weights.
fn expected(csv: &str) -> Vec<Vec<f64>> {
    normalise(&parse(csv))
        .iter()
        .map(|x| {
            let h: Vec<f64> = (0..HIDDEN)
                .map(|j| {
                    let z = (0..IN).fold(f64::from(b1(j)), |acc, k| {
                        acc + f64::from(x[k]) * f64::from(w1(k, j))
                    });
                    z.max(0.0)
                })
                .collect();
            (0..OUT)
                .map(|m| {
                    (0..HIDDEN).fold(f64::from(b2(m)), |acc, j| acc + h[j] * f64::from(w2(j, m)))
                })
                .collect()
        })
        .collect()
}

/// Relative tolerance 1e-5, with an absolute floor of 1e-6 for values near zero.
fn assert_close(name: &str, got: &[Vec<f64>], want: &[Vec<f64>]) {
    assert_eq!(got.len(), want.len(), "{name}: row count");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len(), "{name}: column count");
        for (a, b) in g.iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs() + 1e-6,
                "{name}: got {got:?}\nwant {want:?}"
            );
        }
    }
}

const TABLE: &str = "height,weight,age\n1.62,55.0,31\n1.80,82.5,45\n1.75,70.25,23\n1.55,48.0,67\n";

/// Five rows with blank lines, spaces, signs, exponents and a constant column.
const TABLE_ODD: &str =
    "\n a , b , c \r\n-1.5e1, 7, .5\n+2.25, 7, 3.\n\n0, 7 ,-4E-1\n 12.125 ,7,1e+1\n3,7,-.25\n";

#[test]
fn reference_sanity() {
    // Hand-checked corner: W1[0][0] = (0 - 5)/8, W2[7][1] = (52 % 13 - 6)/10 = -0.6.
    assert_eq!(w1(0, 0), -0.625);
    assert_eq!(w2(7, 1), -0.6f32);
    // A constant column normalises to zeros, the others to mean 0.
    let x = normalise(&parse(TABLE_ODD));
    assert!(x.iter().all(|r| r[1] == 0.0));
    let mean: f32 = x.iter().map(|r| r[0]).sum::<f32>() / x.len() as f32;
    assert!(mean.abs() < 1e-6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_match_the_rust_reference() {
    for name in GUESTS {
        for csv in [TABLE, TABLE_ODD, "x,y,z\n1,2,3\n"] {
            let o = run(name, &["--csv", csv], "").await;
            assert_close(name, &result_rows(name, &o), &expected(csv));
            let out = text(&o.stdout);
            let rows = csv.lines().filter(|l| !l.trim().is_empty()).count() - 1;
            assert!(out.contains(&format!("rows: {rows}\n")), "{name}: {out}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_and_python_read_csv_from_stdin() {
    for name in ["c-mlp", "python-mlp"] {
        let o = run(name, &[], TABLE).await;
        assert_close(name, &result_rows(name, &o), &expected(TABLE));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_rows_compile_for_their_own_shape() {
    // 64 rows (the limit): values from a formula, so every column varies.
    let mut csv = String::from("p,q,r\n");
    for i in 0..64 {
        let i = i as f64;
        csv += &format!(
            "{},{},{}\n",
            i * 0.5 - 7.0,
            (i * 1.7) % 5.0,
            100.0 - i * i / 9.0
        );
    }
    for name in GUESTS {
        let o = run(name, &["--csv", &csv], "").await;
        assert_close(name, &result_rows(name, &o), &expected(&csv));
    }
}

/// Runs `name` on bad input: it must fail with exactly one stderr line starting with
/// `NAME: error: ` and containing `want`, and print no result.
async fn assert_rejects(name: &str, args: &[&str], stdin: &str, want: &str) {
    let o = run(name, args, stdin).await;
    let err = text(&o.stderr);
    assert!(
        !o.success,
        "{name} accepted bad input {args:?}: {}",
        text(&o.stdout)
    );
    assert_eq!(
        err.lines().count(),
        1,
        "{name}: stderr is not one line:\n{err}"
    );
    assert!(
        err.starts_with(&format!("{name}: error: ")) && err.contains(want),
        "{name}: stderr {err:?} does not say {want:?}"
    );
    assert!(
        !text(&o.stdout).contains("result:"),
        "{name}: printed a result"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_reject_bad_input_with_one_line() {
    let cases: [(&str, &str); 7] = [
        (
            "a,b,c\n1,2,3\n4,x,6\n",
            "line 3, column 2: not a number: 'x'",
        ),
        ("a,b,c\n1,2\n", "line 2: expected 3 fields, got 2"),
        ("a,b\n1,2\n", "line 1: header has 2 columns, expected 3"),
        ("a,b,c\n1,nan,3\n", "not a number: 'nan'"),
        ("a,b,c\n1,0x10,3\n", "not a number: '0x10'"),
        (
            "a,b,c\n1,1e999,3\n",
            "line 2, column 2: out of range: '1e999'",
        ),
        ("a,b,c\n\n", "no data rows"),
    ];
    for name in GUESTS {
        for (csv, want) in cases {
            assert_rejects(name, &["--csv", csv], "", want).await;
        }
        assert_rejects(name, &["--bogus"], "", "usage:").await;
    }
    let mut big = String::from("a,b,c\n");
    for i in 0..65 {
        big += &format!("{i},1,2\n");
    }
    for name in GUESTS {
        assert_rejects(name, &["--csv", &big], "", "at most 64").await;
    }
    // An empty stdin for the guests that read it.
    for name in ["c-mlp", "python-mlp"] {
        assert_rejects(name, &[], "", "empty input").await;
    }
}
