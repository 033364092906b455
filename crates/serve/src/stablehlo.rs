//! StableHLO models: an exported program (VHLO bytecode as `jax.export` writes it, or StableHLO
//! text), its weights in a safetensors file and a `config.toml` with a `[tpubox.stablehlo]`
//! table, served with no guest component. tpubox runs them natively, through the session layer
//! like every tenant: each instance is one [`Session`] of the model's tenant, which compiles the
//! programs (compile cache, program policy, limits), charges every input it uploads and every
//! result, and opens the weights as read-only handles of a shared weight set.
//!
//! A program has static shapes, so the model lists one program per batch size (a *bucket*);
//! a merged batch runs in the smallest bucket that holds it, its inputs padded with zeros, and
//! its results are sliced back to the batch's rows. The padding rows are never returned.
//!
//! Everything the configuration promises is checked against each compiled program and the
//! weight file before the model serves ([`Plan::check_program`], [`Plan::check_unused_weights`]):
//! the parameter and result counts, each parameter's and result's dtype and dims against the
//! weight or the declared input or output it stands for, missing and extra weights. The
//! messages name the file and the parameter. `tpubox model check DIR` runs the same checks
//! ([`check_dir`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use pjrt::PrimitiveType;
use safetensors::SafeTensors;

use super::config::ModelConfig;
use super::instance::{GuestMetadata, InferFailure, TensorDecl};
use super::protocol::{Datatype, Tensor};
use tpubox_core::device::DeviceService;
use tpubox_core::error::DeviceError;
use tpubox_core::placement::Placement;
use tpubox_core::session::{ExecutableHandle, ProgramFormat, Session, TensorHandle};
use tpubox_core::tenant::Tenant;
use tpubox_core::types::TensorSpec;
use tpubox_core::weights::{WeightRegistry, WeightSet};

/// The default weight file of a StableHLO model, relative to its directory.
pub const DEFAULT_WEIGHTS: &str = "weights.safetensors";

/// The XLA element type of a protocol datatype; `None` for `BYTES`, which a program cannot take.
pub fn xla_type(d: Datatype) -> Option<PrimitiveType> {
    Some(match d {
        Datatype::Bool => PrimitiveType::Pred,
        Datatype::Uint8 => PrimitiveType::U8,
        Datatype::Uint16 => PrimitiveType::U16,
        Datatype::Uint32 => PrimitiveType::U32,
        Datatype::Uint64 => PrimitiveType::U64,
        Datatype::Int8 => PrimitiveType::S8,
        Datatype::Int16 => PrimitiveType::S16,
        Datatype::Int32 => PrimitiveType::S32,
        Datatype::Int64 => PrimitiveType::S64,
        Datatype::Fp16 => PrimitiveType::F16,
        Datatype::Bf16 => PrimitiveType::Bf16,
        Datatype::Fp32 => PrimitiveType::F32,
        Datatype::Fp64 => PrimitiveType::F64,
        Datatype::Bytes => return None,
    })
}

fn spec_text(ty: PrimitiveType, dims: &[i64]) -> String {
    tpubox_core::types::format_spec(&TensorSpec {
        ty,
        dims: dims.to_vec(),
    })
}

/// Where one program parameter comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Param {
    /// The weight of this name in the model's weight set.
    Weight(String),
    /// The declared input at this position.
    Input(usize),
}

/// One bucket: a program exported for one batch size.
#[derive(Debug, Clone)]
pub struct Bucket {
    /// The leading dimension of its inputs and results; 0 for a model without a batch
    /// dimension.
    pub batch: u64,
    /// The program's file (for messages).
    pub file: PathBuf,
    /// The program's bytes.
    pub code: Arc<Vec<u8>>,
    /// Bytecode or text.
    pub format: ProgramFormat,
}

/// A weight of the model's file as its header describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightInfo {
    /// Element type.
    pub ty: PrimitiveType,
    /// Dimensions.
    pub dims: Vec<i64>,
}

/// A StableHLO model read from its directory and checked as far as can be without compiling:
/// its buckets (sorted by batch size), parameter and result mapping, declared inputs and
/// outputs, and the weight file's header.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The model's name.
    pub name: String,
    /// Programs by batch size, ascending.
    pub buckets: Vec<Bucket>,
    /// The weight file.
    pub weights_file: PathBuf,
    /// The shared weight set's name.
    pub weight_set: String,
    /// The weight file's tensors, by name (from its header).
    pub weights: BTreeMap<String, WeightInfo>,
    /// Where each parameter comes from, in order.
    pub params: Vec<Param>,
    /// The declared output (position) each result is, in order.
    pub results: Vec<usize>,
    /// Inputs, outputs (dims without the batch dimension) and the largest batch.
    pub metadata: GuestMetadata,
}

