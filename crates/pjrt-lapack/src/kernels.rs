//! The handlers' bodies: one generic function per LAPACK routine, over the element type.
//!
//! Each follows the operands, results, attributes and layouts of the custom call JAX emits for
//! it (`jax/_src/lax/linalg.py`): matrices arrive as a batch of column-major matrices (the
//! custom call's `operand_layouts`), leading dimensions are batch dimensions, results that
//! alias an operand (`output_operand_aliases`) are written in place, LAPACK's `info` is
//! returned per matrix and JAX turns a nonzero `info` into NaNs. Every step that could reach
//! LAPACK's `xerbla` (which may stop the process) is checked first: shapes, element types,
//! option characters, and 32-bit sizes.
//!
//! Order inside every kernel, which keeps the borrows sound: check every buffer, copy the
//! read-only operands out, copy aliased operands into their results with raw copies, and only
//! then take mutable views of the results (which XLA gives as distinct buffers; checked).

// Batches are walked by matrix index: every buffer advances by its own stride per matrix.
#![allow(clippy::needless_range_loop)]

use std::ffi::c_void;
use std::ptr;

use pjrt::ErrorCode;
use pjrt::ffi::{CallFrame, FfiBuffer, FfiError};
use pjrt_sys::xla_ffi as xf;

use crate::library::{self, Library};
use crate::scalar::*;

type R<T> = Result<T, FfiError>;

/// Shape facts of a batch of matrices.
struct Mats {
    /// Batch dimensions.
    batch: Vec<i64>,
    /// Number of matrices.
    count: usize,
    /// Rows and columns of each.
    rows: usize,
    cols: usize,
}

fn lib() -> R<&'static Library> {
    library::get().map_err(|e| FfiError::new(ErrorCode::FailedPrecondition, e))
}

/// A LAPACK routine of element type `T` (`base` without the type prefix, e.g. `getrf`).
///
/// # Safety
/// `F` must be the C signature of that routine.
unsafe fn routine<T: Elem, F: Copy>(lib: &Library, base: &str) -> R<F> {
    // SAFETY: passed on to the caller.
    unsafe { lib.func::<F>(&format!("{}{base}_", T::PREFIX)) }
        .map_err(|e| FfiError::new(ErrorCode::FailedPrecondition, e))
}

fn dims_usize(dims: &[i64]) -> R<Vec<usize>> {
    dims.iter()
        .map(|&d| usize::try_from(d).map_err(|_| FfiError::invalid("negative dimension")))
        .collect()
}

/// Splits `b` into batch dimensions and a `rows × cols` matrix. Errors: rank below 2, wrong
/// element type, sizes that overflow.
fn matrices<T: Elem>(b: &FfiBuffer<'_>, what: &str) -> R<Mats> {
    if b.dtype != T::DTYPE {
        return Err(FfiError::invalid(format!(
            "{what}: element type {} where {} was expected",
            type_name(b.dtype),
            type_name(T::DTYPE)
        )));
    }
    if b.dims.len() < 2 {
        return Err(FfiError::invalid(format!(
            "{what}: a matrix needs at least 2 dimensions, got {:?}",
            b.dims
        )));
    }
    let d = dims_usize(b.dims)?;
    let (rows, cols) = (d[d.len() - 2], d[d.len() - 1]);
    let count = d[..d.len() - 2]
        .iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .ok_or_else(|| FfiError::invalid("batch size overflows"))?;
    b.elements()
        .ok_or_else(|| FfiError::invalid(format!("{what}: size overflows")))?;
    Ok(Mats {
        batch: b.dims[..b.dims.len() - 2].to_vec(),
        count,
        rows,
        cols,
    })
}

/// Checks that `b` has element type `dtype` and dimensions `batch ++ tail`.
fn expect(
    b: &FfiBuffer<'_>,
    dtype: xf::XLA_FFI_DataType,
    batch: &[i64],
    tail: &[usize],
    what: &str,
) -> R<()> {
    let mut want: Vec<i64> = batch.to_vec();
    want.extend(tail.iter().map(|&t| t as i64));
    if b.dtype != dtype || b.dims != want.as_slice() {
        return Err(FfiError::invalid(format!(
            "{what}: expected {}{want:?}, got {}{:?}",
            type_name(dtype),
            type_name(b.dtype),
            b.dims
        )));
    }
    Ok(())
}

const S32: xf::XLA_FFI_DataType = xf::XLA_FFI_DataType_S32;

/// XLA's name of an element type, for messages.
fn type_name(t: xf::XLA_FFI_DataType) -> String {
    match t {
        xf::XLA_FFI_DataType_F32 => "f32".into(),
        xf::XLA_FFI_DataType_F64 => "f64".into(),
        xf::XLA_FFI_DataType_C64 => "c64".into(),
        xf::XLA_FFI_DataType_C128 => "c128".into(),
        xf::XLA_FFI_DataType_S32 => "s32".into(),
        xf::XLA_FFI_DataType_S64 => "s64".into(),
        xf::XLA_FFI_DataType_F16 => "f16".into(),
        xf::XLA_FFI_DataType_BF16 => "bf16".into(),
        other => format!("type {other}"),
    }
}

/// A size as LAPACK's 32-bit integer. Errors: above `i32::MAX`.
fn int(v: usize) -> R<i32> {
    i32::try_from(v).map_err(|_| {
        FfiError::invalid(format!(
            "size {v} is too large for LAPACK's 32-bit integers"
        ))
    })
}

/// Most floating-point operations one custom call may ask LAPACK for: 10^12 by default
/// (tens of seconds on one core), `TPUBOX_LAPACK_MAX_FLOP` to change it. A call that would do
/// more fails with `RESOURCE_EXHAUSTED` before LAPACK runs: XLA cannot interrupt a custom
/// call, so this bounds how long one tenant's program can hold an execution slot.
pub fn max_flop() -> f64 {
    std::env::var("TPUBOX_LAPACK_MAX_FLOP")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| *v > 0.0)
        .unwrap_or(1e12)
}

fn cost(target: &str, count: usize, per_matrix: f64) -> R<()> {
    let total = count as f64 * per_matrix;
    let limit = max_flop();
    if total > limit {
        return Err(FfiError::new(
            ErrorCode::ResourceExhausted,
            format!(
                "{target}: about {total:.3e} floating-point operations, above the limit of {limit:.3e} per custom call (TPUBOX_LAPACK_MAX_FLOP)"
            ),
        ));
    }
    Ok(())
}

fn byte_range(b: &FfiBuffer<'_>, elem: usize) -> (usize, usize) {
    let start = b.data as usize;
    (start, start + b.elements().unwrap_or(0) * elem)
}

