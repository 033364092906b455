//! Printing a graph as MLIR text: types, literals, one line per op, the function `@main`.

use std::fmt::Write as _;

use super::shape::{is_complex, is_float, is_signed_int};
use super::{Node, Op, Unary};
use crate::{Dtype, TensorSpec};

/// The MLIR element type of `dtype`, e.g. `f32`, `i1`, `ui8`, `complex<f32>`.
pub fn mlir_element_type(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Pred => "i1",
        Dtype::S8 => "i8",
        Dtype::S16 => "i16",
        Dtype::S32 => "i32",
        Dtype::S64 => "i64",
        Dtype::U8 => "ui8",
        Dtype::U16 => "ui16",
        Dtype::U32 => "ui32",
        Dtype::U64 => "ui64",
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
        Dtype::F32 => "f32",
        Dtype::F64 => "f64",
        Dtype::C64 => "complex<f32>",
        Dtype::C128 => "complex<f64>",
    }
}

/// The MLIR tensor type of `spec`, e.g. `tensor<2x3xf32>`, `tensor<i1>` for a scalar.
pub fn mlir_type(spec: &TensorSpec) -> String {
    let mut s = String::from("tensor<");
    for d in &spec.dims {
        let _ = write!(s, "{d}x");
    }
    s.push_str(mlir_element_type(spec.dtype));
    s.push('>');
    s
}

/// `1, 2, 3`
fn comma_separated(xs: &[u64]) -> String {
    let mut s = String::new();
    for (i, x) in xs.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{x}");
    }
    s
}

/// `[1, 2, 3]`
fn list(xs: &[u64]) -> String {
    format!("[{}]", comma_separated(xs))
}

/// `array<i64: 1, 2, 3>` (`array<i64>` when empty)
fn i64_array(xs: &[u64]) -> String {
    if xs.is_empty() {
        return "array<i64>".to_string();
    }
    format!("array<i64: {}>", comma_separated(xs))
}

/// The SSA name of node `index`, e.g. `%v3`.
fn name(index: u32) -> String {
    format!("%v{index}")
}

/// Formats `count` elements (given as literal strings, row-major) as a nested MLIR dense
/// literal of `dims`.
fn nested_literal(elems: &[String], dims: &[u64]) -> String {
    fn go(out: &mut String, elems: &[String], dims: &[u64]) {
        match dims.split_first() {
            None => out.push_str(&elems[0]),
            Some((&n, rest)) => {
                let inner: usize = rest.iter().map(|&d| d as usize).product();
                out.push('[');
                for i in 0..n as usize {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    go(out, &elems[i * inner..(i + 1) * inner], rest);
                }
                out.push(']');
            }
        }
    }
    let mut s = String::new();
    go(&mut s, elems, dims);
    s
}

/// The MLIR literal of one element of `dtype` given as its little-endian bytes: `true`,
/// `-3`, or the bit pattern `0x3F800000` for floats.
fn element_literal(dtype: Dtype, bytes: &[u8]) -> String {
    let mut le = [0u8; 8];
    le[..bytes.len()].copy_from_slice(bytes);
    let bits = u64::from_le_bytes(le);
    match dtype {
        Dtype::Pred => (bits != 0).to_string(),
        Dtype::S8 => (bits as u8 as i8).to_string(),
        Dtype::S16 => (bits as u16 as i16).to_string(),
        Dtype::S32 => (bits as u32 as i32).to_string(),
        Dtype::S64 => (bits as i64).to_string(),
        Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64 => bits.to_string(),
        // Floats as their exact bit pattern (MLIR reads a hex literal of a float type so).
        _ => format!("0x{:0width$X}", bits, width = bytes.len() * 2),
    }
}

/// The `dense<...>` attribute holding `bytes` (host layout) as a `spec` tensor.
fn dense_attr(spec: &TensorSpec, bytes: &[u8]) -> String {
    let size = spec.dtype.size_bytes();
    let count = bytes.len() / size;
    if count == 1 {
        // One element: a splat literal, whatever the rank.
        return format!("dense<{}>", element_literal(spec.dtype, bytes));
    }
    if spec.dtype == Dtype::Pred || count == 0 {
        let elems: Vec<String> = bytes
            .chunks_exact(size)
            .map(|b| element_literal(spec.dtype, b))
            .collect();
        return format!("dense<{}>", nested_literal(&elems, &spec.dims));
    }
    // Raw little-endian bytes as a hex string: compact for large constants (weights).
    let mut s = String::with_capacity(bytes.len() * 2 + 12);
    s.push_str("dense<\"0x");
    for b in bytes {
        let _ = write!(s, "{b:02X}");
    }
    s.push_str("\">");
    s
}

/// The function `@main` over `nodes` (in definition order), taking the nodes `params` and
/// returning the nodes `outputs`.
pub(super) fn function(nodes: &[Node], params: &[u32], outputs: &[u32]) -> String {
    let ty = |i: u32| mlir_type(&nodes[i as usize].spec);
    let mut s = String::from("func.func public @main(");
    for (i, &p) in params.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{}: {}", name(p), ty(p));
    }
    let out_types: Vec<String> = outputs.iter().map(|&o| ty(o)).collect();
    let _ = writeln!(s, ") -> ({}) {{", out_types.join(", "));
    for (i, node) in (0u32..).zip(nodes) {
        if let Some(line) = op_line(nodes, i, node) {
            let _ = writeln!(s, "  {line}");
        }
    }
    let names: Vec<String> = outputs.iter().map(|&o| name(o)).collect();
    let _ = writeln!(
        s,
        "  func.return {} : {}",
        names.join(", "),
        out_types.join(", ")
    );
    s.push_str("}\n");
    s
}

