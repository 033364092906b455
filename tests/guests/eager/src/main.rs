//! A test guest for `tpubox_guest::eager`: runs the same cases in one eager mode, or as one
//! compiled graph, and prints one line `NAME: [values]` per output (f32 values as `{:?}`). A
//! case that fails prints `NAME: ERROR <error>` and the guest goes on.
//!
//! `tpubox-eager MODE [CASE...]`, MODE one of
//! - `env`: the mode the host's environment grants (`TPUBOX_DEFER_AND_FUSE`,
//!   `TPUBOX_LAUNCH_BLOCKING`); `never`, `fuse`, `blocking`: that mode (a scoped override);
//! - `graph`: every case as one `Graph::compile`d program.
//!
//! and CASE `values` (default: every op on fixed inputs), `repeat` (one MLP step three times:
//! caching and donation), `threshold` (a trace longer than the fused-op threshold), `checks` (debug checks: a NaN, an out-of-range index), `fail` (a
//! launch that fails on the device, read through an eager op), `pending` (ends with launches
//! pending and a trace recorded), `bounded` (a stream of bounded-shape inputs); or `bench
//! WORKLOAD STEPS` (the eager benchmark's workloads, timed: see [`mod@bench`]). The first
//! line is always `mode: NAME`; the last `stats: ...`.
//!
//! The inputs come from [`data`] and [`pos`], restated in `tests/all/eager.rs`, which computes
//! the expected values independently.

use tpubox_guest::eager::{self, Array, EagerMode};
use tpubox_guest::graph::{Graph, Precision, Value};
use tpubox_guest::{Element, Result, Tensor, compile_mlir};

mod bench;
#[path = "../../test_data.rs"]
mod test_data;
use test_data::{data, pos};

fn json(xs: &[f32]) -> String {
    let items: Vec<String> = xs.iter().map(|x| format!("{x:?}")).collect();
    format!("[{}]", items.join(", "))
}

/// The ops the cases use, on eager arrays or on graph values.
trait Backend {
    type V: Clone;
    fn input<T: Element>(&mut self, data: &[T], dims: &[u64]) -> Result<Self::V>;
    fn bin(&mut self, op: &str, a: &Self::V, b: &Self::V) -> Result<Self::V>;
    fn un(&mut self, op: &str, a: &Self::V) -> Result<Self::V>;
    fn reduce(&mut self, op: &str, a: &Self::V, axes: &[u64]) -> Result<Self::V>;
    fn softmax(&mut self, a: &Self::V, axis: u64) -> Result<Self::V>;
    fn layer_norm(&mut self, x: &Self::V, g: &Self::V, b: &Self::V) -> Result<Self::V>;
    fn slice(&mut self, a: &Self::V, s: &[u64], l: &[u64], st: &[u64]) -> Result<Self::V>;
    fn concat(&mut self, xs: &[&Self::V], axis: u64) -> Result<Self::V>;
    fn dynamic_slice(&mut self, a: &Self::V, starts: &Self::V, sizes: &[u64]) -> Result<Self::V>;
    fn reshape(&mut self, a: &Self::V, dims: &[u64]) -> Result<Self::V>;
    fn transpose(&mut self, a: &Self::V, permutation: &[u64]) -> Result<Self::V>;
    /// A value already on the device (a weight of the host's weight set).
    fn tensor(&mut self, t: Tensor) -> Result<Self::V>;
    /// Records an output to print as `name`.
    fn output(&mut self, name: &str, v: &Self::V);
    /// Prints the outputs recorded (reading them, or compiling and running the graph).
    fn finish(&mut self) -> Result<()>;
}

#[derive(Default)]
struct Eager {
    outputs: Vec<(String, Array)>,
}

