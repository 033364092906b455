//! Compiling programs ([`compile_mlir`], [`compile_mlir_bytecode`], [`Executable::compile`]) and
//! running them ([`Executable`]).

use std::cell::OnceCell;
use std::fmt;

use crate::bindings::tpubox::device::client as raw_client;
use crate::bindings::tpubox::device::types as raw_types;
use crate::{CompileOptions, Error, ProgramFormat, Result, Tensor, TensorSpec};

impl Default for CompileOptions {
    /// Host defaults: compile for device 0.
    fn default() -> Self {
        CompileOptions { device: None }
    }
}

impl CompileOptions {
    /// Options that compile for device `device` (index from [`devices`](crate::devices)).
    pub fn for_device(device: u32) -> Self {
        CompileOptions {
            device: Some(device),
        }
    }
}

/// Compiles StableHLO (or another MLIR dialect mix the host's plugin accepts) given as MLIR
/// text, for device 0. The entry function must be `main`, e.g.
/// `func.func public @main(%x: tensor<2x3xf32>) -> tensor<2x3xf32>`.
///
/// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for an empty or oversized program;
/// [`ErrorKind::CompileFailed`](crate::ErrorKind::CompileFailed) with the compiler's diagnostics when it does not parse, verify
/// or compile.
pub fn compile_mlir(text: &str) -> Result<Executable> {
    Executable::compile(
        ProgramFormat::MlirText,
        text.as_bytes(),
        CompileOptions::default(),
    )
}

/// Compiles an MLIR bytecode program (including portable VHLO artifacts such as `jax.export`
/// serializations), for device 0. The entry function must be `main`.
///
/// Errors: as for [`compile_mlir`].
pub fn compile_mlir_bytecode(bytecode: &[u8]) -> Result<Executable> {
    Executable::compile(
        ProgramFormat::MlirBytecode,
        bytecode,
        CompileOptions::default(),
    )
}

/// A program compiled for one device, ready to run with [`Executable::call`].
///
/// Its parameter and result specs ([`Executable::inputs`], [`Executable::outputs`]) and
/// [`Executable::fingerprint`] are fetched from the host at most once.
pub struct Executable {
    raw: raw_types::Executable,
    inputs: OnceCell<Vec<TensorSpec>>,
    outputs: OnceCell<Vec<TensorSpec>>,
    fingerprint: OnceCell<String>,
}

impl fmt::Debug for Executable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executable")
            .field("fingerprint", &self.fingerprint.get())
            .finish_non_exhaustive()
    }
}

impl Executable {
    /// Compiles `code` in `format` with `options`; the entry function must be `main`.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for an empty or oversized program, or
    /// [`ProgramFormat::MlirText`] that is not UTF-8 (an empty program is rejected
    /// guest-side); [`ErrorKind::NotFound`](crate::ErrorKind::NotFound) for an unknown device;
    /// [`ErrorKind::CompileFailed`](crate::ErrorKind::CompileFailed) with the compiler's message.
    pub fn compile(format: ProgramFormat, code: &[u8], options: CompileOptions) -> Result<Self> {
        if code.is_empty() {
            return Err(Error::invalid_argument("program is empty"));
        }
        let raw = raw_client::compile(format, code, options)?;
        Ok(Executable::from_raw(raw))
    }

    /// Wraps a raw handle from [`bindings`](crate::bindings).
    pub fn from_raw(raw: raw_types::Executable) -> Self {
        Executable {
            raw,
            inputs: OnceCell::new(),
            outputs: OnceCell::new(),
            fingerprint: OnceCell::new(),
        }
    }

    /// The raw handle.
    pub fn as_raw(&self) -> &raw_types::Executable {
        &self.raw
    }

    /// Unwraps the raw handle.
    pub fn into_raw(self) -> raw_types::Executable {
        self.raw
    }

    /// Specs of the parameters of `main`, in order.
    pub fn inputs(&self) -> &[TensorSpec] {
        self.inputs.get_or_init(|| self.raw.inputs())
    }

    /// Specs of the results, in order (a tuple result is flattened).
    pub fn outputs(&self) -> &[TensorSpec] {
        self.outputs.get_or_init(|| self.raw.outputs())
    }

    /// Index of the device this executable runs on.
    pub fn device(&self) -> u32 {
        self.raw.device()
    }

    /// A stable hex identifier of the compiled program, equal for equal
    /// (program, options, plugin) triples.
    pub fn fingerprint(&self) -> &str {
        self.fingerprint.get_or_init(|| self.raw.fingerprint())
    }

    /// Runs the program with `args` as its parameters and returns its results, one tensor per
    /// entry of [`Executable::outputs`].
    ///
    /// Arguments are borrowed and stay valid. Each argument must match the corresponding
    /// entry of [`Executable::inputs`] in dtype and dims and live on [`Executable::device`].
    ///
    /// Errors: [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) if the argument count differs from `inputs()`
    /// (checked guest-side) or, from the host, an argument's dtype or dims differ;
    /// [`ErrorKind::FailedPrecondition`](crate::ErrorKind::FailedPrecondition) for a donated tensor or one on another device;
    /// [`ErrorKind::ExecutionFailed`](crate::ErrorKind::ExecutionFailed) if the device fails.
    pub fn call(&self, args: &[&Tensor]) -> Result<Vec<Tensor>> {
        self.call_donating(args, &[])
    }

