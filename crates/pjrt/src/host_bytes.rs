//! [`HostBytes`]: 64-byte aligned host memory for zero-copy uploads.

/// One 64-byte, 64-byte-aligned block.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Chunk([u8; 64]);

/// Owned host bytes whose start is 64-byte aligned, so PJRT can alias them instead of copying
/// (`PJRT_HostBufferSemantics_kImmutableZeroCopy`, see [`crate::Client::buffer_from_host_bytes`]).
///
/// Backed by a `Vec` of 64-byte aligned blocks; the last block is zero-padded past
/// [`HostBytes::len`].
#[derive(Clone, Default)]
pub struct HostBytes {
    chunks: Vec<Chunk>,
    len: usize,
}

impl HostBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        Self {
            chunks: vec![Chunk([0; 64]); len.div_ceil(64)],
            len,
        }
    }

    /// A 64-byte aligned copy of `b`.
    pub fn from_slice(b: &[u8]) -> Self {
        let mut h = Self::zeroed(b.len());
        h.as_mut_slice().copy_from_slice(b);
        h
    }

    /// The bytes (length [`HostBytes::len`]); the pointer is 64-byte aligned.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `chunks` holds `ceil(len/64)*64 >= len` initialized bytes starting at its
        // (aligned, possibly dangling-but-aligned when empty) data pointer; `Chunk` is
        // `repr(C)` over `[u8; 64]`, so its bytes are plain `u8`s; the borrow of `self` keeps the
        // allocation alive and unmodified.
        unsafe { std::slice::from_raw_parts(self.chunks.as_ptr().cast::<u8>(), self.len) }
    }

    /// Mutable access to the bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; the exclusive borrow of `self` makes the slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.chunks.as_mut_ptr().cast::<u8>(), self.len) }
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when [`HostBytes::len`] is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBytes")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl From<&[u8]> for HostBytes {
    fn from(b: &[u8]) -> Self {
        Self::from_slice(b)
    }
}
