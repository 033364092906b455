//! Decoding a REST inference request's JSON without building a JSON tree.
//!
//! A `serde_json::Value` tree costs about 22 times its text for an array of small numbers (a
//! 32 MiB body of zeros took 700 MiB). This decoder reads the request in two passes over the
//! header bytes, both with serde visitors that keep nothing they do not need:
//!
//! 1. The *head* pass reads everything but the elements of `data`: ids, names, datatypes,
//!    shapes, parameters, requested outputs, the binary extension's slices. It counts the
//!    elements of each `data` (and the bytes of `BYTES` strings) without keeping them, checks
//!    the count against the declared shape, and rejects duplicate keys in every object and
//!    objects with more than [`MAX_OBJECT_KEYS`] keys.
//! 2. The *data* pass reads the header again and writes each input's `data` straight into a
//!    buffer of exactly the tensor's size, in the declared datatype. It stops at the first
//!    element that does not fit.
//!
//! So decoding a request costs its tensors' bytes (at most 4 bytes per byte of JSON text:
//! one 8-byte element per `0,`) plus a small constant per input, output and object key, on
//! top of the body itself. Two passes let `data` come before `datatype` and `shape` in an
//! input object, as JSON allows.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::{
    Datatype, InferRequest, RequestedOutput, SEQUENCE_END, SEQUENCE_ID, SEQUENCE_START,
    SHM_BYTE_SIZE, SHM_OFFSET, SHM_REGION, SequenceId, SequenceRequest, ShmRef, Tensor,
    element_count,
};
use crate::error::{ServeError, ServeResult};

/// Most keys one JSON object of a request may have (any object: the request, a tensor, a
/// `parameters` object, or an object nested in a parameter). More is a bad request: the
/// duplicate-key check keeps one set of keys per open object.
pub const MAX_OBJECT_KEYS: usize = 1024;

/// Deepest nesting of an input's `data` arrays.
pub const MAX_DATA_DEPTH: usize = 64;

/// Where a visitor leaves the request's error: serde's error type carries only text, so the
/// visitors put the [`ServeError`] here and return a placeholder serde error.
struct Ctx {
    err: RefCell<Option<ServeError>>,
}

impl Ctx {
    fn new() -> Self {
        Ctx {
            err: RefCell::new(None),
        }
    }

    /// Records `e` (the first one wins) and returns a serde error that stops the parse.
    fn fail<E: de::Error>(&self, e: ServeError) -> E {
        let mut slot = self.err.borrow_mut();
        if slot.is_none() {
            *slot = Some(e);
        }
        E::custom("the request was rejected")
    }

    /// The error of a parse that failed: the recorded one, or serde_json's (the JSON itself
    /// is bad).
    fn error(&self, e: serde_json::Error) -> ServeError {
        self.err.borrow_mut().take().unwrap_or_else(|| {
            ServeError::bad_request(format!("the request is not valid JSON: {e}"))
        })
    }
}

/// A key for messages: escaped, and cut to 64 characters.
fn shown(key: &str) -> String {
    let cut: String = key.chars().take(64).collect();
    if cut.len() < key.len() {
        format!("{cut:?}…")
    } else {
        format!("{cut:?}")
    }
}

/// An object key, borrowed from the request when it has no escapes.
struct Key<'de>(Cow<'de, str>);

struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Key<'de>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// The keys of one open object: rejects a duplicate and a key past [`MAX_OBJECT_KEYS`].
struct Keys<'de> {
    seen: HashSet<Cow<'de, str>>,
    what: &'static str,
}

impl<'de> Keys<'de> {
    fn new(what: &'static str) -> Self {
        Keys {
            seen: HashSet::new(),
            what,
        }
    }

    /// The next key of the object, checked; `None` at its end.
    fn next<A: MapAccess<'de>>(
        &mut self,
        ctx: &Ctx,
        map: &mut A,
    ) -> Result<Option<Cow<'de, str>>, A::Error> {
        let Some(Key(k)) = map.next_key_seed(KeySeed)? else {
            return Ok(None);
        };
        if self.seen.contains(&k) {
            return Err(ctx.fail(ServeError::bad_request(format!(
                "duplicate key {} in {}",
                shown(&k),
                self.what
            ))));
        }
        if self.seen.len() >= MAX_OBJECT_KEYS {
            tpubox_core::protection::triggered(
                "json-object-keys",
                "rest",
                format_args!("a JSON object with more than {MAX_OBJECT_KEYS} keys"),
            );
            return Err(ctx.fail(ServeError::bad_request(format!(
                "{} has more than {MAX_OBJECT_KEYS} keys",
                self.what
            ))));
        }
        self.seen.insert(k.clone());
        Ok(Some(k))
    }
}

/// Reads and drops any JSON value, checking the keys of the objects in it.
struct Skip<'c> {
    ctx: &'c Ctx,
}

impl<'de> DeserializeSeed<'de> for Skip<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Skip<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Skip { ctx: self.ctx })?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut keys = Keys::new("an object of the request");
        while keys.next(self.ctx, &mut map)?.is_some() {
            map.next_value_seed(Skip { ctx: self.ctx })?;
        }
        Ok(())
    }
}

