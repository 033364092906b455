//! minilm-serve: sentence embeddings with sentence-transformers/all-MiniLM-L6-v2, served by
//! `tpubox serve` (a model guest: `tpubox:device/model@0.1.2`).
//!
//! Metadata (`max-batch-size` 64):
//!
//! * input `text`, `BYTES`, shape `[]`: one UTF-8 sentence per batch row (a request's tensor is
//!   `[B]`, B ≤ 64);
//! * output `embedding`, `FP32`, shape `[384]` (`[B, 384]` per request): the sentence's
//!   embedding, mean-pooled over its tokens and L2-normalized.
//!
//! The embeddings are those of the `minilm-embed` command guest: the same library
//! (`minilm_embed`) tokenizes with the model's `tokenizer.json`, read from the model directory
//! the host grants at `/model`, builds the encoder with the SDK's graph builder, takes the
//! weights from the host's weight set `minilm` (`[tpubox.weights] minilm =
//! "model.safetensors"`; they stay on the device) and runs padded (batch, seq) buckets. The
//! instance loads the tokenizer and weights on its first `infer` and compiles each bucket once,
//! keeping both for every later request.
//!
//! Errors: `invalid-argument` (HTTP 400) for a sentence that is not UTF-8, empty or
//! whitespace-only, or over 64 KiB; `failed-precondition` when the tokenizer or the weight set
//! cannot be loaded (the next request tries again); the host's error kind for a failed device
//! call (`resource-exhausted`: 429).
//!
//! Build: `cargo build --release --target wasm32-wasip2 -p minilm-serve` →
//! `target/wasm32-wasip2/release/minilm_serve.wasm`. Configuration: `config.toml` next to this
//! crate's `Cargo.toml`.

use std::cell::RefCell;
use std::path::Path;

use minilm_embed::{
    Compiled, DEFAULT_MODEL_DIR, DEFAULT_WEIGHTS, HIDDEN, SentenceTokenizer, embed, load_weights,
};
use tpubox_guest::model::{
    Datatype, Model, ModelMetadata, TensorData, TensorMetadata, WitError, input,
};
use tpubox_guest::{Error, ErrorKind, Result, Tensor};

/// Largest batch one `infer` call takes (the encoder runs it in calls of at most 32 rows).
pub const MAX_BATCH_SIZE: u32 = 64;
/// Name of the input (`BYTES`, one sentence per row).
pub const INPUT: &str = "text";
/// Name of the output (`FP32`, `[batch, 384]`).
pub const OUTPUT: &str = "embedding";

/// What the instance keeps across requests.
struct State {
    tokenizer: SentenceTokenizer,
    weights: Vec<Tensor>,
    compiled: Compiled,
}

thread_local! {
    /// Loaded on the first `infer`; `None` until then (or while loading fails).
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// The host's error kind when `e` carries a [`tpubox_guest::Error`], else `fallback`; the
/// message is the whole chain.
fn to_error(e: anyhow::Error, fallback: ErrorKind) -> Error {
    let kind = e
        .downcast_ref::<Error>()
        .map_or(fallback, |inner| inner.kind());
    Error::new(kind, format!("{e:#}"))
}

fn load() -> Result<State> {
    let path = Path::new(DEFAULT_MODEL_DIR).join("tokenizer.json");
    let tokenizer = SentenceTokenizer::from_file(&path).map_err(|e| {
        Error::new(
            ErrorKind::FailedPrecondition,
            format!(
                "{e:#} (the model directory, granted at {DEFAULT_MODEL_DIR}, needs tokenizer.json)"
            ),
        )
    })?;
    let weights = load_weights(DEFAULT_WEIGHTS).map_err(|e| {
        Error::new(
            ErrorKind::FailedPrecondition,
            format!(
                "{e:#} (the model's config needs [tpubox.weights] {DEFAULT_WEIGHTS} = \"model.safetensors\")"
            ),
        )
    })?;
    Ok(State {
        tokenizer,
        weights,
        compiled: Compiled::new(),
    })
}

/// Embeds `texts`, one `HIDDEN`-wide row each, flattened row-major.
fn run(texts: &[&[u8]]) -> Result<Vec<f32>> {
    STATE.with_borrow_mut(|state| {
        if state.is_none() {
            *state = Some(load()?);
        }
        let State {
            tokenizer,
            weights,
            compiled,
        } = state.as_mut().expect("loaded above");
        let ids = texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let text = std::str::from_utf8(t).map_err(|e| {
                    Error::invalid_argument(format!("text {i} is not valid UTF-8: {e}"))
                })?;
                tokenizer
                    .encode(text)
                    .map_err(|e| Error::invalid_argument(format!("text {i}: {e:#}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let rows = embed(weights, &ids, compiled).map_err(|e| to_error(e, ErrorKind::Internal))?;
        Ok(rows.concat())
    })
}

/// The model: see the crate documentation.
pub struct MiniLm;

impl Model for MiniLm {
    fn metadata() -> ModelMetadata {
        ModelMetadata {
            inputs: vec![TensorMetadata::new(INPUT, Datatype::Bytes, &[])],
            outputs: vec![TensorMetadata::new(
                OUTPUT,
                Datatype::Fp32,
                &[HIDDEN as i64],
            )],
            max_batch_size: MAX_BATCH_SIZE,
        }
    }

    fn infer(inputs: Vec<TensorData>) -> std::result::Result<Vec<TensorData>, WitError> {
        let text = input(&inputs, INPUT)?;
        let [batch] = text.shape[..] else {
            return Err(Error::invalid_argument(format!(
                "{INPUT} has shape {:?}; expected [batch]",
                text.shape
            ))
            .into());
        };
        let texts = text.bytes_elements()?;
        let embeddings = if texts.is_empty() {
            Vec::new()
        } else {
            run(&texts)?
        };
        Ok(vec![TensorData::from_slice(
            OUTPUT,
            &embeddings,
            &[batch, HIDDEN],
        )?])
    }
}

tpubox_guest::export_model!(MiniLm);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata() {
        let m = MiniLm::metadata();
        assert_eq!(m.max_batch_size, 64);
        assert_eq!(
            m.inputs,
            [TensorMetadata::new("text", Datatype::Bytes, &[])]
        );
        assert_eq!(
            m.outputs,
            [TensorMetadata::new("embedding", Datatype::Fp32, &[384])]
        );
    }

    #[test]
    fn bad_shapes_are_refused_before_the_device() {
        let scalar = TensorData::from_bytes_elements("text", &["a"], &[]).unwrap();
        let e = MiniLm::infer(vec![scalar]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        let missing = TensorData::from_bytes_elements("other", &["a"], &[1]).unwrap();
        assert_eq!(
            MiniLm::infer(vec![missing]).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        let empty = TensorData::from_bytes_elements::<&str>("text", &[], &[0]).unwrap();
        let out = MiniLm::infer(vec![empty]).unwrap();
        assert_eq!(out[0].shape, [0, 384]);
        assert!(out[0].data.is_empty());
    }
}
