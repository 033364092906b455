//! [`MappedFile`]: a read-only memory map of a file, as a source of host bytes for uploads
//! (weights files are mapped instead of read into the heap).

use std::path::Path;

use crate::error::{Error, ErrorCode, Result};

/// A file mapped read-only into memory. Its bytes are valid for as long as the value lives.
///
/// The map is private and read-only. Like every memory map, it assumes no other process
/// truncates or rewrites the file while it is mapped: a truncated file makes reads past the new
/// end fault (SIGBUS). tpubox maps weights files once, copies them to the device, and drops the
/// map; do not point it at files that are being written.
pub struct MappedFile {
    map: memmap2::Mmap,
}

impl MappedFile {
    /// Maps `path` read-only.
    ///
    /// Errors: `NotFound` when the file does not exist; `InvalidArgument` when it cannot be
    /// opened or mapped (a directory, no permission).
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                ErrorCode::NotFound
            } else {
                ErrorCode::InvalidArgument
            };
            Error::new(code, format!("opening {}: {e}", path.display()))
        })?;
        // SAFETY: the map is read-only and private (`Mmap::map` uses PROT_READ + MAP_SHARED of a
        // file opened read-only, so this process cannot write through it), and the returned
        // bytes are only handed out as `&[u8]` borrowed from `self`, so they cannot outlive the
        // map. The remaining hazard, another process truncating the file while mapped, is
        // documented on the type.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| {
            Error::new(
                ErrorCode::InvalidArgument,
                format!("mapping {}: {e}", path.display()),
            )
        })?;
        Ok(MappedFile { map })
    }

    /// Maps the first `len` bytes of a memfd (`memfd_create(2)`) that its writer sealed
    /// against writing and shrinking (`F_SEAL_WRITE | F_SEAL_SHRINK`), e.g. a tensor a client
    /// process on the same machine hands over a Unix socket. Only those `len` bytes are mapped
    /// (and populated): a memfd larger than what its sender declared costs this process no
    /// more than `len` bytes of resident memory.
    ///
    /// Errors: `InvalidArgument` when the descriptor is not a memfd, lacks either seal, holds
    /// fewer than `len` bytes, or cannot be mapped.
    pub fn sealed_memfd(fd: std::os::fd::OwnedFd, len: usize) -> Result<Self> {
        use rustix::fs::SealFlags;
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            Error::new(
                ErrorCode::InvalidArgument,
                format!("the descriptor is not a memfd (F_GET_SEALS: {e})"),
            )
        })?;
        if !seals.contains(SealFlags::WRITE | SealFlags::SHRINK) {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "the memfd must be sealed with F_SEAL_WRITE and F_SEAL_SHRINK before it is handed over",
            ));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| {
                Error::new(
                    ErrorCode::InvalidArgument,
                    format!("the memfd's size (fstat: {e})"),
                )
            })?
            .st_size;
        if u64::try_from(size).unwrap_or(0) < len as u64 {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!("the memfd holds {size} bytes, fewer than the {len} declared"),
            ));
        }
        let file = std::fs::File::from(fd);
        // SAFETY: the kernel enforces both seals for as long as the file exists, and this map
        // keeps it open: F_SEAL_SHRINK means the file never gets shorter than it is now, and
        // it holds at least `len` bytes now (checked above with the seal already in place), so
        // no page of this `len`-byte map can fault with SIGBUS; F_SEAL_WRITE means no process
        // can change its contents (no write(2), and no writable shared mapping: the seal could
        // not have been added while one existed), so the `&[u8]` handed out below is
        // immutable memory. The bytes are borrowed from `self` and cannot outlive the map. The
        // map is populated at once (MAP_POPULATE), `len` bytes only: one call instead of a
        // page fault per 4 KiB page.
        let map =
            unsafe { memmap2::MmapOptions::new().len(len).populate().map(&file) }.map_err(|e| {
                Error::new(
                    ErrorCode::InvalidArgument,
                    format!("mapping the memfd: {e}"),
                )
            })?;
        Ok(MappedFile { map })
    }

    /// The file's bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }
}
