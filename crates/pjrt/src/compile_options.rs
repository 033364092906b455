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
//! `ComputationDevice { repeated int64 replica_device_ids = 1; }` (one `ComputationDevice` per
//! partition, listing its device for each replica, as `xla::DeviceAssignment::Serialize`
//! writes it).
//!
//! Programs over several devices use two more `ExecutableBuildOptionsProto` fields:
//! `bool use_spmd_partitioning = 6;` and `bool use_shardy_partitioner = 19;` (false, their
//! default, is omitted, so options without them are byte-identical to those of builds that
//! did not know them).
//!
//! The optimisation level ([`OptimizationLevel`]) uses two more fields of
//! `compile_options.proto`: `ExecutableBuildOptionsProto { ExecutionOptions.EffortLevel
//! optimization_level = 24; }` and `CompileOptionsProto { map<string, OptionOverrideProto>
//! env_option_overrides = 7; }` with `OptionOverrideProto { oneof value { ... int64 int_field =
//! 3; ... } }`, through which it sets `xla/xla.proto`'s `DebugOptions.xla_backend_optimization_level`
//! (field 31, "numerical optimization level for the XLA compiler backend"; XLA's default is 3).
//! The `EffortLevel` numbers (`EFFORT_UNKNOWN = 0`, `EFFORT_O0 = 9`, `EFFORT_O1 = 19`,
//! `EFFORT_O2 = 29`, `EFFORT_O3 = 39`) were read from the proto descriptors embedded in both CPU
//! plugins (`xla-cpu-pjrt` 0.0.1, `lammps-jax-pjrt-cpu` 0.11.2).
//!
//! Why the override and not `ExecutableBuildOptionsProto.debug_options` (field 3): XLA replaces
//! its whole default `DebugOptions` with a `debug_options` message when one is present, so a
//! message holding only `xla_backend_optimization_level` would zero every other debug option
//! (the CPU thunk runtime, Eigen threading, ...). An option override is applied by name on top
//! of the defaults (`CompileOptions::ApplyAllOptionOverrides`), which is what JAX's
//! `compiler_options=` does.

use std::collections::BTreeMap;

use prost::Message;

use crate::error::{Error, Result};

/// `xla.CompileOptionsProto`, only the fields this crate sets.
#[derive(Clone, PartialEq, prost::Message)]
struct CompileOptionsProto {
    #[prost(message, optional, tag = "3")]
    executable_build_options: Option<ExecutableBuildOptionsProto>,
    /// Debug options set by name on top of XLA's defaults.
    #[prost(btree_map = "string, message", tag = "7")]
    env_option_overrides: BTreeMap<String, OptionOverrideProto>,
}

/// `xla.OptionOverrideProto { oneof value { string string_field = 1; bool bool_field = 2;
/// int64 int_field = 3; double double_field = 4; } }`, without `double_field`; exactly one
/// member is set (a oneof with one member set encodes exactly like that optional field).
#[derive(Clone, PartialEq, prost::Message)]
struct OptionOverrideProto {
    #[prost(string, optional, tag = "1")]
    string_field: Option<String>,
    #[prost(bool, optional, tag = "2")]
    bool_field: Option<bool>,
    #[prost(int64, optional, tag = "3")]
    int_field: Option<i64>,
}

impl OptionOverrideProto {
    fn int(v: i64) -> Self {
        Self {
            int_field: Some(v),
            ..Self::default()
        }
    }

    fn boolean(v: bool) -> Self {
        Self {
            bool_field: Some(v),
            ..Self::default()
        }
    }

    fn string(v: &str) -> Self {
        Self {
            string_field: Some(v.to_string()),
            ..Self::default()
        }
    }
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
    /// SPMD partitioning of a module with several partitions (false is omitted).
    #[prost(bool, tag = "6")]
    use_spmd_partitioning: bool,
    #[prost(message, optional, tag = "9")]
    device_assignment: Option<DeviceAssignmentProto>,
    /// `ExecutionOptions.EffortLevel`; 0 (`EFFORT_UNKNOWN`, the backend's default) is omitted.
    #[prost(int32, tag = "24")]
    optimization_level: i32,
    /// Shardy instead of GSPMD's propagation and partitioner (false is omitted).
    #[prost(bool, tag = "19")]
    use_shardy_partitioner: bool,
}

