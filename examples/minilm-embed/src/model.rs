//! The all-MiniLM-L6-v2 encoder (a 6-layer BERT) as a StableHLO graph, plus the mean pooling
//! and L2 normalization that sentence-transformers applies after it.
//!
//! The graph's parameters are, in order: every weight of [`weight_specs`] (f32, PyTorch layout:
//! a `Linear` weight is `[out, in]` and computes `y = x·Wᵀ + b`), then `input_ids` (s32
//! `[batch, seq]`), then `attention_mask` (s32 `[batch, seq]`, 1 for a real token, 0 for
//! padding). Its one result is the normalized sentence embeddings, f32 `[batch, 384]`.

use anyhow::{Context, Result, ensure};
use tpubox_guest::Dtype;
use tpubox_guest::graph::{Graph, Precision, Value};

/// Width of the hidden states (`hidden_size`), and so of an embedding.
pub const HIDDEN: u64 = 384;
/// Attention heads per layer.
pub const HEADS: u64 = 12;
/// Width of one head.
pub const HEAD_DIM: u64 = HIDDEN / HEADS;
/// Encoder layers.
pub const LAYERS: usize = 6;
/// Width of the feed-forward layer.
pub const INTERMEDIATE: u64 = 1536;
/// WordPiece vocabulary size.
pub const VOCAB: u64 = 30522;
/// Rows of the position-embedding table (the longest sequence the model can read).
pub const MAX_POSITIONS: u64 = 512;
/// Rows of the token-type table.
pub const TYPE_VOCAB: u64 = 2;
/// `layer_norm_eps` from config.json.
pub const LAYER_NORM_EPS: f32 = 1e-12;
/// sentence-transformers clamps the token count of mean pooling to at least this.
const POOL_MIN_COUNT: f32 = 1e-9;
/// `torch.nn.functional.normalize` divides by `max(‖x‖, eps)` with this eps.
const NORMALIZE_EPS: f32 = 1e-12;

/// One weight the graph takes as a parameter: its name in `model.safetensors` (and so in the
/// host's weight set) and its dims. Every weight is f32.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightSpec {
    /// Tensor name, e.g. `encoder.layer.0.attention.self.query.weight`.
    pub name: String,
    /// Dims (PyTorch layout).
    pub dims: Vec<u64>,
}

impl WeightSpec {
    fn new(name: impl Into<String>, dims: &[u64]) -> Self {
        WeightSpec {
            name: name.into(),
            dims: dims.to_vec(),
        }
    }

    /// Element type: every MiniLM weight is f32.
    pub fn dtype(&self) -> Dtype {
        Dtype::F32
    }
}

/// One parameter of the encoder graph, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EncoderInput {
    /// A weight from the weight set.
    Weight(WeightSpec),
    /// Token ids, s32 `[batch, seq]`, padded with 0 (`[PAD]`).
    InputIds,
    /// 1 for a real token, 0 for padding, s32 `[batch, seq]`.
    AttentionMask,
}

/// The weights the encoder reads, in the order they are the graph's first parameters.
pub fn weight_specs() -> Vec<WeightSpec> {
    let mut w = vec![
        WeightSpec::new("embeddings.word_embeddings.weight", &[VOCAB, HIDDEN]),
        WeightSpec::new(
            "embeddings.position_embeddings.weight",
            &[MAX_POSITIONS, HIDDEN],
        ),
        WeightSpec::new(
            "embeddings.token_type_embeddings.weight",
            &[TYPE_VOCAB, HIDDEN],
        ),
        WeightSpec::new("embeddings.LayerNorm.weight", &[HIDDEN]),
        WeightSpec::new("embeddings.LayerNorm.bias", &[HIDDEN]),
    ];
    for l in 0..LAYERS {
        let p = format!("encoder.layer.{l}");
        for (name, out, inp) in [
            ("attention.self.query", HIDDEN, HIDDEN),
            ("attention.self.key", HIDDEN, HIDDEN),
            ("attention.self.value", HIDDEN, HIDDEN),
            ("attention.output.dense", HIDDEN, HIDDEN),
            ("attention.output.LayerNorm", HIDDEN, 0),
            ("intermediate.dense", INTERMEDIATE, HIDDEN),
            ("output.dense", HIDDEN, INTERMEDIATE),
            ("output.LayerNorm", HIDDEN, 0),
        ] {
            if inp == 0 {
                // LayerNorm: weight (gamma) and bias (beta), both [HIDDEN].
                w.push(WeightSpec::new(format!("{p}.{name}.weight"), &[out]));
            } else {
                w.push(WeightSpec::new(format!("{p}.{name}.weight"), &[out, inp]));
            }
            w.push(WeightSpec::new(format!("{p}.{name}.bias"), &[out]));
        }
    }
    w
}

