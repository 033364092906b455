//! Bounds on what a gRPC request may cost once decoded, checked on its protobuf bytes before
//! prost decodes them.
//!
//! prost turns each entry of a repeated message field into a whole struct: an empty `inputs`
//! entry is 2 bytes on the wire and about 300 bytes decoded, so 4 MiB of them took 620 MiB.
//! [`BoundedCodec`] (the service's codec, named in `build.rs`) first walks the message's wire
//! format without allocating and refuses, with `INVALID_ARGUMENT`:
//!
//! - a `ModelInfer` request with more than [`MAX_ENTRIES`] `inputs`, `outputs` or
//!   `raw_input_contents`, more than [`MAX_ENTRIES`] parameters in all (the request's, every
//!   input's and every output's), an input shape of more than [`MAX_RANK`] dimensions, or
//!   typed `contents` that would decode to more than [`CONTENTS_MULTIPLE`] bytes per byte of
//!   the message plus [`CONTENTS_ALLOWANCE`] (only short `bytes_contents` elements can: send
//!   `BYTES` in `raw_input_contents`);
//! - a repository load or unload request with more than [`MAX_ENTRIES`] parameters;
//! - a message whose wire format is broken (prost would refuse it too).
//!
//! A message that passes the walk and still does not decode (a known field of the wrong wire
//! type, a string that is not UTF-8) is refused with `INVALID_ARGUMENT` too, where prost's
//! codec in tonic answers `INTERNAL`.
//!
//! So a `ModelInfer` request decodes to at most [`CONTENTS_MULTIPLE`] times its size plus a
//! constant (about 1 MiB at the caps, with [`CONTENTS_ALLOWANCE`]), and the other requests of the service to about their
//! size. Each refusal counts as the protection `grpc-decode-bounds`.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder};

use super::inference::*;

/// Most entries of each repeated field of a `ModelInfer` request (`inputs`, `outputs`,
/// `raw_input_contents`), and most parameters of one request in all.
pub const MAX_ENTRIES: usize = 1024;

/// Most dimensions of an input's shape (as the REST decoder).
pub const MAX_RANK: usize = 16;

/// Most bytes the typed `contents` of a `ModelInfer` request may take decoded, per byte of
/// the message. Every fixed-size element type is within it (an `int64` of one wire byte
/// takes 8); a `bytes_contents` element takes 24 bytes plus its heap block.
pub const CONTENTS_MULTIPLE: usize = 8;

/// Bytes the typed `contents` of a `ModelInfer` request may take decoded beyond
/// [`CONTENTS_MULTIPLE`] times the message: a small request of short strings (Triton's
/// `grpc_explicit_byte_content_client.py`: 16 one- and two-digit strings in each of two
/// inputs, 185 bytes on the wire, 1,792 decoded) is well within any bound that matters, and
/// a fixed allowance keeps what a message may cost decoded linear in its size.
pub const CONTENTS_ALLOWANCE: usize = 64 << 10;

/// Bytes a decoded `bytes_contents` element of `len` bytes takes: its `Vec` and its heap
/// block (allocators round small blocks up to 32 bytes).
fn bytes_element_cost(len: usize) -> usize {
    24 + if len == 0 { 0 } else { (len + 8).max(32) }
}

/// A request message whose protobuf bytes are checked before prost decodes them.
pub trait DecodeBounds {
    /// Checks `wire` (the message's encoded bytes).
    ///
    /// Errors: `INVALID_ARGUMENT` naming the bound the message breaks.
    fn check_wire(_wire: &[u8]) -> Result<(), Status> {
        Ok(())
    }
}

