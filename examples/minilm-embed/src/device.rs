//! The device side of embedding: the weights taken from the host's weight set
//! ([`load_weights`]) and the padded, bucketed encoder calls ([`embed`]), shared by the
//! `minilm-embed` command guest and the `minilm-serve` model guest.
//!
//! These call the host, so they work only in a guest (`wasm32-wasip2`); natively the SDK's
//! imports are stubs that panic.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use anyhow::{Context, Result, bail};
use tpubox_guest::weights::WeightSet;
use tpubox_guest::{Executable, Tensor, TensorSpec};

use crate::batching::{PACK_LEN, PACK_ROWS, PACK_SEGS, pack_packed, pack_rows};
use crate::{
    Chunk, EncoderInput, HIDDEN, PackedAttention, build_encoder, build_packed_encoder_mlir,
    encoder_inputs, pack, plan,
};

/// The encoder compiled for each (batch, seq) bucket used so far; the keys [`PACKED_SEGMENTS`]
/// and [`PACKED_DENSE`] are the packed encoder (`PACK_ROWS` × `PACK_LEN`, up to `PACK_SEGS`
/// sentences per row) with each [`PackedAttention`].
pub type Compiled = HashMap<(usize, usize), Executable>;

/// [`Compiled`]'s key of the packed encoder with [`PackedAttention::Segments`].
pub const PACKED_SEGMENTS: (usize, usize) = (0, 0);
/// [`Compiled`]'s key of the packed encoder with [`PackedAttention::Dense`].
pub const PACKED_DENSE: (usize, usize) = (0, 1);

/// The packed encoder, compiled on first use: segment attention on the CPU platform, unless
/// the host cannot compile it (a CPU plugin without tpubox's handler: `not-found`), then
/// dense attention.
fn packed_encoder(compiled: &mut Compiled) -> Result<(&Executable, PackedAttention)> {
    let build = |attention| -> Result<Executable> {
        let mlir = build_packed_encoder_mlir(
            PACK_ROWS as u64,
            PACK_LEN as u64,
            PACK_SEGS as u64,
            attention,
        )?;
        tpubox_guest::compile_mlir(&mlir)
            .map_err(anyhow::Error::from)
            .context("cannot compile the packed encoder")
    };
    if !compiled.contains_key(&PACKED_SEGMENTS) && !compiled.contains_key(&PACKED_DENSE) {
        let segments = (PackedAttention::for_platform(&tpubox_guest::platform().name)
            == PackedAttention::Segments)
            .then(|| build(PackedAttention::Segments));
        match segments {
            Some(Ok(exe)) => {
                compiled.insert(PACKED_SEGMENTS, exe);
            }
            Some(Err(e))
                if e.downcast_ref::<tpubox_guest::Error>().map(|e| e.kind())
                    != Some(tpubox_guest::ErrorKind::NotFound) =>
            {
                return Err(e);
            }
            _ => {
                compiled.insert(PACKED_DENSE, build(PackedAttention::Dense)?);
            }
        }
    }
    Ok(match compiled.get(&PACKED_SEGMENTS) {
        Some(exe) => (exe, PackedAttention::Segments),
        None => (&compiled[&PACKED_DENSE], PackedAttention::Dense),
    })
}

/// The encoder's weights, taken from the host's weight set `set_name` (device-resident
/// handles), in the order of [`encoder_inputs`].
///
/// Errors: the set cannot be opened, lacks a weight, or holds one of another dtype or shape
/// (the underlying [`tpubox_guest::Error`] stays reachable with `downcast_ref`).
pub fn load_weights(set_name: &str) -> Result<Vec<Tensor>> {
    let set = WeightSet::open(set_name).with_context(|| {
        format!("cannot open weight set {set_name:?} (run the host with --weights {set_name}=MODELDIR/model.safetensors)")
    })?;
    let mut tensors = Vec::new();
    for input in encoder_inputs() {
        let EncoderInput::Weight(w) = input else {
            continue;
        };
        let want = TensorSpec::new(w.dtype(), &w.dims);
        let got = set
            .spec(&w.name)
            .with_context(|| format!("weight set {set_name:?} is not all-MiniLM-L6-v2"))?;
        if got != want {
            bail!(
                "weight {} in set {set_name:?} is {got}, expected {want}",
                w.name
            );
        }
        tensors.push(set.get(&w.name)?);
    }
    Ok(tensors)
}