impl Backend for Eager {
    type V = Array;
    fn input<T: Element>(&mut self, data: &[T], dims: &[u64]) -> Result<Array> {
        Array::from_slice(data, dims)
    }
    fn bin(&mut self, op: &str, a: &Array, b: &Array) -> Result<Array> {
        match op {
            "add" => a.add(b),
            "sub" => a.sub(b),
            "mul" => a.mul(b),
            "div" => a.div(b),
            "maximum" => a.maximum(b),
            "minimum" => a.minimum(b),
            "pow" => a.pow(b),
            "matmul" => a.matmul(b),
            "take" => a.take(b),
            _ => unreachable!("{op}"),
        }
    }
    fn un(&mut self, op: &str, a: &Array) -> Result<Array> {
        match op {
            "neg" => a.neg(),
            "abs" => a.abs(),
            "exp" => a.exp(),
            "log" => a.log(),
            "tanh" => a.tanh(),
            "sqrt" => a.sqrt(),
            "rsqrt" => a.rsqrt(),
            "logistic" => a.logistic(),
            "gelu" => a.gelu(),
            _ => unreachable!("{op}"),
        }
    }
    fn reduce(&mut self, op: &str, a: &Array, axes: &[u64]) -> Result<Array> {
        match op {
            "sum" => a.sum(axes),
            _ => a.max(axes),
        }
    }
    fn softmax(&mut self, a: &Array, axis: u64) -> Result<Array> {
        a.softmax(axis)
    }
    fn layer_norm(&mut self, x: &Array, g: &Array, b: &Array) -> Result<Array> {
        x.layer_norm(g, b, 1e-5)
    }
    fn slice(&mut self, a: &Array, s: &[u64], l: &[u64], st: &[u64]) -> Result<Array> {
        a.slice(s, l, st)
    }
    fn concat(&mut self, xs: &[&Array], axis: u64) -> Result<Array> {
        Array::concatenate(xs, axis)
    }
    fn dynamic_slice(&mut self, a: &Array, starts: &Array, sizes: &[u64]) -> Result<Array> {
        a.dynamic_slice(starts, sizes)
    }
    fn reshape(&mut self, a: &Array, dims: &[u64]) -> Result<Array> {
        a.reshape(dims)
    }
    fn transpose(&mut self, a: &Array, permutation: &[u64]) -> Result<Array> {
        a.transpose(permutation)
    }
    fn tensor(&mut self, t: Tensor) -> Result<Array> {
        Ok(Array::from_tensor(t))
    }
    fn output(&mut self, name: &str, v: &Array) {
        self.outputs.push((name.to_string(), v.clone()));
    }
    fn finish(&mut self) -> Result<()> {
        // The first read runs a fused trace with every output still held.
        for (name, a) in std::mem::take(&mut self.outputs) {
            match a.to_vec::<f32>() {
                Ok(v) => println!("{name}: {}", json(&v)),
                Err(e) => println!("{name}: ERROR {e}"),
            }
        }
        Ok(())
    }
}

struct Compiled {
    g: Graph,
    args: Vec<Tensor>,
    outputs: Vec<(String, Value)>,
}

