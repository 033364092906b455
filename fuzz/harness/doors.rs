//! The `doors` harness: the daemon's request decoding on untrusted bytes, in process, before
//! any session, model or device is involved. Shared by the cargo-fuzz target
//! (`fuzz/fuzz_targets/doors.rs`) and the ordinary test that replays `fuzz/regressions/doors/`
//! (`tests/all/fuzz_regressions.rs`), through `#[path]`.
//!
//! The input's first byte picks a door; the rest decodes (with `arbitrary`) into a mirror of
//! that door's messages, written out as mostly valid bytes with the real field numbers and
//! names (lying sizes, wrong dtypes and wire types, huge and negative dims, duplicated fields,
//! deep nesting, truncated frames), or, in each door's raw mode, taken as they are:
//!
//! - the session API over gRPC: every request message of `tpubox.v1.Session`, framed as
//!   gRPC messages split over HTTP/2 DATA frames, through tonic's framing, the session codec
//!   and the service's conversions (`tpubox_session_api::fuzzing::session_request`);
//! - the session API's local socket: a request's 4-byte length and JSON header
//!   (`tpubox_session_api::fuzzing::local_request`);
//! - the REST door: an inference request body with or without
//!   `Inference-Header-Content-Length` and `binary_data_size` inputs
//!   (`tpubox_serve::fuzzing::rest_infer`);
//! - the gRPC inference door: `ModelInfer` and repository load requests through the bounded
//!   codec (`tpubox_serve::fuzzing::grpc_infer`, `grpc_load`);
//! - model configurations: `config.pbtxt`, TOML and JSON (a load's config override)
//!   (`tpubox_serve::fuzzing::config`).
//!
//! Invariants checked:
//! - nothing panics;
//! - every refusal is of the kind the door documents for a client's error: gRPC
//!   `INVALID_ARGUMENT`, or `RESOURCE_EXHAUSTED` / `OUT_OF_RANGE` for a message over the size
//!   limit and a tensor over the session's `max-device-bytes`, never `INTERNAL` or `UNKNOWN`;
//!   REST 400; local socket `invalid-argument` (or `resource-exhausted` over the limit);
//! - what is accepted is consistent: a decoded tensor's bytes are its shape's elements times
//!   its dtype's size (`BYTES`: as many length-prefixed elements as the shape says), an
//!   upload never holds more than its declared size, admitted sizes are below the limit;
//! - bounded allocation: while one input is decoded, the bytes allocated at once never exceed
//!   [`ALLOC_MULTIPLE`] times the input's size plus [`ALLOC_ALLOWANCE`] (measured by the
//!   target's counting allocator, when it has one; see [`PEAK`]).
//!
//! Run: `bash scripts/dev.sh fuzz [SECONDS] doors`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};

use arbitrary::{Arbitrary, Unstructured};
use bytes::Bytes;

/// Bytes allocated now, kept by the fuzz target's counting allocator (0 without one).
pub static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The most bytes allocated at once since it was last reset to [`LIVE`].
pub static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Bytes one input's decoding may hold at once: this many times the input's size ...
pub const ALLOC_MULTIPLE: usize = 32;
/// ... plus this: tonic's read buffer and its reservation of a message's declared length (at
/// most [`MAX_MESSAGE_BYTES`]), prost-reflect's descriptor pool for a configuration, and the
/// decoders' fixed costs.
pub const ALLOC_ALLOWANCE: usize = 3 << 20;

/// Largest gRPC message the harness's doors take (the daemon's `--max-request-mib` in small).
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// The session's `max-device-bytes` the conversions admit against.
pub const MAX_DEVICE_BYTES: u64 = 1 << 30;
/// Devices the host has, for the session API's device counts.
pub const HOST_DEVICES: usize = 8;

// --- protobuf, written by hand from a mirror -----------------------------------------------

/// A field's kind in the schema of a message.
#[derive(Clone, Copy, Debug)]
enum K {
    Varint,
    Int64,
    Bool,
    Enum,
    Double,
    Str,
    Bytes,
    Packed,
    PackedI64,
    PackedBool,
    PackedF32,
    PackedF64,
    Msg(usize),
    Map(usize),
}

