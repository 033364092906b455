//! Neural-network helpers built from the ops: softmax, layer normalisation, GELU.

use super::{Graph, Op, Value, shape};
use crate::{Result, TensorSpec};

#[cfg(doc)]
use crate::ErrorKind;

impl Graph {
    /// Broadcasts `r`, the result of reducing `spec`-shaped data over `axis`, back to `spec`.
    fn unreduce(&self, r: Value, spec: &TensorSpec, axis: u64) -> Value {
        let bd: Vec<u64> = (0..spec.rank() as u64).filter(|&d| d != axis).collect();
        self.emit_broadcast_in_dim(r, &self.spec(r), &spec.dims, bd)
    }

    /// The spec of `v`, operand of `op`, which must be a float.
    fn float_operand(&self, op: &str, v: Value) -> Result<TensorSpec> {
        let s = self.operand(op, v)?;
        shape::float_operand(op, &s)?;
        Ok(s)
    }

    /// Softmax along `axis`: `exp(a - max(a)) / sum(exp(a - max(a)))`, with the max taken along
    /// `axis` (so large inputs do not overflow). The result has the spec of `a`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `a` is not a float or `axis` is out of range.
    pub fn softmax(&self, a: Value, axis: u64) -> Result<Value> {
        const OP: &str = "softmax";
        let s = self.float_operand(OP, a)?;
        shape::check_axes(OP, &s, &[axis], "axis")?;
        let m = self.reduce_max(a, &[axis])?;
        let m = self.unreduce(m, &s, axis);
        let e = self.exp(self.sub(a, m)?)?;
        let sum = self.reduce_sum(e, &[axis])?;
        let sum = self.unreduce(sum, &s, axis);
        self.div(e, sum)
    }

    /// Layer normalisation over the last axis, as in BERT:
    /// `(x - mean) / sqrt(var + eps) * gamma + beta`, with the biased variance (mean of squared
    /// deviations). `x: [..., D]`, `gamma` and `beta: [D]`; the result has the spec of `x`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `x` is not a float of rank >= 1, or `gamma` /
    /// `beta` are not `[D]` of `x`'s dtype.
    pub fn layer_norm(&self, x: Value, gamma: Value, beta: Value, eps: f32) -> Result<Value> {
        const OP: &str = "layer_norm";
        let s = self.float_operand(OP, x)?;
        let d = shape::last_dim(OP, &s)?;
        for (what, v) in [("gamma", gamma), ("beta", beta)] {
            shape::last_dim_vector(OP, what, &s, &self.operand(OP, v)?)?;
        }
        let axis = s.rank() as u64 - 1;
        let inv_d = self.float_scalar(s.dtype, 1.0 / d as f64);
        let mean = self.mul(self.reduce_sum(x, &[axis])?, inv_d)?;
        let mean = self.unreduce(mean, &s, axis);
        let xc = self.sub(x, mean)?;
        let sq = self.mul(xc, xc)?;
        let var = self.mul(self.reduce_sum(sq, &[axis])?, inv_d)?;
        let eps = self.float_scalar(s.dtype, f64::from(eps));
        let inv = self.rsqrt(self.add(var, eps)?)?;
        let inv = self.unreduce(inv, &s, axis);
        let y = self.mul(self.mul(xc, inv)?, gamma)?;
        self.add(y, beta)
    }

    /// GELU in its exact erf form, `0.5 · x · (1 + erf(x / √2))` (BERT's and Hugging Face's
    /// `"gelu"`, not the tanh approximation). The result has the spec of `a`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `a` is not a float.
    pub fn gelu(&self, a: Value) -> Result<Value> {
        let s = self.float_operand("gelu", a)?;
        let r = self.float_scalar(s.dtype, std::f64::consts::FRAC_1_SQRT_2);
        let half = self.float_scalar(s.dtype, 0.5);
        let one = self.float_scalar(s.dtype, 1.0);
        let e = self.add(self.erf(self.mul(a, r)?)?, one)?;
        self.mul(self.mul(a, half)?, e)
    }

    /// Softmax attention inside the segments of packed rows, computed by the host's
    /// `tpubox_segment_attention` custom call (CPU plugins; the host registers its handler and
    /// allows the target by default).
    ///
    /// `q`, `k`, `v`: f32 `[R, S, H, D]` (rows, tokens, heads, head size; `q` already scaled by
    /// `1/√D`); `positions`: s32 `[R, S]`. A segment starts at token 0 of each row and at every
    /// token whose position is 0, and runs to the next start; query token `i` of head `h`
    /// attends to the keys of its own segment only:
    /// `out[r,i,h,:] = Σ_j softmax_j(q[r,i,h,:]·k[r,j,h,:]) v[r,j,h,:]`, j over the segment.
    /// The result is f32 `[R, S, H, D]`. Work is proportional to the sum of squared segment
    /// lengths, not to `S²`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the specs differ from the above. On a plugin
    /// without the handler (not a CPU plugin) the program fails to compile instead
    /// ([`ErrorKind::NotFound`]: no FFI handler registered for the target).
    pub fn segment_attention(
        &self,
        q: Value,
        k: Value,
        v: Value,
        positions: Value,
    ) -> Result<Value> {
        const OP: &str = "segment_attention";
        let specs = [q, k, v, positions]
            .iter()
            .map(|&x| self.operand(OP, x))
            .collect::<Result<Vec<_>>>()?;
        let out = shape::segment_attention(&specs[0], &specs[1], &specs[2], &specs[3])?;
        Ok(self.push(
            out,
            Op::CustomCall(SEGMENT_ATTENTION),
            &[q, k, v, positions],
        ))
    }
}

/// Custom-call target of [`Graph::segment_attention`] (the host's handler is registered under
/// this name).
pub const SEGMENT_ATTENTION: &str = "tpubox_segment_attention";
