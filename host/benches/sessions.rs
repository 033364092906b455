//! The session API's overhead, measured side by side in one run: a tiny execute (scalar f32
//! add, inputs already on the device) from a guest (`tests/guests/probe exec-loop`), from the
//! session layer directly, and over the session API from a Rust gRPC client on a Unix socket
//! and on TCP loopback; then putting and getting a 64 MiB f32 tensor over the Unix socket
//! against a 64 MiB memcpy on the same machine. The Python client's numbers come from
//! `python/bench/bench_session.py`.
//!
//! Run with `cargo bench -p tpubox --bench all -- sessions` after `bash scripts/dev.sh setup`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tonic::Request;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tpubox_core::{PrimitiveType, Session};
use tpubox_serve::access::Access;
use tpubox_session_api::grpc::v1::session_client::SessionClient;
use tpubox_session_api::grpc::v1::*;
use tpubox_session_api::registry::Registry;
use tpubox_session_api::{SessionAccess, SessionApiConfig};
use tpubox_wasm::sandbox::Sandbox;
use tpubox_wasm::{Host, HostConfig, RunOptions, SandboxConfig};

const SCALAR_ADD: &str = r#"
func.func public @main(%a: tensor<f32>, %b: tensor<f32>) -> tensor<f32> {
  %0 = stablehlo.add %a, %b : tensor<f32>
  return %0 : tensor<f32>
}
"#;

const CALLS: u32 = 5_000;
const ROUNDS: usize = 5;
const BIG: usize = 64 << 20;
const PUT_CHUNK: usize = 4 << 20;
const GET_CHUNK: u64 = 4 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn probe_wasm() -> PathBuf {
    let p = crate::guest_wasm("tpubox-probe");
    assert!(
        p.is_file(),
        "{} missing: run `bash scripts/dev.sh setup` first",
        p.display()
    );
    p
}

fn authed<T>(msg: T, token: &str) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut().insert(
        "authorization",
        MetadataValue::try_from(format!("Bearer {token}")).unwrap(),
    );
    r
}

async fn unix_channel(path: PathBuf) -> Channel {
    Endpoint::try_from("http://localhost")
        .unwrap()
        .initial_stream_window_size(Some(tpubox_session_api::WINDOW_BYTES))
        .initial_connection_window_size(Some(4 * tpubox_session_api::WINDOW_BYTES))
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .unwrap()
}

