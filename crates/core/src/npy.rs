//! Reading and writing NumPy `.npy` files (through the `npyz` crate) as dense XLA arrays.
//!
//! Mapping of XLA types to NumPy dtypes: PRED ↔ `|b1`, S8…S64 ↔ `i1…i8`, U8…U64 ↔ `u1…u8`,
//! F16 ↔ `f2`, F32 ↔ `f4`, F64 ↔ `f8`, C64 ↔ `c8`, C128 ↔ `c16`. NumPy has no BF16, so BF16
//! arrays are written as raw two-byte records (`|V2`, little-endian bit patterns); reading a
//! `|VN` array needs the expected XLA type (from the executable's parameter) to give it meaning.

use std::path::Path;

use anyhow::{Context, Result, bail};
use npyz::{DType, FixedSizeBytes, NpyFile, TypeStr, WriterBuilder};
use pjrt::PrimitiveType;

/// A dense, row-major array in host memory, in the byte layout PJRT uses (little-endian).
#[derive(Debug, Clone, PartialEq)]
pub struct HostArray {
    /// XLA element type.
    pub ty: PrimitiveType,
    /// Dimensions (empty for a scalar).
    pub dims: Vec<i64>,
    /// `ty.byte_size() × product(dims)` bytes.
    pub data: Vec<u8>,
}

/// The NumPy type string tpubox writes for `ty` (`"|V2"` for BF16).
pub fn numpy_descr(ty: PrimitiveType) -> &'static str {
    match ty {
        PrimitiveType::Pred => "|b1",
        PrimitiveType::S8 => "|i1",
        PrimitiveType::S16 => "<i2",
        PrimitiveType::S32 => "<i4",
        PrimitiveType::S64 => "<i8",
        PrimitiveType::U8 => "|u1",
        PrimitiveType::U16 => "<u2",
        PrimitiveType::U32 => "<u4",
        PrimitiveType::U64 => "<u8",
        PrimitiveType::F16 => "<f2",
        PrimitiveType::Bf16 => "|V2",
        PrimitiveType::F32 => "<f4",
        PrimitiveType::F64 => "<f8",
        PrimitiveType::C64 => "<c8",
        PrimitiveType::C128 => "<c16",
    }
}

// Calls `$body` with `$T` bound to the Rust type npyz uses for `$ty`.
macro_rules! with_rust_type {
    ($ty:expr, $T:ident => $body:expr) => {
        match $ty {
            PrimitiveType::Pred => {
                type $T = bool;
                $body
            }
            PrimitiveType::S8 => {
                type $T = i8;
                $body
            }
            PrimitiveType::S16 => {
                type $T = i16;
                $body
            }
            PrimitiveType::S32 => {
                type $T = i32;
                $body
            }
            PrimitiveType::S64 => {
                type $T = i64;
                $body
            }
            PrimitiveType::U8 => {
                type $T = u8;
                $body
            }
            PrimitiveType::U16 => {
                type $T = u16;
                $body
            }
            PrimitiveType::U32 => {
                type $T = u32;
                $body
            }
            PrimitiveType::U64 => {
                type $T = u64;
                $body
            }
            PrimitiveType::F16 => {
                type $T = npyz::half::f16;
                $body
            }
            PrimitiveType::Bf16 => {
                type $T = FixedSizeBytes<2>;
                $body
            }
            PrimitiveType::F32 => {
                type $T = f32;
                $body
            }
            PrimitiveType::F64 => {
                type $T = f64;
                $body
            }
            PrimitiveType::C64 => {
                type $T = npyz::num_complex::Complex<f32>;
                $body
            }
            PrimitiveType::C128 => {
                type $T = npyz::num_complex::Complex<f64>;
                $body
            }
        }
    };
}

/// Conversion between one npyz element and its little-endian bytes.
trait LeBytes: Sized {
    fn put(&self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
}

macro_rules! le_num {
    ($($t:ty),*) => {$(
        impl LeBytes for $t {
            fn put(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("chunk has the element size"))
            }
        }
    )*};
}
le_num!(
    i8,
    i16,
    i32,
    i64,
    u8,
    u16,
    u32,
    u64,
    f32,
    f64,
    npyz::half::f16
);

