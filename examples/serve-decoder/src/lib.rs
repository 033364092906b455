//! serve-decoder: a decoupled model for `tpubox serve` that streams text one token at a time
//! from a small autoregressive decoder, the shape of an LLM server's generate endpoint.
//!
//! The decoder is one pre-norm transformer block (single-head causal self-attention and a GELU
//! MLP, `D` = 64) over a window of the last `L` = 64 tokens, with tied input and output
//! embeddings, built with the SDK's graph builder ([`tpubox_guest::graph`]) and compiled once
//! per instance. Its weights are random but reproducible: weight `i` of matrix `m` is
//! `scale * (splitmix64(m << 32 | i) / 2^64 - 0.5)` as `f32` ([`weight`]), so a test computes
//! the same numbers with numpy. Decoding is greedy (the first index of the largest logit).
//!
//! Vocabulary: the 95 printable ASCII characters, token `t` is byte `32 + t`; other bytes of
//! the prompt map to `?`.
//!
//! Metadata (no batch dimension; `model_transaction_policy.decoupled`):
//! - inputs `text_input` (BYTES `[1]`: the prompt, at least one byte) and `max_tokens`
//!   (INT32 `[1]`: how many tokens to generate, 0..=[`MAX_TOKENS`]);
//! - outputs, one response per token: `text_output` (BYTES `[1]`: the token's character) and
//!   `token_id` (INT32 `[1]`), then the end of the stream after `max_tokens` responses.
//!
//! Build: `cargo build --release --target wasm32-wasip2 -p serve-decoder`. Configuration:
//! `config.toml` next to this crate's `Cargo.toml`.

use std::cell::{OnceCell, RefCell};

use tpubox_guest::graph::{Compare, Graph, Precision};
use tpubox_guest::model::{self as sdk, Datatype, TensorMetadata, WitError, input};
use tpubox_guest::{Dtype, Error, ErrorKind, Executable, Tensor};
use tpubox_guest_decoupled::{
    Decoupled, Generation, GuestGeneration, Model, ModelMetadata, TensorData,
};

/// Vocabulary size: printable ASCII.
pub const VOCAB: u64 = 95;
/// Model width.
pub const WIDTH: u64 = 64;
/// MLP width.
pub const HIDDEN: u64 = 4 * WIDTH;
/// Context window in tokens.
pub const WINDOW: u64 = 64;
/// Largest `max_tokens` a request may ask for.
pub const MAX_TOKENS: i32 = 1 << 20;

/// The weight matrices in the order the program takes them: (name, dims, scale). The matrix
/// index `m` in [`weight`] is the position in this list.
pub const MATRICES: [(&str, [u64; 2], f64); 8] = [
    ("embed", [VOCAB, WIDTH], 1.0),
    ("position", [WINDOW, WIDTH], 0.5),
    ("wq", [WIDTH, WIDTH], 0.5),
    ("wk", [WIDTH, WIDTH], 0.5),
    ("wv", [WIDTH, WIDTH], 0.5),
    ("wo", [WIDTH, WIDTH], 0.5),
    ("w1", [WIDTH, HIDDEN], 0.5),
    ("w2", [HIDDEN, WIDTH], 0.25),
];

/// SplitMix64's output function (Steele, Lea and Flood, 2014) of `x`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Element `i` of weight matrix `m` (row-major) at `scale`.
pub fn weight(m: u64, i: u64, scale: f64) -> f32 {
    let u = splitmix64((m << 32) | i) as f64 / 18_446_744_073_709_551_616.0;
    (scale * (u - 0.5)) as f32
}

/// The token of byte `b` (non-printable bytes are `?`).
pub fn token_of(b: u8) -> i32 {
    let b = if (32..127).contains(&b) { b } else { b'?' };
    i32::from(b - 32)
}

