//! Tier 2 of the compile cache: serialized executables in a directory shared by every process
//! of a host.
//!
//! One file per key, `<hex key>.tpbx`:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `TPBXEXE\0` |
//! | 4 | format version ([`CACHE_FORMAT_VERSION`]), little-endian |
//! | 32 | the key |
//! | 4 | metadata length M, little-endian |
//! | 8 | executable length N, little-endian |
//! | 32 | SHA-256 of the metadata and executable bytes |
//! | M | metadata (JSON: parameter and result specs, fingerprint, compile time) |
//! | N | the serialized executable (`PJRT_Executable_Serialize`) |
//!
//! Writes go to a locked temporary file in the same directory (`.tmp-…`), are flushed to the
//! disk and renamed into place ([`super::atomic::write`]), so readers in other processes see
//! either no entry or a whole one, even when the writer is killed (SIGKILL) in the middle; two
//! writers of one key both leave a valid entry. A killed writer leaves only its temporary file,
//! which the next process to open the directory read-write removes ([`DiskCache::new`]; a
//! temporary another live process is writing is locked and left alone). Every read checks
//! magic, version, key, lengths and checksum; an entry that fails is reported, removed and
//! treated as a miss — never loaded. Reads refresh the file's modification time, which orders
//! eviction (least recently used first) when the directory exceeds its byte cap.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::atomic::{self, TEMP_PREFIX};
use super::error::{CacheError, CacheResult};
use super::key::{CACHE_FORMAT_VERSION, CacheKey};

const MAGIC: &[u8; 8] = b"TPBXEXE\0";
const HEADER_LEN: usize = 8 + 4 + 32 + 4 + 8 + 32;
/// File name extension of entries.
pub const ENTRY_EXT: &str = "tpbx";

/// What an entry records besides the executable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EntryMeta {
    /// Parameter specs as (XLA type name, dims).
    pub inputs: Vec<(String, Vec<i64>)>,
    /// Result specs as (XLA type name, dims).
    pub outputs: Vec<(String, Vec<i64>)>,
    /// The executable's fingerprint.
    pub fingerprint: String,
    /// How long the original compile took, in milliseconds (to report time saved).
    pub compile_ms: f64,
}

/// A verified entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Its metadata.
    pub meta: EntryMeta,
    /// The serialized executable.
    pub executable: Vec<u8>,
}

/// Size and count of the entries in a directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DiskUsage {
    /// Number of entries.
    pub entries: u64,
    /// Their total size in bytes.
    pub bytes: u64,
}

/// Hit and miss counters of a cache directory, summed over every process that used it
/// (kept in `stats.json` in the directory, replaced atomically under a lock on `stats.lock`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DiskCounters {
    /// Lookups answered from the directory.
    pub hits: u64,
    /// Lookups that found nothing usable.
    pub misses: u64,
    /// Compile time the hits saved, in milliseconds.
    pub compile_ms_saved: f64,
}

/// A cache directory.
#[derive(Debug, Clone)]
pub struct DiskCache {
    dir: PathBuf,
    max_bytes: u64,
    read_only: bool,
}

/// Encodes an entry in the file layout above.
pub fn encode(key: &CacheKey, entry: &Entry) -> Vec<u8> {
    let meta = serde_json::to_vec(&entry.meta).expect("entry metadata serializes");
    let mut h = Sha256::new();
    h.update(&meta);
    h.update(&entry.executable);
    let sum: [u8; 32] = h.finalize().into();
    let mut out = Vec::with_capacity(HEADER_LEN + meta.len() + entry.executable.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&CACHE_FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&key.0);
    out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    out.extend_from_slice(&(entry.executable.len() as u64).to_le_bytes());
    out.extend_from_slice(&sum);
    out.extend_from_slice(&meta);
    out.extend_from_slice(&entry.executable);
    out
}

/// Decodes and verifies an entry for `key`.
///
/// Errors: [`CacheError::Corrupt`] saying which check failed; its location is the key (callers
/// that know a file or object name put it there).
pub fn decode(key: &CacheKey, bytes: &[u8]) -> CacheResult<Entry> {
    verify(key, bytes).map_err(|reason| CacheError::Corrupt {
        location: key.hex(),
        reason,
    })
}

