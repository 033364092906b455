//! The compile cache's one error type.

use std::path::PathBuf;

/// What can go wrong in the compile cache. None of these fail a compile's caller: the cache
/// logs them and compiles instead ([`CompileCache::get_or_compile`](super::CompileCache::get_or_compile)).
/// They reach callers of the tier APIs ([`DiskCache`](super::DiskCache),
/// [`RemoteStore`](super::RemoteStore)) and of [`CompileCache::new`](super::CompileCache::new).
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A file or directory of tier 2 could not be created, written or renamed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// An entry failed verification (magic, format version, key, lengths, SHA-256 or its
    /// metadata) and was not loaded.
    #[error("corrupt cache entry {location}: {reason}")]
    Corrupt {
        /// The entry's file path (tier 2) or object name (tier 3).
        location: String,
        /// Which check failed.
        reason: String,
    },
    /// The tier-3 object store could not be reached or answered with an error.
    #[error("remote store: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A tier-3 URL that does not parse, names an unknown scheme, or has an unknown option.
    #[error(
        "remote cache URL {url:?}: {reason} (expected file:///ABSOLUTE/DIR, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX)"
    )]
    Url {
        /// The URL as given.
        url: String,
        /// What was wrong with it.
        reason: String,
    },
}

impl CacheError {
    /// An [`Io`](Self::Io) error for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CacheError::Io {
            path: path.into(),
            source,
        }
    }

    /// Whether this error says an entry was corrupt (as opposed to unreachable).
    pub fn is_corrupt(&self) -> bool {
        matches!(self, CacheError::Corrupt { .. })
    }
}

/// Result of a cache operation.
pub type CacheResult<T> = Result<T, CacheError>;
