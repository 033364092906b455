//! The ops of [`Graph`]: constants, element-wise math, contractions, shape ops, reductions,
//! comparisons, gathers. Each checks its operands ([`super::shape`]) before it adds anything.

use super::{
    Binary, Compare, DotDimensionNumbers, Graph, Op, Precision, Reduction, Unary, Value, invalid,
    shape,
};
use crate::spec::check_len;
use crate::{Dtype, Element, Result, TensorSpec, encode};

#[cfg(doc)]
use crate::ErrorKind;

impl Graph {
    // -----------------------------------------------------------------------------------------
    // Constants
    // -----------------------------------------------------------------------------------------

    /// A constant of dtype `T::DTYPE` and `dims` holding row-major `data`, embedded in the
    /// program (`stablehlo.constant`; large constants use the compact hex form
    /// `dense<"0x...">`).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `data.len()` is not the product of `dims`.
    pub fn constant<T: Element>(&self, data: &[T], dims: &[u64]) -> Result<Value> {
        check_len(T::DTYPE, dims, data.len()).map_err(|e| invalid("constant", e.message()))?;
        Ok(self.constant_bytes(TensorSpec::new(T::DTYPE, dims), encode(data)))
    }

    /// A rank-0 constant holding `v`.
    pub fn scalar<T: Element>(&self, v: T) -> Value {
        self.constant_bytes(TensorSpec::new(T::DTYPE, &[]), encode(&[v]))
    }

    fn constant_bytes(&self, spec: TensorSpec, bytes: Vec<u8>) -> Value {
        self.push(spec, Op::Constant(bytes), &[])
    }

    /// A rank-0 constant `v` of a floating `dtype` (rounded to it).
    pub(super) fn float_scalar(&self, dtype: Dtype, v: f64) -> Value {
        match dtype {
            Dtype::F64 => self.scalar(v),
            Dtype::F16 => self.scalar(half::f16::from_f64(v)),
            Dtype::Bf16 => self.scalar(half::bf16::from_f64(v)),
            _ => self.scalar(v as f32),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Element-wise ops
    // -----------------------------------------------------------------------------------------

    /// Numpy-broadcasts `v` (of spec `s`, known to be compatible) to `dims`.
    fn broadcast_unchecked(&self, v: Value, s: &TensorSpec, dims: &[u64]) -> Value {
        if s.dims == dims {
            return v;
        }
        let offset = (dims.len() - s.rank()) as u64;
        let bd: Vec<u64> = (0..s.rank() as u64).map(|i| i + offset).collect();
        self.emit_broadcast_in_dim(v, s, dims, bd)
    }

    /// Adds `broadcast_in_dim` of `v` (of spec `s`) to `dims`, unchecked.
    pub(super) fn emit_broadcast_in_dim(
        &self,
        v: Value,
        s: &TensorSpec,
        dims: &[u64],
        broadcast_dimensions: Vec<u64>,
    ) -> Value {
        let out = TensorSpec::new(s.dtype, dims);
        self.push(out, Op::BroadcastInDim(broadcast_dimensions), &[v])
    }

    fn binary(&self, op: Binary, a: Value, b: Value) -> Result<Value> {
        let sa = self.operand(op.name(), a)?;
        let sb = self.operand(op.name(), b)?;
        let dims = shape::binary(op, &sa, &sb)?;
        let a = self.broadcast_unchecked(a, &sa, &dims);
        let b = self.broadcast_unchecked(b, &sb, &dims);
        Ok(self.push(TensorSpec::new(sa.dtype, &dims), Op::Binary(op), &[a, b]))
    }

    /// `a + b`, element-wise with numpy broadcasting.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the dtypes differ, the shapes do not
    /// broadcast, or the dtype is `pred`.
    pub fn add(&self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Add, a, b)
    }

    /// `a - b`, element-wise with numpy broadcasting. Errors: as for [`Graph::add`].
    pub fn sub(&self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Sub, a, b)
    }

