//! [`Program`]: code handed to `PJRT_Client_Compile` (`PJRT_Program` in the C API).

/// Format of a [`Program`]'s code (`PJRT_Program.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProgramFormat {
    /// `"mlir"`: StableHLO/MHLO module as MLIR text or MLIR bytecode (including portable VHLO
    /// artifacts such as `jax.export` output).
    Mlir,
    /// `"hlo"`: a serialized `xla.HloModuleProto`.
    Hlo,
}

impl ProgramFormat {
    /// The C API format string: `"mlir"` or `"hlo"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProgramFormat::Mlir => "mlir",
            ProgramFormat::Hlo => "hlo",
        }
    }
}

/// A program to compile: format plus code bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// How `code` is encoded.
    pub format: ProgramFormat,
    /// MLIR text/bytecode or serialized `HloModuleProto`.
    pub code: Vec<u8>,
}

impl Program {
    /// An MLIR program (text or bytecode).
    pub fn mlir(code: impl Into<Vec<u8>>) -> Self {
        Self {
            format: ProgramFormat::Mlir,
            code: code.into(),
        }
    }

    /// A serialized `HloModuleProto`.
    pub fn hlo(code: impl Into<Vec<u8>>) -> Self {
        Self {
            format: ProgramFormat::Hlo,
            code: code.into(),
        }
    }
}
