//! ONNX models, as a Triton repository has them (`model.onnx` or `1/model.onnx`, `platform:
//! "onnxruntime_onnx"` or `backend: "onnxruntime"`): converted to a StableHLO model (programs
//! per batch size, the weights lifted into a safetensors file, the `[tpubox.stablehlo]` table)
//! by `python -m tpubox.onnx_convert` (`python/tpubox/onnx_convert.py`: torch-mlir's ONNX
//! importer and its lowering to StableHLO), then served as every StableHLO model is, with
//! batching ([`crate::stablehlo`]).
//!
//! The converter runs in its own pinned venv (`scripts/venvs/onnx.txt`), as a child process of
//! the load, never inside the daemon: a converter that crashes, hangs past
//! [`OnnxConverter::timeout`] or writes something broken fails that model's load alone. Its
//! output is cached under [`OnnxConverter::cache_dir`], keyed by the SHA-256 of the ONNX file,
//! the configuration the converter read and the batch sizes, so a model converts once per
//! file and batch sizes; a later load (or a restart) reads the cache. A conversion is written
//! into a locked `.converting-…` directory and renamed into place when the converter succeeded,
//! so a daemon killed mid-conversion leaves no half-converted model, only that directory, which
//! the next conversion removes (`tpubox_core::cache::atomic`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tpubox_core::cache::atomic;

use super::config::{ModelConfig, StablehloSection, TensorConfig};

/// Prefix of the directories conversions are written into before they are renamed into place.
const CONVERTING_PREFIX: &str = ".converting-";

/// Where the converter runs and where its output is kept.
#[derive(Debug, Clone)]
pub struct OnnxConverter {
    /// The Python of the converter's venv: `TPUBOX_ONNX_PYTHON`, default
    /// `~/.cache/tpubox/venv-onnx/bin/python` (what `bash scripts/dev.sh setup` makes).
    pub python: PathBuf,
    /// Prepended to the child's `PYTHONPATH` (`TPUBOX_ONNX_PYTHONPATH`): where the `tpubox`
    /// package is when it is not installed in that venv.
    pub pythonpath: Option<PathBuf>,
    /// Converted models, one directory per cache key: `TPUBOX_ONNX_CACHE_DIR`, default
    /// `~/.cache/tpubox/onnx`.
    pub cache_dir: PathBuf,
    /// Longest one conversion may take before it is killed and the load fails (default 600 s;
    /// a BERT-base of 435 MB converts in about 12 s on 2 cores).
    pub timeout: Duration,
}

impl OnnxConverter {
    /// The converter the environment names (see the fields), else the defaults.
    pub fn from_env() -> OnnxConverter {
        let cache = dirs::cache_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("tpubox");
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        OnnxConverter {
            python: var("TPUBOX_ONNX_PYTHON")
                .unwrap_or_else(|| cache.join("venv-onnx").join("bin").join("python")),
            pythonpath: var("TPUBOX_ONNX_PYTHONPATH"),
            cache_dir: var("TPUBOX_ONNX_CACHE_DIR").unwrap_or_else(|| cache.join("onnx")),
            timeout: Duration::from_secs(600),
        }
    }
}

/// The ONNX file of the model in `dir`, if it is an ONNX model: `default_model_filename` (when
/// it names a `.onnx` file) or `model.onnx`, in `dir` or its version directories (the highest
/// first), for a model with no component and no `[tpubox.stablehlo]` table.
pub fn onnx_file(config: &ModelConfig, dir: &Path) -> Option<PathBuf> {
    if config.tpubox.stablehlo.is_some() || config.tpubox.component.is_some() {
        return None;
    }
    if config.component_path(dir).is_ok() {
        return None;
    }
    let file = config
        .default_model_filename
        .as_deref()
        .filter(|f| f.ends_with(".onnx"))
        .unwrap_or("model.onnx");
    ModelConfig::model_file_candidates(dir, file)
        .into_iter()
        .find(|p| p.is_file())
}

impl OnnxConverter {
    /// `python -m tpubox.onnx_convert ONNX [--batch-sizes …] [--config-pbtxt …]`, with the
    /// child's environment; stdin closed, killed when dropped.
    ///
    /// Errors: the converter's Python is missing (named, with how to make it).
    fn command(
        &self,
        onnx: &Path,
        sizes: &[u32],
        pbtxt: Option<&Path>,
    ) -> Result<tokio::process::Command> {
        if !self.python.is_file() {
            bail!(
                "{}: an ONNX model needs the converter's Python, {}, which is missing: `bash scripts/dev.sh setup` makes it (scripts/venvs/onnx.txt), or set TPUBOX_ONNX_PYTHON",
                onnx.display(),
                self.python.display()
            );
        }
        let mut cmd = tokio::process::Command::new(&self.python);
        cmd.args(["-m", "tpubox.onnx_convert"])
            .arg(onnx)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        if !sizes.is_empty() {
            cmd.args(["--batch-sizes", &joined(sizes)]);
        }
        if let Some(p) = pbtxt {
            cmd.arg("--config-pbtxt").arg(p);
        }
        if let Some(pp) = &self.pythonpath {
            let mut paths = vec![pp.clone()];
            paths.extend(std::env::split_paths(
                &std::env::var_os("PYTHONPATH").unwrap_or_default(),
            ));
            cmd.env("PYTHONPATH", std::env::join_paths(paths)?);
        }
        Ok(cmd)
    }

