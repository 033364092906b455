//! The REST front door (KServe v2 / Triton HTTP, default port 8000) and the metrics listener
//! (default 8002). Handlers only translate HTTP to [`Server`] calls and back.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde_json::{Value, json};

use super::error::{ServeError, ServeErrorKind, ServeResult};
use super::model::{Model, VERSION};
use super::protocol::{InferRequest, request_from_json, response_to_json};
use super::{EXTENSIONS, SERVER_NAME, Server};
use tpubox_core::logsafe::clip;

/// The header that gives the JSON part's length in a binary-extension body.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

type S = State<Arc<Server>>;

/// A [`ServeError`] as an HTTP response: its status and `{"error": message}`.
struct ErrorResponse(ServeError);

impl From<ServeError> for ErrorResponse {
    fn from(e: ServeError) -> Self {
        ErrorResponse(e)
    }
}

impl IntoResponse for ErrorResponse {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status_code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, axum::Json(json!({ "error": self.0.message }))).into_response();
        match status {
            StatusCode::UNAUTHORIZED => {
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            StatusCode::TOO_MANY_REQUESTS => {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        r
    }
}

type R<T> = Result<T, ErrorResponse>;

fn auth(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

/// The REST router over `server`.
pub fn router(server: Arc<Server>) -> Router {
    let limit = server.max_request_bytes;
    Router::new()
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2", get(server_metadata))
        .route("/v2/models/stats", get(all_stats))
        .route("/v2/models/{m}", get(model_metadata))
        .route("/v2/models/{m}/versions/{v}", get(model_metadata_v))
        .route("/v2/models/{m}/ready", get(model_ready))
        .route("/v2/models/{m}/versions/{v}/ready", get(model_ready_v))
        .route("/v2/models/{m}/config", get(model_config))
        .route("/v2/models/{m}/versions/{v}/config", get(model_config_v))
        .route("/v2/models/{m}/stats", get(model_stats))
        .route("/v2/models/{m}/versions/{v}/stats", get(model_stats_v))
        .route("/v2/models/{m}/infer", post(infer))
        .route("/v2/models/{m}/generate", post(generate))
        .route("/v2/models/{m}/versions/{v}/generate", post(generate_v))
        .route("/v2/models/{m}/generate_stream", post(generate_stream))
        .route(
            "/v2/models/{m}/versions/{v}/generate_stream",
            post(generate_stream_v),
        )
        .route("/v2/models/{m}/versions/{v}/infer", post(infer_v))
        .route("/v2/repository/index", post(repository_index))
        .route("/v2/repository/models/{m}/load", post(repository_load))
        .route("/v2/repository/models/{m}/unload", post(repository_unload))
        .route("/v2/systemsharedmemory/status", get(shm_status_all))
        .route(
            "/v2/systemsharedmemory/region/{r}/status",
            get(shm_status_one),
        )
        .route(
            "/v2/systemsharedmemory/region/{r}/register",
            post(shm_register),
        )
        .route(
            "/v2/systemsharedmemory/unregister",
            post(shm_unregister_all),
        )
        .route(
            "/v2/systemsharedmemory/region/{r}/unregister",
            post(shm_unregister_one),
        )
        .route("/v2/cudasharedmemory/status", get(cuda_shm_status_all))
        .route(
            "/v2/cudasharedmemory/region/{r}/status",
            get(cuda_shm_status_one),
        )
        .route("/v2/cudasharedmemory/unregister", post(cuda_shm_unregister))
        .route(
            "/v2/cudasharedmemory/region/{r}/unregister",
            post(cuda_shm_unregister),
        )
        .route("/v2/cudasharedmemory/{*rest}", get(cuda_shm).post(cuda_shm))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(server)
}

async fn shm_status_all(State(s): S, headers: HeaderMap) -> R<axum::Json<Value>> {
    Ok(axum::Json(json!(s.shm_status(auth(&headers), None)?)))
}

async fn shm_status_one(
    State(s): S,
    headers: HeaderMap,
    Path(r): Path<String>,
) -> R<axum::Json<Value>> {
    Ok(axum::Json(json!(s.shm_status(auth(&headers), Some(&r))?)))
}

async fn shm_register(
    State(s): S,
    headers: HeaderMap,
    Path(r): Path<String>,
    body: Body,
) -> R<Response> {
    let bytes = body_bytes(&s, &headers, body).await?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ServeError::bad_request(format!("the register request is not JSON: {e}")))?;
    let key = v
        .get("key")
        .and_then(Value::as_str)
        .ok_or_else(|| ServeError::bad_request("the register request needs a string `key`"))?;
    let int = |k: &str, default: Option<u64>| match v.get(k) {
        None if default.is_some() => Ok(default.unwrap_or(0)),
        Some(x) => x.as_u64().ok_or_else(|| {
            ServeError::bad_request(format!("`{k}` must be a non-negative integer"))
        }),
        None => Err(ServeError::bad_request(format!(
            "the register request needs `{k}`"
        ))),
    };
    s.shm_register(
        auth(&headers),
        &r,
        key,
        int("offset", Some(0))?,
        int("byte_size", None)?,
    )?;
    Ok(StatusCode::OK.into_response())
}

async fn shm_unregister_all(State(s): S, headers: HeaderMap) -> R<Response> {
    s.shm_unregister(auth(&headers), None)?;
    Ok(StatusCode::OK.into_response())
}

async fn shm_unregister_one(State(s): S, headers: HeaderMap, Path(r): Path<String>) -> R<Response> {
    s.shm_unregister(auth(&headers), Some(&r))?;
    Ok(StatusCode::OK.into_response())
}

async fn cuda_shm_status_all(State(s): S, headers: HeaderMap) -> R<axum::Json<Value>> {
    s.cuda_shm_status(auth(&headers), None)?;
    Ok(axum::Json(json!([])))
}

async fn cuda_shm_status_one(
    State(s): S,
    headers: HeaderMap,
    Path(r): Path<String>,
) -> R<axum::Json<Value>> {
    s.cuda_shm_status(auth(&headers), Some(&r))?;
    Ok(axum::Json(json!([])))
}

async fn cuda_shm_unregister(State(s): S, headers: HeaderMap) -> R<Response> {
    s.cuda_shm_unregister(auth(&headers))?;
    Ok(StatusCode::OK.into_response())
}

/// Registering CUDA shared memory (and any other CUDA shared-memory path).
async fn cuda_shm() -> ErrorResponse {
    ErrorResponse(ServeError::bad_request(CUDA_SHM_REFUSED))
}

/// The answer to a CUDA shared-memory registration.
pub const CUDA_SHM_REFUSED: &str = "CUDA shared memory is not supported: tpubox shares no device memory with clients (the device may be a TPU, and is shared by tenants); use system shared memory (/v2/systemsharedmemory)";

async fn not_found() -> ErrorResponse {
    ErrorResponse(ServeError::new(
        ServeErrorKind::NotFound,
        "no such endpoint (see docs/SERVING.md)",
    ))
}

async fn method_not_allowed() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        axum::Json(
            json!({"error": "this endpoint does not take that method (see docs/SERVING.md)"}),
        ),
    )
        .into_response()
}