/// What a visitor that wants one kind of value found: that value, or something else (read
/// and dropped).
enum Got<T> {
    Is(T),
    Other,
}

/// Reads a string (`Got::Is`) or any other value (`Got::Other`).
struct Str<'c> {
    ctx: &'c Ctx,
}

impl<'de> DeserializeSeed<'de> for Str<'_> {
    type Value = Got<String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Got<String>, D::Error> {
        d.deserialize_any(self)
    }
}

macro_rules! other_scalars {
    () => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Got::Other)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Got::Other)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Got::Other)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Got::Other)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(Got::Other)
        }
    };
}

macro_rules! other_containers {
    () => {
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            Skip { ctx: self.ctx }.visit_seq(seq)?;
            Ok(Got::Other)
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            Skip { ctx: self.ctx }.visit_map(map)?;
            Ok(Got::Other)
        }
    };
}

impl<'de> Visitor<'de> for Str<'_> {
    type Value = Got<String>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E>(self, v: &str) -> Result<Got<String>, E> {
        Ok(Got::Is(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Got<String>, E> {
        Ok(Got::Is(v))
    }
    other_scalars!();
    other_containers!();
}

/// A parameter's value, as far as the protocol's parameters need it.
#[derive(Clone)]
enum Param {
    Bool(bool),
    U64(u64),
    /// A string (a shared-memory region's name): at most as long as its text in the header.
    Str(String),
    Other,
}

impl Param {
    fn as_bool(&self) -> Option<bool> {
        match self {
            Param::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

/// The values of a `parameters` object's keys that a [`Params`] wants, in its `want` order.
type Wanted = Vec<Option<Param>>;

/// The shared-memory slice of an input's or output's parameters (region, offset and size at
/// `at`, `at + 1`, `at + 2` of `p`): `None` without `shared_memory_region`.
///
/// Errors: bad request for a region name that is not a string, or an offset or size that is
/// not a non-negative integer.
fn shm_ref(what: &str, p: &Wanted, at: usize) -> ServeResult<Option<ShmRef>> {
    let region = match p.get(at).cloned().flatten() {
        None => return Ok(None),
        Some(Param::Str(r)) => r,
        Some(_) => {
            return Err(ServeError::bad_request(format!(
                "{what}: `{SHM_REGION}` must be a string"
            )));
        }
    };
    let int = |i: usize, key: &str, default: Option<u64>| match p.get(at + i).cloned().flatten() {
        Some(Param::U64(v)) => Ok(v),
        None if default.is_some() => Ok(default.unwrap_or(0)),
        _ => Err(ServeError::bad_request(format!(
            "{what}: `{key}` must be a non-negative integer"
        ))),
    };
    Ok(Some(ShmRef {
        region,
        offset: int(1, SHM_OFFSET, Some(0))?,
        byte_size: int(2, SHM_BYTE_SIZE, None)?,
    }))
}

/// Reads a `parameters` object, keeping the values of the keys in `want` ([`Wanted`], in
/// `want`'s order). A `parameters` that is not an object is ignored (nothing found), as are
/// the other keys' values (checked for duplicate keys all the same).
struct Params<'c> {
    ctx: &'c Ctx,
    want: &'static [&'static str],
}

impl Params<'_> {
    fn none(&self) -> Wanted {
        vec![None; self.want.len()]
    }
}

impl<'de> DeserializeSeed<'de> for Params<'_> {
    type Value = Wanted;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Wanted, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Params<'_> {
    type Value = Wanted;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a parameters object")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Wanted, E> {
        Ok(self.none())
    }
    fn visit_i64<E>(self, _: i64) -> Result<Wanted, E> {
        Ok(self.none())
    }
    fn visit_u64<E>(self, _: u64) -> Result<Wanted, E> {
        Ok(self.none())
    }
    fn visit_f64<E>(self, _: f64) -> Result<Wanted, E> {
        Ok(self.none())
    }
    fn visit_str<E>(self, _: &str) -> Result<Wanted, E> {
        Ok(self.none())
    }
    fn visit_unit<E>(self) -> Result<Wanted, E> {
        Ok(self.none())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Wanted, A::Error> {
        Skip { ctx: self.ctx }.visit_seq(seq)?;
        Ok(self.none())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Wanted, A::Error> {
        let mut keys = Keys::new("`parameters`");
        let mut found = self.none();
        while let Some(k) = keys.next(self.ctx, &mut map)? {
            if let Some(i) = self.want.iter().position(|w| *w == k) {
                found[i] = Some(map.next_value_seed(ParamValue { ctx: self.ctx })?);
            } else {
                map.next_value_seed(Skip { ctx: self.ctx })?;
            }
        }
        Ok(found)
    }
}

struct ParamValue<'c> {
    ctx: &'c Ctx,
}

impl<'de> DeserializeSeed<'de> for ParamValue<'_> {
    type Value = Param;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Param, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ParamValue<'_> {
    type Value = Param;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a parameter value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Param, E> {
        Ok(Param::Bool(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Param, E> {
        Ok(Param::U64(v))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Param, E> {
        Ok(Param::Other)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Param, E> {
        Ok(Param::Other)
    }
    fn visit_str<E>(self, v: &str) -> Result<Param, E> {
        Ok(Param::Str(v.to_owned()))
    }
    fn visit_unit<E>(self) -> Result<Param, E> {
        Ok(Param::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Param, A::Error> {
        Skip { ctx: self.ctx }.visit_seq(seq)?;
        Ok(Param::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Param, A::Error> {
        Skip { ctx: self.ctx }.visit_map(map)?;
        Ok(Param::Other)
    }
}

// --- Pass 1: the head ---------------------------------------------------------------------

/// An input's `shape` as read.
enum Shape {
    Dims(Vec<u64>),
    NotArray,
    /// Its rank, more than 16.
    TooLong(usize),
    /// A dimension that is not a non-negative integer, and the rank.
    BadDim,
}

struct ShapeSeed<'c> {
    ctx: &'c Ctx,
}

impl<'de> DeserializeSeed<'de> for ShapeSeed<'_> {
    type Value = Shape;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Shape, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ShapeSeed<'_> {
    type Value = Shape;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of dimensions")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Shape, E> {
        Ok(Shape::NotArray)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Shape, E> {
        Ok(Shape::NotArray)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Shape, E> {
        Ok(Shape::NotArray)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Shape, E> {
        Ok(Shape::NotArray)
    }
    fn visit_str<E>(self, _: &str) -> Result<Shape, E> {
        Ok(Shape::NotArray)
    }
    fn visit_unit<E>(self) -> Result<Shape, E> {
        Ok(Shape::NotArray)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Shape, A::Error> {
        Skip { ctx: self.ctx }.visit_map(map)?;
        Ok(Shape::NotArray)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
        let mut dims = Vec::new();
        let mut rank = 0usize;
        let mut bad = false;
        while let Some(d) = seq.next_element_seed(Dim { ctx: self.ctx })? {
            rank += 1;
            match d {
                Some(d) if rank <= 16 => dims.push(d),
                Some(_) => {}
                None => bad = true,
            }
        }
        Ok(if rank > 16 {
            Shape::TooLong(rank)
        } else if bad {
            Shape::BadDim
        } else {
            Shape::Dims(dims)
        })
    }
}

/// One dimension: `Some` for a non-negative integer.
struct Dim<'c> {
    ctx: &'c Ctx,
}

impl<'de> DeserializeSeed<'de> for Dim<'_> {
    type Value = Option<u64>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
        match Skip::deserialize_u64_or_skip(self.ctx, d)? {
            Got::Is(v) => Ok(Some(v)),
            Got::Other => Ok(None),
        }
    }
}

impl Skip<'_> {
    fn deserialize_u64_or_skip<'de, D: Deserializer<'de>>(
        ctx: &Ctx,
        d: D,
    ) -> Result<Got<u64>, D::Error> {
        struct V<'c> {
            ctx: &'c Ctx,
        }
        impl<'de> Visitor<'de> for V<'_> {
            type Value = Got<u64>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a non-negative integer")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Got<u64>, E> {
                Ok(Got::Is(v))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Got<u64>, E> {
                Ok(Got::Other)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Got<u64>, E> {
                Ok(Got::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Got<u64>, E> {
                Ok(Got::Other)
            }
            fn visit_str<E>(self, _: &str) -> Result<Got<u64>, E> {
                Ok(Got::Other)
            }
            fn visit_unit<E>(self) -> Result<Got<u64>, E> {
                Ok(Got::Other)
            }
            other_containers!();
        }
        d.deserialize_any(V { ctx })
    }
}

/// What the head pass learns of an input's `data`: how many elements it has (nested arrays
/// flattened) and, for strings, how many bytes they hold.
#[derive(Default, Clone, Copy)]
struct DataCount {
    elements: u64,
    string_bytes: u64,
}

struct CountSeed<'c, 'a> {
    ctx: &'c Ctx,
    count: &'a mut DataCount,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for CountSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CountSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("tensor data")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        self.count.elements += 1;
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        self.count.elements += 1;
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        self.count.elements += 1;
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        self.count.elements += 1;
        Ok(())
    }
    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.count.elements += 1;
        self.count.string_bytes += v.len() as u64;
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        self.count.elements += 1;
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        // An element of the wrong type; the data pass does not get this far.
        self.count.elements += 1;
        Skip { ctx: self.ctx }.visit_map(map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if self.depth >= MAX_DATA_DEPTH {
            return Err(self.ctx.fail(ServeError::bad_request(format!(
                "tensor data nested more than {MAX_DATA_DEPTH} deep"
            ))));
        }
        while seq
            .next_element_seed(CountSeed {
                ctx: self.ctx,
                count: self.count,
                depth: self.depth + 1,
            })?
            .is_some()
        {}
        Ok(())
    }
}

/// An input as the head pass reads it, before its checks.
#[derive(Default)]
struct InputFields {
    name: Option<Got<String>>,
    datatype: Option<Got<String>>,
    shape: Option<Shape>,
    /// The values of [`INPUT_WANT`].
    params: Wanted,
    data: Option<DataCount>,
}

/// What an input's `parameters` are read for: `binary_data_size`, then the shared-memory
/// slice ([`shm_ref`]).
const INPUT_WANT: [&str; 4] = ["binary_data_size", SHM_REGION, SHM_OFFSET, SHM_BYTE_SIZE];

/// An input after the head pass: the tensor (its `data` already filled from the binary
/// extension, or empty) and, for JSON data, the bytes it will take.
struct InputHead {
    tensor: Tensor,
    json_bytes: Option<usize>,
    /// Its bytes are in shared memory, read once the tenant is known.
    shm: Option<ShmRef>,
}

/// What the head pass keeps across the inputs: the binary extension's bytes and how far the
/// inputs have taken them.
struct Binary<'b> {
    bytes: &'b [u8],
    offset: usize,
}

struct InputSeed<'c, 'a, 'b> {
    ctx: &'c Ctx,
    binary: &'a mut Binary<'b>,
}

impl<'de> DeserializeSeed<'de> for InputSeed<'_, '_, '_> {
    type Value = InputHead;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<InputHead, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for InputSeed<'_, '_, '_> {
    type Value = InputHead;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an input object")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<InputHead, E> {
        Err(self.not_object())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<InputHead, E> {
        Err(self.not_object())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<InputHead, E> {
        Err(self.not_object())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<InputHead, E> {
        Err(self.not_object())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<InputHead, E> {
        Err(self.not_object())
    }
    fn visit_unit<E: de::Error>(self) -> Result<InputHead, E> {
        Err(self.not_object())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<InputHead, A::Error> {
        Err(self.not_object())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<InputHead, A::Error> {
        let ctx = self.ctx;
        let mut keys = Keys::new("an input");
        let mut f = InputFields::default();
        while let Some(k) = keys.next(ctx, &mut map)? {
            match &*k {
                "name" => f.name = Some(map.next_value_seed(Str { ctx })?),
                "datatype" => f.datatype = Some(map.next_value_seed(Str { ctx })?),
                "shape" => f.shape = Some(map.next_value_seed(ShapeSeed { ctx })?),
                "parameters" => {
                    f.params = map.next_value_seed(Params {
                        ctx,
                        want: &INPUT_WANT,
                    })?
                }
                "data" => {
                    let mut count = DataCount::default();
                    map.next_value_seed(CountSeed {
                        ctx,
                        count: &mut count,
                        depth: 0,
                    })?;
                    f.data = Some(count);
                }
                _ => map.next_value_seed(Skip { ctx })?,
            }
        }
        input_head(f, self.binary).map_err(|e| ctx.fail(e))
    }
}

impl InputSeed<'_, '_, '_> {
    fn not_object<E: de::Error>(&self) -> E {
        self.ctx
            .fail(ServeError::bad_request("each input must be a JSON object"))
    }
}

/// Checks an input read by the head pass, in the order and with the messages the protocol's
/// decoder always had.
fn input_head(f: InputFields, binary: &mut Binary<'_>) -> ServeResult<InputHead> {
    let Some(Got::Is(name)) = f.name else {
        return Err(ServeError::bad_request("an input has no `name`"));
    };
    let Some(Got::Is(dt)) = f.datatype else {
        return Err(ServeError::bad_request(format!(
            "input `{name}` has no `datatype`"
        )));
    };
    let datatype = Datatype::from_protocol_name(&dt).ok_or_else(|| {
        ServeError::bad_request(format!(
            "input `{name}`: unknown datatype `{}`",
            dt.chars().take(64).collect::<String>()
        ))
    })?;
    let shape = match f.shape {
        Some(Shape::Dims(d)) => d,
        None | Some(Shape::NotArray) => {
            return Err(ServeError::bad_request(format!(
                "input `{name}`: `shape` must be an array of integers"
            )));
        }
        Some(Shape::TooLong(rank)) => {
            return Err(ServeError::bad_request(format!(
                "input `{name}`: rank {rank} is more than 16"
            )));
        }
        Some(Shape::BadDim) => {
            return Err(ServeError::bad_request(format!(
                "input `{name}`: shape has a dimension that is not a non-negative integer"
            )));
        }
    };
    if let Some(r) = shm_ref(&format!("input `{name}`"), &f.params, 1)? {
        return Ok(InputHead {
            tensor: Tensor {
                name,
                datatype,
                shape,
                data: Vec::new(),
            },
            json_bytes: None,
            shm: Some(r),
        });
    }
    if let Some(size) = f.params.first().cloned().flatten() {
        let Param::U64(size) = size else {
            return Err(ServeError::bad_request(format!(
                "input `{name}`: `binary_data_size` must be a non-negative integer"
            )));
        };
        let offset = binary.offset;
        let end = usize::try_from(size)
            .ok()
            .and_then(|s| offset.checked_add(s))
            .filter(|&e| e <= binary.bytes.len())
            .ok_or_else(|| {
                ServeError::bad_request(format!(
                    "input `{name}`: binary_data_size {size} runs past the end of the binary data ({} bytes after byte {offset})",
                    binary.bytes.len() - offset
                ))
            })?;
        binary.offset = end;
        let tensor = Tensor {
            name,
            datatype,
            shape,
            data: binary.bytes[offset..end].to_vec(),
        };
        tensor.check()?;
        return Ok(InputHead {
            tensor,
            json_bytes: None,
            shm: None,
        });
    }
    let Some(count) = f.data else {
        return Err(ServeError::bad_request(format!(
            "input `{name}` has neither `data` nor `binary_data_size` nor `shared_memory_region`"
        )));
    };
    let n = element_count(&shape).ok_or_else(|| {
        ServeError::bad_request(format!("input `{name}`: shape {shape:?} overflows"))
    })?;
    let bytes = match datatype.element_size() {
        Some(size) => {
            let want = n.checked_mul(size as u64);
            if count.elements != n {
                return Err(ServeError::bad_request(format!(
                    "tensor `{name}`: {} bytes of data, but shape {shape:?} of {} needs {}",
                    count.elements.saturating_mul(size as u64),
                    datatype.name(),
                    want.map_or("more than 2^64".to_string(), |w| w.to_string())
                )));
            }
            want
        }
        None => {
            if count.elements != n {
                return Err(ServeError::bad_request(format!(
                    "tensor `{name}`: {} BYTES elements, but shape {shape:?} needs {n}",
                    count.elements
                )));
            }
            n.checked_mul(4)
                .and_then(|b| b.checked_add(count.string_bytes))
        }
    };
    // The count matched the text's elements, so the size is at most a few times the text.
    let bytes = bytes
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| ServeError::bad_request(format!("input `{name}` is too large")))?;
    Ok(InputHead {
        tensor: Tensor {
            name,
            datatype,
            shape,
            data: Vec::new(),
        },
        json_bytes: Some(bytes),
        shm: None,
    })
}

struct InputsSeed<'c, 'a, 'b> {
    ctx: &'c Ctx,
    binary: &'a mut Binary<'b>,
}

impl<'de> DeserializeSeed<'de> for InputsSeed<'_, '_, '_> {
    type Value = Got<Vec<InputHead>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for InputsSeed<'_, '_, '_> {
    type Value = Got<Vec<InputHead>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of inputs")
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Got::Other)
    }
    other_scalars!();
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Skip { ctx: self.ctx }.visit_map(map)?;
        Ok(Got::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut inputs = Vec::new();
        while let Some(i) = seq.next_element_seed(InputSeed {
            ctx: self.ctx,
            binary: self.binary,
        })? {
            inputs.push(i);
        }
        Ok(Got::Is(inputs))
    }
}

/// A requested output as read: its name, its `binary_data` parameter when it is a bool, and
/// its shared-memory slice.
struct OutputHead {
    name: String,
    binary: Option<bool>,
    shm: Option<ShmRef>,
}

/// What an output's `parameters` are read for: `binary_data`, then the shared-memory slice
/// ([`shm_ref`]).
const OUTPUT_WANT: [&str; 4] = ["binary_data", SHM_REGION, SHM_OFFSET, SHM_BYTE_SIZE];

struct OutputSeed<'c> {
    ctx: &'c Ctx,
}

impl<'de> DeserializeSeed<'de> for OutputSeed<'_> {
    type Value = OutputHead;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<OutputHead, D::Error> {
        d.deserialize_any(self)
    }
}