/// Message schemas: (field number, kind). Indexes are the `Msg`/`Map` references.
const SCHEMAS: &[&[(u32, K)]] = &[
    /* 0 TensorSpec */ &[(1, K::Enum), (2, K::Packed)],
    /* 1 Limits */
    &[
        (1, K::Varint),
        (2, K::Varint),
        (3, K::Varint),
        (4, K::Varint),
        (5, K::Varint),
        (6, K::Double),
        (7, K::Varint),
        (8, K::Double),
        (9, K::Varint),
    ],
    /* 2 OpenRequest */
    &[
        (1, K::Msg(1)),
        (2, K::Bool),
        (3, K::Str),
        (4, K::Varint),
        (5, K::Packed),
        (6, K::Bool),
    ],
    /* 3 empty */ &[],
    /* 4 PutTensorChunk */ &[(1, K::Msg(0)), (2, K::Varint), (3, K::Bytes)],
    /* 5 GetTensorRequest */ &[(1, K::Varint), (2, K::Varint)],
    /* 6 FreeRequest */ &[(1, K::Packed), (2, K::Packed)],
    /* 7 CompileRequest */
    &[
        (1, K::Bytes),
        (2, K::Enum),
        (3, K::Varint),
        (4, K::Str),
        (5, K::Packed),
    ],
    /* 8 ExecuteRequest */ &[(1, K::Varint), (2, K::Packed), (3, K::Packed)],
    /* 9 InlineTensor */ &[(1, K::Msg(0)), (2, K::Bytes), (3, K::Varint)],
    /* 10 CallArgument */ &[(1, K::Varint), (2, K::Msg(9))],
    /* 11 CallRequest */
    &[
        (1, K::Varint),
        (2, K::Msg(10)),
        (3, K::Packed),
        (4, K::Packed),
        (5, K::Packed),
        (6, K::Packed),
        (7, K::Bool),
    ],
    /* 12 PutShardedChunk */
    &[(1, K::Msg(0)), (2, K::Str), (3, K::Packed), (4, K::Bytes)],
    /* 13 GetShardedTensorRequest */
    &[(1, K::Msg(0)), (2, K::Str), (3, K::Packed), (4, K::Varint)],
    /* 14 ShardHandles */ &[(1, K::Packed)],
    /* 15 ShardedArgument */ &[(1, K::Msg(14)), (2, K::Msg(9))],
    /* 16 CallShardedRequest */
    &[
        (1, K::Varint),
        (2, K::Msg(15)),
        (3, K::Packed),
        (4, K::Packed),
        (5, K::Packed),
        (6, K::Packed),
    ],
    /* 17 WaitRequest */ &[(1, K::Packed), (2, K::Bool)],
    /* 18 SetLaunchBlockingRequest */ &[(1, K::Bool)],
    /* 19 OpenWeightsRequest */ &[(1, K::Str), (2, K::Varint)],
    /* 20 PublishWeightsRequest.Entry */ &[(1, K::Str), (2, K::Varint)],
    /* 21 PublishWeightsRequest */ &[(1, K::Str), (2, K::Msg(20)), (3, K::Str)],
    /* 22 a name */ &[(1, K::Str)],
    /* 23 RunComponentRequest */
    &[
        (1, K::Bytes),
        (2, K::Str),
        (3, K::Str),
        (4, K::Bytes),
        (5, K::Double),
    ],
    /* 24 InferParameter */
    &[
        (1, K::Bool),
        (2, K::Int64),
        (3, K::Str),
        (4, K::Double),
        (5, K::Varint),
    ],
    /* 25 InferTensorContents */
    &[
        (1, K::PackedBool),
        (2, K::PackedI64),
        (3, K::PackedI64),
        (4, K::Packed),
        (5, K::Packed),
        (6, K::PackedF32),
        (7, K::PackedF64),
        (8, K::Bytes),
    ],
    /* 26 InferInputTensor */
    &[
        (1, K::Str),
        (2, K::Str),
        (3, K::PackedI64),
        (4, K::Map(24)),
        (5, K::Msg(25)),
    ],
    /* 27 InferRequestedOutputTensor */ &[(1, K::Str), (2, K::Map(24))],
    /* 28 ModelInferRequest */
    &[
        (1, K::Str),
        (2, K::Str),
        (3, K::Str),
        (4, K::Map(24)),
        (5, K::Msg(26)),
        (6, K::Msg(27)),
        (7, K::Bytes),
    ],
    /* 29 ModelRepositoryParameter */
    &[(1, K::Bool), (2, K::Int64), (3, K::Str), (4, K::Bytes)],
    /* 30 RepositoryModelLoadRequest */ &[(1, K::Str), (2, K::Str), (3, K::Map(29))],
];

/// The request message of each method of `tpubox.v1.Session`, in the proto's order
/// (`tpubox_session_api::fuzzing::METHODS`).
const SESSION_REQUESTS: [usize; 22] = [
    2, 3, 3, 3, 4, 5, 6, 7, 8, 11, 12, 13, 16, 17, 18, 19, 21, 22, 22, 23, 3, 3,
];
const MODEL_INFER: usize = 28;
const REPOSITORY_LOAD: usize = 30;

/// A number: mostly the interesting ones.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Num {
    Small(u8),
    Interesting(u8),
    Any(u64),
    Negative(i64),
}

const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    16,
    255,
    256,
    4096,
    65535,
    65536,
    1 << 20,
    (1 << 24) - 1,
    1 << 30,
    (1 << 31) - 1,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    (1 << 40) + 1,
    i64::MAX as u64,
    (i64::MAX as u64) + 1,
    u64::MAX - 1,
    u64::MAX,
];

impl Num {
    fn u64(self) -> u64 {
        match self {
            Num::Small(n) => u64::from(n % 8),
            Num::Interesting(i) => INTERESTING[i as usize % INTERESTING.len()],
            Num::Any(n) => n,
            Num::Negative(n) => n as u64,
        }
    }

    fn i64(self) -> i64 {
        match self {
            Num::Negative(n) => n,
            n => n.u64() as i64,
        }
    }
}

/// Strings the doors know, and anything else.
#[derive(Arbitrary, Debug, Clone)]
enum Text {
    Known(u8),
    Sharding(Sharding),
    Any(String),
    Long(u16, char),
}

const KNOWN: &[&str] = &[
    "",
    "x",
    "input0",
    "FP32",
    "FP16",
    "BF16",
    "FP64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "BOOL",
    "BYTES",
    "TYPE_FP32",
    "F32",
    "S64",
    "PRED",
    "C128",
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "shared_memory_region",
    "shared_memory_offset",
    "shared_memory_byte_size",
    "binary_data_size",
    "binary_data",
    "binary_data_output",
    "config",
    "file:model.onnx",
    "O0",
    "O3",
    "O9",
    "component",
    "../etc/passwd",
    ".hidden",
    "*",
    "{}",
    "{\"tpubox\": {}}",
    "{\"name\": \"model\", \"max_batch_size\": 8}",
    "{\"input\": [{\"name\": \"x\", \"data_type\": \"TYPE_FP32\", \"dims\": [-1, 3]}]}",
    "ML\u{ef}R",
];

