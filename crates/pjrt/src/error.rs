//! Errors: PJRT `PJRT_Error` values (code + message) and wrapper-side validation failures.

use pjrt_sys as sys;

/// Status code of an [`Error`]. Same set and meaning as `PJRT_Error_Code` in the C API header,
/// which follows the absl status codes (<https://abseil.io/docs/cpp/guides/status-codes>).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// `PJRT_Error_Code_CANCELLED` (1).
    Cancelled,
    /// `PJRT_Error_Code_UNKNOWN` (2); also used for codes this crate does not know.
    Unknown,
    /// `PJRT_Error_Code_INVALID_ARGUMENT` (3); also every wrapper-side validation failure.
    InvalidArgument,
    /// `PJRT_Error_Code_DEADLINE_EXCEEDED` (4).
    DeadlineExceeded,
    /// `PJRT_Error_Code_NOT_FOUND` (5); also a plugin file that does not exist.
    NotFound,
    /// `PJRT_Error_Code_ALREADY_EXISTS` (6).
    AlreadyExists,
    /// `PJRT_Error_Code_PERMISSION_DENIED` (7).
    PermissionDenied,
    /// `PJRT_Error_Code_RESOURCE_EXHAUSTED` (8).
    ResourceExhausted,
    /// `PJRT_Error_Code_FAILED_PRECONDITION` (9); also a plugin with an unsupported API version.
    FailedPrecondition,
    /// `PJRT_Error_Code_ABORTED` (10).
    Aborted,
    /// `PJRT_Error_Code_OUT_OF_RANGE` (11).
    OutOfRange,
    /// `PJRT_Error_Code_UNIMPLEMENTED` (12); also a C API function missing from the plugin's
    /// function table, or a type/shape this crate does not support.
    Unimplemented,
    /// `PJRT_Error_Code_INTERNAL` (13).
    Internal,
    /// `PJRT_Error_Code_UNAVAILABLE` (14).
    Unavailable,
    /// `PJRT_Error_Code_DATA_LOSS` (15).
    DataLoss,
    /// `PJRT_Error_Code_UNAUTHENTICATED` (16).
    Unauthenticated,
}

impl ErrorCode {
    /// Maps a raw `PJRT_Error_Code`; `OK` and unknown values map to [`ErrorCode::Unknown`]
    /// (an error object always means failure).
    pub(crate) fn from_raw(code: sys::PJRT_Error_Code) -> Self {
        match code {
            sys::PJRT_Error_Code_CANCELLED => Self::Cancelled,
            sys::PJRT_Error_Code_INVALID_ARGUMENT => Self::InvalidArgument,
            sys::PJRT_Error_Code_DEADLINE_EXCEEDED => Self::DeadlineExceeded,
            sys::PJRT_Error_Code_NOT_FOUND => Self::NotFound,
            sys::PJRT_Error_Code_ALREADY_EXISTS => Self::AlreadyExists,
            sys::PJRT_Error_Code_PERMISSION_DENIED => Self::PermissionDenied,
            sys::PJRT_Error_Code_RESOURCE_EXHAUSTED => Self::ResourceExhausted,
            sys::PJRT_Error_Code_FAILED_PRECONDITION => Self::FailedPrecondition,
            sys::PJRT_Error_Code_ABORTED => Self::Aborted,
            sys::PJRT_Error_Code_OUT_OF_RANGE => Self::OutOfRange,
            sys::PJRT_Error_Code_UNIMPLEMENTED => Self::Unimplemented,
            sys::PJRT_Error_Code_INTERNAL => Self::Internal,
            sys::PJRT_Error_Code_UNAVAILABLE => Self::Unavailable,
            sys::PJRT_Error_Code_DATA_LOSS => Self::DataLoss,
            sys::PJRT_Error_Code_UNAUTHENTICATED => Self::Unauthenticated,
            _ => Self::Unknown,
        }
    }
}

/// An error from a PJRT plugin (code from `PJRT_Error_GetCode`, text from `PJRT_Error_Message`)
/// or from this crate's own validation (usually [`ErrorCode::InvalidArgument`]).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct Error {
    /// Status code.
    pub code: ErrorCode,
    /// Human-readable reason.
    pub message: String,
}

impl Error {
    /// An error with the given code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub(crate) fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }
    pub(crate) fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Unimplemented, message)
    }
    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
}

/// `std::result::Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