/// Errors unless the results' memory is pairwise disjoint.
fn distinct(rets: &[(&FfiBuffer<'_>, usize)]) -> R<()> {
    for (i, (a, ea)) in rets.iter().enumerate() {
        for (b, eb) in &rets[i + 1..] {
            let (a0, a1) = byte_range(a, *ea);
            let (b0, b1) = byte_range(b, *eb);
            if a0 < b1 && b0 < a1 {
                return Err(FfiError::invalid("two results share memory"));
            }
        }
    }
    Ok(())
}

fn check_ptr<T>(b: &FfiBuffer<'_>, len: usize) -> R<()> {
    if len > 0 && (b.data.is_null() || !(b.data as usize).is_multiple_of(std::mem::align_of::<T>()))
    {
        return Err(FfiError::invalid("buffer is null or misaligned"));
    }
    Ok(())
}

/// A copy of operand `b`'s `len` elements.
fn read<T: Copy>(b: &FfiBuffer<'_>, len: usize) -> R<Vec<T>> {
    check_ptr::<T>(b, len)?;
    if len == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: `b` was checked to hold `len` elements of `T` (element type and dimensions), its
    // pointer is non-null and aligned, and no mutable view of any buffer exists yet.
    Ok(unsafe { std::slice::from_raw_parts(b.data.cast::<T>(), len) }.to_vec())
}

/// Copies operand `src` into result `dst` (`len` elements of `T`) unless XLA aliased them.
fn copy_in<T>(src: &FfiBuffer<'_>, dst: &FfiBuffer<'_>, len: usize) -> R<()> {
    check_ptr::<T>(src, len)?;
    check_ptr::<T>(dst, len)?;
    if len > 0 && src.data != dst.data {
        // SAFETY: both buffers hold `len` elements of `T` (checked by the caller); `ptr::copy`
        // allows overlap; no reference to either exists.
        unsafe { ptr::copy(src.data.cast::<T>(), dst.data.cast::<T>(), len) };
    }
    Ok(())
}

/// A mutable view of result `b` (`len` elements of `T`).
///
/// # Safety
/// `b` must hold `len` elements of `T` (checked element type and dimensions), and no other
/// view of its memory may be alive while this one is.
unsafe fn view<'a, T>(b: &FfiBuffer<'a>, len: usize) -> R<&'a mut [T]> {
    check_ptr::<T>(b, len)?;
    if len == 0 {
        return Ok(&mut []);
    }
    // SAFETY: see the function's contract; pointer checked non-null and aligned.
    Ok(unsafe { std::slice::from_raw_parts_mut(b.data.cast::<T>(), len) })
}

fn at<T>(s: &mut [T], i: usize, len: usize) -> *mut T {
    s[i * len..(i + 1) * len].as_mut_ptr()
}

fn uplo(f: &CallFrame<'_>) -> R<u8> {
    one_of(f, "uplo", b"LU")
}

fn one_of(f: &CallFrame<'_>, name: &str, allowed: &[u8]) -> R<u8> {
    let v = f.attr_u8(name)?;
    if allowed.contains(&v) {
        Ok(v)
    } else {
        Err(FfiError::invalid(format!(
            "attribute {name} = {:?} is not one of {:?}",
            v as char,
            String::from_utf8_lossy(allowed)
        )))
    }
}

/// Workspace length: LAPACK's answer to a query (`lwork = -1`), at least `min`.
fn lwork<T: Elem>(query: T, min: usize) -> usize {
    query.work_size().max(min).max(1)
}

/// LU with partial pivoting: `lapack_?getrf_ffi`. Operand `a [.., m, n]`; results `lu`
/// (aliases `a`), `ipiv: s32 [.., min(m, n)]` (1-based, as LAPACK returns them), `info: s32 [..]`.
pub(crate) fn getrf<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let x = f.arg(0)?;
    let s = matrices::<T>(&x, "operand")?;
    let (m, n, b) = (s.rows, s.cols, s.count);
    let k = m.min(n);
    let (xo, ipiv, info) = (f.ret(0)?, f.ret(1)?, f.ret(2)?);
    expect(&xo, T::DTYPE, &s.batch, &[m, n], "result 0")?;
    expect(&ipiv, S32, &s.batch, &[k], "pivots")?;
    expect(&info, S32, &s.batch, &[], "info")?;
    distinct(&[(&xo, size_of::<T>()), (&ipiv, 4), (&info, 4)])?;
    cost("getrf", b, (m * n * k) as f64)?;
    let lib = lib()?;
    // SAFETY: `Getrf<T>` is `?getrf`'s signature.
    let func: Getrf<T> = unsafe { routine::<T, _>(lib, "getrf") }?;
    copy_in::<T>(&x, &xo, b * m * n)?;
    // SAFETY: dimensions and element types checked above; the results are distinct.
    let (a, p, inf) = unsafe {
        (
            view::<T>(&xo, b * m * n)?,
            view::<i32>(&ipiv, b * k)?,
            view::<i32>(&info, b)?,
        )
    };
    let (mi, ni, ld) = (int(m)?, int(n)?, int(m.max(1))?);
    for i in 0..b {
        // SAFETY: `a` holds `m·n` elements for matrix `i` with leading dimension `m`, `p`
        // holds `min(m, n)` pivots; all sizes fit LAPACK's integers.
        unsafe { func(&mi, &ni, at(a, i, m * n), &ld, at(p, i, k), &mut inf[i]) };
    }
    Ok(())
}

/// Triangular solve: `lapack_?trsm_ffi`. Operands `a [.., k, k]` (triangular), `b [.., m, n]`;
/// result `x` (aliases `b`) with `op(a)·x = b` (side `L`, k = m) or `x·op(a) = b` (side `R`,
/// k = n). Attributes `side`, `uplo`, `trans_x` (`N`, `T`, `C`), `diag` (`U` unit, `N`).
pub(crate) fn trsm<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let side = one_of(f, "side", b"LR")?;
    let up = uplo(f)?;
    let trans = one_of(f, "trans_x", b"NTC")?;
    let diag = one_of(f, "diag", b"UN")?;
    let (a, y) = (f.arg(0)?, f.arg(1)?);
    let s = matrices::<T>(&y, "right-hand side")?;
    let (m, n, b) = (s.rows, s.cols, s.count);
    let k = if side == b'L' { m } else { n };
    expect(&a, T::DTYPE, &s.batch, &[k, k], "triangular operand")?;
    let yo = f.ret(0)?;
    expect(&yo, T::DTYPE, &s.batch, &[m, n], "result")?;
    cost("trsm", b, (k * k * if side == b'L' { n } else { m }) as f64)?;
    let lib = lib()?;
    // SAFETY: BLAS `?trsm`'s signature.
    let func: Trsm<T> = unsafe { routine::<T, _>(lib, "trsm") }?;
    let a = read::<T>(&a, b * k * k)?;
    copy_in::<T>(&y, &yo, b * m * n)?;
    // SAFETY: checked above; `yo` is the only result.
    let x = unsafe { view::<T>(&yo, b * m * n)? };
    let one = T::one();
    let (mi, ni, lda, ldb) = (int(m)?, int(n)?, int(k.max(1))?, int(m.max(1))?);
    for i in 0..b {
        // SAFETY: matrix `i` of `a` has `k·k` elements (leading dimension `k`), of `x` `m·n`
        // (leading dimension `m`); option characters were checked.
        unsafe {
            func(
                &side,
                &up,
                &trans,
                &diag,
                &mi,
                &ni,
                &one,
                a[i * k * k..].as_ptr(),
                &lda,
                at(x, i, m * n),
                &ldb,
                1,
                1,
                1,
                1,
            )
        };
    }
    Ok(())
}

