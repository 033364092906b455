//! Serving benchmark: MiniLM embeddings served by `tpubox serve` over REST, with dynamic
//! batching on and off, at 1, 4 and 16 concurrent clients that each send one sentence per
//! request, next to the same guest (`examples/minilm-serve`) called in process, without a
//! server, at batch 1 and batch 16. All in one run, on one machine.
//!
//! The load client is this program: tokio tasks over keep-alive HTTP connections (reqwest),
//! each sending requests back to back with the binary tensor extension. Latency is from
//! sending a request to having read its whole response; throughput is sentences per second
//! over a phase. Every phase starts warm (each batch size's buckets compiled before).
//!
//! Batching on uses `max_queue_delay_microseconds` 2000 and `preferred_batch_size` [16, 32], as
//! `examples/minilm-serve/config.toml` does (`TPUBOX_BENCH_DELAY_US`, `TPUBOX_BENCH_PREFERRED`
//! change them; `TPUBOX_BENCH_ONLY_BATCHING=1` skips the phases without batching). The table
//! also gives each phase's mean batch and the server's infer time per batch (from the
//! statistics extension), so a difference can be placed inside or outside the guest call.
//!
//! Run with `cargo bench -p tpubox --bench all -- serve` after `bash scripts/dev.sh setup`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tpubox_core::weights::WeightRegistry;
use tpubox_serve::instance::Instance;
use tpubox_serve::protocol::{Datatype, Tensor, push_bytes_element};
use tpubox_wasm::SandboxConfig;
use tpubox_wasm::sandbox::{RunOptions, Sandbox};

/// Requests per client in one served phase.
const PER_CLIENT: usize = 96;
/// Sentences embedded per in-process measurement.
const IN_PROCESS_SENTENCES: usize = 512;

/// 216 short sentences (at most 16 tokens each).
pub(crate) fn sentences() -> Vec<String> {
    let subjects = [
        "The host",
        "A guest",
        "Every tenant",
        "The compiler",
        "A notebook user",
        "The sampler",
    ];
    let verbs = [
        "compiles",
        "executes",
        "shares",
        "caches",
        "validates",
        "embeds",
    ];
    // Short enough that every sentence tokenizes to at most 16 tokens: both sides then run the
    // same (batch, 16) buckets, whichever sentences a batch happens to hold.
    let objects = [
        "a program",
        "small weights",
        "one device",
        "StableHLO modules",
        "a cache entry",
        "tokens",
    ];
    (0..216)
        .map(|i| {
            format!(
                "{} {} {}.",
                subjects[i % 6],
                verbs[(i / 6) % 6],
                objects[(i / 36) % 6]
            )
        })
        .collect()
}

/// Where `tpubox setup minilm` put the model (model.safetensors, tokenizer.json, ...).
pub(crate) fn model_dir() -> PathBuf {
    tpubox_core::plugin::known("minilm")
        .and_then(|p| p.installed_library())
        .expect("run `tpubox setup minilm` first")
}

/// The `minilm-serve` model guest, built for wasm32-wasip2.
pub(crate) fn component() -> PathBuf {
    let p = crate::guest_wasm("minilm_serve");
    assert!(
        p.is_file(),
        "{} is missing: run bash scripts/dev.sh setup",
        p.display()
    );
    p
}

fn text_tensor(texts: &[&str]) -> Tensor {
    let mut data = Vec::new();
    for t in texts {
        push_bytes_element(&mut data, t.as_bytes());
    }
    Tensor {
        name: "text".into(),
        datatype: Datatype::Bytes,
        shape: vec![texts.len() as u64],
        data,
    }
}

/// The `p` quantile (0..=1) of sorted durations.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Sentences per second of the guest called in process, `batch` sentences per `infer`.
async fn in_process(inst: &mut Instance, texts: &[String], batch: usize) -> f64 {
    let start = Instant::now();
    let mut done = 0;
    let mut i = 0;
    while done < IN_PROCESS_SENTENCES {
        let chunk: Vec<&str> = (0..batch)
            .map(|k| texts[(i + k) % texts.len()].as_str())
            .collect();
        i += batch;
        let out = inst.infer(vec![text_tensor(&chunk)]).await.expect("infer");
        assert_eq!(out[0].shape, [batch as u64, 384]);
        done += batch;
    }
    done as f64 / start.elapsed().as_secs_f64()
}

