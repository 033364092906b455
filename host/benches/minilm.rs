//! MiniLM benchmark: sentence embeddings from the guest vs the host running the same executables
//! natively (no Wasm), measured side by side in one run.
//!
//! Both sides tokenize with the model's `tokenizer.json`, split the fixed 256-sentence set with
//! the same bucket plan (batch 32, sequence buckets 16…256), build the same MLIR with
//! `minilm_embed::build_encoder_mlir`, and use the same device-resident weights. The two sides
//! alternate, round by round, so both see the same machine: each round times one native pass
//! and one guest pass (the guest's second pass over the set; its first compiles every bucket).
//! The table gives medians over the rounds. Time to first embedding is a fresh run on one
//! sentence (tokenizer load, compile, execute).
//!
//! Run with `cargo bench -p tpubox-host --bench minilm` after `bash scripts/dev.sh setup`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use minilm_embed::{
    EncoderInput, SentenceTokenizer, build_encoder_mlir, encoder_inputs, pack, plan,
};
use tpubox::device::{Arg, DeviceExecutable, DeviceTensor};
use tpubox::{Host, HostConfig, PrimitiveType, RunOptions, SandboxConfig};

const SENTENCES: usize = 256;
const ROUNDS: usize = 5;

/// 256 sentences of mixed lengths, built deterministically from a few templates.
fn sentence_set() -> Vec<String> {
    let subjects = [
        "The host",
        "A guest",
        "Every tenant",
        "The compiler",
        "This TPU chip",
        "A notebook user",
        "The sampler",
        "One trainer",
    ];
    let verbs = [
        "compiles",
        "executes",
        "shares",
        "caches",
        "streams",
        "validates",
        "schedules",
        "embeds",
    ];
    let objects = [
        "a program",
        "the weights of a small sentence encoder",
        "one device among many sandboxed WebAssembly guests without copying tensors through guest memory",
        "StableHLO modules",
        "every batch of sentences padded to fixed sequence-length buckets so that each bucket compiles once and padding never leaks into the pooled embedding of any sentence in the batch",
        "results",
        "tokens",
        "a cache entry keyed by the program, the options and the plugin",
    ];
    (0..SENTENCES)
        .map(|i| {
            format!(
                "{} {} {}.",
                subjects[i % 8],
                verbs[(i / 8) % 8],
                objects[(i / 64 + i) % 8]
            )
        })
        .collect()
}

fn model_dir() -> PathBuf {
    tpubox::plugin::known("minilm")
        .and_then(|p| p.installed_library())
        .expect("run `tpubox setup minilm` first")
}

struct Native {
    weights: Vec<Arc<DeviceTensor>>,
    compiled: HashMap<(usize, usize), Arc<DeviceExecutable>>,
}

