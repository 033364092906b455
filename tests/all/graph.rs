//! The graph builder of the guest SDK (`tpubox_guest::graph`), end to end: the test guest
//! `tests/guests/graph-ops` builds one tiny graph per op and helper, runs it through the host on
//! the CPU plugin and prints `NAME: [values]`; every line is compared here with values computed
//! independently in plain Rust (f64 arithmetic on the same f32 inputs).
//!
//! The guest is built for wasm32-wasip2 before the tests run (`bash scripts/dev.sh test`, or
//! `cargo build --release --target wasm32-wasip2 -p tpubox-graph-ops`).

use crate::support::{test_host_config, wasm};

use std::collections::BTreeMap;
use std::time::Duration;

use tpubox_wasm::{Host, RunOptions};

/// Runs the graph-ops guest once and returns its stdout.
async fn run_guest() -> String {
    let config = test_host_config();
    let host = Host::new(config).expect("host starts on the CPU plugin");
    let name = "tpubox-graph-ops";
    let component = host.load_component(&wasm(name)).expect("component loads");
    let opts = RunOptions {
        capture_output: true,
        stdin: Some(Vec::new()),
        deadline: Some(Duration::from_secs(120)),
        ..RunOptions::default()
    };
    let o = host.run(&component, name, &opts).await.expect("guest runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.success,
        "guest failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

// ---------------------------------------------------------------------------------------------
// Inputs (restated from the guest) and reference math
// ---------------------------------------------------------------------------------------------

use crate::test_data::{data, pos};

fn scaled(xs: Vec<f32>, k: f32) -> Vec<f32> {
    xs.iter().map(|x| x * k).collect()
}

fn f64s(xs: &[f32]) -> Vec<f64> {
    xs.iter().map(|&x| f64::from(x)).collect()
}

/// erf by its Maclaurin series, summed in f64: for |x| <= 4 the rounding error stays below
/// 1e-9, far inside the 1e-6 tolerance (checked against known values in `reference_erf`).
fn erf(x: f64) -> f64 {
    assert!(x.abs() <= 4.0, "series erf is only used for |x| <= 4");
    let mut term = x; // (-1)^n x^(2n+1) / n!
    let mut sum = x;
    for n in 1..200 {
        term *= -x * x / n as f64;
        let t = term / (2 * n + 1) as f64;
        sum += t;
        if t.abs() < 1e-18 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// Expected values of one output, with the error scale each element is judged against.
struct Want {
    values: Vec<f64>,
    /// Per element: allowed |got - want| = rel * scale + abs.
    scale: Vec<f64>,
    rel: f64,
    abs: f64,
    /// The output is f32: the printed value is read back as f32 before comparing.
    is_f32: bool,
}

/// Compared relative to each value's magnitude (1e-5), with a 1e-7 floor.
fn rel(values: Vec<f64>) -> Want {
    let scale = values.iter().map(|v| v.abs()).collect();
    Want {
        values,
        scale,
        rel: 1e-5,
        abs: 1e-7,
        is_f32: true,
    }
}

/// Compared with an absolute tolerance.
fn abs(values: Vec<f64>, tol: f64) -> Want {
    let n = values.len();
    Want {
        values,
        scale: vec![0.0; n],
        rel: 0.0,
        abs: tol,
        is_f32: true,
    }
}

/// Compared exactly (pure data movement of f32 values, exact f32 ops).
fn exact(values: Vec<f64>) -> Want {
    abs(values, 0.0)
}

/// An integer (or `pred` as 0/1) output, compared exactly.
fn ints(values: Vec<f64>) -> Want {
    Want {
        is_f32: false,
        ..abs(values, 0.0)
    }
}

/// `sum` terms: the value and the sum of magnitudes, which bounds the f32 rounding error of
/// a dot product or reduction (so cancellation does not make a correct result look wrong).
fn dot(terms: impl Iterator<Item = f64>) -> (f64, f64) {
    terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()))
}

fn sums(pairs: Vec<(f64, f64)>) -> Want {
    let (values, scale) = pairs.into_iter().unzip();
    Want {
        values,
        scale,
        rel: 1e-5,
        abs: 0.0,
        is_f32: true,
    }
}

fn softmax_ref(x: &[f64], rows: usize, cols: usize, axis: usize) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    let (outer, inner) = if axis == 1 {
        (rows, cols)
    } else {
        (cols, rows)
    };
    for o in 0..outer {
        let idx = |i: usize| {
            if axis == 1 {
                o * cols + i
            } else {
                i * cols + o
            }
        };
        let m = (0..inner).map(|i| x[idx(i)]).fold(f64::MIN, f64::max);
        let s: f64 = (0..inner).map(|i| (x[idx(i)] - m).exp()).sum();
        for i in 0..inner {
            out[idx(i)] = (x[idx(i)] - m).exp() / s;
        }
    }
    out
}

/// Every expected output line of the guest.
fn expected() -> BTreeMap<&'static str, Want> {
    let mut w: BTreeMap<&'static str, Want> = BTreeMap::new();

    // Element-wise binary ops.
    let (a, b) = (f64s(&data(6, 1)), f64s(&data(3, 2)));
    w.insert("add", rel((0..6).map(|i| a[i] + b[i % 3]).collect()));
    let (a, b) = (f64s(&data(2, 3)), f64s(&data(3, 4)));
    w.insert("sub", rel((0..6).map(|i| a[i / 3] - b[i % 3]).collect()));
    let a = f64s(&data(6, 5));
    w.insert("mul", rel(a.iter().map(|x| x * 1.5).collect()));
    let (a, b) = (f64s(&data(6, 6)), f64s(&pos(6, 7)));
    w.insert("div", rel((0..6).map(|i| a[i] / b[i]).collect()));
    let (a, b) = (f64s(&pos(4, 8)), f64s(&data(4, 9)));
    w.insert("maximum", exact((0..4).map(|i| a[i].max(b[i])).collect()));
    w.insert("minimum", exact((0..4).map(|i| a[i].min(b[i])).collect()));
    w.insert("pow", rel((0..4).map(|i| a[i].powf(b[i])).collect()));

    // Unary ops.
    let x = f64s(&data(6, 12));
    let p = f64s(&pos(6, 13));
    let map = |v: &[f64], f: fn(f64) -> f64| v.iter().map(|&x| f(x)).collect::<Vec<_>>();
    w.insert("neg", exact(map(&x, |x| -x)));
    w.insert("abs", exact(map(&x, f64::abs)));
    w.insert("exp", rel(map(&x, f64::exp)));
    w.insert("tanh", rel(map(&x, f64::tanh)));
    w.insert("logistic", rel(map(&x, |x| 1.0 / (1.0 + (-x).exp()))));
    w.insert("erf", abs(map(&x, erf), 1e-6));
    w.insert("log", rel(map(&p, f64::ln)));
    w.insert("sqrt", rel(map(&p, f64::sqrt)));
    w.insert("rsqrt", rel(map(&p, |x| 1.0 / x.sqrt())));
    let xw = f64s(&scaled(data(23, 40), 2.0));
    w.insert("erf_wide", abs(map(&xw, erf), 1e-6));

    // Contractions.
    let (a, b) = (f64s(&data(24, 14)), f64s(&data(40, 15)));
    let mut out = Vec::new();
    for bt in 0..2 {
        for i in 0..3 {
            for j in 0..5 {
                out.push(dot(
                    (0..4).map(|k| a[bt * 12 + i * 4 + k] * b[bt * 20 + j * 4 + k])
                ));
            }
        }
    }
    w.insert("dot_general", sums(out));
    let (a, m) = (f64s(&data(24, 16)), f64s(&data(20, 17)));
    let mut out = Vec::new();
    for r in 0..6 {
        for j in 0..5 {
            out.push(dot((0..4).map(|k| a[r * 4 + k] * m[k * 5 + j])));
        }
    }
    w.insert("matmul", sums(out));
    let b = f64s(&data(16, 18));
    let mut out = Vec::new();
    for bt in 0..2 {
        for i in 0..3 {
            for j in 0..2 {
                out.push(dot(
                    (0..4).map(|k| a[bt * 12 + i * 4 + k] * b[bt * 8 + k * 2 + j])
                ));
            }
        }
    }
    w.insert("matmul_batched", sums(out));

    // Shape ops: [2,3,4] outputs indexed (i, j, k).
    let idx3 = || (0..2).flat_map(|i| (0..3).flat_map(move |j| (0..4).map(move |k| (i, j, k))));
    let a = f64s(&data(3, 19));
    w.insert(
        "broadcast_in_dim",
        exact(idx3().map(|(_, j, _)| a[j]).collect()),
    );
    let a = f64s(&data(3, 20));
    w.insert(
        "broadcast_to",
        exact(idx3().map(|(_, j, _)| a[j]).collect()),
    );
    let a = f64s(&data(24, 21));
    w.insert("reshape", exact(a.clone()));
    let mut t = Vec::new();
    for k in 0..4 {
        for i in 0..2 {
            for j in 0..3 {
                t.push(a[i * 12 + j * 4 + k]);
            }
        }
    }
    w.insert("transpose", exact(t));
    let a = f64s(&data(24, 22));
    let rs = (0..3)
        .map(|j| {
            dot(idx3()
                .filter(|&(_, jj, _)| jj == j)
                .map(|(i, j, k)| a[i * 12 + j * 4 + k]))
        })
        .collect();
    w.insert("reduce_sum", sums(rs));
    let mut rm = Vec::new();
    for i in 0..2 {
        for k in 0..4 {
            rm.push(
                (0..3)
                    .map(|j| a[i * 12 + j * 4 + k])
                    .fold(f64::MIN, f64::max),
            );
        }
    }
    w.insert("reduce_max", exact(rm));
    let s = [3i64, -7, 12, 0, -1, -20];
    w.insert(
        "reduce_sum_s32",
        ints(vec![
            (s[0] + s[1] + s[2]) as f64,
            (s[3] + s[4] + s[5]) as f64,
        ]),
    );
    w.insert(
        "reduce_max_s32",
        ints((0..3).map(|j| s[j].max(s[3 + j]) as f64).collect()),
    );
    let c = scaled(data(6, 23), 2.5);
    w.insert(
        "convert_f32_s32",
        ints(c.iter().map(|x| x.trunc() as f64).collect()),
    );
    w.insert("convert_s32_f32", exact(vec![-3.0, 7.0, 0.0, 123456.0]));

    // Compare and select.
    let (a, b) = (data(6, 24), data(3, 24));
    type Cmp = fn(&f32, &f32) -> bool;
    let dirs: [(&str, Cmp); 6] = [
        ("compare_eq", f32::eq),
        ("compare_ne", f32::ne),
        ("compare_lt", f32::lt),
        ("compare_le", f32::le),
        ("compare_gt", f32::gt),
        ("compare_ge", f32::ge),
    ];
    for (name, f) in dirs {
        w.insert(
            name,
            ints(
                (0..6)
                    .map(|i| f64::from(u8::from(f(&a[i], &b[i % 3]))))
                    .collect(),
            ),
        );
    }
    let a = f64s(&data(6, 25));
    w.insert(
        "select",
        exact(a.iter().map(|&x| if x > 0.0 { x } else { -1.0 }).collect()),
    );
    w.insert("iota_s32", ints(vec![0.0, 1.0, 2.0, 0.0, 1.0, 2.0]));
    w.insert("iota_f32", exact(vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]));

    // Gather, slice, concatenate.
    let table = f64s(&data(15, 26));
    let take = [4usize, 0, 2, 2]
        .iter()
        .flat_map(|&r| table[r * 3..r * 3 + 3].to_vec())
        .collect();
    w.insert("take", exact(take));
    let a = f64s(&data(24, 27));
    w.insert("slice", exact(vec![a[6], a[10], a[18], a[22]]));
    let (a, b) = (f64s(&data(6, 28)), f64s(&data(2, 29)));
    let mut cat = Vec::new();
    for r in 0..2 {
        cat.extend_from_slice(&a[r * 3..r * 3 + 3]);
        cat.push(b[r]);
        cat.extend_from_slice(&a[r * 3..r * 3 + 3]);
    }
    w.insert("concatenate", exact(cat));

    // Constants.
    let k = f64s(&[1.0f32, -2.5, 3.25, 0.0, 1e-3, -7.0]);
    w.insert("constant", rel(k.iter().map(|x| x + 0.5).collect()));
    w.insert("constant_big", exact(f64s(&data(100, 35))));
    w.insert(
        "constant_s64",
        ints(vec![-4.0, ((1i64 << 40) + 1) as f64, 4.0]),
    );

    // Helpers.
    let x = f64s(&scaled(data(8, 30), 3.0));
    w.insert("softmax", rel(softmax_ref(&x, 2, 4, 1)));
    w.insert("softmax_axis0", rel(softmax_ref(&x, 2, 4, 0)));
    let (x, g, b) = (f64s(&data(10, 31)), f64s(&pos(5, 32)), f64s(&data(5, 33)));
    let eps = f64::from(1e-5f32);
    let mut ln = Vec::new();
    for r in 0..2 {
        let row = &x[r * 5..r * 5 + 5];
        let mean = row.iter().sum::<f64>() / 5.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5.0;
        for d in 0..5 {
            ln.push((row[d] - mean) / (var + eps).sqrt() * g[d] + b[d]);
        }
    }
    w.insert("layer_norm", rel(ln));
    let x = f64s(&scaled(data(8, 34), 2.0));
    let gelu = x
        .iter()
        .map(|&v| 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2)))
        .collect();
    // 0.5·x·(1 + erf): an erf error of e moves the result by at most 0.5·|x|·e <= 2e.
    let mut gelu = rel(gelu);
    gelu.abs = 2e-6;
    w.insert("gelu", gelu);
    w
}

