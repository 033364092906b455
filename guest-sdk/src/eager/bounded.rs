//! Bounded shapes (TorchTPU's bounded dynamism, `mark_dynamic(t, dim, lower, upper)`): an
//! array with one dynamic axis of true length `len <= max` is stored padded to the next
//! bucket, so that a stream of different lengths runs a handful of programs.
//!
//! Buckets are the powers of two below `max`, then `max` itself ([`bucket`], [`buckets`]):
//! a stream of lengths `1..=max` compiles at most `buckets(max).len()` (`ceil(log2(max)) + 1`)
//! programs per op (DEFER_NEVER) or per fused step (DEFER_AND_FUSE). TorchTPU's fixed `bucket_size` (default 128) gives one
//! bucket per 128 elements; powers of two keep the count logarithmic in `max` and the
//! padding below half the array.
//!
//! The true length is kept on the guest (for [`Array::to_vec`] and the checks) and as an
//! `s32[]` device scalar uploaded with the data: the masks of reductions compare an iota with
//! that scalar, so a program's text depends on the bucket only, not on the length.

use super::array::{Array, State};
use crate::graph::{Compare, Graph, Value, is_float};
use crate::{Dtype, Element, Error, Result};

/// The dynamic axis of an array: its index, its true length and the device scalar holding
/// that length (`s32[]`).
#[derive(Clone)]
pub(super) struct Dynamic {
    pub(super) axis: u64,
    pub(super) len: u64,
    pub(super) len_array: Array,
}

/// The bucket a dynamic axis of true length `len` and maximum `max` is padded to: the
/// smallest power of two `>= len`, capped at `max`.
///
/// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) unless
/// `1 <= len <= max` (and `max` fits an `s32`).
pub fn bucket(len: u64, max: u64) -> Result<u64> {
    if len == 0 || len > max || max > i32::MAX as u64 {
        return Err(Error::invalid_argument(format!(
            "bounded: length {len} must be in 1..={max} (max at most {})",
            i32::MAX
        )));
    }
    Ok(len.next_power_of_two().min(max))
}

/// Every bucket of a dynamic axis with maximum `max`, ascending: `1, 2, 4, ..., max` (empty
/// for `max == 0`).
pub fn buckets(max: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut b = 1u64;
    while b < max {
        out.push(b);
        b *= 2;
    }
    if max > 0 {
        out.push(max);
    }
    out
}

/// `data` (row-major `dims`) padded with `zero` along `axis` to `to` entries.
pub(super) fn pad_axis<T: Copy>(data: &[T], dims: &[u64], axis: usize, to: u64, zero: T) -> Vec<T> {
    let outer: u64 = dims[..axis].iter().product();
    let inner: u64 = dims[axis + 1..].iter().product();
    let (len, inner) = (dims[axis] as usize, inner as usize);
    let mut out = Vec::with_capacity(outer as usize * to as usize * inner);
    for row in data.chunks(len * inner).take(outer as usize) {
        out.extend_from_slice(row);
        out.resize(out.len() + (to as usize - len) * inner, zero);
    }
    out
}

/// `data` (row-major `dims`) cut along `axis` to its first `len` entries.
pub(super) fn unpad_axis<T: Copy>(data: &[T], dims: &[u64], axis: usize, len: u64) -> Vec<T> {
    let inner: u64 = dims[axis + 1..].iter().product();
    let (padded, inner) = (dims[axis] as usize, inner as usize);
    if padded * inner == 0 {
        return Vec::new();
    }
    data.chunks(padded * inner)
        .flat_map(|row| &row[..len as usize * inner])
        .copied()
        .collect()
}

/// The dynamic axis of the result of an element-wise op of output rank `rank` on operands of
/// `dims` with dynamic axes `dynamic` (`(axis, len)` each), under numpy broadcasting.
///
/// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `op` if
/// two dynamic operands disagree (other axis or length) or a static operand has that axis
/// with a size other than 1 (its padding would not line up).
pub(super) fn propagate(
    op: &str,
    dims: &[&[u64]],
    dynamic: &[Option<(u64, u64)>],
) -> Result<Option<(u64, u64)>> {
    let rank = dims.iter().map(|d| d.len()).max().unwrap_or(0) as u64;
    let mut out: Option<(u64, u64)> = None;
    for (d, dy) in dims.iter().zip(dynamic) {
        if let Some((axis, len)) = *dy {
            let at = (axis + rank - d.len() as u64, len);
            match out {
                Some(o) if o != at => {
                    return Err(Error::invalid_argument(format!(
                        "{op}: operands with different dynamic axes (axis {} length {} and \
                         axis {} length {}, counted in the result)",
                        o.0, o.1, at.0, at.1
                    )));
                }
                _ => out = Some(at),
            }
        }
    }
    let Some((axis, _)) = out else {
        return Ok(None);
    };
    for (d, dy) in dims.iter().zip(dynamic) {
        let shift = rank - d.len() as u64;
        if dy.is_none() && axis >= shift && d[(axis - shift) as usize] != 1 {
            return Err(Error::invalid_argument(format!(
                "{op}: a static operand {:?} has the dynamic axis {axis} with size {} \
                 (it must be 1 or absent: mark it dynamic with the same length)",
                d,
                d[(axis - shift) as usize]
            )));
        }
    }
    Ok(out)
}

