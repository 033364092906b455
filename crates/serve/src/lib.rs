//! `tpubox serve`: the long-lived daemon that owns the device and serves guest models over the
//! Open Inference Protocol (see `docs/SERVING.md`).
//!
//! Modules, one job each:
//! - [`protocol`]: the protocol's datatypes, tensors, requests and responses, the JSON form
//!   and the binary tensor extension;
//! - [`error`]: the server's error kinds and their HTTP statuses and gRPC codes;
//! - [`config`]: a model's `config.toml`/`config.json` (Triton's field names);
//! - [`access`]: bearer tokens → request tenants, the models they may call, in-flight and rate
//!   limits;
//! - [`instance`]: one long-lived instance of a model component;
//! - [`stablehlo`]: StableHLO models (exported program + weights), run natively through a session;
//! - [`batcher`]: the per-model queue and dynamic batching;
//! - [`model`]: a loaded model: declaration checks, its instances' tasks, statistics;
//! - [`repository`]: the model repository, load and unload at run time;
//! - [`metrics`]: Prometheus metrics with Triton's names;
//! - [`rest`] and [`grpc`]: the two front doors, translating the protocol only.
//!
//! With `--session-socket`/`--session-port` the same daemon also serves the session API
//! (the `tpubox-session-api` crate) to notebook kernels and Python clients, authenticated by the same
//! tokens file.
//!
//! [`Server`] is what both doors call: every request is admitted for its tenant
//! ([`access::Access::admit`]) and checked against the model ([`model::Model::check_request`])
//! there, so no door decides anything about tenants.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod access;
pub mod admin;
pub mod batcher;
pub mod config;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod generate;
pub mod grpc;
pub mod instance;
pub mod metrics;
pub mod model;
pub mod nn;
pub mod onnx;
pub mod protocol;
pub mod repository;
pub mod rest;
pub mod sequence;
pub mod shm;
pub mod stablehlo;
pub mod triton_schema;
pub mod wording;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use self::access::Access;
use self::error::{ServeError, ServeErrorKind, ServeResult};
use self::metrics::{Metrics, RequestRecord};
use self::model::{LoadContext, Model, VERSION};
use self::protocol::{InferRequest, InferResponse};
use self::repository::Repository;
use tpubox_core::device::DeviceService;
use tpubox_core::logsafe::clip;
use tpubox_core::weights::WeightRegistry;
use tpubox_session_api::registry::Registry;
use tpubox_session_api::{SessionAccess, SessionApiConfig};
use tpubox_wasm::sandbox::Sandbox;

/// The server's name in `GET /v2`.
pub const SERVER_NAME: &str = "tpubox";

/// Protocol extensions the server implements (`GET /v2`'s `extensions`).
pub const EXTENSIONS: [&str; 6] = [
    "binary_tensor_data",
    "system_shared_memory",
    "model_repository",
    "statistics",
    "model_configuration",
    "parameters",
];

/// How `tpubox serve` runs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The model repository directory; `None` opens no inference doors (REST and gRPC
    /// inference), only the session API and metrics.
    pub repository: Option<PathBuf>,
    /// The tokens file; `None` serves everyone as tenant `anonymous`.
    pub tokens: Option<PathBuf>,
    /// Address the three listeners bind (default 127.0.0.1).
    pub host: IpAddr,
    /// REST port (default 8000).
    pub http_port: u16,
    /// gRPC port (default 8001).
    pub grpc_port: u16,
    /// Metrics port (default 8002).
    pub metrics_port: u16,
    /// Longest SIGTERM waits for in-flight requests (default 30 s).
    pub drain: Duration,
    /// Largest request body, in bytes (REST and gRPC; default 256 MiB).
    pub max_request_bytes: usize,
    /// Exit (status 2) when a model found at start-up fails to load (default false: serve the
    /// others).
    pub exit_on_error: bool,
    /// Readiness also needs every model found at start-up loaded (default false: loaded or
    /// failed).
    pub strict_readiness: bool,
    /// The session API's listeners (none by default).
    pub sessions: SessionApiConfig,
    /// Connection caps and timeouts of every door (`tpubox_net`).
    pub doors: tpubox_net::DoorLimits,
    /// TLS on every TCP door (REST, gRPC, metrics, the session API's port): `None` serves
    /// plain text.
    pub tls: Option<tpubox_net::TlsFiles>,
    /// Serve a non-loopback address without a tokens file (`--allow-anonymous-network`).
    /// Default false: without `--tokens` the daemon refuses to start on any address but
    /// loopback, since every caller would be tenant `anonymous`.
    pub allow_anonymous_network: bool,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            repository: Some(PathBuf::from("models")),
            tokens: None,
            host: IpAddr::from([127, 0, 0, 1]),
            http_port: 8000,
            grpc_port: 8001,
            metrics_port: 8002,
            drain: Duration::from_secs(30),
            max_request_bytes: 256 << 20,
            exit_on_error: false,
            strict_readiness: false,
            sessions: SessionApiConfig::default(),
            doors: tpubox_net::DoorLimits::default(),
            tls: None,
            allow_anonymous_network: false,
        }
    }
}

