//! [`Event`]: completion of asynchronous PJRT work (`PJRT_Event`).

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use pjrt_sys as sys;
use sys::Args;

use crate::api::{Api, api_fn};
use crate::client::Client;
use crate::error::{Error, Result};

/// A PJRT event: becomes ready when asynchronous work (a transfer, an execution) completes,
/// carrying that work's error status. Destroyed (`PJRT_Event_Destroy`) when dropped; dropping
/// an event does not cancel the work. Keeps its [`Client`] alive.
pub struct Event {
    client: Client,
    raw: *mut sys::PJRT_Event,
}

// SAFETY: a PJRT_Event wraps a reference-counted, internally synchronized future
// (the plugin itself completes it from its own threads); this type only calls IsReady, Await,
// OnReady and Destroy on it, Destroy exactly once from `Drop`.
unsafe impl Send for Event {}
// SAFETY: the only `&self` operation is `PJRT_Event_IsReady`, a read of the future's state.
unsafe impl Sync for Event {}

type Callback = Box<dyn FnOnce(Result<()>) + Send + 'static>;

/// State shared between [`Event::on_ready`] and the C callback. Holding the event here keeps
/// it alive until both sides are done with it (the callback may run on any thread, even inside
/// `PJRT_Event_OnReady` before it returns).
struct Pending {
    event: Event,
    callback: Mutex<Option<Callback>>,
}

impl Pending {
    fn take(&self) -> Option<Callback> {
        self.callback
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// Called by the plugin exactly once when the event becomes ready.
unsafe extern "C" fn on_ready_trampoline(err: *mut sys::PJRT_Error, user_arg: *mut c_void) {
    // SAFETY: `user_arg` is the `Arc::into_raw` pointer made in `Event::on_ready` for this one
    // callback invocation; reclaiming it here balances that reference.
    let pending = unsafe { Arc::from_raw(user_arg.cast_const().cast::<Pending>()) };
    // Ownership of `err` is passed to the callback (header); `check` destroys it.
    let result = pending.event.api().check(err);
    if let Some(cb) = pending.take() {
        // A panic must not unwind into the plugin's C++ frames.
        if catch_unwind(AssertUnwindSafe(move || cb(result))).is_err() {
            tracing::error!("panic in a PJRT event callback (ignored)");
        }
    }
}

impl Event {
    /// Wraps an owned, non-null `PJRT_Event*`.
    pub(crate) fn from_raw(client: Client, raw: *mut sys::PJRT_Event) -> Event {
        Event { client, raw }
    }

    fn api(&self) -> Api {
        self.client.plugin().api()
    }

    /// Blocks the calling thread until the event is ready (`PJRT_Event_Await`), then returns the
    /// work's status.
    ///
    /// Errors: the error of the asynchronous work, or `Unimplemented` if the plugin lacks
    /// `PJRT_Event_Await`.
    pub fn wait_blocking(self) -> Result<()> {
        self.await_ready()
            .unwrap_or_else(|| Err(Error::unimplemented("PJRT_Event_Await missing")))
    }

    /// `Some(status)` once the event is ready (blocking); `None` if waiting was impossible
    /// (plugin lacks `PJRT_Event_Await`), in which case the event's state is unknown.
    pub(crate) fn await_ready(&self) -> Option<Result<()>> {
        let api = self.api();
        let f = api_fn!(api, PJRT_Event_Await).ok()?;
        let mut args = sys::PJRT_Event_Await_Args::new();
        args.event = self.raw;
        // SAFETY: `self.raw` is a live event owned by `self`; `args` has the header's size.
        Some(api.check(unsafe { f(&mut args) }))
    }

    /// Waits for the event without blocking the calling thread: the plugin's `OnReady`
    /// callback completes a `tokio::sync::oneshot` channel. Works under any async runtime.
    ///
    /// Errors: the error of the asynchronous work; `Internal` if the callback was lost.
    pub async fn wait(self) -> Result<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.on_ready(move |r| {
            let _ = tx.send(r);
        });
        rx.await
            .map_err(|_| Error::internal("PJRT event callback was dropped"))?
    }

    /// True if the event has completed, successfully or not (`PJRT_Event_IsReady`).
    ///
    /// Errors: the plugin's error, or `Unimplemented` if it lacks the function.
    pub fn is_ready(&self) -> Result<bool> {
        let api = self.api();
        let f = api_fn!(api, PJRT_Event_IsReady)?;
        let mut args = sys::PJRT_Event_IsReady_Args::new();
        args.event = self.raw;
        // SAFETY: `self.raw` is a live event owned by `self`; `args` has the header's size.
        api.check(unsafe { f(&mut args) })?;
        Ok(args.is_ready)
    }

    /// Runs `f` with the event's status once it is ready, on whatever thread the plugin
    /// completes it (possibly the current one, before this returns). `f` must not block for
    /// long: it may run on a plugin worker thread.
    ///
    /// `f` is always either called exactly once or (only if the plugin misbehaves: OnReady and
    /// Await both unusable) leaked, never dropped uncalled while the event may still be pending;
    /// callers may therefore move memory that the pending work writes into `f`.
    pub fn on_ready(self, f: impl FnOnce(Result<()>) + Send + 'static) {
        let api = self.api();
        let pending = Arc::new(Pending {
            event: self,
            callback: Mutex::new(Some(Box::new(f))),
        });
        let register = match api_fn!(api, PJRT_Event_OnReady) {
            Ok(register) => register,
            Err(e) => {
                tracing::warn!("{e}; waiting for the event synchronously");
                return Self::finish_blocking(pending);
            }
        };
        let mut args = sys::PJRT_Event_OnReady_Args::new();
        args.event = pending.event.raw;
        args.callback = Some(on_ready_trampoline);
        let user_arg = Arc::into_raw(Arc::clone(&pending));
        args.user_arg = user_arg.cast_mut().cast::<c_void>();
        // SAFETY: the event is alive (owned by `pending`, which outlives the call); the
        // trampoline matches `PJRT_Event_OnReadyCallback`; `user_arg` is a leaked Arc reference
        // that the trampoline reclaims exactly once.
        let err = unsafe { register(&mut args) };
        if let Err(e) = api.check(err) {
            // Registration failed, so the callback presumably never runs; its Arc reference is
            // deliberately leaked in case it does (it then finds no closure and returns).
            tracing::warn!("PJRT_Event_OnReady failed ({e}); waiting synchronously");
            Self::finish_blocking(pending);
        }
    }

    /// Fallback of `on_ready`: block until ready, then run the closure (or leak it if the event
    /// state cannot be known).
    fn finish_blocking(pending: Arc<Pending>) {
        match pending.event.await_ready() {
            Some(result) => {
                if let Some(cb) = pending.take() {
                    cb(result);
                }
            }
            None => {
                tracing::error!("cannot wait for a PJRT event; leaking its callback");
                std::mem::forget(pending);
            }
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let api = self.api();
        match api_fn!(api, PJRT_Event_Destroy) {
            Ok(f) => {
                let mut args = sys::PJRT_Event_Destroy_Args::new();
                args.event = self.raw;
                // SAFETY: `self.raw` is owned by this value and destroyed exactly once, here.
                if let Err(e) = api.check(unsafe { f(&mut args) }) {
                    tracing::warn!("PJRT_Event_Destroy: {e}");
                }
            }
            Err(e) => tracing::warn!("{e}"),
        }
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").field("raw", &self.raw).finish()
    }
}
