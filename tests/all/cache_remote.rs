//! Tier 3 of the compile cache: a `file://` store and a real S3-compatible server (moto) on
//! loopback, the race between fetching and compiling, background uploads, and the modes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tpubox_cache_remote::RemoteCache;
use tpubox_core::DeviceConfig;
use tpubox_core::cache::{CacheConfig, CacheMode, CompileCache, Compiled, DiskCache};
use tpubox_core::{DeviceService, ErrorKind};

const SCALE: &str = r#"
func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c = stablehlo.constant dense<-1.5> : tensor<4xf32>
  %0 = stablehlo.multiply %a, %c : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"#;

type Options = Vec<(String, String)>;

fn service(disk: &Path, mode: CacheMode, remote: &str) -> Arc<DeviceService> {
    service_with(disk, mode, remote, &Vec::new())
}

fn service_with(disk: &Path, mode: CacheMode, remote: &str, opts: &Options) -> Arc<DeviceService> {
    let config = DeviceConfig {
        cache: CacheConfig {
            mode,
            disk_dir: Some(disk.to_path_buf()),
            remote_url: Some(remote.to_string()),
            remote_options: opts.clone(),
            remote_opener: Some(tpubox_cache_remote::open),
            ..CacheConfig::default()
        },
        ..DeviceConfig::default()
    };
    tpubox_core::open_device(&config).expect("device opens")
}

/// Compiles SCALE and checks it computes -1.5·x.
async fn compile_and_check(svc: &Arc<DeviceService>) -> Result<(), tpubox_core::DeviceError> {
    crate::support::scale_and_check(svc, SCALE, -1.5).await
}

fn file_url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