/// Cholesky: `lapack_?potrf_ffi`. Operand `a [.., n, n]`; results the factor (aliases `a`; the
/// other triangle keeps `a`'s values, as LAPACK leaves it) and `info: s32 [..]`. Attribute
/// `uplo`.
pub(crate) fn potrf<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let up = uplo(f)?;
    let x = f.arg(0)?;
    let s = square::<T>(&x)?;
    let (n, b) = (s.rows, s.count);
    let (xo, info) = (f.ret(0)?, f.ret(1)?);
    expect(&xo, T::DTYPE, &s.batch, &[n, n], "result 0")?;
    expect(&info, S32, &s.batch, &[], "info")?;
    distinct(&[(&xo, size_of::<T>()), (&info, 4)])?;
    cost("potrf", b, (n * n * n) as f64 / 3.0)?;
    let lib = lib()?;
    // SAFETY: `?potrf`'s signature.
    let func: Potrf<T> = unsafe { routine::<T, _>(lib, "potrf") }?;
    copy_in::<T>(&x, &xo, b * n * n)?;
    // SAFETY: checked above; distinct results.
    let (a, inf) = unsafe { (view::<T>(&xo, b * n * n)?, view::<i32>(&info, b)?) };
    let (ni, ld) = (int(n)?, int(n.max(1))?);
    for i in 0..b {
        // SAFETY: matrix `i` has `n·n` elements, leading dimension `n`.
        unsafe { func(&up, &ni, at(a, i, n * n), &ld, &mut inf[i], 1) };
    }
    Ok(())
}

fn square<T: Elem>(x: &FfiBuffer<'_>) -> R<Mats> {
    let s = matrices::<T>(x, "operand")?;
    if s.rows != s.cols {
        return Err(FfiError::invalid(format!(
            "operand: a square matrix was expected, got {} × {}",
            s.rows, s.cols
        )));
    }
    Ok(s)
}

/// QR in Householder form: `lapack_?geqrf_ffi`. Operand `a [.., m, n]`; results `a` (aliases;
/// R above the diagonal, reflectors below) and `tau [.., min(m, n)]`.
pub(crate) fn geqrf<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let x = f.arg(0)?;
    let s = matrices::<T>(&x, "operand")?;
    let (m, n, b) = (s.rows, s.cols, s.count);
    let k = m.min(n);
    let (xo, tau) = (f.ret(0)?, f.ret(1)?);
    expect(&xo, T::DTYPE, &s.batch, &[m, n], "result 0")?;
    expect(&tau, T::DTYPE, &s.batch, &[k], "tau")?;
    distinct(&[(&xo, size_of::<T>()), (&tau, size_of::<T>())])?;
    cost("geqrf", b, 2.0 * (m * n * k) as f64)?;
    let lib = lib()?;
    // SAFETY: `?geqrf`'s signature.
    let func: Geqrf<T> = unsafe { routine::<T, _>(lib, "geqrf") }?;
    copy_in::<T>(&x, &xo, b * m * n)?;
    // SAFETY: checked above; distinct results.
    let (a, t) = unsafe { (view::<T>(&xo, b * m * n)?, view::<T>(&tau, b * k)?) };
    if b == 0 {
        return Ok(());
    }
    let (mi, ni, ld) = (int(m)?, int(n)?, int(m.max(1))?);
    let (mut q, mut info, minus1) = (T::default(), 0, -1);
    // SAFETY: a workspace query (`lwork = -1`) only writes `q`.
    unsafe {
        func(
            &mi,
            &ni,
            at(a, 0, m * n),
            &ld,
            at(t, 0, k),
            &mut q,
            &minus1,
            &mut info,
        )
    };
    let lw = lwork(q, n);
    let mut work = vec![T::default(); lw];
    let lwi = int(lw)?;
    for i in 0..b {
        // SAFETY: matrix `i` has `m·n` elements (leading dimension `m`), `tau` `min(m, n)`,
        // `work` `lw` ≥ max(1, n).
        unsafe {
            func(
                &mi,
                &ni,
                at(a, i, m * n),
                &ld,
                at(t, i, k),
                work.as_mut_ptr(),
                &lwi,
                &mut info,
            )
        };
    }
    Ok(())
}

/// The orthogonal/unitary factor: `lapack_?orgqr_ffi` / `lapack_?ungqr_ffi`. Operands
/// `a [.., m, n]` (reflectors, m ≥ n), `tau [.., k]` (k ≤ n); result `q [.., m, n]` (aliases
/// `a`).
pub(crate) fn orgqr<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let (x, tau) = (f.arg(0)?, f.arg(1)?);
    let s = matrices::<T>(&x, "operand")?;
    let (m, n, b) = (s.rows, s.cols, s.count);
    let k = match tau.dims.last() {
        Some(&k) if k >= 0 => k as usize,
        _ => return Err(FfiError::invalid("tau: a vector per matrix was expected")),
    };
    expect(&tau, T::DTYPE, &s.batch, &[k], "tau")?;
    if !(m >= n && n >= k) {
        return Err(FfiError::invalid(format!(
            "orgqr needs rows ≥ columns ≥ reflectors, got {m}, {n}, {k}"
        )));
    }
    let xo = f.ret(0)?;
    expect(&xo, T::DTYPE, &s.batch, &[m, n], "result")?;
    cost("orgqr", b, 2.0 * (m * n * n) as f64)?;
    let lib = lib()?;
    let base = if T::COMPLEX { "ungqr" } else { "orgqr" };
    // SAFETY: `?orgqr`/`?ungqr` share this signature.
    let func: Orgqr<T> = unsafe { routine::<T, _>(lib, base) }?;
    let tau = read::<T>(&tau, b * k)?;
    copy_in::<T>(&x, &xo, b * m * n)?;
    // SAFETY: checked above; one result.
    let a = unsafe { view::<T>(&xo, b * m * n)? };
    if b == 0 {
        return Ok(());
    }
    let (mi, ni, ki, ld) = (int(m)?, int(n)?, int(k)?, int(m.max(1))?);
    let (mut q, mut info, minus1) = (T::default(), 0, -1);
    // SAFETY: a workspace query only writes `q`.
    unsafe {
        func(
            &mi,
            &ni,
            &ki,
            at(a, 0, m * n),
            &ld,
            tau.as_ptr(),
            &mut q,
            &minus1,
            &mut info,
        )
    };
    let lw = lwork(q, n);
    let mut work = vec![T::default(); lw];
    let lwi = int(lw)?;
    for i in 0..b {
        // SAFETY: sizes as checked above; `tau` holds `k` per matrix.
        unsafe {
            func(
                &mi,
                &ni,
                &ki,
                at(a, i, m * n),
                &ld,
                tau[i * k..].as_ptr(),
                work.as_mut_ptr(),
                &lwi,
                &mut info,
            )
        };
    }
    Ok(())
}

/// Fills `outs` with NaN and sets `info` to 1 when matrix `a` has a non-finite entry, and
/// says so: the iterative routines are not run on NaN or infinity (some LAPACK builds loop
/// for a long time on them); JAX turns `info ≠ 0` into NaN results, as for a LAPACK failure.
fn non_finite<T: Elem>(a: &[T]) -> bool {
    !a.iter().all(|v| v.finite())
}