/// Every parameter of the encoder graph, in order: the weights, then ids, then mask.
pub fn encoder_inputs() -> Vec<EncoderInput> {
    let mut v: Vec<EncoderInput> = weight_specs()
        .into_iter()
        .map(EncoderInput::Weight)
        .collect();
    v.push(EncoderInput::InputIds);
    v.push(EncoderInput::AttentionMask);
    v
}

/// The encoder graph for one (batch, seq) shape and its single output (embeddings
/// `[batch, 384]`).
pub struct Encoder {
    /// The graph; its parameters are [`encoder_inputs`] in order.
    pub graph: Graph,
    /// Normalized embeddings, f32 `[batch, HIDDEN]`.
    pub output: Value,
}

/// Builds the encoder for `batch` rows of `seq` tokens.
pub fn build_encoder(batch: u64, seq: u64) -> Result<Encoder> {
    ensure!(batch >= 1, "batch must be at least 1");
    ensure!(
        (1..=MAX_POSITIONS).contains(&seq),
        "sequence length {seq} is outside 1..={MAX_POSITIONS}"
    );
    let b = Builder {
        g: Graph::new(),
        batch,
        seq,
    };
    let output = b.encoder().context("building the MiniLM encoder graph")?;
    Ok(Encoder { graph: b.g, output })
}

/// The encoder for `batch` × `seq` as StableHLO MLIR text (entry `main`; parameters as
/// [`encoder_inputs`]).
pub fn build_encoder_mlir(batch: u64, seq: u64) -> Result<String> {
    let e = build_encoder(batch, seq)?;
    Ok(e.graph.to_mlir(&[e.output])?)
}

/// How the packed encoder keeps the sentences of a row apart in attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedAttention {
    /// `Graph::segment_attention`: the host's `tpubox_segment_attention` custom call, which
    /// computes only the token pairs inside one sentence (the sum of the squared sentence
    /// lengths, not `len²` per row). Only CPU plugins have its handler.
    Segments,
    /// Dense attention over the whole row with an additive bias input that masks the pairs
    /// across sentences. Any plugin.
    Dense,
}

impl PackedAttention {
    /// [`PackedAttention::Segments`] on the `"cpu"` platform, [`PackedAttention::Dense`]
    /// elsewhere.
    pub fn for_platform(name: &str) -> PackedAttention {
        if name == "cpu" {
            PackedAttention::Segments
        } else {
            PackedAttention::Dense
        }
    }
}

/// The packed encoder: `rows` rows of `len` tokens, each row holding up to `segs` sentences
/// one after another, so that almost no padding is computed. Its parameters are every weight
/// of [`weight_specs`], then `input_ids` (s32 `[rows, len]`), `positions` (s32 `[rows, len]`:
/// each token's position inside its own sentence, 0 on padding; a sentence starts at each
/// position 0), with [`PackedAttention::Dense`] only `bias` (f32 `[rows, len, len]`: 0 where
/// query and key are in the same sentence, `f32::MIN` elsewhere), and `pool` (f32
/// `[rows, segs, len]`: `1/n` on the `n` tokens of segment `s`, 0 elsewhere). Its result is
/// the normalized embeddings per segment, f32 `[rows, segs, 384]`. [`crate::pack_packed`]
/// makes these inputs.
///
/// Errors: `rows` or `segs` is 0, or `len` is outside `1..=512`.
pub fn build_packed_encoder_mlir(
    rows: u64,
    len: u64,
    segs: u64,
    attention: PackedAttention,
) -> Result<String> {
    ensure!(
        rows >= 1 && segs >= 1,
        "rows and segments must be at least 1"
    );
    ensure!(
        (1..=MAX_POSITIONS).contains(&len),
        "row length {len} is outside 1..={MAX_POSITIONS}"
    );
    let b = Builder {
        g: Graph::new(),
        batch: rows,
        seq: len,
    };
    let output = b
        .packed(segs, attention)
        .context("building the packed MiniLM encoder graph")?;
    Ok(b.g.to_mlir(&[output])?)
}

