//! Unit tests of the graph builder: shapes, errors and the MLIR text of every op.

use std::fmt;

use super::*;

fn err_msg<T: fmt::Debug>(r: Result<T>) -> String {
    let e = r.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    e.message().to_string()
}

#[track_caller]
fn assert_msg<T: fmt::Debug>(r: Result<T>, parts: &[&str]) {
    let m = err_msg(r);
    for p in parts {
        assert!(m.contains(p), "message {m:?} lacks {p:?}");
    }
}

#[test]
fn mlir_types() {
    assert_eq!(
        mlir_type(&TensorSpec::new(Dtype::F32, &[2, 3])),
        "tensor<2x3xf32>"
    );
    assert_eq!(mlir_type(&TensorSpec::new(Dtype::Pred, &[])), "tensor<i1>");
    assert_eq!(
        mlir_type(&TensorSpec::new(Dtype::U8, &[4])),
        "tensor<4xui8>"
    );
    assert_eq!(
        mlir_type(&TensorSpec::new(Dtype::C64, &[1])),
        "tensor<1xcomplex<f32>>"
    );
}

#[test]
fn constants() {
    let g = Graph::new();
    let a = g.constant(&[1.0f32, 2.0], &[2]).unwrap();
    let b = g.scalar(-3i32);
    let c = g.constant(&[true, false, true, true], &[2, 2]).unwrap();
    let d = g.scalar(1.0f32);
    let e = g.constant(&[1i64, 2, 3, 4, 5, 6], &[3, 2]).unwrap();
    let f = g.constant::<f32>(&[], &[2, 0]).unwrap();
    let h = g.scalar(half::bf16::from_f32(1.0));
    assert_eq!(g.spec(a), TensorSpec::new(Dtype::F32, &[2]));
    assert_eq!(g.dims(e), &[3, 2]);
    assert_eq!(g.dtype(c), Dtype::Pred);
    let m = g.to_mlir(&[a, b, c, d, e, f, h]).unwrap();
    assert!(
        m.contains(r#"stablehlo.constant dense<"0x0000803F00000040"> : tensor<2xf32>"#),
        "{m}"
    );
    assert!(
        m.contains("stablehlo.constant dense<-3> : tensor<i32>"),
        "{m}"
    );
    assert!(
        m.contains("dense<[[true, false], [true, true]]> : tensor<2x2xi1>"),
        "{m}"
    );
    assert!(m.contains("dense<0x3F800000> : tensor<f32>"), "{m}");
    assert!(m.contains("dense<[[], []]> : tensor<2x0xf32>"), "{m}");
    assert!(m.contains("dense<0x3F80> : tensor<bf16>"), "{m}");
    assert_msg(
        g.constant(&[1.0f32; 5], &[2, 3]),
        &["constant", "f32[2,3]", "5"],
    );
}

#[test]
fn function_signature_and_return() {
    let g = Graph::new();
    let x = g.parameter(Dtype::F32, &[2, 3]);
    let y = g.parameter(Dtype::S32, &[]);
    assert_eq!(g.parameters(), vec![x, y]);
    let z = g.exp(x).unwrap();
    let m = g.to_mlir(&[z, y]).unwrap();
    assert!(
        m.starts_with(
            "func.func public @main(%v0: tensor<2x3xf32>, %v1: tensor<i32>) -> (tensor<2x3xf32>, tensor<i32>) {\n"
        ),
        "{m}"
    );
    assert!(
        m.contains("  %v2 = stablehlo.exponential %v0 : tensor<2x3xf32>\n"),
        "{m}"
    );
    assert!(
        m.ends_with("  func.return %v2, %v1 : tensor<2x3xf32>, tensor<i32>\n}\n"),
        "{m}"
    );
    assert_msg(g.to_mlir(&[]), &["to_mlir", "at least one output"]);
}

#[test]
fn foreign_values_are_rejected() {
    let g1 = Graph::new();
    let g2 = Graph::new();
    let a = g1.parameter(Dtype::F32, &[2]);
    let b = g2.parameter(Dtype::F32, &[2]);
    assert_msg(
        g1.add(a, b),
        &["add", "belongs to another graph", "not this graph"],
    );
    assert_msg(g2.exp(a), &["exp", "belongs to another graph"]);
    assert_msg(g1.to_mlir(&[b]), &["to_mlir", "belongs to another graph"]);
    let r = std::panic::catch_unwind(|| g2.dims(a).len());
    assert!(r.is_err());
}

#[test]
fn elementwise_broadcasting() {
    let g = Graph::new();
    let a = g.parameter(Dtype::F32, &[2, 1, 4]);
    let b = g.parameter(Dtype::F32, &[3, 1]);
    let c = g.add(a, b).unwrap();
    assert_eq!(g.dims(c), &[2, 3, 4]);
    let m = g.to_mlir(&[c]).unwrap();
    assert!(
        m.contains("stablehlo.broadcast_in_dim %v0, dims = [0, 1, 2] : (tensor<2x1x4xf32>) -> tensor<2x3x4xf32>"),
        "{m}"
    );
    assert!(
        m.contains(
            "stablehlo.broadcast_in_dim %v1, dims = [1, 2] : (tensor<3x1xf32>) -> tensor<2x3x4xf32>"
        ),
        "{m}"
    );
    assert!(
        m.contains("= stablehlo.add %v2, %v3 : tensor<2x3x4xf32>"),
        "{m}"
    );
    // Equal shapes insert nothing.
    let d = g.mul(c, c).unwrap();
    assert!(
        g.to_mlir(&[d])
            .unwrap()
            .contains("stablehlo.multiply %v4, %v4")
    );
    let s = g.scalar(2.0f32);
    let p = g.pow(c, s).unwrap();
    assert_eq!(g.dims(p), &[2, 3, 4]);
    for (name, r) in [
        ("sub", g.sub(a, b)),
        ("div", g.div(a, b)),
        ("maximum", g.maximum(a, b)),
        ("minimum", g.minimum(a, b)),
    ] {
        assert_eq!(g.dims(r.unwrap()), &[2, 3, 4], "{name}");
    }
}

#[test]
fn elementwise_errors() {
    let g = Graph::new();
    let a = g.parameter(Dtype::F32, &[2, 3]);
    let b = g.parameter(Dtype::F32, &[4]);
    let i = g.parameter(Dtype::S32, &[2, 3]);
    let p = g.parameter(Dtype::Pred, &[2]);
    assert_msg(
        g.add(a, b),
        &["add: shapes do not broadcast: f32[2,3] vs f32[4]"],
    );
    assert_msg(g.mul(a, i), &["mul: dtypes differ: f32[2,3] vs s32[2,3]"]);
    assert_msg(
        g.sub(p, p),
        &["sub: needs numeric operands, got pred[2] and pred[2]"],
    );
    assert!(g.maximum(p, p).is_ok());
    assert_msg(g.exp(i), &["exp: needs a float operand, got s32[2,3]"]);
    assert_msg(g.erf(i), &["erf", "s32[2,3]"]);
    assert_msg(
        g.neg(p),
        &["neg: needs a float or signed integer operand, got pred[2]"],
    );
    assert!(g.neg(i).is_ok());
    assert!(g.abs(i).is_ok());
    for r in [
        g.log(a),
        g.tanh(a),
        g.sqrt(a),
        g.rsqrt(a),
        g.erf(a),
        g.logistic(a),
        g.abs(a),
        g.neg(a),
    ] {
        assert_eq!(g.dims(r.unwrap()), &[2, 3]);
    }
    let m = g.to_mlir(&[a]).unwrap();
    assert!(
        m.contains("chlo.erf %v0 : tensor<2x3xf32> -> tensor<2x3xf32>"),
        "{m}"
    );
    assert!(
        m.contains("stablehlo.logistic %v0 : tensor<2x3xf32>"),
        "{m}"
    );
}

#[test]
fn dot_general_shapes_and_text() {
    let g = Graph::new();
    let a = g.parameter(Dtype::F32, &[2, 3, 4]);
    let b = g.parameter(Dtype::F32, &[2, 5, 4]);
    let c = g
        .dot_general(a, b, ((&[2], &[2]), (&[0], &[0])), Precision::Highest)
        .unwrap();
    assert_eq!(g.dims(c), &[2, 3, 5]);
    let m = g.to_mlir(&[c]).unwrap();
    assert!(
        m.contains("stablehlo.dot_general %v0, %v1, batching_dims = [0] x [0], contracting_dims = [2] x [2], precision = [HIGHEST, HIGHEST] : (tensor<2x3x4xf32>, tensor<2x5x4xf32>) -> tensor<2x3x5xf32>"),
        "{m}"
    );
    let x = g.parameter(Dtype::F32, &[2, 3]);
    let y = g.parameter(Dtype::F32, &[4, 5]);
    assert_msg(
        g.dot_general(x, y, ((&[1], &[0]), (&[], &[])), Precision::Default),
        &["dot_general: contracting dims differ: f32[2,3] dim 1 (3) vs f32[4,5] dim 0 (4)"],
    );
    assert_msg(
        g.dot_general(a, b, ((&[2], &[2]), (&[0], &[1])), Precision::Default),
        &["dot_general: batch dims differ: f32[2,3,4] dim 0 (2) vs f32[2,5,4] dim 1 (5)"],
    );
    assert_msg(
        g.dot_general(x, y, ((&[1], &[]), (&[], &[])), Precision::Default),
        &[
            "contracting dim lists differ in length",
            "f32[2,3] [1] vs f32[4,5] []",
        ],
    );
    assert_msg(
        g.dot_general(x, y, ((&[2], &[0]), (&[], &[])), Precision::Default),
        &["dot_general", "2 is out of range for f32[2,3]"],
    );
    assert_msg(
        g.dot_general(a, b, ((&[2], &[2]), (&[2], &[2])), Precision::Default),
        &["dot_general", "2 is repeated for f32[2,3,4]"],
    );
    let i = g.parameter(Dtype::S32, &[4, 5]);
    assert_msg(
        g.dot_general(x, i, ((&[1], &[0]), (&[], &[])), Precision::Default),
        &["dot_general: dtypes differ: f32[2,3] vs s32[4,5]"],
    );
    // No batching attribute when there are no batch dims; DEFAULT precision.
    let z = g.parameter(Dtype::F32, &[3, 7]);
    let w = g
        .dot_general(x, z, ((&[1], &[0]), (&[], &[])), Precision::High)
        .unwrap();
    assert_eq!(g.dims(w), &[2, 7]);
    let m = g.to_mlir(&[w]).unwrap();
    assert!(
        m.contains("%v3, %v6, contracting_dims = [1] x [0], precision = [HIGH, HIGH]"),
        "{m}"
    );
}

#[test]
fn matmul_forms() {
    let g = Graph::new();
    let a = g.parameter(Dtype::F32, &[2, 3, 4]);
    let w = g.parameter(Dtype::F32, &[4, 5]);
    let b = g.parameter(Dtype::F32, &[2, 4, 6]);
    let c = g.matmul(a, w, Precision::Default).unwrap();
    assert_eq!(g.dims(c), &[2, 3, 5]);
    let d = g.matmul(a, b, Precision::Default).unwrap();
    assert_eq!(g.dims(d), &[2, 3, 6]);
    let m = g.to_mlir(&[c, d]).unwrap();
    assert!(m.contains("%v0, %v1, contracting_dims = [2] x [0]"), "{m}");
    assert!(
        m.contains("%v0, %v2, batching_dims = [0, 1] x [0, 1]")
            || m.contains("%v0, %v2, batching_dims = [0] x [0], contracting_dims = [2] x [1]"),
        "{m}"
    );
    let v = g.parameter(Dtype::F32, &[4]);
    assert_msg(
        g.matmul(a, v, Precision::Default),
        &["matmul: needs operands of rank >= 2, got f32[2,3,4] and f32[4]"],
    );
    let bad = g.parameter(Dtype::F32, &[5, 6]);
    assert_msg(
        g.matmul(a, bad, Precision::Default),
        &["matmul: contracting dims differ: f32[2,3,4] dim 2 (4) vs f32[5,6] dim 0 (5)"],
    );
    let b3 = g.parameter(Dtype::F32, &[3, 4, 6]);
    assert_msg(
        g.matmul(a, b3, Precision::Default),
        &["matmul: batch dims differ: f32[2,3,4] vs f32[3,4,6]"],
    );
}

#[test]
fn shape_ops() {
    let g = Graph::new();
    let a = g.parameter(Dtype::F32, &[3, 1]);
    let b = g.broadcast_in_dim(a, &[2, 3, 4], &[1, 2]).unwrap();
    assert_eq!(g.dims(b), &[2, 3, 4]);
    assert_msg(
        g.broadcast_in_dim(a, &[2, 4, 4], &[1, 2]),
        &["broadcast_in_dim: f32[3,1] dim 0 (3) cannot broadcast to f32[2,4,4] dim 1 (4)"],
    );
    assert_msg(
        g.broadcast_in_dim(a, &[2, 3], &[1]),
        &["broadcast_in_dim", "one entry per dim of f32[3,1]"],
    );
    assert_msg(
        g.broadcast_in_dim(a, &[3, 3], &[0, 2]),
        &["broadcast_in_dim", "2 is out of range for f32[3,3]"],
    );
    assert_msg(
        g.broadcast_in_dim(a, &[3, 3], &[0, 0]),
        &["broadcast_in_dim", "0 is repeated"],
    );

    let c = g.broadcast_to(a, &[2, 3, 5]).unwrap();
    assert_eq!(g.dims(c), &[2, 3, 5]);
    assert_eq!(g.broadcast_to(a, &[3, 1]).unwrap(), a);
    assert_msg(
        g.broadcast_to(a, &[2, 5]),
        &["broadcast_to: f32[3,1] does not broadcast to f32[2,5]"],
    );
    assert_msg(
        g.broadcast_to(a, &[3]),
        &["broadcast_to: f32[3,1] does not broadcast to f32[3]"],
    );

    let r = g.reshape(c, &[6, 5]).unwrap();
    assert_eq!(g.dims(r), &[6, 5]);
    assert_msg(
        g.reshape(c, &[7, 5]),
        &["reshape: element counts differ: f32[2,3,5] vs f32[7,5]"],
    );

    let t = g.transpose(c, &[2, 0, 1]).unwrap();
    assert_eq!(g.dims(t), &[5, 2, 3]);
    let m = g.to_mlir(&[t]).unwrap();
    assert!(
        m.contains(
            "stablehlo.transpose %v2, dims = [2, 0, 1] : (tensor<2x3x5xf32>) -> tensor<5x2x3xf32>"
        ),
        "{m}"
    );
    assert_msg(
        g.transpose(c, &[0, 1]),
        &["transpose: permutation [0, 1] is not a permutation of the dims of f32[2,3,5]"],
    );
    assert_msg(
        g.transpose(c, &[0, 1, 1]),
        &["transpose", "1 is repeated for f32[2,3,5]"],
    );
    assert_msg(
        g.transpose(c, &[0, 1, 3]),
        &["transpose", "3 is out of range for f32[2,3,5]"],
    );
}

#[test]
fn reductions() {
    let g = Graph::new();
    let a = g.parameter(Dtype::F32, &[2, 3, 4]);
    let s = g.reduce_sum(a, &[2, 0]).unwrap();
    assert_eq!(g.spec(s), TensorSpec::new(Dtype::F32, &[3]));
    let m = g.reduce_max(a, &[1]).unwrap();
    assert_eq!(g.dims(m), &[2, 4]);
    let i = g.parameter(Dtype::S32, &[5]);
    let im = g.reduce_max(i, &[0]).unwrap();
    assert_eq!(g.dims(im), &[] as &[u64]);
    let text = g.to_mlir(&[s, m, im]).unwrap();
    assert!(text.contains("stablehlo.reduce(%v1 init: %v2) applies stablehlo.add across dimensions = [0, 2] : (tensor<2x3x4xf32>, tensor<f32>) -> tensor<3xf32>") || text.contains("stablehlo.reduce(%v0 init: %v1) applies stablehlo.add across dimensions = [0, 2] : (tensor<2x3x4xf32>, tensor<f32>) -> tensor<3xf32>"), "{text}");
    assert!(
        text.contains("stablehlo.constant dense<0xFF800000> : tensor<f32>"),
        "{text}"
    );
    assert!(
        text.contains("stablehlo.constant dense<-2147483648> : tensor<i32>"),
        "{text}"
    );
    assert!(
        text.contains("applies stablehlo.maximum across dimensions = [1]"),
        "{text}"
    );
    assert_msg(
        g.reduce_sum(a, &[3]),
        &["reduce_sum: axis 3 is out of range for f32[2,3,4] (rank 3)"],
    );
    assert_msg(
        g.reduce_max(a, &[1, 1]),
        &["reduce_max: axis 1 is repeated for f32[2,3,4]"],
    );
}

#[test]
fn convert_compare_select_iota() {
    let g = Graph::new();
    let a = g.parameter(Dtype::F32, &[2, 3]);
    let b = g.parameter(Dtype::F32, &[3]);
    let i = g.convert(a, Dtype::S32).unwrap();
    assert_eq!(g.spec(i), TensorSpec::new(Dtype::S32, &[2, 3]));
    assert_eq!(g.convert(a, Dtype::F32).unwrap(), a);
    let c = g.parameter(Dtype::C64, &[2]);
    assert_msg(
        g.convert(c, Dtype::F32),
        &["convert: cannot convert complex c64[2] to f32"],
    );

    let p = g.compare(a, b, Compare::Gt).unwrap();
    assert_eq!(g.spec(p), TensorSpec::new(Dtype::Pred, &[2, 3]));
    let q = g.compare(i, i, Compare::Le).unwrap();
    let text = g.to_mlir(&[p, q]).unwrap();
    assert!(text.contains("stablehlo.compare GT, %v0, %v4, FLOAT : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xi1>"), "{text}");
    assert!(
        text.contains("stablehlo.compare LE, %v2, %v2, SIGNED"),
        "{text}"
    );
    assert_msg(
        g.compare(a, i, Compare::Eq),
        &["compare: dtypes differ: f32[2,3] vs s32[2,3]"],
    );
    assert_msg(
        g.compare(c, c, Compare::Lt),
        &["compare: complex values have no order (c64[2] LT c64[2])"],
    );

    let zero = g.scalar(0.0f32);
    let s = g.select(p, a, zero).unwrap();
    assert_eq!(g.spec(s), TensorSpec::new(Dtype::F32, &[2, 3]));
    assert_msg(
        g.select(a, a, a),
        &["select: predicate must be pred, got f32[2,3]"],
    );
    assert_msg(
        g.select(p, a, i),
        &["select: branch dtypes differ: f32[2,3] vs s32[2,3]"],
    );
    let four = g.parameter(Dtype::F32, &[4]);
    assert_msg(
        g.select(p, a, four),
        &["select: shapes do not broadcast: pred[2,3], f32[2,3], f32[4]"],
    );

    let io = g.iota(Dtype::S32, &[2, 3], 1).unwrap();
    assert_eq!(g.spec(io), TensorSpec::new(Dtype::S32, &[2, 3]));
    assert!(
        g.to_mlir(&[io])
            .unwrap()
            .contains("stablehlo.iota dim = 1 : tensor<2x3xi32>")
    );
    assert_msg(
        g.iota(Dtype::S32, &[2, 3], 2),
        &["iota: axis 2 is out of range for s32[2,3] (rank 2)"],
    );
    assert_msg(
        g.iota(Dtype::Pred, &[2], 0),
        &["iota: needs a numeric dtype, got pred[2]"],
    );
}

#[test]
fn take_slice_concatenate() {
    let g = Graph::new();
    let table = g.parameter(Dtype::F32, &[30522, 384]);
    let idx = g.parameter(Dtype::S32, &[2, 8]);
    let e = g.take(table, idx).unwrap();
    assert_eq!(g.dims(e), &[2, 8, 384]);
    let text = g.to_mlir(&[e]).unwrap();
    assert!(text.contains(r#"%v2 = "stablehlo.gather"(%v0, %v1) {dimension_numbers = #stablehlo.gather<offset_dims = [2], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 2>, slice_sizes = array<i64: 1, 384>, indices_are_sorted = false} : (tensor<30522x384xf32>, tensor<2x8xi32>) -> tensor<2x8x384xf32>"#), "{text}");
    let fidx = g.parameter(Dtype::F32, &[2]);
    assert_msg(
        g.take(table, fidx),
        &["take: indices must be integers, got f32[2] (table f32[30522,384])"],
    );
    let s = g.scalar(1.0f32);
    assert_msg(
        g.take(s, idx),
        &["take: table must have rank >= 1, got f32[]"],
    );

    let a = g.parameter(Dtype::F32, &[4, 6]);
    let sl = g.slice(a, &[1, 0], &[3, 6], &[1, 4]).unwrap();
    assert_eq!(g.dims(sl), &[2, 2]);
    let text = g.to_mlir(&[sl]).unwrap();
    assert!(text.contains(r#""stablehlo.slice"(%v5) {start_indices = array<i64: 1, 0>, limit_indices = array<i64: 3, 6>, strides = array<i64: 1, 4>} : (tensor<4x6xf32>) -> tensor<2x2xf32>"#), "{text}");
    assert_msg(
        g.slice(a, &[0, 0], &[5, 6], &[1, 1]),
        &["slice: bad range 0:5:1 for f32[4,6] dim 0 (4)"],
    );
    assert_msg(
        g.slice(a, &[0, 0], &[4, 6], &[1, 0]),
        &["slice: bad range 0:6:0 for f32[4,6] dim 1 (6)"],
    );
    assert_msg(
        g.slice(a, &[0], &[4], &[1]),
        &["slice", "need one entry per dim of f32[4,6]"],
    );

    let b = g.parameter(Dtype::F32, &[4, 2]);
    let c = g.concatenate(&[a, b, a], 1).unwrap();
    assert_eq!(g.dims(c), &[4, 14]);
    let text = g.to_mlir(&[c]).unwrap();
    assert!(text.contains("stablehlo.concatenate %v5, %v7, %v5, dim = 1 : (tensor<4x6xf32>, tensor<4x2xf32>, tensor<4x6xf32>) -> tensor<4x14xf32>"), "{text}");
    assert_msg(
        g.concatenate(&[a, b], 0),
        &["concatenate: f32[4,2] does not match f32[4,6] outside axis 0"],
    );
    assert_msg(
        g.concatenate(&[a], 2),
        &["concatenate: axis 2 is out of range for f32[4,6] (rank 2)"],
    );
    assert_msg(
        g.concatenate(&[], 0),
        &["concatenate: needs at least one value"],
    );
    assert_eq!(g.concatenate(&[a], 0).unwrap(), a);
}

#[test]
fn helpers() {
    let g = Graph::new();
    let x = g.parameter(Dtype::F32, &[2, 8, 16]);
    let gamma = g.parameter(Dtype::F32, &[16]);
    let beta = g.parameter(Dtype::F32, &[16]);
    let s = g.softmax(x, 1).unwrap();
    assert_eq!(g.spec(s), g.spec(x));
    let n = g.layer_norm(x, gamma, beta, 1e-12).unwrap();
    assert_eq!(g.spec(n), g.spec(x));
    let h = g.gelu(x).unwrap();
    assert_eq!(g.spec(h), g.spec(x));
    let text = g.to_mlir(&[s, n, h]).unwrap();
    assert!(text.contains("chlo.erf"), "{text}");
    assert_msg(
        g.softmax(x, 3),
        &["softmax: axis 3 is out of range for f32[2,8,16]"],
    );
    let i = g.parameter(Dtype::S32, &[4]);
    assert_msg(
        g.softmax(i, 0),
        &["softmax: needs a float operand, got s32[4]"],
    );
    assert_msg(g.gelu(i), &["gelu: needs a float operand, got s32[4]"]);
    let bad = g.parameter(Dtype::F32, &[8]);
    assert_msg(
        g.layer_norm(x, bad, beta, 1e-5),
        &["layer_norm: gamma must be f32[16] for x f32[2,8,16], got f32[8]"],
    );
    assert_msg(
        g.layer_norm(x, gamma, i, 1e-5),
        &["layer_norm: beta must be f32[16] for x f32[2,8,16], got s32[4]"],
    );
    // bf16 graphs get bf16 constants.
    let xb = g.parameter(Dtype::Bf16, &[4]);
    let gb = g.gelu(xb).unwrap();
    assert_eq!(g.dtype(gb), Dtype::Bf16);
}

#[test]
fn failed_ops_add_nothing() {
    let g = Graph::new();
    let a = g.parameter(Dtype::F32, &[2]);
    let b = g.parameter(Dtype::F32, &[3]);
    let before = g.to_mlir(&[a]).unwrap();
    assert!(g.add(a, b).is_err());
    assert!(g.layer_norm(a, b, b, 1e-5).is_err());
    assert_eq!(g.to_mlir(&[a]).unwrap(), before);
}

#[test]
fn expressions_nest() -> Result<()> {
    let g = Graph::new();
    let x = g.parameter(Dtype::F32, &[2, 3]);
    let w = g.parameter(Dtype::F32, &[3, 4]);
    let b = g.parameter(Dtype::F32, &[4]);
    let y = g.add(g.matmul(x, w, Precision::Highest)?, b)?;
    assert_eq!(g.spec(y), TensorSpec::new(Dtype::F32, &[2, 4]));
    let m = g.to_mlir(&[y])?;
    assert!(
        m.contains("%v3 = stablehlo.dot_general %v0, %v1, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>\n"),
        "{m}"
    );
    assert!(
        m.contains("%v4 = stablehlo.broadcast_in_dim %v2, dims = [1] : (tensor<4xf32>) -> tensor<2x4xf32>\n  %v5 = stablehlo.add %v3, %v4 : tensor<2x4xf32>\n"),
        "{m}"
    );
    // The op that fails reports, however deep it is nested; the outer op is never built.
    let before = g.to_mlir(&[y])?;
    let nested = || g.add(g.matmul(x, x, Precision::Highest)?, b);
    assert_msg(
        nested(),
        &["matmul: contracting dims differ: f32[2,3] dim 1 (3) vs f32[2,3] dim 0 (2)"],
    );
    assert_eq!(g.to_mlir(&[y])?, before);
    Ok(())
}

#[test]
fn segment_attention_emits_the_host_custom_call_and_checks_its_operands() {
    let g = Graph::new();
    let q = g.parameter(Dtype::F32, &[2, 8, 3, 4]);
    let p = g.parameter(Dtype::S32, &[2, 8]);
    let r = g.segment_attention(q, q, q, p).unwrap();
    assert_eq!(g.spec(r), TensorSpec::new(Dtype::F32, &[2, 8, 3, 4]));
    let m = g.to_mlir(&[r]).unwrap();
    assert!(
        m.contains("stablehlo.custom_call @tpubox_segment_attention(%v0, %v0, %v0, %v1) {api_version = 4 : i32} : (tensor<2x8x3x4xf32>, tensor<2x8x3x4xf32>, tensor<2x8x3x4xf32>, tensor<2x8xi32>) -> tensor<2x8x3x4xf32>"),
        "{m}"
    );
    let v = g.parameter(Dtype::F32, &[2, 8, 3, 5]);
    assert_msg(
        g.segment_attention(q, q, v, p),
        &["segment_attention", "v must be"],
    );
    let p3 = g.parameter(Dtype::S32, &[2, 7]);
    assert_msg(
        g.segment_attention(q, q, q, p3),
        &["segment_attention", "positions must be"],
    );
    let q3 = g.parameter(Dtype::F32, &[2, 8, 12]);
    assert_msg(
        g.segment_attention(q3, q3, q3, p),
        &["segment_attention", "q must be f32 [R, S, H, D]"],
    );
}

#[test]
fn dynamic_slice() {
    let g = Graph::new();
    let a = g.parameter(Dtype::F32, &[4, 6]);
    let i = g.parameter(Dtype::S32, &[]);
    let j = g.parameter(Dtype::S32, &[]);
    let d = g.dynamic_slice(a, &[i, j], &[2, 3]).unwrap();
    assert_eq!(g.dims(d), &[2, 3]);
    let text = g.to_mlir(&[d]).unwrap();
    assert!(text.contains(r#"%v3 = "stablehlo.dynamic_slice"(%v0, %v1, %v2) {slice_sizes = array<i64: 2, 3>} : (tensor<4x6xf32>, tensor<i32>, tensor<i32>) -> tensor<2x3xf32>"#), "{text}");
    assert_msg(
        g.dynamic_slice(a, &[i], &[2, 3]),
        &["dynamic_slice: 1 start indices and sizes [2, 3] need one entry per dim of f32[4,6]"],
    );
    assert_msg(
        g.dynamic_slice(a, &[i, j], &[5, 3]),
        &["dynamic_slice: size 5 exceeds f32[4,6] dim 0 (4)"],
    );
    let f = g.parameter(Dtype::F32, &[]);
    assert_msg(
        g.dynamic_slice(a, &[i, f], &[2, 3]),
        &["dynamic_slice: start index 1 must be an integer scalar"],
    );
}
