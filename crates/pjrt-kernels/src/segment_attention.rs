//! `tpubox_segment_attention`: softmax attention inside the segments of packed rows.
//!
//! A packed encoder puts several sentences one after another in each row, so that almost no
//! padding is computed; dense attention over such a row computes the scores of every token
//! pair (`S²` per row and head) and masks all but the pairs inside one sentence. This kernel
//! computes only those pairs: the work is the sum of the squared segment lengths.
//!
//! Contract (operands in the default row-major layout):
//! - operands `q`, `k`, `v`: f32 `[R, S, H, D]` (rows, tokens, heads, head size); `q` is
//!   already scaled (by `1/√D` for scaled dot-product attention);
//! - operand `positions`: s32 `[R, S]`. A segment starts at token 0 of every row and at every
//!   token whose position is 0, and runs to the next start;
//! - result: f32 `[R, S, H, D]`,
//!   `out[r,i,h,:] = Σ_j p_j v[r,j,h,:]`, `p = softmax_j(q[r,i,h,:]·k[r,j,h,:])` over the keys
//!   `j` of query `i`'s segment (the softmax is shifted by its maximum).
//!
//! Checks before any data is read: element types and dimensions, non-null aligned buffers, a
//! result that shares no memory with an operand, and the work bound ([`crate::max_flop`]).

// Lane loops (`for l in 0..8`) index several fixed-size arrays at once, which is what lets
// the compiler keep them in vector registers.
#![allow(clippy::needless_range_loop)]

use std::sync::Mutex;

use pjrt::ErrorCode;
use pjrt::ffi::{CallFrame, FfiBuffer, FfiError};
use pjrt_sys::xla_ffi as xf;

type R<T> = Result<T, FfiError>;

/// Start and end (exclusive) of each segment of one row, from its positions.
fn segments(positions: &[i32]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (t, &p) in positions.iter().enumerate().skip(1) {
        if p == 0 {
            out.push((start, t));
            start = t;
        }
    }
    if !positions.is_empty() {
        out.push((start, positions.len()));
    }
    out
}

/// XLA's name of an element type, for messages.
fn type_name(t: xf::XLA_FFI_DataType) -> String {
    match t {
        xf::XLA_FFI_DataType_F32 => "f32".into(),
        xf::XLA_FFI_DataType_S32 => "s32".into(),
        other => format!("element type {other}"),
    }
}

fn check(b: &FfiBuffer<'_>, dtype: xf::XLA_FFI_DataType, dims: &[i64], what: &str) -> R<()> {
    if b.dtype != dtype || b.dims != dims {
        return Err(FfiError::invalid(format!(
            "tpubox_segment_attention: {what} must be {} {dims:?}, got {} {:?}",
            type_name(dtype),
            type_name(b.dtype),
            b.dims
        )));
    }
    Ok(())
}

/// The byte range of `b`, which holds `len` elements of `elem` bytes; errors unless its pointer
/// is non-null and aligned to `align` (when it holds anything).
fn range(b: &FfiBuffer<'_>, len: usize, elem: usize, align: usize) -> R<(usize, usize)> {
    let start = b.data as usize;
    if len > 0 && (b.data.is_null() || !start.is_multiple_of(align)) {
        return Err(FfiError::invalid(
            "tpubox_segment_attention: buffer is null or misaligned",
        ));
    }
    Ok((start, start + len * elem))
}