impl OutputSeed<'_> {
    fn not_object<E: de::Error>(&self) -> E {
        self.ctx
            .fail(ServeError::bad_request("each output must be a JSON object"))
    }
}

impl<'de> Visitor<'de> for OutputSeed<'_> {
    type Value = OutputHead;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an output object")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<OutputHead, E> {
        Err(self.not_object())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<OutputHead, E> {
        Err(self.not_object())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<OutputHead, E> {
        Err(self.not_object())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<OutputHead, E> {
        Err(self.not_object())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<OutputHead, E> {
        Err(self.not_object())
    }
    fn visit_unit<E: de::Error>(self) -> Result<OutputHead, E> {
        Err(self.not_object())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<OutputHead, A::Error> {
        Err(self.not_object())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OutputHead, A::Error> {
        let ctx = self.ctx;
        let mut keys = Keys::new("an output");
        let mut name = None;
        let mut params = Vec::new();
        while let Some(k) = keys.next(ctx, &mut map)? {
            match &*k {
                "name" => name = Some(map.next_value_seed(Str { ctx })?),
                "parameters" => {
                    params = map.next_value_seed(Params {
                        ctx,
                        want: &OUTPUT_WANT,
                    })?
                }
                _ => map.next_value_seed(Skip { ctx })?,
            }
        }
        let Some(Got::Is(name)) = name else {
            return Err(ctx.fail(ServeError::bad_request("a requested output has no `name`")));
        };
        let binary = params.first().cloned().flatten().and_then(|p| p.as_bool());
        let shm = shm_ref(&format!("output `{name}`"), &params, 1).map_err(|e| ctx.fail(e))?;
        Ok(OutputHead { name, binary, shm })
    }
}

struct OutputsSeed<'c> {
    ctx: &'c Ctx,
}

impl<'de> DeserializeSeed<'de> for OutputsSeed<'_> {
    type Value = Got<Vec<OutputHead>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for OutputsSeed<'_> {
    type Value = Got<Vec<OutputHead>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of outputs")
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Got::Other)
    }
    other_scalars!();
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Skip { ctx: self.ctx }.visit_map(map)?;
        Ok(Got::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut outputs = Vec::new();
        while let Some(o) = seq.next_element_seed(OutputSeed { ctx: self.ctx })? {
            outputs.push(o);
        }
        Ok(Got::Is(outputs))
    }
}