    /// `a * b`, element-wise with numpy broadcasting. Errors: as for [`Graph::add`].
    pub fn mul(&self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Mul, a, b)
    }

    /// `a / b`, element-wise with numpy broadcasting (integers truncate toward zero).
    /// Errors: as for [`Graph::add`].
    pub fn div(&self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Div, a, b)
    }

    /// Element-wise maximum with numpy broadcasting (NaN propagates), like `jax.lax.max` and
    /// `jnp.maximum`; for the maximum over axes see [`Graph::reduce_max`]. Also accepts `pred`
    /// (logical or).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the dtypes differ or the shapes do not
    /// broadcast.
    pub fn maximum(&self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Maximum, a, b)
    }

    /// Element-wise minimum with numpy broadcasting (NaN propagates), like `jax.lax.min` and
    /// `jnp.minimum`. Also accepts `pred` (logical and).
    ///
    /// Errors: as for [`Graph::maximum`].
    pub fn minimum(&self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Minimum, a, b)
    }

    /// `a` raised to the power `b`, element-wise with numpy broadcasting (`stablehlo.power`;
    /// a negative float base with a non-integer exponent gives NaN). Errors: as for
    /// [`Graph::add`].
    pub fn pow(&self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Pow, a, b)
    }

    fn unary(&self, op: Unary, a: Value) -> Result<Value> {
        let s = self.operand(op.name(), a)?;
        shape::unary(op, &s)?;
        Ok(self.push(s, Op::Unary(op), &[a]))
    }

    /// `-a`, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a float or
    /// signed integer.
    pub fn neg(&self, a: Value) -> Result<Value> {
        self.unary(Unary::Neg, a)
    }

    /// `|a|`, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a float or
    /// signed integer.
    pub fn abs(&self, a: Value) -> Result<Value> {
        self.unary(Unary::Abs, a)
    }

    /// `e^a`, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a float.
    pub fn exp(&self, a: Value) -> Result<Value> {
        self.unary(Unary::Exp, a)
    }

    /// Natural logarithm, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a
    /// float.
    pub fn log(&self, a: Value) -> Result<Value> {
        self.unary(Unary::Log, a)
    }

    /// Hyperbolic tangent, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is
    /// a float.
    pub fn tanh(&self, a: Value) -> Result<Value> {
        self.unary(Unary::Tanh, a)
    }

    /// Square root, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a
    /// float.
    pub fn sqrt(&self, a: Value) -> Result<Value> {
        self.unary(Unary::Sqrt, a)
    }

    /// `1 / sqrt(a)`, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a
    /// float.
    pub fn rsqrt(&self, a: Value) -> Result<Value> {
        self.unary(Unary::Rsqrt, a)
    }

    /// The error function, element-wise (`chlo.erf`, which XLA expands into its own rational
    /// approximation; on the CPU plugin f32 results are within 1e-6 of the exact value).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] unless `a` is a float.
    pub fn erf(&self, a: Value) -> Result<Value> {
        self.unary(Unary::Erf, a)
    }

    /// The logistic sigmoid `1 / (1 + e^-a)`, element-wise. Errors:
    /// [`ErrorKind::InvalidArgument`] unless `a` is a float.
    pub fn logistic(&self, a: Value) -> Result<Value> {
        self.unary(Unary::Logistic, a)
    }

    // -----------------------------------------------------------------------------------------
    // Contractions
    // -----------------------------------------------------------------------------------------

    /// General tensor contraction (`stablehlo.dot_general`), with the arguments of
    /// [`jax.lax.dot_general(lhs, rhs, dimension_numbers, precision)`][jax]:
    ///
    /// `dimension_numbers = ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`
    ///
    /// Each pair lists dims of `lhs` and the dims of `rhs` they pair with (equal sizes):
    /// contracting dims are summed over, batch dims are kept. The result's dims are the batch
    /// dims (in the order given), then `lhs`'s remaining dims, then `rhs`'s remaining dims,
    /// each in increasing order, as in JAX. `precision` applies to both operands.
    ///
    /// ```no_run
    /// # use tpubox_guest::{Dtype, graph::{Graph, Precision}};
    /// # let g = Graph::new();
    /// let q = g.parameter(Dtype::F32, &[2, 8, 12, 32]); // [batch, seq, heads, dim]
    /// let k = g.parameter(Dtype::F32, &[2, 8, 12, 32]);
    /// // scores[b, h, i, j] = Σ_d q[b, i, h, d] · k[b, j, h, d]; in JAX:
    /// // lax.dot_general(q, k, (((3,), (3,)), ((0, 2), (0, 2))), precision=Precision.HIGHEST)
    /// let scores = g.dot_general(q, k, ((&[3], &[3]), (&[0, 2], &[0, 2])), Precision::Highest)?;
    /// assert_eq!(g.dims(scores), [2, 12, 8, 8]);
    /// # Ok::<(), tpubox_guest::Error>(())
    /// ```
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the dtypes differ or are `pred`, a pair of
    /// lists has different lengths, a dim is out of range or used twice in one operand, or
    /// paired dims have different sizes.
    ///
    /// [jax]: https://docs.jax.dev/en/latest/_autosummary/jax.lax.dot_general.html
    pub fn dot_general(
        &self,
        lhs: Value,
        rhs: Value,
        dimension_numbers: DotDimensionNumbers<'_>,
        precision: Precision,
    ) -> Result<Value> {
        const OP: &str = "dot_general";
        let (contracting, batch) = dimension_numbers;
        let sa = self.operand(OP, lhs)?;
        let sb = self.operand(OP, rhs)?;
        let out = shape::dot_general(OP, &sa, &sb, contracting, batch)?;
        let op = Op::DotGeneral {
            contracting: (contracting.0.to_vec(), contracting.1.to_vec()),
            batch: (batch.0.to_vec(), batch.1.to_vec()),
            precision,
        };
        Ok(self.push(out, op, &[lhs, rhs]))
    }

    /// Matrix product over the last two dims.
    ///
    /// * `a: [..., m, k]`, `b: [..., k, n]` with equal leading (batch) dims → `[..., m, n]`;
    /// * `a: [..., m, k]`, `b: [k, n]` (rank 2) → `[..., m, n]`: `b` is shared by every leading
    ///   index of `a` (e.g. `[B, S, K] × [K, N] → [B, S, N]`), without materialising a
    ///   broadcast.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if either operand has rank below 2, the ranks
    /// differ while `b` is not rank 2, the leading dims differ, `k` differs, or as for
    /// [`Graph::dot_general`].
    pub fn matmul(&self, a: Value, b: Value, precision: Precision) -> Result<Value> {
        const OP: &str = "matmul";
        let sa = self.operand(OP, a)?;
        let sb = self.operand(OP, b)?;
        let batch = shape::matmul(&sa, &sb)?;
        // The last dim of `a` with the next-to-last of `b`.
        let (ca, cb) = ([sa.rank() as u64 - 1], [sb.rank() as u64 - 2]);
        self.dot_general(a, b, ((&ca, &cb), (&batch, &batch)), precision)
            .map_err(|e| invalid(OP, e.message()))
    }

    // -----------------------------------------------------------------------------------------
    // Shape ops
    // -----------------------------------------------------------------------------------------

    /// `stablehlo.broadcast_in_dim`: a tensor of `dims` where operand dim `i` maps to result
    /// dim `broadcast_dimensions[i]`; result dims not mapped to are filled by repetition, and
    /// an operand dim of size 1 stretches.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `broadcast_dimensions` does not have one
    /// distinct, in-range entry per operand dim, or an operand dim is neither 1 nor the size
    /// of the result dim it maps to.
    pub fn broadcast_in_dim(
        &self,
        a: Value,
        dims: &[u64],
        broadcast_dimensions: &[u64],
    ) -> Result<Value> {
        let s = self.operand("broadcast_in_dim", a)?;
        shape::broadcast_in_dim(&s, dims, broadcast_dimensions)?;
        Ok(self.emit_broadcast_in_dim(a, &s, dims, broadcast_dimensions.to_vec()))
    }

    /// Broadcasts `a` to `dims` with numpy rules (dims aligned from the right; an operand dim
    /// of 1 stretches; missing leading dims are added). Returns `a` itself if it already has
    /// `dims`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `a` has more dims than `dims` or a dim is
    /// neither 1 nor equal to the target's.
    pub fn broadcast_to(&self, a: Value, dims: &[u64]) -> Result<Value> {
        let s = self.operand("broadcast_to", a)?;
        shape::broadcast_to(&s, dims)?;
        Ok(self.broadcast_unchecked(a, &s, dims))
    }

    /// Reinterprets `a` (row-major) with new `dims` of the same element count. Returns `a`
    /// itself if it already has `dims`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the element
    /// counts differ.
    pub fn reshape(&self, a: Value, dims: &[u64]) -> Result<Value> {
        let s = self.operand("reshape", a)?;
        let out = shape::reshape(&s, dims)?;
        if s.dims == dims {
            return Ok(a);
        }
        Ok(self.push(out, Op::Reshape, &[a]))
    }

    /// Permutes the dims of `a`: result dim `i` is operand dim `permutation[i]`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `permutation` is not a permutation of
    /// `0..rank`.
    pub fn transpose(&self, a: Value, permutation: &[u64]) -> Result<Value> {
        let s = self.operand("transpose", a)?;
        let out = shape::transpose(&s, permutation)?;
        Ok(self.push(out, Op::Transpose(permutation.to_vec()), &[a]))
    }

    // -----------------------------------------------------------------------------------------
    // Reductions
    // -----------------------------------------------------------------------------------------

    /// The scalar constant `reduction` starts from: 0 for a sum, the lowest value for a max.
    fn reduce_init(&self, reduction: Reduction, dtype: Dtype) -> Value {
        match (reduction, dtype) {
            (_, Dtype::Pred) => self.scalar(false),
            (Reduction::Sum, d) if shape::is_float(d) => self.float_scalar(d, 0.0),
            (Reduction::Sum, d) => {
                self.constant_bytes(TensorSpec::new(d, &[]), vec![0u8; d.size_bytes()])
            }
            (Reduction::Max, Dtype::S8) => self.scalar(i8::MIN),
            (Reduction::Max, Dtype::S16) => self.scalar(i16::MIN),
            (Reduction::Max, Dtype::S32) => self.scalar(i32::MIN),
            (Reduction::Max, Dtype::S64) => self.scalar(i64::MIN),
            (Reduction::Max, Dtype::U8) => self.scalar(0u8),
            (Reduction::Max, Dtype::U16) => self.scalar(0u16),
            (Reduction::Max, Dtype::U32) => self.scalar(0u32),
            (Reduction::Max, Dtype::U64) => self.scalar(0u64),
            (Reduction::Max, d) => self.float_scalar(d, f64::NEG_INFINITY),
        }
    }

    fn reduce(&self, reduction: Reduction, a: Value, axes: &[u64]) -> Result<Value> {
        let s = self.operand(reduction.name(), a)?;
        let (out, axes) = shape::reduce(reduction, &s, axes)?;
        let init = self.reduce_init(reduction, s.dtype);
        Ok(self.push(out, Op::Reduce { reduction, axes }, &[a, init]))
    }

    /// Sums `a` over `axes`, which are removed from the result (`f32[2,3,4]` over `[0, 2]` →
    /// `f32[3]`). `pred` sums are logical ors.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if an axis is out of range or repeated, or `a`
    /// is complex.
    pub fn reduce_sum(&self, a: Value, axes: &[u64]) -> Result<Value> {
        self.reduce(Reduction::Sum, a, axes)
    }

    /// Maximum of `a` over `axes`, which are removed from the result. Starts from `-inf` for
    /// floats (so an empty reduction gives `-inf`), the minimum for integers.
    ///
    /// Errors: as for [`Graph::reduce_sum`].
    pub fn reduce_max(&self, a: Value, axes: &[u64]) -> Result<Value> {
        self.reduce(Reduction::Max, a, axes)
    }

    // -----------------------------------------------------------------------------------------
    // Conversion, comparison, selection, iota
    // -----------------------------------------------------------------------------------------

    /// Converts `a` element-wise to dtype `to` (`stablehlo.convert`: float → integer truncates
    /// toward zero; to `pred` is `x != 0`). Returns `a` itself if it already has dtype `to`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for a complex → real conversion.
    pub fn convert(&self, a: Value, to: Dtype) -> Result<Value> {
        let s = self.operand("convert", a)?;
        if s.dtype == to {
            return Ok(a);
        }
        let out = shape::convert(&s, to)?;
        Ok(self.push(out, Op::Convert, &[a]))
    }

    /// Compares `a` and `b` element-wise with numpy broadcasting; the result is `pred`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the dtypes differ or the shapes do not
    /// broadcast, or for an ordering (`Lt`, `Le`, `Gt`, `Ge`) of complex values.
    pub fn compare(&self, a: Value, b: Value, dir: Compare) -> Result<Value> {
        const OP: &str = "compare";
        let sa = self.operand(OP, a)?;
        let sb = self.operand(OP, b)?;
        let dims = shape::compare(dir, &sa, &sb)?;
        let a = self.broadcast_unchecked(a, &sa, &dims);
        let b = self.broadcast_unchecked(b, &sb, &dims);
        let out = TensorSpec::new(Dtype::Pred, &dims);
        Ok(self.push(out, Op::Compare(dir), &[a, b]))
    }

    /// Element-wise `pred ? on_true : on_false`, all three broadcast together with numpy
    /// rules.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `pred` is not `pred`, `on_true` and
    /// `on_false` have different dtypes, or the three shapes do not broadcast.
    pub fn select(&self, pred: Value, on_true: Value, on_false: Value) -> Result<Value> {
        const OP: &str = "select";
        let sp = self.operand(OP, pred)?;
        let st = self.operand(OP, on_true)?;
        let sf = self.operand(OP, on_false)?;
        let dims = shape::select(&sp, &st, &sf)?;
        let p = self.broadcast_unchecked(pred, &sp, &dims);
        let t = self.broadcast_unchecked(on_true, &st, &dims);
        let f = self.broadcast_unchecked(on_false, &sf, &dims);
        Ok(self.push(TensorSpec::new(st.dtype, &dims), Op::Select, &[p, t, f]))
    }

    /// A tensor of `dtype` and `dims` whose elements equal their index along `axis`
    /// (`iota(s32, [2, 3], 1)` = `[[0, 1, 2], [0, 1, 2]]`).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `axis` is not below the rank (so a scalar
    /// iota is an error) or `dtype` is `pred`.
    pub fn iota(&self, dtype: Dtype, dims: &[u64], axis: u64) -> Result<Value> {
        let out = shape::iota(dtype, dims, axis)?;
        Ok(self.push(out, Op::Iota(axis), &[]))
    }

    // -----------------------------------------------------------------------------------------
    // Gather, slice, concatenate
    // -----------------------------------------------------------------------------------------

    /// Embedding lookup: rows of `table: [V, D...]` picked by integer `indices: [I...]`,
    /// giving `[I..., D...]` (`stablehlo.gather`). Out-of-range indices are clamped into
    /// `0..V` (gather semantics), not reported.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `table` is a scalar or `indices` is not an
    /// integer tensor.
    pub fn take(&self, table: Value, indices: Value) -> Result<Value> {
        const OP: &str = "take";
        let st = self.operand(OP, table)?;
        let si = self.operand(OP, indices)?;
        let out = shape::take(&st, &si)?;
        Ok(self.push(out, Op::Take, &[table, indices]))
    }

    /// The elements of `a` from `start` (inclusive) to `limit` (exclusive) every `strides`
    /// along each dim; result dim `i` is `ceil((limit[i] - start[i]) / strides[i])`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if a list's length is not the rank, a start
    /// exceeds its limit, a limit exceeds the dim, or a stride is 0.
    pub fn slice(&self, a: Value, start: &[u64], limit: &[u64], strides: &[u64]) -> Result<Value> {
        let s = self.operand("slice", a)?;
        let out = shape::slice(&s, start, limit, strides)?;
        let op = Op::Slice {
            start: start.to_vec(),
            limit: limit.to_vec(),
            strides: strides.to_vec(),
        };
        Ok(self.push(out, op, &[a]))
    }

    /// The block of `a` of dims `sizes` starting at run-time indices `starts` (one integer
    /// scalar per dim, all of one dtype; `stablehlo.dynamic_slice`). A start is clamped into
    /// `0..=dim - size` (XLA's semantics), not reported.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `starts` or `sizes` does not have one entry
    /// per dim, a start is not an integer scalar of the first one's dtype, or a size exceeds
    /// its dim.
    pub fn dynamic_slice(&self, a: Value, starts: &[Value], sizes: &[u64]) -> Result<Value> {
        const OP: &str = "dynamic_slice";
        let s = self.operand(OP, a)?;
        let specs = starts
            .iter()
            .map(|&v| self.operand(OP, v))
            .collect::<Result<Vec<_>>>()?;
        let out = shape::dynamic_slice(&s, &specs, sizes)?;
        let mut operands = vec![a];
        operands.extend_from_slice(starts);
        Ok(self.push(out, Op::DynamicSlice(sizes.to_vec()), &operands))
    }

    /// Joins `values` along `axis`; all must have the same dtype and rank, and equal dims
    /// except along `axis`. A single value is returned as is.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `values` is empty, `axis` is out of range,
    /// or the dtypes, ranks or other dims differ.
    pub fn concatenate(&self, values: &[Value], axis: u64) -> Result<Value> {
        const OP: &str = "concatenate";
        let specs = values
            .iter()
            .map(|&v| self.operand(OP, v))
            .collect::<Result<Vec<_>>>()?;
        let out = shape::concatenate(&specs, axis)?;
        if values.len() == 1 {
            return Ok(values[0]);
        }
        Ok(self.push(out, Op::Concatenate(axis), values))
    }
}