/// `x` with the entries at or past `len` (an `s32[]` value) along `axis` replaced by `fill`
/// (converted to `x`'s dtype). The text depends on `x`'s spec only.
pub(super) fn masked(g: &Graph, x: Value, len: Value, axis: u64, fill: f32) -> Result<Value> {
    let s = g.spec(x);
    let iota = g.iota(Dtype::S32, &s.dims, axis)?;
    let keep = g.compare(iota, len, Compare::Lt)?;
    let fill = g.convert(g.scalar(fill), s.dtype)?;
    g.select(keep, x, fill)
}

impl Array {
    /// An array of dtype `T::DTYPE` holding row-major `data` of `dims`, whose axis `axis`
    /// is dynamic with maximum `max` (TorchTPU's `mark_dynamic(t, axis, 1, max)`): its true
    /// length is `dims[axis]`, it is stored padded with zeros to [`bucket`]`(dims[axis], max)`,
    /// and its length is uploaded as an `s32[]` scalar (two uploads, no program).
    ///
    /// [`Array::dims`] gives the padded dims, [`Array::logical_dims`] the true ones;
    /// [`Array::to_vec`] returns the true elements. Element-wise ops keep the dynamic axis;
    /// [`Array::sum`], [`Array::max`] and [`Array::softmax`] over it mask the padding; other
    /// ops on such an array fail rather than compute on the padding.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) if `axis` is
    /// out of range, `dims[axis]` is not in `1..=max`, or `data.len()` is not the product of
    /// `dims`.
    pub fn from_slice_bounded<T: Element>(
        data: &[T],
        dims: &[u64],
        axis: u64,
        max: u64,
    ) -> Result<Array> {
        let Some(&len) = dims.get(axis as usize) else {
            return Err(Error::invalid_argument(format!(
                "from_slice_bounded: axis {axis} out of range for dims {dims:?}"
            )));
        };
        let to = bucket(len, max)?;
        let n: u64 = dims.iter().product();
        if data.len() as u64 != n {
            return Err(Error::invalid_argument(format!(
                "from_slice_bounded: {} values for dims {dims:?} ({n} expected)",
                data.len()
            )));
        }
        let zero = T::read_le(&vec![0u8; T::SIZE]);
        let padded = pad_axis(data, dims, axis as usize, to, zero);
        let mut pdims = dims.to_vec();
        pdims[axis as usize] = to;
        let array = Array::from_slice(&padded, &pdims)?;
        let len_array = Array::from_slice(&[len as i32], &[])?;
        array.set_dynamic(Some(Dynamic {
            axis,
            len,
            len_array,
        }));
        Ok(array)
    }

    /// This array with axis `axis` marked dynamic, of true length `len` and maximum `max`,
    /// for an array that is already padded (`dims[axis]` is [`bucket`]`(len, max)`, e.g. a
    /// tensor from [`Array::from_tensor`]): the entries past `len` may hold anything, as no op
    /// reads them. Uploads the length as an `s32[]` scalar; in
    /// [`EagerMode::DeferAndFuse`](super::EagerMode::DeferAndFuse) it runs the pending trace
    /// first if the array is still recorded.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) if the array
    /// already has a dynamic axis, `axis` is out of range, `len` is not in `1..=max` or
    /// `dims[axis]` is not its bucket; those of running the trace.
    pub fn mark_dynamic(&self, axis: u64, len: u64, max: u64) -> Result<Array> {
        Array::no_dynamic("mark_dynamic", &[self])?;
        let Some(&size) = self.dims().get(axis as usize) else {
            return Err(Error::invalid_argument(format!(
                "mark_dynamic: axis {axis} out of range for {}",
                self.spec()
            )));
        };
        let b = bucket(len, max)?;
        if size != b {
            return Err(Error::invalid_argument(format!(
                "mark_dynamic: axis {axis} of {} has size {size}, not the bucket {b} of length \
                 {len} (max {max}); pad it first or use Array::from_slice_bounded",
                self.spec()
            )));
        }
        let ready = self.ready()?;
        let out = Array::with_state(self.spec().clone(), "mark_dynamic", State::Ready(ready));
        out.set_dynamic(Some(Dynamic {
            axis,
            len,
            len_array: Array::from_slice(&[len as i32], &[])?,
        }));
        Ok(out)
    }

