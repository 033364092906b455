//! [`CompileOptions`]: builder for the serialized `xla.CompileOptionsProto` given to
//! `PJRT_Client_Compile`.
//!
//! Field numbers come from `xla/pjrt/proto/compile_options.proto`:
//! `CompileOptionsProto { ExecutableBuildOptionsProto executable_build_options = 3; }` and
//! `ExecutableBuildOptionsProto { int64 device_ordinal = 1; int64 num_replicas = 4;
//! int64 num_partitions = 5; DeviceAssignmentProto device_assignment = 9; }` (these messages
//! moved there from `xla/xla.proto`), and `xla/xla_data.proto`
//! `DeviceAssignmentProto { int32 replica_count = 1; int32 computation_count = 2;
//! repeated ComputationDevice computation_devices = 3; }`,
//! `ComputationDevice { repeated int64 replica_device_ids = 1; }`.

use prost::Message;

use crate::error::{Error, Result};

/// `xla.CompileOptionsProto`, only the fields this crate sets.
#[derive(Clone, PartialEq, prost::Message)]
struct CompileOptionsProto {
    #[prost(message, optional, tag = "3")]
    executable_build_options: Option<ExecutableBuildOptionsProto>,
}

/// `xla.ExecutableBuildOptionsProto`, only the fields this crate sets.
#[derive(Clone, PartialEq, prost::Message)]
struct ExecutableBuildOptionsProto {
    /// -1 means "not set" (the XLA default).
    #[prost(int64, tag = "1")]
    device_ordinal: i64,
    #[prost(int64, tag = "4")]
    num_replicas: i64,
    #[prost(int64, tag = "5")]
    num_partitions: i64,
    #[prost(message, optional, tag = "9")]
    device_assignment: Option<DeviceAssignmentProto>,
}

/// `xla.DeviceAssignmentProto`.
#[derive(Clone, PartialEq, prost::Message)]
struct DeviceAssignmentProto {
    #[prost(int32, tag = "1")]
    replica_count: i32,
    #[prost(int32, tag = "2")]
    computation_count: i32,
    #[prost(message, repeated, tag = "3")]
    computation_devices: Vec<ComputationDevice>,
}

/// `xla.DeviceAssignmentProto.ComputationDevice`.
#[derive(Clone, PartialEq, prost::Message)]
struct ComputationDevice {
    #[prost(int64, repeated, tag = "1")]
    replica_device_ids: Vec<i64>,
}

/// Compile options. Defaults: one replica, one partition, no device ordinal (the plugin picks
/// its default device assignment, i.e. the first addressable device).
///
/// The CPU plugins ignore `device_ordinal` alone when choosing where the executable runs (seen
/// with both plugins: ordinal 1 still ran on device 0), so with one replica and one partition a
/// device ordinal also emits a one-device `device_assignment`, which they do honour.
///
/// An empty `CompileOptionsProto` makes XLA abort the process (`CHECK failed: replica_count >
/// 0`), so [`CompileOptions::to_bytes`] validates every value before it can reach a plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileOptions {
    /// Device ordinal to build for (`0..number of devices`), `None` = not set.
    pub device_ordinal: Option<i64>,
    /// Number of replicas (>= 1).
    pub num_replicas: u32,
    /// Number of partitions (>= 1).
    pub num_partitions: u32,
}

impl Default for CompileOptions {
    fn default() -> Self {
        Self {
            device_ordinal: None,
            num_replicas: 1,
            num_partitions: 1,
        }
    }
}

impl CompileOptions {
    /// Defaults: 1 replica, 1 partition, no device ordinal.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the number of replicas (must be >= 1, checked by [`CompileOptions::to_bytes`]).
    pub fn num_replicas(mut self, n: u32) -> Self {
        self.num_replicas = n;
        self
    }

    /// Sets the number of partitions (must be >= 1, checked by [`CompileOptions::to_bytes`]).
    pub fn num_partitions(mut self, n: u32) -> Self {
        self.num_partitions = n;
        self
    }

    /// Sets the device ordinal to build and run on (must be >= 0; [`crate::Client::compile`]
    /// also checks it against the number of addressable devices and maps it to that device's
    /// id in the device assignment; [`CompileOptions::to_bytes`] assumes id == ordinal).
    pub fn device_ordinal(mut self, d: i64) -> Self {
        self.device_ordinal = Some(d);
        self
    }

    /// Validates and serializes to `xla.CompileOptionsProto` bytes.
    ///
    /// Errors: `InvalidArgument` if `num_replicas` or `num_partitions` is 0 or the device
    /// ordinal is negative.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.encode(self.device_ordinal)
    }

    /// Validates and serializes; `device_id` is the global id of the device chosen by
    /// `device_ordinal` (used for the one-device assignment).
    pub(crate) fn encode(&self, device_id: Option<i64>) -> Result<Vec<u8>> {
        if self.num_replicas == 0 {
            return Err(Error::invalid_argument("num_replicas must be >= 1"));
        }
        if self.num_partitions == 0 {
            return Err(Error::invalid_argument("num_partitions must be >= 1"));
        }
        if let Some(d) = self.device_ordinal
            && d < 0
        {
            return Err(Error::invalid_argument(format!(
                "device_ordinal must be >= 0, got {d}"
            )));
        }
        let single = self.num_replicas == 1 && self.num_partitions == 1;
        let device_assignment = match (self.device_ordinal, device_id) {
            (Some(_), Some(id)) if single => Some(DeviceAssignmentProto {
                replica_count: 1,
                computation_count: 1,
                computation_devices: vec![ComputationDevice {
                    replica_device_ids: vec![id],
                }],
            }),
            _ => None,
        };
        let proto = CompileOptionsProto {
            executable_build_options: Some(ExecutableBuildOptionsProto {
                device_ordinal: self.device_ordinal.unwrap_or(-1),
                num_replicas: i64::from(self.num_replicas),
                num_partitions: i64::from(self.num_partitions),
                device_assignment,
            }),
        };
        Ok(proto.encode_to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_expected_bytes() {
        let b = CompileOptions::new()
            .device_ordinal(0)
            .encode(None)
            .unwrap();
        // device_ordinal 0 is the proto3 default and is omitted.
        assert_eq!(b, [0x1a, 0x04, 0x20, 0x01, 0x28, 0x01]);
        let b = CompileOptions::new().device_ordinal(1).to_bytes().unwrap();
        // device_assignment { replica_count: 1 computation_count: 1
        //   computation_devices { replica_device_ids: [1] (packed) } }
        let da = [
            0x4a, 0x09, 0x08, 0x01, 0x10, 0x01, 0x1a, 0x03, 0x0a, 0x01, 0x01,
        ];
        assert_eq!(
            b,
            [&[0x1a, 0x11, 0x08, 0x01, 0x20, 0x01, 0x28, 0x01][..], &da].concat()
        );
        let b = CompileOptions::new()
            .num_replicas(2)
            .num_partitions(3)
            .device_ordinal(1);
        assert_eq!(
            b.to_bytes().unwrap(),
            [0x1a, 0x06, 0x08, 0x01, 0x20, 0x02, 0x28, 0x03]
        );
        let b = CompileOptions::new().to_bytes().unwrap();
        assert_eq!(b[..2], [0x1a, 0x0f]);
    }

    #[test]
    fn rejects_zero() {
        assert!(CompileOptions::new().num_replicas(0).to_bytes().is_err());
        assert!(CompileOptions::new().num_partitions(0).to_bytes().is_err());
        assert!(CompileOptions::new().device_ordinal(-2).to_bytes().is_err());
    }
}