async fn live(State(s): S) -> Response {
    (StatusCode::OK, axum::Json(json!({ "live": s.live() }))).into_response()
}

async fn ready(State(s): S) -> Response {
    let r = s.ready();
    let status = if r {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(json!({ "ready": r }))).into_response()
}

async fn server_metadata(State(s): S, headers: HeaderMap) -> R<axum::Json<Value>> {
    s.authenticate(auth(&headers))?;
    Ok(axum::Json(json!({
        "name": SERVER_NAME,
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": EXTENSIONS,
    })))
}

/// Model metadata in the protocol's JSON form.
pub fn metadata_json(m: &Model) -> Value {
    let t = |ds: &[super::instance::TensorDecl]| -> Vec<Value> {
        ds.iter()
            .map(|d| json!({"name": d.name, "datatype": d.datatype.name(), "shape": m.protocol_shape(d)}))
            .collect()
    };
    json!({
        "name": m.name,
        "versions": [VERSION],
        "platform": "tpubox",
        "inputs": t(&m.client_inputs()),
        "outputs": t(&m.metadata.outputs),
    })
}

fn model_for(s: &Server, headers: &HeaderMap, m: &str, v: Option<&str>) -> ServeResult<Arc<Model>> {
    s.authorize(auth(headers), m)?;
    s.model(m, v)
}

