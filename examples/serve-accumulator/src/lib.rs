//! serve-accumulator: a stateful test model for `tpubox serve`'s sequence batching, in the shape
//! Triton's stateful models have: the state lives in the model instance, and the server tells
//! the model, through control inputs it fills itself, which sequence each batch row belongs to.
//!
//! Metadata (`max-batch-size` 8), every tensor `[B, 1]`:
//! - inputs `INPUT` (INT32: the value to add), `START`, `END`, `READY` (INT32, 0 or 1) and
//!   `CORRID` (UINT64: the sequence's correlation id);
//! - output `OUTPUT` (INT64): for each row whose `READY` is 1, the sum of the `INPUT`s of its
//!   sequence so far, this one included (`START` resets it to this row's value; after `END` the
//!   sequence's state is dropped); 0 for a row that is not ready.
//!
//! Test hook: an `INPUT` of -999 panics, so the instance traps and the server must replace it;
//! the sequences it held lose their state, which the server must report.
//!
//! Build: `cargo build --release --target wasm32-wasip2 -p serve-accumulator`. Configuration:
//! `config.toml` next to this crate's `Cargo.toml`.

use std::cell::RefCell;
use std::collections::HashMap;

use tpubox_guest::Error;
use tpubox_guest::model::{
    Datatype, Model, ModelMetadata, TensorData, TensorMetadata, WitError, input,
};

/// Largest batch one `infer` call takes.
pub const MAX_BATCH_SIZE: u32 = 8;

/// The `INPUT` value that makes `infer` panic (test hook).
pub const TRAP: i32 = -999;

thread_local! {
    /// The running sum of each live sequence, by correlation id: the instance's state.
    static SUMS: RefCell<HashMap<u64, i64>> = RefCell::new(HashMap::new());
}

/// The `[B, 1]` column of `name` as `B` values, each `width` bytes.
fn column<'a>(
    inputs: &'a [TensorData],
    name: &str,
    d: Datatype,
) -> Result<Vec<&'a [u8]>, WitError> {
    let t = input(inputs, name)?;
    if t.datatype != d || t.shape.len() != 2 || t.shape[1] != 1 {
        return Err(Error::invalid_argument(format!(
            "{name} must be {d} [B, 1], not {} {:?}",
            t.datatype, t.shape
        ))
        .into());
    }
    let width = d.size_bytes().unwrap_or(1);
    if t.data.len() != t.shape[0] as usize * width {
        return Err(
            Error::invalid_argument(format!("{name}: data does not match its shape")).into(),
        );
    }
    Ok(t.data.chunks_exact(width).collect())
}

fn i32_of(b: &[u8]) -> i32 {
    i32::from_le_bytes(b.try_into().unwrap_or([0; 4]))
}

struct Accumulator;

impl Model for Accumulator {
    fn metadata() -> ModelMetadata {
        let col = |n: &str, d| TensorMetadata::new(n, d, &[1]);
        ModelMetadata {
            inputs: vec![
                col("INPUT", Datatype::Int32),
                col("START", Datatype::Int32),
                col("END", Datatype::Int32),
                col("READY", Datatype::Int32),
                col("CORRID", Datatype::Uint64),
            ],
            outputs: vec![col("OUTPUT", Datatype::Int64)],
            max_batch_size: MAX_BATCH_SIZE,
        }
    }

    fn infer(inputs: Vec<TensorData>) -> Result<Vec<TensorData>, WitError> {
        let value = column(&inputs, "INPUT", Datatype::Int32)?;
        let start = column(&inputs, "START", Datatype::Int32)?;
        let end = column(&inputs, "END", Datatype::Int32)?;
        let ready = column(&inputs, "READY", Datatype::Int32)?;
        let corrid = column(&inputs, "CORRID", Datatype::Uint64)?;
        let rows = value.len();
        if [start.len(), end.len(), ready.len(), corrid.len()] != [rows; 4] {
            return Err(
                Error::invalid_argument("the control inputs' batches differ from INPUT's").into(),
            );
        }
        let mut out = Vec::with_capacity(rows * 8);
        SUMS.with(|sums| {
            let mut sums = sums.borrow_mut();
            for r in 0..rows {
                let v = i32_of(value[r]);
                if v == TRAP {
                    panic!("INPUT is {TRAP}: trapping on purpose (test hook)");
                }
                let id = u64::from_le_bytes(corrid[r].try_into().unwrap_or([0; 8]));
                let sum = if i32_of(ready[r]) == 0 {
                    0
                } else {
                    let s = sums.entry(id).or_insert(0);
                    if i32_of(start[r]) == 1 {
                        *s = 0;
                    }
                    *s += i64::from(v);
                    let now = *s;
                    if i32_of(end[r]) == 1 {
                        sums.remove(&id);
                    }
                    now
                };
                out.extend_from_slice(&sum.to_le_bytes());
            }
        });
        Ok(vec![TensorData {
            name: "OUTPUT".into(),
            datatype: Datatype::Int64,
            shape: vec![rows as u64, 1],
            data: out,
        }])
    }
}

tpubox_guest::export_model!(Accumulator);
