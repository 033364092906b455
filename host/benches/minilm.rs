//! MiniLM benchmark: sentence embeddings from the guest vs the host running the same executables
//! natively (no Wasm), measured side by side in one run.
//!
//! Both sides tokenize with the model's `tokenizer.json`, split 1,024 sentences of realistic
//! lengths (`minilm_embed::corpus`) with the same bucket plan (`minilm_embed::plan`), build the
//! same MLIR with
//! `minilm_embed::build_encoder_mlir`, and use the same device-resident weights. The two sides
//! alternate, round by round, so both see the same machine: each round times one native pass
//! and one guest pass (the guest's second pass over the set; its first compiles every bucket).
//! When the benchmark venv is there, each round also runs one pass of each anchor
//! (sentence-transformers on PyTorch, ONNX Runtime: `minilm_anchors.py --interleave`, a child
//! process kept warm between rounds), so all five systems see the same machine round by round;
//! the per-round ratios show how much it moved, and their median is printed with them. The table
//! gives medians over the rounds. Time to first embedding is a fresh run on one sentence
//! (tokenizer load, compile, execute).
//!
//! Run with `cargo bench -p tpubox --bench all -- minilm` after `bash scripts/dev.sh setup`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use minilm_embed::{
    EncoderInput, SentenceTokenizer, build_encoder_mlir, encoder_inputs, pack, plan,
};
use tpubox_core::PrimitiveType;
use tpubox_core::device::{Arg, DeviceExecutable, DeviceTensor};
use tpubox_wasm::{Host, HostConfig, RunOptions, SandboxConfig};

const SENTENCES: usize = 1024;
/// Rounds of the side-by-side comparison. On a shared 2-core VM the load moves by more than the
/// differences measured here within one round, so the table's medians need more than a handful.
const ROUNDS: usize = 9;

/// 1,024 sentences with realistic lengths (`minilm_embed::corpus`: log-normal word counts,
/// median 13 words).
fn sentence_set() -> Vec<String> {
    minilm_embed::realistic_sentences(SENTENCES, 1)
}

/// Matmul floating-point operations of the encoder for one row of `seq` tokens: per layer and
/// token, Q/K/V and output projections (4 × 2·384·384), the feed-forward pair (2 × 2·384·1536)
/// and attention scores and values (2 × 2·seq·384); 6 layers.
fn flop_per_row(seq: usize) -> f64 {
    let per_token =
        4.0 * 2.0 * 384.0 * 384.0 + 2.0 * 2.0 * 384.0 * 1536.0 + 4.0 * seq as f64 * 384.0;
    6.0 * per_token * seq as f64
}

/// What a plan's calls `(batch, seq)` cost: padded tokens, distinct (batch, seq) programs, executed
/// matmul FLOPs.
fn plan_cost(chunks: &[(usize, usize)]) -> (usize, usize, f64) {
    let programs: std::collections::BTreeSet<(usize, usize)> = chunks.iter().copied().collect();
    let padded = chunks.iter().map(|(b, s)| b * s).sum();
    let flop = chunks
        .iter()
        .map(|&(b, s)| b as f64 * flop_per_row(s))
        .sum();
    (padded, programs.len(), flop)
}

/// The plan before finer buckets (sequence buckets 16, 32, 64, 128, 256; batch 32), for the
/// table's comparison row.
fn power_of_two_plan(lengths: &[usize]) -> Vec<(usize, usize)> {
    let mut sorted = lengths.to_vec();
    sorted.sort();
    sorted
        .chunks(32)
        .map(|c| {
            let longest = *c.iter().max().unwrap();
            let seq = [16, 32, 64, 128, 256]
                .into_iter()
                .find(|&b| b >= longest)
                .unwrap();
            let batch = [1, 8, 32].into_iter().find(|&b| b >= c.len()).unwrap();
            (batch, seq)
        })
        .collect()
}

/// The machine's f32 peak: cores × clock (`cpu MHz` of /proc/cpuinfo) × FLOP per cycle: 64 with
/// AVX-512 (two 16-lane fused multiply-adds per cycle, as Xeon Gold and later have; one unit
/// would give 32, and this machine's measured rate exceeds that bound), 32 with AVX2.
fn peak_gflops() -> (f64, String) {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mhz = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .unwrap_or(2000.0);
    let avx512 = std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|t| t.contains(" avx512f"));
    let per_cycle = if avx512 { 64.0 } else { 32.0 };
    let peak = cores as f64 * mhz / 1e3 * per_cycle;
    (
        peak,
        format!(
            "{cores} cores × {:.2} GHz × {per_cycle} FLOP/cycle",
            mhz / 1e3
        ),
    )
}