async fn model_metadata(
    State(s): S,
    headers: HeaderMap,
    Path(m): Path<String>,
) -> R<axum::Json<Value>> {
    let model = model_for(&s, &headers, &m, None)?;
    Ok(axum::Json(metadata_json(&model)))
}

async fn model_metadata_v(
    State(s): S,
    headers: HeaderMap,
    Path((m, v)): Path<(String, String)>,
) -> R<axum::Json<Value>> {
    let model = model_for(&s, &headers, &m, Some(&v))?;
    Ok(axum::Json(metadata_json(&model)))
}

async fn ready_response(s: &Server, headers: &HeaderMap, m: &str, v: Option<&str>) -> R<Response> {
    s.authorize(auth(headers), m)?;
    let ok = s.model(m, v).is_ok();
    // Triton answers 200 for a ready model and 400 for any other.
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_REQUEST
    };
    Ok((status, axum::Json(json!({"name": m, "ready": ok}))).into_response())
}

async fn model_ready(State(s): S, headers: HeaderMap, Path(m): Path<String>) -> R<Response> {
    ready_response(&s, &headers, &m, None).await
}

async fn model_ready_v(
    State(s): S,
    headers: HeaderMap,
    Path((m, v)): Path<(String, String)>,
) -> R<Response> {
    ready_response(&s, &headers, &m, Some(&v)).await
}

async fn model_config(
    State(s): S,
    headers: HeaderMap,
    Path(m): Path<String>,
) -> R<axum::Json<Value>> {
    Ok(axum::Json(model_for(&s, &headers, &m, None)?.config_json()))
}

async fn model_config_v(
    State(s): S,
    headers: HeaderMap,
    Path((m, v)): Path<(String, String)>,
) -> R<axum::Json<Value>> {
    Ok(axum::Json(
        model_for(&s, &headers, &m, Some(&v))?.config_json(),
    ))
}

async fn all_stats(State(s): S, headers: HeaderMap) -> R<axum::Json<Value>> {
    let visible = s.visible(auth(&headers))?;
    let models: Vec<_> = s
        .ready_models()
        .into_iter()
        .filter(|m| visible(&m.name))
        .collect();
    Ok(axum::Json(s.stats_json(&models)))
}

async fn model_stats(
    State(s): S,
    headers: HeaderMap,
    Path(m): Path<String>,
) -> R<axum::Json<Value>> {
    let model = model_for(&s, &headers, &m, None)?;
    Ok(axum::Json(s.stats_json(&[model])))
}

async fn model_stats_v(
    State(s): S,
    headers: HeaderMap,
    Path((m, v)): Path<(String, String)>,
) -> R<axum::Json<Value>> {
    let model = model_for(&s, &headers, &m, Some(&v))?;
    Ok(axum::Json(s.stats_json(&[model])))
}

/// Reads the body, refusing one over the server's limit with 413 before reading it when its
/// Content-Length says so.
async fn body_bytes(s: &Server, headers: &HeaderMap, body: Body) -> ServeResult<Bytes> {
    let too_large = || {
        ServeError::new(
            ServeErrorKind::PayloadTooLarge,
            format!(
                "the request body is larger than this server accepts ({} bytes; tpubox serve --max-request-mib)",
                s.max_request_bytes
            ),
        )
    };
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > s.max_request_bytes as u64
    {
        return Err(too_large());
    }
    axum::body::to_bytes(body, s.max_request_bytes)
        .await
        .map_err(|e| {
            if std::error::Error::source(&e).is_some_and(|c| c.to_string().contains("length limit"))
                || e.to_string().contains("length limit")
            {
                too_large()
            } else {
                ServeError::bad_request(format!("reading the request body: {e}"))
            }
        })
}

