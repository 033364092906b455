//! The compile cache, shared by every tenant of a host.
//!
//! - Tier 1, in process: a byte-bounded LRU map of loaded executables. Concurrent requests for
//!   one key compile once; the others wait for that result (single-flight).
//! - Tier 2, host disk ([`disk`]): serialized executables written right after compiling
//!   (programs with `sort` cannot be serialized after their first run), shared by all processes.
//! - Tier 3, remote ([`remote`], a trait; the store is in the `tpubox-cache-remote` crate): an object store (`file://`, `s3://`, `gs://`) shared by a
//!   fleet. On a tier-2 miss the fetch from tier 3 and a local compile start together and the
//!   first to finish is used; uploads of new entries run in the background and never delay a
//!   compile's caller ([`CompileCache::flush_uploads`] waits for them before a process exits).
//!
//! Keys are described in [`key`]. Modes ([`CacheMode`]) make the cache read-only (workers that
//! must not write), cache-only (a miss is an error, for production fleets) or off. A miss is
//! logged (target `tpubox::cache`, level info) with its key, so `TPUBOX_LOG=tpubox::cache=info`
//! shows why a program recompiled.

pub mod atomic;
pub mod disk;
pub mod error;
pub mod key;
pub mod remote;

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;

pub use disk::{DiskCache, DiskCounters, DiskUsage, Entry, EntryMeta};
pub use error::{CacheError, CacheResult};
pub use key::{CacheKey, PluginIdentity, cache_key};
pub use remote::{RemoteOpener, RemoteStore};

use crate::error::{DeviceError, DeviceResult, ErrorKind};
pub use crate::types::Compiled;
use crate::types::{DeviceExecutable, spec_list};

/// How the cache may be used. Parsed from and printed as its kebab-case name (`read-write`,
/// `read-only`, `cache-only`, `off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheMode {
    /// Read and write every tier (default).
    #[default]
    ReadWrite,
    /// Read every tier, write none of the shared ones (tier 1 still fills, it is private).
    ReadOnly,
    /// Like read-only, and a miss is an error instead of a compile (`not-found`).
    CacheOnly,
    /// No caching at all.
    Off,
}

impl CacheMode {
    /// Every mode, in the order the docs list them.
    pub const ALL: [CacheMode; 4] = [
        CacheMode::ReadWrite,
        CacheMode::ReadOnly,
        CacheMode::CacheOnly,
        CacheMode::Off,
    ];

    /// The kebab-case name, e.g. `"read-only"`.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheMode::ReadWrite => "read-write",
            CacheMode::ReadOnly => "read-only",
            CacheMode::CacheOnly => "cache-only",
            CacheMode::Off => "off",
        }
    }
}

impl std::fmt::Display for CacheMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for CacheMode {
    type Err = String;

    /// Parses a kebab-case name. Errors: a message listing the accepted names.
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|m| m.as_str()).collect();
                format!(
                    "unknown cache mode {s:?}; expected one of {}",
                    names.join(", ")
                )
            })
    }
}

/// Which cache tier served a compile request, or that it was compiled. Every compile reports
/// one ([`crate::device::CompileOutcome`], the session API's `CompileResponse.tier`, the Python
/// client's `Executable.tier`). Printed as its kebab-case name.
///
/// Tenants' compile-rate limit (`max-compiles-per-minute`) is charged for every tier but
/// [`Memory`](CacheTier::Memory); see [`crate::tenant::Tenant::admit_compile_rate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheTier {
    /// Tier 1: a loaded executable this process already held (microseconds).
    Memory,
    /// Tier 2: a serialized executable on the host's disk, deserialized (milliseconds).
    Disk,
    /// Tier 3: a serialized executable fetched from the remote store, deserialized.
    Remote,
    /// A cache miss: the program was compiled (and written to the tiers the mode allows).
    Compiled,
    /// Compiled with no cache in front (no cache configured, or mode `off`).
    CompiledWithoutCache,
}

impl CacheTier {
    /// Every tier, in the order above.
    pub const ALL: [CacheTier; 5] = [
        CacheTier::Memory,
        CacheTier::Disk,
        CacheTier::Remote,
        CacheTier::Compiled,
        CacheTier::CompiledWithoutCache,
    ];