/// How a layer's queries see the keys.
#[derive(Clone, Copy)]
enum Attention {
    /// Dense attention with an additive bias over keys, f32 broadcastable to `[B, h, S, S]`.
    Dense(Value),
    /// Attention inside the segments of packed rows (`Graph::segment_attention`), from the
    /// positions s32 `[B, S]`.
    Segments(Value),
}

struct Builder {
    g: Graph,
    batch: u64,
    seq: u64,
}

/// The weight parameters of one encoder layer.
struct Layer {
    q: (Value, Value),
    k: (Value, Value),
    v: (Value, Value),
    attn_out: (Value, Value),
    attn_ln: (Value, Value),
    inter: (Value, Value),
    out: (Value, Value),
    out_ln: (Value, Value),
}

impl Builder {
    /// The weights as parameters, in [`weight_specs`] order.
    fn weights(&self) -> (Value, Value, Value, (Value, Value), Vec<Layer>) {
        let mut params = weight_specs()
            .into_iter()
            .map(|w| self.g.parameter(Dtype::F32, &w.dims));
        let mut next = move || params.next().expect("weight_specs lists every weight");
        let word = next();
        let pos = next();
        let typ = next();
        let emb_ln = (next(), next());
        let layers: Vec<Layer> = (0..LAYERS)
            .map(|_| Layer {
                q: (next(), next()),
                k: (next(), next()),
                v: (next(), next()),
                attn_out: (next(), next()),
                attn_ln: (next(), next()),
                inter: (next(), next()),
                out: (next(), next()),
                out_ln: (next(), next()),
            })
            .collect();
        (word, pos, typ, emb_ln, layers)
    }

    fn packed(&self, segs: u64, attention: PackedAttention) -> Result<Value> {
        let (r, l) = (self.batch, self.seq);
        let (word, pos, typ, emb_ln, layers) = self.weights();
        let ids = self.g.parameter(Dtype::S32, &[r, l]);
        let positions = self.g.parameter(Dtype::S32, &[r, l]);
        let bias = match attention {
            PackedAttention::Dense => Some(self.g.parameter(Dtype::F32, &[r, l, l])),
            PackedAttention::Segments => None,
        };
        let pool = self.g.parameter(Dtype::F32, &[r, segs, l]);
        let g = &self.g;
        let x = g.take(word, ids)?; // [R,L,H]
        let typ0 = g.slice(typ, &[0, 0], &[1, HIDDEN], &[1, 1])?;
        let typ0 = g.reshape(typ0, &[HIDDEN])?;
        let x = g.add(x, typ0)?;
        let p = g.take(pos, positions)?; // [R,L,H]
        let x = g.add(x, p)?;
        let mut x = self.layer_norm(x, emb_ln)?;
        let attention = match bias {
            Some(bias) => {
                Attention::Dense(g.broadcast_in_dim(bias, &[r, HEADS, l, l], &[0, 2, 3])?)
            }
            None => Attention::Segments(positions),
        };
        for layer in &layers {
            x = self.layer(x, layer, attention)?;
        }
        // mean[r,s,:] = Σ_t pool[r,s,t] x[r,t,:]
        let mean = g.dot_general(pool, x, ((&[2], &[1]), (&[0], &[0])), Precision::Highest)?;
        let sq = g.mul(mean, mean)?;
        let norm = g.reduce_sum(sq, &[2])?;
        let norm = g.sqrt(norm)?;
        let eps = g.scalar(NORMALIZE_EPS);
        let norm = g.maximum(norm, eps)?;
        let norm = g.broadcast_in_dim(norm, &[r, segs, HIDDEN], &[0, 1])?;
        Ok(g.div(mean, norm)?)
    }

