//! CPU handlers for the LAPACK custom calls that JAX emits for `jnp.linalg` and
//! `jax.scipy.linalg` on CPU (`lapack_sgetrf_ffi`, `lapack_zheevd_ffi`, ...), registered with a
//! PJRT plugin through its FFI extension.
//!
//! On CPU, JAX lowers linear algebra to `stablehlo.custom_call` ops with `api_version = 4`
//! (typed XLA FFI) whose handlers jaxlib registers in its own process; a PJRT CPU plugin
//! loaded elsewhere has none, so such a program fails to compile ("No FFI handler registered
//! for lapack_sgetrf_ffi"). [`register`] gives the plugin handlers with the same operands,
//! results, attributes and layouts as jaxlib's, calling a LAPACK library loaded at run time
//! (OpenBLAS by default; see [`DEFAULT_LIBRARIES`]).
//!
//! Covered, each for f32, f64, c64 and c128 ([`targets`] lists the names):
//!
//! | routine | JAX functions |
//! |---|---|
//! | `getrf` (LU) | `solve`, `inv`, `det`, `slogdet`, `lu`, `lu_factor`, `expm` |
//! | `trsm` (triangular solve) | `solve`, `inv`, `solve_triangular`, `cho_solve` |
//! | `potrf` (Cholesky) | `cholesky`, `cho_factor` |
//! | `geqrf`, `orgqr`/`ungqr` (QR) | `qr`, `polar`, `householder_product` |
//! | `syevd`/`heevd` | `eigh`, `eigvalsh` |
//! | `gesdd`, `gesvd` (SVD) | `svd`, `pinv`, `lstsq`, `matrix_rank`, `cond`, `norm(ord=2)` |
//! | `geev` | `eig`, `eigvals` |
//! | `gees` (Schur) | `schur`, `sqrtm` |
//! | `gehrd` | `hessenberg` |
//! | `sytrd`/`hetrd` | `lax.linalg.tridiagonal` |
//! | `gtsv` | `lax.linalg.tridiagonal_solve` |
//!
//! Hostile inputs: every buffer's element type and dimensions are checked against the custom
//! call's contract before LAPACK runs (a wrong call fails with `INVALID_ARGUMENT` instead of
//! reaching LAPACK's `xerbla`); a call asking for more than [`kernels::max_flop`] floating-point
//! operations fails with `RESOURCE_EXHAUSTED` (XLA cannot interrupt a custom call); the
//! iterative routines (eigen, SVD, Schur) are not run on a matrix with NaN or infinity: its
//! results are NaN and its `info` is 1, which JAX reports as NaN, as for a LAPACK failure.

#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

pub mod kernels;
mod library;
mod scalar;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use num_complex::Complex;
use pjrt::Plugin;
use pjrt::ffi::{HandlerFn, handle};
use pjrt_sys::xla_ffi::{XLA_FFI_CallFrame, XLA_FFI_Error};

pub use library::DEFAULT_LIBRARIES;

/// What [`register`] did.
#[derive(Debug, Clone)]
pub struct Registered {
    /// Custom-call targets now handled, e.g. `lapack_sgetrf_ffi`.
    pub targets: Vec<&'static str>,
    /// The LAPACK library the handlers call (the name or path that was loaded).
    pub library: String,
}

/// One handler: custom-call target, the LAPACK/BLAS symbol it needs, the handler.
type Entry = (&'static str, &'static str, HandlerFn);