/// Embeds every sentence (token ids given; each at most [`crate::MAX_SEQ_LEN`] tokens) into a
/// normalized `HIDDEN`-wide vector, in input order: packed calls where they compute less
/// (see [`crate::batching`]), the rest in (batch, seq) buckets ([`plan`]); each program is
/// compiled once into `compiled`.
///
/// Errors: compiling or running the encoder (the host's [`tpubox_guest::Error`] stays
/// reachable with `downcast_ref`), or a result of the wrong size.
pub fn embed(
    weights: &[Tensor],
    ids: &[Vec<i32>],
    compiled: &mut Compiled,
) -> Result<Vec<Vec<f32>>> {
    let hidden = HIDDEN as usize;
    let mut out = vec![Vec::new(); ids.len()];
    let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
    // Packed calls where they cost less than the buckets would for the same sentences (a
    // full call always does; a small request does not), the rest (and sentences longer than
    // a row) through the buckets.
    let (rows, long) = pack_rows(&lengths, PACK_LEN, PACK_SEGS);
    let mut leftover = Vec::new();
    for call in rows.chunks(PACK_ROWS) {
        let members: Vec<usize> = call.iter().flatten().copied().collect();
        let sub: Vec<usize> = members.iter().map(|&i| lengths[i]).collect();
        let bucketed: usize = plan(&sub)?.iter().map(|c| c.batch * c.seq).sum();
        if bucketed < PACK_ROWS * PACK_LEN {
            leftover.extend(members);
            continue;
        }
        let (exe, attention) = packed_encoder(compiled)?;
        let (tok, pos, bias, pool) = pack_packed(call, ids, PACK_ROWS, PACK_LEN, PACK_SEGS);
        let (r, l, sg) = (PACK_ROWS as u64, PACK_LEN as u64, PACK_SEGS as u64);
        let mut t = vec![
            Tensor::from_slice(&tok, &[r, l])?,
            Tensor::from_slice(&pos, &[r, l])?,
        ];
        if attention == PackedAttention::Dense {
            t.push(Tensor::from_slice(&bias, &[r, l, l])?);
        }
        t.push(Tensor::from_slice(&pool, &[r, sg, l])?);
        let mut args: Vec<&Tensor> = weights.iter().collect();
        args.extend(t.iter());
        let result = exe.call(&args)?;
        let emb: Vec<f32> = result
            .first()
            .context("the packed encoder returned nothing")?
            .to_vec()?;
        if emb.len() != PACK_ROWS * PACK_SEGS * hidden {
            bail!("the packed encoder returned {} values", emb.len());
        }
        for (row, m) in call.iter().enumerate() {
            for (seg, &i) in m.iter().enumerate() {
                let at = (row * PACK_SEGS + seg) * hidden;
                out[i] = emb[at..at + hidden].to_vec();
            }
        }
    }
    // Leftovers and long sentences are bucketed apart: mixed, one long sentence would pad a
    // whole chunk of short ones to its length.
    let mut chunks = Vec::new();
    for group in [leftover, long] {
        let group_lengths: Vec<usize> = group.iter().map(|&i| lengths[i]).collect();
        for mut chunk in plan(&group_lengths)? {
            chunk.indices = chunk.indices.iter().map(|&k| group[k]).collect();
            chunks.push(chunk);
        }
    }
    for chunk in chunks {
        let Chunk { batch, seq, .. } = chunk;
        let exe = match compiled.entry((batch, seq)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let enc = build_encoder(batch as u64, seq as u64)?;
                let exe = enc.graph.compile(&[enc.output]).with_context(|| {
                    format!("cannot compile the encoder for batch {batch} × seq {seq}")
                })?;
                e.insert(exe)
            }
        };
        let (input_ids, mask) = pack(&chunk, ids)?;
        let dims = [batch as u64, seq as u64];
        let input_ids = Tensor::from_slice(&input_ids, &dims)?;
        let mask = Tensor::from_slice(&mask, &dims)?;
        let mut args: Vec<&Tensor> = weights.iter().collect();
        args.push(&input_ids);
        args.push(&mask);
        let result = exe.call(&args)?;
        let emb: Vec<f32> = result
            .first()
            .context("the encoder returned nothing")?
            .to_vec()?;
        if emb.len() != batch * hidden {
            bail!(
                "the encoder returned {} values, expected {}",
                emb.len(),
                batch * hidden
            );
        }
        for (row, &i) in chunk.indices.iter().enumerate() {
            out[i] = emb[row * hidden..(row + 1) * hidden].to_vec();
        }
    }
    Ok(out)
}