fn model_dir() -> PathBuf {
    tpubox_core::plugin::known("minilm")
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

/// Rows, row length and most sentences per row of the packed encoder.
const PACK: (usize, usize, usize) = (
    minilm_embed::batching::PACK_ROWS,
    minilm_embed::batching::PACK_LEN,
    minilm_embed::batching::PACK_SEGS,
);

/// The packed path: several sentences per row, one program shape (`PACK`), sentences longer
/// than a row through `Native`.
struct Packed {
    exe: Option<Arc<DeviceExecutable>>,
    calls: usize,
    /// Tokens the last pass computed (packed rows plus the bucketed rest, padding included).
    tokens: usize,
    /// Matmul FLOPs of the last pass, and its distinct programs.
    flop: f64,
    programs: usize,
}

impl Packed {
    async fn embed(&mut self, host: &Host, native: &mut Native, ids: &[Vec<i32>]) -> Vec<Vec<f32>> {
        let (rb, len, segs) = PACK;
        let dev = host.device();
        if self.exe.is_none() {
            // The CPU plugin: segment attention, as the guest picks there.
            let mlir = minilm_embed::build_packed_encoder_mlir(
                rb as u64,
                len as u64,
                segs as u64,
                minilm_embed::PackedAttention::Segments,
            )
            .unwrap();
            self.exe = Some(dev.compile(mlir.into_bytes(), true, 0).await.unwrap());
        }
        let exe = self.exe.clone().unwrap();
        let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
        let (rows, long) = minilm_embed::pack_rows(&lengths, len, segs);
        let mut leftover = Vec::new();
        let mut out = vec![Vec::new(); ids.len()];
        self.calls = 0;
        for call in rows.chunks(rb) {
            // The guest's rule (minilm_embed::embed): packed only where it costs less.
            let members: Vec<usize> = call.iter().flatten().copied().collect();
            let sub: Vec<usize> = members.iter().map(|&i| lengths[i]).collect();
            let bucketed: usize = plan(&sub).unwrap().iter().map(|c| c.batch * c.seq).sum();
            if bucketed < rb * len {
                leftover.extend(members);
                continue;
            }
            self.calls += 1;
            let (tok, pos, _bias, pool) = minilm_embed::pack_packed(call, ids, rb, len, segs);
            let i32s = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            let d2 = [rb as i64, len as i64];
            let t = [
                dev.tensor_from_bytes(PrimitiveType::S32, &d2, &i32s(&tok), 0)
                    .unwrap(),
                dev.tensor_from_bytes(PrimitiveType::S32, &d2, &i32s(&pos), 0)
                    .unwrap(),
                dev.tensor_from_bytes(
                    PrimitiveType::F32,
                    &[rb as i64, segs as i64, len as i64],
                    &f32s(&pool),
                    0,
                )
                .unwrap(),
            ];
            let mut args: Vec<Arg<'_>> = native
                .weights
                .iter()
                .map(|w| Arg {
                    tensor: w,
                    donate: false,
                })
                .collect();
            args.extend(t.iter().map(|x| Arg {
                tensor: x,
                donate: false,
            }));
            let result = dev.execute(&exe, &args).await.unwrap();
            let bytes = dev.read(&result[0]).await.unwrap();
            let emb: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            for (r, members) in call.iter().enumerate() {
                for (sg, &i) in members.iter().enumerate() {
                    let at = (r * segs + sg) * 384;
                    out[i] = emb[at..at + 384].to_vec();
                }
            }
        }
        self.tokens = self.calls * rb * len;
        self.flop = (self.calls * rb) as f64 * flop_per_row(len);
        let mut programs = std::collections::BTreeSet::new();
        if self.calls > 0 {
            programs.insert((0, 0));
        }
        for group in [leftover, long] {
            let group_lengths: Vec<usize> = group.iter().map(|&i| lengths[i]).collect();
            let chunks: Vec<(usize, usize)> = plan(&group_lengths)
                .unwrap()
                .iter()
                .map(|c| (c.batch, c.seq))
                .collect();
            self.tokens += chunks.iter().map(|(b, s)| b * s).sum::<usize>();
            self.flop += plan_cost(&chunks).2;
            programs.extend(chunks);
            if group.is_empty() {
                continue;
            }
            let group_ids: Vec<Vec<i32>> = group.iter().map(|&i| ids[i].clone()).collect();
            for (k, e) in native.embed(host, &group_ids).await.into_iter().enumerate() {
                out[group[k]] = e;
            }
        }
        self.programs = programs.len();
        out
    }
}

pub fn main() {
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
        let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
        let useful_tokens: usize = lengths.iter().sum();
        let useful_flop: f64 = lengths.iter().map(|&l| flop_per_row(l)).sum();
        let chunks: Vec<(usize, usize)> = plan(&lengths).unwrap().iter().map(|c| (c.batch, c.seq)).collect();
        let (padded, programs, flop) = plan_cost(&chunks);
        let (old_padded, old_programs, old_flop) = plan_cost(&power_of_two_plan(&lengths));
        let mut by_len = lengths.clone();
        by_len.sort();
        let exact: usize = by_len.chunks(32).map(|c| c.len() * c.iter().max().unwrap()).sum();
        let mut native = Native { weights, compiled: HashMap::new() };
        let native_ref = native.embed(&host, &ids).await; // warm-up: compiles every bucket
        // Guest.
        let wasm = crate::guest_wasm("minilm-embed");
        let component = host.load_component(&wasm).unwrap();
        let run = |args: Vec<String>, stdin: Vec<u8>| {
            let opts = RunOptions {
                args,
                dirs: vec![(dir.clone(), "/model".into())],
                stdin: Some(stdin),
                capture_output: true,
                // The guest times its own passes (`--repeat`): it needs the clock.
                allow_clock: true,
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

        let mut packed = Packed { exe: None, calls: 0, tokens: 0, flop: 0.0, programs: 0 };
        let packed_ref = packed.embed(&host, &mut native, &ids).await; // compiles
        let packed_cos = packed_ref
            .iter()
            .zip(&native_ref)
            .map(|(p, n)| minilm_embed::cosine(p, n))
            .fold(f32::MAX, f32::min);
        let mut packed_s = Vec::new();
        let stdin = sentences.join("\n").into_bytes();
        let mut native_s = Vec::new();
        let mut guest_s = Vec::new();
        let mut guest_out: Vec<serde_json::Value> = Vec::new();
        let mut guest_cold_ms: Option<f64> = None;
        let mut anchor = Anchors::start(&dir, &sentences);
        for _ in 0..ROUNDS {
            if let Some(a) = anchor.as_mut() {
                a.round();
            }
            let t = Instant::now();
            let _ = native.embed(&host, &ids).await;
            native_s.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let _ = packed.embed(&host, &mut native, &ids).await;
            packed_s.push(t.elapsed().as_secs_f64());
            let o = run(vec!["--json".into(), "--repeat".into(), "1".into()], stdin.clone()).await;
            assert!(o.success, "{}", String::from_utf8_lossy(&o.stderr));
            let err = String::from_utf8_lossy(&o.stderr);
            let pass1 = err
                .lines()
                .find_map(|l| l.strip_prefix("pass 1: "))
                .expect("the guest reports its second pass");
            guest_s.push(pass1.split(' ').next().unwrap().parse::<f64>().unwrap() / 1e3);
            if guest_cold_ms.is_none() {
                let pass0 = err.lines().find_map(|l| l.strip_prefix("pass 0: ")).unwrap();
                guest_cold_ms = Some(pass0.split(' ').next().unwrap().parse::<f64>().unwrap());
            }
            guest_out = serde_json::from_slice(&o.stdout).unwrap();
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v[v.len() / 2]
        };
        let (native_med, guest_med) = (median(native_s), median(guest_s.clone()));
        let packed_med = median(packed_s);
        println!(
            "native host with the guest's plan (packed: {} calls of {}x{}, up to {} sentences per row; the rest bucketed; {} tokens computed, {:.3} of useful): {:.1} sentences/s, min cosine vs buckets only {:.7}",
            packed.calls, PACK.0, PACK.1, PACK.2, packed.tokens, packed.tokens as f64 / useful_tokens as f64, SENTENCES as f64 / packed_med, packed_cos
        );
        let min_cos = guest_out
            .iter()
            .zip(&native_ref)
            .map(|(g, n)| {
                let g: Vec<f32> = g["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
                minilm_embed::cosine(&g, n)
            })
            .fold(f32::MAX, f32::min);

        let native_rate = SENTENCES as f64 / packed_med;
        let guest_rate = SENTENCES as f64 / guest_med;
        let (peak, peak_how) = peak_gflops();
        let p = host.device().platform();
        println!("tpubox MiniLM benchmark — {} {} (PJRT C API {}.{})", p.name, p.version, p.pjrt_api_version.0, p.pjrt_api_version.1);
        println!(
            "{SENTENCES} realistic sentences (minilm_embed::corpus, seed 1): {useful_tokens} tokens, {:.1} per sentence; median of {ROUNDS} alternating rounds",
            useful_tokens as f64 / SENTENCES as f64
        );
        println!("guest vs native agreement: min cosine {min_cos:.7} ({SENTENCES} sentences), {same_first:.7} (first sentence)");
        println!("peak {peak:.0} GFLOP/s ({peak_how})");
        println!();
        println!("| plan | padded tokens | / useful | / per-call exact | programs | executed GFLOP |");
        println!("|---|---|---|---|---|---|");
        for (name, t, n, f) in [
            ("power-of-two buckets (before)", old_padded, old_programs, old_flop),
            ("finer buckets only", padded, programs, flop),
            (
                "packed rows + finer buckets (the guest's plan, now)",
                packed.tokens,
                packed.programs,
                packed.flop,
            ),
        ] {
            println!(
                "| {name} | {t} | {:.3} | {:.3} | {n} | {:.1} |",
                t as f64 / useful_tokens as f64,
                t as f64 / exact as f64,
                f / 1e9
            );
        }
        println!("(per-call exact: each call of 32 sorted sentences padded to its own longest: {exact} tokens)");
        println!();
        println!("| measure | native host (same plan) | guest | guest / native |");
        println!("|---|---|---|---|");
        println!("| embeddings per second | {native_rate:.1} | {guest_rate:.1} | {:.3} |", guest_rate / native_rate);
        println!(
            "| useful tokens per second | {:.0} | {:.0} | {:.3} |",
            useful_tokens as f64 / packed_med,
            useful_tokens as f64 / guest_med,
            packed_med / guest_med
        );
        println!(
            "| useful GFLOP/s (fraction of peak) | {:.1} ({:.2}) | {:.1} ({:.2}) | |",
            useful_flop / packed_med / 1e9,
            useful_flop / packed_med / 1e9 / peak,
            useful_flop / guest_med / 1e9,
            useful_flop / guest_med / 1e9 / peak
        );
        println!(
            "| executed GFLOP/s (fraction of peak) | {:.1} ({:.2}) | {:.1} ({:.2}) | |",
            packed.flop / packed_med / 1e9,
            packed.flop / packed_med / 1e9 / peak,
            packed.flop / guest_med / 1e9,
            packed.flop / guest_med / 1e9 / peak
        );
        println!("| time to first embedding | {native_first_ms:.0} ms | {guest_first_ms:.0} ms | {:.2} |", guest_first_ms / native_first_ms);
        println!(
            "| guest's first pass over the set (compiles {} programs) | | {:.0} ms | |",
            packed.programs,
            guest_cold_ms.unwrap_or(f64::NAN)
        );
        if let Some(a) = anchor {
            // Paired per round (each round runs every system once, back to back): the spread
            // of the guest-to-anchor ratio says how much the machine moved during the run.
            let vs_pt: Vec<f64> = a.rounds.iter().zip(&guest_s).map(|((pt, _), g)| pt / g).collect();
            let vs_ort: Vec<f64> = a.rounds.iter().zip(&guest_s).map(|((_, ort), g)| ort / g).collect();
            println!(
                "guest vs PyTorch per round, in round order: {}; vs ONNX Runtime: {}",
                vs_pt.iter().map(|r| format!("{r:.2}×")).collect::<Vec<_>>().join(" "),
                vs_ort.iter().map(|r| format!("{r:.2}×")).collect::<Vec<_>>().join(" ")
            );
            // The median of the paired ratios: each ratio compares passes run back to back, so
            // it moves less with the machine than the ratio of the separate medians.
            println!(
                "median of the per-round ratios: guest vs PyTorch {:.2}×, vs ONNX Runtime {:.2}×",
                median(vs_pt),
                median(vs_ort)
            );
            a.finish(&sentences, &guest_out, guest_med, packed_med, native_med, useful_tokens);
        }
    });
}

/// The anchors (host/benches/minilm_anchors.py: sentence-transformers on PyTorch, ONNX
/// Runtime) on the same sentences, from the benchmark venv, in a child process driven round by
/// round (`--interleave`) so that their passes alternate with tpubox's on the same machine.
struct Anchors {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    _work: tempfile::TempDir,
    emb: PathBuf,
    threads: usize,
    /// Seconds of each round's PyTorch and ONNX Runtime passes.
    rounds: Vec<(f64, f64)>,
}

impl Anchors {
    /// Starts the anchors and waits until they are warm; `None`, saying so, when the venv is
    /// missing (`bash scripts/dev.sh bench` installs it) or they fail to start.
    fn start(dir: &std::path::Path, sentences: &[String]) -> Option<Anchors> {
        use std::io::BufRead;
        let cache = std::env::var_os("TPUBOX_CACHE_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| dirs::home_dir().unwrap().join(".cache/tpubox"));
        let python = cache.join("venv-bench/bin/python");
        if !python.exists() {
            println!(
                "anchors skipped: {} is missing (`bash scripts/dev.sh bench` installs it)",
                python.display()
            );
            return None;
        }
        let work = tempfile::tempdir().unwrap();
        let text = work.path().join("sentences.txt");
        std::fs::write(&text, sentences.join("\n")).unwrap();
        let emb = work.path().join("guest.f32");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/minilm_anchors.py");
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let mut child = std::process::Command::new(&python)
            .arg(&script)
            .arg(dir)
            .arg(&text)
            .arg(&emb)
            .args(["--threads", &threads.to_string(), "--interleave"])
            .arg("--cache")
            .arg(cache.join("bench"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        if stdout.read_line(&mut line).unwrap_or(0) == 0 || !line.contains("ready") {
            println!(
                "anchors failed to start: {}",
                child
                    .wait_with_output()
                    .map(|o| o.status.to_string())
                    .unwrap_or_default()
            );
            return None;
        }
        Some(Anchors {
            child,
            stdin,
            stdout,
            _work: work,
            emb,
            threads,
            rounds: Vec::new(),
        })
    }

    /// Runs one pass of each anchor and records its (PyTorch, ONNX Runtime) seconds.
    fn round(&mut self) {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "round").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        let r: serde_json::Value = serde_json::from_str(&line).expect("an anchors round");
        let t = (
            r["pytorch_s"].as_f64().unwrap(),
            r["onnxruntime_s"].as_f64().unwrap(),
        );
        self.rounds.push(t);
    }

    /// Ends the anchors (handing them the guest's embeddings to compare) and prints the joint
    /// table.
    fn finish(
        mut self,
        sentences: &[String],
        guest_out: &[serde_json::Value],
        guest_s: f64,
        native_s: f64,
        buckets_s: f64,
        tokens: usize,
    ) {
        use std::io::{Read, Write};
        println!();
        let bytes: Vec<u8> = guest_out
            .iter()
            .flat_map(|g| {
                g["embedding"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|v| (v.as_f64().unwrap() as f32).to_le_bytes())
                    .collect::<Vec<u8>>()
            })
            .collect();
        std::fs::write(&self.emb, bytes).unwrap();
        writeln!(self.stdin, "done").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_to_string(&mut line).unwrap();
        let status = self.child.wait().unwrap();
        if !status.success() {
            println!("anchors failed: {status}");
            return;
        }
        let threads = self.threads;
        let r: serde_json::Value =
            serde_json::from_str(line.lines().last().unwrap_or("{}")).unwrap();
        let (pt, ort) = (
            r["pytorch_s"].as_f64().unwrap(),
            r["onnxruntime_s"].as_f64().unwrap(),
        );
        println!(
            "Anchors in the same run: sentence-transformers on PyTorch {}, ONNX Runtime {}, {threads} threads each, same weights and sentences",
            r["torch"], r["onnxruntime"]
        );
        println!(
            "(tokens counted by the model's tokenizer: {} here, {} by the anchors)",
            tokens, r["tokens"]
        );
        println!();
        println!(
            "| system | sentences/s | useful tokens/s | vs PyTorch | vs ONNX Runtime | min cosine vs PyTorch |"
        );
        println!("|---|---|---|---|---|---|");
        let n = sentences.len() as f64;
        let guest_cos = r["guest_min_cosine"].as_f64().unwrap();
        for (name, secs, cos) in [
            ("tpubox guest", guest_s, format!("{guest_cos:.6}")),
            (
                "tpubox native host (same plan and executables)",
                native_s,
                "(= guest)".to_string(),
            ),
            (
                "tpubox native host, buckets only",
                buckets_s,
                "(= guest)".to_string(),
            ),
            (
                "sentence-transformers, PyTorch",
                pt,
                "reference".to_string(),
            ),
            (
                "ONNX Runtime",
                ort,
                format!("{:.6}", r["onnxruntime_min_cosine"].as_f64().unwrap()),
            ),
        ] {
            println!(
                "| {name} | {:.1} | {:.0} | {:.2}× | {:.2}× | {cos} |",
                n / secs,
                tokens as f64 / secs,
                pt / secs,
                ort / secs
            );
        }
    }
}
