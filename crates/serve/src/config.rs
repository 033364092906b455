//! A model's configuration (`config.toml` or `config.json` in its repository directory), with
//! Triton's field names wherever a field means the same thing, and its Triton JSON form for
//! `GET /v2/models/{m}/config`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use serde_json::{Value, json};

use super::protocol::Datatype;
use super::triton_schema::{Format, Normalized, normalize};
use tpubox_core::tenant::TenantLimits;
pub use tpubox_session_api::policy::DevicesField;

/// One declared input or output (`[[input]]`, `[[output]]`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TensorConfig {
    /// Name.
    pub name: String,
    /// `TYPE_FP32`, `TYPE_STRING`, … (or the protocol's `FP32`, `BYTES`). Required: absent,
    /// it reads as Triton's `TYPE_INVALID` (the enum's 0), and the load fails.
    #[serde(default = "type_invalid")]
    pub data_type: String,
    /// Dimensions without the batch dimension; -1 for any size. Absent: none (a scalar per
    /// batch item), as protobuf reads an empty list.
    #[serde(default)]
    pub dims: Vec<i64>,
}

fn type_invalid() -> String {
    "TYPE_INVALID".into()
}

/// `[[instance_group]]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct InstanceGroup {
    /// Instances of the model (default 1); with `gpus`, instances on each device listed (as
    /// Triton counts them: `count = 2, gpus = [0, 1]` makes four).
    #[serde(default = "one")]
    pub count: u32,
    /// Triton's `kind` (`KIND_CPU`, `KIND_GPU`, …): accepted and ignored; `gpus` places the
    /// group's instances whatever the kind.
    #[serde(default)]
    pub kind: Option<String>,
    /// The group's name (shown in the configuration's Triton form).
    #[serde(default)]
    pub name: Option<String>,
    /// Triton's `gpus`: the device indices (as `tpubox devices` lists them) the group's
    /// instances run on, `count` on each. Absent or empty: the group's instances are spread
    /// over the devices the model may use ([`ModelConfig::instance_devices`]).
    #[serde(default)]
    pub gpus: Vec<u32>,
}

fn one() -> u32 {
    1
}

/// `[dynamic_batching.default_queue_policy]`.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct QueuePolicy {
    /// Requests that may wait in the model's queue; 0 (default) for no limit.
    #[serde(default)]
    pub max_queue_size: u32,
}

/// `[dynamic_batching]`.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct DynamicBatching {
    /// Batch sizes to run as soon as they are reached.
    #[serde(default)]
    pub preferred_batch_size: Vec<u32>,
    /// Longest a request waits for others to join its batch, in microseconds (default 0).
    #[serde(default)]
    pub max_queue_delay_microseconds: u64,
    /// Queue limits.
    #[serde(default)]
    pub default_queue_policy: QueuePolicy,
}

/// `[sequence_batching]` (Triton's field names): a stateful model. Each request carries a
/// sequence id (`sequence_id`, with `sequence_start` / `sequence_end`); all requests of a
/// sequence run on one instance, in order, and the server fills the control inputs that tell
/// the model which sequence each batch row belongs to ([`crate::sequence`]).
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct SequenceBatching {
    /// A sequence with no request for this long is released; its next request fails (default
    /// 1 s, Triton's).
    #[serde(default = "default_sequence_idle")]
    pub max_sequence_idle_microseconds: u64,
    /// The control inputs the server fills.
    #[serde(default)]
    pub control_input: Vec<ControlInput>,
    /// The `direct` strategy: each request runs with those of other sequences on its instance
    /// as they come (tpubox runs both strategies alike; see docs/SERVING.md).
    #[serde(default)]
    pub direct: Option<SequenceStrategy>,
    /// The `oldest` strategy.
    #[serde(default)]
    pub oldest: Option<SequenceStrategy>,
}

fn default_sequence_idle() -> u64 {
    1_000_000
}

/// `direct {}` / `oldest {}` of `[sequence_batching]`.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct SequenceStrategy {
    /// Longest a request waits for requests of other sequences to join its batch, in
    /// microseconds (default 0).
    #[serde(default)]
    pub max_queue_delay_microseconds: u64,
}

/// One `control_input` of `[sequence_batching]`: an input of the model the server fills.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ControlInput {
    /// The model input's name.
    pub name: String,
    /// What it carries (one control per input here).
    pub control: Vec<Control>,
}

fn control_start() -> String {
    "CONTROL_SEQUENCE_START".into()
}

/// One control of a [`ControlInput`].
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct Control {
    /// `CONTROL_SEQUENCE_START`, `CONTROL_SEQUENCE_END`, `CONTROL_SEQUENCE_READY` or
    /// `CONTROL_SEQUENCE_CORRID`. Default `CONTROL_SEQUENCE_START`: the enum's 0, which
    /// protobuf leaves out of the message ([`crate::triton_schema`]).
    #[serde(default = "control_start")]
    pub kind: String,
    /// The false and true values as INT32 (a flag).
    #[serde(default)]
    pub int32_false_true: Vec<i32>,
    /// The false and true values as FP32 (a flag).
    #[serde(default)]
    pub fp32_false_true: Vec<f32>,
    /// The false and true values as BOOL (a flag).
    #[serde(default)]
    pub bool_false_true: Vec<bool>,
    /// The correlation id's type (`TYPE_UINT64`, `TYPE_INT64`, `TYPE_UINT32`, `TYPE_INT32`).
    #[serde(default)]
    pub data_type: Option<String>,
}

