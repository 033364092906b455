//! An exported MiniLM served natively vs the hand-written MiniLM guest, in one `tpubox serve`.
//!
//! Two models in one repository, both all-MiniLM-L6-v2 on the same device-resident weights (the
//! weight set `minilm`, loaded once from the file `tpubox setup minilm` installed):
//!
//! * `minilm`: the guest `examples/minilm-serve` (tokenizer and the SDK-built encoder in the
//!   sandbox), with the example's config (dynamic batching, 2 ms queue delay, preferred batch
//!   sizes 16 and 32). It takes the sentences as text.
//! * `exported`: the same encoder written in JAX (`host/benches/minilm_export.py`), exported with
//!   `tpubox.jax.export_model` as a StableHLO model, one program per batch size of the guest's
//!   batch buckets (1, 8, 32) at the guest's 16-token sequence bucket, with the same dynamic
//!   batching; its weights are the same file under the same set name. It takes `input_ids` and
//!   `attention_mask` (INT32, 16 per row), made by the bench with the model's tokenizer
//!   (`minilm_embed::SentenceTokenizer`, the guest's own code).
//!
//! The sentences are those of the `serve` bench that tokenize to 9-16 tokens, so that every
//! batch the guest runs is in its (batch, 16) bucket like the exported model's, and the guest's
//! packing never applies (a packed call is 16 rows of 128 tokens; the guest packs only where
//! that computes fewer tokens than the buckets, and a batch of at most 64 sentences of at most
//! 16 tokens costs at most 1,024 bucketed tokens). The guest's tenant's compile count, from the
//! metrics, shows which programs it built.
//!
//! First the embeddings are compared (max |difference| per element): the guest, the exported
//! model served, and JAX itself on the same ids. Then both models are driven by 16 concurrent
//! clients (tokio tasks over keep-alive HTTP connections, the binary tensor extension, one
//! sentence per request, back to back, the same sentence sequence for both), in rounds that
//! alternate which model goes first; sentences/s per phase, the median over rounds and the
//! ratio, and from the statistics extension the inferences (batch items) and executions (model
//! calls) of each phase, so mean batch and infer time per batch place a difference inside or
//! outside the model call.
//!
//! The export runs the Python of `TPUBOX_JAX_PYTHON` (default `$CACHE/venv-python/bin/python`,
//! which `bash scripts/dev.sh setup` creates with the pinned jax) with this checkout's `python/`
//! on `PYTHONPATH`. Run with `cargo bench -p tpubox --bench all -- exported` after set-up;
//! `TPUBOX_BENCH_ROUNDS` and `TPUBOX_BENCH_PER_CLIENT` change the rounds (5) and the requests
//! per client per phase (96).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use minilm_embed::SentenceTokenizer;

use crate::serve::{
    Body, Served, binary_body, component, free_port, guest_body, load, model_dir, percentile,
    sentences,
};