fn parse(out: &str) -> BTreeMap<String, Result<Vec<f64>, String>> {
    out.lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| {
            let parsed = if v.starts_with("ERROR") {
                Err(v.to_string())
            } else {
                serde_json::from_str::<Vec<f64>>(v).map_err(|e| format!("{e}: {v}"))
            };
            (k.to_string(), parsed)
        })
        .collect()
}

#[test]
fn reference_erf() {
    let known = [
        (0.0, 0.0),
        (0.5, 0.520_499_877_813_046_5),
        (-1.0, -0.842_700_792_949_714_9),
        (2.0, 0.995_322_265_018_952_7),
        (3.5, 0.999_999_256_901_627_7),
        (-4.0, -0.999_999_984_582_742_1),
    ];
    for (x, e) in known {
        assert!((erf(x) - e).abs() < 1e-10, "erf({x}) = {} vs {e}", erf(x));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graph_ops_match_reference() {
    let out = run_guest().await;
    let got = parse(&out);
    let want = expected();
    let mut failures = Vec::new();
    for name in got.keys() {
        if !want.contains_key(name.as_str()) {
            failures.push(format!("{name}: unexpected line"));
        }
    }
    for (name, w) in &want {
        let g = match got.get(*name) {
            None => {
                failures.push(format!("{name}: missing"));
                continue;
            }
            Some(Err(e)) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
            Some(Ok(g)) => g,
        };
        if g.len() != w.values.len() {
            failures.push(format!(
                "{name}: {} values, want {}",
                g.len(),
                w.values.len()
            ));
            continue;
        }
        for (i, (&gv, &wv)) in g.iter().zip(&w.values).enumerate() {
            // The guest prints the shortest decimal that reads back as the same f32.
            let gv = if w.is_f32 { f64::from(gv as f32) } else { gv };
            let tol = w.rel * w.scale[i] + w.abs;
            if (gv - wv).abs() > tol || gv.is_nan() {
                failures.push(format!(
                    "{name}[{i}]: got {gv}, want {wv} (|diff| {:e} > tol {tol:e})",
                    (gv - wv).abs()
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatch(es):\n{}\n\nguest output:\n{out}",
        failures.len(),
        failures.join("\n")
    );
}