/// How hard XLA optimises a program, TorchTPU's `xla_optimization_level` ("O0"–"O3"): O0 for
/// programs that run once or are tiny (an eager op), O3 for fused programs that run many times.
///
/// A level sets both `ExecutableBuildOptionsProto.optimization_level` (the `EffortLevel` of the
/// same name; see the module docs for its source) and `DebugOptions.xla_backend_optimization_level`
/// (0–3, the LLVM optimisation level on the CPU and GPU backends). On the XLA CPU plugins only the
/// second changes compile time measurably (docs/BENCHMARKS.md, "Optimisation level"); the first is
/// what TPU and GPU compilers read. Numerical results do not depend on the level: it changes how
/// code is generated, not the HLO semantics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OptimizationLevel {
    /// Least effort: fastest compile (`EFFORT_O0`, backend level 0).
    O0,
    /// `EFFORT_O1`, backend level 1.
    O1,
    /// `EFFORT_O2`, backend level 2.
    O2,
    /// Most effort (`EFFORT_O3`, backend level 3, XLA's default backend level).
    O3,
}

impl OptimizationLevel {
    /// Every level, lowest first.
    pub const ALL: [OptimizationLevel; 4] = [
        OptimizationLevel::O0,
        OptimizationLevel::O1,
        OptimizationLevel::O2,
        OptimizationLevel::O3,
    ];

    /// TorchTPU's name: `"O0"` … `"O3"`.
    pub fn as_str(self) -> &'static str {
        match self {
            OptimizationLevel::O0 => "O0",
            OptimizationLevel::O1 => "O1",
            OptimizationLevel::O2 => "O2",
            OptimizationLevel::O3 => "O3",
        }
    }

    /// 0–3: the value of `DebugOptions.xla_backend_optimization_level`.
    pub fn backend_level(self) -> i64 {
        self as i64
    }

    /// The `ExecutionOptions.EffortLevel` number (`EFFORT_O0` = 9, `EFFORT_O1` = 19,
    /// `EFFORT_O2` = 29, `EFFORT_O3` = 39).
    pub fn effort_level(self) -> i32 {
        10 * (self as i32) + 9
    }
}

impl std::fmt::Display for OptimizationLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OptimizationLevel {
    type Err = Error;

    /// Parses `"O0"` … `"O3"` (exactly; TorchTPU's spelling).
    ///
    /// Errors: `InvalidArgument` naming the accepted values.
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|l| l.as_str() == s)
            .ok_or_else(|| {
                Error::invalid_argument(format!(
                    "unknown optimization level {s:?}; expected one of O0, O1, O2, O3"
                ))
            })
    }
}

impl CompileOptions {
    /// The `DebugOptions` overrides these options set, by field name.
    fn overrides(&self) -> BTreeMap<String, OptionOverrideProto> {
        let mut o = BTreeMap::new();
        if let Some(l) = self.optimization_level {
            o.insert(
                BACKEND_LEVEL_OPTION.to_string(),
                OptionOverrideProto::int(l.backend_level()),
            );
        }
        if let Some(dir) = &self.dump_hlo_to {
            o.insert("xla_dump_to".into(), OptionOverrideProto::string(dir));
            o.insert(
                "xla_dump_hlo_as_proto".into(),
                OptionOverrideProto::boolean(true),
            );
            o.insert(
                "xla_dump_hlo_as_text".into(),
                OptionOverrideProto::boolean(false),
            );
        }
        o
    }
}

