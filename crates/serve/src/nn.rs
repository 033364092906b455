//! Graphs for guests' `wasi:nn` ([`tpubox_wasm::nn`]): ONNX bytes a guest loads, converted to
//! StableHLO by the ONNX models' converter ([`crate::onnx`], cached by the bytes' hash), and
//! graphs by name: `tpubox run --nn-graph NAME=PATH` (an `.onnx` file, or a model directory as
//! a repository has it: ONNX or StableHLO).
//!
//! A graph is the [`Plan`] its StableHLO model reads as: one program per batch size, the
//! parameters' mapping to weights and inputs, the weight file. The guest's wasi-nn state
//! compiles it and uploads its weights as the guest's own tensors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tpubox_core::tenant::Tenant;
use tpubox_wasm::nn::{NnError, NnErrorCode, NnFuture, NnGraphDef, NnLoader, NnParam, NnProgram};

use super::config::ModelConfig;
use super::onnx::{OnnxConverter, onnx_file, prepare};
use super::stablehlo::{Param, Plan};

/// The loader `tpubox run` and `tpubox serve` give their guests.
pub struct NnGraphs {
    converter: OnnxConverter,
    named: BTreeMap<String, PathBuf>,
    /// One conversion at a time on this host: each is a process of its own.
    converting: tokio::sync::Semaphore,
}

impl NnGraphs {
    /// Graphs converted by `converter`, and those of `named` (name → an `.onnx` file or a model
    /// directory).
    pub fn new(converter: OnnxConverter, named: BTreeMap<String, PathBuf>) -> Arc<Self> {
        Arc::new(NnGraphs {
            converter,
            named,
            converting: tokio::sync::Semaphore::new(1),
        })
    }

    /// The graph of the ONNX file `onnx`, converted (or found converted).
    async fn graph_of_onnx(&self, name: &str, onnx: &Path) -> Result<NnGraphDef, NnError> {
        let mut config = ModelConfig::default();
        let _one =
            self.converting.acquire().await.map_err(|_| {
                NnError::new(NnErrorCode::RuntimeError, "the host is shutting down")
            })?;
        prepare(&self.converter, name, onnx, None, &mut config)
            .await
            .map_err(|e| conversion_error(&e))?;
        let dir = onnx.parent().unwrap_or(Path::new("."));
        let plan = Plan::read(dir, name, &config).map_err(|e| conversion_error(&e))?;
        Ok(def_of(name, &plan))
    }

    /// The graph of the model directory `dir` (ONNX or StableHLO).
    async fn graph_of_dir(&self, name: &str, dir: &Path) -> Result<NnGraphDef, NnError> {
        let bad = |e: anyhow::Error| {
            NnError::new(
                NnErrorCode::InvalidEncoding,
                format!("graph `{name}` ({}): {e:#}", dir.display()),
            )
        };
        let mut config = ModelConfig::load(dir).map_err(bad)?;
        if let Some(onnx) = onnx_file(&config, dir) {
            let pbtxt = dir.join("config.pbtxt");
            let pbtxt = pbtxt.is_file().then_some(pbtxt);
            let _one = self.converting.acquire().await.map_err(|_| {
                NnError::new(NnErrorCode::RuntimeError, "the host is shutting down")
            })?;
            prepare(&self.converter, name, &onnx, pbtxt.as_deref(), &mut config)
                .await
                .map_err(|e| conversion_error(&e))?;
        }
        let plan = Plan::read(dir, name, &config).map_err(bad)?;
        Ok(def_of(name, &plan))
    }
}

/// The wasi-nn error of a failed conversion: `unsupported-operation` when ops do not convert,
/// or no converter, else `invalid-encoding` (bytes that are no ONNX model,
/// a model the ONNX checker refuses).
fn conversion_error(e: &anyhow::Error) -> NnError {
    let text = format!("{e:#}");
    let code = if [
        "do not convert",
        "left outside StableHLO",
        "no converter",
        "venv",
    ]
    .iter()
    .any(|k| text.contains(k))
    {
        NnErrorCode::UnsupportedOperation
    } else {
        NnErrorCode::InvalidEncoding
    };
    NnError::new(code, tpubox_core::logsafe::clip_to(&text))
}

/// The graph a StableHLO model's plan describes.
fn def_of(name: &str, plan: &Plan) -> NnGraphDef {
    let params: Vec<NnParam> = plan
        .params
        .iter()
        .map(|p| match p {
            Param::Weight(w) => NnParam::Weight(w.clone()),
            Param::Input(i) => NnParam::Input(*i),
        })
        .collect();
    NnGraphDef {
        name: name.to_string(),
        inputs: plan
            .metadata
            .inputs
            .iter()
            .map(|t| t.name.clone())
            .collect(),
        outputs: plan
            .metadata
            .outputs
            .iter()
            .map(|t| t.name.clone())
            .collect(),
        programs: plan
            .buckets
            .iter()
            .map(|b| NnProgram {
                code: Arc::clone(&b.code),
                format: b.format,
                params: params.clone(),
                results: plan.results.clone(),
            })
            .collect(),
        weights: Some(plan.weights_file.clone()),
    }
}

impl NnLoader for NnGraphs {
    fn load_onnx<'a>(&'a self, _tenant: &'a Arc<Tenant>, bytes: &'a [u8]) -> NnFuture<'a> {
        Box::pin(async move {
            let hash = hex::encode(Sha256::digest(bytes));
            let dir = self.converter.cache_dir.join("wasi-nn");
            let file = dir.join(format!("{}.onnx", &hash[..32]));
            if !file.is_file() {
                let write = || -> std::io::Result<()> {
                    std::fs::create_dir_all(&dir)?;
                    tpubox_core::cache::atomic::write(&file, bytes, false)
                };
                write().map_err(|e| {
                    NnError::new(
                        NnErrorCode::RuntimeError,
                        format!("keeping the graph's bytes in {}: {e}", dir.display()),
                    )
                })?;
            }
            self.graph_of_onnx(&format!("onnx graph {}", &hash[..12]), &file)
                .await
        })
    }

    fn load_by_name<'a>(&'a self, _tenant: &'a Arc<Tenant>, name: &'a str) -> NnFuture<'a> {
        Box::pin(async move {
            let Some(path) = self.named.get(name) else {
                let known: Vec<&str> = self.named.keys().map(String::as_str).collect();
                return Err(NnError::new(
                    NnErrorCode::NotFound,
                    format!(
                        "no graph named `{}` (this host names: {})",
                        tpubox_core::logsafe::clip(name),
                        if known.is_empty() {
                            "none; tpubox run --nn-graph NAME=PATH names one".to_string()
                        } else {
                            known.join(", ")
                        }
                    ),
                ));
            };
            if path.is_dir() {
                self.graph_of_dir(name, path).await
            } else {
                self.graph_of_onnx(name, path).await
            }
        })
    }
}

/// Parses `NAME=PATH` (`--nn-graph`).
///
/// Errors: no `=`, an empty name, or a path that does not exist.
pub fn parse_named(text: &str) -> anyhow::Result<(String, PathBuf)> {
    let Some((name, path)) = text.split_once('=') else {
        anyhow::bail!("--nn-graph takes NAME=PATH, not `{text}`");
    };
    if name.is_empty() {
        anyhow::bail!("--nn-graph `{text}`: the name is empty");
    }
    let path = PathBuf::from(path);
    if !path.exists() {
        anyhow::bail!("--nn-graph {name}: {} does not exist", path.display());
    }
    Ok((name.to_string(), path))
}
