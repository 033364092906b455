//! Tier 3 of tpubox's compile cache: a remote, persistent store of serialized executables,
//! shared by a fleet. It implements `tpubox_core::cache::RemoteStore`; a program offers tier 3
//! by setting `CacheConfig::remote_opener` to [`open`]. It stands beside the device and session
//! layer so that only programs that want it link an HTTP client.
//!
//! Any URL the [`object_store`] crate understands works: `file:///abs/dir`, `s3://bucket/prefix`,
//! `gs://bucket/prefix` (and `memory://` for tests). Credentials and endpoints come from the
//! environment, read the way `object_store`'s builders read them: every variable whose name
//! starts with `AWS_` or `GOOGLE_` is passed on as an option (for example `AWS_ENDPOINT`,
//! `AWS_ALLOW_HTTP`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
//! `GOOGLE_SERVICE_ACCOUNT`).
//!
//! Objects are named `<prefix>/<key>.tpbx` and hold exactly the bytes of a tier-2 file
//! (`tpubox_core::cache::disk::encode`): magic, format version, key, lengths and SHA-256 are checked on every
//! fetch, so a corrupt or foreign object is reported and never loaded.

use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use tpubox_core::cache::disk::{self, Entry};
use tpubox_core::cache::remote::BoxFuture;
use tpubox_core::cache::{CacheError, CacheKey, CacheResult, RemoteStore};

/// A store error as the cache reports it.
fn store_err(e: object_store::Error) -> CacheError {
    CacheError::Store(Box::new(e))
}

/// The [`RemoteOpener`](tpubox_core::cache::RemoteOpener) of this crate: [`RemoteCache::open_with`]
/// with the environment's options first, then `options`.
///
/// Errors: [`CacheError::Url`] for a URL that does not parse, an unknown scheme or option.
pub fn open(url: &str, options: &[(String, String)]) -> CacheResult<Arc<dyn RemoteStore>> {
    Ok(Arc::new(RemoteCache::open_with(
        url,
        env_options().chain(options.iter().cloned()),
    )?))
}

impl RemoteStore for RemoteCache {
    fn url(&self) -> &str {
        RemoteCache::url(self)
    }

    fn get<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, CacheResult<Option<Entry>>> {
        Box::pin(RemoteCache::get(self, key))
    }

    fn put<'a>(&'a self, key: &'a CacheKey, entry: &'a Entry) -> BoxFuture<'a, CacheResult<()>> {
        Box::pin(RemoteCache::put(self, key, entry))
    }
}

/// Suffix of tier-3 object names.
pub const OBJECT_SUFFIX: &str = ".tpbx";

/// Age past which [`RemoteCache::open`] removes an unfinished upload of a `file://` store.
pub const STALE_UPLOAD: std::time::Duration = std::time::Duration::from_secs(3600);

/// Removes the staging files that uploads to a `file://` store left in its directory `dir`
/// when their process was killed (`object_store` writes `<key>.tpbx#<n>` and renames it into
/// place, so an object is whole or absent), once older than `older_than`; returns how many.
/// Those uploads take no lock, so another live process's upload can be told from a dead one
/// by age only; one upload of an entry takes seconds at most.
pub fn remove_stale_uploads(dir: &std::path::Path, older_than: std::time::Duration) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    for e in rd.filter_map(|e| e.ok()) {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let staged = name
            .split_once(&format!("{OBJECT_SUFFIX}#"))
            .is_some_and(|(key, n)| {
                CacheKey::from_hex(key).is_some()
                    && !n.is_empty()
                    && n.bytes().all(|b| b.is_ascii_digit())
            });
        let old = e
            .metadata()
            .ok()
            .filter(|m| m.is_file())
            .and_then(|m| m.modified().ok())
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age >= older_than);
        if staged && old && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// A handle on the remote tier. Cheap to clone.
#[derive(Clone)]
pub struct RemoteCache {
    store: Arc<dyn ObjectStore>,
    prefix: StorePath,
    url: String,
}

impl std::fmt::Debug for RemoteCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteCache")
            .field("url", &self.url)
            .finish()
    }
}