/// The handler body of `tpubox_segment_attention` (see the module docs for the contract).
///
/// Errors: `INVALID_ARGUMENT` for a call that breaks the contract (operand or result count,
/// element types, dimensions, a result overlapping an operand, a misaligned buffer);
/// `RESOURCE_EXHAUSTED` when the call's segments would need more than [`crate::max_flop`]
/// floating-point operations.
pub fn segment_attention(f: &CallFrame<'_>) -> R<()> {
    if f.num_args() != 4 || f.num_rets() != 1 {
        return Err(FfiError::invalid(format!(
            "tpubox_segment_attention takes 4 operands and gives 1 result, got {} and {}",
            f.num_args(),
            f.num_rets()
        )));
    }
    let (q, k, v, pos, out) = (f.arg(0)?, f.arg(1)?, f.arg(2)?, f.arg(3)?, f.ret(0)?);
    if q.dtype != xf::XLA_FFI_DataType_F32 || q.dims.len() != 4 {
        return Err(FfiError::invalid(format!(
            "tpubox_segment_attention: q must be f32 [R, S, H, D], got {} {:?}",
            type_name(q.dtype),
            q.dims
        )));
    }
    let dims = q.dims;
    check(&k, xf::XLA_FFI_DataType_F32, dims, "k")?;
    check(&v, xf::XLA_FFI_DataType_F32, dims, "v")?;
    check(&out, xf::XLA_FFI_DataType_F32, dims, "the result")?;
    check(&pos, xf::XLA_FFI_DataType_S32, &dims[..2], "positions")?;
    let d: Vec<usize> = dims
        .iter()
        .map(|&x| usize::try_from(x))
        .collect::<Result<_, _>>()
        .map_err(|_| FfiError::invalid("tpubox_segment_attention: negative dimension"))?;
    let (rows, len, heads, dim) = (d[0], d[1], d[2], d[3]);
    let n = q
        .elements()
        .ok_or_else(|| FfiError::invalid("tpubox_segment_attention: size overflows"))?;
    let np = pos
        .elements()
        .ok_or_else(|| FfiError::invalid("tpubox_segment_attention: size overflows"))?;
    let o = range(&out, n, 4, 4)?;
    for (b, len) in [(&q, n), (&k, n), (&v, n), (&pos, np)] {
        let r = range(b, len, 4, 4)?;
        if n > 0 && len > 0 && r.0 < o.1 && o.0 < r.1 {
            return Err(FfiError::invalid(
                "tpubox_segment_attention: the result shares memory with an operand",
            ));
        }
    }
    if n == 0 {
        return Ok(());
    }
    // SAFETY: `pos` holds `np = R·S` s32 elements (element type and dimensions checked), its
    // pointer is non-null and aligned, and it does not overlap the only buffer written (`out`).
    let pos = unsafe { std::slice::from_raw_parts(pos.data.cast::<i32>(), np) };
    let segs: Vec<Vec<(usize, usize)>> = pos.chunks_exact(len).map(segments).collect();
    // Per query and head: D multiply-adds for each key's score and each key's value, plus the
    // softmax (counted as 4 operations per key).
    let per_pair = (heads * (4 * dim + 4)) as f64;
    let flop: f64 = segs
        .iter()
        .flatten()
        .map(|&(a, b)| ((b - a) * (b - a)) as f64 * per_pair)
        .sum();
    let limit = crate::max_flop();
    if flop > limit {
        return Err(FfiError::new(
            ErrorCode::ResourceExhausted,
            format!(
                "tpubox_segment_attention: about {flop:.3e} floating-point operations, above the limit of {limit:.3e} per custom call (TPUBOX_KERNEL_MAX_FLOP)"
            ),
        ));
    }
    // SAFETY: `q`, `k` and `v` each hold `n` f32 elements (checked), are non-null and aligned,
    // and are only read; none overlaps `out` (checked), so the shared views below and the one
    // mutable view of `out` never alias. XLA keeps every buffer alive for the call.
    let (q, k, v, out) = unsafe {
        (
            std::slice::from_raw_parts(q.data.cast::<f32>(), n),
            std::slice::from_raw_parts(k.data.cast::<f32>(), n),
            std::slice::from_raw_parts(v.data.cast::<f32>(), n),
            std::slice::from_raw_parts_mut(out.data.cast::<f32>(), n),
        )
    };
    let row_len = len * heads * dim;
    // Rows are independent: one worker per core, each taking the next row.
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(rows);
    let work = Mutex::new(out.chunks_mut(row_len).enumerate());
    let next = || work.lock().unwrap_or_else(|p| p.into_inner()).next();
    let run = || {
        let mut scratch = Scratch::default();
        while let Some((r, o)) = next() {
            let at = r * row_len..(r + 1) * row_len;
            let row = Row {
                q: &q[at.clone()],
                k: &k[at.clone()],
                v: &v[at],
                heads,
                dim,
            };
            row.attend(&segs[r], o, &mut scratch);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(run);
        }
        run();
    });
    Ok(())
}