impl Backend for Compiled {
    type V = Value;
    fn input<T: Element>(&mut self, data: &[T], dims: &[u64]) -> Result<Value> {
        self.args.push(Tensor::from_slice(data, dims)?);
        Ok(self.g.parameter(T::DTYPE, dims))
    }
    fn bin(&mut self, op: &str, a: &Value, b: &Value) -> Result<Value> {
        let (g, a, b) = (&self.g, *a, *b);
        match op {
            "add" => g.add(a, b),
            "sub" => g.sub(a, b),
            "mul" => g.mul(a, b),
            "div" => g.div(a, b),
            "maximum" => g.maximum(a, b),
            "minimum" => g.minimum(a, b),
            "pow" => g.pow(a, b),
            "matmul" => g.matmul(a, b, Precision::Highest),
            "take" => g.take(a, b),
            _ => unreachable!("{op}"),
        }
    }
    fn un(&mut self, op: &str, a: &Value) -> Result<Value> {
        let (g, a) = (&self.g, *a);
        match op {
            "neg" => g.neg(a),
            "abs" => g.abs(a),
            "exp" => g.exp(a),
            "log" => g.log(a),
            "tanh" => g.tanh(a),
            "sqrt" => g.sqrt(a),
            "rsqrt" => g.rsqrt(a),
            "logistic" => g.logistic(a),
            "gelu" => g.gelu(a),
            _ => unreachable!("{op}"),
        }
    }
    fn reduce(&mut self, op: &str, a: &Value, axes: &[u64]) -> Result<Value> {
        match op {
            "sum" => self.g.reduce_sum(*a, axes),
            _ => self.g.reduce_max(*a, axes),
        }
    }
    fn softmax(&mut self, a: &Value, axis: u64) -> Result<Value> {
        self.g.softmax(*a, axis)
    }
    fn layer_norm(&mut self, x: &Value, g: &Value, b: &Value) -> Result<Value> {
        self.g.layer_norm(*x, *g, *b, 1e-5)
    }
    fn slice(&mut self, a: &Value, s: &[u64], l: &[u64], st: &[u64]) -> Result<Value> {
        self.g.slice(*a, s, l, st)
    }
    fn concat(&mut self, xs: &[&Value], axis: u64) -> Result<Value> {
        let xs: Vec<Value> = xs.iter().map(|&&v| v).collect();
        self.g.concatenate(&xs, axis)
    }
    fn dynamic_slice(&mut self, a: &Value, starts: &Value, sizes: &[u64]) -> Result<Value> {
        let g = &self.g;
        let starts = (0..sizes.len() as u64)
            .map(|i| g.reshape(g.slice(*starts, &[i], &[i + 1], &[1])?, &[]))
            .collect::<Result<Vec<Value>>>()?;
        g.dynamic_slice(*a, &starts, sizes)
    }
    fn reshape(&mut self, a: &Value, dims: &[u64]) -> Result<Value> {
        self.g.reshape(*a, dims)
    }
    fn transpose(&mut self, a: &Value, permutation: &[u64]) -> Result<Value> {
        self.g.transpose(*a, permutation)
    }
    fn tensor(&mut self, t: Tensor) -> Result<Value> {
        let spec = t.spec().clone();
        self.args.push(t);
        Ok(self.g.parameter(spec.dtype, &spec.dims))
    }
    fn output(&mut self, name: &str, v: &Value) {
        self.outputs.push((name.to_string(), *v));
    }
    fn finish(&mut self) -> Result<()> {
        let outputs: Vec<Value> = self.outputs.iter().map(|(_, v)| *v).collect();
        let exe = self.g.compile(&outputs)?;
        let args: Vec<&Tensor> = self.args.iter().collect();
        let outs = exe.call(&args)?;
        for ((name, _), t) in self.outputs.iter().zip(&outs) {
            println!("{name}: {}", json(&t.to_vec::<f32>()?));
        }
        Ok(())
    }
}

