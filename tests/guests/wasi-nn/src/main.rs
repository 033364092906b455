//! A wasi-nn test guest, written against the wasi-nn WIT alone (`wit/wasi-nn/`, generated with
//! `wit-bindgen`; no tpubox SDK). `argv[1]` picks what it does; each line it prints is
//! asserted by `tests/wasi-nn/test_guest.py`.
//!
//! - `run MODEL NAME:TYPE:DIMS:FILE ...`: loads the ONNX file MODEL (encoding `onnx`, or
//!   `autodetect` when MODEL ends in `.auto`), feeds each input from a raw little-endian file
//!   (DIMS like `1x8`), computes, and prints `output NAME TYPE DIMS` and the output's bytes as
//!   hex on the next line.
//! - `by-name NAME INPUTS...`: the same with `load-by-name`.
//! - `hostile CASE`: one misuse, printing `CASE: CODE` (the wasi-nn error code) for each call
//!   that failed as it must, or `CASE: ok` where a call succeeded.

use std::process::exit;

wit_bindgen::generate!({
    path: "../../../wit/wasi-nn",
    world: "ml",
});

use wasi::nn::errors::{Error, ErrorCode};
use wasi::nn::graph::{ExecutionTarget, Graph, GraphEncoding, load, load_by_name};
use wasi::nn::tensor::{Tensor, TensorType};

/// `x + x` over `f32[2,2]`, as StableHLO text (what `autodetect` loads without a converter).
const DOUBLE: &str = "func.func @main(%a: tensor<2x2xf32>) -> tensor<2x2xf32> {\n  %0 = stablehlo.add %a, %a : tensor<2x2xf32>\n  return %0 : tensor<2x2xf32>\n}\n";

/// The error's code as the WIT names it.
fn code(e: &Error) -> String {
    match e.code() {
        ErrorCode::InvalidArgument => "invalid-argument",
        ErrorCode::InvalidEncoding => "invalid-encoding",
        ErrorCode::Timeout => "timeout",
        ErrorCode::RuntimeError => "runtime-error",
        ErrorCode::UnsupportedOperation => "unsupported-operation",
        ErrorCode::TooLarge => "too-large",
        ErrorCode::NotFound => "not-found",
        ErrorCode::Security => "security",
        ErrorCode::Unknown => "unknown",
    }
    .to_string()
}

fn ty_of(s: &str) -> TensorType {
    match s {
        "f16" => TensorType::Fp16,
        "f32" => TensorType::Fp32,
        "f64" => TensorType::Fp64,
        "bf16" => TensorType::Bf16,
        "u8" => TensorType::U8,
        "i32" => TensorType::I32,
        "i64" => TensorType::I64,
        _ => {
            eprintln!("unknown type {s}");
            exit(2)
        }
    }
}

fn compute_and_print(graph: &Graph, inputs: &[String]) {
    let ctx = match graph.init_execution_context() {
        Ok(c) => c,
        Err(e) => {
            println!("init-execution-context: {} {}", code(&e), e.data());
            exit(1)
        }
    };
    let mut named = Vec::new();
    for spec in inputs {
        let parts: Vec<&str> = spec.splitn(4, ':').collect();
        let [name, ty, dims, file] = parts[..] else {
            eprintln!("input {spec}: expected NAME:TYPE:DIMS:FILE");
            exit(2)
        };
        let dims: Vec<u32> = dims.split('x').map(|d| d.parse().unwrap()).collect();
        let data = std::fs::read(file).unwrap();
        named.push((name.to_string(), Tensor::new(&dims, ty_of(ty), &data)));
    }
    match ctx.compute(named) {
        Ok(outs) => {
            for (name, t) in outs {
                let data = t.data();
                let hex: String = data.iter().map(|b| format!("{b:02x}")).collect();
                println!("output {name} {:?} {:?}", t.ty(), t.dimensions());
                println!("{hex}");
            }
        }
        Err(e) => {
            println!("compute: {} {}", code(&e), e.data());
            exit(1)
        }
    }
}

