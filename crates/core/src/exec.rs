//! `tpubox exec`: compile and run one StableHLO program on the device, without a guest.
//!
//! Inputs are `.npy` files, one per parameter in order; output N is written as `DIR/out{N}.npy`
//! and `DIR/outputs.json` lists every output's XLA dtype, dims and the devices the program ran
//! on (see [`crate::npy`] for the dtype mapping, including BF16 as raw `|V2`).
//!
//! A program whose module declares several partitions (`mhlo.num_partitions = N`, as
//! `jax.export` of a `jax.jit` over a mesh of N devices writes it, with Shardy's `sdy.sharding`
//! or GSPMD's `mhlo.sharding` annotations) is compiled for N devices at once (SPMD, one
//! partition per device, [`CompileSettings::devices`]) and run as JAX runs it: each input file
//! holds the global array, split by the program's parameter shardings into one shard per
//! device; each output is gathered from its shards by the program's output sharding into the
//! global array. The count is read from the module itself: from MLIR text, and from MLIR
//! bytecode (what `Exported.mlir_module_serialized` holds) by [`declared_devices`], which
//! reads the module's attribute dictionary out of the bytecode's attribute table. XLA does not
//! check the count it is given against the module's (it refuses some mismatches through its
//! verifier, with messages about sharding tiles or replica groups, and compiles others, such
//! as a replicated program, for any count), so the check is made here, before compiling.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::device::{CompileSettings, format_spec};
use crate::error::{DeviceError, ErrorKind};
use crate::npy;
use crate::session::{ExecutableHandle, ProgramFormat, Session, TensorHandle};
use crate::types::TensorSpec;

/// One entry of `outputs.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputInfo {
    /// Position of the output (0-based).
    pub index: usize,
    /// File name of the array inside the output directory, e.g. `out0.npy`.
    pub file: String,
    /// XLA element type name, e.g. `"F32"`, `"BF16"`.
    pub dtype: String,
    /// Dimensions (empty for a scalar); of the global array for a program of several devices.
    pub dims: Vec<i64>,
    /// The devices (indices, as `tpubox devices` lists them) the program ran on, in the order
    /// of its partitions: one for a program of one device.
    #[serde(default)]
    pub devices: Vec<u32>,
    /// For a program of several devices, how this output was laid out over them (XLA's text
    /// form of its sharding, e.g. `{devices=[4,1]<=[4]}` or `{replicated}`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharding: Option<String>,
}

/// How [`exec_with`] places the program.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOptions {
    /// The devices to run on, in partition order (`tpubox exec --devices`). `None`: device 0
    /// for a program of one device, the session's first N devices for a program that declares
    /// N partitions. Given, its length must equal the count the module declares; for a module
    /// whose count cannot be read, the list is taken as it is.
    pub devices: Option<Vec<u32>>,
}

pub use crate::declared::{DeclaredDevices, declared_devices};
use crate::declared::{NUM_PARTITIONS, NUM_REPLICAS};

/// Compiles `program` (MLIR text or bytecode) for device 0, runs it on the arrays in `args`,
/// writes the outputs under `out_dir` (created if missing) and returns their descriptions.
/// A program that declares several partitions runs on the session's first devices, as
/// [`exec_with`] says. Everything goes through `session`, so its tenant's limits and program
/// policy apply (a program with an unfed `infeed` or an endless loop is refused unless the
/// tenant is trusted).
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
    exec_with(session, program, args, out_dir, &ExecOptions::default()).await
}

