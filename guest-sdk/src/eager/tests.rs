//! Host-side tests of the eager layer's pure parts: canonical program text, mode selection
//! and its scoped override, the debug checks' scanners. (Running ops needs the host: see
//! `tests/all/eager.rs`.)

use super::checks::{first_non_finite, first_out_of_range, integers};
use super::mode::mode_from_env;
use super::program::{OneOp, one_op};
use super::*;
use crate::graph::{Graph, Value};
use crate::{Dtype, ErrorKind, TensorSpec, encode};

fn text(specs: &[TensorSpec], build: &dyn Fn(&Graph, &[Value]) -> Result<Value>) -> String {
    let specs: Vec<&TensorSpec> = specs.iter().collect();
    match one_op(&specs, build).expect("op builds") {
        OneOp::Program { graph, out, .. } => graph.to_mlir(&[out]).expect("prints"),
        OneOp::Operand(i) => panic!("op returned operand {i}"),
    }
}

fn f32s(dims: &[u64]) -> TensorSpec {
    TensorSpec::new(Dtype::F32, dims)
}

#[test]
fn the_same_op_on_the_same_specs_prints_byte_identical_text() {
    let add = |g: &Graph, v: &[Value]| g.add(v[0], v[1]);
    // Graphs made at different times (different graph ids, other graphs in between).
    let a = text(&[f32s(&[2, 3]), f32s(&[3])], &add);
    let _other = Graph::new();
    let b = text(&[f32s(&[2, 3]), f32s(&[3])], &add);
    assert_eq!(a, b);
    assert_eq!(
        a,
        "func.func public @main(%v0: tensor<2x3xf32>, %v1: tensor<3xf32>) -> (tensor<2x3xf32>) {\n  \
         %v2 = stablehlo.broadcast_in_dim %v1, dims = [1] : (tensor<3xf32>) -> tensor<2x3xf32>\n  \
         %v3 = stablehlo.add %v0, %v2 : tensor<2x3xf32>\n  \
         func.return %v3 : tensor<2x3xf32>\n}\n"
    );
    // Helpers (several ops) are canonical too.
    let ln = |g: &Graph, v: &[Value]| g.layer_norm(v[0], v[1], v[2], 1e-5);
    let specs = [f32s(&[4, 8]), f32s(&[8]), f32s(&[8])];
    assert_eq!(text(&specs, &ln), text(&specs, &ln));
}

#[test]
fn attributes_and_specs_change_the_text() {
    let sum0 = text(&[f32s(&[2, 3])], &|g, v| g.reduce_sum(v[0], &[0]));
    let sum1 = text(&[f32s(&[2, 3])], &|g, v| g.reduce_sum(v[0], &[1]));
    assert_ne!(sum0, sum1);
    let sum_other = text(&[f32s(&[2, 4])], &|g, v| g.reduce_sum(v[0], &[0]));
    assert_ne!(sum0, sum_other);
    let ln4 = text(&[f32s(&[2, 3]), f32s(&[3]), f32s(&[3])], &|g, v| {
        g.layer_norm(v[0], v[1], v[2], 1e-4)
    });
    let ln5 = text(&[f32s(&[2, 3]), f32s(&[3]), f32s(&[3])], &|g, v| {
        g.layer_norm(v[0], v[1], v[2], 1e-5)
    });
    assert_ne!(ln4, ln5);
}

#[test]
fn ops_that_return_an_operand_run_nothing_and_shape_errors_name_the_op() {
    let s = [f32s(&[2, 3])];
    let specs: Vec<&TensorSpec> = s.iter().collect();
    assert!(matches!(
        one_op(&specs, &|g, v| g.reshape(v[0], &[2, 3])).unwrap(),
        OneOp::Operand(0)
    ));
    let s = [f32s(&[2, 3]), f32s(&[4, 5])];
    let specs: Vec<&TensorSpec> = s.iter().collect();
    let e = match one_op(&specs, &|g, v| g.matmul(v[0], v[1], Default::default())) {
        Err(e) => e,
        Ok(_) => panic!("a matmul of f32[2,3] and f32[4,5] built"),
    };
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().starts_with("matmul: "), "{e}");
}

