//! Tier 3's interface: a remote, persistent store of serialized executables shared by a fleet.
//!
//! The store itself (the `object_store` crate: `file://`, `s3://`, `gs://`) lives in the crate
//! `tpubox-cache-remote`, so that the device and session layer links no HTTP client; a program
//! that offers tier 3 passes that crate's opener in [`CacheConfig::remote_opener`](super::CacheConfig::remote_opener).
//! An object holds exactly the bytes of a tier-2 file ([`disk::encode`](super::disk::encode)), and
//! a store checks them on every fetch with [`disk::decode`](super::disk::decode).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::disk::Entry;
use super::error::CacheResult;
use super::key::CacheKey;

/// A boxed future that may move between threads (the trait is object-safe with it).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A tier-3 store, as the [`CompileCache`](super::CompileCache) uses it.
pub trait RemoteStore: Send + Sync + std::fmt::Debug {
    /// The URL it was opened with (logs, `tpubox cache stats`).
    fn url(&self) -> &str;

    /// Fetches and verifies the entry for `key`; `Ok(None)` when there is none.
    ///
    /// Errors: [`CacheError::Store`](super::CacheError::Store) when the store fails;
    /// [`CacheError::Corrupt`](super::CacheError::Corrupt) naming the object when it fails the
    /// header, key or checksum checks.
    fn get<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, CacheResult<Option<Entry>>>;

    /// Uploads `entry` under `key`, atomically (one PUT).
    ///
    /// Errors: [`CacheError::Store`](super::CacheError::Store).
    fn put<'a>(&'a self, key: &'a CacheKey, entry: &'a Entry) -> BoxFuture<'a, CacheResult<()>>;
}

/// Opens the store `url` names, with `options` applied after those a store reads from the
/// environment. Errors: [`CacheError::Url`](super::CacheError::Url) for a URL that does not
/// parse, an unknown scheme or option.
pub type RemoteOpener =
    fn(url: &str, options: &[(String, String)]) -> CacheResult<Arc<dyn RemoteStore>>;