/// Splits a body into the JSON header and the binary data after it, as the binary tensor
/// extension's `Inference-Header-Content-Length` says.
pub(crate) fn split_body<'a>(
    headers: &HeaderMap,
    body: &'a [u8],
) -> ServeResult<(&'a [u8], &'a [u8])> {
    match headers.get(HEADER_LENGTH) {
        None => Ok((body, &[])),
        Some(v) => {
            let n: usize = v
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| {
                    ServeError::bad_request("Inference-Header-Content-Length is not a byte count")
                })?;
            if n > body.len() {
                return Err(ServeError::bad_request(format!(
                    "Inference-Header-Content-Length is {n}, but the body has only {} bytes",
                    body.len()
                )));
            }
            Ok(body.split_at(n))
        }
    }
}

async fn infer_common(
    s: Arc<Server>,
    headers: HeaderMap,
    m: String,
    v: Option<String>,
    body: Body,
) -> R<Response> {
    let bytes = body_bytes(&s, &headers, body).await?;
    let (header_json, binary) = split_body(&headers, &bytes)?;
    let req: InferRequest = request_from_json(header_json, binary)?;
    let echo = req.without_inputs();
    let resp = s.infer(auth(&headers), &m, v.as_deref(), req).await?;
    let (json_part, binary_part) = response_to_json(&resp, &echo);
    if binary_part.is_empty() {
        return Ok((
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            json_part,
        )
            .into_response());
    }
    let len = json_part.len();
    let mut body = json_part;
    body.extend_from_slice(&binary_part);
    let mut r = (StatusCode::OK, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(HEADER_LENGTH, HeaderValue::from(len));
    Ok(r)
}

/// A generate request ([`super::generate`]) run as an inference; its response, or (for
/// `stream`) the same as server-sent events: one `data: {json}` event per response, and for a
/// failure after the stream began an event `data: {"error": "…"}` that ends it. A decoupled
/// model's responses stream as the model makes them, one event each; over plain `generate`
/// a decoupled model must answer exactly once.
async fn generate_common(
    s: Arc<Server>,
    headers: HeaderMap,
    m: String,
    v: Option<String>,
    body: Body,
    stream: bool,
) -> R<Response> {
    let bytes = body_bytes(&s, &headers, body).await?;
    let json: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ServeError::bad_request(format!("the generate request is not JSON: {e}")))?;
    // The model's inputs are needed to read the request: only for a caller that may call it.
    s.authorize(auth(&headers), &m)?;
    let model = s.model(&m, v.as_deref())?;
    let req = super::generate::request(&model, &json)?;
    if model.decoupled {
        let mut rx = s.infer_stream(auth(&headers), &m, v.as_deref(), req)?;
        if stream {
            return Ok(event_stream(Body::from_stream(sse_events(rx))));
        }
        let mut only = None;
        while let Some(item) = rx.recv().await {
            let Some(resp) = item? else { break };
            if only.is_some() {
                return Err(ServeError::bad_request(format!(
                    "model '{m}' answered this request with more than one response: use /v2/models/{m}/generate_stream"
                ))
                .into());
            }
            only = Some(resp);
        }
        let Some(resp) = only else {
            return Err(ServeError::bad_request(format!(
                "model '{m}' answered this request with no response: use /v2/models/{m}/generate_stream"
            ))
            .into());
        };
        return Ok(axum::Json(super::generate::response(&resp)).into_response());
    }
    let resp = s.infer(auth(&headers), &m, v.as_deref(), req).await?;
    let out = super::generate::response(&resp);
    if !stream {
        return Ok(axum::Json(out).into_response());
    }
    Ok(event_stream(Body::from(format!("data: {out}\n\n"))))
}

/// A `text/event-stream` response of `body`.
fn event_stream(body: Body) -> Response {
    (
        StatusCode::OK,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        body,
    )
        .into_response()
}

