//! [`Array`]: an eager array, its states, and how one op runs in each mode.

use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;

use super::bounded::Dynamic;
use super::mode::{EagerMode, debug_checks, eager_mode};
use super::{checks, fuse, program};
use crate::graph::{Compare, Graph, Precision, Value};
use crate::{Dtype, Element, Error, ErrorKind, Result, Tensor, TensorSpec};

/// A dense array whose ops run eagerly on the host's device, in the current
/// [`EagerMode`](super::EagerMode): `x.matmul(&w)?.add(&b)?.gelu()?`.
///
/// An `Array` is a cheap handle (cloning shares the value; arrays are immutable). Its dtype and
/// dims are known at once ([`Array::spec`]); its value lives on the device and is read with
/// [`Array::to_vec`]. Depending on the mode the value may still be computing (a launch not
/// yet finished) or not yet launched (an op recorded in a fused trace); a read waits for it,
/// running the trace if needed.
///
/// Every op checks its operands' shapes and dtypes when called, as [`Graph`]'s ops do (same
/// rules: numpy broadcasting for element-wise ops, no implicit dtype promotion), and fails with
/// [`ErrorKind::InvalidArgument`] naming the op. Errors of the device come back as the host
/// reports them (e.g. [`ErrorKind::ExecutionFailed`]), their message prefixed with the eager op
/// that made the array read (`eager exp: launch 12 of program ... failed: ...`).
///
/// Arrays are tied to the thread that made them (they are neither `Send` nor `Sync`).
#[derive(Clone)]
pub struct Array {
    pub(super) node: Rc<Node>,
}

/// The shared state behind the handles of one array.
pub(super) struct Node {
    pub(super) spec: TensorSpec,
    /// The op that made the array (`from_slice` for uploads).
    pub(super) op: Cow<'static, str>,
    pub(super) state: RefCell<State>,
    /// The dynamic axis, for a bounded array ([`Array::from_slice_bounded`]).
    pub(super) dynamic: RefCell<Option<Dynamic>>,
}

/// Where an array's value is.
pub(super) enum State {
    /// On the device (possibly still being computed by a launch).
    Ready(Ready),
    /// An op recorded in fused trace `trace`, as its value `value`.
    Pending { trace: u64, value: Value },
    /// The fused step that should have computed it failed with this error.
    Failed(Error),
}

/// An array's device tensor and where it came from.
#[derive(Clone)]
pub(super) struct Ready {
    pub(super) tensor: Rc<Tensor>,
    /// Whether the SDK made the tensor (an upload or an op's output), so that donating it once
    /// no array holds it is safe; tensors given by the caller ([`Array::from_tensor`]) are
    /// never donated.
    pub(super) donatable: bool,
    /// The launch that computes it, if any.
    pub(super) launch: Option<u64>,
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &*self.node.state.borrow() {
            State::Ready(r) => match r.launch {
                Some(id) => format!("launch {id}"),
                None => "ready".to_string(),
            },
            State::Pending { trace, .. } => format!("pending in trace {trace}"),
            State::Failed(_) => "failed".to_string(),
        };
        write!(
            f,
            "Array({} from {}, {state})",
            self.node.spec, self.node.op
        )
    }
}

/// `error` with its message prefixed by the eager op it concerns.
pub(super) fn named(op: &str, error: Error) -> Error {
    Error::new(error.kind(), format!("eager {op}: {}", error.message()))
}

impl Array {
    pub(super) fn with_state(
        spec: TensorSpec,
        op: impl Into<Cow<'static, str>>,
        state: State,
    ) -> Array {
        Array {
            node: Rc::new(Node {
                spec,
                op: op.into(),
                state: RefCell::new(state),
                dynamic: RefCell::new(None),
            }),
        }
    }

    fn uploaded(tensor: Tensor, spec: TensorSpec, donatable: bool, op: &'static str) -> Array {
        let ready = Ready {
            tensor: Rc::new(tensor),
            donatable,
            launch: None,
        };
        Array::with_state(spec, op, State::Ready(ready))
    }