/// Entries and bytes under the remote prefix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RemoteUsage {
    /// Objects named like cache entries.
    pub entries: u64,
    /// Their total size in bytes.
    pub bytes: u64,
}

/// The `AWS_*` and `GOOGLE_*` environment variables, as store options.
pub fn env_options() -> impl Iterator<Item = (String, String)> {
    std::env::vars().filter(|(k, _)| k.starts_with("AWS_") || k.starts_with("GOOGLE_"))
}

impl RemoteCache {
    /// Opens the store named by `url`, with options taken from the environment (see the module
    /// docs). Nothing is contacted until the first request.
    ///
    /// Errors: [`CacheError::Url`] for a URL that does not parse or names a scheme
    /// `object_store` does not know (or one this build lacks: only `file`, `memory`, `s3` and
    /// `gs` are built in).
    pub fn open(url: &str) -> CacheResult<Self> {
        Self::open_with(url, env_options())
    }

    /// Like [`open`](Self::open) with explicit options (`aws_endpoint`, `aws_allow_http`, ...;
    /// names as in `object_store`'s `AmazonS3ConfigKey` and `GoogleConfigKey`).
    ///
    /// Errors: as [`open`](Self::open), and an unknown option name for the URL's scheme.
    pub fn open_with<I, K, V>(url: &str, options: I) -> CacheResult<Self>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: Into<String>,
    {
        // reqwest is built without a TLS crypto provider of its own (`rustls-no-provider`):
        // give the process ring's, unless the embedder installed one first.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let bad = |reason: String| CacheError::Url {
            url: url.to_string(),
            reason,
        };
        let parsed = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
        let options: Vec<(String, String)> = options
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_ascii_lowercase(), v.into()))
            .collect();
        let (store, prefix) =
            object_store::parse_url_opts(&parsed, options).map_err(|e| bad(e.to_string()))?;
        if parsed.scheme() == "file"
            && let Ok(dir) = parsed.to_file_path()
        {
            remove_stale_uploads(&dir, STALE_UPLOAD);
        }
        Ok(RemoteCache {
            store: Arc::from(store),
            prefix,
            url: url.to_string(),
        })
    }

    /// The URL this handle was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The object name of `key`.
    pub fn object(&self, key: &CacheKey) -> StorePath {
        self.prefix.clone().join(format!("{key}{OBJECT_SUFFIX}"))
    }

    /// Fetches and verifies the entry for `key`; `Ok(None)` when there is none.
    ///
    /// Errors: [`CacheError::Store`] when the store fails; [`CacheError::Corrupt`] naming the
    /// object when it fails the header, key or checksum checks (the object is left in place:
    /// other hosts may be reading it, and the next upload of this key replaces it).
    pub async fn get(&self, key: &CacheKey) -> CacheResult<Option<Entry>> {
        let object = self.object(key);
        let result = match self.store.get(&object).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(store_err(e)),
        };
        let bytes = result.bytes().await.map_err(store_err)?;
        match disk::decode(key, &bytes) {
            Ok(entry) => Ok(Some(entry)),
            Err(CacheError::Corrupt { reason, .. }) => Err(CacheError::Corrupt {
                location: format!("{}/{object}", self.url.trim_end_matches('/')),
                reason,
            }),
            Err(e) => Err(e),
        }
    }

    /// Uploads `entry` under `key` (one PUT of the encoded bytes; stores make it atomic).
    ///
    /// Errors: [`CacheError::Store`].
    pub async fn put(&self, key: &CacheKey, entry: &Entry) -> CacheResult<()> {
        let bytes = disk::encode(key, entry);
        self.store
            .put(&self.object(key), PutPayload::from(bytes))
            .await
            .map_err(store_err)?;
        Ok(())
    }

    /// Counts the entries under the prefix.
    ///
    /// Errors: [`CacheError::Store`].
    pub async fn usage(&self) -> CacheResult<RemoteUsage> {
        let mut u = RemoteUsage::default();
        for m in self.entries().await? {
            u.entries += 1;
            u.bytes += m.size;
        }
        Ok(u)
    }

    /// The objects under the prefix named like cache entries.
    async fn entries(&self) -> CacheResult<Vec<object_store::ObjectMeta>> {
        let metas: Vec<object_store::ObjectMeta> = self
            .store
            .list(Some(&self.prefix))
            .try_collect()
            .await
            .map_err(store_err)?;
        Ok(metas
            .into_iter()
            .filter(|m| m.location.as_ref().ends_with(OBJECT_SUFFIX))
            .collect())
    }

    /// Deletes every entry under the prefix; returns how many were deleted.
    ///
    /// Errors: [`CacheError::Store`].
    pub async fn clear(&self) -> CacheResult<u64> {
        let mut n = 0;
        for m in self.entries().await? {
            self.store.delete(&m.location).await.map_err(store_err)?;
            n += 1;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpubox_core::cache::EntryMeta;

    fn entry() -> Entry {
        Entry {
            meta: EntryMeta {
                inputs: vec![("F32".into(), vec![2, 3])],
                outputs: vec![("F32".into(), vec![3])],
                fingerprint: "abc".into(),
                compile_ms: 12.5,
            },
            executable: (0..=255u8).cycle().take(5000).collect(),
        }
    }

    #[tokio::test]
    async fn file_store_round_trip_and_corruption_detected() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}/fleet", dir.path().display());
        std::fs::create_dir_all(dir.path().join("fleet")).unwrap();
        let r = RemoteCache::open_with(&url, std::iter::empty::<(&str, &str)>()).unwrap();
        let key = CacheKey([7; 32]);
        assert_eq!(r.get(&key).await.unwrap(), None);
        r.put(&key, &entry()).await.unwrap();
        let got = r.get(&key).await.unwrap().unwrap();
        assert_eq!(got, entry());
        assert_eq!(
            r.usage().await.unwrap(),
            RemoteUsage {
                entries: 1,
                bytes: disk::encode(&key, &entry()).len() as u64
            }
        );
        // An object stored under another key's name is refused.
        let other = CacheKey([8; 32]);
        let path = dir.path().join(format!("fleet/{other}{OBJECT_SUFFIX}"));
        std::fs::write(&path, disk::encode(&key, &entry())).unwrap();
        assert!(matches!(
            r.get(&other).await,
            Err(CacheError::Corrupt { .. })
        ));
        // A flipped byte is refused.
        let path = dir.path().join(format!("fleet/{key}{OBJECT_SUFFIX}"));
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert!(matches!(r.get(&key).await, Err(CacheError::Corrupt { .. })));
        assert_eq!(r.clear().await.unwrap(), 2);
        assert_eq!(r.usage().await.unwrap(), RemoteUsage::default());
    }

    #[test]
    fn stale_staged_uploads_are_removed_when_a_file_store_opens() {
        let dir = tempfile::tempdir().unwrap();
        let key = CacheKey([9; 32]);
        let staged = dir.path().join(format!("{key}{OBJECT_SUFFIX}#3"));
        let other = dir.path().join("notes#3");
        std::fs::write(&staged, b"half").unwrap();
        std::fs::write(&other, b"mine").unwrap();
        // Young: maybe another process's upload in progress.
        assert_eq!(remove_stale_uploads(dir.path(), STALE_UPLOAD), 0);
        let old = std::time::SystemTime::now() - 2 * STALE_UPLOAD;
        for p in [&staged, &other] {
            std::fs::File::options()
                .append(true)
                .open(p)
                .unwrap()
                .set_modified(old)
                .unwrap();
        }
        let url = format!("file://{}", dir.path().display());
        RemoteCache::open_with(&url, std::iter::empty::<(&str, &str)>()).unwrap();
        assert!(!staged.exists());
        assert!(other.exists(), "only staged uploads of entries are removed");
    }

    #[test]
    fn bad_urls_are_errors() {
        assert!(RemoteCache::open("not a url").is_err());
        assert!(RemoteCache::open("ftp://example.com/x").is_err());
    }
}
