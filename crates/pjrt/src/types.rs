//! Element types ([`PrimitiveType`]) and array shapes ([`TensorSpec`]).

use pjrt_sys as sys;

/// Element type of an array, as far as this crate supports them (the XLA/PJRT types that have a
/// whole-byte, host-representable layout).
///
/// Names follow XLA (`xla_data.proto` `PrimitiveType`); the PJRT C API counterpart is
/// `PJRT_Buffer_Type_*`. Host data is little-endian; `Pred` is one byte per element (0 or 1),
/// complex types are (real, imaginary) pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrimitiveType {
    /// Boolean, 1 byte.
    Pred,
    /// Signed 8-bit integer.
    S8,
    /// Signed 16-bit integer.
    S16,
    /// Signed 32-bit integer.
    S32,
    /// Signed 64-bit integer.
    S64,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE half precision, 2 bytes.
    F16,
    /// bfloat16 (1 sign, 8 exponent, 7 mantissa bits), 2 bytes.
    Bf16,
    /// IEEE single precision, 4 bytes.
    F32,
    /// IEEE double precision, 8 bytes.
    F64,
    /// Complex of two `F32` (real, imaginary), 8 bytes.
    C64,
    /// Complex of two `F64` (real, imaginary), 16 bytes.
    C128,
}

use PrimitiveType::*;

impl PrimitiveType {
    /// Every supported type, in declaration order.
    pub const ALL: [PrimitiveType; 15] = [
        Pred, S8, S16, S32, S64, U8, U16, U32, U64, F16, Bf16, F32, F64, C64, C128,
    ];

    /// Bytes per element in host (dense, row-major) layout: `Pred` = 1, `C64` = 8, `C128` = 16.
    pub fn byte_size(self) -> usize {
        match self {
            Pred | S8 | U8 => 1,
            S16 | U16 | F16 | Bf16 => 2,
            S32 | U32 | F32 => 4,
            S64 | U64 | F64 | C64 => 8,
            C128 => 16,
        }
    }

    /// XLA name: `"PRED"`, `"S8"`, ..., `"F16"`, `"BF16"`, `"F32"`, `"F64"`, `"C64"`, `"C128"`.
    pub fn name(self) -> &'static str {
        match self {
            Pred => "PRED",
            S8 => "S8",
            S16 => "S16",
            S32 => "S32",
            S64 => "S64",
            U8 => "U8",
            U16 => "U16",
            U32 => "U32",
            U64 => "U64",
            F16 => "F16",
            Bf16 => "BF16",
            F32 => "F32",
            F64 => "F64",
            C64 => "C64",
            C128 => "C128",
        }
    }

    /// Inverse of [`PrimitiveType::name`], case-insensitive (`"f32"`, `"BF16"`, `"pred"`).
    /// `None` for any other string.
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
    }

    /// MLIR element type spelling used in StableHLO `tensor<...>` types: `i1`, `i8`..`i64`,
    /// `ui8`..`ui64`, `f16`, `bf16`, `f32`, `f64`, `complex<f32>`, `complex<f64>`.
    pub fn mlir_name(self) -> &'static str {
        match self {
            Pred => "i1",
            S8 => "i8",
            S16 => "i16",
            S32 => "i32",
            S64 => "i64",
            U8 => "ui8",
            U16 => "ui16",
            U32 => "ui32",
            U64 => "ui64",
            F16 => "f16",
            Bf16 => "bf16",
            F32 => "f32",
            F64 => "f64",
            C64 => "complex<f32>",
            C128 => "complex<f64>",
        }
    }

    /// The C API `PJRT_Buffer_Type` value.
    pub(crate) fn to_pjrt(self) -> sys::PJRT_Buffer_Type {
        match self {
            Pred => sys::PJRT_Buffer_Type_PRED,
            S8 => sys::PJRT_Buffer_Type_S8,
            S16 => sys::PJRT_Buffer_Type_S16,
            S32 => sys::PJRT_Buffer_Type_S32,
            S64 => sys::PJRT_Buffer_Type_S64,
            U8 => sys::PJRT_Buffer_Type_U8,
            U16 => sys::PJRT_Buffer_Type_U16,
            U32 => sys::PJRT_Buffer_Type_U32,
            U64 => sys::PJRT_Buffer_Type_U64,
            F16 => sys::PJRT_Buffer_Type_F16,
            Bf16 => sys::PJRT_Buffer_Type_BF16,
            F32 => sys::PJRT_Buffer_Type_F32,
            F64 => sys::PJRT_Buffer_Type_F64,
            C64 => sys::PJRT_Buffer_Type_C64,
            C128 => sys::PJRT_Buffer_Type_C128,
        }
    }

    /// From a C API `PJRT_Buffer_Type`; `None` for types this crate does not support
    /// (F8 variants, S4/U4, TOKEN, INVALID, ...).
    pub(crate) fn from_pjrt(t: sys::PJRT_Buffer_Type) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.to_pjrt() == t)
    }

    /// From the numbering of `xla_data.proto` `enum PrimitiveType` (PRED=1, S8=2, S16=3,
    /// S32=4, S64=5, U8=6, U16=7, U32=8, U64=9, F16=10, F32=11, F64=12, C64=15, BF16=16,
    /// C128=18); `None` for anything else (TUPLE=13, TOKEN=17, F8 types, ...).
    pub(crate) fn from_xla_proto(v: i32) -> Option<Self> {
        Some(match v {
            1 => Pred,
            2 => S8,
            3 => S16,
            4 => S32,
            5 => S64,
            6 => U8,
            7 => U16,
            8 => U32,
            9 => U64,
            10 => F16,
            11 => F32,
            12 => F64,
            15 => C64,
            16 => Bf16,
            18 => C128,
            _ => return None,
        })
    }
}

impl std::fmt::Display for PrimitiveType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Element type and dimensions of a dense array (dimensions major-to-minor; empty = scalar).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    /// Element type.
    pub ty: PrimitiveType,
    /// Dimension sizes, outermost first.
    pub dims: Vec<i64>,
}

impl TensorSpec {
    /// Number of host bytes of a dense array with this spec (`byte_size × product(dims)`);
    /// `None` on a negative dimension or overflow.
    pub fn byte_len(&self) -> Option<usize> {
        dense_byte_len(self.ty, &self.dims)
    }
}

impl std::fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{:?}", self.ty.name(), self.dims)
    }
}

/// `byte_size × product(dims)` with checked arithmetic; `None` on a negative dim or overflow.
pub(crate) fn dense_byte_len(ty: PrimitiveType, dims: &[i64]) -> Option<usize> {
    dims.iter().try_fold(ty.byte_size(), |acc, &d| {
        let d = usize::try_from(d).ok()?;
        acc.checked_mul(d)
    })
}