    /// Like [`Executable::call`], but donates the arguments at positions `donate`: their
    /// device memory may be reused for outputs, and the donated tensors can no longer be used
    /// (later calls on them fail with [`ErrorKind::FailedPrecondition`](crate::ErrorKind::FailedPrecondition)). Drop them after the
    /// call.
    ///
    /// Errors: as for [`Executable::call`], plus [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) (checked
    /// guest-side) if a donate index is out of range or repeated, and, from the host,
    /// when one tensor is passed twice with one position donated;
    /// [`ErrorKind::PermissionDenied`](crate::ErrorKind::PermissionDenied) when donating a shared tensor.
    pub fn call_donating(&self, args: &[&Tensor], donate: &[u32]) -> Result<Vec<Tensor>> {
        check_arg_count(self.inputs().len(), args.len())?;
        check_donate(args.len(), donate)?;
        let raw_args: Vec<&raw_types::Tensor> = args.iter().map(|t| t.as_raw()).collect();
        let outs = raw_client::execute(&self.raw, &raw_args, donate)?;
        Ok(self.wrap_outputs(outs))
    }

    /// Launches the program like [`Executable::call_donating`] (`donate` may be empty), but
    /// returns at once while the device works: the outputs are valued once the launch
    /// finished ([`Tensor::wait`], [`wait_all`]; a read waits). They may be passed to later
    /// launches at once; the host orders those after this one. Donation is final at launch.
    ///
    /// Errors: as for [`Executable::call_donating`], except the device's error
    /// ([`ErrorKind::ExecutionFailed`](crate::ErrorKind::ExecutionFailed)), which surfaces at
    /// the first wait or read of an output (or here, with [`set_launch_blocking`]);
    /// [`ErrorKind::ResourceExhausted`](crate::ErrorKind::ResourceExhausted) naming
    /// `max-pending-launches` when the guest already has that many launches pending.
    pub fn launch(&self, args: &[&Tensor], donate: &[u32]) -> Result<Launch> {
        check_arg_count(self.inputs().len(), args.len())?;
        check_donate(args.len(), donate)?;
        let raw_args: Vec<&raw_types::Tensor> = args.iter().map(|t| t.as_raw()).collect();
        let (id, outs) = raw_client::launch(&self.raw, &raw_args, donate)?;
        Ok(Launch {
            id,
            outputs: self.wrap_outputs(outs),
        })
    }

    fn wrap_outputs(&self, outs: Vec<raw_types::Tensor>) -> Vec<Tensor> {
        let specs = self.outputs.get();
        outs.into_iter()
            .enumerate()
            .map(|(i, raw)| Tensor::with_spec(raw, specs.and_then(|s| s.get(i)).cloned()))
            .collect()
    }
}

/// Waits until every launch of this guest so far has finished ([`Executable::launch`]).
///
/// Errors: the error of the first failed launch that no [`Tensor::wait`], read or earlier
/// `wait_all` reported ([`ErrorKind::ExecutionFailed`](crate::ErrorKind::ExecutionFailed),
/// naming the launch and how many others failed).
pub fn wait_all() -> Result<()> {
    Ok(raw_client::wait_all()?)
}

/// Makes this guest's later launches synchronous (`true`): [`Executable::launch`] returns only
/// once the device finished, with the device's error, as TorchTPU's
/// `TORCH_TPU_LAUNCH_BLOCKING=1` does. For debugging; the host may force it on for every guest
/// (`tpubox run --launch-blocking`).
pub fn set_launch_blocking(on: bool) {
    raw_client::set_launch_blocking(on);
}

/// What [`Executable::launch`] returns: the launch's id and its outputs.
#[derive(Debug)]
pub struct Launch {
    /// The launch's id, unique in the host; the launch's errors name it
    /// (`launch <id> of program <fingerprint> failed: ...`).
    pub id: u64,
    /// One tensor per entry of [`Executable::outputs`], in order; the device may still be
    /// computing them ([`Tensor::wait`]; reading one waits).
    pub outputs: Vec<Tensor>,
}

fn check_arg_count(want: usize, got: usize) -> Result<()> {
    if want != got {
        return Err(Error::invalid_argument(format!(
            "executable takes {want} argument(s) but {got} were given"
        )));
    }
    Ok(())
}

fn check_donate(nargs: usize, donate: &[u32]) -> Result<()> {
    for (i, &d) in donate.iter().enumerate() {
        if usize::try_from(d).map_or(true, |d| d >= nargs) {
            return Err(Error::invalid_argument(format!(
                "donate index {d} is out of range for {nargs} argument(s)"
            )));
        }
        if donate[..i].contains(&d) {
            return Err(Error::invalid_argument(format!(
                "donate index {d} is repeated"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn compile_rejects_empty_program() {
        let e = compile_mlir("").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let e = compile_mlir_bytecode(&[]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn donate_and_arg_checks() {
        assert!(check_donate(3, &[0, 2]).is_ok());
        assert!(check_donate(3, &[]).is_ok());
        assert_eq!(
            check_donate(3, &[3]).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            check_donate(3, &[1, 1]).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert!(check_arg_count(2, 2).is_ok());
        assert_eq!(
            check_arg_count(2, 3).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}
