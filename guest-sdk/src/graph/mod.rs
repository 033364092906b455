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
//! Ops take `&self` (the graph keeps its nodes behind a `RefCell`, as XLA's `XlaBuilder` keeps
//! its state), so expressions nest: `g.add(g.matmul(x, w, Precision::Highest)?, b)?`.
//!
//! ```no_run
//! use tpubox_guest::{Dtype, Tensor};
//! use tpubox_guest::graph::{Graph, Precision};
//!
//! let g = Graph::new();
//! let x = g.parameter(Dtype::F32, &[2, 3]);
//! let w = g.parameter(Dtype::F32, &[3, 4]);
//! let b = g.parameter(Dtype::F32, &[4]);
//! let y = g.add(g.matmul(x, w, Precision::Highest)?, b)?; // b broadcasts over the rows
//! let y = g.gelu(y)?;
//! assert_eq!(g.dims(y), [2, 4]);
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

// The builder's methods are spread over the submodules by job: `ops` (the op methods), `nn`
// (the helpers built from ops), `shape` (the checks and shape inference the ops run first) and
// `mlir` (printing the graph as MLIR text). This file holds the graph's state.

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::{Dtype, Error, ErrorKind, Executable, Result, TensorSpec, compile_mlir};

mod mlir;
mod nn;
mod ops;
mod shape;
#[cfg(test)]
mod tests;

pub use mlir::{mlir_element_type, mlir_type};
pub use nn::SEGMENT_ATTENTION;
pub(crate) use shape::is_float;

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

/// The `dimension_numbers` of [`Graph::dot_general`], as in `jax.lax.dot_general`:
/// `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`, each a list of dims of one
/// operand; the two lists of a pair have equal lengths and pair dims of equal sizes.
///
/// For example `((&[1], &[0]), (&[], &[]))` is a plain matrix product of `[m, k]` and `[k, n]`.
pub type DotDimensionNumbers<'a> = ((&'a [u64], &'a [u64]), (&'a [u64], &'a [u64]));

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

/// An element-wise binary op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
    Pow,
}

impl Binary {
    /// The builder method, as error messages name it.
    const fn name(self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
            Binary::Maximum => "maximum",
            Binary::Minimum => "minimum",
            Binary::Pow => "pow",
        }
    }

    /// The StableHLO op.
    const fn mlir(self) -> &'static str {
        match self {
            Binary::Add => "stablehlo.add",
            Binary::Sub => "stablehlo.subtract",
            Binary::Mul => "stablehlo.multiply",
            Binary::Div => "stablehlo.divide",
            Binary::Maximum => "stablehlo.maximum",
            Binary::Minimum => "stablehlo.minimum",
            Binary::Pow => "stablehlo.power",
        }
    }

    /// Whether `pred` operands are accepted (maximum and minimum are logical or and and).
    const fn accepts_pred(self) -> bool {
        matches!(self, Binary::Maximum | Binary::Minimum)
    }
}

/// An element-wise unary op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Unary {
    Neg,
    Abs,
    Exp,
    Log,
    Tanh,
    Sqrt,
    Rsqrt,
    Erf,
    Logistic,
}

impl Unary {
    /// The builder method, as error messages name it.
    const fn name(self) -> &'static str {
        match self {
            Unary::Neg => "neg",
            Unary::Abs => "abs",
            Unary::Exp => "exp",
            Unary::Log => "log",
            Unary::Tanh => "tanh",
            Unary::Sqrt => "sqrt",
            Unary::Rsqrt => "rsqrt",
            Unary::Erf => "erf",
            Unary::Logistic => "logistic",
        }
    }

    /// The StableHLO (or CHLO) op.
    const fn mlir(self) -> &'static str {
        match self {
            Unary::Neg => "stablehlo.negate",
            Unary::Abs => "stablehlo.abs",
            Unary::Exp => "stablehlo.exponential",
            Unary::Log => "stablehlo.log",
            Unary::Tanh => "stablehlo.tanh",
            Unary::Sqrt => "stablehlo.sqrt",
            Unary::Rsqrt => "stablehlo.rsqrt",
            Unary::Erf => "chlo.erf",
            Unary::Logistic => "stablehlo.logistic",
        }
    }

    /// Whether signed integer operands are accepted besides floats.
    const fn accepts_signed_ints(self) -> bool {
        matches!(self, Unary::Neg | Unary::Abs)
    }
}

/// A reduction over some axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Reduction {
    Sum,
    Max,
}

impl Reduction {
    /// The builder method, as error messages name it.
    const fn name(self) -> &'static str {
        match self {
            Reduction::Sum => "reduce_sum",
            Reduction::Max => "reduce_max",
        }
    }

    /// The binary op that combines two elements.
    const fn body(self) -> Binary {
        match self {
            Reduction::Sum => Binary::Add,
            Reduction::Max => Binary::Maximum,
        }
    }
}