/// What the request's `parameters` are read for: `binary_data_output`, then the sequence.
const REQUEST_WANT: [&str; 4] = [
    "binary_data_output",
    SEQUENCE_ID,
    SEQUENCE_START,
    SEQUENCE_END,
];

/// The sequence a request's `parameters` name (the values of [`REQUEST_WANT`] from 1).
///
/// Errors: bad request for a `sequence_id` that is not a non-negative integer or a string, or
/// flags that are not booleans.
fn sequence(p: &Wanted) -> ServeResult<Option<SequenceRequest>> {
    let id = match p.get(1).cloned().flatten() {
        None => return Ok(None),
        Some(Param::U64(n)) => SequenceId::Number(n),
        Some(Param::Str(t)) => SequenceId::Text(t),
        Some(_) => {
            return Err(ServeError::bad_request(format!(
                "`{SEQUENCE_ID}` must be a non-negative integer or a string"
            )));
        }
    };
    let flag = |i: usize, k: &str| match p.get(i).cloned().flatten() {
        None => Ok(false),
        Some(Param::Bool(b)) => Ok(b),
        Some(_) => Err(ServeError::bad_request(format!("`{k}` must be a boolean"))),
    };
    Ok(Some(SequenceRequest {
        id,
        start: flag(2, SEQUENCE_START)?,
        end: flag(3, SEQUENCE_END)?,
    }))
}

