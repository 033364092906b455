//! The eager benchmark's workloads (`cargo bench -p tpubox --bench all -- eager`), timed inside
//! the guest: `tpubox-eager MODE bench WORKLOAD STEPS`, MODE `blocking`, `never`, `fuse` or
//! `graph` (one compiled [`Graph`], compiled at the first step).
//!
//! A step uploads a fresh input, runs the workload on it and reads the result back
//! ([`Array::to_vec`]; in DEFER_AND_FUSE the read runs the step's trace). Parameters (weights,
//! constants) are made once before the first step. Workloads:
//! - `chain`: 150 element-wise ops (multiply, add, tanh, multiply, maximum, repeated) on
//!   `f32[2048,2048]`;
//! - `mlp1`, `mlp32`, `mlp256`: `gelu(x · w1 + b1) · w2 + b2`, `x: f32[B,512]`, 512 → 2048 →
//!   512;
//! - `encoder32`, `encoder128`: one MiniLM encoder layer (layer 0 of the host's weight set
//!   `minilm`: 12-head self-attention, output projection, residual and layer norm, GELU
//!   feed-forward, residual and layer norm) on the hidden states of one sentence of 32 or 128
//!   tokens, `f32[T,384]`; the `Linear` weights are transposed once before the first step
//!   (arrays of their own; the compiled graph is given copies of the same parameters);
//! - `stream`: `STEPS` inputs `f32[len]` of lengths from a fixed LCG in `1..=128`, each as a
//!   bounded array (max 128: 8 buckets), `sum(softmax(x) * x)` over the dynamic axis; the
//!   compiled graph compiles one program per bucket and masks the padding itself.
//!
//! Prints one line `bench: key=value ...`: `first_ms` (the first step, compiles included),
//! `step_ms` (median of the other steps), `launches_per_step` and `compiles_per_step` (over
//! the steps after the first), `compiles_first`, `compiles_total`, `checksum` (sum of the last result, to
//! compare the modes).

use std::collections::HashMap;
use std::time::Instant;

use tpubox_guest::eager::{self, Array, EagerMode};
use tpubox_guest::graph::{Compare, Graph};
use tpubox_guest::weights::WeightSet;
use tpubox_guest::{Dtype, Executable, Result, Tensor};

use crate::test_data::data;
use crate::{Backend, Compiled, Eager};

/// Ops of the element-wise chain.
const CHAIN_OPS: usize = 150;
/// Side of the chain's square input.
const CHAIN_SIDE: u64 = 2048;
/// MLP widths: in, hidden, out.
const MLP: (u64, u64, u64) = (512, 2048, 512);
/// Encoder: hidden width, heads, head size.
const ENC: (u64, u64, u64) = (384, 12, 32);
/// The stream's maximum length (the buckets are 1, 2, 4, ..., 64, 128).
const STREAM_MAX: u64 = 128;

/// A workload: its parameters made once, then one step on a fresh input.
trait Workload {
    /// The input's dims.
    fn input_dims(&self) -> Vec<u64>;
    /// The parameters (weights, constants).
    fn params<B: Backend>(&self, b: &mut B) -> Result<Vec<B::V>>;
    /// Whether [`Workload::params`] computes (the compiled graph then takes copies of the
    /// eager results instead of computing them at every step).
    fn prepared(&self) -> bool {
        false
    }
    /// One step's result from the input `x`.
    fn step<B: Backend>(&self, b: &mut B, x: &B::V, p: &[B::V]) -> Result<B::V>;
}

struct Chain;

impl Workload for Chain {
    fn input_dims(&self) -> Vec<u64> {
        vec![CHAIN_SIDE, CHAIN_SIDE]
    }
    fn params<B: Backend>(&self, b: &mut B) -> Result<Vec<B::V>> {
        [1.0001f32, 0.01, 0.999, -0.5]
            .iter()
            .map(|c| b.input(&[*c], &[]))
            .collect()
    }
    fn step<B: Backend>(&self, b: &mut B, x: &B::V, p: &[B::V]) -> Result<B::V> {
        let mut v = x.clone();
        for i in 0..CHAIN_OPS {
            v = match i % 5 {
                0 => b.bin("mul", &v, &p[0])?,
                1 => b.bin("add", &v, &p[1])?,
                2 => b.un("tanh", &v)?,
                3 => b.bin("mul", &v, &p[2])?,
                _ => b.bin("maximum", &v, &p[3])?,
            };
        }
        Ok(v)
    }
}

