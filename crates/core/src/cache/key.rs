//! The compile-cache key: a SHA-256 that changes whenever anything that could change the
//! compiled executable changes.
//!
//! What goes in, in this order, each item length-prefixed (so no two different inputs can
//! produce the same byte stream):
//!
//! 1. [`CACHE_FORMAT_VERSION`] — bumped whenever the entry layout or the key recipe changes;
//! 2. the program format (`"mlir"`) and the program bytes;
//! 3. the serialized `CompileOptionsProto` and the id of the target device;
//! 4. the plugin's identity ([`PluginIdentity`]): SHA-256 of the plugin file, platform name and
//!    version, PJRT C API version;
//! 5. the device kind and the number of addressable devices;
//! 6. on CPU platforms, the host CPU's model and feature flags;
//! 7. the compiler's environment variables ([`COMPILER_ENV`]: `XLA_FLAGS` changes what XLA
//!    generates, e.g. `--xla_cpu_use_onednn`; `LIBTPU_INIT_ARGS` does on TPUs).
//!
//! Lessons this follows: JAX once returned wrong cache hits because the TPU runtime version was
//! missing from its key (JAX `compilation_cache` / `cache_key.py` now hashes the backend
//! version); in trials here an executable serialized by one CPU plugin build loaded into another
//! and silently returned wrong numbers (the two CPU plugin builds report the same platform name
//! and version), hence the plugin file hash and the CPU features.

use std::fmt;
use std::path::Path;

use sha2::{Digest, Sha256};

/// Version of the cache entry format and key recipe. Entries of other versions are never read.
pub const CACHE_FORMAT_VERSION: u32 = 2;

/// Environment variables the plugin's compiler reads; their values are part of the key.
pub const COMPILER_ENV: [&str; 2] = ["XLA_FLAGS", "LIBTPU_INIT_ARGS"];

/// A 32-byte cache key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheKey(pub [u8; 32]);

impl CacheKey {
    /// Lower-case hex, 64 characters (also the entry's file name stem).
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses 64 hex characters.
    pub fn from_hex(s: &str) -> Option<Self> {
        let v = hex::decode(s).ok()?;
        Some(CacheKey(v.try_into().ok()?))
    }
}

impl fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CacheKey({})", &self.hex()[..16])
    }
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// Everything about the compiler and target that is fixed for one PJRT client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginIdentity {
    /// SHA-256 of the plugin shared library, hex.
    pub plugin_sha256: String,
    /// Platform name, e.g. `"cpu"`.
    pub platform_name: String,
    /// Platform version string.
    pub platform_version: String,
    /// PJRT C API version (major, minor).
    pub api_version: (u32, u32),
    /// Device kind of the addressable devices, e.g. `"cpu"`.
    pub device_kind: String,
    /// Number of addressable devices.
    pub device_count: usize,
    /// CPU model and sorted feature flags on CPU platforms; empty otherwise.
    pub host_cpu: String,
    /// `NAME=value` of each [`COMPILER_ENV`] variable, one per line (empty value when unset),
    /// read when the identity is built.
    pub compiler_env: String,
}

impl PluginIdentity {
    /// Builds the identity, hashing the plugin file at `plugin_path` (≈ 0.5 s for a 200 MB
    /// plugin; done once per client).
    ///
    /// Errors: the plugin file cannot be read.
    pub fn new(
        plugin_path: &Path,
        platform_name: &str,
        platform_version: &str,
        api_version: (u32, u32),
        device_kind: &str,
        device_count: usize,
    ) -> std::io::Result<Self> {
        let plugin_sha256 = file_sha256_memoized(plugin_path)?;
        let host_cpu = if platform_name.eq_ignore_ascii_case("cpu") {
            host_cpu_description()
        } else {
            String::new()
        };
        Ok(PluginIdentity {
            plugin_sha256,
            platform_name: platform_name.to_string(),
            platform_version: platform_version.to_string(),
            api_version,
            device_kind: device_kind.to_string(),
            device_count,
            host_cpu,
            compiler_env: compiler_env(),
        })
    }
}

/// `NAME=value` lines of the [`COMPILER_ENV`] variables in this process.
pub fn compiler_env() -> String {
    COMPILER_ENV
        .iter()
        .map(|k| format!("{k}={}", std::env::var(k).unwrap_or_default()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// SHA-256 of a file, hex, remembered across processes in
/// `<cache root>/file-hashes/` under a name derived from the file's path, inode, size and
/// modification time (so a replaced or rewritten file is hashed again). Hashing a 200 MB plugin
/// takes about half a second; a memoized lookup, microseconds. Memos are written atomically
/// ([`super::atomic::write`]), so a process killed while writing one leaves no torn memo.
///
/// Errors: the file cannot be read.
pub fn file_sha256_memoized(path: &Path) -> std::io::Result<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path)?;
    let canonical = std::fs::canonicalize(path)?;
    let mut id = Sha256::new();
    id.update(canonical.as_os_str().as_encoded_bytes());
    id.update(meta.ino().to_le_bytes());
    id.update(meta.len().to_le_bytes());
    id.update(meta.mtime().to_le_bytes());
    id.update(meta.mtime_nsec().to_le_bytes());
    let memo =
        crate::plugin::cache_root().map(|r| r.join("file-hashes").join(hex::encode(id.finalize())));
    if let Some(m) = &memo
        && let Ok(s) = std::fs::read_to_string(m)
        && s.len() == 64
        && s.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Ok(s);
    }
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    let digest = hex::encode(h.finalize());
    if let Some(m) = &memo
        && let Some(dir) = m.parent()
        && std::fs::create_dir_all(dir).is_ok()
    {
        // Whole or not at all, even when this process is killed; a killed writer's temporary
        // is removed by the next one.
        super::atomic::remove_stale(dir, super::atomic::TEMP_PREFIX);
        let _ = super::atomic::write(m, digest.as_bytes(), true);
    }
    Ok(digest)
}

