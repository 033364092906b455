//! Raw bindings to the PJRT C API (`xla/pjrt/c/pjrt_c_api.h`).
//!
//! The bindings are generated at build time by `bindgen` from the header that ships with an
//! installed PJRT plugin (see `build.rs` for the lookup order; `bash scripts/dev.sh setup`
//! installs one). The header must declare API version 0.81 or newer. Only `PJRT_*` items are
//! generated:
//!
//! * every argument struct (`PJRT_*_Args`) with `Default` (all-zero) so callers can fill the
//!   fields they need and set `struct_size` from the matching `PJRT_*_STRUCT_SIZE` constant;
//! * C enums as plain integer type aliases plus one `const` per enumerator, named exactly as in
//!   the header (e.g. `PJRT_Buffer_Type_F32: PJRT_Buffer_Type`), so values coming back from a
//!   plugin can never be an invalid Rust enum;
//! * the `PJRT_Api` function table, whose entries are `Option<unsafe extern "C" fn ..>`.
//!
//! There is no linking: a plugin is a shared library that exports `GetPjrtApi`, loaded at run
//! time by the safe `tpubox-pjrt` crate. [`PJRT_API_MAJOR`] / [`PJRT_API_MINOR`] are the version
//! of the header these bindings were generated from; [`HEADER_PATH`] is where it was found.

#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    clippy::all,
    rustdoc::all,
    missing_docs
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// Path of the `pjrt_c_api.h` the bindings were generated from (at build time).
pub const HEADER_PATH: &str = env!("PJRT_SYS_HEADER_PATH");

/// Signature of the `GetPjrtApi` symbol every PJRT plugin exports.
pub type GetPjrtApiFn = unsafe extern "C" fn() -> *const PJRT_Api;

/// A C API struct that starts with `size_t struct_size` and has a `*_STRUCT_SIZE` constant.
///
/// Implemented (by `build.rs`) for every such struct in the header: all `PJRT_*_Args`,
/// `PJRT_NamedValue`, `PJRT_Program`, `PJRT_ExecuteOptions`, `PJRT_Api`, ...
pub trait Args: Sized {
    /// `PJRT_STRUCT_SIZE(S, last_field)` from the header: offset of the last field plus its size.
    /// This is what the `struct_size` field must hold so the plugin knows which fields exist.
    const STRUCT_SIZE: usize;
    /// An all-zero value (null pointers, zero sizes) with `struct_size` set to
    /// [`Args::STRUCT_SIZE`] and `extension_start` null.
    fn new() -> Self;
}