/// Every op on fixed inputs; each output named after the op.
fn values<B: Backend>(b: &mut B) -> Result<()> {
    // Element-wise, with broadcasting.
    let x = b.input(&data(6, 1), &[2, 3])?;
    let y = b.input(&data(3, 2), &[3])?;
    let p = b.input(&pos(6, 3), &[2, 3])?;
    for op in ["add", "sub", "mul", "maximum", "minimum"] {
        let v = b.bin(op, &x, &y)?;
        b.output(op, &v);
    }
    let v = b.bin("div", &x, &p)?;
    b.output("div", &v);
    let v = b.bin("pow", &p, &x)?;
    b.output("pow", &v);
    for op in ["neg", "abs", "exp", "tanh", "logistic", "gelu"] {
        let v = b.un(op, &x)?;
        b.output(op, &v);
    }
    for op in ["log", "sqrt", "rsqrt"] {
        let v = b.un(op, &p)?;
        b.output(op, &v);
    }
    // matmul, and the MLP layer of the issue: gelu(x · w + b).
    let w = b.input(&data(12, 4), &[3, 4])?;
    let bias = b.input(&data(4, 5), &[4])?;
    let xw = b.bin("matmul", &x, &w)?;
    b.output("matmul", &xw);
    let h = b.bin("add", &xw, &bias)?;
    let mlp = b.un("gelu", &h)?;
    b.output("mlp", &mlp);
    // Reductions.
    let t = b.input(&data(24, 6), &[2, 3, 4])?;
    let v = b.reduce("sum", &t, &[0, 2])?;
    b.output("sum", &v);
    let v = b.reduce("max", &t, &[1])?;
    b.output("max", &v);
    // Softmax and layer norm.
    let s = b.input(&data(15, 7), &[3, 5])?;
    let v = b.softmax(&s, 1)?;
    b.output("softmax", &v);
    let ln_x = b.input(&data(24, 8), &[3, 8])?;
    let gamma = b.input(&pos(8, 9), &[8])?;
    let beta = b.input(&data(8, 10), &[8])?;
    let v = b.layer_norm(&ln_x, &gamma, &beta)?;
    b.output("layer_norm", &v);
    // Gather, slice, concatenate.
    let table = b.input(&data(15, 11), &[5, 3])?;
    let idx = b.input(&[4i32, 0, 2, 4], &[4])?;
    let v = b.bin("take", &table, &idx)?;
    b.output("take", &v);
    let a = b.input(&data(24, 12), &[4, 6])?;
    let v = b.slice(&a, &[1, 0], &[4, 6], &[2, 3])?;
    b.output("slice", &v);
    let starts = b.input(&[1i32, 2], &[2])?;
    let v = b.dynamic_slice(&a, &starts, &[2, 3])?;
    b.output("dynamic_slice", &v);
    let top = b.input(&data(6, 13), &[2, 3])?;
    let bottom = b.input(&data(3, 14), &[1, 3])?;
    let v = b.concat(&[&top, &bottom], 0)?;
    b.output("concatenate", &v);
    // A chain of ops on intermediate results (fused in DEFER_AND_FUSE).
    let (g2, b2) = (b.input(&pos(4, 15), &[4])?, b.input(&data(4, 16), &[4])?);
    let ln = b.layer_norm(&mlp, &g2, &b2)?;
    let sm = b.softmax(&ln, 1)?;
    let weighted = b.bin("mul", &sm, &mlp)?;
    let v = b.reduce("sum", &weighted, &[1])?;
    b.output("chain", &v);
    b.finish()
}

fn stats_line() {
    let s = eager::stats();
    println!(
        "stats: compiles={} cache_hits={} launches={} fused_steps={} donated={}",
        s.compiles, s.cache_hits, s.launches, s.fused_steps, s.donated
    );
}

/// One MLP step (`gelu(x · w + b)`, x fresh each time and dropped before the read) three
/// times: in DEFER_AND_FUSE one fused program, compiled once, with x donated.
fn repeat() -> Result<()> {
    let w = Array::from_slice(&data(12, 4), &[3, 4])?;
    let b = Array::from_slice(&data(4, 5), &[4])?;
    let before = eager::stats();
    for i in 0..3u32 {
        let x = Array::from_slice(&data(6, 20 + i), &[2, 3])?;
        let y = x.matmul(&w)?.add(&b)?.gelu()?;
        drop(x);
        eager::mark_step()?;
        println!("repeat{i}: {}", json(&y.to_vec::<f32>()?));
    }
    let s = eager::stats();
    println!(
        "repeat-stats: compiles={} cache_hits={} launches={} fused_steps={} donated={}",
        s.compiles - before.compiles,
        s.cache_hits - before.cache_hits,
        s.launches - before.launches,
        s.fused_steps - before.fused_steps,
        s.donated - before.donated
    );
    Ok(())
}