/// The request as the head pass reads it.
#[derive(Default)]
struct Head {
    id: Option<String>,
    params: Wanted,
    inputs: Option<Got<Vec<InputHead>>>,
    outputs: Option<Got<Vec<OutputHead>>>,
}

struct HeadSeed<'c, 'a, 'b> {
    ctx: &'c Ctx,
    binary: &'a mut Binary<'b>,
}

impl<'de> DeserializeSeed<'de> for HeadSeed<'_, '_, '_> {
    type Value = Got<Head>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Got<Head>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for HeadSeed<'_, '_, '_> {
    type Value = Got<Head>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an inference request")
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Got::Other)
    }
    other_scalars!();
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Skip { ctx: self.ctx }.visit_seq(seq)?;
        Ok(Got::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let ctx = self.ctx;
        let mut keys = Keys::new("the request");
        let mut h = Head::default();
        while let Some(k) = keys.next(ctx, &mut map)? {
            match &*k {
                "id" => {
                    h.id = match map.next_value_seed(Str { ctx })? {
                        Got::Is(s) => Some(s),
                        Got::Other => None,
                    }
                }
                "parameters" => {
                    h.params = map.next_value_seed(Params {
                        ctx,
                        want: &REQUEST_WANT,
                    })?
                }
                "inputs" => {
                    h.inputs = Some(map.next_value_seed(InputsSeed {
                        ctx,
                        binary: self.binary,
                    })?)
                }
                "outputs" => h.outputs = Some(map.next_value_seed(OutputsSeed { ctx })?),
                _ => map.next_value_seed(Skip { ctx })?,
            }
        }
        Ok(Got::Is(h))
    }
}

