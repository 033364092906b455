//! Compile workers under load and abuse (issue 27): the host's cap on compiles at once, a
//! tenant's flood that leaves the host's slots to other tenants, the bound on a tenant's
//! waiting compiles, the resident-memory cap, and workers that compile one program each and are
//! started ahead of need.
//!
//! Each test runs its own device service with the compile cache off (every compile reaches a
//! worker) and its workers under a command name of its own (a symlink to the `tpubox` binary),
//! so it can count its worker processes apart from other tests'.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tpubox_core::cache::{CacheConfig, CacheMode};
use tpubox_core::compiler::{CompileIsolation, CompileStats, MAX_WAITING_COMPILES_PER_TENANT};
use tpubox_core::{DeviceConfig, DeviceService, ErrorKind};

/// `f32[4] -> f32[4]` times `k + 0.5`: distinct `k`, distinct programs.
fn scale(k: usize) -> Vec<u8> {
    format!(
        "func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {{\n  %c = stablehlo.constant dense<{k}.5> : tensor<4xf32>\n  %0 = stablehlo.multiply %a, %c : tensor<4xf32>\n  return %0 : tensor<4xf32>\n}}\n"
    )
    .into_bytes()
}

/// `@main` calls itself: the compiler recurses until its stack is full, touching it all (the
/// worker's resident set grows past a GiB on the default 1 GiB stack).
const RECURSIVE: &str = "func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n  %r = func.call @main(%a) : (tensor<4xf32>) -> tensor<4xf32>\n  return %r : tensor<4xf32>\n}\n";

/// The `tpubox` binary under the name `dir/name`, for workers this test can count.
fn named_worker(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_tpubox"), &p).expect("symlink");
    p
}

/// A CPU device service, compile cache off, compiling in `worker` with `set`'s settings
/// (60 s to compile or wait for a slot: generous for a loaded CI machine).
fn service(worker: PathBuf, set: impl FnOnce(&mut CompileIsolation)) -> Arc<DeviceService> {
    let mut isolation = CompileIsolation {
        worker: Some(worker),
        max_compile_time: Duration::from_secs(60),
        ..CompileIsolation::default()
    };
    set(&mut isolation);
    let svc = tpubox_core::open_device(&DeviceConfig {
        cache: CacheConfig {
            mode: CacheMode::Off,
            disk_dir: None,
            remote_url: None,
            ..CacheConfig::default()
        },
        compile_isolation: isolation,
        ..DeviceConfig::default()
    })
    .expect("the CPU plugin opens");
    assert!(svc.compile_isolation().1, "workers are in use");
    svc
}

/// Live processes whose command is `cmd` (exited ones awaiting their reaping have an empty
/// command line, so they do not count).
fn processes_of(cmd: &Path) -> Vec<u32> {
    let want = cmd.as_os_str().as_bytes();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).next() == Some(want))
        })
        .collect()
}

/// Counts `cmd`'s processes every millisecond on a thread of its own until stopped; the most
/// seen at once.
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicUsize>,
    thread: std::thread::JoinHandle<()>,
}

