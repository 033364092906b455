//! [`Device`]: an addressable device of a client (`PJRT_Device` + its `PJRT_DeviceDescription`).

use std::sync::Arc;

use pjrt_sys as sys;
use sys::Args;

use crate::api::{api_fn, string_from};
use crate::client::Client;
use crate::error::Result;

/// A device of a [`Client`]. Cheap to clone; keeps the client alive.
///
/// Id, kind, debug string and local hardware id are read once when the handle is created.
#[derive(Clone)]
pub struct Device {
    client: Client,
    raw: *mut sys::PJRT_Device,
    info: Arc<DeviceInfo>,
}

struct DeviceInfo {
    id: i32,
    kind: String,
    debug_string: String,
    local_hardware_id: i32,
}

// SAFETY: a PJRT_Device is owned by its client (kept alive by `client`) and only queried
// (description, ids) or passed as a target to client calls; its cached info is immutable.
unsafe impl Send for Device {}
// SAFETY: as above: no `&self` method mutates plugin state.
unsafe impl Sync for Device {}

impl Device {
    /// Wraps a device pointer owned by `client`, reading its description.
    pub(crate) fn from_raw(client: &Client, raw: *mut sys::PJRT_Device) -> Result<Device> {
        let api = client.plugin().api();
        let f = api_fn!(api, PJRT_Device_GetDescription)?;
        let mut args = sys::PJRT_Device_GetDescription_Args::new();
        args.device = raw;
        // SAFETY: `raw` is a device of `client`, alive while the client is; `args` has the
        // header's struct_size.
        api.check(unsafe { f(&mut args) })?;
        let desc = args.device_description;

        let f = api_fn!(api, PJRT_DeviceDescription_Id)?;
        let mut a = sys::PJRT_DeviceDescription_Id_Args::new();
        a.device_description = desc;
        // SAFETY: `desc` is owned by the device and valid as long as it is.
        api.check(unsafe { f(&mut a) })?;
        let id = a.id;

        let f = api_fn!(api, PJRT_DeviceDescription_Kind)?;
        let mut a = sys::PJRT_DeviceDescription_Kind_Args::new();
        a.device_description = desc;
        // SAFETY: as above.
        api.check(unsafe { f(&mut a) })?;
        // SAFETY: the kind string is owned by the device, alive during this call.
        let kind = unsafe { string_from(a.device_kind, a.device_kind_size) };

        let f = api_fn!(api, PJRT_DeviceDescription_DebugString)?;
        let mut a = sys::PJRT_DeviceDescription_DebugString_Args::new();
        a.device_description = desc;
        // SAFETY: as above.
        api.check(unsafe { f(&mut a) })?;
        // SAFETY: the string is owned by the description, alive during this call.
        let debug_string = unsafe { string_from(a.debug_string, a.debug_string_size) };

        let local_hardware_id = match api_fn!(api, PJRT_Device_LocalHardwareId) {
            Ok(f) => {
                let mut a = sys::PJRT_Device_LocalHardwareId_Args::new();
                a.device = raw;
                // SAFETY: as above.
                match api.check(unsafe { f(&mut a) }) {
                    Ok(()) => a.local_hardware_id,
                    Err(_) => -1,
                }
            }
            Err(_) => -1,
        };

        Ok(Device {
            client: client.clone(),
            raw,
            info: Arc::new(DeviceInfo {
                id,
                kind,
                debug_string,
                local_hardware_id,
            }),
        })
    }

    pub(crate) fn raw(&self) -> *mut sys::PJRT_Device {
        self.raw
    }

    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// Global device id (`PJRT_DeviceDescription_Id`), unique among the client's devices.
    pub fn id(&self) -> i32 {
        self.info.id
    }

    /// Device kind (`PJRT_DeviceDescription_Kind`), e.g. `"cpu"`.
    pub fn kind(&self) -> String {
        self.info.kind.clone()
    }

    /// Verbose description for logs (`PJRT_DeviceDescription_DebugString`), e.g. `"TFRT_CPU_0"`.
    pub fn debug_string(&self) -> String {
        self.info.debug_string.clone()
    }

    /// Id of the device among the host's devices of its kind
    /// (`PJRT_Device_LocalHardwareId`); -1 if the plugin does not report it.
    pub fn local_hardware_id(&self) -> i32 {
        self.info.local_hardware_id
    }
}

impl PartialEq for Device {
    /// Same underlying `PJRT_Device`.
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}
impl Eq for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("id", &self.info.id)
            .field("kind", &self.info.kind)
            .field("debug_string", &self.info.debug_string)
            .finish()
    }
}