    /// The dynamic axis and its true length, if the array has one
    /// ([`Array::from_slice_bounded`]); the axis's size in [`Array::dims`] is its bucket.
    pub fn dynamic_axis(&self) -> Option<(u64, u64)> {
        self.node.dynamic.borrow().as_ref().map(|d| (d.axis, d.len))
    }

    /// The true dims: [`Array::dims`] with the dynamic axis (if any) at its true length.
    pub fn logical_dims(&self) -> Vec<u64> {
        let mut dims = self.dims().to_vec();
        if let Some((axis, len)) = self.dynamic_axis() {
            dims[axis as usize] = len;
        }
        dims
    }

    pub(super) fn dynamic(&self) -> Option<Dynamic> {
        self.node.dynamic.borrow().clone()
    }

    pub(super) fn set_dynamic(&self, d: Option<Dynamic>) {
        *self.node.dynamic.borrow_mut() = d;
    }

    /// Fails naming `op` if one of `operands` has a dynamic axis (for ops that do not handle
    /// the padding).
    pub(super) fn no_dynamic(op: &str, operands: &[&Array]) -> Result<()> {
        match operands.iter().find_map(|a| a.dynamic_axis()) {
            Some((axis, len)) => Err(Error::invalid_argument(format!(
                "{op}: does not support an operand with a dynamic axis (axis {axis}, length \
                 {len}); supported are element-wise ops, sum, max and softmax, and to_vec"
            ))),
            None => Ok(()),
        }
    }

    /// An element-wise op: runs it on the padded arrays and gives the result the operands'
    /// dynamic axis ([`propagate`]).
    pub(super) fn elementwise<F>(name: &'static str, operands: &[&Array], build: F) -> Result<Array>
    where
        F: Fn(&Graph, &[Value]) -> Result<Value>,
    {
        let dyns: Vec<Option<Dynamic>> = operands.iter().map(|a| a.dynamic()).collect();
        if dyns.iter().all(Option::is_none) {
            return Array::apply_any(name, operands, None, build);
        }
        let dims: Vec<&[u64]> = operands.iter().map(|a| a.dims()).collect();
        let axes: Vec<Option<(u64, u64)>> = dyns
            .iter()
            .map(|d| d.as_ref().map(|d| (d.axis, d.len)))
            .collect();
        let out_dyn = propagate(name, &dims, &axes)?.and_then(|(axis, len)| {
            let d = dyns.iter().flatten().next()?;
            Some(Dynamic {
                axis,
                len,
                len_array: d.len_array.clone(),
            })
        });
        Array::apply_any(name, operands, out_dyn, build)
    }

    /// A reduction `name` over `axes` that fills the padding with `fill` first when the
    /// dynamic axis is among `axes`; otherwise the result keeps the axis (renumbered).
    pub(super) fn reduction<F>(
        &self,
        name: &'static str,
        axes: &[u64],
        fill: f32,
        build: F,
    ) -> Result<Array>
    where
        F: Fn(&Graph, Value) -> Result<Value> + 'static,
    {
        let Some(d) = self.dynamic() else {
            return Array::apply_any(name, &[self], None, move |g, v| build(g, v[0]));
        };
        if axes.contains(&d.axis) {
            if !fill.is_finite() && !is_float(self.dtype()) {
                return Err(Error::invalid_argument(format!(
                    "{name}: over a dynamic axis needs a float array (its padding is masked \
                     with {fill}), got {}",
                    self.spec()
                )));
            }
            let axis = d.axis;
            return Array::apply_any(name, &[self, &d.len_array], None, move |g, v| {
                build(g, masked(g, v[0], v[1], axis, fill)?)
            });
        }
        let axis = d.axis - axes.iter().filter(|&&a| a < d.axis).count() as u64;
        let out_dyn = Some(Dynamic { axis, ..d });
        Array::apply_any(name, &[self], out_dyn, move |g, v| build(g, v[0]))
    }

    /// Softmax along `axis` with the padding of a dynamic `axis` masked with `-inf` (so it
    /// gets probability 0); the result keeps the dynamic axis.
    pub(super) fn softmax_bounded(&self, axis: u64) -> Result<Array> {
        let Some(d) = self.dynamic() else {
            return Array::apply_any("softmax", &[self], None, move |g, v| g.softmax(v[0], axis));
        };
        if d.axis == axis {
            let len = d.len_array.clone();
            Array::apply_any("softmax", &[self, &len], Some(d), move |g, v| {
                g.softmax(masked(g, v[0], v[1], axis, f32::NEG_INFINITY)?, axis)
            })
        } else {
            Array::apply_any("softmax", &[self], Some(d), move |g, v| {
                g.softmax(v[0], axis)
            })
        }
    }

    /// The true elements of a dynamic array read back as `data` of its padded dims.
    pub(super) fn unpad<T: Copy>(&self, data: Vec<T>) -> Vec<T> {
        match self.dynamic_axis() {
            Some((axis, len)) => unpad_axis(&data, self.dims(), axis as usize, len),
            None => data,
        }
    }
}
