//! Graphs for guests' `wasi:nn` ([`tpubox_wasm::nn`]): ONNX bytes a guest loads, converted to
//! StableHLO by the ONNX models' converter ([`crate::onnx`], cached by the bytes' hash), and
//! graphs by name: `tpubox run --nn-graph NAME=PATH` (an `.onnx` file, or a model directory as
//! a repository has it: ONNX or StableHLO), and for a `tpubox serve` guest the models of its
//! repository.
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
    /// A model repository whose models' directories are graphs by their names too.
    repository: Option<PathBuf>,
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
            repository: None,
            converting: tokio::sync::Semaphore::new(1),
        })
    }

    /// Graphs converted by `converter`, and the models of the repository at `root` by their
    /// names (a guest of `tpubox serve`).
    pub fn of_repository(converter: OnnxConverter, root: PathBuf) -> Arc<Self> {
        Arc::new(NnGraphs {
            converter,
            named: BTreeMap::new(),
            repository: Some(root),
            converting: tokio::sync::Semaphore::new(1),
        })
    }

    /// Where the graph `name` is: a `--nn-graph` name, else a model directory of the
    /// repository (a plain directory name: no separator, no leading dot).
    fn path_of(&self, name: &str) -> Option<PathBuf> {
        if let Some(p) = self.named.get(name) {
            return Some(p.clone());
        }
        let root = self.repository.as_ref()?;
        let plain = !name.is_empty() && !name.starts_with('.') && !name.contains(['/', '\\', '\0']);
        let dir = root.join(name);
        (plain && dir.is_dir()).then_some(dir)
    }

    /// The one conversion this host runs at a time: each is a process of its own.
    async fn one_conversion(&self) -> Result<tokio::sync::SemaphorePermit<'_>, NnError> {
        self.converting
            .acquire()
            .await
            .map_err(|_| NnError::new(NnErrorCode::RuntimeError, "the host is shutting down"))
    }

    /// The graph of the ONNX file `onnx`, converted (or found converted); the caller holds
    /// [`Self::one_conversion`].
    async fn graph_of_onnx(&self, name: &str, onnx: &Path) -> Result<NnGraphDef, NnError> {
        let mut config = ModelConfig::default();
        prepare(&self.converter, name, onnx, None, &mut config)
            .await
            .map_err(|e| conversion_error(&self.converter, &e))?;
        let dir = onnx.parent().unwrap_or(Path::new("."));
        let plan =
            Plan::read(dir, name, &config).map_err(|e| conversion_error(&self.converter, &e))?;
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
            let _one = self.one_conversion().await?;
            prepare(&self.converter, name, &onnx, pbtxt.as_deref(), &mut config)
                .await
                .map_err(|e| conversion_error(&self.converter, &e))?;
        }
        let plan = Plan::read(dir, name, &config).map_err(bad)?;
        Ok(def_of(name, &plan))
    }
}

/// The wasi-nn error of a failed conversion of `converter`'s: `unsupported-operation` when ops
/// do not convert or there is no converter to run (its Python missing, or failing to start),
/// else `invalid-encoding` (bytes that are no ONNX model, a model the ONNX checker refuses).
fn conversion_error(converter: &OnnxConverter, e: &anyhow::Error) -> NnError {
    let text = format!("{e:#}");
    // The phrases of the converter's errors (python/tpubox/onnx_convert.py) and of
    // `onnx::prepare`'s when the converter cannot run.
    let starting = format!("starting {}", converter.python.display());
    let unsupported = [
        "do not convert",
        "left outside StableHLO",
        "needs the converter's Python",
    ];
    let code = if text.contains(&starting) || unsupported.iter().any(|k| text.contains(k)) {
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
            // The bytes go to a file for the converter, and the file goes once it has run:
            // what stays is the conversion, cached by the bytes' hash (`onnx::prepare`).
            let hash = hex::encode(Sha256::digest(bytes));
            let dir = self.converter.cache_dir.join("wasi-nn");
            let file = dir.join(format!("{}.onnx", &hash[..32]));
            let _one = self.one_conversion().await?;
            let write = || -> std::io::Result<()> {
                std::fs::create_dir_all(&dir)?;
                tpubox_core::cache::atomic::write(&file, bytes, false)
            };
            write().map_err(|e| {
                NnError::new(
                    NnErrorCode::RuntimeError,
                    format!("writing the graph's bytes into {}: {e}", dir.display()),
                )
            })?;
            let graph = self
                .graph_of_onnx(&format!("onnx graph {}", &hash[..12]), &file)
                .await;
            let _ = std::fs::remove_file(&file);
            graph
        })
    }

    fn load_by_name<'a>(&'a self, _tenant: &'a Arc<Tenant>, name: &'a str) -> NnFuture<'a> {
        Box::pin(async move {
            let Some(path) = self.path_of(name) else {
                let mut known: Vec<&str> = self.named.keys().map(String::as_str).collect();
                if self.repository.is_some() {
                    known.push("the models of the repository");
                }
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
                self.graph_of_dir(name, &path).await
            } else {
                let _one = self.one_conversion().await?;
                self.graph_of_onnx(name, &path).await
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_find_repository_models_and_nothing_outside() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("lin")).unwrap();
        let g = NnGraphs::of_repository(OnnxConverter::from_env(), root.path().to_path_buf());
        assert_eq!(g.path_of("lin"), Some(root.path().join("lin")));
        for bad in ["", ".", "..", "../lin", "lin/..", "missing", ".hidden"] {
            assert_eq!(g.path_of(bad), None, "{bad}");
        }
    }
}
