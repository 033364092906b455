//! tpubox-triton-repeat: a stand-in for `repeat_int32`, the decoupled model of Triton's
//! repeat backend example (`src/backends/backend/examples/repeat.cc` in Triton's tree), which
//! `simple_grpc_custom_repeat.py` (vendored unchanged in `tests/serve/triton_examples/`)
//! streams; `tests/serve/test_triton_examples.py` serves it.
//!
//! Metadata (no batch dimension; the configuration says
//! `model_transaction_policy { decoupled: true }`):
//! - inputs `IN` (INT32 `[-1]`: the values to send back), `DELAY` (UINT32 `[-1]`, as many
//!   elements as `IN`) and `WAIT` (UINT32 `[1]`);
//! - outputs, one response per element `i` of `IN`, in order: `OUT` (INT32 `[1]`: `IN[i]`)
//!   and `IDX` (UINT32 `[1]`: `i`); then the end of the stream.
//!
//! Unlike Triton's repeat backend, this stand-in ignores the times: it does not sleep
//! `DELAY[i]` milliseconds before response `i`, nor `WAIT` milliseconds before releasing the
//! request (the responses' values and order are what the example checks; the server's
//! back-pressure already paces a stream to its reader). `DELAY` must still hold as many
//! elements as `IN`, as Triton's backend requires.
//!
//! Build: `cargo build --release --target wasm32-wasip2 -p tpubox-triton-repeat`
//! (`target/wasm32-wasip2/release/tpubox_triton_repeat.wasm`). The configuration is
//! `tests/serve/triton_repository/repeat_int32/config.pbtxt`.

use std::cell::Cell;

use tpubox_guest::model::{self as sdk, Datatype, TensorMetadata, WitError, input};
use tpubox_guest::{Error, ErrorKind};
use tpubox_guest_decoupled::{
    Decoupled, Generation, GuestGeneration, Model, ModelMetadata, TensorData,
};

/// The model: its metadata, and a [`Repeat`] per request.
pub struct RepeatInt32;

/// One request's responses: the values of `IN` and the index of the next one to send.
pub struct Repeat {
    values: Vec<i32>,
    next: Cell<usize>,
}

impl Model for RepeatInt32 {
    fn metadata() -> ModelMetadata {
        sdk::ModelMetadata {
            inputs: vec![
                TensorMetadata::new("IN", Datatype::Int32, &[-1]),
                TensorMetadata::new("DELAY", Datatype::Uint32, &[-1]),
                TensorMetadata::new("WAIT", Datatype::Uint32, &[1]),
            ],
            outputs: vec![
                TensorMetadata::new("OUT", Datatype::Int32, &[1]),
                TensorMetadata::new("IDX", Datatype::Uint32, &[1]),
            ],
            max_batch_size: 0,
        }
        .into()
    }

    fn infer(_: Vec<TensorData>) -> Result<Vec<TensorData>, WitError> {
        Err(Error::new(
            ErrorKind::Unsupported,
            "repeat_int32 is a decoupled model: stream it (ModelStreamInfer, generate_stream)",
        )
        .into())
    }
}

impl Decoupled for RepeatInt32 {
    type Generation = Repeat;

    fn start(inputs: Vec<TensorData>) -> Result<Generation, WitError> {
        let inputs: Vec<sdk::TensorData> = inputs.into_iter().map(Into::into).collect();
        let values = input(&inputs, "IN")?.to_vec::<i32>()?;
        let delays = input(&inputs, "DELAY")?.to_vec::<u32>()?;
        if delays.len() != values.len() {
            return Err(Error::invalid_argument(format!(
                "expected IN and DELAY to have the same shape: IN has {} elements, DELAY {}",
                values.len(),
                delays.len()
            ))
            .into());
        }
        Ok(Generation::new(Repeat {
            values,
            next: Cell::new(0),
        }))
    }
}

impl GuestGeneration for Repeat {
    fn next(&self) -> Result<Option<Vec<TensorData>>, WitError> {
        let i = self.next.get();
        let Some(&v) = self.values.get(i) else {
            return Ok(None);
        };
        self.next.set(i + 1);
        Ok(Some(vec![
            sdk::TensorData::from_slice("OUT", &[v], &[1])?.into(),
            sdk::TensorData::from_slice("IDX", &[i as u32], &[1])?.into(),
        ]))
    }
}

tpubox_guest_decoupled::export_decoupled_model!(RepeatInt32);