/// The first CPU's `model name` and its `flags`, sorted, from `/proc/cpuinfo`; on other systems
/// the features `std::arch` detects.
pub fn host_cpu_description() -> String {
    if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
        let field = |name: &str| {
            info.lines()
                .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_default()
        };
        let mut flags: Vec<String> = field("flags")
            .split_whitespace()
            .map(String::from)
            .collect();
        if flags.is_empty() {
            flags = field("Features")
                .split_whitespace()
                .map(String::from)
                .collect();
        }
        flags.sort();
        return format!("{}|{}", field("model name"), flags.join(" "));
    }
    format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS)
}

fn put(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// Computes the key of one compile request; see the module docs for what goes in.
pub fn cache_key(
    identity: &PluginIdentity,
    format: &str,
    program: &[u8],
    options: &[u8],
    device_id: i32,
) -> CacheKey {
    let mut h = Sha256::new();
    h.update(b"tpubox-compile-cache");
    h.update(CACHE_FORMAT_VERSION.to_le_bytes());
    put(&mut h, format.as_bytes());
    put(&mut h, program);
    put(&mut h, options);
    h.update(device_id.to_le_bytes());
    put(&mut h, identity.plugin_sha256.as_bytes());
    put(&mut h, identity.platform_name.as_bytes());
    put(&mut h, identity.platform_version.as_bytes());
    h.update(identity.api_version.0.to_le_bytes());
    h.update(identity.api_version.1.to_le_bytes());
    put(&mut h, identity.device_kind.as_bytes());
    h.update((identity.device_count as u64).to_le_bytes());
    put(&mut h, identity.host_cpu.as_bytes());
    put(&mut h, identity.compiler_env.as_bytes());
    CacheKey(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident() -> PluginIdentity {
        PluginIdentity {
            plugin_sha256: "ab".repeat(32),
            platform_name: "cpu".into(),
            platform_version: "1".into(),
            api_version: (0, 115),
            device_kind: "cpu".into(),
            device_count: 4,
            host_cpu: "x|avx2 sse4".into(),
            compiler_env: "XLA_FLAGS=\nLIBTPU_INIT_ARGS=".into(),
        }
    }

    #[test]
    fn every_input_changes_the_key() {
        let base = cache_key(&ident(), "mlir", b"prog", b"opts", 0);
        assert_eq!(base, cache_key(&ident(), "mlir", b"prog", b"opts", 0));
        let mut variants = vec![
            cache_key(&ident(), "hlo", b"prog", b"opts", 0),
            cache_key(&ident(), "mlir", b"prog2", b"opts", 0),
            cache_key(&ident(), "mlir", b"prog", b"opts2", 0),
            cache_key(&ident(), "mlir", b"prog", b"opts", 1),
            // Moving a byte between fields must not collide (length prefixes).
            cache_key(&ident(), "mlir", b"pro", b"gopts", 0),
        ];
        type Change = Box<dyn Fn(&mut PluginIdentity)>;
        let changes: Vec<Change> = vec![
            Box::new(|i| i.plugin_sha256 = "cd".repeat(32)),
            Box::new(|i| i.platform_name = "tpu".into()),
            Box::new(|i| i.platform_version = "2".into()),
            Box::new(|i| i.api_version = (0, 81)),
            Box::new(|i| i.device_kind = "gpu".into()),
            Box::new(|i| i.device_count = 8),
            Box::new(|i| i.host_cpu = "x|sse4".into()),
            Box::new(|i| {
                i.compiler_env = "XLA_FLAGS=--xla_cpu_use_onednn=true\nLIBTPU_INIT_ARGS=".into()
            }),
        ];
        for change in changes {
            let mut i = ident();
            change(&mut i);
            variants.push(cache_key(&i, "mlir", b"prog", b"opts", 0));
        }
        for (n, v) in variants.iter().enumerate() {
            assert_ne!(*v, base, "variant {n} collided with the base key");
        }
    }

    /// The key of a fixed program, identity and the default compile options for device 0, as
    /// computed before the optimisation level joined the compile options: entries written by
    /// earlier builds must keep being found.
    #[test]
    fn default_options_key_is_unchanged() {
        let options = pjrt::CompileOptions::new()
            .device_ordinal(0)
            .to_bytes()
            .unwrap();
        let k = cache_key(
            &ident(),
            "mlir",
            b"func.func @main() { return }",
            &options,
            0,
        );
        assert_eq!(
            k.hex(),
            "cc1f1519f61515fa46dd521b6168dd99013494e1dddb1daa4703011403bfd897"
        );
    }

    #[test]
    fn hex_round_trips() {
        let k = cache_key(&ident(), "mlir", b"p", b"o", 0);
        assert_eq!(CacheKey::from_hex(&k.hex()), Some(k));
        assert_eq!(CacheKey::from_hex("zz"), None);
    }

    #[test]
    fn cpu_description_lists_features() {
        let d = host_cpu_description();
        if std::path::Path::new("/proc/cpuinfo").exists() {
            let (_, flags) = d.split_once('|').expect("model|flags");
            let flags: Vec<&str> = flags.split(' ').collect();
            assert!(flags.len() > 3, "{d}");
            assert!(
                flags.windows(2).all(|w| w[0] <= w[1]),
                "flags are sorted: {d}"
            );
        } else {
            assert!(!d.is_empty());
        }
    }
}