impl Text {
    fn string(&self) -> String {
        match self {
            Text::Known(i) => KNOWN[*i as usize % KNOWN.len()].to_string(),
            Text::Sharding(s) => s.text(),
            Text::Any(s) => s.clone(),
            Text::Long(n, c) => std::iter::repeat_n(*c, *n as usize % 4096).collect(),
        }
    }
}

/// A sharding in XLA's text form.
#[derive(Arbitrary, Debug, Clone)]
enum Sharding {
    Replicated,
    Manual,
    Maximal(Num),
    Tiled {
        dims: Vec<Num>,
        devices: Vec<Num>,
        last_tile_dim_replicate: bool,
    },
    Iota {
        dims: Vec<Num>,
        reshape: Vec<Num>,
        transpose: Vec<u8>,
        last_tile_dims: Vec<u8>,
    },
}

impl Sharding {
    fn text(&self) -> String {
        let list = |v: &[Num]| {
            v.iter()
                .map(|n| n.i64().to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            Sharding::Replicated => "{replicated}".into(),
            Sharding::Manual => "{manual}".into(),
            Sharding::Maximal(n) => format!("{{maximal device={}}}", n.i64()),
            Sharding::Tiled {
                dims,
                devices,
                last_tile_dim_replicate,
            } => format!(
                "{{devices=[{}]{}{}}}",
                list(dims),
                list(devices),
                if *last_tile_dim_replicate {
                    " last_tile_dim_replicate"
                } else {
                    ""
                }
            ),
            Sharding::Iota {
                dims,
                reshape,
                transpose,
                last_tile_dims,
            } => {
                let mut s = format!("{{devices=[{}]<=[{}]", list(dims), list(reshape));
                if !transpose.is_empty() {
                    let t: Vec<String> = transpose.iter().map(|t| (t % 8).to_string()).collect();
                    let _ = write!(s, "T({})", t.join(","));
                }
                if !last_tile_dims.is_empty() {
                    let kinds = ["replicated", "manual", "unreduced", "bogus"];
                    let t: Vec<&str> = last_tile_dims
                        .iter()
                        .map(|k| kinds[*k as usize % 4])
                        .collect();
                    let _ = write!(s, " last_tile_dims={{{}}}", t.join(", "));
                }
                s.push('}');
                s
            }
        }
    }
}

/// One field of a message: which of the schema's fields (or another number) and its value.
#[derive(Arbitrary, Debug, Clone)]
struct Field {
    pick: u8,
    value: Value,
}

/// A field's value; one that does not fit the field's kind is written as it is (a wrong wire
/// type, or a message where a scalar belongs).
#[derive(Arbitrary, Debug, Clone)]
enum Value {
    Num(Num),
    Nums(Vec<Num>),
    Text(Text),
    Bytes(Vec<u8>),
    Repeat(u16, u8),
    Message(Vec<Field>),
    /// A length-delimited field whose length says more (or less) than follows.
    LyingLength(u32, Vec<u8>),
    /// A field of an unknown number, of wire type `t`.
    Unknown(u16, u8, Num),
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire & 7));
}

