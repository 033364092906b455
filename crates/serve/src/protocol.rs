//! The Open Inference Protocol's data model, independent of the transport: datatypes, tensors in
//! host memory, inference requests and responses, the JSON form of tensors and the binary
//! tensor extension. REST and gRPC both convert to and from these types.
//!
//! Tensor bytes use one layout everywhere (the layout of `tensor-data` in `wit/model.wit`):
//! fixed-size datatypes row-major little-endian (`BOOL` one byte, 0 or 1); `BYTES` each element
//! as a 4-byte little-endian length and its bytes, which is also how the binary tensor
//! extension and gRPC's `raw_input_contents` carry `BYTES`.

use serde_json::{Value, json};
use tpubox_core::logsafe::clip;

use super::error::{ServeError, ServeResult};

pub mod json;

pub use json::{MAX_DATA_DEPTH, MAX_OBJECT_KEYS};

/// A tensor datatype of the Open Inference Protocol ("Tensor Data Types" in the KServe v2
/// protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Datatype {
    /// `BOOL`: one byte, 0 or 1.
    Bool,
    /// `UINT8`.
    Uint8,
    /// `UINT16`.
    Uint16,
    /// `UINT32`.
    Uint32,
    /// `UINT64`.
    Uint64,
    /// `INT8`.
    Int8,
    /// `INT16`.
    Int16,
    /// `INT32`.
    Int32,
    /// `INT64`.
    Int64,
    /// `FP16`: IEEE half precision.
    Fp16,
    /// `BF16`: bfloat16.
    Bf16,
    /// `FP32`.
    Fp32,
    /// `FP64`.
    Fp64,
    /// `BYTES`: variable-length byte strings.
    Bytes,
}

impl Datatype {
    /// Every datatype, in the protocol's order.
    pub const ALL: [Datatype; 14] = [
        Datatype::Bool,
        Datatype::Uint8,
        Datatype::Uint16,
        Datatype::Uint32,
        Datatype::Uint64,
        Datatype::Int8,
        Datatype::Int16,
        Datatype::Int32,
        Datatype::Int64,
        Datatype::Fp16,
        Datatype::Bf16,
        Datatype::Fp32,
        Datatype::Fp64,
        Datatype::Bytes,
    ];

    /// The protocol's name: `"BOOL"`, `"UINT8"`, …, `"FP32"`, `"BYTES"`.
    pub fn name(self) -> &'static str {
        match self {
            Datatype::Bool => "BOOL",
            Datatype::Uint8 => "UINT8",
            Datatype::Uint16 => "UINT16",
            Datatype::Uint32 => "UINT32",
            Datatype::Uint64 => "UINT64",
            Datatype::Int8 => "INT8",
            Datatype::Int16 => "INT16",
            Datatype::Int32 => "INT32",
            Datatype::Int64 => "INT64",
            Datatype::Fp16 => "FP16",
            Datatype::Bf16 => "BF16",
            Datatype::Fp32 => "FP32",
            Datatype::Fp64 => "FP64",
            Datatype::Bytes => "BYTES",
        }
    }

    /// Triton's model-configuration name: `"TYPE_BOOL"`, …, `"TYPE_FP32"`, and `"TYPE_STRING"`
    /// for `BYTES`.
    pub fn config_name(self) -> String {
        match self {
            Datatype::Bytes => "TYPE_STRING".into(),
            d => format!("TYPE_{}", d.name()),
        }
    }

    /// Parses a protocol name (`"FP32"`) or a Triton configuration name (`"TYPE_FP32"`,
    /// `"TYPE_STRING"`), case-sensitively as the protocol spells them. `None` otherwise.
    pub fn from_name(s: &str) -> Option<Self> {
        let s = s.strip_prefix("TYPE_").unwrap_or(s);
        if s == "STRING" {
            return Some(Datatype::Bytes);
        }
        Self::ALL.into_iter().find(|d| d.name() == s)
    }

    /// Parses exactly a protocol name (`"FP32"`, `"BYTES"`): what requests carry. `None`
    /// otherwise (Triton's configuration names such as `TYPE_STRING` are not request
    /// datatypes).
    pub fn from_protocol_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == s)
    }

    /// Bytes of one element; `None` for `BYTES`.
    pub fn element_size(self) -> Option<usize> {
        Some(match self {
            Datatype::Bool | Datatype::Uint8 | Datatype::Int8 => 1,
            Datatype::Uint16 | Datatype::Int16 | Datatype::Fp16 | Datatype::Bf16 => 2,
            Datatype::Uint32 | Datatype::Int32 | Datatype::Fp32 => 4,
            Datatype::Uint64 | Datatype::Int64 | Datatype::Fp64 => 8,
            Datatype::Bytes => return None,
        })
    }
}