macro_rules! handlers {
    ($module:ident, $t:ty, $p:literal, $orgqr:literal, $syevd:literal, $sytrd:literal) => {
        mod $module {
            use super::*;
            use crate::kernels as k;

            macro_rules! h {
                ($name:ident, $body:expr) => {
                    /// # Safety
                    /// Called by XLA with a valid call frame.
                    unsafe extern "C" fn $name(
                        frame: *mut XLA_FFI_CallFrame,
                    ) -> *mut XLA_FFI_Error {
                        // SAFETY: XLA passes its live call frame.
                        unsafe { handle(frame, $body) }
                    }
                };
            }
            h!(getrf, k::getrf::<$t>);
            h!(trsm, k::trsm::<$t>);
            h!(potrf, k::potrf::<$t>);
            h!(geqrf, k::geqrf::<$t>);
            h!(orgqr, k::orgqr::<$t>);
            h!(syevd, k::syevd::<$t>);
            h!(gesdd, |f| k::gesdd::<$t>(f, false));
            h!(gesvd, |f| k::gesdd::<$t>(f, true));
            h!(geev, k::geev::<$t>);
            h!(gees, k::gees::<$t>);
            h!(gehrd, k::gehrd::<$t>);
            h!(sytrd, k::sytrd::<$t>);
            h!(gtsv, k::gtsv::<$t>);

            pub(super) const TABLE: [Entry; 13] = [
                (
                    concat!("lapack_", $p, "getrf_ffi"),
                    concat!($p, "getrf_"),
                    getrf,
                ),
                (
                    concat!("lapack_", $p, "trsm_ffi"),
                    concat!($p, "trsm_"),
                    trsm,
                ),
                (
                    concat!("lapack_", $p, "potrf_ffi"),
                    concat!($p, "potrf_"),
                    potrf,
                ),
                (
                    concat!("lapack_", $p, "geqrf_ffi"),
                    concat!($p, "geqrf_"),
                    geqrf,
                ),
                (
                    concat!("lapack_", $p, $orgqr, "_ffi"),
                    concat!($p, $orgqr, "_"),
                    orgqr,
                ),
                (
                    concat!("lapack_", $p, $syevd, "_ffi"),
                    concat!($p, $syevd, "_"),
                    syevd,
                ),
                (
                    concat!("lapack_", $p, "gesdd_ffi"),
                    concat!($p, "gesdd_"),
                    gesdd,
                ),
                (
                    concat!("lapack_", $p, "gesvd_ffi"),
                    concat!($p, "gesvd_"),
                    gesvd,
                ),
                (
                    concat!("lapack_", $p, "geev_ffi"),
                    concat!($p, "geev_"),
                    geev,
                ),
                (
                    concat!("lapack_", $p, "gees_ffi"),
                    concat!($p, "gees_"),
                    gees,
                ),
                (
                    concat!("lapack_", $p, "gehrd_ffi"),
                    concat!($p, "gehrd_"),
                    gehrd,
                ),
                (
                    concat!("lapack_", $p, $sytrd, "_ffi"),
                    concat!($p, $sytrd, "_"),
                    sytrd,
                ),
                (
                    concat!("lapack_", $p, "gtsv_ffi"),
                    concat!($p, "gtsv_"),
                    gtsv,
                ),
            ];
        }
    };
}

handlers!(f32_handlers, f32, "s", "orgqr", "syevd", "sytrd");
handlers!(f64_handlers, f64, "d", "orgqr", "syevd", "sytrd");
handlers!(c64_handlers, Complex<f32>, "c", "ungqr", "heevd", "hetrd");
handlers!(c128_handlers, Complex<f64>, "z", "ungqr", "heevd", "hetrd");

fn table() -> impl Iterator<Item = &'static Entry> {
    f32_handlers::TABLE
        .iter()
        .chain(c64_handlers::TABLE.iter())
        .chain(f64_handlers::TABLE.iter())
        .chain(c128_handlers::TABLE.iter())
}

/// Every custom-call target these handlers implement (52: 13 routines × 4 element types).
pub fn targets() -> Vec<&'static str> {
    table().map(|e| e.0).collect()
}

/// Per plugin path: what was registered (registration is process-wide and happens once).
static DONE: Mutex<Option<HashMap<PathBuf, Registered>>> = Mutex::new(None);

/// Registers the LAPACK handlers with `plugin` for the platform `"cpu"`, once per process and
/// plugin (later calls return the first result). Only call it for a CPU plugin: the handlers
/// read and write buffers as host memory.
///
/// A handler is registered only when the LAPACK library exports its routine.
///
/// Errors: no LAPACK library could be loaded, or the plugin refused every handler (for example
/// a plugin without the PJRT FFI extension's `register_handler`); the message says which. A
/// refusal of some handlers only is logged and those targets are left out.
pub fn register(plugin: &Plugin) -> Result<Registered, String> {
    let mut done = DONE.lock().unwrap_or_else(|p| p.into_inner());
    let done = done.get_or_insert_with(HashMap::new);
    if let Some(r) = done.get(plugin.path()) {
        return Ok(r.clone());
    }
    let lib = library::get()?;
    let mut targets = Vec::new();
    let mut first_error = None;
    for (target, symbol, handler) in table() {
        if !lib.has(symbol) {
            tracing::debug!(target, symbol, library = %lib.name, "LAPACK routine missing; handler not registered");
            continue;
        }
        match plugin.register_ffi_handler(target, "cpu", *handler) {
            Ok(()) => targets.push(*target),
            Err(e) => {
                tracing::debug!(target, error = %e, "FFI handler refused");
                first_error.get_or_insert(e.to_string());
            }
        }
    }
    if targets.is_empty() {
        return Err(format!(
            "no LAPACK handler could be registered with {}: {}",
            plugin.path().display(),
            first_error.unwrap_or_else(|| format!("{} exports none of the routines", lib.name))
        ));
    }
    let r = Registered {
        targets,
        library: lib.name.clone(),
    };
    done.insert(plugin.path().to_path_buf(), r.clone());
    Ok(r)
}
