//! Shape inference and operand checks: the result spec of each op from its operands' specs, or
//! the [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) error naming the op and
//! the operands. Nothing here touches a graph.

use super::{Binary, Compare, Reduction, Unary, invalid};
use crate::{Dtype, Result, TensorSpec};

pub(crate) fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F16 | Dtype::Bf16 | Dtype::F32 | Dtype::F64)
}

pub(super) fn is_signed_int(d: Dtype) -> bool {
    matches!(d, Dtype::S8 | Dtype::S16 | Dtype::S32 | Dtype::S64)
}

fn is_unsigned_int(d: Dtype) -> bool {
    matches!(d, Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64)
}

fn is_int(d: Dtype) -> bool {
    is_signed_int(d) || is_unsigned_int(d)
}

pub(super) fn is_complex(d: Dtype) -> bool {
    matches!(d, Dtype::C64 | Dtype::C128)
}

/// Numpy broadcast of two shapes, or `None` if they are incompatible.
fn broadcast_dims(a: &[u64], b: &[u64]) -> Option<Vec<u64>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0u64; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() {
            1
        } else {
            a[i - (rank - a.len())]
        };
        let db = if i < rank - b.len() {
            1
        } else {
            b[i - (rank - b.len())]
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(out)
}

/// Checks that `axes` are distinct and below the rank of `spec`.
pub(super) fn check_axes(op: &str, spec: &TensorSpec, axes: &[u64], what: &str) -> Result<()> {
    for (i, &a) in axes.iter().enumerate() {
        if a >= spec.rank() as u64 {
            return Err(invalid(
                op,
                format!(
                    "{what} {a} is out of range for {spec} (rank {})",
                    spec.rank()
                ),
            ));
        }
        if axes[..i].contains(&a) {
            return Err(invalid(op, format!("{what} {a} is repeated for {spec}")));
        }
    }
    Ok(())
}

/// The common dims of two operands of equal dtype (numpy broadcasting).
fn broadcast_pair(op: &str, a: &TensorSpec, b: &TensorSpec) -> Result<Vec<u64>> {
    if a.dtype != b.dtype {
        return Err(invalid(op, format!("dtypes differ: {a} vs {b}")));
    }
    broadcast_dims(&a.dims, &b.dims)
        .ok_or_else(|| invalid(op, format!("shapes do not broadcast: {a} vs {b}")))
}

/// Fails unless operand `s` of `op` is not `pred` (`s` and `other` are both named).
fn numeric(op: &str, s: &TensorSpec, other: &TensorSpec) -> Result<()> {
    if s.dtype == Dtype::Pred {
        return Err(invalid(
            op,
            format!("needs numeric operands, got {s} and {other}"),
        ));
    }
    Ok(())
}

/// The result dims of element-wise `op` on `a` and `b` (after broadcasting).
pub(super) fn binary(op: Binary, a: &TensorSpec, b: &TensorSpec) -> Result<Vec<u64>> {
    if !op.accepts_pred() {
        numeric(op.name(), a, b)?;
    }
    broadcast_pair(op.name(), a, b)
}

/// Fails unless operand `s` of `op` is a float.
pub(super) fn float_operand(op: &str, s: &TensorSpec) -> Result<()> {
    if !is_float(s.dtype) {
        return Err(invalid(op, format!("needs a float operand, got {s}")));
    }
    Ok(())
}

/// Checks the operand of element-wise `op` (the result has its spec).
pub(super) fn unary(op: Unary, s: &TensorSpec) -> Result<()> {
    if !op.accepts_signed_ints() {
        return float_operand(op.name(), s);
    }
    if !is_float(s.dtype) && !is_signed_int(s.dtype) {
        return Err(invalid(
            op.name(),
            format!("needs a float or signed integer operand, got {s}"),
        ));
    }
    Ok(())
}

