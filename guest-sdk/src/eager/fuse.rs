//! DEFER_AND_FUSE: the trace of recorded ops and how it runs as one program.
//!
//! The trace is one [`Graph`] per thread. An operand that is already on the device becomes a
//! parameter of the graph (once per tensor); an operand recorded in the trace is its value
//! there. Arrays are recorded by weak reference, so that at a flush only the arrays still held
//! become outputs; the others are left to the compiler's dead-code elimination. The program
//! text depends only on the trace's structure (ops, attributes, specs, the order of parameters
//! and outputs), not on the data, so the executable of a repeated step comes from the
//! guest-side cache (and the host's).

use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};

use super::array::{Array, Node, Ready, State, named};
use super::bounded::Dynamic;
use super::mode::debug_checks;
use super::{checks, program};
use crate::graph::{Graph, Value};
use crate::{Error, ErrorKind, Result, Tensor};

/// Default of [`max_fused_ops`].
const DEFAULT_MAX_FUSED_OPS: usize = 512;

struct Trace {
    id: u64,
    graph: Graph,
    /// The parameters' tensors, in parameter order, with whether each may be donated.
    inputs: Vec<(Rc<Tensor>, bool)>,
    /// The arrays recorded, in order.
    nodes: Vec<Weak<Node>>,
    /// With debug checks on, every array recorded, held so that each is an output of the step
    /// and checked: the first non-finite one in recording order names the op that made it.
    keep: Vec<Array>,
}

impl Trace {
    fn new() -> Trace {
        let id = NEXT_TRACE.with(|n| {
            let id = n.get();
            n.set(id + 1);
            id
        });
        Trace {
            id,
            graph: Graph::new(),
            inputs: Vec::new(),
            nodes: Vec::new(),
            keep: Vec::new(),
        }
    }

    /// The parameter holding `r`'s tensor, added on first use.
    fn input(&mut self, r: &Ready) -> Value {
        let params = self.graph.parameters();
        if let Some(i) = self
            .inputs
            .iter()
            .position(|(t, _)| Rc::ptr_eq(t, &r.tensor))
        {
            return params[i];
        }
        let v = self.graph.parameter(r.tensor.dtype(), r.tensor.dims());
        self.inputs.push((Rc::clone(&r.tensor), r.donatable));
        v
    }
}

thread_local! {
    static NEXT_TRACE: Cell<u64> = const { Cell::new(1) };
    static TRACE: RefCell<Option<Trace>> = const { RefCell::new(None) };
    static MAX_FUSED_OPS: Cell<usize> = const { Cell::new(DEFAULT_MAX_FUSED_OPS) };
}

/// The most ops a fused trace records before it runs by itself (512 unless
/// [`set_max_fused_ops`] changed it).
pub fn max_fused_ops() -> usize {
    MAX_FUSED_OPS.with(Cell::get)
}

/// Sets [`max_fused_ops`] for this thread (at least 1).
pub fn set_max_fused_ops(n: usize) {
    MAX_FUSED_OPS.with(|m| m.set(n.max(1)));
}

/// Records the op `name` on `operands` in the trace; the result gets the dynamic axis
/// `out_dyn`.
pub(super) fn record(
    name: &'static str,
    operands: &[&Array],
    out_dyn: Option<Dynamic>,
    build: &dyn Fn(&Graph, &[Value]) -> Result<Value>,
) -> Result<Array> {
    let (out, full) = TRACE.with(|cell| -> Result<(Array, bool)> {
        let mut slot = cell.borrow_mut();
        let trace = slot.get_or_insert_with(Trace::new);
        let mut values = Vec::with_capacity(operands.len());
        for a in operands {
            match &*a.node.state.borrow() {
                State::Ready(r) => values.push(trace.input(r)),
                State::Pending { trace: t, value } if *t == trace.id => values.push(*value),
                State::Pending { .. } => {
                    return Err(Error::new(
                        ErrorKind::Internal,
                        format!("eager {name}: operand of a trace that is gone"),
                    ));
                }
                State::Failed(e) => return Err(e.clone()),
            }
        }
        let out = build(&trace.graph, &values)?;
        if let Some(i) = values.iter().position(|&v| v == out) {
            return Ok((operands[i].clone(), false));
        }
        let spec = trace.graph.spec(out);
        let array = Array::with_state(
            spec,
            name,
            State::Pending {
                trace: trace.id,
                value: out,
            },
        );
        array.set_dynamic(out_dyn.clone());
        trace.nodes.push(Rc::downgrade(&array.node));
        if debug_checks() {
            trace.keep.push(array.clone());
        }
        Ok((array, trace.nodes.len() >= max_fused_ops()))
    })?;
    if full {
        flush()?;
    }
    Ok(out)
}

/// Runs this thread's trace as one program and gives its live arrays their tensors; nothing to
/// do when no array of the trace is still held.
///
/// Errors: the compile or launch error (every live array of the trace then fails with it at
/// its reads); with debug checks on, a NaN or infinity in an output, naming its op.
pub(super) fn flush() -> Result<()> {
    let Some(trace) = TRACE.with(|cell| cell.borrow_mut().take()) else {
        return Ok(());
    };
    let live: Vec<Rc<Node>> = trace.nodes.iter().filter_map(Weak::upgrade).collect();
    if live.is_empty() {
        return Ok(());
    }
    let outputs: Vec<Value> = live
        .iter()
        .map(|n| match &*n.state.borrow() {
            State::Pending { value, .. } => *value,
            _ => unreachable!("only flush gives a recorded array a value"),
        })
        .collect();
    // Formatted only for an error: a step that runs pays nothing for it.
    let what = || {
        let ops: Vec<&str> = live.iter().map(|n| &*n.op).collect();
        format!(
            "fused step ({} ops, outputs from {})",
            trace.nodes.len(),
            ops.join(", ")
        )
    };
    let launched = (|| {
        let exe = program::executable(&trace.graph, &outputs)?;
        // An input no array holds any more (only the trace does) is donated.
        let donate: Vec<u32> = (0u32..)
            .zip(&trace.inputs)
            .filter(|(_, (t, donatable))| *donatable && Rc::strong_count(t) == 1)
            .map(|(i, _)| i)
            .collect();
        let args: Vec<&Tensor> = trace.inputs.iter().map(|(t, _)| &**t).collect();
        let launch = exe.launch(&args, &donate)?;
        program::update_stats(|s| {
            s.launches += 1;
            s.fused_steps += 1;
            s.donated += donate.len() as u64;
        });
        Ok(launch)
    })();
    let launch = match launched {
        Ok(l) => l,
        Err(e) => {
            let e = named(&what(), e);
            for n in &live {
                *n.state.borrow_mut() = State::Failed(e.clone());
            }
            return Err(e);
        }
    };
    let id = launch.id;
    let mut readies = Vec::with_capacity(live.len());
    for (n, t) in live.iter().zip(launch.outputs) {
        let ready = Ready {
            tensor: Rc::new(t),
            donatable: true,
            launch: Some(id),
        };
        *n.state.borrow_mut() = State::Ready(ready.clone());
        readies.push(ready);
    }
    if debug_checks() {
        for (n, r) in live.iter().zip(&readies) {
            checks::finite(n, r, " in a fused step")?;
        }
    }
    Ok(())
}
