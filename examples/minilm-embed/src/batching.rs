//! Padding policy: every device call has a batch size and a sequence length drawn from fixed
//! sets, so each (batch, seq) pair compiles once per process (and once per machine with the
//! host's compile cache).
//!
//! * Sequence buckets: every 8 tokens up to 64, every 16 up to 128, every 32 up to 256 (the
//!   smallest that holds the longest sentence of the call). Power-of-two buckets padded a
//!   realistic set (median 13 words) to 1.55× its tokens; these pad it to about 1.2×, close
//!   to what padding each call to its own longest sentence gives, for about twice the
//!   programs (7 instead of 4 for 1,024 such sentences).
//! * Batch buckets: 1, 8 or 32 rows (the smallest that holds the call's sentences). Sentences
//!   are sorted by token count and cut into calls of at most 32, so that sentences of similar
//!   length share a call and padding stays small.
//!
//! Padding never reaches the results: padded keys get a `finfo(f32).min` attention bias and
//! pooling averages only real tokens; padded rows are dropped.

use anyhow::{Result, bail};

/// Sequence-length buckets, ascending.
pub const SEQ_BUCKETS: [usize; 16] = [
    8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
];
/// Batch-size buckets, ascending; the last is the most rows in one call.
pub const BATCH_BUCKETS: [usize; 3] = [1, 8, 32];
/// Id of `[PAD]`.
pub const PAD_ID: i32 = 0;

/// The smallest sequence bucket that holds `len` tokens.
pub fn seq_bucket(len: usize) -> Result<usize> {
    match SEQ_BUCKETS.iter().find(|&&b| b >= len) {
        Some(&b) => Ok(b),
        None => bail!(
            "{len} tokens is longer than the largest bucket ({})",
            SEQ_BUCKETS[SEQ_BUCKETS.len() - 1]
        ),
    }
}

/// The smallest batch bucket that holds `rows` rows (`rows` ≤ the largest bucket).
pub fn batch_bucket(rows: usize) -> Result<usize> {
    match BATCH_BUCKETS.iter().find(|&&b| b >= rows) {
        Some(&b) => Ok(b),
        None => bail!(
            "{rows} rows is more than the largest batch ({})",
            BATCH_BUCKETS[BATCH_BUCKETS.len() - 1]
        ),
    }
}

/// One device call: which sentences it embeds, and its padded shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Indices of the sentences, row by row (rows past `indices.len()` are padding).
    pub indices: Vec<usize>,
    /// Padded batch size (a [`BATCH_BUCKETS`] entry).
    pub batch: usize,
    /// Padded sequence length (a [`SEQ_BUCKETS`] entry).
    pub seq: usize,
}

/// Splits sentences with token counts `lengths` into device calls.
pub fn plan(lengths: &[usize]) -> Result<Vec<Chunk>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| lengths[i]); // stable: equal lengths keep their input order
    let max_rows = BATCH_BUCKETS[BATCH_BUCKETS.len() - 1];
    order
        .chunks(max_rows)
        .map(|idx| {
            let longest = idx.iter().map(|&i| lengths[i]).max().unwrap_or(1);
            Ok(Chunk {
                indices: idx.to_vec(),
                batch: batch_bucket(idx.len())?,
                seq: seq_bucket(longest)?,
            })
        })
        .collect()
}