    fn encoder(&self) -> Result<Value> {
        let (bsz, s) = (self.batch, self.seq);
        // Parameters, in the order of `encoder_inputs` (weight_specs order).
        let (word, pos, typ, emb_ln, layers) = self.weights();
        let ids = self.g.parameter(Dtype::S32, &[bsz, s]);
        let mask = self.g.parameter(Dtype::S32, &[bsz, s]);
        let g = &self.g;

        // Embeddings: word + token type (all 0) + position (0..seq), then LayerNorm.
        let x = g.take(word, ids)?; // [B,S,H]
        let typ0 = g.slice(typ, &[0, 0], &[1, HIDDEN], &[1, 1])?;
        let typ0 = g.reshape(typ0, &[HIDDEN])?;
        let x = g.add(x, typ0)?;
        let pos = g.slice(pos, &[0, 0], &[s, HIDDEN], &[1, 1])?; // [S,H]
        let x = g.add(x, pos)?;
        let mut x = self.layer_norm(x, emb_ln)?;

        // Additive attention bias over keys: 0 for real tokens, finfo(f32).min for padding
        // (what transformers does: (1 - mask) * min), shaped [B, heads, S_query, S_key].
        let maskf = g.convert(mask, Dtype::F32)?; // [B,S]
        let one = g.scalar(1.0f32);
        let inv = g.sub(one, maskf)?;
        let min = g.scalar(f32::MIN);
        let bias = g.mul(inv, min)?;
        let bias = g.broadcast_in_dim(bias, &[bsz, HEADS, s, s], &[0, 3])?;

        for layer in &layers {
            x = self.layer(x, layer, Attention::Dense(bias))?;
        }

        // Mean pooling over real tokens, then L2 normalization.
        let m3 = g.broadcast_in_dim(maskf, &[bsz, s, HIDDEN], &[0, 1])?;
        let xm = g.mul(x, m3)?;
        let summed = g.reduce_sum(xm, &[1])?; // [B,H]
        let count = g.reduce_sum(maskf, &[1])?; // [B]
        let floor = g.scalar(POOL_MIN_COUNT);
        let count = g.maximum(count, floor)?;
        let count = g.broadcast_in_dim(count, &[bsz, HIDDEN], &[0])?;
        let mean = g.div(summed, count)?;
        let sq = g.mul(mean, mean)?;
        let norm = g.reduce_sum(sq, &[1])?;
        let norm = g.sqrt(norm)?;
        let eps = g.scalar(NORMALIZE_EPS);
        let norm = g.maximum(norm, eps)?;
        let norm = g.broadcast_in_dim(norm, &[bsz, HIDDEN], &[0])?;
        Ok(g.div(mean, norm)?)
    }

    /// One BERT layer (post-LayerNorm): self-attention, residual + LN, GELU MLP, residual + LN.
    fn layer(&self, x: Value, w: &Layer, attention: Attention) -> Result<Value> {
        let (bsz, s) = (self.batch, self.seq);
        let heads = [bsz, s, HEADS, HEAD_DIM];
        let g = &self.g;
        // The 1/sqrt(d) of the scores is applied to q ([B,S,384]) rather than to the scores
        // ([B,h,S,S], 4 times larger for 128-token rows): XLA materializes the scale as a
        // full-size constant for the fused attention, read again in every layer.
        let q = self.linear(x, w.q)?;
        let scale = g.scalar(1.0 / (HEAD_DIM as f32).sqrt());
        let q = g.mul(q, scale)?;
        let k = self.linear(x, w.k)?;
        let v = self.linear(x, w.v)?;
        let q = g.reshape(q, &heads)?; // [B,S,h,d]
        let k = g.reshape(k, &heads)?;
        let v = g.reshape(v, &heads)?;
        let ctx = match attention {
            Attention::Dense(bias) => {
                // scores[b,h,i,j] = (q[b,i,h,:] / sqrt(d))·k[b,j,h,:]
                let scores =
                    g.dot_general(q, k, ((&[3], &[3]), (&[0, 2], &[0, 2])), Precision::Highest)?;
                let scores = g.add(scores, bias)?;
                let probs = self.softmax_last(scores)?; // [B,h,S,S]
                // ctx[b,h,i,:] = Σ_j probs[b,h,i,j] v[b,j,h,:]
                let ctx = g.dot_general(
                    probs,
                    v,
                    ((&[3], &[1]), (&[0, 1], &[0, 2])),
                    Precision::Highest,
                )?;
                g.transpose(ctx, &[0, 2, 1, 3])? // [B,S,h,d]
            }
            Attention::Segments(positions) => g.segment_attention(q, k, v, positions)?,
        };
        let ctx = g.reshape(ctx, &[bsz, s, HIDDEN])?;
        let a = self.linear(ctx, w.attn_out)?;
        let a = g.add(a, x)?;
        let x = self.layer_norm(a, w.attn_ln)?;

        let h = self.linear(x, w.inter)?;
        let h = self.gelu(h)?;
        let o = self.linear(h, w.out)?;
        let o = g.add(o, x)?;
        self.layer_norm(o, w.out_ln)
    }