impl DecodeBounds for ServerLiveRequest {}
impl DecodeBounds for ServerReadyRequest {}
impl DecodeBounds for ModelReadyRequest {}
impl DecodeBounds for ServerMetadataRequest {}
impl DecodeBounds for ModelMetadataRequest {}
impl DecodeBounds for ModelConfigRequest {}
impl DecodeBounds for ModelStatisticsRequest {}
impl DecodeBounds for RepositoryIndexRequest {}
impl DecodeBounds for SystemSharedMemoryStatusRequest {}
impl DecodeBounds for SystemSharedMemoryRegisterRequest {}
impl DecodeBounds for SystemSharedMemoryUnregisterRequest {}
impl DecodeBounds for CudaSharedMemoryStatusRequest {}
impl DecodeBounds for CudaSharedMemoryRegisterRequest {}
impl DecodeBounds for CudaSharedMemoryUnregisterRequest {}

impl DecodeBounds for ModelInferRequest {
    fn check_wire(wire: &[u8]) -> Result<(), Status> {
        check_infer(wire).map_err(refuse)
    }
}

impl DecodeBounds for RepositoryModelLoadRequest {
    fn check_wire(wire: &[u8]) -> Result<(), Status> {
        check_repository(wire).map_err(refuse)
    }
}

impl DecodeBounds for RepositoryModelUnloadRequest {
    fn check_wire(wire: &[u8]) -> Result<(), Status> {
        check_repository(wire).map_err(refuse)
    }
}

fn refuse(why: String) -> Status {
    tpubox_core::protection::triggered("grpc-decode-bounds", "grpc", format_args!("{why}"));
    Status::invalid_argument(why)
}

/// The service's codec: prost's, with [`DecodeBounds::check_wire`] before each decode.
#[derive(Debug)]
pub struct BoundedCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for BoundedCodec<T, U> {
    fn default() -> Self {
        BoundedCodec { _pd: PhantomData }
    }
}

impl<T, U> Codec for BoundedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + DecodeBounds + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = BoundedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        BoundedDecoder {
            inner: tonic_prost::ProstDecoder::default(),
        }
    }
}

/// [`BoundedCodec`]'s decoder.
#[derive(Debug)]
pub struct BoundedDecoder<U> {
    inner: tonic_prost::ProstDecoder<U>,
}

impl<U: Message + Default + DecodeBounds> Decoder for BoundedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        use bytes::Buf;
        if buf.chunk().len() == buf.remaining() {
            U::check_wire(buf.chunk())?;
        } else {
            // tonic keeps a message in one buffer; this copy is not expected to run.
            let whole = buf.copy_to_bytes(buf.remaining());
            U::check_wire(&whole)?;
            return U::decode(whole)
                .map(Some)
                .map_err(|e| tpubox_session_api::codec::undecodable::<U>(&e.to_string()));
        }
        // A message the walk let through can still break prost's rules (a known field of
        // the wrong wire type, a string that is not UTF-8): the client's error too, not the
        // INTERNAL of tonic's codec.
        self.inner
            .decode(buf)
            .map_err(|e| tpubox_session_api::codec::undecodable::<U>(e.message()))
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        self.inner.buffer_settings()
    }
}

// --- The wire format ------------------------------------------------------------------------

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const FIXED32: u8 = 5;

/// prost's recursion limit, which also bounds the groups this reader skips.
const MAX_DEPTH: usize = 100;

type Check<T> = Result<T, String>;

fn broken() -> String {
    "the message is not valid protobuf".to_string()
}

/// A reader of protobuf fields over one message's bytes.
struct Wire<'a> {
    rest: &'a [u8],
}

/// One field: its number, and its value (a varint, fixed bytes or a length-delimited slice).
enum Value<'a> {
    Varint,
    Fixed,
    Bytes(&'a [u8]),
}

impl<'a> Wire<'a> {
    fn new(b: &'a [u8]) -> Self {
        Wire { rest: b }
    }

    fn varint(&mut self) -> Check<u64> {
        let mut v = 0u64;
        for i in 0..10 {
            let (&b, rest) = self.rest.split_first().ok_or_else(broken)?;
            self.rest = rest;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err(broken())
    }

    fn take(&mut self, n: usize) -> Check<&'a [u8]> {
        if n > self.rest.len() {
            return Err(broken());
        }
        let (a, b) = self.rest.split_at(n);
        self.rest = b;
        Ok(a)
    }