/// µs per tiny execute over `channel` (median of rounds), and the result checked.
async fn wire_execute(channel: Channel) -> f64 {
    let mut c = SessionClient::new(channel);
    let s = c
        .open(authed(OpenRequest::default(), "bench"))
        .await
        .unwrap()
        .into_inner();
    let t = s.session_token;
    let exe = c
        .compile(authed(
            CompileRequest {
                program: SCALAR_ADD.as_bytes().to_vec().into(),
                ..Default::default()
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner()
        .executable;
    let put = |v: f32| {
        let mut c = c.clone();
        let t = t.clone();
        async move {
            let chunk = PutTensorChunk {
                spec: Some(TensorSpec {
                    dtype: DType::F32 as i32,
                    dims: vec![],
                }),
                device: None,
                data: v.to_le_bytes().to_vec().into(),
            };
            c.put_tensor(authed(tokio_stream::iter(vec![chunk]), &t))
                .await
                .unwrap()
                .into_inner()
                .handle
        }
    };
    let a = put(1.5).await;
    let b = put(2.25).await;
    let req = || ExecuteRequest {
        executable: exe,
        arguments: vec![a, b],
        donate: vec![],
    };
    let mut rounds = Vec::new();
    for _ in 0..ROUNDS {
        let start = Instant::now();
        for _ in 0..CALLS {
            let r = c.execute(authed(req(), &t)).await.unwrap().into_inner();
            c.free(authed(
                FreeRequest {
                    tensors: vec![r.results[0].handle],
                    executables: vec![],
                },
                &t,
            ))
            .await
            .unwrap();
        }
        rounds.push(start.elapsed().as_secs_f64() * 1e6 / f64::from(CALLS));
    }
    // The free is a second round trip; time it alone and subtract it.
    let start = Instant::now();
    for _ in 0..CALLS {
        c.free(authed(FreeRequest::default(), &t)).await.unwrap();
    }
    let free_us = start.elapsed().as_secs_f64() * 1e6 / f64::from(CALLS);
    let out = c.execute(authed(req(), &t)).await.unwrap().into_inner();
    let mut g = c
        .get_tensor(authed(
            GetTensorRequest {
                handle: out.results[0].handle,
                chunk_bytes: 0,
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    let m = g.message().await.unwrap().unwrap();
    assert_eq!(f32::from_le_bytes(m.data[..4].try_into().unwrap()), 3.75);
    c.close(authed(CloseRequest {}, &t)).await.unwrap();
    median(rounds) - free_us
}

/// (put GiB/s, get GiB/s) of a 64 MiB tensor over `channel`, best of rounds.
async fn wire_transfer(channel: Channel) -> (f64, f64) {
    let mut c = SessionClient::new(channel)
        .max_decoding_message_size(128 << 20)
        .max_encoding_message_size(128 << 20);
    let s = c
        .open(authed(OpenRequest::default(), "bench"))
        .await
        .unwrap()
        .into_inner();
    let t = s.session_token;
    let data = bytes::Bytes::from(vec![7u8; BIG]);
    let gib = BIG as f64 / f64::from(1u32 << 30);
    let (mut put_best, mut get_best) = (0f64, 0f64);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        let chunks: Vec<PutTensorChunk> = (0..BIG / PUT_CHUNK)
            .map(|i| PutTensorChunk {
                spec: (i == 0).then(|| TensorSpec {
                    dtype: DType::F32 as i32,
                    dims: vec![(BIG / 4) as u64],
                }),
                device: None,
                data: data.slice(i * PUT_CHUNK..(i + 1) * PUT_CHUNK),
            })
            .collect();
        let h = c
            .put_tensor(authed(tokio_stream::iter(chunks), &t))
            .await
            .unwrap()
            .into_inner()
            .handle;
        put_best = put_best.max(gib / start.elapsed().as_secs_f64());
        let start = Instant::now();
        let mut g = c
            .get_tensor(authed(
                GetTensorRequest {
                    handle: h,
                    chunk_bytes: GET_CHUNK,
                },
                &t,
            ))
            .await
            .unwrap()
            .into_inner();
        let mut out = Vec::with_capacity(BIG);
        while let Some(m) = g.message().await.unwrap() {
            out.extend_from_slice(&m.data);
        }
        get_best = get_best.max(gib / start.elapsed().as_secs_f64());
        assert_eq!(out.len(), BIG);
        assert!(out.iter().all(|&b| b == 7));
        c.free(authed(
            FreeRequest {
                tensors: vec![h],
                executables: vec![],
            },
            &t,
        ))
        .await
        .unwrap();
    }
    (put_best, get_best)
}

fn memcpy_gib_s() -> f64 {
    let src = vec![3u8; BIG];
    let mut dst = vec![0u8; BIG];
    let mut best = 0f64;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.max(BIG as f64 / f64::from(1u32 << 30) / start.elapsed().as_secs_f64());
    }
    best
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let tokens = dir.path().join("tokens.toml");
        std::fs::write(
            &tokens,
            "[[tenant]]\nname = \"bench\"\ntokens = [\"bench\"]\n[tenant.session]\n",
        )
        .unwrap();
        let config = HostConfig {
            sandbox: SandboxConfig {
                cache_dir: Some(dir.path().join("wasm-cache")),
                ..SandboxConfig::default()
            },
            ..HostConfig::default()
        };
        let host = Arc::new(Host::new(config.clone()).unwrap());

        // A guest's tiny execute: the guest times its own loop.
        let component = host.load_component(&probe_wasm()).unwrap();
        let mut guest = Vec::new();
        for _ in 0..ROUNDS {
            let opts = RunOptions {
                args: vec!["exec-loop".into(), CALLS.to_string()],
                capture_output: true,
                allow_clock: true,
                stdin: Some(Vec::new()),
                ..RunOptions::default()
            };
            let o = host.run(&component, "probe", &opts).await.unwrap();
            let out = String::from_utf8(o.stdout).unwrap();
            let line = out.lines().find_map(|l| l.strip_prefix("exec-loop: ")).unwrap();
            let ns: f64 = line.split(' ').nth(1).unwrap().parse().unwrap();
            guest.push(ns / 1e3 / f64::from(CALLS));
        }
        let guest = median(guest);

        // The session layer directly, as the session API calls it.
        let session = Session::new(
            Arc::clone(host.device()),
            Arc::clone(host.weights()),
            tpubox_core::Tenant::new("direct", Default::default()),
        );
        let exe = session
            .compile(
                SCALAR_ADD.as_bytes().to_vec(),
                tpubox_core::session::ProgramFormat::MlirText,
                None,
            )
            .await
            .unwrap();
        let a = session
            .tensor_from_bytes(PrimitiveType::F32, &[], &1.5f32.to_le_bytes(), None)
            .unwrap();
        let b = session
            .tensor_from_bytes(PrimitiveType::F32, &[], &2.25f32.to_le_bytes(), None)
            .unwrap();
        let mut direct = Vec::new();
        for _ in 0..ROUNDS {
            let start = Instant::now();
            for _ in 0..CALLS {
                drop(session.execute(&exe, &[&a, &b], &[]).await.unwrap());
            }
            direct.push(start.elapsed().as_secs_f64() * 1e6 / f64::from(CALLS));
        }
        let direct = median(direct);
        // The same 64 MiB transfer through the session layer alone (no wire): the floor.
        let (mut floor_put, mut floor_get) = (0f64, 0f64);
        let big = vec![7u8; BIG];
        let gib = BIG as f64 / f64::from(1u32 << 30);
        for _ in 0..ROUNDS {
            let start = Instant::now();
            let t = session
                .tensor_from_bytes(PrimitiveType::F32, &[(BIG / 4) as u64], &big, None)
                .unwrap();
            floor_put = floor_put.max(gib / start.elapsed().as_secs_f64());
            let start = Instant::now();
            let back = session.read(&t).await.unwrap();
            floor_get = floor_get.max(gib / start.elapsed().as_secs_f64());
            assert_eq!(back.len(), BIG);
        }
        drop(big);

        // The session API, served in this process.
        let socket = dir.path().join("tpubox.sock");
        let api = SessionApiConfig {
            socket: Some(socket.clone()),
            socket_mode: None,
            socket_group: None,
            tcp: Some("127.0.0.1:0".parse().unwrap()),
            components: None,
            max_message_bytes: 128 << 20,
        };
        let listeners = tpubox_session_api::Listeners::bind(&api).await.unwrap();
        let tcp = format!("http://{}", listeners.tcp_addr().unwrap());
        let registry = Registry::new(Arc::clone(host.device()), Arc::clone(host.weights()));
        let access: Arc<dyn SessionAccess> = Arc::new(Access::from_file(&tokens).unwrap());
        let sandbox = Arc::new(Sandbox::new(config.sandbox.clone()).unwrap());
        tokio::spawn(tpubox_session_api::serve(
            listeners,
            registry,
            access,
            sandbox,
            api,
            tpubox_net::Doors::new(&tpubox_net::DoorLimits::default()),
            std::future::pending(),
        ));
        // The client runs on its own thread and runtime, as another process would.
        let (unix_us, tcp_us, (put, get)) = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let unix_us = wire_execute(unix_channel(socket.clone()).await).await;
                let tcp_us = wire_execute(
                    Endpoint::try_from(tcp)
                        .unwrap()
                        .tcp_nodelay(true)
                        .connect()
                        .await
                        .unwrap(),
                )
                .await;
                let transfer = wire_transfer(unix_channel(socket).await).await;
                (unix_us, tcp_us, transfer)
            })
        })
        .join()
        .unwrap();
        let memcpy = memcpy_gib_s();

        println!("tiny execute (scalar f32 add, inputs on the device), µs per call, median of {ROUNDS} x {CALLS}:");
        println!("| path | µs/call | vs guest |");
        println!("|---|---|---|");
        println!("| session layer, in process | {direct:.1} | {:.2}x |", direct / guest);
        println!("| guest (probe exec-loop) | {guest:.1} | 1.00x |");
        println!("| session API, Rust client, Unix socket | {unix_us:.1} | {:.2}x |", unix_us / guest);
        println!("| session API, Rust client, TCP loopback | {tcp_us:.1} | {:.2}x |", tcp_us / guest);
        println!();
        println!("64 MiB f32 tensor over the Unix socket (Rust client), GiB/s, best of {ROUNDS}:");
        println!("| transfer | GiB/s | vs memcpy |");
        println!("|---|---|---|");
        println!("| memcpy 64 MiB | {memcpy:.2} | 1.00x |");
        println!("| put, session layer in process (no wire) | {floor_put:.2} | {:.2}x |", floor_put / memcpy);
        println!("| get, session layer in process (no wire) | {floor_get:.2} | {:.2}x |", floor_get / memcpy);
        println!("| put (PutTensor, 4 MiB chunks) | {put:.2} | {:.2}x |", put / memcpy);
        println!("| get (GetTensor, 4 MiB chunks) | {get:.2} | {:.2}x |", get / memcpy);
    });
}