/// [`exec`], placed as `opts` says. A program of one device runs as `exec` runs it (on
/// `opts.devices`' one device if given). A program whose module declares N > 1 partitions
/// ([`declared_devices`]) is compiled for N devices (`opts.devices`, else the session's first
/// N), each `.npy` input is read as the parameter's global array and split by the program's
/// parameter sharding, the program runs on all N at once, and each output is gathered into its
/// global array; `outputs.json` names the devices and each output's sharding.
///
/// Errors: as [`exec`]; `invalid-argument` naming both numbers when the module declares N
/// partitions and `opts.devices` lists another number, or the session has fewer than N
/// devices; `unsupported` for a module of several replicas (`mhlo.num_replicas`; JAX exports
/// partitions) or a sharding with no global-array view.
pub async fn exec_with(
    session: &Session,
    program: &Path,
    args: &[PathBuf],
    out_dir: &Path,
    opts: &ExecOptions,
) -> Result<Vec<OutputInfo>> {
    let code = std::fs::read(program).with_context(|| format!("reading {}", program.display()))?;
    let format = if code.starts_with(crate::declared::BYTECODE_MAGIC) {
        ProgramFormat::MlirBytecode
    } else {
        ProgramFormat::MlirText
    };
    let devices = choose_devices(session, program, &code, opts)?;
    let compiled = match &devices {
        None => session.compile(code, format, None).await,
        Some(d) if d.len() == 1 => session.compile(code, format, Some(d[0])).await,
        Some(d) => {
            let settings = CompileSettings {
                device: d[0],
                devices: d.clone(),
                ..CompileSettings::default()
            };
            session.compile_with(code, format, settings).await
        }
    };
    let handle = compiled.with_context(|| format!("compiling {}", program.display()))?;
    if handle.executable().is_spmd() {
        run_spmd(session, &handle, program, args, out_dir).await
    } else {
        run_single(session, &handle, program, args, out_dir).await
    }
}

/// The devices to compile for: `None` for device 0 as before (a program of one device, or one
/// whose count cannot be read and no `--devices`).
fn choose_devices(
    session: &Session,
    program: &Path,
    code: &[u8],
    opts: &ExecOptions,
) -> Result<Option<Vec<u32>>> {
    let declared = match declared_devices(code) {
        Ok(d) => Some(d),
        Err(e) => {
            // Compiled as before: for one device unless --devices says otherwise (XLA
            // reports a malformed module better than this reader).
            tracing::warn!(
                program = %program.display(),
                "the module's device count cannot be read ({e}); running it as given"
            );
            None
        }
    };
    if let Some(d) = declared
        && d.replicas() > 1
    {
        bail!(DeviceError::new(
            ErrorKind::Unsupported,
            format!(
                "{} declares {} replicas ({NUM_REPLICAS} = {}): tpubox runs programs of several partitions (mhlo.num_partitions, what jax.jit over a mesh exports), not of several replicas",
                program.display(),
                d.replicas(),
                d.replicas()
            )
        ));
    }
    let n = declared.map(|d| d.partitions());
    if n == Some(0) {
        bail!(DeviceError::invalid(format!(
            "{} declares {NUM_PARTITIONS} = 0",
            program.display()
        )));
    }
    let named = |n: u64| match declared.and_then(|d| d.partitions) {
        Some(1) => format!("1 device ({NUM_PARTITIONS} = 1)"),
        Some(_) => format!("{n} devices ({NUM_PARTITIONS} = {n})"),
        None => format!("1 device (it declares no {NUM_PARTITIONS})"),
    };
    match (&opts.devices, n) {
        (None, None | Some(1)) => Ok(None),
        (None, Some(n)) => {
            let have = session.placement().devices();
            if (have.len() as u64) < n {
                bail!(DeviceError::invalid(format!(
                    "{} is a program for {}, and only {} device(s) are available ({have:?}; the CPU plugin exposes as many as --cpu-devices says)",
                    program.display(),
                    named(n),
                    have.len()
                )));
            }
            Ok(Some(have[..n as usize].to_vec()))
        }
        (Some(list), _) if list.is_empty() => Ok(None),
        (Some(list), Some(n)) if list.len() as u64 != n => {
            bail!(DeviceError::invalid(format!(
                "{} is a program for {}, and --devices lists {} ({list:?})",
                program.display(),
                named(n),
                list.len()
            )))
        }
        (Some(list), _) => Ok(Some(list.clone())),
    }
}

/// Reads argument `i` from `path` as `spec` (dtype and dims).
fn read_arg(path: &Path, i: usize, spec: &TensorSpec) -> Result<npy::HostArray> {
    npy::read_npy(path, Some(spec.ty))
        .with_context(|| format!("argument {i} must be {}", format_spec(spec)))
}