fn double_graph() -> Graph {
    load(
        &[DOUBLE.as_bytes().to_vec()],
        GraphEncoding::Autodetect,
        ExecutionTarget::Tpu,
    )
    .unwrap_or_else(|e| {
        println!("load: {} {}", code(&e), e.data());
        exit(1)
    })
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn hostile(case: &str) {
    let report = |what: &str, r: Result<(), Error>| match r {
        Ok(()) => println!("{what}: ok"),
        Err(e) => println!("{what}: {}", code(&e)),
    };
    match case {
        "lying-bytes" => {
            // Bytes that claim to be ONNX: nothing, noise, a protobuf header and then noise.
            let mut noise = vec![0u8; 4096];
            let mut x: u32 = 12345;
            for b in &mut noise {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                *b = (x >> 16) as u8;
            }
            let mut header = vec![0x08, 0x07, 0x12, 0xff, 0xff, 0xff, 0xff, 0x0f];
            header.extend_from_slice(&noise);
            for (what, bytes, enc) in [
                ("empty-onnx", vec![], GraphEncoding::Onnx),
                ("noise-onnx", noise.clone(), GraphEncoding::Onnx),
                ("noise-autodetect", noise.clone(), GraphEncoding::Autodetect),
                ("header-onnx", header.clone(), GraphEncoding::Onnx),
                (
                    "bad-stablehlo",
                    b"func.func @main( {".to_vec(),
                    GraphEncoding::Autodetect,
                ),
            ] {
                report(what, load(&[bytes], enc, ExecutionTarget::Cpu).map(|_| ()));
            }
            for (what, enc) in [
                ("openvino", GraphEncoding::Openvino),
                ("tensorflow", GraphEncoding::Tensorflow),
                ("pytorch", GraphEncoding::Pytorch),
                ("tensorflowlite", GraphEncoding::Tensorflowlite),
                ("ggml", GraphEncoding::Ggml),
            ] {
                let r = load(&[noise.clone()], enc, ExecutionTarget::Cpu);
                match r {
                    Ok(_) => println!("{what}: ok"),
                    Err(e) => println!("{what}: {} {}", code(&e), e.data()),
                }
            }
            report(
                "two-parts",
                load(
                    &[DOUBLE.as_bytes().to_vec(), vec![1]],
                    GraphEncoding::Autodetect,
                    ExecutionTarget::Cpu,
                )
                .map(|_| ()),
            );
            report("by-name", load_by_name("no-such-graph").map(|_| ()));
        }
        "dims" => {
            let g = double_graph();
            let ctx = g.init_execution_context().unwrap();
            // [2,2] f32 is 16 bytes; these disagree.
            for (what, dims, ty, data) in [
                ("short-data", vec![2, 2], TensorType::Fp32, vec![0u8; 3]),
                ("long-data", vec![2, 2], TensorType::Fp32, vec![0u8; 17]),
                (
                    "huge-dims",
                    vec![u32::MAX, u32::MAX, u32::MAX],
                    TensorType::Fp32,
                    vec![0u8; 16],
                ),
                ("wrong-shape", vec![4, 1], TensorType::Fp32, vec![0u8; 16]),
                ("wrong-type", vec![2, 2], TensorType::I32, vec![0u8; 16]),
            ] {
                let t = Tensor::new(&dims, ty, &data);
                // The tensor keeps the guest's bytes for data(), even when refused.
                let back = t.data().len() == data.len();
                let r = ctx.compute(vec![("0".to_string(), t)]).map(|_| ());
                match r {
                    Ok(()) => println!("{what}: ok"),
                    Err(e) => println!("{what}: {} data-kept={back}", code(&e)),
                }
            }
            let ok = Tensor::new(&[2, 2], TensorType::Fp32, &f32s(&[1.0, 2.0, 3.0, 4.0]));
            report(
                "wrong-name",
                ctx.compute(vec![("x".to_string(), ok)]).map(|_| ()),
            );
            report("missing", ctx.compute(vec![]).map(|_| ()));
            let a = Tensor::new(&[2, 2], TensorType::Fp32, &f32s(&[1.0, 2.0, 3.0, 4.0]));
            let b = Tensor::new(&[2, 2], TensorType::Fp32, &f32s(&[1.0, 2.0, 3.0, 4.0]));
            report(
                "twice",
                ctx.compute(vec![("0".to_string(), a), ("0".to_string(), b)])
                    .map(|_| ()),
            );
            // And the context still works.
            let good = Tensor::new(&[2, 2], TensorType::Fp32, &f32s(&[1.0, 2.0, 3.0, 4.0]));
            match ctx.compute(vec![("0".to_string(), good)]) {
                Ok(outs) => {
                    let d = outs[0].1.data();
                    let v: Vec<f32> = d
                        .chunks(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    println!("after: {v:?}");
                }
                Err(e) => println!("after: {}", code(&e)),
            }
        }
        "dropped-graph" => {
            let g = double_graph();
            let ctx = g.init_execution_context().unwrap();
            drop(g);
            let t = Tensor::new(&[2, 2], TensorType::Fp32, &f32s(&[1.0, 2.0, 3.0, 4.0]));
            report(
                "compute-after-drop",
                ctx.compute(vec![("0".to_string(), t)]).map(|_| ()),
            );
        }
        "contexts" => {
            let g = double_graph();
            let mut held = Vec::new();
            let (mut ok, mut refused) = (0, std::collections::BTreeMap::<String, u32>::new());
            for _ in 0..10_000 {
                match g.init_execution_context() {
                    Ok(c) => {
                        ok += 1;
                        held.push(c);
                    }
                    Err(e) => *refused.entry(code(&e)).or_default() += 1,
                }
            }
            println!("contexts: ok {ok}, refused {refused:?}");
            held.clear();
            // Dropped, they make room again.
            report("after-drop", g.init_execution_context().map(|_| ()));
        }
        "graphs" => {
            let mut held = Vec::new();
            let (mut ok, mut refused) = (0, std::collections::BTreeMap::<String, u32>::new());
            for _ in 0..100 {
                match load(
                    &[DOUBLE.as_bytes().to_vec()],
                    GraphEncoding::Autodetect,
                    ExecutionTarget::Cpu,
                ) {
                    Ok(g) => {
                        ok += 1;
                        held.push(g);
                    }
                    Err(e) => *refused.entry(code(&e)).or_default() += 1,
                }
            }
            println!("graphs: ok {ok}, refused {refused:?}");
        }
        "chain" => {
            // An output fed back as an input: it never leaves the device in between.
            let g = double_graph();
            let ctx = g.init_execution_context().unwrap();
            let mut t = Tensor::new(&[2, 2], TensorType::Fp32, &f32s(&[1.0, 2.0, 3.0, 4.0]));
            for _ in 0..3 {
                let mut outs = ctx.compute(vec![("0".to_string(), t)]).unwrap();
                t = outs.remove(0).1;
            }
            let v: Vec<f32> = t
                .data()
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            println!("chain: {v:?}");
        }
        _ => {
            eprintln!("unknown case {case}");
            exit(2)
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("run") if args.len() >= 3 => {
            let model = std::fs::read(&args[2]).unwrap_or_else(|e| {
                eprintln!("reading {}: {e}", args[2]);
                exit(2)
            });
            let enc = if args[2].ends_with(".auto") {
                GraphEncoding::Autodetect
            } else {
                GraphEncoding::Onnx
            };
            let graph = load(&[model], enc, ExecutionTarget::Cpu).unwrap_or_else(|e| {
                println!("load: {} {}", code(&e), e.data());
                exit(1)
            });
            compute_and_print(&graph, &args[3..]);
        }
        Some("by-name") if args.len() >= 3 => {
            let graph = load_by_name(&args[2]).unwrap_or_else(|e| {
                println!("load-by-name: {} {}", code(&e), e.data());
                exit(1)
            });
            compute_and_print(&graph, &args[3..]);
        }
        Some("hostile") if args.len() == 3 => hostile(&args[2]),
        _ => {
            eprintln!("usage: run MODEL INPUTS... | by-name NAME INPUTS... | hostile CASE");
            exit(2)
        }
    }
}
