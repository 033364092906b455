//! serve-dtypes: a test model for `tpubox serve` that takes every Open Inference Protocol
//! datatype and gives it back reversed.
//!
//! Metadata (`max-batch-size` 8): for each datatype DT of `BOOL`, `UINT8`, `UINT16`, `UINT32`,
//! `UINT64`, `INT8`, `INT16`, `INT32`, `INT64`, `FP16`, `BF16`, `FP32`, `FP64`, `BYTES`, one
//! input `INPUT_<DT>` and one output `OUTPUT_<DT>` of that datatype and shape `[-1]` (batch
//! dimension excluded, so a request's tensor is `[B, N]`, B ≤ 8), in that order.
//!
//! `OUTPUT_<DT>` is `INPUT_<DT>` reversed along its last axis, with the same shape:
//!
//! * The 13 fixed-size datatypes go through the device: the input's bytes become a device
//!   tensor of the matching dtype (`BOOL` → `pred`, `UINT8` → `u8`, …, `BF16` → `bf16`), a
//!   StableHLO program `stablehlo.reverse` (dimensions = [last axis]) runs on it, and the
//!   result is read back. Each (dtype, shape) compiles once; the executable is kept in the
//!   instance for later requests of that shape. A tensor with no elements (some dimension 0)
//!   is returned as it came, without a device call.
//! * `BYTES` is reversed in the guest, element-wise (each element's bytes stay as they are).
//!
//! Test hook: when the first element of `INPUT_BYTES` is exactly `trap!`, `infer` panics, so
//! the instance traps; the host must fail that request alone and replace the instance.
//!
//! Build: `cargo build --release --target wasm32-wasip2 -p serve-dtypes` →
//! `target/wasm32-wasip2/release/serve_dtypes.wasm`. Configuration: `config.toml` next to this
//! crate's `Cargo.toml`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::collections::hash_map::Entry;

use tpubox_guest::graph::mlir_type;
use tpubox_guest::model::{
    Datatype, Model, ModelMetadata, TensorData, TensorMetadata, WitError, input,
};
use tpubox_guest::{Error, Executable, Result, TensorSpec, compile_mlir};

/// Largest batch one `infer` call takes.
pub const MAX_BATCH_SIZE: u32 = 8;

/// The first `INPUT_BYTES` element that makes `infer` panic (the replace-on-trap test hook).
pub const TRAP: &[u8] = b"trap!";

thread_local! {
    /// The reverse program compiled for each (dtype, dims) seen so far; kept for the
    /// instance's life.
    static COMPILED: RefCell<HashMap<TensorSpec, Executable>> = RefCell::new(HashMap::new());
}

/// Name of the input of datatype `d`: `INPUT_FP32`, ...
pub fn input_name(d: Datatype) -> String {
    format!("INPUT_{}", d.name())
}

/// Name of the output of datatype `d`: `OUTPUT_FP32`, ...
pub fn output_name(d: Datatype) -> String {
    format!("OUTPUT_{}", d.name())
}

/// StableHLO (MLIR text) of `main(x: spec) -> spec` reversing `x` along its last axis.
///
/// Errors: `invalid-argument` for a scalar (no axis to reverse).
pub fn reverse_program(spec: &TensorSpec) -> Result<String> {
    let Some(axis) = spec.rank().checked_sub(1) else {
        return Err(Error::invalid_argument(format!(
            "cannot reverse a scalar ({spec})"
        )));
    };
    let t = mlir_type(spec);
    Ok(format!(
        "func.func public @main(%x: {t}) -> {t} {{\n  \
           %0 = stablehlo.reverse %x, dims = [{axis}] : {t}\n  \
           func.return %0 : {t}\n}}\n"
    ))
}

/// Reverses a fixed-size tensor along its last axis on the device, compiling the program for
/// its (dtype, shape) on first use.
fn reverse_on_device(t: &TensorData, out_name: String) -> Result<TensorData> {
    if t.shape.is_empty() {
        return Err(Error::invalid_argument(format!(
            "{} is a scalar; it needs at least one dimension",
            t.name
        )));
    }
    if t.element_count()? == 0 {
        return Ok(TensorData {
            name: out_name,
            ..t.clone()
        });
    }
    let x = t.to_tensor()?;
    let y = COMPILED.with_borrow_mut(|compiled| -> Result<_> {
        let exe = match compiled.entry(x.spec().clone()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let exe = compile_mlir(&reverse_program(e.key())?)?;
                e.insert(exe)
            }
        };
        exe.call(&[&x])
    })?;
    let y = y.first().ok_or_else(|| {
        Error::new(
            tpubox_guest::ErrorKind::Internal,
            "reverse returned nothing",
        )
    })?;
    TensorData::from_tensor(out_name, y)
}