    /// The kebab-case name: `memory`, `disk`, `remote`, `compiled`, `compiled-without-cache`.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheTier::Memory => "memory",
            CacheTier::Disk => "disk",
            CacheTier::Remote => "remote",
            CacheTier::Compiled => "compiled",
            CacheTier::CompiledWithoutCache => "compiled-without-cache",
        }
    }
}

impl std::fmt::Display for CacheTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Settings of a [`CompileCache`].
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// What the cache may do.
    pub mode: CacheMode,
    /// Tier 1 bound: total size of the cached executables' serialized forms, in bytes
    /// (default 1 GiB).
    pub memory_max_bytes: u64,
    /// Tier 2 directory; `None` disables tier 2. Default `~/.cache/tpubox/executables`.
    pub disk_dir: Option<PathBuf>,
    /// Tier 2 bound in bytes (default 10 GiB); least recently used entries go first.
    pub disk_max_bytes: u64,
    /// Compiles faster than this are not written to disk or uploaded, in milliseconds
    /// (default 0).
    pub min_compile_ms: f64,
    /// Tier 3: URL of an object store (`file:///dir`, `s3://bucket/prefix`, `gs://...`);
    /// `None` (the default) disables tier 3. The store is opened by
    /// [`remote_opener`](Self::remote_opener); see the `tpubox-cache-remote` crate for schemes
    /// and credentials.
    pub remote_url: Option<String>,
    /// Tier-3 store options (`aws_endpoint`, `aws_allow_http`, `google_service_account`, ...),
    /// applied after those read from `AWS_*` / `GOOGLE_*` environment variables.
    pub remote_options: Vec<(String, String)>,
    /// Opens [`remote_url`](Self::remote_url)'s store. This crate links no object-store or
    /// HTTP client: a program that offers tier 3 sets the opener of the crate that does
    /// (`tpubox_cache_remote::open`); `None` (the default) makes a `remote_url` an error.
    pub remote_opener: Option<RemoteOpener>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            mode: CacheMode::ReadWrite,
            memory_max_bytes: 1 << 30,
            disk_dir: crate::plugin::cache_root().map(|d| d.join("executables")),
            disk_max_bytes: 10 << 30,
            min_compile_ms: 0.0,
            remote_url: None,
            remote_options: Vec::new(),
            remote_opener: None,
        }
    }
}

/// Counters of one tier.
#[derive(Debug, Default)]
struct TierCounters {
    hits: AtomicU64,
    misses: AtomicU64,
    /// Compile time the hits saved, in microseconds.
    saved_us: AtomicU64,
}

/// A snapshot of one tier's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TierStats {
    /// Entries held now.
    pub entries: u64,
    /// Bytes held now.
    pub bytes: u64,
    /// Lookups answered by this tier since the cache was built.
    pub hits: u64,
    /// Lookups this tier could not answer.
    pub misses: u64,
    /// Compile time the hits saved, in milliseconds.
    pub compile_ms_saved: f64,
}

/// Counters of the whole cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CacheStats {
    /// Tier 1 (this process).
    pub memory: TierStats,
    /// Tier 2 (host disk).
    pub disk: TierStats,
    /// Tier 3 (remote; entries and bytes are not listed here, see `tpubox_cache_remote::RemoteCache::usage`).
    pub remote: TierStats,
    /// Background uploads to tier 3 that finished, and that failed.
    pub uploads: u64,
    /// Uploads that failed (logged at warn).
    pub upload_failures: u64,
    /// Programs actually compiled.
    pub compiles: u64,
    /// Corrupt tier-2 entries found (and removed).
    pub corrupt: u64,
}

struct MemEntry {
    exe: Arc<DeviceExecutable>,
    bytes: u64,
    last_use: u64,
    compile_ms: f64,
}

#[derive(Default)]
struct Memory {
    map: HashMap<CacheKey, MemEntry>,
    bytes: u64,
    clock: u64,
}

/// An executable and the tier that served it.
type Served = (Arc<DeviceExecutable>, CacheTier);

