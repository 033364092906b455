//! What the program prints: a cosine-similarity matrix, or JSON records.

use std::fmt::Write as _;

use anyhow::Result;
use serde::Serialize;

/// Cosine similarity of two vectors (0 when either is all zeros), accumulated in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    if na == 0.0 || nb == 0.0 {
        return 0.0;
    }
    (dot / (na.sqrt() * nb.sqrt())) as f32
}

/// One sentence's result, as printed by `--json`.
#[derive(Serialize)]
struct Record<'a> {
    text: &'a str,
    input_ids: &'a [i32],
    embedding: &'a [f32],
}

/// `[{"text": …, "input_ids": […], "embedding": […]}, …]`, one record per sentence in order.
pub fn to_json(texts: &[String], ids: &[Vec<i32>], embeddings: &[Vec<f32>]) -> Result<String> {
    let records: Vec<Record> = texts
        .iter()
        .zip(ids)
        .zip(embeddings)
        .map(|((text, input_ids), embedding)| Record {
            text,
            input_ids,
            embedding,
        })
        .collect();
    Ok(serde_json::to_string(&records)?)
}

/// The sentences, numbered, then their pairwise cosine similarities to 3 decimals.
pub fn similarity_table(texts: &[String], embeddings: &[Vec<f32>]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "sentences:");
    for (i, t) in texts.iter().enumerate() {
        let _ = writeln!(out, "  [{i}] {}", one_line(t));
    }
    let _ = writeln!(out, "cosine similarity:");
    let label = |i: usize| format!("[{i}]");
    let w = label(texts.len().saturating_sub(1)).len().max(6);
    let _ = write!(out, "  {:>w$}", "");
    for j in 0..texts.len() {
        let _ = write!(out, " {:>w$}", label(j));
    }
    out.push('\n');
    for (i, a) in embeddings.iter().enumerate() {
        let _ = write!(out, "  {:>w$}", label(i));
        for b in embeddings {
            let _ = write!(out, " {:>w$.3}", cosine(a, b));
        }
        out.push('\n');
    }
    out
}

/// `text` with control characters (newlines, tabs, escapes) shown as spaces, so one sentence
/// stays on one line of the table.
fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_basics() {
        assert!((cosine(&[1.0, 0.0], &[1.0, 0.0]) - 1.0).abs() < 1e-7);
        assert!(cosine(&[1.0, 0.0], &[0.0, 2.0]).abs() < 1e-7);
        assert!((cosine(&[1.0, 1.0], &[-2.0, -2.0]) + 1.0).abs() < 1e-7);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 2.0]), 0.0);
    }

    #[test]
    fn json_format() {
        let texts = vec!["a \"q\"".to_string(), "b".to_string()];
        let ids = vec![vec![101, 1037, 102], vec![101, 1038, 102]];
        let emb = vec![vec![0.5f32, -0.25], vec![1.0, 0.0]];
        let s = to_json(&texts, &ids, &emb).unwrap();
        assert_eq!(
            s,
            r#"[{"text":"a \"q\"","input_ids":[101,1037,102],"embedding":[0.5,-0.25]},{"text":"b","input_ids":[101,1038,102],"embedding":[1.0,0.0]}]"#
        );
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        let first = v.as_array().unwrap()[0].as_object().unwrap();
        let keys: Vec<&str> = first.keys().map(String::as_str).collect();
        assert_eq!(keys.len(), 3);
        for k in ["text", "input_ids", "embedding"] {
            assert!(first.contains_key(k));
        }
        assert_eq!(to_json(&[], &[], &[]).unwrap(), "[]");
    }

    #[test]
    fn table_layout() {
        let texts = vec!["one".to_string(), "two\nlines".to_string()];
        let emb = vec![vec![1.0f32, 0.0], vec![0.6, 0.8]];
        let t = similarity_table(&texts, &emb);
        assert!(t.contains("[0] one"), "{t}");
        assert!(t.contains("[1] two lines"), "{t}");
        assert!(t.contains(" 1.000"), "{t}");
        assert!(t.contains(" 0.600"), "{t}");
        let rows: Vec<&str> = t.lines().collect();
        assert_eq!(rows.len(), 1 + 2 + 1 + 1 + 2);
    }
}