/// Symmetric / Hermitian eigendecomposition: `lapack_?syevd_ffi` / `lapack_?heevd_ffi`.
/// Operand `a [.., n, n]`; results the eigenvectors (aliases `a`, as columns), `w: real [.., n]`
/// (ascending), `info: s32 [..]`. Attributes `mode` (`V` with vectors, `N` without), `uplo`.
pub(crate) fn syevd<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let jobz = one_of(f, "mode", b"VN")?;
    let up = uplo(f)?;
    let x = f.arg(0)?;
    let s = square::<T>(&x)?;
    let (n, b) = (s.rows, s.count);
    let (xo, w, info) = (f.ret(0)?, f.ret(1)?, f.ret(2)?);
    expect(&xo, T::DTYPE, &s.batch, &[n, n], "result 0")?;
    expect(&w, <T::Real as Elem>::DTYPE, &s.batch, &[n], "eigenvalues")?;
    expect(&info, S32, &s.batch, &[], "info")?;
    distinct(&[
        (&xo, size_of::<T>()),
        (&w, size_of::<T::Real>()),
        (&info, 4),
    ])?;
    cost("syevd", b, 10.0 * (n * n * n) as f64)?;
    let lib = lib()?;
    copy_in::<T>(&x, &xo, b * n * n)?;
    // SAFETY: checked above; distinct results.
    let (a, w, inf) = unsafe {
        (
            view::<T>(&xo, b * n * n)?,
            view::<T::Real>(&w, b * n)?,
            view::<i32>(&info, b)?,
        )
    };
    if b == 0 {
        return Ok(());
    }
    let (ni, ld, minus1) = (int(n)?, int(n.max(1))?, -1);
    let (mut q, mut rq, mut iq, mut qi) = (T::default(), T::Real::default(), 0i32, 0);
    if T::COMPLEX {
        // SAFETY: `?heevd`'s signature (complex types).
        let func: Heevd<T, T::Real> = unsafe { routine::<T, _>(lib, "heevd") }?;
        // SAFETY: a workspace query only writes `q`, `rq` and `iq`.
        unsafe {
            func(
                &jobz,
                &up,
                &ni,
                at(a, 0, n * n),
                &ld,
                at(w, 0, n),
                &mut q,
                &minus1,
                &mut rq,
                &minus1,
                &mut iq,
                &minus1,
                &mut qi,
                1,
                1,
            )
        };
        let (lw, lrw, liw) = (
            lwork(q, 2 * n + n * n),
            lwork(rq, 1 + 5 * n + 2 * n * n),
            (iq.max(0) as usize).max(3 + 5 * n),
        );
        let (mut work, mut rwork, mut iwork) = (
            vec![T::default(); lw],
            vec![T::Real::default(); lrw],
            vec![0i32; liw],
        );
        let (lwi, lrwi, liwi) = (int(lw)?, int(lrw)?, int(liw)?);
        for i in 0..b {
            if non_finite(&a[i * n * n..(i + 1) * n * n]) {
                nan_fill(&mut a[i * n * n..(i + 1) * n * n]);
                nan_fill(&mut w[i * n..(i + 1) * n]);
                inf[i] = 1;
                continue;
            }
            // SAFETY: workspaces sized from LAPACK's query and its documented minimums.
            unsafe {
                func(
                    &jobz,
                    &up,
                    &ni,
                    at(a, i, n * n),
                    &ld,
                    at(w, i, n),
                    work.as_mut_ptr(),
                    &lwi,
                    rwork.as_mut_ptr(),
                    &lrwi,
                    iwork.as_mut_ptr(),
                    &liwi,
                    &mut inf[i],
                    1,
                    1,
                )
            };
        }
    } else {
        // SAFETY: `?syevd`'s signature (real types).
        let func: Syevd<T, T::Real> = unsafe { routine::<T, _>(lib, "syevd") }?;
        // SAFETY: a workspace query only writes `q` and `iq`.
        unsafe {
            func(
                &jobz,
                &up,
                &ni,
                at(a, 0, n * n),
                &ld,
                at(w, 0, n),
                &mut q,
                &minus1,
                &mut iq,
                &minus1,
                &mut qi,
                1,
                1,
            )
        };
        let (lw, liw) = (
            lwork(q, 1 + 6 * n + 2 * n * n),
            (iq.max(0) as usize).max(3 + 5 * n),
        );
        let (mut work, mut iwork) = (vec![T::default(); lw], vec![0i32; liw]);
        let (lwi, liwi) = (int(lw)?, int(liw)?);
        for i in 0..b {
            if non_finite(&a[i * n * n..(i + 1) * n * n]) {
                nan_fill(&mut a[i * n * n..(i + 1) * n * n]);
                nan_fill(&mut w[i * n..(i + 1) * n]);
                inf[i] = 1;
                continue;
            }
            // SAFETY: workspaces sized from LAPACK's query and its documented minimums.
            unsafe {
                func(
                    &jobz,
                    &up,
                    &ni,
                    at(a, i, n * n),
                    &ld,
                    at(w, i, n),
                    work.as_mut_ptr(),
                    &lwi,
                    iwork.as_mut_ptr(),
                    &liwi,
                    &mut inf[i],
                    1,
                    1,
                )
            };
        }
    }
    Ok(())
}

fn nan_fill<T: Elem>(s: &mut [T]) {
    s.iter_mut().for_each(|v| *v = T::nan());
}

/// The SVD routine a call uses: divide and conquer or QR iteration, real or complex.
#[derive(Clone, Copy)]
enum Svd<T, Rl> {
    DivideR(GesddR<T, Rl>),
    DivideC(GesddC<T, Rl>),
    QrR(GesvdR<T, Rl>),
    QrC(GesvdC<T, Rl>),
}