/// Reverses the elements of a `BYTES` tensor along its last axis, in the guest.
fn reverse_bytes(t: &TensorData, out_name: String) -> Result<TensorData> {
    let elements = t.bytes_elements()?;
    let Some(&row) = t.shape.last() else {
        return Err(Error::invalid_argument(format!(
            "{} is a scalar; it needs at least one dimension",
            t.name
        )));
    };
    let mut reversed: Vec<&[u8]> = Vec::with_capacity(elements.len());
    if row > 0 {
        for chunk in elements.chunks(row as usize) {
            reversed.extend(chunk.iter().rev());
        }
    }
    TensorData::from_bytes_elements(out_name, &reversed, &t.shape)
}

/// The model: see the crate documentation.
pub struct DtypesModel;

impl Model for DtypesModel {
    fn metadata() -> ModelMetadata {
        let meta = |name: fn(Datatype) -> String| {
            Datatype::ALL
                .iter()
                .map(|&d| TensorMetadata::new(name(d), d, &[-1]))
                .collect()
        };
        ModelMetadata {
            inputs: meta(input_name),
            outputs: meta(output_name),
            max_batch_size: MAX_BATCH_SIZE,
        }
    }

    fn infer(inputs: Vec<TensorData>) -> std::result::Result<Vec<TensorData>, WitError> {
        let bytes = input(&inputs, &input_name(Datatype::Bytes))?;
        if bytes.bytes_elements()?.first() == Some(&TRAP) {
            panic!("INPUT_BYTES starts with \"trap!\": trapping on purpose (test hook)");
        }
        let mut outputs = Vec::with_capacity(Datatype::ALL.len());
        for d in Datatype::ALL {
            let t = input(&inputs, &input_name(d))?;
            if t.datatype != d {
                return Err(Error::invalid_argument(format!(
                    "{} is {}, expected {d}",
                    t.name, t.datatype
                ))
                .into());
            }
            outputs.push(match d {
                Datatype::Bytes => reverse_bytes(t, output_name(d))?,
                _ => reverse_on_device(t, output_name(d))?,
            });
        }
        Ok(outputs)
    }
}

tpubox_guest::export_model!(DtypesModel);

#[cfg(test)]
mod tests {
    use super::*;
    use tpubox_guest::Dtype;

    #[test]
    fn program_text() {
        let p = reverse_program(&TensorSpec::new(Dtype::Bf16, &[2, 5])).unwrap();
        assert!(
            p.contains("stablehlo.reverse %x, dims = [1] : tensor<2x5xbf16>"),
            "{p}"
        );
        let p = reverse_program(&TensorSpec::new(Dtype::Pred, &[3])).unwrap();
        assert!(p.contains("dims = [0] : tensor<3xi1>"), "{p}");
        assert!(reverse_program(&TensorSpec::new(Dtype::F32, &[])).is_err());
    }

    #[test]
    fn bytes_reversed_per_row() {
        let t = TensorData::from_bytes_elements(
            "INPUT_BYTES",
            &["a", "bb", "", "c", "d", "e"],
            &[2, 3],
        )
        .unwrap();
        let r = reverse_bytes(&t, "OUTPUT_BYTES".into()).unwrap();
        assert_eq!(r.name, "OUTPUT_BYTES");
        assert_eq!(r.shape, [2, 3]);
        assert_eq!(
            r.bytes_elements().unwrap(),
            [b"".as_slice(), b"bb", b"a", b"e", b"d", b"c"]
        );
        let empty = TensorData::from_bytes_elements::<&str>("INPUT_BYTES", &[], &[2, 0]).unwrap();
        assert_eq!(reverse_bytes(&empty, "o".into()).unwrap().shape, [2, 0]);
    }

    #[test]
    fn metadata_lists_every_datatype() {
        let m = DtypesModel::metadata();
        assert_eq!(m.max_batch_size, 8);
        assert_eq!(m.inputs.len(), 14);
        assert_eq!(m.inputs[0].name, "INPUT_BOOL");
        assert_eq!(m.outputs[13].name, "OUTPUT_BYTES");
        assert!(m.outputs.iter().all(|o| o.shape == [-1]));
    }
}
