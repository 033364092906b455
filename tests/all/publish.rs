//! Published weight versions (issue 34, item 3) at the session layer: a session publishes
//! tensors it holds as a named set's next version without a copy, readers of other sessions
//! and tenants open one whole version, donation of a published tensor is refused, versions are
//! freed once no reader holds them, and the publish ledger outlives sessions. Each case asserts
//! the exact error kind and what the error names; the Python suite (`python/tests/
//! test_publish.py`) runs the same rules through the daemon with many concurrent readers.

use std::sync::{Arc, OnceLock};

use tpubox_core::session::{ExecutableHandle, ProgramFormat, TensorHandle};
use tpubox_core::weights::{PublishedUsage, WeightRegistry};
use tpubox_core::{DeviceConfig, DeviceService, ErrorKind, PrimitiveType, Session, Tenant};
use tpubox_core::{DeviceError, TenantLimits};

/// `f32[4], f32[4] -> f32[4]`: a + b.
const ADD: &str = r#"func.func public @main(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %r = stablehlo.add %a, %b : tensor<4xf32>
  return %r : tensor<4xf32>
}
"#;

fn device() -> Arc<DeviceService> {
    static DEV: OnceLock<Arc<DeviceService>> = OnceLock::new();
    Arc::clone(DEV.get_or_init(|| {
        tpubox_core::open_device(&DeviceConfig::default()).expect("the CPU plugin opens")
    }))
}

/// A tenant that may publish `versions` versions of at most `bytes` bytes in all.
fn publisher(name: &str, bytes: u64, versions: u64) -> Arc<Tenant> {
    Tenant::new(
        name,
        TenantLimits {
            max_published_bytes: bytes,
            max_published_versions: versions,
            ..TenantLimits::default()
        },
    )
}

fn session(reg: &Arc<WeightRegistry>, tenant: &Arc<Tenant>) -> Session {
    Session::new(device(), Arc::clone(reg), Arc::clone(tenant))
}

use crate::support::{put4 as put, read_f32 as get};

async fn add(s: &Session) -> ExecutableHandle {
    s.compile(ADD.as_bytes().to_vec(), ProgramFormat::MlirText, None)
        .await
        .expect("ADD compiles")
}

fn kind<T>(r: Result<T, DeviceError>) -> (ErrorKind, String) {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => (e.kind, e.message),
    }
}

async fn publish(s: &Session, name: &str, t: &[(&str, &TensorHandle)], readers: &[&str]) -> u64 {
    try_publish(s, name, t, readers)
        .await
        .expect("the publish succeeds")
}

