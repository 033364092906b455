//! Real guests run through the host on the CPU plugin.
//!
//! The guests are built for wasm32-wasip2 by `scripts/dev.sh` before the tests run. Numbers are
//! checked against values computed here in plain Rust, not against the guest's own output.

use crate::support::{hello_expected, test_host_config, wasm};

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tpubox_wasm::{Host, RunOptions, RunOutcome};
use wasmtime::component::Component;

fn host() -> &'static Arc<Host> {
    static HOST: OnceLock<Arc<Host>> = OnceLock::new();
    HOST.get_or_init(|| {
        let config = test_host_config();
        let host = Host::new(config).expect("host starts on the CPU plugin");
        host.load_weights("test", &test_weights_file())
            .expect("test weights load");
        Arc::new(host)
    })
}

/// A safetensors file with `w`: f32[2,2] = [0.5, -1, 2, 8] and `ids`: s64[3] = [7, 8, 9].
fn test_weights_file() -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let w: Vec<u8> = [0.5f32, -1.0, 2.0, 8.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let ids: Vec<u8> = [7i64, 8, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensors = vec![
        ("w", TensorView::new(Dtype::F32, vec![2, 2], &w).unwrap()),
        ("ids", TensorView::new(Dtype::I64, vec![3], &ids).unwrap()),
    ];
    let path = std::env::temp_dir().join(format!(
        "tpubox-test-weights-{}.safetensors",
        std::process::id()
    ));
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
    path
}

fn component(name: &str) -> Component {
    static CACHE: OnceLock<std::sync::Mutex<Vec<(String, Component)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut c = cache.lock().unwrap();
    if let Some((_, comp)) = c.iter().find(|(n, _)| n == name) {
        return comp.clone();
    }
    let comp = host().load_component(&wasm(name)).expect("component loads");
    c.push((name.to_string(), comp.clone()));
    comp
}

async fn run(
    name: &str,
    args: &[&str],
    tweak: impl FnOnce(&mut RunOptions),
) -> anyhow::Result<RunOutcome> {
    let mut opts = RunOptions {
        args: args.iter().map(|s| s.to_string()).collect(),
        capture_output: true,
        stdin: Some(Vec::new()),
        deadline: Some(Duration::from_secs(60)),
        ..RunOptions::default()
    };
    tweak(&mut opts);
    host().run(&component(name), name, &opts).await
}

fn stdout(o: &RunOutcome) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The line `KEY: VALUE` of a probe's output.
fn line<'a>(out: &'a str, key: &str) -> &'a str {
    let prefix = format!("{key}: ");
    out.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no `{key}:` line in output:\n{out}"))
}

/// The error kind of a probe line `KEY: KIND (message)`.
fn kind<'a>(out: &'a str, key: &str) -> &'a str {
    line(out, key).split(' ').next().unwrap()
}

