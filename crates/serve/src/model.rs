//! A loaded model: its configuration, what its guest declared, its queue and the tasks that run
//! its instances, and its statistics. Requests are checked against the declaration here, before
//! they reach a guest.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::batcher::{BatchPolicy, Batched, Pending, Queue, StreamItem, merge, split};
use super::config::{ModelConfig, triton_json};
use super::error::{ServeError, ServeErrorKind, ServeResult};
use super::instance::{GenerationHandle, GuestMetadata, InferFailure, Instance, TensorDecl};
use super::protocol::{Datatype, InferRequest, Tensor};
use super::sequence::Sequencer;
use super::stablehlo::{NativeInstance, Plan};
use tpubox_core::device::DeviceService;
use tpubox_core::placement::Placement;
use tpubox_core::session::WeightTag;
use tpubox_core::tenant::Tenant;
use tpubox_core::weights::WeightRegistry;
use tpubox_wasm::sandbox::{RunOptions, Sandbox};

/// The only version a model has.
pub const VERSION: &str = "1";

/// Counters of one model (Triton's statistics extension and metrics). Durations are in
/// nanoseconds, summed over requests.
#[derive(Debug, Default)]
pub struct ModelStats {
    /// Requests that succeeded.
    pub success: AtomicU64,
    /// Their summed end-to-end duration.
    pub success_ns: AtomicU64,
    /// Requests that failed after they were admitted to the model.
    pub failure: AtomicU64,
    /// Their summed duration.
    pub failure_ns: AtomicU64,
    /// Summed time requests waited in the queue.
    pub queue_ns: AtomicU64,
    /// Summed time of the `infer` calls requests were part of.
    pub compute_ns: AtomicU64,
    /// Batch items inferred (sum of the requests' batch sizes).
    pub inference_count: AtomicU64,
    /// `infer` calls (batches).
    pub execution_count: AtomicU64,
    /// Unix time of the last inference, in milliseconds.
    pub last_inference_ms: AtomicU64,
    /// Instances replaced after a trap.
    pub instance_restarts: AtomicU64,
    /// Executions per batch size: (count, summed infer ns), for the statistics' `batch_stats`.
    pub batches: std::sync::Mutex<std::collections::BTreeMap<u64, (u64, u64)>>,
}

/// A request's outputs and what it cost.
#[derive(Debug)]
pub struct Inferred {
    /// Outputs, in declared order, filtered to those asked for.
    pub outputs: Vec<Tensor>,
    /// Batch items (the request's batch size).
    pub items: u64,
    /// Time in the queue.
    pub queued: Duration,
    /// Time of the `infer` call it was part of.
    pub compute: Duration,
    /// The weight-set versions its outputs were read from (sorted; empty for a model that
    /// uses no weight set).
    pub weights: Arc<[WeightTag]>,
}

/// Everything a model needs from the server to load.
#[derive(Clone)]
pub struct LoadContext {
    /// The sandbox instances run in.
    pub sandbox: Arc<Sandbox>,
    /// The device.
    pub device: Arc<DeviceService>,
    /// The weight registry shared by all models.
    pub weights: Arc<WeightRegistry>,
    /// Weight sets already loaded, by name, and the file each came from (with its state on
    /// disk when it was read).
    pub loaded_weights: Arc<std::sync::Mutex<std::collections::BTreeMap<String, WeightFile>>>,
    /// The server's metrics (executions are counted there as they happen, so the counters stay
    /// cumulative across reloads).
    pub metrics: Arc<super::metrics::Metrics>,
    /// The devices some session tenant holds alone now
    /// ([`crate::access::Access::exclusive_devices`]): a model's instances are not spread onto
    /// them. Asked at each load.
    pub exclusive_devices: Arc<dyn Fn() -> Vec<u32> + Send + Sync>,
    /// How ONNX models are converted ([`super::onnx`]).
    pub onnx: super::onnx::OnnxConverter,
}

/// A loaded model.
pub struct Model {
    /// Its name (its directory's).
    pub name: String,
    /// Its configuration.
    pub config: ModelConfig,
    /// What its guest declared, with the configuration's `max_batch_size` applied.
    pub metadata: GuestMetadata,
    /// Its counters.
    pub stats: Arc<ModelStats>,
    /// The device of each instance, by instance index ([`ModelConfig::instance_devices`]).
    pub devices: Vec<u32>,
    /// The tenant its instances charge.
    pub tenant: Arc<Tenant>,
    /// The request queue every instance takes from; for a stateful model one per instance
    /// (a sequence's requests go to its instance's).
    queues: Vec<Arc<Queue>>,
    /// A stateful model's sequences ([`crate::sequence`]).
    sequencer: Option<Arc<Sequencer>>,
    /// A decoupled model: it answers only streaming calls ([`Model::infer_stream`]).
    pub decoupled: bool,
    workers: Vec<JoinHandle<()>>,
    /// Told the tenant's counters when the model is dropped ([`super::metrics::Metrics::retire`]).
    metrics: Arc<super::metrics::Metrics>,
}

fn to_dims(d: &TensorDecl) -> (String, Datatype, Vec<i64>) {
    (d.name.clone(), d.datatype, d.dims.clone())
}

/// A weight file as a set was read from it: its canonical path, and its identity and state on
/// disk at that moment (device and inode, size, modification and status-change times), so that
/// a later load can tell whether the file changed since (rewritten in place, or replaced).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightFile {
    /// The canonical path.
    pub path: PathBuf,
    stamp: FileStamp,
}

