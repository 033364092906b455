//! What the host runs on: [`platform`] and [`devices`].

use std::fmt;

use crate::bindings::tpubox::device::client as raw_client;
use crate::{DeviceInfo, PlatformInfo};

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} (id {}, {})", self.index, self.id, self.kind)
    }
}

impl fmt::Display for PlatformInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.pjrt_api_version;
        write!(
            f,
            "{} {} (PJRT C API {major}.{minor})",
            self.name, self.version
        )
    }
}

/// Describes the PJRT platform behind the host (name such as `"cpu"`, `"cuda"`, `"tpu"`,
/// version, PJRT C API version).
pub fn platform() -> PlatformInfo {
    raw_client::platform()
}

/// Lists the host's addressable devices, ordered by [`DeviceInfo::index`] (0-based, dense).
/// Device indices name devices in [`Tensor::on_device`](crate::Tensor::on_device), [`Tensor::copy_to_device`](crate::Tensor::copy_to_device) and
/// [`CompileOptions::device`](crate::CompileOptions::device).
pub fn devices() -> Vec<DeviceInfo> {
    raw_client::list_devices()
}
