//! Canonical programs and the guest-side cache of their executables.
//!
//! An op of [`EagerMode::DeferNever`](super::EagerMode::DeferNever) is a one-op [`Graph`] with
//! one parameter per operand; the graph prints values by their position, so the same op,
//! attributes and operand specs always give byte-identical text. The host's compile cache is
//! keyed by that text, so the program is compiled once for every tenant; this module also keeps
//! the executables by the graph's structure (what the text is printed from, compared without
//! printing it: [`Graph::structure_hash`]), so that a repeated op or fused step neither asks
//! the host nor prints its text.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use crate::graph::{Graph, Structure, Value};
use crate::{Executable, Result, TensorSpec, compile_mlir};

/// Most executables kept by the guest-side cache; it is emptied when full.
const MAX_CACHED: usize = 1024;

/// What [`one_op`] made of an op.
pub(super) enum OneOp {
    /// The op returns operand `i` itself (a reshape to the same dims, ...): nothing to run.
    Operand(usize),
    /// The canonical program (`graph`, returning `out`) and the spec of its one result.
    Program {
        graph: Graph,
        out: Value,
        spec: TensorSpec,
    },
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
        spec: g.spec(out),
        graph: g,
        out,
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

/// One executable of the guest-side cache and the structure it was compiled from.
struct Cached {
    structure: Structure,
    exe: Rc<Executable>,
}

thread_local! {
    /// By [`Graph::structure_hash`]; entries with equal hashes side by side.
    static CACHE: RefCell<HashMap<u64, Vec<Cached>>> = RefCell::new(HashMap::new());
    static CACHED: Cell<usize> = const { Cell::new(0) };
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

/// The executable of `graph` returning `outputs`, from the guest-side cache (found by the
/// graph's structure, without printing its text) or compiled by the host.
///
/// Errors: as for [`Graph::compile`].
pub(super) fn executable(graph: &Graph, outputs: &[Value]) -> Result<Rc<Executable>> {
    let hash = graph.structure_hash(outputs)?;
    let hit = CACHE.with(|c| {
        c.borrow().get(&hash).and_then(|entries| {
            entries
                .iter()
                .find(|e| graph.has_structure(outputs, &e.structure))
                .map(|e| Rc::clone(&e.exe))
        })
    });
    if let Some(exe) = hit {
        update_stats(|s| s.cache_hits += 1);
        return Ok(exe);
    }
    let exe = Rc::new(compile_mlir(&graph.to_mlir(outputs)?)?);
    update_stats(|s| s.compiles += 1);
    let structure = graph.structure(outputs)?;
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if CACHED.with(Cell::get) >= MAX_CACHED {
            c.clear();
            CACHED.with(|n| n.set(0));
        }
        c.entry(hash).or_default().push(Cached {
            structure,
            exe: Rc::clone(&exe),
        });
        CACHED.with(|n| n.set(n.get() + 1));
    });
    Ok(exe)
}
