//! Files that a process killed at any moment leaves whole or not at all.
//!
//! What tpubox keeps in directories that outlive a process (tier-2 entries and `stats.json`,
//! the plugin-hash memos, the ONNX converter's outputs) is written under a temporary name in
//! the destination's directory and renamed into place once complete ([`write()`],
//! [`LockedTempDir::persist`]): a reader sees the old file, the whole new one, or none, never a
//! torn one, even when the writer is killed with SIGKILL in the middle.
//!
//! What a killed writer does leave is its temporary. Each writer holds an exclusive `flock` on
//! its temporary (a file, or a directory's own descriptor) from just after creating it until it
//! is renamed or removed. The kernel drops a lock when its holder's process ends, however it
//! ends, so a temporary whose lock can be taken belongs to no live process: [`remove_stale`]
//! removes exactly those, and never one that another live process sharing the directory (a
//! second daemon, `tpubox run`, a compile of `tpubox exec`) is writing now. A writer that loses
//! the race between creating its temporary and locking it (a cleaner took the lock first and
//! removed it) finds its path gone once it holds the lock and starts over under a new name.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Prefix of the temporary files [`write()`] makes (`.tmp-` and random characters).
pub const TEMP_PREFIX: &str = ".tmp-";

/// Attempts at a temporary before [`write()`] or [`LockedTempDir::new`] gives up: each fails
/// only when a cleaner removed the fresh temporary before it was locked.
const ATTEMPTS: usize = 8;

/// Whether `path` still names the file (or directory) open as `file`.
fn still_named(path: &Path, file: &File) -> bool {
    match (std::fs::symlink_metadata(path), file.metadata()) {
        (Ok(p), Ok(f)) => p.dev() == f.dev() && p.ino() == f.ino(),
        _ => false,
    }
}

fn lost_race(path: &Path) -> io::Error {
    io::Error::other(format!(
        "temporary files in {} kept being removed before they were locked",
        path.display()
    ))
}

/// Writes `bytes` to `path` atomically: to a locked temporary ([`TEMP_PREFIX`]) in the same
/// directory, flushed to the disk first when `sync` (without it, a power loss may leave the
/// file empty; a killed process cannot), then renamed over `path`.
///
/// Errors: creating, locking, writing, syncing or renaming the temporary (it is removed).
pub fn write(path: &Path, bytes: &[u8], sync: bool) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    for _ in 0..ATTEMPTS {
        let mut tmp = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempfile_in(dir)?;
        tmp.as_file().lock()?;
        if !still_named(tmp.path(), tmp.as_file()) {
            // A cleaner removed it between its creation and our lock: take another name.
            continue;
        }
        tmp.write_all(bytes)?;
        if sync {
            tmp.as_file().sync_data()?;
        }
        // The lock goes with the file once it is renamed (and is dropped with it).
        tmp.persist(path).map_err(|e| e.error)?;
        return Ok(());
    }
    Err(lost_race(dir))
}

/// A temporary directory in a shared parent, locked while it lives so that
/// [`remove_stale`] leaves it alone; removed when dropped unless persisted.
#[derive(Debug)]
pub struct LockedTempDir {
    dir: tempfile::TempDir,
    _lock: File,
}

impl LockedTempDir {
    /// Creates `PARENT/PREFIXrandom` and locks it.
    ///
    /// Errors: creating, opening or locking the directory.
    pub fn new(parent: &Path, prefix: &str) -> io::Result<Self> {
        for _ in 0..ATTEMPTS {
            let dir = tempfile::Builder::new().prefix(prefix).tempdir_in(parent)?;
            let lock = File::open(dir.path())?;
            lock.lock()?;
            if still_named(dir.path(), &lock) {
                return Ok(LockedTempDir { dir, _lock: lock });
            }
            // Removed by a cleaner before we locked it; the `TempDir` finds nothing to remove.
        }
        Err(lost_race(parent))
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Renames it to `dest` (which must not be a non-empty directory); on failure removes it.
    ///
    /// Errors: the rename's.
    pub fn persist(self, dest: &Path) -> io::Result<()> {
        let path: PathBuf = self.dir.keep();
        std::fs::rename(&path, dest).inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&path);
        })
    }
}

/// Removes the temporaries named `PREFIX…` directly in `dir` (files and directories) that no
/// live process holds locked: those a killed writer left. Symbolic links and other kinds of
/// file are left alone, as are temporaries that cannot be opened. Returns how many were
/// removed.
pub fn remove_stale(dir: &Path, prefix: &str) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in rd.filter_map(|e| e.ok()) {
        if !e.file_name().to_string_lossy().starts_with(prefix) {
            continue;
        }
        let path = e.path();
        let Ok(kind) = std::fs::symlink_metadata(&path).map(|m| m.file_type()) else {
            continue;
        };
        if !kind.is_file() && !kind.is_dir() {
            continue;
        }
        let Ok(f) = File::open(&path) else {
            continue;
        };
        // Held: a live writer's. Any other failure: leave it too.
        if f.try_lock().is_err() || !still_named(&path, &f) {
            continue;
        }
        let gone = if kind.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if gone.is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn write_replaces_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        write(&p, b"one", true).unwrap();
        write(&p, b"two, longer", false).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two, longer");
        assert_eq!(names(dir.path()), ["f"]);
    }

    #[test]
    fn only_unlocked_temporaries_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        // Left by killed writers: a file and a directory with contents, nobody holding them.
        std::fs::write(dir.path().join(".tmp-dead"), b"half an entry").unwrap();
        std::fs::create_dir(dir.path().join(".converting-dead")).unwrap();
        std::fs::write(dir.path().join(".converting-dead/plan.json"), b"{").unwrap();
        // Live writers: a locked file and a locked directory.
        let live = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempfile_in(dir.path())
            .unwrap();
        live.as_file().lock().unwrap();
        let live_dir = LockedTempDir::new(dir.path(), ".converting-").unwrap();
        // Other files are not temporaries, whatever their age or lock.
        std::fs::write(dir.path().join("entry.tpbx"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join(".tmp-link")).unwrap();

        assert_eq!(remove_stale(dir.path(), TEMP_PREFIX), 1);
        assert_eq!(remove_stale(dir.path(), ".converting-"), 1);
        let left = names(dir.path());
        assert!(!left.contains(&".tmp-dead".to_string()), "{left:?}");
        assert!(!left.contains(&".converting-dead".to_string()), "{left:?}");
        assert!(live.path().exists() && live_dir.path().exists(), "{left:?}");
        assert!(
            left.contains(&"entry.tpbx".to_string()) && left.contains(&".tmp-link".to_string())
        );

        // Once the writer is gone (its lock with it), its temporary is stale.
        drop(live_dir);
        let path = live.path().to_path_buf();
        let (file, _) = live.keep().unwrap();
        drop(file);
        assert_eq!(remove_stale(dir.path(), TEMP_PREFIX), 1);
        assert!(!path.exists());
    }

    #[test]
    fn a_locked_temp_dir_persists_by_rename() {
        let dir = tempfile::tempdir().unwrap();
        let t = LockedTempDir::new(dir.path(), ".converting-").unwrap();
        std::fs::write(t.path().join("plan.json"), b"{}").unwrap();
        let dest = dir.path().join("done");
        t.persist(&dest).unwrap();
        assert_eq!(std::fs::read(dest.join("plan.json")).unwrap(), b"{}");
        assert_eq!(names(dir.path()), ["done"]);
    }
}
