//! XLA FFI custom-call handlers: registering one with a plugin ([`Plugin::register_ffi_handler`],
//! through the PJRT FFI extension) and reading the call frame XLA passes it ([`CallFrame`],
//! through the XLA FFI C API, `xla/ffi/api/c_api.h`).
//!
//! A handler is an `extern "C" fn(*mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error` ([`HandlerFn`]).
//! Its body should be one call to [`handle`], which answers XLA's metadata query, skips the
//! stages other than execute, turns a Rust error or panic into an `XLA_FFI_Error`, and gives the
//! body a [`CallFrame`] with bounds-checked access to arguments, results and attributes.

use std::ffi::CString;
use std::mem::{offset_of, size_of};
use std::panic::{AssertUnwindSafe, catch_unwind};

use pjrt_sys as sys;
use sys::xla_ffi as xf;

use crate::error::{Error, ErrorCode, Result};
use crate::plugin::Plugin;

/// Signature of a typed XLA FFI handler (`XLA_FFI_Handler` in `c_api.h`).
pub type HandlerFn = unsafe extern "C" fn(*mut xf::XLA_FFI_CallFrame) -> *mut xf::XLA_FFI_Error;

/// Element type of an FFI buffer (`XLA_FFI_DataType`; the values are XLA's primitive types).
pub type DataType = xf::XLA_FFI_DataType;

impl Plugin {
    /// Registers `handler` for custom calls whose target is `target` on `platform` (`"cpu"`,
    /// `"cuda"`, ...), through the plugin's FFI extension (`PJRT_FFI_Register_Handler`). The
    /// registry is process-wide: every client of the plugin, and every later compile, sees it.
    ///
    /// Errors: `Unimplemented` if the plugin has no FFI extension or one older than extension
    /// version 2 (no `register_handler`); the plugin's error otherwise (XLA refuses a second,
    /// different handler for the same target).
    pub fn register_ffi_handler(
        &self,
        target: &str,
        platform: &str,
        handler: HandlerFn,
    ) -> Result<()> {
        let api = self.api();
        let missing = |why: &str| {
            Error::unimplemented(format!("cannot register FFI handler {target}: {why}"))
        };
        // SAFETY: `api.raw()` is the plugin's `PJRT_Api`, valid for the process; the field
        // `extension_start` is in every table version this crate accepts (0.81+).
        let mut ext = unsafe { (*api.raw()).extension_start };
        while !ext.is_null() {
            // SAFETY: every entry of the extension chain starts with `PJRT_Extension_Base`
            // (`pjrt_c_api.h`) and lives as long as the plugin.
            let base = unsafe { &*ext };
            if base.type_ == sys::PJRT_Extension_Type_FFI {
                break;
            }
            ext = base.next;
        }
        if ext.is_null() {
            return Err(missing("the plugin has no PJRT FFI extension"));
        }
        let needed = offset_of!(sys::PJRT_FFI_Extension, register_handler)
            + size_of::<Option<sys::PJRT_FFI_Register_Handler>>();
        // SAFETY: as above, `ext` points to a live `PJRT_Extension_Base`.
        if unsafe { (*ext).struct_size } < needed {
            return Err(missing(
                "the plugin's FFI extension predates handler registration (extension version 2)",
            ));
        }
        // SAFETY: an extension of type FFI is a `PJRT_FFI_Extension`, and its `struct_size`
        // (checked above) covers `register_handler`.
        let register = unsafe { (*ext.cast::<sys::PJRT_FFI_Extension>()).register_handler }
            .ok_or_else(|| missing("the plugin's FFI extension has no register_handler"))?;
        let mut args = sys::PJRT_FFI_Register_Handler_Args {
            struct_size: sys::PJRT_FFI_Register_Handler_Args_STRUCT_SIZE,
            target_name: target.as_ptr().cast(),
            target_name_size: target.len(),
            handler: handler as *mut std::ffi::c_void,
            platform_name: platform.as_ptr().cast(),
            platform_name_size: platform.len(),
            traits: 0,
        };
        // SAFETY: `args` is laid out as the extension header declares; the strings are passed
        // with their lengths and outlive the call (XLA copies them); `handler` is a function
        // that lives for the whole process.
        let err = unsafe { register(&mut args) };
        api.check(err)
    }
}

/// An error a handler returns to XLA: a code and a message (XLA reports the message as the
/// execution's error).
#[derive(Debug, Clone)]
pub struct FfiError {
    /// Status code.
    pub code: ErrorCode,
    /// Human-readable reason.
    pub message: String,
}

