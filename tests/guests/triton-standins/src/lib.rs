//! tpubox-triton-standins: stand-ins for the models of Triton's example model repository
//! (`docs/examples/model_repository` of triton-inference-server/server, and the test models
//! `custom_identity_int32` and `simple_string_dyna_sequence` of its QA suite), so that
//! Triton's own Python client examples (`tests/serve/triton_examples/`, vendored unchanged) run
//! against `tpubox serve` (`tests/serve/test_triton_examples.py`).
//!
//! One component plays every model: which one it is comes from the file
//! [`STANDIN_FILE`] (`/model/standin`; the model directory is granted at `/model`), which
//! holds a [`Behaviour`]'s name, the model's name in Triton's repository. The arithmetic is
//! what the examples check (each example's expected values, read off its source), computed in
//! the guest on the host CPU: no device program is involved.
//!
//! | `standin` | inputs → outputs (dims without the batch dimension) | answer |
//! |---|---|---|
//! | `simple` | `INPUT0`, `INPUT1` INT32 `[16]` → `OUTPUT0`, `OUTPUT1` INT32 `[16]` | sum and difference (wrapping) |
//! | `simple_int8` | the same in INT8 | the same |
//! | `simple_string` | the same in BYTES, each element a decimal integer | the sum and difference as decimal strings |
//! | `simple_identity` | `INPUT0` BYTES `[-1]` → `OUTPUT0` | the input |
//! | `custom_identity_int32` | `INPUT0` INT32 `[-1]` → `OUTPUT0` | the input |
//! | `simple_sequence` | `INPUT`, and the control inputs `START`, `READY` INT32 `[1]` → `OUTPUT` INT32 `[1]` | `INPUT + START` |
//! | `simple_dyna_sequence` | `INPUT`, `START`, `END`, `READY` INT32 `[1]`, `CORRID` UINT64 `[1]` → `OUTPUT` INT32 `[1]` | `INPUT + START`, plus `CORRID` on the sequence's last request |
//! | `simple_string_dyna_sequence` | as `simple_dyna_sequence`, but `CORRID` BYTES `[1]` (the string id, a decimal integer) | the running sum of the sequence's `INPUT`s, plus `int(CORRID)` on its last request |
//! | `densenet_onnx` | `data_0` FP32 `[3, 224, 224]` → `fc6_1` FP32 `[1000]`, no batch dimension | `fc6_1[i]` = the mean of channel `i % 3` |
//!
//! Rows whose `READY` is 0 answer 0. Every batched stand-in declares a `max-batch-size` of
//! [`MAX_BATCH_SIZE`] (64); the configuration narrows it (Triton's `config.pbtxt` files say 8,
//! and `simple_http_model_control.py` reloads `simple` with `max_batch_size` 16).
//!
//! `simple_string_dyna_sequence` keeps each live sequence's sum in the instance, keyed by its
//! correlation id (the server runs a sequence's requests in order, on one instance), and drops
//! it on the sequence's last request.
//!
//! A missing or unknown `standin` makes `metadata` panic (it cannot return an error), so the
//! model fails its load with the reason in the server's log.
//!
//! Build: `cargo build --release --target wasm32-wasip2 -p tpubox-triton-standins`
//! (`target/wasm32-wasip2/release/tpubox_triton_standins.wasm`). The configurations are in
//! `tests/serve/triton_repository/<model>/config.pbtxt`.

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;

use tpubox_guest::Error;
use tpubox_guest::model::{
    Datatype, Model, ModelMetadata, TensorData, TensorMetadata, WitError, input,
};

/// Where the harness writes the behaviour's name (the model directory is granted at `/model`).
pub const STANDIN_FILE: &str = "/model/standin";

/// The `max-batch-size` every batched stand-in declares (the configuration narrows it).
pub const MAX_BATCH_SIZE: u32 = 64;

/// Which model of Triton's example repository the component stands in for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    /// `simple`: INT32 sum and difference.
    Simple,
    /// `simple_int8`: INT8 sum and difference.
    SimpleInt8,
    /// `simple_string`: sum and difference of decimal strings.
    SimpleString,
    /// `simple_identity`: BYTES identity.
    SimpleIdentity,
    /// `custom_identity_int32`: INT32 identity.
    CustomIdentityInt32,
    /// `simple_sequence`: `INPUT + START`.
    SimpleSequence,
    /// `simple_dyna_sequence`: `INPUT + START`, plus `CORRID` at the end.
    SimpleDynaSequence,
    /// `simple_string_dyna_sequence`: a running sum, plus the string `CORRID` at the end.
    SimpleStringDynaSequence,
    /// `densenet_onnx`: per-channel means broadcast to 1000 outputs.
    DensenetOnnx,
}

