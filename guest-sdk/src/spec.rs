//! [`TensorSpec`]: a dtype and dims, with element-count and byte-size arithmetic checked for
//! overflow, and the guest-side length checks done before data is sent to the host.

use std::fmt;

use crate::{Dtype, Error, Result, TensorSpec};

impl TensorSpec {
    /// A spec of `dtype` with `dims` (row-major; empty for a scalar).
    pub fn new(dtype: Dtype, dims: &[u64]) -> Self {
        TensorSpec {
            dtype,
            dims: dims.to_vec(),
        }
    }

    /// Number of dimensions (0 for a scalar).
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// Number of elements (the product of dims; 1 for a scalar).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) if the product overflows `usize`.
    pub fn element_count(&self) -> Result<usize> {
        element_count(&self.dims)
    }

    /// Size of the dense host representation in bytes (`dtype.size_bytes()` × element count).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) if the size overflows `usize`.
    pub fn byte_size(&self) -> Result<usize> {
        self.element_count()?
            .checked_mul(self.dtype.size_bytes())
            .ok_or_else(|| Error::invalid_argument(format!("byte size of {self} overflows")))
    }
}

/// Formats as XLA does, e.g. `f32[2,3]`, `pred[]`.
impl fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Product of `dims` as a `usize` element count (1 for no dims), checked for overflow.
fn element_count(dims: &[u64]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| {
            usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        })
        .ok_or_else(|| Error::invalid_argument(format!("element count of dims {dims:?} overflows")))
}

/// Checks guest-side that `len` elements fill a tensor of `dims` exactly.
pub(crate) fn check_len(dtype: Dtype, dims: &[u64], len: usize) -> Result<()> {
    let count = element_count(dims)?;
    if count != len {
        return Err(Error::invalid_argument(format!(
            "{} has {count} elements but {len} were given",
            TensorSpec::new(dtype, dims)
        )));
    }
    Ok(())
}

/// Checks guest-side that `len` bytes are the dense size of a `dtype` tensor of `dims`.
pub(crate) fn check_byte_len(dtype: Dtype, dims: &[u64], len: usize) -> Result<()> {
    let spec = TensorSpec::new(dtype, dims);
    let want = spec.byte_size()?;
    if want != len {
        return Err(Error::invalid_argument(format!(
            "{spec} needs {want} bytes but {len} were given"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn spec_counts_and_display() {
        let s = TensorSpec::new(Dtype::F32, &[2, 3]);
        assert_eq!(s.rank(), 2);
        assert_eq!(s.element_count().unwrap(), 6);
        assert_eq!(s.byte_size().unwrap(), 24);
        assert_eq!(s.to_string(), "f32[2,3]");
        let scalar = TensorSpec::new(Dtype::Pred, &[]);
        assert_eq!(scalar.element_count().unwrap(), 1);
        assert_eq!(scalar.to_string(), "pred[]");
        assert_eq!(TensorSpec::new(Dtype::C64, &[0, 5]).byte_size().unwrap(), 0);
        let huge = TensorSpec::new(Dtype::F64, &[u64::MAX, 2]);
        assert_eq!(
            huge.element_count().unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        let huge_bytes = TensorSpec::new(Dtype::F64, &[1 << 62]);
        assert!(huge_bytes.byte_size().is_err());
    }
}
