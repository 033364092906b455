//! Entry points for the fuzz target `doors` (`fuzz/harness/doors.rs`): the inference doors'
//! request decoding, in process and without a model, through the daemon's own code: the REST
//! door's body split (`Inference-Header-Content-Length`) and JSON request decoder, the gRPC
//! door's framing, bounded codec ([`crate::grpc::BoundedCodec`]) and `ModelInferRequest`
//! conversion, and a model configuration read from text (a repository load's config
//! override, a `config.pbtxt`). Not an API: nothing in the daemon calls it.

use bytes::Bytes;
use tonic::Status;
use tonic::codec::Codec as _;

use crate::config::ModelConfig;
use crate::error::ServeResult;
use crate::grpc::BoundedCodec;
use crate::grpc::inference::{ModelInferRequest, RepositoryModelLoadRequest};
use crate::protocol::InferRequest;
use crate::triton_schema::Format;

/// A REST inference request: the body split as its `Inference-Header-Content-Length` header
/// (`header_length`, the header's raw value, when sent) says, then decoded.
///
/// Errors: as the REST door answers them.
pub fn rest_infer(header_length: Option<&[u8]>, body: &[u8]) -> ServeResult<InferRequest> {
    let mut headers = axum::http::HeaderMap::new();
    if let Some(v) = header_length {
        match axum::http::HeaderValue::from_bytes(v) {
            Ok(v) => {
                headers.insert(crate::rest::HEADER_LENGTH, v);
            }
            // hyper refuses such a header before the door sees it.
            Err(_) => return Ok(InferRequest::default()),
        }
    }
    let (header, binary) = crate::rest::split_body(&headers, body)?;
    crate::protocol::request_from_json(header, binary)
}

/// A gRPC `ModelInfer` request: the messages of a body of DATA frames `frames` (messages up
/// to `max_message_bytes`), through tonic's framing and the door's bounded codec, converted
/// as the door converts it.
///
/// Errors: the status the client would get.
pub fn grpc_infer(frames: Vec<Bytes>, max_message_bytes: usize) -> Result<InferRequest, Status> {
    let decoder = BoundedCodec::<ModelInferRequest, ModelInferRequest>::default().decoder();
    let mut ms =
        tpubox_session_api::fuzzing::decode_body(decoder, frames, max_message_bytes, true)?;
    crate::grpc::decode_request(ms.remove(0)).map_err(crate::grpc::status)
}

/// A gRPC repository load request: decoded through the door's bounded codec, its load
/// parameters checked, its `config` override (when it has one) read as a model's
/// configuration.
///
/// Errors: the status the client would get (`INVALID_ARGUMENT` for a bad override, as the
/// load's failure).
pub fn grpc_load(frames: Vec<Bytes>, max_message_bytes: usize) -> Result<(), Status> {
    let decoder =
        BoundedCodec::<RepositoryModelLoadRequest, RepositoryModelLoadRequest>::default().decoder();
    let mut ms =
        tpubox_session_api::fuzzing::decode_body(decoder, frames, max_message_bytes, true)?;
    let r = ms.remove(0);
    crate::repository::check_load_parameters(
        &r.model_name,
        r.parameters.keys().map(String::as_str),
    )
    .map_err(crate::grpc::status)?;
    if let Some(c) = r.parameters.get("config")
        && let Some(
            crate::grpc::inference::model_repository_parameter::ParameterChoice::StringParam(text),
        ) = &c.parameter_choice
    {
        config(text, 2).map_err(|e| Status::invalid_argument(format!("{e:#}")))?;
    }
    Ok(())
}

/// A model configuration read from `text` as format `format` (0: `config.pbtxt`, 1: TOML,
/// else JSON, as a load's config override is) for a model directory named `model`, with
/// every check a load applies before it looks at the model's files.
///
/// Errors: as a load reports them.
pub fn config(text: &str, format: u8) -> anyhow::Result<ModelConfig> {
    let format = match format {
        0 => Format::Pbtxt,
        1 => Format::Toml,
        _ => Format::Json,
    };
    let n = crate::triton_schema::normalize(text, format, "the fuzzed configuration")?;
    ModelConfig::build("model", n, "the fuzzed configuration")
}
