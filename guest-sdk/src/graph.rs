//! A builder of StableHLO programs: build a graph of tensor operations in Rust, then compile it
//! with [`Graph::compile`] (or get the MLIR text with [`Graph::to_mlir`]).
//!
//! A [`Graph`] is one function `@main`. Its inputs are [`Graph::parameter`]s (in the order they
//! were created); every op returns a [`Value`], a small `Copy` handle into the graph that
//! records the result's dtype and dims ([`Graph::spec`]). Shapes and dtypes are checked as the
//! graph is built, so a mistake surfaces at the op that made it, as an
//! [`ErrorKind::InvalidArgument`] error whose message names the op and its operands' specs
//! (`f32[2,3]` style), e.g.
//! `dot_general: contracting dims differ: f32[2,3] dim 1 (3) vs f32[4,5] dim 0 (4)`.
//!
//! ```no_run
//! use tpubox_guest::{Dtype, Tensor};
//! use tpubox_guest::graph::{Graph, Precision};
//!
//! let mut g = Graph::new();
//! let x = g.parameter(Dtype::F32, &[2, 3]);
//! let w = g.parameter(Dtype::F32, &[3, 4]);
//! let b = g.parameter(Dtype::F32, &[4]);
//! let y = g.matmul(x, w, Precision::Highest)?;
//! let y = g.add(y, b)?; // b broadcasts over the rows
//! let y = g.gelu(y)?;
//! assert_eq!(g.dims(y), &[2, 4]);
//! let exe = g.compile(&[y])?;
//! let out = exe.call(&[
//!     &Tensor::from_slice(&[0.5f32; 6], &[2, 3])?,
//!     &Tensor::from_slice(&[0.1f32; 12], &[3, 4])?,
//!     &Tensor::from_slice(&[0.0f32; 4], &[4])?,
//! ])?;
//! # Ok::<(), tpubox_guest::Error>(())
//! ```
//!
//! # Conventions
//!
//! * Element-wise binary ops ([`Graph::add`], [`Graph::compare`], [`Graph::select`], ...)
//!   broadcast their operands with numpy rules (dims aligned from the right; a dim of 1, or a
//!   missing leading dim, stretches), inserting `stablehlo.broadcast_in_dim` where needed.
//!   Operand dtypes must be equal; there is no implicit promotion (use [`Graph::convert`]).
//! * Axes and dims are `u64`, 0-based, row-major.
//! * Transcendental ops ([`Graph::exp`], [`Graph::erf`], the helpers ...) need a floating
//!   dtype (`f16`, `bf16`, `f32`, `f64`).
//! * Complex dtypes can flow through parameters, reshapes and the like, but no op here makes
//!   complex constants.
//! * A [`Value`] belongs to the graph that made it; passing it to another graph is an error
//!   (or a panic for the infallible accessors [`Graph::spec`], [`Graph::dims`],
//!   [`Graph::dtype`]).
//!
//! Ops map one-to-one to StableHLO ops except [`Graph::erf`], which emits `chlo.erf` (accepted
//! by XLA's StableHLO pipeline, as emitted by JAX), and the helpers [`Graph::softmax`],
//! [`Graph::layer_norm`] and [`Graph::gelu`], which are compositions of the other ops.

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::spec::check_len;
use crate::{
    Dtype, Element, Error, ErrorKind, Executable, Result, TensorSpec, compile_mlir, encode,
};

static NEXT_GRAPH_ID: AtomicU32 = AtomicU32::new(1);

/// A handle to a value (a tensor) in a [`Graph`]: a parameter, a constant or an op's result.
///
/// Cheap to copy; only meaningful together with the graph that returned it. Ask that graph for
/// its dtype and dims ([`Graph::spec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Value {
    graph: u32,
    index: u32,
}

/// The `precision_config` of [`Graph::dot_general`] and [`Graph::matmul`], applied to both
/// operands (XLA's `DEFAULT` / `HIGH` / `HIGHEST`).
///
/// On CPU and GPU f32 matmuls run in full precision whatever is asked; on TPU, `Default` uses
/// one bf16 pass, `High` three (about bf16×3 ≈ f24), `Highest` full f32 precision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Fastest mode the backend offers (`DEFAULT`).
    #[default]
    Default,
    /// More precise than default (`HIGH`).
    High,
    /// Full precision of the operand dtype (`HIGHEST`).
    Highest,
}

impl Precision {
    /// The StableHLO spelling, e.g. `"HIGHEST"`.
    pub const fn name(self) -> &'static str {
        match self {
            Precision::Default => "DEFAULT",
            Precision::High => "HIGH",
            Precision::Highest => "HIGHEST",
        }
    }
}

/// The comparison of [`Graph::compare`].
///
/// Floats compare with IEEE semantics (any comparison with NaN is false except `Ne`); signed
/// integers as signed, unsigned integers and `pred` as unsigned (`false < true`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Compare {
    /// `a == b`
    Eq,
    /// `a != b`
    Ne,
    /// `a < b`
    Lt,
    /// `a <= b`
    Le,
    /// `a > b`
    Gt,
    /// `a >= b`
    Ge,
}

impl Compare {
    /// The StableHLO comparison direction, e.g. `"GE"`.
    pub const fn name(self) -> &'static str {
        match self {
            Compare::Eq => "EQ",
            Compare::Ne => "NE",
            Compare::Lt => "LT",
            Compare::Le => "LE",
            Compare::Gt => "GT",
            Compare::Ge => "GE",
        }
    }
}

/// One value of the graph: its spec and, unless it is a parameter, the MLIR that defines it
/// (one or more lines; the last defines `%vN`).
struct Node {
    spec: TensorSpec,
    body: Option<String>,
}

/// Builder of one StableHLO function `@main`; emits MLIR text the plugin compiles.
///
/// Create values with [`Graph::parameter`], [`Graph::constant`] and the ops, then call
/// [`Graph::compile`] with the values to return. The graph keeps every value it made, in
/// creation order (which is always a valid definition order); values that do not reach an
/// output are emitted too and left to the compiler's dead-code elimination.
///
/// Every op checks its operands when called and fails with [`ErrorKind::InvalidArgument`],
/// naming the op and the operand specs. A failed op adds nothing to the graph.
pub struct Graph {
    id: u32,
    nodes: Vec<Node>,
    params: Vec<u32>,
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph")
            .field("id", &self.id)
            .field("values", &self.nodes.len())
            .field("parameters", &self.params.len())
            .finish()
    }
}

impl Default for Graph {
    fn default() -> Self {
        Graph::new()
    }
}

/// The MLIR element type of `dtype`, e.g. `f32`, `i1`, `ui8`, `complex<f32>`.
pub fn mlir_element_type(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Pred => "i1",
        Dtype::S8 => "i8",
        Dtype::S16 => "i16",
        Dtype::S32 => "i32",
        Dtype::S64 => "i64",
        Dtype::U8 => "ui8",
        Dtype::U16 => "ui16",
        Dtype::U32 => "ui32",
        Dtype::U64 => "ui64",
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
        Dtype::F32 => "f32",
        Dtype::F64 => "f64",
        Dtype::C64 => "complex<f32>",
        Dtype::C128 => "complex<f64>",
    }
}

/// The MLIR tensor type of `spec`, e.g. `tensor<2x3xf32>`, `tensor<i1>` for a scalar.
pub fn mlir_type(spec: &TensorSpec) -> String {
    let mut s = String::from("tensor<");
    for d in &spec.dims {
        let _ = write!(s, "{d}x");
    }
    s.push_str(mlir_element_type(spec.dtype));
    s.push('>');
    s
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F16 | Dtype::Bf16 | Dtype::F32 | Dtype::F64)
}

fn is_signed_int(d: Dtype) -> bool {
    matches!(d, Dtype::S8 | Dtype::S16 | Dtype::S32 | Dtype::S64)
}

fn is_unsigned_int(d: Dtype) -> bool {
    matches!(d, Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64)
}

fn is_int(d: Dtype) -> bool {
    is_signed_int(d) || is_unsigned_int(d)
}

fn is_complex(d: Dtype) -> bool {
    matches!(d, Dtype::C64 | Dtype::C128)
}

fn invalid(op: &str, msg: impl fmt::Display) -> Error {
    Error::new(ErrorKind::InvalidArgument, format!("{op}: {msg}"))
}

/// `[1, 2, 3]`
fn list(xs: &[u64]) -> String {
    let mut s = String::from("[");
    for (i, x) in xs.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{x}");
    }
    s.push(']');
    s
}

/// `array<i64: 1, 2, 3>` (`array<i64>` when empty)
fn i64_array(xs: &[u64]) -> String {
    if xs.is_empty() {
        return "array<i64>".to_string();
    }
    let mut s = String::from("array<i64: ");
    for (i, x) in xs.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{x}");
    }
    s.push('>');
    s
}

/// Numpy broadcast of two shapes, or `None` if they are incompatible.
fn broadcast_dims(a: &[u64], b: &[u64]) -> Option<Vec<u64>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0u64; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() {
            1
        } else {
            a[i - (rank - a.len())]
        };
        let db = if i < rank - b.len() {
            1
        } else {
            b[i - (rank - b.len())]
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(out)
}

/// Checks that `axes` are distinct and below `rank`.
fn check_axes(op: &str, spec: &TensorSpec, axes: &[u64], what: &str) -> Result<()> {
    for (i, &a) in axes.iter().enumerate() {
        if a >= spec.rank() as u64 {
            return Err(invalid(
                op,
                format!(
                    "{what} {a} is out of range for {spec} (rank {})",
                    spec.rank()
                ),
            ));
        }
        if axes[..i].contains(&a) {
            return Err(invalid(op, format!("{what} {a} is repeated for {spec}")));
        }
    }
    Ok(())
}