/// One row's `q`, `k`, `v` (`[S, H, D]` each, row-major).
struct Row<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    heads: usize,
    dim: usize,
}

/// Per-thread buffers: one segment's keys and values of one head, contiguous, and one query's
/// scores.
#[derive(Default)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    scores: Vec<f32>,
}

impl Row<'_> {
    /// Token `t`, head `h` of `x`.
    #[inline(always)]
    fn at<'x>(&self, x: &'x [f32], t: usize, h: usize) -> &'x [f32] {
        let i = (t * self.heads + h) * self.dim;
        &x[i..i + self.dim]
    }

    /// Writes the row's attention output into `out` (`[S, H, D]`), with the fastest code the
    /// CPU runs.
    fn attend(&self, segs: &[(usize, usize)], out: &mut [f32], scratch: &mut Scratch) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA, the only requirement of `attend_avx2`.
            return unsafe { self.attend_avx2(segs, out, scratch) };
        }
        self.attend_with::<false>(segs, out, scratch)
    }

    /// [`Row::attend_with`] compiled for AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn attend_avx2(&self, segs: &[(usize, usize)], out: &mut [f32], scratch: &mut Scratch) {
        self.attend_with::<true>(segs, out, scratch)
    }

    #[inline(always)]
    fn attend_with<const FMA: bool>(
        &self,
        segs: &[(usize, usize)],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) {
        match self.dim {
            32 => self.attend_fixed::<32, FMA>(segs, out, scratch),
            64 => self.attend_fixed::<64, FMA>(segs, out, scratch),
            _ => self.attend_any::<FMA>(segs, out, scratch),
        }
    }

    /// Head size `D` (a multiple of 8) known at compile time. Per segment and head: the keys
    /// are transposed into `[D, n8]` (`n8`: the segment length rounded up to 8, zero-filled),
    /// scores are computed for 4 queries × 8 keys at a time (32 accumulators, each key vector
    /// loaded once for the 4 queries), then each query's softmax and its weighted sum of values.
    #[inline(always)]
    fn attend_fixed<const D: usize, const FMA: bool>(
        &self,
        segs: &[(usize, usize)],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) {
        const QB: usize = 4;
        for &(a, b) in segs {
            let n = b - a;
            let n8 = n.div_ceil(8) * 8;
            scratch.scores.resize(QB * n8, 0.0);
            for h in 0..self.heads {
                scratch.k.clear();
                scratch.k.resize(D * n8, 0.0);
                scratch.v.clear();
                for j in 0..n {
                    for (d, &x) in self.at(self.k, a + j, h).iter().enumerate() {
                        scratch.k[d * n8 + j] = x;
                    }
                    scratch.v.extend_from_slice(self.at(self.v, a + j, h));
                }
                for i0 in (a..b).step_by(QB) {
                    let rows = (b - i0).min(QB);
                    let mut qs = [[0.0f32; D]; QB];
                    for (r, q) in qs.iter_mut().enumerate() {
                        // Missing queries of the last block repeat the block's last one.
                        let qi = self.at(self.q, i0 + r.min(rows - 1), h);
                        q.copy_from_slice(qi);
                    }
                    for jb in (0..n8).step_by(8) {
                        let mut acc = [[0.0f32; 8]; QB];
                        for d in 0..D {
                            let kv: &[f32; 8] = scratch.k[d * n8 + jb..d * n8 + jb + 8]
                                .try_into()
                                .expect("8");
                            for r in 0..QB {
                                let qd = qs[r][d];
                                for l in 0..8 {
                                    acc[r][l] = madd::<FMA>(qd, kv[l], acc[r][l]);
                                }
                            }
                        }
                        for (r, row) in acc.iter().enumerate() {
                            scratch.scores[r * n8 + jb..r * n8 + jb + 8].copy_from_slice(row);
                        }
                    }
                    for r in 0..rows {
                        let sc = &mut scratch.scores[r * n8..(r + 1) * n8];
                        sc[n..].fill(f32::NEG_INFINITY);
                        let sum = softmax_numerators(sc);
                        let mut acc = [0.0f32; D];
                        for (&w, vj) in sc[..n].iter().zip(scratch.v.chunks_exact(D)) {
                            let vj: &[f32; D] = vj.try_into().expect("head size");
                            for d in 0..D {
                                acc[d] = madd::<FMA>(w, vj[d], acc[d]);
                            }
                        }
                        let inv = 1.0 / sum;
                        let o0 = ((i0 + r) * self.heads + h) * D;
                        for (o, x) in out[o0..o0 + D].iter_mut().zip(acc) {
                            *o = x * inv;
                        }
                    }
                }
            }
        }
    }

    /// Any head size.
    #[inline(always)]
    fn attend_any<const FMA: bool>(
        &self,
        segs: &[(usize, usize)],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) {
        let dim = self.dim;
        for &(a, b) in segs {
            scratch.scores.resize(b - a, 0.0);
            for h in 0..self.heads {
                for i in a..b {
                    let qi = self.at(self.q, i, h);
                    for (s, j) in scratch.scores.iter_mut().zip(a..b) {
                        *s = qi
                            .iter()
                            .zip(self.at(self.k, j, h))
                            .fold(0.0, |acc, (&x, &y)| madd::<FMA>(x, y, acc));
                    }
                    let sum = softmax_numerators(&mut scratch.scores);
                    let inv = 1.0 / sum;
                    let o0 = (i * self.heads + h) * dim;
                    let o = &mut out[o0..o0 + dim];
                    o.fill(0.0);
                    for (&w, j) in scratch.scores.iter().zip(a..b) {
                        for (o, &x) in o.iter_mut().zip(self.at(self.v, j, h)) {
                            *o = madd::<FMA>(w, x, *o);
                        }
                    }
                    for o in o.iter_mut() {
                        *o *= inv;
                    }
                }
            }
        }
    }
}