impl Sampler {
    fn start(cmd: PathBuf) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicUsize::new(0));
        let thread = std::thread::spawn({
            let (stop, peak) = (Arc::clone(&stop), Arc::clone(&peak));
            move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(processes_of(&cmd).len(), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        Sampler { stop, peak, thread }
    }

    fn stop(self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("sampler");
        self.peak.load(Ordering::Relaxed)
    }
}

/// Waits (60 s at most) until `svc`'s compile stats satisfy `cond`.
async fn wait_for(svc: &DeviceService, what: &str, cond: impl Fn(&CompileStats) -> bool) {
    let start = Instant::now();
    loop {
        let stats = svc.compile_stats();
        if cond(&stats) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "waited 60 s for {what}: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_cap_bounds_compiles_at_once_across_tenants() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = named_worker(dir.path(), "worker-host-cap");
    let svc = service(cmd.clone(), |i| {
        i.max_workers = 2;
        i.max_workers_per_tenant = 2;
        i.prestarted_workers = 0;
    });
    let triggered = tpubox_core::protection::count("compile-workers");
    let sampler = Sampler::start(cmd.clone());
    let compiles = (0..6).map(|k| {
        let svc = Arc::clone(&svc);
        async move {
            svc.compile_as(scale(k), true, 0, ["a", "b", "c"][k % 3])
                .await
        }
    });
    let results = futures::future::join_all(compiles).await;
    let peak_processes = sampler.stop();
    for r in results {
        r.expect("every compile succeeds in its turn");
    }
    let stats = svc.compile_stats();
    // Six at once, three tenants allowed two each: two compile, four wait for the host.
    assert!(
        (1..=2).contains(&peak_processes),
        "{peak_processes} workers ran at once (cap 2)"
    );
    assert_eq!(stats.peak_running, 2, "{stats:?}");
    assert_eq!(stats.waited_for_host, 4, "{stats:?}");
    assert_eq!(stats.waited_for_tenant, 0, "{stats:?}");
    assert_eq!(
        stats.workers_started, 6,
        "one worker per compile: {stats:?}"
    );
    assert_eq!(stats.running, 0, "{stats:?}");
    assert!(tpubox_core::protection::count("compile-workers") >= triggered + 4);
    assert!(processes_of(&cmd).is_empty(), "every worker exited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_flood_leaves_host_slots_to_other_tenants() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = named_worker(dir.path(), "worker-flood");
    let svc = service(cmd, |i| {
        i.max_workers = 2;
        i.max_workers_per_tenant = 1;
        i.prestarted_workers = 0;
    });
    let triggered = tpubox_core::protection::count("compile-workers-per-tenant");
    let flood_done = Arc::new(AtomicUsize::new(0));
    let flood = tokio::spawn({
        let (svc, done) = (Arc::clone(&svc), Arc::clone(&flood_done));
        async move {
            let compiles = (0..6).map(|k| {
                let (svc, done) = (Arc::clone(&svc), Arc::clone(&done));
                async move {
                    let r = svc.compile_as(scale(k), true, 0, "flood").await;
                    done.fetch_add(1, Ordering::SeqCst);
                    r
                }
            });
            futures::future::join_all(compiles).await
        }
    });
    // The flood is in: one of its compiles runs, five wait in the tenant's own queue.
    wait_for(&svc, "the flood to queue", |s| s.waited_for_tenant == 5).await;
    svc.compile_as(scale(100), true, 0, "other")
        .await
        .expect("the other tenant's compile succeeds");
    let flood_done_then = flood_done.load(Ordering::SeqCst);
    let stats = svc.compile_stats();
    assert_eq!(
        stats.waited_for_host, 0,
        "the other tenant found a host slot free at once: {stats:?}"
    );
    assert!(
        flood_done_then < 6,
        "the other tenant's compile waited for the whole flood"
    );
    for r in flood.await.unwrap() {
        r.expect("the flood's compiles succeed, one at a time");
    }
    let stats = svc.compile_stats();
    assert_eq!(stats.waited_for_tenant, 5, "{stats:?}");
    assert_eq!(stats.waited_for_host, 0, "{stats:?}");
    assert!(stats.peak_running <= 2, "{stats:?}");
    assert!(tpubox_core::protection::count("compile-workers-per-tenant") >= triggered + 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_queues_at_most_its_waiting_bound() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = named_worker(dir.path(), "worker-queue");
    let svc = service(cmd, |i| {
        i.max_workers = 2;
        i.max_workers_per_tenant = 1;
        i.prestarted_workers = 0;
    });
    // All at once: one runs, MAX_WAITING_COMPILES_PER_TENANT wait, two more are refused.
    let n = 1 + MAX_WAITING_COMPILES_PER_TENANT + 2;
    let compiles = (0..n).map(|k| {
        let svc = Arc::clone(&svc);
        async move { svc.compile_as(scale(k), true, 0, "greedy").await }
    });
    let results = futures::future::join_all(compiles).await;
    let refused: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    for e in refused {
        assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{e}");
        assert!(
            e.message.contains("max-compile-workers-per-tenant")
                && e.message.contains("17 compiles running or waiting"),
            "{e}"
        );
    }
    let stats = svc.compile_stats();
    assert_eq!(stats.refused, 2, "{stats:?}");
    assert_eq!(stats.workers_started as usize, n - 2, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resident_cap_ends_a_memory_hungry_compile() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = named_worker(dir.path(), "worker-resident");
    let svc = service(cmd.clone(), |i| {
        i.max_resident_bytes = 512 << 20;
        i.prestarted_workers = 0;
    });
    let triggered = tpubox_core::protection::count("compile-resident");
    let err = svc
        .compile_as(RECURSIVE.as_bytes().to_vec(), true, 0, "hungry")
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ResourceExhausted, "{err}");
    assert!(
        err.message.contains("limit max-compile-resident")
            && err.message.contains("more than 512 MiB"),
        "{err}"
    );
    let stats = svc.compile_stats();
    assert_eq!(stats.resident_kills, 1, "{stats:?}");
    assert!(stats.peak_resident_bytes > 512 << 20, "{stats:?}");
    assert!(tpubox_core::protection::count("compile-resident") > triggered);
    assert!(processes_of(&cmd).is_empty(), "the worker was killed");
    // The host goes on.
    svc.compile_as(scale(1), true, 0, "hungry")
        .await
        .expect("a normal program compiles after");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_worker_compiles_once_and_the_next_is_started_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = named_worker(dir.path(), "worker-once");
    let svc = service(cmd.clone(), |i| i.prestarted_workers = 1);
    // Started with the service, before any compile.
    wait_for(&svc, "the first worker to be ready", |s| {
        s.workers_ready == 1 && s.idle_workers == 1
    })
    .await;
    svc.compile_as(scale(1), true, 0, "first")
        .await
        .expect("compiles");
    let first = svc.compile_stats();
    assert_eq!(first.prestarted_used, 1, "{first:?}");
    assert_eq!(first.ready_used, 1, "{first:?}");
    assert_eq!(first.started_on_demand, 0, "{first:?}");
    let pid1 = first.last_worker_pid.expect("a worker pid");
    // Its replacement was started as it was taken.
    wait_for(&svc, "the replacement to be ready", |s| {
        s.workers_ready == 2 && s.idle_workers == 1
    })
    .await;
    assert!(
        !processes_of(&cmd).contains(&pid1),
        "the first worker exited after its one compile"
    );
    svc.compile_as(scale(2), true, 0, "second")
        .await
        .expect("compiles");
    let second = svc.compile_stats();
    let pid2 = second.last_worker_pid.expect("a worker pid");
    assert_ne!(pid1, pid2, "another tenant's compile gets another process");
    assert_eq!(second.prestarted_used, 2, "{second:?}");
    assert_eq!(second.ready_used, 2, "{second:?}");
    assert_eq!(second.started_on_demand, 0, "{second:?}");
    assert!(!processes_of(&cmd).contains(&pid2), "the second exited too");
}