/// The size threshold: with [`eager::set_max_fused_ops`] at 8, a chain of 20 ops (`tanh`,
/// then `+ 0.5`, alternating) on `data(6, 30)` runs as three fused steps, two when the trace
/// fills and one at the read. Prints `threshold` (the values) and `threshold-stats: [fused
/// steps, launches]`.
fn threshold() -> Result<()> {
    let before = eager::stats();
    let old = eager::max_fused_ops();
    eager::set_max_fused_ops(8);
    let half = Array::scalar(0.5f32)?;
    let mut x = Array::from_slice(&data(6, 30), &[2, 3])?;
    for i in 0..20 {
        x = if i % 2 == 0 { x.tanh()? } else { x.add(&half)? };
    }
    let v = x.to_vec::<f32>();
    eager::set_max_fused_ops(old);
    println!("threshold: {}", json(&v?));
    let s = eager::stats();
    println!(
        "threshold-stats: [{}, {}]",
        s.fused_steps - before.fused_steps,
        s.launches - before.launches
    );
    Ok(())
}

fn report<T: std::fmt::Debug>(name: &str, r: Result<T>) {
    match r {
        Ok(v) => println!("{name}: ok {v:?}"),
        Err(e) => println!("{name}: ERROR {e}"),
    }
}

/// Debug checks: a NaN from `log`, an out-of-range gather index; and the same without checks.
fn checks() -> Result<()> {
    let neg = Array::from_slice(&[1.0f32, -1.0], &[2])?;
    let table = Array::from_slice(&data(15, 11), &[5, 3])?;
    let idx = Array::from_slice(&[1i32, 7], &[2])?;
    eager::set_debug_checks(true);
    report("checks-nan", neg.log().and_then(|a| a.to_vec::<f32>()));
    report(
        "checks-index",
        table.take(&idx).and_then(|a| a.to_vec::<f32>()),
    );
    let a = Array::from_slice(&data(24, 12), &[4, 6])?;
    let starts = Array::from_slice(&[3i32, 0], &[2])?;
    report(
        "checks-dynamic-slice",
        a.dynamic_slice(&starts, &[2, 3])
            .and_then(|a| a.to_vec::<f32>()),
    );
    // A NaN inside a chain: the op that made it is named, not the last one.
    report(
        "checks-nan-chain",
        neg.log()
            .and_then(|a| a.exp())
            .and_then(|a| a.add(&neg))
            .and_then(|a| a.to_vec::<f32>()),
    );
    eager::set_debug_checks(false);
    // Without checks XLA clamps the index (row 4) and the NaN goes through.
    report(
        "unchecked-index",
        table.take(&idx).and_then(|a| a.to_vec::<f32>()),
    );
    report(
        "unchecked-dynamic-slice",
        a.dynamic_slice(&starts, &[2, 3])
            .and_then(|a| a.to_vec::<f32>()),
    );
    report("unchecked-nan", neg.log().and_then(|a| a.to_vec::<f32>()));
    Ok(())
}

/// The maximum length of [`bounded`]'s stream.
const BOUNDED_MAX: u64 = 100;