/// The result of `dot_general` contracting dims `contracting` and pairing batch dims `batch`
/// (each a pair of lhs dims and rhs dims): the batch dims, then the other dims of `a`, then
/// those of `b`.
pub(super) fn dot_general(
    op: &str,
    a: &TensorSpec,
    b: &TensorSpec,
    contracting: (&[u64], &[u64]),
    batch: (&[u64], &[u64]),
) -> Result<TensorSpec> {
    if a.dtype != b.dtype {
        return Err(invalid(op, format!("dtypes differ: {a} vs {b}")));
    }
    numeric(op, a, b)?;
    let pairs = [("batch", batch), ("contracting", contracting)];
    for (what, (da, db)) in pairs {
        if da.len() != db.len() {
            return Err(invalid(
                op,
                format!("{what} dim lists differ in length: {a} {da:?} vs {b} {db:?}"),
            ));
        }
    }
    let used_a: Vec<u64> = batch.0.iter().chain(contracting.0).copied().collect();
    let used_b: Vec<u64> = batch.1.iter().chain(contracting.1).copied().collect();
    check_axes(op, a, &used_a, "batch/contracting dim")?;
    check_axes(op, b, &used_b, "batch/contracting dim")?;
    for (what, (da, db)) in pairs {
        for (&x, &y) in da.iter().zip(db) {
            let (nx, ny) = (a.dims[x as usize], b.dims[y as usize]);
            if nx != ny {
                return Err(invalid(
                    op,
                    format!("{what} dims differ: {a} dim {x} ({nx}) vs {b} dim {y} ({ny})"),
                ));
            }
        }
    }
    let free = |s: &TensorSpec, used: &[u64]| -> Vec<u64> {
        (0..s.rank() as u64)
            .filter(|d| !used.contains(d))
            .map(|d| s.dims[d as usize])
            .collect()
    };
    let mut dims: Vec<u64> = batch.0.iter().map(|&d| a.dims[d as usize]).collect();
    dims.extend(free(a, &used_a));
    dims.extend(free(b, &used_b));
    Ok(TensorSpec::new(a.dtype, &dims))
}

/// The batch dims (the same for both operands) of `matmul(a, b)`, which contracts the last dim
/// of `a` with the next-to-last of `b`; empty when `b` has rank 2.
pub(super) fn matmul(a: &TensorSpec, b: &TensorSpec) -> Result<Vec<u64>> {
    const OP: &str = "matmul";
    if a.rank() < 2 || b.rank() < 2 {
        return Err(invalid(
            OP,
            format!("needs operands of rank >= 2, got {a} and {b}"),
        ));
    }
    let (ra, rb) = (a.rank(), b.rank());
    let (ka, kb) = (a.dims[ra - 1], b.dims[rb - 2]);
    if ka != kb {
        return Err(invalid(
            OP,
            format!(
                "contracting dims differ: {a} dim {} ({ka}) vs {b} dim {} ({kb})",
                ra - 1,
                rb - 2
            ),
        ));
    }
    if rb == 2 {
        return Ok(Vec::new());
    }
    if ra != rb || a.dims[..ra - 2] != b.dims[..rb - 2] {
        return Err(invalid(
            OP,
            format!("batch dims differ: {a} vs {b} (b must be rank 2 or have a's leading dims)"),
        ));
    }
    Ok((0..ra as u64 - 2).collect())
}

/// The result of `broadcast_in_dim` of `s` to `dims`.
pub(super) fn broadcast_in_dim(
    s: &TensorSpec,
    dims: &[u64],
    broadcast_dimensions: &[u64],
) -> Result<TensorSpec> {
    const OP: &str = "broadcast_in_dim";
    let out = TensorSpec::new(s.dtype, dims);
    if broadcast_dimensions.len() != s.rank() {
        return Err(invalid(
            OP,
            format!("broadcast_dimensions {broadcast_dimensions:?} needs one entry per dim of {s}"),
        ));
    }
    check_axes(OP, &out, broadcast_dimensions, "broadcast dimension")?;
    for (i, &d) in broadcast_dimensions.iter().enumerate() {
        let (n, m) = (s.dims[i], dims[d as usize]);
        if n != 1 && n != m {
            return Err(invalid(
                OP,
                format!("{s} dim {i} ({n}) cannot broadcast to {out} dim {d} ({m})"),
            ));
        }
    }
    Ok(out)
}

/// Checks that `s` numpy-broadcasts to `dims`.
pub(super) fn broadcast_to(s: &TensorSpec, dims: &[u64]) -> Result<()> {
    if s.rank() > dims.len() || broadcast_dims(&s.dims, dims).as_deref() != Some(dims) {
        let out = TensorSpec::new(s.dtype, dims);
        return Err(invalid(
            "broadcast_to",
            format!("{s} does not broadcast to {out}"),
        ));
    }
    Ok(())
}

/// The result of reshaping `s` to `dims`.
pub(super) fn reshape(s: &TensorSpec, dims: &[u64]) -> Result<TensorSpec> {
    let out = TensorSpec::new(s.dtype, dims);
    match (s.element_count(), out.element_count()) {
        (Ok(n), Ok(m)) if n == m => Ok(out),
        _ => Err(invalid(
            "reshape",
            format!("element counts differ: {s} vs {out}"),
        )),
    }
}