/// A `tpubox serve` child process, stopped (SIGTERM) when dropped.
pub(crate) struct Served {
    pub(crate) child: std::process::Child,
    pub(crate) port: u16,
    pub(crate) _dir: tempfile::TempDir,
}

impl Drop for Served {
    fn drop(&mut self) {
        let pid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let _ = self.child.wait();
    }
}

/// A loopback TCP port that was free a moment ago.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `tpubox serve` with MiniLM, with or without dynamic batching, and waits until it is
/// ready.
async fn serve(batching: bool, http: &reqwest::Client) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("minilm");
    std::fs::create_dir(&m).unwrap();
    std::os::unix::fs::symlink(model_dir(), m.join("files")).unwrap();
    std::fs::copy(component(), m.join("model.wasm")).unwrap();
    let mut config = String::from(
        "max_batch_size = 64\n[tpubox]\nfiles = \"files\"\n[tpubox.weights]\nminilm = \"files/model.safetensors\"\n",
    );
    if batching {
        let delay = std::env::var("TPUBOX_BENCH_DELAY_US").unwrap_or_else(|_| "2000".into());
        let preferred =
            std::env::var("TPUBOX_BENCH_PREFERRED").unwrap_or_else(|_| "[16, 32]".into());
        config.push_str(&format!(
            "[dynamic_batching]\nmax_queue_delay_microseconds = {delay}\npreferred_batch_size = {preferred}\n"
        ));
    }
    std::fs::write(m.join("config.toml"), config).unwrap();
    let port = free_port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_tpubox"))
        .args(["serve", "--model-repository"])
        .arg(dir.path())
        .args(["--http-port", &port.to_string()])
        .args(["--grpc-port", &free_port().to_string()])
        .args(["--metrics-port", &free_port().to_string()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start tpubox serve");
    let served = Served {
        child,
        port,
        _dir: dir,
    };
    let url = format!("http://127.0.0.1:{port}/v2/health/ready");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(r) = http.get(&url).send().await
            && r.status() == 200
        {
            break;
        }
        assert!(Instant::now() < deadline, "tpubox serve not ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    served
}

/// A prepared request: body and the length of its JSON header.
pub(crate) type Body = (Vec<u8>, usize);

/// The guest's request for one sentence (BYTES `text`, binary extension).
pub(crate) fn guest_body(text: &str) -> Body {
    let mut raw = Vec::new();
    push_bytes_element(&mut raw, text.as_bytes());
    binary_body(&[("text", "BYTES", raw)], 1)
}

/// A request in the binary tensor extension: `inputs` (name, datatype, raw bytes), each of
/// shape `[1]` when `row` is 1, else `[1, row]`; the `embedding` output asked for in binary.
pub(crate) fn binary_body(inputs: &[(&str, &str, Vec<u8>)], row: usize) -> Body {
    let shape: Vec<usize> = if row == 1 { vec![1] } else { vec![1, row] };
    let header = serde_json::json!({
        "inputs": inputs.iter().map(|(name, dt, raw)| serde_json::json!({
            "name": name, "shape": shape, "datatype": dt,
            "parameters": {"binary_data_size": raw.len()},
        })).collect::<Vec<_>>(),
        "outputs": [{"name": "embedding", "parameters": {"binary_data": true}}],
    });
    let mut body = serde_json::to_vec(&header).unwrap();
    let n = body.len();
    for (_, _, raw) in inputs {
        body.extend_from_slice(raw);
    }
    (body, n)
}

/// `clients` clients, `per_client` requests each, client `c`'s `i`-th request being
/// `bodies[(c * 37 + i) % len]`: (sentences per second, sorted latencies).
pub(crate) async fn load(
    http: &reqwest::Client,
    port: u16,
    model: &str,
    bodies: &Arc<Vec<Body>>,
    clients: usize,
    per_client: usize,
) -> (f64, Vec<Duration>) {
    let url = format!("http://127.0.0.1:{port}/v2/models/{model}/infer");
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (http, url, bodies) = (http.clone(), url.clone(), Arc::clone(bodies));
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(per_client);
            for i in 0..per_client {
                let (body, n) = &bodies[(c * 37 + i) % bodies.len()];
                let t = Instant::now();
                let r = http
                    .post(&url)
                    .header("Inference-Header-Content-Length", *n)
                    .header("Content-Type", "application/octet-stream")
                    .body(body.clone())
                    .send()
                    .await
                    .expect("send");
                assert_eq!(r.status(), 200);
                let b = r.bytes().await.expect("body");
                lat.push(t.elapsed());
                assert!(b.len() >= 384 * 4);
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let secs = start.elapsed().as_secs_f64();
    all.sort();
    ((clients * per_client) as f64 / secs, all)
}

/// (inference count, execution count, summed infer ns, requests) of the served model, from the
/// statistics extension.
async fn batches(http: &reqwest::Client, port: u16) -> (u64, u64, u64, u64) {
    let body = http
        .get(format!("http://127.0.0.1:{port}/v2/models/minilm/stats"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let s = &v["model_stats"][0];
    (
        s["inference_count"].as_u64().unwrap(),
        s["execution_count"].as_u64().unwrap(),
        s["inference_stats"]["compute_infer"]["ns"]
            .as_u64()
            .unwrap(),
        s["inference_stats"]["compute_infer"]["count"]
            .as_u64()
            .unwrap(),
    )
}

pub fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let texts = Arc::new(sentences());
        // One request per sentence (BYTES `text`, binary extension), made before the clients run.
        let bodies: Arc<Vec<Body>> = Arc::new(texts.iter().map(|t| guest_body(t)).collect());
        // In process: the same component, instantiated directly.
        let device = tpubox_core::open_device(&tpubox_core::DeviceConfig::default()).expect("open the device");
        let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
        let weights = Arc::new(WeightRegistry::new());
        weights
            .load_safetensors(&device, "minilm", &model_dir().join("model.safetensors"), 0)
            .unwrap();
        let comp = sandbox.load_component(&component()).unwrap();
        let opts = RunOptions {
            dirs: vec![(model_dir(), "/model".into())],
            ..RunOptions::default()
        };
        let mut inst = Instance::new(&sandbox, &device, &weights, &comp, "minilm", &opts)
            .await
            .unwrap();
        for b in 1..=16 {
            let chunk: Vec<&str> = texts.iter().take(b).map(String::as_str).collect();
            inst.infer(vec![text_tensor(&chunk)]).await.unwrap();
        }
        let ip1 = in_process(&mut inst, &texts, 1).await;
        let ip16 = in_process(&mut inst, &texts, 16).await;
        println!("in process: {:.1} ms per batch of 16", 16e3 / ip16);
        drop(inst);
        drop(device);

        // reqwest is built without a TLS provider of its own (see the root Cargo.toml); plain
        // HTTP still wants one installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()
            .unwrap();
        println!("MiniLM all-MiniLM-L6-v2, one sentence per request, REST + binary extension");
        println!("in process (no server): batch 1 {ip1:.1} sentences/s, batch 16 {ip16:.1} sentences/s\n");
        println!("| dynamic batching | clients | mean batch | infer ms per batch | sentences/s | p50 ms | p99 ms | ÷ in-process batch 1 | ÷ in-process batch 16 |");
        println!("|---|---|---|---|---|---|---|---|---|");
        let phases: &[bool] = if std::env::var_os("TPUBOX_BENCH_ONLY_BATCHING").is_some() {
            &[true]
        } else {
            &[true, false]
        };
        for &batching in phases {
            let served = serve(batching, &http).await;
            // Warm: every batch size the batcher may form has compiled.
            for (clients, n) in [(1, 4), (4, 4), (16, 8)] {
                load(&http, served.port, "minilm", &bodies, clients, n).await;
            }
            for clients in [1usize, 4, 16] {
                let before = batches(&http, served.port).await;
                let (tput, lat) =
                    load(&http, served.port, "minilm", &bodies, clients, PER_CLIENT).await;
                let after = batches(&http, served.port).await;
                let mean_batch = (after.0 - before.0) as f64 / (after.1 - before.1).max(1) as f64;
                // Each request counts its batch's infer time once.
                let infer_ms =
                    (after.2 - before.2) as f64 / 1e6 / (after.3 - before.3).max(1) as f64;
                println!(
                    "| {} | {clients} | {mean_batch:.1} | {infer_ms:.1} | {tput:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
                    if batching { "on" } else { "off" },
                    percentile(&lat, 0.5).as_secs_f64() * 1e3,
                    percentile(&lat, 0.99).as_secs_f64() * 1e3,
                    tput / ip1,
                    tput / ip16,
                );
            }
        }
    });
}