fn delimited(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Writes `fields` as a message of schema `schema`.
fn message(schema: usize, fields: &[Field], depth: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let s = SCHEMAS[schema];
    for f in fields {
        if s.is_empty() {
            // An empty message: only unknown fields.
            unknown(&mut out, u32::from(f.pick) + 1, &f.value, depth);
            continue;
        }
        let (num, kind) = s[f.pick as usize % s.len()];
        field(&mut out, num, kind, &f.value, depth);
    }
    out
}

fn unknown(out: &mut Vec<u8>, num: u32, v: &Value, depth: usize) {
    match v {
        Value::Num(n) => {
            key(out, num, 0);
            varint(out, n.u64());
        }
        _ => field(out, num, K::Bytes, v, depth),
    }
}

fn field(out: &mut Vec<u8>, num: u32, kind: K, v: &Value, depth: usize) {
    match v {
        Value::LyingLength(len, bytes) => {
            key(out, num, 2);
            varint(out, u64::from(*len));
            out.extend_from_slice(bytes);
            return;
        }
        Value::Unknown(n, t, x) => {
            let t = t % 8;
            key(out, u32::from(*n) + 1, t);
            match t {
                0 => varint(out, x.u64()),
                1 => out.extend_from_slice(&x.u64().to_le_bytes()),
                2 => {
                    varint(out, x.u64() % 64);
                    out.extend(std::iter::repeat_n(0u8, (x.u64() % 64) as usize));
                }
                5 => out.extend_from_slice(&(x.u64() as u32).to_le_bytes()),
                _ => {}
            }
            return;
        }
        _ => {}
    }
    match kind {
        K::Varint | K::Enum | K::Int64 | K::Bool => match v {
            Value::Num(n) => {
                key(out, num, 0);
                let x = match kind {
                    K::Bool => n.u64() % 3,
                    K::Enum => match n {
                        Num::Small(s) => u64::from(*s % 20),
                        n => n.u64(),
                    },
                    K::Int64 => n.i64() as u64,
                    _ => n.u64(),
                };
                varint(out, x);
            }
            Value::Nums(ns) => {
                // Repeated scalars where one belongs: the last one wins.
                for n in ns {
                    key(out, num, 0);
                    varint(out, n.u64());
                }
            }
            other => bytes_of(out, num, other, depth),
        },
        K::Double => match v {
            Value::Num(n) => {
                key(out, num, 1);
                let x = match n {
                    Num::Small(s) => [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300, 0.5, 5e-324, -0.0]
                        [*s as usize % 8],
                    n => f64::from_bits(n.u64()),
                };
                out.extend_from_slice(&x.to_le_bytes());
            }
            other => bytes_of(out, num, other, depth),
        },
        K::Str | K::Bytes => bytes_of(out, num, v, depth),
        K::Packed | K::PackedI64 | K::PackedBool | K::PackedF32 | K::PackedF64 => match v {
            Value::Nums(ns) => {
                let mut p = Vec::new();
                for n in ns {
                    match kind {
                        K::PackedF32 => p.extend_from_slice(&(n.u64() as u32).to_le_bytes()),
                        K::PackedF64 => p.extend_from_slice(&n.u64().to_le_bytes()),
                        K::PackedBool => varint(&mut p, n.u64() % 3),
                        K::PackedI64 => varint(&mut p, n.i64() as u64),
                        _ => varint(&mut p, n.u64()),
                    }
                }
                delimited(out, num, &p);
            }
            Value::Repeat(count, b) => {
                // Many elements in few bytes: `count` copies of one small element.
                let p = vec![b & 0x7f; *count as usize];
                delimited(out, num, &p);
            }
            Value::Num(n) => {
                // One unpacked element, as an older writer sends it.
                match kind {
                    K::PackedF32 => {
                        key(out, num, 5);
                        out.extend_from_slice(&(n.u64() as u32).to_le_bytes());
                    }
                    K::PackedF64 => {
                        key(out, num, 1);
                        out.extend_from_slice(&n.u64().to_le_bytes());
                    }
                    _ => {
                        key(out, num, 0);
                        varint(out, n.u64());
                    }
                }
            }
            other => bytes_of(out, num, other, depth),
        },
        K::Msg(m) => match v {
            Value::Message(fields) if depth < 12 => {
                delimited(out, num, &message(m, fields, depth + 1));
            }
            other => bytes_of(out, num, other, depth),
        },
        K::Map(m) => match v {
            Value::Message(fields) if depth < 12 => {
                // A map entry: key 1 (a string), value 2 (a message of schema `m`).
                let mut entry = Vec::new();
                let mut rest = fields.as_slice();
                if let Some((first, r)) = rest.split_first() {
                    if let Value::Text(t) = &first.value {
                        delimited(&mut entry, 1, t.string().as_bytes());
                        rest = r;
                    } else {
                        delimited(
                            &mut entry,
                            1,
                            KNOWN[first.pick as usize % KNOWN.len()].as_bytes(),
                        );
                    }
                }
                delimited(&mut entry, 2, &message(m, rest, depth + 1));
                delimited(out, num, &entry);
            }
            other => bytes_of(out, num, other, depth),
        },
    }
}

/// Writes `v` as a length-delimited field.
fn bytes_of(out: &mut Vec<u8>, num: u32, v: &Value, depth: usize) {
    match v {
        Value::Text(t) => delimited(out, num, t.string().as_bytes()),
        Value::Bytes(b) => delimited(out, num, b),
        Value::Repeat(n, b) => delimited(out, num, &vec![*b; *n as usize]),
        Value::Message(fields) if depth < 12 => {
            // A message of unknown schema: its fields as a TensorSpec's.
            delimited(out, num, &message(0, fields, depth + 1));
        }
        Value::Num(n) => {
            key(out, num, 0);
            varint(out, n.u64());
        }
        Value::Nums(ns) => {
            let mut p = Vec::new();
            for n in ns {
                varint(&mut p, n.u64());
            }
            delimited(out, num, &p);
        }
        _ => {}
    }
}

/// How messages are framed on the wire (gRPC's 5-byte prefix) and split into DATA frames.
#[derive(Arbitrary, Debug, Clone)]
struct Framing {
    /// Per message: `None` honest, else a lie about it.
    lies: Vec<Option<Lie>>,
    /// Where the body is cut into DATA frames.
    splits: Vec<u16>,
    /// Bytes after the last message.
    trailing: Vec<u8>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Lie {
    Length(u32),
    Flag(u8),
    Truncate(u16),
}

fn frame(messages: &[Vec<u8>], framing: &Framing) -> Vec<Bytes> {
    let mut body = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let lie = framing.lies.get(i).copied().flatten();
        let flag = match lie {
            Some(Lie::Flag(f)) => f,
            _ => 0,
        };
        let len = match lie {
            Some(Lie::Length(l)) => l,
            _ => m.len() as u32,
        };
        body.push(flag);
        body.extend_from_slice(&len.to_be_bytes());
        match lie {
            Some(Lie::Truncate(t)) => body.extend_from_slice(&m[..(t as usize).min(m.len())]),
            _ => body.extend_from_slice(m),
        }
    }
    body.extend_from_slice(&framing.trailing);
    split(body, &framing.splits)
}

fn split(body: Vec<u8>, splits: &[u16]) -> Vec<Bytes> {
    let body = Bytes::from(body);
    let mut cuts: Vec<usize> = splits
        .iter()
        .map(|&s| s as usize)
        .filter(|&s| s < body.len())
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::new();
    let mut at = 0;
    for c in cuts {
        out.push(body.slice(at..c));
        at = c;
    }
    out.push(body.slice(at..));
    out
}

// --- JSON, written by hand from a mirror ---------------------------------------------------

/// A JSON value.
#[derive(Arbitrary, Debug, Clone)]
enum J {
    Null,
    Bool(bool),
    Num(Num),
    Float(f64),
    Exp(i8, i16),
    Str(Text),
    Arr(Vec<J>),
    Obj(Vec<(Text, J)>),
    /// `n` copies of one value in an array: many elements in few bytes.
    Many(u16, Box<J>),
    /// An array nested `n` deep around a value.
    Deep(u8, Box<J>),
    /// Raw text (JSON that is not).
    Raw(String),
}

fn json_str(out: &mut String, s: &str) {
    out.push_str(&serde_json::to_string(s).unwrap_or_default());
}

/// Most JSON text one input writes (nested `Many`s would multiply without end).
const MAX_JSON: usize = 1 << 20;

fn json(out: &mut String, v: &J, depth: usize) {
    if depth > 80 || out.len() > MAX_JSON {
        out.push('0');
        return;
    }
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(Num::Negative(n)) => {
            let _ = write!(out, "{n}");
        }
        J::Num(n) => {
            let _ = write!(out, "{}", n.u64());
        }
        J::Float(f) => {
            if f.is_finite() {
                let _ = write!(out, "{f:?}");
            } else {
                out.push_str("1e999");
            }
        }
        J::Exp(m, e) => {
            let _ = write!(out, "{m}e{e}");
        }
        J::Str(t) => json_str(out, &t.string()),
        J::Arr(items) => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json(out, x, depth + 1);
            }
            out.push(']');
        }
        J::Obj(items) => {
            out.push('{');
            for (i, (k, x)) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json_str(out, &k.string());
                out.push(':');
                json(out, x, depth + 1);
            }
            out.push('}');
        }
        J::Many(n, x) => {
            let mut one = String::new();
            json(&mut one, x, depth + 1);
            out.push('[');
            for i in 0..(*n as usize % 8192) {
                if out.len() + one.len() > MAX_JSON {
                    break;
                }
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&one);
            }
            out.push(']');
        }
        J::Deep(n, x) => {
            let n = *n as usize % 80;
            out.extend(std::iter::repeat_n('[', n));
            json(out, x, depth + n);
            out.extend(std::iter::repeat_n(']', n));
        }
        J::Raw(s) => out.push_str(s),
    }
}