#[test]
fn launch_blocking_wins_over_defer_and_fuse() {
    assert_eq!(mode_from_env(None, None), EagerMode::DeferNever);
    assert_eq!(mode_from_env(Some("0"), Some("")), EagerMode::DeferNever);
    assert_eq!(mode_from_env(Some("1"), None), EagerMode::DeferAndFuse);
    assert_eq!(
        mode_from_env(Some("true"), Some("0")),
        EagerMode::DeferAndFuse
    );
    assert_eq!(
        mode_from_env(Some("1"), Some("1")),
        EagerMode::DeferNeverAndLaunchBlocking
    );
    assert_eq!(
        mode_from_env(None, Some("ON")),
        EagerMode::DeferNeverAndLaunchBlocking
    );
    assert_eq!(EagerMode::DeferAndFuse.name(), "DEFER_AND_FUSE");
}

#[test]
fn the_scoped_override_nests_and_restores() {
    // The test process's environment sets none of the switches.
    let base = eager_mode();
    {
        let _fuse = set_eager_mode(EagerMode::DeferAndFuse);
        assert_eq!(eager_mode(), EagerMode::DeferAndFuse);
        {
            let _blocking = set_eager_mode(EagerMode::DeferNeverAndLaunchBlocking);
            assert_eq!(eager_mode(), EagerMode::DeferNeverAndLaunchBlocking);
        }
        assert_eq!(eager_mode(), EagerMode::DeferAndFuse);
    }
    assert_eq!(eager_mode(), base);
}

#[test]
fn the_scanners_find_non_finite_floats_and_bad_indices() {
    let f = encode(&[1.0f32, 2.0, f32::NAN, f32::INFINITY]);
    let (i, x) = first_non_finite(Dtype::F32, &f).unwrap().unwrap();
    assert_eq!(i, 2);
    assert!(x.is_nan());
    let f = encode(&[1.0f64, f64::NEG_INFINITY]);
    assert_eq!(
        first_non_finite(Dtype::F64, &f).unwrap(),
        Some((1, f64::NEG_INFINITY))
    );
    let h = encode(&[half::bf16::from_f32(1.0), half::bf16::INFINITY]);
    assert_eq!(
        first_non_finite(Dtype::Bf16, &h).unwrap(),
        Some((1, f64::INFINITY))
    );
    assert_eq!(
        first_non_finite(Dtype::F32, &encode(&[0.0f32, -1.0])).unwrap(),
        None
    );
    assert_eq!(
        first_non_finite(Dtype::S32, &encode(&[1i32])).unwrap(),
        None
    );

    let v = integers(Dtype::S32, &encode(&[0i32, 4, -1, 9]))
        .unwrap()
        .unwrap();
    assert_eq!(first_out_of_range(&v, 5), Some((2, -1)));
    assert_eq!(first_out_of_range(&v[..2], 5), None);
    let v = integers(Dtype::U64, &encode(&[u64::MAX])).unwrap().unwrap();
    assert_eq!(first_out_of_range(&v, 5), Some((0, i128::from(u64::MAX))));
    assert_eq!(integers(Dtype::F32, &encode(&[1.0f32])).unwrap(), None);
}

