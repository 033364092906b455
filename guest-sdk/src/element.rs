//! Element types: [`Dtype`] facts (size, name) and the [`Element`] trait that maps Rust types to
//! dtypes and encodes them in the host byte layout ([`encode`], [`decode`]).

use std::fmt;

use crate::{Dtype, Error, Result};

impl Dtype {
    /// Every dtype, in WIT declaration order.
    pub const ALL: [Dtype; 15] = [
        Dtype::Pred,
        Dtype::S8,
        Dtype::S16,
        Dtype::S32,
        Dtype::S64,
        Dtype::U8,
        Dtype::U16,
        Dtype::U32,
        Dtype::U64,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
        Dtype::F64,
        Dtype::C64,
        Dtype::C128,
    ];

    /// Size in bytes of one element in the host byte layout (`pred` is 1 byte, `c64` is 8,
    /// `c128` is 16).
    pub const fn size_bytes(self) -> usize {
        match self {
            Dtype::Pred | Dtype::S8 | Dtype::U8 => 1,
            Dtype::S16 | Dtype::U16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::S32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::S64 | Dtype::U64 | Dtype::F64 | Dtype::C64 => 8,
            Dtype::C128 => 16,
        }
    }

    /// The WIT name of this dtype (also the XLA / MLIR-ish spelling), e.g. `"f32"`, `"bf16"`.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::Pred => "pred",
            Dtype::S8 => "s8",
            Dtype::S16 => "s16",
            Dtype::S32 => "s32",
            Dtype::S64 => "s64",
            Dtype::U8 => "u8",
            Dtype::U16 => "u16",
            Dtype::U32 => "u32",
            Dtype::U64 => "u64",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
            Dtype::C64 => "c64",
            Dtype::C128 => "c128",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type whose values are elements of a tensor of dtype [`Element::DTYPE`].
///
/// Implemented for `bool` ([`Dtype::Pred`]), `i8`..`i64` (`s8`..`s64`), `u8`..`u64`,
/// `f32`, `f64`, [`half::f16`] and [`half::bf16`]. Encoding follows the host byte layout:
/// little-endian of the type's width, `bool` as one byte 0 or 1.
///
/// Implementors must keep `SIZE == DTYPE.size_bytes()`, and `read_le(write_le(x)) == x`.
pub trait Element: Copy + Sized + 'static {
    /// The tensor dtype of this element type.
    const DTYPE: Dtype;
    /// Encoded size in bytes (equal to `DTYPE.size_bytes()`).
    const SIZE: usize;

    /// Writes `self` as exactly [`Self::SIZE`] little-endian bytes into `out`.
    ///
    /// Panics if `out.len() != Self::SIZE`.
    fn write_le(self, out: &mut [u8]);

    /// Reads a value from exactly [`Self::SIZE`] little-endian bytes.
    ///
    /// Panics if `bytes.len() != Self::SIZE`. For `bool`, any non-zero byte reads as `true`.
    fn read_le(bytes: &[u8]) -> Self;
}

macro_rules! impl_element_num {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl Element for $t {
            const DTYPE: Dtype = Dtype::$d;
            const SIZE: usize = std::mem::size_of::<$t>();

            #[inline]
            fn write_le(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }

            #[inline]
            fn read_le(bytes: &[u8]) -> Self {
                let mut buf = [0u8; std::mem::size_of::<$t>()];
                buf.copy_from_slice(bytes);
                <$t>::from_le_bytes(buf)
            }
        }
    )*};
}

impl_element_num! {
    i8 => S8, i16 => S16, i32 => S32, i64 => S64,
    u8 => U8, u16 => U16, u32 => U32, u64 => U64,
    f32 => F32, f64 => F64,
    half::f16 => F16, half::bf16 => Bf16,
}

impl Element for bool {
    const DTYPE: Dtype = Dtype::Pred;
    const SIZE: usize = 1;

    #[inline]
    fn write_le(self, out: &mut [u8]) {
        out.copy_from_slice(&[u8::from(self)]);
    }

    #[inline]
    fn read_le(bytes: &[u8]) -> Self {
        assert_eq!(bytes.len(), 1, "bool is encoded in one byte");
        bytes[0] != 0
    }
}