struct Mlp(u64);

impl Workload for Mlp {
    fn input_dims(&self) -> Vec<u64> {
        vec![self.0, MLP.0]
    }
    fn params<B: Backend>(&self, b: &mut B) -> Result<Vec<B::V>> {
        let (i, h, o) = MLP;
        let scale = |v: Vec<f32>, s: f32| v.into_iter().map(|x| x * s).collect::<Vec<f32>>();
        Ok(vec![
            b.input(&scale(data((i * h) as usize, 1), 0.05), &[i, h])?,
            b.input(&data(h as usize, 2), &[h])?,
            b.input(&scale(data((h * o) as usize, 3), 0.02), &[h, o])?,
            b.input(&data(o as usize, 4), &[o])?,
        ])
    }
    fn step<B: Backend>(&self, b: &mut B, x: &B::V, p: &[B::V]) -> Result<B::V> {
        let h = b.bin("matmul", x, &p[0])?;
        let h = b.bin("add", &h, &p[1])?;
        let h = b.un("gelu", &h)?;
        let y = b.bin("matmul", &h, &p[2])?;
        b.bin("add", &y, &p[3])
    }
}

/// One encoder layer on this many tokens.
struct Encoder(u64);

/// The weights of MiniLM's layer 0 the encoder step reads, in this order (PyTorch `Linear`
/// weights are `[out, in]`; [`Encoder::params`] transposes them once).
const ENCODER_WEIGHTS: [&str; 16] = [
    "attention.self.query.weight",
    "attention.self.query.bias",
    "attention.self.key.weight",
    "attention.self.key.bias",
    "attention.self.value.weight",
    "attention.self.value.bias",
    "attention.output.dense.weight",
    "attention.output.dense.bias",
    "attention.output.LayerNorm.weight",
    "attention.output.LayerNorm.bias",
    "intermediate.dense.weight",
    "intermediate.dense.bias",
    "output.dense.weight",
    "output.dense.bias",
    "output.LayerNorm.weight",
    "output.LayerNorm.bias",
];

impl Workload for Encoder {
    fn prepared(&self) -> bool {
        true
    }
    fn input_dims(&self) -> Vec<u64> {
        vec![self.0, ENC.0]
    }
    fn params<B: Backend>(&self, b: &mut B) -> Result<Vec<B::V>> {
        let set = WeightSet::open("minilm")?;
        let mut p = Vec::new();
        for name in ENCODER_WEIGHTS {
            let w = b.tensor(set.get(&format!("encoder.layer.0.{name}"))?)?;
            // Linear weights, [out, in] → [in, out], once.
            let w = if name.ends_with("dense.weight")
                || (name.starts_with("attention.self") && name.ends_with("weight"))
            {
                b.transpose(&w, &[1, 0])?
            } else {
                w
            };
            p.push(w);
        }
        p.push(b.input(&[1.0 / (ENC.2 as f32).sqrt()], &[])?);
        Ok(p)
    }
    fn step<B: Backend>(&self, b: &mut B, x: &B::V, p: &[B::V]) -> Result<B::V> {
        let (s, (d, heads, hd)) = (self.0, ENC);
        let linear = |b: &mut B, v: &B::V, k: usize| -> Result<B::V> {
            let y = b.bin("matmul", v, &p[k])?;
            b.bin("add", &y, &p[k + 1])
        };
        let q = linear(b, x, 0)?;
        let k = linear(b, x, 2)?;
        let v = linear(b, x, 4)?;
        // [S, D] → [H, S, Dh] (keys: [H, Dh, S]).
        let q = b.reshape(&q, &[s, heads, hd])?;
        let q = b.transpose(&q, &[1, 0, 2])?;
        let k = b.reshape(&k, &[s, heads, hd])?;
        let k = b.transpose(&k, &[1, 2, 0])?;
        let v = b.reshape(&v, &[s, heads, hd])?;
        let v = b.transpose(&v, &[1, 0, 2])?;
        let scores = b.bin("matmul", &q, &k)?;
        let scores = b.bin("mul", &scores, &p[16])?;
        let probs = b.softmax(&scores, 2)?;
        let ctx = b.bin("matmul", &probs, &v)?;
        let ctx = b.transpose(&ctx, &[1, 0, 2])?;
        let ctx = b.reshape(&ctx, &[s, d])?;
        let attn = linear(b, &ctx, 6)?;
        let a = b.bin("add", &attn, x)?;
        let a = b.layer_norm(&a, &p[8], &p[9])?;
        let f = linear(b, &a, 10)?;
        let f = b.un("gelu", &f)?;
        let f = linear(b, &f, 12)?;
        let o = b.bin("add", &f, &a)?;
        b.layer_norm(&o, &p[14], &p[15])
    }
}