    /// The next field, groups skipped whole; `None` at the end.
    fn next(&mut self) -> Check<Option<(u32, Value<'a>)>> {
        loop {
            if self.rest.is_empty() {
                return Ok(None);
            }
            let (field, wt) = self.tag()?;
            if wt == START_GROUP {
                self.skip_group(field, 1)?;
                continue;
            }
            return Ok(Some((field, self.value(wt)?)));
        }
    }

    fn tag(&mut self) -> Check<(u32, u8)> {
        let key = self.varint()?;
        let field = u32::try_from(key >> 3).map_err(|_| broken())?;
        if field == 0 || field > 0x1fff_ffff {
            return Err(broken());
        }
        Ok((field, (key & 7) as u8))
    }

    fn value(&mut self, wt: u8) -> Check<Value<'a>> {
        Ok(match wt {
            VARINT => {
                self.varint()?;
                Value::Varint
            }
            FIXED64 => {
                self.take(8)?;
                Value::Fixed
            }
            FIXED32 => {
                self.take(4)?;
                Value::Fixed
            }
            LEN => {
                let n = usize::try_from(self.varint()?).map_err(|_| broken())?;
                Value::Bytes(self.take(n)?)
            }
            _ => return Err(broken()),
        })
    }

    fn skip_group(&mut self, field: u32, depth: usize) -> Check<()> {
        if depth > MAX_DEPTH {
            return Err(broken());
        }
        loop {
            let (f, wt) = self.tag()?;
            match wt {
                END_GROUP if f == field => return Ok(()),
                END_GROUP => return Err(broken()),
                START_GROUP => self.skip_group(f, depth + 1)?,
                _ => {
                    self.value(wt)?;
                }
            }
        }
    }
}

/// Elements of a packed run of varints: the bytes that end one.
fn packed_varints(b: &[u8]) -> usize {
    b.iter().filter(|&&x| x < 0x80).count()
}

/// What a `ModelInfer` request holds, as counted so far.
#[derive(Default)]
struct Counts {
    inputs: usize,
    outputs: usize,
    raw: usize,
    parameters: usize,
    /// Bytes the typed contents take decoded.
    contents: usize,
}

impl Counts {
    fn parameter(&mut self) -> Check<()> {
        self.parameters += 1;
        if self.parameters > MAX_ENTRIES {
            return Err(format!(
                "the request has more than {MAX_ENTRIES} parameters (request, inputs and outputs together)"
            ));
        }
        Ok(())
    }
}

fn over(what: &str) -> String {
    format!("the request has more than {MAX_ENTRIES} {what}")
}

/// Checks a `ModelInferRequest` (see the module docs).
fn check_infer(wire: &[u8]) -> Check<()> {
    let mut c = Counts::default();
    let mut w = Wire::new(wire);
    while let Some((field, v)) = w.next()? {
        match (field, v) {
            (4, Value::Bytes(_)) => c.parameter()?,
            (5, Value::Bytes(b)) => {
                c.inputs += 1;
                if c.inputs > MAX_ENTRIES {
                    return Err(over("inputs"));
                }
                check_input(b, &mut c)?;
            }
            (6, Value::Bytes(b)) => {
                c.outputs += 1;
                if c.outputs > MAX_ENTRIES {
                    return Err(over("outputs"));
                }
                let mut o = Wire::new(b);
                while let Some((f, v)) = o.next()? {
                    if let (2, Value::Bytes(_)) = (f, v) {
                        c.parameter()?;
                    }
                }
            }
            (7, Value::Bytes(_)) => {
                c.raw += 1;
                if c.raw > MAX_ENTRIES {
                    return Err(over("raw_input_contents"));
                }
            }
            _ => {}
        }
    }
    let limit = CONTENTS_MULTIPLE
        .saturating_mul(wire.len())
        .saturating_add(CONTENTS_ALLOWANCE);
    if c.contents > limit {
        return Err(format!(
            "the inputs' typed contents would take {} bytes decoded, more than {CONTENTS_MULTIPLE} times the message's {} bytes plus {CONTENTS_ALLOWANCE} (send BYTES tensors in raw_input_contents)",
            c.contents,
            wire.len()
        ));
    }
    Ok(())
}