#[test]
fn buckets_are_powers_of_two_capped_at_the_maximum() {
    assert_eq!(buckets(100), [1, 2, 4, 8, 16, 32, 64, 100]);
    assert_eq!(buckets(64), [1, 2, 4, 8, 16, 32, 64]);
    assert_eq!(buckets(1), [1]);
    assert!(buckets(0).is_empty());
    assert_eq!(bucket(1, 100).unwrap(), 1);
    assert_eq!(bucket(3, 100).unwrap(), 4);
    assert_eq!(bucket(64, 100).unwrap(), 64);
    assert_eq!(bucket(65, 100).unwrap(), 100);
    assert_eq!(bucket(100, 100).unwrap(), 100);
    for max in 1..300 {
        let bs = buckets(max);
        for len in 1..=max {
            let b = bucket(len, max).unwrap();
            assert!(
                b >= len && b <= max && bs.contains(&b),
                "len {len} max {max}"
            );
        }
    }
    for (len, max) in [(0, 10), (11, 10), (1, 1 << 40)] {
        assert_eq!(
            bucket(len, max).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}

#[test]
fn padding_along_an_axis_and_back() {
    use super::bounded::{pad_axis, unpad_axis};
    // [2, 3] padded along axis 1 to 4, and along axis 0 to 4.
    let x = [1, 2, 3, 4, 5, 6];
    let p = pad_axis(&x, &[2, 3], 1, 4, 0);
    assert_eq!(p, [1, 2, 3, 0, 4, 5, 6, 0]);
    assert_eq!(unpad_axis(&p, &[2, 4], 1, 3), x);
    let p = pad_axis(&x, &[2, 3], 0, 4, 0);
    assert_eq!(p, [1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 0]);
    assert_eq!(unpad_axis(&p, &[4, 3], 0, 2), x);
}

#[test]
fn element_wise_ops_carry_the_dynamic_axis_through_broadcasting() {
    use super::bounded::propagate;
    // Dynamic axis 0 of a [8] and a static [3, 1]: the result [3, 8] has it at 1.
    assert_eq!(
        propagate("add", &[&[8], &[3, 1]], &[Some((0, 5)), None]).unwrap(),
        Some((1, 5))
    );
    assert_eq!(
        propagate("add", &[&[8], &[]], &[Some((0, 5)), None]).unwrap(),
        Some((0, 5))
    );
    assert_eq!(
        propagate("add", &[&[8], &[8]], &[None, None]).unwrap(),
        None
    );
    // A static operand spanning the padded axis, or two different lengths: errors.
    let e = propagate("mul", &[&[8], &[8]], &[Some((0, 5)), None]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("mul"), "{}", e.message());
    let e = propagate("add", &[&[8], &[8]], &[Some((0, 5)), Some((0, 6))]).unwrap_err();
    assert!(e.message().contains("add"), "{}", e.message());
}

#[test]
fn a_masked_reduction_prints_the_same_text_for_every_length_of_a_bucket() {
    use super::bounded::masked;
    // The length is a parameter (s32[]), so the program is the bucket's.
    let specs = [f32s(&[2, 8]), TensorSpec::new(Dtype::S32, &[])];
    let sum = |g: &Graph, v: &[Value]| g.reduce_sum(masked(g, v[0], v[1], 1, 0.0)?, &[1]);
    let t = text(&specs, &sum);
    assert!(t.contains("stablehlo.iota"), "{t}");
    assert!(t.contains("stablehlo.select"), "{t}");
    assert_eq!(t, text(&specs, &sum));
}

#[test]
fn equal_structures_hash_equal_and_compare_equal_without_printing() {
    let build = |axis: u64, eps: f32| {
        let g = Graph::new();
        let x = g.parameter(Dtype::F32, &[4, 8]);
        let gamma = g.parameter(Dtype::F32, &[8]);
        let beta = g.parameter(Dtype::F32, &[8]);
        let y = g.layer_norm(x, gamma, beta, eps).unwrap();
        let out = g.reduce_sum(y, &[axis]).unwrap();
        (g, out)
    };
    let (a, a_out) = build(0, 1e-5);
    let (b, b_out) = build(0, 1e-5);
    let s = a.structure(&[a_out]).unwrap();
    assert_eq!(
        a.structure_hash(&[a_out]).unwrap(),
        b.structure_hash(&[b_out]).unwrap()
    );
    assert!(b.has_structure(&[b_out], &s));
    assert_eq!(a.to_mlir(&[a_out]).unwrap(), b.to_mlir(&[b_out]).unwrap());
    // An attribute (the axis, the epsilon constant), the outputs or a value of another graph
    // make it another structure.
    for (c, c_out) in [build(1, 1e-5), build(0, 1e-4)] {
        assert_ne!(
            a.structure_hash(&[a_out]).unwrap(),
            c.structure_hash(&[c_out]).unwrap()
        );
        assert!(!c.has_structure(&[c_out], &s));
    }
    assert!(!b.has_structure(&[b_out, b_out], &s));
    assert!(!b.has_structure(&[a_out], &s));
    assert_eq!(
        b.structure_hash(&[a_out]).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}