fn decls(ts: &[super::config::TensorConfig], what: &str) -> Result<Vec<TensorDecl>> {
    ts.iter()
        .map(|t| {
            let datatype = Datatype::from_name(&t.data_type)
                .with_context(|| format!("{what} `{}`: unknown data_type", t.name))?;
            if datatype == Datatype::Bytes {
                bail!(
                    "{what} `{}` is {}: a StableHLO program takes no strings",
                    t.name,
                    t.data_type
                );
            }
            if t.dims.iter().any(|&d| d < 0) {
                bail!(
                    "{what} `{}` has dims {:?}: a StableHLO model's dims are static (no -1; export one program per shape)",
                    t.name,
                    t.dims
                );
            }
            Ok(TensorDecl {
                name: t.name.clone(),
                datatype,
                dims: t.dims.clone(),
            })
        })
        .collect()
}

impl Plan {
    /// Reads the StableHLO model `name` in `dir` as `config` describes it: the programs' files,
    /// the weight file's header, and checks the mapping against the declared inputs and
    /// outputs.
    ///
    /// Errors (each names the file or the configuration entry): the config has no
    /// `[tpubox.stablehlo]` table or also names a component; no program; a program file that
    /// cannot be read; batch sizes missing, repeated or 0 in a batching model, or given in one
    /// without batching; `max_batch_size` over the largest batch size; a parameter with both or
    /// neither of `weight` and `input`, or naming an undeclared input; a declared input no
    /// parameter takes, or taken twice; a result naming an undeclared output, or an output no
    /// result is, or one that two are; a `BYTES` or `-1` input or output; a weight file that is
    /// missing or not valid safetensors, or a weight dtype XLA lacks.
    pub fn read(dir: &Path, name: &str, config: &ModelConfig) -> Result<Plan> {
        let Some(s) = &config.tpubox.stablehlo else {
            bail!("the config has no [tpubox.stablehlo] table");
        };
        if config.tpubox.component.is_some() {
            bail!(
                "[tpubox] component is set: a StableHLO model ([tpubox.stablehlo]) has no component"
            );
        }
        if config.input.is_empty() || config.output.is_empty() {
            bail!(
                "a StableHLO model declares its inputs and outputs ([[input]] and [[output]] with name, data_type, dims)"
            );
        }
        let inputs = decls(&config.input, "input")?;
        let outputs = decls(&config.output, "output")?;
        if s.programs.is_empty() {
            bail!("[tpubox.stablehlo] lists no program ([[tpubox.stablehlo.program]])");
        }
        // Without max_batch_size (config.pbtxt's 0 reads as unset, as protobuf has it), the
        // programs say: batch sizes make a batched model.
        let batching = match config.max_batch_size {
            Some(m) => m > 0,
            None => s.programs.iter().any(|p| p.batch_size.is_some()),
        };
        let mut buckets = Vec::with_capacity(s.programs.len());
        for p in &s.programs {
            let path = dir.join(&p.file);
            let batch = match (batching, p.batch_size) {
                (true, Some(b)) if b > 0 => u64::from(b),
                (true, _) => bail!(
                    "program {}: a model with a batch dimension gives each program its batch_size (≥ 1); set max_batch_size = 0 for a model without one",
                    p.file.display()
                ),
                (false, None) => 0,
                (false, Some(_)) => bail!(
                    "program {}: max_batch_size = 0 (no batch dimension), so no program has a batch_size",
                    p.file.display()
                ),
            };
            let code = std::fs::read(&path).with_context(|| {
                format!("program {}: reading {}", p.file.display(), path.display())
            })?;
            let format = if code.starts_with(b"ML\xefR") {
                ProgramFormat::MlirBytecode
            } else {
                ProgramFormat::MlirText
            };
            buckets.push(Bucket {
                batch,
                file: p.file.clone(),
                code: Arc::new(code),
                format,
            });
        }
        buckets.sort_by_key(|b| b.batch);
        if let Some(w) = buckets.windows(2).find(|w| w[0].batch == w[1].batch) {
            bail!(
                "programs {} and {} are both for batch size {}{}",
                w[0].file.display(),
                w[1].file.display(),
                w[0].batch,
                if batching {
                    ""
                } else {
                    " (a model without a batch dimension has one program)"
                }
            );
        }
        let largest = buckets.last().map_or(0, |b| b.batch);
        let max_batch_size = match config.max_batch_size {
            Some(0) => 0,
            Some(m) if u64::from(m) > largest => {
                bail!("max_batch_size {m} is larger than the largest program batch size, {largest}")
            }
            Some(m) => m,
            None => u32::try_from(largest).context("the largest batch size is over 2^32")?,
        };
        let mut params = Vec::with_capacity(s.parameters.len());
        let mut taken = vec![0usize; inputs.len()];
        for (i, p) in s.parameters.iter().enumerate() {
            params.push(match (&p.weight, &p.input) {
                (Some(w), None) => Param::Weight(w.clone()),
                (None, Some(n)) => {
                    let Some(j) = inputs.iter().position(|d| &d.name == n) else {
                        bail!("parameter {i} is input `{n}`, which no [[input]] declares");
                    };
                    taken[j] += 1;
                    Param::Input(j)
                }
                _ => bail!(
                    "parameter {i}: give exactly one of `weight = \"NAME\"` and `input = \"NAME\"`"
                ),
            });
        }
        for (d, n) in inputs.iter().zip(&taken) {
            if *n != 1 {
                bail!(
                    "input `{}` is taken by {n} parameters; each declared input is exactly one parameter",
                    d.name
                );
            }
        }
        let mut results = Vec::with_capacity(s.results.len());
        for (i, r) in s.results.iter().enumerate() {
            let Some(j) = outputs.iter().position(|d| &d.name == r) else {
                bail!("result {i} is output `{r}`, which no [[output]] declares");
            };
            if results.contains(&j) {
                bail!("output `{r}` is named by two results");
            }
            results.push(j);
        }
        if let Some(d) = outputs
            .iter()
            .enumerate()
            .find(|(j, _)| !results.contains(j))
        {
            bail!("output `{}` is no result of the program", d.1.name);
        }
        let weights_file = dir.join(s.weights.as_deref().unwrap_or(Path::new(DEFAULT_WEIGHTS)));
        let weights = read_weight_header(&weights_file)?;
        Ok(Plan {
            name: name.to_string(),
            buckets,
            weights_file,
            weight_set: s.weight_set.clone().unwrap_or_else(|| name.to_string()),
            weights,
            params,
            results,
            metadata: GuestMetadata {
                inputs,
                outputs,
                max_batch_size,
            },
        })
    }