/// Checks one `InferInputTensor`: its rank, parameters and typed contents.
fn check_input(b: &[u8], c: &mut Counts) -> Check<()> {
    let mut rank = 0usize;
    let mut w = Wire::new(b);
    while let Some((field, v)) = w.next()? {
        match (field, v) {
            (3, Value::Bytes(p)) => rank += packed_varints(p),
            (3, Value::Varint) => rank += 1,
            (4, Value::Bytes(_)) => c.parameter()?,
            (5, Value::Bytes(contents)) => check_contents(contents, c)?,
            _ => {}
        }
        if rank > MAX_RANK {
            return Err(format!(
                "an input's shape has more than {MAX_RANK} dimensions"
            ));
        }
    }
    Ok(())
}

/// Adds what one `InferTensorContents` takes decoded to `c.contents`.
fn check_contents(b: &[u8], c: &mut Counts) -> Check<()> {
    let mut w = Wire::new(b);
    while let Some((field, v)) = w.next()? {
        let cost = match (field, v) {
            // bool, int32, int64, uint32, uint64: packed varints or one varint.
            (1..=5, v) => {
                let size = match field {
                    1 => 1,
                    2 | 4 => 4,
                    _ => 8,
                };
                match v {
                    Value::Bytes(p) => packed_varints(p) * size,
                    _ => size,
                }
            }
            (6, Value::Bytes(p)) => p.len(),
            (7, Value::Bytes(p)) => p.len(),
            (6 | 7, _) => 8,
            (8, Value::Bytes(p)) => bytes_element_cost(p.len()),
            _ => 0,
        };
        c.contents = c.contents.saturating_add(cost);
    }
    Ok(())
}

