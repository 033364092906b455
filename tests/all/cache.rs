//! The compile cache (tiers 1 and 2) on the CPU plugin: single-flight, multi-process safety,
//! corruption handling, key isolation between plugins, and the read-only / cache-only modes.

use std::path::Path;
use std::sync::Arc;

use tpubox_core::DeviceConfig;
use tpubox_core::cache::{CacheConfig, CacheMode, DiskCache};
use tpubox_core::{DeviceService, ErrorKind, PrimitiveType};

const SCALE: &str = r#"
func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c = stablehlo.constant dense<2.5> : tensor<4xf32>
  %0 = stablehlo.multiply %a, %c : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"#;

fn service(dir: &Path, mode: CacheMode, plugin: Option<&str>) -> Arc<DeviceService> {
    let config = DeviceConfig {
        plugin: plugin.map(String::from),
        cache: CacheConfig {
            mode,
            disk_dir: Some(dir.to_path_buf()),
            ..CacheConfig::default()
        },
        ..DeviceConfig::default()
    };
    tpubox_core::open_device(&config).expect("device opens")
}

/// Compiles SCALE and checks it computes 2.5·x.
async fn compile_and_check(svc: &Arc<DeviceService>) -> Result<(), tpubox_core::DeviceError> {
    crate::support::scale_and_check(svc, SCALE, 2.5).await
}

