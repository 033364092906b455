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
///
/// `Display` and `Debug` both print `KIND: MESSAGE` (`compile-failed: ...`), so that
/// `fn main() -> Result<(), tpubox_guest::Error>` ends a guest with a readable
/// `Error: KIND: MESSAGE` on stderr; `{:#?}` prints the struct.
#[derive(Clone, PartialEq, Eq)]
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

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            f.debug_struct("Error")
                .field("kind", &self.kind)
                .field("message", &self.message)
                .finish()
        } else {
            fmt::Display::fmt(self, f)
        }
    }
}

impl std::error::Error for Error {}

/// Replaces the standard panic message with one that fits a guest: `panicked at FILE:LINE:COL:
/// MESSAGE` on stderr, without the advice to set `RUST_BACKTRACE` (the standard library has no
/// backtraces on `wasm32-wasip2`). The panic then aborts the guest as before, and `tpubox run`
/// prints the guest's backtrace, with source lines when the guest was built with debug line
/// tables (`[profile.release] debug = "line-tables-only"`).
///
/// Call it first in `main`; it replaces any hook set before.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(a panic payload that is not a string)");
        match info.location() {
            Some(l) => eprintln!(
                "panicked at {}:{}:{}: {message}",
                l.file(),
                l.line(),
                l.column()
            ),
            None => eprintln!("panicked: {message}"),
        }
    }));
}

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
        // What `fn main() -> Result<(), Error>` prints after `Error: `.
        assert_eq!(format!("{boxed:?}"), "invalid-argument: x");
        let e = Error::new(ErrorKind::NotFound, "w");
        assert_eq!(
            format!("{e:#?}"),
            "Error {\n    kind: ErrorKind::NotFound,\n    message: \"w\",\n}"
        );
    }
}
