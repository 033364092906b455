//! all-MiniLM-L6-v2 sentence embeddings for tpubox: the parts that are plain Rust and build
//! natively as well as for `wasm32-wasip2`.
//!
//! * [`model`]: the encoder as a StableHLO graph ([`build_encoder_mlir`]) and the weight names
//!   and parameter order it expects ([`encoder_inputs`]).
//! * [`tokenize`]: the model's WordPiece tokenizer, truncating at 256 tokens.
//! * [`batching`]: the (batch, seq) bucket policy and padding.
//! * [`corpus`]: a fixed generator of sentences with realistic lengths, for benchmarks.
//! * [`output`]: the similarity table, JSON records, cosine similarity.
//! * [`device`]: the weights from the host's weight set ([`load_weights`]) and the bucketed
//!   encoder calls ([`embed`]); these call the host, so they run only in a guest.
//!
//! The guest program (`src/main.rs`) ties these to the host: it takes the weights from the
//! host's weight set by name and runs the graph on the host's device. The `minilm-serve` model
//! guest (`examples/minilm-serve`) serves the same embeddings through `tpubox serve`. A native
//! benchmark can build the same MLIR with [`build_encoder_mlir`] and tokenize with
//! [`SentenceTokenizer`].

pub mod batching;
pub mod corpus;
pub mod device;
pub mod model;
pub mod output;
pub mod tokenize;

pub use batching::{
    BATCH_BUCKETS, Chunk, SEQ_BUCKETS, batch_bucket, pack, pack_packed, pack_rows, plan, seq_bucket,
};
pub use corpus::realistic_sentences;
pub use device::{Compiled, embed, load_weights};
pub use model::{
    EncoderInput, HIDDEN, PackedAttention, WeightSpec, build_encoder, build_encoder_mlir,
    build_packed_encoder_mlir, encoder_inputs, weight_specs,
};
pub use output::{cosine, similarity_table, to_json};
pub use tokenize::{MAX_SEQ_LEN, MAX_TEXT_BYTES, SentenceTokenizer};

/// The default weight-set name (`tpubox run --weights minilm=…/model.safetensors`).
pub const DEFAULT_WEIGHTS: &str = "minilm";
/// Where the guest looks for `tokenizer.json` by default (`--dir MODELDIR::/model`).
pub const DEFAULT_MODEL_DIR: &str = "/model";