/// `[tpubox.limits]`: the model's tenant, which every instance of the model charges.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ModelLimits {
    /// Device memory the model's tensors may hold, in MiB.
    pub max_device_mib: Option<u64>,
    /// Live tensor handles.
    pub max_live_tensors: Option<u64>,
    /// Live executables.
    pub max_live_executables: Option<u64>,
    /// Wall-clock limit of one `infer` call, in seconds (default 60).
    pub max_call_seconds: Option<f64>,
    /// Guest linear memory, in MiB.
    pub max_guest_memory_mib: Option<u64>,
    /// Launches queued for the device or running at once (default 256).
    pub max_pending_launches: Option<u64>,
    /// Skip the program policy for the model's programs (default `false`: at most 1,048,576
    /// trips of a loop XLA can bound, loops it cannot bound on the loop budget, no host
    /// transfers, only the default custom calls,
    /// [`tpubox_core::tenant::default_custom_calls`]). For models whose programs the operator
    /// trusts.
    pub trusted: Option<bool>,
    /// Most trips of loops XLA cannot bound in one execution (default 1 048 576; 0 refuses
    /// such loops at compile). `max-loop-iterations`.
    pub max_loop_iterations: Option<u64>,
    /// Most work of those trips in one execution, in estimated operations plus bytes written
    /// (default 10^11). `max-loop-work`.
    pub max_loop_work: Option<u64>,
    /// The devices the model's instances may be spread over when an instance group names no
    /// `gpus`: a list of device indices (`devices = [1, 2]`) or a count (`devices = 2`: the
    /// first two devices no session tenant holds alone). Default: every device no session
    /// tenant holds alone (`exclusive_devices` in the tokens file).
    pub devices: Option<DevicesField>,
}

/// Where one parameter of a StableHLO model's program comes from
/// (`parameters = [{ weight = "dense/w" }, { input = "x" }]`): exactly one of the two.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ParameterSource {
    /// A tensor of the model's weight file, by its safetensors name.
    pub weight: Option<String>,
    /// A protocol input, by the name of its `[[input]]`.
    pub input: Option<String>,
}

/// One program of a StableHLO model: the batch size it was exported for and its file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProgramConfig {
    /// The leading dimension of every input and output of this program; absent for a model
    /// without a batch dimension (`max_batch_size = 0`, one program).
    pub batch_size: Option<u32>,
    /// The program, relative to the model directory: VHLO/StableHLO bytecode (what
    /// `jax.export`'s `Exported.mlir_module_serialized` holds) or StableHLO text.
    pub file: PathBuf,
}

/// `[tpubox.stablehlo]`: the model is an exported StableHLO program with its weights, run by
/// tpubox itself, with no guest component.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StablehloSection {
    /// The programs, one per batch size (bucket); a merged batch runs in the smallest program
    /// whose batch size holds it, padded with zeros, its results sliced back.
    #[serde(rename = "program")]
    pub programs: Vec<ProgramConfig>,
    /// The safetensors file of the weights, relative to the model directory (default
    /// `weights.safetensors`); loaded once onto the device as a shared weight set.
    pub weights: Option<PathBuf>,
    /// The weight set's name (default: the model's name); a set of that name loaded from
    /// another file is an error.
    pub weight_set: Option<String>,
    /// The source of each of the programs' parameters, in order.
    pub parameters: Vec<ParameterSource>,
    /// The output (an `[[output]]` name) each of the programs' results is, in order.
    pub results: Vec<String>,
}

/// `[tpubox]`: what only tpubox has.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct TpuboxSection {
    /// The component, relative to the model directory (default `model.wasm`, then
    /// `1/model.wasm`).
    pub component: Option<PathBuf>,
    /// The directory the guest reads at `/model` (read-only), relative to the model directory
    /// (default: the model directory itself). It may be a symbolic link, e.g. to where
    /// `tpubox setup minilm` unpacked a model: links inside the granted directory that point
    /// out of it are not followed, a granted link itself is.
    pub files: Option<PathBuf>,
    /// Weight sets the guest may open: name → safetensors file relative to the model
    /// directory. Loaded once; shared with every other model that names the same file.
    #[serde(default)]
    pub weights: BTreeMap<String, PathBuf>,
    /// The model's tenant limits.
    #[serde(default)]
    pub limits: ModelLimits,
    /// Present for a StableHLO model (exported program, weights, no component).
    pub stablehlo: Option<StablehloSection>,
    /// How a decoupled model's streams are run.
    #[serde(default)]
    pub decoupled: DecoupledSection,
}

/// Triton's `model_transaction_policy`.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct TransactionPolicy {
    /// The model answers a request with zero or more responses (its component exports the
    /// `decoupled` interface of `wit/model.wit`); it is served only by streaming calls.
    #[serde(default)]
    pub decoupled: bool,
}

