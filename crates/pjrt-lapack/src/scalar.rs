//! Element types of the handlers (f32, f64, c64, c128) and the C signatures of the LAPACK and
//! BLAS routines they call.
//!
//! Signatures follow the reference Fortran interface with LP64 integers: every argument by
//! pointer, and one hidden `size_t` length after the others per `CHARACTER` argument (what
//! gfortran expects; C implementations such as OpenBLAS's ignore them).

use std::ffi::c_void;
use std::fmt::Debug;

use num_complex::Complex;
use pjrt::ffi::DataType;
use pjrt_sys::xla_ffi as xf;

type I = *const i32;
type Ch = *const u8;

/// `?getrf`: LU with partial pivoting.
pub(crate) type Getrf<T> = unsafe extern "C" fn(I, I, *mut T, I, *mut i32, *mut i32);
/// `?trsm` (BLAS): triangular solve with several right-hand sides.
pub(crate) type Trsm<T> = unsafe extern "C" fn(
    Ch,
    Ch,
    Ch,
    Ch,
    I,
    I,
    *const T,
    *const T,
    I,
    *mut T,
    I,
    usize,
    usize,
    usize,
    usize,
);
/// `?potrf`: Cholesky.
pub(crate) type Potrf<T> = unsafe extern "C" fn(Ch, I, *mut T, I, *mut i32, usize);
/// `?geqrf`: QR (Householder form).
pub(crate) type Geqrf<T> = unsafe extern "C" fn(I, I, *mut T, I, *mut T, *mut T, I, *mut i32);
/// `?orgqr` / `?ungqr`: the orthogonal (unitary) factor from Householder reflectors.
pub(crate) type Orgqr<T> = unsafe extern "C" fn(I, I, I, *mut T, I, *const T, *mut T, I, *mut i32);
/// `?syevd`: symmetric eigendecomposition (real types).
pub(crate) type Syevd<T, R> = unsafe extern "C" fn(
    Ch,
    Ch,
    I,
    *mut T,
    I,
    *mut R,
    *mut T,
    I,
    *mut i32,
    I,
    *mut i32,
    usize,
    usize,
);
/// `?heevd`: Hermitian eigendecomposition (complex types).
pub(crate) type Heevd<T, R> = unsafe extern "C" fn(
    Ch,
    Ch,
    I,
    *mut T,
    I,
    *mut R,
    *mut T,
    I,
    *mut R,
    I,
    *mut i32,
    I,
    *mut i32,
    usize,
    usize,
);
/// `?gesdd`, real types.
pub(crate) type GesddR<T, R> = unsafe extern "C" fn(
    Ch,
    I,
    I,
    *mut T,
    I,
    *mut R,
    *mut T,
    I,
    *mut T,
    I,
    *mut T,
    I,
    *mut i32,
    *mut i32,
    usize,
);
/// `?gesdd`, complex types (with `rwork`).
pub(crate) type GesddC<T, R> = unsafe extern "C" fn(
    Ch,
    I,
    I,
    *mut T,
    I,
    *mut R,
    *mut T,
    I,
    *mut T,
    I,
    *mut T,
    I,
    *mut R,
    *mut i32,
    *mut i32,
    usize,
);
/// `?gesvd`, real types.
pub(crate) type GesvdR<T, R> = unsafe extern "C" fn(
    Ch,
    Ch,
    I,
    I,
    *mut T,
    I,
    *mut R,
    *mut T,
    I,
    *mut T,
    I,
    *mut T,
    I,
    *mut i32,
    usize,
    usize,
);
/// `?gesvd`, complex types (with `rwork`).
pub(crate) type GesvdC<T, R> = unsafe extern "C" fn(
    Ch,
    Ch,
    I,
    I,
    *mut T,
    I,
    *mut R,
    *mut T,
    I,
    *mut T,
    I,
    *mut T,
    I,
    *mut R,
    *mut i32,
    usize,
    usize,
);
/// `?geev`, real types (eigenvalues as real and imaginary parts, packed eigenvectors).
pub(crate) type GeevR<T> = unsafe extern "C" fn(
    Ch,
    Ch,
    I,
    *mut T,
    I,
    *mut T,
    *mut T,
    *mut T,
    I,
    *mut T,
    I,
    *mut T,
    I,
    *mut i32,
    usize,
    usize,
);
/// `?geev`, complex types.
pub(crate) type GeevC<T, R> = unsafe extern "C" fn(
    Ch,
    Ch,
    I,
    *mut T,
    I,
    *mut T,
    *mut T,
    I,
    *mut T,
    I,
    *mut T,
    I,
    *mut R,
    *mut i32,
    usize,
    usize,
);
/// `?gees`, real types.
pub(crate) type GeesR<T> = unsafe extern "C" fn(
    Ch,
    Ch,
    *const c_void,
    I,
    *mut T,
    I,
    *mut i32,
    *mut T,
    *mut T,
    *mut T,
    I,
    *mut T,
    I,
    *mut i32,
    *mut i32,
    usize,
    usize,
);
/// `?gees`, complex types.
pub(crate) type GeesC<T, R> = unsafe extern "C" fn(
    Ch,
    Ch,
    *const c_void,
    I,
    *mut T,
    I,
    *mut i32,
    *mut T,
    *mut T,
    I,
    *mut T,
    I,
    *mut R,
    *mut i32,
    *mut i32,
    usize,
    usize,
);
/// `?gehrd`: Hessenberg reduction.
pub(crate) type Gehrd<T> = unsafe extern "C" fn(I, I, I, *mut T, I, *mut T, *mut T, I, *mut i32);
/// `?sytrd` / `?hetrd`: tridiagonal reduction.
pub(crate) type Sytrd<T, R> =
    unsafe extern "C" fn(Ch, I, *mut T, I, *mut R, *mut R, *mut T, *mut T, I, *mut i32, usize);
