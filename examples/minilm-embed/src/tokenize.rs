//! Tokenization as sentence-transformers does it for all-MiniLM-L6-v2: the model's own
//! `tokenizer.json` (BERT normalizer: clean text, CJK split, lower-case, accent strip; BERT
//! pre-tokenizer; WordPiece; `[CLS] … [SEP]`), no padding, truncation to 256 tokens.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use tokenizers::{
    PaddingParams, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy,
};

/// sentence-transformers' `max_seq_length` for this model: longer inputs are truncated to this
/// many tokens, `[CLS]` and `[SEP]` included.
pub const MAX_SEQ_LEN: usize = 256;

/// Longest sentence accepted, in bytes. Only the first 256 tokens are read anyway; this bounds
/// the tokenizer's work on absurd inputs.
pub const MAX_TEXT_BYTES: usize = 64 * 1024;

/// The MiniLM tokenizer, configured for sentence embedding.
pub struct SentenceTokenizer {
    inner: Tokenizer,
}

impl SentenceTokenizer {
    /// Loads `tokenizer.json` from `path`.
    ///
    /// The file's own padding (fixed 128) and truncation (128) settings are replaced: no
    /// padding (batching pads), truncation to [`MAX_SEQ_LEN`] as sentence-transformers does.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        Self::from_bytes(&bytes).with_context(|| format!("cannot load {}", path.display()))
    }

    /// Loads a `tokenizer.json` given as bytes (see [`SentenceTokenizer::from_file`]).
    pub fn from_bytes(json: &[u8]) -> Result<Self> {
        let mut inner =
            Tokenizer::from_bytes(json).map_err(|e| anyhow!("not a tokenizer.json: {e}"))?;
        inner.with_padding(None::<PaddingParams>);
        inner
            .with_truncation(Some(TruncationParams {
                max_length: MAX_SEQ_LEN,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| anyhow!("cannot set truncation: {e}"))?;
        Ok(SentenceTokenizer { inner })
    }

    /// Token ids of `text` (`[CLS] … [SEP]`, at most [`MAX_SEQ_LEN`]).
    ///
    /// Errors: an empty (or whitespace-only) text, or one over [`MAX_TEXT_BYTES`].
    pub fn encode(&self, text: &str) -> Result<Vec<i32>> {
        // sentence-transformers strips each input before tokenizing.
        let text = text.trim();
        if text.is_empty() {
            bail!("empty sentence");
        }
        if text.len() > MAX_TEXT_BYTES {
            bail!(
                "sentence is {} bytes, over the {MAX_TEXT_BYTES}-byte limit (the model reads only its first {MAX_SEQ_LEN} tokens)",
                text.len()
            );
        }
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| anyhow!("tokenizer failed: {e}"))?;
        let ids = enc.get_ids();
        debug_assert!(ids.len() <= MAX_SEQ_LEN);
        ids.iter()
            .map(|&id| i32::try_from(id).map_err(|_| anyhow!("token id {id} overflows s32")))
            .collect()
    }
}