/// Singular value decomposition: `lapack_?gesdd_ffi` (divide and conquer) and
/// `lapack_?gesvd_ffi` (QR iteration, `qr` true). Operand `a [.., m, n]`; results `a`
/// (aliases; overwritten), `s: real [.., min(m, n)]` (descending), `u [.., m, m or k]`,
/// `vt [.., n or k, n]`, `info: s32 [..]`. Attribute `mode`: `A` full, `S` thin (k columns /
/// rows), `N` singular values only (`u` and `vt` are not written).
pub(crate) fn gesdd<T: Elem>(f: &CallFrame<'_>, qr: bool) -> R<()> {
    let mode = one_of(f, "mode", b"ASN")?;
    let x = f.arg(0)?;
    let s = matrices::<T>(&x, "operand")?;
    let (m, n, b) = (s.rows, s.cols, s.count);
    let k = m.min(n);
    let (xo, sv, u, vt, info) = (f.ret(0)?, f.ret(1)?, f.ret(2)?, f.ret(3)?, f.ret(4)?);
    expect(&xo, T::DTYPE, &s.batch, &[m, n], "result 0")?;
    expect(
        &sv,
        <T::Real as Elem>::DTYPE,
        &s.batch,
        &[k],
        "singular values",
    )?;
    let ucols = match u.dims.last() {
        Some(&c) if c >= 0 => c as usize,
        _ => return Err(FfiError::invalid("u: a matrix was expected")),
    };
    let vrows = match vt.dims.len() {
        r if r >= 2 && vt.dims[r - 2] >= 0 => vt.dims[r - 2] as usize,
        _ => return Err(FfiError::invalid("vt: a matrix was expected")),
    };
    match mode {
        b'A' if ucols != m || vrows != n => {
            return Err(FfiError::invalid("mode A needs u m × m and vt n × n"));
        }
        b'S' if ucols != k || vrows != k => {
            return Err(FfiError::invalid("mode S needs u m × k and vt k × n"));
        }
        _ => {}
    }
    expect(&u, T::DTYPE, &s.batch, &[m, ucols], "u")?;
    expect(&vt, T::DTYPE, &s.batch, &[vrows, n], "vt")?;
    expect(&info, S32, &s.batch, &[], "info")?;
    let e = size_of::<T>();
    distinct(&[
        (&xo, e),
        (&sv, size_of::<T::Real>()),
        (&u, e),
        (&vt, e),
        (&info, 4),
    ])?;
    cost("gesdd", b, 25.0 * (m.max(n) * k * k) as f64)?;
    let lib = lib()?;
    copy_in::<T>(&x, &xo, b * m * n)?;
    // SAFETY: checked above; distinct results.
    let (a, sv, u, vt, inf) = unsafe {
        (
            view::<T>(&xo, b * m * n)?,
            view::<T::Real>(&sv, b * k)?,
            view::<T>(&u, b * m * ucols)?,
            view::<T>(&vt, b * vrows * n)?,
            view::<i32>(&info, b)?,
        )
    };
    if b == 0 {
        return Ok(());
    }
    let (mi, ni, lda, ldu, ldvt, minus1) = (
        int(m)?,
        int(n)?,
        int(m.max(1))?,
        int(m.max(1))?,
        int(vrows.max(1))?,
        -1,
    );
    let (mx, mn) = (m.max(n), k);
    // Real workspace of the complex routines (LAPACK 3.11's documented minimums, generous).
    let lrwork = if qr {
        5 * mn
    } else if mode == b'N' {
        7 * mn
    } else {
        (5 * mn * mn + 7 * mn).max(2 * mx * mn + 2 * mn * mn + mn)
    }
    .max(1);
    let mut rwork = vec![T::Real::default(); if T::COMPLEX { lrwork } else { 1 }];
    let mut iwork = vec![0i32; (8 * mn).max(1)];
    let (mut q, mut qi) = (T::default(), 0);
    let (uo, vo) = (m * ucols, vrows * n);
    // The routine, looked up once for the whole batch.
    let svd = match (qr, T::COMPLEX) {
        (false, false) => {
            // SAFETY: `?gesdd`'s real signature; sizes checked; workspaces sized by query.
            Svd::DivideR(unsafe { routine::<T, GesddR<T, T::Real>>(lib, "gesdd") }?)
        }
        (false, true) => {
            // SAFETY: `?gesdd`'s complex signature.
            Svd::DivideC(unsafe { routine::<T, GesddC<T, T::Real>>(lib, "gesdd") }?)
        }
        (true, false) => {
            // SAFETY: `?gesvd`'s real signature.
            Svd::QrR(unsafe { routine::<T, GesvdR<T, T::Real>>(lib, "gesvd") }?)
        }
        (true, true) => {
            // SAFETY: `?gesvd`'s complex signature.
            Svd::QrC(unsafe { routine::<T, GesvdC<T, T::Real>>(lib, "gesvd") }?)
        }
    };
    let call = |i: usize,
                a: &mut [T],
                sv: &mut [T::Real],
                u: &mut [T],
                vt: &mut [T],
                work: *mut T,
                lw: &i32,
                rwork: *mut T::Real,
                iwork: *mut i32,
                info: &mut i32|
     -> R<()> {
        let (ap, sp, up, vp) = (at(a, i, m * n), at(sv, i, k), at(u, i, uo), at(vt, i, vo));
        match svd {
            Svd::DivideR(func) => {
                // SAFETY: as above.
                unsafe {
                    func(
                        &mode, &mi, &ni, ap, &lda, sp, up, &ldu, vp, &ldvt, work, lw, iwork, info,
                        1,
                    )
                };
            }
            Svd::DivideC(func) => {
                // SAFETY: as above; `rwork` sized by the documented minimum.
                unsafe {
                    func(
                        &mode, &mi, &ni, ap, &lda, sp, up, &ldu, vp, &ldvt, work, lw, rwork, iwork,
                        info, 1,
                    )
                };
            }
            Svd::QrR(func) => {
                // SAFETY: as above.
                unsafe {
                    func(
                        &mode, &mode, &mi, &ni, ap, &lda, sp, up, &ldu, vp, &ldvt, work, lw, info,
                        1, 1,
                    )
                };
            }
            Svd::QrC(func) => {
                // SAFETY: as above.
                unsafe {
                    func(
                        &mode, &mode, &mi, &ni, ap, &lda, sp, up, &ldu, vp, &ldvt, work, lw, rwork,
                        info, 1, 1,
                    )
                };
            }
        }
        Ok(())
    };
    call(
        0,
        a,
        sv,
        u,
        vt,
        &mut q,
        &minus1,
        rwork.as_mut_ptr(),
        iwork.as_mut_ptr(),
        &mut qi,
    )?;
    let lw = lwork(q, 1);
    let mut work = vec![T::default(); lw];
    let lwi = int(lw)?;
    for i in 0..b {
        if non_finite(&a[i * m * n..(i + 1) * m * n]) {
            nan_fill(&mut sv[i * k..(i + 1) * k]);
            nan_fill(&mut u[i * uo..(i + 1) * uo]);
            nan_fill(&mut vt[i * vo..(i + 1) * vo]);
            inf[i] = 1;
            continue;
        }
        let mut info_i = 0;
        call(
            i,
            a,
            sv,
            u,
            vt,
            work.as_mut_ptr(),
            &lwi,
            rwork.as_mut_ptr(),
            iwork.as_mut_ptr(),
            &mut info_i,
        )?;
        inf[i] = info_i;
    }
    Ok(())
}