/// What [`WeightFile`] compares: a file rewritten in place changes its size or times, a file
/// replaced (renamed over, or deleted and written again) its inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    fn of(path: &Path) -> Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).with_context(|| path.display().to_string())?;
        Ok(FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// Loads the weight set `set` from the safetensors file `path`, unless a model loaded it from
/// the same file already and the file has not changed since (then it is shared). When the file
/// changed on disk since the set was read (another size, modification or status-change time,
/// or another file at that path), the set is read again and replaces the old one: this model's
/// instances, and every instance opened after it, get the new tensors; instances that opened
/// the old set keep theirs until they end.
///
/// A set read here is loaded onto `device` (the model's first instance's); instances on other
/// devices get copies made once per device ([`tpubox_core::weights::WeightSet::get_on`]).
///
/// Errors: the file is missing or does not load; another model loaded a set of that name from
/// another file.
fn ensure_weight_set(ctx: &LoadContext, set: &str, path: &Path, device: u32) -> Result<()> {
    let canonical = path
        .canonicalize()
        .with_context(|| format!("weight set `{set}`: {}", path.display()))?;
    // Taken before the file is read: a change during the read shows at the next load.
    let stamp = FileStamp::of(&canonical).with_context(|| format!("weight set `{set}`"))?;
    let mut loaded = ctx.loaded_weights.lock().unwrap();
    let file = WeightFile {
        path: canonical.clone(),
        stamp,
    };
    match loaded.get(set) {
        Some(w) if w.path == canonical && w.stamp == stamp => Ok(()),
        Some(w) if w.path == canonical => {
            ctx.weights
                .reload_safetensors(&ctx.device, set, &canonical, device)
                .map_err(|e| anyhow::anyhow!("weight set `{set}`: {e}"))?;
            tracing::info!(
                weight_set = set,
                file = %canonical.display(),
                "the weight file changed on disk since the set was loaded: loaded again"
            );
            loaded.insert(set.to_string(), file);
            Ok(())
        }
        Some(w) => bail!(
            "weight set `{set}` is already loaded from {}; this model names {}",
            w.path.display(),
            canonical.display()
        ),
        None => {
            ctx.weights
                .load_safetensors(&ctx.device, set, &canonical, device)
                .map_err(|e| anyhow::anyhow!("weight set `{set}`: {e}"))?;
            loaded.insert(set.to_string(), file);
            Ok(())
        }
    }
}

/// What a model's instances are, and how to make another.
#[derive(Clone)]
enum Kind {
    /// A guest component, instantiated in the sandbox.
    Guest {
        component: wasmtime::component::Component,
        opts: RunOptions,
    },
    /// A StableHLO model, run natively through a session.
    Native(Arc<Plan>),
}

/// One instance of either kind.
enum Runner {
    Guest(Instance),
    Native(NativeInstance),
}

impl Kind {
    fn name(&self) -> &'static str {
        match self {
            Kind::Guest { .. } => "component",
            Kind::Native(_) => "stablehlo",
        }
    }

    /// A new instance on `device`: its session is placed there alone, so what it compiles,
    /// uploads and opens (weights) lands on that device.
    async fn instance(
        &self,
        ctx: &LoadContext,
        name: &str,
        tenant: &Arc<Tenant>,
        device: u32,
    ) -> Result<Runner> {
        Ok(match self {
            Kind::Guest { component, opts } => {
                let opts = RunOptions {
                    devices: Some(vec![device]),
                    ..opts.clone()
                };
                Runner::Guest(
                    Instance::new(
                        &ctx.sandbox,
                        &ctx.device,
                        &ctx.weights,
                        component,
                        name,
                        &opts,
                    )
                    .await?,
                )
            }
            Kind::Native(plan) => Runner::Native(
                NativeInstance::new(
                    Arc::clone(plan),
                    &ctx.device,
                    &ctx.weights,
                    Arc::clone(tenant),
                    device,
                )
                .await?,
            ),
        })
    }
}

impl Runner {
    fn counted_in(self, gauge: prometheus::IntGauge) -> Self {
        match self {
            Runner::Guest(i) => Runner::Guest(i.counted_in(gauge)),
            Runner::Native(i) => Runner::Native(i.counted_in(gauge)),
        }
    }

