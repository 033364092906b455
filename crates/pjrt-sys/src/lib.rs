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

/// Raw bindings to the XLA FFI C API (`xla/ffi/api/c_api.h`): the call frame, buffers,
/// attributes, errors and metadata a custom-call handler sees.
///
/// Generated at build time by `bindgen` from the header in the `jaxlib` wheel's `include/`
/// directory (see `build.rs`). Only `XLA_FFI_*` items are generated, enums as integer aliases
/// plus one `const` per enumerator, as for the PJRT bindings.
pub mod xla_ffi {
    include!(concat!(env!("OUT_DIR"), "/xla_ffi.rs"));

    /// Path of the `c_api.h` these bindings were generated from (at build time).
    pub const HEADER_PATH: &str = env!("XLA_FFI_SYS_HEADER_PATH");
}

/// `PJRT_FFI_Register_Handler_Args`, of the PJRT FFI extension.
///
/// The extension's header (`xla/pjrt/c/pjrt_c_api_ffi_extension.h`, extension version 2) ships
/// in no wheel, so its two structs are written here, field for field as that header declares
/// them. `handler` is an `XLA_FFI_Handler*` (a typed FFI handler); `traits` is a bit set
/// (`1` = command-buffer compatible).
#[repr(C)]
#[derive(Debug)]
pub struct PJRT_FFI_Register_Handler_Args {
    pub struct_size: usize,
    pub target_name: *const std::ffi::c_char,
    pub target_name_size: usize,
    pub handler: *mut std::ffi::c_void,
    pub platform_name: *const std::ffi::c_char,
    pub platform_name_size: usize,
    pub traits: u32,
}

/// `PJRT_FFI_Register_Handler_Args`'s `PJRT_STRUCT_SIZE` (offset of `traits` plus its size).
pub const PJRT_FFI_Register_Handler_Args_STRUCT_SIZE: usize =
    std::mem::offset_of!(PJRT_FFI_Register_Handler_Args, traits) + std::mem::size_of::<u32>();

/// `PJRT_FFI_Register_Handler`: registers a typed FFI handler for a custom-call target name on
/// a platform (`"cpu"`, `"cuda"`, ...), process-wide.
pub type PJRT_FFI_Register_Handler =
    unsafe extern "C" fn(args: *mut PJRT_FFI_Register_Handler_Args) -> *mut PJRT_Error;

/// `PJRT_FFI_Extension` (`PJRT_Extension_Type_FFI` in the extension chain). Extension version 1
/// ends after `user_data_add` (`struct_size` 40); version 2 adds `register_handler` (48).
#[repr(C)]
#[derive(Debug)]
pub struct PJRT_FFI_Extension {
    pub base: PJRT_Extension_Base,
    pub type_id_register: *mut std::ffi::c_void,
    pub user_data_add: *mut std::ffi::c_void,
    pub register_handler: Option<PJRT_FFI_Register_Handler>,
}