/// Encodes `data` in the host byte layout of `T::DTYPE` (row-major, little-endian).
pub fn encode<T: Element>(data: &[T]) -> Vec<u8> {
    let mut out = vec![0u8; data.len() * T::SIZE];
    for (x, chunk) in data.iter().zip(out.chunks_exact_mut(T::SIZE)) {
        x.write_le(chunk);
    }
    out
}

/// Decodes host-layout bytes of dtype `T::DTYPE` into values.
///
/// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) if `bytes.len()` is not a multiple of `T::SIZE`.
pub fn decode<T: Element>(bytes: &[u8]) -> Result<Vec<T>> {
    if !bytes.len().is_multiple_of(T::SIZE) {
        return Err(Error::invalid_argument(format!(
            "{} bytes is not a whole number of {} elements ({} bytes each)",
            bytes.len(),
            T::DTYPE,
            T::SIZE
        )));
    }
    Ok(bytes.chunks_exact(T::SIZE).map(T::read_le).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;
    use half::{bf16, f16};

    fn round_trip<T: Element + PartialEq + fmt::Debug>(values: &[T]) {
        let bytes = encode(values);
        assert_eq!(bytes.len(), values.len() * T::DTYPE.size_bytes());
        assert_eq!(T::SIZE, T::DTYPE.size_bytes());
        assert_eq!(decode::<T>(&bytes).unwrap(), values);
    }

    #[test]
    fn element_round_trips() {
        round_trip(&[true, false, true]);
        round_trip(&[i8::MIN, -1, 0, 1, i8::MAX]);
        round_trip(&[i16::MIN, -2, 0, 300, i16::MAX]);
        round_trip(&[i32::MIN, -3, 0, 70000, i32::MAX]);
        round_trip(&[i64::MIN, -4, 0, 1 << 40, i64::MAX]);
        round_trip(&[0u8, 1, 255]);
        round_trip(&[0u16, 1, u16::MAX]);
        round_trip(&[0u32, 1, u32::MAX]);
        round_trip(&[0u64, 1, u64::MAX]);
        round_trip(&[0.0f32, -1.5, f32::MAX, f32::MIN_POSITIVE, f32::INFINITY]);
        round_trip(&[0.0f64, -1.5, f64::MAX, f64::MIN_POSITIVE, f64::NEG_INFINITY]);
        round_trip(&[f16::from_f32(0.5), f16::from_f32(-2.0), f16::MAX]);
        round_trip(&[bf16::from_f32(0.5), bf16::from_f32(-2.0), bf16::MAX]);
    }

    #[test]
    fn element_dtypes() {
        assert_eq!(bool::DTYPE, Dtype::Pred);
        assert_eq!(i8::DTYPE, Dtype::S8);
        assert_eq!(i64::DTYPE, Dtype::S64);
        assert_eq!(u16::DTYPE, Dtype::U16);
        assert_eq!(f32::DTYPE, Dtype::F32);
        assert_eq!(f64::DTYPE, Dtype::F64);
        assert_eq!(f16::DTYPE, Dtype::F16);
        assert_eq!(bf16::DTYPE, Dtype::Bf16);
    }

    #[test]
    fn little_endian_layout() {
        assert_eq!(encode(&[1.0f32]), vec![0x00, 0x00, 0x80, 0x3f]);
        assert_eq!(encode(&[0x0102_0304i32]), vec![4, 3, 2, 1]);
        assert_eq!(encode(&[-2i16]), vec![0xfe, 0xff]);
        assert_eq!(encode(&[bf16::from_f32(1.0)]), vec![0x80, 0x3f]);
        assert_eq!(encode(&[f16::from_f32(1.0)]), vec![0x00, 0x3c]);
        assert_eq!(encode(&[true, false]), vec![1, 0]);
        assert!(bool::read_le(&[7]));
    }

    #[test]
    fn decode_rejects_ragged_bytes() {
        let e = decode::<f32>(&[0; 7]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(decode::<f32>(&[]).unwrap().is_empty());
    }

    #[test]
    fn dtype_sizes_and_names() {
        let sizes: Vec<usize> = Dtype::ALL.iter().map(|d| d.size_bytes()).collect();
        assert_eq!(sizes, [1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 2, 4, 8, 8, 16]);
        assert_eq!(Dtype::Bf16.to_string(), "bf16");
        assert_eq!(Dtype::C128.name(), "c128");
    }
}