/// The state both front doors share.
pub struct Server {
    /// The model repository.
    pub repository: Repository,
    /// Who may call what.
    pub access: Arc<Access>,
    /// The session API's live sessions (empty without its listeners).
    pub sessions: Arc<Registry>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The device.
    pub device: Arc<DeviceService>,
    /// Largest request body in bytes.
    pub max_request_bytes: usize,
    /// TLS of the TCP doors, which a reload reads again (`None`: plain text).
    pub tls: Option<Arc<tpubox_net::Tls>>,
    /// The tenants' registered system shared-memory regions.
    pub shm: shm::Regions,
    started_loading: AtomicBool,
    shutting_down: AtomicBool,
    strict_readiness: AtomicBool,
    in_flight: tokio::sync::watch::Sender<u64>,
}

/// Decrements the server's in-flight count when dropped.
struct InFlight<'a>(&'a tokio::sync::watch::Sender<u64>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

impl Server {
    /// A server over `repository`, with nothing loaded yet.
    pub fn new(
        repository: Repository,
        access: Arc<Access>,
        metrics: Arc<Metrics>,
        device: Arc<DeviceService>,
        max_request_bytes: usize,
        sessions: Arc<Registry>,
        tls: Option<Arc<tpubox_net::Tls>>,
    ) -> Self {
        Server {
            repository,
            access,
            sessions,
            metrics,
            device,
            max_request_bytes,
            tls,
            shm: shm::Regions::default(),
            started_loading: AtomicBool::new(false),
            shutting_down: AtomicBool::new(false),
            strict_readiness: AtomicBool::new(false),
            in_flight: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Loads every model of the repository, concurrently; readiness turns true when all have
    /// loaded or failed.
    ///
    /// Errors: the repository directory cannot be read.
    pub async fn load_all(self: &Arc<Self>) -> Result<()> {
        let names = self.repository.scan().with_context(|| {
            format!(
                "reading the model repository {}",
                self.repository.root().display()
            )
        })?;
        self.started_loading.store(true, Ordering::SeqCst);
        let mut tasks = tokio::task::JoinSet::new();
        for name in names {
            let s = Arc::clone(self);
            tasks.spawn(async move {
                let _ = s.repository.load(&name).await;
            });
        }
        while tasks.join_next().await.is_some() {}
        Ok(())
    }

    /// Whether the server is live (it is, until it exits).
    pub fn live(&self) -> bool {
        true
    }

    /// Whether the server is ready: the start-up loads are done and it is not shutting down;
    /// with strict readiness, also no model failed to load (one unloaded on purpose does not
    /// count).
    pub fn ready(&self) -> bool {
        let strict_ok = !self.strict_readiness.load(Ordering::SeqCst)
            || self.repository.states().iter().all(|(_, st)| match st {
                repository::ModelState::Unavailable(reason) => reason == "unloaded",
                _ => true,
            });
        self.started_loading.load(Ordering::SeqCst)
            && self.repository.settled()
            && !self.shutting_down.load(Ordering::SeqCst)
            && strict_ok
    }

    /// Sets strict readiness ([`ServeConfig::strict_readiness`]).
    pub fn set_strict_readiness(&self, strict: bool) {
        self.strict_readiness.store(strict, Ordering::SeqCst);
    }

    /// The model `name` at `version` (`None` or `"1"`), ready.
    ///
    /// Errors: not found for an unknown model (whatever the version), or another version of a
    /// known one; not ready.
    pub fn model(&self, name: &str, version: Option<&str>) -> ServeResult<Arc<Model>> {
        if !self.repository.knows(name) {
            return Err(repository::unknown_model(name));
        }
        if let Some(v) = wording::parse_version(version.unwrap_or(""))?
            && v.to_string() != VERSION
        {
            return Err(wording::unknown_version(name, v));
        }
        self.repository.get(name)
    }

    /// Every ready model.
    pub fn ready_models(&self) -> Vec<Arc<Model>> {
        self.repository
            .states()
            .into_iter()
            .filter_map(|(_, s)| match s {
                repository::ModelState::Ready(m) => Some(m),
                _ => None,
            })
            .collect()
    }

    /// Admits a caller for a non-inference call that names no model (metadata, repository,
    /// statistics).
    ///
    /// Returns the tenant's name.
    ///
    /// Errors: unauthenticated.
    pub fn authenticate(&self, authorization: Option<&str>) -> ServeResult<String> {
        self.access
            .identify(authorization)
            .map(|t| t.entry.name.clone())
    }

    /// Admits a caller for `model` (its metadata, config, stats, readiness).
    ///
    /// Errors: unauthenticated; not found ([`repository::unknown_model`]) for a model the
    /// repository does not have and, alike, for one the tenant may not call.
    pub fn authorize(&self, authorization: Option<&str>, model: &str) -> ServeResult<()> {
        let t = self.access.identify(authorization)?;
        if !t.may_call(model) || !self.repository.knows(model) {
            return Err(repository::unknown_model(model));
        }
        Ok(())
    }

    /// Admits a caller for loading (`load`) or unloading `model`: it needs `repository_control`
    /// in the tokens file and permission for the model (without a tokens file everyone has
    /// both).
    ///
    /// Errors: unauthenticated; forbidden without `repository_control`; for a model the tenant
    /// may not call, what the repository answers for one it does not have: a load's `failed
    /// to load 'm', failed to poll from model repository`, an unload's not found
    /// ([`repository::unknown_model`]).
    pub fn authorize_control(
        &self,
        authorization: Option<&str>,
        model: &str,
        load: bool,
    ) -> ServeResult<String> {
        let t = self.access.identify(authorization)?;
        if !t.entry.repository_control {
            return Err(ServeError::new(
                ServeErrorKind::Forbidden,
                format!(
                    "tenant `{}` may not load or unload models (repository_control in the tokens file)",
                    t.entry.name
                ),
            ));
        }
        if !t.may_call(model) {
            return Err(if load {
                repository::missing_for_load(model)
            } else {
                repository::unknown_model(model)
            });
        }
        Ok(t.entry.name.clone())
    }

    /// The models a caller may see (index, statistics): those its tenant may call.
    ///
    /// Errors: unauthenticated.
    pub fn visible(
        &self,
        authorization: Option<&str>,
    ) -> ServeResult<impl Fn(&str) -> bool + use<>> {
        let t = self.access.identify(authorization)?;
        Ok(move |m: &str| t.may_call(m))
    }

    /// One inference: admits the caller for `model` (tenant, in-flight, rate), runs the
    /// request through the model's queue, counts it in the metrics.
    ///
    /// Errors: see [`access::Access::admit`], [`Server::model`] and [`model::Model::infer`];
    /// shutting down once SIGTERM arrived.
    pub async fn infer(
        &self,
        authorization: Option<&str>,
        model: &str,
        version: Option<&str>,
        req: InferRequest,
    ) -> ServeResult<InferResponse> {
        let admission = self.admit_request(authorization, model)?;
        let m = self.model(model, version)?;
        let mut req = req;
        if !req.shm_inputs.is_empty() {
            self.shm
                .read_inputs(admission.tenant(), &mut req, self.max_request_bytes)?;
        }
        let shm_outputs: Vec<_> = req
            .outputs
            .iter()
            .filter(|o| o.shm.is_some())
            .cloned()
            .collect();
        self.in_flight.send_modify(|n| *n += 1);
        let _guard = InFlight(&self.in_flight);
        let start = Instant::now();
        let id = req.id.clone();
        let result = m.infer(admission.tenant(), req).await;
        let request_us = start.elapsed().as_micros() as u64;
        match result {
            Ok(done) => {
                self.metrics.record(&RequestRecord {
                    model,
                    success: true,
                    items: done.items,
                    request_us,
                    queue_us: done.queued.as_micros() as u64,
                    compute_us: done.compute.as_micros() as u64,
                });
                let mut resp = InferResponse {
                    model_name: model.to_string(),
                    model_version: VERSION.to_string(),
                    id,
                    outputs: done.outputs,
                    shm_outputs: Vec::new(),
                    weights: done
                        .weights
                        .iter()
                        .map(|(n, v)| (n.to_string(), *v))
                        .collect(),
                };
                self.shm
                    .write_outputs(admission.tenant(), &shm_outputs, &mut resp)?;
                Ok(resp)
            }
            Err(e) => {
                self.metrics.record(&RequestRecord {
                    model,
                    success: false,
                    items: 0,
                    request_us,
                    queue_us: 0,
                    compute_us: 0,
                });
                if let Some(l) = e.limit {
                    self.metrics.refused(admission.tenant(), l);
                }
                Err(e)
            }
        }
    }

    /// Admits one inference request for `model` ([`access::Access::admit`]), counting a
    /// refusal by a limit in the metrics.
    ///
    /// Errors: shutting down once SIGTERM arrived; as [`access::Access::admit`].
    fn admit_request(
        &self,
        authorization: Option<&str>,
        model: &str,
    ) -> ServeResult<access::Admission> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ServeError::new(
                ServeErrorKind::ShuttingDown,
                "the server is shutting down",
            ));
        }
        self.access
            .admit(authorization, model)
            .map_err(|(tenant, e)| {
                if let (Some(t), Some(l)) = (&tenant, e.limit) {
                    self.metrics.refused(t, l);
                }
                e
            })
    }

    /// One streamed inference on a decoupled model: admits the caller as
    /// [`Server::infer`] does (the admission, and the server's in-flight count, are held
    /// until the stream ends), starts the request ([`model::Model::infer_stream`]) and returns
    /// its responses as they come: `Ok(Some(response))` for each, then `Ok(None)` at the end,
    /// or an error that ends it. Each response carries the request's id and the outputs asked
    /// for. The channel holds one response: a client that does not read holds the model's
    /// generation still (back-pressure); dropping the receiver cancels the request.
    ///
    /// Errors (before any response): as [`Server::infer`]; bad request for outputs to shared
    /// memory (a stream's responses travel on the stream) and for a model that is not
    /// decoupled.
    pub fn infer_stream(
        self: &Arc<Self>,
        authorization: Option<&str>,
        model: &str,
        version: Option<&str>,
        req: InferRequest,
    ) -> ServeResult<tokio::sync::mpsc::Receiver<ServeResult<Option<InferResponse>>>> {
        let admission = self.admit_request(authorization, model)?;
        let m = self.model(model, version)?;
        let mut req = req;
        if req.outputs.iter().any(|o| o.shm.is_some()) {
            return Err(ServeError::bad_request(
                "a streamed response travels on the stream: outputs cannot go to shared memory",
            ));
        }
        if !req.shm_inputs.is_empty() {
            self.shm
                .read_inputs(admission.tenant(), &mut req, self.max_request_bytes)?;
        }
        let wanted: Vec<String> = req.outputs.iter().map(|o| o.name.clone()).collect();
        let id = req.id.clone();
        let mut responses = m.infer_stream(req)?;
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let server = Arc::clone(self);
        let model = model.to_string();
        server.in_flight.send_modify(|n| *n += 1);
        tokio::spawn(async move {
            let _admission = admission;
            let _guard = InFlight(&server.in_flight);
            let start = Instant::now();
            let ok = loop {
                let item = tokio::select! {
                    item = responses.recv() => item,
                    // The client went away: dropping `responses` stops the generation.
                    _ = tx.closed() => break false,
                };
                let (msg, end, ok) = match item {
                    Some(Ok(Some(outputs))) => {
                        let outputs = if wanted.is_empty() {
                            outputs
                        } else {
                            outputs
                                .into_iter()
                                .filter(|t| wanted.contains(&t.name))
                                .collect()
                        };
                        let resp = InferResponse {
                            model_name: model.clone(),
                            model_version: VERSION.to_string(),
                            id: id.clone(),
                            outputs,
                            shm_outputs: Vec::new(),
                            weights: Vec::new(),
                        };
                        (Ok(Some(resp)), false, true)
                    }
                    Some(Ok(None)) => (Ok(None), true, true),
                    Some(Err(e)) => (Err(e), true, false),
                    None => (
                        Err(ServeError::new(
                            ServeErrorKind::Internal,
                            format!("model `{model}`: the instance serving this stream stopped"),
                        )),
                        true,
                        false,
                    ),
                };
                if tx.send(msg).await.is_err() {
                    break false;
                }
                if end {
                    break ok;
                }
            };
            m.stream_done(ok, start.elapsed());
            server.metrics.record(&RequestRecord {
                model: &model,
                success: ok,
                items: u64::from(ok),
                request_us: start.elapsed().as_micros() as u64,
                queue_us: 0,
                compute_us: 0,
            });
        });
        Ok(rx)
    }

    /// Registers a system shared-memory region for the caller's tenant
    /// ([`shm::Regions::register`]; with a tokens file its keys must start with
    /// `/<tenant>-`).
    ///
    /// Errors: unauthenticated; those of [`shm::Regions::register`].
    pub fn shm_register(
        &self,
        authorization: Option<&str>,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> ServeResult<()> {
        let t = self.access.identify(authorization)?;
        let prefix = self
            .access
            .has_file()
            .then(|| format!("/{}-", t.entry.name));
        self.shm.register(
            &t.entry.name,
            prefix.as_deref(),
            name,
            key,
            offset,
            byte_size,
        )?;
        tracing::debug!(tenant = %t.entry.name, region = %clip(name), key = %clip(key), offset, byte_size, "shared-memory region registered");
        Ok(())
    }

    /// Unregisters the caller's region `name`, or all of its regions.
    ///
    /// Errors: unauthenticated.
    pub fn shm_unregister(
        &self,
        authorization: Option<&str>,
        name: Option<&str>,
    ) -> ServeResult<()> {
        let t = self.access.identify(authorization)?;
        self.shm.unregister(&t.entry.name, name);
        Ok(())
    }

    /// The caller's regions (or its region `name`).
    ///
    /// Errors: unauthenticated; bad request for a name it has not registered.
    pub fn shm_status(
        &self,
        authorization: Option<&str>,
        name: Option<&str>,
    ) -> ServeResult<Vec<shm::RegionStatus>> {
        let t = self.access.identify(authorization)?;
        self.shm.status(&t.entry.name, name)
    }

    /// CUDA shared memory's status: no region is ever registered (registering is refused,
    /// [`rest::CUDA_SHM_REFUSED`]), so the caller's regions are none, and a named one is not
    /// found, in Triton's words. Triton's clients ask it, and unregister all, to clean up
    /// before they register anything; so both are answered, as Triton answers them on a
    /// server with no CUDA region.
    ///
    /// Errors: unauthenticated; bad request for a `name`.
    pub fn cuda_shm_status(
        &self,
        authorization: Option<&str>,
        name: Option<&str>,
    ) -> ServeResult<()> {
        self.access.identify(authorization)?;
        match name {
            Some(n) => Err(ServeError::bad_request(format!(
                "Unable to find cuda shared memory region: '{n}'"
            ))),
            None => Ok(()),
        }
    }

    /// Unregisters the caller's CUDA shared-memory regions (or its region `name`): there are
    /// none ([`Server::cuda_shm_status`]), so this succeeds, as Triton's unregister of a
    /// region it does not hold does.
    ///
    /// Errors: unauthenticated.
    pub fn cuda_shm_unregister(&self, authorization: Option<&str>) -> ServeResult<()> {
        self.access.identify(authorization)?;
        Ok(())
    }

    /// The metrics text.
    pub fn metrics_text(&self) -> String {
        let cache = self.device.cache().map(|c| c.stats());
        let (host_to_device_bytes, device_to_host_bytes) = self.device.transferred_bytes();
        let (live_bytes, peak_live_bytes) = tpubox_core::types::live_device_bytes();
        let device = metrics::DeviceStats {
            host_to_device_bytes,
            device_to_host_bytes,
            live_bytes,
            peak_live_bytes,
            published: self.sessions.weights().published_usages(),
        };
        self.metrics.render(
            &self.ready_models(),
            cache,
            &self.sessions.tenants(),
            &self.sessions.budgets(),
            &device,
        )
    }

    /// Starts shutting down: readiness turns false and new inference requests are refused.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Waits until no inference request is in flight, or `limit` passed; returns whether all
    /// finished.
    pub async fn drain(&self, limit: Duration) -> bool {
        let mut rx = self.in_flight.subscribe();
        tokio::time::timeout(limit, rx.wait_for(|n| *n == 0))
            .await
            .is_ok()
    }

    /// Statistics (Triton's statistics extension) of `models`, as JSON.
    pub fn stats_json(&self, models: &[Arc<Model>]) -> serde_json::Value {
        use std::sync::atomic::Ordering::Relaxed;
        let dur = |count: u64, ns: u64| serde_json::json!({"count": count, "ns": ns});
        let stats: Vec<serde_json::Value> = models
            .iter()
            .map(|m| {
                let s = &m.stats;
                let ok = s.success.load(Relaxed);
                serde_json::json!({
                    "name": m.name,
                    "version": VERSION,
                    "last_inference": s.last_inference_ms.load(Relaxed),
                    "inference_count": s.inference_count.load(Relaxed),
                    "execution_count": s.execution_count.load(Relaxed),
                    "inference_stats": {
                        "success": dur(ok, s.success_ns.load(Relaxed)),
                        "fail": dur(s.failure.load(Relaxed), s.failure_ns.load(Relaxed)),
                        "queue": dur(ok, s.queue_ns.load(Relaxed)),
                        "compute_input": dur(ok, 0),
                        "compute_infer": dur(ok, s.compute_ns.load(Relaxed)),
                        "compute_output": dur(ok, 0),
                        "cache_hit": dur(0, 0),
                        "cache_miss": dur(0, 0),
                    },
                    "batch_stats": m.stats.batches.lock().unwrap().iter().map(|(&size, &(count, ns))| {
                        serde_json::json!({
                            "batch_size": size,
                            "compute_input": dur(count, 0),
                            "compute_infer": dur(count, ns),
                            "compute_output": dur(count, 0),
                        })
                    }).collect::<Vec<_>>(),
                })
            })
            .collect();
        serde_json::json!({ "model_stats": stats })
    }
}