/// The result of permuting the dims of `s`.
pub(super) fn transpose(s: &TensorSpec, permutation: &[u64]) -> Result<TensorSpec> {
    const OP: &str = "transpose";
    if permutation.len() != s.rank() {
        return Err(invalid(
            OP,
            format!("permutation {permutation:?} is not a permutation of the dims of {s}"),
        ));
    }
    check_axes(OP, s, permutation, "permutation entry")?;
    let dims: Vec<u64> = permutation.iter().map(|&p| s.dims[p as usize]).collect();
    Ok(TensorSpec::new(s.dtype, &dims))
}

/// The result of reducing `s` over `axes`, and the axes sorted.
pub(super) fn reduce(
    op: Reduction,
    s: &TensorSpec,
    axes: &[u64],
) -> Result<(TensorSpec, Vec<u64>)> {
    if is_complex(s.dtype) {
        return Err(invalid(
            op.name(),
            format!("complex operands are not supported, got {s}"),
        ));
    }
    check_axes(op.name(), s, axes, "axis")?;
    let mut sorted = axes.to_vec();
    sorted.sort_unstable();
    let dims: Vec<u64> = (0..s.rank() as u64)
        .filter(|d| !sorted.contains(d))
        .map(|d| s.dims[d as usize])
        .collect();
    Ok((TensorSpec::new(s.dtype, &dims), sorted))
}

/// The result of converting `s` to dtype `to`.
pub(super) fn convert(s: &TensorSpec, to: Dtype) -> Result<TensorSpec> {
    if is_complex(s.dtype) && !is_complex(to) {
        return Err(invalid(
            "convert",
            format!("cannot convert complex {s} to {to}"),
        ));
    }
    Ok(TensorSpec::new(to, &s.dims))
}

/// The common dims of the operands of `compare` (the result is `pred` of these dims).
pub(super) fn compare(dir: Compare, a: &TensorSpec, b: &TensorSpec) -> Result<Vec<u64>> {
    const OP: &str = "compare";
    if is_complex(a.dtype) && !matches!(dir, Compare::Eq | Compare::Ne) {
        return Err(invalid(
            OP,
            format!("complex values have no order ({a} {} {b})", dir.name()),
        ));
    }
    broadcast_pair(OP, a, b)
}

/// The common dims of the three operands of `select`.
pub(super) fn select(p: &TensorSpec, t: &TensorSpec, f: &TensorSpec) -> Result<Vec<u64>> {
    const OP: &str = "select";
    if p.dtype != Dtype::Pred {
        return Err(invalid(OP, format!("predicate must be pred, got {p}")));
    }
    if t.dtype != f.dtype {
        return Err(invalid(OP, format!("branch dtypes differ: {t} vs {f}")));
    }
    broadcast_dims(&p.dims, &t.dims)
        .and_then(|d| broadcast_dims(&d, &f.dims))
        .ok_or_else(|| invalid(OP, format!("shapes do not broadcast: {p}, {t}, {f}")))
}

/// The result of `iota` (checked: `axis` below the rank, a numeric dtype).
pub(super) fn iota(dtype: Dtype, dims: &[u64], axis: u64) -> Result<TensorSpec> {
    const OP: &str = "iota";
    let out = TensorSpec::new(dtype, dims);
    check_axes(OP, &out, &[axis], "axis")?;
    if dtype == Dtype::Pred {
        return Err(invalid(OP, format!("needs a numeric dtype, got {out}")));
    }
    Ok(out)
}

/// The result of `take`: the dims of `indices`, then those of a row of `table`.
pub(super) fn take(table: &TensorSpec, indices: &TensorSpec) -> Result<TensorSpec> {
    const OP: &str = "take";
    if table.rank() == 0 {
        return Err(invalid(
            OP,
            format!("table must have rank >= 1, got {table}"),
        ));
    }
    if !is_int(indices.dtype) {
        return Err(invalid(
            OP,
            format!("indices must be integers, got {indices} (table {table})"),
        ));
    }
    let mut dims = indices.dims.clone();
    dims.extend_from_slice(&table.dims[1..]);
    Ok(TensorSpec::new(table.dtype, &dims))
}