// --- Pass 2: the data ---------------------------------------------------------------------

/// Where the data pass writes one input's elements.
struct Fill<'t> {
    tensor: &'t mut Tensor,
    /// Elements the shape declares.
    want: u64,
    /// Elements written so far.
    index: u64,
}

impl Fill<'_> {
    fn bad<E: de::Error>(&self, ctx: &Ctx, what: &str) -> E {
        ctx.fail(ServeError::bad_request(format!(
            "input `{}`: element {} is not {what} ({} data)",
            self.tensor.name,
            self.index,
            self.tensor.datatype.name()
        )))
    }

    /// Makes room for one more element; a bad request past the shape's count.
    fn next<E: de::Error>(&mut self, ctx: &Ctx) -> Result<(), E> {
        if self.index >= self.want {
            return Err(ctx.fail(ServeError::bad_request(format!(
                "tensor `{}`: more elements than shape {:?} holds ({})",
                self.tensor.name, self.tensor.shape, self.want
            ))));
        }
        Ok(())
    }

    fn int<E: de::Error>(&mut self, ctx: &Ctx, v: Result<u64, i64>) -> Result<(), E> {
        macro_rules! put {
            ($t:ty) => {{
                let x = match v {
                    Ok(u) => <$t>::try_from(u).ok(),
                    Err(i) => <$t>::try_from(i).ok(),
                };
                let x = x.ok_or_else(|| {
                    self.bad(ctx, concat!("an integer in the range of ", stringify!($t)))
                })?;
                self.tensor.data.extend_from_slice(&x.to_le_bytes());
            }};
        }
        let f = || match v {
            Ok(u) => u as f64,
            Err(i) => i as f64,
        };
        match self.tensor.datatype {
            Datatype::Bool => return Err(self.bad(ctx, "a boolean")),
            Datatype::Bytes => return Err(self.bad(ctx, "a string")),
            Datatype::Uint8 => put!(u8),
            Datatype::Uint16 => put!(u16),
            Datatype::Uint32 => put!(u32),
            Datatype::Uint64 => put!(u64),
            Datatype::Int8 => put!(i8),
            Datatype::Int16 => put!(i16),
            Datatype::Int32 => put!(i32),
            Datatype::Int64 => put!(i64),
            Datatype::Fp16 | Datatype::Bf16 | Datatype::Fp32 | Datatype::Fp64 => {
                return self.float(ctx, f());
            }
        }
        Ok(())
    }

    fn float<E: de::Error>(&mut self, ctx: &Ctx, x: f64) -> Result<(), E> {
        let d = &mut self.tensor.data;
        match self.tensor.datatype {
            Datatype::Fp16 => d.extend_from_slice(&half::f16::from_f64(x).to_le_bytes()),
            Datatype::Bf16 => d.extend_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
            Datatype::Fp32 => d.extend_from_slice(&(x as f32).to_le_bytes()),
            Datatype::Fp64 => d.extend_from_slice(&x.to_le_bytes()),
            Datatype::Bool => return Err(self.bad(ctx, "a boolean")),
            Datatype::Bytes => return Err(self.bad(ctx, "a string")),
            _ => {
                let what = match self.tensor.datatype {
                    Datatype::Uint8 => "an integer in the range of u8",
                    Datatype::Uint16 => "an integer in the range of u16",
                    Datatype::Uint32 => "an integer in the range of u32",
                    Datatype::Uint64 => "an integer in the range of u64",
                    Datatype::Int8 => "an integer in the range of i8",
                    Datatype::Int16 => "an integer in the range of i16",
                    Datatype::Int32 => "an integer in the range of i32",
                    _ => "an integer in the range of i64",
                };
                return Err(self.bad(ctx, what));
            }
        }
        Ok(())
    }

    /// The message for an element of the wrong JSON type.
    fn wrong<E: de::Error>(&self, ctx: &Ctx) -> E {
        let what = match self.tensor.datatype {
            Datatype::Bool => "a boolean",
            Datatype::Bytes => "a string",
            Datatype::Fp16 | Datatype::Bf16 | Datatype::Fp32 | Datatype::Fp64 => "a number",
            Datatype::Uint8 => "an integer in the range of u8",
            Datatype::Uint16 => "an integer in the range of u16",
            Datatype::Uint32 => "an integer in the range of u32",
            Datatype::Uint64 => "an integer in the range of u64",
            Datatype::Int8 => "an integer in the range of i8",
            Datatype::Int16 => "an integer in the range of i16",
            Datatype::Int32 => "an integer in the range of i32",
            Datatype::Int64 => "an integer in the range of i64",
        };
        self.bad(ctx, what)
    }
}