/// Runs `tpubox serve` until SIGTERM or Ctrl-C: opens the listeners, loads the repository in
/// the background, serves, then drains and unloads.
///
/// Errors: a port that cannot be bound, an unreadable repository or tokens file.
pub async fn run(
    config: ServeConfig,
    sandbox: Arc<Sandbox>,
    device: Arc<DeviceService>,
    weights: Arc<WeightRegistry>,
) -> Result<()> {
    let access = Arc::new(match &config.tokens {
        Some(p) => Access::from_file(p)?,
        None => Access::open(),
    });
    access
        .set_device_count(device.device_count())
        .with_context(|| match &config.tokens {
            Some(p) => format!("{}: devices", p.display()),
            None => "devices".to_string(),
        })?;
    if let Some(repo) = &config.repository {
        if !repo.exists() {
            anyhow::bail!(
                "the model repository {} does not exist (--model-repository DIR: one directory per model)",
                repo.display()
            );
        }
        if !repo.is_dir() {
            anyhow::bail!("the model repository {} is not a directory", repo.display());
        }
    } else if !config.sessions.enabled() {
        anyhow::bail!(
            "nothing to serve: give --model-repository DIR (inference), --session-socket PATH or --session-port N (sessions), or several"
        );
    }
    check_anonymous_exposure(&config)?;
    let mut doors = tpubox_net::Doors::new(&config.doors);
    doors.tls = config.tls.clone().map(tpubox_net::Tls::load).transpose()?;
    let scheme = if doors.tls.is_some() { "https" } else { "http" };
    let metrics = Arc::new(Metrics::new());
    let ctx = LoadContext {
        sandbox,
        device: Arc::clone(&device),
        weights: Arc::clone(&weights),
        loaded_weights: Arc::new(std::sync::Mutex::new(BTreeMap::new())),
        metrics: Arc::clone(&metrics),
        onnx: onnx::OnnxConverter::from_env(),
        exclusive_devices: {
            let access = Arc::clone(&access);
            Arc::new(move || access.exclusive_devices())
        },
    };
    let sandbox = Arc::clone(&ctx.sandbox);
    let repository = Repository::new(config.repository.clone().unwrap_or_default(), ctx);
    let registry = Registry::new(Arc::clone(&device), weights);
    let server = Arc::new(Server::new(
        repository,
        Arc::clone(&access),
        metrics,
        device,
        config.max_request_bytes,
        Arc::clone(&registry),
        doors.tls.clone(),
    ));
    server.set_strict_readiness(config.strict_readiness);
    // The refusals left out of the log (per peer, `tpubox_core::logsafe`), said every few seconds.
    let flusher = tokio::spawn(async {
        let mut every = tokio::time::interval(Duration::from_secs(2));
        loop {
            every.tick().await;
            tpubox_core::logsafe::flush_suppressed();
        }
    });
    if config.repository.is_some()
        && let Ok(names) = server.repository.scan()
    {
        if config.tokens.is_some() && server.access.tenants().is_empty() {
            tracing::warn!("the tokens file names no tenant: every request will get 401");
        }
        for t in server.access.tenants() {
            for m in &t.entry.models {
                if m != "*" && !names.contains(m) {
                    tracing::warn!(
                        tenant = %t.entry.name,
                        "the tokens file lets tenant `{}` call model `{m}`, which the repository does not have",
                        t.entry.name
                    );
                }
            }
        }
    }
    let addr = |port| SocketAddr::new(config.host, port);
    let inference = config.repository.is_some();
    let (http, grpc) = if inference {
        let http = tpubox_net::bind_tcp(addr(config.http_port))
            .with_context(|| format!("binding the REST port {}", addr(config.http_port)))?;
        let grpc = tpubox_net::bind_tcp(addr(config.grpc_port))
            .with_context(|| format!("binding the gRPC port {}", addr(config.grpc_port)))?;
        (Some(http), Some(grpc))
    } else {
        (None, None)
    };
    let metrics = tpubox_net::bind_tcp(addr(config.metrics_port))
        .with_context(|| format!("binding the metrics port {}", addr(config.metrics_port)))?;
    let session_listeners = if config.sessions.enabled() {
        Some(tpubox_session_api::Listeners::bind(&config.sessions).await?)
    } else {
        None
    };
    if let (Some(http), Some(grpc), Some(repo)) = (&http, &grpc, &config.repository) {
        tracing::info!(
            rest = %http.local_addr()?,
            grpc = %grpc.local_addr()?,
            metrics = %metrics.local_addr()?,
            repository = %repo.display(),
            "tpubox serve listening: REST on {scheme}://{}, gRPC on {}{}, metrics on {scheme}://{}/metrics; loading the models",
            http.local_addr()?,
            grpc.local_addr()?,
            if doors.tls.is_some() { " (TLS)" } else { "" },
            metrics.local_addr()?
        );
    } else {
        tracing::info!(
            metrics = %metrics.local_addr()?,
            "tpubox serve: no model repository, so no inference doors; metrics on {scheme}://{}/metrics",
            metrics.local_addr()?
        );
    }
    if session_listeners
        .as_ref()
        .is_some_and(|l| l.tcp_addr().is_some())
        && config.tokens.is_none()
    {
        tracing::warn!(
            "the session API listens on TCP without --tokens: every process that can reach the port may use the device, as tenant `anonymous`"
        );
    }
    if let Some(l) = &session_listeners {
        let socket = l.socket_path().map(|p| format!("unix:{}", p.display()));
        let tcp = l.tcp_addr().map(|a| a.to_string());
        tracing::info!(
            socket = socket.as_deref().unwrap_or("-"),
            tcp = tcp.as_deref().unwrap_or("-"),
            "session API listening on {}",
            [socket.clone(), tcp.clone()]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(" and ")
        );
    }

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let mut tasks = Vec::new();
    if let (Some(http), Some(grpc)) = (http, grpc) {
        tasks.push(tokio::spawn(rest::serve_rest(
            http,
            Arc::clone(&server),
            doors.door("rest", rest::admit(Arc::clone(&server))),
            stopped(stop_rx.clone()),
        )));
        let mut door = doors.door("grpc", grpc::admit(Arc::clone(&server)));
        door.http2_only = true;
        // A stream's request body stays open as long as the client streams.
        door.long_lived = &["/inference.GRPCInferenceService/ModelStreamInfer"];
        tasks.push(tokio::spawn(grpc::serve_grpc(
            grpc,
            Arc::clone(&server),
            door,
            stopped(stop_rx.clone()),
        )));
    }
    tasks.push(tokio::spawn(rest::serve_metrics(
        metrics,
        Arc::clone(&server),
        doors.door("metrics", rest::admit(Arc::clone(&server))),
        stopped(stop_rx.clone()),
    )));
    let (sessions_stop_tx, sessions_stop_rx) = tokio::sync::watch::channel(false);
    let sessions_task = session_listeners.map(|l| {
        let access: Arc<dyn SessionAccess> = Arc::clone(&access) as Arc<dyn SessionAccess>;
        tokio::spawn(tpubox_session_api::serve(
            l,
            Arc::clone(&registry),
            access,
            Arc::clone(&sandbox),
            config.sessions.clone(),
            doors.clone(),
            stopped(sessions_stop_rx),
        ))
    });
    // SIGHUP reads the tokens file (and the TLS files) again: new tenants may connect at once,
    // removed ones' sessions end, changed limits apply to new sessions; a bad file is logged
    // and the one in use kept. The admin call POST /v2/admin/reload does the same.
    let reloader = tokio::spawn(admin::reload_on_hangup(Arc::clone(&server)));
    let exit_on_error = config.exit_on_error;
    let loader = {
        let s = Arc::clone(&server);
        tokio::spawn(async move {
            if !inference {
                return;
            }
            if let Err(e) = s.load_all().await {
                tracing::error!("{e:#}");
            }
            let ready: Vec<String> = s.ready_models().iter().map(|m| m.name.clone()).collect();
            let failed: Vec<String> = s
                .repository
                .states()
                .into_iter()
                .filter(|(_, st)| matches!(st, repository::ModelState::Unavailable(_)))
                .map(|(n, _)| n)
                .collect();
            if failed.is_empty() {
                tracing::info!("ready; models loaded: {}", ready.join(", "));
            } else {
                tracing::warn!(
                    "ready; models loaded: {}; FAILED to load: {} (POST /v2/repository/index gives the reasons)",
                    ready.join(", "),
                    failed.join(", ")
                );
                if exit_on_error {
                    tracing::error!("exiting: a model failed to load and --exit-on-error is set");
                    std::process::exit(2);
                }
            }
        })
    };
    shutdown_signal().await;
    if inference {
        tracing::info!(
            "shutting down: new inference requests get 503; draining those in flight (up to {:?}; a second signal exits at once); sessions end",
            config.drain
        );
    } else {
        tracing::info!("shutting down: sessions end (calls in flight fail with UNAVAILABLE)");
    }
    tokio::spawn(async {
        shutdown_signal().await;
        eprintln!("tpubox serve: second signal; exiting without waiting");
        std::process::exit(1);
    });
    server.begin_shutdown();
    loader.abort();
    reloader.abort();
    let drained = server.drain(config.drain).await;
    if !drained {
        tracing::warn!(
            "requests still in flight after {:?}; failing those still queued",
            config.drain
        );
        server.repository.abort_all();
    }
    server.repository.unload_all().await;
    // Sessions end (their clients see ENDED on Attach, then UNAUTHENTICATED/session-ended).
    let _ = sessions_stop_tx.send(true);
    if let Some(t) = sessions_task
        && let Ok(Ok(Err(e))) = tokio::time::timeout(Duration::from_secs(2), t).await
    {
        tracing::warn!("the session API ended with: {e:#}");
    }
    let _ = stop_tx.send(true);
    // The listeners finish the responses they are writing; a request still inside a model
    // (PJRT cannot cancel it) is not waited for past this.
    for t in tasks {
        if let Ok(Ok(Err(e))) = tokio::time::timeout(Duration::from_secs(1), t).await {
            tracing::warn!("a listener ended with: {e:#}");
        }
    }
    flusher.abort();
    tpubox_core::logsafe::flush_suppressed();
    tracing::info!("stopped");
    Ok(())
}