/// What defines a node: the op and its attributes (operands are [`Node::operands`]).
#[derive(Clone, PartialEq, Eq, Hash)]
enum Op {
    /// A parameter of `@main`; no operands.
    Parameter,
    /// `stablehlo.constant` holding these bytes (host layout); no operands.
    Constant(Vec<u8>),
    Unary(Unary),
    Binary(Binary),
    /// `broadcast_dimensions`.
    BroadcastInDim(Vec<u64>),
    DotGeneral {
        contracting: (Vec<u64>, Vec<u64>),
        batch: (Vec<u64>, Vec<u64>),
        precision: Precision,
    },
    Reshape,
    /// The permutation.
    Transpose(Vec<u64>),
    /// Operands: the value, then the scalar init value. `axes` are sorted.
    Reduce {
        reduction: Reduction,
        axes: Vec<u64>,
    },
    Convert,
    Compare(Compare),
    /// Operands: predicate, on-true, on-false (already broadcast to one shape).
    Select,
    /// The iota dimension; no operands.
    Iota(u64),
    /// Row gather: operands table, indices.
    Take,
    Slice {
        start: Vec<u64>,
        limit: Vec<u64>,
        strides: Vec<u64>,
    },
    /// Operands: the value, then one scalar start index per dim. The slice sizes.
    DynamicSlice(Vec<u64>),
    /// The concatenation axis.
    Concatenate(u64),
    /// `stablehlo.custom_call` of this target through the typed XLA FFI (`api_version = 4`),
    /// one result.
    CustomCall(&'static str),
}

/// One value of the graph: its spec, the op that defines it and the op's operands (indices of
/// earlier nodes).
#[derive(Clone, PartialEq, Eq, Hash)]
struct Node {
    spec: TensorSpec,
    op: Op,
    operands: Vec<u32>,
}

/// Everything [`Graph::to_mlir`] prints a function from: the nodes, the parameters and the
/// outputs. Two graphs with equal structures print byte-identical text, so a structure can key
/// a cache of executables without printing the text ([`Graph::structure_hash`],
/// [`Graph::has_structure`]).
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct Structure {
    nodes: Vec<Node>,
    params: Vec<u32>,
    outputs: Vec<u32>,
}

/// The mutable part of a [`Graph`].
#[derive(Default)]
struct Nodes {
    nodes: Vec<Node>,
    /// Indices of the parameter nodes, in order.
    params: Vec<u32>,
}

/// Builder of one StableHLO function `@main`; emits MLIR text the plugin compiles.
///
/// Create values with [`Graph::parameter`], [`Graph::constant`] and the ops, then call
/// [`Graph::compile`] with the values to return. The graph keeps every value it made, in
/// creation order (which is always a valid definition order); values that do not reach an
/// output are emitted too and left to the compiler's dead-code elimination.
///
/// Every op takes `&self`, so ops nest (`g.exp(g.neg(x)?)?`), and checks its operands when
/// called: it fails with [`ErrorKind::InvalidArgument`], naming the op and the operand specs. A
/// failed op adds nothing to the graph. A `Graph` can be sent to another thread but not shared
/// between threads (it is not `Sync`).
pub struct Graph {
    id: u32,
    state: RefCell<Nodes>,
}

// A panic never leaves a graph half-updated (nodes are only appended, after all checks), so
// it stays usable after `catch_unwind`, as a graph of plain vectors would.
impl std::panic::UnwindSafe for Graph {}
impl std::panic::RefUnwindSafe for Graph {}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.borrow();
        f.debug_struct("Graph")
            .field("id", &self.id)
            .field("values", &state.nodes.len())
            .field("parameters", &state.params.len())
            .finish()
    }
}

impl Default for Graph {
    fn default() -> Self {
        Graph::new()
    }
}

/// An [`ErrorKind::InvalidArgument`] error `"{op}: {msg}"`.
fn invalid(op: &str, msg: impl fmt::Display) -> Error {
    Error::new(ErrorKind::InvalidArgument, format!("{op}: {msg}"))
}

impl Graph {
    /// An empty graph (no parameters, no values).
    pub fn new() -> Graph {
        Graph {
            id: NEXT_GRAPH_ID.fetch_add(1, Ordering::Relaxed),
            state: RefCell::default(),
        }
    }

    /// The dtype and dims of `v`.
    ///
    /// Panics if `v` comes from another graph.
    pub fn spec(&self, v: Value) -> TensorSpec {
        self.node_spec(v)
            .unwrap_or_else(|e| panic!("{}", e.message()))
    }

    /// The dims of `v` (empty for a scalar). Panics if `v` comes from another graph.
    pub fn dims(&self, v: Value) -> Vec<u64> {
        self.spec(v).dims
    }

    /// The dtype of `v`. Panics if `v` comes from another graph.
    pub fn dtype(&self, v: Value) -> Dtype {
        self.spec(v).dtype
    }

    /// The parameters of `@main`, in order.
    pub fn parameters(&self) -> Vec<Value> {
        let state = self.state.borrow();
        state
            .params
            .iter()
            .map(|&index| self.value(index))
            .collect()
    }