/// Eigendecomposition of a general matrix: `lapack_?geev_ffi`. Operand `a [.., n, n]`;
/// results, for real types, `wr [.., n]`, `wi [.., n]`, `vl`, `vr: complex [.., n, n]`,
/// `info`; for complex types `w [.., n]`, `vl`, `vr [.., n, n]`, `info`. Attributes
/// `compute_left`, `compute_right` (`V` or `N`). Real eigenvectors come from LAPACK packed (a
/// conjugate pair in two real columns) and are unpacked into complex columns; vectors that
/// were not asked for are zeros.
pub(crate) fn geev<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let jl = one_of(f, "compute_left", b"VN")?;
    let jr = one_of(f, "compute_right", b"VN")?;
    let x = f.arg(0)?;
    let s = square::<T>(&x)?;
    let (n, b) = (s.rows, s.count);
    let nn = n * n;
    let c = <T::Cplx as Elem>::DTYPE;
    let (rv, first_vec) = if T::COMPLEX { (1, 1) } else { (2, 2) };
    let vl_b = f.ret(first_vec)?;
    let vr_b = f.ret(first_vec + 1)?;
    let info_b = f.ret(first_vec + 2)?;
    for i in 0..rv {
        expect(
            &f.ret(i)?,
            if T::COMPLEX { c } else { T::DTYPE },
            &s.batch,
            &[n],
            "eigenvalues",
        )?;
    }
    expect(&vl_b, c, &s.batch, &[n, n], "left eigenvectors")?;
    expect(&vr_b, c, &s.batch, &[n, n], "right eigenvectors")?;
    expect(&info_b, S32, &s.batch, &[], "info")?;
    let e = size_of::<T>();
    let ce = size_of::<T::Cplx>();
    let w0 = f.ret(0)?;
    let w1 = if T::COMPLEX { None } else { Some(f.ret(1)?) };
    let mut parts = vec![(&w0, e), (&vl_b, ce), (&vr_b, ce), (&info_b, 4)];
    if let Some(w1) = &w1 {
        parts.push((w1, e));
    }
    distinct(&parts)?;
    cost("geev", b, 30.0 * (n * n * n) as f64)?;
    let lib = lib()?;
    let input = read::<T>(&x, b * nn)?;
    // SAFETY: checked above; distinct results.
    let (vl, vr, inf) = unsafe {
        (
            view::<T::Cplx>(&vl_b, b * nn)?,
            view::<T::Cplx>(&vr_b, b * nn)?,
            view::<i32>(&info_b, b)?,
        )
    };
    vl.iter_mut()
        .chain(vr.iter_mut())
        .for_each(|v| *v = <T::Cplx>::default());
    if b == 0 {
        return Ok(());
    }
    let (ni, ld, minus1) = (int(n)?, int(n.max(1))?, -1);
    let mut a = vec![T::default(); nn.max(1)];
    let mut q = T::default();
    let mut qi = 0;
    if T::COMPLEX {
        // SAFETY: checked above; `w0` is distinct from the other results.
        let w = unsafe { view::<T>(&w0, b * n)? };
        // SAFETY: `?geev`'s complex signature.
        let func: GeevC<T, T::Real> = unsafe { routine::<T, _>(lib, "geev") }?;
        let mut rwork = vec![T::Real::default(); (2 * n).max(1)];
        // Complex vl/vr are `T::Cplx` = `T`: written straight into the results.
        let (vlp, vrp) = (vl.as_mut_ptr().cast::<T>(), vr.as_mut_ptr().cast::<T>());
        // SAFETY: a workspace query only writes `q`.
        unsafe {
            func(
                &jl,
                &jr,
                &ni,
                a.as_mut_ptr(),
                &ld,
                w.as_mut_ptr(),
                vlp,
                &ld,
                vrp,
                &ld,
                &mut q,
                &minus1,
                rwork.as_mut_ptr(),
                &mut qi,
                1,
                1,
            )
        };
        let lw = lwork(q, 2 * n);
        let mut work = vec![T::default(); lw];
        let lwi = int(lw)?;
        for i in 0..b {
            a[..nn].copy_from_slice(&input[i * nn..(i + 1) * nn]);
            if non_finite(&a[..nn]) {
                nan_fill(&mut w[i * n..(i + 1) * n]);
                inf[i] = 1;
                continue;
            }
            // SAFETY: `a` is a copy of matrix `i`; `w` has `n`, `vl`/`vr` `n·n` per matrix
            // (as `T`, since `T` is complex); workspaces sized by query and minimums.
            unsafe {
                func(
                    &jl,
                    &jr,
                    &ni,
                    a.as_mut_ptr(),
                    &ld,
                    at(w, i, n),
                    vlp.add(i * nn),
                    &ld,
                    vrp.add(i * nn),
                    &ld,
                    work.as_mut_ptr(),
                    &lwi,
                    rwork.as_mut_ptr(),
                    &mut inf[i],
                    1,
                    1,
                )
            };
        }
    } else {
        let w1 = w1.ok_or_else(|| FfiError::invalid("missing imaginary parts"))?;
        // SAFETY: checked above; `w0` and `w1` are distinct results.
        let (wr, wi) = unsafe { (view::<T>(&w0, b * n)?, view::<T>(&w1, b * n)?) };
        // SAFETY: `?geev`'s real signature.
        let func: GeevR<T> = unsafe { routine::<T, _>(lib, "geev") }?;
        let (mut pl, mut pr) = (vec![T::default(); nn.max(1)], vec![T::default(); nn.max(1)]);
        // SAFETY: a workspace query only writes `q`.
        unsafe {
            func(
                &jl,
                &jr,
                &ni,
                a.as_mut_ptr(),
                &ld,
                wr.as_mut_ptr(),
                wi.as_mut_ptr(),
                pl.as_mut_ptr(),
                &ld,
                pr.as_mut_ptr(),
                &ld,
                &mut q,
                &minus1,
                &mut qi,
                1,
                1,
            )
        };
        let lw = lwork(q, 4 * n);
        let mut work = vec![T::default(); lw];
        let lwi = int(lw)?;
        for i in 0..b {
            a[..nn].copy_from_slice(&input[i * nn..(i + 1) * nn]);
            if non_finite(&a[..nn]) {
                nan_fill(&mut wr[i * n..(i + 1) * n]);
                nan_fill(&mut wi[i * n..(i + 1) * n]);
                inf[i] = 1;
                continue;
            }
            // SAFETY: `a`, `pl`, `pr` hold `n·n`; `wr`, `wi` `n` per matrix; workspace by query.
            unsafe {
                func(
                    &jl,
                    &jr,
                    &ni,
                    a.as_mut_ptr(),
                    &ld,
                    at(wr, i, n),
                    at(wi, i, n),
                    pl.as_mut_ptr(),
                    &ld,
                    pr.as_mut_ptr(),
                    &ld,
                    work.as_mut_ptr(),
                    &lwi,
                    &mut inf[i],
                    1,
                    1,
                )
            };
            if inf[i] != 0 {
                continue;
            }
            let wi_i = &wi[i * n..(i + 1) * n];
            if jl == b'V' {
                unpack(n, wi_i, &pl, &mut vl[i * nn..(i + 1) * nn]);
            }
            if jr == b'V' {
                unpack(n, wi_i, &pr, &mut vr[i * nn..(i + 1) * nn]);
            }
        }
    }
    Ok(())
}

/// LAPACK's real eigenvectors as complex columns: a real eigenvalue's vector is column `j`; a
/// conjugate pair (`wi[j] > 0`) has `v_j = col_j + i·col_{j+1}` and `v_{j+1}` its conjugate.
fn unpack<T: Elem>(n: usize, wi: &[T], packed: &[T], out: &mut [T::Cplx]) {
    let zero = T::default();
    let re = |v: T| v.re();
    let mut j = 0;
    while j < n {
        if wi[j] == zero || j + 1 == n {
            for r in 0..n {
                out[j * n + r] = T::cplx(re(packed[j * n + r]), T::Real::default());
            }
            j += 1;
        } else {
            for r in 0..n {
                let (a, b) = (re(packed[j * n + r]), re(packed[(j + 1) * n + r]));
                out[j * n + r] = T::cplx(a, b);
                out[(j + 1) * n + r] = T::cplx(a, b.neg());
            }
            j += 2;
        }
    }
}