/// Row-major `input_ids` and `attention_mask` (both `[chunk.batch, chunk.seq]`) for `chunk`,
/// from each sentence's token ids.
pub fn pack(chunk: &Chunk, ids: &[Vec<i32>]) -> Result<(Vec<i32>, Vec<i32>)> {
    let n = chunk.batch * chunk.seq;
    let mut input_ids = vec![PAD_ID; n];
    let mut mask = vec![0i32; n];
    if chunk.indices.len() > chunk.batch {
        bail!(
            "{} sentences do not fit a batch of {}",
            chunk.indices.len(),
            chunk.batch
        );
    }
    for (row, &i) in chunk.indices.iter().enumerate() {
        let toks = &ids[i];
        if toks.len() > chunk.seq {
            bail!(
                "sentence {i} has {} tokens, over the chunk's {}",
                toks.len(),
                chunk.seq
            );
        }
        let at = row * chunk.seq;
        input_ids[at..at + toks.len()].copy_from_slice(toks);
        mask[at..at + toks.len()].fill(1);
    }
    Ok((input_ids, mask))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_buckets() {
        assert_eq!(seq_bucket(1).unwrap(), 8);
        assert_eq!(seq_bucket(9).unwrap(), 16);
        assert_eq!(seq_bucket(17).unwrap(), 24);
        assert_eq!(seq_bucket(64).unwrap(), 64);
        assert_eq!(seq_bucket(65).unwrap(), 80);
        assert_eq!(seq_bucket(129).unwrap(), 160);
        assert_eq!(seq_bucket(256).unwrap(), 256);
        assert!(seq_bucket(257).is_err());
        // Padding per sentence is below 8 tokens up to 64, 16 up to 128, 32 up to 256.
        for len in 1..=256usize {
            let pad = seq_bucket(len).unwrap() - len;
            assert!(
                pad < if len <= 64 {
                    8
                } else if len <= 128 {
                    16
                } else {
                    32
                }
            );
        }
    }

    #[test]
    fn batch_buckets() {
        assert_eq!(batch_bucket(1).unwrap(), 1);
        assert_eq!(batch_bucket(2).unwrap(), 8);
        assert_eq!(batch_bucket(8).unwrap(), 8);
        assert_eq!(batch_bucket(9).unwrap(), 32);
        assert_eq!(batch_bucket(32).unwrap(), 32);
        assert!(batch_bucket(33).is_err());
    }

    #[test]
    fn plan_sorts_and_splits() {
        let c = plan(&[9]).unwrap();
        assert_eq!(
            c,
            vec![Chunk {
                indices: vec![0],
                batch: 1,
                seq: 16
            }]
        );

        let c = plan(&[40, 5, 12]).unwrap();
        assert_eq!(
            c,
            vec![Chunk {
                indices: vec![1, 2, 0],
                batch: 8,
                seq: 40
            }]
        );

        // 40 sentences: 32 shortest, then 8 longest.
        let lengths: Vec<usize> = (0..40).map(|i| 3 + (i * 7) % 200).collect();
        let c = plan(&lengths).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].batch, c[1].batch), (32, 8));
        assert_eq!(c[0].indices.len() + c[1].indices.len(), 40);
        let longest0 = c[0].indices.iter().map(|&i| lengths[i]).max().unwrap();
        let shortest1 = c[1].indices.iter().map(|&i| lengths[i]).min().unwrap();
        assert!(longest0 <= shortest1);
        assert_eq!(c[1].seq, 224);
        let mut all: Vec<usize> = c.iter().flat_map(|c| c.indices.clone()).collect();
        all.sort();
        assert_eq!(all, (0..40).collect::<Vec<_>>());
        assert!(plan(&[]).unwrap().is_empty());
        assert!(plan(&[300]).is_err());
    }

    #[test]
    fn pack_pads_and_masks() {
        let ids = vec![vec![101, 7, 102], vec![101, 102]];
        let chunk = Chunk {
            indices: vec![1, 0],
            batch: 8,
            seq: 16,
        };
        let (x, m) = pack(&chunk, &ids).unwrap();
        assert_eq!(x.len(), 8 * 16);
        assert_eq!(&x[..3], &[101, 102, 0]);
        assert_eq!(&m[..3], &[1, 1, 0]);
        assert_eq!(&x[16..20], &[101, 7, 102, 0]);
        assert_eq!(&m[16..20], &[1, 1, 1, 0]);
        assert!(x[32..].iter().all(|&v| v == PAD_ID));
        assert!(m[32..].iter().all(|&v| v == 0));
        let small = Chunk {
            indices: vec![0],
            batch: 1,
            seq: 2,
        };
        assert!(pack(&small, &ids).is_err());
    }
}