impl Behaviour {
    /// Every behaviour.
    pub const ALL: [Behaviour; 9] = [
        Behaviour::Simple,
        Behaviour::SimpleInt8,
        Behaviour::SimpleString,
        Behaviour::SimpleIdentity,
        Behaviour::CustomIdentityInt32,
        Behaviour::SimpleSequence,
        Behaviour::SimpleDynaSequence,
        Behaviour::SimpleStringDynaSequence,
        Behaviour::DensenetOnnx,
    ];

    /// Its name in the `standin` file: the model's name in Triton's repository.
    pub const fn name(self) -> &'static str {
        match self {
            Behaviour::Simple => "simple",
            Behaviour::SimpleInt8 => "simple_int8",
            Behaviour::SimpleString => "simple_string",
            Behaviour::SimpleIdentity => "simple_identity",
            Behaviour::CustomIdentityInt32 => "custom_identity_int32",
            Behaviour::SimpleSequence => "simple_sequence",
            Behaviour::SimpleDynaSequence => "simple_dyna_sequence",
            Behaviour::SimpleStringDynaSequence => "simple_string_dyna_sequence",
            Behaviour::DensenetOnnx => "densenet_onnx",
        }
    }

    /// The behaviour named `name` (surrounding white space ignored), or `None`.
    pub fn from_name(name: &str) -> Option<Behaviour> {
        let name = name.trim();
        Behaviour::ALL.into_iter().find(|b| b.name() == name)
    }

    /// What the model declares.
    pub fn metadata(self) -> ModelMetadata {
        let t = |n: &str, d: Datatype, s: &[i64]| TensorMetadata::new(n, d, s);
        let pair = |d: Datatype| ModelMetadata {
            inputs: vec![t("INPUT0", d, &[16]), t("INPUT1", d, &[16])],
            outputs: vec![t("OUTPUT0", d, &[16]), t("OUTPUT1", d, &[16])],
            max_batch_size: MAX_BATCH_SIZE,
        };
        let identity = |d: Datatype| ModelMetadata {
            inputs: vec![t("INPUT0", d, &[-1])],
            outputs: vec![t("OUTPUT0", d, &[-1])],
            max_batch_size: MAX_BATCH_SIZE,
        };
        let sequence = |controls: &[(&str, Datatype)]| {
            let mut inputs = vec![t("INPUT", Datatype::Int32, &[1])];
            inputs.extend(controls.iter().map(|(n, d)| t(n, *d, &[1])));
            ModelMetadata {
                inputs,
                outputs: vec![t("OUTPUT", Datatype::Int32, &[1])],
                max_batch_size: MAX_BATCH_SIZE,
            }
        };
        let flags = [
            ("START", Datatype::Int32),
            ("END", Datatype::Int32),
            ("READY", Datatype::Int32),
        ];
        match self {
            Behaviour::Simple => pair(Datatype::Int32),
            Behaviour::SimpleInt8 => pair(Datatype::Int8),
            Behaviour::SimpleString => pair(Datatype::Bytes),
            Behaviour::SimpleIdentity => identity(Datatype::Bytes),
            Behaviour::CustomIdentityInt32 => identity(Datatype::Int32),
            Behaviour::SimpleSequence => {
                sequence(&[("START", Datatype::Int32), ("READY", Datatype::Int32)])
            }
            Behaviour::SimpleDynaSequence => {
                sequence(&[flags[0], flags[1], flags[2], ("CORRID", Datatype::Uint64)])
            }
            Behaviour::SimpleStringDynaSequence => {
                sequence(&[flags[0], flags[1], flags[2], ("CORRID", Datatype::Bytes)])
            }
            Behaviour::DensenetOnnx => ModelMetadata {
                inputs: vec![t("data_0", Datatype::Fp32, &[3, 224, 224])],
                outputs: vec![t("fc6_1", Datatype::Fp32, &[1000])],
                max_batch_size: 0,
            },
        }
    }

    /// Answers one (possibly batched) request.
    ///
    /// Errors: invalid argument for inputs the stand-in cannot read (a `simple_string`
    /// element that is no decimal integer, a string `CORRID` that is none either, tensors
    /// whose batches differ).
    pub fn infer(self, inputs: &[TensorData]) -> Result<Vec<TensorData>, Error> {
        match self {
            Behaviour::Simple => {
                sum_difference::<i32>(inputs, i32::wrapping_add, i32::wrapping_sub)
            }
            Behaviour::SimpleInt8 => {
                sum_difference::<i8>(inputs, i8::wrapping_add, i8::wrapping_sub)
            }
            Behaviour::SimpleString => string_sum_difference(inputs),
            Behaviour::SimpleIdentity | Behaviour::CustomIdentityInt32 => {
                let x = input(inputs, "INPUT0")?;
                Ok(vec![TensorData {
                    name: "OUTPUT0".into(),
                    ..x.clone()
                }])
            }
            Behaviour::SimpleSequence => {
                let value = column::<i32>(inputs, "INPUT")?;
                let start = column::<i32>(inputs, "START")?;
                let ready = column::<i32>(inputs, "READY")?;
                same_rows(&value, &[start.len(), ready.len()])?;
                let out = (0..value.len())
                    .map(|r| {
                        if ready[r] == 0 {
                            0
                        } else {
                            value[r].wrapping_add(start[r])
                        }
                    })
                    .collect::<Vec<_>>();
                output_column(&out)
            }
            Behaviour::SimpleDynaSequence => {
                let value = column::<i32>(inputs, "INPUT")?;
                let start = column::<i32>(inputs, "START")?;
                let end = column::<i32>(inputs, "END")?;
                let ready = column::<i32>(inputs, "READY")?;
                let corrid = column::<u64>(inputs, "CORRID")?;
                same_rows(&value, &[start.len(), end.len(), ready.len(), corrid.len()])?;
                let out = (0..value.len())
                    .map(|r| {
                        if ready[r] == 0 {
                            return 0;
                        }
                        let v = value[r].wrapping_add(start[r]);
                        if end[r] != 0 {
                            v.wrapping_add(corrid[r] as i32)
                        } else {
                            v
                        }
                    })
                    .collect::<Vec<_>>();
                output_column(&out)
            }
            Behaviour::SimpleStringDynaSequence => string_dyna_sequence(inputs),
            Behaviour::DensenetOnnx => {
                let x = input(inputs, "data_0")?.to_vec::<f32>()?;
                let plane = x.len() / 3;
                let means: Vec<f32> = x
                    .chunks_exact(plane.max(1))
                    .map(|c| (c.iter().map(|&v| f64::from(v)).sum::<f64>() / c.len() as f64) as f32)
                    .collect();
                let out: Vec<f32> = (0..1000).map(|i| means[i % means.len()]).collect();
                Ok(vec![TensorData::from_slice("fc6_1", &out, &[1000])?])
            }
        }
    }
}

