//! Canonical programs and the guest-side cache of their executables.
//!
//! An op of [`EagerMode::DeferNever`](super::EagerMode::DeferNever) is a one-op [`Graph`] with
//! one parameter per operand; the graph prints values by their position, so the same op,
//! attributes and operand specs always give byte-identical text. The host's compile cache is
//! keyed by that text, so the program is compiled once for every tenant; this module also keeps
//! a map from text to [`Executable`] so that a repeated op does not even ask the host.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use crate::graph::{Graph, Value};
use crate::{Executable, Result, TensorSpec, compile_mlir};

/// Most executables kept by the guest-side cache; it is emptied when full.
const MAX_CACHED: usize = 1024;

/// What [`one_op`] made of an op.
pub(super) enum OneOp {
    /// The op returns operand `i` itself (a reshape to the same dims, ...): nothing to run.
    Operand(usize),
    /// The canonical program and the spec of its one result.
    Program { text: String, spec: TensorSpec },
}

/// The canonical program of one op on operands of `specs` (built by `build`), checking the
/// op's shapes on the way.
///
/// Errors: the op's [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument).
pub(super) fn one_op(
    specs: &[&TensorSpec],
    build: &dyn Fn(&Graph, &[Value]) -> Result<Value>,
) -> Result<OneOp> {
    let g = Graph::new();
    let params: Vec<Value> = specs
        .iter()
        .map(|s| g.parameter(s.dtype, &s.dims))
        .collect();
    let out = build(&g, &params)?;
    if let Some(i) = params.iter().position(|&p| p == out) {
        return Ok(OneOp::Operand(i));
    }
    Ok(OneOp::Program {
        text: g.to_mlir(&[out])?,
        spec: g.spec(out),
    })
}

/// Counters of the eager layer on this thread, from [`stats`](super::stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EagerStats {
    /// Programs sent to the host to compile (one per distinct program text not already in
    /// the guest-side cache).
    pub compiles: u64,
    /// Ops and fused steps whose executable came from the guest-side cache.
    pub cache_hits: u64,
    /// Launches made (one per op in DEFER_NEVER modes, one per fused step).
    pub launches: u64,
    /// Fused steps run (DEFER_AND_FUSE).
    pub fused_steps: u64,
    /// Input tensors donated to fused steps.
    pub donated: u64,
}

thread_local! {
    static CACHE: RefCell<HashMap<String, Rc<Executable>>> = RefCell::new(HashMap::new());
    static STATS: Cell<EagerStats> = Cell::new(EagerStats::default());
}

pub(super) fn update_stats(f: impl FnOnce(&mut EagerStats)) {
    STATS.with(|s| {
        let mut v = s.get();
        f(&mut v);
        s.set(v);
    });
}

pub(super) fn stats() -> EagerStats {
    STATS.with(Cell::get)
}

pub(super) fn count_launch() {
    update_stats(|s| s.launches += 1);
}

/// The executable of `text`, from the guest-side cache or compiled by the host.
///
/// Errors: as for [`compile_mlir`].
pub(super) fn executable(text: &str) -> Result<Rc<Executable>> {
    if let Some(exe) = CACHE.with(|c| c.borrow().get(text).cloned()) {
        update_stats(|s| s.cache_hits += 1);
        return Ok(exe);
    }
    let exe = Rc::new(compile_mlir(text)?);
    update_stats(|s| s.compiles += 1);
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= MAX_CACHED {
            c.clear();
        }
        c.insert(text.to_string(), Rc::clone(&exe));
    });
    Ok(exe)
}