/// The fleet scenario on one store: host A compiles and uploads; host B, with an empty disk
/// tier, in cache-only mode, is answered by tier 3 alone; host C (read-write) then keeps a
/// local copy in its tier 2.
async fn fleet_scenario(remote: &str, opts: Options) {
    let service = |d: &Path, m: CacheMode, r: &str| service_with(d, m, r, &opts);
    let store = RemoteCache::open_with(remote, opts.clone()).unwrap();
    store.clear().await.unwrap();
    let (da, db, dc) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );

    // B first, on an empty store: cache-only is a miss and a `not-found` error.
    let b = service(db.path(), CacheMode::CacheOnly, remote);
    let err = compile_and_check(&b).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");

    let a = service(da.path(), CacheMode::ReadWrite, remote);
    compile_and_check(&a).await.unwrap();
    let cache = a.cache().unwrap();
    cache.flush_uploads().await;
    let s = cache.stats();
    assert_eq!(
        (s.compiles, s.uploads, s.upload_failures),
        (1, 1, 0),
        "{s:?}"
    );
    let usage = store.usage().await.unwrap();
    assert_eq!(usage.entries, 1);
    let local = DiskCache::new(da.path(), u64::MAX, true).unwrap().usage();
    assert_eq!(usage.bytes, local.bytes, "tier 3 holds the tier-2 bytes");

    let b = service(db.path(), CacheMode::CacheOnly, remote);
    compile_and_check(&b).await.unwrap();
    let s = b.cache().unwrap().stats();
    assert_eq!(
        (s.compiles, s.remote.hits, s.disk.misses),
        (0, 1, 1),
        "{s:?}"
    );
    assert!(s.remote.compile_ms_saved > 0.0);
    assert_eq!(
        DiskCache::new(db.path(), u64::MAX, true)
            .unwrap()
            .usage()
            .entries,
        0,
        "cache-only never writes tier 2"
    );

    let c = service(dc.path(), CacheMode::ReadWrite, remote);
    compile_and_check(&c).await.unwrap();
    c.cache().unwrap().flush_uploads().await;
    assert_eq!(
        DiskCache::new(dc.path(), u64::MAX, true)
            .unwrap()
            .usage()
            .entries,
        1,
        "read-write keeps a local copy"
    );
    // A fresh process on C's host now stops at tier 2.
    let c2 = service(dc.path(), CacheMode::ReadWrite, remote);
    compile_and_check(&c2).await.unwrap();
    let s = c2.cache().unwrap().stats();
    assert_eq!((s.disk.hits, s.remote.hits + s.remote.misses), (1, 0));
    assert_eq!(store.usage().await.unwrap().entries, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_serves_a_fleet() {
    let remote = tempfile::tempdir().unwrap();
    fleet_scenario(&file_url(remote.path()), Vec::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_hosts_never_upload_and_corrupt_objects_are_not_loaded() {
    let remote = tempfile::tempdir().unwrap();
    let url = file_url(remote.path());
    let d = tempfile::tempdir().unwrap();
    let ro = service(d.path(), CacheMode::ReadOnly, &url);
    compile_and_check(&ro).await.unwrap();
    ro.cache().unwrap().flush_uploads().await;
    let s = ro.cache().unwrap().stats();
    assert_eq!((s.compiles, s.uploads), (1, 0), "{s:?}");
    assert_eq!(std::fs::read_dir(remote.path()).unwrap().count(), 0);

    // Upload from a writer, then damage the object: a cache-only reader refuses it.
    let w = tempfile::tempdir().unwrap();
    let writer = service(w.path(), CacheMode::ReadWrite, &url);
    compile_and_check(&writer).await.unwrap();
    writer.cache().unwrap().flush_uploads().await;
    let object = std::fs::read_dir(remote.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&object).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    std::fs::write(&object, &bytes).unwrap();
    let e = tempfile::tempdir().unwrap();
    let reader = service(e.path(), CacheMode::CacheOnly, &url);
    let err = compile_and_check(&reader).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound);
    let s = reader.cache().unwrap().stats();
    assert_eq!((s.corrupt, s.remote.hits), (1, 0), "{s:?}");
    // A read-write host compiles instead and its upload replaces the damaged object.
    let f = tempfile::tempdir().unwrap();
    let fixer = service(f.path(), CacheMode::ReadWrite, &url);
    compile_and_check(&fixer).await.unwrap();
    fixer.cache().unwrap().flush_uploads().await;
    let g = tempfile::tempdir().unwrap();
    let reader = service(g.path(), CacheMode::CacheOnly, &url);
    compile_and_check(&reader).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upload_is_counted_and_never_fails_the_caller() {
    // The "store" root is a regular file, so every PUT fails at once.
    let blocker = tempfile::NamedTempFile::new().unwrap();
    let url = format!("{}/sub", file_url(blocker.path()));
    let d = tempfile::tempdir().unwrap();
    let svc = service(d.path(), CacheMode::ReadWrite, &url);
    compile_and_check(&svc).await.unwrap();
    svc.cache().unwrap().flush_uploads().await;
    let s = svc.cache().unwrap().stats();
    assert_eq!(
        (s.compiles, s.uploads, s.upload_failures),
        (1, 0, 1),
        "{s:?}"
    );
}

/// When tier 3 answers first, the local compile's result is not waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_3_answer_wins_the_race_against_a_slow_compile() {
    let remote = tempfile::tempdir().unwrap();
    let url = file_url(remote.path());
    // Fill the store from a real compile.
    let w = tempfile::tempdir().unwrap();
    let writer = service(w.path(), CacheMode::ReadWrite, &url);
    compile_and_check(&writer).await.unwrap();
    writer.cache().unwrap().flush_uploads().await;
    let key_name = std::fs::read_dir(remote.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name()
        .into_string()
        .unwrap();
    let key = tpubox_core::cache::CacheKey(
        hex_key(key_name.strip_suffix(".tpbx").unwrap())
            .try_into()
            .unwrap(),
    );
    let exe = writer
        .compile(SCALE.as_bytes().to_vec(), true, 0)
        .await
        .unwrap();

    let cache = CompileCache::new(CacheConfig {
        disk_dir: None,
        remote_opener: Some(tpubox_cache_remote::open),
        remote_url: Some(url),
        ..CacheConfig::default()
    })
    .unwrap();
    let finished = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&finished);
    let loaded = Arc::clone(&exe);
    let got = cache
        .get_or_compile(
            key,
            || Ok(()),
            move |entry| {
                assert_eq!(entry.meta.inputs, vec![("F32".to_string(), vec![4])]);
                Ok(Arc::clone(&loaded))
            },
            || async move {
                tokio::time::sleep(Duration::from_secs(30)).await;
                flag.store(true, Ordering::SeqCst);
                Err::<Compiled, _>(tpubox_core::DeviceError::new(
                    ErrorKind::Internal,
                    "slow compile",
                ))
            },
        )
        .await
        .unwrap();
    assert_eq!(got.1, tpubox_core::CacheTier::Remote);
    let got = got.0;
    assert!(Arc::ptr_eq(&got, &exe));
    assert!(
        !finished.load(Ordering::SeqCst),
        "the compile was not awaited"
    );
    let s = cache.stats();
    assert_eq!((s.remote.hits, s.memory.entries), (1, 1), "{s:?}");
}

fn hex_key(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// A moto S3 server on a free loopback port, stopped on drop.
struct Moto {
    child: Child,
    port: u16,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `moto_server`: `$TPUBOX_MOTO_SERVER`, else the venv that `scripts/dev.sh setup` makes
/// (`<cache>/venv-moto`), else whatever `PATH` has.
fn moto_server() -> PathBuf {
    if let Some(p) = std::env::var_os("TPUBOX_MOTO_SERVER") {
        return PathBuf::from(p);
    }
    tpubox_core::plugin::cache_root()
        .map(|c| c.join("venv-moto/bin/moto_server"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("moto_server"))
}

fn start_moto() -> Moto {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let server = moto_server();
    let child = Command::new(&server)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "starting {}: {e} (bash scripts/dev.sh setup installs moto[server] into a venv)",
                server.display()
            )
        });
    let moto = Moto { child, port };
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "moto_server did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    moto
}

/// Creates a bucket with one unsigned `PUT /bucket` (moto does not check signatures).
fn create_bucket(port: u16, bucket: &str) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_on_loopback_serves_a_fleet() {
    let moto = start_moto();
    create_bucket(moto.port, "tpubox-fleet");
    let opts = [
        ("aws_endpoint", format!("http://127.0.0.1:{}", moto.port)),
        ("aws_allow_http", "true".into()),
        ("aws_access_key_id", "test".into()),
        ("aws_secret_access_key", "test".into()),
        ("aws_region", "us-east-1".into()),
    ];
    let opts = opts
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    fleet_scenario("s3://tpubox-fleet/executables", opts).await;
}