/// `?gtsv`: tridiagonal solve.
pub(crate) type Gtsv<T> = unsafe extern "C" fn(I, I, *mut T, *mut T, *mut T, *mut T, I, *mut i32);

/// An element type the handlers take: `f32`, `f64`, `Complex<f32>`, `Complex<f64>`.
pub(crate) trait Elem: Copy + Default + PartialEq + Debug + Send + Sync + 'static {
    /// The real type of the same precision.
    type Real: Real;
    /// The complex type of the same precision.
    type Cplx: Elem<Real = Self::Real>;
    /// XLA's element type.
    const DTYPE: DataType;
    /// LAPACK's prefix: `s`, `d`, `c`, `z`.
    const PREFIX: &'static str;
    /// Whether the type is complex.
    const COMPLEX: bool;
    /// NaN (both parts NaN for complex types).
    fn nan() -> Self;
    /// Whether every part is finite.
    fn finite(self) -> bool;
    /// A workspace size LAPACK returned in this type (its real part), rounded up with a small
    /// margin: single precision cannot hold every integer exactly.
    fn work_size(self) -> usize;
    /// `re + i·im` in the complex type.
    fn cplx(re: Self::Real, im: Self::Real) -> Self::Cplx;
    /// One.
    fn one() -> Self;
    /// The negated value.
    fn neg(self) -> Self;
    /// The real part.
    fn re(self) -> Self::Real;
}

/// The real element types.
pub(crate) trait Real: Elem<Real = Self> + Into<f64> {}

macro_rules! real {
    ($t:ty, $prefix:literal, $dtype:expr) => {
        impl Elem for $t {
            type Real = $t;
            type Cplx = Complex<$t>;
            const DTYPE: DataType = $dtype;
            const PREFIX: &'static str = $prefix;
            const COMPLEX: bool = false;
            fn nan() -> Self {
                <$t>::NAN
            }
            fn finite(self) -> bool {
                self.is_finite()
            }
            fn work_size(self) -> usize {
                let v = f64::from(self);
                if v.is_finite() && v > 0.0 {
                    (v * (1.0 + 1e-6)).ceil() as usize
                } else {
                    1
                }
            }
            fn cplx(re: $t, im: $t) -> Complex<$t> {
                Complex::new(re, im)
            }
            fn one() -> Self {
                1.0
            }
            fn neg(self) -> Self {
                -self
            }
            fn re(self) -> $t {
                self
            }
        }
        impl Real for $t {}
    };
}

macro_rules! complex {
    ($t:ty, $prefix:literal, $dtype:expr) => {
        impl Elem for Complex<$t> {
            type Real = $t;
            type Cplx = Complex<$t>;
            const DTYPE: DataType = $dtype;
            const PREFIX: &'static str = $prefix;
            const COMPLEX: bool = true;
            fn nan() -> Self {
                Complex::new(<$t>::NAN, <$t>::NAN)
            }
            fn finite(self) -> bool {
                self.re.is_finite() && self.im.is_finite()
            }
            fn work_size(self) -> usize {
                self.re.work_size()
            }
            fn cplx(re: $t, im: $t) -> Complex<$t> {
                Complex::new(re, im)
            }
            fn one() -> Self {
                Complex::new(1.0, 0.0)
            }
            fn neg(self) -> Self {
                -self
            }
            fn re(self) -> $t {
                self.re
            }
        }
    };
}

real!(f32, "s", xf::XLA_FFI_DataType_F32);
real!(f64, "d", xf::XLA_FFI_DataType_F64);
complex!(f32, "c", xf::XLA_FFI_DataType_C64);
complex!(f64, "z", xf::XLA_FFI_DataType_C128);