/// `[tpubox.decoupled]`: the bounds of a decoupled model's streams.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DecoupledSection {
    /// Streams one instance serves at a time (their `next` calls interleave); further
    /// requests wait in the queue. Default 8.
    #[serde(default = "default_max_generations")]
    pub max_generations: u32,
    /// A stream whose client has taken no response for this long is ended (its slot freed):
    /// a client that stops reading cannot hold an instance. Default 30 s.
    #[serde(default = "default_stall_seconds")]
    pub stall_seconds: f64,
}

fn default_max_generations() -> u32 {
    8
}

fn default_stall_seconds() -> f64 {
    30.0
}

impl Default for DecoupledSection {
    fn default() -> Self {
        DecoupledSection {
            max_generations: default_max_generations(),
            stall_seconds: default_stall_seconds(),
        }
    }
}

/// A model's configuration: `config.pbtxt` (Triton's), `config.toml` or `config.json`, each
/// read first as Triton's `ModelConfig` message ([`crate::triton_schema`]): a field Triton does
/// not define is an error (a misspelt `max_batch_size` must not pass unnoticed), a Triton field
/// tpubox does not implement is dropped and named in [`ModelConfig::ignored`] (logged as a
/// warning at load), or fails the load where ignoring it would serve wrong answers
/// ([`crate::triton_schema::REFUSED`]).
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model's name; must equal its directory's name when given.
    #[serde(default)]
    pub name: Option<String>,
    /// Triton's `platform`/`backend`: accepted and ignored, except that `"stablehlo"` needs a
    /// `[tpubox.stablehlo]` table.
    #[serde(default)]
    pub platform: Option<String>,
    /// See [`ModelConfig::platform`].
    #[serde(default)]
    pub backend: Option<String>,
    /// Largest batch; 0 for a model without a batch dimension. Default: the guest's (a
    /// StableHLO model's: the largest program batch size, or none when no program has one).
    /// In `config.pbtxt` a 0 reads as unset, since protobuf cannot tell the two apart (as
    /// Triton's auto-complete does, the model's own is taken).
    #[serde(default)]
    pub max_batch_size: Option<u32>,
    /// Declared inputs, checked against the guest's metadata.
    #[serde(default)]
    pub input: Vec<TensorConfig>,
    /// Declared outputs, checked against the guest's metadata.
    #[serde(default)]
    pub output: Vec<TensorConfig>,
    /// Instances.
    #[serde(default)]
    pub instance_group: Vec<InstanceGroup>,
    /// Dynamic batching; absent, each request runs alone.
    #[serde(default)]
    pub dynamic_batching: Option<DynamicBatching>,
    /// Sequence batching (a stateful model); exclusive with `dynamic_batching`.
    #[serde(default)]
    pub sequence_batching: Option<SequenceBatching>,
    /// Triton's transaction policy: `decoupled = true` for a model that streams responses.
    #[serde(default)]
    pub model_transaction_policy: TransactionPolicy,
    /// The model file in the model directory or its version directory (Triton's
    /// `default_model_filename`): the component, where `tpubox.component` is not given.
    #[serde(default)]
    pub default_model_filename: Option<String>,
    /// tpubox's own settings: the `[tpubox]` table of `config.toml`, the `tpubox` object of
    /// `config.json` or of a config override, or for `config.pbtxt` the `tpubox.toml` file
    /// beside it (the table's contents, without the `[tpubox]` header).
    #[serde(default)]
    pub tpubox: TpuboxSection,
    /// Triton fields the configuration sets that tpubox ignores, by path
    /// (`input[data_0].reshape`); the load logs them as a warning.
    #[serde(skip)]
    pub ignored: Vec<String>,
}

/// The UTF-8 name of a model directory.
fn dir_name(dir: &Path) -> Result<&str> {
    dir.file_name()
        .and_then(|n| n.to_str())
        .context("the model directory has no UTF-8 name")
}

/// The file names a model directory's configuration may have (exactly one of them).
pub const CONFIG_FILES: [&str; 3] = ["config.pbtxt", "config.toml", "config.json"];

/// The file beside a `config.pbtxt` that holds tpubox's own settings (the `[tpubox]` table's
/// contents), which Triton's message has no place for.
pub const TPUBOX_SETTINGS_FILE: &str = "tpubox.toml";