impl LeBytes for bool {
    fn put(&self, out: &mut Vec<u8>) {
        out.push(u8::from(*self));
    }
    fn get(b: &[u8]) -> Self {
        b[0] != 0
    }
}

impl LeBytes for FixedSizeBytes<2> {
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.0);
    }
    fn get(b: &[u8]) -> Self {
        FixedSizeBytes([b[0], b[1]])
    }
}

impl<F: LeBytes> LeBytes for npyz::num_complex::Complex<F> {
    fn put(&self, out: &mut Vec<u8>) {
        self.re.put(out);
        self.im.put(out);
    }
    fn get(b: &[u8]) -> Self {
        let h = b.len() / 2;
        npyz::num_complex::Complex {
            re: F::get(&b[..h]),
            im: F::get(&b[h..]),
        }
    }
}

/// Serializes an array as `.npy` bytes.
///
/// Errors: `data.len()` differs from the size the type and dims imply, or a dim is negative.
pub fn to_npy_bytes(ty: PrimitiveType, dims: &[i64], data: &[u8]) -> Result<Vec<u8>> {
    let expected = crate::device::checked_byte_size(ty, dims)
        .with_context(|| format!("invalid dims {dims:?}"))?;
    if data.len() != expected {
        bail!(
            "{} {dims:?} needs {expected} bytes, got {}",
            ty.name(),
            data.len()
        );
    }
    let shape: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    let dtype = DType::Plain(
        numpy_descr(ty)
            .parse::<TypeStr>()
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    let mut out = Vec::with_capacity(data.len() + 128);
    with_rust_type!(ty, T => {
        let mut w = npyz::WriteOptions::<T>::new()
            .dtype(dtype)
            .shape(&shape)
            .writer(&mut out)
            .begin_nd()?;
        for chunk in data.chunks_exact(ty.byte_size()) {
            w.push(&T::get(chunk))?;
        }
        w.finish()?;
    });
    Ok(out)
}

/// Writes an array to a `.npy` file; see [`to_npy_bytes`].
pub fn write_npy(path: &Path, ty: PrimitiveType, dims: &[i64], data: &[u8]) -> Result<()> {
    let bytes = to_npy_bytes(ty, dims, data)?;
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// The XLA type a NumPy type string denotes, if any (`VN` has none on its own).
fn xla_type_of(descr: &TypeStr) -> Option<PrimitiveType> {
    let s = descr.to_string();
    let body = s.trim_start_matches(['<', '>', '|', '=']);
    Some(match body {
        "b1" => PrimitiveType::Pred,
        "i1" => PrimitiveType::S8,
        "i2" => PrimitiveType::S16,
        "i4" => PrimitiveType::S32,
        "i8" => PrimitiveType::S64,
        "u1" => PrimitiveType::U8,
        "u2" => PrimitiveType::U16,
        "u4" => PrimitiveType::U32,
        "u8" => PrimitiveType::U64,
        "f2" => PrimitiveType::F16,
        "f4" => PrimitiveType::F32,
        "f8" => PrimitiveType::F64,
        "c8" => PrimitiveType::C64,
        "c16" => PrimitiveType::C128,
        _ => return None,
    })
}

/// Parses `.npy` bytes into a dense array.
///
/// `expected` is the XLA type the caller needs (for example an executable parameter's). A raw
/// `|VN` array is accepted for any expected type of N bytes (this is how BF16 travels); a typed
/// array must match `expected` exactly — no silent conversion.
///
/// Errors: not an `.npy` file, Fortran order, a structured or object dtype, a type with no XLA
/// equivalent, or a type other than `expected`.
pub fn from_npy_bytes(bytes: &[u8], expected: Option<PrimitiveType>) -> Result<HostArray> {
    let file = NpyFile::new(bytes).context("not a valid .npy file")?;
    if file.order() != npyz::Order::C {
        bail!("Fortran-ordered arrays are not supported; save with np.ascontiguousarray");
    }
    let descr = match file.dtype() {
        DType::Plain(t) => t,
        other => bail!(
            "structured or array dtype {:?} is not supported",
            other.descr()
        ),
    };
    let dims: Vec<i64> = file
        .shape()
        .iter()
        .map(|&d| i64::try_from(d).context("dimension exceeds i64::MAX"))
        .collect::<Result<_>>()?;
    let ty = match (xla_type_of(&descr), expected) {
        (Some(t), Some(e)) if t != e => bail!(
            "array has dtype {descr} ({}) but {} is expected",
            t.name(),
            e.name()
        ),
        (Some(t), _) => t,
        // NumPy writes raw records as `|V2`; `ml_dtypes.bfloat16` arrays save as `<V2`. A byte
        // order marker means nothing for raw records, so any is accepted.
        (None, Some(e))
            if descr.to_string().trim_start_matches(['<', '>', '|', '='])
                == format!("V{}", e.byte_size()) =>
        {
            e
        }
        (None, Some(e)) => bail!("array dtype {descr} cannot hold {} values", e.name()),
        (None, None) => bail!("array dtype {descr} has no XLA equivalent"),
    };
    let len = crate::device::checked_byte_size(ty, &dims).context("array too large")?;
    let mut data = Vec::with_capacity(len);
    if ty == PrimitiveType::Bf16 || xla_type_of(&descr).is_none() {
        // Raw records: the bytes after the header are the data.
        let raw = file.into_inner();
        if raw.len() < len {
            bail!("array data is truncated: {} of {len} bytes", raw.len());
        }
        data.extend_from_slice(&raw[..len]);
    } else {
        with_rust_type!(ty, T => {
            for v in file.into_vec::<T>()? {
                v.put(&mut data);
            }
        });
    }
    Ok(HostArray { ty, dims, data })
}

/// Reads a `.npy` file; see [`from_npy_bytes`].
pub fn read_npy(path: &Path, expected: Option<PrimitiveType>) -> Result<HostArray> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    from_npy_bytes(&bytes, expected).with_context(|| format!("in {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips_exactly() {
        for ty in PrimitiveType::ALL {
            let n = 6;
            let data: Vec<u8> = (0..n * ty.byte_size())
                .map(|i| {
                    if ty == PrimitiveType::Pred {
                        (i % 2) as u8
                    } else {
                        (i * 37 + 11) as u8
                    }
                })
                .collect();
            let bytes = to_npy_bytes(ty, &[2, 3], &data).unwrap();
            let back = from_npy_bytes(&bytes, Some(ty)).unwrap();
            assert_eq!(
                back,
                HostArray {
                    ty,
                    dims: vec![2, 3],
                    data
                },
                "{}",
                ty.name()
            );
        }
    }

    #[test]
    fn header_uses_numpy_names() {
        let bytes = to_npy_bytes(PrimitiveType::F32, &[2], &[0; 8]).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("'descr': '<f4'"), "{text}");
        assert!(text.contains("'shape': (2,"), "{text}");
        let bytes = to_npy_bytes(PrimitiveType::Bf16, &[], &[0x80, 0x3f]).unwrap();
        assert!(String::from_utf8_lossy(&bytes).contains("'descr': '|V2'"));
    }

    #[test]
    fn raw_records_with_any_byte_order_marker() {
        // What `np.save` writes for an `ml_dtypes.bfloat16` array: `<V2`.
        let bytes = to_npy_bytes(PrimitiveType::Bf16, &[2], &[0x80, 0x3f, 0, 0x40]).unwrap();
        let mut ml = bytes.clone();
        let at = ml.windows(5).position(|w| w == b"'|V2'").unwrap();
        ml[at + 1] = b'<';
        let back = from_npy_bytes(&ml, Some(PrimitiveType::Bf16)).unwrap();
        assert_eq!(back.data, [0x80, 0x3f, 0, 0x40]);
        assert_eq!(back.dims, [2]);
        let err = from_npy_bytes(&ml, Some(PrimitiveType::F32)).unwrap_err();
        assert!(err.to_string().contains("cannot hold F32"), "{err}");
    }

    #[test]
    fn mismatched_type_is_refused() {
        let bytes = to_npy_bytes(PrimitiveType::F64, &[1], &[0; 8]).unwrap();
        let err = from_npy_bytes(&bytes, Some(PrimitiveType::F32)).unwrap_err();
        assert!(err.to_string().contains("F32 is expected"), "{err}");
    }
}
