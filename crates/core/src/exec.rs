//! `tpubox exec`: compile and run one StableHLO program on the device, without a guest.
//!
//! Inputs are `.npy` files, one per parameter in order; output N is written as `DIR/out{N}.npy`
//! and `DIR/outputs.json` lists every output's XLA dtype and dims (see [`crate::npy`] for the
//! dtype mapping, including BF16 as raw `|V2`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::device::format_spec;
use crate::npy;
use crate::session::{ProgramFormat, Session};

/// One entry of `outputs.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputInfo {
    /// Position of the output (0-based).
    pub index: usize,
    /// File name of the array inside the output directory, e.g. `out0.npy`.
    pub file: String,
    /// XLA element type name, e.g. `"F32"`, `"BF16"`.
    pub dtype: String,
    /// Dimensions (empty for a scalar).
    pub dims: Vec<i64>,
}

/// Compiles `program` (MLIR text or bytecode) for device 0, runs it on the arrays in `args`,
/// writes the outputs under `out_dir` (created if missing) and returns their descriptions.
/// Everything goes through `session`, so its tenant's limits and program policy apply (a
/// program with an unfed `infeed` or an endless loop is refused unless the tenant is trusted).
///
/// Errors: unreadable files, a compile failure or refusal, an argument count or an array whose
/// dtype or dims differ from the program's parameters (named in the message), or an execution
/// failure.
pub async fn exec(
    session: &Session,
    program: &Path,
    args: &[PathBuf],
    out_dir: &Path,
) -> Result<Vec<OutputInfo>> {
    let code = std::fs::read(program).with_context(|| format!("reading {}", program.display()))?;
    let format = if code.starts_with(b"ML\xefR") {
        ProgramFormat::MlirBytecode
    } else {
        ProgramFormat::MlirText
    };
    let handle = session
        .compile(code, format, None)
        .await
        .with_context(|| format!("compiling {}", program.display()))?;
    let exe = Arc::clone(handle.executable());
    if args.len() != exe.inputs().len() {
        let want: Vec<String> = exe.inputs().iter().map(format_spec).collect();
        bail!(
            "{} takes {} argument(s) ({}), got {} --arg",
            program.display(),
            want.len(),
            want.join(", "),
            args.len()
        );
    }
    let mut tensors = Vec::with_capacity(args.len());
    for (i, (path, spec)) in args.iter().zip(exe.inputs()).enumerate() {
        let arr = npy::read_npy(path, Some(spec.ty))
            .with_context(|| format!("argument {i} must be {}", format_spec(spec)))?;
        if arr.dims != spec.dims {
            let got = crate::types::TensorSpec {
                ty: arr.ty,
                dims: arr.dims.clone(),
            };
            bail!(
                "argument {i} ({}) is {} but {} expects {}",
                path.display(),
                format_spec(&got),
                program.display(),
                format_spec(spec)
            );
        }
        let dims: Vec<u64> = arr.dims.iter().map(|&d| d as u64).collect();
        let t = session
            .tensor_from_bytes(arr.ty, &dims, &arr.data, None)
            .with_context(|| format!("argument {i} ({})", path.display()))?;
        tensors.push(t);
    }
    let call: Vec<&_> = tensors.iter().collect();
    let outputs = session.execute(&handle, &call, &[]).await?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let mut infos = Vec::with_capacity(outputs.len());
    for (index, t) in outputs.iter().enumerate() {
        let bytes = session.read(t).await?;
        let file = format!("out{index}.npy");
        npy::write_npy(&out_dir.join(&file), t.spec().ty, &t.spec().dims, &bytes)?;
        infos.push(OutputInfo {
            index,
            file,
            dtype: t.spec().ty.name().to_string(),
            dims: t.spec().dims.clone(),
        });
    }
    let json = serde_json::to_string_pretty(&infos)?;
    std::fs::write(out_dir.join("outputs.json"), json + "\n")?;
    Ok(infos)
}
