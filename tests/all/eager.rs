//! Eager arrays of the guest SDK (`tpubox_guest::eager`, issue 28 item 6), end to end: the
//! test guest `tests/guests/eager` runs every op in each of TorchTPU's three eager modes
//! (chosen by a scoped override, or by the environment the host grants) and as one compiled
//! `Graph`, and prints `NAME: [values]`; every line is compared here with values computed
//! independently in plain Rust (f64 arithmetic on the same f32 inputs), within
//! [`ATOL`] + [`RTOL`]·|want|. Then: a repeated fused step compiles once and donates its input,
//! ops hit the host's compile cache across tenants, debug checks name the op of a NaN and of an
//! out-of-range index, a device failure surfaces at the next read naming the op and the launch,
//! and a guest that ends with launches pending leaks nothing.
//!
//! The guest is built for wasm32-wasip2 before the tests run (`bash scripts/dev.sh test`, or
//! `cargo build --release --target wasm32-wasip2 -p tpubox-eager`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tpubox_core::tenant::ProgramPolicy;
use tpubox_core::{Tenant, TenantLimits};
use tpubox_wasm::{Host, RunOptions};

use crate::support::{test_host_config, wasm};

/// Absolute and relative tolerance of every value (f32 results against f64 references; the
/// CPU plugin's erf, exp and rsqrt are within a few ulps).
const ATOL: f64 = 2e-5;
const RTOL: f64 = 2e-5;

fn limits() -> TenantLimits {
    let mut policy = ProgramPolicy::default();
    policy
        .allowed_custom_calls
        .push("tpubox_test_fail".to_string());
    TenantLimits {
        max_pending_launches: 64,
        program_policy: policy,
        ..TenantLimits::default()
    }
}

/// A host with in-process compiles (the test-only failing custom call is registered in this
/// process only) and the compile cache on.
fn host() -> Host {
    let mut config = test_host_config();
    config.compile_isolation.worker = None;
    config.test_custom_calls = true;
    config.sandbox.tenant_limits = limits();
    Host::new(config).expect("the host starts on the CPU plugin")
}

struct Guest {
    host: Host,
    component: wasmtime::component::Component,
}

impl Guest {
    fn new() -> Guest {
        let host = host();
        let component = host
            .load_component(&wasm("tpubox-eager"))
            .expect("the eager guest loads");
        Guest { host, component }
    }

