//! `PJRT_NamedValue`: typed key/value pairs used for client create options and attributes.

use pjrt_sys as sys;
use sys::Args;

use crate::api::{slice_from, string_from};

/// A value of a PJRT named key/value pair (`PJRT_NamedValue` in the C API header): plugin
/// attributes and client create options such as `("cpu_device_count", Int64(4))`.
#[derive(Debug, Clone, PartialEq)]
pub enum NamedValue {
    /// `PJRT_NamedValue_kString`.
    String(String),
    /// `PJRT_NamedValue_kInt64`.
    Int64(i64),
    /// `PJRT_NamedValue_kInt64List`.
    Int64List(Vec<i64>),
    /// `PJRT_NamedValue_kFloat`.
    Float(f32),
    /// `PJRT_NamedValue_kBool`.
    Bool(bool),
}

/// Builds the C array for `options`; the result borrows from `options` (names, strings and
/// lists are referenced, not copied), so it must not outlive them.
pub(crate) fn to_raw(options: &[(&str, NamedValue)]) -> Vec<sys::PJRT_NamedValue> {
    options
        .iter()
        .map(|(name, value)| {
            let mut nv = sys::PJRT_NamedValue::new();
            nv.name = name.as_ptr().cast();
            nv.name_size = name.len();
            match value {
                NamedValue::String(s) => {
                    nv.type_ = sys::PJRT_NamedValue_kString;
                    nv.__bindgen_anon_1.string_value = s.as_ptr().cast();
                    nv.value_size = s.len();
                }
                NamedValue::Int64(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kInt64;
                    nv.__bindgen_anon_1.int64_value = *v;
                    nv.value_size = 1;
                }
                NamedValue::Int64List(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kInt64List;
                    nv.__bindgen_anon_1.int64_array_value = v.as_ptr();
                    nv.value_size = v.len();
                }
                NamedValue::Float(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kFloat;
                    nv.__bindgen_anon_1.float_value = *v;
                    nv.value_size = 1;
                }
                NamedValue::Bool(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kBool;
                    nv.__bindgen_anon_1.bool_value = *v;
                    nv.value_size = 1;
                }
            }
            nv
        })
        .collect()
}

/// Copies a plugin-owned `PJRT_NamedValue`; `None` for an unknown value type.
///
/// # Safety
/// `nv` must be a valid `PJRT_NamedValue` whose pointers are live for the call.
pub(crate) unsafe fn from_raw(nv: &sys::PJRT_NamedValue) -> Option<(String, NamedValue)> {
    // SAFETY: the caller guarantees `name`/`name_size` describe a live string.
    let name = unsafe { string_from(nv.name, nv.name_size) };
    // SAFETY: for all union reads below, `type_` tells which union member the plugin wrote, and
    // the pointers of string/list members are live per the caller's guarantee.
    let value = unsafe {
        match nv.type_ {
            sys::PJRT_NamedValue_kString => {
                NamedValue::String(string_from(nv.__bindgen_anon_1.string_value, nv.value_size))
            }
            sys::PJRT_NamedValue_kInt64 => NamedValue::Int64(nv.__bindgen_anon_1.int64_value),
            sys::PJRT_NamedValue_kInt64List => NamedValue::Int64List(
                slice_from(nv.__bindgen_anon_1.int64_array_value, nv.value_size).to_vec(),
            ),
            sys::PJRT_NamedValue_kFloat => NamedValue::Float(nv.__bindgen_anon_1.float_value),
            sys::PJRT_NamedValue_kBool => {
                // Read as a byte: a C `bool` other than 0/1 would be UB as a Rust `bool`.
                let byte = std::ptr::addr_of!(nv.__bindgen_anon_1).cast::<u8>().read();
                NamedValue::Bool(byte != 0)
            }
            _ => return None,
        }
    };
    Some((name, value))
}