    /// Adds a parameter of `@main` of `dtype` and `dims`. Parameters are numbered in creation
    /// order: the compiled executable takes its arguments in that order.
    pub fn parameter(&self, dtype: Dtype, dims: &[u64]) -> Value {
        let v = self.push(TensorSpec::new(dtype, dims), Op::Parameter, &[]);
        self.state.borrow_mut().params.push(v.index);
        v
    }

    /// The graph as MLIR text: `func.func public @main(<parameters>) -> (<outputs>)`, returning
    /// `outputs` in order (a value may be returned more than once, and parameters may be
    /// returned directly).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `outputs` is empty or holds a value of
    /// another graph.
    pub fn to_mlir(&self, outputs: &[Value]) -> Result<String> {
        let outputs = self.output_indices("to_mlir", outputs)?;
        let state = self.state.borrow();
        Ok(mlir::function(&state.nodes, &state.params, &outputs))
    }

    /// The indices of `outputs`, checked to be values of this graph (`op` names the caller in
    /// the error).
    fn output_indices(&self, op: &str, outputs: &[Value]) -> Result<Vec<u32>> {
        if outputs.is_empty() {
            return Err(invalid(op, "needs at least one output"));
        }
        outputs
            .iter()
            .map(|&v| self.operand(op, v).map(|_| v.index))
            .collect()
    }

    /// A hash of the function [`Graph::to_mlir`] would print for `outputs`, computed from the
    /// graph's structure without printing it: equal for graphs that print equal text. A hit
    /// must be confirmed with [`Graph::has_structure`].
    ///
    /// Errors: as for [`Graph::to_mlir`].
    pub(crate) fn structure_hash(&self, outputs: &[Value]) -> Result<u64> {
        use std::hash::{Hash, Hasher};
        let outputs = self.output_indices("structure_hash", outputs)?;
        let state = self.state.borrow();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        state.nodes.hash(&mut h);
        state.params.hash(&mut h);
        outputs.hash(&mut h);
        Ok(h.finish())
    }

    /// Whether the function for `outputs` is the one `s` was taken from
    /// ([`Graph::structure`]); `false` for outputs of another graph.
    pub(crate) fn has_structure(&self, outputs: &[Value], s: &Structure) -> bool {
        let state = self.state.borrow();
        state.nodes == s.nodes
            && state.params == s.params
            && outputs.len() == s.outputs.len()
            && outputs
                .iter()
                .zip(&s.outputs)
                .all(|(v, &i)| v.graph == self.id && v.index == i)
    }

    /// A copy of the structure of the function for `outputs`.
    ///
    /// Errors: as for [`Graph::to_mlir`].
    pub(crate) fn structure(&self, outputs: &[Value]) -> Result<Structure> {
        let outputs = self.output_indices("structure", outputs)?;
        let state = self.state.borrow();
        Ok(Structure {
            nodes: state.nodes.clone(),
            params: state.params.clone(),
            outputs,
        })
    }

    /// Compiles the graph ([`Graph::to_mlir`], then [`compile_mlir`]) for device 0. The
    /// executable takes the [`Graph::parameter`]s in creation order and returns `outputs`.
    ///
    /// Errors: as for [`Graph::to_mlir`]; [`ErrorKind::CompileFailed`] with the compiler's
    /// diagnostics if the plugin rejects the program.
    pub fn compile(&self, outputs: &[Value]) -> Result<Executable> {
        compile_mlir(&self.to_mlir(outputs)?)
    }

    fn value(&self, index: u32) -> Value {
        Value {
            graph: self.id,
            index,
        }
    }

    /// The spec of `v`, or an error if `v` is not a value of this graph.
    fn node_spec(&self, v: Value) -> Result<TensorSpec> {
        if v.graph != self.id {
            return Err(Error::invalid_argument(format!(
                "value %v{} belongs to another graph (#{}, not this graph #{})",
                v.index, v.graph, self.id
            )));
        }
        let state = self.state.borrow();
        state
            .nodes
            .get(v.index as usize)
            .map(|n| n.spec.clone())
            .ok_or_else(|| Error::invalid_argument(format!("value %v{} is unknown", v.index)))
    }

    /// The spec of operand `v` of `op` (an error names the op if `v` is foreign).
    fn operand(&self, op: &str, v: Value) -> Result<TensorSpec> {
        self.node_spec(v).map_err(|e| invalid(op, e.message()))
    }

    /// Adds a node of `spec` defined by `op` on `operands` (values of this graph, checked by
    /// the caller) and returns its value.
    fn push(&self, spec: TensorSpec, op: Op, operands: &[Value]) -> Value {
        let mut state = self.state.borrow_mut();
        let index = u32::try_from(state.nodes.len()).expect("fewer than 2^32 values");
        state.nodes.push(Node {
            spec,
            op,
            operands: operands.iter().map(|v| v.index).collect(),
        });
        self.value(index)
    }
}
