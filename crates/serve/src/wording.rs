//! The error messages clients parse, in Triton's words, kept in one table.
//!
//! Triton clients (and the tools built on them: load balancers, retry wrappers, test suites)
//! recognise some failures by their message, not only by status: an unknown model, a version
//! string that is not a number, typed `contents` mixed with `raw_input_contents`, a failed
//! load. tpubox says those in the words Triton's server uses (`src/` of
//! triton-inference-server/server and core: `model_repository_manager.cc`,
//! `GetModelVersionFromString`, `grpc/infer_handler.cc`, `http_server.cc`), and adds its own
//! detail after them, never before.
//!
//! | failure | message | kind |
//! |---|---|---|
//! | unknown model (or one the tenant may not call) | `Request for unknown model: 'M' is not found` | not found |
//! | unknown version of a known model | `Request for unknown model: 'M' version V is not found` | not found |
//! | version string not an integer | `failed to get model version from specified version string 'V' (details: …), version should be an integral value > 0` | bad request |
//! | negative version | `invalid model version specified 'V' , version should be an integral value > 0` | bad request |
//! | typed contents and raw contents | `contents field must not be specified when using raw_input_contents for 'I' for model 'M'` | bad request |
//! | a load that fails (also an invalid config override) | `failed to load 'M', …` | bad request |
//! | a load of a model the repository does not have (or the tenant may not call) | `failed to load 'M', failed to poll from model repository` | not found |
//! | a load with a `file:` parameter | `failed to load 'M', failed to poll from model repository: …` | internal (500 / `INTERNAL`, as Triton answers) |
//! | a stateful model's request without a sequence id | `inference request to model 'M' must specify a non-zero or non-empty correlation ID` | bad request |
//! | a unary inference (HTTP `infer`) to a decoupled model | `HTTP end point doesn't support models with decoupled transaction policy` | unsupported (501) |
//! | a unary inference (gRPC `ModelInfer`) to a decoupled model | `ModelInfer RPC doesn't support models with decoupled transaction policy` | unsupported (`UNIMPLEMENTED`) |
//! | a sequence's request before its start | `inference request for sequence N to model 'M' must specify the START flag on the first request of the sequence` | bad request |

use super::error::{ServeError, ServeErrorKind};
use tpubox_core::logsafe::clip;

/// The model `name` does not exist, or the tenant may not call it (answered alike).
pub fn unknown_model(name: &str) -> ServeError {
    ServeError::new(
        ServeErrorKind::NotFound,
        format!("Request for unknown model: '{}' is not found", clip(name)),
    )
}

/// The model `name` exists, without version `version`.
pub fn unknown_version(name: &str, version: i64) -> ServeError {
    ServeError::new(
        ServeErrorKind::NotFound,
        format!(
            "Request for unknown model: '{}' version {version} is not found",
            clip(name)
        ),
    )
}

/// A request's model version string: `None` for empty (the latest), else the integer it is.
///
/// Errors: bad request, in Triton's words, for a string that is not an integer or is negative.
pub fn parse_version(version: &str) -> Result<Option<i64>, ServeError> {
    if version.is_empty() {
        return Ok(None);
    }
    let v: i64 = version.trim().parse().map_err(|e| {
        ServeError::bad_request(format!(
            "failed to get model version from specified version string '{}' (details: {e}), version should be an integral value > 0",
            clip(version)
        ))
    })?;
    if v < 0 {
        return Err(ServeError::bad_request(format!(
            "invalid model version specified '{}' , version should be an integral value > 0",
            clip(version)
        )));
    }
    Ok(Some(v))
}

/// A gRPC input carries both typed `contents` and an entry of `raw_input_contents`.
pub fn contents_with_raw(input: &str, model: &str) -> ServeError {
    ServeError::bad_request(format!(
        "contents field must not be specified when using raw_input_contents for '{}' for model '{}'",
        clip(input),
        clip(model)
    ))
}

/// A request to the stateful model `model` names no sequence (or sequence 0 / "").
pub fn no_correlation_id(model: &str) -> ServeError {
    ServeError::bad_request(format!(
        "inference request to model '{}' must specify a non-zero or non-empty correlation ID",
        clip(model)
    ))
}

/// A request of sequence `id` of the stateful model `model` that was never started (or was
/// released: ended, idle too long).
pub fn sequence_not_started(model: &str, id: &crate::protocol::SequenceId) -> ServeError {
    ServeError::bad_request(format!(
        "inference request for sequence {} to model '{}' must specify the START flag on the first request of the sequence",
        clip(&id.to_string()),
        clip(model)
    ))
}

/// The door that cannot answer a decoupled model: a unary call answers once, a decoupled
/// model may answer any number of times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnaryDoor {
    /// REST `POST /v2/models/M/infer`.
    Http,
    /// gRPC `ModelInfer`.
    Grpc,
}

/// A unary inference reached the decoupled model `model` through `door`.
pub fn decoupled_unary(door: UnaryDoor, model: &str) -> ServeError {
    let what = match door {
        UnaryDoor::Http => "HTTP end point",
        UnaryDoor::Grpc => "ModelInfer RPC",
    };
    ServeError::new(
        ServeErrorKind::Unsupported,
        format!(
            "{what} doesn't support models with decoupled transaction policy (model '{model}': stream it with ModelStreamInfer or /v2/models/{model}/generate_stream)",
            model = clip(model)
        ),
    )
}

/// Loading the model `name` failed because of `reason`.
pub fn failed_to_load(name: &str, reason: &str) -> ServeError {
    ServeError::bad_request(format!("failed to load '{}', {reason}", clip(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoed_names_are_clipped() {
        let name = "m".repeat(1 << 20);
        let e = unknown_model(&name);
        assert!(e.message.len() < 300, "{}", e.message.len());
        assert!(e.message.contains("…[+1048448 bytes]"), "{}", e.message);
        assert!(
            unknown_model("dtypes").message == "Request for unknown model: 'dtypes' is not found"
        );
        assert!(
            parse_version(&"x".repeat(1 << 20))
                .unwrap_err()
                .message
                .len()
                < 400
        );
    }

    #[test]
    fn versions() {
        assert_eq!(parse_version("").unwrap(), None);
        assert_eq!(parse_version("1").unwrap(), Some(1));
        assert_eq!(parse_version("007").unwrap(), Some(7));
        let e = parse_version("one").unwrap_err();
        assert!(
            e.message
                .starts_with("failed to get model version from specified version string 'one'"),
            "{}",
            e.message
        );
        assert_eq!(e.kind, ServeErrorKind::BadRequest);
        let e = parse_version("-2").unwrap_err();
        assert!(
            e.message
                .starts_with("invalid model version specified '-2'")
        );
    }
}
