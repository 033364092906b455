//! The session API (`tpubox.v1.Session`) over the wire: a daemon's session listener started in
//! this process on loopback, driven with the generated tonic client. Every hostile request is
//! checked for its exact gRPC code and tpubox error kind (the `tpubox-error-kind` trailer).
//! The Python package's tests (python/tests) drive the same API from a user's side.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Request;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tpubox_serve::access::Access;
use tpubox_session_api::grpc::v1::session_client::SessionClient;
use tpubox_session_api::grpc::v1::*;
use tpubox_session_api::registry::Registry;
use tpubox_session_api::{SessionAccess, SessionApiConfig};
use tpubox_wasm::Host;
use tpubox_wasm::sandbox::Sandbox;

const TOKENS: &str = r#"
[[tenant]]
name = "alice"
tokens = ["alice-token"]
[tenant.session]
max_sessions = 3
max_device_mib = 1
idle_timeout_seconds = 60

[[tenant]]
name = "bob"
tokens = ["bob-token"]
[tenant.session]

[[tenant]]
name = "serving-only"
tokens = ["serving-token"]
"#;

const ADD: &str = r#"
func.func public @main(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.add %a, %b : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"#;

struct Daemon {
    addr: String,
    registry: Arc<Registry>,
    _stop: tokio::sync::oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

async fn daemon() -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(&tokens, TOKENS).unwrap();
    let host = Host::new(crate::support::test_host_config()).unwrap();
    {
        use safetensors::tensor::{Dtype, TensorView};
        let w = f32_bytes(&[0.5, -1.5]);
        let views = vec![("w", TensorView::new(Dtype::F32, vec![2], &w).unwrap())];
        let path = dir.path().join("tiny.safetensors");
        safetensors::serialize_to_file(views, None, &path).unwrap();
        host.load_weights("tiny", &path).unwrap();
    }
    let sandbox = Arc::new(Sandbox::new(crate::support::test_host_config().sandbox).unwrap());
    let components = dir.path().join("components");
    std::fs::create_dir(&components).unwrap();
    std::fs::copy(
        crate::support::wasm("hello-matmul"),
        components.join("hello-matmul.wasm"),
    )
    .unwrap();
    let config = SessionApiConfig {
        socket: Some(dir.path().join("tpubox.sock")),
        socket_mode: None,
        socket_group: None,
        tcp: Some("127.0.0.1:0".parse().unwrap()),
        components: Some(components),
        max_message_bytes: 64 << 20,
    };
    let listeners = tpubox_session_api::Listeners::bind(&config).await.unwrap();
    let addr = format!("http://{}", listeners.tcp_addr().unwrap());
    let registry = Registry::new(Arc::clone(host.device()), Arc::clone(host.weights()));
    let access: Arc<dyn SessionAccess> = Arc::new(Access::from_file(&tokens).unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(tpubox_session_api::serve(
        listeners,
        Arc::clone(&registry),
        access,
        sandbox,
        config,
        tpubox_net::Doors::new(&tpubox_net::DoorLimits::default()),
        async {
            let _ = rx.await;
        },
    ));
    Daemon {
        addr,
        registry,
        _stop: tx,
        _dir: dir,
    }
}

async fn client(d: &Daemon) -> SessionClient<Channel> {
    SessionClient::connect(d.addr.clone())
        .await
        .unwrap()
        .max_decoding_message_size(64 << 20)
}

fn authed<T>(msg: T, token: &str) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut().insert(
        "authorization",
        MetadataValue::try_from(format!("Bearer {token}")).unwrap(),
    );
    r
}

/// The tpubox error kind of a failed call, and its gRPC code.
fn kind(s: &tonic::Status) -> (tonic::Code, String) {
    let k = s
        .metadata()
        .get("tpubox-error-kind")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (s.code(), k)
}

async fn open(c: &mut SessionClient<Channel>, tenant: &str, r: OpenRequest) -> OpenResponse {
    c.open(authed(r, tenant)).await.unwrap().into_inner()
}

fn spec(dtype: DType, dims: &[u64]) -> TensorSpec {
    TensorSpec {
        dtype: dtype as i32,
        dims: dims.to_vec(),
    }
}

async fn put(
    c: &mut SessionClient<Channel>,
    token: &str,
    chunks: Vec<PutTensorChunk>,
) -> Result<TensorInfo, tonic::Status> {
    c.put_tensor(authed(tokio_stream::iter(chunks), token))
        .await
        .map(|r| r.into_inner())
}

fn first(spec: TensorSpec, data: &[u8]) -> PutTensorChunk {
    PutTensorChunk {
        spec: Some(spec),
        device: None,
        data: data.to_vec().into(),
    }
}

fn more(data: &[u8]) -> PutTensorChunk {
    PutTensorChunk {
        spec: None,
        device: None,
        data: data.to_vec().into(),
    }
}

async fn get(
    c: &mut SessionClient<Channel>,
    token: &str,
    handle: u64,
) -> Result<Vec<u8>, tonic::Status> {
    let mut s = c
        .get_tensor(authed(
            GetTensorRequest {
                handle,
                chunk_bytes: 5,
            },
            token,
        ))
        .await?
        .into_inner();
    let mut out = Vec::new();
    let mut n = 0;
    while let Some(m) = s.message().await? {
        assert_eq!(
            m.info.is_some(),
            n == 0,
            "only the first chunk has the header"
        );
        out.extend_from_slice(&m.data);
        n += 1;
    }
    Ok(out)
}

/// Compiles [`ADD`] in the session of `token`.
async fn compile_add(c: &mut SessionClient<Channel>, token: &str) -> CompileResponse {
    c.compile(authed(
        CompileRequest {
            program: ADD.as_bytes().to_vec().into(),
            ..Default::default()
        },
        token,
    ))
    .await
    .unwrap()
    .into_inner()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_compile_execute_donate_and_free() {
    let d = daemon().await;
    let mut c = client(&d).await;
    let s = open(&mut c, "bob-token", OpenRequest::default()).await;
    assert_eq!(s.tenant, "bob");
    assert_eq!(s.platform.as_ref().unwrap().name, "cpu");
    let t = &s.session_token;

    // Every dtype round-trips its bytes exactly, over chunked puts and gets.
    for (dt, size) in [
        (DType::Pred, 1),
        (DType::S8, 1),
        (DType::S16, 2),
        (DType::S32, 4),
        (DType::S64, 8),
        (DType::U8, 1),
        (DType::U16, 2),
        (DType::U32, 4),
        (DType::U64, 8),
        (DType::F16, 2),
        (DType::Bf16, 2),
        (DType::F32, 4),
        (DType::F64, 8),
        (DType::C64, 8),
        (DType::C128, 16),
    ] {
        let n = 6 * size;
        let bytes: Vec<u8> = (0..n)
            .map(|i| {
                if dt == DType::Pred {
                    (i % 2) as u8
                } else {
                    (i as u8).wrapping_mul(7).wrapping_add(1)
                }
            })
            .collect();
        let (a, b) = bytes.split_at(5);
        let info = put(&mut c, t, vec![first(spec(dt, &[2, 3]), a), more(b)])
            .await
            .unwrap();
        assert_eq!(info.byte_size as usize, n);
        assert_eq!(get(&mut c, t, info.handle).await.unwrap(), bytes, "{dt:?}");
    }
    // Zero-size and rank-0 tensors.
    let z = put(&mut c, t, vec![first(spec(DType::F32, &[0, 3]), &[])])
        .await
        .unwrap();
    assert!(get(&mut c, t, z.handle).await.unwrap().is_empty());
    let r0 = put(
        &mut c,
        t,
        vec![first(spec(DType::F64, &[]), &2.5f64.to_le_bytes())],
    )
    .await
    .unwrap();
    assert_eq!(
        get(&mut c, t, r0.handle).await.unwrap(),
        2.5f64.to_le_bytes()
    );

    let exe = compile_add(&mut c, t).await;
    assert_eq!(exe.parameters.len(), 2);
    assert_eq!(exe.results, vec![spec(DType::F32, &[4])]);
    let a = put(
        &mut c,
        t,
        vec![first(spec(DType::F32, &[4]), &f32_bytes(&[1., 2., 3., 4.]))],
    )
    .await
    .unwrap();
    let b = put(
        &mut c,
        t,
        vec![first(
            spec(DType::F32, &[4]),
            &f32_bytes(&[10., 20., 30., 40.]),
        )],
    )
    .await
    .unwrap();
    let run = |donate: Vec<u32>| ExecuteRequest {
        executable: exe.executable,
        arguments: vec![a.handle, b.handle],
        donate,
    };
    let out = c
        .execute(authed(run(vec![]), t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        get(&mut c, t, out.results[0].handle).await.unwrap(),
        f32_bytes(&[11., 22., 33., 44.])
    );
    // Borrowed arguments stay; a donated one is gone.
    let out2 = c
        .execute(authed(run(vec![0]), t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        get(&mut c, t, out2.results[0].handle).await.unwrap(),
        f32_bytes(&[11., 22., 33., 44.])
    );
    let e = c.execute(authed(run(vec![]), t)).await.unwrap_err();
    assert_eq!(
        kind(&e),
        (
            tonic::Code::FailedPrecondition,
            "failed-precondition".into()
        ),
        "{e:?}"
    );
    let e = get(&mut c, t, a.handle).await.unwrap_err();
    assert_eq!(kind(&e).1, "failed-precondition");
    // Donating twice in one call, or out of range.
    for donate in [vec![1, 1], vec![2]] {
        let e = c.execute(authed(run(donate), t)).await.unwrap_err();
        assert_eq!(
            kind(&e),
            (tonic::Code::InvalidArgument, "invalid-argument".into())
        );
    }
    // Wrong arguments for the program.
    let e = c
        .execute(authed(
            ExecuteRequest {
                executable: exe.executable,
                arguments: vec![b.handle],
                donate: vec![],
            },
            t,
        ))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "invalid-argument");
    // A program that does not parse.
    let e = c
        .compile(authed(
            CompileRequest {
                program: b"func.func @main( {".to_vec().into(),
                ..Default::default()
            },
            t,
        ))
        .await
        .unwrap_err();
    assert_eq!(
        kind(&e),
        (tonic::Code::InvalidArgument, "compile-failed".into())
    );

    // Shared weights: readable, usable as arguments, never donated, charged to nobody.
    assert_eq!(
        c.info(authed(InfoRequest {}, t))
            .await
            .unwrap()
            .into_inner()
            .weight_sets,
        vec!["tiny".to_string()]
    );
    let before = c
        .usage(authed(UsageRequest {}, t))
        .await
        .unwrap()
        .into_inner();
    let ws = c
        .open_weights(authed(
            OpenWeightsRequest {
                name: "tiny".into(),
                version: 0,
            },
            t,
        ))
        .await
        .unwrap()
        .into_inner();
    let w = ws.tensors[0].tensor.clone().unwrap();
    assert_eq!((ws.tensors[0].name.as_str(), w.read_only), ("w", true));
    assert_eq!(
        get(&mut c, t, w.handle).await.unwrap(),
        f32_bytes(&[0.5, -1.5])
    );
    let after = c
        .usage(authed(UsageRequest {}, t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(after.device_bytes, before.device_bytes);
    assert_eq!(after.live_tensors, before.live_tensors + 1);
    let e = c
        .open_weights(authed(
            OpenWeightsRequest {
                name: "nope".into(),
                version: 0,
            },
            t,
        ))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "not-found");
    assert!(e.message().contains("tiny"), "{}", e.message());
    c.free(authed(
        FreeRequest {
            tensors: vec![w.handle],
            executables: vec![],
        },
        t,
    ))
    .await
    .unwrap();

    let usage = c
        .usage(authed(UsageRequest {}, t))
        .await
        .unwrap()
        .into_inner();
    assert!(usage.device_bytes > 0 && usage.live_executables == 1);
    // Free everything the session holds: unknown handles are reported, not errors.
    let info = c
        .info(authed(InfoRequest {}, t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.components, vec!["hello-matmul".to_string()]);
    let live = d.registry.sessions();
    let (n_tensors, n_exes) = live[0].handle_counts();
    assert_eq!((n_tensors, n_exes), (21, 1));
    let all: Vec<u64> = (1..=info_max_handle(&out2)).collect();
    let f = c
        .free(authed(
            FreeRequest {
                tensors: all.clone(),
                executables: vec![exe.executable],
            },
            t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(f.freed, 22);
    let usage = c
        .usage(authed(UsageRequest {}, t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            usage.device_bytes,
            usage.live_tensors,
            usage.live_executables
        ),
        (0, 0, 0)
    );
}

/// The largest handle number made so far (handles are numbered from one counter).
fn info_max_handle(r: &ExecuteResponse) -> u64 {
    r.results.iter().map(|t| t.handle).max().unwrap()
}

/// A compile says which cache tier served it, takes an optimisation level ("O0"–"O3") and
/// refuses any other with `invalid-argument`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compile_reports_its_tier_and_takes_an_optimization_level() {
    let d = daemon().await;
    let mut c = client(&d).await;
    let s = open(&mut c, "bob-token", OpenRequest::default()).await;
    let t = &s.session_token;
    // A program no other test compiles, at O1: a cache miss the first time (this daemon's
    // tier 2 may hold it from an earlier run of the test), tier 1 the second.
    let program = ADD.replace("stablehlo.add", "stablehlo.subtract");
    let compile = |level: &str| CompileRequest {
        program: program.as_bytes().to_vec().into(),
        optimization_level: level.to_string(),
        ..Default::default()
    };
    let first = c
        .compile(authed(compile("O1"), t))
        .await
        .unwrap()
        .into_inner();
    assert!(
        ["compiled", "disk"].contains(&first.tier.as_str()),
        "{}",
        first.tier
    );
    let again = c
        .compile(authed(compile("O1"), t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.tier, "memory");
    for bad in ["O4", "o1", "fast"] {
        let e = c.compile(authed(compile(bad), t)).await.unwrap_err();
        assert_eq!(kind(&e).1, "invalid-argument", "{bad}");
        assert!(e.message().contains("O0, O1, O2, O3"), "{bad}: {e:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_sessions_and_handles_are_isolated() {
    let d = daemon().await;
    let mut c = client(&d).await;
    // No token, a bad token, a session token where a tenant token is needed and the reverse.
    let e = c
        .open(Request::new(OpenRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(
        kind(&e),
        (tonic::Code::Unauthenticated, "unauthenticated".into())
    );
    let e = c
        .open(authed(OpenRequest::default(), "nope"))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "unauthenticated");
    let e = c
        .info(authed(InfoRequest {}, "alice-token"))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "unauthenticated");
    // A serving-only tenant opens nothing.
    let e = c
        .open(authed(OpenRequest::default(), "serving-token"))
        .await
        .unwrap_err();
    assert_eq!(
        kind(&e),
        (tonic::Code::PermissionDenied, "permission-denied".into())
    );
    assert!(e.message().contains("[tenant.session]"), "{}", e.message());
    // Asking for more than the tenant has.
    let e = c
        .open(authed(
            OpenRequest {
                limits: Some(Limits {
                    max_device_bytes: 2 << 20,
                    ..Default::default()
                }),
                ..Default::default()
            },
            "alice-token",
        ))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "invalid-argument");
    assert!(e.message().contains("max-device-bytes"));

    let a = open(&mut c, "alice-token", OpenRequest::default()).await;
    let b = open(&mut c, "bob-token", OpenRequest::default()).await;
    let x = put(
        &mut c,
        &a.session_token,
        vec![first(spec(DType::F32, &[4]), &f32_bytes(&[1., 2., 3., 4.]))],
    )
    .await
    .unwrap();
    // Bob's session does not know Alice's handle: not-found, as for a handle never made.
    let e = get(&mut c, &b.session_token, x.handle).await.unwrap_err();
    assert_eq!(kind(&e), (tonic::Code::NotFound, "not-found".into()));
    let never = get(&mut c, &b.session_token, 1 << 60).await.unwrap_err();
    assert_eq!(kind(&never), kind(&e));
    let f = c
        .free(authed(
            FreeRequest {
                tensors: vec![x.handle],
                executables: vec![],
            },
            &b.session_token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((f.freed, f.unknown), (0, vec![x.handle]));
    assert_eq!(
        get(&mut c, &a.session_token, x.handle).await.unwrap().len(),
        16
    );

    // Alice's limit is 1 MiB per session: a bigger tensor is refused before its data is read,
    // and a tensor that fits only with what is held is refused at the charge.
    let e = put(
        &mut c,
        &a.session_token,
        vec![first(spec(DType::F32, &[1 << 20]), &[])],
    )
    .await
    .unwrap_err();
    assert_eq!(
        kind(&e),
        (tonic::Code::ResourceExhausted, "resource-exhausted".into())
    );
    assert!(e.message().contains("max-device-bytes"), "{}", e.message());
    let big = vec![0u8; 1 << 20];
    let e = put(
        &mut c,
        &a.session_token,
        vec![first(spec(DType::U8, &[1 << 20]), &big)],
    )
    .await
    .unwrap_err();
    assert_eq!(kind(&e).1, "resource-exhausted");
    assert!(e.message().contains("max-device-bytes"), "{}", e.message());
    // Bob is not affected.
    put(
        &mut c,
        &b.session_token,
        vec![first(spec(DType::U8, &[1 << 20]), &big)],
    )
    .await
    .unwrap();

    // max_sessions = 3 for alice.
    let _a2 = open(&mut c, "alice-token", OpenRequest::default()).await;
    let _a3 = open(&mut c, "alice-token", OpenRequest::default()).await;
    let e = c
        .open(authed(OpenRequest::default(), "alice-token"))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "resource-exhausted");
    assert!(e.message().contains("max-sessions"));

    // Closing ends the session: its token now says so, and what it held is freed.
    let tu = c
        .tenant_usage(authed(TenantUsageRequest {}, "alice-token"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((tu.sessions, tu.usage.unwrap().device_bytes), (3, 16));
    let closed = c
        .close(authed(CloseRequest {}, &a.session_token))
        .await
        .unwrap()
        .into_inner();
    assert!(closed.closed);
    let again = c
        .close(authed(CloseRequest {}, &a.session_token))
        .await
        .unwrap()
        .into_inner();
    assert!(!again.closed);
    let e = get(&mut c, &a.session_token, x.handle).await.unwrap_err();
    assert_eq!(
        kind(&e),
        (tonic::Code::Unauthenticated, "session-ended".into())
    );
    assert!(
        e.message().contains("closed by its client"),
        "{}",
        e.message()
    );
    let tu = c
        .tenant_usage(authed(TenantUsageRequest {}, "alice-token"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((tu.sessions, tu.usage.unwrap().device_bytes), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_puts_are_refused_with_their_kind() {
    let d = daemon().await;
    let mut c = client(&d).await;
    let s = open(&mut c, "bob-token", OpenRequest::default()).await;
    let t = &s.session_token;
    let cases: Vec<(&str, Vec<PutTensorChunk>)> = vec![
        ("no message", vec![]),
        ("no spec", vec![more(b"abcd")]),
        (
            "second spec",
            vec![
                first(spec(DType::U8, &[2]), b"a"),
                first(spec(DType::U8, &[2]), b"b"),
            ],
        ),
        (
            "too many bytes",
            vec![first(spec(DType::U8, &[2]), b"ab"), more(b"c")],
        ),
        (
            "too few bytes",
            vec![first(spec(DType::F32, &[2]), b"abcd")],
        ),
        (
            "no dtype",
            vec![first(
                TensorSpec {
                    dtype: 0,
                    dims: vec![1],
                },
                b"a",
            )],
        ),
        (
            "unknown dtype",
            vec![first(
                TensorSpec {
                    dtype: 13,
                    dims: vec![1],
                },
                b"a",
            )],
        ),
        ("rank 65", vec![first(spec(DType::U8, &[1; 65]), b"a")]),
        (
            "dim over i64",
            vec![first(spec(DType::U8, &[u64::MAX]), b"")],
        ),
        (
            "overflowing size",
            vec![first(spec(DType::C128, &[1 << 40, 1 << 40]), b"")],
        ),
    ];
    for (what, chunks) in cases {
        let e = put(&mut c, t, chunks).await.unwrap_err();
        assert_eq!(
            kind(&e),
            (tonic::Code::InvalidArgument, "invalid-argument".into()),
            "{what}: {e:?}"
        );
    }
    // A device that does not exist.
    let mut ch = first(spec(DType::U8, &[1]), b"a");
    ch.device = Some(7);
    let e = put(&mut c, t, vec![ch]).await.unwrap_err();
    assert_eq!(kind(&e).1, "not-found", "{e:?}");
    // Nothing was kept.
    let u = c
        .usage(authed(UsageRequest {}, t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((u.device_bytes, u.live_tensors), (0, 0));
    // Compile: unknown format; Execute: an executable handle that is a tensor's.
    let e = c
        .compile(authed(
            CompileRequest {
                program: ADD.as_bytes().to_vec().into(),
                format: 9,
                ..Default::default()
            },
            t,
        ))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "invalid-argument");
    let x = put(&mut c, t, vec![first(spec(DType::U8, &[1]), b"a")])
        .await
        .unwrap();
    let e = c
        .execute(authed(
            ExecuteRequest {
                executable: x.handle,
                arguments: vec![],
                donate: vec![],
            },
            t,
        ))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "not-found");
    // RunComponent: no component, not a component, a name that walks out of the directory.
    for (what, comp) in [
        ("none", None),
        (
            "not wasm",
            Some(run_component_request::Component::Wasm(
                b"hello".to_vec().into(),
            )),
        ),
        (
            "path",
            Some(run_component_request::Component::Name("../tokens".into())),
        ),
    ] {
        let e = c
            .run_component(authed(
                RunComponentRequest {
                    component: comp,
                    ..Default::default()
                },
                t,
            ))
            .await
            .unwrap_err();
        assert_eq!(kind(&e).1, "invalid-argument", "{what}: {e:?}");
    }
    let e = c
        .run_component(authed(
            RunComponentRequest {
                component: Some(run_component_request::Component::Name("nope".into())),
                ..Default::default()
            },
            t,
        ))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "not-found");
    assert!(e.message().contains("hello-matmul"), "{}", e.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_end_on_disconnect_and_idle_timeout() {
    let d = daemon().await;
    let mut c = client(&d).await;
    let tenant_sessions = |c: &mut SessionClient<Channel>| {
        let mut c = c.clone();
        async move {
            c.tenant_usage(authed(TenantUsageRequest {}, "bob-token"))
                .await
                .unwrap()
                .into_inner()
        }
    };
    // end_on_disconnect: the session lives while an Attach stream is open.
    let s = open(
        &mut c,
        "bob-token",
        OpenRequest {
            end_on_disconnect: true,
            ..Default::default()
        },
    )
    .await;
    {
        // Its own connection, dropped below as a client process exiting would.
        let mut c2 = client(&d).await;
        let mut attach = c2
            .attach(authed(AttachRequest {}, &s.session_token))
            .await
            .unwrap()
            .into_inner();
        let ev = attach.message().await.unwrap().unwrap();
        assert_eq!(ev.kind, attach_event::Kind::Attached as i32);
        put(
            &mut c,
            &s.session_token,
            vec![first(spec(DType::U8, &[1000]), &[1; 1000])],
        )
        .await
        .unwrap();
        assert_eq!(
            tenant_sessions(&mut c).await.usage.unwrap().device_bytes,
            1000
        );
    }
    let start = Instant::now();
    loop {
        let u = tenant_sessions(&mut c).await;
        if u.sessions == 0 {
            assert_eq!(u.usage.unwrap().device_bytes, 0);
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the session did not end"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let e = c
        .info(authed(InfoRequest {}, &s.session_token))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "session-ended");
    assert!(e.message().contains("disconnected"), "{}", e.message());

    // An attached client sees ENDED when the session is closed elsewhere.
    let s = open(&mut c, "bob-token", OpenRequest::default()).await;
    let mut attach = c
        .attach(authed(AttachRequest {}, &s.session_token))
        .await
        .unwrap()
        .into_inner();
    attach.message().await.unwrap().unwrap();
    c.clone()
        .close(authed(CloseRequest {}, &s.session_token))
        .await
        .unwrap();
    let ev = attach.message().await.unwrap().unwrap();
    assert_eq!(ev.kind, attach_event::Kind::Ended as i32);

    // Idle timeout: no call and no attached client for 1 s ends it.
    let s = open(
        &mut c,
        "bob-token",
        OpenRequest {
            limits: Some(Limits {
                idle_timeout_seconds: 1.0,
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await;
    put(
        &mut c,
        &s.session_token,
        vec![first(spec(DType::U8, &[10]), &[1; 10])],
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let e = c
        .usage(authed(UsageRequest {}, &s.session_token))
        .await
        .unwrap_err();
    assert_eq!(kind(&e).1, "session-ended");
    assert!(e.message().contains("idle"), "{}", e.message());
    assert_eq!(tenant_sessions(&mut c).await.sessions, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_component_streams_output_and_charges_the_session() {
    let d = daemon().await;
    let mut c = client(&d).await;
    let s = open(&mut c, "bob-token", OpenRequest::default()).await;
    let wasm = std::fs::read(crate::support::wasm("hello-matmul")).unwrap();
    for comp in [
        run_component_request::Component::Name("hello-matmul".into()),
        run_component_request::Component::Wasm(wasm.into()),
    ] {
        let mut events = c
            .run_component(authed(
                RunComponentRequest {
                    component: Some(comp),
                    args: vec!["--scale".into(), "2".into()],
                    ..Default::default()
                },
                &s.session_token,
            ))
            .await
            .unwrap()
            .into_inner();
        let mut stdout = Vec::new();
        let mut exit = None;
        while let Some(ev) = events.message().await.unwrap() {
            match ev.event.unwrap() {
                run_component_event::Event::Stdout(b) => stdout.extend_from_slice(&b),
                run_component_event::Event::Stderr(_) => {}
                run_component_event::Event::Exit(e) => exit = Some(e),
            }
        }
        let exit = exit.expect("an exit event");
        let out = String::from_utf8_lossy(&stdout);
        assert_eq!(exit.code, 0, "{out} {}", exit.error);
        assert!(out.contains("platform: cpu"), "{out}");
        assert!(out.contains("scale: 2.0"), "{out}");
    }
    // The guest's handles were charged to the session's tenant and returned at its end.
    let u = c
        .usage(authed(UsageRequest {}, &s.session_token))
        .await
        .unwrap()
        .into_inner();
    assert!(u.executions >= 2 && u.compiles >= 1, "{u:?}");
    assert_eq!(u.device_bytes, 0);
    // A guest that fails: its stderr and exit status come back.
    let mut events = c
        .run_component(authed(
            RunComponentRequest {
                component: Some(run_component_request::Component::Name(
                    "hello-matmul".into(),
                )),
                args: vec!["--bogus".into()],
                ..Default::default()
            },
            &s.session_token,
        ))
        .await
        .unwrap()
        .into_inner();
    let mut code = None;
    let mut stderr = Vec::new();
    while let Some(ev) = events.message().await.unwrap() {
        match ev.event.unwrap() {
            run_component_event::Event::Exit(e) => code = Some(e.code),
            run_component_event::Event::Stderr(b) => stderr.extend_from_slice(&b),
            _ => {}
        }
    }
    assert_ne!(code, Some(0));
    assert!(String::from_utf8_lossy(&stderr).contains("usage"));
}

/// One local-socket request: header JSON and descriptors in; reply JSON and descriptors out.
fn local(
    path: &std::path::Path,
    header: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> (serde_json::Value, Vec<std::os::fd::OwnedFd>) {
    use rustix::net::*;
    use std::io::{IoSlice, IoSliceMut};
    use std::mem::MaybeUninit;
    let s = std::os::unix::net::UnixStream::connect(path).unwrap();
    let mut msg = (header.len() as u32).to_le_bytes().to_vec();
    msg.extend_from_slice(header);
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    sendmsg(&s, &[IoSlice::new(&msg)], &mut control, SendFlags::empty()).unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let r = recvmsg(
        &s,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::empty(),
    )
    .unwrap();
    let mut out = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = m {
            out.extend(it);
        }
    }
    let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
    assert_eq!(r.bytes, 4 + len, "one reply in one message");
    (serde_json::from_slice(&buf[4..4 + len]).unwrap(), out)
}

fn memfd(data: &[u8], seals: rustix::fs::SealFlags) -> std::os::fd::OwnedFd {
    use rustix::fs::*;
    let fd = memfd_create("test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    let f = std::fs::File::from(fd);
    use std::io::Write;
    (&f).write_all(data).unwrap();
    let fd = std::os::fd::OwnedFd::from(f);
    if !seals.is_empty() {
        fcntl_add_seals(&fd, seals).unwrap();
    }
    fd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_socket_moves_tensors_through_sealed_memfds_only() {
    use rustix::fs::SealFlags;
    use std::os::fd::AsFd;
    let d = daemon().await;
    let mut c = client(&d).await;
    let s = open(&mut c, "alice-token", OpenRequest::default()).await;
    let info = c
        .info(authed(InfoRequest {}, &s.session_token))
        .await
        .unwrap()
        .into_inner();
    let path = std::path::PathBuf::from(&info.local_socket);
    assert!(path.ends_with("tpubox.sock.local"), "{path:?}");
    let token = s.session_token.clone();
    let exe = compile_add(&mut c, &token).await.executable;
    let sealed = SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW;
    tokio::task::spawn_blocking(move || {
        let kind = |v: &serde_json::Value| v["error"]["kind"].as_str().unwrap_or("").to_string();
        let put = |dims: &str, fds: &[std::os::fd::BorrowedFd<'_>]| {
            let h = format!(r#"{{"op":"put","token":"{token}","dtype":"F32","dims":{dims}}}"#);
            local(&path, h.as_bytes(), fds).0
        };
        let data = f32_bytes(&[1., 2., 3., 4., 5., 6.]);
        // Put through a sealed memfd, get back a sealed memfd with the same bytes.
        let fd = memfd(&data, sealed);
        let r = put("[2,3]", &[fd.as_fd()]);
        let h = r["ok"]["handle"].as_u64().unwrap_or_else(|| panic!("{r}"));
        assert_eq!(r["ok"]["byte_size"], 24);
        let (r, fds) = local(
            &path,
            format!(r#"{{"op":"get","token":"{token}","handle":{h}}}"#).as_bytes(),
            &[],
        );
        assert_eq!(r["ok"]["dims"], serde_json::json!([2, 3]));
        assert_eq!(fds.len(), 1);
        // Lent: sealed against writing and growing, seals sealed, not against shrinking (the
        // daemon truncates it when the lease ends).
        let seals = rustix::fs::fcntl_get_seals(&fds[0]).unwrap();
        assert!(seals.contains(SealFlags::WRITE | SealFlags::GROW | SealFlags::SEAL));
        assert!(!seals.contains(SealFlags::SHRINK));
        assert!(r["ok"]["lease"].as_u64().is_some(), "{r}");
        let mut back = vec![0u8; 24];
        use std::os::unix::fs::FileExt;
        std::fs::File::from(fds.into_iter().next().unwrap())
            .read_exact_at(&mut back, 0)
            .unwrap();
        assert_eq!(back, data);
        // Execute and free over the local socket, as over gRPC; donation empties the handle.
        let four = memfd(&f32_bytes(&[1., 2., 3., 4.]), sealed);
        let r = put("[4]", &[four.as_fd()]);
        let x = r["ok"]["handle"].as_u64().unwrap();
        let call = |donate: &str| {
            let h = format!(
                r#"{{"op":"execute","token":"{token}","executable":{exe},"arguments":[{x},{x}],"donate":{donate}}}"#
            );
            local(&path, h.as_bytes(), &[]).0
        };
        let r = call("[]");
        let y = r["ok"]["results"][0]["handle"].as_u64().unwrap_or_else(|| panic!("{r}"));
        let (_, fds) = local(&path, format!(r#"{{"op":"get","token":"{token}","handle":{y}}}"#).as_bytes(), &[]);
        let mut back = vec![0u8; 16];
        std::fs::File::from(fds.into_iter().next().unwrap()).read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back, f32_bytes(&[2., 4., 6., 8.]));
        assert_eq!(kind(&call("[0, 0]")), "invalid-argument");
        let r = local(&path, format!(r#"{{"op":"execute","token":"{token}","executable":{x},"arguments":[]}}"#).as_bytes(), &[]).0;
        assert_eq!(kind(&r), "not-found", "a tensor handle as the executable");
        let r = local(&path, format!(r#"{{"op":"free","token":"{token}","tensors":[{x},{y},{}]}}"#, 1u64 << 60).as_bytes(), &[]).0;
        assert_eq!(r["ok"]["freed"], 2, "{r}");
        assert_eq!(r["ok"]["unknown"].as_array().unwrap().len(), 1);
        let r = local(&path, format!(r#"{{"op":"free","token":"{token}"}}"#).as_bytes(), &[fd.as_fd()]).0;
        assert_eq!(kind(&r), "invalid-argument", "a descriptor on a free");
        // Hostile puts, each with its kind.
        let unsealed = memfd(&data, SealFlags::empty());
        assert_eq!(
            kind(&put("[6]", &[unsealed.as_fd()])),
            "invalid-argument",
            "an unsealed memfd"
        );
        let shrinkable = memfd(&data, SealFlags::WRITE);
        assert_eq!(
            kind(&put("[6]", &[shrinkable.as_fd()])),
            "invalid-argument",
            "no F_SEAL_SHRINK"
        );
        let (pipe_r, _pipe_w) = rustix::pipe::pipe().unwrap();
        assert_eq!(
            kind(&put("[6]", &[pipe_r.as_fd()])),
            "invalid-argument",
            "a pipe"
        );
        let short = memfd(&data[..8], sealed);
        assert_eq!(
            kind(&put("[6]", &[short.as_fd()])),
            "invalid-argument",
            "too few bytes"
        );
        assert_eq!(kind(&put("[6]", &[])), "invalid-argument", "no descriptor");
        let two = memfd(&data, sealed);
        assert_eq!(
            kind(&put("[6]", &[fd.as_fd(), two.as_fd()])),
            "invalid-argument",
            "two descriptors"
        );
        let r = put("[1048576]", &[fd.as_fd()]);
        assert_eq!(kind(&r), "resource-exhausted", "over alice's 1 MiB");
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("max-device-bytes")
        );
        assert_eq!(
            kind(&put("[18446744073709551615]", &[fd.as_fd()])),
            "invalid-argument",
            "a dim over i64"
        );
        for bad in [
            &b"{"[..],
            b"[]",
            br#"{"op":"put"}"#,
            br#"{"op":"drop","token":"x"}"#,
        ] {
            assert_eq!(
                kind(&local(&path, bad, &[]).0),
                "invalid-argument",
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let r = local(&path, br#"{"op":"get","token":"nope","handle":1}"#, &[]).0;
        assert_eq!(kind(&r), "unauthenticated");
        let r = local(
            &path,
            format!(
                r#"{{"op":"get","token":"{token}","handle":{}}}"#,
                1u64 << 60
            )
            .as_bytes(),
            &[],
        )
        .0;
        assert_eq!(kind(&r), "not-found");
        // A header longer than the limit is refused from its length alone.
        let s = std::os::unix::net::UnixStream::connect(&path).unwrap();
        use std::io::{Read, Write};
        (&s).write_all(&u32::MAX.to_le_bytes()).unwrap();
        let mut reply = Vec::new();
        (&s).read_to_end(&mut reply).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&reply[4..]).unwrap();
        assert_eq!(kind(&v), "invalid-argument");
    })
    .await
    .unwrap();
    // Only the one good tensor is held.
    let u = c
        .usage(authed(UsageRequest {}, &s.session_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((u.live_tensors, u.device_bytes), (1, 24));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn donated_handles_count_against_max_live_tensors() {
    let d = daemon().await;
    let mut c = client(&d).await;
    let s = open(
        &mut c,
        "bob-token",
        OpenRequest {
            limits: Some(Limits {
                max_live_tensors: 4,
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await;
    let t = &s.session_token;
    let exe = compile_add(&mut c, t).await.executable;
    let four = f32_bytes(&[1., 2., 3., 4.]);
    let mut x = put(&mut c, t, vec![first(spec(DType::F32, &[4]), &four)])
        .await
        .unwrap()
        .handle;
    let b = put(&mut c, t, vec![first(spec(DType::F32, &[4]), &four)])
        .await
        .unwrap()
        .handle;
    let step = |x: u64| ExecuteRequest {
        executable: exe,
        arguments: vec![x, b],
        donate: vec![0],
    };
    // a, b; then each step donates x and adds its result: 3, then 4 handles in the table.
    for _ in 0..2 {
        x = c
            .execute(authed(step(x), t))
            .await
            .unwrap()
            .into_inner()
            .results[0]
            .handle;
    }
    let e = c.execute(authed(step(x), t)).await.unwrap_err();
    assert_eq!(kind(&e).1, "resource-exhausted", "{e:?}");
    assert!(
        e.message().contains("max-live-tensors") && e.message().contains("donated"),
        "{}",
        e.message()
    );
    // The refused execution donated nothing: x is still usable.
    assert_eq!(
        get(&mut c, t, x).await.unwrap(),
        f32_bytes(&[3., 6., 9., 12.])
    );
}

/// A connection to the local socket that sends requests without waiting for their replies
/// (pipelined) and reads the replies in order: (JSON, the bytes after it).
struct LocalConn(std::os::unix::net::UnixStream);

impl LocalConn {
    fn send(&mut self, header: &str, tail: &[u8]) {
        use std::io::Write;
        let mut msg = (header.len() as u32).to_le_bytes().to_vec();
        msg.extend_from_slice(header.as_bytes());
        msg.extend_from_slice(tail);
        self.0.write_all(&msg).unwrap();
    }

    fn reply(&mut self) -> (serde_json::Value, Vec<u8>) {
        use std::io::Read;
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        self.0.read_exact(&mut body).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let mut tail = vec![0u8; v["tail"].as_u64().unwrap_or(0) as usize];
        self.0.read_exact(&mut tail).unwrap();
        (v, tail)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_socket_pipelines_launches_into_reserved_handles() {
    let d = daemon().await;
    let mut c = client(&d).await;
    let s = open(
        &mut c,
        "bob-token",
        OpenRequest {
            limits: Some(Limits {
                max_pending_launches: 1,
                max_live_tensors: 64,
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await;
    let other = open(&mut c, "bob-token", OpenRequest::default()).await;
    let info = c
        .info(authed(InfoRequest {}, &s.session_token))
        .await
        .unwrap()
        .into_inner();
    let path = std::path::PathBuf::from(&info.local_socket);
    let token = s.session_token.clone();
    let other_token = other.session_token.clone();
    let exe = compile_add(&mut c, &token).await.executable;
    tokio::task::spawn_blocking(move || {
        let kind = |v: &serde_json::Value| v["error"]["kind"].as_str().unwrap_or("").to_string();
        let mut l = LocalConn(std::os::unix::net::UnixStream::connect(&path).unwrap());
        // A small put with its bytes after the header (no memfd).
        l.send(
            &format!(r#"{{"op":"put","token":"{token}","dtype":"F32","dims":[4],"tail":16}}"#),
            &f32_bytes(&[1., 2., 3., 4.]),
        );
        let (r, _) = l.reply();
        let x = r["ok"]["handle"].as_u64().unwrap_or_else(|| panic!("{r}"));
        // Reserve handle numbers; launch into them without reading the replies, the second
        // launch using the first's result, then read the second's result inline.
        l.send(&format!(r#"{{"op":"reserve","token":"{token}","count":8}}"#), &[]);
        let (r, _) = l.reply();
        let first = r["ok"]["first"].as_u64().unwrap_or_else(|| panic!("{r}"));
        let launch = |a: u64, out: u64| {
            format!(
                r#"{{"op":"call","token":"{token}","executable":{exe},"arguments":[{{"handle":{a}}},{{"handle":{a}}}],"launch":true,"out":[{out}]}}"#
            )
        };
        l.send(&launch(x, first), &[]);
        l.send(&launch(first, first + 1), &[]);
        l.send(
            &format!(r#"{{"op":"wait","token":"{token}","tensors":[{}]}}"#, first + 1),
            &[],
        );
        l.send(
            &format!(r#"{{"op":"get","token":"{token}","handle":{},"inline":true}}"#, first + 1),
            &[],
        );
        for _ in 0..3 {
            let (r, _) = l.reply();
            assert!(r.get("ok").is_some(), "{r}");
        }
        let (r, tail) = l.reply();
        assert_eq!(r["ok"]["handle"], first + 1, "{r}");
        assert_eq!(tail, f32_bytes(&[4., 8., 12., 16.]));
        // A call's small inline arguments after its header, its fetched result after the
        // reply's JSON.
        let mut args = f32_bytes(&[1., 1., 1., 1.]);
        args.resize(64, 0);
        args.extend(f32_bytes(&[2., 2., 2., 2.]));
        l.send(
            &format!(
                r#"{{"op":"call","token":"{token}","executable":{exe},"arguments":[{{"dtype":"F32","dims":[4]}},{{"dtype":"F32","dims":[4]}}],"fetch":[0],"inline":true,"tail":{}}}"#,
                args.len()
            ),
            &args,
        );
        let (r, tail) = l.reply();
        assert_eq!(r["ok"]["results"][0]["offset"], 0, "{r}");
        assert_eq!(tail, f32_bytes(&[3., 3., 3., 3.]));
        // Made-up handles: a used one, one out of the reservation, another session's, one
        // below the next (out of order): each refused, nothing made.
        let mut o = LocalConn(std::os::unix::net::UnixStream::connect(&path).unwrap());
        o.send(&format!(r#"{{"op":"reserve","token":"{other_token}","count":4}}"#), &[]);
        let theirs = o.reply().0["ok"]["first"].as_u64().unwrap();
        for out in [first, first + 1, first + 8, 12345, theirs] {
            l.send(&launch(x, out), &[]);
            let (r, _) = l.reply();
            assert_eq!(kind(&r), "invalid-argument", "out {out}: {r}");
        }
        l.send(&launch(x, first + 3), &[]);
        assert!(l.reply().0.get("ok").is_some());
        l.send(&launch(x, first + 2), &[]);
        assert_eq!(kind(&l.reply().0), "invalid-argument", "below the next");
        l.send(
            &format!(r#"{{"op":"reserve","token":"{token}","count":{}}}"#, (1u64 << 16) + 1),
            &[],
        );
        assert_eq!(kind(&l.reply().0), "invalid-argument", "too many");
        // A tail larger than the limit ends the connection; a tail of the wrong size is
        // refused and skipped (the next request is read where it starts).
        l.send(
            &format!(r#"{{"op":"put","token":"{token}","dtype":"F32","dims":[2],"tail":16}}"#),
            &[0u8; 16],
        );
        assert_eq!(kind(&l.reply().0), "invalid-argument", "8 bytes declared, 16 sent");
        l.send(&format!(r#"{{"op":"reserve","token":"{token}","count":4}}"#), &[]);
        assert!(l.reply().0["ok"]["first"].as_u64().is_some(), "read where it starts");
        let mut big = LocalConn(std::os::unix::net::UnixStream::connect(&path).unwrap());
        big.send(
            &format!(r#"{{"op":"put","token":"{token}","dtype":"F32","dims":[1],"tail":{}}}"#, 1 << 20),
            &[],
        );
        assert_eq!(kind(&big.reply().0), "invalid-argument");
        // A flood of pipelined launches whose replies are never read: the daemon answers each
        // (admitted, or refused naming max-pending-launches / max-live-tensors) and stops
        // reading once its replies fill the socket, so the flood blocks.
        let mut flood = LocalConn(std::os::unix::net::UnixStream::connect(&path).unwrap());
        flood.send(&format!(r#"{{"op":"reserve","token":"{token}","count":65536}}"#), &[]);
        let base = flood.reply().0["ok"]["first"].as_u64().unwrap();
        flood
            .0
            .set_write_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let mut sent = 0u64;
        let mut blocked = false;
        use std::io::Write;
        while sent < 65536 {
            let msg = launch(x, base + sent);
            let mut framed = (msg.len() as u32).to_le_bytes().to_vec();
            framed.extend_from_slice(msg.as_bytes());
            match flood.0.write_all(&framed) {
                Ok(()) => sent += 1,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    blocked = true;
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(blocked, "{sent} pipelined launches never blocked");
        // Its replies, in order: each admitted, or refused with the kind its limit gives.
        let mut kinds = std::collections::BTreeMap::new();
        for _ in 0..sent.min(2000) {
            let (r, _) = flood.reply();
            let k = kind(&r);
            if !k.is_empty() {
                let m = r["error"]["message"].as_str().unwrap().to_string();
                assert!(
                    k == "resource-exhausted"
                        && (m.contains("max-pending-launches") || m.contains("max-live-tensors")),
                    "{r}"
                );
            }
            *kinds.entry(k).or_insert(0u32) += 1;
        }
        assert!(kinds.get("").copied().unwrap_or(0) <= 64, "{kinds:?}");
        assert!(kinds.contains_key("resource-exhausted"), "{kinds:?}");
        drop(flood);
        // The daemon still serves the session on other connections.
        l.send(&format!(r#"{{"op":"wait","token":"{token}","all":true}}"#), &[]);
        assert!(l.reply().0.get("ok").is_some());
    })
    .await
    .unwrap();
}