/// The configuration of the model in `dir`, read as Triton's message; with the name of its file.
fn read_dir_config(dir: &Path) -> Result<(String, Normalized)> {
    let found: Vec<PathBuf> = CONFIG_FILES
        .iter()
        .map(|f| dir.join(f))
        .filter(|p| p.is_file())
        .collect();
    let path = match found.as_slice() {
        [] => bail!(
            "{} has no configuration: config.pbtxt, config.toml or config.json",
            dir.display()
        ),
        [one] => one,
        [a, b, ..] => bail!(
            "{} has both {} and {}: keep one",
            dir.display(),
            a.file_name().unwrap_or_default().to_string_lossy(),
            b.file_name().unwrap_or_default().to_string_lossy()
        ),
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let what = path.display().to_string();
    let format = match path.extension().and_then(|e| e.to_str()) {
        Some("pbtxt") => Format::Pbtxt,
        Some("json") => Format::Json,
        _ => Format::Toml,
    };
    let mut n = normalize(&text, format, &what)?;
    let settings = dir.join(TPUBOX_SETTINGS_FILE);
    if format == Format::Pbtxt && settings.is_file() {
        let text = std::fs::read_to_string(&settings)
            .with_context(|| format!("reading {}", settings.display()))?;
        let table: toml::Table =
            toml::from_str(&text).with_context(|| format!("parsing {}", settings.display()))?;
        n.tpubox = Some(serde_json::to_value(table)?);
    }
    Ok((what, n))
}

impl ModelConfig {
    /// Reads the configuration of the model in `dir`: its `config.pbtxt` (with `tpubox.toml`
    /// beside it, where present), `config.toml` or `config.json`.
    ///
    /// Errors: no configuration file or more than one, one that does not parse as Triton's
    /// `ModelConfig` (the message names the file, the field and, for `config.pbtxt`, the line
    /// and column), a field tpubox refuses, a `name` that differs from the directory's, an
    /// unknown datatype, a dimension below -1.
    pub fn load(dir: &Path) -> Result<Self> {
        let dir_name = dir_name(dir)?;
        let (what, n) = read_dir_config(dir)?;
        Self::build(dir_name, n, &what)
    }

    /// The configuration a repository load gives in place of the directory's (Triton's
    /// `config` load parameter: the model configuration as protobuf JSON). It replaces the
    /// Triton part of the directory's configuration for that load (it is not merged into it);
    /// tpubox's own settings are the override's `tpubox` object where it has one, else the
    /// directory's.
    ///
    /// Errors: as [`ModelConfig::load`], naming "the config override".
    pub fn from_override(dir: &Path, json: &str) -> Result<Self> {
        let what = "the config override";
        let mut n = normalize(json, Format::Json, what)?;
        if n.tpubox.is_none() {
            n.tpubox = read_dir_config(dir).ok().and_then(|(_, d)| d.tpubox);
        }
        Self::build(dir_name(dir)?, n, what)
    }

    /// Parses and checks a configuration of the model directory `dir_name` in tpubox's TOML
    /// (`json`: JSON) form; `what` names its source in errors.
    #[cfg(test)]
    fn parse(dir_name: &str, text: &str, json: bool, what: &str) -> Result<Self> {
        let format = if json { Format::Json } else { Format::Toml };
        Self::build(dir_name, normalize(text, format, what)?, what)
    }

    /// The configuration of the model directory `dir_name` from its normalized form, checked;
    /// `what` names its source in errors.
    pub(crate) fn build(dir_name: &str, n: Normalized, what: &str) -> Result<Self> {
        let mut value = n.triton;
        if let Some(t) = n.tpubox {
            value.insert("tpubox".into(), t);
        }
        let mut config: ModelConfig = serde_json::from_value(Value::Object(value))
            .with_context(|| format!("parsing {what}"))?;
        config.ignored = n.ignored;
        // A file name, as Triton takes it: a load's override must not reach out of the model
        // directory through it.
        if let Some(f) = &config.default_model_filename
            && (f.is_empty() || f == "." || f == ".." || f.contains(['/', '\\', '\0']))
        {
            bail!("{what}: default_model_filename `{f}` must be a file name, without a directory");
        }
        if let Some(name) = &config.name
            && name != dir_name
        {
            bail!("{what}: name `{name}` differs from the directory's name `{dir_name}`");
        }
        // dynamic_batching and sequence_batching are one oneof of Triton's message: the text
        // parser refuses both, normalize() checks JSON and TOML before protobuf would keep one.
        if config.model_transaction_policy.decoupled {
            if config.dynamic_batching.is_some() || config.sequence_batching.is_some() {
                bail!(
                    "{what}: a decoupled model runs each request on its own stream; drop dynamic_batching and sequence_batching"
                );
            }
            if config.tpubox.stablehlo.is_some() {
                bail!(
                    "{what}: a StableHLO model answers once per request; model_transaction_policy.decoupled needs a component exporting the decoupled interface"
                );
            }
        }
        let d = &config.tpubox.decoupled;
        if d.max_generations == 0 || !(d.stall_seconds > 0.0 && d.stall_seconds <= 86_400.0) {
            bail!(
                "{what}: tpubox.decoupled needs max_generations >= 1 and 0 < stall_seconds <= 86400"
            );
        }
        let says_stablehlo = [&config.platform, &config.backend]
            .iter()
            .any(|f| f.as_deref() == Some("stablehlo"));
        if says_stablehlo && config.tpubox.stablehlo.is_none() {
            bail!(
                "{what}: backend/platform \"stablehlo\" needs a [tpubox.stablehlo] table (the programs, the weights, the parameter and result mapping; tpubox.jax.export_model writes it)"
            );
        }
        for (i, g) in config.instance_group.iter().enumerate() {
            let mut seen = std::collections::BTreeSet::new();
            if let Some(d) = g.gpus.iter().find(|&&d| !seen.insert(d)) {
                bail!("{what}: instance_group {i}: gpus names device {d} twice");
            }
        }
        match &config.tpubox.limits.devices {
            Some(DevicesField::Count(0)) => {
                bail!("{what}: tpubox.limits.devices = 0 leaves the model no device")
            }
            Some(DevicesField::List(l)) if l.is_empty() => {
                bail!("{what}: tpubox.limits.devices = [] leaves the model no device")
            }
            Some(DevicesField::List(l)) => {
                let mut seen = std::collections::BTreeSet::new();
                if let Some(d) = l.iter().find(|&&d| !seen.insert(d)) {
                    bail!("{what}: tpubox.limits.devices names device {d} twice");
                }
            }
            _ => {}
        }
        for t in config.input.iter().chain(&config.output) {
            if t.data_type == "TYPE_INVALID" {
                bail!("{what}: `{}` has no data_type", t.name);
            }
            if Datatype::from_name(&t.data_type).is_none() {
                bail!(
                    "{what}: `{}` has unknown data_type `{}`",
                    t.name,
                    t.data_type
                );
            }
            if t.dims.iter().any(|&d| d < -1) {
                bail!("{what}: `{}` has a dimension below -1", t.name);
            }
        }
        Ok(config)
    }

    /// Instances to run (the sum over instance groups of `count`, times the number of `gpus`
    /// where a group lists them; 1 without any).
    pub fn instances(&self) -> u32 {
        let n: u32 = self
            .instance_group
            .iter()
            .map(|g| g.count.saturating_mul(g.gpus.len().max(1) as u32))
            .fold(0, u32::saturating_add);
        n.max(1)
    }

    /// The devices the model's instances may be spread over on a host of `device_count`
    /// devices, of which session tenants hold `exclusive` alone: `[tpubox.limits] devices`
    /// (a list as given, a count the first that many), or every device not in `exclusive`.
    ///
    /// Errors: a listed device the host lacks or that a session tenant holds alone; a count
    /// larger than the devices left; no device left at all.
    pub fn model_devices(&self, device_count: u32, exclusive: &[u32]) -> Result<Vec<u32>> {
        let free: Vec<u32> = (0..device_count.max(1))
            .filter(|d| !exclusive.contains(d))
            .collect();
        match &self.tpubox.limits.devices {
            Some(DevicesField::List(l)) => {
                for &d in l {
                    check_device(d, device_count, "tpubox.limits.devices")?;
                    if exclusive.contains(&d) {
                        bail!(
                            "tpubox.limits.devices names device {d}, which a session tenant holds alone (exclusive_devices in the tokens file)"
                        );
                    }
                }
                Ok(l.clone())
            }
            Some(DevicesField::Count(n)) => {
                if *n as usize > free.len() {
                    bail!(
                        "tpubox.limits.devices = {n}, and the host has {} device(s) no session tenant holds alone: {free:?}",
                        free.len()
                    );
                }
                Ok(free[..*n as usize].to_vec())
            }
            None if free.is_empty() => bail!(
                "every device of the host ({device_count}) is held alone by a session tenant (exclusive_devices in the tokens file): name the model's devices with instance_group gpus"
            ),
            None => Ok(free),
        }
    }

    /// The device of each instance, in the order the instances are made, on a host of
    /// `device_count` devices of which session tenants hold `exclusive` alone. A group with
    /// `gpus` puts `count` instances on each device it lists (Triton's meaning); the other
    /// groups' instances take the model's devices ([`ModelConfig::model_devices`]) in turn,
    /// round-robin across those groups. No group: one instance, on the model's first device.
    ///
    /// Errors: a `gpus` device the host lacks, that a session tenant holds alone, or outside
    /// `[tpubox.limits] devices`; [`ModelConfig::model_devices`]'s errors when a group needs
    /// them.
    pub fn instance_devices(&self, device_count: u32, exclusive: &[u32]) -> Result<Vec<u32>> {
        let spread = || self.model_devices(device_count, exclusive);
        let mut out = Vec::new();
        let mut allowed: Option<Vec<u32>> = None;
        let mut next = 0usize;
        for (i, g) in self.instance_group.iter().enumerate() {
            if g.gpus.is_empty() {
                let devices = match &allowed {
                    Some(d) => d,
                    None => allowed.insert(spread()?),
                };
                for _ in 0..g.count {
                    out.push(devices[next % devices.len()]);
                    next += 1;
                }
                continue;
            }
            for &d in &g.gpus {
                check_device(d, device_count, &format!("instance_group {i}: gpus"))?;
                if exclusive.contains(&d) {
                    bail!(
                        "instance_group {i}: gpus names device {d}, which a session tenant holds alone (exclusive_devices in the tokens file)"
                    );
                }
                if let Some(DevicesField::List(l)) = &self.tpubox.limits.devices
                    && !l.contains(&d)
                {
                    bail!(
                        "instance_group {i}: gpus names device {d}, outside the model's tpubox.limits.devices {l:?}"
                    );
                }
                out.extend(std::iter::repeat_n(d, g.count as usize));
            }
        }
        if out.is_empty() {
            out.push(spread()?[0]);
        }
        Ok(out)
    }

    /// The component's path inside `dir`: `tpubox.component` where given; else the model file
    /// (`default_model_filename`, default `model.wasm`) in `dir` itself, then in its version
    /// directories (`1/`, `2/`, …, Triton's layout), the highest version first, as Triton's
    /// default version policy (the latest one) serves it.
    ///
    /// Errors: none of those files exists.
    pub fn component_path(&self, dir: &Path) -> Result<PathBuf> {
        let candidates: Vec<PathBuf> = match &self.tpubox.component {
            Some(p) => vec![dir.join(p)],
            None => Self::model_file_candidates(
                dir,
                self.default_model_filename
                    .as_deref()
                    .unwrap_or("model.wasm"),
            ),
        };
        candidates
            .iter()
            .find(|p| p.is_file())
            .cloned()
            .with_context(|| {
                format!(
                    "no component: looked for {}",
                    candidates
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(" and ")
                )
            })
    }

    /// Where a model file `file` may be, in the order looked at: `dir/file`, then
    /// `dir/<version>/file` for each version directory (a directory named by a number), the
    /// highest version first (`dir/1/file` when there is none).
    pub fn model_file_candidates(dir: &Path, file: &str) -> Vec<PathBuf> {
        let mut versions: Vec<u64> = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        versions.sort_unstable_by(|a, b| b.cmp(a));
        if versions.is_empty() {
            versions.push(1);
        }
        std::iter::once(dir.join(file))
            .chain(versions.iter().map(|v| dir.join(v.to_string()).join(file)))
            .collect()
    }

    /// The directory granted to the guest at `/model`, resolved.
    ///
    /// Errors: it does not exist.
    pub fn files_dir(&self, dir: &Path) -> Result<PathBuf> {
        let p = match &self.tpubox.files {
            Some(f) => dir.join(f),
            None => dir.to_path_buf(),
        };
        p.canonicalize()
            .with_context(|| format!("the model's files directory {}", p.display()))
    }

    /// The model tenant's limits: [`TenantLimits::default`] with the `[tpubox.limits]` given.
    pub fn tenant_limits(&self) -> TenantLimits {
        let l = &self.tpubox.limits;
        let mut t = TenantLimits::default();
        if let Some(m) = l.max_device_mib {
            t.max_device_bytes = m.saturating_mul(1 << 20);
        }
        if let Some(n) = l.max_live_tensors {
            t.max_live_tensors = n;
        }
        if let Some(n) = l.max_live_executables {
            t.max_live_executables = n;
        }
        if let Some(m) = l.max_guest_memory_mib {
            t.max_guest_memory = usize::try_from(m.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
        }
        if let Some(n) = l.max_pending_launches {
            t.max_pending_launches = n;
        }
        if let Some(trusted) = l.trusted {
            t.program_policy.trusted = trusted;
        }
        if let Some(n) = l.max_loop_iterations {
            t.program_policy.max_loop_iterations = n;
        }
        if let Some(n) = l.max_loop_work {
            t.program_policy.max_loop_work = n;
        }
        t.max_call_time = Some(Duration::from_secs_f64(
            l.max_call_seconds.unwrap_or(60.0).clamp(0.001, 86_400.0),
        ));
        t
    }

    /// The queue delay of dynamic batching (zero without it).
    pub fn max_queue_delay(&self) -> Duration {
        self.dynamic_batching.as_ref().map_or(Duration::ZERO, |b| {
            Duration::from_micros(b.max_queue_delay_microseconds)
        })
    }
}

/// `device`, if a host of `device_count` devices has it; `what` names the field.
fn check_device(device: u32, device_count: u32, what: &str) -> Result<()> {
    if device >= device_count.max(1) {
        bail!(
            "{what} names device {device}, which this host does not have: it has {device_count} device(s), 0 to {}",
            device_count.max(1) - 1
        );
    }
    Ok(())
}

/// One instance group as the configuration's Triton form shows it ([`ModelConfig::groups`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupView {
    /// The group's name: its own, or the model's (one group) or `MODEL_INDEX`.
    pub name: String,
    /// `KIND_GPU` for a group placed with `gpus`, `KIND_MODEL` otherwise.
    pub kind: &'static str,
    /// Instances (on each of `gpus`, where given).
    pub count: u32,
    /// The devices it was placed on by `gpus`; empty when spread.
    pub gpus: Vec<u32>,
}

impl ModelConfig {
    /// The instance groups as Triton's configuration shows them: as configured (one group of
    /// one instance when none is).
    pub fn groups(&self, model: &str) -> Vec<GroupView> {
        if self.instance_group.is_empty() {
            return vec![GroupView {
                name: model.to_string(),
                kind: "KIND_MODEL",
                count: 1,
                gpus: Vec::new(),
            }];
        }
        let several = self.instance_group.len() > 1;
        self.instance_group
            .iter()
            .enumerate()
            .map(|(i, g)| GroupView {
                name: g.name.clone().unwrap_or_else(|| {
                    if several {
                        format!("{model}_{i}")
                    } else {
                        model.to_string()
                    }
                }),
                kind: if g.gpus.is_empty() {
                    "KIND_MODEL"
                } else {
                    "KIND_GPU"
                },
                count: g.count,
                gpus: g.gpus.clone(),
            })
            .collect()
    }
}

/// The Triton JSON form of a model's configuration (what `GET /v2/models/{m}/config` returns
/// and perf_analyzer reads), completed with what the guest declared: `inputs`/`outputs` as
/// `(name, datatype, dims without the batch dimension)`.
pub fn triton_json(
    name: &str,
    config: &ModelConfig,
    max_batch_size: u32,
    inputs: &[(String, Datatype, Vec<i64>)],
    outputs: &[(String, Datatype, Vec<i64>)],
) -> Value {
    let tensors = |ts: &[(String, Datatype, Vec<i64>)]| -> Vec<Value> {
        ts.iter()
            .map(|(n, d, dims)| json!({"name": n, "data_type": d.config_name(), "dims": dims}))
            .collect()
    };
    let groups: Vec<Value> = config
        .groups(name)
        .into_iter()
        .map(|g| {
            let mut v = json!({"name": g.name, "kind": g.kind, "count": g.count});
            if !g.gpus.is_empty() {
                v["gpus"] = json!(g.gpus);
            }
            v
        })
        .collect();
    let mut v = json!({
        "name": name,
        "platform": "tpubox",
        "backend": if config.tpubox.stablehlo.is_some() { "stablehlo" } else { "tpubox" },
        "max_batch_size": max_batch_size,
        "input": tensors(inputs),
        "output": tensors(outputs),
        "instance_group": groups,
    });
    if config.model_transaction_policy.decoupled {
        v["model_transaction_policy"] = json!({"decoupled": true});
    }
    if let Some(b) = &config.dynamic_batching {
        v["dynamic_batching"] = json!({
            "preferred_batch_size": b.preferred_batch_size,
            "max_queue_delay_microseconds": b.max_queue_delay_microseconds,
            "default_queue_policy": {"max_queue_size": b.default_queue_policy.max_queue_size},
        });
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_with_triton_names() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("m");
        std::fs::create_dir(&m).unwrap();
        std::fs::write(
            m.join("config.toml"),
            r#"
max_batch_size = 8
[[input]]
name = "text"
data_type = "TYPE_STRING"
dims = [-1]
[[instance_group]]
count = 2
[dynamic_batching]
preferred_batch_size = [4]
max_queue_delay_microseconds = 500
[dynamic_batching.default_queue_policy]
max_queue_size = 3
[tpubox.weights]
w = "w.safetensors"
[tpubox.limits]
max_device_mib = 16
"#,
        )
        .unwrap();
        let c = ModelConfig::load(&m).unwrap();
        assert_eq!(c.max_batch_size, Some(8));
        assert_eq!(c.instances(), 2);
        assert_eq!(c.max_queue_delay(), Duration::from_micros(500));
        assert_eq!(c.tenant_limits().max_device_bytes, 16 << 20);
        assert_eq!(
            c.dynamic_batching
                .unwrap()
                .default_queue_policy
                .max_queue_size,
            3
        );
        std::fs::write(m.join("config.toml"), "name = \"other\"").unwrap();
        let e = ModelConfig::load(&m).unwrap_err().to_string();
        assert!(e.contains("differs"), "{e}");
        std::fs::write(m.join("config.toml"), "[tpubox]\nbogus = 1").unwrap();
        let e = format!("{:#}", ModelConfig::load(&m).unwrap_err());
        assert!(e.contains("bogus"), "{e}");
        for typo in [
            "max_batch_sizes = 4",
            "[dynamic_batching]\nmax_queue_delay_microsecond = 1",
            "[[instance_group]]\ncont = 2",
        ] {
            std::fs::write(m.join("config.toml"), typo).unwrap();
            let e = format!("{:#}", ModelConfig::load(&m).unwrap_err());
            assert!(e.contains("unrecognized field name"), "{typo}: {e}");
        }
        for bad in ["../x.wasm", "a/b.wasm", ".."] {
            std::fs::write(
                m.join("config.toml"),
                format!("default_model_filename = {bad:?}"),
            )
            .unwrap();
            let e = format!("{:#}", ModelConfig::load(&m).unwrap_err());
            assert!(e.contains("must be a file name"), "{bad}: {e}");
        }
        std::fs::write(m.join("config.toml"), "backend = \"stablehlo\"").unwrap();
        let e = format!("{:#}", ModelConfig::load(&m).unwrap_err());
        assert!(e.contains("needs a [tpubox.stablehlo] table"), "{e}");
        // The program policy of the model's tenant: default, lifted, widened.
        std::fs::write(m.join("config.toml"), "").unwrap();
        let p = ModelConfig::load(&m)
            .unwrap()
            .tenant_limits()
            .program_policy;
        assert!(!p.trusted);
        assert_eq!(
            p.allowed_custom_calls,
            tpubox_core::tenant::default_custom_calls()
        );
        std::fs::write(m.join("config.toml"), "[tpubox.limits]\ntrusted = true").unwrap();
        let p = ModelConfig::load(&m)
            .unwrap()
            .tenant_limits()
            .program_policy;
        assert!(p.trusted);
        // Triton fields with no meaning here are accepted.
        std::fs::write(
            m.join("config.toml"),
            "platform = \"x\"\n[version_policy.latest]\nnum_versions = 1\n[[instance_group]]\nkind = \"KIND_CPU\"\ngpus = [0]\n",
        )
        .unwrap();
        ModelConfig::load(&m).unwrap();
    }

    fn parsed(toml: &str) -> Result<ModelConfig> {
        ModelConfig::parse("m", toml, false, "config.toml")
    }

    #[test]
    fn gpus_place_count_instances_on_each_device_listed() {
        let c = parsed(
            "[[instance_group]]\ncount = 2\ngpus = [0, 1]\n[[instance_group]]\ngpus = [3]\n",
        )
        .unwrap();
        assert_eq!(c.instances(), 5);
        assert_eq!(c.instance_devices(4, &[]).unwrap(), vec![0, 0, 1, 1, 3]);
        let j = triton_json("m", &c, 0, &[], &[]);
        assert_eq!(
            j["instance_group"],
            json!([
                {"name": "m_0", "kind": "KIND_GPU", "count": 2, "gpus": [0, 1]},
                {"name": "m_1", "kind": "KIND_GPU", "count": 1, "gpus": [3]},
            ])
        );
        // JSON configurations (and load overrides) name them the same way.
        let c = ModelConfig::parse(
            "m",
            r#"{"instance_group": [{"count": 1, "gpus": [1], "kind": "KIND_GPU"}]}"#,
            true,
            "config.json",
        )
        .unwrap();
        assert_eq!(c.instance_devices(2, &[]).unwrap(), vec![1]);
        // A device the host lacks fails the load, naming it.
        let e = parsed("[[instance_group]]\ngpus = [0, 4]\n")
            .unwrap()
            .instance_devices(4, &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gpus names device 4, which this host does not have: it has 4 device(s)"),
            "{e}"
        );
        let e = parsed("[[instance_group]]\ngpus = [1, 1]\n").unwrap_err();
        assert!(format!("{e:#}").contains("names device 1 twice"), "{e:#}");
        // A device a session tenant holds alone, or outside the model's devices.
        let c = parsed("[[instance_group]]\ngpus = [2]\n").unwrap();
        let e = c.instance_devices(4, &[2]).unwrap_err().to_string();
        assert!(e.contains("holds alone"), "{e}");
        let c =
            parsed("[[instance_group]]\ngpus = [2]\n[tpubox.limits]\ndevices = [0, 1]\n").unwrap();
        let e = c.instance_devices(4, &[]).unwrap_err().to_string();
        assert!(
            e.contains("outside the model's tpubox.limits.devices [0, 1]"),
            "{e}"
        );
    }

    #[test]
    fn instances_without_gpus_spread_over_the_models_devices() {
        // Every device but those held alone, round-robin across the groups without gpus.
        let c = parsed(
            "[[instance_group]]\ncount = 3\n[[instance_group]]\ngpus = [0]\n[[instance_group]]\ncount = 2\n",
        )
        .unwrap();
        assert_eq!(c.instances(), 6);
        assert_eq!(c.instance_devices(4, &[1]).unwrap(), vec![0, 2, 3, 0, 0, 2]);
        assert_eq!(c.instance_devices(1, &[]).unwrap(), vec![0, 0, 0, 0, 0, 0]);
        // No group: one instance, on the first device left.
        let c = parsed("").unwrap();
        assert_eq!(c.instance_devices(4, &[0]).unwrap(), vec![1]);
        let e = c.instance_devices(2, &[0, 1]).unwrap_err().to_string();
        assert!(e.contains("held alone by a session tenant"), "{e}");
        // [tpubox.limits] devices: a list or a count.
        let c =
            parsed("[[instance_group]]\ncount = 3\n[tpubox.limits]\ndevices = [3, 1]\n").unwrap();
        assert_eq!(c.instance_devices(4, &[]).unwrap(), vec![3, 1, 3]);
        let e = c.instance_devices(2, &[]).unwrap_err().to_string();
        assert!(
            e.contains("names device 3, which this host does not have"),
            "{e}"
        );
        let c = parsed("[[instance_group]]\ncount = 3\n[tpubox.limits]\ndevices = 2\n").unwrap();
        assert_eq!(c.instance_devices(4, &[0]).unwrap(), vec![1, 2, 1]);
        let e = c.instance_devices(2, &[0]).unwrap_err().to_string();
        assert!(
            e.contains("devices = 2, and the host has 1 device(s)"),
            "{e}"
        );
        for bad in ["devices = 0", "devices = []", "devices = [1, 1]"] {
            let e = parsed(&format!("[tpubox.limits]\n{bad}\n")).unwrap_err();
            assert!(
                format!("{e:#}").contains("tpubox.limits.devices"),
                "{bad}: {e:#}"
            );
        }
        // The Triton form of a single spread group is the model's one group, as before.
        let c = parsed("[[instance_group]]\ncount = 2\n").unwrap();
        assert_eq!(
            triton_json("m", &c, 0, &[], &[])["instance_group"],
            json!([{"name": "m", "kind": "KIND_MODEL", "count": 2}])
        );
    }
}