/// The line defining node `index` (`%vN = ...`), or `None` for a parameter.
fn op_line(nodes: &[Node], index: u32, node: &Node) -> Option<String> {
    let r = name(index);
    let specs: Vec<&TensorSpec> = node
        .operands
        .iter()
        .map(|&o| &nodes[o as usize].spec)
        .collect();
    let names: Vec<String> = node.operands.iter().map(|&o| name(o)).collect();
    let args = names.join(", ");
    let to = mlir_type(&node.spec);
    // `(operand types) -> result type`
    let types: Vec<String> = specs.iter().map(|s| mlir_type(s)).collect();
    let sig = format!("({}) -> {to}", types.join(", "));
    let line = match &node.op {
        Op::Parameter => return None,
        Op::Constant(bytes) => {
            let attr = dense_attr(&node.spec, bytes);
            format!("{r} = stablehlo.constant {attr} : {to}")
        }
        Op::Unary(Unary::Erf) => format!("{r} = {} {args} : {to} -> {to}", Unary::Erf.mlir()),
        Op::Unary(op) => format!("{r} = {} {args} : {to}", op.mlir()),
        Op::Binary(op) => format!("{r} = {} {args} : {to}", op.mlir()),
        Op::BroadcastInDim(bd) => {
            format!(
                "{r} = stablehlo.broadcast_in_dim {args}, dims = {} : {sig}",
                list(bd)
            )
        }
        Op::DotGeneral {
            contracting,
            batch,
            precision,
        } => {
            let mut attrs = String::new();
            if !batch.0.is_empty() {
                let _ = write!(
                    attrs,
                    "batching_dims = {} x {}, ",
                    list(&batch.0),
                    list(&batch.1)
                );
            }
            let _ = write!(
                attrs,
                "contracting_dims = {} x {}, precision = [{p}, {p}]",
                list(&contracting.0),
                list(&contracting.1),
                p = precision.name()
            );
            format!("{r} = stablehlo.dot_general {args}, {attrs} : {sig}")
        }
        Op::Reshape => format!("{r} = stablehlo.reshape {args} : {sig}"),
        Op::Transpose(permutation) => format!(
            "{r} = stablehlo.transpose {args}, dims = {} : {sig}",
            list(permutation)
        ),
        Op::Reduce { reduction, axes } => format!(
            "{r} = stablehlo.reduce({} init: {}) applies {} across dimensions = {} : {sig}",
            names[0],
            names[1],
            reduction.body().mlir(),
            list(axes)
        ),
        Op::Convert => format!("{r} = stablehlo.convert {args} : {sig}"),
        Op::Compare(dir) => {
            let d = specs[0].dtype;
            let kind = if is_float(d) || is_complex(d) {
                "FLOAT"
            } else if is_signed_int(d) {
                "SIGNED"
            } else {
                "UNSIGNED"
            };
            format!(
                "{r} = stablehlo.compare {}, {args}, {kind} : {sig}",
                dir.name()
            )
        }
        Op::Select => format!("{r} = stablehlo.select {args} : {sig}"),
        Op::Iota(axis) => format!("{r} = stablehlo.iota dim = {axis} : {to}"),
        Op::Take => {
            // Rows of the table (dim 0) picked by every index; the other table dims are kept.
            let (table, indices) = (specs[0], specs[1]);
            let ri = indices.rank() as u64;
            let offset_dims: Vec<u64> = (ri..ri + table.rank() as u64 - 1).collect();
            let mut slice_sizes = vec![1u64];
            slice_sizes.extend_from_slice(&table.dims[1..]);
            let (od, ss) = (list(&offset_dims), i64_array(&slice_sizes));
            format!(
                "{r} = \"stablehlo.gather\"({args}) {{dimension_numbers = #stablehlo.gather<offset_dims = {od}, collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = {ri}>, slice_sizes = {ss}, indices_are_sorted = false}} : {sig}"
            )
        }
        Op::Slice {
            start,
            limit,
            strides,
        } => {
            let (b, e, st) = (i64_array(start), i64_array(limit), i64_array(strides));
            format!(
                "{r} = \"stablehlo.slice\"({args}) {{start_indices = {b}, limit_indices = {e}, strides = {st}}} : {sig}"
            )
        }
        Op::DynamicSlice(sizes) => {
            let ss = i64_array(sizes);
            format!("{r} = \"stablehlo.dynamic_slice\"({args}) {{slice_sizes = {ss}}} : {sig}")
        }
        Op::Concatenate(axis) => {
            format!("{r} = stablehlo.concatenate {args}, dim = {axis} : {sig}")
        }
        Op::CustomCall(target) => {
            format!(
                "{r} = stablehlo.custom_call @{target}({args}) {{api_version = 4 : i32}} : {sig}"
            )
        }
    };
    Some(line)
}