type Flight = Arc<tokio::sync::OnceCell<DeviceResult<Served>>>;

/// The multi-tier compile cache; see the module docs. `Send + Sync`, shared through `Arc`.
pub struct CompileCache {
    config: CacheConfig,
    disk: Option<DiskCache>,
    remote: Option<Arc<dyn RemoteStore>>,
    uploads: Mutex<tokio::task::JoinSet<()>>,
    upload_counts: Arc<(AtomicU64, AtomicU64)>,
    remote_counters: TierCounters,
    memory: Mutex<Memory>,
    flights: Mutex<HashMap<CacheKey, Flight>>,
    mem_counters: TierCounters,
    disk_counters: TierCounters,
    compiles: AtomicU64,
    corrupt: AtomicU64,
}

impl std::fmt::Debug for CompileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompileCache")
            .field("config", &self.config)
            .finish()
    }
}

impl CompileCache {
    /// Builds the cache.
    ///
    /// Errors: [`CacheError::Io`] when the tier-2 directory cannot be created (read-write mode
    /// only); [`CacheError::Url`] when the tier-3 URL does not parse or names an unknown scheme.
    pub fn new(config: CacheConfig) -> CacheResult<Self> {
        let read_only = matches!(config.mode, CacheMode::ReadOnly | CacheMode::CacheOnly);
        let disk = match (&config.disk_dir, config.mode) {
            (_, CacheMode::Off) | (None, _) => None,
            (Some(dir), _) => Some(DiskCache::new(dir, config.disk_max_bytes, read_only)?),
        };
        let remote = match (&config.remote_url, config.mode) {
            (_, CacheMode::Off) | (None, _) => None,
            (Some(url), _) => match config.remote_opener {
                Some(open) => Some(open(url, &config.remote_options)?),
                None => {
                    return Err(CacheError::Url {
                        url: url.clone(),
                        reason:
                            "this program was built without the remote tier (tpubox-cache-remote)"
                                .into(),
                    });
                }
            },
        };
        Ok(CompileCache {
            config,
            disk,
            remote,
            uploads: Mutex::new(tokio::task::JoinSet::new()),
            upload_counts: Arc::default(),
            remote_counters: TierCounters::default(),
            memory: Mutex::new(Memory::default()),
            flights: Mutex::new(HashMap::new()),
            mem_counters: TierCounters::default(),
            disk_counters: TierCounters::default(),
            compiles: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
        })
    }

    /// The settings.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The tier-2 directory, if any.
    pub fn disk(&self) -> Option<&DiskCache> {
        self.disk.as_ref()
    }

    /// The tier-3 store, if any.
    pub fn remote(&self) -> Option<&Arc<dyn RemoteStore>> {
        self.remote.as_ref()
    }

    /// Waits for every background upload to tier 3 started so far. Call it before a
    /// short-lived process exits, or its new entries may never reach the fleet.
    pub async fn flush_uploads(&self) {
        let mut set = std::mem::take(&mut *self.uploads.lock().expect("cache lock"));
        while set.join_next().await.is_some() {}
    }

    /// A snapshot of the counters and sizes.
    pub fn stats(&self) -> CacheStats {
        let snap = |c: &TierCounters| TierStats {
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            compile_ms_saved: c.saved_us.load(Ordering::Relaxed) as f64 / 1e3,
            ..TierStats::default()
        };
        let mut memory = snap(&self.mem_counters);
        {
            let m = self.memory.lock().expect("cache lock");
            memory.entries = m.map.len() as u64;
            memory.bytes = m.bytes;
        }
        let mut disk = snap(&self.disk_counters);
        if let Some(d) = &self.disk {
            let u = d.usage();
            disk.entries = u.entries;
            disk.bytes = u.bytes;
        }
        CacheStats {
            memory,
            disk,
            remote: snap(&self.remote_counters),
            uploads: self.upload_counts.0.load(Ordering::Relaxed),
            upload_failures: self.upload_counts.1.load(Ordering::Relaxed),
            compiles: self.compiles.load(Ordering::Relaxed),
            corrupt: self.corrupt.load(Ordering::Relaxed),
        }
    }