struct FillSeed<'c, 'a, 't> {
    ctx: &'c Ctx,
    fill: &'a mut Fill<'t>,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for FillSeed<'_, '_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FillSeed<'_, '_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("tensor data")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.fill.next(self.ctx)?;
        if self.fill.tensor.datatype != Datatype::Bool {
            return Err(self.fill.wrong(self.ctx));
        }
        self.fill.tensor.data.push(u8::from(v));
        self.fill.index += 1;
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.fill.next(self.ctx)?;
        self.fill.int(self.ctx, Ok(v))?;
        self.fill.index += 1;
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.fill.next(self.ctx)?;
        self.fill.int(self.ctx, Err(v))?;
        self.fill.index += 1;
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.fill.next(self.ctx)?;
        self.fill.float(self.ctx, v)?;
        self.fill.index += 1;
        Ok(())
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.fill.next(self.ctx)?;
        if self.fill.tensor.datatype != Datatype::Bytes {
            return Err(self.fill.wrong(self.ctx));
        }
        super::push_bytes_element(&mut self.fill.tensor.data, v.as_bytes());
        self.fill.index += 1;
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.fill.next(self.ctx)?;
        Err(self.fill.wrong(self.ctx))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        self.fill.next(self.ctx)?;
        Err(self.fill.wrong(self.ctx))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        // The head pass checked the depth.
        while seq
            .next_element_seed(FillSeed {
                ctx: self.ctx,
                fill: &mut *self.fill,
                depth: self.depth + 1,
            })?
            .is_some()
        {}
        Ok(())
    }
}