/// Refuses to serve a non-loopback address without a tokens file, unless
/// [`ServeConfig::allow_anonymous_network`]: every caller would be tenant `anonymous`.
///
/// Errors: `--host` or `--session-port`'s address is not loopback, no `--tokens`, no
/// `--allow-anonymous-network`.
pub fn check_anonymous_exposure(config: &ServeConfig) -> Result<()> {
    if config.tokens.is_some() {
        return Ok(());
    }
    let mut exposed = Vec::new();
    if !config.host.is_loopback() {
        exposed.push(format!("--host {}", config.host));
    }
    if let Some(a) = config.sessions.tcp
        && !a.ip().is_loopback()
    {
        exposed.push(format!("the session port on {a}"));
    }
    if exposed.is_empty() {
        tracing::info!(
            "no --tokens: serving loopback and Unix sockets only, every caller as tenant `anonymous`"
        );
        return Ok(());
    }
    if config.allow_anonymous_network {
        tracing::warn!(
            "no --tokens and {}: every process that can reach it may use the device as tenant `anonymous` (--allow-anonymous-network)",
            exposed.join(", ")
        );
        return Ok(());
    }
    anyhow::bail!(
        "refusing to serve {} without --tokens: every caller would be tenant `anonymous`. Give a tokens file (docs/SERVING.md), bind loopback, or pass --allow-anonymous-network",
        exposed.join(" and ")
    )
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