/// Bounded shapes: a stream of 200 lengths in `1..=BOUNDED_MAX` (a fixed LCG), each input
/// `data(len, i)` as `f32[len]` (axis 0 dynamic) and `data(3 * len, i)` as `f32[3, len]` (axis
/// 1 dynamic). Prints, per item `i`, `bounded-i-len`, then `sum`, `max`, `softmax`, `chain`
/// (`exp(x) * x + 0.5`), `chain-sum`, `rows` (sum of the 2-D input over its dynamic axis),
/// `cols` (over its static axis); then `bounded-compiles: [compiles, buckets used, distinct
/// lengths, distinct programs per bucket in DEFER_NEVER]` and `bounded-error-*` lines for ops that refuse a dynamic axis.
fn bounded() -> Result<()> {
    let before = eager::stats().compiles;
    let half = Array::scalar(0.5f32)?;
    let mut state = 0x2545_f491u64;
    let mut used = std::collections::BTreeSet::new();
    let mut lens = std::collections::BTreeSet::new();
    for i in 0..200u32 {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = (state >> 33) % BOUNDED_MAX + 1;
        used.insert(eager::bucket(len, BOUNDED_MAX)?);
        lens.insert(len);
        let x = Array::from_slice_bounded(&data(len as usize, i), &[len], 0, BOUNDED_MAX)?;
        let x2 = Array::from_slice_bounded(&data(3 * len as usize, i), &[3, len], 1, BOUNDED_MAX)?;
        let sum = x.sum(&[0])?;
        let max = x.max(&[0])?;
        let softmax = x.softmax(0)?;
        let chain = x.exp()?.mul(&x)?.add(&half)?;
        let chain_sum = chain.sum(&[0])?;
        let rows = x2.sum(&[1])?;
        let cols = x2.sum(&[0])?;
        println!("bounded-{i}-len: [{len}]");
        for (name, a) in [
            ("sum", &sum),
            ("max", &max),
            ("softmax", &softmax),
            ("chain", &chain),
            ("chain-sum", &chain_sum),
            ("rows", &rows),
            ("cols", &cols),
        ] {
            println!("bounded-{i}-{name}: {}", json(&a.to_vec::<f32>()?));
        }
    }
    println!(
        "bounded-compiles: [{}, {}, {}, {}]",
        eager::stats().compiles - before,
        used.len(),
        lens.len(),
        8
    );
    let x = Array::from_slice_bounded(&data(5, 0), &[5], 0, BOUNDED_MAX)?;
    let x2 = Array::from_slice_bounded(&data(15, 0), &[3, 5], 1, BOUNDED_MAX)?;
    let w = Array::from_slice(&data(8 * 2, 1), &[8, 2])?;
    report("bounded-error-matmul", x2.matmul(&w));
    // An already padded array (garbage past the length) marked dynamic.
    let mut padded = data(5, 3);
    padded.extend([1e30f32, -1e30, 7.0]);
    let marked = Array::from_slice(&padded, &[8])?.mark_dynamic(0, 5, BOUNDED_MAX)?;
    println!(
        "bounded-mark-sum: {}",
        json(&marked.sum(&[0])?.to_vec::<f32>()?)
    );
    println!(
        "bounded-mark-softmax: {}",
        json(&marked.softmax(0)?.to_vec::<f32>()?)
    );
    report("bounded-error-mark", marked.mark_dynamic(0, 5, BOUNDED_MAX));
    report(
        "bounded-error-bucket",
        x2.sum(&[0])
            .and_then(|_| Array::from_slice(&[0f32; 6], &[6])?.mark_dynamic(0, 5, BOUNDED_MAX)),
    );
    report("bounded-error-reshape", x.reshape(&[2, 4]));
    report(
        "bounded-error-static",
        x.add(&Array::from_slice(&data(8, 2), &[8])?),
    );
    // Debug checks read the true elements only: log of the zero padding (-inf) is not an
    // error; a NaN within the length is, in each mode.
    eager::set_debug_checks(true);
    let p = Array::from_slice_bounded(&pos(5, 1), &[5], 0, BOUNDED_MAX)?;
    report(
        "bounded-checks-padding",
        p.log()
            .and_then(|l| l.sum(&[0]))
            .and_then(|s| s.to_vec::<f32>()),
    );
    report(
        "bounded-checks-nan",
        x.log()
            .and_then(|l| l.sum(&[0]))
            .and_then(|s| s.to_vec::<f32>()),
    );
    eager::set_debug_checks(false);
    report(
        "bounded-dims",
        Ok((x.dims().to_vec(), x.logical_dims(), x.dynamic_axis())),
    );
    Ok(())
}

