//! Debug checks ([`set_debug_checks`](super::set_debug_checks)): what XLA lets through
//! silently, read back and reported naming the op.

use super::array::{Array, Node, Ready, named};
use super::bounded::unpad_axis;
use crate::graph::is_float;
use crate::{Dtype, Element, Error, ErrorKind, Result, TensorSpec, decode};

/// The first element of `bytes` (host layout of `dtype`) that is not finite: (position, value
/// as f64). `None` for non-float dtypes.
pub(super) fn first_non_finite(dtype: Dtype, bytes: &[u8]) -> Result<Option<(usize, f64)>> {
    fn scan<T: Element>(bytes: &[u8], to_f64: impl Fn(T) -> f64) -> Result<Option<(usize, f64)>> {
        Ok(decode::<T>(bytes)?
            .into_iter()
            .map(to_f64)
            .enumerate()
            .find(|(_, x)| !x.is_finite()))
    }
    match dtype {
        Dtype::F32 => scan::<f32>(bytes, f64::from),
        Dtype::F64 => scan::<f64>(bytes, |x| x),
        Dtype::F16 => scan::<half::f16>(bytes, f64::from),
        Dtype::Bf16 => scan::<half::bf16>(bytes, f64::from),
        _ => Ok(None),
    }
}

/// Fails if the float array `node` (whose tensor is `ready`) holds a NaN or an infinity.
/// `context` is added after the op's name (`" in a fused step"`).
pub(super) fn finite(node: &Node, ready: &Ready, context: &str) -> Result<()> {
    if !is_float(node.spec.dtype) {
        return Ok(());
    }
    let mut bytes = ready.tensor.to_bytes().map_err(|e| named(&node.op, e))?;
    if let Some(d) = &*node.dynamic.borrow() {
        // Only the true elements: the padding may hold anything (log(0), ...).
        let size = node.spec.dtype.size_bytes();
        let elems: Vec<&[u8]> = bytes.chunks(size).collect();
        bytes = unpad_axis(&elems, &node.spec.dims, d.axis as usize, d.len).concat();
    }
    if let Some((i, x)) = first_non_finite(node.spec.dtype, &bytes)? {
        let launch = ready
            .launch
            .map(|id| format!(", launch {id}"))
            .unwrap_or_default();
        return Err(Error::new(
            ErrorKind::ExecutionFailed,
            format!(
                "debug check: eager {}{context} produced {x} at element {i} of {}{launch}",
                node.op, node.spec
            ),
        ));
    }
    Ok(())
}

/// The integer values of `bytes` (host layout of integer `dtype`), widened; `None` for other
/// dtypes.
pub(super) fn integers(dtype: Dtype, bytes: &[u8]) -> Result<Option<Vec<i128>>> {
    fn widen<T: Element + Into<i128>>(bytes: &[u8]) -> Result<Option<Vec<i128>>> {
        Ok(Some(
            decode::<T>(bytes)?.into_iter().map(Into::into).collect(),
        ))
    }
    match dtype {
        Dtype::S8 => widen::<i8>(bytes),
        Dtype::S16 => widen::<i16>(bytes),
        Dtype::S32 => widen::<i32>(bytes),
        Dtype::S64 => widen::<i64>(bytes),
        Dtype::U8 => widen::<u8>(bytes),
        Dtype::U16 => widen::<u16>(bytes),
        Dtype::U32 => widen::<u32>(bytes),
        Dtype::U64 => widen::<u64>(bytes),
        _ => Ok(None),
    }
}

/// The first of `values` outside `0..bound`: (position, value).
pub(super) fn first_out_of_range(values: &[i128], bound: u64) -> Option<(usize, i128)> {
    values
        .iter()
        .copied()
        .enumerate()
        .find(|&(_, v)| v < 0 || v >= i128::from(bound))
}

/// Reads `indices` (waiting for them) and fails with [`ErrorKind::InvalidArgument`] naming
/// `op` if one is outside `0..bound` (`bound` rows of `table`). Non-integer indices are left
/// to the op's own check.
pub(super) fn indices_in_range(
    op: &str,
    indices: &Array,
    bound: u64,
    table: &TensorSpec,
) -> Result<()> {
    let r = indices.ready()?;
    let bytes = r.tensor.to_bytes().map_err(|e| named(indices.op(), e))?;
    let Some(values) = integers(indices.dtype(), &bytes)? else {
        return Ok(());
    };
    if let Some((i, v)) = first_out_of_range(&values, bound) {
        return Err(Error::invalid_argument(format!(
            "debug check: eager {op}: index {v} at position {i} of {} is out of range 0..{bound} \
             for {table} (XLA would clamp it silently)",
            indices.spec()
        )));
    }
    Ok(())
}

/// Reads `starts` (waiting for them) and fails with [`ErrorKind::InvalidArgument`] naming `op`
/// if start `i` is outside `0..=bounds[i]` (`bounds[i]` = dim minus size: the last start XLA
/// would not clamp).
pub(super) fn starts_in_range(
    op: &str,
    starts: &Array,
    bounds: &[u64],
    operand: &TensorSpec,
    sizes: &[u64],
) -> Result<()> {
    let r = starts.ready()?;
    let bytes = r.tensor.to_bytes().map_err(|e| named(starts.op(), e))?;
    let Some(values) = integers(starts.dtype(), &bytes)? else {
        return Ok(());
    };
    for (i, (&v, &b)) in values.iter().zip(bounds).enumerate() {
        if first_out_of_range(&[v], b + 1).is_some() {
            return Err(Error::invalid_argument(format!(
                "debug check: eager {op}: start {v} of dim {i} is out of range 0..={b} for \
                 sizes {sizes:?} of {operand} (XLA would clamp it silently)"
            )));
        }
    }
    Ok(())
}
