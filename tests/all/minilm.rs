//! The MiniLM guest (`examples/minilm-embed`) through the host, against the reference outputs of
//! sentence-transformers in `shared/reference/minilm_public.json` (PyTorch, float32).
//!
//! Needs the model files (`tpubox setup minilm`) and the guest built for wasm32-wasip2, both of
//! which `bash scripts/dev.sh test` does first.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use serde::Deserialize;
use tpubox_wasm::{Host, HostConfig, RunOptions, RunOutcome, SandboxConfig};
use wasmtime::component::Component;

#[derive(Deserialize)]
struct Reference {
    cases: Vec<Case>,
}

#[derive(Deserialize, Clone)]
struct Case {
    text: String,
    input_ids: Vec<u32>,
    embedding: Vec<f64>,
}

#[derive(Deserialize)]
struct Embedded {
    text: String,
    input_ids: Vec<u32>,
    embedding: Vec<f64>,
}

fn reference() -> Reference {
    // $TPUBOX_MINILM_REFERENCE, else the `shared/` folder beside the checkout, else the
    // workplace's /work/shared.
    let beside =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/minilm_public.json");
    let path = std::env::var_os("TPUBOX_MINILM_REFERENCE")
        .map(PathBuf::from)
        .or_else(|| beside.is_file().then_some(beside))
        .unwrap_or_else(|| PathBuf::from("/work/shared/reference/minilm_public.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).expect("reference JSON")
}

fn model_dir() -> PathBuf {
    tpubox_core::plugin::known("minilm")
        .and_then(|p| p.installed_library())
        .expect("MiniLM model files are missing: run `tpubox setup minilm` (scripts/dev.sh does)")
}

struct Fixture {
    host: Host,
    component: Component,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let config = HostConfig {
            sandbox: SandboxConfig {
                cache_dir: None,
                ..SandboxConfig::default()
            },
            ..HostConfig::default()
        };
        let host = Host::new(config).expect("host starts");
        host.load_weights("minilm", &model_dir().join("model.safetensors"))
            .expect("MiniLM weights load");
        let wasm = crate::support::wasm("minilm-embed");
        let component = host
            .load_component(&wasm)
            .expect("minilm-embed.wasm loads (build it with scripts/dev.sh)");
        Fixture { host, component }
    })
}

async fn embed(args: &[&str], stdin: &[u8]) -> RunOutcome {
    let f = fixture();
    let opts = RunOptions {
        args: args.iter().map(|s| s.to_string()).collect(),
        dirs: vec![(model_dir(), "/model".into())],
        stdin: Some(stdin.to_vec()),
        capture_output: true,
        deadline: Some(Duration::from_secs(600)),
        ..RunOptions::default()
    };
    f.host
        .run(&f.component, "minilm-embed", &opts)
        .await
        .expect("the guest runs without trapping")
}

async fn embed_json(texts: &[&str]) -> Vec<Embedded> {
    let mut args = vec!["--json"];
    args.extend_from_slice(texts);
    let o = embed(&args, b"").await;
    assert!(
        o.success,
        "guest failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("--json output parses")
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_match_sentence_transformers() {
    let r = reference();
    let texts: Vec<&str> = r.cases.iter().map(|c| c.text.as_str()).collect();
    let got = embed_json(&texts).await;
    assert_eq!(got.len(), r.cases.len());
    assert!(
        r.cases.iter().any(|c| c.input_ids.len() == 256),
        "the reference includes the 256-token truncation case"
    );
    for (g, want) in got.iter().zip(&r.cases) {
        assert_eq!(g.text, want.text);
        assert_eq!(g.input_ids, want.input_ids, "input_ids of {:?}", want.text);
        assert_eq!(g.embedding.len(), 384);
        let c = cosine(&g.embedding, &want.embedding);
        assert!(c >= 0.9999, "cosine {c} for {:?}", want.text);
        let norm: f64 = g.embedding.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!(
            (norm - 1.0).abs() < 1e-5,
            "embedding is L2-normalised, norm {norm}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_rows_give_each_sentence_its_own_embedding() {
    // Enough sentences that the guest packs several per row (minilm_embed::batching): the
    // reference cases, 40 times over (the 256-token case goes through the buckets).
    let r = reference();
    let texts: Vec<&str> = (0..40)
        .flat_map(|_| r.cases.iter().map(|c| c.text.as_str()))
        .collect();
    let got = embed_json(&texts).await;
    assert_eq!(got.len(), texts.len());
    for (k, g) in got.iter().enumerate() {
        let want = &r.cases[k % r.cases.len()];
        assert_eq!(g.text, want.text);
        let c = cosine(&g.embedding, &want.embedding);
        assert!(
            c >= 0.9999,
            "cosine {c} for {:?} (copy {})",
            want.text,
            k / r.cases.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn padding_does_not_leak_into_a_batch() {
    let r = reference();
    let batch: Vec<&str> = r.cases.iter().map(|c| c.text.as_str()).collect();
    let together = embed_json(&batch).await;
    // The shortest, a middle one and the truncated one, each alone (other buckets, no padding
    // rows from other sentences).
    let mut picks: Vec<Case> = r.cases.clone();
    picks.sort_by_key(|c| c.input_ids.len());
    for case in [&picks[0], &picks[picks.len() / 2], &picks[picks.len() - 1]] {
        let alone = embed_json(&[&case.text]).await;
        let in_batch = together.iter().find(|e| e.text == case.text).unwrap();
        let max_diff = alone[0]
            .embedding
            .iter()
            .zip(&in_batch.embedding)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            max_diff <= 1e-5,
            "{:?}: alone vs batch differ by {max_diff}",
            case.text
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gives_a_clear_message() {
    let cases: Vec<(Vec<&str>, &[u8], &str)> = vec![
        (vec![""], b"", "empty"),
        (vec!["--weights", "nope", "hello"], b"", "nope"),
        (vec![], b"fine line\n\xff\xfe broken\n", "UTF-8"),
        (vec!["--model-dir", "/nowhere", "hello"], b"", "tokenizer"),
    ];
    for (args, stdin, needle) in cases {
        let o = embed(&args, stdin).await;
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.success, "{args:?} should fail");
        assert!(
            err.contains(needle),
            "{args:?}: stderr lacks {needle:?}: {err}"
        );
        assert_eq!(
            err.trim().lines().count(),
            1,
            "{args:?}: one line, got {err}"
        );
    }
    // Very long text is truncated to 256 tokens, not refused.
    let long = "word ".repeat(5000);
    let got = embed_json(&[&long]).await;
    assert_eq!(got[0].input_ids.len(), 256);
}