/// `f32[4] -> f32[4]` that fails on the device (the host's test-only custom call).
const FAIL: &str = r#"func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %r = stablehlo.custom_call @tpubox_test_fail(%a) {api_version = 4 : i32} : (tensor<4xf32>) -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

/// A launch that fails on the device, then eager ops on its output: the failure surfaces at
/// the read (or at the op, when blocking), naming the op and the launch.
fn fail() -> Result<()> {
    let exe = compile_mlir(FAIL)?;
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4])?;
    let launch = exe.launch(&[&x], &[])?;
    println!("fail-launch: {} {}", launch.id, exe.fingerprint());
    let out = launch.outputs.into_iter().next().expect("one output");
    let a = Array::from_tensor(out);
    report("fail-read-input", a.to_vec::<f32>());
    let op = a.exp();
    println!("fail-op: {}", if op.is_ok() { "ok" } else { "error" });
    report(
        "fail-read",
        op.and_then(|y| y.mul(&y)).and_then(|z| z.to_vec::<f32>()),
    );
    Ok(())
}

/// Ends with launches pending (DEFER_NEVER) and a trace recorded (DEFER_AND_FUSE), never
/// reading anything.
fn pending() -> Result<()> {
    let mut keep = Vec::new();
    let mut x = Array::from_slice(&data(4096, 1), &[64, 64])?;
    for _ in 0..6 {
        x = x.matmul(&x)?.tanh()?;
        keep.push(x.clone());
    }
    {
        let _f = eager::set_eager_mode(EagerMode::DeferAndFuse);
        for _ in 0..4 {
            x = x.matmul(&x)?.tanh()?;
            keep.push(x.clone());
        }
    }
    println!("pending: {} arrays held", keep.len());
    std::mem::forget(keep);
    Ok(())
}

fn main() {
    tpubox_guest::install_panic_hook();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("env");
    let cases: Vec<&str> = if args.len() > 1 {
        args[1..].iter().map(String::as_str).collect()
    } else {
        vec!["values"]
    };
    let _guard = match mode {
        "never" => Some(eager::set_eager_mode(EagerMode::DeferNever)),
        "fuse" => Some(eager::set_eager_mode(EagerMode::DeferAndFuse)),
        "blocking" => Some(eager::set_eager_mode(
            EagerMode::DeferNeverAndLaunchBlocking,
        )),
        "env" | "graph" => None,
        m => panic!("unknown mode {m}"),
    };
    if mode == "graph" {
        println!("mode: graph");
    } else {
        println!("mode: {}", eager::eager_mode().name());
        println!("debug-checks: {}", eager::debug_checks());
    }
    if cases.first() == Some(&"bench") {
        let workload = cases.get(1).copied().unwrap_or("chain");
        let steps = cases.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
        if let Err(e) = bench::bench(mode, workload, steps) {
            println!("bench: ERROR {e}");
        }
        return;
    }
    for case in cases {
        let r = match (case, mode) {
            ("values", "graph") => values(&mut Compiled {
                g: Graph::new(),
                args: Vec::new(),
                outputs: Vec::new(),
            }),
            ("values", _) => values(&mut Eager::default()),
            ("repeat", _) => repeat(),
            ("threshold", _) => threshold(),
            ("checks", _) => checks(),
            ("fail", _) => fail(),
            ("pending", _) => pending(),
            ("bounded", _) => bounded(),
            ("scoped", _) => {
                let outer = eager::eager_mode();
                let inner = {
                    let _g = eager::set_eager_mode(EagerMode::DeferNeverAndLaunchBlocking);
                    eager::eager_mode()
                };
                println!(
                    "scoped: {} {} {}",
                    outer.name(),
                    inner.name(),
                    eager::eager_mode().name()
                );
                Ok(())
            }
            (c, _) => panic!("unknown case {c}"),
        };
        if let Err(e) = r {
            println!("{case}: ERROR {e}");
        }
    }
    stats_line();
}
