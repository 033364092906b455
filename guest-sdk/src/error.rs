//! [`Error`], the error type of every fallible call, its [`ErrorKind`] and [`Result`].

use std::fmt;

use crate::ErrorKind;
use crate::bindings::tpubox::device::types as raw_types;

/// The error type of every fallible tpubox call.
///
/// Errors returned by the host carry the host's [`ErrorKind`] and message unchanged. Errors
/// detected guest-side before a host call (a slice whose length does not match its dims, a
/// dtype mismatch in [`Tensor::to_vec`](crate::Tensor::to_vec), ...) use the same kinds the host would have used,
/// normally [`ErrorKind::InvalidArgument`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    /// Creates an error of `kind` with a human-readable `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }

    /// Shorthand for an [`ErrorKind::InvalidArgument`] error.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    /// The class of the failure; branch on this.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// What happened, in words (for compile failures, the compiler's diagnostics).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.name(), self.message)
    }
}

impl std::error::Error for Error {}

impl From<raw_types::Error> for Error {
    fn from(e: raw_types::Error) -> Self {
        Error {
            kind: e.kind,
            message: e.message,
        }
    }
}

impl From<Error> for raw_types::Error {
    fn from(e: Error) -> Self {
        raw_types::Error {
            kind: e.kind,
            message: e.message,
        }
    }
}

/// `Result<T, tpubox_guest::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl ErrorKind {
    /// The WIT name of this kind, e.g. `"invalid-argument"`.
    pub const fn name(self) -> &'static str {
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

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_conversions_and_display() {
        let raw = raw_types::Error {
            kind: ErrorKind::CompileFailed,
            message: "bad op".into(),
        };
        let e: Error = raw.clone().into();
        assert_eq!(e.kind(), ErrorKind::CompileFailed);
        assert_eq!(e.to_string(), "compile-failed: bad op");
        let back: raw_types::Error = e.into();
        assert_eq!(back, raw);
        let boxed: Box<dyn std::error::Error> = Box::new(Error::invalid_argument("x"));
        assert_eq!(boxed.to_string(), "invalid-argument: x");
    }
}