/// `a·b + c`, fused where the code is compiled for FMA.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// Replaces `scores` by `exp(score - max)` and returns their sum, with eight independent
/// partial maxima and sums (so that both loops vectorize).
#[inline(always)]
fn softmax_numerators(scores: &mut [f32]) -> f32 {
    let mut mx = [f32::NEG_INFINITY; 8];
    let chunks = scores.chunks_exact(8);
    let mut max = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for l in 0..8 {
            mx[l] = mx[l].max(c[l]);
        }
    }
    max = mx.iter().copied().fold(max, f32::max);
    for s in scores.iter_mut() {
        *s = exp(*s - max);
    }
    let mut sm = [0.0f32; 8];
    let chunks = scores.chunks_exact(8);
    let mut sum: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..8 {
            sm[l] += c[l];
        }
    }
    sum += sm.iter().sum::<f32>();
    sum
}

/// `e^x` for `x <= 0` (what a shifted softmax needs), in branch-free arithmetic the compiler
/// vectorizes: `x = n·ln 2 + r` with `|r| <= ln 2 / 2`, `e^r` from Cephes' `expf` polynomial
/// (relative error about 1e-7), times `2^n` built in the exponent bits. `n` is rounded by
/// adding 1.5·2^23, which leaves it in the low mantissa bits. Below -87 (where `e^x` leaves
/// the normal floats, and masked keys at minus infinity) it returns 0; NaN stays NaN.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12_582_912.0; // 1.5·2^23
    // ln 2 split in two, so that n·C1 is exact.
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let c = x.clamp(-87.0, 0.0);
    let t = c * LOG2E + ROUND;
    let n = t - ROUND;
    let r = c - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // The low 9 bits of `t`'s representation are n (two's complement); n + 127 is in 1..=127.
    let scale = f32::from_bits(t.to_bits().wrapping_add(127) << 23);
    let y = if x < -87.0 { 0.0 } else { e * scale };
    if x.is_nan() { x } else { y }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_start_at_row_start_and_at_every_position_zero() {
        assert_eq!(segments(&[0, 1, 2, 0, 1, 0]), [(0, 3), (3, 5), (5, 6)]);
        // A row that does not begin at position 0 still has its first segment at token 0.
        assert_eq!(segments(&[5, 6, 0, 0]), [(0, 2), (2, 3), (3, 4)]);
        assert_eq!(segments(&[]), []);
    }

    #[test]
    fn attention_inside_one_segment_matches_a_direct_computation() {
        // One row, 3 tokens in one segment then 1 alone; 1 head of size 2.
        let q = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 3.0, -1.0];
        let k = [0.5, 0.0, 0.0, 2.0, 1.0, 1.0, 9.0, 9.0];
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let row = Row {
            q: &q,
            k: &k,
            v: &v,
            heads: 1,
            dim: 2,
        };
        let mut out = [0.0f32; 8];
        row.attend(&segments(&[0, 1, 2, 0]), &mut out, &mut Scratch::default());
        for i in 0..3 {
            let s: Vec<f64> = (0..3)
                .map(|j| (q[2 * i] * k[2 * j] + q[2 * i + 1] * k[2 * j + 1]) as f64)
                .collect();
            let m = s.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..2 {
                let want: f64 = (0..3).map(|j| e[j] / z * v[2 * j + c] as f64).sum();
                assert!((out[2 * i + c] as f64 - want).abs() < 1e-6, "{out:?}");
            }
        }
        // A segment of one token attends to itself: its output is its own value.
        assert_eq!(&out[6..], &[7.0, 8.0]);
    }

    #[test]
    fn exp_matches_the_standard_library_for_non_positive_arguments() {
        for i in 0..=87_000 {
            let x = -(i as f32) / 1000.0;
            let (got, want) = (exp(x), x.exp());
            if x < -87.0 {
                continue;
            }
            assert!(
                (got - want).abs() <= 2e-7 * want,
                "exp({x}) = {got}, want {want}"
            );
        }
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(-1e30), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn every_head_size_path_agrees_with_a_direct_computation() {
        // Head sizes 32 and 64 (fixed paths), 40 and 5 (any size); 2 heads; one row of 19
        // tokens in segments of 13 (several blocks of queries and keys), 2, 1 and 3.
        let positions: Vec<i32> = [13, 2, 1, 3].iter().flat_map(|&n| 0..n).collect();
        let segs = segments(&positions);
        let len = positions.len();
        for dim in [32usize, 64, 40, 5] {
            let heads = 2;
            let n = len * heads * dim;
            let f = |seed: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| (((i * 7 + seed * 13) % 17) as f32 - 8.0) / 8.0)
                    .collect()
            };
            let (q, k, v) = (f(1), f(2), f(3));
            let row = Row {
                q: &q,
                k: &k,
                v: &v,
                heads,
                dim,
            };
            let mut out = vec![0.0f32; n];
            row.attend(&segs, &mut out, &mut Scratch::default());
            for &(a, b) in &segs {
                for i in a..b {
                    for h in 0..heads {
                        let at = |t: usize| (t * heads + h) * dim;
                        let s: Vec<f64> = (a..b)
                            .map(|j| (0..dim).map(|e| (q[at(i) + e] * k[at(j) + e]) as f64).sum())
                            .collect();
                        let m = s.iter().cloned().fold(f64::MIN, f64::max);
                        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                        let z: f64 = e.iter().sum();
                        for c in 0..dim {
                            let want: f64 =
                                (a..b).map(|j| e[j - a] * v[at(j) + c] as f64).sum::<f64>() / z;
                            let got = out[at(i) + c] as f64;
                            assert!(
                                (got - want).abs() < 1e-5,
                                "dim {dim}, token {i}, head {h}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