thread_local! {
    /// The behaviour, read from [`STANDIN_FILE`] once per instance.
    static BEHAVIOUR: OnceCell<Behaviour> = const { OnceCell::new() };
    /// `simple_string_dyna_sequence`: each live sequence's sum, by its string correlation id.
    static SUMS: RefCell<HashMap<Vec<u8>, i32>> = RefCell::new(HashMap::new());
}

/// The behaviour [`STANDIN_FILE`] names.
///
/// Panics (the instance traps) when the file is missing or names no [`Behaviour`].
pub fn behaviour() -> Behaviour {
    BEHAVIOUR.with(|cell| {
        *cell.get_or_init(|| {
            let text = std::fs::read_to_string(STANDIN_FILE).unwrap_or_else(|e| {
                panic!("tpubox-triton-standins: cannot read {STANDIN_FILE} (it names the model to stand in for): {e}")
            });
            Behaviour::from_name(&text).unwrap_or_else(|| {
                let names: Vec<_> = Behaviour::ALL.iter().map(|b| b.name()).collect();
                panic!(
                    "tpubox-triton-standins: {STANDIN_FILE} says {:?}, which is none of {}",
                    text.trim(),
                    names.join(", ")
                )
            })
        })
    })
}

/// `OUTPUT0 = INPUT0 + INPUT1`, `OUTPUT1 = INPUT0 - INPUT1`, elementwise in `T`.
fn sum_difference<T: tpubox_guest::Element + Copy>(
    inputs: &[TensorData],
    add: fn(T, T) -> T,
    sub: fn(T, T) -> T,
) -> Result<Vec<TensorData>, Error> {
    let (x0, x1) = (input(inputs, "INPUT0")?, input(inputs, "INPUT1")?);
    let (a, b) = (x0.to_vec::<T>()?, x1.to_vec::<T>()?);
    if x0.shape != x1.shape {
        return Err(Error::invalid_argument(format!(
            "INPUT0 is {:?}, INPUT1 {:?}: they must have the same shape",
            x0.shape, x1.shape
        )));
    }
    let sum: Vec<T> = a.iter().zip(&b).map(|(&x, &y)| add(x, y)).collect();
    let diff: Vec<T> = a.iter().zip(&b).map(|(&x, &y)| sub(x, y)).collect();
    Ok(vec![
        TensorData::from_slice("OUTPUT0", &sum, &x0.shape)?,
        TensorData::from_slice("OUTPUT1", &diff, &x0.shape)?,
    ])
}