    async fn infer(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, InferFailure> {
        match self {
            Runner::Guest(i) => i.infer(inputs).await,
            Runner::Native(i) => i.infer(inputs).await,
        }
    }

    fn take_weights_read(&self) -> Arc<[WeightTag]> {
        match self {
            Runner::Guest(i) => i.take_weights_read().into(),
            Runner::Native(i) => i.take_weights_read().into(),
        }
    }
}

impl Model {
    /// Loads the model in `dir`: reads its configuration, loads its weight sets and component
    /// (or, for a StableHLO model, compiles and checks its programs and loads its weights;
    /// see [`super::stablehlo`]), starts its instances and checks what the guest declares
    /// against the configuration.
    ///
    /// Errors: a bad configuration, a missing or invalid component, weight files that do not
    /// load or a weight-set name another model uses for a different file, a guest whose
    /// `metadata()` disagrees with the configuration's inputs, outputs or `max_batch_size`; for
    /// a StableHLO model the errors of [`Plan::read`] and [`Plan::compile`], which name the
    /// file and the parameter.
    ///
    /// `config_override` (JSON, [`ModelConfig::from_override`]) replaces the directory's
    /// configuration file for this load.
    pub async fn load(
        ctx: &LoadContext,
        name: &str,
        dir: &Path,
        config_override: Option<&str>,
    ) -> Result<Arc<Model>> {
        let mut config = match config_override {
            Some(json) => ModelConfig::from_override(dir, json)?,
            None => ModelConfig::load(dir)?,
        };
        // An ONNX model becomes a StableHLO model: converted (once per file and batch sizes,
        // by the converter's process), then loaded as one.
        if let Some(onnx) = super::onnx::onnx_file(&config, dir) {
            let pbtxt = dir.join("config.pbtxt");
            let pbtxt = (config_override.is_none() && pbtxt.is_file()).then_some(pbtxt);
            super::onnx::prepare(&ctx.onnx, name, &onnx, pbtxt.as_deref(), &mut config).await?;
        }
        if !config.ignored.is_empty() {
            tracing::warn!(
                model = name,
                fields = config.ignored.join(", "),
                "the configuration sets Triton fields tpubox does not implement; they are ignored"
            );
        }
        // Where each instance runs, decided before anything loads: a device the host lacks
        // fails the load here.
        let devices = config
            .instance_devices(ctx.device.device_count(), &(ctx.exclusive_devices)())
            .context("placing the instances")?;
        for (set, file) in &config.tpubox.weights {
            ensure_weight_set(ctx, set, &dir.join(file), devices[0])?;
        }
        let tenant = Tenant::new(format!("model:{name}"), config.tenant_limits());
        let live = ctx.metrics.instances_of(name);
        let (kind, first, metadata) = if config.tpubox.stablehlo.is_some() {
            // Read and checked before anything is loaded: a broken directory loads nothing.
            let plan = Arc::new(Plan::read(dir, name, &config)?);
            let session = tpubox_core::session::Session::new(
                Arc::clone(&ctx.device),
                Arc::clone(&ctx.weights),
                Arc::clone(&tenant),
            )
            .with_placement(Placement::fixed(vec![devices[0]]));
            let exes = plan.compile(&session).await?;
            ensure_weight_set(ctx, &plan.weight_set, &plan.weights_file, devices[0])?;
            let first = Runner::Native(NativeInstance::from_compiled(
                Arc::clone(&plan),
                session,
                exes,
            )?);
            let kind = Kind::Native(Arc::clone(&plan));
            let metadata = plan.metadata.clone();
            (kind, first, metadata)
        } else {
            let component_path = config.component_path(dir)?;
            let sandbox = Arc::clone(&ctx.sandbox);
            let component =
                tokio::task::spawn_blocking(move || sandbox.load_component(&component_path))
                    .await
                    .context("loading the component")??;
            let opts = RunOptions {
                dirs: vec![(config.files_dir(dir)?, "/model".to_string())],
                tenant: Some(Arc::clone(&tenant)),
                // wasi-nn: ONNX graphs the guest loads from bytes, and the repository's models by name
                // (docs/WASI_NN.md).
                nn: Some(tpubox_wasm::nn::NnLoaderRef(match dir.parent() {
                    Some(root) => {
                        super::nn::NnGraphs::of_repository(ctx.onnx.clone(), root.to_path_buf())
                    }
                    None => super::nn::NnGraphs::new(ctx.onnx.clone(), Default::default()),
                })),
                ..RunOptions::default()
            };
            let kind = Kind::Guest { component, opts };
            let mut first = kind.instance(ctx, name, &tenant, devices[0]).await?;
            let Runner::Guest(guest) = &mut first else {
                unreachable!("a guest kind makes guest instances")
            };
            let mut metadata = guest.metadata().await.context("the model's metadata()")?;
            check_declared(&config, &metadata)?;
            match (
                guest.is_decoupled(),
                config.model_transaction_policy.decoupled,
            ) {
                (true, false) => bail!(
                    "the component exports the decoupled interface (a decoupled model): say so with [model_transaction_policy] decoupled = true"
                ),
                (false, true) => bail!(
                    "model_transaction_policy.decoupled is set, but the component does not export the decoupled interface (build it for the decoupled-model world of wit/model.wit)"
                ),
                _ => {}
            }
            if let Some(m) = config.max_batch_size {
                if m > metadata.max_batch_size {
                    bail!(
                        "max_batch_size {m} is larger than the {} the model accepts",
                        metadata.max_batch_size
                    );
                }
                metadata.max_batch_size = m;
            }
            (kind, first, metadata)
        };
        let first = first.counted_in(live.clone());
        let sequencer = match &config.sequence_batching {
            Some(sb) => Some(Arc::new(Sequencer::new(
                name,
                sb,
                &metadata.inputs,
                metadata.max_batch_size > 0,
                devices.len(),
            )?)),
            None => None,
        };
        let policy = match &config.sequence_batching {
            Some(sb) => {
                let strategy = sb.oldest.clone().or(sb.direct.clone()).unwrap_or_default();
                BatchPolicy {
                    batching: metadata.max_batch_size > 0,
                    max_batch_size: u64::from(metadata.max_batch_size.max(1)),
                    preferred: Vec::new(),
                    max_delay: Duration::from_micros(strategy.max_queue_delay_microseconds),
                    max_queue_size: 0,
                }
            }
            None => {
                let db = config.dynamic_batching.clone().unwrap_or_default();
                BatchPolicy {
                    batching: metadata.max_batch_size > 0 && config.dynamic_batching.is_some(),
                    max_batch_size: u64::from(metadata.max_batch_size.max(1)),
                    preferred: db
                        .preferred_batch_size
                        .iter()
                        .map(|&b| u64::from(b))
                        .collect(),
                    max_delay: config.max_queue_delay(),
                    max_queue_size: db.default_queue_policy.max_queue_size as usize,
                }
            }
        };
        let batching = policy.batching;
        let queues: Vec<Arc<Queue>> = if sequencer.is_some() {
            (0..devices.len())
                .map(|_| Arc::new(Queue::new(policy.clone())))
                .collect()
        } else {
            vec![Arc::new(Queue::new(policy))]
        };
        let stats = Arc::new(ModelStats::default());
        let mut instances = vec![first];
        for &device in &devices[1..] {
            instances.push(
                kind.instance(ctx, name, &tenant, device)
                    .await?
                    .counted_in(live.clone()),
            );
        }
        let workers = instances
            .into_iter()
            .enumerate()
            .map(|(index, instance)| {
                let worker = Worker {
                    name: name.to_string(),
                    index,
                    device: devices[index],
                    queue: Arc::clone(&queues[index % queues.len()]),
                    sequencer: sequencer.clone(),
                    stats: Arc::clone(&stats),
                    ctx: ctx.clone(),
                    kind: kind.clone(),
                    tenant: Arc::clone(&tenant),
                    outputs: metadata.outputs.clone(),
                    decoupled: config.tpubox.decoupled.clone(),
                };
                if config.model_transaction_policy.decoupled {
                    tokio::spawn(worker.run_decoupled(instance))
                } else {
                    tokio::spawn(worker.run(instance))
                }
            })
            .collect();
        tracing::info!(
            model = name,
            kind = kind.name(),
            instances = devices.len(),
            devices = ?devices,
            max_batch_size = metadata.max_batch_size,
            batching,
            "model loaded"
        );
        Ok(Arc::new(Model {
            name: name.to_string(),
            metadata,
            stats,
            devices,
            tenant,
            queues,
            sequencer,
            decoupled: config.model_transaction_policy.decoupled,
            config,
            workers,
            metrics: Arc::clone(&ctx.metrics),
        }))
    }

