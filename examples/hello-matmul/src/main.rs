//! hello-matmul: the smallest useful tpubox guest.
//!
//! Computes `tanh(x · w + b)` for x: `f32[2,3]`, w: `f32[3,4]`, b: `f32[4]` on the host's device with
//! a StableHLO program, recomputes it in plain Rust inside the guest, and checks that both
//! agree (max abs diff <= 1e-5). It exits with status 1 and a message on stderr if they do not,
//! or on bad arguments (WASI preview 2 carries only success or failure out of `main`, so the
//! `ExitCode` 2 it returns for bad arguments arrives as 1).
//!
//! Usage: `hello-matmul [--scale S]`; `--scale S` multiplies every element of `x` by `S` (in
//! f32) before upload, so that tests can vary the inputs.
//!
//! Build: `cargo build --release --target wasm32-wasip2 -p hello-matmul`, then run
//! `tpubox run target/wasm32-wasip2/release/hello-matmul.wasm`.
//!
//! Output ends with one machine-checkable line, `result: [[r00,r01,r02,r03],[r10,...]]`, a JSON
//! array of the device's result rows. The inputs are printed as JSON too (`x: ...`, `w: ...`,
//! `b: ...`, after scaling), so a checker can recompute the result independently.

use std::fmt::Write as _;
use std::process::ExitCode;

use tpubox_guest::{Tensor, TensorSpec, compile_mlir};

/// `tanh(x · w + b)` in StableHLO. `precision = [HIGHEST, HIGHEST]` asks backends that would
/// otherwise use reduced-precision matmul passes for f32 (TPU bf16 passes, GPU TF32) for full
/// f32, so the result agrees with the f32 reference to 1e-5.
const PROGRAM: &str = r#"
module @hello_matmul {
  func.func public @main(%x: tensor<2x3xf32>, %w: tensor<3x4xf32>, %b: tensor<4xf32>) -> tensor<2x4xf32> {
    %xw = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
    %bb = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<4xf32>) -> tensor<2x4xf32>
    %sum = stablehlo.add %xw, %bb : tensor<2x4xf32>
    %out = stablehlo.tanh %sum : tensor<2x4xf32>
    func.return %out : tensor<2x4xf32>
  }
}
"#;

const M: usize = 2;
const K: usize = 3;
const N: usize = 4;

/// x: `f32[2,3]`, row-major (before `--scale`).
const X: [f32; M * K] = [0.5, -1.25, 2.0, 1.5, 0.25, -0.75];
/// w: `f32[3,4]`, row-major.
const W: [f32; K * N] = [
    0.2, -0.4, 0.1, 0.3, //
    -0.3, 0.15, 0.25, -0.2, //
    0.05, 0.1, -0.35, 0.4,
];
/// b: `f32[4]`.
const B: [f32; N] = [0.1, -0.2, 0.05, -0.15];

/// Largest accepted absolute difference between device and guest results.
const TOLERANCE: f64 = 1e-5;