/// A BYTES element holding a decimal integer (as Triton's `simple_string` model reads them).
fn decimal(what: &str, e: &[u8]) -> Result<i32, Error> {
    std::str::from_utf8(e)
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "{what}: {:?} is not a decimal integer",
                String::from_utf8_lossy(e)
            ))
        })
}

/// `simple_string`: the sum and difference of decimal strings, as decimal strings.
fn string_sum_difference(inputs: &[TensorData]) -> Result<Vec<TensorData>, Error> {
    let (x0, x1) = (input(inputs, "INPUT0")?, input(inputs, "INPUT1")?);
    if x0.shape != x1.shape {
        return Err(Error::invalid_argument(format!(
            "INPUT0 is {:?}, INPUT1 {:?}: they must have the same shape",
            x0.shape, x1.shape
        )));
    }
    let a = x0
        .bytes_elements()?
        .into_iter()
        .map(|e| decimal("INPUT0", e))
        .collect::<Result<Vec<_>, _>>()?;
    let b = x1
        .bytes_elements()?
        .into_iter()
        .map(|e| decimal("INPUT1", e))
        .collect::<Result<Vec<_>, _>>()?;
    let sum: Vec<String> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| x.wrapping_add(*y).to_string())
        .collect();
    let diff: Vec<String> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| x.wrapping_sub(*y).to_string())
        .collect();
    Ok(vec![
        TensorData::from_bytes_elements("OUTPUT0", &sum, &x0.shape)?,
        TensorData::from_bytes_elements("OUTPUT1", &diff, &x0.shape)?,
    ])
}

/// `simple_string_dyna_sequence`: per sequence (its string `CORRID`), the running sum of its
/// `INPUT`s (`START` restarts it), plus `int(CORRID)` on its last request (`END`).
fn string_dyna_sequence(inputs: &[TensorData]) -> Result<Vec<TensorData>, Error> {
    let value = column::<i32>(inputs, "INPUT")?;
    let start = column::<i32>(inputs, "START")?;
    let end = column::<i32>(inputs, "END")?;
    let ready = column::<i32>(inputs, "READY")?;
    let c = input(inputs, "CORRID")?;
    check_column(c, Datatype::Bytes)?;
    let corrid = c.bytes_elements()?;
    same_rows(&value, &[start.len(), end.len(), ready.len(), corrid.len()])?;
    let mut out = Vec::with_capacity(value.len());
    SUMS.with(|sums| {
        let mut sums = sums.borrow_mut();
        for r in 0..value.len() {
            if ready[r] == 0 {
                out.push(0);
                continue;
            }
            let id = corrid[r];
            let s = sums.entry(id.to_vec()).or_insert(0);
            *s = if start[r] != 0 {
                value[r]
            } else {
                s.wrapping_add(value[r])
            };
            let mut v = *s;
            if end[r] != 0 {
                sums.remove(id);
                v = v.wrapping_add(decimal(
                    "CORRID (the string sequence id must be a decimal integer)",
                    id,
                )?);
            }
            out.push(v);
        }
        Ok::<(), Error>(())
    })?;
    output_column(&out)
}

/// `t` is of datatype `d` and shape `[B, 1]`.
fn check_column(t: &TensorData, d: Datatype) -> Result<(), Error> {
    if t.datatype != d || t.shape.len() != 2 || t.shape[1] != 1 {
        return Err(Error::invalid_argument(format!(
            "{} must be {d} [B, 1], not {} {:?}",
            t.name, t.datatype, t.shape
        )));
    }
    Ok(())
}

/// The `[B, 1]` input `name` as its `B` values.
fn column<T: tpubox_guest::Element>(inputs: &[TensorData], name: &str) -> Result<Vec<T>, Error> {
    let t = input(inputs, name)?;
    let d = Datatype::from_dtype(T::DTYPE).unwrap_or(Datatype::Bytes);
    check_column(t, d)?;
    t.to_vec::<T>()
}

/// Every control column has as many rows as `INPUT`.
fn same_rows<T>(value: &[T], others: &[usize]) -> Result<(), Error> {
    if others.iter().any(|&n| n != value.len()) {
        return Err(Error::invalid_argument(
            "the control inputs' batches differ from INPUT's",
        ));
    }
    Ok(())
}

/// `OUTPUT` as an INT32 `[B, 1]` tensor.
fn output_column(out: &[i32]) -> Result<Vec<TensorData>, Error> {
    Ok(vec![TensorData::from_slice(
        "OUTPUT",
        out,
        &[out.len() as u64, 1],
    )?])
}

struct Standins;

impl Model for Standins {
    fn metadata() -> ModelMetadata {
        behaviour().metadata()
    }

    fn infer(inputs: Vec<TensorData>) -> Result<Vec<TensorData>, WitError> {
        Ok(behaviour().infer(&inputs)?)
    }
}

tpubox_guest::export_model!(Standins);