/// The members of a JSON object.
type Members = Vec<(Text, J)>;

/// A KServe v2 REST inference request.
#[derive(Arbitrary, Debug, Clone)]
struct RestRequest {
    id: Option<J>,
    parameters: Vec<(Text, J)>,
    inputs: Vec<RestInput>,
    outputs: Option<Vec<(Text, Members)>>,
    extra: Vec<(Text, J)>,
}

#[derive(Arbitrary, Debug, Clone)]
struct RestInput {
    name: Text,
    datatype: Text,
    shape: Vec<Num>,
    /// `data`: a value, or (`None`) as many numbers as the shape says, honestly.
    data: Option<J>,
    /// `binary_data_size`: the input's bytes are in the binary part.
    binary: Option<Num>,
    parameters: Vec<(Text, J)>,
    duplicate: Option<(u8, J)>,
}

impl RestRequest {
    /// The JSON header and the binary part (the inputs' `binary_data_size` bytes).
    fn write(&self, binary_bytes: &[u8]) -> (String, Vec<u8>) {
        let mut s = String::from("{");
        let mut first = true;
        let mut sep = |s: &mut String| {
            if !std::mem::take(&mut first) {
                s.push(',');
            }
        };
        if let Some(id) = &self.id {
            sep(&mut s);
            s.push_str("\"id\":");
            json(&mut s, id, 1);
        }
        if !self.parameters.is_empty() {
            sep(&mut s);
            s.push_str("\"parameters\":");
            json(&mut s, &J::Obj(self.parameters.clone()), 1);
        }
        let mut binary = Vec::new();
        sep(&mut s);
        s.push_str("\"inputs\":[");
        for (i, inp) in self.inputs.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str("{\"name\":");
            json_str(&mut s, &inp.name.string());
            s.push_str(",\"datatype\":");
            let dt = inp.datatype.string();
            json_str(&mut s, &dt);
            s.push_str(",\"shape\":[");
            for (k, d) in inp.shape.iter().enumerate() {
                if k > 0 {
                    s.push(',');
                }
                match d {
                    Num::Negative(n) => {
                        let _ = write!(s, "{n}");
                    }
                    d => {
                        let _ = write!(s, "{}", d.u64());
                    }
                }
            }
            s.push(']');
            let mut params = inp.parameters.clone();
            if let Some(n) = inp.binary {
                params.push((Text::Known(28), J::Num(n)));
                let want = (n.u64() as usize).min(binary_bytes.len());
                binary.extend_from_slice(&binary_bytes[..want]);
            } else {
                s.push_str(",\"data\":");
                match &inp.data {
                    Some(d) => json(&mut s, d, 1),
                    None => {
                        let n = inp
                            .shape
                            .iter()
                            .try_fold(1u64, |a, d| a.checked_mul(d.u64()))
                            .unwrap_or(0)
                            .min(4096);
                        let elem = match dt.as_str() {
                            "BOOL" => "true",
                            "BYTES" => "\"ab\"",
                            _ => "1",
                        };
                        s.push('[');
                        for k in 0..n {
                            if k > 0 {
                                s.push(',');
                            }
                            s.push_str(elem);
                        }
                        s.push(']');
                    }
                }
            }
            if !params.is_empty() {
                s.push_str(",\"parameters\":");
                json(&mut s, &J::Obj(params), 1);
            }
            if let Some((k, v)) = &inp.duplicate {
                let keys = ["name", "datatype", "shape", "data", "parameters", "bogus"];
                let _ = write!(s, ",\"{}\":", keys[*k as usize % keys.len()]);
                json(&mut s, v, 1);
            }
            s.push('}');
        }
        s.push(']');
        if let Some(outputs) = &self.outputs {
            sep(&mut s);
            s.push_str("\"outputs\":[");
            for (i, (name, params)) in outputs.iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                s.push_str("{\"name\":");
                json_str(&mut s, &name.string());
                if !params.is_empty() {
                    s.push_str(",\"parameters\":");
                    json(&mut s, &J::Obj(params.clone()), 1);
                }
                s.push('}');
            }
            s.push(']');
        }
        for (k, v) in &self.extra {
            sep(&mut s);
            json_str(&mut s, &k.string());
            s.push(':');
            json(&mut s, v, 1);
        }
        s.push('}');
        (s, binary)
    }
}