    /// PyTorch `Linear`: `x·Wᵀ + b` with `W` as `[out, in]`, contracting x's last axis.
    fn linear(&self, x: Value, (w, b): (Value, Value)) -> Result<Value> {
        let last = self.g.dims(x).len() as u64 - 1;
        let y = self
            .g
            .dot_general(x, w, ((&[last], &[1]), (&[], &[])), Precision::Highest)?;
        Ok(self.g.add(y, b)?)
    }

    /// LayerNorm over the last axis: `(x - mean) / sqrt(var + eps) * gamma + beta`, with the
    /// biased variance.
    fn layer_norm(&self, x: Value, (gamma, beta): (Value, Value)) -> Result<Value> {
        let g = &self.g;
        let dims = g.dims(x);
        let last = dims.len() as u64 - 1;
        let keep: Vec<u64> = (0..last).collect();
        let n = g.scalar(1.0f32 / dims[last as usize] as f32);
        let sum = g.reduce_sum(x, &[last])?;
        let mean = g.mul(sum, n)?;
        let mean = g.broadcast_in_dim(mean, &dims, &keep)?;
        let xc = g.sub(x, mean)?;
        let sq = g.mul(xc, xc)?;
        let var = g.reduce_sum(sq, &[last])?;
        let var = g.mul(var, n)?;
        let eps = g.scalar(LAYER_NORM_EPS);
        let var = g.add(var, eps)?;
        let inv = g.rsqrt(var)?;
        let inv = g.broadcast_in_dim(inv, &dims, &keep)?;
        let y = g.mul(xc, inv)?;
        let y = g.mul(y, gamma)?;
        Ok(g.add(y, beta)?)
    }

    /// Softmax over the last axis, shifted by the row maximum.
    fn softmax_last(&self, x: Value) -> Result<Value> {
        let g = &self.g;
        let dims = g.dims(x);
        let last = dims.len() as u64 - 1;
        let keep: Vec<u64> = (0..last).collect();
        let m = g.reduce_max(x, &[last])?;
        let m = g.broadcast_in_dim(m, &dims, &keep)?;
        let z = g.sub(x, m)?;
        let e = g.exp(z)?;
        let s = g.reduce_sum(e, &[last])?;
        let s = g.broadcast_in_dim(s, &dims, &keep)?;
        Ok(g.div(e, s)?)
    }

    /// Exact GELU: `0.5 · x · (1 + erf(x / √2))` (`hidden_act = "gelu"` in transformers).
    fn gelu(&self, x: Value) -> Result<Value> {
        let g = &self.g;
        let inv_sqrt2 = g.scalar(std::f32::consts::FRAC_1_SQRT_2);
        let t = g.mul(x, inv_sqrt2)?;
        let t = g.erf(t)?;
        let one = g.scalar(1.0f32);
        let t = g.add(t, one)?;
        let half = g.scalar(0.5f32);
        let y = g.mul(x, half)?;
        Ok(g.mul(y, t)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_order_and_count() {
        let w = weight_specs();
        // 5 embedding tensors + 16 per layer.
        assert_eq!(w.len(), 5 + 16 * LAYERS);
        assert_eq!(w[0].name, "embeddings.word_embeddings.weight");
        assert_eq!(w[0].dims, [VOCAB, HIDDEN]);
        assert_eq!(w[5].name, "encoder.layer.0.attention.self.query.weight");
        assert_eq!(w[5].dims, [HIDDEN, HIDDEN]);
        let last = w.last().unwrap();
        assert_eq!(last.name, "encoder.layer.5.output.LayerNorm.bias");
        let inter = w
            .iter()
            .find(|w| w.name == "encoder.layer.3.intermediate.dense.weight")
            .unwrap();
        assert_eq!(inter.dims, [INTERMEDIATE, HIDDEN]);
        let out = w
            .iter()
            .find(|w| w.name == "encoder.layer.3.output.dense.weight")
            .unwrap();
        assert_eq!(out.dims, [HIDDEN, INTERMEDIATE]);
        let inputs = encoder_inputs();
        assert_eq!(inputs.len(), w.len() + 2);
        assert_eq!(inputs[w.len()], EncoderInput::InputIds);
        assert_eq!(inputs[w.len() + 1], EncoderInput::AttentionMask);
    }
}