/// A tensor in host memory: a request input or a response output.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Its name.
    pub name: String,
    /// Its datatype.
    pub datatype: Datatype,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// The elements in the layout described in the module docs.
    pub data: Vec<u8>,
}

/// Number of elements of `shape`, or `None` on overflow.
pub fn element_count(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

impl Tensor {
    /// Checks that `data` holds exactly the elements `shape` says.
    ///
    /// Errors: bad request naming the tensor, when the byte length (fixed-size datatypes) or
    /// the number of length-prefixed elements (`BYTES`) disagrees with the shape, or a `BOOL`
    /// byte is neither 0 nor 1.
    pub fn check(&self) -> ServeResult<()> {
        let n = element_count(&self.shape).ok_or_else(|| {
            ServeError::bad_request(format!(
                "input `{}`: shape {:?} overflows",
                clip(&self.name),
                self.shape
            ))
        })?;
        match self.datatype.element_size() {
            Some(size) => {
                let want = n.checked_mul(size as u64);
                if want != Some(self.data.len() as u64) {
                    return Err(ServeError::bad_request(format!(
                        "tensor `{}`: {} bytes of data, but shape {:?} of {} needs {}",
                        clip(&self.name),
                        self.data.len(),
                        self.shape,
                        self.datatype.name(),
                        want.map_or("more than 2^64".to_string(), |w| w.to_string())
                    )));
                }
                if self.datatype == Datatype::Bool && self.data.iter().any(|&b| b > 1) {
                    return Err(ServeError::bad_request(format!(
                        "tensor `{}`: BOOL elements must be 0 or 1",
                        clip(&self.name)
                    )));
                }
            }
            None => {
                let count = bytes_element_count(&self.data).map_err(|e| {
                    ServeError::bad_request(format!("tensor `{}`: {e}", clip(&self.name)))
                })? as u64;
                if count != n {
                    return Err(ServeError::bad_request(format!(
                        "tensor `{}`: {count} BYTES elements, but shape {:?} needs {n}",
                        clip(&self.name),
                        self.shape
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Counts the elements of `BYTES` data without collecting them (what [`Tensor::check`] needs:
/// a list of slices would take 16 bytes per element, 5 times the JSON text `"",`).
///
/// Errors: as [`bytes_elements`].
pub fn bytes_element_count(data: &[u8]) -> Result<usize, String> {
    let mut n = 0;
    let mut rest = data;
    while !rest.is_empty() {
        if rest.len() < 4 {
            return Err("BYTES data ends inside a 4-byte length prefix".into());
        }
        let len = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        rest = &rest[4..];
        if len > rest.len() {
            return Err(format!(
                "a BYTES element of {len} bytes runs past the end of the data ({} bytes left)",
                rest.len()
            ));
        }
        rest = &rest[len..];
        n += 1;
    }
    Ok(n)
}

/// Splits `BYTES` data into its elements.
///
/// Errors: a length prefix that is cut off or runs past the end.
pub fn bytes_elements(data: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        if rest.len() < 4 {
            return Err("BYTES data ends inside a 4-byte length prefix".into());
        }
        let len = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        rest = &rest[4..];
        if len > rest.len() {
            return Err(format!(
                "a BYTES element of {len} bytes runs past the end of the data ({} bytes left)",
                rest.len()
            ));
        }
        out.push(&rest[..len]);
        rest = &rest[len..];
    }
    Ok(out)
}

/// Appends one `BYTES` element (length prefix and bytes) to `out`.
pub fn push_bytes_element(out: &mut Vec<u8>, element: &[u8]) {
    out.extend_from_slice(&(element.len() as u32).to_le_bytes());
    out.extend_from_slice(element);
}

/// A slice of a registered system shared-memory region (Triton's `shared_memory_region`,
/// `shared_memory_offset` and `shared_memory_byte_size` parameters): where an input's bytes
/// are read from, or an output's written to ([`crate::shm`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmRef {
    /// The region's name, as registered by the calling tenant.
    pub region: String,
    /// Bytes from the start of the registered region (itself at an offset in its file).
    pub offset: u64,
    /// Bytes of the slice.
    pub byte_size: u64,
}

/// A sequence id (Triton's `sequence_id` request parameter, its correlation id): an unsigned
/// integer or a string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SequenceId {
    /// A number (0 is no id).
    Number(u64),
    /// A string (empty is no id).
    Text(String),
}

impl std::fmt::Display for SequenceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SequenceId::Number(n) => write!(f, "{n}"),
            SequenceId::Text(t) => write!(f, "'{t}'"),
        }
    }
}

/// A request's sequence parameters (`sequence_id`, `sequence_start`, `sequence_end`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceRequest {
    /// Its sequence.
    pub id: SequenceId,
    /// The first request of the sequence.
    pub start: bool,
    /// The last request of the sequence.
    pub end: bool,
}

/// The request parameters of [`SequenceRequest`].
pub const SEQUENCE_ID: &str = "sequence_id";
/// See [`SEQUENCE_ID`].
pub const SEQUENCE_START: &str = "sequence_start";
/// See [`SEQUENCE_ID`].
pub const SEQUENCE_END: &str = "sequence_end";

/// The parameter names of [`ShmRef`] (Triton's shared-memory extension).
pub const SHM_REGION: &str = "shared_memory_region";
/// See [`SHM_REGION`].
pub const SHM_OFFSET: &str = "shared_memory_offset";
/// See [`SHM_REGION`].
pub const SHM_BYTE_SIZE: &str = "shared_memory_byte_size";

/// An output the client asked for.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestedOutput {
    /// Output name.
    pub name: String,
    /// Return it in the binary extension (REST only).
    pub binary: bool,
    /// Write it into this shared-memory slice instead of the response.
    pub shm: Option<ShmRef>,
}

/// An inference request, as both front doors decode it.
#[derive(Debug, Clone, Default)]
pub struct InferRequest {
    /// The client's request id, echoed back.
    pub id: Option<String>,
    /// Inputs.
    pub inputs: Vec<Tensor>,
    /// Outputs asked for; empty for all of them.
    pub outputs: Vec<RequestedOutput>,
    /// REST: `binary_data_output` (every output in the binary extension).
    pub binary_output: bool,
    /// Inputs whose bytes are in shared memory (index into `inputs`, whose `data` is empty
    /// until [`crate::shm::Regions::read_inputs`] fills it).
    pub shm_inputs: Vec<(usize, ShmRef)>,
    /// Its sequence, when it names one (a stateful model's request).
    pub sequence: Option<SequenceRequest>,
}

impl InferRequest {
    /// A copy without the inputs: what the response needs to know (id, outputs asked for,
    /// binary choices) once the inputs went to the model.
    pub fn without_inputs(&self) -> InferRequest {
        InferRequest {
            id: self.id.clone(),
            inputs: Vec::new(),
            outputs: self.outputs.clone(),
            binary_output: self.binary_output,
            shm_inputs: Vec::new(),
            sequence: self.sequence.clone(),
        }
    }
}

/// An inference response.
#[derive(Debug, Clone)]
pub struct InferResponse {
    /// Model name.
    pub model_name: String,
    /// Model version.
    pub model_version: String,
    /// The request's id.
    pub id: Option<String>,
    /// Outputs, in the model's order, filtered to those asked for. One written to shared
    /// memory has empty `data` and an entry in `shm_outputs`.
    pub outputs: Vec<Tensor>,
    /// Outputs written to shared memory: their name and the slice, `byte_size` the bytes
    /// written.
    pub shm_outputs: Vec<(String, ShmRef)>,
    /// The weight-set versions the outputs were computed from (set name, version), sent as
    /// the response parameter [`WEIGHT_VERSIONS_PARAMETER`] when not empty.
    pub weights: Vec<(String, u64)>,
}

/// The response parameter naming the weight-set versions a response was computed from: a
/// string holding a JSON list of `{"name": SET, "version": N}`, sorted by name (a set named
/// twice means the model read two versions of it in one call).
pub const WEIGHT_VERSIONS_PARAMETER: &str = "tpubox_weight_versions";

/// The value of [`WEIGHT_VERSIONS_PARAMETER`] for `weights`.
pub fn weight_versions_value(weights: &[(String, u64)]) -> String {
    Value::Array(
        weights
            .iter()
            .map(|(name, version)| json!({"name": name, "version": version}))
            .collect(),
    )
    .to_string()
}

// --- JSON -------------------------------------------------------------------------------------

fn flatten<'a>(v: &'a Value, out: &mut Vec<&'a Value>, depth: usize) -> ServeResult<()> {
    if depth > 64 {
        return Err(ServeError::bad_request(
            "tensor data nested more than 64 deep",
        ));
    }
    match v {
        Value::Array(items) => {
            for item in items {
                flatten(item, out, depth + 1)?;
            }
        }
        other => out.push(other),
    }
    Ok(())
}

/// Encodes the JSON `data` of an input (flat or nested arrays, row-major) into tensor bytes.
///
/// Errors: bad request for an element of the wrong JSON type or out of the datatype's range.
pub fn data_from_json(name: &str, datatype: Datatype, data: &Value) -> ServeResult<Vec<u8>> {
    let mut items = Vec::new();
    flatten(data, &mut items, 0)?;
    let bad = |i: usize, what: &str| {
        ServeError::bad_request(format!(
            "input `{}`: element {i} is not {what} ({} data)",
            clip(name),
            datatype.name()
        ))
    };
    let mut out = Vec::with_capacity(items.len() * datatype.element_size().unwrap_or(8));
    for (i, v) in items.iter().enumerate() {
        macro_rules! int {
            ($t:ty, $get:ident) => {{
                let x = v
                    .$get()
                    .and_then(|x| <$t>::try_from(x).ok())
                    .ok_or_else(|| {
                        bad(i, concat!("an integer in the range of ", stringify!($t)))
                    })?;
                out.extend_from_slice(&x.to_le_bytes());
            }};
        }
        match datatype {
            Datatype::Bool => out.push(u8::from(v.as_bool().ok_or_else(|| bad(i, "a boolean"))?)),
            Datatype::Uint8 => int!(u8, as_u64),
            Datatype::Uint16 => int!(u16, as_u64),
            Datatype::Uint32 => int!(u32, as_u64),
            Datatype::Uint64 => int!(u64, as_u64),
            Datatype::Int8 => int!(i8, as_i64),
            Datatype::Int16 => int!(i16, as_i64),
            Datatype::Int32 => int!(i32, as_i64),
            Datatype::Int64 => int!(i64, as_i64),
            Datatype::Fp16 => {
                let x = v.as_f64().ok_or_else(|| bad(i, "a number"))?;
                out.extend_from_slice(&half::f16::from_f64(x).to_le_bytes());
            }
            Datatype::Bf16 => {
                let x = v.as_f64().ok_or_else(|| bad(i, "a number"))?;
                out.extend_from_slice(&half::bf16::from_f64(x).to_le_bytes());
            }
            Datatype::Fp32 => {
                let x = v.as_f64().ok_or_else(|| bad(i, "a number"))?;
                out.extend_from_slice(&(x as f32).to_le_bytes());
            }
            Datatype::Fp64 => {
                let x = v.as_f64().ok_or_else(|| bad(i, "a number"))?;
                out.extend_from_slice(&x.to_le_bytes());
            }
            Datatype::Bytes => {
                let s = v.as_str().ok_or_else(|| bad(i, "a string"))?;
                push_bytes_element(&mut out, s.as_bytes());
            }
        }
    }
    Ok(out)
}

/// The JSON `data` of an output: a flat array in row-major order. `BYTES` elements become
/// strings (invalid UTF-8 replaced).
pub fn data_to_json(t: &Tensor) -> Value {
    fn chunks<const N: usize>(data: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        data.chunks_exact(N).map(|c| c.try_into().unwrap())
    }
    let d = &t.data;
    let items: Vec<Value> = match t.datatype {
        Datatype::Bool => d.iter().map(|&b| json!(b != 0)).collect(),
        Datatype::Uint8 => d.iter().map(|&b| json!(b)).collect(),
        Datatype::Int8 => d.iter().map(|&b| json!(b as i8)).collect(),
        Datatype::Uint16 => chunks::<2>(d)
            .map(|c| json!(u16::from_le_bytes(c)))
            .collect(),
        Datatype::Int16 => chunks::<2>(d)
            .map(|c| json!(i16::from_le_bytes(c)))
            .collect(),
        Datatype::Uint32 => chunks::<4>(d)
            .map(|c| json!(u32::from_le_bytes(c)))
            .collect(),
        Datatype::Int32 => chunks::<4>(d)
            .map(|c| json!(i32::from_le_bytes(c)))
            .collect(),
        Datatype::Uint64 => chunks::<8>(d)
            .map(|c| json!(u64::from_le_bytes(c)))
            .collect(),
        Datatype::Int64 => chunks::<8>(d)
            .map(|c| json!(i64::from_le_bytes(c)))
            .collect(),
        Datatype::Fp16 => chunks::<2>(d)
            .map(|c| float_json(half::f16::from_le_bytes(c).to_f64()))
            .collect(),
        Datatype::Bf16 => chunks::<2>(d)
            .map(|c| float_json(half::bf16::from_le_bytes(c).to_f64()))
            .collect(),
        Datatype::Fp32 => chunks::<4>(d)
            .map(|c| float_json(f64::from(f32::from_le_bytes(c))))
            .collect(),
        Datatype::Fp64 => chunks::<8>(d)
            .map(|c| float_json(f64::from_le_bytes(c)))
            .collect(),
        Datatype::Bytes => bytes_elements(d)
            .unwrap_or_default()
            .into_iter()
            .map(|e| json!(String::from_utf8_lossy(e)))
            .collect(),
    };
    Value::Array(items)
}

/// JSON has no NaN or infinity; like Triton, they are written as strings.
fn float_json(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else if x.is_nan() {
        json!("NaN")
    } else if x > 0.0 {
        json!("Infinity")
    } else {
        json!("-Infinity")
    }
}

/// Decodes a REST inference request: the JSON header and, for the binary tensor extension, the
/// bytes after it (`binary` is empty without the extension). Inputs whose parameters carry
/// `binary_data_size` take that many bytes of `binary`, in order; the others take their JSON
/// `data` (flat or nested arrays, row-major).
///
/// No JSON tree is built: the elements of `data` go straight into a buffer of the tensor's
/// size in its datatype, so decoding costs at most 4 bytes per byte of the header (8-byte
/// elements written as `0,`) plus a small constant per input, output and object key (see
/// [`mod@json`] and `docs/SERVING.md`).
///
/// Errors: bad request for JSON that is not an inference request, a duplicate key in any
/// object, an object with more than [`MAX_OBJECT_KEYS`] keys, an unknown datatype, a missing
/// `data`, elements that disagree with the shape (the element count is checked before any
/// element is stored), `binary_data_size` past the end of the body or bytes left over.
pub fn request_from_json(header: &[u8], binary: &[u8]) -> ServeResult<InferRequest> {
    json::request_from_json(header, binary)
}

/// Encodes a REST inference response: the JSON header and the binary data that follows it
/// (empty when no output is binary). An output is binary when the request asked for it by name
/// with `binary_data`, or asked `binary_data_output`.
pub fn response_to_json(resp: &InferResponse, req: &InferRequest) -> (Vec<u8>, Vec<u8>) {
    let mut binary = Vec::new();
    let outputs: Vec<Value> = resp
        .outputs
        .iter()
        .map(|t| {
            let as_binary = req
                .outputs
                .iter()
                .find(|o| o.name == t.name)
                .map_or(req.binary_output, |o| o.binary);
            let mut o = json!({
                "name": t.name,
                "datatype": t.datatype.name(),
                "shape": t.shape,
            });
            if let Some((_, r)) = resp.shm_outputs.iter().find(|(n, _)| *n == t.name) {
                o["parameters"] = json!({
                    SHM_REGION: r.region,
                    SHM_OFFSET: r.offset,
                    SHM_BYTE_SIZE: r.byte_size,
                });
            } else if as_binary {
                o["parameters"] = json!({ "binary_data_size": t.data.len() });
                binary.extend_from_slice(&t.data);
            } else {
                o["data"] = data_to_json(t);
            }
            o
        })
        .collect();
    let mut v = json!({
        "model_name": resp.model_name,
        "model_version": resp.model_version,
        "outputs": outputs,
    });
    if let Some(id) = &resp.id {
        v["id"] = json!(id);
    }
    if !resp.weights.is_empty() {
        v["parameters"] =
            json!({ WEIGHT_VERSIONS_PARAMETER: weight_versions_value(&resp.weights) });
    }
    (serde_json::to_vec(&v).unwrap_or_default(), binary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in Datatype::ALL {
            assert_eq!(Datatype::from_name(d.name()), Some(d));
            assert_eq!(Datatype::from_name(&d.config_name()), Some(d));
        }
        assert_eq!(Datatype::from_name("TYPE_STRING"), Some(Datatype::Bytes));
        assert_eq!(Datatype::from_name("fp32"), None);
        assert_eq!(Datatype::from_protocol_name("STRING"), None);
        assert_eq!(Datatype::from_protocol_name("TYPE_FP32"), None);
    }

    #[test]
    fn json_and_binary_inputs() {
        let mut bin = Vec::new();
        push_bytes_element(&mut bin, b"hi");
        push_bytes_element(&mut bin, b"");
        let header = serde_json::to_vec(&json!({
            "id": "7",
            "inputs": [
                {"name": "a", "datatype": "INT16", "shape": [2, 2], "data": [[1, -2], [3, 4]]},
                {"name": "b", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": bin.len()}},
                {"name": "c", "datatype": "BOOL", "shape": [1], "data": [true]},
            ],
            "outputs": [{"name": "x", "parameters": {"binary_data": true}}],
        }))
        .unwrap();
        let r = request_from_json(&header, &bin).unwrap();
        assert_eq!(r.id.as_deref(), Some("7"));
        assert_eq!(r.inputs[0].data, [1, 0, 0xfe, 0xff, 3, 0, 4, 0]);
        assert_eq!(
            bytes_elements(&r.inputs[1].data).unwrap(),
            [&b"hi"[..], b""]
        );
        assert_eq!(r.inputs[2].data, [1]);
        assert!(r.outputs[0].binary);
    }

    #[test]
    fn bad_inputs_are_bad_requests() {
        let cases: &[(Value, &[u8], &str)] = &[
            (
                json!({"inputs": [{"name": "a", "datatype": "INT8", "shape": [1], "data": [300]}]}),
                b"",
                "range",
            ),
            (
                json!({"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], "data": [1.0]}]}),
                b"",
                "needs 8",
            ),
            (
                json!({"inputs": [{"name": "a", "datatype": "FP33", "shape": [1], "data": [1]}]}),
                b"",
                "unknown datatype",
            ),
            (
                json!({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 8}}]}),
                &[0; 4],
                "past the end",
            ),
            (
                json!({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}]}),
                &[0; 6],
                "add up to 4",
            ),
            (
                json!({"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 4}}]}),
                &[9, 0, 0, 0],
                "runs past",
            ),
            (
                json!({"inputs": [{"name": "a", "datatype": "FP32", "shape": [-1], "data": []}]}),
                b"",
                "non-negative",
            ),
            (
                json!({"inputs": [{"name": "a", "datatype": "BOOL", "shape": [1], "data": [2]}]}),
                b"",
                "boolean",
            ),
            (json!([1, 2]), b"", "JSON object"),
        ];
        for (v, bin, want) in cases {
            let e = request_from_json(&serde_json::to_vec(v).unwrap(), bin).unwrap_err();
            assert_eq!(e.status_code(), 400, "{v}");
            assert!(e.message.contains(want), "{v}: {}", e.message);
        }
        let e = request_from_json(b"{not json", b"").unwrap_err();
        assert!(e.message.contains("not valid JSON"));
    }

    #[test]
    fn data_may_come_before_datatype_and_shape() {
        let header = br#"{"inputs": [{"data": [[1.5], [-2]], "name": "a", "shape": [2, 1], "datatype": "FP64"},
            {"data": ["x", "\u00e9"], "datatype": "BYTES", "shape": [2], "name": "b"}],
            "parameters": {"binary_data_output": true}, "outputs": [{"name": "o"}], "id": 7}"#;
        let r = request_from_json(header, b"").unwrap();
        assert_eq!(r.id, None);
        let mut want = 1.5f64.to_le_bytes().to_vec();
        want.extend_from_slice(&(-2.0f64).to_le_bytes());
        assert_eq!(r.inputs[0].data, want);
        assert_eq!(
            bytes_elements(&r.inputs[1].data).unwrap(),
            [&b"x"[..], "\u{e9}".as_bytes()]
        );
        assert!(r.binary_output && r.outputs[0].binary);
        // A scalar `data` is one element, as before.
        let r = request_from_json(
            br#"{"inputs": [{"name": "a", "shape": [], "datatype": "INT32", "data": -3}]}"#,
            b"",
        )
        .unwrap();
        assert_eq!(r.inputs[0].data, (-3i32).to_le_bytes());
    }

    #[test]
    fn duplicate_keys_are_bad_requests() {
        for text in [
            r#"{"inputs": [], "inputs": []}"#,
            r#"{"id": "a", "inputs": [], "id": "b"}"#,
            r#"{"inputs": [{"name": "a", "name": "b", "shape": [1], "datatype": "FP32", "data": [1]}]}"#,
            r#"{"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1], "data": [2]}]}"#,
            r#"{"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1], "parameters": {"k": 1, "k": 1}}]}"#,
            r#"{"inputs": [], "parameters": {"binary_data_output": true, "binary_data_output": true}}"#,
            r#"{"inputs": [], "outputs": [{"name": "o", "parameters": {"binary_data": true, "binary_data": true}}]}"#,
            r#"{"inputs": [], "extra": [{"deep": {"x": 1, "x": 2}}]}"#,
            r#"{"inputs": [], "parameters": {"p": {"x": 1, "\u0078": 2}}}"#,
        ] {
            let e = request_from_json(text.as_bytes(), b"").unwrap_err();
            assert_eq!(e.status_code(), 400, "{text}");
            assert!(e.message.contains("duplicate key"), "{text}: {}", e.message);
        }
    }

    #[test]
    fn objects_and_data_are_bounded() {
        let keys: Vec<String> = (0..=MAX_OBJECT_KEYS)
            .map(|i| format!("\"k{i}\": 0"))
            .collect();
        let text = format!(r#"{{"inputs": [], "parameters": {{{}}}}}"#, keys.join(","));
        let e = request_from_json(text.as_bytes(), b"").unwrap_err();
        assert!(e.message.contains("more than 1024 keys"), "{}", e.message);
        // More elements than the shape: refused from the count, before any is stored.
        let zeros = vec!["0"; 1000].join(",");
        let text = format!(
            r#"{{"inputs": [{{"name": "a", "shape": [4], "datatype": "FP64", "data": [{zeros}]}}]}}"#
        );
        let e = request_from_json(text.as_bytes(), b"").unwrap_err();
        assert!(e.message.contains("8000 bytes of data"), "{}", e.message);
        assert!(e.message.contains("needs 32"), "{}", e.message);
        let text =
            r#"{"inputs": [{"name": "a", "shape": [1], "datatype": "BYTES", "data": ["a", "b"]}]}"#;
        let e = request_from_json(text.as_bytes(), b"").unwrap_err();
        assert!(e.message.contains("2 BYTES elements"), "{}", e.message);
        let deep = format!(
            "{}1{}",
            "[".repeat(MAX_DATA_DEPTH + 1),
            "]".repeat(MAX_DATA_DEPTH + 1)
        );
        let text = format!(
            r#"{{"inputs": [{{"name": "a", "shape": [1], "datatype": "FP64", "data": {deep}}}]}}"#
        );
        let e = request_from_json(text.as_bytes(), b"").unwrap_err();
        assert!(e.message.contains("nested more than 64"), "{}", e.message);
        // Wrong element types keep their messages.
        let text =
            r#"{"inputs": [{"name": "a", "shape": [2], "datatype": "UINT8", "data": [1, -1]}]}"#;
        let e = request_from_json(text.as_bytes(), b"").unwrap_err();
        assert!(
            e.message
                .contains("element 1 is not an integer in the range of u8"),
            "{}",
            e.message
        );
        let text =
            r#"{"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [null]}]}"#;
        let e = request_from_json(text.as_bytes(), b"").unwrap_err();
        assert!(
            e.message.contains("element 0 is not a number"),
            "{}",
            e.message
        );
        let text =
            r#"{"inputs": [{"name": "a", "shape": [1], "datatype": "INT8", "data": [1.0]}]}"#;
        let e = request_from_json(text.as_bytes(), b"").unwrap_err();
        assert!(e.message.contains("range of i8"), "{}", e.message);
    }

    #[test]
    fn request_shapes_keep_their_messages() {
        let cases: &[(&str, &str)] = &[
            (r#"{"inputs": 7}"#, "no `inputs` array"),
            (r#"{}"#, "no `inputs` array"),
            (r#"{"inputs": [3]}"#, "each input must be a JSON object"),
            (r#"{"inputs": [{"shape": [1]}]}"#, "has no `name`"),
            (r#"{"inputs": [{"name": "a"}]}"#, "has no `datatype`"),
            (
                r#"{"inputs": [{"name": "a", "datatype": "FP32"}]}"#,
                "must be an array",
            ),
            (
                r#"{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]}"#,
                "neither `data`",
            ),
            (
                r#"{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1], "data": []}]}"#,
                "rank 17",
            ),
            (r#"{"inputs": [], "outputs": {}}"#, "must be an array"),
            (
                r#"{"inputs": [], "outputs": [1]}"#,
                "each output must be a JSON object",
            ),
            (r#"{"inputs": [], "outputs": [{}]}"#, "has no `name`"),
            (r#""text""#, "must be a JSON object"),
            (r#"{"inputs": []} x"#, "not valid JSON"),
        ];
        for (text, want) in cases {
            let e = request_from_json(text.as_bytes(), b"").unwrap_err();
            assert_eq!(e.status_code(), 400, "{text}");
            assert!(e.message.contains(want), "{text}: {}", e.message);
        }
    }

    #[test]
    fn every_datatype_survives_json() {
        for d in Datatype::ALL {
            let data = json!(match d {
                Datatype::Bool => json!([true, false]),
                Datatype::Bytes => json!(["x", "yz"]),
                Datatype::Fp16 | Datatype::Bf16 | Datatype::Fp32 | Datatype::Fp64 =>
                    json!([1.5, -2.0]),
                Datatype::Int8 | Datatype::Int16 | Datatype::Int32 | Datatype::Int64 =>
                    json!([-3, 4]),
                _ => json!([3, 4]),
            });
            let bytes = data_from_json("t", d, &data).unwrap();
            let t = Tensor {
                name: "t".into(),
                datatype: d,
                shape: vec![2],
                data: bytes,
            };
            t.check().unwrap();
            assert_eq!(data_to_json(&t), data, "{d:?}");
        }
    }
}