/// What one run measured.
#[derive(Default)]
struct Timings {
    first_ms: f64,
    steps_ms: Vec<f64>,
    compiles_first: u64,
    compiles_after: u64,
    launches_after: u64,
    checksum: f64,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// `steps` steps of `w` on eager arrays in the mode in force.
fn run_eager(w: &impl Workload, steps: usize) -> Result<Timings> {
    let mut b = Eager::default();
    let p = w.params(&mut b)?;
    eager::mark_step()?;
    for a in &p {
        a.wait()?;
    }
    let dims = w.input_dims();
    let input = data(dims.iter().product::<u64>() as usize, 7);
    let s0 = eager::stats();
    let mut t = Timings::default();
    let mut s1 = s0;
    for i in 0..steps {
        let start = Instant::now();
        let x = Array::from_slice(&input, &dims)?;
        let y = w.step(&mut b, &x, &p)?;
        drop(x);
        let v = y.to_vec::<f32>()?;
        let took = ms(start);
        if i == 0 {
            t.first_ms = took;
            s1 = eager::stats();
        } else {
            t.steps_ms.push(took);
        }
        t.checksum = v.iter().map(|&x| f64::from(x)).sum();
    }
    let s2 = eager::stats();
    t.compiles_first = s1.compiles - s0.compiles;
    t.compiles_after = s2.compiles - s1.compiles;
    t.launches_after = s2.launches - s1.launches;
    Ok(t)
}

/// `steps` steps of `w` as one compiled graph (compiled in the first step) on the parameters
/// the eager modes use; the input is its last parameter.
fn run_graph(w: &impl Workload, steps: usize) -> Result<Timings> {
    let mut b = Compiled {
        g: Graph::new(),
        args: Vec::new(),
        outputs: Vec::new(),
    };
    let p = if w.prepared() {
        // The parameters the eager modes use (transposed weights included), made by eager
        // ops and copied into tensors of their own one at a time, so that the program does
        // not redo the one-time work at every step.
        let prepared = {
            let _blocking = eager::set_eager_mode(EagerMode::DeferNeverAndLaunchBlocking);
            w.params(&mut Eager::default())?
        };
        let mut p = Vec::with_capacity(prepared.len());
        for a in prepared {
            let copy = Tensor::from_slice(&a.to_vec::<f32>()?, a.dims())?;
            drop(a);
            p.push(b.tensor(copy)?);
        }
        p
    } else {
        w.params(&mut b)?
    };
    let dims = w.input_dims();
    let input = data(dims.iter().product::<u64>() as usize, 7);
    let mut t = Timings {
        compiles_first: 1,
        launches_after: (steps as u64).saturating_sub(1),
        ..Timings::default()
    };
    let mut exe: Option<Executable> = None;
    for i in 0..steps {
        let start = Instant::now();
        let x = Tensor::from_slice(&input, &dims)?;
        if exe.is_none() {
            let xv = b.g.parameter(Dtype::F32, &dims);
            let y = w.step(&mut b, &xv, &p)?;
            exe = Some(b.g.compile(&[y])?);
        }
        let exe = exe.as_ref().expect("compiled above");
        let mut args: Vec<&Tensor> = b.args.iter().collect();
        args.push(&x);
        let out = exe.call(&args)?;
        let v = out[0].to_vec::<f32>()?;
        let took = ms(start);
        if i == 0 {
            t.first_ms = took;
        } else {
            t.steps_ms.push(took);
        }
        t.checksum = v.iter().map(|&x| f64::from(x)).sum();
    }
    Ok(t)
}

/// The stream's lengths: a fixed LCG in `1..=STREAM_MAX`.
fn stream_lengths(n: usize) -> Vec<u64> {
    let mut state = 0x9e37_79b9u64;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % STREAM_MAX + 1
        })
        .collect()
}