    /// Requests waiting in the queue(s).
    pub fn pending(&self) -> usize {
        self.queues.iter().map(|q| q.len()).sum()
    }

    /// The inputs a client sends, as the model's metadata and configuration show them: those
    /// the model declares but the sequence control inputs the server fills, unless the
    /// configuration lists them in `input` too (Triton shows the configured inputs).
    pub fn client_inputs(&self) -> Vec<TensorDecl> {
        without_controls(&self.config, &self.metadata.inputs)
    }

    /// The Triton JSON configuration.
    pub fn config_json(&self) -> serde_json::Value {
        let ins: Vec<_> = self.client_inputs().iter().map(to_dims).collect();
        let outs: Vec<_> = self.metadata.outputs.iter().map(to_dims).collect();
        triton_json(
            &self.name,
            &self.config,
            self.metadata.max_batch_size,
            &ins,
            &outs,
        )
    }

    /// Shapes as the protocol reports them: with a leading -1 when the model batches.
    pub fn protocol_shape(&self, d: &TensorDecl) -> Vec<i64> {
        let mut s = Vec::with_capacity(d.dims.len() + 1);
        if self.metadata.max_batch_size > 0 {
            s.push(-1);
        }
        s.extend_from_slice(&d.dims);
        s
    }

    /// Checks `req` against the declaration and orders its inputs as declared; returns them
    /// and the request's batch size.
    ///
    /// Errors: bad request for an unknown, missing or repeated input, a wrong datatype or
    /// shape, a batch of 0 or over `max_batch_size`, data that does not match its shape, or an
    /// unknown requested output.
    pub fn check_request(&self, req: &mut InferRequest) -> ServeResult<(Vec<Tensor>, u64)> {
        let m = &self.metadata;
        let batched = m.max_batch_size > 0;
        for t in &req.inputs {
            if !m.inputs.iter().any(|d| d.name == t.name) {
                return Err(ServeError::bad_request(format!(
                    "model `{}` has no input `{}` (inputs: {})",
                    self.name,
                    tpubox_core::logsafe::clip(&t.name),
                    names(&m.inputs)
                )));
            }
        }
        for o in &req.outputs {
            if !m.outputs.iter().any(|d| d.name == o.name) {
                return Err(ServeError::bad_request(format!(
                    "model `{}` has no output `{}` (outputs: {})",
                    self.name,
                    tpubox_core::logsafe::clip(&o.name),
                    names(&m.outputs)
                )));
            }
        }
        let mut ordered = Vec::with_capacity(m.inputs.len());
        let mut batch = None;
        let mut inputs = std::mem::take(&mut req.inputs);
        for d in &m.inputs {
            let mut found = inputs.iter().filter(|t| t.name == d.name);
            let (Some(_), None) = (found.next(), found.next()) else {
                let n = inputs.iter().filter(|t| t.name == d.name).count();
                return Err(ServeError::bad_request(if n == 0 {
                    format!("input `{}` is missing", d.name)
                } else {
                    format!("input `{}` is given {n} times", d.name)
                }));
            };
            let i = inputs.iter().position(|t| t.name == d.name).unwrap();
            let t = inputs.swap_remove(i);
            if t.datatype != d.datatype {
                return Err(ServeError::bad_request(format!(
                    "input `{}` has datatype {}, the model takes {}",
                    d.name,
                    t.datatype.name(),
                    d.datatype.name()
                )));
            }
            let want = self.protocol_shape(d);
            let ok = t.shape.len() == want.len()
                && t.shape
                    .iter()
                    .zip(&want)
                    .all(|(&s, &w)| w < 0 || s == w as u64);
            if !ok {
                return Err(ServeError::bad_request(format!(
                    "input `{}` has shape {:?}, the model takes {:?}",
                    d.name, t.shape, want
                )));
            }
            if batched {
                let b = t.shape[0];
                if b == 0 || b > u64::from(m.max_batch_size) {
                    return Err(ServeError::bad_request(format!(
                        "input `{}` has a batch of {b}; the model takes 1 to {}",
                        d.name, m.max_batch_size
                    )));
                }
                if *batch.get_or_insert(b) != b {
                    return Err(ServeError::bad_request(format!(
                        "input `{}` has a batch of {b}, other inputs {}",
                        d.name,
                        batch.unwrap()
                    )));
                }
            }
            t.check()?;
            ordered.push(t);
        }
        Ok((ordered, batch.unwrap_or(1)))
    }