/// Checks a repository load or unload request: at most [`MAX_ENTRIES`] parameters.
fn check_repository(wire: &[u8]) -> Check<()> {
    let mut n = 0usize;
    let mut w = Wire::new(wire);
    while let Some((field, v)) = w.next()? {
        if let (3, Value::Bytes(_)) = (field, v) {
            n += 1;
            if n > MAX_ENTRIES {
                return Err(over("parameters"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn infer(r: &ModelInferRequest) -> Result<(), Status> {
        ModelInferRequest::check_wire(&r.encode_to_vec())
    }

    fn input(name: &str) -> model_infer_request::InferInputTensor {
        model_infer_request::InferInputTensor {
            name: name.into(),
            datatype: "FP32".into(),
            shape: vec![1, 2],
            ..Default::default()
        }
    }

    /// A message the walk lets through and prost refuses (here a known string field sent as
    /// a varint) is `INVALID_ARGUMENT`, not tonic's `INTERNAL` (found by the fuzz target
    /// `doors` on a repository load).
    #[test]
    fn an_undecodable_message_is_invalid_argument() {
        let frame = |m: &[u8]| {
            let mut b = vec![0u8];
            b.extend_from_slice(&(m.len() as u32).to_be_bytes());
            b.extend_from_slice(m);
            vec![bytes::Bytes::from(b)]
        };
        let decoder =
            BoundedCodec::<RepositoryModelLoadRequest, RepositoryModelLoadRequest>::default()
                .decoder();
        let e =
            tpubox_session_api::fuzzing::decode_body(decoder, frame(&[0x08, 0x01]), 1 << 20, true)
                .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        let decoder = BoundedCodec::<ModelInferRequest, ModelInferRequest>::default().decoder();
        let e =
            tpubox_session_api::fuzzing::decode_body(decoder, frame(&[0x08, 0x01]), 1 << 20, true)
                .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    }

    #[test]
    fn ordinary_requests_pass() {
        let mut r = ModelInferRequest {
            model_name: "m".into(),
            inputs: (0..MAX_ENTRIES).map(|i| input(&i.to_string())).collect(),
            raw_input_contents: vec![vec![0; 8]; MAX_ENTRIES],
            ..Default::default()
        };
        r.inputs[0].contents = Some(InferTensorContents {
            int64_contents: vec![1; 1000],
            bytes_contents: vec![b"a longer string of bytes".to_vec(); 10],
            ..Default::default()
        });
        r.parameters.insert("p".into(), InferParameter::default());
        infer(&r).unwrap();
    }

    #[test]
    fn short_strings_in_a_small_request_pass() {
        // Triton's grpc_explicit_byte_content_client.py: 16 short strings in each of two inputs.
        let strings = |f: fn(i32) -> i32| InferTensorContents {
            bytes_contents: (0..16).map(|i| f(i).to_string().into_bytes()).collect(),
            ..Default::default()
        };
        let tensor = |name: &str, c| model_infer_request::InferInputTensor {
            name: name.into(),
            datatype: "BYTES".into(),
            shape: vec![1, 16],
            contents: Some(c),
            ..Default::default()
        };
        let r = ModelInferRequest {
            model_name: "simple_string".into(),
            inputs: vec![
                tensor("INPUT0", strings(|i| i)),
                tensor("INPUT1", strings(|_| 1)),
            ],
            ..Default::default()
        };
        infer(&r).unwrap();
    }

    #[test]
    fn too_many_entries_are_invalid_arguments() {
        let base = ModelInferRequest::default();
        let mut many_inputs = base.clone();
        many_inputs.inputs = vec![Default::default(); MAX_ENTRIES + 1];
        let mut many_outputs = base.clone();
        many_outputs.outputs = vec![Default::default(); MAX_ENTRIES + 1];
        let mut many_raw = base.clone();
        many_raw.raw_input_contents = vec![vec![]; MAX_ENTRIES + 1];
        let mut many_params = base.clone();
        many_params.inputs = (0..2)
            .map(|i| model_infer_request::InferInputTensor {
                parameters: (0..MAX_ENTRIES / 2 + 1)
                    .map(|p| (format!("{i}-{p}"), InferParameter::default()))
                    .collect(),
                ..Default::default()
            })
            .collect();
        let mut deep = base.clone();
        deep.inputs = vec![model_infer_request::InferInputTensor {
            shape: vec![1; MAX_RANK + 1],
            ..Default::default()
        }];
        let mut strings = base.clone();
        strings.inputs = vec![model_infer_request::InferInputTensor {
            contents: Some(InferTensorContents {
                bytes_contents: vec![vec![]; 20_000],
                ..Default::default()
            }),
            ..Default::default()
        }];
        for (r, want) in [
            (many_inputs, "inputs"),
            (many_outputs, "outputs"),
            (many_raw, "raw_input_contents"),
            (many_params, "parameters"),
            (deep, "dimensions"),
            (strings, "typed contents"),
        ] {
            let e = infer(&r).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{want}");
            assert!(e.message().contains(want), "{want}: {}", e.message());
        }
    }

    #[test]
    fn broken_wire_and_groups() {
        // A truncated length-delimited field.
        let e = ModelInferRequest::check_wire(&[0x2a, 0x05, 0x00]).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        // An unknown group is skipped whole, and the inputs after it still count.
        let mut wire = Vec::new();
        prost::encoding::encode_varint((99 << 3) | 3, &mut wire);
        wire.extend_from_slice(&[0x08, 0x01]);
        prost::encoding::encode_varint((99 << 3) | 4, &mut wire);
        for _ in 0..=MAX_ENTRIES {
            wire.extend_from_slice(&[0x2a, 0x00]);
        }
        let e = ModelInferRequest::check_wire(&wire).unwrap_err();
        assert!(e.message().contains("inputs"), "{}", e.message());
    }

    #[test]
    fn repository_parameters_are_bounded() {
        let r = RepositoryModelLoadRequest {
            parameters: (0..=MAX_ENTRIES)
                .map(|i| (i.to_string(), ModelRepositoryParameter::default()))
                .collect(),
            ..Default::default()
        };
        let e = RepositoryModelLoadRequest::check_wire(&r.encode_to_vec()).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }
}