    // -----------------------------------------------------------------------------------------
    // Creation and reads
    // -----------------------------------------------------------------------------------------

    /// An array of dtype `T::DTYPE` and `dims` holding row-major `data`, uploaded to device 0
    /// at once (in every mode).
    ///
    /// Errors: as for [`Tensor::from_slice`] ([`ErrorKind::InvalidArgument`] if `data.len()`
    /// is not the product of `dims`).
    pub fn from_slice<T: Element>(data: &[T], dims: &[u64]) -> Result<Array> {
        let t = Tensor::from_slice(data, dims)?;
        Ok(Array::uploaded(
            t,
            TensorSpec::new(T::DTYPE, dims),
            true,
            "from_slice",
        ))
    }

    /// A rank-0 array holding `value`. Errors: as for [`Tensor::scalar`].
    pub fn scalar<T: Element>(value: T) -> Result<Array> {
        Array::from_slice(&[value], &[])
    }

    /// Wraps an existing tensor (e.g. a weight, or the output of an [`Executable`](crate::Executable)).
    /// Its spec is fetched from the host once. The SDK never donates such a tensor.
    pub fn from_tensor(tensor: Tensor) -> Array {
        let spec = tensor.spec().clone();
        Array::uploaded(tensor, spec, false, "from_tensor")
    }

    /// The dtype and dims.
    pub fn spec(&self) -> &TensorSpec {
        &self.node.spec
    }

    /// The dims (empty for a scalar).
    pub fn dims(&self) -> &[u64] {
        &self.node.spec.dims
    }

    /// The dtype.
    pub fn dtype(&self) -> Dtype {
        self.node.spec.dtype
    }

    /// The name of the op that made this array (`"matmul"`, `"from_slice"`, ...), as errors
    /// name it.
    pub fn op(&self) -> &str {
        &self.node.op
    }

    /// The array's device tensor, running its fused trace first if it is still recorded.
    pub(super) fn ready(&self) -> Result<Ready> {
        if matches!(&*self.node.state.borrow(), State::Pending { .. }) {
            fuse::flush()?;
        }
        match &*self.node.state.borrow() {
            State::Ready(r) => Ok(r.clone()),
            State::Failed(e) => Err(e.clone()),
            State::Pending { .. } => Err(Error::new(
                ErrorKind::Internal,
                format!("eager {}: still pending after its trace ran", self.node.op),
            )),
        }
    }