/// The server-sent events of a stream's responses: each response as `data: {json}`, an error
/// as `data: {"error": …}` (the last event), nothing after the end. The body is polled only
/// when the connection can take more, so a client that reads slowly holds the model back;
/// dropping the body (the client went away) drops `rx`, which cancels the request.
fn sse_events(
    rx: tokio::sync::mpsc::Receiver<ServeResult<Option<super::protocol::InferResponse>>>,
) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    futures::stream::unfold(Some(rx), |rx| async move {
        let mut rx = rx?;
        let event = match rx.recv().await? {
            Ok(Some(resp)) => (super::generate::response(&resp), Some(rx)),
            Ok(None) => return None,
            Err(e) => (json!({ "error": e.message }), None),
        };
        Some((Ok(Bytes::from(format!("data: {}\n\n", event.0))), event.1))
    })
}

async fn generate(
    State(s): S,
    headers: HeaderMap,
    Path(m): Path<String>,
    body: Body,
) -> R<Response> {
    generate_common(s, headers, m, None, body, false).await
}

async fn generate_v(
    State(s): S,
    headers: HeaderMap,
    Path((m, v)): Path<(String, String)>,
    body: Body,
) -> R<Response> {
    generate_common(s, headers, m, Some(v), body, false).await
}

async fn generate_stream(
    State(s): S,
    headers: HeaderMap,
    Path(m): Path<String>,
    body: Body,
) -> R<Response> {
    generate_common(s, headers, m, None, body, true).await
}

async fn generate_stream_v(
    State(s): S,
    headers: HeaderMap,
    Path((m, v)): Path<(String, String)>,
    body: Body,
) -> R<Response> {
    generate_common(s, headers, m, Some(v), body, true).await
}

async fn infer(State(s): S, headers: HeaderMap, Path(m): Path<String>, body: Body) -> R<Response> {
    infer_common(s, headers, m, None, body).await
}

async fn infer_v(
    State(s): S,
    headers: HeaderMap,
    Path((m, v)): Path<(String, String)>,
    body: Body,
) -> R<Response> {
    infer_common(s, headers, m, Some(v), body).await
}

async fn repository_index(State(s): S, headers: HeaderMap, body: Body) -> R<axum::Json<Value>> {
    let visible = s.visible(auth(&headers))?;
    let bytes = body_bytes(&s, &headers, body).await?;
    let ready_only = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.get("ready").and_then(Value::as_bool))
        .unwrap_or(false);
    let rows: Vec<Value> = s
        .repository
        .index()
        .into_iter()
        .filter(|e| (!ready_only || e.state == "READY") && visible(&e.name))
        .map(|e| {
            let mut v = json!({"name": e.name, "version": e.version, "state": e.state});
            if !e.reason.is_empty() {
                v["reason"] = json!(e.reason);
            }
            v
        })
        .collect();
    Ok(axum::Json(Value::Array(rows)))
}

async fn repository_load(
    State(s): S,
    headers: HeaderMap,
    Path(m): Path<String>,
    body: Body,
) -> R<Response> {
    let tenant = s.authorize_control(auth(&headers), &m, true)?;
    let bytes = body_bytes(&s, &headers, body).await?;
    let mut config = None;
    if let Ok(v) = serde_json::from_slice::<Value>(&bytes)
        && let Some(p) = v.get("parameters").and_then(Value::as_object)
    {
        super::repository::check_load_parameters(&m, p.keys().map(String::as_str))?;
        config = match p.get("config") {
            None => None,
            Some(Value::String(c)) => Some(c.clone()),
            Some(_) => {
                return Err(super::wording::failed_to_load(
                    &m,
                    "the `config` parameter must be a string holding the model configuration as JSON",
                )
                .into());
            }
        };
    }
    tracing::info!(model = %clip(&m), %tenant, config_override = config.is_some(), "load requested");
    s.repository.load_with(&m, config.as_deref()).await?;
    Ok(StatusCode::OK.into_response())
}

async fn repository_unload(State(s): S, headers: HeaderMap, Path(m): Path<String>) -> R<Response> {
    let tenant = s.authorize_control(auth(&headers), &m, false)?;
    tracing::info!(model = %clip(&m), %tenant, "unload requested");
    s.repository.unload(&m).await?;
    Ok(StatusCode::OK.into_response())
}