/// The sequence bucket both models run (the guest's for 9-16 tokens).
const SEQ: usize = 16;
/// The guest's batch buckets (`minilm_embed::BATCH_BUCKETS`): one exported program each.
const BATCH_SIZES: [usize; 3] = minilm_embed::BATCH_BUCKETS;
/// Concurrent clients.
const CLIENTS: usize = 16;
/// Sentences compared in the numerical check.
const CHECK: usize = 8;
/// The guest model's name.
const GUEST: &str = "minilm";
/// The exported model's name.
const EXPORTED: &str = "exported";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn cache_dir() -> PathBuf {
    std::env::var_os("TPUBOX_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| dirs::home_dir().unwrap().join(".cache/tpubox"))
}

/// The Python with jax and this checkout's `tpubox` package.
fn jax_python() -> PathBuf {
    let p = std::env::var_os("TPUBOX_JAX_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("venv-python/bin/python"));
    assert!(
        p.exists(),
        "{} is missing: `bash scripts/dev.sh setup` creates it (or set TPUBOX_JAX_PYTHON)",
        p.display()
    );
    p
}

/// Row-major `input_ids` and `attention_mask` for `ids`, each row padded to [`SEQ`].
fn padded(ids: &[&Vec<i32>]) -> (Vec<i32>, Vec<i32>) {
    let mut tok = vec![0i32; ids.len() * SEQ];
    let mut mask = vec![0i32; ids.len() * SEQ];
    for (r, t) in ids.iter().enumerate() {
        tok[r * SEQ..r * SEQ + t.len()].copy_from_slice(t);
        mask[r * SEQ..r * SEQ + t.len()].fill(1);
    }
    (tok, mask)
}

fn le_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Exports the JAX MiniLM into `repo/exported` and returns JAX's own embeddings of `check`.
fn export(repo: &std::path::Path, check: &[&Vec<i32>]) -> Vec<f32> {
    let work = repo.parent().unwrap();
    let ids_json = work.join("check_ids.json");
    std::fs::write(&ids_json, serde_json::to_vec(check).unwrap()).unwrap();
    let reference = work.join("reference.f32");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let batch_sizes = BATCH_SIZES.map(|b| b.to_string()).join(",");
    let t = Instant::now();
    let out = std::process::Command::new(jax_python())
        .arg(root.join("host/benches/minilm_export.py"))
        .arg(model_dir())
        .arg(repo)
        .arg(EXPORTED)
        .args(["--seq", &SEQ.to_string(), "--batch-sizes", &batch_sizes])
        .args([
            "--weight-set",
            "minilm",
            "--delay-us",
            "2000",
            "--preferred",
            "16,32",
        ])
        .arg("--reference")
        .arg(&ids_json)
        .arg(&reference)
        .env("PYTHONPATH", root.join("python"))
        .env("JAX_PLATFORMS", "cpu")
        .output()
        .expect("run minilm_export.py");
    assert!(
        out.status.success(),
        "minilm_export.py failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "export (JAX, {} programs): {:.1} s: {}",
        BATCH_SIZES.len(),
        t.elapsed().as_secs_f64(),
        String::from_utf8_lossy(&out.stdout).trim()
    );
    std::fs::read(&reference)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The guest model's directory in `repo`, configured as `examples/minilm-serve/config.toml`.
fn guest_model(repo: &std::path::Path) {
    let m = repo.join(GUEST);
    std::fs::create_dir_all(&m).unwrap();
    std::os::unix::fs::symlink(model_dir(), m.join("files")).unwrap();
    std::fs::copy(component(), m.join("model.wasm")).unwrap();
    std::fs::write(
        m.join("config.toml"),
        "max_batch_size = 64\n[[instance_group]]\ncount = 1\n\
         [dynamic_batching]\npreferred_batch_size = [16, 32]\nmax_queue_delay_microseconds = 2000\n\
         [tpubox]\nfiles = \"files\"\n[tpubox.weights]\nminilm = \"files/model.safetensors\"\n",
    )
    .unwrap();
}

/// Starts `tpubox serve` on the repository in `dir` and waits until both models are ready.
async fn start(dir: tempfile::TempDir, http: &reqwest::Client) -> (Served, u16) {
    let port = free_port();
    let metrics = free_port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_tpubox"))
        .args(["serve", "--model-repository"])
        .arg(dir.path().join("repo"))
        .args(["--http-port", &port.to_string()])
        .args(["--grpc-port", &free_port().to_string()])
        .args(["--metrics-port", &metrics.to_string()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start tpubox serve");
    let served = Served {
        child,
        port,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    for model in [GUEST, EXPORTED] {
        let url = format!("http://127.0.0.1:{port}/v2/models/{model}/ready");
        loop {
            if let Ok(r) = http.get(&url).send().await
                && r.status() == 200
            {
                break;
            }
            assert!(Instant::now() < deadline, "model {model} not ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    (served, metrics)
}

/// One inference with JSON outputs: the `embedding` output's values.
async fn infer_json(
    http: &reqwest::Client,
    port: u16,
    model: &str,
    inputs: serde_json::Value,
) -> Vec<f32> {
    let r = http
        .post(format!("http://127.0.0.1:{port}/v2/models/{model}/infer"))
        .header("Content-Type", "application/json")
        .body(serde_json::to_vec(&serde_json::json!({ "inputs": inputs })).unwrap())
        .send()
        .await
        .expect("send");
    let status = r.status();
    let body: serde_json::Value =
        serde_json::from_slice(&r.bytes().await.expect("an answer")).expect("a JSON answer");
    assert_eq!(status, 200, "{model}: {body}");
    body["outputs"][0]["data"]
        .as_array()
        .expect("embedding data")
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The exported model's request for one sentence's ids (INT32 `input_ids`, `attention_mask`).
fn exported_body(ids: &Vec<i32>) -> Body {
    let (tok, mask) = padded(&[ids]);
    binary_body(
        &[
            ("input_ids", "INT32", le_bytes(&tok)),
            ("attention_mask", "INT32", le_bytes(&mask)),
        ],
        SEQ,
    )
}

/// A model's counters from the statistics extension.
#[derive(Clone, Copy, Default)]
struct Stats {
    /// Batch items (sentences).
    inferences: u64,
    /// Model calls (merged batches).
    executions: u64,
    /// Summed compute (infer) time of the successful requests, ns; each request counts its
    /// batch's time once.
    compute_ns: u64,
    /// Successful requests counted in `compute_ns`.
    requests: u64,
}

impl std::ops::Sub for Stats {
    type Output = Stats;
    fn sub(self, o: Stats) -> Stats {
        Stats {
            inferences: self.inferences - o.inferences,
            executions: self.executions - o.executions,
            compute_ns: self.compute_ns - o.compute_ns,
            requests: self.requests - o.requests,
        }
    }
}

async fn stats(http: &reqwest::Client, port: u16, model: &str) -> Stats {
    let body = http
        .get(format!("http://127.0.0.1:{port}/v2/models/{model}/stats"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let s = &v["model_stats"][0];
    let c = &s["inference_stats"]["compute_infer"];
    Stats {
        inferences: s["inference_count"].as_u64().unwrap(),
        executions: s["execution_count"].as_u64().unwrap(),
        compute_ns: c["ns"].as_u64().unwrap(),
        requests: c["count"].as_u64().unwrap(),
    }
}

/// `tpubox_tenant_{compiles,executions}_total` of the model's tenant, from `/metrics` (a load
/// makes a new tenant, so they count from the model's last load).
async fn tenant_counters(http: &reqwest::Client, metrics: u16, model: &str) -> (f64, f64) {
    let text = http
        .get(format!("http://127.0.0.1:{metrics}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let get = |name: &str| {
        let prefix = format!("{name}{{tenant=\"model:{model}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    (
        get("tpubox_tenant_compiles_total"),
        get("tpubox_tenant_executions_total"),
    )
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// One phase's measurements.
struct Phase {
    tput: f64,
    lat: Vec<Duration>,
    delta: Stats,
}

/// The prepared requests of both models.
struct Bodies {
    guest: Arc<Vec<Body>>,
    exported: Arc<Vec<Body>>,
}

impl Bodies {
    fn of(&self, model: &str) -> &Arc<Vec<Body>> {
        if model == GUEST {
            &self.guest
        } else {
            &self.exported
        }
    }
}

/// Sets the dynamic batching of `model`'s config in `repo`.
fn set_batching(repo: &std::path::Path, model: &str, delay_us: u64, preferred: &str) {
    let path = repo.join(model).join("config.toml");
    let config: String = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| {
            if l.starts_with("max_queue_delay_microseconds") {
                format!("max_queue_delay_microseconds = {delay_us}\n")
            } else if l.starts_with("preferred_batch_size") {
                format!("preferred_batch_size = {preferred}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(&path, config).unwrap();
}

/// Loads `model` again (repository API) and waits until it is ready.
async fn reload(http: &reqwest::Client, port: u16, model: &str) {
    let r = http
        .post(format!(
            "http://127.0.0.1:{port}/v2/repository/models/{model}/load"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "reload of {model}");
}

/// `rounds` rounds of both models under [`CLIENTS`] clients, alternating which goes first;
/// prints each phase, then the summary table and the ratio.
async fn measure(
    http: &reqwest::Client,
    port: u16,
    metrics: u16,
    b: &Bodies,
    rounds: usize,
    per_client: usize,
) {
    let mut phases: [Vec<Phase>; 2] = [Vec::new(), Vec::new()];
    println!();
    println!("| round | model | sentences/s | mean batch | infer ms per batch | p50 ms | p99 ms |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for r in 0..rounds {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            let model = [GUEST, EXPORTED][k];
            let before = stats(http, port, model).await;
            let (tput, lat) = load(http, port, model, b.of(model), CLIENTS, per_client).await;
            let delta = stats(http, port, model).await - before;
            let p = Phase { tput, lat, delta };
            println!(
                "| {} | {model} | {tput:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
                r + 1,
                p.delta.inferences as f64 / p.delta.executions.max(1) as f64,
                p.delta.compute_ns as f64 / 1e6 / p.delta.requests.max(1) as f64,
                percentile(&p.lat, 0.5).as_secs_f64() * 1e3,
                percentile(&p.lat, 0.99).as_secs_f64() * 1e3,
            );
            phases[k].push(p);
        }
    }

    println!();
    println!(
        "| model | sentences/s (median of {rounds}) | range | inferences | executions | mean batch | infer ms per batch | p50 ms | p99 ms | tenant compiles (since the model loaded) | tenant device executions (since the model loaded) |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut medians = [0.0; 2];
    for (k, model) in [GUEST, EXPORTED].into_iter().enumerate() {
        let ps = &phases[k];
        let tputs: Vec<f64> = ps.iter().map(|p| p.tput).collect();
        medians[k] = median(&tputs);
        let sum = ps.iter().fold(Stats::default(), |a, p| Stats {
            inferences: a.inferences + p.delta.inferences,
            executions: a.executions + p.delta.executions,
            compute_ns: a.compute_ns + p.delta.compute_ns,
            requests: a.requests + p.delta.requests,
        });
        let mut lat: Vec<Duration> = ps.iter().flat_map(|p| p.lat.iter().copied()).collect();
        lat.sort();
        let (compiles, executions) = tenant_counters(http, metrics, model).await;
        println!(
            "| {model} | {:.1} | {:.1}-{:.1} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {compiles} | {executions} |",
            medians[k],
            tputs.iter().copied().fold(f64::INFINITY, f64::min),
            tputs.iter().copied().fold(0.0, f64::max),
            sum.inferences,
            sum.executions,
            sum.inferences as f64 / sum.executions.max(1) as f64,
            sum.compute_ns as f64 / 1e6 / sum.requests.max(1) as f64,
            percentile(&lat, 0.5).as_secs_f64() * 1e3,
            percentile(&lat, 0.99).as_secs_f64() * 1e3,
        );
    }
    let per_round: Vec<f64> = phases[1]
        .iter()
        .zip(&phases[0])
        .map(|(e, g)| e.tput / g.tput)
        .collect();
    println!();
    println!(
        "exported / guest: {:.2}× (medians); per round {} (median {:.2}×)",
        medians[1] / medians[0],
        per_round
            .iter()
            .map(|r| format!("{r:.2}×"))
            .collect::<Vec<_>>()
            .join(", "),
        median(&per_round)
    );
}

pub fn main() {
    let rounds = env_usize("TPUBOX_BENCH_ROUNDS", 4).max(1);
    let per_client = env_usize("TPUBOX_BENCH_PER_CLIENT", 64).max(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let tokenizer = SentenceTokenizer::from_file(&model_dir().join("tokenizer.json"))
            .expect("the MiniLM tokenizer");
        // Sentences of 9-16 tokens: the guest's sequence bucket is then 16 for every batch.
        let (texts, ids): (Vec<String>, Vec<Vec<i32>>) = sentences()
            .into_iter()
            .map(|t| {
                let ids = tokenizer.encode(&t).unwrap();
                (t, ids)
            })
            .filter(|(_, ids)| minilm_embed::seq_bucket(ids.len()).unwrap() == SEQ)
            .unzip();
        assert!(texts.len() >= 32, "too few sentences of 9-16 tokens");
        let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
        println!(
            "MiniLM all-MiniLM-L6-v2: exported (JAX → StableHLO, served natively) vs the guest (examples/minilm-serve)"
        );
        println!(
            "{} sentences of {}-{} tokens (mean {:.1}); sequence bucket {SEQ}, batch sizes {BATCH_SIZES:?}; {CLIENTS} clients × {per_client} requests per phase, {rounds} rounds",
            texts.len(),
            lengths.iter().min().unwrap(),
            lengths.iter().max().unwrap(),
            lengths.iter().sum::<usize>() as f64 / lengths.len() as f64
        );
        // What the guest does per sentence that the exported model's client did instead.
        let t = Instant::now();
        for t in &texts {
            std::hint::black_box(tokenizer.encode(t).unwrap());
        }
        println!(
            "tokenizing natively (the guest tokenizes in the sandbox, the exported model's client before sending): {:.1} µs per sentence",
            t.elapsed().as_secs_f64() * 1e6 / texts.len() as f64
        );

        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        std::fs::create_dir(&repo).unwrap();
        let check: Vec<&Vec<i32>> = ids.iter().take(CHECK).collect();
        let reference = export(&repo, &check);
        guest_model(&repo);

        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()
            .unwrap();
        let t = Instant::now();
        let (served, metrics) = start(dir, &http).await;
        let port = served.port;
        println!(
            "tpubox serve ready in {:.1} s (the exported model's {} programs compiled at load)",
            t.elapsed().as_secs_f64(),
            BATCH_SIZES.len()
        );

        // The embeddings, compared: the same sentences as text to the guest, as ids to the
        // exported model, and JAX's own on the same ids.
        let texts_check: Vec<&str> = texts.iter().take(CHECK).map(String::as_str).collect();
        let guest = infer_json(
            &http,
            port,
            GUEST,
            serde_json::json!([{"name": "text", "shape": [CHECK], "datatype": "BYTES",
                                "data": texts_check}]),
        )
        .await;
        let (tok, mask) = padded(&check);
        let exported = infer_json(
            &http,
            port,
            EXPORTED,
            serde_json::json!([
                {"name": "input_ids", "shape": [CHECK, SEQ], "datatype": "INT32", "data": tok},
                {"name": "attention_mask", "shape": [CHECK, SEQ], "datatype": "INT32", "data": mask},
            ]),
        )
        .await;
        let (ge, gj, ej) = (
            max_abs_diff(&guest, &exported),
            max_abs_diff(&guest, &reference),
            max_abs_diff(&exported, &reference),
        );
        println!(
            "embeddings of {CHECK} sentences, max |difference| per element: guest vs exported {ge:.3e}, guest vs JAX {gj:.3e}, exported vs JAX {ej:.3e}"
        );
        assert!(
            ge < 1e-4 && gj < 1e-4 && ej < 1e-4,
            "the exported model's embeddings are not the guest's"
        );

        let guest_bodies: Arc<Vec<Body>> = Arc::new(texts.iter().map(|t| guest_body(t)).collect());
        let exported_bodies: Arc<Vec<Body>> = Arc::new(ids.iter().map(exported_body).collect());
        // Warm: every batch size the batcher may form has run (the guest compiles its buckets
        // on first use).
        for (model, bodies) in [(GUEST, &guest_bodies), (EXPORTED, &exported_bodies)] {
            for (clients, n) in [(1, 4), (4, 4), (16, 8)] {
                load(&http, port, model, bodies, clients, n).await;
            }
        }

        let b = Bodies {
            guest: guest_bodies,
            exported: exported_bodies,
        };
        println!();
        println!(
            "### batching as the guest example configures it: queue delay 2 ms, preferred batch sizes 16 and 32"
        );
        measure(&http, port, metrics, &b, rounds, per_client).await;

        // The same with every batch full: each model waits (up to 10 s) until all 16 clients'
        // requests are queued, so both run every batch at 16 rows, in the 32-row bucket.
        for model in [GUEST, EXPORTED] {
            set_batching(&repo, model, 10_000_000, "[16]");
            reload(&http, port, model).await;
            load(&http, port, model, b.of(model), CLIENTS, 4).await;
        }
        println!();
        println!(
            "### full batches: preferred batch size 16, queue delay up to 10 s (every batch holds all 16 clients' requests)"
        );
        measure(&http, port, metrics, &b, rounds, per_client).await;
        drop(served);
    });
}