    /// Reads the array back as row-major values of `T`, waiting for it (and running its fused
    /// trace, in [`EagerMode::DeferAndFuse`](super::EagerMode::DeferAndFuse)).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `T::DTYPE` is not the array's dtype; the
    /// error of the launch that computed it, or of one it depends on (e.g.
    /// [`ErrorKind::ExecutionFailed`], naming the launch), prefixed with the op.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let r = self.ready()?;
        let data = r
            .tensor
            .to_vec::<T>()
            .map_err(|e| named(&self.node.op, e))?;
        Ok(self.unpad(data))
    }

    /// Reads a one-element array as a value of `T`. Errors: as for [`Array::to_vec`], plus
    /// [`ErrorKind::InvalidArgument`] if the array does not hold exactly one element.
    pub fn to_scalar<T: Element>(&self) -> Result<T> {
        if self.dynamic_axis().is_some() {
            let v = self.to_vec::<T>()?;
            return match v[..] {
                [x] => Ok(x),
                _ => Err(Error::invalid_argument(format!(
                    "to_scalar: {} elements (true dims {:?}), not one",
                    v.len(),
                    self.logical_dims()
                ))),
            };
        }
        let r = self.ready()?;
        r.tensor
            .to_scalar::<T>()
            .map_err(|e| named(&self.node.op, e))
    }

    /// Waits until the array's value is computed (running its fused trace if needed).
    ///
    /// Errors: as for [`Array::to_vec`].
    pub fn wait(&self) -> Result<()> {
        let r = self.ready()?;
        r.tensor.wait().map_err(|e| named(&self.node.op, e))
    }

    /// Calls `f` with the array's device tensor (e.g. to pass it to an
    /// [`Executable`](crate::Executable)), running its fused trace first if needed.
    ///
    /// Errors: those of running the trace, or `f`'s.
    pub fn with_tensor<R>(&self, f: impl FnOnce(&Tensor) -> Result<R>) -> Result<R> {
        let r = self.ready()?;
        f(&r.tensor)
    }

    // -----------------------------------------------------------------------------------------
    // How an op runs
    // -----------------------------------------------------------------------------------------

    /// Runs the op `name` on `operands` in the current mode; `build` adds it to a graph whose
    /// values for the operands it is given, and returns the result.
    ///
    /// Fails naming the op if an operand has a dynamic axis (ops that handle one call
    /// [`Array::apply_any`]).
    pub(super) fn apply<F>(name: &'static str, operands: &[&Array], build: F) -> Result<Array>
    where
        F: Fn(&Graph, &[Value]) -> Result<Value>,
    {
        Array::no_dynamic(name, operands)?;
        Array::apply_any(name, operands, None, build)
    }

    /// [`Array::apply`] without the check for dynamic axes; the result gets the dynamic axis
    /// `out_dyn` (before the debug checks read it, so that they skip its padding).
    pub(super) fn apply_any<F>(
        name: &'static str,
        operands: &[&Array],
        out_dyn: Option<Dynamic>,
        build: F,
    ) -> Result<Array>
    where
        F: Fn(&Graph, &[Value]) -> Result<Value>,
    {
        match eager_mode() {
            EagerMode::DeferAndFuse => fuse::record(name, operands, out_dyn, &build),
            EagerMode::DeferNever => Array::run_one(name, operands, out_dyn, &build, false),
            EagerMode::DeferNeverAndLaunchBlocking => {
                Array::run_one(name, operands, out_dyn, &build, true)
            }
        }
    }

    /// DEFER_NEVER: the op as its own canonical program, launched at once.
    fn run_one(
        name: &'static str,
        operands: &[&Array],
        out_dyn: Option<Dynamic>,
        build: &dyn Fn(&Graph, &[Value]) -> Result<Value>,
        blocking: bool,
    ) -> Result<Array> {
        let specs: Vec<&TensorSpec> = operands.iter().map(|a| a.spec()).collect();
        let (graph, value, spec) = match program::one_op(&specs, build)? {
            program::OneOp::Operand(i) => return Ok(operands[i].clone()),
            program::OneOp::Program { graph, out, spec } => (graph, out, spec),
        };
        let readies = operands
            .iter()
            .map(|a| a.ready())
            .collect::<Result<Vec<Ready>>>()?;
        let exe = program::executable(&graph, &[value]).map_err(|e| named(name, e))?;
        let args: Vec<&Tensor> = readies.iter().map(|r| &*r.tensor).collect();
        let launch = exe.launch(&args, &[]).map_err(|e| named(name, e))?;
        program::count_launch();
        let id = launch.id;
        let tensor = launch.outputs.into_iter().next().ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("eager {name}: launch has no output"),
            )
        })?;
        if blocking {
            tensor.wait().map_err(|e| named(name, e))?;
        }
        let ready = Ready {
            tensor: Rc::new(tensor),
            donatable: true,
            launch: Some(id),
        };
        let out = Array::with_state(spec, name, State::Ready(ready.clone()));
        out.set_dynamic(out_dyn);
        if debug_checks() {
            checks::finite(&out.node, &ready, "")?;
        }
        Ok(out)
    }

    // -----------------------------------------------------------------------------------------
    // Element-wise ops
    // -----------------------------------------------------------------------------------------

    /// `self + other`, element-wise with numpy broadcasting; both of one dtype (not `pred`).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if the dtypes differ or the shapes do not
    /// broadcast; device errors as for [`Array::to_vec`].
    pub fn add(&self, other: &Array) -> Result<Array> {
        Array::elementwise("add", &[self, other], |g, v| g.add(v[0], v[1]))
    }

    /// `self - other`, element-wise with numpy broadcasting. Errors: as for [`Array::add`].
    pub fn sub(&self, other: &Array) -> Result<Array> {
        Array::elementwise("sub", &[self, other], |g, v| g.sub(v[0], v[1]))
    }

    /// `self * other`, element-wise with numpy broadcasting. Errors: as for [`Array::add`].
    pub fn mul(&self, other: &Array) -> Result<Array> {
        Array::elementwise("mul", &[self, other], |g, v| g.mul(v[0], v[1]))
    }

    /// `self / other`, element-wise with numpy broadcasting (integers truncate toward zero).
    /// Errors: as for [`Array::add`].
    pub fn div(&self, other: &Array) -> Result<Array> {
        Array::elementwise("div", &[self, other], |g, v| g.div(v[0], v[1]))
    }

    /// Element-wise maximum with numpy broadcasting (NaN propagates). Errors: as for
    /// [`Array::add`].
    pub fn maximum(&self, other: &Array) -> Result<Array> {
        Array::elementwise("maximum", &[self, other], |g, v| g.maximum(v[0], v[1]))
    }

    /// Element-wise minimum with numpy broadcasting (NaN propagates). Errors: as for
    /// [`Array::add`].
    pub fn minimum(&self, other: &Array) -> Result<Array> {
        Array::elementwise("minimum", &[self, other], |g, v| g.minimum(v[0], v[1]))
    }

    /// `self` raised to the power `other`, element-wise with numpy broadcasting. Errors: as
    /// for [`Array::add`].
    pub fn pow(&self, other: &Array) -> Result<Array> {
        Array::elementwise("pow", &[self, other], |g, v| g.pow(v[0], v[1]))
    }

    /// `-self`. Errors: [`ErrorKind::InvalidArgument`] unless a float or signed integer.
    pub fn neg(&self) -> Result<Array> {
        Array::elementwise("neg", &[self], |g, v| g.neg(v[0]))
    }

    /// `|self|`. Errors: [`ErrorKind::InvalidArgument`] unless a float or signed integer.
    pub fn abs(&self) -> Result<Array> {
        Array::elementwise("abs", &[self], |g, v| g.abs(v[0]))
    }

    /// `e^self`. Errors: [`ErrorKind::InvalidArgument`] unless a float.
    pub fn exp(&self) -> Result<Array> {
        Array::elementwise("exp", &[self], |g, v| g.exp(v[0]))
    }

    /// Natural logarithm (NaN below 0, `-inf` at 0). Errors: [`ErrorKind::InvalidArgument`]
    /// unless a float.
    pub fn log(&self) -> Result<Array> {
        Array::elementwise("log", &[self], |g, v| g.log(v[0]))
    }

    /// Hyperbolic tangent. Errors: [`ErrorKind::InvalidArgument`] unless a float.
    pub fn tanh(&self) -> Result<Array> {
        Array::elementwise("tanh", &[self], |g, v| g.tanh(v[0]))
    }

    /// Square root. Errors: [`ErrorKind::InvalidArgument`] unless a float.
    pub fn sqrt(&self) -> Result<Array> {
        Array::elementwise("sqrt", &[self], |g, v| g.sqrt(v[0]))
    }

    /// `1 / sqrt(self)`. Errors: [`ErrorKind::InvalidArgument`] unless a float.
    pub fn rsqrt(&self) -> Result<Array> {
        Array::elementwise("rsqrt", &[self], |g, v| g.rsqrt(v[0]))
    }

    /// The error function ([`Graph::erf`]). Errors: [`ErrorKind::InvalidArgument`] unless a
    /// float.
    pub fn erf(&self) -> Result<Array> {
        Array::elementwise("erf", &[self], |g, v| g.erf(v[0]))
    }

    /// The logistic sigmoid `1 / (1 + e^-x)`. Errors: [`ErrorKind::InvalidArgument`] unless a
    /// float.
    pub fn logistic(&self) -> Result<Array> {
        Array::elementwise("logistic", &[self], |g, v| g.logistic(v[0]))
    }

    /// GELU, exact erf form ([`Graph::gelu`]). Errors: [`ErrorKind::InvalidArgument`] unless
    /// a float.
    pub fn gelu(&self) -> Result<Array> {
        Array::elementwise("gelu", &[self], |g, v| g.gelu(v[0]))
    }

    /// Converts element-wise to `to` ([`Graph::convert`]); the array itself if it is already
    /// of dtype `to`. Errors: [`ErrorKind::InvalidArgument`] for complex → real.
    pub fn convert(&self, to: Dtype) -> Result<Array> {
        Array::elementwise("convert", &[self], move |g, v| g.convert(v[0], to))
    }

    /// Compares element-wise with numpy broadcasting; the result is `pred`. Errors: as for
    /// [`Graph::compare`].
    pub fn compare(&self, other: &Array, dir: Compare) -> Result<Array> {
        Array::elementwise("compare", &[self, other], move |g, v| {
            g.compare(v[0], v[1], dir)
        })
    }

    /// `self ? on_true : on_false` element-wise (`self` is `pred`), the three broadcast
    /// together. Errors: as for [`Graph::select`].
    pub fn select(&self, on_true: &Array, on_false: &Array) -> Result<Array> {
        Array::elementwise("select", &[self, on_true, on_false], |g, v| {
            g.select(v[0], v[1], v[2])
        })
    }

    // -----------------------------------------------------------------------------------------
    // Contractions, reductions, helpers
    // -----------------------------------------------------------------------------------------

    /// Matrix product over the last two dims at full precision ([`Precision::Highest`]):
    /// `[..., m, k] × [..., k, n]` or `[..., m, k] × [k, n]` → `[..., m, n]`
    /// ([`Graph::matmul`]).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for ranks below 2, mismatched `k` or batch dims,
    /// or different dtypes.
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        self.matmul_with(other, Precision::Highest)
    }

    /// [`Array::matmul`] with an explicit `precision`. Errors: as for [`Array::matmul`].
    pub fn matmul_with(&self, other: &Array, precision: Precision) -> Result<Array> {
        Array::apply("matmul", &[self, other], move |g, v| {
            g.matmul(v[0], v[1], precision)
        })
    }

    /// Sum over `axes`, which are removed. Errors: [`ErrorKind::InvalidArgument`] for an
    /// axis out of range or repeated.
    pub fn sum(&self, axes: &[u64]) -> Result<Array> {
        let axes = axes.to_vec();
        self.reduction("sum", &axes.clone(), 0.0, move |g, v| {
            g.reduce_sum(v, &axes)
        })
    }

    /// Maximum over `axes`, which are removed (`-inf` for an empty float reduction). Errors:
    /// as for [`Array::sum`].
    pub fn max(&self, axes: &[u64]) -> Result<Array> {
        let axes = axes.to_vec();
        self.reduction("max", &axes.clone(), f32::NEG_INFINITY, move |g, v| {
            g.reduce_max(v, &axes)
        })
    }

    /// Softmax along `axis` ([`Graph::softmax`]). Errors: [`ErrorKind::InvalidArgument`]
    /// unless a float with `axis` in range.
    pub fn softmax(&self, axis: u64) -> Result<Array> {
        self.softmax_bounded(axis)
    }

    /// Layer normalisation over the last axis ([`Graph::layer_norm`]): `self: [..., D]`,
    /// `gamma`, `beta: [D]`, biased variance, `eps` added to it.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] unless `self` is a float of rank >= 1 and
    /// `gamma`, `beta` are `[D]` of its dtype.
    pub fn layer_norm(&self, gamma: &Array, beta: &Array, eps: f32) -> Result<Array> {
        Array::apply("layer_norm", &[self, gamma, beta], move |g, v| {
            g.layer_norm(v[0], v[1], v[2], eps)
        })
    }

    // -----------------------------------------------------------------------------------------
    // Shape ops, gather, slices
    // -----------------------------------------------------------------------------------------

    /// The same elements (row-major) with new `dims`; the array itself if the dims are
    /// equal. Errors: [`ErrorKind::InvalidArgument`] if the element counts differ.
    pub fn reshape(&self, dims: &[u64]) -> Result<Array> {
        let dims = dims.to_vec();
        Array::apply("reshape", &[self], move |g, v| g.reshape(v[0], &dims))
    }

    /// Permutes the dims: result dim `i` is dim `permutation[i]`. Errors:
    /// [`ErrorKind::InvalidArgument`] unless `permutation` permutes `0..rank`.
    pub fn transpose(&self, permutation: &[u64]) -> Result<Array> {
        let p = permutation.to_vec();
        Array::apply("transpose", &[self], move |g, v| g.transpose(v[0], &p))
    }

    /// Broadcasts to `dims` with numpy rules. Errors: as for [`Graph::broadcast_to`].
    pub fn broadcast_to(&self, dims: &[u64]) -> Result<Array> {
        let dims = dims.to_vec();
        Array::apply("broadcast_to", &[self], move |g, v| {
            g.broadcast_to(v[0], &dims)
        })
    }

    /// Gather: rows of `self: [V, D...]` picked by integer `indices: [I...]`, giving
    /// `[I..., D...]` ([`Graph::take`]). XLA clamps an out-of-range index into `0..V`
    /// silently; with debug checks on, the indices are read first and one out of range fails
    /// the op.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `self` is a scalar or `indices` is not an
    /// integer array, or (debug checks) for an index out of range, naming the op, the index
    /// and its position.
    pub fn take(&self, indices: &Array) -> Result<Array> {
        if debug_checks() && !self.dims().is_empty() {
            checks::indices_in_range("take", indices, self.dims()[0], self.spec())?;
        }
        Array::apply("take", &[self, indices], |g, v| g.take(v[0], v[1]))
    }

    /// The elements from `start` (inclusive) to `limit` (exclusive) every `strides` along
    /// each dim ([`Graph::slice`]). Errors: [`ErrorKind::InvalidArgument`] as for
    /// [`Graph::slice`].
    pub fn slice(&self, start: &[u64], limit: &[u64], strides: &[u64]) -> Result<Array> {
        let (b, e, s) = (start.to_vec(), limit.to_vec(), strides.to_vec());
        Array::apply("slice", &[self], move |g, v| g.slice(v[0], &b, &e, &s))
    }

    /// The block of dims `sizes` starting at the run-time indices `starts` (an integer array
    /// `[rank]`, one start per dim; [`Graph::dynamic_slice`]). XLA clamps each start into
    /// `0..=dim - size` silently; with debug checks on, the starts are read first and one out
    /// of that range fails the op.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `starts` is not an integer `[rank]` array,
    /// `sizes` does not have one entry per dim or a size exceeds its dim, or (debug checks)
    /// for a start out of range, naming the op, the start and its dim.
    pub fn dynamic_slice(&self, starts: &Array, sizes: &[u64]) -> Result<Array> {
        let rank = self.dims().len();
        if starts.dims() != [rank as u64] {
            return Err(Error::invalid_argument(format!(
                "dynamic_slice: starts must be [{rank}] (one per dim of {}), got {}",
                self.spec(),
                starts.spec()
            )));
        }
        if debug_checks()
            && sizes.len() == rank
            && sizes.iter().zip(self.dims()).all(|(s, d)| s <= d)
        {
            let bounds: Vec<u64> = self.dims().iter().zip(sizes).map(|(d, s)| d - s).collect();
            checks::starts_in_range("dynamic_slice", starts, &bounds, self.spec(), sizes)?;
        }
        let sizes = sizes.to_vec();
        Array::apply("dynamic_slice", &[self, starts], move |g, v| {
            let starts = (0..rank as u64)
                .map(|i| g.reshape(g.slice(v[1], &[i], &[i + 1], &[1])?, &[]))
                .collect::<Result<Vec<Value>>>()?;
            g.dynamic_slice(v[0], &starts, &sizes)
        })
    }

    /// Joins `arrays` along `axis` (equal dtypes and ranks, equal dims but along `axis`); a
    /// single array is returned as is.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] if `arrays` is empty, `axis` is out of range or
    /// the specs do not fit.
    pub fn concatenate(arrays: &[&Array], axis: u64) -> Result<Array> {
        Array::apply("concatenate", arrays, move |g, v| g.concatenate(v, axis))
    }
}
