//! The handler of `tpubox_loop_budget` ([`LOOP_BUDGET`]), the custom call that
//! [`pjrt::loop_budget::budget_loops`] puts into the condition of every `while` loop XLA
//! cannot bound.
//!
//! Operands: none. Result: one `pred[]`, set to `true`. Attributes (`i64`): `iterations` (most
//! condition evaluations of budgeted loops in one execution, `max-loop-iterations`), `work`
//! (most work in one execution, `max-loop-work`), `step` (work one evaluation stands for).
//!
//! State is kept per execution, keyed by the execution's `xla::RunId` ([`CallFrame::run_id`];
//! the host gives every execution its own launch id, which the CPU plugins make the run id):
//! every budgeted loop of one execution, nested or called or not, draws from the same counts.
//! A call past either budget fails the execution with `RESOURCE_EXHAUSTED` naming the limit.
//! Entries of executions that no call touched for [`FORGET_AFTER`] are dropped once more than
//! [`KEEP_RUNS`] are kept.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pjrt::ErrorCode;
use pjrt::ffi::{CallFrame, FfiError};

/// Custom-call target of the loop budget.
pub const LOOP_BUDGET: &str = pjrt::loop_budget::LOOP_BUDGET_TARGET;

/// Executions' entries kept before idle ones are dropped.
pub const KEEP_RUNS: usize = 1024;

/// How long an execution's entry is kept without a call once more than [`KEEP_RUNS`] are kept.
pub const FORGET_AFTER: Duration = Duration::from_secs(60);

struct Run {
    iterations: u64,
    work: u64,
    seen: Instant,
}

static RUNS: Mutex<Option<HashMap<i64, Run>>> = Mutex::new(None);

fn attr_u64(f: &CallFrame<'_>, name: &str) -> Result<u64, FfiError> {
    u64::try_from(f.attr_i64(name)?)
        .map_err(|_| FfiError::invalid(format!("attribute {name} is negative")))
}

/// One condition evaluation: counts it against the execution's budget and answers `true`, or
/// fails with `RESOURCE_EXHAUSTED` naming `max-loop-iterations` or `max-loop-work`.
pub fn loop_budget(f: &CallFrame<'_>) -> Result<(), FfiError> {
    let (max_iterations, max_work, step) = (
        attr_u64(f, "iterations")?,
        attr_u64(f, "work")?,
        attr_u64(f, "step")?,
    );
    let out = f.ret(0)?;
    if out.dtype != pjrt_sys::xla_ffi::XLA_FFI_DataType_PRED || out.elements() != Some(1) {
        return Err(FfiError::invalid(format!(
            "{LOOP_BUDGET} returns one pred[]"
        )));
    }
    let run = f.run_id()?;
    let now = Instant::now();
    let (iterations, work) = {
        let mut runs = RUNS.lock().unwrap_or_else(|p| p.into_inner());
        let runs = runs.get_or_insert_with(HashMap::new);
        if runs.len() > KEEP_RUNS {
            runs.retain(|_, r| now.duration_since(r.seen) < FORGET_AFTER);
        }
        let r = runs.entry(run).or_insert(Run {
            iterations: 0,
            work: 0,
            seen: now,
        });
        r.iterations = r.iterations.saturating_add(1);
        r.work = r.work.saturating_add(step);
        r.seen = now;
        (r.iterations, r.work)
    };
    if iterations > max_iterations {
        return Err(FfiError::new(
            ErrorCode::ResourceExhausted,
            format!(
                "the loop budget is spent: more than {max_iterations} trips of loops XLA cannot bound in one execution (max-loop-iterations)"
            ),
        ));
    }
    if work > max_work {
        return Err(FfiError::new(
            ErrorCode::ResourceExhausted,
            format!(
                "the loop budget is spent: loops XLA cannot bound would do more than {max_work} units of work in one execution, {step} a trip (max-loop-work)"
            ),
        ));
    }
    // SAFETY: the result is one PRED element (checked above), which XLA stores as one byte.
    unsafe { out.data.cast::<u8>().write(1) };
    Ok(())
}
