//! The eager mode: the default from the guest's environment, a scoped override
//! ([`set_eager_mode`]) and the debug-check switch.

use std::cell::Cell;
use std::sync::OnceLock;

/// How [`Array`](super::Array) ops run; TorchTPU's `EagerMode`, under the same names.
///
/// The default comes from the environment the host granted the guest (`tpubox run --env
/// KEY=VALUE`), read once: `TPUBOX_LAUNCH_BLOCKING=1` gives
/// [`EagerMode::DeferNeverAndLaunchBlocking`] (it wins over the other), else
/// `TPUBOX_DEFER_AND_FUSE=1` gives [`EagerMode::DeferAndFuse`], else
/// [`EagerMode::DeferNever`]. [`set_eager_mode`] overrides it for a scope.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EagerMode {
    /// Each op is one small program (the same op, attributes and operand specs always print
    /// the same text, so it is compiled once and served from every cache tier, across
    /// tenants), launched without waiting: the result is pending until read, and a device
    /// failure surfaces at the next read of it (or of an array computed from it), naming the
    /// op and the launch.
    #[default]
    DeferNever,
    /// Ops are recorded into a trace and run as one fused program when an array of the trace
    /// is read, at [`mark_step`](super::mark_step), or when the trace reaches
    /// [`max_fused_ops`](super::max_fused_ops) ops. Only arrays still held become outputs;
    /// fused programs are cached by their text (so a repeated step compiles once), and an
    /// input tensor no array holds any more is donated.
    DeferAndFuse,
    /// As [`EagerMode::DeferNever`], but each op waits for the device: its failure is the
    /// op's error. With debug checks on ([`set_debug_checks`], `TPUBOX_ENABLE_DEBUG_CHECKS=1`),
    /// the mode for debugging.
    DeferNeverAndLaunchBlocking,
}

impl EagerMode {
    /// TorchTPU's spelling, e.g. `"DEFER_AND_FUSE"`.
    pub const fn name(self) -> &'static str {
        match self {
            EagerMode::DeferNever => "DEFER_NEVER",
            EagerMode::DeferAndFuse => "DEFER_AND_FUSE",
            EagerMode::DeferNeverAndLaunchBlocking => "DEFER_NEVER_AND_LAUNCH_BLOCKING",
        }
    }
}

/// Whether an environment value turns a switch on (`1`, `true`, `yes`, `on`, any case).
pub(super) fn env_on(value: Option<&str>) -> bool {
    value.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// The mode the switches `TPUBOX_DEFER_AND_FUSE` and `TPUBOX_LAUNCH_BLOCKING` give.
pub(super) fn mode_from_env(
    defer_and_fuse: Option<&str>,
    launch_blocking: Option<&str>,
) -> EagerMode {
    if env_on(launch_blocking) {
        EagerMode::DeferNeverAndLaunchBlocking
    } else if env_on(defer_and_fuse) {
        EagerMode::DeferAndFuse
    } else {
        EagerMode::DeferNever
    }
}

/// The environment's defaults: (mode, debug checks).
fn env_defaults() -> (EagerMode, bool) {
    static DEFAULTS: OnceLock<(EagerMode, bool)> = OnceLock::new();
    *DEFAULTS.get_or_init(|| {
        let var = |k: &str| std::env::var(k).ok();
        (
            mode_from_env(
                var("TPUBOX_DEFER_AND_FUSE").as_deref(),
                var("TPUBOX_LAUNCH_BLOCKING").as_deref(),
            ),
            env_on(var("TPUBOX_ENABLE_DEBUG_CHECKS").as_deref()),
        )
    })
}

thread_local! {
    static OVERRIDE: Cell<Option<EagerMode>> = const { Cell::new(None) };
    static DEBUG_CHECKS: Cell<Option<bool>> = const { Cell::new(None) };
}

/// The mode ops run in now: the innermost [`set_eager_mode`] override still alive, else the
/// environment's default (see [`EagerMode`]).
pub fn eager_mode() -> EagerMode {
    OVERRIDE.with(Cell::get).unwrap_or(env_defaults().0)
}

/// Runs later ops in `mode` until the returned guard is dropped, which restores the mode
/// before (TorchTPU's `with set_eager_mode(mode):`). Guards nest; drop them in reverse order.
///
/// Arrays keep working across modes: an array still pending in a fused trace is run when an
/// op of another mode uses it or it is read.
#[must_use = "the mode is restored when the guard is dropped"]
pub fn set_eager_mode(mode: EagerMode) -> ModeGuard {
    let previous = OVERRIDE.with(|o| o.replace(Some(mode)));
    ModeGuard { previous }
}

/// Restores the eager mode that was in force before [`set_eager_mode`] when dropped.
#[derive(Debug)]
pub struct ModeGuard {
    previous: Option<EagerMode>,
}

impl Drop for ModeGuard {
    fn drop(&mut self) {
        OVERRIDE.with(|o| o.set(self.previous));
    }
}

/// Whether debug checks run: the last [`set_debug_checks`], else
/// `TPUBOX_ENABLE_DEBUG_CHECKS` from the environment.
pub fn debug_checks() -> bool {
    DEBUG_CHECKS.with(Cell::get).unwrap_or(env_defaults().1)
}

/// Turns the debug checks on or off (TorchTPU's `TORCH_TPU_ENABLE_DEBUG_CHECKS`). Each check
/// costs a transfer to the guest and a wait, so it makes ops synchronous:
///
/// * float results are read back and a NaN or infinity fails the op that made it;
/// * the indices of a gather ([`Array::take`](super::Array::take)) and the starts of a
///   [`Array::dynamic_slice`](super::Array::dynamic_slice) are read before it runs, and one
///   out of range (which XLA would clamp silently) fails the op.
///
/// In [`EagerMode::DeferAndFuse`] the NaN check runs on the outputs of each fused step and
/// names the op that made the offending array. Errors are
/// [`ErrorKind::ExecutionFailed`](crate::ErrorKind::ExecutionFailed) for a NaN or infinity and
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for an index.
pub fn set_debug_checks(on: bool) {
    DEBUG_CHECKS.with(|d| d.set(Some(on)));
}