impl FfiError {
    /// `INVALID_ARGUMENT` with `message`.
    pub fn invalid(message: impl Into<String>) -> Self {
        FfiError {
            code: ErrorCode::InvalidArgument,
            message: message.into(),
        }
    }
    /// An error with `code` and `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        FfiError {
            code,
            message: message.into(),
        }
    }
}

fn errc(code: ErrorCode) -> xf::XLA_FFI_Error_Code {
    match code {
        ErrorCode::Cancelled => xf::XLA_FFI_Error_Code_CANCELLED,
        ErrorCode::InvalidArgument => xf::XLA_FFI_Error_Code_INVALID_ARGUMENT,
        ErrorCode::DeadlineExceeded => xf::XLA_FFI_Error_Code_DEADLINE_EXCEEDED,
        ErrorCode::NotFound => xf::XLA_FFI_Error_Code_NOT_FOUND,
        ErrorCode::PermissionDenied => xf::XLA_FFI_Error_Code_PERMISSION_DENIED,
        ErrorCode::ResourceExhausted => xf::XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
        ErrorCode::FailedPrecondition => xf::XLA_FFI_Error_Code_FAILED_PRECONDITION,
        ErrorCode::Unimplemented => xf::XLA_FFI_Error_Code_UNIMPLEMENTED,
        ErrorCode::Internal => xf::XLA_FFI_Error_Code_INTERNAL,
        _ => xf::XLA_FFI_Error_Code_UNKNOWN,
    }
}

/// One buffer of a call frame: element type, dimensions (major to minor, as XLA's shape lists
/// them; the physical layout is what the custom call's `operand_layouts`/`result_layouts`
/// asked for) and data pointer.
#[derive(Debug, Clone, Copy)]
pub struct FfiBuffer<'a> {
    /// Element type.
    pub dtype: DataType,
    /// Dimensions.
    pub dims: &'a [i64],
    /// Start of the data (device memory; host memory on CPU plugins).
    pub data: *mut std::ffi::c_void,
}

impl FfiBuffer<'_> {
    /// Number of elements (product of the dimensions); `None` on overflow or a negative
    /// dimension.
    pub fn elements(&self) -> Option<usize> {
        self.dims.iter().try_fold(1usize, |acc, &d| {
            usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        })
    }
}

/// The call frame of one custom-call execution, with checked access to its parts.
pub struct CallFrame<'a> {
    raw: &'a xf::XLA_FFI_CallFrame,
}

impl<'a> CallFrame<'a> {
    /// Number of arguments (operands).
    pub fn num_args(&self) -> usize {
        usize::try_from(self.raw.args.size).unwrap_or(0)
    }

    /// Number of results.
    pub fn num_rets(&self) -> usize {
        usize::try_from(self.raw.rets.size).unwrap_or(0)
    }

