//! Eager arrays in TorchTPU's three eager modes: write `x.matmul(&w)?.add(&b)?.gelu()?` and
//! read the result with [`Array::to_vec`]; the SDK builds and runs the programs.
//!
//! | mode ([`EagerMode`]) | environment (granted by the host, e.g. `tpubox run --env`) | what an op does |
//! |---|---|---|
//! | [`EagerMode::DeferNever`] (default) | — | launches its own small canonical program and returns at once |
//! | [`EagerMode::DeferAndFuse`] | `TPUBOX_DEFER_AND_FUSE=1` | is recorded; a read, [`mark_step`] or the size threshold ([`max_fused_ops`]) runs the trace as one program |
//! | [`EagerMode::DeferNeverAndLaunchBlocking`] | `TPUBOX_LAUNCH_BLOCKING=1` (wins over the other) | as `DeferNever`, but waits: a device failure is the op's own error |
//!
//! [`set_eager_mode`] overrides the mode for a scope (the guard restores it when dropped);
//! [`eager_mode`] tells the mode in force. Debug checks (`TPUBOX_ENABLE_DEBUG_CHECKS=1` or
//! [`set_debug_checks`]) read results back and report NaN and infinities and out-of-range
//! gather indices, naming the op.
//!
//! ```no_run
//! use tpubox_guest::eager::{self, Array, EagerMode};
//!
//! let x = Array::from_slice(&[0.5f32, -1.0, 2.0, 1.5, 0.25, -0.75], &[2, 3])?;
//! let w = Array::from_slice(&[0.1f32; 12], &[3, 4])?;
//! let b = Array::from_slice(&[0.0f32, 0.1, 0.2, 0.3], &[4])?;
//! let y = x.matmul(&w)?.add(&b)?.gelu()?; // f32[2,4]
//! let _fused = eager::set_eager_mode(EagerMode::DeferAndFuse);
//! let z = y.softmax(1)?.sum(&[1])?;   // recorded, not run yet
//! assert_eq!(z.dims(), [2]);
//! let v: Vec<f32> = z.to_vec()?;      // runs the trace as one program
//! # Ok::<(), tpubox_guest::Error>(())
//! ```
//!
//! # Numbers
//!
//! Every mode runs the ops of [`crate::graph`] on the same inputs, so the results agree with a
//! compiled [`Graph`](crate::graph::Graph) up to the compiler's freedom to fuse and reorder
//! float arithmetic (on the CPU plugin, f32 results agree within a few ulps; the test suite
//! checks all three modes and a compiled graph against f64 references within 2e-5 absolute
//! plus 2e-5 relative).
//!
//! # Caching
//!
//! A DEFER_NEVER op's program depends only on the op, its attributes and its operands' dtypes
//! and dims, printed canonically, so it is compiled once per host (the host caches compiles by
//! program text, across tenants) and once per guest thread is it even sent to the host: the
//! SDK keeps the executables by text ([`stats`] counts compiles and hits). A fused step is
//! keyed by its text too, which depends on the trace's structure, not on the data.
//!
//! # Bounded shapes
//!
//! [`Array::from_slice_bounded`] (TorchTPU's `mark_dynamic(t, axis, 1, max)`) makes an array
//! whose axis `axis` has a true length `len <= max`, stored padded with zeros to [`bucket`]
//! `(len, max)` (the powers of two below `max`, then `max`: [`buckets`]), its length kept by
//! the SDK and uploaded as an `s32[]` scalar. Element-wise ops keep the dynamic axis;
//! [`Array::sum`], [`Array::max`] and [`Array::softmax`] over it mask the padding (0, `-inf`,
//! `-inf`) with an iota compared to that scalar, so one program per bucket serves every length
//! in it; [`Array::to_vec`] returns the true elements. [`Array::mark_dynamic`] marks an
//! array that is already padded to its bucket. Any other op on a dynamic array fails
//! with [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the op.

mod array;
mod bounded;
mod checks;
mod fuse;
mod mode;
mod program;
#[cfg(test)]
mod tests;

pub use array::Array;
pub use bounded::{bucket, buckets};
pub use fuse::{max_fused_ops, set_max_fused_ops};
pub use mode::{EagerMode, ModeGuard, debug_checks, eager_mode, set_debug_checks, set_eager_mode};
pub use program::EagerStats;

use crate::Result;

/// Runs this thread's pending fused trace now ([`EagerMode::DeferAndFuse`]), as TorchTPU's
/// `mark_step`: the arrays still held get their values (computing on the device; reads wait).
/// Nothing happens when no trace is pending, e.g. in the other modes.
///
/// Errors: the trace's compile or launch error (the trace's arrays then fail with it at their
/// reads); with debug checks on, a NaN or infinity in one of its outputs, naming the op.
pub fn mark_step() -> Result<()> {
    fuse::flush()
}

/// Counters of this thread's eager ops: compiles, guest-side cache hits, launches, fused steps
/// and donated inputs.
pub fn stats() -> EagerStats {
    program::stats()
}