/// The result of slicing `s` from `start` to `limit` every `strides`.
pub(super) fn slice(
    s: &TensorSpec,
    start: &[u64],
    limit: &[u64],
    strides: &[u64],
) -> Result<TensorSpec> {
    const OP: &str = "slice";
    if start.len() != s.rank() || limit.len() != s.rank() || strides.len() != s.rank() {
        return Err(invalid(
            OP,
            format!(
                "start {start:?}, limit {limit:?} and strides {strides:?} need one entry per dim of {s}"
            ),
        ));
    }
    let mut dims = Vec::with_capacity(s.rank());
    for i in 0..s.rank() {
        let (b, e, st, n) = (start[i], limit[i], strides[i], s.dims[i]);
        if st == 0 || b > e || e > n {
            return Err(invalid(
                OP,
                format!("bad range {b}:{e}:{st} for {s} dim {i} ({n})"),
            ));
        }
        dims.push((e - b).div_ceil(st));
    }
    Ok(TensorSpec::new(s.dtype, &dims))
}

/// The result of `dynamic_slice` of `s` at scalar integer `starts` (one per dim, one dtype)
/// with `sizes`.
pub(super) fn dynamic_slice(
    s: &TensorSpec,
    starts: &[TensorSpec],
    sizes: &[u64],
) -> Result<TensorSpec> {
    const OP: &str = "dynamic_slice";
    if starts.len() != s.rank() || sizes.len() != s.rank() {
        return Err(invalid(
            OP,
            format!(
                "{} start indices and sizes {sizes:?} need one entry per dim of {s}",
                starts.len()
            ),
        ));
    }
    for (i, st) in starts.iter().enumerate() {
        if st.rank() != 0 || !is_int(st.dtype) || st.dtype != starts[0].dtype {
            return Err(invalid(
                OP,
                format!(
                    "start index {i} must be an integer scalar of the first one's dtype, got {st} (operand {s})"
                ),
            ));
        }
    }
    for (i, (&n, &d)) in sizes.iter().zip(&s.dims).enumerate() {
        if n > d {
            return Err(invalid(OP, format!("size {n} exceeds {s} dim {i} ({d})")));
        }
    }
    Ok(TensorSpec::new(s.dtype, sizes))
}

/// The result of concatenating values of `specs` along `axis`.
pub(super) fn concatenate(specs: &[TensorSpec], axis: u64) -> Result<TensorSpec> {
    const OP: &str = "concatenate";
    let Some(first) = specs.first() else {
        return Err(invalid(OP, "needs at least one value"));
    };
    check_axes(OP, first, &[axis], "axis")?;
    let ax = axis as usize;
    let mut dims = first.dims.clone();
    for s in &specs[1..] {
        let same_other = s.rank() == first.rank()
            && (0..s.rank()).all(|i| i == ax || s.dims[i] == first.dims[i]);
        if s.dtype != first.dtype || !same_other {
            return Err(invalid(
                OP,
                format!("{s} does not match {first} outside axis {axis}"),
            ));
        }
        dims[ax] += s.dims[ax];
    }
    Ok(TensorSpec::new(first.dtype, &dims))
}

/// The size of the last dim of `x`, the axis `layer_norm` normalises (`x` must have one).
pub(super) fn last_dim(op: &str, x: &TensorSpec) -> Result<u64> {
    x.dims
        .last()
        .copied()
        .ok_or_else(|| invalid(op, format!("needs an operand of rank >= 1, got {x}")))
}

/// Checks that `param` (named `what`) is a vector over the last dim of `x`, of its dtype.
pub(super) fn last_dim_vector(
    op: &str,
    what: &str,
    x: &TensorSpec,
    param: &TensorSpec,
) -> Result<()> {
    let want = TensorSpec::new(x.dtype, &[last_dim(op, x)?]);
    if *param != want {
        return Err(invalid(
            op,
            format!("{what} must be {want} for x {x}, got {param}"),
        ));
    }
    Ok(())
}

/// Checks the operands of `segment_attention`: `q`, `k` and `v` one f32 spec `[R, S, H, D]`,
/// `positions` s32 `[R, S]`; the result has `q`'s spec.
pub(super) fn segment_attention(
    q: &TensorSpec,
    k: &TensorSpec,
    v: &TensorSpec,
    positions: &TensorSpec,
) -> Result<TensorSpec> {
    const OP: &str = "segment_attention";
    if q.dtype != Dtype::F32 || q.rank() != 4 {
        return Err(invalid(OP, format!("q must be f32 [R, S, H, D], got {q}")));
    }
    for (what, s) in [("k", k), ("v", v)] {
        if s != q {
            return Err(invalid(OP, format!("{what} must be {q} like q, got {s}")));
        }
    }
    let want = TensorSpec::new(Dtype::S32, &q.dims[..2]);
    if *positions != want {
        return Err(invalid(
            OP,
            format!("positions must be {want} for q {q}, got {positions}"),
        ));
    }
    Ok(q.clone())
}