    /// Argument `i`. Errors: `i` out of range, or not a buffer.
    pub fn arg(&self, i: usize) -> std::result::Result<FfiBuffer<'a>, FfiError> {
        let a = &self.raw.args;
        if i >= self.num_args() {
            return Err(FfiError::invalid(format!(
                "custom call has {} operands, operand {i} was asked for",
                self.num_args()
            )));
        }
        // SAFETY: `types` and `args` have `size` entries (c_api.h), `i < size`.
        let (ty, ptr) = unsafe { (*a.types.add(i), *a.args.add(i)) };
        if ty != xf::XLA_FFI_ArgType_BUFFER {
            return Err(FfiError::invalid(format!("operand {i} is not a buffer")));
        }
        // SAFETY: an argument of type BUFFER points to an `XLA_FFI_Buffer` valid for the call.
        Ok(unsafe { buffer(ptr.cast()) })
    }

    /// Result `i`. Errors: `i` out of range, or not a buffer.
    pub fn ret(&self, i: usize) -> std::result::Result<FfiBuffer<'a>, FfiError> {
        let r = &self.raw.rets;
        if i >= self.num_rets() {
            return Err(FfiError::invalid(format!(
                "custom call has {} results, result {i} was asked for",
                self.num_rets()
            )));
        }
        // SAFETY: `types` and `rets` have `size` entries (c_api.h), `i < size`.
        let (ty, ptr) = unsafe { (*r.types.add(i), *r.rets.add(i)) };
        if ty != xf::XLA_FFI_RetType_BUFFER {
            return Err(FfiError::invalid(format!("result {i} is not a buffer")));
        }
        // SAFETY: a result of type BUFFER points to an `XLA_FFI_Buffer` valid for the call.
        Ok(unsafe { buffer(ptr.cast()) })
    }

    /// The scalar attribute `name` as raw little-endian bytes with its element type, if the
    /// call has it.
    fn scalar(&self, name: &str) -> Option<(DataType, *const std::ffi::c_void)> {
        let at = &self.raw.attrs;
        let n = usize::try_from(at.size).unwrap_or(0);
        (0..n).find_map(|i| {
            // SAFETY: `types`, `names` and `attrs` have `size` entries (c_api.h); each name is
            // a byte span valid for the call.
            let (ty, span, attr) =
                unsafe { (*at.types.add(i), &**at.names.add(i), *at.attrs.add(i)) };
            // SAFETY: a byte span's `ptr` has `len` readable bytes.
            let bytes = unsafe { std::slice::from_raw_parts(span.ptr.cast::<u8>(), span.len) };
            if bytes != name.as_bytes() || ty != xf::XLA_FFI_AttrType_SCALAR {
                return None;
            }
            // SAFETY: a SCALAR attribute points to an `XLA_FFI_Scalar`.
            let s = unsafe { &*attr.cast::<xf::XLA_FFI_Scalar>() };
            Some((s.dtype, s.value.cast_const()))
        })
    }

    /// The `ui8` attribute `name` (JAX passes LAPACK's character options, e.g. `uplo = 76`,
    /// as `ui8`). Errors: missing, or of another type.
    pub fn attr_u8(&self, name: &str) -> std::result::Result<u8, FfiError> {
        match self.scalar(name) {
            // SAFETY: a U8 scalar's value points to one byte.
            Some((xf::XLA_FFI_DataType_U8, v)) => Ok(unsafe { *v.cast::<u8>() }),
            Some(_) => Err(FfiError::invalid(format!("attribute {name} is not a ui8"))),
            None => Err(FfiError::invalid(format!("attribute {name} is missing"))),
        }
    }

    /// The `i32` attribute `name`. Errors: missing, or of another type.
    pub fn attr_i32(&self, name: &str) -> std::result::Result<i32, FfiError> {
        match self.scalar(name) {
            // SAFETY: an S32 scalar's value points to a 4-byte integer (XLA aligns it).
            Some((xf::XLA_FFI_DataType_S32, v)) => Ok(unsafe { v.cast::<i32>().read_unaligned() }),
            Some(_) => Err(FfiError::invalid(format!("attribute {name} is not an i32"))),
            None => Err(FfiError::invalid(format!("attribute {name} is missing"))),
        }
    }
}

impl CallFrame<'_> {
    /// The `i64` attribute `name`. Errors: missing, or of another type.
    pub fn attr_i64(&self, name: &str) -> std::result::Result<i64, FfiError> {
        match self.scalar(name) {
            // SAFETY: an S64 scalar's value points to an 8-byte integer.
            Some((xf::XLA_FFI_DataType_S64, v)) => Ok(unsafe { v.cast::<i64>().read_unaligned() }),
            Some(_) => Err(FfiError::invalid(format!("attribute {name} is not an i64"))),
            None => Err(FfiError::invalid(format!("attribute {name} is missing"))),
        }
    }

    /// The identifier of the logical execution this call belongs to (`XLA_FFI_RunId_Get`,
    /// `xla::RunId` of the execution's run options): equal for every custom call of one
    /// execution, including calls inside loops and called computations.
    ///
    /// Errors: `Unimplemented` if XLA's FFI function table predates `XLA_FFI_RunId_Get`;
    /// XLA's error otherwise.
    pub fn run_id(&self) -> std::result::Result<i64, FfiError> {
        let missing = || FfiError::new(ErrorCode::Unimplemented, "XLA_FFI_RunId_Get is missing");
        // SAFETY: `api` is XLA's FFI function table, valid during the call.
        let api = unsafe { self.raw.api.as_ref() }.ok_or_else(missing)?;
        let needed =
            offset_of!(xf::XLA_FFI_Api, XLA_FFI_RunId_Get) + size_of::<xf::XLA_FFI_RunId_Get>();
        if api.struct_size < needed {
            return Err(missing());
        }
        let get = api.XLA_FFI_RunId_Get.ok_or_else(missing)?;
        let mut args = xf::XLA_FFI_RunId_Get_Args {
            struct_size: xf::XLA_FFI_RunId_Get_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            ctx: self.raw.ctx,
            run_id: 0,
        };
        // SAFETY: the table is large enough to hold the function (checked above), `ctx` is the
        // frame's execution context, live for the call, and `args` is a valid argument struct.
        let err = unsafe { get(&mut args) };
        if !err.is_null() {
            // SAFETY: a non-null error is XLA's, ours to destroy; `api` is live for the call.
            if let Some(destroy) = api.XLA_FFI_Error_Destroy {
                let mut d = xf::XLA_FFI_Error_Destroy_Args {
                    struct_size: xf::XLA_FFI_Error_Destroy_Args_STRUCT_SIZE as usize,
                    extension_start: std::ptr::null_mut(),
                    error: err,
                };
                // SAFETY: as above.
                unsafe { destroy(&mut d) };
            }
            return Err(FfiError::new(
                ErrorCode::Internal,
                "XLA_FFI_RunId_Get failed",
            ));
        }
        Ok(args.run_id)
    }
}