/// Formats `count` elements (given as literal strings, row-major) as a nested MLIR dense
/// literal of `dims`.
fn nested_literal(elems: &[String], dims: &[u64]) -> String {
    fn go(out: &mut String, elems: &[String], dims: &[u64]) {
        match dims.split_first() {
            None => out.push_str(&elems[0]),
            Some((&n, rest)) => {
                let inner: usize = rest.iter().map(|&d| d as usize).product();
                out.push('[');
                for i in 0..n as usize {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    go(out, &elems[i * inner..(i + 1) * inner], rest);
                }
                out.push(']');
            }
        }
    }
    let mut s = String::new();
    go(&mut s, elems, dims);
    s
}

/// The MLIR literal of one element of `dtype` given as its little-endian bytes: `true`,
/// `-3`, or the bit pattern `0x3F800000` for floats.
fn element_literal(dtype: Dtype, bytes: &[u8]) -> String {
    let mut le = [0u8; 8];
    le[..bytes.len()].copy_from_slice(bytes);
    let bits = u64::from_le_bytes(le);
    match dtype {
        Dtype::Pred => (bits != 0).to_string(),
        Dtype::S8 => (bits as u8 as i8).to_string(),
        Dtype::S16 => (bits as u16 as i16).to_string(),
        Dtype::S32 => (bits as u32 as i32).to_string(),
        Dtype::S64 => (bits as i64).to_string(),
        Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64 => bits.to_string(),
        // Floats as their exact bit pattern (MLIR reads a hex literal of a float type so).
        _ => format!("0x{:0width$X}", bits, width = bytes.len() * 2),
    }
}

/// The `dense<...>` attribute holding `bytes` (host layout) as a `spec` tensor.
fn dense_attr(spec: &TensorSpec, bytes: &[u8]) -> String {
    let size = spec.dtype.size_bytes();
    let count = bytes.len() / size;
    if count == 1 {
        // One element: a splat literal, whatever the rank.
        return format!("dense<{}>", element_literal(spec.dtype, bytes));
    }
    if spec.dtype == Dtype::Pred || count == 0 {
        let elems: Vec<String> = bytes
            .chunks_exact(size)
            .map(|b| element_literal(spec.dtype, b))
            .collect();
        return format!("dense<{}>", nested_literal(&elems, &spec.dims));
    }
    // Raw little-endian bytes as a hex string: compact for large constants (weights).
    let mut s = String::with_capacity(bytes.len() * 2 + 12);
    s.push_str("dense<\"0x");
    for b in bytes {
        let _ = write!(s, "{b:02X}");
    }
    s.push_str("\">");
    s
}