/// Schur decomposition: `lapack_?gees_ffi`. Operand `a [.., n, n]`; results `t` (aliases
/// `a`), `vs [.., n, n]` (Schur vectors), then for real types `wr`, `wi [.., n]`, for complex
/// `w [.., n]`, then `sdim: s32 [..]` and `info: s32 [..]`. Attributes `mode` (`V` or `N`
/// vectors), `sort` (only `N`: JAX never sorts).
pub(crate) fn gees<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let jobvs = one_of(f, "mode", b"VN")?;
    let sort = one_of(f, "sort", b"N")?;
    let x = f.arg(0)?;
    let s = square::<T>(&x)?;
    let (n, b) = (s.rows, s.count);
    let nn = n * n;
    let nw = if T::COMPLEX { 1 } else { 2 };
    let (xo, vs_b) = (f.ret(0)?, f.ret(1)?);
    expect(&xo, T::DTYPE, &s.batch, &[n, n], "result 0")?;
    expect(&vs_b, T::DTYPE, &s.batch, &[n, n], "Schur vectors")?;
    let w0 = f.ret(2)?;
    expect(&w0, T::DTYPE, &s.batch, &[n], "eigenvalues")?;
    let w1 = if nw == 2 { Some(f.ret(3)?) } else { None };
    if let Some(w1) = &w1 {
        expect(
            w1,
            T::DTYPE,
            &s.batch,
            &[n],
            "eigenvalues (imaginary parts)",
        )?;
    }
    let (sdim_b, info_b) = (f.ret(2 + nw)?, f.ret(3 + nw)?);
    expect(&sdim_b, S32, &s.batch, &[], "sdim")?;
    expect(&info_b, S32, &s.batch, &[], "info")?;
    let e = size_of::<T>();
    let mut parts = vec![(&xo, e), (&vs_b, e), (&w0, e), (&sdim_b, 4), (&info_b, 4)];
    if let Some(w1) = &w1 {
        parts.push((w1, e));
    }
    distinct(&parts)?;
    cost("gees", b, 30.0 * (n * n * n) as f64)?;
    let lib = lib()?;
    copy_in::<T>(&x, &xo, b * nn)?;
    // SAFETY: checked above; distinct results.
    let (a, vs, w, sdim, inf) = unsafe {
        (
            view::<T>(&xo, b * nn)?,
            view::<T>(&vs_b, b * nn)?,
            view::<T>(&w0, b * n)?,
            view::<i32>(&sdim_b, b)?,
            view::<i32>(&info_b, b)?,
        )
    };
    let wi: &mut [T] = match &w1 {
        // SAFETY: checked above; distinct from the other results.
        Some(w1) => unsafe { view::<T>(w1, b * n)? },
        None => &mut [],
    };
    if b == 0 {
        return Ok(());
    }
    let (ni, ld, minus1) = (int(n)?, int(n.max(1))?, -1);
    let mut bwork = vec![0i32; n.max(1)];
    let (mut q, mut qi, mut qs) = (T::default(), 0, 0);
    let select: *const c_void = ptr::null();
    if T::COMPLEX {
        // SAFETY: `?gees`'s complex signature.
        let func: GeesC<T, T::Real> = unsafe { routine::<T, _>(lib, "gees") }?;
        let mut rwork = vec![T::Real::default(); n.max(1)];
        // SAFETY: a workspace query only writes `q`.
        unsafe {
            func(
                &jobvs,
                &sort,
                select,
                &ni,
                at(a, 0, nn),
                &ld,
                &mut qs,
                at(w, 0, n),
                at(vs, 0, nn),
                &ld,
                &mut q,
                &minus1,
                rwork.as_mut_ptr(),
                bwork.as_mut_ptr(),
                &mut qi,
                1,
                1,
            )
        };
        let lw = lwork(q, 2 * n);
        let mut work = vec![T::default(); lw];
        let lwi = int(lw)?;
        for i in 0..b {
            if non_finite(&a[i * nn..(i + 1) * nn]) {
                nan_fill(&mut a[i * nn..(i + 1) * nn]);
                nan_fill(&mut w[i * n..(i + 1) * n]);
                inf[i] = 1;
                continue;
            }
            // SAFETY: sizes checked; no sorting, so `select` is not called.
            unsafe {
                func(
                    &jobvs,
                    &sort,
                    select,
                    &ni,
                    at(a, i, nn),
                    &ld,
                    &mut sdim[i],
                    at(w, i, n),
                    at(vs, i, nn),
                    &ld,
                    work.as_mut_ptr(),
                    &lwi,
                    rwork.as_mut_ptr(),
                    bwork.as_mut_ptr(),
                    &mut inf[i],
                    1,
                    1,
                )
            };
        }
    } else {
        // SAFETY: `?gees`'s real signature.
        let func: GeesR<T> = unsafe { routine::<T, _>(lib, "gees") }?;
        // SAFETY: a workspace query only writes `q`.
        unsafe {
            func(
                &jobvs,
                &sort,
                select,
                &ni,
                at(a, 0, nn),
                &ld,
                &mut qs,
                at(w, 0, n),
                at(wi, 0, n),
                at(vs, 0, nn),
                &ld,
                &mut q,
                &minus1,
                bwork.as_mut_ptr(),
                &mut qi,
                1,
                1,
            )
        };
        let lw = lwork(q, 3 * n);
        let mut work = vec![T::default(); lw];
        let lwi = int(lw)?;
        for i in 0..b {
            if non_finite(&a[i * nn..(i + 1) * nn]) {
                nan_fill(&mut a[i * nn..(i + 1) * nn]);
                nan_fill(&mut w[i * n..(i + 1) * n]);
                nan_fill(&mut wi[i * n..(i + 1) * n]);
                inf[i] = 1;
                continue;
            }
            // SAFETY: sizes checked; no sorting, so `select` is not called.
            unsafe {
                func(
                    &jobvs,
                    &sort,
                    select,
                    &ni,
                    at(a, i, nn),
                    &ld,
                    &mut sdim[i],
                    at(w, i, n),
                    at(wi, i, n),
                    at(vs, i, nn),
                    &ld,
                    work.as_mut_ptr(),
                    &lwi,
                    bwork.as_mut_ptr(),
                    &mut inf[i],
                    1,
                    1,
                )
            };
        }
    }
    Ok(())
}

/// Hessenberg reduction: `lapack_?gehrd_ffi`. Operand `a [.., n, n]`; results `a` (aliases;
/// H on and above the subdiagonal, reflectors below), `tau [.., n - 1]`, `info`. Attributes
/// `low`, `high` (LAPACK's 1-based `ilo`, `ihi`).
pub(crate) fn gehrd<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let (lo, hi) = (f.attr_i32("low")?, f.attr_i32("high")?);
    let x = f.arg(0)?;
    let s = square::<T>(&x)?;
    let (n, b) = (s.rows, s.count);
    let nt = n.saturating_sub(1);
    let ni = int(n)?;
    let ok = if n == 0 {
        lo == 1 && hi == 0
    } else {
        1 <= lo && lo <= hi.max(1) && hi <= ni
    };
    if !ok {
        return Err(FfiError::invalid(format!(
            "gehrd: need 1 ≤ low ≤ high ≤ n, got low {lo}, high {hi}, n {n}"
        )));
    }
    let (xo, tau, info) = (f.ret(0)?, f.ret(1)?, f.ret(2)?);
    expect(&xo, T::DTYPE, &s.batch, &[n, n], "result 0")?;
    expect(&tau, T::DTYPE, &s.batch, &[nt], "tau")?;
    expect(&info, S32, &s.batch, &[], "info")?;
    distinct(&[(&xo, size_of::<T>()), (&tau, size_of::<T>()), (&info, 4)])?;
    cost("gehrd", b, 4.0 * (n * n * n) as f64)?;
    let lib = lib()?;
    // SAFETY: `?gehrd`'s signature.
    let func: Gehrd<T> = unsafe { routine::<T, _>(lib, "gehrd") }?;
    copy_in::<T>(&x, &xo, b * n * n)?;
    // SAFETY: checked above; distinct results.
    let (a, t, inf) = unsafe {
        (
            view::<T>(&xo, b * n * n)?,
            view::<T>(&tau, b * nt)?,
            view::<i32>(&info, b)?,
        )
    };
    if b == 0 || n == 0 {
        return Ok(());
    }
    let (ld, minus1) = (int(n.max(1))?, -1);
    let (mut q, mut qi) = (T::default(), 0);
    let mut tq = vec![T::default(); n.max(1)];
    // SAFETY: a workspace query only writes `q`.
    unsafe {
        func(
            &ni,
            &lo,
            &hi,
            at(a, 0, n * n),
            &ld,
            tq.as_mut_ptr(),
            &mut q,
            &minus1,
            &mut qi,
        )
    };
    let lw = lwork(q, n);
    let mut work = vec![T::default(); lw];
    let lwi = int(lw)?;
    for i in 0..b {
        // LAPACK writes `n - 1` entries of tau; the result holds exactly that many.
        // SAFETY: matrix `i` has `n·n` elements; `tq` has room for `n` (≥ n - 1).
        unsafe {
            func(
                &ni,
                &lo,
                &hi,
                at(a, i, n * n),
                &ld,
                tq.as_mut_ptr(),
                work.as_mut_ptr(),
                &lwi,
                &mut inf[i],
            )
        };
        t[i * nt..(i + 1) * nt].copy_from_slice(&tq[..nt]);
    }
    Ok(())
}