fn parse_result(out: &str) -> Vec<Vec<f32>> {
    serde_json::from_str(line(out, "result")).expect("result line is a JSON matrix")
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len());
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() <= 1e-5, "got {got:?}, want {want:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_matmul_matches_reference() {
    for scale in ["1", "2", "-0.5"] {
        let o = run("hello-matmul", &["--scale", scale], |_| {})
            .await
            .unwrap();
        let out = stdout(&o);
        assert!(
            o.success,
            "guest failed:\n{out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_close(&parse_result(&out), &hello_expected(scale.parse().unwrap()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_run_concurrently_on_one_device() {
    let runs = (0..4).map(|i| {
        let scale = format!("{}", i + 1);
        async move {
            let o = run("hello-matmul", &["--scale", &scale], |_| {})
                .await
                .unwrap();
            (scale, o)
        }
    });
    for (scale, o) in futures_join(runs).await {
        assert!(o.success);
        assert_close(
            &parse_result(&stdout(&o)),
            &hello_expected(scale.parse().unwrap()),
        );
    }
}

async fn futures_join<F: std::future::Future + Send + 'static>(
    fs: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = fs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_rejects_bad_calls_with_typed_errors() {
    let o = run("tpubox-probe", &["errors"], |_| {}).await.unwrap();
    let out = stdout(&o);
    assert!(o.success, "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let expect = [
        ("short-data", "invalid-argument"),
        ("long-data", "invalid-argument"),
        ("dims-overflow", "invalid-argument"),
        ("dim-over-i64", "invalid-argument"),
        ("rank-too-big", "invalid-argument"),
        ("bad-device", "not-found"),
        ("empty-program", "invalid-argument"),
        ("not-utf8", "invalid-argument"),
        ("garbage-mlir", "compile-failed"),
        ("bad-bytecode", "invalid-argument"),
        ("compile-bad-device", "not-found"),
        ("arg-count", "invalid-argument"),
        ("arg-dtype", "invalid-argument"),
        ("arg-dims", "invalid-argument"),
        ("donate-out-of-range", "invalid-argument"),
        ("donate-repeated", "invalid-argument"),
        ("same-tensor-donated", "invalid-argument"),
        ("same-tensor-borrowed", "ok"),
        ("valid-call", "ok"),
    ];
    for (case, want) in expect {
        assert_eq!(kind(&out, case), want, "case {case}: {}", line(&out, case));
    }
    assert!(line(&out, "short-data").contains("needs 16 bytes"), "{out}");
    assert!(
        line(&out, "arg-dtype").contains("expects f32[2,2]"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn donated_tensor_is_unusable_and_others_are_not() {
    let o = run("tpubox-probe", &["donate"], |_| {}).await.unwrap();
    let out = stdout(&o);
    assert!(o.success, "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(line(&out, "donate-result"), "[11.0, 22.0, 33.0, 44.0]");
    assert_eq!(kind(&out, "read-after-donate"), "failed-precondition");
    assert_eq!(kind(&out, "execute-after-donate"), "failed-precondition");
    assert_eq!(kind(&out, "copy-after-donate"), "failed-precondition");
    assert_eq!(line(&out, "spec-after-donate"), "[2, 2]");
    assert_eq!(kind(&out, "b-still-usable"), "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_sees_no_environment_or_files_unless_granted() {
    let o = run("tpubox-probe", &["env"], |_| {}).await.unwrap();
    assert_eq!(line(&stdout(&o), "env"), "0 ");
    let o = run("tpubox-probe", &["env"], |opt| {
        opt.env = vec![("ANSWER".into(), "42".into())]
    })
    .await
    .unwrap();
    assert_eq!(line(&stdout(&o), "env"), "1 ANSWER");

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data.txt"), b"hello").unwrap();
    let host_file = dir.path().join("data.txt");
    let o = run(
        "tpubox-probe",
        &["read", host_file.to_str().unwrap()],
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(line(&stdout(&o), "read"), "err");
    let o = run("tpubox-probe", &["read", "/data/data.txt"], |opt| {
        opt.dirs = vec![(dir.path().to_path_buf(), "/data".into())]
    })
    .await
    .unwrap();
    assert_eq!(line(&stdout(&o), "read"), "ok 5");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_stops_an_infinite_loop_and_host_keeps_serving() {
    let err = run("tpubox-probe", &["loop"], |opt| {
        opt.deadline = Some(Duration::from_millis(300))
    })
    .await
    .unwrap_err();
    assert!(format!("{err:#}").contains("deadline"), "{err:#}");
    let o = run("hello-matmul", &[], |_| {}).await.unwrap();
    assert_close(&parse_result(&stdout(&o)), &hello_expected(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_shorter_than_an_epoch_tick_stops_every_run_and_says_so() {
    // 1 µs is over before instantiation ends: every run must stop with the deadline message,
    // whether instantiation or `run` was executing (a trap in instantiation once escaped as a
    // bare "wasm trap: interrupt", and some runs finished inside the first tick).
    for i in 0..20 {
        let err = run("hello-matmul", &[], |opt| {
            opt.deadline = Some(Duration::from_micros(1))
        })
        .await
        .expect_err("a 1 µs deadline stops the run");
        assert!(
            format!("{err:#}").contains("exceeded its deadline"),
            "run {i}: {err:#}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_cap_stops_a_memory_bomb_and_host_keeps_serving() {
    let o = run("tpubox-probe", &["alloc", "8"], |_| {}).await.unwrap();
    assert_eq!(line(&stdout(&o), "alloc"), "ok 1");
    // 512 MiB is over the 256 MiB cap of this test host: the guest's allocation fails.
    let failed = match run("tpubox-probe", &["alloc", "512"], |_| {}).await {
        Ok(o) => !o.success,
        Err(_) => true,
    };
    assert!(failed, "a 512 MiB allocation must fail under a 256 MiB cap");
    let o = run("hello-matmul", &[], |_| {}).await.unwrap();
    assert_close(&parse_result(&stdout(&o)), &hello_expected(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_share_read_only_weights() {
    let o = run("tpubox-probe", &["weights"], |_| {}).await.unwrap();
    let out = stdout(&o);
    assert!(o.success, "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(line(&out, "available"), "test");
    assert_eq!(kind(&out, "missing-set"), "not-found");
    assert!(line(&out, "missing-set").contains("offers: test"), "{out}");
    assert_eq!(line(&out, "names"), "ids,w");
    assert_eq!(line(&out, "spec-w"), "Dtype::F32 [2, 2]");
    assert_eq!(kind(&out, "missing-tensor"), "not-found");
    assert_eq!(line(&out, "read-w"), "[0.5, -1.0, 2.0, 8.0]");
    assert_eq!(line(&out, "w-plus-w"), "[1.0, -2.0, 4.0, 16.0]");
    assert_eq!(kind(&out, "donate-weight"), "permission-denied");
    assert_eq!(line(&out, "read-w-again"), "[0.5, -1.0, 2.0, 8.0]");
    // One device copy, however many guests open the set.
    let set = host().weights().get("test").unwrap();
    assert_eq!(set.device_bytes(), 16 + 24);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_publish_weight_versions_through_wit_when_their_tenant_may() {
    // The suite's host gives its tenants no max-published-bytes: publishing is refused.
    let o = run("tpubox-probe", &["publish"], |_| {}).await.unwrap();
    let out = stdout(&o);
    assert_eq!(kind(&out, "publish-1"), "permission-denied", "{out}");
    assert!(
        line(&out, "publish-1").contains("max-published-bytes"),
        "{out}"
    );

    // A host whose tenants may publish.
    let mut config = test_host_config();
    config.sandbox.tenant_limits.max_published_bytes = 1 << 20;
    let publishing = Host::new(config).expect("host starts on the CPU plugin");
    let probe = publishing
        .load_component(&wasm("tpubox-probe"))
        .expect("component loads");
    let opts = RunOptions {
        args: vec!["publish".into()],
        capture_output: true,
        stdin: Some(Vec::new()),
        deadline: Some(Duration::from_secs(60)),
        ..RunOptions::default()
    };
    let o = publishing.run(&probe, "publisher", &opts).await.unwrap();
    let out = stdout(&o);
    assert!(o.success, "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(line(&out, "publish-1"), "1");
    assert_eq!(line(&out, "opened"), "1");
    assert_eq!(line(&out, "publish-2"), "2");
    assert_eq!(
        line(&out, "versions"),
        "2 [1, 2]",
        "the guest still holds version 1"
    );
    assert_eq!(line(&out, "read-v1"), "[1.0, 2.0, 3.0, 4.0]");
    assert_eq!(line(&out, "read-latest"), "2 [10.0, 20.0, 30.0, 40.0]");
    assert_eq!(line(&out, "versions-after-drop"), "2 [2]");
    assert_eq!(kind(&out, "open-freed"), "not-found");
    assert_eq!(kind(&out, "donate-published"), "permission-denied");
    assert_eq!(line(&out, "a-plus-b"), "[11.0, 22.0, 33.0, 44.0]");
    // The version outlives the guest's run (its session), charged to its tenant's ledger.
    let set = publishing.weights().get("pub").unwrap();
    assert_eq!((set.version(), set.publisher()), (2, Some("publisher")));
    assert_eq!(publishing.weights().published_usage("publisher").bytes, 16);
}