/// How a REST body says where its JSON header ends.
#[derive(Arbitrary, Debug, Clone)]
enum HeaderLength {
    None,
    Honest,
    Lie(Num),
    Text(Vec<u8>),
}

/// A local-socket request.
#[derive(Arbitrary, Debug, Clone)]
struct LocalRequest {
    op: u8,
    token: bool,
    fields: Vec<(u8, J)>,
    arguments: Option<Vec<LocalArg>>,
    length: Option<u32>,
}

#[derive(Arbitrary, Debug, Clone)]
enum LocalArg {
    Handle(Num),
    Inline(Text, Vec<Num>, Option<Num>),
    Other(Vec<(u8, J)>),
}

const LOCAL_OPS: &[&str] = &[
    "put",
    "get",
    "reserve",
    "execute",
    "free",
    "call",
    "group_create",
    "group_join",
    "collective",
    "wait",
    "PUT",
    "bogus",
];
const LOCAL_KEYS: &[&str] = &[
    "dtype",
    "dims",
    "device",
    "tail",
    "handle",
    "inline",
    "count",
    "executable",
    "arguments",
    "donate",
    "fetch",
    "keep",
    "free",
    "launch",
    "out",
    "size",
    "timeout_ms",
    "rank",
    "group",
    "kind",
    "reduce",
    "root",
    "peer",
    "tag",
    "tensors",
    "executables",
    "all",
    "op",
    "token",
    "bogus",
];

impl LocalRequest {
    fn write(&self) -> String {
        let mut s = String::from("{\"op\":");
        json_str(&mut s, LOCAL_OPS[self.op as usize % LOCAL_OPS.len()]);
        if self.token {
            s.push_str(",\"token\":\"t\"");
        }
        for (k, v) in &self.fields {
            s.push(',');
            json_str(&mut s, LOCAL_KEYS[*k as usize % LOCAL_KEYS.len()]);
            s.push(':');
            json(&mut s, v, 1);
        }
        if let Some(args) = &self.arguments {
            s.push_str(",\"arguments\":[");
            for (i, a) in args.iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                match a {
                    LocalArg::Handle(h) => {
                        let _ = write!(s, "{{\"handle\":{}}}", h.u64());
                    }
                    LocalArg::Inline(dt, dims, device) => {
                        s.push_str("{\"dtype\":");
                        json_str(&mut s, &dt.string());
                        let dims: Vec<String> = dims.iter().map(|d| d.u64().to_string()).collect();
                        let _ = write!(s, ",\"dims\":[{}]", dims.join(","));
                        if let Some(d) = device {
                            let _ = write!(s, ",\"device\":{}", d.u64());
                        }
                        s.push('}');
                    }
                    LocalArg::Other(fields) => {
                        let fields: Vec<(Text, J)> = fields
                            .iter()
                            .map(|(k, v)| {
                                (
                                    Text::Any(LOCAL_KEYS[*k as usize % LOCAL_KEYS.len()].into()),
                                    v.clone(),
                                )
                            })
                            .collect();
                        json(&mut s, &J::Obj(fields), 1);
                    }
                }
            }
            s.push(']');
        }
        s.push('}');
        s
    }
}

// --- model configurations -------------------------------------------------------------------

/// A configuration, as lines of `config.pbtxt` or members of a JSON / TOML object.
#[derive(Arbitrary, Debug, Clone)]
struct Config {
    format: u8,
    items: Vec<(u8, Num, Text)>,
}

const PBTXT: &[&str] = &[
    "name: \"model\"",
    "name: \"@T\"",
    "max_batch_size: @N",
    "platform: \"@T\"",
    "backend: \"@T\"",
    "input [ { name: \"@T\" data_type: TYPE_FP32 dims: [ @N, 3 ] } ]",
    "input { name: \"x\" data_type: TYPE_STRING dims: [ -1 ] reshape: { shape: [ @N ] } }",
    "output [ { name: \"y\" data_type: TYPE_INT64 dims: [ @N ] } ]",
    "output { name: \"y\" data_type: TYPE_BOGUS dims: [ -2 ] }",
    "dynamic_batching { max_queue_delay_microseconds: @N preferred_batch_size: [ @N ] }",
    "sequence_batching { max_sequence_idle_microseconds: @N }",
    "instance_group [ { count: @N kind: KIND_CPU gpus: [ @N ] } ]",
    "parameters { key: \"@T\" value: { string_value: \"@T\" } }",
    "parameters: { key: \"tpubox\" value: { string_value: \"@T\" } }",
    "model_warmup [ { name: \"w\" batch_size: @N } ]",
    "default_model_filename: \"@T\"",
    "version_policy: { specific: { versions: [ @N ] } }",
    "optimization { priority: PRIORITY_MAX }",
    "input [ { name: \"x\" data_type: TYPE_FP32 dims: [ 1 ] is_shape_tensor: true } ]",
    "{",
    "}",
    "[",
];