fn wrong_count(program: &Path, want: &[TensorSpec], got: usize) -> anyhow::Error {
    let want: Vec<String> = want.iter().map(format_spec).collect();
    anyhow::anyhow!(
        "{} takes {} argument(s) ({}), got {} --arg",
        program.display(),
        want.len(),
        want.join(", "),
        got
    )
}

/// A program of one device: each input as it is, each output as it is.
async fn run_single(
    session: &Session,
    handle: &ExecutableHandle,
    program: &Path,
    args: &[PathBuf],
    out_dir: &Path,
) -> Result<Vec<OutputInfo>> {
    let exe = Arc::clone(handle.executable());
    if args.len() != exe.inputs().len() {
        return Err(wrong_count(program, exe.inputs(), args.len()));
    }
    let mut tensors = Vec::with_capacity(args.len());
    for (i, (path, spec)) in args.iter().zip(exe.inputs()).enumerate() {
        let arr = read_arg(path, i, spec)?;
        if arr.dims != spec.dims {
            let got = TensorSpec {
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
            .tensor_from_bytes(arr.ty, &dims, &arr.data, Some(exe.device()))
            .with_context(|| format!("argument {i} ({})", path.display()))?;
        tensors.push(t);
    }
    let call: Vec<&_> = tensors.iter().collect();
    let outputs = session.execute(handle, &call, &[]).await?;
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
            devices: exe.devices().to_vec(),
            sharding: None,
        });
    }
    write_json(out_dir, &infos)?;
    Ok(infos)
}

/// A program of several devices: each input split by its parameter's sharding, each output
/// gathered by its result's.
async fn run_spmd(
    session: &Session,
    handle: &ExecutableHandle,
    program: &Path,
    args: &[PathBuf],
    out_dir: &Path,
) -> Result<Vec<OutputInfo>> {
    let exe = Arc::clone(handle.executable());
    let sh = exe.shardings()?;
    if args.len() != sh.global_inputs.len() {
        return Err(wrong_count(program, &sh.global_inputs, args.len()));
    }
    let mut shards: Vec<Vec<TensorHandle>> = Vec::with_capacity(args.len());
    for (i, path) in args.iter().enumerate() {
        let global = &sh.global_inputs[i];
        let arr = read_arg(path, i, global)?;
        if arr.dims != global.dims {
            let got = TensorSpec {
                ty: arr.ty,
                dims: arr.dims.clone(),
            };
            bail!(
                "argument {i} ({}) is {} but {} expects {} (the global array, which its sharding {} splits into {} per device)",
                path.display(),
                format_spec(&got),
                program.display(),
                format_spec(global),
                sh.params[i],
                format_spec(&exe.inputs()[i])
            );
        }
        let dims: Vec<u64> = arr.dims.iter().map(|&d| d as u64).collect();
        let parts = session
            .put_sharded(handle, i, arr.ty, &dims, &arr.data)
            .with_context(|| format!("argument {i} ({})", path.display()))?;
        shards.push(parts);
    }
    let call: Vec<Vec<&TensorHandle>> = shards.iter().map(|s| s.iter().collect()).collect();
    let outputs = session.execute_spmd(handle, &call, &[]).await?;
    drop(call);
    drop(shards);
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let mut infos = Vec::with_capacity(outputs.len());
    for (index, parts) in outputs.iter().enumerate() {
        let global = &sh.global_outputs[index];
        let bytes = session.read_sharded(handle, index, parts).await?;
        let file = format!("out{index}.npy");
        npy::write_npy(&out_dir.join(&file), global.ty, &global.dims, &bytes)?;
        infos.push(OutputInfo {
            index,
            file,
            dtype: global.ty.name().to_string(),
            dims: global.dims.clone(),
            devices: exe.devices().to_vec(),
            sharding: Some(sh.outputs[index].to_string()),
        });
    }
    write_json(out_dir, &infos)?;
    Ok(infos)
}

fn write_json(out_dir: &Path, infos: &[OutputInfo]) -> Result<()> {
    let json = serde_json::to_string_pretty(infos)?;
    std::fs::write(out_dir.join("outputs.json"), json + "\n")
        .with_context(|| format!("writing {}", out_dir.join("outputs.json").display()))
}