    fn shaped(&self, batch: u64, dims: &[i64]) -> Vec<i64> {
        let mut v = Vec::with_capacity(dims.len() + 1);
        if self.metadata.max_batch_size > 0 {
            v.push(batch as i64);
        }
        v.extend_from_slice(dims);
        v
    }

    /// Checks a compiled program of `bucket` against the plan: the parameter count; each
    /// parameter's dtype and dims against its weight (which must be in the file) or its input
    /// (with the bucket's batch size in front); the result count, each result's dtype and dims
    /// against its output.
    ///
    /// Errors: a message naming the program's file and the parameter or result.
    pub fn check_program(
        &self,
        bucket: &Bucket,
        inputs: &[TensorSpec],
        outputs: &[TensorSpec],
    ) -> Result<()> {
        let file = bucket.file.display();
        if inputs.len() != self.params.len() {
            bail!(
                "{file}: the program has {} parameters, [tpubox.stablehlo] parameters lists {} (parameter count mismatch)",
                inputs.len(),
                self.params.len()
            );
        }
        for (i, (spec, p)) in inputs.iter().zip(&self.params).enumerate() {
            match p {
                Param::Weight(w) => {
                    let Some(info) = self.weights.get(w) else {
                        bail!(
                            "{file}: parameter {i} is weight `{w}`, which {} does not have (missing weight)",
                            self.weights_file.display()
                        );
                    };
                    if info.ty != spec.ty {
                        bail!(
                            "{file}: parameter {i} (weight `{w}`) is {} in the program, {} in {} (dtype mismatch)",
                            spec.ty.name(),
                            info.ty.name(),
                            self.weights_file.display()
                        );
                    }
                    if info.dims != spec.dims {
                        bail!(
                            "{file}: parameter {i} (weight `{w}`) is {} in the program, {} in {} (shape mismatch)",
                            spec_text(spec.ty, &spec.dims),
                            spec_text(info.ty, &info.dims),
                            self.weights_file.display()
                        );
                    }
                }
                Param::Input(j) => {
                    let d = &self.metadata.inputs[*j];
                    let ty = xla_type(d.datatype).expect("checked in Plan::read");
                    let want = self.shaped(bucket.batch, &d.dims);
                    if ty != spec.ty {
                        bail!(
                            "{file}: parameter {i} (input `{}`) is {} in the program, the config says {} (dtype mismatch)",
                            d.name,
                            spec.ty.name(),
                            d.datatype.config_name()
                        );
                    }
                    if want != spec.dims {
                        bail!(
                            "{file}: parameter {i} (input `{}`) is {} in the program, the config says {} for batch size {} (shape mismatch)",
                            d.name,
                            spec_text(spec.ty, &spec.dims),
                            spec_text(ty, &want),
                            bucket.batch
                        );
                    }
                }
            }
        }
        if outputs.len() != self.results.len() {
            bail!(
                "{file}: the program has {} results, [tpubox.stablehlo] results lists {} (result count mismatch)",
                outputs.len(),
                self.results.len()
            );
        }
        for (i, (spec, &j)) in outputs.iter().zip(&self.results).enumerate() {
            let d = &self.metadata.outputs[j];
            let ty = xla_type(d.datatype).expect("checked in Plan::read");
            let want = self.shaped(bucket.batch, &d.dims);
            if ty != spec.ty || want != spec.dims {
                bail!(
                    "{file}: result {i} (output `{}`) is {} in the program, the config says {} (result {} mismatch)",
                    d.name,
                    spec_text(spec.ty, &spec.dims),
                    spec_text(ty, &want),
                    if ty != spec.ty { "dtype" } else { "shape" }
                );
            }
        }
        Ok(())
    }