const JSON_MEMBERS: &[&str] = &[
    "\"name\": \"@T\"",
    "\"max_batch_size\": @N",
    "\"platform\": \"@T\"",
    "\"input\": [{\"name\": \"@T\", \"data_type\": \"TYPE_FP32\", \"dims\": [@N, 3]}]",
    "\"output\": [{\"name\": \"y\", \"data_type\": \"TYPE_INT8\", \"dims\": [@N]}]",
    "\"dynamic_batching\": {\"max_queue_delay_microseconds\": @N, \"preferred_batch_size\": [@N]}",
    "\"sequence_batching\": {\"max_sequence_idle_microseconds\": \"@N\"}",
    "\"instance_group\": [{\"count\": @N, \"kind\": \"KIND_CPU\"}]",
    "\"parameters\": {\"@T\": {\"string_value\": \"@T\"}}",
    "\"default_model_filename\": \"@T\"",
    "\"tpubox\": {\"limits\": {\"max_call_seconds\": @N, \"max_device_mib\": @N}}",
    "\"tpubox\": {\"decoupled\": {\"max_generations\": @N, \"stall_seconds\": @N}}",
    "\"tpubox\": {\"batching\": {\"max_queue_delay_microseconds\": @N}, \"devices\": \"@T\"}",
    "\"tpubox\": {\"stablehlo\": {\"batch_sizes\": [@N], \"weights\": \"@T\"}}",
    "\"tpubox\": @N",
    "\"version_policy\": {\"latest\": {\"num_versions\": @N}}",
    "\"bogus\": 1",
];

impl Config {
    fn write(&self) -> (String, u8) {
        let format = self.format % 3;
        let fill = |t: &str, n: &Num, x: &Text| {
            let num = match n {
                Num::Negative(v) => v.to_string(),
                n => n.u64().to_string(),
            };
            let text: String = x.string().replace(['"', '\\'], "");
            t.replace("@N", &num).replace("@T", &text)
        };
        match format {
            0 => {
                let mut s = String::new();
                for (k, n, x) in &self.items {
                    s.push_str(&fill(PBTXT[*k as usize % PBTXT.len()], n, x));
                    s.push('\n');
                }
                (s, 0)
            }
            _ => {
                let members: Vec<String> = self
                    .items
                    .iter()
                    .map(|(k, n, x)| fill(JSON_MEMBERS[*k as usize % JSON_MEMBERS.len()], n, x))
                    .collect();
                // TOML gets the JSON members as inline tables: mostly not TOML, sometimes.
                (format!("{{{}}}", members.join(", ")), format)
            }
        }
    }
}

// --- the doors ------------------------------------------------------------------------------

/// One input: which door, and what it is sent.
#[derive(Arbitrary, Debug)]
enum Input {
    Session {
        method: u8,
        messages: Vec<Vec<Field>>,
        framing: Framing,
    },
    SessionRaw {
        method: u8,
        splits: Vec<u16>,
        body: Vec<u8>,
    },
    SessionMessageRaw {
        method: u8,
        message: Vec<u8>,
    },
    Local(LocalRequest),
    LocalRaw([u8; 4], Vec<u8>),
    Rest {
        request: RestRequest,
        length: HeaderLength,
        binary: Vec<u8>,
    },
    RestRaw {
        length: Option<Vec<u8>>,
        body: Vec<u8>,
    },
    GrpcInfer {
        load: bool,
        messages: Vec<Vec<Field>>,
        framing: Framing,
    },
    GrpcRaw {
        load: bool,
        body: Vec<u8>,
    },
    Config(Config),
    ConfigRaw(u8, String),
}

/// Runs one input through its door and checks the invariants (panics on a broken one).
pub fn run_bytes(data: &[u8]) {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    if std::env::var_os("DOORS_DEBUG").is_some() {
        eprintln!("{input:#?}");
    }
    run(input);
}

/// Runs `decode`, the daemon's decoding of `size` bytes, and checks what it held at once
/// (what the harness made before, the input among it, is not counted).
fn measured<T>(size: usize, decode: impl FnOnce() -> T) -> T {
    let start = LIVE.load(Ordering::Relaxed);
    PEAK.store(start, Ordering::Relaxed);
    let out = decode();
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(start);
    let bound = ALLOC_MULTIPLE
        .saturating_mul(size)
        .saturating_add(ALLOC_ALLOWANCE);
    assert!(
        peak <= bound,
        "decoding {size} bytes held {peak} bytes at once (bound {bound})"
    );
    out
}

/// Sends `input` to its door; returns the size of what the door was sent.
fn run(input: Input) -> usize {
    match input {
        Input::Session {
            method,
            messages,
            framing,
        } => {
            let m = method as usize % SESSION_REQUESTS.len();
            let schema = SESSION_REQUESTS[m];
            let msgs: Vec<Vec<u8>> = messages.iter().map(|f| message(schema, f, 0)).collect();
            let frames = frame(&msgs, &framing);
            session(m, frames)
        }
        Input::SessionRaw {
            method,
            splits,
            body,
        } => session(
            method as usize % SESSION_REQUESTS.len(),
            split(body, &splits),
        ),
        Input::SessionMessageRaw { method, message } => {
            let framing = Framing {
                lies: vec![],
                splits: vec![],
                trailing: vec![],
            };
            session(
                method as usize % SESSION_REQUESTS.len(),
                frame(&[message], &framing),
            )
        }
        Input::Local(r) => {
            let header = r.write();
            let len = r.length.unwrap_or(header.len() as u32);
            local(len.to_le_bytes(), header.as_bytes())
        }
        Input::LocalRaw(len, header) => local(len, &header),
        Input::Rest {
            request,
            length,
            binary,
        } => {
            let (header, bin) = request.write(&binary);
            let mut body = header.clone().into_bytes();
            let value = match length {
                HeaderLength::None => None,
                HeaderLength::Honest => Some(header.len().to_string().into_bytes()),
                HeaderLength::Lie(n) => Some(n.i64().to_string().into_bytes()),
                HeaderLength::Text(t) => Some(t),
            };
            if value.is_some() {
                body.extend_from_slice(&bin);
            }
            rest(value.as_deref(), &body)
        }
        Input::RestRaw { length, body } => rest(length.as_deref(), &body),
        Input::GrpcInfer {
            load,
            messages,
            framing,
        } => {
            let schema = if load { REPOSITORY_LOAD } else { MODEL_INFER };
            let msgs: Vec<Vec<u8>> = messages.iter().map(|f| message(schema, f, 0)).collect();
            grpc(load, frame(&msgs, &framing))
        }
        Input::GrpcRaw { load, body } => grpc(load, vec![Bytes::from(body)]),
        Input::Config(c) => {
            let (text, format) = c.write();
            config(&text, format)
        }
        Input::ConfigRaw(format, text) => config(&text, format % 3),
    }
}