/// The `DebugOptions` field an [`OptimizationLevel`] overrides by name.
const BACKEND_LEVEL_OPTION: &str = "xla_backend_optimization_level";

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
    /// How hard to optimise; `None` (the default) leaves the plugin's defaults and adds nothing
    /// to the serialized options, so they are byte-identical to those of builds without it.
    pub optimization_level: Option<OptimizationLevel>,
    /// A directory where XLA writes the module before and after its HLO passes, as serialized
    /// `HloModuleProto`s (`*.before_optimizations.hlo.pb`, `*.after_optimizations.hlo.pb`;
    /// see [`CompileOptions::dump_hlo_to`]); `None` (the default) dumps nothing.
    pub dump_hlo_to: Option<String>,
    /// The devices each replica and partition runs on (`None`: the plugin's default
    /// assignment, or the one-device assignment of `device_ordinal`). When set, its replica and
    /// partition counts must equal `num_replicas` and `num_partitions`, and `device_ordinal`
    /// must be unset.
    pub device_assignment: Option<DeviceAssignment>,
    /// `ExecutableBuildOptionsProto.use_spmd_partitioning`: partition a module of several
    /// partitions by its shardings (SPMD) into one program that every partition runs.
    pub use_spmd_partitioning: bool,
    /// `ExecutableBuildOptionsProto.use_shardy_partitioner`: propagate and partition with
    /// Shardy instead of GSPMD. Needed for modules with Shardy annotations (`sdy.sharding`,
    /// `sdy.manual_computation`: what `jax.export` writes): GSPMD's partitioner cannot lower
    /// them ("No registered implementation for untyped custom call to
    /// xla.sdy.GlobalToLocalShape"). Shardy also imports GSPMD's `mhlo.sharding` attributes.
    pub use_shardy_partitioner: bool,
}

impl Default for CompileOptions {
    fn default() -> Self {
        Self {
            device_ordinal: None,
            num_replicas: 1,
            num_partitions: 1,
            optimization_level: None,
            dump_hlo_to: None,
            device_assignment: None,
            use_spmd_partitioning: false,
            use_shardy_partitioner: false,
        }
    }
}

/// Which device runs each (replica, partition) of a program (`xla.DeviceAssignmentProto`).
///
/// Device ids are global PJRT device ids ([`crate::Device::id`]), not ordinals. The
/// executable's addressable devices, and so the argument lists of
/// [`crate::LoadedExecutable::execute_sharded`], come in replica-major order: replica 0's
/// partitions 0, 1, …, then replica 1's (what `xla::PjRtLoadedExecutable` builds from the
/// assignment, and what the CPU plugins report).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceAssignment {
    replicas: u32,
    partitions: u32,
    /// `ids[replica * partitions + partition]`.
    ids: Vec<i64>,
}