    /// Runs `cmd` to its end within [`OnnxConverter::timeout`].
    ///
    /// Errors: it could not start, or ran past the timeout (then it is killed).
    async fn run(
        &self,
        mut cmd: tokio::process::Command,
        onnx: &Path,
    ) -> Result<std::process::Output> {
        match tokio::time::timeout(self.timeout, cmd.output()).await {
            Err(_) => bail!(
                "converting {}: the converter ran past {} s and was stopped",
                onnx.display(),
                self.timeout.as_secs()
            ),
            Ok(r) => r.with_context(|| format!("starting {}", self.python.display())),
        }
    }
}

/// The batch sizes a model's configuration asks to convert: [`batch_sizes`] of its
/// `max_batch_size` and preferred sizes; none (the converter decides from the model) without a
/// `max_batch_size`.
fn sizes_for(config: &ModelConfig) -> Vec<u32> {
    match config.max_batch_size {
        Some(m) if m > 0 => batch_sizes(
            m,
            config
                .dynamic_batching
                .as_ref()
                .map_or(&[][..], |d| &d.preferred_batch_size[..]),
        ),
        _ => Vec::new(),
    }
}

fn joined(sizes: &[u32]) -> String {
    sizes
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The last non-empty line of the converter's stderr: its own error
/// (`tpubox.onnx_convert: error: …`), or `no message`.
fn last_line(stderr: &[u8]) -> String {
    String::from_utf8_lossy(stderr)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no message")
        .to_string()
}

/// The converter's explanation of the ONNX model `onnx` (`--check`): the ops it uses, which
/// convert at which batch sizes, which do not; one line each.
///
/// Errors: as [`prepare`]; a model some of whose ops do not convert fails with the whole
/// explanation.
pub async fn explain(
    converter: &OnnxConverter,
    onnx: &Path,
    pbtxt: Option<&Path>,
    config: &ModelConfig,
) -> Result<Vec<String>> {
    let mut cmd = converter.command(onnx, &sizes_for(config), pbtxt)?;
    cmd.arg("--check");
    let out = converter.run(cmd, onnx).await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<String> = stdout.lines().map(str::to_string).collect();
    if !out.status.success() {
        bail!("{}\n{}", lines.join("\n"), last_line(&out.stderr));
    }
    Ok(lines)
}

/// What the converter writes beside the programs (`plan.json`; `format` 1).
#[derive(Debug, Deserialize)]
struct ConvertedPlan {
    format: u32,
    max_batch_size: u32,
    input: Vec<TensorConfig>,
    output: Vec<TensorConfig>,
    stablehlo: StablehloSection,
}

/// The batch sizes to convert for a largest batch of `max`: the powers of two below it, the
/// preferred sizes, and `max` itself.
fn batch_sizes(max: u32, preferred: &[u32]) -> Vec<u32> {
    let mut sizes: Vec<u32> = std::iter::successors(Some(1u32), |b| b.checked_mul(2))
        .take_while(|&b| b < max)
        .chain(preferred.iter().copied().filter(|&b| b >= 1 && b <= max))
        .chain(std::iter::once(max))
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// Converts the ONNX model `onnx` of the model in `dir` (or finds it converted in the cache)
/// and makes `config` that of the StableHLO model it became: its `[tpubox.stablehlo]` table
/// (absolute paths into the cache), its inputs and outputs and `max_batch_size`.
/// `pbtxt`: the directory's `config.pbtxt`, which the converter reads for the inputs' names,
/// types and dims (none for a config override).
///
/// Errors: no converter venv (named, with how to make it); the converter's own error, which
/// names the ops that do not convert or what is wrong with the file; a conversion past the
/// timeout; a plan of another format; inputs or outputs that disagree with the
/// configuration's.
pub async fn prepare(
    converter: &OnnxConverter,
    name: &str,
    onnx: &Path,
    pbtxt: Option<&Path>,
    config: &mut ModelConfig,
) -> Result<()> {
    let sizes = sizes_for(config);
    let sizes_arg = joined(&sizes);
    let bytes = tokio::fs::read(onnx)
        .await
        .with_context(|| format!("reading {}", onnx.display()))?;
    let pbtxt_text = match pbtxt {
        Some(p) => Some(tokio::fs::read(p).await?),
        None => None,
    };
    let mut h = Sha256::new();
    h.update(Sha256::digest(&bytes));
    h.update(Sha256::digest(pbtxt_text.as_deref().unwrap_or_default()));
    h.update(sizes_arg.as_bytes());
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    let key = hex::encode(h.finalize());
    let out = converter.cache_dir.join(&key[..32]);
    if !out.join("plan.json").is_file() {
        tokio::fs::create_dir_all(&converter.cache_dir)
            .await
            .with_context(|| format!("creating {}", converter.cache_dir.display()))?;
        // A load killed while converting left its locked directory behind; the lock died
        // with it, and only such directories are removed (not another live conversion's).
        atomic::remove_stale(&converter.cache_dir, CONVERTING_PREFIX);
        let tmp = atomic::LockedTempDir::new(&converter.cache_dir, CONVERTING_PREFIX)?;
        let mut cmd = converter.command(onnx, &sizes, pbtxt)?;
        cmd.arg("--out").arg(tmp.path());
        let started = std::time::Instant::now();
        let output = converter.run(cmd, onnx).await?;
        if !output.status.success() {
            let last = last_line(&output.stderr);
            bail!(
                "converting {} to StableHLO: {}",
                onnx.display(),
                last.trim_start_matches("tpubox.onnx_convert: error: ")
            );
        }
        tracing::info!(
            model = name,
            onnx = %onnx.display(),
            batch_sizes = %sizes_arg,
            seconds = started.elapsed().as_secs_f64(),
            cache = %out.display(),
            "ONNX model converted to StableHLO"
        );
        if let Err(e) = tmp.persist(&out) {
            // Another load converted the same file meanwhile: keep its output.
            if !out.join("plan.json").is_file() {
                return Err(e)
                    .with_context(|| format!("moving the conversion to {}", out.display()));
            }
        }
    }
    let text = std::fs::read_to_string(out.join("plan.json"))
        .with_context(|| format!("reading {}", out.join("plan.json").display()))?;
    let plan: ConvertedPlan = serde_json::from_str(&text)
        .with_context(|| format!("reading {}", out.join("plan.json").display()))?;
    if plan.format != 1 {
        bail!(
            "{}: plan format {} (this tpubox reads format 1)",
            out.display(),
            plan.format
        );
    }
    agree("input", &config.input, &plan.input)?;
    agree("output", &config.output, &plan.output)?;
    let mut section = plan.stablehlo;
    for p in &mut section.programs {
        p.file = out.join(&p.file);
    }
    section.weights = Some(
        out.join(
            section
                .weights
                .as_deref()
                .unwrap_or(Path::new("weights.safetensors")),
        ),
    );
    // Named by content: models with the same file share one weight set, and a changed file
    // is a new set.
    section.weight_set = Some(format!("onnx-{}", &key[..16]));
    config.tpubox.stablehlo = Some(section);
    config.input = plan.input;
    config.output = plan.output;
    config.max_batch_size = Some(plan.max_batch_size);
    Ok(())
}

/// The configuration's `input`/`output` (where it lists any) against what the converter
/// found: the same names and datatypes, and dims equal but where the configuration has -1.
fn agree(what: &str, configured: &[TensorConfig], converted: &[TensorConfig]) -> Result<()> {
    if configured.is_empty() {
        return Ok(());
    }
    for c in configured {
        let Some(m) = converted.iter().find(|m| m.name == c.name) else {
            bail!(
                "the config declares {what} `{}`, the ONNX model has no such {what} ({})",
                c.name,
                converted
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        let same_type = super::protocol::Datatype::from_name(&c.data_type)
            == super::protocol::Datatype::from_name(&m.data_type);
        let same_dims = c.dims.len() == m.dims.len()
            && c.dims.iter().zip(&m.dims).all(|(a, b)| *a == -1 || a == b);
        if !same_type || !same_dims {
            bail!(
                "{what} `{}`: the config says {} {:?}, the ONNX model has {} {:?}",
                c.name,
                c.data_type,
                c.dims,
                m.data_type,
                m.dims
            );
        }
    }
    if configured.len() != converted.len() && what == "input" {
        bail!(
            "the config declares {} inputs, the ONNX model {}",
            configured.len(),
            converted.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_sizes_are_powers_of_two_the_preferred_and_the_largest() {
        assert_eq!(batch_sizes(8, &[]), [1, 2, 4, 8]);
        assert_eq!(batch_sizes(6, &[3, 9]), [1, 2, 3, 4, 6]);
        assert_eq!(batch_sizes(1, &[]), [1]);
    }

    #[test]
    fn configured_tensors_must_match_the_converted_ones() {
        let t = |n: &str, d: &str, dims: &[i64]| TensorConfig {
            name: n.into(),
            data_type: d.into(),
            dims: dims.to_vec(),
        };
        let converted = [t("x", "TYPE_FP32", &[3, 224, 224])];
        agree("input", &[], &converted).unwrap();
        agree("input", &[t("x", "TYPE_FP32", &[3, -1, -1])], &converted).unwrap();
        let e = agree("input", &[t("y", "TYPE_FP32", &[3])], &converted).unwrap_err();
        assert!(e.to_string().contains("no such input (x)"), "{e}");
        let e = agree("input", &[t("x", "TYPE_INT32", &[3, 224, 224])], &converted).unwrap_err();
        assert!(
            e.to_string().contains("the ONNX model has TYPE_FP32"),
            "{e}"
        );
    }
}