/// Tridiagonal reduction: `lapack_?sytrd_ffi` / `lapack_?hetrd_ffi`. Operand `a [.., n, n]`;
/// results `a` (aliases), `d: real [.., n]`, `e: real [.., n - 1]`, `tau [.., n - 1]`,
/// `info`. Attribute `uplo`.
pub(crate) fn sytrd<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let up = uplo(f)?;
    let x = f.arg(0)?;
    let s = square::<T>(&x)?;
    let (n, b) = (s.rows, s.count);
    let nt = n.saturating_sub(1);
    let (xo, d, e, tau, info) = (f.ret(0)?, f.ret(1)?, f.ret(2)?, f.ret(3)?, f.ret(4)?);
    let rt = <T::Real as Elem>::DTYPE;
    expect(&xo, T::DTYPE, &s.batch, &[n, n], "result 0")?;
    expect(&d, rt, &s.batch, &[n], "diagonal")?;
    expect(&e, rt, &s.batch, &[nt], "off-diagonal")?;
    expect(&tau, T::DTYPE, &s.batch, &[nt], "tau")?;
    expect(&info, S32, &s.batch, &[], "info")?;
    let (te, re) = (size_of::<T>(), size_of::<T::Real>());
    distinct(&[(&xo, te), (&d, re), (&e, re), (&tau, te), (&info, 4)])?;
    cost("sytrd", b, 2.0 * (n * n * n) as f64)?;
    let lib = lib()?;
    let base = if T::COMPLEX { "hetrd" } else { "sytrd" };
    // SAFETY: `?sytrd`/`?hetrd` share this signature.
    let func: Sytrd<T, T::Real> = unsafe { routine::<T, _>(lib, base) }?;
    copy_in::<T>(&x, &xo, b * n * n)?;
    // SAFETY: checked above; distinct results.
    let (a, dv, ev, t, inf) = unsafe {
        (
            view::<T>(&xo, b * n * n)?,
            view::<T::Real>(&d, b * n)?,
            view::<T::Real>(&e, b * nt)?,
            view::<T>(&tau, b * nt)?,
            view::<i32>(&info, b)?,
        )
    };
    if b == 0 || n == 0 {
        return Ok(());
    }
    let (ni, ld, minus1) = (int(n)?, int(n.max(1))?, -1);
    let (mut q, mut qi) = (T::default(), 0);
    let (mut eq, mut tq) = (vec![T::Real::default(); n], vec![T::default(); n]);
    // SAFETY: a workspace query only writes `q`.
    unsafe {
        func(
            &up,
            &ni,
            at(a, 0, n * n),
            &ld,
            at(dv, 0, n),
            eq.as_mut_ptr(),
            tq.as_mut_ptr(),
            &mut q,
            &minus1,
            &mut qi,
            1,
        )
    };
    let lw = lwork(q, 1);
    let mut work = vec![T::default(); lw];
    let lwi = int(lw)?;
    for i in 0..b {
        // SAFETY: matrix `i` has `n·n` elements; `d` `n`; `eq`, `tq` have room for n - 1.
        unsafe {
            func(
                &up,
                &ni,
                at(a, i, n * n),
                &ld,
                at(dv, i, n),
                eq.as_mut_ptr(),
                tq.as_mut_ptr(),
                work.as_mut_ptr(),
                &lwi,
                &mut inf[i],
                1,
            )
        };
        ev[i * nt..(i + 1) * nt].copy_from_slice(&eq[..nt]);
        t[i * nt..(i + 1) * nt].copy_from_slice(&tq[..nt]);
    }
    Ok(())
}

/// Tridiagonal solve: `lapack_?gtsv_ffi`. Operands `dl`, `d`, `du [.., n]` (JAX's convention:
/// `dl[0]` and `du[n-1]` are not part of the matrix) and `b [.., n, nrhs]`; results the four
/// operands (aliased; `b` holds the solution) and `info`.
pub(crate) fn gtsv<T: Elem>(f: &CallFrame<'_>) -> R<()> {
    let bm = f.arg(3)?;
    let s = matrices::<T>(&bm, "right-hand side")?;
    let (n, nrhs, b) = (s.rows, s.cols, s.count);
    let mut outs = Vec::new();
    for i in 0..3 {
        let (a, o) = (f.arg(i)?, f.ret(i)?);
        expect(&a, T::DTYPE, &s.batch, &[n], "diagonal")?;
        expect(&o, T::DTYPE, &s.batch, &[n], "diagonal result")?;
        outs.push((a, o));
    }
    let (bo, info) = (f.ret(3)?, f.ret(4)?);
    expect(&bo, T::DTYPE, &s.batch, &[n, nrhs], "solution")?;
    expect(&info, S32, &s.batch, &[], "info")?;
    let e = size_of::<T>();
    distinct(&[
        (&outs[0].1, e),
        (&outs[1].1, e),
        (&outs[2].1, e),
        (&bo, e),
        (&info, 4),
    ])?;
    cost("gtsv", b, 10.0 * (n * nrhs.max(1)) as f64)?;
    let lib = lib()?;
    // SAFETY: `?gtsv`'s signature.
    let func: Gtsv<T> = unsafe { routine::<T, _>(lib, "gtsv") }?;
    for (a, o) in &outs {
        copy_in::<T>(a, o, b * n)?;
    }
    copy_in::<T>(&bm, &bo, b * n * nrhs)?;
    // SAFETY: checked above; distinct results.
    let (dl, d, du, x, inf) = unsafe {
        (
            view::<T>(&outs[0].1, b * n)?,
            view::<T>(&outs[1].1, b * n)?,
            view::<T>(&outs[2].1, b * n)?,
            view::<T>(&bo, b * n * nrhs)?,
            view::<i32>(&info, b)?,
        )
    };
    if n == 0 {
        return Ok(());
    }
    let (ni, nr, ld) = (int(n)?, int(nrhs)?, int(n.max(1))?);
    for i in 0..b {
        // SAFETY: LAPACK's sub-diagonal (n - 1 entries) starts at `dl[1]`, its
        // super-diagonal at `du[0]`; `d` has `n`, `x` `n·nrhs` (leading dimension `n`).
        unsafe {
            func(
                &ni,
                &nr,
                at(dl, i, n).add(1),
                at(d, i, n),
                at(du, i, n),
                at(x, i, n * nrhs),
                &ld,
                &mut inf[i],
            )
        };
    }
    Ok(())
}
