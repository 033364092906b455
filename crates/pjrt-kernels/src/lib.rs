//! CPU handlers for tpubox's own custom calls, registered with a PJRT plugin through its FFI
//! extension (typed XLA FFI, `api_version = 4`).
//!
//! | target | what it computes |
//! |---|---|
//! | [`SEGMENT_ATTENTION`] | softmax attention inside the segments of packed rows ([`segment_attention`](mod@segment_attention)) |
//!
//! Hostile inputs: a handler checks every buffer's element type and dimensions, that its result
//! shares no memory with its operands, and bounds the work one call may do
//! ([`max_flop`]; XLA cannot interrupt a custom call) before it touches any data; a wrong call
//! fails with `INVALID_ARGUMENT` or `RESOURCE_EXHAUSTED` and the execution returns that error.

#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

pub mod loop_budget;
pub mod segment_attention;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use pjrt::Plugin;
use pjrt::ffi::handle;
use pjrt_sys::xla_ffi::{XLA_FFI_CallFrame, XLA_FFI_Error};

pub use loop_budget::LOOP_BUDGET;
pub use segment_attention::segment_attention;

/// Custom-call target of [`segment_attention()`].
pub const SEGMENT_ATTENTION: &str = "tpubox_segment_attention";

/// Every custom-call target this crate handles that a tenant's program may call ([`LOOP_BUDGET`]
/// is the host's own: only its rewrite inserts it).
pub fn targets() -> Vec<&'static str> {
    vec![SEGMENT_ATTENTION]
}

/// Most floating-point operations one custom call may do: 10^12 by default (tens of seconds on
/// one core), `TPUBOX_KERNEL_MAX_FLOP` to change it. A call that would do more fails with
/// `RESOURCE_EXHAUSTED` before it runs.
pub fn max_flop() -> f64 {
    std::env::var("TPUBOX_KERNEL_MAX_FLOP")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| *v > 0.0)
        .unwrap_or(1e12)
}

/// # Safety
/// Called by XLA with a valid call frame.
unsafe extern "C" fn segment_attention_handler(
    frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    // SAFETY: XLA passes its live call frame.
    unsafe { handle(frame, segment_attention) }
}

/// # Safety
/// Called by XLA with a valid call frame.
unsafe extern "C" fn loop_budget_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    // SAFETY: XLA passes its live call frame.
    unsafe { handle(frame, loop_budget::loop_budget) }
}

/// Custom-call target of a **test-only** handler that fails every execution with
/// `INTERNAL` ("tpubox_test_fail: this custom call fails on purpose"), whatever its operands
/// (it writes nothing). Registered only by [`register_test_fail`], which a host calls only
/// when asked (`tpubox_core::open::DeviceConfig::test_custom_calls`), and allowed in no
/// tenant's program policy by default: tests use it to inject a failure at execution, after
/// the program compiled and was launched.
pub const TEST_FAIL: &str = "tpubox_test_fail";

fn test_fail(_f: &pjrt::ffi::CallFrame<'_>) -> Result<(), pjrt::ffi::FfiError> {
    Err(pjrt::ffi::FfiError::new(
        pjrt::ErrorCode::Internal,
        "tpubox_test_fail: this custom call fails on purpose (test-only)",
    ))
}

/// # Safety
/// Called by XLA with a valid call frame.
unsafe extern "C" fn test_fail_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    // SAFETY: XLA passes its live call frame; `handle` reads it only as its docs say.
    unsafe { handle(frame, test_fail) }
}

/// Per plugin path: the result of the first test-only registration.
static TEST_DONE: Mutex<Option<HashMap<PathBuf, Result<(), String>>>> = Mutex::new(None);

/// Registers the test-only [`TEST_FAIL`] handler with `plugin` for the platform `"cpu"`, once
/// per process and plugin (later calls return the first result). Registration is
/// process-wide: every client of the plugin in this process can then compile programs that
/// call it (tenants still need it in their program policy's allowed custom calls).
///
/// Errors: the plugin has no FFI extension, or refuses the handler (its message).
pub fn register_test_fail(plugin: &Plugin) -> Result<(), String> {
    let mut done = TEST_DONE.lock().unwrap_or_else(|p| p.into_inner());
    let done = done.get_or_insert_with(HashMap::new);
    if let Some(r) = done.get(plugin.path()) {
        return r.clone();
    }
    let r = plugin
        .register_ffi_handler(TEST_FAIL, "cpu", test_fail_handler)
        .map_err(|e| e.to_string());
    done.insert(plugin.path().to_path_buf(), r.clone());
    r
}

/// Per plugin path: the result of the first registration (registration is process-wide).
static DONE: Mutex<Option<HashMap<PathBuf, Result<(), String>>>> = Mutex::new(None);

/// Registers every handler of this crate with `plugin` for the platform `"cpu"`, once per
/// process and plugin (later calls return the first result). Only call it for a CPU plugin:
/// the handlers read and write buffers as host memory.
///
/// Errors: the plugin has no FFI extension, or refuses a handler (its message).
pub fn register(plugin: &Plugin) -> Result<(), String> {
    let mut done = DONE.lock().unwrap_or_else(|p| p.into_inner());
    let done = done.get_or_insert_with(HashMap::new);
    if let Some(r) = done.get(plugin.path()) {
        return r.clone();
    }
    let r = plugin
        .register_ffi_handler(SEGMENT_ATTENTION, "cpu", segment_attention_handler)
        .and_then(|()| plugin.register_ffi_handler(LOOP_BUDGET, "cpu", loop_budget_handler))
        .map_err(|e| e.to_string());
    done.insert(plugin.path().to_path_buf(), r.clone());
    r
}