    /// Runs `req` (already admitted for its tenant): checks it, queues it, waits for its batch
    /// and returns its outputs, filtered to those asked for. Counts it in the statistics.
    ///
    /// Errors: as [`Model::check_request`]; too many requests when the queue is full; the
    /// model's errors ([`ServeError::from_model`]); internal when an instance trapped or
    /// broke the interface's contract.
    pub async fn infer(&self, tenant: &str, mut req: InferRequest) -> ServeResult<Inferred> {
        if self.decoupled {
            return Err(super::wording::decoupled_unary(
                super::wording::UnaryDoor::Http,
                &self.name,
            ));
        }
        // A stateful model: the request joins its sequence's instance, with the control inputs
        // the server fills.
        let (queue, sequence) = match &self.sequencer {
            None => (&self.queues[0], None),
            Some(sq) => {
                if let Some(t) = req
                    .inputs
                    .iter()
                    .find(|t| sq.control_names().any(|n| n == t.name))
                {
                    return Err(ServeError::bad_request(format!(
                        "input `{}` is a sequence control input: the server fills it from sequence_id, sequence_start and sequence_end",
                        t.name
                    )));
                }
                let Some(seq) = req.sequence.clone() else {
                    return Err(super::wording::no_correlation_id(&self.name));
                };
                let instance = sq.route(tenant, &seq)?;
                req.inputs.extend(sq.controls(&seq));
                (&self.queues[instance % self.queues.len()], Some((sq, seq)))
            }
        };
        let checked = self.check_request(&mut req);
        let (inputs, batch) = match checked {
            Ok(x) => x,
            Err(e) => {
                if let Some((sq, seq)) = &sequence {
                    sq.finish(tenant, seq, false);
                }
                return Err(e);
            }
        };
        if let Some((sq, seq)) = &sequence
            && batch != 1
        {
            sq.finish(tenant, seq, false);
            return Err(ServeError::bad_request(format!(
                "a request of a sequence to model '{}' must have a batch of 1, not {batch}",
                self.name
            )));
        }
        let start = Instant::now();
        let (tx, rx) = oneshot::channel();
        queue.push(Pending {
            inputs,
            batch,
            enqueued: start,
            sequence: sequence.as_ref().map(|(_, s)| sequence_hash(tenant, &s.id)),
            reply: tx,
            stream: None,
        })?;
        let result = rx.await.unwrap_or_else(|_| {
            Err(ServeError::new(
                ServeErrorKind::Internal,
                "the model's instance stopped",
            ))
        });
        if let Some((sq, seq)) = &sequence {
            let lost = matches!(&result, Err(e) if e.kind == ServeErrorKind::Internal);
            sq.finish(tenant, seq, lost);
        }
        let ns = start.elapsed().as_nanos() as u64;
        let s = &self.stats;
        match result {
            Ok(Batched {
                outputs,
                queued,
                compute,
                weights,
            }) => {
                s.success.fetch_add(1, Ordering::Relaxed);
                s.success_ns.fetch_add(ns, Ordering::Relaxed);
                s.queue_ns
                    .fetch_add(queued.as_nanos() as u64, Ordering::Relaxed);
                s.compute_ns
                    .fetch_add(compute.as_nanos() as u64, Ordering::Relaxed);
                s.inference_count.fetch_add(batch, Ordering::Relaxed);
                let ms = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_millis() as u64;
                s.last_inference_ms.store(ms, Ordering::Relaxed);
                let outputs = if req.outputs.is_empty() {
                    outputs
                } else {
                    outputs
                        .into_iter()
                        .filter(|t| req.outputs.iter().any(|o| o.name == t.name))
                        .collect()
                };
                Ok(Inferred {
                    outputs,
                    items: batch,
                    queued,
                    compute,
                    weights,
                })
            }
            Err(e) => {
                s.failure.fetch_add(1, Ordering::Relaxed);
                s.failure_ns.fetch_add(ns, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Starts `req` on a decoupled model: checks it and queues it; its responses arrive on the
    /// returned channel, one [`StreamItem`] each, as the client takes them (the channel holds
    /// one: the model computes a response only when there is room for it). Dropping the
    /// receiver cancels the request: the instance drops its generation and computes no more.
    ///
    /// Errors: bad request for a model that is not decoupled, and as [`Model::check_request`];
    /// too many requests when the queue is full.
    pub fn infer_stream(&self, mut req: InferRequest) -> ServeResult<mpsc::Receiver<StreamItem>> {
        if !self.decoupled {
            return Err(ServeError::bad_request(format!(
                "model '{}' answers once per request: call infer (a stream of responses needs a decoupled model)",
                self.name
            )));
        }
        let (inputs, batch) = self.check_request(&mut req)?;
        let (tx, rx) = mpsc::channel(1);
        let (reply, _) = oneshot::channel();
        self.queues[0].push(Pending {
            inputs,
            batch,
            enqueued: Instant::now(),
            sequence: None,
            reply,
            stream: Some(tx),
        })?;
        Ok(rx)
    }

    /// Counts a finished stream in the statistics: `responses` sent, `ok` whether it ended
    /// without error, after `elapsed`.
    pub fn stream_done(&self, ok: bool, elapsed: Duration) {
        let s = &self.stats;
        let ns = elapsed.as_nanos() as u64;
        if ok {
            s.success.fetch_add(1, Ordering::Relaxed);
            s.success_ns.fetch_add(ns, Ordering::Relaxed);
            s.inference_count.fetch_add(1, Ordering::Relaxed);
            let ms = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis() as u64;
            s.last_inference_ms.store(ms, Ordering::Relaxed);
        } else {
            s.failure.fetch_add(1, Ordering::Relaxed);
            s.failure_ns.fetch_add(ns, Ordering::Relaxed);
        }
    }

    /// Stops taking requests, lets the instances finish those queued, and waits for them.
    pub async fn shutdown(&self) {
        for q in &self.queues {
            q.close();
        }
    }

    /// Stops taking requests and fails those still queued as the server shutting down.
    pub fn abort(&self) {
        for q in &self.queues {
            q.abort(ServeError::new(
                ServeErrorKind::ShuttingDown,
                "the server is shutting down (its drain time is up)",
            ));
        }
    }

    /// Waits for every instance task to end (after [`Model::shutdown`]); returns at once while
    /// requests still hold the model (its instances end when the queue is empty either way).
    pub async fn join(self: Arc<Self>) {
        let mut model = match Arc::try_unwrap(self) {
            Ok(m) => m,
            Err(_) => return,
        };
        for w in std::mem::take(&mut model.workers) {
            let _ = w.await;
        }
    }
}

/// No instance outlives its model: a model dropped without [`Model::shutdown`] (a reload
/// that replaced it, a failed swap) closes its queue, so its instance tasks finish what is
/// queued and end, freeing their slots in the sandbox's instance pool.
impl Drop for Model {
    fn drop(&mut self) {
        for q in &self.queues {
            q.close();
        }
        self.metrics
            .retire(self.tenant.name(), &self.tenant.usage());
    }
}

/// The batcher's key of a sequence (tenant and id hashed: two requests of one sequence never
/// share a batch; a collision only keeps two sequences apart).
fn sequence_hash(tenant: &str, id: &crate::protocol::SequenceId) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (tenant, id).hash(&mut h);
    h.finish()
}

fn names(ds: &[TensorDecl]) -> String {
    ds.iter()
        .map(|d| d.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The configuration's `input`/`output`, where given, must be what the guest declares. The
/// inputs of a sequence model are the configured ones plus its control inputs, which Triton's
/// configurations name only in `sequence_batching.control_input` (its `simple_sequence`); a
/// configuration that also lists them in `input` is taken as well.
fn check_declared(config: &ModelConfig, m: &GuestMetadata) -> Result<()> {
    let declared_inputs = without_controls(config, &m.inputs);
    for (what, cfg, decl) in [
        ("input", &config.input, &declared_inputs),
        ("output", &config.output, &m.outputs),
    ] {
        if cfg.is_empty() {
            continue;
        }
        for c in cfg {
            let Some(d) = decl.iter().find(|d| d.name == c.name) else {
                bail!(
                    "the config declares {what} `{}`, the model has no such {what}",
                    c.name
                );
            };
            let dt = Datatype::from_name(&c.data_type).unwrap_or(Datatype::Bytes);
            if dt != d.datatype || c.dims != d.dims {
                bail!(
                    "{what} `{}`: the config says {} {:?}, the model declares {} {:?}",
                    c.name,
                    dt.name(),
                    c.dims,
                    d.datatype.name(),
                    d.dims
                );
            }
        }
        if cfg.len() != decl.len() {
            bail!(
                "the config declares {} {what}s, the model {} ({})",
                cfg.len(),
                decl.len(),
                names(decl)
            );
        }
    }
    Ok(())
}

/// `inputs` without the configuration's sequence control inputs (the server fills them),
/// except those the configuration also lists in `input`.
fn without_controls(config: &ModelConfig, inputs: &[TensorDecl]) -> Vec<TensorDecl> {
    let controls: Vec<&str> = config
        .sequence_batching
        .iter()
        .flat_map(|sb| sb.control_input.iter().map(|c| c.name.as_str()))
        .collect();
    inputs
        .iter()
        .filter(|d| {
            !controls.contains(&d.name.as_str()) || config.input.iter().any(|c| c.name == d.name)
        })
        .cloned()
        .collect()
}

/// Sends each request of `batch` its part of the outputs.
fn reply(
    batch: Vec<Pending>,
    parts: Vec<Vec<Tensor>>,
    compute: Duration,
    weights: &Arc<[WeightTag]>,
) {
    let now = Instant::now();
    for (p, outputs) in batch.into_iter().zip(parts) {
        let queued = now
            .saturating_duration_since(p.enqueued)
            .saturating_sub(compute);
        let _ = p.reply.send(Ok(Batched {
            outputs,
            queued,
            compute,
            weights: Arc::clone(weights),
        }));
    }
}

/// One instance's task: takes batches from the queue, runs them, replaces the instance when
/// it breaks.
struct Worker {
    name: String,
    /// Its place among the model's instances.
    index: usize,
    /// The device its instance runs on (and a replacement too).
    device: u32,
    queue: Arc<Queue>,
    /// A stateful model's sequences: told when this instance is replaced.
    sequencer: Option<Arc<Sequencer>>,
    stats: Arc<ModelStats>,
    ctx: LoadContext,
    kind: Kind,
    tenant: Arc<Tenant>,
    outputs: Vec<TensorDecl>,
    /// A decoupled model's stream bounds.
    decoupled: super::config::DecoupledSection,
}

/// A stream in flight on a decoupled model's instance.
struct Active {
    generation: GenerationHandle,
    tx: mpsc::Sender<StreamItem>,
    /// When the client last took a response (or the stream started): a stream whose client
    /// takes nothing for `stall_seconds` is ended.
    progressed: Instant,
}

/// How a decoupled instance's wait ended.
enum Wake {
    /// Stream `i`'s client has room for a response (or went away: `None`).
    Room(usize, Option<mpsc::OwnedPermit<StreamItem>>),
    /// New requests.
    Requests(Option<Vec<Pending>>),
    /// A stream may have stalled.
    Stall,
}

impl Worker {
    /// Its instance broke: the sequences it held lost their state.
    fn replaced(&self) {
        if let Some(sq) = &self.sequencer {
            sq.instance_replaced(self.index);
        }
    }

    async fn run(self, instance: Runner) {
        let mut instance = Some(instance);
        while let Some(batch) = self.queue.next_batch().await {
            let inst = match &mut instance {
                Some(i) => i,
                None => match self
                    .kind
                    .instance(&self.ctx, &self.name, &self.tenant, self.device)
                    .await
                {
                    Ok(i) => {
                        let i = i.counted_in(self.ctx.metrics.instances_of(&self.name));
                        self.stats.instance_restarts.fetch_add(1, Ordering::Relaxed);
                        instance.insert(i)
                    }
                    Err(e) => {
                        let msg = format!(
                            "model `{}`: replacing its instance failed: {e:#}",
                            self.name
                        );
                        tracing::error!("{msg}");
                        for p in batch {
                            let _ = p
                                .reply
                                .send(Err(ServeError::new(ServeErrorKind::Internal, msg.clone())));
                        }
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                },
            };
            let (outcome, compute, broken) = self.execute(inst, &batch).await;
            if broken {
                instance = None;
                self.replaced();
            }
            match outcome {
                Ok((parts, weights)) => reply(batch, parts, compute, &weights),
                // One request the guest refused would fail every request merged with it: run
                // them one by one, so only the bad one fails.
                Err(e) if e.kind == ServeErrorKind::BadRequest && batch.len() > 1 => {
                    for p in batch {
                        let Some(inst) = instance.as_mut() else {
                            let _ = p.reply.send(Err(e.clone()));
                            continue;
                        };
                        let one = std::slice::from_ref(&p);
                        let (outcome, compute, broken) = self.execute(inst, one).await;
                        if broken {
                            instance = None;
                            self.replaced();
                        }
                        match outcome {
                            Ok((parts, weights)) => reply(vec![p], parts, compute, &weights),
                            Err(e) => {
                                let _ = p.reply.send(Err(e));
                            }
                        }
                    }
                }
                Err(e) => {
                    for p in batch {
                        let _ = p.reply.send(Err(e.clone()));
                    }
                }
            }
        }
    }

    /// A decoupled model's instance task: starts the queued requests (up to
    /// `max_generations` at a time) and steps them, one `next` call at a time, each when its
    /// client has room for a response; ends a stream whose client went away or stalled;
    /// replaces the instance when it breaks (every stream on it fails).
    async fn run_decoupled(self, instance: Runner) {
        let Runner::Guest(first) = instance else {
            tracing::error!(model = %self.name, "a decoupled model needs a component instance");
            return;
        };
        let max = self.decoupled.max_generations.max(1) as usize;
        let stall = Duration::from_secs_f64(self.decoupled.stall_seconds);
        let mut instance = Some(first);
        let mut active: std::collections::VecDeque<Active> = std::collections::VecDeque::new();
        let mut open = true;
        loop {
            if active.is_empty() {
                if !open {
                    return;
                }
                match self.queue.next_batch().await {
                    Some(batch) => self.start_all(&mut instance, &mut active, batch).await,
                    None => return,
                }
                continue;
            }
            while open && active.len() < max {
                match self.queue.try_next() {
                    Some(batch) => self.start_all(&mut instance, &mut active, batch).await,
                    None => break,
                }
            }
            if active.is_empty() {
                continue;
            }
            let oldest = active
                .iter()
                .map(|a| a.progressed)
                .min()
                .unwrap_or_else(Instant::now);
            let wake = {
                let rooms = active.iter().enumerate().map(|(i, a)| {
                    let tx = a.tx.clone();
                    Box::pin(async move { (i, tx.reserve_owned().await.ok()) })
                });
                let rooms = futures::future::select_all(rooms);
                tokio::select! {
                    ((i, permit), _, _) = rooms => Wake::Room(i, permit),
                    b = self.queue.next_batch(), if open && active.len() < max => Wake::Requests(b),
                    _ = tokio::time::sleep_until((oldest + stall).into()) => Wake::Stall,
                }
            };
            match wake {
                Wake::Requests(Some(batch)) => {
                    self.start_all(&mut instance, &mut active, batch).await;
                }
                Wake::Requests(None) => open = false,
                Wake::Stall => {
                    let now = Instant::now();
                    // Stalled: no room for a response (the client takes none) for too long.
                    let (stalled, kept): (Vec<Active>, Vec<Active>) =
                        active.drain(..).partition(|a| {
                            a.tx.capacity() == 0
                                && now.saturating_duration_since(a.progressed) >= stall
                        });
                    active.extend(kept);
                    for a in stalled {
                        tracing::info!(model = %self.name, "a stream's client took no response for {stall:?}: ended");
                        self.ctx.metrics.stream_cancelled(&self.name, "stalled");
                        self.end(&mut instance, &mut active, a.generation).await;
                    }
                }
                Wake::Room(i, None) => {
                    // The client went away: stop its generation.
                    let a = active.remove(i).expect("index from the list");
                    self.ctx.metrics.stream_cancelled(&self.name, "client gone");
                    self.end(&mut instance, &mut active, a.generation).await;
                }
                Wake::Room(i, Some(permit)) => {
                    let a = active.remove(i).expect("index from the list");
                    let Some(inst) = instance.as_mut() else {
                        permit.send(Err(self.lost()));
                        continue;
                    };
                    let started = Instant::now();
                    let result = inst.next(a.generation).await;
                    self.ctx.metrics.executed(&self.name, self.device);
                    self.stats
                        .compute_ns
                        .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    match result {
                        Ok(Some(outputs)) => match self.check_outputs(outputs) {
                            Ok(outputs) => {
                                permit.send(Ok(Some(outputs)));
                                self.ctx.metrics.stream_response(&self.name);
                                // To the back: the streams take turns.
                                active.push_back(Active {
                                    progressed: Instant::now(),
                                    ..a
                                });
                            }
                            Err(e) => {
                                permit.send(Err(e));
                                self.end(&mut instance, &mut active, a.generation).await;
                            }
                        },
                        Ok(None) => {
                            permit.send(Ok(None));
                            self.end(&mut instance, &mut active, a.generation).await;
                        }
                        Err(InferFailure::Model(e)) => {
                            permit.send(Err(ServeError::from_model(&self.name, &e)));
                            self.end(&mut instance, &mut active, a.generation).await;
                        }
                        Err(InferFailure::Broken(msg)) => {
                            let e = self.broke(&msg);
                            permit.send(Err(e.clone()));
                            for other in active.drain(..) {
                                let _ = other.tx.try_send(Err(e.clone()));
                            }
                            instance = None;
                            self.replaced();
                        }
                    }
                }
            }
        }
    }

    /// Starts each request of `batch` on the instance (made again first if it broke): a
    /// request the guest refuses gets its error; one that breaks the instance fails every
    /// stream on it.
    async fn start_all(
        &self,
        instance: &mut Option<Instance>,
        active: &mut std::collections::VecDeque<Active>,
        batch: Vec<Pending>,
    ) {
        for p in batch {
            let Some(tx) = p.stream else {
                let _ = p.reply.send(Err(ServeError::bad_request(
                    "a decoupled model answers only streaming calls",
                )));
                continue;
            };
            if tx.is_closed() {
                continue;
            }
            if instance.is_none() {
                match self
                    .kind
                    .instance(&self.ctx, &self.name, &self.tenant, self.device)
                    .await
                {
                    Ok(Runner::Guest(i)) => {
                        let gauge = self.ctx.metrics.instances_of(&self.name);
                        self.stats.instance_restarts.fetch_add(1, Ordering::Relaxed);
                        *instance = Some(i.counted_in(gauge));
                    }
                    Ok(Runner::Native(_)) => {
                        let _ = tx.try_send(Err(self.lost()));
                        continue;
                    }
                    Err(e) => {
                        let msg = format!(
                            "model `{}`: replacing its instance failed: {e:#}",
                            self.name
                        );
                        tracing::error!("{msg}");
                        let _ = tx.try_send(Err(ServeError::new(ServeErrorKind::Internal, msg)));
                        continue;
                    }
                }
            }
            let inst = instance.as_mut().expect("made above");
            self.stats.execution_count.fetch_add(1, Ordering::Relaxed);
            let started = Instant::now();
            let result = inst.start(p.inputs).await;
            self.stats.queue_ns.fetch_add(
                started.saturating_duration_since(p.enqueued).as_nanos() as u64,
                Ordering::Relaxed,
            );
            self.stats
                .compute_ns
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match result {
                Ok(generation) => active.push_back(Active {
                    generation,
                    tx,
                    progressed: Instant::now(),
                }),
                // A fresh channel has room for the one message.
                Err(InferFailure::Model(e)) => {
                    let _ = tx.try_send(Err(ServeError::from_model(&self.name, &e)));
                }
                Err(InferFailure::Broken(msg)) => {
                    let e = self.broke(&msg);
                    let _ = tx.try_send(Err(e.clone()));
                    for other in active.drain(..) {
                        let _ = other.tx.try_send(Err(e.clone()));
                    }
                    *instance = None;
                    self.replaced();
                }
            }
        }
    }

    /// Drops `generation` in the guest; a destructor that breaks the instance replaces it, and
    /// every stream still `active` on it fails.
    async fn end(
        &self,
        instance: &mut Option<Instance>,
        active: &mut std::collections::VecDeque<Active>,
        generation: GenerationHandle,
    ) {
        if let Some(inst) = instance.as_mut()
            && let Err(InferFailure::Broken(msg)) = inst.end(generation).await
        {
            let e = self.broke(&msg);
            for other in active.drain(..) {
                let _ = other.tx.try_send(Err(e.clone()));
            }
            *instance = None;
            self.replaced();
        }
    }

    /// The error of a request whose instance broke.
    fn broke(&self, msg: &str) -> ServeError {
        tracing::warn!(model = %self.name, "instance replaced: {msg}");
        ServeError::new(
            ServeErrorKind::Internal,
            format!("model `{}`: {msg}; the instance was replaced", self.name),
        )
    }

    /// The error of a stream whose instance was replaced under it.
    fn lost(&self) -> ServeError {
        ServeError::new(
            ServeErrorKind::Internal,
            format!(
                "model `{}`: the instance serving this stream failed and was replaced",
                self.name
            ),
        )
    }

    /// Runs `batch` as one `infer`: its outputs split per request, how long the call took, and
    /// whether the instance broke (and must be replaced).
    async fn execute(
        &self,
        inst: &mut Runner,
        batch: &[Pending],
    ) -> (
        ServeResult<(Vec<Vec<Tensor>>, Arc<[WeightTag]>)>,
        Duration,
        bool,
    ) {
        let sizes: Vec<u64> = batch.iter().map(|p| p.batch).collect();
        let started = Instant::now();
        let inputs = merge(batch);
        self.stats.execution_count.fetch_add(1, Ordering::Relaxed);
        self.ctx.metrics.executed(&self.name, self.device);
        let result = inst.infer(inputs).await;
        let weights = inst.take_weights_read();
        let compute = started.elapsed();
        {
            let mut b = self.stats.batches.lock().unwrap();
            let e = b.entry(sizes.iter().sum()).or_default();
            e.0 += 1;
            e.1 += compute.as_nanos() as u64;
        }
        match result {
            Ok(outputs) => (
                self.check_outputs(outputs)
                    .and_then(|o| split(o, &sizes))
                    .map(|parts| (parts, weights)),
                compute,
                false,
            ),
            Err(InferFailure::Model(e)) => {
                (Err(ServeError::from_model(&self.name, &e)), compute, false)
            }
            Err(InferFailure::Broken(msg)) => {
                tracing::warn!(model = %self.name, "instance replaced: {msg}");
                (
                    Err(ServeError::new(
                        ServeErrorKind::Internal,
                        format!("model `{}`: {msg}; the instance was replaced", self.name),
                    )),
                    compute,
                    true,
                )
            }
        }
    }

    /// The guest's outputs must be the declared ones, each once, well-formed; returned in
    /// declared order.
    fn check_outputs(&self, mut outputs: Vec<Tensor>) -> ServeResult<Vec<Tensor>> {
        let broke = |m: String| {
            ServeError::new(
                ServeErrorKind::Internal,
                format!("model `{}` broke its contract: {m}", self.name),
            )
        };
        let mut ordered = Vec::with_capacity(self.outputs.len());
        for d in &self.outputs {
            let Some(i) = outputs.iter().position(|t| t.name == d.name) else {
                return Err(broke(format!("it returned no output `{}`", d.name)));
            };
            let t = outputs.swap_remove(i);
            if t.datatype != d.datatype {
                return Err(broke(format!(
                    "output `{}` is {}, declared {}",
                    d.name,
                    t.datatype.name(),
                    d.datatype.name()
                )));
            }
            t.check().map_err(|e| broke(e.message))?;
            ordered.push(t);
        }
        if let Some(t) = outputs.first() {
            return Err(broke(format!(
                "it returned an undeclared output `{}`",
                t.name
            )));
        }
        Ok(ordered)
    }
}