    /// Runs the guest with `args` and the environment `env`, charged to `tenant`; its stdout.
    async fn run(&self, args: &[&str], env: &[(&str, &str)], tenant: &Arc<Tenant>) -> String {
        let opts = RunOptions {
            args: args.iter().map(|a| a.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            capture_output: true,
            stdin: Some(Vec::new()),
            deadline: Some(Duration::from_secs(120)),
            tenant: Some(Arc::clone(tenant)),
            ..RunOptions::default()
        };
        let o = self
            .host
            .run(&self.component, "tpubox-eager", &opts)
            .await
            .unwrap_or_else(|e| panic!("{args:?}: {e:#}"));
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.success,
            "{args:?} failed:\n{out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    }
}

/// The `NAME: rest` lines of `out`.
fn lines(out: &str) -> BTreeMap<String, String> {
    out.lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn line<'a>(lines: &'a BTreeMap<String, String>, key: &str) -> &'a str {
    lines
        .get(key)
        .unwrap_or_else(|| panic!("no `{key}:` line in {lines:?}"))
}

/// Parses `[1.0, NaN, ...]`.
fn floats(s: &str) -> Vec<f64> {
    let inner = s
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or_else(|| panic!("not a list: {s}"));
    if inner.is_empty() {
        return Vec::new();
    }
    inner
        .split(", ")
        .map(|x| x.parse().unwrap_or_else(|_| panic!("not a number: {x}")))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Inputs (restated from the guest) and reference math in f64
// ---------------------------------------------------------------------------------------------

/// The guest's inputs ([`crate::test_data::data`], computed in f32), as f64.
fn data(n: usize, seed: u32) -> Vec<f64> {
    crate::test_data::data(n, seed)
        .into_iter()
        .map(f64::from)
        .collect()
}

/// The guest's positive inputs ([`crate::test_data::pos`]), as f64.
fn pos(n: usize, seed: u32) -> Vec<f64> {
    crate::test_data::pos(n, seed)
        .into_iter()
        .map(f64::from)
        .collect()
}

/// erf by its Taylor series at 0, summed in f64 for |x| <= 4 (the terms' rounding stays far
/// below the tolerance); beyond, ±1 (erfc(4) < 1.6e-8, so a GELU of |x| <= 20 is off by less
/// than 2e-7).
fn erf(x: f64) -> f64 {
    if x.abs() > 4.0 {
        return x.signum();
    }
    let (mut term, mut sum) = (x, x);
    let mut n = 1.0;
    while term.abs() > 1e-20 {
        term *= -x * x / n;
        sum += term / (2.0 * n + 1.0);
        n += 1.0;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn reference_erf() {
    // erf(0.5), erf(1), erf(2), erf(3.5) to 15 digits (Abramowitz and Stegun, table 7.1).
    for (x, want) in [
        (0.5, 0.520499877813047),
        (1.0, 0.842700792949715),
        (2.0, 0.995322265018953),
        (3.5, 0.999999256901628),
    ] {
        assert!((erf(x) - want).abs() < 1e-11, "erf({x}) = {}", erf(x));
        assert!((erf(-x) + want).abs() < 1e-11);
    }
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

/// `a[m,k] · b[k,n]`.
fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
        }
    }
    out
}

/// Softmax of each row of `a` (`cols` wide).
fn softmax_rows(a: &[f64], cols: usize) -> Vec<f64> {
    a.chunks(cols)
        .flat_map(|r| {
            let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = r.iter().map(|x| (x - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(move |x| x / s)
        })
        .collect()
}

/// Layer norm of each row of `x`, eps 1e-5, biased variance.
fn layer_norm_rows(x: &[f64], gamma: &[f64], beta: &[f64]) -> Vec<f64> {
    let d = gamma.len();
    x.chunks(d)
        .flat_map(|r| {
            let mean = r.iter().sum::<f64>() / d as f64;
            let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (var + 1e-5).sqrt();
            (0..d)
                .map(|j| (r[j] - mean) * inv * gamma[j] + beta[j])
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `gelu(x · w + b)` for x of 2 rows, w = data(12, 4) as [3, 4], b = data(4, 5).
fn mlp(x: &[f64]) -> Vec<f64> {
    let (w, b) = (data(12, 4), data(4, 5));
    let xw = matmul(x, &w, 2, 3, 4);
    (0..8).map(|i| gelu(xw[i] + b[i % 4])).collect()
}

/// The expected output of every case of the guest's `values`.
fn expected_values() -> BTreeMap<&'static str, Vec<f64>> {
    let mut want = BTreeMap::new();
    let (x, y, p) = (data(6, 1), data(3, 2), pos(6, 3));
    let bin = |f: fn(f64, f64) -> f64| -> Vec<f64> { (0..6).map(|i| f(x[i], y[i % 3])).collect() };
    want.insert("add", bin(|a, b| a + b));
    want.insert("sub", bin(|a, b| a - b));
    want.insert("mul", bin(|a, b| a * b));
    want.insert("maximum", bin(f64::max));
    want.insert("minimum", bin(f64::min));
    want.insert("div", (0..6).map(|i| x[i] / p[i]).collect());
    want.insert("pow", (0..6).map(|i| p[i].powf(x[i])).collect());
    let un = |f: fn(f64) -> f64, v: &[f64]| -> Vec<f64> { v.iter().map(|&a| f(a)).collect() };
    want.insert("neg", un(|a| -a, &x));
    want.insert("abs", un(f64::abs, &x));
    want.insert("exp", un(f64::exp, &x));
    want.insert("tanh", un(f64::tanh, &x));
    want.insert("logistic", un(|a| 1.0 / (1.0 + (-a).exp()), &x));
    want.insert("gelu", un(gelu, &x));
    want.insert("log", un(f64::ln, &p));
    want.insert("sqrt", un(f64::sqrt, &p));
    want.insert("rsqrt", un(|a| 1.0 / a.sqrt(), &p));
    want.insert("matmul", matmul(&x, &data(12, 4), 2, 3, 4));
    let h = mlp(&x);
    want.insert("mlp", h.clone());
    let t = data(24, 6);
    want.insert(
        "sum",
        (0..3)
            .map(|j| {
                (0..2)
                    .flat_map(|i| (0..4).map(move |k| (i, k)))
                    .map(|(i, k)| t[i * 12 + j * 4 + k])
                    .sum()
            })
            .collect(),
    );
    want.insert(
        "max",
        (0..8)
            .map(|ik| {
                let (i, k) = (ik / 4, ik % 4);
                (0..3)
                    .map(|j| t[i * 12 + j * 4 + k])
                    .fold(f64::NEG_INFINITY, f64::max)
            })
            .collect(),
    );
    want.insert("softmax", softmax_rows(&data(15, 7), 5));
    want.insert(
        "layer_norm",
        layer_norm_rows(&data(24, 8), &pos(8, 9), &data(8, 10)),
    );
    let table = data(15, 11);
    want.insert(
        "take",
        [4usize, 0, 2, 4]
            .iter()
            .flat_map(|&r| table[r * 3..r * 3 + 3].to_vec())
            .collect(),
    );
    let a = data(24, 12);
    want.insert("slice", vec![a[6], a[9], a[18], a[21]]);
    want.insert(
        "dynamic_slice",
        [1usize, 2]
            .iter()
            .flat_map(|&r| a[r * 6 + 2..r * 6 + 5].to_vec())
            .collect(),
    );
    let mut cat = data(6, 13);
    cat.extend(data(3, 14));
    want.insert("concatenate", cat);
    let ln = layer_norm_rows(&h, &pos(4, 15), &data(4, 16));
    let sm = softmax_rows(&ln, 4);
    want.insert(
        "chain",
        (0..2)
            .map(|i| (0..4).map(|j| sm[i * 4 + j] * h[i * 4 + j]).sum())
            .collect(),
    );
    want
}

/// Asserts that `got` (a printed list) is `want` within the tolerance.
fn assert_close(what: &str, got: &str, want: &[f64]) {
    let got = floats(got);
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= ATOL + RTOL * w.abs(),
            "{what}[{i}]: got {g}, want {w} (all: {got:?} vs {want:?})"
        );
    }
}

/// Asserts every `values` line of `out`.
fn assert_values(what: &str, out: &str) {
    let got = lines(out);
    for (name, want) in expected_values() {
        assert_close(&format!("{what} {name}"), line(&got, name), &want);
    }
}

/// Asserts the `repeat<i>` lines of `l` (mode `mode`) against `want[i]`.
fn assert_repeats(mode: &str, l: &BTreeMap<String, String>, want: &[Vec<f64>]) {
    for (i, w) in want.iter().enumerate() {
        assert_close(
            &format!("{mode} repeat{i}"),
            line(l, &format!("repeat{i}")),
            w,
        );
    }
}

/// The `stats:` line's counters.
fn stats(l: &str) -> BTreeMap<String, u64> {
    l.split(' ')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
        .collect()
}

/// Waits until `tenant` holds nothing: no device bytes, tensors, executables, launches or
/// running executions (polled every 10 ms, for at most 60 s).
async fn nothing_held(what: &str, tenant: &Tenant) {
    for _ in 0..6000 {
        let u = tenant.usage();
        if u.device_bytes == 0
            && u.live_tensors == 0
            && u.live_executables == 0
            && u.pending_launches == 0
            && u.executions_running == 0
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: still held: {:?}", tenant.usage());
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_gives_the_same_numbers_in_each_mode_and_as_a_compiled_graph() {
    let g = Guest::new();
    let tenant = Tenant::new("eager-values", limits());
    for (mode, name) in [
        ("never", "DEFER_NEVER"),
        ("fuse", "DEFER_AND_FUSE"),
        ("blocking", "DEFER_NEVER_AND_LAUNCH_BLOCKING"),
        ("graph", "graph"),
    ] {
        let out = g.run(&[mode, "values"], &[], &tenant).await;
        assert_eq!(line(&lines(&out), "mode"), name, "{out}");
        assert_values(mode, &out);
        if mode == "fuse" {
            // One read ran the whole trace: every output of the case in one step.
            let s = stats(line(&lines(&out), "stats"));
            assert_eq!((s["fused_steps"], s["launches"]), (1, 1), "{out}");
        }
    }
    nothing_held("after the value runs", &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mode_comes_from_the_environment_the_host_grants() {
    let g = Guest::new();
    let tenant = Tenant::new("eager-env", limits());
    let cases: [(&[(&str, &str)], &str); 4] = [
        (&[], "DEFER_NEVER"),
        (&[("TPUBOX_DEFER_AND_FUSE", "1")], "DEFER_AND_FUSE"),
        (
            &[
                ("TPUBOX_DEFER_AND_FUSE", "1"),
                ("TPUBOX_LAUNCH_BLOCKING", "1"),
            ],
            "DEFER_NEVER_AND_LAUNCH_BLOCKING",
        ),
        (
            &[
                ("TPUBOX_LAUNCH_BLOCKING", "1"),
                ("TPUBOX_ENABLE_DEBUG_CHECKS", "1"),
            ],
            "DEFER_NEVER_AND_LAUNCH_BLOCKING",
        ),
    ];
    for (env, mode) in cases {
        let out = g.run(&["env", "values", "scoped"], env, &tenant).await;
        let l = lines(&out);
        assert_eq!(line(&l, "mode"), mode, "{env:?}: {out}");
        let checks = env.iter().any(|(k, _)| *k == "TPUBOX_ENABLE_DEBUG_CHECKS");
        assert_eq!(line(&l, "debug-checks"), checks.to_string(), "{out}");
        assert_values(mode, &out);
        // The scoped override, and the mode restored after it.
        assert_eq!(
            line(&l, "scoped"),
            format!("{mode} DEFER_NEVER_AND_LAUNCH_BLOCKING {mode}")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_step_compiles_once_donates_its_input_and_ops_hit_the_cache_across_tenants() {
    let g = Guest::new();
    let want: Vec<Vec<f64>> = (0..3).map(|i| mlp(&data(6, 20 + i))).collect();

    let fuse = Tenant::new("eager-fuse", limits());
    let out = g.run(&["fuse", "repeat"], &[], &fuse).await;
    let l = lines(&out);
    assert_repeats("fuse", &l, &want);
    // One fused program for the three steps: compiled once; x (held by no array at the
    // step) donated each time, w and b (still held) never.
    let s = stats(line(&l, "repeat-stats"));
    let got = [
        s["compiles"],
        s["cache_hits"],
        s["launches"],
        s["fused_steps"],
        s["donated"],
    ];
    assert_eq!(got, [1, 2, 3, 3, 3], "{out}");

    let first = Tenant::new("eager-first", limits());
    let out = g.run(&["never", "repeat"], &[], &first).await;
    let l = lines(&out);
    assert_repeats("never", &l, &want);
    // matmul, add, gelu: each compiled once by the guest, then served from its own cache.
    let s = stats(line(&l, "repeat-stats"));
    let got = [
        s["compiles"],
        s["cache_hits"],
        s["launches"],
        s["fused_steps"],
    ];
    assert_eq!(got, [3, 6, 9, 0], "{out}");

    // Another tenant running the same ops: the canonical texts are byte-identical, so the
    // host serves every compile from its in-memory tier (none charged to the tenant).
    let second = Tenant::new("eager-second", limits());
    let before = second.usage().compiles;
    let out = g.run(&["never", "repeat"], &[], &second).await;
    assert_eq!(
        stats(line(&lines(&out), "repeat-stats"))["compiles"],
        3,
        "{out}"
    );
    assert_eq!(second.usage().compiles, before, "{:?}", second.usage());
    assert!(first.usage().compiles >= 1, "{:?}", first.usage());
    for t in [&fuse, &first, &second] {
        nothing_held("after the repeats", t).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_longer_than_the_threshold_runs_in_steps_with_the_same_values() {
    let g = Guest::new();
    let mut want = data(6, 30);
    for i in 0..20 {
        for v in &mut want {
            *v = if i % 2 == 0 { v.tanh() } else { *v + 0.5 };
        }
    }
    let tenant = Tenant::new("eager-threshold", limits());
    // DEFER_AND_FUSE with max_fused_ops 8: 20 ops run as 8 + 8 when the trace fills, then 4
    // at the read; the other modes launch each op.
    for (mode, counts) in [("fuse", [3, 3]), ("never", [0, 20]), ("blocking", [0, 20])] {
        let out = g.run(&[mode, "threshold"], &[], &tenant).await;
        let l = lines(&out);
        assert_close(&format!("{mode} threshold"), line(&l, "threshold"), &want);
        let got: Vec<u64> = floats(line(&l, "threshold-stats"))
            .into_iter()
            .map(|x| x as u64)
            .collect();
        assert_eq!(got, counts, "{mode}: {out}");
    }
    nothing_held("after the threshold runs", &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_checks_name_the_op_of_a_nan_and_of_an_out_of_range_index() {
    let g = Guest::new();
    let tenant = Tenant::new("eager-checks", limits());
    let table = data(15, 11);
    for mode in ["never", "fuse", "blocking"] {
        let out = g.run(&[mode, "checks"], &[], &tenant).await;
        let l = lines(&out);
        for key in ["checks-nan", "checks-nan-chain"] {
            let e = line(&l, key);
            assert!(
                e.starts_with("ERROR execution-failed: debug check: eager log")
                    && e.contains("produced NaN at element 1 of f32[2]"),
                "{mode} {key}: {e}"
            );
        }
        let e = line(&l, "checks-index");
        assert!(
            e.starts_with("ERROR invalid-argument: debug check: eager take: index 7 at position 1")
                && e.contains("out of range 0..5"),
            "{mode}: {e}"
        );
        let e = line(&l, "checks-dynamic-slice");
        assert!(
            e.starts_with(
                "ERROR invalid-argument: debug check: eager dynamic_slice: start 3 of dim 0 is out of range 0..=2"
            ),
            "{mode}: {e}"
        );
        // Without the checks, XLA clamps the index to the last row and the NaN goes through.
        let mut clamped = table[3..6].to_vec();
        clamped.extend_from_slice(&table[12..15]);
        let ok = line(&l, "unchecked-index");
        assert_close(
            &format!("{mode} unchecked-index"),
            ok.strip_prefix("ok ").unwrap_or(ok),
            &clamped,
        );
        assert_eq!(line(&l, "unchecked-nan"), "ok [0.0, NaN]", "{mode}");
        // The start 3 of dim 0 clamped to 2: rows 2 and 3, columns 0..3.
        let a = data(24, 12);
        let clamped: Vec<f64> = [2usize, 3]
            .iter()
            .flat_map(|&r| a[r * 6..r * 6 + 3].to_vec())
            .collect();
        let ok = line(&l, "unchecked-dynamic-slice");
        assert_close(
            &format!("{mode} unchecked-dynamic-slice"),
            ok.strip_prefix("ok ").unwrap_or(ok),
            &clamped,
        );
    }
    nothing_held("after the checks", &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_failure_surfaces_at_the_next_read_naming_the_op_and_the_launch() {
    let g = Guest::new();
    let tenant = Tenant::new("eager-fail", limits());
    for mode in ["never", "fuse", "blocking"] {
        let out = g.run(&[mode, "fail"], &[], &tenant).await;
        let l = lines(&out);
        let id = line(&l, "fail-launch")
            .split(' ')
            .next()
            .unwrap()
            .to_string();
        // The read of the op's input names the failed launch.
        let e = line(&l, "fail-read-input");
        assert!(
            e.starts_with(&format!(
                "ERROR execution-failed: eager from_tensor: launch {id} of program "
            )),
            "{mode}: {e}"
        );
        // DEFER_NEVER launches the op without waiting: the failure comes at the read, named.
        // LAUNCH_BLOCKING waits: the op itself fails.
        let op = line(&l, "fail-op");
        assert_eq!(op, if mode == "blocking" { "error" } else { "ok" }, "{out}");
        // The read names the op, its launch, and the failed launch it took as an argument
        // (`eager mul: launch N of program P failed: argument 0: launch ID of program ...`).
        let e = line(&l, "fail-read");
        let op = if mode == "blocking" { "exp" } else { "mul" };
        assert!(
            e.starts_with(&format!("ERROR execution-failed: eager {op}: launch "))
                && e.contains(&format!("argument 0: launch {id} of program "))
                && e.ends_with("this custom call fails on purpose (test-only)"),
            "{mode}: {e}"
        );
    }
    nothing_held("after the failures", &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_ends_with_launches_pending_leaks_nothing() {
    let g = Guest::new();
    let tenant = Tenant::new("eager-pending", limits());
    let out = g.run(&["never", "pending"], &[], &tenant).await;
    assert_eq!(line(&lines(&out), "pending"), "10 arrays held", "{out}");
    nothing_held("the pending launches of an ended guest", &tenant).await;
    // The host serves the next run.
    let out = g.run(&["fuse", "values"], &[], &tenant).await;
    assert_values("after pending", &out);
    nothing_held("after the next run", &tenant).await;
}

/// The f64 references of the `bounded` case's item `i` of length `len`, by output name.
fn expected_bounded(i: u32, len: usize) -> Vec<(&'static str, Vec<f64>)> {
    let x = data(len, i);
    let x2 = data(3 * len, i);
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let chain: Vec<f64> = x.iter().map(|v| v.exp() * v + 0.5).collect();
    vec![
        ("sum", vec![x.iter().sum()]),
        ("max", vec![max]),
        ("softmax", softmax_rows(&x, len)),
        ("chain-sum", vec![chain.iter().sum()]),
        ("chain", chain),
        (
            "rows",
            (0..3)
                .map(|r| x2[r * len..(r + 1) * len].iter().sum())
                .collect(),
        ),
        (
            "cols",
            (0..len)
                .map(|c| (0..3).map(|r| x2[r * len + c]).sum())
                .collect(),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_bounded_lengths_compiles_one_program_per_bucket_with_exact_values() {
    let g = Guest::new();
    let tenant = Tenant::new("eager-bounded", limits());
    for mode in ["fuse", "never", "blocking"] {
        let out = g.run(&[mode, "bounded"], &[], &tenant).await;
        let got = lines(&out);
        for i in 0..200u32 {
            let len = floats(line(&got, &format!("bounded-{i}-len")))[0] as usize;
            assert!((1..=100).contains(&len), "{out}");
            for (name, want) in expected_bounded(i, len) {
                let key = format!("bounded-{i}-{name}");
                assert_close(
                    &format!("{mode} {key} (length {len})"),
                    line(&got, &key),
                    &want,
                );
            }
        }
        let c = floats(line(&got, "bounded-compiles"));
        let (compiles, buckets, lengths, ops) = (c[0], c[1], c[2], c[3]);
        eprintln!("{mode}: {compiles} compiles for {lengths} lengths in {buckets} buckets");
        // Lengths 1..=100: buckets 1, 2, 4, ..., 64, 100.
        assert!(buckets <= 8.0 && lengths > buckets, "{out}");
        if mode == "fuse" {
            assert!(
                compiles <= buckets,
                "{compiles} fused programs for {buckets} buckets"
            );
        } else {
            assert!(
                compiles <= buckets * ops,
                "{compiles} programs for {buckets} buckets"
            );
        }
        for op in ["matmul", "reshape", "add"] {
            let l = line(
                &got,
                &format!("bounded-error-{}", if op == "add" { "static" } else { op }),
            );
            assert!(
                l.starts_with("ERROR") && l.contains(op) && l.contains("dynamic"),
                "{op}: {l}"
            );
        }
        let x = data(5, 3);
        assert_close(
            "mark sum",
            line(&got, "bounded-mark-sum"),
            &[x.iter().sum()],
        );
        assert_close(
            "mark softmax",
            line(&got, "bounded-mark-softmax"),
            &softmax_rows(&x, 5),
        );
        let logs: f64 = pos(5, 1).iter().map(|v| v.ln()).sum();
        let l = line(&got, "bounded-checks-padding");
        assert_close(
            "checks padding",
            l.strip_prefix("ok ").unwrap_or(l),
            &[logs],
        );
        let l = line(&got, "bounded-checks-nan");
        assert!(l.starts_with("ERROR") && l.contains("log"), "{l}");
        let l = line(&got, "bounded-error-mark");
        assert!(l.starts_with("ERROR") && l.contains("mark_dynamic"), "{l}");
        let l = line(&got, "bounded-error-bucket");
        assert!(l.starts_with("ERROR") && l.contains("bucket 8"), "{l}");
        assert_eq!(
            line(&got, "bounded-dims"),
            "ok ([8], [5], Some((0, 5)))",
            "{out}"
        );
    }
    nothing_held("after the bounded runs", &tenant).await;
}
