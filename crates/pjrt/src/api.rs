//! Access to a plugin's `PJRT_Api` function table, with bounds checks against its
//! `struct_size`, and conversion of returned `PJRT_Error*` into [`Error`].

use std::mem::{offset_of, size_of};

use pjrt_sys as sys;
use sys::Args;

use crate::error::{Error, ErrorCode, Result};

/// Copyable handle to a plugin's function table.
///
/// The table lives in the plugin's memory; plugins are never unloaded, so the pointer is valid
/// for the rest of the process. Only the first `struct_size` bytes (as reported by the plugin)
/// are read: a plugin built against an older header has a shorter table.
#[derive(Clone, Copy)]
pub(crate) struct Api {
    raw: *const sys::PJRT_Api,
    struct_size: usize,
}

// SAFETY: `Api` is a pointer to an immutable function table that stays mapped for the whole
// process (plugins are never unloaded); reading it from any thread is fine.
unsafe impl Send for Api {}
// SAFETY: as above, shared reads of immutable data only.
unsafe impl Sync for Api {}

/// Looks up a function pointer in the plugin's table; `Err(Unimplemented)` if the entry lies
/// beyond the plugin's `struct_size` (older plugin) or is null.
macro_rules! api_fn {
    ($api:expr, $name:ident) => {{
        let api: $crate::api::Api = $api;
        let offset = ::std::mem::offset_of!(::pjrt_sys::PJRT_Api, $name);
        if !api.has_field(offset, ::std::mem::size_of::<::pjrt_sys::$name>()) {
            Err($crate::error::Error::unimplemented(concat!(
                stringify!($name),
                " is not in this plugin's PJRT_Api table (plugin API version too old)"
            )))
        } else {
            // SAFETY: `offset + size` lies within the first `struct_size` bytes of the plugin's
            // PJRT_Api (checked just above), which stay valid and immutable for the process
            // lifetime; no reference to the (possibly shorter) struct is created.
            let f = unsafe { ::std::ptr::addr_of!((*api.raw()).$name).read() };
            f.ok_or_else(|| {
                $crate::error::Error::unimplemented(concat!(
                    stringify!($name),
                    " is not implemented by this plugin (null entry)"
                ))
            })
        }
    }};
}
pub(crate) use api_fn;

impl Api {
    /// Wraps the table returned by `GetPjrtApi`.
    ///
    /// # Safety
    /// `raw` must be non-null and point to a `PJRT_Api` that stays valid for the process
    /// lifetime and whose `struct_size` field is correct.
    pub(crate) unsafe fn from_raw(raw: *const sys::PJRT_Api) -> Result<Api> {
        // SAFETY: the caller guarantees `raw` points to a live PJRT_Api; `struct_size` is its
        // first field in every API version.
        let struct_size = unsafe { std::ptr::addr_of!((*raw).struct_size).read() };
        let api = Api { raw, struct_size };
        let need = offset_of!(sys::PJRT_Api, pjrt_api_version) + size_of::<sys::PJRT_Api_Version>();
        if struct_size < need {
            return Err(Error::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "plugin PJRT_Api.struct_size is {struct_size}, too small to hold a version"
                ),
            ));
        }
        Ok(api)
    }

    pub(crate) fn raw(&self) -> *const sys::PJRT_Api {
        self.raw
    }

    /// Byte size of the plugin's function table.
    pub(crate) fn struct_size(&self) -> usize {
        self.struct_size
    }

    /// True if a field at `offset` of `size` bytes lies within the plugin's table.
    pub(crate) fn has_field(&self, offset: usize, size: usize) -> bool {
        offset
            .checked_add(size)
            .is_some_and(|end| end <= self.struct_size)
    }

    /// `pjrt_api_version` (major, minor) as declared by the plugin.
    pub(crate) fn version(&self) -> (i32, i32) {
        // SAFETY: `from_raw` checked that `pjrt_api_version` lies within `struct_size`.
        let v = unsafe { std::ptr::addr_of!((*self.raw).pjrt_api_version).read() };
        (v.major_version, v.minor_version)
    }

    /// Converts a `PJRT_Error*` returned by a C API call: null is `Ok(())`; otherwise the code
    /// and message are read and the error object is destroyed.
    pub(crate) fn check(&self, err: *mut sys::PJRT_Error) -> Result<()> {
        if err.is_null() {
            Ok(())
        } else {
            Err(self.take_error(err))
        }
    }

    /// Reads and destroys a non-null `PJRT_Error*` owned by the caller.
    fn take_error(&self, err: *mut sys::PJRT_Error) -> Error {
        let mut message = String::from("(plugin gave no message)");
        if let Ok(f) = api_fn!(*self, PJRT_Error_Message) {
            let mut args = sys::PJRT_Error_Message_Args::new();
            args.error = err;
            // SAFETY: `err` is a live error object owned by us; `args` is fully initialized with
            // the header's struct_size.
            unsafe { f(&mut args) };
            // SAFETY: the message has the lifetime of `err`, which is still alive.
            message = unsafe { string_from(args.message, args.message_size) };
        }
        let mut code = ErrorCode::Unknown;
        if let Ok(f) = api_fn!(*self, PJRT_Error_GetCode) {
            let mut args = sys::PJRT_Error_GetCode_Args::new();
            args.error = err;
            // SAFETY: as above; GetCode only writes `args.code`.
            let e2 = unsafe { f(&mut args) };
            if e2.is_null() {
                code = ErrorCode::from_raw(args.code);
            } else {
                self.destroy_error(e2);
            }
        }
        self.destroy_error(err);
        Error::new(code, message)
    }

    fn destroy_error(&self, err: *mut sys::PJRT_Error) {
        if let Ok(f) = api_fn!(*self, PJRT_Error_Destroy) {
            let mut args = sys::PJRT_Error_Destroy_Args::new();
            args.error = err;
            // SAFETY: `err` is owned by us and destroyed exactly once, here.
            unsafe { f(&mut args) };
        }
    }
}

/// Copies a (pointer, length) string owned by the plugin into a `String` (lossy UTF-8).
///
/// # Safety
/// If `ptr` is non-null it must point to `len` readable bytes.
pub(crate) unsafe fn string_from(ptr: *const std::os::raw::c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    // SAFETY: the caller guarantees `len` readable bytes at `ptr`.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// Builds a slice from a plugin-owned (pointer, length) array; empty when null.
///
/// # Safety
/// If `ptr` is non-null it must point to `len` initialized `T`s that stay valid for `'a`.
pub(crate) unsafe fn slice_from<'a, T>(ptr: *const T, len: usize) -> &'a [T] {
    if ptr.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}
