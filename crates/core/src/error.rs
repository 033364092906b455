//! The host's error type: a kind a guest can branch on plus a message for people.
//!
//! The kinds mirror `error-kind` in `wit/device.wit`; `tpubox_wasm::wit` converts one into the other.

use std::fmt;

/// The class of a failure, one-to-one with the WIT `error-kind` enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A malformed value: byte length vs dtype × dims, bad dims, wrong argument dtype or dims.
    InvalidArgument,
    /// A named thing (device, weight set, tensor name) does not exist.
    NotFound,
    /// The state forbids the call: a donated tensor, a tensor on another device.
    FailedPrecondition,
    /// The caller may not do this (for example donate a shared, read-only tensor).
    PermissionDenied,
    /// A limit would be exceeded; the message names the limit.
    ResourceExhausted,
    /// The host or its plugin does not support the request.
    Unsupported,
    /// The program did not parse, verify or compile.
    CompileFailed,
    /// The device failed while executing.
    ExecutionFailed,
    /// A fault inside the host or the plugin.
    Internal,
}

impl ErrorKind {
    /// The kebab-case name used in WIT and in CLI messages, e.g. `"invalid-argument"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid-argument",
            ErrorKind::NotFound => "not-found",
            ErrorKind::FailedPrecondition => "failed-precondition",
            ErrorKind::PermissionDenied => "permission-denied",
            ErrorKind::ResourceExhausted => "resource-exhausted",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::CompileFailed => "compile-failed",
            ErrorKind::ExecutionFailed => "execution-failed",
            ErrorKind::Internal => "internal",
        }
    }
}

impl ErrorKind {
    /// Every kind, in the order of the WIT enum.
    pub const ALL: [ErrorKind; 9] = [
        ErrorKind::InvalidArgument,
        ErrorKind::NotFound,
        ErrorKind::FailedPrecondition,
        ErrorKind::PermissionDenied,
        ErrorKind::ResourceExhausted,
        ErrorKind::Unsupported,
        ErrorKind::CompileFailed,
        ErrorKind::ExecutionFailed,
        ErrorKind::Internal,
    ];

    /// The kind whose [`as_str`](Self::as_str) is `name`, if any.
    pub fn from_name(name: &str) -> Option<ErrorKind> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

/// An error from a device operation: its [`ErrorKind`] and a message saying what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceError {
    /// What class of failure this is.
    pub kind: ErrorKind,
    /// A sentence for people: what was wrong and what was expected.
    pub message: String,
}

impl DeviceError {
    /// Builds an error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        DeviceError {
            kind,
            message: message.into(),
        }
    }

    /// Shorthand for [`ErrorKind::InvalidArgument`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    /// Maps an error from the PJRT wrapper, using `fallback` for codes that carry no better
    /// meaning in context (for example `CompileFailed` when compiling).
    pub fn from_pjrt(err: pjrt::Error, fallback: ErrorKind) -> Self {
        use pjrt::ErrorCode as C;
        let kind = match err.code {
            C::InvalidArgument if fallback == ErrorKind::CompileFailed => ErrorKind::CompileFailed,
            C::InvalidArgument | C::OutOfRange => ErrorKind::InvalidArgument,
            C::NotFound => ErrorKind::NotFound,
            C::FailedPrecondition => ErrorKind::FailedPrecondition,
            C::PermissionDenied => ErrorKind::PermissionDenied,
            C::ResourceExhausted => ErrorKind::ResourceExhausted,
            C::Unimplemented => ErrorKind::Unsupported,
            _ => fallback,
        };
        DeviceError::new(kind, err.message)
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)
    }
}

impl std::error::Error for DeviceError {}

/// Result of a device operation.
pub type DeviceResult<T> = Result<T, DeviceError>;