impl DeviceAssignment {
    /// An assignment of `replicas × partitions` devices, `ids[replica * partitions +
    /// partition]`.
    ///
    /// Errors: `InvalidArgument` if a count is 0, `ids` does not hold `replicas × partitions`
    /// ids, an id is negative, or an id appears twice.
    pub fn new(replicas: u32, partitions: u32, ids: Vec<i64>) -> Result<Self> {
        if replicas == 0 || partitions == 0 {
            return Err(Error::invalid_argument(format!(
                "a device assignment needs at least one replica and one partition, got \
                 {replicas} × {partitions}"
            )));
        }
        let want = u64::from(replicas) * u64::from(partitions);
        if ids.len() as u64 != want {
            return Err(Error::invalid_argument(format!(
                "a device assignment of {replicas} replicas × {partitions} partitions needs \
                 {want} device ids, got {}",
                ids.len()
            )));
        }
        if let Some(d) = ids.iter().find(|&&d| d < 0) {
            return Err(Error::invalid_argument(format!(
                "device id {d} in a device assignment is negative"
            )));
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(d) = ids.iter().find(|&&d| !seen.insert(d)) {
            return Err(Error::invalid_argument(format!(
                "device id {d} appears twice in a device assignment"
            )));
        }
        Ok(Self {
            replicas,
            partitions,
            ids,
        })
    }

    /// One replica whose partition `p` runs on `ids[p]` (an SPMD program over these devices).
    ///
    /// Errors: as [`DeviceAssignment::new`].
    pub fn partitions(ids: Vec<i64>) -> Result<Self> {
        let n = u32::try_from(ids.len())
            .map_err(|_| Error::invalid_argument("too many devices in a device assignment"))?;
        Self::new(1, n, ids)
    }

    /// Replicas of a one-partition program, replica `r` on `ids[r]`.
    ///
    /// Errors: as [`DeviceAssignment::new`].
    pub fn replicas(ids: Vec<i64>) -> Result<Self> {
        let n = u32::try_from(ids.len())
            .map_err(|_| Error::invalid_argument("too many devices in a device assignment"))?;
        Self::new(n, 1, ids)
    }

    /// Number of replicas.
    pub fn replica_count(&self) -> u32 {
        self.replicas
    }

    /// Number of partitions.
    pub fn partition_count(&self) -> u32 {
        self.partitions
    }

    /// Every device id, replica-major (`[replica * partitions + partition]`).
    pub fn device_ids(&self) -> &[i64] {
        &self.ids
    }

    /// The device id of `(replica, partition)`, if both are in range.
    pub fn device_id(&self, replica: u32, partition: u32) -> Option<i64> {
        if replica >= self.replicas || partition >= self.partitions {
            return None;
        }
        self.ids
            .get(replica as usize * self.partitions as usize + partition as usize)
            .copied()
    }

    /// `DeviceAssignmentProto { replica_count, computation_count, computation_devices[p]
    /// .replica_device_ids[r] }`: one `ComputationDevice` per partition.
    fn to_proto(&self) -> DeviceAssignmentProto {
        DeviceAssignmentProto {
            replica_count: self.replicas as i32,
            computation_count: self.partitions as i32,
            computation_devices: (0..self.partitions)
                .map(|p| ComputationDevice {
                    replica_device_ids: (0..self.replicas)
                        .filter_map(|r| self.device_id(r, p))
                        .collect(),
                })
                .collect(),
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

    /// Sets the device assignment (`None`: none; see [`CompileOptions::device_assignment`]
    /// the field) and, when `Some`, `num_replicas` and `num_partitions` to its counts.
    pub fn device_assignment(mut self, assignment: Option<DeviceAssignment>) -> Self {
        if let Some(a) = &assignment {
            self.num_replicas = a.replica_count();
            self.num_partitions = a.partition_count();
        }
        self.device_assignment = assignment;
        self
    }

    /// Sets `use_spmd_partitioning` (see the field).
    pub fn use_spmd_partitioning(mut self, on: bool) -> Self {
        self.use_spmd_partitioning = on;
        self
    }

    /// Sets `use_shardy_partitioner` (see the field).
    pub fn use_shardy_partitioner(mut self, on: bool) -> Self {
        self.use_shardy_partitioner = on;
        self
    }

    /// Options for an SPMD program partitioned over `device_ids` (one replica, partition `p` on
    /// `device_ids[p]`), as JAX compiles a `jit` over a mesh: the device assignment,
    /// `num_partitions`, `use_spmd_partitioning` and `use_shardy_partitioner`.
    ///
    /// Errors: as [`DeviceAssignment::new`].
    pub fn spmd(device_ids: &[i64]) -> Result<Self> {
        Ok(Self::new()
            .device_assignment(Some(DeviceAssignment::partitions(device_ids.to_vec())?))
            .use_spmd_partitioning(true)
            .use_shardy_partitioner(true))
    }

    /// Sets the optimisation level (`None`: the plugin's default).
    pub fn optimization_level(mut self, level: Option<OptimizationLevel>) -> Self {
        self.optimization_level = level;
        self
    }

    /// Makes XLA write the module it compiles into `dir`, as serialized `HloModuleProto`s,
    /// before and after its HLO passes: `DebugOptions` overrides `xla_dump_to = dir`,
    /// `xla_dump_hlo_as_proto = true`, `xla_dump_hlo_as_text = false` (`xla/xla.proto`; XLA
    /// names the files `module_NNNN.<name>.before_optimizations.hlo.pb` and
    /// `….after_optimizations.hlo.pb`, `xla/service/dump.cc`). The directory must exist and be
    /// the caller's alone; XLA may write other files there too (the CPU backend's LLVM IR).
    /// The program before the passes is what the loop budget rewrites
    /// ([`crate::loop_budget`]).
    pub fn dump_hlo_to(mut self, dir: Option<String>) -> Self {
        self.dump_hlo_to = dir;
        self
    }

    /// Validates and serializes to `xla.CompileOptionsProto` bytes.
    ///
    /// Errors: `InvalidArgument` if `num_replicas` or `num_partitions` is 0, the device
    /// ordinal is negative, or a device assignment disagrees with the replica and partition
    /// counts or comes with a device ordinal.
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
        let device_assignment = if let Some(a) = &self.device_assignment {
            if a.replica_count() != self.num_replicas || a.partition_count() != self.num_partitions
            {
                return Err(Error::invalid_argument(format!(
                    "the device assignment has {} replicas × {} partitions but the options ask \
                     for {} × {}",
                    a.replica_count(),
                    a.partition_count(),
                    self.num_replicas,
                    self.num_partitions
                )));
            }
            if let Some(d) = self.device_ordinal {
                return Err(Error::invalid_argument(format!(
                    "device_ordinal {d} and a device assignment are both set; set one"
                )));
            }
            Some(a.to_proto())
        } else {
            match (self.device_ordinal, device_id) {
                (Some(_), Some(id)) if single => Some(DeviceAssignmentProto {
                    replica_count: 1,
                    computation_count: 1,
                    computation_devices: vec![ComputationDevice {
                        replica_device_ids: vec![id],
                    }],
                }),
                _ => None,
            }
        };
        let proto = CompileOptionsProto {
            executable_build_options: Some(ExecutableBuildOptionsProto {
                device_ordinal: self.device_ordinal.unwrap_or(-1),
                num_replicas: i64::from(self.num_replicas),
                num_partitions: i64::from(self.num_partitions),
                device_assignment,
                optimization_level: self.optimization_level.map_or(0, |l| l.effort_level()),
                use_spmd_partitioning: self.use_spmd_partitioning,
                use_shardy_partitioner: self.use_shardy_partitioner,
            }),
            env_option_overrides: self.overrides(),
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
    fn optimization_level_adds_the_effort_level_and_the_backend_override() {
        let default = CompileOptions::new()
            .device_ordinal(0)
            .encode(None)
            .unwrap();
        assert_eq!(
            CompileOptions::new()
                .device_ordinal(0)
                .optimization_level(None)
                .encode(None)
                .unwrap(),
            default
        );
        let o1 = CompileOptions::new()
            .device_ordinal(0)
            .optimization_level(Some(OptimizationLevel::O1))
            .encode(None)
            .unwrap();
        // executable_build_options { num_replicas: 1 num_partitions: 1 optimization_level: 19 }
        // env_option_overrides { key: "xla_backend_optimization_level" value { int_field: 1 } }
        let mut want = vec![0x1a, 0x07, 0x20, 0x01, 0x28, 0x01, 0xc0, 0x01, 19];
        let key = b"xla_backend_optimization_level";
        let entry_len = 2 + key.len() + 2 + 2;
        want.extend([0x3a, entry_len as u8, 0x0a, key.len() as u8]);
        want.extend(key);
        want.extend([0x12, 0x02, 0x18, 0x01]);
        assert_eq!(o1, want);
        let levels: Vec<Vec<u8>> = OptimizationLevel::ALL
            .iter()
            .map(|&l| {
                CompileOptions::new()
                    .optimization_level(Some(l))
                    .to_bytes()
                    .unwrap()
            })
            .collect();
        for (i, a) in levels.iter().enumerate() {
            for b in &levels[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn optimization_level_names_round_trip() {
        for l in OptimizationLevel::ALL {
            assert_eq!(l.as_str().parse::<OptimizationLevel>().unwrap(), l);
        }
        assert_eq!(
            OptimizationLevel::ALL.map(|l| l.effort_level()),
            [9, 19, 29, 39]
        );
        assert_eq!(
            OptimizationLevel::ALL.map(|l| l.backend_level()),
            [0, 1, 2, 3]
        );
        for bad in ["o1", "O4", "", "3"] {
            let e = bad.parse::<OptimizationLevel>().unwrap_err();
            assert_eq!(e.code, crate::ErrorCode::InvalidArgument, "{bad}");
        }
    }

    #[test]
    fn spmd_options_encode_the_assignment_and_both_flags() {
        let b = CompileOptions::spmd(&[0, 1, 2, 3])
            .unwrap()
            .to_bytes()
            .unwrap();
        // device_assignment { replica_count: 1 computation_count: 4
        //   computation_devices { replica_device_ids: [p] } for p in 0..4 }
        let mut da = vec![0x4a, 24, 0x08, 0x01, 0x10, 0x04];
        for p in 0..4 {
            da.extend([0x1a, 0x03, 0x0a, 0x01, p]);
        }
        let mut want = vec![0x1a, 46, 0x08];
        want.extend([0xff; 9]); // device_ordinal -1
        want.push(0x01);
        want.extend([0x20, 0x01, 0x28, 0x04, 0x30, 0x01]); // replicas 1, partitions 4, spmd
        want.extend(da);
        want.extend([0x98, 0x01, 0x01]); // use_shardy_partitioner (field 19)
        assert_eq!(b, want);
        // Two replicas × two partitions: one ComputationDevice per partition, listing the
        // device of each replica.
        let a = DeviceAssignment::new(2, 2, vec![10, 11, 12, 13]).unwrap();
        assert_eq!(a.device_id(1, 0), Some(12));
        assert_eq!(a.device_id(2, 0), None);
        let p = a.to_proto();
        assert_eq!((p.replica_count, p.computation_count), (2, 2));
        assert_eq!(p.computation_devices[0].replica_device_ids, [10, 12]);
        assert_eq!(p.computation_devices[1].replica_device_ids, [11, 13]);
        let o = CompileOptions::new().device_assignment(Some(a));
        assert_eq!((o.num_replicas, o.num_partitions), (2, 2));
        // Flags off and no assignment: the bytes of builds that did not know them.
        let plain = CompileOptions::new().num_partitions(4);
        assert_eq!(
            plain
                .clone()
                .use_spmd_partitioning(false)
                .use_shardy_partitioner(false)
                .device_assignment(None)
                .to_bytes()
                .unwrap(),
            plain.to_bytes().unwrap()
        );
    }

    #[test]
    fn rejects_bad_assignments() {
        let bad = [
            DeviceAssignment::new(0, 1, vec![]),
            DeviceAssignment::new(1, 2, vec![0]),
            DeviceAssignment::new(1, 2, vec![0, -1]),
            DeviceAssignment::new(1, 2, vec![3, 3]),
            DeviceAssignment::partitions(vec![]),
        ];
        for b in bad {
            assert_eq!(b.unwrap_err().code, crate::ErrorCode::InvalidArgument);
        }
        let a = DeviceAssignment::partitions(vec![0, 1]).unwrap();
        let mut o = CompileOptions::new().device_assignment(Some(a.clone()));
        o.num_partitions = 4;
        assert!(o.to_bytes().is_err(), "counts disagree");
        let o = CompileOptions::new()
            .device_assignment(Some(a))
            .device_ordinal(0);
        assert!(o.to_bytes().is_err(), "ordinal and assignment");
    }

    #[test]
    fn rejects_zero() {
        assert!(CompileOptions::new().num_replicas(0).to_bytes().is_err());
        assert!(CompileOptions::new().num_partitions(0).to_bytes().is_err());
        assert!(CompileOptions::new().device_ordinal(-2).to_bytes().is_err());
    }
}