fn main() -> ExitCode {
    let scale = match parse_args(std::env::args().skip(1)) {
        Ok(scale) => scale,
        Err(msg) => {
            eprintln!("hello-matmul: {msg}");
            eprintln!("usage: hello-matmul [--scale S]");
            return ExitCode::from(2);
        }
    };
    match run(scale) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("hello-matmul: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// Parses `[--scale S]` (also `--scale=S`); S must be a finite number.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<f32, String> {
    let mut scale = 1.0f32;
    while let Some(arg) = args.next() {
        let value = if arg == "--scale" {
            args.next()
                .ok_or_else(|| "--scale needs a value".to_string())?
        } else if let Some(v) = arg.strip_prefix("--scale=") {
            v.to_string()
        } else {
            return Err(format!("unknown argument {arg:?}"));
        };
        scale = value
            .parse::<f32>()
            .ok()
            .filter(|s| s.is_finite())
            .ok_or_else(|| format!("--scale wants a finite number, got {value:?}"))?;
    }
    Ok(scale)
}

fn run(scale: f32) -> Result<(), String> {
    let platform = tpubox_guest::platform();
    println!("platform: {platform}");
    let devices = tpubox_guest::devices();
    println!("devices: {}", devices.len());
    for d in &devices {
        println!("  device {d}: {}", d.description);
    }

    let x: Vec<f32> = X.iter().map(|v| v * scale).collect();

    let exe = compile_mlir(PROGRAM).map_err(|e| format!("compile: {e}"))?;
    println!("inputs: {}", specs(exe.inputs()));
    println!("outputs: {}", specs(exe.outputs()));
    println!("fingerprint: {}", exe.fingerprint());

    let xt = Tensor::from_slice(&x, &[M as u64, K as u64]).map_err(|e| format!("x: {e}"))?;
    let wt = Tensor::from_slice(&W, &[K as u64, N as u64]).map_err(|e| format!("w: {e}"))?;
    let bt = Tensor::from_slice(&B, &[N as u64]).map_err(|e| format!("b: {e}"))?;

    let outs = exe
        .call(&[&xt, &wt, &bt])
        .map_err(|e| format!("execute: {e}"))?;
    let [out] = outs.as_slice() else {
        return Err(format!("expected 1 result, got {}", outs.len()));
    };
    let want_spec = TensorSpec::new(tpubox_guest::Dtype::F32, &[M as u64, N as u64]);
    if *out.spec() != want_spec {
        return Err(format!("result is {}, expected {want_spec}", out.spec()));
    }
    let got = out
        .to_vec::<f32>()
        .map_err(|e| format!("read result: {e}"))?;

    let want = reference(&x, &W, &B);
    let max_diff = got
        .iter()
        .zip(&want)
        .map(|(&g, &w)| (f64::from(g) - w).abs())
        .fold(0.0f64, |m, d| if d.is_nan() || d > m { d } else { m });

    println!("scale: {scale:?}");
    println!("x: {}", json_matrix(&x, K));
    println!("w: {}", json_matrix(&W, N));
    println!("b: {}", json_row(&B));
    println!("guest reference: {}", json_matrix(&want, N));
    println!("max abs diff: {max_diff:e}");
    // A NaN difference (NaN in the device result) fails the check too.
    if max_diff.is_nan() || max_diff > TOLERANCE {
        return Err(format!(
            "device result {} differs from guest reference {} by {max_diff:e} (> {TOLERANCE:e})",
            json_matrix(&got, N),
            json_matrix(&want, N)
        ));
    }
    println!("result: {}", json_matrix(&got, N));
    Ok(())
}

/// `tanh(x · w + b)` in plain Rust, accumulated in f64 from the f32 inputs.
fn reference(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f64> {
    let mut out = Vec::with_capacity(M * N);
    for i in 0..M {
        for j in 0..N {
            let dot: f64 = (0..K)
                .map(|k| f64::from(x[i * K + k]) * f64::from(w[k * N + j]))
                .sum();
            out.push((dot + f64::from(b[j])).tanh());
        }
    }
    out
}

fn specs(specs: &[TensorSpec]) -> String {
    let parts: Vec<String> = specs.iter().map(ToString::to_string).collect();
    format!("[{}]", parts.join(", "))
}

/// A JSON array of numbers. `{:?}` prints the shortest text that round-trips (e.g. `0.1`,
/// `-1.25`, `1e-7`), which is valid JSON for finite values.
fn json_row<T: std::fmt::Debug>(row: &[T]) -> String {
    let mut s = String::from("[");
    for (i, v) in row.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{v:?}");
    }
    s.push(']');
    s
}

/// A JSON array of rows of `cols` numbers each.
fn json_matrix<T: std::fmt::Debug>(data: &[T], cols: usize) -> String {
    let rows: Vec<String> = data.chunks(cols).map(json_row).collect();
    format!("[{}]", rows.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> impl Iterator<Item = String> {
        a.iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn parses_scale() {
        assert_eq!(parse_args(args(&[])), Ok(1.0));
        assert_eq!(parse_args(args(&["--scale", "2.5"])), Ok(2.5));
        assert_eq!(parse_args(args(&["--scale=-0.5"])), Ok(-0.5));
        assert!(parse_args(args(&["--scale"])).is_err());
        assert!(parse_args(args(&["--scale", "nan"])).is_err());
        assert!(parse_args(args(&["--bogus"])).is_err());
    }

    #[test]
    fn reference_matches_hand_computation() {
        let r = reference(&X, &W, &B);
        // Row 0, column 0: 0.5*0.2 + (-1.25)*(-0.3) + 2.0*0.05 + 0.1 = 0.675 (in f32 inputs).
        assert!((r[0] - 0.675f64.tanh()).abs() < 1e-6, "{}", r[0]);
        assert_eq!(r.len(), M * N);
    }

    #[test]
    fn json_output_shape() {
        assert_eq!(
            json_matrix(&[1.0f32, -0.5, 0.25, 2.0], 2),
            "[[1.0,-0.5],[0.25,2.0]]"
        );
        assert_eq!(json_row(&[1e-7f32]), "[1e-7]");
    }
}