/// # Safety
/// `ptr` must point to an `XLA_FFI_Buffer` valid for `'a`.
unsafe fn buffer<'a>(ptr: *const xf::XLA_FFI_Buffer) -> FfiBuffer<'a> {
    // SAFETY: the caller guarantees `ptr` is a valid buffer for `'a`.
    let b = unsafe { &*ptr };
    let rank = usize::try_from(b.rank).unwrap_or(0);
    let dims = if rank == 0 || b.dims.is_null() {
        &[][..]
    } else {
        // SAFETY: `dims` has `rank` entries (c_api.h: "length == rank").
        unsafe { std::slice::from_raw_parts(b.dims, rank) }
    };
    FfiBuffer {
        dtype: b.dtype,
        dims,
        data: b.data,
    }
}

/// Runs a handler's `body` on the call frame XLA passed, with the protocol around it:
/// - a metadata query (an `XLA_FFI_Extension_Metadata` in the frame's extension chain) is
///   answered with this crate's FFI API version and no traits, without running `body`;
/// - stages other than execute return success without running `body`;
/// - an `Err` from `body`, or a panic in it, becomes an `XLA_FFI_Error` (a panic as
///   `INTERNAL`), so nothing unwinds into XLA.
///
/// # Safety
/// `frame` must be the pointer XLA passed to the handler, valid for the duration of the call.
pub unsafe fn handle(
    frame: *mut xf::XLA_FFI_CallFrame,
    body: impl FnOnce(&CallFrame<'_>) -> std::result::Result<(), FfiError>,
) -> *mut xf::XLA_FFI_Error {
    if frame.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the caller passes XLA's live call frame.
    let raw = unsafe { &*frame };
    let mut ext = raw.extension_start;
    while !ext.is_null() {
        // SAFETY: extension chain entries start with `XLA_FFI_Extension_Base`.
        let base = unsafe { &*ext };
        if base.type_ == xf::XLA_FFI_Extension_Metadata {
            // SAFETY: an extension of type Metadata is an `XLA_FFI_Metadata_Extension` whose
            // `metadata` XLA owns and lets the handler fill in.
            let md = unsafe { (*ext.cast::<xf::XLA_FFI_Metadata_Extension>()).metadata };
            if !md.is_null() {
                // SAFETY: as above; only the fields up to `traits` are written, and XLA sized
                // the struct with at least those fields.
                unsafe {
                    (*md).api_version = xf::XLA_FFI_Api_Version {
                        struct_size: xf::XLA_FFI_Api_Version_STRUCT_SIZE as usize,
                        extension_start: std::ptr::null_mut(),
                        major_version: xf::XLA_FFI_API_MAJOR as i32,
                        minor_version: xf::XLA_FFI_API_MINOR as i32,
                    };
                    (*md).traits = 0;
                }
            }
            return std::ptr::null_mut();
        }
        ext = base.next;
    }
    if raw.stage != xf::XLA_FFI_ExecutionStage_EXECUTE {
        return std::ptr::null_mut();
    }
    let needed = offset_of!(xf::XLA_FFI_CallFrame, attrs) + size_of::<xf::XLA_FFI_Attrs>();
    let result = if raw.struct_size < needed {
        Err(FfiError::new(
            ErrorCode::FailedPrecondition,
            "XLA's FFI call frame is older than this handler's",
        ))
    } else {
        let call = CallFrame { raw };
        catch_unwind(AssertUnwindSafe(|| body(&call))).unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(FfiError::new(
                ErrorCode::Internal,
                format!("custom-call handler panicked: {what}"),
            ))
        })
    };
    match result {
        Ok(()) => std::ptr::null_mut(),
        Err(e) => {
            // SAFETY: `api` is XLA's FFI function table, valid during the call.
            let create = unsafe { raw.api.as_ref() }.and_then(|api| api.XLA_FFI_Error_Create);
            let Some(create) = create else {
                return std::ptr::null_mut();
            };
            let message = CString::new(e.message.replace('\0', " ")).unwrap_or_default();
            let mut args = xf::XLA_FFI_Error_Create_Args {
                struct_size: xf::XLA_FFI_Error_Create_Args_STRUCT_SIZE as usize,
                extension_start: std::ptr::null_mut(),
                message: message.as_ptr(),
                errc: errc(e.code),
            };
            // SAFETY: `args` is a valid argument struct; XLA copies the message.
            unsafe { create(&mut args) }
        }
    }
}