/// One decoder step: `ids: s32[WINDOW]` (the context, padded), `last: s32[]` (the position of
/// its last token) and the weights → the logits `f32[VOCAB]` of the next token.
fn program() -> tpubox_guest::Result<Executable> {
    let g = Graph::new();
    let p = Precision::Highest;
    let ids = g.parameter(Dtype::S32, &[WINDOW]);
    let last = g.parameter(Dtype::S32, &[]);
    let w: Vec<_> = MATRICES
        .iter()
        .map(|(_, dims, _)| g.parameter(Dtype::F32, dims))
        .collect();
    let (embed, position, wq, wk, wv, wo, w1, w2) =
        (w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
    let ones = g.constant(&[1.0f32; WIDTH as usize], &[WIDTH])?;
    let zeros = g.constant(&[0.0f32; WIDTH as usize], &[WIDTH])?;
    let norm = |x| g.layer_norm(x, ones, zeros, 1e-5);

    let x = g.add(g.take(embed, ids)?, position)?; // [L, D]
    let h = norm(x)?;
    let q = g.matmul(h, wq, p)?;
    let k = g.matmul(h, wk, p)?;
    let v = g.matmul(h, wv, p)?;
    let kt = g.transpose(k, &[1, 0])?;
    let scores = g.mul(
        g.matmul(q, kt, p)?,
        g.scalar(1.0f32 / (WIDTH as f32).sqrt()),
    )?;
    // Causal: position i sees positions j <= i.
    let row = g.iota(Dtype::S32, &[WINDOW, WINDOW], 0)?;
    let col = g.iota(Dtype::S32, &[WINDOW, WINDOW], 1)?;
    let seen = g.compare(col, row, Compare::Le)?;
    let neg = g.broadcast_to(g.scalar(-1e9f32), &[WINDOW, WINDOW])?;
    let scores = g.select(seen, scores, neg)?;
    let attn = g.matmul(g.matmul(g.softmax(scores, 1)?, v, p)?, wo, p)?;
    let x = g.add(x, attn)?;
    let mlp = g.matmul(g.gelu(g.matmul(norm(x)?, w1, p)?)?, w2, p)?;
    let x = g.add(x, mlp)?;
    // The last token's row, normalised, against the (tied) embeddings.
    let zero = g.scalar(0i32);
    let h = g.reshape(g.dynamic_slice(x, &[last, zero], &[1, WIDTH])?, &[1, WIDTH])?;
    let et = g.transpose(embed, &[1, 0])?;
    let logits = g.reshape(g.matmul(norm(h)?, et, p)?, &[VOCAB])?;
    g.compile(&[logits])
}

/// What an instance builds once: the compiled step and the weights on the device.
struct Compiled {
    step: Executable,
    weights: Vec<Tensor>,
}

thread_local! {
    static DECODER: OnceCell<Compiled> = const { OnceCell::new() };
}

fn with_decoder<R>(
    f: impl FnOnce(&Compiled) -> tpubox_guest::Result<R>,
) -> tpubox_guest::Result<R> {
    DECODER.with(|cell| {
        if cell.get().is_none() {
            let weights = MATRICES
                .iter()
                .enumerate()
                .map(|(m, (_, dims, scale))| {
                    let n = dims[0] * dims[1];
                    let data: Vec<f32> = (0..n).map(|i| weight(m as u64, i, *scale)).collect();
                    Tensor::from_slice(&data, dims)
                })
                .collect::<tpubox_guest::Result<Vec<_>>>()?;
            let _ = cell.set(Compiled {
                step: program()?,
                weights,
            });
        }
        f(cell.get().expect("set above"))
    })
}

/// The model: metadata, and a [`Stream`] per request.
pub struct TinyDecoder;

/// One request's generation: the context so far and how many tokens are left.
pub struct Stream {
    context: RefCell<Vec<i32>>,
    left: RefCell<i32>,
}

impl Model for TinyDecoder {
    fn metadata() -> ModelMetadata {
        sdk::ModelMetadata {
            inputs: vec![
                TensorMetadata::new("text_input", Datatype::Bytes, &[1]),
                TensorMetadata::new("max_tokens", Datatype::Int32, &[1]),
            ],
            outputs: vec![
                TensorMetadata::new("text_output", Datatype::Bytes, &[1]),
                TensorMetadata::new("token_id", Datatype::Int32, &[1]),
            ],
            max_batch_size: 0,
        }
        .into()
    }

    fn infer(_: Vec<TensorData>) -> Result<Vec<TensorData>, WitError> {
        Err(Error::new(
            ErrorKind::Unsupported,
            "serve-decoder is a decoupled model: stream it (ModelStreamInfer, generate_stream)",
        )
        .into())
    }
}

impl Decoupled for TinyDecoder {
    type Generation = Stream;

    fn start(inputs: Vec<TensorData>) -> Result<Generation, WitError> {
        let inputs: Vec<sdk::TensorData> = inputs.into_iter().map(Into::into).collect();
        let prompt = input(&inputs, "text_input")?.bytes_elements()?;
        let prompt = prompt.first().copied().unwrap_or_default();
        if prompt.is_empty() {
            return Err(Error::invalid_argument(
                "text_input is empty: give at least one character",
            )
            .into());
        }
        let n = input(&inputs, "max_tokens")?.to_vec::<i32>()?[0];
        if !(0..=MAX_TOKENS).contains(&n) {
            return Err(Error::invalid_argument(format!(
                "max_tokens is {n}; it must be 0..={MAX_TOKENS}"
            ))
            .into());
        }
        // Compile (once per instance) before the first response is asked for.
        with_decoder(|_| Ok(()))?;
        Ok(Generation::new(Stream {
            context: RefCell::new(prompt.iter().map(|&b| token_of(b)).collect()),
            left: RefCell::new(n),
        }))
    }
}

impl GuestGeneration for Stream {
    fn next(&self) -> Result<Option<Vec<TensorData>>, WitError> {
        if *self.left.borrow() <= 0 {
            return Ok(None);
        }
        let mut context = self.context.borrow_mut();
        let window = &context[context.len().saturating_sub(WINDOW as usize)..];
        let mut ids = window.to_vec();
        let last = ids.len() as i32 - 1;
        ids.resize(WINDOW as usize, 0);
        let logits = with_decoder(|d| {
            let ids = Tensor::from_slice(&ids, &[WINDOW])?;
            let last = Tensor::from_slice(&[last], &[])?;
            let mut args = vec![&ids, &last];
            args.extend(d.weights.iter());
            d.step.call(&args)?[0].to_vec::<f32>()
        })?;
        // Greedy: the first index of the largest logit.
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        let token = best as i32;
        context.push(token);
        *self.left.borrow_mut() -= 1;
        let ch = [32 + token as u8];
        Ok(Some(vec![
            sdk::TensorData::from_bytes_elements("text_output", &[&ch[..]], &[1])?.into(),
            sdk::TensorData::from_slice("token_id", &[token], &[1])?.into(),
        ]))
    }
}

tpubox_guest_decoupled::export_decoupled_model!(TinyDecoder);