fn verify(key: &CacheKey, bytes: &[u8]) -> Result<Entry, String> {
    if bytes.len() < HEADER_LEN {
        return Err(format!(
            "truncated: {} bytes, the header alone is {HEADER_LEN}",
            bytes.len()
        ));
    }
    if &bytes[0..8] != MAGIC {
        return Err("bad magic".into());
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != CACHE_FORMAT_VERSION {
        return Err(format!(
            "format version {version}, expected {CACHE_FORMAT_VERSION}"
        ));
    }
    if bytes[12..44] != key.0 {
        return Err("entry holds another key".into());
    }
    let meta_len = u32::from_le_bytes(bytes[44..48].try_into().expect("4 bytes")) as usize;
    let exe_len = u64::from_le_bytes(bytes[48..56].try_into().expect("8 bytes"));
    let want = (HEADER_LEN as u64)
        .checked_add(meta_len as u64)
        .and_then(|n| n.checked_add(exe_len));
    if want != Some(bytes.len() as u64) {
        return Err(format!(
            "length mismatch: header says {} bytes, file has {}",
            want.map_or("overflowing".to_string(), |n| n.to_string()),
            bytes.len()
        ));
    }
    let body = &bytes[HEADER_LEN..];
    let sum: [u8; 32] = Sha256::digest(body).into();
    if sum[..] != bytes[56..88] {
        return Err("checksum mismatch".into());
    }
    let meta: EntryMeta =
        serde_json::from_slice(&body[..meta_len]).map_err(|e| format!("bad metadata: {e}"))?;
    Ok(Entry {
        meta,
        executable: body[meta_len..].to_vec(),
    })
}

impl DiskCache {
    /// A cache in `dir` (created if missing unless `read_only`), evicting least recently used
    /// entries above `max_bytes`. Unless `read_only`, removes the temporary files that writers
    /// killed in the middle of a write left in `dir` (those no live process holds locked; see
    /// [`super::atomic`]).
    ///
    /// Errors: the directory cannot be created.
    pub fn new(dir: &Path, max_bytes: u64, read_only: bool) -> CacheResult<Self> {
        if !read_only {
            std::fs::create_dir_all(dir).map_err(|e| CacheError::io(dir, e))?;
            let n = atomic::remove_stale(dir, TEMP_PREFIX);
            if n > 0 {
                tracing::info!(target: "tpubox::cache", dir = %dir.display(), removed = n, "removed temporary files that interrupted writes left");
            }
        }
        Ok(DiskCache {
            dir: dir.to_path_buf(),
            max_bytes,
            read_only,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the entry for `key`.
    pub fn path(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(format!("{}.{ENTRY_EXT}", key.hex()))
    }

    /// Reads and verifies the entry for `key`. `Ok(None)` is a miss (an unreadable file is
    /// one too).
    ///
    /// Errors: [`CacheError::Corrupt`] naming the file, for the caller to report; the entry is
    /// removed first (unless read-only).
    pub fn get(&self, key: &CacheKey) -> CacheResult<Option<Entry>> {
        let path = self.path(key);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(_) => return Ok(None),
        };
        match decode(key, &bytes) {
            Ok(entry) => {
                if !self.read_only {
                    // Refresh the LRU order; failure only makes eviction less precise.
                    if let Ok(f) = std::fs::File::options().append(true).open(&path) {
                        let _ = f.set_modified(SystemTime::now());
                    }
                }
                Ok(Some(entry))
            }
            Err(e) => {
                if !self.read_only {
                    let _ = std::fs::remove_file(&path);
                }
                Err(match e {
                    CacheError::Corrupt { reason, .. } => CacheError::Corrupt {
                        location: path.display().to_string(),
                        reason,
                    },
                    other => other,
                })
            }
        }
    }

    /// Writes the entry for `key` atomically, then evicts down to the byte cap. Does nothing
    /// in read-only mode.
    ///
    /// Errors: [`CacheError::Io`] writing or renaming the file.
    pub fn put(&self, key: &CacheKey, entry: &Entry) -> CacheResult<()> {
        if self.read_only {
            return Ok(());
        }
        let bytes = encode(key, entry);
        let path = self.path(key);
        atomic::write(&path, &bytes, true).map_err(|e| CacheError::io(&path, e))?;
        self.prune(self.max_bytes);
        Ok(())
    }

    fn entries(&self) -> Vec<(PathBuf, u64, SystemTime)> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        rd.filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == ENTRY_EXT))
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                Some((
                    e.path(),
                    m.len(),
                    m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                ))
            })
            .collect()
    }

    /// The counters summed over all processes (zero when none were recorded).
    pub fn counters(&self) -> DiskCounters {
        std::fs::read(self.dir.join("stats.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// Adds `delta` to the shared counters: read-modify-write under an exclusive lock on
    /// `stats.lock`, `stats.json` replaced atomically (not flushed to the disk: counters are
    /// worth no `fsync` per lookup). Best effort: does nothing in read-only mode or when the
    /// lock cannot be taken.
    pub fn record(&self, delta: DiskCounters) {
        if self.read_only {
            return;
        }
        let Ok(lock) = std::fs::File::options()
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.dir.join("stats.lock"))
        else {
            return;
        };
        if lock.lock().is_err() {
            return;
        }
        let mut c = self.counters();
        c.hits += delta.hits;
        c.misses += delta.misses;
        c.compile_ms_saved += delta.compile_ms_saved;
        let out = serde_json::to_vec(&c).expect("counters serialize");
        let _ = atomic::write(&self.dir.join("stats.json"), &out, false);
    }

    /// Number and total size of the entries.
    pub fn usage(&self) -> DiskUsage {
        let e = self.entries();
        DiskUsage {
            entries: e.len() as u64,
            bytes: e.iter().map(|(_, n, _)| n).sum(),
        }
    }

    /// Removes least recently used entries until the total is at most `max_bytes`; returns how
    /// many were removed. Entries another process removed first, and removal failures, are
    /// skipped.
    pub fn prune(&self, max_bytes: u64) -> u64 {
        let mut entries = self.entries();
        let mut total: u64 = entries.iter().map(|(_, n, _)| n).sum();
        if total <= max_bytes {
            return 0;
        }
        entries.sort_by_key(|(_, _, t)| *t);
        let mut removed = 0;
        for (path, len, _) in entries {
            if total <= max_bytes {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                removed += 1;
            }
            total = total.saturating_sub(len);
        }
        removed
    }

    /// Removes every entry (and the temporary files of interrupted writes; not those another
    /// process is writing now); returns how many entries were removed. Removal failures are
    /// skipped.
    pub fn clear(&self) -> u64 {
        let mut n = 0;
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.filter_map(|e| e.ok()) {
                let p = e.path();
                if p.extension().is_some_and(|x| x == ENTRY_EXT) && std::fs::remove_file(&p).is_ok()
                {
                    n += 1;
                }
            }
        }
        atomic::remove_stale(&self.dir, TEMP_PREFIX);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry {
            meta: EntryMeta {
                inputs: vec![("F32".into(), vec![2, 2])],
                outputs: vec![("F32".into(), vec![2])],
                fingerprint: "fp".into(),
                compile_ms: 12.5,
            },
            executable: (0..=255u8).collect(),
        }
    }

    #[test]
    fn round_trip() {
        let k = CacheKey([7; 32]);
        assert_eq!(decode(&k, &encode(&k, &entry())).unwrap(), entry());
    }

    #[test]
    fn every_flipped_byte_and_every_truncation_is_detected() {
        let k = CacheKey([7; 32]);
        let good = encode(&k, &entry());
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            assert!(decode(&k, &bad).is_err(), "flipped byte {i} went unnoticed");
        }
        for n in 0..good.len() {
            assert!(
                decode(&k, &good[..n]).is_err(),
                "truncation to {n} went unnoticed"
            );
        }
        assert!(
            decode(&CacheKey([8; 32]), &good)
                .unwrap_err()
                .to_string()
                .contains("another key")
        );
    }

    #[test]
    fn corrupt_entry_is_removed_and_lru_eviction_keeps_recent() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::new(dir.path(), 10_000, false).unwrap();
        let k = CacheKey([1; 32]);
        c.put(&k, &entry()).unwrap();
        assert_eq!(c.get(&k).unwrap(), Some(entry()));
        let mut bytes = std::fs::read(c.path(&k)).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(c.path(&k), bytes).unwrap();
        let err = c.get(&k).unwrap_err();
        assert!(
            matches!(&err, CacheError::Corrupt { location, reason }
                if reason == "checksum mismatch" && location.ends_with(".tpbx")),
            "{err}"
        );
        assert!(!c.path(&k).exists(), "a corrupt entry is removed");
        assert_eq!(c.get(&k).unwrap(), None);

        // Three entries of ~400 bytes under a 1000-byte cap: the least recently used goes.
        let small = DiskCache::new(dir.path(), 1000, false).unwrap();
        let keys = [CacheKey([2; 32]), CacheKey([3; 32]), CacheKey([4; 32])];
        small.put(&keys[0], &entry()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        small.put(&keys[1], &entry()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        small.get(&keys[0]).unwrap(); // touch: now keys[1] is the oldest
        std::thread::sleep(std::time::Duration::from_millis(20));
        small.put(&keys[2], &entry()).unwrap();
        assert!(small.path(&keys[0]).exists());
        assert!(!small.path(&keys[1]).exists());
        assert!(small.path(&keys[2]).exists());
        assert_eq!(small.usage().entries, 2);
        assert_eq!(small.clear(), 2);
        assert_eq!(small.usage(), DiskUsage::default());
    }

    #[test]
    fn opening_removes_temporaries_of_killed_writers_only() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::new(dir.path(), 1 << 20, false).unwrap();
        let k = CacheKey([6; 32]);
        c.put(&k, &entry()).unwrap();
        // A writer killed after writing half an entry, and one writing now (it holds the lock).
        let half = encode(&k, &entry());
        std::fs::write(dir.path().join(".tmp-killed"), &half[..half.len() / 2]).unwrap();
        let live = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempfile_in(dir.path())
            .unwrap();
        live.as_file().lock().unwrap();
        // A read-only opener removes nothing.
        DiskCache::new(dir.path(), 1 << 20, true).unwrap();
        assert!(dir.path().join(".tmp-killed").exists());
        let again = DiskCache::new(dir.path(), 1 << 20, false).unwrap();
        assert!(!dir.path().join(".tmp-killed").exists());
        assert!(
            live.path().exists(),
            "a live writer's temporary is left alone"
        );
        assert_eq!(again.get(&k).unwrap(), Some(entry()));
        assert_eq!(again.usage().entries, 1);
        // Counters survive as whole files too.
        again.record(DiskCounters {
            hits: 2,
            misses: 1,
            compile_ms_saved: 3.5,
        });
        again.record(DiskCounters {
            hits: 1,
            ..DiskCounters::default()
        });
        let counters = again.counters();
        assert_eq!((counters.hits, counters.misses), (3, 1));
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(TEMP_PREFIX))
            .collect();
        assert_eq!(left.len(), 1, "only the live writer's: {left:?}");
    }

    #[test]
    fn read_only_never_writes_or_removes() {
        let dir = tempfile::tempdir().unwrap();
        let rw = DiskCache::new(dir.path(), 1 << 20, false).unwrap();
        let ro = DiskCache::new(dir.path(), 1 << 20, true).unwrap();
        let k = CacheKey([5; 32]);
        ro.put(&k, &entry()).unwrap();
        assert!(!ro.path(&k).exists());
        rw.put(&k, &entry()).unwrap();
        std::fs::write(ro.path(&k), b"garbage").unwrap();
        assert!(ro.get(&k).is_err());
        assert!(ro.path(&k).exists(), "read-only mode leaves files alone");
    }
}