/// The data pass over one input object: fills its tensor from `data` when it is pending.
struct DataInput<'c, 'a> {
    ctx: &'c Ctx,
    input: Option<&'a mut InputHead>,
}

impl<'de> DeserializeSeed<'de> for DataInput<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for DataInput<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an input object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let pending = self.input.filter(|i| i.json_bytes.is_some());
        let Some(input) = pending else {
            while map.next_key::<IgnoredAny>()?.is_some() {
                map.next_value::<IgnoredAny>()?;
            }
            return Ok(());
        };
        while let Some(Key(k)) = map.next_key_seed(KeySeed)? {
            if k != "data" {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let bytes = input.json_bytes.unwrap_or(0);
            let want = element_count(&input.tensor.shape).unwrap_or(0);
            input.tensor.data = Vec::with_capacity(bytes);
            let mut fill = Fill {
                tensor: &mut input.tensor,
                want,
                index: 0,
            };
            map.next_value_seed(FillSeed {
                ctx: self.ctx,
                fill: &mut fill,
                depth: 0,
            })?;
        }
        Ok(())
    }
}

struct DataInputs<'c, 'a> {
    ctx: &'c Ctx,
    inputs: &'a mut [InputHead],
}

impl<'de> DeserializeSeed<'de> for DataInputs<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for DataInputs<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of inputs")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut it = self.inputs.iter_mut();
        while seq
            .next_element_seed(DataInput {
                ctx: self.ctx,
                input: it.next(),
            })?
            .is_some()
        {}
        Ok(())
    }
}

struct DataRequest<'c, 'a> {
    ctx: &'c Ctx,
    inputs: &'a mut [InputHead],
}

impl<'de> DeserializeSeed<'de> for DataRequest<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for DataRequest<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an inference request")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut inputs = Some(self.inputs);
        while let Some(Key(k)) = map.next_key_seed(KeySeed)? {
            match (&*k, inputs.take()) {
                ("inputs", Some(i)) => map.next_value_seed(DataInputs {
                    ctx: self.ctx,
                    inputs: i,
                })?,
                (_, i) => {
                    inputs = i;
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// Runs one pass of `seed` over `header`, with serde_json's checks of what follows the value.
fn parse<'de, S: DeserializeSeed<'de>>(
    ctx: &Ctx,
    header: &'de [u8],
    seed: S,
) -> ServeResult<S::Value> {
    let mut de = serde_json::Deserializer::from_slice(header);
    let v = seed.deserialize(&mut de).map_err(|e| ctx.error(e))?;
    de.end().map_err(|e| ctx.error(e))?;
    Ok(v)
}

/// Decodes a REST inference request (see [`super::request_from_json`]).
pub(super) fn request_from_json(header: &[u8], binary: &[u8]) -> ServeResult<InferRequest> {
    let ctx = Ctx::new();
    let mut bin = Binary {
        bytes: binary,
        offset: 0,
    };
    let Got::Is(head) = parse(
        &ctx,
        header,
        HeadSeed {
            ctx: &ctx,
            binary: &mut bin,
        },
    )?
    else {
        return Err(ServeError::bad_request("the request must be a JSON object"));
    };
    let Some(Got::Is(mut inputs)) = head.inputs else {
        return Err(ServeError::bad_request("the request has no `inputs` array"));
    };
    if bin.offset != binary.len() {
        return Err(ServeError::bad_request(format!(
            "{} bytes of binary data follow the header, but the inputs' binary_data_size add up to {}",
            binary.len(),
            bin.offset
        )));
    }
    let binary_output = head
        .params
        .first()
        .cloned()
        .flatten()
        .and_then(|p| p.as_bool())
        .unwrap_or(false);
    let outputs = match head.outputs {
        None => Vec::new(),
        Some(Got::Other) => {
            return Err(ServeError::bad_request("`outputs` must be an array"));
        }
        Some(Got::Is(o)) => o
            .into_iter()
            .map(|o| RequestedOutput {
                name: o.name,
                binary: o.binary.unwrap_or(binary_output),
                shm: o.shm,
            })
            .collect(),
    };
    if inputs.iter().any(|i| i.json_bytes.is_some()) {
        parse(
            &ctx,
            header,
            DataRequest {
                ctx: &ctx,
                inputs: &mut inputs,
            },
        )?;
    }
    for i in &inputs {
        if i.json_bytes.is_some() {
            i.tensor.check()?;
        }
    }
    let sequence = sequence(&head.params)?;
    let shm_inputs = inputs
        .iter_mut()
        .enumerate()
        .filter_map(|(i, h)| h.shm.take().map(|r| (i, r)))
        .collect();
    // Collected in place: the inputs' vector becomes the tensors' without a second one.
    let tensors: Vec<Tensor> = inputs.into_iter().map(|i| i.tensor).collect();
    Ok(InferRequest {
        id: head.id,
        inputs: tensors,
        outputs,
        binary_output,
        shm_inputs,
        sequence,
    })
}
