//! The LAPACK shared library the handlers call, loaded once per process at run time.
//!
//! Lookup order: `TPUBOX_LAPACK` (a path or a library name), then OpenBLAS
//! (`libopenblas.so.0`, Debian's `libopenblas0`), then the reference LAPACK (`liblapack.so.3`,
//! Debian's `liblapack3`, which brings BLAS as `libblas.so.3`). Symbols are the Fortran names
//! (`sgetrf_`, `strsm_`, ...) with LP64 (32-bit) integers, which is what those packages export.

use std::sync::OnceLock;

/// A loaded LAPACK library (never unloaded).
pub(crate) struct Library {
    lib: &'static libloading::Library,
    /// What was loaded (the name or path that was opened).
    pub(crate) name: String,
}

static LIBRARY: OnceLock<Result<Library, String>> = OnceLock::new();

/// Library names tried when `TPUBOX_LAPACK` is not set, in order.
pub const DEFAULT_LIBRARIES: [&str; 2] = ["libopenblas.so.0", "liblapack.so.3"];

/// The process's LAPACK library, loaded on first use. Errors: no candidate could be loaded
/// (the message lists what was tried).
pub(crate) fn get() -> Result<&'static Library, String> {
    LIBRARY.get_or_init(load).as_ref().map_err(|e| e.clone())
}

fn load() -> Result<Library, String> {
    let candidates: Vec<String> = match std::env::var("TPUBOX_LAPACK") {
        Ok(v) if !v.is_empty() => vec![v],
        _ => DEFAULT_LIBRARIES.iter().map(|s| s.to_string()).collect(),
    };
    let mut tried = Vec::new();
    for name in &candidates {
        // SAFETY: loading a shared library runs its initializers; the candidates are LAPACK
        // implementations (or what the operator named in TPUBOX_LAPACK), whose initializers
        // only set up their own state. The library is leaked: never unloaded while handlers
        // registered with XLA may call into it.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => {
                let lib: &'static libloading::Library = Box::leak(Box::new(lib));
                limit_threads(lib);
                return Ok(Library {
                    lib,
                    name: name.clone(),
                });
            }
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "no LAPACK library could be loaded (set TPUBOX_LAPACK, or install Debian's libopenblas0): {}",
        tried.join("; ")
    ))
}

/// OpenBLAS starts one thread per core for every call; XLA already runs custom calls on its
/// own thread pool, several at once, so OpenBLAS is held to one thread per call.
fn limit_threads(lib: &'static libloading::Library) {
    // SAFETY: `openblas_set_num_threads` is OpenBLAS's `void openblas_set_num_threads(int)`.
    if let Ok(f) = unsafe { lib.get::<unsafe extern "C" fn(i32)>(b"openblas_set_num_threads\0") } {
        // SAFETY: as above; called before any handler runs.
        unsafe { f(1) };
    }
}

impl Library {
    /// Whether the library exports `symbol` (a Fortran name such as `sgetrf_`).
    pub(crate) fn has(&self, symbol: &str) -> bool {
        let mut name = symbol.as_bytes().to_vec();
        name.push(0);
        // SAFETY: only the symbol's presence is checked; nothing is called. The type `*const
        // u8` is what a data address is, whatever the symbol is.
        unsafe { self.lib.get::<*const u8>(&name) }.is_ok()
    }

    /// The function `symbol` as the function-pointer type `F`.
    ///
    /// # Safety
    /// `F` must be the exact C ABI signature of `symbol` in the LAPACK/BLAS reference
    /// interface (Fortran calling convention: every argument by pointer, then one hidden
    /// `size_t` length per character argument).
    pub(crate) unsafe fn func<F: Copy>(&self, symbol: &str) -> Result<F, String> {
        let mut name = symbol.as_bytes().to_vec();
        name.push(0);
        // SAFETY: the caller guarantees `F` is the symbol's signature.
        unsafe { self.lib.get::<F>(&name) }
            .map(|s| *s)
            .map_err(|e| format!("{}: no symbol {symbol}: {e}", self.name))
    }
}