fn entries(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "tpbx"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_for_one_key_compile_once() {
    let dir = tempfile::tempdir().unwrap();
    let svc = service(dir.path(), CacheMode::ReadWrite, None);
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let svc = Arc::clone(&svc);
            tokio::spawn(async move {
                svc.compile(SCALE.as_bytes().to_vec(), true, 0)
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut exes = Vec::new();
    for t in tasks {
        exes.push(t.await.unwrap());
    }
    assert!(
        exes.iter().all(|e| Arc::ptr_eq(e, &exes[0])),
        "all callers share one executable"
    );
    let stats = svc.cache().unwrap().stats();
    assert_eq!(stats.compiles, 1, "{stats:?}");
    assert_eq!(entries(dir.path()).len(), 1);
    compile_and_check(&svc).await.unwrap();
    assert_eq!(
        svc.cache().unwrap().stats().memory.hits,
        1 + stats.memory.hits
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_process_loads_from_disk_without_compiling() {
    let dir = tempfile::tempdir().unwrap();
    let first = service(dir.path(), CacheMode::ReadWrite, None);
    compile_and_check(&first).await.unwrap();
    assert_eq!(first.cache().unwrap().stats().compiles, 1);
    // A new client and cache over the same directory stand in for a fresh process.
    let second = service(dir.path(), CacheMode::ReadWrite, None);
    compile_and_check(&second).await.unwrap();
    let s = second.cache().unwrap().stats();
    assert_eq!((s.compiles, s.disk.hits), (0, 1), "{s:?}");
    assert!(s.disk.compile_ms_saved > 0.0);
    let counters = DiskCache::new(dir.path(), u64::MAX, true)
        .unwrap()
        .counters();
    assert_eq!((counters.hits, counters.misses), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_or_truncated_entries_are_detected_and_recompiled() {
    for damage in ["flip", "truncate"] {
        let dir = tempfile::tempdir().unwrap();
        compile_and_check(&service(dir.path(), CacheMode::ReadWrite, None))
            .await
            .unwrap();
        let path = entries(dir.path()).pop().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        match damage {
            "flip" => {
                let mid = bytes.len() / 2;
                bytes[mid] ^= 0x10;
            }
            _ => bytes.truncate(bytes.len() - 100),
        }
        std::fs::write(&path, &bytes).unwrap();
        let svc = service(dir.path(), CacheMode::ReadWrite, None);
        compile_and_check(&svc).await.unwrap();
        let s = svc.cache().unwrap().stats();
        assert_eq!(
            (s.corrupt, s.compiles, s.disk.hits),
            (1, 1, 0),
            "{damage}: {s:?}"
        );
        // The recompiled entry replaced the damaged one and is valid again.
        let again = service(dir.path(), CacheMode::ReadWrite, None);
        compile_and_check(&again).await.unwrap();
        assert_eq!(again.cache().unwrap().stats().disk.hits, 1, "{damage}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_from_another_plugin_is_never_used() {
    let dir = tempfile::tempdir().unwrap();
    compile_and_check(&service(dir.path(), CacheMode::ReadWrite, Some("cpu")))
        .await
        .unwrap();
    // Same program and options, other plugin build (xla-cpu-pjrt, PJRT C API 0.81): a miss.
    let other = service(dir.path(), CacheMode::ReadWrite, Some("xla-cpu"));
    compile_and_check(&other).await.unwrap();
    let s = other.cache().unwrap().stats();
    assert_eq!((s.compiles, s.disk.hits), (1, 0), "{s:?}");
    assert_eq!(entries(dir.path()).len(), 2, "one entry per plugin");
    // Another options set (another target device) is another key as well.
    let svc = service(dir.path(), CacheMode::ReadWrite, Some("cpu"));
    svc.compile(SCALE.as_bytes().to_vec(), true, 1)
        .await
        .unwrap();
    assert_eq!(svc.cache().unwrap().stats().compiles, 1);
    assert_eq!(entries(dir.path()).len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_and_cache_only_modes() {
    let dir = tempfile::tempdir().unwrap();
    // Read-only: compiles on a miss, writes nothing.
    let ro = service(dir.path(), CacheMode::ReadOnly, None);
    compile_and_check(&ro).await.unwrap();
    assert!(
        entries(dir.path()).is_empty(),
        "read-only mode wrote an entry"
    );
    // Cache-only: a miss is a not-found error, not a compile.
    let co = service(dir.path(), CacheMode::CacheOnly, None);
    let err = compile_and_check(&co).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(err.message.contains("cache-only"), "{err}");
    assert_eq!(co.cache().unwrap().stats().compiles, 0);
    // After a read-write process fills the cache, both modes are served from it.
    compile_and_check(&service(dir.path(), CacheMode::ReadWrite, None))
        .await
        .unwrap();
    for mode in [CacheMode::ReadOnly, CacheMode::CacheOnly] {
        let svc = service(dir.path(), mode, None);
        compile_and_check(&svc).await.unwrap();
        assert_eq!(svc.cache().unwrap().stats().compiles, 0, "{mode:?}");
    }
    // Off: no cache at all.
    let off = service(dir.path(), CacheMode::Off, None);
    assert!(off.cache().is_none());
    compile_and_check(&off).await.unwrap();
}

#[test]
fn two_processes_racing_on_one_key_leave_one_valid_entry() {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let program = work.path().join("scale.mlir");
    std::fs::write(&program, SCALE).unwrap();
    let x: Vec<u8> = [1.0f32, -2.0, 0.5, 8.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let arg = work.path().join("x.npy");
    tpubox_core::npy::write_npy(&arg, PrimitiveType::F32, &[4], &x).unwrap();
    for round in 0..3 {
        let children: Vec<_> = (0..2)
            .map(|i| {
                std::process::Command::new(env!("CARGO_BIN_EXE_tpubox"))
                    .arg("exec")
                    .arg(&program)
                    .arg("--arg")
                    .arg(&arg)
                    .arg("--out")
                    .arg(work.path().join(format!("out-{round}-{i}")))
                    .arg("--cache-dir")
                    .arg(dir.path())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for mut c in children {
            assert!(c.wait().unwrap().success());
        }
        let found = entries(dir.path());
        assert_eq!(found.len(), 1, "round {round}: {found:?}");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            .collect();
        assert!(leftovers.is_empty(), "temporary files left behind");
        for i in 0..2 {
            let out = tpubox_core::npy::read_npy(
                &work.path().join(format!("out-{round}-{i}/out0.npy")),
                None,
            )
            .unwrap();
            let got: Vec<f32> = out
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(got, vec![2.5, -5.0, 1.25, 20.0]);
        }
    }
    let counters = DiskCache::new(dir.path(), u64::MAX, true)
        .unwrap()
        .counters();
    assert_eq!(counters.hits + counters.misses, 6, "{counters:?}");
    assert!(counters.hits >= 4, "{counters:?}");
}