impl Graph {
    /// An empty graph (no parameters, no values).
    pub fn new() -> Graph {
        Graph {
            id: NEXT_GRAPH_ID.fetch_add(1, Ordering::Relaxed),
            nodes: Vec::new(),
            params: Vec::new(),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Accessors
    // -----------------------------------------------------------------------------------------

    /// The dtype and dims of `v`.
    ///
    /// Panics if `v` comes from another graph.
    pub fn spec(&self, v: Value) -> &TensorSpec {
        match self.node(v) {
            Ok(n) => &n.spec,
            Err(e) => panic!("{}", e.message()),
        }
    }

    /// The dims of `v` (empty for a scalar). Panics if `v` comes from another graph.
    pub fn dims(&self, v: Value) -> &[u64] {
        &self.spec(v).dims
    }

    /// The dtype of `v`. Panics if `v` comes from another graph.
    pub fn dtype(&self, v: Value) -> Dtype {
        self.spec(v).dtype
    }

    /// The parameters of `@main`, in order.
    pub fn parameters(&self) -> Vec<Value> {
        self.params.iter().map(|&index| self.value(index)).collect()
    }

    fn value(&self, index: u32) -> Value {
        Value {
            graph: self.id,
            index,
        }
    }

    fn node(&self, v: Value) -> Result<&Node> {
        if v.graph != self.id {
            return Err(Error::invalid_argument(format!(
                "value %v{} belongs to another graph (#{}, not this graph #{})",
                v.index, v.graph, self.id
            )));
        }
        self.nodes
            .get(v.index as usize)
            .ok_or_else(|| Error::invalid_argument(format!("value %v{} is unknown", v.index)))
    }

    /// The spec of operand `v` of `op` (an error names the op if `v` is foreign).
    fn operand(&self, op: &str, v: Value) -> Result<TensorSpec> {
        self.node(v)
            .map(|n| n.spec.clone())
            .map_err(|e| invalid(op, e.message()))
    }

    fn name(v: Value) -> String {
        format!("%v{}", v.index)
    }

    /// Adds a node whose MLIR `make(result_name)` defines it.
    fn push(&mut self, spec: TensorSpec, make: impl FnOnce(&str) -> String) -> Value {
        let index = u32::try_from(self.nodes.len()).expect("fewer than 2^32 values");
        let body = make(&format!("%v{index}"));
        self.nodes.push(Node {
            spec,
            body: Some(body),
        });
        self.value(index)
    }

    // -----------------------------------------------------------------------------------------
    // Inputs and constants
    // -----------------------------------------------------------------------------------------

    /// Adds a parameter of `@main` of `dtype` and `dims`. Parameters are numbered in creation
    /// order: the compiled executable takes its arguments in that order.
    pub fn parameter(&mut self, dtype: Dtype, dims: &[u64]) -> Value {
        let index = u32::try_from(self.nodes.len()).expect("fewer than 2^32 values");
        self.nodes.push(Node {
            spec: TensorSpec::new(dtype, dims),
            body: None,
        });
        self.params.push(index);
        self.value(index)
    }

    /// A constant of dtype `T::DTYPE` and `dims` holding row-major `data`, embedded in the
    /// program (`stablehlo.constant`; large constants use the compact hex form
    /// `dense<"0x...">`).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `data.len()` is not the product of `dims`.
    pub fn constant<T: Element>(&mut self, data: &[T], dims: &[u64]) -> Result<Value> {
        check_len(T::DTYPE, dims, data.len()).map_err(|e| invalid("constant", e.message()))?;
        Ok(self.constant_bytes(TensorSpec::new(T::DTYPE, dims), &encode(data)))
    }

    /// A rank-0 constant holding `v`.
    pub fn scalar<T: Element>(&mut self, v: T) -> Value {
        self.constant_bytes(TensorSpec::new(T::DTYPE, &[]), &encode(&[v]))
    }

    fn constant_bytes(&mut self, spec: TensorSpec, bytes: &[u8]) -> Value {
        let attr = dense_attr(&spec, bytes);
        let ty = mlir_type(&spec);
        self.push(spec, |r| format!("{r} = stablehlo.constant {attr} : {ty}"))
    }

    /// A rank-0 constant `v` of a floating `dtype` (rounded to it).
    fn float_scalar(&mut self, dtype: Dtype, v: f64) -> Value {
        match dtype {
            Dtype::F64 => self.scalar(v),
            Dtype::F16 => self.scalar(half::f16::from_f64(v)),
            Dtype::Bf16 => self.scalar(half::bf16::from_f64(v)),
            _ => self.scalar(v as f32),
        }
    }

    /// The scalar constant reductions start from: 0 for a sum, the lowest value for a max.
    fn reduce_init(&mut self, dtype: Dtype, max: bool) -> Value {
        if !max {
            return match dtype {
                Dtype::Pred => self.scalar(false),
                d if is_float(d) => self.float_scalar(d, 0.0),
                d => {
                    let spec = TensorSpec::new(d, &[]);
                    self.constant_bytes(spec, &vec![0u8; d.size_bytes()])
                }
            };
        }
        match dtype {
            Dtype::Pred => self.scalar(false),
            Dtype::S8 => self.scalar(i8::MIN),
            Dtype::S16 => self.scalar(i16::MIN),
            Dtype::S32 => self.scalar(i32::MIN),
            Dtype::S64 => self.scalar(i64::MIN),
            Dtype::U8 => self.scalar(0u8),
            Dtype::U16 => self.scalar(0u16),
            Dtype::U32 => self.scalar(0u32),
            Dtype::U64 => self.scalar(0u64),
            d => self.float_scalar(d, f64::NEG_INFINITY),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Element-wise ops
    // -----------------------------------------------------------------------------------------

    /// Broadcasts `a` and `b` to their common shape (numpy rules); checks equal dtypes.
    fn broadcast_pair(&mut self, op: &str, a: Value, b: Value) -> Result<(Value, Value)> {
        let sa = self.operand(op, a)?;
        let sb = self.operand(op, b)?;
        if sa.dtype != sb.dtype {
            return Err(invalid(op, format!("dtypes differ: {sa} vs {sb}")));
        }
        let dims = broadcast_dims(&sa.dims, &sb.dims)
            .ok_or_else(|| invalid(op, format!("shapes do not broadcast: {sa} vs {sb}")))?;
        let a = self.broadcast_unchecked(a, &sa, &dims);
        let b = self.broadcast_unchecked(b, &sb, &dims);
        Ok((a, b))
    }

    /// Numpy-broadcasts `v` (of spec `s`, known to be compatible) to `dims`.
    fn broadcast_unchecked(&mut self, v: Value, s: &TensorSpec, dims: &[u64]) -> Value {
        if s.dims == dims {
            return v;
        }
        let offset = (dims.len() - s.rank()) as u64;
        let bd: Vec<u64> = (0..s.rank() as u64).map(|i| i + offset).collect();
        self.emit_broadcast_in_dim(v, s, dims, &bd)
    }

    fn emit_broadcast_in_dim(
        &mut self,
        v: Value,
        s: &TensorSpec,
        dims: &[u64],
        bd: &[u64],
    ) -> Value {
        let out = TensorSpec::new(s.dtype, dims);
        let (x, ti, to) = (Self::name(v), mlir_type(s), mlir_type(&out));
        let bd = list(bd);
        self.push(out, |r| {
            format!("{r} = stablehlo.broadcast_in_dim {x}, dims = {bd} : ({ti}) -> {to}")
        })
    }

    fn binary(
        &mut self,
        op: &str,
        mlir: &str,
        a: Value,
        b: Value,
        allow_pred: bool,
    ) -> Result<Value> {
        let dtype = self.operand(op, a)?.dtype;
        if !allow_pred && dtype == Dtype::Pred {
            let (sa, sb) = (self.operand(op, a)?, self.operand(op, b)?);
            return Err(invalid(
                op,
                format!("needs numeric operands, got {sa} and {sb}"),
            ));
        }
        let (a, b) = self.broadcast_pair(op, a, b)?;
        let out = self.operand(op, a)?;
        let (x, y, ty) = (Self::name(a), Self::name(b), mlir_type(&out));
        Ok(self.push(out, |r| format!("{r} = stablehlo.{mlir} {x}, {y} : {ty}")))
    }

    /// `a + b`, element-wise with numpy broadcasting.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the dtypes differ, the shapes do not
    /// broadcast, or the dtype is `pred`.
    pub fn add(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary("add", "add", a, b, false)
    }

    /// `a - b`, element-wise with numpy broadcasting. Errors: as for [`Graph::add`].
    pub fn sub(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary("sub", "subtract", a, b, false)
    }

    /// `a * b`, element-wise with numpy broadcasting. Errors: as for [`Graph::add`].
    pub fn mul(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary("mul", "multiply", a, b, false)
    }

    /// `a / b`, element-wise with numpy broadcasting (integers truncate toward zero).
    /// Errors: as for [`Graph::add`].
    pub fn div(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary("div", "divide", a, b, false)
    }

    /// Element-wise maximum with numpy broadcasting (NaN propagates). Also accepts `pred`
    /// (logical or). Errors: [`ErrorKind::InvalidArgument`] if the dtypes differ or the shapes
    /// do not broadcast.
    pub fn max(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary("max", "maximum", a, b, true)
    }

    /// Element-wise minimum with numpy broadcasting (NaN propagates). Also accepts `pred`
    /// (logical and). Errors: as for [`Graph::max`].
    pub fn min(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary("min", "minimum", a, b, true)
    }

    /// `a` raised to the power `b`, element-wise with numpy broadcasting (`stablehlo.power`;
    /// a negative float base with a non-integer exponent gives NaN). Errors: as for
    /// [`Graph::add`].
    pub fn pow(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary("pow", "power", a, b, false)
    }

    /// An element-wise unary op on a float (or, with `signed_ints`, also a signed integer).
    fn unary(&mut self, op: &str, a: Value, signed_ints: bool) -> Result<Value> {
        let s = self.operand(op, a)?;
        let ok = is_float(s.dtype) || (signed_ints && is_signed_int(s.dtype));
        if !ok {
            let want = if signed_ints {
                "a float or signed integer"
            } else {
                "a float"
            };
            return Err(invalid(op, format!("needs {want} operand, got {s}")));
        }
        let x = Self::name(a);
        let ty = mlir_type(&s);
        let line = match op {
            "neg" => format!("stablehlo.negate {x} : {ty}"),
            "exp" => format!("stablehlo.exponential {x} : {ty}"),
            "log" => format!("stablehlo.log {x} : {ty}"),
            "tanh" => format!("stablehlo.tanh {x} : {ty}"),
            "sqrt" => format!("stablehlo.sqrt {x} : {ty}"),
            "rsqrt" => format!("stablehlo.rsqrt {x} : {ty}"),
            "abs" => format!("stablehlo.abs {x} : {ty}"),
            "logistic" => format!("stablehlo.logistic {x} : {ty}"),
            "erf" => format!("chlo.erf {x} : {ty} -> {ty}"),
            _ => unreachable!("unknown unary op {op}"),
        };
        Ok(self.push(s, |r| format!("{r} = {line}")))
    }

    /// `-a`, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a float or
    /// signed integer.
    pub fn neg(&mut self, a: Value) -> Result<Value> {
        self.unary("neg", a, true)
    }

    /// `|a|`, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a float or
    /// signed integer.
    pub fn abs(&mut self, a: Value) -> Result<Value> {
        self.unary("abs", a, true)
    }

    /// `e^a`, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a float.
    pub fn exp(&mut self, a: Value) -> Result<Value> {
        self.unary("exp", a, false)
    }

    /// Natural logarithm, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a
    /// float.
    pub fn log(&mut self, a: Value) -> Result<Value> {
        self.unary("log", a, false)
    }

    /// Hyperbolic tangent, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is
    /// a float.
    pub fn tanh(&mut self, a: Value) -> Result<Value> {
        self.unary("tanh", a, false)
    }

    /// Square root, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a
    /// float.
    pub fn sqrt(&mut self, a: Value) -> Result<Value> {
        self.unary("sqrt", a, false)
    }

    /// `1 / sqrt(a)`, element-wise. Errors: [`ErrorKind::InvalidArgument`] unless `a` is a
    /// float.
    pub fn rsqrt(&mut self, a: Value) -> Result<Value> {
        self.unary("rsqrt", a, false)
    }

    /// The error function, element-wise (`chlo.erf`, which XLA expands into its own rational
    /// approximation; on the CPU plugin f32 results are within 1e-6 of the exact value).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] unless `a` is a float.
    pub fn erf(&mut self, a: Value) -> Result<Value> {
        self.unary("erf", a, false)
    }

    /// The logistic sigmoid `1 / (1 + e^-a)`, element-wise. Errors:
    /// [`ErrorKind::InvalidArgument`] unless `a` is a float.
    pub fn logistic(&mut self, a: Value) -> Result<Value> {
        self.unary("logistic", a, false)
    }

    // -----------------------------------------------------------------------------------------
    // Contractions
    // -----------------------------------------------------------------------------------------

    /// General tensor contraction (`stablehlo.dot_general`).
    ///
    /// `batch = (a_dims, b_dims)` pairs batch dims of `a` and `b` (equal sizes), `contract`
    /// likewise pairs contracted dims. The result's dims are the batch dims (in the order
    /// given), then `a`'s remaining dims, then `b`'s remaining dims, each in increasing order.
    /// `precision` applies to both operands.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the dtypes differ or are `pred`, a pair of
    /// lists has different lengths, a dim is out of range or used twice in one operand, or
    /// paired dims have different sizes.
    pub fn dot_general(
        &mut self,
        a: Value,
        b: Value,
        batch: (&[u64], &[u64]),
        contract: (&[u64], &[u64]),
        precision: Precision,
    ) -> Result<Value> {
        const OP: &str = "dot_general";
        let sa = self.operand(OP, a)?;
        let sb = self.operand(OP, b)?;
        if sa.dtype != sb.dtype {
            return Err(invalid(OP, format!("dtypes differ: {sa} vs {sb}")));
        }
        if sa.dtype == Dtype::Pred {
            return Err(invalid(
                OP,
                format!("needs numeric operands, got {sa} and {sb}"),
            ));
        }
        for (what, (da, db)) in [("batch", batch), ("contracting", contract)] {
            if da.len() != db.len() {
                return Err(invalid(
                    OP,
                    format!(
                        "{what} dim lists differ in length: {sa} {} vs {sb} {}",
                        list(da),
                        list(db)
                    ),
                ));
            }
        }
        let used_a: Vec<u64> = batch.0.iter().chain(contract.0).copied().collect();
        let used_b: Vec<u64> = batch.1.iter().chain(contract.1).copied().collect();
        check_axes(OP, &sa, &used_a, "batch/contracting dim")?;
        check_axes(OP, &sb, &used_b, "batch/contracting dim")?;
        for (what, (da, db)) in [("batch", batch), ("contracting", contract)] {
            for (&x, &y) in da.iter().zip(db) {
                let (nx, ny) = (sa.dims[x as usize], sb.dims[y as usize]);
                if nx != ny {
                    return Err(invalid(
                        OP,
                        format!("{what} dims differ: {sa} dim {x} ({nx}) vs {sb} dim {y} ({ny})"),
                    ));
                }
            }
        }
        let mut dims: Vec<u64> = batch.0.iter().map(|&d| sa.dims[d as usize]).collect();
        dims.extend(
            (0..sa.rank() as u64)
                .filter(|d| !used_a.contains(d))
                .map(|d| sa.dims[d as usize]),
        );
        dims.extend(
            (0..sb.rank() as u64)
                .filter(|d| !used_b.contains(d))
                .map(|d| sb.dims[d as usize]),
        );
        let out = TensorSpec::new(sa.dtype, &dims);
        let mut attrs = String::new();
        if !batch.0.is_empty() {
            let _ = write!(
                attrs,
                "batching_dims = {} x {}, ",
                list(batch.0),
                list(batch.1)
            );
        }
        let _ = write!(
            attrs,
            "contracting_dims = {} x {}, precision = [{p}, {p}]",
            list(contract.0),
            list(contract.1),
            p = precision.name()
        );
        let (x, y) = (Self::name(a), Self::name(b));
        let (ta, tb, to) = (mlir_type(&sa), mlir_type(&sb), mlir_type(&out));
        Ok(self.push(out, |r| {
            format!("{r} = stablehlo.dot_general {x}, {y}, {attrs} : ({ta}, {tb}) -> {to}")
        }))
    }

    /// Matrix product over the last two dims.
    ///
    /// * `a: [..., m, k]`, `b: [..., k, n]` with equal leading (batch) dims → `[..., m, n]`;
    /// * `a: [..., m, k]`, `b: [k, n]` (rank 2) → `[..., m, n]`: `b` is shared by every leading
    ///   index of `a` (e.g. `[B, S, K] × [K, N] → [B, S, N]`), without materialising a
    ///   broadcast.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if either operand has rank below 2, the ranks
    /// differ while `b` is not rank 2, the leading dims differ, `k` differs, or as for
    /// [`Graph::dot_general`].
    pub fn matmul(&mut self, a: Value, b: Value, precision: Precision) -> Result<Value> {
        const OP: &str = "matmul";
        let sa = self.operand(OP, a)?;
        let sb = self.operand(OP, b)?;
        if sa.rank() < 2 || sb.rank() < 2 {
            return Err(invalid(
                OP,
                format!("needs operands of rank >= 2, got {sa} and {sb}"),
            ));
        }
        let (ra, rb) = (sa.rank() as u64, sb.rank() as u64);
        let (ka, kb) = (sa.dims[ra as usize - 1], sb.dims[rb as usize - 2]);
        if ka != kb {
            return Err(invalid(
                OP,
                format!(
                    "contracting dims differ: {sa} dim {} ({ka}) vs {sb} dim {} ({kb})",
                    ra - 1,
                    rb - 2
                ),
            ));
        }
        if rb == 2 {
            return self
                .dot_general(a, b, (&[], &[]), (&[ra - 1], &[0]), precision)
                .map_err(|e| invalid(OP, e.message()));
        }
        if ra != rb || sa.dims[..ra as usize - 2] != sb.dims[..rb as usize - 2] {
            return Err(invalid(
                OP,
                format!(
                    "batch dims differ: {sa} vs {sb} (b must be rank 2 or have a's leading dims)"
                ),
            ));
        }
        let batch: Vec<u64> = (0..ra - 2).collect();
        self.dot_general(a, b, (&batch, &batch), (&[ra - 1], &[rb - 2]), precision)
            .map_err(|e| invalid(OP, e.message()))
    }

    // -----------------------------------------------------------------------------------------
    // Shape ops
    // -----------------------------------------------------------------------------------------

    /// `stablehlo.broadcast_in_dim`: a tensor of `dims` where operand dim `i` maps to result
    /// dim `broadcast_dimensions[i]`; result dims not mapped to are filled by repetition, and
    /// an operand dim of size 1 stretches.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `broadcast_dimensions` does not have one
    /// distinct, in-range entry per operand dim, or an operand dim is neither 1 nor the size
    /// of the result dim it maps to.
    pub fn broadcast_in_dim(
        &mut self,
        a: Value,
        dims: &[u64],
        broadcast_dimensions: &[u64],
    ) -> Result<Value> {
        const OP: &str = "broadcast_in_dim";
        let s = self.operand(OP, a)?;
        let out = TensorSpec::new(s.dtype, dims);
        if broadcast_dimensions.len() != s.rank() {
            return Err(invalid(
                OP,
                format!(
                    "broadcast_dimensions {} needs one entry per dim of {s}",
                    list(broadcast_dimensions)
                ),
            ));
        }
        check_axes(OP, &out, broadcast_dimensions, "broadcast dimension")?;
        for (i, &d) in broadcast_dimensions.iter().enumerate() {
            let (n, m) = (s.dims[i], dims[d as usize]);
            if n != 1 && n != m {
                return Err(invalid(
                    OP,
                    format!("{s} dim {i} ({n}) cannot broadcast to {out} dim {d} ({m})"),
                ));
            }
        }
        Ok(self.emit_broadcast_in_dim(a, &s, dims, broadcast_dimensions))
    }

    /// Broadcasts `a` to `dims` with numpy rules (dims aligned from the right; an operand dim
    /// of 1 stretches; missing leading dims are added). Returns `a` itself if it already has
    /// `dims`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `a` has more dims than `dims` or a dim is
    /// neither 1 nor equal to the target's.
    pub fn broadcast_to(&mut self, a: Value, dims: &[u64]) -> Result<Value> {
        const OP: &str = "broadcast_to";
        let s = self.operand(OP, a)?;
        let out = TensorSpec::new(s.dtype, dims);
        if s.rank() > dims.len() || broadcast_dims(&s.dims, dims).as_deref() != Some(dims) {
            return Err(invalid(OP, format!("{s} does not broadcast to {out}")));
        }
        Ok(self.broadcast_unchecked(a, &s, dims))
    }

    /// Reinterprets `a` (row-major) with new `dims` of the same element count.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the element counts differ.
    pub fn reshape(&mut self, a: Value, dims: &[u64]) -> Result<Value> {
        const OP: &str = "reshape";
        let s = self.operand(OP, a)?;
        let out = TensorSpec::new(s.dtype, dims);
        let (n, m) = (s.element_count(), out.element_count());
        match (n, m) {
            (Ok(n), Ok(m)) if n == m => {}
            _ => {
                return Err(invalid(OP, format!("element counts differ: {s} vs {out}")));
            }
        }
        if s.dims == dims {
            return Ok(a);
        }
        let (x, ti, to) = (Self::name(a), mlir_type(&s), mlir_type(&out));
        Ok(self.push(out, |r| {
            format!("{r} = stablehlo.reshape {x} : ({ti}) -> {to}")
        }))
    }

    /// Permutes the dims of `a`: result dim `i` is operand dim `permutation[i]`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `permutation` is not a permutation of
    /// `0..rank`.
    pub fn transpose(&mut self, a: Value, permutation: &[u64]) -> Result<Value> {
        const OP: &str = "transpose";
        let s = self.operand(OP, a)?;
        if permutation.len() != s.rank() {
            return Err(invalid(
                OP,
                format!(
                    "permutation {} is not a permutation of the dims of {s}",
                    list(permutation)
                ),
            ));
        }
        check_axes(OP, &s, permutation, "permutation entry")?;
        let dims: Vec<u64> = permutation.iter().map(|&p| s.dims[p as usize]).collect();
        let out = TensorSpec::new(s.dtype, &dims);
        let (x, ti, to, p) = (
            Self::name(a),
            mlir_type(&s),
            mlir_type(&out),
            list(permutation),
        );
        Ok(self.push(out, |r| {
            format!("{r} = stablehlo.transpose {x}, dims = {p} : ({ti}) -> {to}")
        }))
    }

    fn reduce(&mut self, op: &str, a: Value, axes: &[u64], max: bool) -> Result<Value> {
        let s = self.operand(op, a)?;
        if is_complex(s.dtype) {
            return Err(invalid(
                op,
                format!("complex operands are not supported, got {s}"),
            ));
        }
        check_axes(op, &s, axes, "axis")?;
        let mut sorted = axes.to_vec();
        sorted.sort_unstable();
        let dims: Vec<u64> = (0..s.rank() as u64)
            .filter(|d| !sorted.contains(d))
            .map(|d| s.dims[d as usize])
            .collect();
        let out = TensorSpec::new(s.dtype, &dims);
        let init = self.reduce_init(s.dtype, max);
        let apply = if max { "maximum" } else { "add" };
        let (x, i) = (Self::name(a), Self::name(init));
        let (ti, ts, to) = (
            mlir_type(&s),
            mlir_type(&TensorSpec::new(s.dtype, &[])),
            mlir_type(&out),
        );
        let axes = list(&sorted);
        Ok(self.push(out, |r| {
            format!(
                "{r} = stablehlo.reduce({x} init: {i}) applies stablehlo.{apply} across dimensions = {axes} : ({ti}, {ts}) -> {to}"
            )
        }))
    }

    /// Sums `a` over `axes`, which are removed from the result (`f32[2,3,4]` over `[0, 2]` →
    /// `f32[3]`). `pred` sums are logical ors.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if an axis is out of range or repeated, or `a`
    /// is complex.
    pub fn reduce_sum(&mut self, a: Value, axes: &[u64]) -> Result<Value> {
        self.reduce("reduce_sum", a, axes, false)
    }

    /// Maximum of `a` over `axes`, which are removed from the result. Starts from `-inf` for
    /// floats (so an empty reduction gives `-inf`), the minimum for integers.
    ///
    /// Errors: as for [`Graph::reduce_sum`].
    pub fn reduce_max(&mut self, a: Value, axes: &[u64]) -> Result<Value> {
        self.reduce("reduce_max", a, axes, true)
    }

    /// Converts `a` element-wise to dtype `to` (`stablehlo.convert`: float → integer truncates
    /// toward zero; to `pred` is `x != 0`). Returns `a` itself if it already has dtype `to`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for a complex → real conversion.
    pub fn convert(&mut self, a: Value, to: Dtype) -> Result<Value> {
        const OP: &str = "convert";
        let s = self.operand(OP, a)?;
        if s.dtype == to {
            return Ok(a);
        }
        if is_complex(s.dtype) && !is_complex(to) {
            return Err(invalid(OP, format!("cannot convert complex {s} to {to}")));
        }
        let out = TensorSpec::new(to, &s.dims);
        let (x, ti, to) = (Self::name(a), mlir_type(&s), mlir_type(&out));
        Ok(self.push(out, |r| {
            format!("{r} = stablehlo.convert {x} : ({ti}) -> {to}")
        }))
    }

    /// Compares `a` and `b` element-wise with numpy broadcasting; the result is `pred`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the dtypes differ or the shapes do not
    /// broadcast, or for an ordering (`Lt`, `Le`, `Gt`, `Ge`) of complex values.
    pub fn compare(&mut self, a: Value, b: Value, dir: Compare) -> Result<Value> {
        const OP: &str = "compare";
        let sa = self.operand(OP, a)?;
        if is_complex(sa.dtype) && !matches!(dir, Compare::Eq | Compare::Ne) {
            let sb = self.operand(OP, b)?;
            return Err(invalid(
                OP,
                format!("complex values have no order ({sa} {} {sb})", dir.name()),
            ));
        }
        let (a, b) = self.broadcast_pair(OP, a, b)?;
        let s = self.operand(OP, a)?;
        let kind = if is_float(s.dtype) || is_complex(s.dtype) {
            "FLOAT"
        } else if is_signed_int(s.dtype) {
            "SIGNED"
        } else {
            "UNSIGNED"
        };
        let out = TensorSpec::new(Dtype::Pred, &s.dims);
        let (x, y, ti, to) = (Self::name(a), Self::name(b), mlir_type(&s), mlir_type(&out));
        let d = dir.name();
        Ok(self.push(out, |r| {
            format!("{r} = stablehlo.compare {d}, {x}, {y}, {kind} : ({ti}, {ti}) -> {to}")
        }))
    }

    /// Element-wise `pred ? on_true : on_false`, all three broadcast together with numpy
    /// rules.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `pred` is not `pred`, `on_true` and
    /// `on_false` have different dtypes, or the three shapes do not broadcast.
    pub fn select(&mut self, pred: Value, on_true: Value, on_false: Value) -> Result<Value> {
        const OP: &str = "select";
        let sp = self.operand(OP, pred)?;
        let st = self.operand(OP, on_true)?;
        let sf = self.operand(OP, on_false)?;
        if sp.dtype != Dtype::Pred {
            return Err(invalid(OP, format!("predicate must be pred, got {sp}")));
        }
        if st.dtype != sf.dtype {
            return Err(invalid(OP, format!("branch dtypes differ: {st} vs {sf}")));
        }
        let dims = broadcast_dims(&sp.dims, &st.dims)
            .and_then(|d| broadcast_dims(&d, &sf.dims))
            .ok_or_else(|| invalid(OP, format!("shapes do not broadcast: {sp}, {st}, {sf}")))?;
        let p = self.broadcast_unchecked(pred, &sp, &dims);
        let t = self.broadcast_unchecked(on_true, &st, &dims);
        let f = self.broadcast_unchecked(on_false, &sf, &dims);
        let out = TensorSpec::new(st.dtype, &dims);
        let tp = mlir_type(&TensorSpec::new(Dtype::Pred, &dims));
        let to = mlir_type(&out);
        let (p, t, f) = (Self::name(p), Self::name(t), Self::name(f));
        Ok(self.push(out, |r| {
            format!("{r} = stablehlo.select {p}, {t}, {f} : ({tp}, {to}, {to}) -> {to}")
        }))
    }

    /// A tensor of `dtype` and `dims` whose elements equal their index along `axis`
    /// (`iota(s32, [2, 3], 1)` = `[[0, 1, 2], [0, 1, 2]]`).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `axis` is not below the rank (so a scalar
    /// iota is an error) or `dtype` is `pred`.
    pub fn iota(&mut self, dtype: Dtype, dims: &[u64], axis: u64) -> Result<Value> {
        const OP: &str = "iota";
        let out = TensorSpec::new(dtype, dims);
        if axis >= dims.len() as u64 {
            return Err(invalid(
                OP,
                format!(
                    "axis {axis} is out of range for {out} (rank {})",
                    dims.len()
                ),
            ));
        }
        if dtype == Dtype::Pred {
            return Err(invalid(OP, format!("needs a numeric dtype, got {out}")));
        }
        let to = mlir_type(&out);
        Ok(self.push(out, |r| format!("{r} = stablehlo.iota dim = {axis} : {to}")))
    }

    /// Embedding lookup: rows of `table: [V, D...]` picked by integer `indices: [I...]`,
    /// giving `[I..., D...]` (`stablehlo.gather`). Out-of-range indices are clamped into
    /// `0..V` (gather semantics), not reported.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `table` is a scalar or `indices` is not an
    /// integer tensor.
    pub fn take(&mut self, table: Value, indices: Value) -> Result<Value> {
        const OP: &str = "take";
        let st = self.operand(OP, table)?;
        let si = self.operand(OP, indices)?;
        if st.rank() == 0 {
            return Err(invalid(OP, format!("table must have rank >= 1, got {st}")));
        }
        if !is_int(si.dtype) {
            return Err(invalid(
                OP,
                format!("indices must be integers, got {si} (table {st})"),
            ));
        }
        let ri = si.rank() as u64;
        let mut dims = si.dims.clone();
        dims.extend_from_slice(&st.dims[1..]);
        let out = TensorSpec::new(st.dtype, &dims);
        let offset_dims: Vec<u64> = (ri..ri + st.rank() as u64 - 1).collect();
        let mut slice_sizes = vec![1u64];
        slice_sizes.extend_from_slice(&st.dims[1..]);
        let (x, y) = (Self::name(table), Self::name(indices));
        let (tt, ti, to) = (mlir_type(&st), mlir_type(&si), mlir_type(&out));
        let (od, ss) = (list(&offset_dims), i64_array(&slice_sizes));
        Ok(self.push(out, |r| {
            format!(
                "{r} = \"stablehlo.gather\"({x}, {y}) {{dimension_numbers = #stablehlo.gather<offset_dims = {od}, collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = {ri}>, slice_sizes = {ss}, indices_are_sorted = false}} : ({tt}, {ti}) -> {to}"
            )
        }))
    }

    /// The elements of `a` from `start` (inclusive) to `limit` (exclusive) every `strides`
    /// along each dim; result dim `i` is `ceil((limit[i] - start[i]) / strides[i])`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if a list's length is not the rank, a start
    /// exceeds its limit, a limit exceeds the dim, or a stride is 0.
    pub fn slice(
        &mut self,
        a: Value,
        start: &[u64],
        limit: &[u64],
        strides: &[u64],
    ) -> Result<Value> {
        const OP: &str = "slice";
        let s = self.operand(OP, a)?;
        if start.len() != s.rank() || limit.len() != s.rank() || strides.len() != s.rank() {
            return Err(invalid(
                OP,
                format!(
                    "start {}, limit {} and strides {} need one entry per dim of {s}",
                    list(start),
                    list(limit),
                    list(strides)
                ),
            ));
        }
        let mut dims = Vec::with_capacity(s.rank());
        for i in 0..s.rank() {
            let (b, e, st, n) = (start[i], limit[i], strides[i], s.dims[i]);
            if st == 0 || b > e || e > n {
                return Err(invalid(
                    OP,
                    format!("bad range {b}:{e}:{st} for {s} dim {i} ({n})"),
                ));
            }
            dims.push((e - b).div_ceil(st));
        }
        let out = TensorSpec::new(s.dtype, &dims);
        let (x, ti, to) = (Self::name(a), mlir_type(&s), mlir_type(&out));
        let (b, e, st) = (i64_array(start), i64_array(limit), i64_array(strides));
        Ok(self.push(out, |r| {
            format!(
                "{r} = \"stablehlo.slice\"({x}) {{start_indices = {b}, limit_indices = {e}, strides = {st}}} : ({ti}) -> {to}"
            )
        }))
    }

    /// Joins `values` along `axis`; all must have the same dtype and rank, and equal dims
    /// except along `axis`. A single value is returned as is.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `values` is empty, `axis` is out of range,
    /// or the dtypes, ranks or other dims differ.
    pub fn concatenate(&mut self, values: &[Value], axis: u64) -> Result<Value> {
        const OP: &str = "concatenate";
        let specs = values
            .iter()
            .map(|&v| self.operand(OP, v))
            .collect::<Result<Vec<_>>>()?;
        let Some(first) = specs.first() else {
            return Err(invalid(OP, "needs at least one value"));
        };
        if axis >= first.rank() as u64 {
            return Err(invalid(
                OP,
                format!(
                    "axis {axis} is out of range for {first} (rank {})",
                    first.rank()
                ),
            ));
        }
        let ax = axis as usize;
        let mut dims = first.dims.clone();
        for s in &specs[1..] {
            let same_other = s.rank() == first.rank()
                && (0..s.rank()).all(|i| i == ax || s.dims[i] == first.dims[i]);
            if s.dtype != first.dtype || !same_other {
                return Err(invalid(
                    OP,
                    format!("{s} does not match {first} outside axis {axis}"),
                ));
            }
            dims[ax] += s.dims[ax];
        }
        if values.len() == 1 {
            return Ok(values[0]);
        }
        let out = TensorSpec::new(first.dtype, &dims);
        let names: Vec<String> = values.iter().map(|&v| Self::name(v)).collect();
        let types: Vec<String> = specs.iter().map(mlir_type).collect();
        let to = mlir_type(&out);
        let (names, types) = (names.join(", "), types.join(", "));
        Ok(self.push(out, |r| {
            format!("{r} = stablehlo.concatenate {names}, dim = {axis} : ({types}) -> {to}")
        }))
    }

    // -----------------------------------------------------------------------------------------
    // Helpers
    // -----------------------------------------------------------------------------------------

    /// Broadcasts `r`, the result of reducing `spec`-shaped data over `axis`, back to `spec`.
    fn unreduce(&mut self, r: Value, spec: &TensorSpec, axis: u64) -> Value {
        let bd: Vec<u64> = (0..spec.rank() as u64).filter(|&d| d != axis).collect();
        let rs = self.spec(r).clone();
        self.emit_broadcast_in_dim(r, &rs, &spec.dims, &bd)
    }

    fn check_float(&self, op: &str, v: Value) -> Result<TensorSpec> {
        let s = self.operand(op, v)?;
        if !is_float(s.dtype) {
            return Err(invalid(op, format!("needs a float operand, got {s}")));
        }
        Ok(s)
    }

    /// Softmax along `axis`: `exp(a - max(a)) / sum(exp(a - max(a)))`, with the max taken along
    /// `axis` (so large inputs do not overflow). The result has the spec of `a`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `a` is not a float or `axis` is out of range.
    pub fn softmax(&mut self, a: Value, axis: u64) -> Result<Value> {
        const OP: &str = "softmax";
        let s = self.check_float(OP, a)?;
        check_axes(OP, &s, &[axis], "axis")?;
        let m = self.reduce_max(a, &[axis])?;
        let m = self.unreduce(m, &s, axis);
        let d = self.sub(a, m)?;
        let e = self.exp(d)?;
        let sum = self.reduce_sum(e, &[axis])?;
        let sum = self.unreduce(sum, &s, axis);
        self.div(e, sum)
    }

    /// Layer normalisation over the last axis, as in BERT:
    /// `(x - mean) / sqrt(var + eps) * gamma + beta`, with the biased variance (mean of squared
    /// deviations). `x: [..., D]`, `gamma` and `beta: [D]`; the result has the spec of `x`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `x` is not a float of rank >= 1, or `gamma` /
    /// `beta` are not `[D]` of `x`'s dtype.
    pub fn layer_norm(&mut self, x: Value, gamma: Value, beta: Value, eps: f32) -> Result<Value> {
        const OP: &str = "layer_norm";
        let s = self.check_float(OP, x)?;
        let Some(&d) = s.dims.last() else {
            return Err(invalid(
                OP,
                format!("needs an operand of rank >= 1, got {s}"),
            ));
        };
        let want = TensorSpec::new(s.dtype, &[d]);
        for (what, v) in [("gamma", gamma), ("beta", beta)] {
            let sv = self.operand(OP, v)?;
            if sv != want {
                return Err(invalid(
                    OP,
                    format!("{what} must be {want} for x {s}, got {sv}"),
                ));
            }
        }
        let axis = s.rank() as u64 - 1;
        let inv_d = self.float_scalar(s.dtype, 1.0 / d as f64);
        let sum = self.reduce_sum(x, &[axis])?;
        let mean = self.mul(sum, inv_d)?;
        let mean = self.unreduce(mean, &s, axis);
        let xc = self.sub(x, mean)?;
        let sq = self.mul(xc, xc)?;
        let sq_sum = self.reduce_sum(sq, &[axis])?;
        let var = self.mul(sq_sum, inv_d)?;
        let eps = self.float_scalar(s.dtype, f64::from(eps));
        let var = self.add(var, eps)?;
        let inv = self.rsqrt(var)?;
        let inv = self.unreduce(inv, &s, axis);
        let y = self.mul(xc, inv)?;
        let y = self.mul(y, gamma)?;
        self.add(y, beta)
    }

    /// GELU in its exact erf form, `0.5 · x · (1 + erf(x / √2))` (BERT's and Hugging Face's
    /// `"gelu"`, not the tanh approximation). The result has the spec of `a`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `a` is not a float.
    pub fn gelu(&mut self, a: Value) -> Result<Value> {
        const OP: &str = "gelu";
        let s = self.check_float(OP, a)?;
        let r = self.float_scalar(s.dtype, std::f64::consts::FRAC_1_SQRT_2);
        let half = self.float_scalar(s.dtype, 0.5);
        let one = self.float_scalar(s.dtype, 1.0);
        let z = self.mul(a, r)?;
        let e = self.erf(z)?;
        let e = self.add(e, one)?;
        let h = self.mul(a, half)?;
        self.mul(h, e)
    }

    // -----------------------------------------------------------------------------------------
    // Output
    // -----------------------------------------------------------------------------------------

    /// The graph as MLIR text: `func.func public @main(<parameters>) -> (<outputs>)`, returning
    /// `outputs` in order (a value may be returned more than once, and parameters may be
    /// returned directly).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `outputs` is empty or holds a value of
    /// another graph.
    pub fn to_mlir(&self, outputs: &[Value]) -> Result<String> {
        const OP: &str = "to_mlir";
        if outputs.is_empty() {
            return Err(invalid(OP, "needs at least one output"));
        }
        let out_specs = outputs
            .iter()
            .map(|&v| self.operand(OP, v))
            .collect::<Result<Vec<_>>>()?;
        let mut s = String::from("func.func public @main(");
        for (i, &p) in self.params.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "%v{p}: {}", mlir_type(&self.nodes[p as usize].spec));
        }
        let out_types: Vec<String> = out_specs.iter().map(mlir_type).collect();
        let _ = writeln!(s, ") -> ({}) {{", out_types.join(", "));
        for node in &self.nodes {
            if let Some(body) = &node.body {
                for line in body.lines() {
                    let _ = writeln!(s, "  {line}");
                }
            }
        }
        let names: Vec<String> = outputs.iter().map(|&v| Self::name(v)).collect();
        let _ = writeln!(
            s,
            "  func.return {} : {}",
            names.join(", "),
            out_types.join(", ")
        );
        s.push_str("}\n");
        Ok(s)
    }

    /// Compiles the graph ([`Graph::to_mlir`], then [`compile_mlir`]) for device 0. The
    /// executable takes the [`Graph::parameter`]s in creation order and returns `outputs`.
    ///
    /// Errors: as for [`Graph::to_mlir`]; [`ErrorKind::CompileFailed`] with the compiler's
    /// diagnostics if the plugin rejects the program.
    pub fn compile(&self, outputs: &[Value]) -> Result<Executable> {
        compile_mlir(&self.to_mlir(outputs)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_msg<T: fmt::Debug>(r: Result<T>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        e.message().to_string()
    }

    #[track_caller]
    fn assert_msg<T: fmt::Debug>(r: Result<T>, parts: &[&str]) {
        let m = err_msg(r);
        for p in parts {
            assert!(m.contains(p), "message {m:?} lacks {p:?}");
        }
    }

    #[test]
    fn mlir_types() {
        assert_eq!(
            mlir_type(&TensorSpec::new(Dtype::F32, &[2, 3])),
            "tensor<2x3xf32>"
        );
        assert_eq!(mlir_type(&TensorSpec::new(Dtype::Pred, &[])), "tensor<i1>");
        assert_eq!(
            mlir_type(&TensorSpec::new(Dtype::U8, &[4])),
            "tensor<4xui8>"
        );
        assert_eq!(
            mlir_type(&TensorSpec::new(Dtype::C64, &[1])),
            "tensor<1xcomplex<f32>>"
        );
    }

    #[test]
    fn constants() {
        let mut g = Graph::new();
        let a = g.constant(&[1.0f32, 2.0], &[2]).unwrap();
        let b = g.scalar(-3i32);
        let c = g.constant(&[true, false, true, true], &[2, 2]).unwrap();
        let d = g.scalar(1.0f32);
        let e = g.constant(&[1i64, 2, 3, 4, 5, 6], &[3, 2]).unwrap();
        let f = g.constant::<f32>(&[], &[2, 0]).unwrap();
        let h = g.scalar(half::bf16::from_f32(1.0));
        assert_eq!(g.spec(a), &TensorSpec::new(Dtype::F32, &[2]));
        assert_eq!(g.dims(e), &[3, 2]);
        assert_eq!(g.dtype(c), Dtype::Pred);
        let m = g.to_mlir(&[a, b, c, d, e, f, h]).unwrap();
        assert!(
            m.contains(r#"stablehlo.constant dense<"0x0000803F00000040"> : tensor<2xf32>"#),
            "{m}"
        );
        assert!(
            m.contains("stablehlo.constant dense<-3> : tensor<i32>"),
            "{m}"
        );
        assert!(
            m.contains("dense<[[true, false], [true, true]]> : tensor<2x2xi1>"),
            "{m}"
        );
        assert!(m.contains("dense<0x3F800000> : tensor<f32>"), "{m}");
        assert!(m.contains("dense<[[], []]> : tensor<2x0xf32>"), "{m}");
        assert!(m.contains("dense<0x3F80> : tensor<bf16>"), "{m}");
        assert_msg(
            g.constant(&[1.0f32; 5], &[2, 3]),
            &["constant", "f32[2,3]", "5"],
        );
    }

    #[test]
    fn function_signature_and_return() {
        let mut g = Graph::new();
        let x = g.parameter(Dtype::F32, &[2, 3]);
        let y = g.parameter(Dtype::S32, &[]);
        assert_eq!(g.parameters(), vec![x, y]);
        let z = g.exp(x).unwrap();
        let m = g.to_mlir(&[z, y]).unwrap();
        assert!(
            m.starts_with(
                "func.func public @main(%v0: tensor<2x3xf32>, %v1: tensor<i32>) -> (tensor<2x3xf32>, tensor<i32>) {\n"
            ),
            "{m}"
        );
        assert!(
            m.contains("  %v2 = stablehlo.exponential %v0 : tensor<2x3xf32>\n"),
            "{m}"
        );
        assert!(
            m.ends_with("  func.return %v2, %v1 : tensor<2x3xf32>, tensor<i32>\n}\n"),
            "{m}"
        );
        assert_msg(g.to_mlir(&[]), &["to_mlir", "at least one output"]);
    }

    #[test]
    fn foreign_values_are_rejected() {
        let mut g1 = Graph::new();
        let mut g2 = Graph::new();
        let a = g1.parameter(Dtype::F32, &[2]);
        let b = g2.parameter(Dtype::F32, &[2]);
        assert_msg(
            g1.add(a, b),
            &["add", "belongs to another graph", "not this graph"],
        );
        assert_msg(g2.exp(a), &["exp", "belongs to another graph"]);
        assert_msg(g1.to_mlir(&[b]), &["to_mlir", "belongs to another graph"]);
        let r = std::panic::catch_unwind(|| g2.dims(a).len());
        assert!(r.is_err());
    }

    #[test]
    fn elementwise_broadcasting() {
        let mut g = Graph::new();
        let a = g.parameter(Dtype::F32, &[2, 1, 4]);
        let b = g.parameter(Dtype::F32, &[3, 1]);
        let c = g.add(a, b).unwrap();
        assert_eq!(g.dims(c), &[2, 3, 4]);
        let m = g.to_mlir(&[c]).unwrap();
        assert!(
            m.contains("stablehlo.broadcast_in_dim %v0, dims = [0, 1, 2] : (tensor<2x1x4xf32>) -> tensor<2x3x4xf32>"),
            "{m}"
        );
        assert!(
            m.contains("stablehlo.broadcast_in_dim %v1, dims = [1, 2] : (tensor<3x1xf32>) -> tensor<2x3x4xf32>"),
            "{m}"
        );
        assert!(
            m.contains("= stablehlo.add %v2, %v3 : tensor<2x3x4xf32>"),
            "{m}"
        );
        // Equal shapes insert nothing.
        let d = g.mul(c, c).unwrap();
        assert!(
            g.to_mlir(&[d])
                .unwrap()
                .contains("stablehlo.multiply %v4, %v4")
        );
        let s = g.scalar(2.0f32);
        let p = g.pow(c, s).unwrap();
        assert_eq!(g.dims(p), &[2, 3, 4]);
        for (name, r) in [
            ("sub", g.sub(a, b)),
            ("div", g.div(a, b)),
            ("max", g.max(a, b)),
            ("min", g.min(a, b)),
        ] {
            assert_eq!(g.dims(r.unwrap()), &[2, 3, 4], "{name}");
        }
    }

    #[test]
    fn elementwise_errors() {
        let mut g = Graph::new();
        let a = g.parameter(Dtype::F32, &[2, 3]);
        let b = g.parameter(Dtype::F32, &[4]);
        let i = g.parameter(Dtype::S32, &[2, 3]);
        let p = g.parameter(Dtype::Pred, &[2]);
        assert_msg(
            g.add(a, b),
            &["add: shapes do not broadcast: f32[2,3] vs f32[4]"],
        );
        assert_msg(g.mul(a, i), &["mul: dtypes differ: f32[2,3] vs s32[2,3]"]);
        assert_msg(
            g.sub(p, p),
            &["sub: needs numeric operands, got pred[2] and pred[2]"],
        );
        assert!(g.max(p, p).is_ok());
        assert_msg(g.exp(i), &["exp: needs a float operand, got s32[2,3]"]);
        assert_msg(g.erf(i), &["erf", "s32[2,3]"]);
        assert_msg(
            g.neg(p),
            &["neg: needs a float or signed integer operand, got pred[2]"],
        );
        assert!(g.neg(i).is_ok());
        assert!(g.abs(i).is_ok());
        for r in [
            g.log(a),
            g.tanh(a),
            g.sqrt(a),
            g.rsqrt(a),
            g.erf(a),
            g.logistic(a),
            g.abs(a),
            g.neg(a),
        ] {
            assert_eq!(g.dims(r.unwrap()), &[2, 3]);
        }
        let m = g.to_mlir(&[a]).unwrap();
        assert!(
            m.contains("chlo.erf %v0 : tensor<2x3xf32> -> tensor<2x3xf32>"),
            "{m}"
        );
        assert!(
            m.contains("stablehlo.logistic %v0 : tensor<2x3xf32>"),
            "{m}"
        );
    }

    #[test]
    fn dot_general_shapes_and_text() {
        let mut g = Graph::new();
        let a = g.parameter(Dtype::F32, &[2, 3, 4]);
        let b = g.parameter(Dtype::F32, &[2, 5, 4]);
        let c = g
            .dot_general(a, b, (&[0], &[0]), (&[2], &[2]), Precision::Highest)
            .unwrap();
        assert_eq!(g.dims(c), &[2, 3, 5]);
        let m = g.to_mlir(&[c]).unwrap();
        assert!(
            m.contains("stablehlo.dot_general %v0, %v1, batching_dims = [0] x [0], contracting_dims = [2] x [2], precision = [HIGHEST, HIGHEST] : (tensor<2x3x4xf32>, tensor<2x5x4xf32>) -> tensor<2x3x5xf32>"),
            "{m}"
        );
        let x = g.parameter(Dtype::F32, &[2, 3]);
        let y = g.parameter(Dtype::F32, &[4, 5]);
        assert_msg(
            g.dot_general(x, y, (&[], &[]), (&[1], &[0]), Precision::Default),
            &["dot_general: contracting dims differ: f32[2,3] dim 1 (3) vs f32[4,5] dim 0 (4)"],
        );
        assert_msg(
            g.dot_general(a, b, (&[0], &[1]), (&[2], &[2]), Precision::Default),
            &["dot_general: batch dims differ: f32[2,3,4] dim 0 (2) vs f32[2,5,4] dim 1 (5)"],
        );
        assert_msg(
            g.dot_general(x, y, (&[], &[]), (&[1], &[]), Precision::Default),
            &[
                "contracting dim lists differ in length",
                "f32[2,3] [1] vs f32[4,5] []",
            ],
        );
        assert_msg(
            g.dot_general(x, y, (&[], &[]), (&[2], &[0]), Precision::Default),
            &["dot_general", "2 is out of range for f32[2,3]"],
        );
        assert_msg(
            g.dot_general(a, b, (&[2], &[2]), (&[2], &[2]), Precision::Default),
            &["dot_general", "2 is repeated for f32[2,3,4]"],
        );
        let i = g.parameter(Dtype::S32, &[4, 5]);
        assert_msg(
            g.dot_general(x, i, (&[], &[]), (&[1], &[0]), Precision::Default),
            &["dot_general: dtypes differ: f32[2,3] vs s32[4,5]"],
        );
        // No batching attribute when there are no batch dims; DEFAULT precision.
        let z = g.parameter(Dtype::F32, &[3, 7]);
        let w = g
            .dot_general(x, z, (&[], &[]), (&[1], &[0]), Precision::High)
            .unwrap();
        assert_eq!(g.dims(w), &[2, 7]);
        let m = g.to_mlir(&[w]).unwrap();
        assert!(
            m.contains("%v3, %v6, contracting_dims = [1] x [0], precision = [HIGH, HIGH]"),
            "{m}"
        );
    }

    #[test]
    fn matmul_forms() {
        let mut g = Graph::new();
        let a = g.parameter(Dtype::F32, &[2, 3, 4]);
        let w = g.parameter(Dtype::F32, &[4, 5]);
        let b = g.parameter(Dtype::F32, &[2, 4, 6]);
        let c = g.matmul(a, w, Precision::Default).unwrap();
        assert_eq!(g.dims(c), &[2, 3, 5]);
        let d = g.matmul(a, b, Precision::Default).unwrap();
        assert_eq!(g.dims(d), &[2, 3, 6]);
        let m = g.to_mlir(&[c, d]).unwrap();
        assert!(m.contains("%v0, %v1, contracting_dims = [2] x [0]"), "{m}");
        assert!(
            m.contains("%v0, %v2, batching_dims = [0, 1] x [0, 1]")
                || m.contains("%v0, %v2, batching_dims = [0] x [0], contracting_dims = [2] x [1]"),
            "{m}"
        );
        let v = g.parameter(Dtype::F32, &[4]);
        assert_msg(
            g.matmul(a, v, Precision::Default),
            &["matmul: needs operands of rank >= 2, got f32[2,3,4] and f32[4]"],
        );
        let bad = g.parameter(Dtype::F32, &[5, 6]);
        assert_msg(
            g.matmul(a, bad, Precision::Default),
            &["matmul: contracting dims differ: f32[2,3,4] dim 2 (4) vs f32[5,6] dim 0 (5)"],
        );
        let b3 = g.parameter(Dtype::F32, &[3, 4, 6]);
        assert_msg(
            g.matmul(a, b3, Precision::Default),
            &["matmul: batch dims differ: f32[2,3,4] vs f32[3,4,6]"],
        );
    }

    #[test]
    fn shape_ops() {
        let mut g = Graph::new();
        let a = g.parameter(Dtype::F32, &[3, 1]);
        let b = g.broadcast_in_dim(a, &[2, 3, 4], &[1, 2]).unwrap();
        assert_eq!(g.dims(b), &[2, 3, 4]);
        assert_msg(
            g.broadcast_in_dim(a, &[2, 4, 4], &[1, 2]),
            &["broadcast_in_dim: f32[3,1] dim 0 (3) cannot broadcast to f32[2,4,4] dim 1 (4)"],
        );
        assert_msg(
            g.broadcast_in_dim(a, &[2, 3], &[1]),
            &["broadcast_in_dim", "one entry per dim of f32[3,1]"],
        );
        assert_msg(
            g.broadcast_in_dim(a, &[3, 3], &[0, 2]),
            &["broadcast_in_dim", "2 is out of range for f32[3,3]"],
        );
        assert_msg(
            g.broadcast_in_dim(a, &[3, 3], &[0, 0]),
            &["broadcast_in_dim", "0 is repeated"],
        );

        let c = g.broadcast_to(a, &[2, 3, 5]).unwrap();
        assert_eq!(g.dims(c), &[2, 3, 5]);
        assert_eq!(g.broadcast_to(a, &[3, 1]).unwrap(), a);
        assert_msg(
            g.broadcast_to(a, &[2, 5]),
            &["broadcast_to: f32[3,1] does not broadcast to f32[2,5]"],
        );
        assert_msg(
            g.broadcast_to(a, &[3]),
            &["broadcast_to: f32[3,1] does not broadcast to f32[3]"],
        );

        let r = g.reshape(c, &[6, 5]).unwrap();
        assert_eq!(g.dims(r), &[6, 5]);
        assert_msg(
            g.reshape(c, &[7, 5]),
            &["reshape: element counts differ: f32[2,3,5] vs f32[7,5]"],
        );

        let t = g.transpose(c, &[2, 0, 1]).unwrap();
        assert_eq!(g.dims(t), &[5, 2, 3]);
        let m = g.to_mlir(&[t]).unwrap();
        assert!(m.contains("stablehlo.transpose %v2, dims = [2, 0, 1] : (tensor<2x3x5xf32>) -> tensor<5x2x3xf32>"), "{m}");
        assert_msg(
            g.transpose(c, &[0, 1]),
            &["transpose: permutation [0, 1] is not a permutation of the dims of f32[2,3,5]"],
        );
        assert_msg(
            g.transpose(c, &[0, 1, 1]),
            &["transpose", "1 is repeated for f32[2,3,5]"],
        );
        assert_msg(
            g.transpose(c, &[0, 1, 3]),
            &["transpose", "3 is out of range for f32[2,3,5]"],
        );
    }

    #[test]
    fn reductions() {
        let mut g = Graph::new();
        let a = g.parameter(Dtype::F32, &[2, 3, 4]);
        let s = g.reduce_sum(a, &[2, 0]).unwrap();
        assert_eq!(g.spec(s), &TensorSpec::new(Dtype::F32, &[3]));
        let m = g.reduce_max(a, &[1]).unwrap();
        assert_eq!(g.dims(m), &[2, 4]);
        let i = g.parameter(Dtype::S32, &[5]);
        let im = g.reduce_max(i, &[0]).unwrap();
        assert_eq!(g.dims(im), &[] as &[u64]);
        let text = g.to_mlir(&[s, m, im]).unwrap();
        assert!(text.contains("stablehlo.reduce(%v1 init: %v2) applies stablehlo.add across dimensions = [0, 2] : (tensor<2x3x4xf32>, tensor<f32>) -> tensor<3xf32>") || text.contains("stablehlo.reduce(%v0 init: %v1) applies stablehlo.add across dimensions = [0, 2] : (tensor<2x3x4xf32>, tensor<f32>) -> tensor<3xf32>"), "{text}");
        assert!(
            text.contains("stablehlo.constant dense<0xFF800000> : tensor<f32>"),
            "{text}"
        );
        assert!(
            text.contains("stablehlo.constant dense<-2147483648> : tensor<i32>"),
            "{text}"
        );
        assert!(
            text.contains("applies stablehlo.maximum across dimensions = [1]"),
            "{text}"
        );
        assert_msg(
            g.reduce_sum(a, &[3]),
            &["reduce_sum: axis 3 is out of range for f32[2,3,4] (rank 3)"],
        );
        assert_msg(
            g.reduce_max(a, &[1, 1]),
            &["reduce_max: axis 1 is repeated for f32[2,3,4]"],
        );
    }

    #[test]
    fn convert_compare_select_iota() {
        let mut g = Graph::new();
        let a = g.parameter(Dtype::F32, &[2, 3]);
        let b = g.parameter(Dtype::F32, &[3]);
        let i = g.convert(a, Dtype::S32).unwrap();
        assert_eq!(g.spec(i), &TensorSpec::new(Dtype::S32, &[2, 3]));
        assert_eq!(g.convert(a, Dtype::F32).unwrap(), a);
        let c = g.parameter(Dtype::C64, &[2]);
        assert_msg(
            g.convert(c, Dtype::F32),
            &["convert: cannot convert complex c64[2] to f32"],
        );

        let p = g.compare(a, b, Compare::Gt).unwrap();
        assert_eq!(g.spec(p), &TensorSpec::new(Dtype::Pred, &[2, 3]));
        let q = g.compare(i, i, Compare::Le).unwrap();
        let text = g.to_mlir(&[p, q]).unwrap();
        assert!(text.contains("stablehlo.compare GT, %v0, %v4, FLOAT : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xi1>"), "{text}");
        assert!(
            text.contains("stablehlo.compare LE, %v2, %v2, SIGNED"),
            "{text}"
        );
        assert_msg(
            g.compare(a, i, Compare::Eq),
            &["compare: dtypes differ: f32[2,3] vs s32[2,3]"],
        );
        assert_msg(
            g.compare(c, c, Compare::Lt),
            &["compare: complex values have no order (c64[2] LT c64[2])"],
        );

        let zero = g.scalar(0.0f32);
        let s = g.select(p, a, zero).unwrap();
        assert_eq!(g.spec(s), &TensorSpec::new(Dtype::F32, &[2, 3]));
        assert_msg(
            g.select(a, a, a),
            &["select: predicate must be pred, got f32[2,3]"],
        );
        assert_msg(
            g.select(p, a, i),
            &["select: branch dtypes differ: f32[2,3] vs s32[2,3]"],
        );
        let four = g.parameter(Dtype::F32, &[4]);
        assert_msg(
            g.select(p, a, four),
            &["select: shapes do not broadcast: pred[2,3], f32[2,3], f32[4]"],
        );

        let io = g.iota(Dtype::S32, &[2, 3], 1).unwrap();
        assert_eq!(g.spec(io), &TensorSpec::new(Dtype::S32, &[2, 3]));
        assert!(
            g.to_mlir(&[io])
                .unwrap()
                .contains("stablehlo.iota dim = 1 : tensor<2x3xi32>")
        );
        assert_msg(
            g.iota(Dtype::S32, &[2, 3], 2),
            &["iota: axis 2 is out of range for s32[2,3] (rank 2)"],
        );
        assert_msg(
            g.iota(Dtype::Pred, &[2], 0),
            &["iota: needs a numeric dtype, got pred[2]"],
        );
    }

    #[test]
    fn take_slice_concatenate() {
        let mut g = Graph::new();
        let table = g.parameter(Dtype::F32, &[30522, 384]);
        let idx = g.parameter(Dtype::S32, &[2, 8]);
        let e = g.take(table, idx).unwrap();
        assert_eq!(g.dims(e), &[2, 8, 384]);
        let text = g.to_mlir(&[e]).unwrap();
        assert!(text.contains(r#"%v2 = "stablehlo.gather"(%v0, %v1) {dimension_numbers = #stablehlo.gather<offset_dims = [2], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 2>, slice_sizes = array<i64: 1, 384>, indices_are_sorted = false} : (tensor<30522x384xf32>, tensor<2x8xi32>) -> tensor<2x8x384xf32>"#), "{text}");
        let fidx = g.parameter(Dtype::F32, &[2]);
        assert_msg(
            g.take(table, fidx),
            &["take: indices must be integers, got f32[2] (table f32[30522,384])"],
        );
        let s = g.scalar(1.0f32);
        assert_msg(
            g.take(s, idx),
            &["take: table must have rank >= 1, got f32[]"],
        );

        let a = g.parameter(Dtype::F32, &[4, 6]);
        let sl = g.slice(a, &[1, 0], &[3, 6], &[1, 4]).unwrap();
        assert_eq!(g.dims(sl), &[2, 2]);
        let text = g.to_mlir(&[sl]).unwrap();
        assert!(text.contains(r#""stablehlo.slice"(%v5) {start_indices = array<i64: 1, 0>, limit_indices = array<i64: 3, 6>, strides = array<i64: 1, 4>} : (tensor<4x6xf32>) -> tensor<2x2xf32>"#), "{text}");
        assert_msg(
            g.slice(a, &[0, 0], &[5, 6], &[1, 1]),
            &["slice: bad range 0:5:1 for f32[4,6] dim 0 (4)"],
        );
        assert_msg(
            g.slice(a, &[0, 0], &[4, 6], &[1, 0]),
            &["slice: bad range 0:6:0 for f32[4,6] dim 1 (6)"],
        );
        assert_msg(
            g.slice(a, &[0], &[4], &[1]),
            &["slice", "need one entry per dim of f32[4,6]"],
        );

        let b = g.parameter(Dtype::F32, &[4, 2]);
        let c = g.concatenate(&[a, b, a], 1).unwrap();
        assert_eq!(g.dims(c), &[4, 14]);
        let text = g.to_mlir(&[c]).unwrap();
        assert!(text.contains("stablehlo.concatenate %v5, %v7, %v5, dim = 1 : (tensor<4x6xf32>, tensor<4x2xf32>, tensor<4x6xf32>) -> tensor<4x14xf32>"), "{text}");
        assert_msg(
            g.concatenate(&[a, b], 0),
            &["concatenate: f32[4,2] does not match f32[4,6] outside axis 0"],
        );
        assert_msg(
            g.concatenate(&[a], 2),
            &["concatenate: axis 2 is out of range for f32[4,6] (rank 2)"],
        );
        assert_msg(
            g.concatenate(&[], 0),
            &["concatenate: needs at least one value"],
        );
        assert_eq!(g.concatenate(&[a], 0).unwrap(), a);
    }

    #[test]
    fn helpers() {
        let mut g = Graph::new();
        let x = g.parameter(Dtype::F32, &[2, 8, 16]);
        let gamma = g.parameter(Dtype::F32, &[16]);
        let beta = g.parameter(Dtype::F32, &[16]);
        let s = g.softmax(x, 1).unwrap();
        assert_eq!(g.spec(s), g.spec(x));
        let n = g.layer_norm(x, gamma, beta, 1e-12).unwrap();
        assert_eq!(g.spec(n), g.spec(x));
        let h = g.gelu(x).unwrap();
        assert_eq!(g.spec(h), g.spec(x));
        let text = g.to_mlir(&[s, n, h]).unwrap();
        assert!(text.contains("chlo.erf"), "{text}");
        assert_msg(
            g.softmax(x, 3),
            &["softmax: axis 3 is out of range for f32[2,8,16]"],
        );
        let i = g.parameter(Dtype::S32, &[4]);
        assert_msg(
            g.softmax(i, 0),
            &["softmax: needs a float operand, got s32[4]"],
        );
        assert_msg(g.gelu(i), &["gelu: needs a float operand, got s32[4]"]);
        let bad = g.parameter(Dtype::F32, &[8]);
        assert_msg(
            g.layer_norm(x, bad, beta, 1e-5),
            &["layer_norm: gamma must be f32[16] for x f32[2,8,16], got f32[8]"],
        );
        assert_msg(
            g.layer_norm(x, gamma, i, 1e-5),
            &["layer_norm: beta must be f32[16] for x f32[2,8,16], got s32[4]"],
        );
        // bf16 graphs get bf16 constants.
        let xb = g.parameter(Dtype::Bf16, &[4]);
        let gb = g.gelu(xb).unwrap();
        assert_eq!(g.dtype(gb), Dtype::Bf16);
    }

    #[test]
    fn failed_ops_add_nothing() {
        let mut g = Graph::new();
        let a = g.parameter(Dtype::F32, &[2]);
        let b = g.parameter(Dtype::F32, &[3]);
        let before = g.to_mlir(&[a]).unwrap();
        assert!(g.add(a, b).is_err());
        assert!(g.layer_norm(a, b, b, 1e-5).is_err());
        assert_eq!(g.to_mlir(&[a]).unwrap(), before);
    }
}