impl Native {
    async fn embed(&mut self, host: &Host, ids: &[Vec<i32>]) -> Vec<Vec<f32>> {
        let dev = host.device();
        let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
        let mut out = vec![Vec::new(); ids.len()];
        for chunk in plan(&lengths).unwrap() {
            let key = (chunk.batch, chunk.seq);
            if let std::collections::hash_map::Entry::Vacant(slot) = self.compiled.entry(key) {
                let mlir = build_encoder_mlir(chunk.batch as u64, chunk.seq as u64).unwrap();
                slot.insert(dev.compile(mlir.into_bytes(), true, 0).await.unwrap());
            }
            let exe = &self.compiled[&key];
            let (input_ids, mask) = pack(&chunk, ids).unwrap();
            let dims = [chunk.batch as i64, chunk.seq as i64];
            let to_bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            let ids_t = dev
                .tensor_from_bytes(PrimitiveType::S32, &dims, &to_bytes(&input_ids), 0)
                .unwrap();
            let mask_t = dev
                .tensor_from_bytes(PrimitiveType::S32, &dims, &to_bytes(&mask), 0)
                .unwrap();
            let mut args: Vec<Arg<'_>> = self
                .weights
                .iter()
                .map(|t| Arg {
                    tensor: t,
                    donate: false,
                })
                .collect();
            args.push(Arg {
                tensor: &ids_t,
                donate: false,
            });
            args.push(Arg {
                tensor: &mask_t,
                donate: false,
            });
            let result = dev.execute(exe, &args).await.unwrap();
            let bytes = dev.read(&result[0]).await.unwrap();
            let emb: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            for (row, &i) in chunk.indices.iter().enumerate() {
                out[i] = emb[row * 384..(row + 1) * 384].to_vec();
            }
        }
        out
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = model_dir();
        let config = HostConfig {
            sandbox: SandboxConfig { cache_dir: None, ..SandboxConfig::default() },
            ..HostConfig::default()
        };
        let host = Host::new(config).unwrap();
        host.load_weights("minilm", &dir.join("model.safetensors")).unwrap();
        let set = host.weights().get("minilm").unwrap();
        let weights: Vec<Arc<DeviceTensor>> = encoder_inputs()
            .into_iter()
            .filter_map(|i| match i {
                EncoderInput::Weight(w) => Some(Arc::clone(set.get(&w.name).unwrap())),
                _ => None,
            })
            .collect();
        let sentences = sentence_set();

        // Native: time to first embedding (tokenizer load + compile + run on one sentence).
        let t = Instant::now();
        let tok = SentenceTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        let first_ids = vec![tok.encode(&sentences[0]).unwrap()];
        let mut native = Native { weights: weights.clone(), compiled: HashMap::new() };
        let first_native = native.embed(&host, &first_ids).await;
        let native_first_ms = t.elapsed().as_secs_f64() * 1e3;

        // Native throughput.
        let ids: Vec<Vec<i32>> = sentences.iter().map(|s| tok.encode(s).unwrap()).collect();
        let mut native = Native { weights, compiled: HashMap::new() };
        let native_ref = native.embed(&host, &ids).await; // warm-up: compiles every bucket
        // Guest.
        let wasm = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/wasm32-wasip2/release/minilm-embed.wasm");
        let component = host.load_component(&wasm).unwrap();
        let run = |args: Vec<String>, stdin: Vec<u8>| {
            let opts = RunOptions {
                args,
                dirs: vec![(dir.clone(), "/model".into())],
                stdin: Some(stdin),
                capture_output: true,
                ..RunOptions::default()
            };
            let host = &host;
            let component = &component;
            async move { host.run(component, "minilm-embed", &opts).await.unwrap() }
        };
        let o = run(vec!["--json".into(), sentences[0].clone()], Vec::new()).await;
        assert!(o.success, "{}", String::from_utf8_lossy(&o.stderr));
        let guest_first_ms = o.elapsed.as_secs_f64() * 1e3;
        let first_guest: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
        let g0: Vec<f32> = first_guest[0]["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let same_first = minilm_embed::cosine(&g0, &first_native[0]);

        let stdin = sentences.join("\n").into_bytes();
        let mut native_s = Vec::new();
        let mut guest_s = Vec::new();
        let mut guest_out: Vec<serde_json::Value> = Vec::new();
        for _ in 0..ROUNDS {
            let t = Instant::now();
            let _ = native.embed(&host, &ids).await;
            native_s.push(t.elapsed().as_secs_f64());
            let o = run(vec!["--json".into(), "--repeat".into(), "1".into()], stdin.clone()).await;
            assert!(o.success, "{}", String::from_utf8_lossy(&o.stderr));
            let err = String::from_utf8_lossy(&o.stderr);
            let pass1 = err
                .lines()
                .find_map(|l| l.strip_prefix("pass 1: "))
                .expect("the guest reports its second pass");
            guest_s.push(pass1.split(' ').next().unwrap().parse::<f64>().unwrap() / 1e3);
            guest_out = serde_json::from_slice(&o.stdout).unwrap();
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v[v.len() / 2]
        };
        let (native_med, guest_med) = (median(native_s), median(guest_s));
        let min_cos = guest_out
            .iter()
            .zip(&native_ref)
            .map(|(g, n)| {
                let g: Vec<f32> = g["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
                minilm_embed::cosine(&g, n)
            })
            .fold(f32::MAX, f32::min);

        let native_rate = SENTENCES as f64 / native_med;
        let guest_rate = SENTENCES as f64 / guest_med;
        let p = host.device().platform();
        println!("tpubox MiniLM benchmark — {} {} (PJRT C API {}.{})", p.name, p.version, p.pjrt_api_version.0, p.pjrt_api_version.1);
        println!("{SENTENCES} sentences, batch 32, seq buckets 16..256; median of {ROUNDS} alternating rounds");
        println!("guest vs native agreement: min cosine {min_cos:.7} (256 sentences), {same_first:.7} (first sentence)");
        println!();
        println!("| measure | native host | guest | guest / native |");
        println!("|---|---|---|---|");
        println!("| embeddings per second | {native_rate:.1} | {guest_rate:.1} | {:.3} |", guest_rate / native_rate);
        println!("| time to first embedding | {native_first_ms:.0} ms | {guest_first_ms:.0} ms | {:.2} |", guest_first_ms / native_first_ms);
    });
}