    /// Every tensor of the weight file must be a parameter: one that none is was probably
    /// meant for a parameter the program does not have.
    ///
    /// Errors: a message naming the file and the unused weights (extra weight).
    pub fn check_unused_weights(&self) -> Result<()> {
        let unused: Vec<&str> = self
            .weights
            .keys()
            .filter(|w| {
                !self
                    .params
                    .iter()
                    .any(|p| matches!(p, Param::Weight(n) if n == *w))
            })
            .map(String::as_str)
            .collect();
        if !unused.is_empty() {
            bail!(
                "{}: weight(s) {} are no parameter of the program (extra weight; [tpubox.stablehlo] parameters names the weights it takes)",
                self.weights_file.display(),
                unused
                    .iter()
                    .map(|w| format!("`{w}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(())
    }

    /// Compiles every bucket's program in `session`, for the session's default device (an
    /// instance's session is placed on the instance's device alone), and checks it
    /// ([`Plan::check_program`]), then the weights ([`Plan::check_unused_weights`]). Returns
    /// the executables, in bucket order.
    ///
    /// Errors: a compile error (an unreadable program, symbolic shapes, the program policy,
    /// the tenant's limits) naming the file; the checks' errors.
    pub async fn compile(&self, session: &Session) -> Result<Vec<ExecutableHandle>> {
        let device = session.placement().default_device();
        let mut exes = Vec::with_capacity(self.buckets.len());
        for b in &self.buckets {
            let exe = session
                .compile(b.code.as_ref().clone(), b.format, Some(device))
                .await
                .map_err(|e| anyhow::anyhow!("{}: {e}", b.file.display()))?;
            if exe.executable().device() != device {
                bail!(
                    "{}: compiled for device {}, the instance runs on device {device}",
                    b.file.display(),
                    exe.executable().device()
                );
            }
            self.check_program(b, exe.executable().inputs(), exe.executable().outputs())?;
            exes.push(exe);
        }
        self.check_unused_weights()?;
        Ok(exes)
    }
}

/// The tensors of a safetensors file, from its header (the data is not copied).
///
/// Errors: a missing or unreadable file, one that is not valid safetensors, a dtype XLA lacks.
pub fn read_weight_header(path: &Path) -> Result<BTreeMap<String, WeightInfo>> {
    let map = pjrt::MappedFile::open(path)
        .map_err(|e| anyhow::anyhow!("weights {}: {e}", path.display()))?;
    let st = SafeTensors::deserialize(map.as_slice()).map_err(|e| {
        anyhow::anyhow!(
            "weights {}: not a valid safetensors file: {e}",
            path.display()
        )
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let ty = tpubox_core::weights::xla_type(view.dtype()).with_context(|| {
            format!(
                "weights {}: tensor `{name}` has dtype {:?}, which XLA lacks",
                path.display(),
                view.dtype()
            )
        })?;
        let dims = view.shape().iter().map(|&d| d as i64).collect();
        out.insert(name, WeightInfo { ty, dims });
    }
    Ok(out)
}

/// One instance of a StableHLO model: a session of the model's tenant with the compiled
/// buckets and read-only handles of the weights.
pub struct NativeInstance {
    plan: Arc<Plan>,
    session: Session,
    exes: Vec<ExecutableHandle>,
    /// One per parameter: the weight's handle, or `None` for an input.
    weights: Vec<Option<TensorHandle>>,
    live: Option<super::instance::LiveCount>,
}

impl NativeInstance {
    /// The weight-set versions of the tensors read since the last call (the outputs' sets),
    /// forgotten by this call.
    pub fn take_weights_read(&self) -> Vec<tpubox_core::session::WeightTag> {
        self.session.take_weights_read()
    }

    /// A new instance on device `on`: a session of `tenant` placed on that device alone, the
    /// plan's programs compiled for it and checked (tier 1 of the compile cache serves every
    /// instance on a device after the first), the weights of the set [`Plan::weight_set`]
    /// (already loaded) opened read-only there (copied to the device once, on first use).
    ///
    /// Errors: as [`Plan::compile`]; the weight set or a weight is missing;
    /// `max-live-tensors`.
    pub async fn new(
        plan: Arc<Plan>,
        device: &Arc<DeviceService>,
        registry: &Arc<WeightRegistry>,
        tenant: Arc<Tenant>,
        on: u32,
    ) -> Result<Self> {
        let session = Session::new(Arc::clone(device), Arc::clone(registry), tenant)
            .with_placement(Placement::fixed(vec![on]));
        let exes = plan.compile(&session).await?;
        Self::from_compiled(plan, session, exes)
    }

    /// An instance from a session in which [`Plan::compile`] compiled `exes`; opens the
    /// weights of the set [`Plan::weight_set`] (already loaded) read-only.
    ///
    /// Errors: the weight set or a weight is missing; `max-live-tensors`; a weight of the
    /// loaded set whose dtype or dims are not the file's now (the file changed after the set
    /// was read).
    pub fn from_compiled(
        plan: Arc<Plan>,
        session: Session,
        exes: Vec<ExecutableHandle>,
    ) -> Result<Self> {
        let set: Arc<WeightSet> = session.open_weights(&plan.weight_set)?;
        let weights = plan
            .params
            .iter()
            .map(|p| match p {
                Param::Weight(w) => session.weight(&set, w).map(Some),
                Param::Input(_) => Ok(None),
            })
            .collect::<Result<Vec<_>, DeviceError>>()?;
        let device = session.placement().default_device();
        for (p, h) in plan.params.iter().zip(&weights) {
            if let (Param::Weight(w), Some(h)) = (p, h) {
                if h.device() != device {
                    bail!(
                        "weight `{w}` of set `{}` is on device {}, the instance runs on device {device}",
                        plan.weight_set,
                        h.device()
                    );
                }
                let info = &plan.weights[w];
                if h.spec().ty != info.ty || h.spec().dims != info.dims {
                    bail!(
                        "weight set `{}` holds `{w}` as {}, {} has it as {} now: the set was loaded before the file changed (load the model again to read it again)",
                        plan.weight_set,
                        tpubox_core::types::format_spec(h.spec()),
                        plan.weights_file.display(),
                        spec_text(info.ty, &info.dims)
                    );
                }
            }
        }
        Ok(NativeInstance {
            plan,
            session,
            exes,
            weights,
            live: None,
        })
    }

    /// Counts this instance in `gauge` while it lives.
    pub fn counted_in(mut self, gauge: prometheus::IntGauge) -> Self {
        self.live = Some(super::instance::LiveCount::new(gauge));
        self
    }

    /// Runs one merged batch: `inputs` in declared order, each with the batch's size in front
    /// (for a batching model). The batch runs in the smallest bucket that holds it, padded
    /// with zeros; the results are sliced back to the batch and returned as the declared
    /// outputs, in declared order.
    ///
    /// Errors: [`InferFailure::Model`] with the session's error (a limit of the model's tenant,
    /// an execution failure); [`InferFailure::Broken`] for inputs that do not match the plan
    /// (the model's checks let through nothing such).
    pub async fn infer(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, InferFailure> {
        let plan = Arc::clone(&self.plan);
        let batched = plan.metadata.max_batch_size > 0;
        let n = if batched {
            inputs
                .first()
                .and_then(|t| t.shape.first())
                .copied()
                .unwrap_or(0)
        } else {
            0
        };
        let Some(k) = plan.buckets.iter().position(|b| b.batch >= n) else {
            return Err(InferFailure::Broken(format!(
                "a batch of {n} is larger than every program's batch size"
            )));
        };
        let bucket = plan.buckets[k].batch;
        if inputs.len() != plan.metadata.inputs.len() {
            return Err(InferFailure::Broken(format!(
                "{} inputs for {} declared",
                inputs.len(),
                plan.metadata.inputs.len()
            )));
        }
        let model = |e: DeviceError| InferFailure::Model(e);
        let mut uploaded: Vec<Option<TensorHandle>> = Vec::with_capacity(inputs.len());
        for (t, d) in inputs.into_iter().zip(&plan.metadata.inputs) {
            let ty = xla_type(d.datatype).expect("checked in Plan::read");
            let dims: Vec<u64> = plan
                .shaped(bucket, &d.dims)
                .into_iter()
                .map(|x| x as u64)
                .collect();
            // Charged against the model's tenant before the padded buffer is made.
            let bytes = self.session.admit_tensor(ty, &dims).map_err(model)?;
            let mut data = t.data;
            if data.len() > bytes {
                return Err(InferFailure::Broken(format!(
                    "input `{}` has {} bytes, more than the {bytes} of its program's parameter",
                    d.name,
                    data.len()
                )));
            }
            data.resize(bytes, 0);
            let h = self
                .session
                .tensor_from_bytes(ty, &dims, &data, None)
                .map_err(model)?;
            uploaded.push(Some(h));
        }
        let args: Vec<&TensorHandle> = plan
            .params
            .iter()
            .zip(&self.weights)
            .map(|(p, w)| match (p, w) {
                (Param::Input(j), _) => uploaded[*j].as_ref().expect("uploaded above"),
                (Param::Weight(_), Some(h)) => h,
                (Param::Weight(_), None) => unreachable!("weights opened in NativeInstance::new"),
            })
            .collect();
        let results = self
            .session
            .execute(&self.exes[k], &args, &[])
            .await
            .map_err(model)?;
        drop(args);
        drop(uploaded);
        let mut outputs: Vec<Option<Tensor>> = vec![None; plan.metadata.outputs.len()];
        for (r, &j) in results.iter().zip(&plan.results) {
            let d = &plan.metadata.outputs[j];
            let mut data = self.session.read(r).await.map_err(model)?;
            let mut shape: Vec<u64> = r.spec().dims.iter().map(|&x| x as u64).collect();
            if batched {
                // The padding rows (bucket - n of them) are cut off here.
                let row = data.len() / bucket as usize;
                data.truncate(row * n as usize);
                shape[0] = n;
            }
            outputs[j] = Some(Tensor {
                name: d.name.clone(),
                datatype: d.datatype,
                shape,
                data,
            });
        }
        Ok(outputs
            .into_iter()
            .map(|o| o.expect("every output is a result"))
            .collect())
    }
}

/// What [`check_dir`] found: one line per checked item.
#[derive(Debug, Clone, Default)]
pub struct CheckReport {
    /// Human-readable lines: each program with its batch size, parameters and results; the
    /// weights.
    pub lines: Vec<String>,
}

/// Checks the StableHLO model in `dir` as a load would, without serving it: reads its
/// configuration, compiles each program on `device` in a session of a tenant with the model's
/// limits and program policy, and checks programs, weights and configuration against each
/// other. Nothing is loaded onto the device but the compiled programs (the weights are checked
/// from the file's header).
///
/// Errors: the configuration's, [`Plan::read`]'s and [`Plan::compile`]'s errors, naming the file
/// and the parameter.
pub async fn check_dir(device: &Arc<DeviceService>, dir: &Path) -> Result<CheckReport> {
    let name = dir
        .canonicalize()
        .with_context(|| format!("model directory {}", dir.display()))?
        .file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
        .context("the model directory has no UTF-8 name")?;
    let mut config = ModelConfig::load(dir)?;
    let mut report = CheckReport::default();
    // An ONNX model: the converter explains it (its ops, which convert at which batch sizes),
    // then it is converted (or found in the cache) and checked as the StableHLO model it is.
    if let Some(onnx) = super::onnx::onnx_file(&config, dir) {
        let converter = super::onnx::OnnxConverter::from_env();
        let pbtxt = dir.join("config.pbtxt");
        let pbtxt = pbtxt.is_file().then_some(pbtxt);
        report
            .lines
            .extend(super::onnx::explain(&converter, &onnx, pbtxt.as_deref(), &config).await?);
        super::onnx::prepare(&converter, &name, &onnx, pbtxt.as_deref(), &mut config).await?;
    }
    if config.tpubox.stablehlo.is_none() {
        bail!(
            "{}: not a StableHLO model (its config has no [tpubox.stablehlo] table) nor an ONNX one (no model.onnx); `tpubox model check` checks those",
            dir.display()
        );
    }
    let plan = Plan::read(dir, &name, &config)?;
    let tenant = Tenant::new(format!("model:{name}"), config.tenant_limits());
    let session = Session::new(Arc::clone(device), Arc::default(), tenant);
    let exes = plan.compile(&session).await?;
    for (b, e) in plan.buckets.iter().zip(&exes) {
        let specs = |s: &[TensorSpec]| {
            s.iter()
                .map(tpubox_core::types::format_spec)
                .collect::<Vec<_>>()
                .join(", ")
        };
        report.lines.push(format!(
            "{}: batch size {}: ({}) -> ({}): ok",
            b.file.display(),
            b.batch,
            specs(e.executable().inputs()),
            specs(e.executable().outputs())
        ));
    }
    report.lines.push(format!(
        "{}: {} weights, all parameters: ok",
        plan.weights_file.display(),
        plan.weights.len()
    ));
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file with F32 tensors of the given shapes (zeros).
    fn safetensors(tensors: &[(&str, &[usize])]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut off = 0usize;
        for (name, shape) in tensors {
            let n: usize = shape.iter().product::<usize>() * 4;
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}),
            );
            off += n;
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.resize(out.len() + off, 0);
        out
    }

    const CONFIG: &str = r#"
max_batch_size = 8
[[input]]
name = "x"
data_type = "TYPE_FP32"
dims = [4]
[[output]]
name = "y"
data_type = "TYPE_FP32"
dims = [3]
[tpubox.stablehlo]
parameters = [{ weight = "w" }, { input = "x" }]
results = ["y"]
[[tpubox.stablehlo.program]]
batch_size = 8
file = "b8.mlir"
[[tpubox.stablehlo.program]]
batch_size = 2
file = "b2.mlir"
"#;

    fn model(config: &str, weights: &[(&str, &[usize])]) -> (tempfile::TempDir, PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("m");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("config.toml"), config).unwrap();
        std::fs::write(dir.join("b8.mlir"), "module {}").unwrap();
        std::fs::write(dir.join("b2.mlir"), "module {}").unwrap();
        std::fs::write(dir.join(DEFAULT_WEIGHTS), safetensors(weights)).unwrap();
        (root, dir)
    }

    fn read(config: &str, weights: &[(&str, &[usize])]) -> Result<Plan> {
        let (_root, dir) = model(config, weights);
        let c = ModelConfig::load(&dir)?;
        Plan::read(&dir, "m", &c)
    }

    fn spec(dims: &[i64]) -> TensorSpec {
        TensorSpec {
            ty: PrimitiveType::F32,
            dims: dims.to_vec(),
        }
    }

    #[test]
    fn reads_the_plan_with_sorted_buckets() {
        let p = read(CONFIG, &[("w", &[4, 3])]).unwrap();
        assert_eq!(
            p.buckets.iter().map(|b| b.batch).collect::<Vec<_>>(),
            [2, 8]
        );
        assert_eq!(p.metadata.max_batch_size, 8);
        assert_eq!(p.params, [Param::Weight("w".into()), Param::Input(0)]);
        assert_eq!(p.results, [0]);
        assert_eq!(p.weight_set, "m");
        assert_eq!(p.buckets[0].format, ProgramFormat::MlirText);
        let b = &p.buckets[0];
        p.check_program(b, &[spec(&[4, 3]), spec(&[2, 4])], &[spec(&[2, 3])])
            .unwrap();
        p.check_unused_weights().unwrap();
    }

    #[test]
    fn each_mismatch_names_the_file_and_the_parameter() {
        let p = read(CONFIG, &[("w", &[4, 3]), ("unused", &[2])]).unwrap();
        let b = &p.buckets[0];
        let err = |ins: &[TensorSpec], outs: &[TensorSpec]| {
            format!("{:#}", p.check_program(b, ins, outs).unwrap_err())
        };
        let e = err(&[spec(&[2, 4])], &[spec(&[2, 3])]);
        assert!(
            e.starts_with("b2.mlir: the program has 1 parameters")
                && e.contains("parameter count mismatch"),
            "{e}"
        );
        let e = err(&[spec(&[4, 4]), spec(&[2, 4])], &[spec(&[2, 3])]);
        assert!(
            e.starts_with("b2.mlir: parameter 0 (weight `w`) is f32[4,4]")
                && e.contains("shape mismatch"),
            "{e}"
        );
        let bf = TensorSpec {
            ty: PrimitiveType::Bf16,
            dims: vec![4, 3],
        };
        let e = err(&[bf, spec(&[2, 4])], &[spec(&[2, 3])]);
        assert!(
            e.contains("parameter 0 (weight `w`) is BF16") && e.contains("dtype mismatch"),
            "{e}"
        );
        let e = err(&[spec(&[4, 3]), spec(&[8, 4])], &[spec(&[2, 3])]);
        assert!(
            e.contains("parameter 1 (input `x`)")
                && e.contains("for batch size 2 (shape mismatch)"),
            "{e}"
        );
        let e = err(
            &[spec(&[4, 3]), spec(&[2, 4])],
            &[spec(&[2, 3]), spec(&[2, 3])],
        );
        assert!(e.contains("result count mismatch"), "{e}");
        let e = err(&[spec(&[4, 3]), spec(&[2, 4])], &[spec(&[2, 5])]);
        assert!(
            e.contains("result 0 (output `y`)") && e.contains("shape mismatch"),
            "{e}"
        );
        let e = format!("{:#}", p.check_unused_weights().unwrap_err());
        assert!(
            e.contains("weights.safetensors")
                && e.contains("`unused`")
                && e.contains("extra weight"),
            "{e}"
        );
        let p = read(CONFIG, &[("v", &[4, 3])]).unwrap();
        let e = format!(
            "{:#}",
            p.check_program(
                &p.buckets[0],
                &[spec(&[4, 3]), spec(&[2, 4])],
                &[spec(&[2, 3])]
            )
            .unwrap_err()
        );
        assert!(
            e.contains("parameter 0 is weight `w`") && e.contains("missing weight"),
            "{e}"
        );
    }

    #[test]
    fn bad_configs_are_refused_before_compiling() {
        let w: &[(&str, &[usize])] = &[("w", &[4, 3])];
        for (edit, want) in [
            (
                CONFIG.replace("{ input = \"x\" }", "{ input = \"x\" }, { input = \"x\" }"),
                "input `x` is taken by 2 parameters",
            ),
            (
                CONFIG.replace("{ input = \"x\" }", "{ input = \"z\" }"),
                "parameter 1 is input `z`, which no [[input]] declares",
            ),
            (
                CONFIG.replace("{ weight = \"w\" }", "{ weight = \"w\", input = \"x\" }"),
                "parameter 0: give exactly one",
            ),
            (
                CONFIG.replace("results = [\"y\"]", "results = [\"z\"]"),
                "result 0 is output `z`",
            ),
            (
                CONFIG.replace("results = [\"y\"]", "results = []"),
                "output `y` is no result",
            ),
            (
                CONFIG.replace("max_batch_size = 8", "max_batch_size = 9"),
                "max_batch_size 9 is larger than the largest program batch size, 8",
            ),
            (
                CONFIG.replace("batch_size = 2", "batch_size = 8"),
                "are both for batch size 8",
            ),
            (
                CONFIG.replace("batch_size = 2\n", ""),
                "program b2.mlir: a model with a batch dimension gives each program its batch_size",
            ),
            (
                CONFIG.replace("dims = [4]", "dims = [-1]"),
                "input `x` has dims [-1]",
            ),
            (
                CONFIG.replace(
                    "data_type = \"TYPE_FP32\"\ndims = [4]",
                    "data_type = \"TYPE_STRING\"\ndims = [4]",
                ),
                "input `x` is TYPE_STRING",
            ),
            (
                CONFIG.replace("file = \"b2.mlir\"", "file = \"gone.mlir\""),
                "program gone.mlir: reading",
            ),
            (
                CONFIG.replace(
                    "[tpubox.stablehlo]",
                    "[tpubox.stablehlo]\nweights = \"nope.safetensors\"",
                ),
                "nope.safetensors",
            ),
        ] {
            let e = format!("{:#}", read(&edit, w).unwrap_err());
            assert!(e.contains(want), "want `{want}` in: {e}");
        }
        let (_root, dir) = model(CONFIG, w);
        std::fs::write(dir.join(DEFAULT_WEIGHTS), b"not safetensors").unwrap();
        let c = ModelConfig::load(&dir).unwrap();
        let e = format!("{:#}", Plan::read(&dir, "m", &c).unwrap_err());
        assert!(e.contains("not a valid safetensors file"), "{e}");
    }
}