fn frames_len(frames: &[Bytes]) -> usize {
    frames.iter().map(Bytes::len).sum()
}

/// gRPC codes a client's malformed or oversized request may get.
fn client_code(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted | tonic::Code::OutOfRange
    )
}

fn session(method: usize, frames: Vec<Bytes>) -> usize {
    let size = frames_len(&frames);
    let positions = size % 5;
    let r = measured(size, || {
        tpubox_session_api::fuzzing::session_request(
            method,
            frames,
            MAX_MESSAGE_BYTES,
            MAX_DEVICE_BYTES,
            HOST_DEVICES,
            positions,
        )
    });
    match r {
        Ok(d) => {
            for t in &d.tensors {
                let elements = t
                    .dims
                    .iter()
                    .try_fold(1u64, |a, &x| a.checked_mul(x))
                    .expect("admitted dims overflow");
                assert_eq!(
                    t.bytes as u64,
                    elements * t.ty.byte_size() as u64,
                    "admitted size of {:?} {:?}",
                    t.ty,
                    t.dims
                );
                assert!(t.bytes as u64 <= MAX_DEVICE_BYTES);
                let method = tpubox_session_api::fuzzing::METHODS[method];
                if method.starts_with("Put") {
                    assert!(t.data <= t.bytes, "an upload holds more than it declared");
                }
            }
            // donate, fetch and keep each mark at most `positions`.
            assert!(d.marked <= 3 * positions);
        }
        Err(s) => {
            assert!(
                client_code(s.code()),
                "{}: a client's request answered {:?}: {}",
                tpubox_session_api::fuzzing::METHODS[method],
                s.code(),
                s.message()
            );
            if s.code() == tonic::Code::InvalidArgument
                && let Some(kind) = s.metadata().get("tpubox-error-kind")
            {
                assert_eq!(kind, "invalid-argument", "{}", s.message());
            }
        }
    }
    size
}

fn local(len: [u8; 4], header: &[u8]) -> usize {
    let r = measured(header.len() + 4, || {
        tpubox_session_api::fuzzing::local_request(len, header, MAX_DEVICE_BYTES)
    });
    match r {
        Ok(d) => {
            assert!(d.tail <= tpubox_session_api::local::MAX_INLINE_BYTES);
            if d.op == "put" {
                assert_eq!(d.tensors.len(), 1);
            }
        }
        Err((kind, message)) => assert!(
            kind == "invalid-argument" || kind == "resource-exhausted",
            "a local request answered {kind}: {message}"
        ),
    }
    header.len() + 4
}

/// Checks a decoded inference request: every in-band input holds exactly its shape's data.
fn check_infer(r: &tpubox_serve::protocol::InferRequest) {
    for (i, t) in r.inputs.iter().enumerate() {
        if r.shm_inputs.iter().any(|(k, _)| *k == i) {
            assert!(t.data.is_empty());
            continue;
        }
        let n = tpubox_serve::protocol::element_count(&t.shape).expect("accepted shape overflows");
        match t.datatype.element_size() {
            Some(size) => assert_eq!(
                t.data.len() as u64,
                n * size as u64,
                "input {} of {:?} {:?}",
                t.name,
                t.datatype,
                t.shape
            ),
            None => assert_eq!(
                tpubox_serve::protocol::bytes_element_count(&t.data).expect("accepted BYTES")
                    as u64,
                n
            ),
        }
        t.check().expect("an accepted input fails its own check");
    }
}

fn rest(length: Option<&[u8]>, body: &[u8]) -> usize {
    let size = body.len() + length.map_or(0, <[u8]>::len);
    match measured(size, || tpubox_serve::fuzzing::rest_infer(length, body)) {
        Ok(r) => check_infer(&r),
        Err(e) => assert_eq!(
            e.status_code(),
            400,
            "a REST inference request answered {:?}: {}",
            e.kind,
            e.message
        ),
    }
    size
}

fn grpc(load: bool, frames: Vec<Bytes>) -> usize {
    let size = frames_len(&frames);
    let r = if load {
        measured(size, || {
            tpubox_serve::fuzzing::grpc_load(frames, MAX_MESSAGE_BYTES)
        })
    } else {
        measured(size, || {
            tpubox_serve::fuzzing::grpc_infer(frames, MAX_MESSAGE_BYTES)
        })
        .map(|r| check_infer(&r))
    };
    if let Err(s) = r {
        // The one documented INTERNAL: a load's `file:` parameter, in Triton's words and with
        // its status (`repository::check_load_parameters`; Triton's client examples check it).
        let triton_file_parameter = load
            && s.code() == tonic::Code::Internal
            && s.message()
                .contains("failed to poll from model repository: load parameter `file:");
        assert!(
            client_code(s.code()) || triton_file_parameter,
            "a gRPC {} request answered {:?}: {}",
            if load { "load" } else { "infer" },
            s.code(),
            s.message()
        );
    }
    size
}

fn config(text: &str, format: u8) -> usize {
    // Refusals are load failures (anyhow errors with a message); only panics and allocation
    // matter here.
    let _ = measured(text.len(), || tpubox_serve::fuzzing::config(text, format));
    text.len()
}