async fn try_publish(
    s: &Session,
    name: &str,
    t: &[(&str, &TensorHandle)],
    readers: &[&str],
) -> Result<u64, DeviceError> {
    let named: Vec<(String, &TensorHandle)> = t.iter().map(|(n, h)| (n.to_string(), *h)).collect();
    let readers: Vec<String> = readers.iter().map(|r| r.to_string()).collect();
    s.publish_weights(name, &named, &readers)
        .await
        .map(|set| set.version())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_see_one_version_results_name_it_and_the_publisher_cannot_donate_it() {
    let reg = Arc::new(WeightRegistry::new());
    let alice = publisher("alice", 1 << 20, 8);
    let bob = Tenant::new("bob", TenantLimits::default());
    let a = session(&reg, &alice);
    let b = session(&reg, &bob);
    let w = put(&a, [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(publish(&a, "policy", &[("w", &w)], &["bob"]).await, 1);
    assert!(
        w.is_read_only(),
        "a published tensor is read-only for its session too"
    );

    // The publisher may still pass it, not donate it.
    let exe_a = add(&a).await;
    let other = put(&a, [0.0; 4]);
    let (k, m) = kind(a.execute(&exe_a, &[&w, &other], &[0]).await);
    assert_eq!(k, ErrorKind::PermissionDenied, "{m}");
    assert!(m.contains("published"), "{m}");
    let doubled = a.execute(&exe_a, &[&w, &w], &[]).await.unwrap();
    assert_eq!(get(&a, &doubled[0]).await, [2.0, 4.0, 6.0, 8.0]);
    assert_eq!(
        doubled[0].weight_versions(),
        [],
        "w is alice's own tensor, not opened"
    );

    // Bob (a named reader) opens it: the same values, the version named on every result.
    let set = b.open_weights("policy").unwrap();
    assert_eq!(set.version(), 1);
    let bw = b.weight(&set, "w").unwrap();
    let x = put(&b, [10.0, 10.0, 10.0, 10.0]);
    let exe_b = add(&b).await;
    let y = b.execute(&exe_b, &[&bw, &x], &[]).await.unwrap();
    assert_eq!(get(&b, &y[0]).await, [11.0, 12.0, 13.0, 14.0]);
    let tags: Vec<(String, u64)> = y[0]
        .weight_versions()
        .iter()
        .map(|(n, v)| (n.to_string(), *v))
        .collect();
    assert_eq!(tags, [("policy".to_string(), 1)]);
    // Through a second execution too.
    let z = b.execute(&exe_b, &[&y[0], &x], &[]).await.unwrap();
    assert_eq!(z[0].weight_versions(), y[0].weight_versions());
    let (k, m) = kind(b.execute(&exe_b, &[&bw, &x], &[0]).await);
    assert_eq!(k, ErrorKind::PermissionDenied, "{m}");

    // Nothing moved for the publish: alice's transfers are her two uploads and her read.
    let u = alice.usage();
    assert_eq!(u.host_to_device_bytes, 32, "w and `other`");
    assert_eq!(u.device_to_host_bytes, 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_live_while_a_reader_holds_them_and_the_ledger_follows() {
    let reg = Arc::new(WeightRegistry::new());
    let alice = publisher("alice", 1 << 20, 8);
    let a = session(&reg, &alice);
    let reader = session(&reg, &alice);
    let v1 = put(&a, [1.0; 4]);
    publish(&a, "p", &[("w", &v1)], &[]).await;
    let held = reader.open_weights("p").unwrap();
    let h1 = reader.weight(&held, "w").unwrap();
    drop(held);
    for i in 2..=3 {
        let t = put(&a, [i as f32; 4]);
        assert_eq!(publish(&a, "p", &[("w", &t)], &[]).await, i);
    }
    // Version 2 went when 3 came (nobody held it); version 1 lives in the reader's handle.
    assert_eq!(reader.weight_versions("p").unwrap(), (3, vec![1, 3]));
    assert_eq!(
        reg.published_usage("alice"),
        PublishedUsage {
            bytes: 32,
            versions: 2
        }
    );
    let again = reader.open_weights_version("p", Some(1)).unwrap();
    assert_eq!(
        get(&reader, &reader.weight(&again, "w").unwrap()).await,
        [1.0; 4]
    );
    drop(again);
    let (k, m) = kind(reader.open_weights_version("p", Some(2)));
    assert_eq!(k, ErrorKind::NotFound, "{m}");
    assert!(m.contains("versions held now: 1, 3"), "{m}");
    drop(h1);
    assert_eq!(reader.weight_versions("p").unwrap(), (3, vec![3]));
    assert_eq!(reg.published_usage("alice").versions, 1);

    // Unpublished: no latest; the numbering goes on.
    reg.unpublish("alice", "p").unwrap();
    assert_eq!(reader.weight_versions("p").unwrap(), (0, vec![]));
    assert_eq!(reg.published_usage("alice"), PublishedUsage::default());
    let (k, _) = kind(reader.open_weights("p"));
    assert_eq!(k, ErrorKind::NotFound);
    let t = put(&a, [9.0; 4]);
    assert_eq!(publish(&a, "p", &[("w", &t)], &[]).await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_outlives_sessions_and_bounds_bytes_and_versions() {
    let reg = Arc::new(WeightRegistry::new());
    {
        let alice = publisher("alice", 48, 2);
        let a = session(&reg, &alice);
        let (t1, t2) = (put(&a, [1.0; 4]), put(&a, [2.0; 4]));
        publish(&a, "one", &[("w", &t1)], &[]).await;
        publish(&a, "two", &[("w", &t2)], &[]).await;
    }
    // A new session (and a new accounting tenant) of the same tenant name: still two versions.
    let alice = publisher("alice", 48, 2);
    let a = session(&reg, &alice);
    let t3 = put(&a, [3.0; 4]);
    let (k, m) = kind(try_publish(&a, "three", &[("w", &t3)], &[]).await);
    assert_eq!(k, ErrorKind::ResourceExhausted, "{m}");
    assert!(m.contains("max-published-versions"), "{m}");
    assert!(!t3.is_read_only(), "a refused publish marks nothing");
    // Replacing a version nobody holds frees its place.
    assert_eq!(publish(&a, "two", &[("w", &t3)], &[]).await, 2);
    // Bytes: 16 + 16 held; 32 more would pass 48.
    let big = a
        .tensor_from_bytes(PrimitiveType::F32, &[8], &[0u8; 32], None)
        .unwrap();
    let pinned = a.open_weights("one").unwrap();
    let (k, m) = kind(try_publish(&a, "one", &[("w", &big)], &[]).await);
    assert_eq!(
        k,
        ErrorKind::ResourceExhausted,
        "16 + 16 + 32 > 48 bytes: {m}"
    );
    assert!(m.contains("max-published-bytes"), "{m}");
    drop(pinned);
    // Once nobody holds version 1 of `one`, it is replaced within the limit: 16 + 32 = 48.
    assert_eq!(publish(&a, "one", &[("w", &big)], &[]).await, 2);
    assert_eq!(
        reg.published_usage("alice"),
        PublishedUsage {
            bytes: 48,
            versions: 2
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissions_and_lying_inputs_fail_with_their_kind() {
    let dev = device();
    let reg = Arc::new(WeightRegistry::new());
    let alice = publisher("alice", 1 << 20, 8);
    let eve = publisher("eve", 1 << 20, 8);
    let nobody = Tenant::new("nobody", TenantLimits::default());
    let a = session(&reg, &alice);
    let e = session(&reg, &eve);
    let n = session(&reg, &nobody);
    let t = put(&a, [1.0; 4]);
    publish(&a, "alice-only", &[("w", &t)], &[]).await;

    // A tenant without max-published-bytes may not publish.
    let nt = put(&n, [1.0; 4]);
    let (k, m) = kind(try_publish(&n, "x", &[("w", &nt)], &[]).await);
    assert_eq!(k, ErrorKind::PermissionDenied, "{m}");
    assert!(m.contains("max-published-bytes"), "{m}");
    // Another tenant can neither publish over the name nor see it.
    let et = put(&e, [2.0; 4]);
    let (k, m) = kind(try_publish(&e, "alice-only", &[("w", &et)], &[]).await);
    assert_eq!(k, ErrorKind::PermissionDenied, "{m}");
    let (k, unseen) = kind(e.open_weights("alice-only"));
    assert_eq!(k, ErrorKind::NotFound);
    let (_, never) = kind(e.open_weights("never-used"));
    assert_eq!(
        unseen.replace("alice-only", "X"),
        never.replace("never-used", "X"),
        "a set eve may not read looks exactly like one that does not exist"
    );
    assert!(!e.weight_sets().contains(&"alice-only".to_string()));
    assert_eq!(kind(e.weight_versions("alice-only")).0, ErrorKind::NotFound);
    // A host set's name is the host's.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), safetensors_one_f32()).unwrap();
    reg.load_safetensors(&dev, "host-set", file.path(), 0)
        .unwrap();
    let (k, m) = kind(try_publish(&a, "host-set", &[("w", &t)], &[]).await);
    assert_eq!(k, ErrorKind::PermissionDenied, "{m}");
    // Another session's handle.
    let (k, _) = kind(try_publish(&a, "mine", &[("w", &et)], &[]).await);
    assert_eq!(k, ErrorKind::PermissionDenied);
    // Names: empty, too long, control characters, a tensor twice; no tensors; too many readers.
    let long = "n".repeat(257);
    for (name, tname) in [("", "w"), (long.as_str(), "w"), ("a\nb", "w"), ("ok", "")] {
        let (k, m) = kind(try_publish(&a, name, &[(tname, &t)], &[]).await);
        assert_eq!(k, ErrorKind::InvalidArgument, "{name:?}/{tname:?}: {m}");
    }
    let (k, m) = kind(try_publish(&a, "twice", &[("w", &t), ("w", &t)], &[]).await);
    assert_eq!(k, ErrorKind::InvalidArgument, "{m}");
    assert_eq!(
        kind(try_publish(&a, "empty", &[], &[]).await).0,
        ErrorKind::InvalidArgument
    );
    let many: Vec<String> = (0..300).map(|i| format!("t{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    assert_eq!(
        kind(try_publish(&a, "crowd", &[("w", &t)], &many).await).0,
        ErrorKind::InvalidArgument
    );
    // One handle under two names is one buffer, published once.
    assert_eq!(
        publish(&a, "tied", &[("a", &t), ("b", &t)], &["*"]).await,
        1
    );
    assert_eq!(e.open_weights("tied").unwrap().len(), 2);
    // A donated tensor cannot be published.
    let d = put(&a, [5.0; 4]);
    let exe = add(&a).await;
    let ones = put(&a, [1.0; 4]);
    a.execute(&exe, &[&d, &ones], &[0]).await.unwrap();
    let (k, m) = kind(try_publish(&a, "gone", &[("w", &d)], &[]).await);
    assert_eq!(k, ErrorKind::FailedPrecondition, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_race_between_donating_and_publishing_has_one_winner() {
    let reg = Arc::new(WeightRegistry::new());
    let alice = publisher("alice", 1 << 30, 1000);
    let a = Arc::new(session(&reg, &alice));
    let exe = Arc::new(add(&a).await);
    let (mut published, mut donated) = (0, 0);
    for i in 0..60 {
        let t = Arc::new(put(&a, [i as f32; 4]));
        let (s1, t1, e1) = (Arc::clone(&a), Arc::clone(&t), Arc::clone(&exe));
        let ones = put(&a, [1.0; 4]);
        let donate =
            tokio::spawn(async move { s1.execute(&e1, &[&t1, &ones], &[0]).await.map(|_| ()) });
        let (s2, t2) = (Arc::clone(&a), Arc::clone(&t));
        let name = format!("race-{i}");
        let publish = tokio::spawn(async move {
            let named = [("w".to_string(), &*t2)];
            s2.publish_weights(&name, &named, &[]).await.map(|_| ())
        });
        let (d, p) = (donate.await.unwrap(), publish.await.unwrap());
        match (d, p) {
            (Err(e), Ok(())) => {
                assert_eq!(e.kind, ErrorKind::PermissionDenied, "{}", e.message);
                published += 1;
                let set = a.open_weights(&format!("race-{i}")).unwrap();
                let w = a.weight(&set, "w").unwrap();
                assert_eq!(
                    get(&a, &w).await,
                    [i as f32; 4],
                    "the version kept its value"
                );
            }
            (Ok(()), Err(e)) => {
                assert_eq!(e.kind, ErrorKind::FailedPrecondition, "{}", e.message);
                donated += 1;
            }
            (d, p) => panic!("round {i}: exactly one must win, got {d:?} and {p:?}"),
        }
    }
    assert_eq!(published + donated, 60);
}

/// A safetensors file holding one f32[4] tensor `w` (the format's 8-byte header length, JSON
/// header, then data).
fn safetensors_one_f32() -> Vec<u8> {
    let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend(std::iter::repeat_n(0u8, 16));
    out
}