/// The stream on bounded eager arrays; one "step" per input.
fn stream_eager(n: usize) -> Result<Timings> {
    let s0 = eager::stats();
    let mut t = Timings::default();
    let mut s1 = s0;
    for (i, len) in stream_lengths(n).into_iter().enumerate() {
        let start = Instant::now();
        let x = Array::from_slice_bounded(&data(len as usize, i as u32), &[len], 0, STREAM_MAX)?;
        let y = x.softmax(0)?.mul(&x)?.sum(&[0])?;
        let v = y.to_scalar::<f32>()?;
        let took = ms(start);
        if i == 0 {
            t.first_ms = took;
            s1 = eager::stats();
        } else {
            t.steps_ms.push(took);
        }
        t.checksum += f64::from(v);
    }
    let s2 = eager::stats();
    t.compiles_first = s1.compiles - s0.compiles;
    t.compiles_after = s2.compiles - s1.compiles;
    t.launches_after = s2.launches - s1.launches;
    Ok(t)
}

/// The stream as compiled graphs, one per bucket: the input padded with zeros to its bucket
/// and its length as an `s32[]` parameter, the softmax masked with `-inf` past the length.
fn stream_graph(n: usize) -> Result<Timings> {
    let mut programs: HashMap<u64, Executable> = HashMap::new();
    let mut t = Timings {
        launches_after: (n as u64).saturating_sub(1),
        ..Timings::default()
    };
    for (i, len) in stream_lengths(n).into_iter().enumerate() {
        let start = Instant::now();
        let bucket = eager::bucket(len, STREAM_MAX)?;
        let mut padded = data(len as usize, i as u32);
        padded.resize(bucket as usize, 0.0);
        let compiles_before = programs.len();
        let exe = match programs.entry(bucket) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(masked_program(bucket)?),
        };
        let x = Tensor::from_slice(&padded, &[bucket])?;
        let l = Tensor::from_slice(&[len as i32], &[])?;
        let v = exe.call(&[&x, &l])?[0].to_vec::<f32>()?[0];
        let took = ms(start);
        let compiled = (programs.len() - compiles_before) as u64;
        if i == 0 {
            t.first_ms = took;
            t.compiles_first = compiled;
        } else {
            t.steps_ms.push(took);
            t.compiles_after += compiled;
        }
        t.checksum += f64::from(v);
    }
    Ok(t)
}

/// `sum(softmax(x) * x)` over the first `len` elements of `x: f32[bucket]`.
fn masked_program(bucket: u64) -> Result<Executable> {
    let g = Graph::new();
    let x = g.parameter(Dtype::F32, &[bucket]);
    let len = g.parameter(Dtype::S32, &[]);
    let iota = g.iota(Dtype::S32, &[bucket], 0)?;
    let inside = g.compare(iota, g.broadcast_to(len, &[bucket])?, Compare::Lt)?;
    let ninf = g.broadcast_to(g.scalar(f32::NEG_INFINITY), &[bucket])?;
    let masked = g.select(inside, x, ninf)?;
    let y = g.reduce_sum(g.mul(g.softmax(masked, 0)?, x)?, &[0])?;
    g.compile(&[y])
}

fn run_workload(w: &impl Workload, graph: bool, steps: usize) -> Result<Timings> {
    if graph {
        run_graph(w, steps)
    } else {
        run_eager(w, steps)
    }
}

/// Runs `workload` for `steps` steps in `mode` and prints the `bench:` line.
pub fn bench(mode: &str, workload: &str, steps: usize) -> Result<()> {
    let graph = mode == "graph";
    let t = match workload {
        "chain" => run_workload(&Chain, graph, steps)?,
        "encoder32" => run_workload(&Encoder(32), graph, steps)?,
        "encoder128" => run_workload(&Encoder(128), graph, steps)?,
        "stream" if graph => stream_graph(steps)?,
        "stream" => stream_eager(steps)?,
        w => {
            let batch: u64 = w
                .strip_prefix("mlp")
                .and_then(|b| b.parse().ok())
                .unwrap_or_else(|| panic!("unknown workload {w}"));
            run_workload(&Mlp(batch), graph, steps)?
        }
    };
    let mut sorted = t.steps_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
    let after = (steps as f64 - 1.0).max(1.0);
    println!(
        "bench: workload={workload} mode={mode} steps={steps} first_ms={:.3} step_ms={median:.3} total_ms={:.1} launches_per_step={:.2} compiles_first={} compiles_per_step={:.3} compiles_total={} checksum={:.6e}",
        t.first_ms,
        t.first_ms + t.steps_ms.iter().sum::<f64>(),
        t.launches_after as f64 / after,
        t.compiles_first,
        t.compiles_after as f64 / after,
        t.compiles_first + t.compiles_after,
        t.checksum
    );
    Ok(())
}
