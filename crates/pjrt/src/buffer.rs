//! [`Buffer`]: an array on a device (`PJRT_Buffer`).

use pjrt_sys as sys;
use sys::Args;

use crate::api::{api_fn, slice_from};
use crate::client::Client;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::host_bytes::HostBytes;
use crate::types::PrimitiveType;

/// Host memory aliased by a zero-copy buffer, released after the buffer is destroyed and the
/// plugin has signalled `done_with_host_buffer`.
pub(crate) struct HostHold {
    pub(crate) bytes: HostBytes,
    pub(crate) done: Option<Event>,
}

/// A dense array on a device. Destroyed (`PJRT_Buffer_Destroy`) when dropped; keeps its
/// [`Client`] alive.
///
/// A buffer donated to an execution is marked deleted by PJRT: later reads return an error.
pub struct Buffer {
    client: Client,
    raw: *mut sys::PJRT_Buffer,
    host: Option<HostHold>,
}

// SAFETY: a PJRT_Buffer (xla::PjRtBuffer) is internally synchronized: the plugin's own threads
// use it concurrently with the caller (transfers, executions). This type exposes no mutation
// through `&self` and destroys it exactly once, in `Drop`. The aliased `HostBytes` is never
// accessed through the buffer.
unsafe impl Send for Buffer {}
// SAFETY: as above; `&self` methods only issue C API queries and asynchronous copies.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Wraps an owned, non-null `PJRT_Buffer*`.
    pub(crate) fn from_raw(
        client: Client,
        raw: *mut sys::PJRT_Buffer,
        host: Option<HostHold>,
    ) -> Self {
        Buffer { client, raw, host }
    }

    pub(crate) fn raw(&self) -> *mut sys::PJRT_Buffer {
        self.raw
    }

    /// The client that owns this buffer.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Element type (`PJRT_Buffer_ElementType`).
    ///
    /// Errors: `Unimplemented` for a type outside [`PrimitiveType`] (e.g. F8); the plugin's
    /// error otherwise.
    pub fn element_type(&self) -> Result<PrimitiveType> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_ElementType)?;
        let mut args = sys::PJRT_Buffer_ElementType_Args::new();
        args.buffer = self.raw;
        // SAFETY: live buffer owned by `self`; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        PrimitiveType::from_pjrt(args.type_).ok_or_else(|| {
            Error::unimplemented(format!("unsupported PJRT_Buffer_Type {}", args.type_))
        })
    }

    /// Dimensions, outermost first (`PJRT_Buffer_Dimensions`); empty for a scalar.
    pub fn dims(&self) -> Result<Vec<i64>> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_Dimensions)?;
        let mut args = sys::PJRT_Buffer_Dimensions_Args::new();
        args.buffer = self.raw;
        // SAFETY: live buffer; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: `dims` has the lifetime of the buffer and length `num_dims` (header).
        Ok(unsafe { slice_from(args.dims, args.num_dims) }.to_vec())
    }

    /// The device holding the buffer (`PJRT_Buffer_Device`).
    pub fn device(&self) -> Result<Device> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_Device)?;
        let mut args = sys::PJRT_Buffer_Device_Args::new();
        args.buffer = self.raw;
        // SAFETY: live buffer; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        self.client.device_from_raw(args.device)
    }

    /// Bytes the buffer occupies on the device (`PJRT_Buffer_OnDeviceSizeInBytes`); may exceed
    /// the dense host size because of padding or tiling.
    pub fn on_device_size_bytes(&self) -> Result<usize> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_OnDeviceSizeInBytes)?;
        let mut args = sys::PJRT_Buffer_OnDeviceSizeInBytes_Args::new();
        args.buffer = self.raw;
        // SAFETY: live buffer; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        Ok(args.on_device_size_in_bytes)
    }

    /// True if the buffer was deleted or donated (`PJRT_Buffer_IsDeleted`).
    pub fn is_deleted(&self) -> Result<bool> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_IsDeleted)?;
        let mut args = sys::PJRT_Buffer_IsDeleted_Args::new();
        args.buffer = self.raw;
        // SAFETY: live buffer handle (a deleted buffer's handle stays valid until Destroy).
        api.check(unsafe { f(&mut args) })?;
        Ok(args.is_deleted)
    }

    /// Host bytes needed for a dense copy (`PJRT_Buffer_ToHostBuffer` with null `dst`).
    fn host_size(&self) -> Result<usize> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_ToHostBuffer)?;
        let mut args = sys::PJRT_Buffer_ToHostBuffer_Args::new();
        args.src = self.raw;
        // SAFETY: live buffer; null `dst` only queries the size into `dst_size`.
        api.check(unsafe { f(&mut args) })?;
        if !args.event.is_null() {
            drop(Event::from_raw(self.client.clone(), args.event));
        }
        Ok(args.dst_size)
    }

    /// Starts copying the buffer into `dst` (dense, row-major: null host layout).
    ///
    /// # Safety
    /// `dst` must point to `len` writable bytes that stay valid, and are not accessed, until
    /// the returned event is ready.
    unsafe fn start_to_host(&self, dst: *mut u8, len: usize) -> Result<Event> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_ToHostBuffer)?;
        let mut args = sys::PJRT_Buffer_ToHostBuffer_Args::new();
        args.src = self.raw;
        args.dst = dst.cast();
        args.dst_size = len;
        // SAFETY: live buffer; `dst` validity is the caller's contract; null host_layout means
        // the buffer's own (dense, major-to-minor) layout.
        api.check(unsafe { f(&mut args) })?;
        if args.event.is_null() {
            return Err(Error::internal(
                "PJRT_Buffer_ToHostBuffer returned no event",
            ));
        }
        Ok(Event::from_raw(self.client.clone(), args.event))
    }

    /// Copies the buffer to host memory and blocks until done: dense row-major little-endian
    /// bytes, `element_type().byte_size() × product(dims())` long.
    ///
    /// Errors: the plugin's error (e.g. the buffer was donated/deleted).
    pub fn to_host_blocking(&self) -> Result<Vec<u8>> {
        let len = self.host_size()?;
        let mut dst = vec![0u8; len];
        // SAFETY: `dst` is neither accessed nor freed until the event is ready: on every path
        // below it is either returned after `await_ready` returned Some, or leaked.
        let event = unsafe { self.start_to_host(dst.as_mut_ptr(), len) }?;
        match event.await_ready() {
            Some(r) => r.map(|()| dst),
            None => {
                std::mem::forget(dst);
                Err(Error::unimplemented(
                    "cannot wait for the transfer: PJRT_Event_Await missing",
                ))
            }
        }
    }

    /// Like [`Buffer::to_host_blocking`] but awaits the transfer without blocking the thread
    /// (`PJRT_Event_OnReady` + oneshot channel). Cancel-safe: the destination memory is owned
    /// by the completion callback, so dropping this future mid-transfer is sound.
    ///
    /// Errors: as [`Buffer::to_host_blocking`].
    pub async fn to_host(&self) -> Result<Vec<u8>> {
        let len = self.host_size()?;
        let mut dst = vec![0u8; len];
        // SAFETY: `dst` moves into the `on_ready` closure right below; `Event::on_ready` either
        // calls that closure after the event is ready or leaks it, so the memory stays valid
        // and untouched for the whole transfer. Moving a Vec does not move its heap buffer.
        let event = unsafe { self.start_to_host(dst.as_mut_ptr(), len) }?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        event.on_ready(move |r| {
            let _ = tx.send(r.map(|()| dst));
        });
        rx.await
            .map_err(|_| Error::internal("PJRT event callback was dropped"))?
    }

    /// Copies the buffer to another device of the same client (`PJRT_Buffer_CopyToDevice`).
    /// The copy may still be in flight; [`Buffer::ready_event`] tells when it is complete.
    ///
    /// Errors: `InvalidArgument` if `device` belongs to another client; the plugin's error.
    pub fn copy_to_device(&self, device: &Device) -> Result<Buffer> {
        if !device.client().same_as(&self.client) {
            return Err(Error::invalid_argument(
                "device belongs to a different client",
            ));
        }
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_CopyToDevice)?;
        let mut args = sys::PJRT_Buffer_CopyToDevice_Args::new();
        args.buffer = self.raw;
        args.dst_device = device.raw();
        // SAFETY: live buffer and device of the same client; header-sized args.
        api.check(unsafe { f(&mut args) })?;
        if args.dst_buffer.is_null() {
            return Err(Error::internal(
                "PJRT_Buffer_CopyToDevice returned no buffer",
            ));
        }
        Ok(Buffer::from_raw(self.client.clone(), args.dst_buffer, None))
    }

    /// Event that becomes ready when the buffer's data is available (`PJRT_Buffer_ReadyEvent`).
    pub fn ready_event(&self) -> Result<Event> {
        let api = self.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_ReadyEvent)?;
        let mut args = sys::PJRT_Buffer_ReadyEvent_Args::new();
        args.buffer = self.raw;
        // SAFETY: live buffer; header-sized args; we own the returned event.
        api.check(unsafe { f(&mut args) })?;
        if args.event.is_null() {
            return Err(Error::internal("PJRT_Buffer_ReadyEvent returned no event"));
        }
        Ok(Event::from_raw(self.client.clone(), args.event))
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let api = self.client.plugin().api();
        let destroyed = match api_fn!(api, PJRT_Buffer_Destroy) {
            Ok(f) => {
                let mut args = sys::PJRT_Buffer_Destroy_Args::new();
                args.buffer = self.raw;
                // SAFETY: `self.raw` is owned by this value and destroyed exactly once, here.
                match api.check(unsafe { f(&mut args) }) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!("PJRT_Buffer_Destroy: {e}");
                        false
                    }
                }
            }
            Err(e) => {
                tracing::warn!("{e}");
                false
            }
        };
        if let Some(hold) = self.host.take() {
            match (destroyed, hold.done) {
                // The plugin says when it no longer uses the aliased memory.
                (true, Some(done)) => {
                    let bytes = hold.bytes;
                    done.on_ready(move |_| drop(bytes));
                }
                // No event to tell: the memory may be freed once the buffer is destroyed.
                (true, None) => drop(hold.bytes),
                // The buffer may still alias the memory: leak it rather than free it.
                (false, done) => {
                    std::mem::forget(hold.bytes);
                    drop(done);
                }
            }
        }
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("raw", &self.raw)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{NamedValue, Plugin};

    /// Device address of the buffer (`PJRT_Buffer_UnsafePointer`), to observe aliasing.
    fn unsafe_pointer(b: &Buffer) -> Result<usize> {
        let api = b.client.plugin().api();
        let f = api_fn!(api, PJRT_Buffer_UnsafePointer)?;
        let mut args = sys::PJRT_Buffer_UnsafePointer_Args::new();
        args.buffer = b.raw;
        // SAFETY: live buffer; header-sized args; only reads the address.
        api.check(unsafe { f(&mut args) })?;
        Ok(args.buffer_pointer)
    }

    #[test]
    fn host_bytes_upload_is_zero_copy() {
        let path = std::env::var_os("TPUBOX_PJRT_PLUGIN").map(std::path::PathBuf::from).unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(
                ".cache/tpubox/plugins/lammps-jax-pjrt-cpu-0.11.2/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so",
            )
        });
        let plugin = Plugin::load(&path).unwrap();
        let c = Client::new(&plugin, &[("cpu_device_count", NamedValue::Int64(1))]).unwrap();
        let d = c.devices().unwrap().remove(0);
        let hb = HostBytes::from_slice(&[7u8; 4096]);
        let host_ptr = hb.as_slice().as_ptr() as usize;
        let b = c
            .buffer_from_host_bytes(hb, PrimitiveType::U8, &[4096], &d)
            .unwrap();
        assert_eq!(unsafe_pointer(&b).unwrap(), host_ptr, "upload was copied");
        let copied = c
            .buffer_from_host(&[7u8; 4096], PrimitiveType::U8, &[4096], &d)
            .unwrap();
        assert_ne!(unsafe_pointer(&copied).unwrap(), host_ptr);
        assert_eq!(b.to_host_blocking().unwrap(), vec![7u8; 4096]);
    }
}
