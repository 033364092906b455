//! The server's error type: one kind per way a request can fail, with the HTTP status and the
//! gRPC code each front door sends for it.

use tpubox_core::error::{DeviceError, ErrorKind};

/// How a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServeErrorKind {
    /// Malformed request, wrong shape or datatype, unknown input: HTTP 400, gRPC
    /// `INVALID_ARGUMENT`.
    BadRequest,
    /// Unknown model or version, or a model the tenant may not call (answered alike, so a
    /// tenant cannot tell which models exist): HTTP 400 (Triton's status for it), gRPC
    /// `NOT_FOUND`.
    NotFound,
    /// The model exists but is not loaded: HTTP 400, gRPC `UNAVAILABLE`.
    NotReady,
    /// No token or an unknown one: HTTP 401, gRPC `UNAUTHENTICATED`.
    Unauthenticated,
    /// The tenant may not do this (load or unload without `repository_control`, read the
    /// metrics without `metrics`): HTTP 403, gRPC `PERMISSION_DENIED`.
    Forbidden,
    /// A limit was reached (in-flight, rate, queue size, the model's device limits): HTTP 429,
    /// gRPC `RESOURCE_EXHAUSTED`.
    TooManyRequests,
    /// The body is larger than the server accepts: HTTP 413, gRPC `RESOURCE_EXHAUSTED`.
    PayloadTooLarge,
    /// The server is shutting down: HTTP 503, gRPC `UNAVAILABLE`.
    ShuttingDown,
    /// The model failed (trapped, returned an error, broke its contract): HTTP 500, gRPC
    /// `INTERNAL`.
    Internal,
    /// The call cannot serve this model (a unary inference to a decoupled model): HTTP 501,
    /// gRPC `UNIMPLEMENTED` (Triton's `TRITONSERVER_ERROR_UNSUPPORTED`).
    Unsupported,
}

/// A failed request: its kind, a message for the client, and the limit that refused it.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeError {
    /// The kind.
    pub kind: ServeErrorKind,
    /// What happened, for the client's `{"error": ...}`.
    pub message: String,
    /// The limit's name when a limit refused the request (`max-in-flight`,
    /// `max-requests-per-second`, `max-queue-size`, or a tenant limit such as
    /// `max-device-bytes`); the `limit` label of `tpubox_refused_requests_total`.
    pub limit: Option<&'static str>,
}

/// `message`, cut to [`tpubox_core::logsafe::LINE_BYTES`] with a marker if it is longer.
fn bounded(message: String) -> String {
    use tpubox_core::logsafe::{Clip, LINE_BYTES};
    if message.len() <= LINE_BYTES {
        message
    } else {
        Clip::with_max(&message, LINE_BYTES).to_string()
    }
}

/// A result with a [`ServeError`].
pub type ServeResult<T> = Result<T, ServeError>;

impl ServeError {
    /// An error of `kind`. A message over [`tpubox_core::logsafe::LINE_BYTES`] is cut there
    /// (a backstop: client-controlled names in it are clipped where it is written), so that no
    /// answer echoes a huge request back.
    pub fn new(kind: ServeErrorKind, message: impl Into<String>) -> Self {
        ServeError {
            kind,
            message: bounded(message.into()),
            limit: None,
        }
    }

    /// A bad request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ServeErrorKind::BadRequest, message)
    }

    /// A request refused by the limit `limit`.
    pub fn limited(limit: &'static str, message: impl Into<String>) -> Self {
        ServeError {
            kind: ServeErrorKind::TooManyRequests,
            message: bounded(message.into()),
            limit: Some(limit),
        }
    }

    /// The HTTP status the REST door answers with.
    pub fn status_code(&self) -> u16 {
        match self.kind {
            ServeErrorKind::BadRequest | ServeErrorKind::NotFound | ServeErrorKind::NotReady => 400,
            ServeErrorKind::Unauthenticated => 401,
            ServeErrorKind::Forbidden => 403,
            ServeErrorKind::PayloadTooLarge => 413,
            ServeErrorKind::TooManyRequests => 429,
            ServeErrorKind::ShuttingDown => 503,
            ServeErrorKind::Internal => 500,
            ServeErrorKind::Unsupported => 501,
        }
    }

    /// An error from a model's `infer` (its WIT `error`): `invalid-argument` is the client's
    /// fault, `resource-exhausted` a limit (the message names it), the rest the model's.
    pub fn from_model(model: &str, e: &DeviceError) -> Self {
        let message = format!("model `{model}`: {}: {}", e.kind.as_str(), e.message);
        match e.kind {
            ErrorKind::InvalidArgument => Self::bad_request(message),
            ErrorKind::ResourceExhausted => ServeError {
                kind: ServeErrorKind::TooManyRequests,
                limit: Some(limit_named_in(&e.message)),
                message,
            },
            _ => Self::new(ServeErrorKind::Internal, message),
        }
    }
}

/// The tenant limit a `resource-exhausted` message names, for metrics labels.
fn limit_named_in(message: &str) -> &'static str {
    // A name that another one starts with comes after it (`max-compile-workers`).
    const LIMITS: [&str; 15] = [
        "max-device-bytes-per-device",
        "max-device-bytes",
        "max-published-bytes",
        "max-published-versions",
        "max-live-tensors",
        "max-live-executables",
        "max-program-bytes",
        "max-compiles-per-minute",
        "max-guest-memory",
        "max-pending-launches",
        "max-compile-seconds",
        "max-compile-memory",
        "max-compile-resident",
        "max-compile-workers-per-tenant",
        "max-compile-workers",
    ];
    LIMITS
        .into_iter()
        .find(|l| message.contains(l))
        .unwrap_or("other")
}

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ServeError {}