/// Who may use the REST door, from a request's head: the health probes are public (for
/// orchestrators; their bodies capped at [`tpubox_net::PUBLIC_BODY_BYTES`]), everything else
/// needs a token the tokens file knows (any token without a tokens file) or gets 401 before
/// its body is read. What the tenant may then do is decided by the handlers ([`Server`]).
pub fn admit(server: Arc<Server>) -> tpubox_net::Admit {
    Arc::new(move |parts: &axum::http::request::Parts| {
        if parts.uri.path().starts_with("/v2/health/") {
            return tpubox_net::Admission::Public;
        }
        match server.authenticate(auth(&parts.headers)) {
            Ok(tenant) => tpubox_net::Admission::Authenticated(tenant),
            Err(e) => tpubox_net::Admission::Refused(ErrorResponse(e).into_response()),
        }
    })
}

/// Serves the REST router on `listener` through `door` until `stop` resolves.
///
/// Errors: the listener fails.
pub async fn serve_rest(
    listener: tokio::net::TcpListener,
    server: Arc<Server>,
    door: tpubox_net::Door,
    stop: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    tpubox_net::serve(
        door,
        tpubox_net::Listener::Tcp(listener),
        router(server),
        stop,
    )
    .await
}

/// The metrics router: `GET /metrics`, Prometheus's text format. With a tokens file it needs
/// the bearer token of a tenant with `metrics = true` (401 without a known token, 403 for
/// another tenant); without one it is open.
///
/// It also serves the admin calls ([`crate::admin`]), for tenants with `admin = true`:
/// - `GET /v2/admin/sessions`: `{"sessions": [SessionRow...]}`, oldest first;
/// - `DELETE /v2/admin/sessions/{id}`: ends it; 200 with its last row, 404 for an id no live
///   session has;
/// - `POST /v2/admin/reload`: reads the tokens file and the TLS files again; 200 with a
///   [`crate::admin::ReloadReport`], 400 naming what is wrong (the files in use stay).
pub fn metrics_router(server: Arc<Server>) -> Router {
    Router::new()
        .route(
            "/v2/admin/sessions",
            get(|State(s): S, headers: HeaderMap| async move {
                s.access.admit_admin(auth(&headers))?;
                R::Ok(axum::Json(json!({ "sessions": s.admin_sessions() })))
            }),
        )
        .route(
            "/v2/admin/sessions/{id}",
            delete(
                |State(s): S, headers: HeaderMap, Path(id): Path<String>| async move {
                    let admin = s.access.admit_admin(auth(&headers))?;
                    match s.admin_end_session(&id, &admin.entry.name) {
                        Ok(row) => {
                            tracing::info!(session = %clip(&id), admin = %admin.entry.name, "session ended by an operator");
                            R::Ok(axum::Json(json!({ "ended": row })).into_response())
                        }
                        Err(e) if e.kind == ServeErrorKind::NotFound => Ok((
                            StatusCode::NOT_FOUND,
                            axum::Json(json!({ "error": e.message })),
                        )
                            .into_response()),
                        Err(e) => Err(e.into()),
                    }
                },
            ),
        )
        .route(
            "/v2/admin/reload",
            post(|State(s): S, headers: HeaderMap| async move {
                let admin = s.access.admit_admin(auth(&headers))?;
                let r = s.reload(&format!("admin call of tenant `{}`", admin.entry.name))?;
                R::Ok(axum::Json(json!(r)))
            }),
        )
        .route(
            "/metrics",
            get(|State(s): S, headers: HeaderMap| async move {
                // The text names every model and tenant: with a tokens file, only a tenant with
                // `metrics = true` reads it.
                s.access.admit_metrics(auth(&headers))?;
                R::Ok(
                    (
                        [(
                            header::CONTENT_TYPE,
                            HeaderValue::from_static("text/plain; version=0.0.4"),
                        )],
                        s.metrics_text(),
                    )
                        .into_response(),
                )
            }),
        )
        .with_state(server)
}

/// Serves `GET /metrics` on `listener` through `door` until `stop` resolves.
///
/// Errors: the listener fails.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    server: Arc<Server>,
    door: tpubox_net::Door,
    stop: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    tpubox_net::serve(
        door,
        tpubox_net::Listener::Tcp(listener),
        metrics_router(server),
        stop,
    )
    .await
}