    fn memory_get(&self, key: &CacheKey) -> Option<Arc<DeviceExecutable>> {
        let mut m = self.memory.lock().expect("cache lock");
        m.clock += 1;
        let now = m.clock;
        let e = m.map.get_mut(key)?;
        e.last_use = now;
        add_ms(&self.mem_counters.saved_us, e.compile_ms);
        Some(Arc::clone(&e.exe))
    }

    fn memory_put(&self, key: CacheKey, exe: Arc<DeviceExecutable>, bytes: u64, compile_ms: f64) {
        let mut m = self.memory.lock().expect("cache lock");
        m.clock += 1;
        let last_use = m.clock;
        if let Some(old) = m.map.insert(
            key,
            MemEntry {
                exe,
                bytes,
                last_use,
                compile_ms,
            },
        ) {
            m.bytes -= old.bytes;
        }
        m.bytes += bytes;
        while m.bytes > self.config.memory_max_bytes && m.map.len() > 1 {
            let oldest = m
                .map
                .iter()
                .filter(|(k, _)| **k != key)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| *k);
            match oldest.and_then(|k| m.map.remove(&k)) {
                Some(e) => m.bytes -= e.bytes,
                None => break,
            }
        }
    }

    /// Returns the executable for `key` and the tier that served it: from tier 1, else tier 2,
    /// else tier 3 raced against running `compile` (first to finish wins) — once, however many
    /// callers ask for `key` at the same time (those that wait for another caller's lookup get
    /// its executable and its tier). Entries from tiers 2 and 3 are turned into executables by
    /// `load`, which runs on tokio's blocking pool (deserializing can take hundreds of
    /// milliseconds).
    ///
    /// `admit` runs when tier 1 does not hold `key` (and in mode `off`), before anything else
    /// is done for this caller: a caller's refusal (a tenant's compile-rate limit) therefore
    /// reaches that caller only, never another caller waiting on the same lookup. A caller that
    /// misses tier 1 just as another caller's lookup fills it is admitted and then served from
    /// tier 1 (reported as [`CacheTier::Memory`]).
    ///
    /// Errors: `admit`'s error; `compile`'s error; `not-found` on a miss in cache-only mode. A
    /// corrupt tier-2 or tier-3 entry, an unreachable store, or an entry that fails to load is
    /// not an error: it is logged (a corrupt tier-2 file is removed) and the program is compiled.
    pub async fn get_or_compile<A, C, Fut, L>(
        &self,
        key: CacheKey,
        admit: A,
        load: L,
        compile: C,
    ) -> DeviceResult<(Arc<DeviceExecutable>, CacheTier)>
    where
        A: FnOnce() -> DeviceResult<()>,
        C: FnOnce() -> Fut,
        Fut: Future<Output = DeviceResult<Compiled>>,
        L: Fn(Entry) -> DeviceResult<Arc<DeviceExecutable>> + Send + Sync + 'static,
    {
        if self.config.mode == CacheMode::Off {
            admit()?;
            self.compiles.fetch_add(1, Ordering::Relaxed);
            return compile()
                .await
                .map(|c| (c.exe, CacheTier::CompiledWithoutCache));
        }
        if let Some(exe) = self.memory_get(&key) {
            self.mem_counters.hits.fetch_add(1, Ordering::Relaxed);
            return Ok((exe, CacheTier::Memory));
        }
        admit()?;
        let flight: Flight = {
            let mut f = self.flights.lock().expect("cache lock");
            Arc::clone(f.entry(key).or_default())
        };
        let result = flight
            .get_or_init(|| async {
                // Another flight may have finished between our tier-1 check and joining.
                if let Some(exe) = self.memory_get(&key) {
                    self.mem_counters.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok((exe, CacheTier::Memory));
                }
                self.mem_counters.misses.fetch_add(1, Ordering::Relaxed);
                self.fill(key, Arc::new(load), compile).await
            })
            .await
            .clone();
        {
            let mut f = self.flights.lock().expect("cache lock");
            if f.get(&key).is_some_and(|cur| Arc::ptr_eq(cur, &flight)) {
                f.remove(&key);
            }
        }
        result
    }

    async fn fill<C, Fut, L>(&self, key: CacheKey, load: Arc<L>, compile: C) -> DeviceResult<Served>
    where
        C: FnOnce() -> Fut,
        Fut: Future<Output = DeviceResult<Compiled>>,
        L: Fn(Entry) -> DeviceResult<Arc<DeviceExecutable>> + Send + Sync + 'static,
    {
        if let Some(disk) = &self.disk {
            match on_disk(disk, move |d| d.get(&key)).await {
                Ok(Some(entry)) => {
                    let bytes = entry.executable.len() as u64;
                    let compile_ms = entry.meta.compile_ms;
                    match load_blocking(&load, entry).await {
                        Ok(exe) => {
                            tracing::debug!(target: "tpubox::cache", %key, "answered from tier 2");
                            self.disk_counters.hits.fetch_add(1, Ordering::Relaxed);
                            add_ms(&self.disk_counters.saved_us, compile_ms);
                            let delta = DiskCounters {
                                hits: 1,
                                compile_ms_saved: compile_ms,
                                ..DiskCounters::default()
                            };
                            on_disk(disk, move |d| d.record(delta)).await;
                            self.memory_put(key, Arc::clone(&exe), bytes, compile_ms);
                            return Ok((exe, CacheTier::Disk));
                        }
                        Err(e) => {
                            tracing::warn!(target: "tpubox::cache", %key, error = %e, "tier-2 entry failed to load; recompiling");
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    self.corrupt.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(target: "tpubox::cache", %key, error = %e, "corrupt tier-2 entry removed; recompiling");
                }
            }
            self.disk_counters.misses.fetch_add(1, Ordering::Relaxed);
            let delta = DiskCounters {
                misses: 1,
                ..DiskCounters::default()
            };
            on_disk(disk, move |d| d.record(delta)).await;
        }
        if self.config.mode == CacheMode::CacheOnly {
            if let Some(remote) = &self.remote {
                let fetched = remote.get(&key).await;
                if let Some(exe) = self.use_remote(key, fetched, &load).await {
                    return Ok((exe, CacheTier::Remote));
                }
            }
            return Err(DeviceError::new(
                ErrorKind::NotFound,
                format!("compile cache miss for key {key} in cache-only mode"),
            ));
        }
        let compiling = compile();
        let c = match &self.remote {
            None => {
                tracing::info!(target: "tpubox::cache", %key, "compile cache miss; compiling");
                self.compiles.fetch_add(1, Ordering::Relaxed);
                compiling.await?
            }
            Some(remote) => {
                tracing::info!(target: "tpubox::cache", %key, "compile cache miss in tiers 1-2; fetching from tier 3 while compiling");
                self.compiles.fetch_add(1, Ordering::Relaxed);
                let fetch = remote.get(&key);
                tokio::pin!(compiling, fetch);
                tokio::select! {
                    fetched = &mut fetch => {
                        if let Some(exe) = self.use_remote(key, fetched, &load).await {
                            // The compile already started on the blocking pool finishes there
                            // and its result is dropped.
                            return Ok((exe, CacheTier::Remote));
                        }
                        compiling.await?
                    }
                    compiled = &mut compiling => {
                        self.remote_counters.misses.fetch_add(1, Ordering::Relaxed);
                        compiled?
                    }
                }
            }
        };
        let bytes = c.serialized.as_ref().map_or(0, |s| s.len() as u64);
        if let Some(serialized) = &c.serialized
            && c.compile_ms >= self.config.min_compile_ms
        {
            let entry = Entry {
                meta: EntryMeta {
                    inputs: spec_list(c.exe.inputs()),
                    outputs: spec_list(c.exe.outputs()),
                    fingerprint: c.exe.fingerprint().to_string(),
                    compile_ms: c.compile_ms,
                },
                executable: serialized.clone(),
            };
            self.write_shared_tiers(key, entry, true).await;
        }
        self.memory_put(key, Arc::clone(&c.exe), bytes, c.compile_ms);
        Ok((c.exe, CacheTier::Compiled))
    }

    /// Turns a tier-3 fetch into an executable, or logs why it could not and returns `None`.
    async fn use_remote<L>(
        &self,
        key: CacheKey,
        fetched: CacheResult<Option<Entry>>,
        load: &Arc<L>,
    ) -> Option<Arc<DeviceExecutable>>
    where
        L: Fn(Entry) -> DeviceResult<Arc<DeviceExecutable>> + Send + Sync + 'static,
    {
        let entry = match fetched {
            Ok(Some(entry)) => entry,
            Ok(None) => {
                self.remote_counters.misses.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            Err(e) => {
                if e.is_corrupt() {
                    self.corrupt.fetch_add(1, Ordering::Relaxed);
                }
                self.remote_counters.misses.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(target: "tpubox::cache", %key, error = %e, "tier-3 fetch gave nothing usable");
                return None;
            }
        };
        let bytes = entry.executable.len() as u64;
        let compile_ms = entry.meta.compile_ms;
        match load_blocking(load, entry.clone()).await {
            Ok(exe) => {
                tracing::info!(target: "tpubox::cache", %key, "answered from tier 3");
                self.remote_counters.hits.fetch_add(1, Ordering::Relaxed);
                add_ms(&self.remote_counters.saved_us, compile_ms);
                // Keep a host-local copy so the next process on this host stops at tier 2.
                self.write_shared_tiers(key, entry, false).await;
                self.memory_put(key, Arc::clone(&exe), bytes, compile_ms);
                Some(exe)
            }
            Err(e) => {
                self.remote_counters.misses.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(target: "tpubox::cache", %key, error = %e, "tier-3 entry failed to load; compiling");
                None
            }
        }
    }

    /// Writes `entry` to tier 2 and, when `upload`, starts a background upload to tier 3.
    /// Does nothing in the read-only and cache-only modes.
    async fn write_shared_tiers(&self, key: CacheKey, entry: Entry, upload: bool) {
        if self.config.mode != CacheMode::ReadWrite {
            return;
        }
        if upload && let Some(remote) = self.remote.clone() {
            let entry = entry.clone();
            let counts = Arc::clone(&self.upload_counts);
            let mut uploads = self.uploads.lock().expect("cache lock");
            // Reap finished uploads so a long-lived host does not accumulate them.
            while uploads.try_join_next().is_some() {}
            uploads.spawn(async move {
                match remote.put(&key, &entry).await {
                    Ok(()) => {
                        counts.0.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        counts.1.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(target: "tpubox::cache", %key, error = %e, "tier-3 upload failed");
                    }
                }
            });
        }
        if let Some(disk) = &self.disk
            && let Err(e) = on_disk(disk, move |d| d.put(&key, &entry)).await
        {
            tracing::warn!(target: "tpubox::cache", %key, error = %e, "could not write a tier-2 entry");
        }
    }
}

/// Runs `load` on tokio's blocking pool.
async fn load_blocking<L>(load: &Arc<L>, entry: Entry) -> DeviceResult<Arc<DeviceExecutable>>
where
    L: Fn(Entry) -> DeviceResult<Arc<DeviceExecutable>> + Send + Sync + 'static,
{
    let load = Arc::clone(load);
    match tokio::task::spawn_blocking(move || load(entry)).await {
        Ok(v) => v,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(DeviceError::new(
            ErrorKind::Internal,
            format!("loading a cache entry was cancelled: {e}"),
        )),
    }
}

/// Runs a tier-2 file operation on tokio's blocking pool, so reads, writes and fsyncs of
/// entries never stall the async threads that serve other tenants.
async fn on_disk<T: Send + 'static>(
    disk: &DiskCache,
    f: impl FnOnce(&DiskCache) -> T + Send + 'static,
) -> T {
    let d = disk.clone();
    match tokio::task::spawn_blocking(move || f(&d)).await {
        Ok(v) => v,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => panic!("tier-2 cache task cancelled: {e}"),
    }
}

fn add_ms(counter: &AtomicU64, ms: f64) {
    counter.fetch_add((ms * 1e3) as u64, Ordering::Relaxed);
}
