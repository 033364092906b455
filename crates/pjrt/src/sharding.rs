//! [`HloSharding`]: how an array of a program over several devices is laid out on them (XLA's
//! `xla::HloSharding`, serialized as `xla.OpSharding`), and [`Shard`]: the part of the global
//! array one device holds.
//!
//! Field numbers, from `xla/xla_data.proto`: `OpSharding { Type type = 1; ShapeProto
//! tile_shape = 2; repeated int64 tile_assignment_dimensions = 3; repeated int64
//! tile_assignment_devices = 4; repeated OpSharding tuple_shardings = 5; bool
//! replicate_on_last_tile_dim = 6; repeated OpMetadata metadata = 7; repeated Type
//! last_tile_dims = 8; repeated int64 iota_reshape_dims = 9; repeated int32
//! iota_transpose_perm = 10; … optional NamedShardingProto named_sharding = 14; }` with
//! `Type { REPLICATED = 0; MAXIMAL = 1; TUPLE = 2; OTHER = 3; MANUAL = 4; UNKNOWN = 5;
//! UNREDUCED = 6; }`.
//!
//! The device numbers of a sharding are *logical*: partition numbers of an SPMD program
//! (`0..num_partitions`), which are the positions of the executable's addressable devices
//! when it has one replica ([`crate::DeviceAssignment`]).
//!
//! How a tiled sharding splits an array (`xla::HloSharding::TileOffsetForDevice` /
//! `TileLimitForDevice`): with `t` tiles along a dimension of size `n`, every tile is
//! `ceil(n / t)` long, tile `i` covers `[i·ceil(n/t), min((i+1)·ceil(n/t), n))`, and the
//! device buffer of every tile has the full tile length (the last tiles are padded where `t`
//! does not divide `n`).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, ErrorCode, Result};

/// `xla.OpSharding`, the fields this crate reads.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct OpShardingProto {
    #[prost(int32, tag = "1")]
    pub(crate) r#type: i32,
    #[prost(int64, repeated, tag = "3")]
    pub(crate) tile_assignment_dimensions: Vec<i64>,
    #[prost(int64, repeated, tag = "4")]
    pub(crate) tile_assignment_devices: Vec<i64>,
    #[prost(message, repeated, tag = "5")]
    pub(crate) tuple_shardings: Vec<OpShardingProto>,
    #[prost(bool, tag = "6")]
    pub(crate) replicate_on_last_tile_dim: bool,
    #[prost(int32, repeated, tag = "8")]
    pub(crate) last_tile_dims: Vec<i32>,
    #[prost(int64, repeated, tag = "9")]
    pub(crate) iota_reshape_dims: Vec<i64>,
    #[prost(int32, repeated, tag = "10")]
    pub(crate) iota_transpose_perm: Vec<i32>,
    /// `NamedShardingProto`, left encoded: only its presence is checked.
    #[prost(bytes = "vec", optional, tag = "14")]
    pub(crate) named_sharding: Option<Vec<u8>>,
}

const REPLICATED: i32 = 0;
const MAXIMAL: i32 = 1;
const TUPLE: i32 = 2;
const OTHER: i32 = 3;
const MANUAL: i32 = 4;
const UNKNOWN: i32 = 5;
const UNREDUCED: i32 = 6;

/// Most devices a sharding may name (a bound on hostile input, far above any machine's count).
const MAX_DEVICES: i64 = 1 << 20;

/// What the devices along one trailing *subgroup* dimension of a tiled sharding's tile
/// assignment hold (`OpSharding.last_tile_dims`; `replicate_on_last_tile_dim` is one
/// [`Subgroup::Replicated`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Subgroup {
    /// Copies of the same tile.
    Replicated,
    /// Parts the program handles itself (`shard_map`'s manual axes).
    Manual,
    /// Partial values still to be summed.
    Unreduced,
}

impl Subgroup {
    fn name(self) -> &'static str {
        match self {
            Subgroup::Replicated => "replicated",
            Subgroup::Manual => "manual",
            Subgroup::Unreduced => "unreduced",
        }
    }
}

/// The devices of a tiled sharding arranged as an array: `dims` (one per array dimension, then
/// one per subgroup) and the device at each position, row-major. Either listed explicitly or,
/// compactly, as an iota reshaped to `reshape_dims`, transposed by `transpose_perm` and
/// reshaped to `dims` (XLA's `<=[…]T(…)` form); both forms are kept expanded in
/// [`TileAssignment::devices`], and two assignments are equal when their dims and devices are.
#[derive(Debug, Clone, Eq)]
pub struct TileAssignment {
    dims: Vec<i64>,
    devices: Vec<i64>,
    /// `(reshape_dims, transpose_perm)` when it came as an iota (for display).
    iota: Option<(Vec<i64>, Vec<usize>)>,
}

impl PartialEq for TileAssignment {
    fn eq(&self, other: &Self) -> bool {
        self.dims == other.dims && self.devices == other.devices
    }
}

impl std::hash::Hash for TileAssignment {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.dims.hash(state);
        self.devices.hash(state);
    }
}

impl TileAssignment {
    /// An explicit assignment: `devices` row-major over `dims`.
    ///
    /// Errors: `InvalidArgument` if a dimension is below 1, `devices` does not hold
    /// `product(dims)` entries, or a device is negative or appears twice.
    pub fn new(dims: Vec<i64>, devices: Vec<i64>) -> Result<Self> {
        let n = device_count(&dims)?;
        if devices.len() as i64 != n {
            return Err(Error::invalid_argument(format!(
                "tile assignment of dims {dims:?} needs {n} devices, got {}",
                devices.len()
            )));
        }
        let mut seen = std::collections::BTreeSet::new();
        for &d in &devices {
            if !(0..MAX_DEVICES).contains(&d) || !seen.insert(d) {
                return Err(Error::invalid_argument(format!(
                    "tile assignment device {d} is out of range or appears twice"
                )));
            }
        }
        Ok(Self {
            dims,
            devices,
            iota: None,
        })
    }

    /// XLA's iota tile assignment `[dims]<=[reshape_dims]T(transpose_perm)`: the devices
    /// `0..product(reshape_dims)` reshaped to `reshape_dims`, transposed by `transpose_perm`
    /// (empty: no transpose) and read row-major into `dims`.
    ///
    /// Errors: `InvalidArgument` if a dimension is below 1, the products of `dims` and
    /// `reshape_dims` differ, or `transpose_perm` is not a permutation of the reshape dims.
    pub fn iota(
        dims: Vec<i64>,
        reshape_dims: Vec<i64>,
        transpose_perm: Vec<usize>,
    ) -> Result<Self> {
        let n = device_count(&dims)?;
        if device_count(&reshape_dims)? != n {
            return Err(Error::invalid_argument(format!(
                "iota tile assignment reshapes {n} devices to {reshape_dims:?}"
            )));
        }
        let perm = if transpose_perm.is_empty() {
            (0..reshape_dims.len()).collect()
        } else {
            transpose_perm
        };
        let mut sorted = perm.clone();
        sorted.sort_unstable();
        if sorted != (0..reshape_dims.len()).collect::<Vec<_>>() {
            return Err(Error::invalid_argument(format!(
                "iota transpose {perm:?} is not a permutation of {} dimensions",
                reshape_dims.len()
            )));
        }
        // The transposed array has dims reshape_dims[perm[k]]; its element at index `t` is the
        // iota value at the source index `s` with s[perm[k]] = t[k].
        let tdims: Vec<i64> = perm.iter().map(|&p| reshape_dims[p]).collect();
        let strides = row_major_strides(&reshape_dims);
        let devices = (0..n)
            .map(|flat| {
                unflatten(flat, &tdims)
                    .iter()
                    .enumerate()
                    .map(|(k, &t)| t * strides[perm[k]])
                    .sum()
            })
            .collect();
        let identity = perm.iter().enumerate().all(|(k, &p)| k == p);
        Ok(Self {
            dims,
            devices,
            iota: Some((reshape_dims, if identity { Vec::new() } else { perm })),
        })
    }

    /// Dimensions: one per array dimension, then one per subgroup.
    pub fn dims(&self) -> &[i64] {
        &self.dims
    }

    /// The device at each position, row-major over [`TileAssignment::dims`].
    pub fn devices(&self) -> &[i64] {
        &self.devices
    }
}

/// A sharding of one array (or of each element of a tuple) over the devices of a program:
/// `xla::HloSharding`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HloSharding {
    /// Every device holds the whole array.
    Replicated,
    /// One device holds the whole array (the others hold an array of the same shape that the
    /// program ignores).
    Maximal {
        /// The logical device.
        device: i64,
    },
    /// Split into tiles along some dimensions, each tile on the devices at its position of the
    /// tile assignment (one device, or several along the subgroup dimensions).
    Tiled {
        /// The devices: one assignment dimension per array dimension, then one per subgroup.
        tile_assignment: TileAssignment,
        /// What the trailing subgroup dimensions of the tile assignment hold (empty: none).
        subgroups: Vec<Subgroup>,
    },
    /// Already per-device (inside a `shard_map`): no global view.
    Manual,
    /// Partial values on each device, still to be summed.
    Unreduced,
    /// Not decided (a placeholder of XLA's propagation).
    Unknown,
    /// One sharding per element of a tuple, flattened in pre-order.
    Tuple(Vec<HloSharding>),
}

/// The part of a global array one device holds: `[start, limit)` along each dimension.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shard {
    /// First index along each dimension.
    pub start: Vec<i64>,
    /// One past the last index along each dimension.
    pub limit: Vec<i64>,
    /// Whether this device holds the copy of its range to read when gathering the global array
    /// back: the first device (in tile-assignment order) of each tile; for a
    /// [`HloSharding::Maximal`] sharding, its device only.
    pub primary: bool,
}

impl Shard {
    /// `limit - start` along each dimension: the elements of the global array this device
    /// holds (its buffer may be padded beyond them, see [`HloSharding::tile_dims`]).
    pub fn dims(&self) -> Vec<i64> {
        self.start
            .iter()
            .zip(&self.limit)
            .map(|(s, l)| l - s)
            .collect()
    }
}

impl Shard {
    /// This shard of a dense row-major global array (`global`: `elem` bytes per element, of
    /// dims `global_dims`), as a dense buffer of `buffer_dims` (the device's dims, each at
    /// least the shard's: [`HloSharding::tile_dims`]), zero where the buffer pads the shard.
    ///
    /// Errors: `InvalidArgument` if the ranks differ, `global` is not `elem × product(dims)`
    /// bytes, the shard lies outside the global dims, or the buffer is smaller than the shard.
    pub fn extract(
        &self,
        global: &[u8],
        global_dims: &[i64],
        elem: usize,
        buffer_dims: &[i64],
    ) -> Result<Vec<u8>> {
        self.check(global.len(), global_dims, elem, buffer_dims)?;
        let mut out = vec![0u8; dense_len(buffer_dims, elem)?];
        self.for_each_row(global_dims, buffer_dims, elem, |g, b, n| {
            out[b..b + n].copy_from_slice(&global[g..g + n]);
        });
        Ok(out)
    }

    /// Writes a device buffer (dense row-major, of `buffer_dims`) holding this shard into its
    /// place in a dense global array of `global_dims` (the inverse of [`Shard::extract`];
    /// the buffer's padding is not read).
    ///
    /// Errors: as [`Shard::extract`], and `InvalidArgument` if `buffer` is not
    /// `elem × product(buffer_dims)` bytes.
    pub fn insert(
        &self,
        buffer: &[u8],
        buffer_dims: &[i64],
        global: &mut [u8],
        global_dims: &[i64],
        elem: usize,
    ) -> Result<()> {
        self.check(global.len(), global_dims, elem, buffer_dims)?;
        if buffer.len() != dense_len(buffer_dims, elem)? {
            return Err(Error::invalid_argument(format!(
                "a buffer of dims {buffer_dims:?} needs {} bytes, got {}",
                dense_len(buffer_dims, elem)?,
                buffer.len()
            )));
        }
        self.for_each_row(global_dims, buffer_dims, elem, |g, b, n| {
            global[g..g + n].copy_from_slice(&buffer[b..b + n]);
        });
        Ok(())
    }

    fn check(
        &self,
        len: usize,
        global_dims: &[i64],
        elem: usize,
        buffer_dims: &[i64],
    ) -> Result<()> {
        let rank = global_dims.len();
        if self.start.len() != rank || self.limit.len() != rank || buffer_dims.len() != rank {
            return Err(Error::invalid_argument(format!(
                "shard {:?}..{:?}, global dims {global_dims:?} and buffer dims \
                 {buffer_dims:?} differ in rank",
                self.start, self.limit
            )));
        }
        if len != dense_len(global_dims, elem)? {
            return Err(Error::invalid_argument(format!(
                "a global array of dims {global_dims:?} needs {} bytes, got {len}",
                dense_len(global_dims, elem)?
            )));
        }
        for k in 0..rank {
            let (s, l) = (self.start[k], self.limit[k]);
            if !(0 <= s && s <= l && l <= global_dims[k]) || l - s > buffer_dims[k] {
                return Err(Error::invalid_argument(format!(
                    "shard {:?}..{:?} does not fit global dims {global_dims:?} and buffer \
                     dims {buffer_dims:?}",
                    self.start, self.limit
                )));
            }
        }
        Ok(())
    }

    /// Calls `f(global_offset, buffer_offset, bytes)` for each contiguous run of the shard
    /// (one per index of all dimensions but the last). Dims were checked.
    fn for_each_row(
        &self,
        global_dims: &[i64],
        buffer_dims: &[i64],
        elem: usize,
        mut f: impl FnMut(usize, usize, usize),
    ) {
        let dims = self.dims();
        if dims.contains(&0) {
            return;
        }
        let rank = dims.len();
        let gs = row_major_strides(global_dims);
        let bs = row_major_strides(buffer_dims);
        let run = dims.last().map_or(1, |&n| n as usize) * elem;
        let outer: i64 = dims[..rank.saturating_sub(1)].iter().product();
        for flat in 0..outer {
            let index = unflatten(flat, &dims[..rank.saturating_sub(1)]);
            let mut g = 0;
            let mut b = 0;
            for k in 0..rank {
                let i = index.get(k).copied().unwrap_or(0);
                g += (self.start[k] + i) * gs[k];
                b += i * bs[k];
            }
            f(g as usize * elem, b as usize * elem, run);
        }
    }
}

/// Bytes of a dense array of `dims` with `elem`-byte elements.
fn dense_len(dims: &[i64], elem: usize) -> Result<usize> {
    dims.iter()
        .try_fold(elem, |a, &d| {
            usize::try_from(d).ok().and_then(|d| a.checked_mul(d))
        })
        .ok_or_else(|| Error::invalid_argument(format!("dims {dims:?} are negative or too large")))
}

impl HloSharding {
    /// Decodes an `xla.OpSharding`.
    ///
    /// Errors: `Unimplemented` for a sharding in the named (Shardy) form (`named_sharding`);
    /// `InvalidArgument` for an unknown type or an inconsistent tile assignment.
    pub(crate) fn from_proto(p: &OpShardingProto) -> Result<Self> {
        if p.named_sharding.is_some() {
            return Err(Error::unimplemented(
                "OpSharding in the named_sharding form is not supported",
            ));
        }
        match p.r#type {
            REPLICATED => Ok(Self::Replicated),
            MAXIMAL => match p.tile_assignment_devices.as_slice() {
                [d] if (0..MAX_DEVICES).contains(d) => Ok(Self::Maximal { device: *d }),
                other => Err(Error::invalid_argument(format!(
                    "maximal sharding names devices {other:?}; expected one"
                ))),
            },
            TUPLE => Ok(Self::Tuple(
                p.tuple_shardings
                    .iter()
                    .map(Self::from_proto)
                    .collect::<Result<_>>()?,
            )),
            OTHER => {
                let dims = p.tile_assignment_dimensions.clone();
                let tile_assignment = if !p.iota_reshape_dims.is_empty() {
                    let perm = p
                        .iota_transpose_perm
                        .iter()
                        .map(|&x| usize::try_from(x))
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .map_err(|_| Error::invalid_argument("negative iota transpose entry"))?;
                    TileAssignment::iota(dims, p.iota_reshape_dims.clone(), perm)?
                } else {
                    TileAssignment::new(dims, p.tile_assignment_devices.clone())?
                };
                let subgroups = if p.replicate_on_last_tile_dim {
                    vec![Subgroup::Replicated]
                } else {
                    p.last_tile_dims
                        .iter()
                        .map(|&t| match t {
                            REPLICATED => Ok(Subgroup::Replicated),
                            MANUAL => Ok(Subgroup::Manual),
                            UNREDUCED => Ok(Subgroup::Unreduced),
                            other => Err(Error::invalid_argument(format!(
                                "last_tile_dims holds sharding type {other}"
                            ))),
                        })
                        .collect::<Result<_>>()?
                };
                Self::tiled(tile_assignment, subgroups)
            }
            MANUAL => Ok(Self::Manual),
            UNKNOWN => Ok(Self::Unknown),
            UNREDUCED => Ok(Self::Unreduced),
            other => Err(Error::invalid_argument(format!(
                "unknown OpSharding type {other}"
            ))),
        }
    }

    /// A tiled sharding.
    ///
    /// Errors: `InvalidArgument` if the tile assignment has fewer dimensions than subgroups.
    pub fn tiled(tile_assignment: TileAssignment, subgroups: Vec<Subgroup>) -> Result<Self> {
        if tile_assignment.dims.len() < subgroups.len() {
            return Err(Error::invalid_argument(format!(
                "tile assignment of dims {:?} cannot have {} subgroup dimensions",
                tile_assignment.dims,
                subgroups.len()
            )));
        }
        Ok(Self::Tiled {
            tile_assignment,
            subgroups,
        })
    }

    /// Whether a tiled sharding replicates along its last tile-assignment dimension
    /// (`OpSharding.replicate_on_last_tile_dim`, XLA's `last_tile_dim_replicate`).
    pub fn replicate_on_last_tile_dim(&self) -> bool {
        matches!(self, Self::Tiled { subgroups, .. } if subgroups == &[Subgroup::Replicated])
    }

    /// Number of tiles along each of the first `rank` dimensions: 1 for a sharding that does
    /// not split the array.
    ///
    /// Errors: `InvalidArgument` if a tiled sharding's assignment does not have `rank` data
    /// dimensions; `Unimplemented` for a tuple, manual, unreduced or unknown sharding.
    pub fn tiles_per_dim(&self, rank: usize) -> Result<Vec<i64>> {
        match self {
            Self::Replicated | Self::Maximal { .. } => Ok(vec![1; rank]),
            Self::Tiled {
                tile_assignment,
                subgroups,
            } => {
                let data = tile_assignment.dims.len().checked_sub(subgroups.len());
                if data != Some(rank) {
                    return Err(Error::invalid_argument(format!(
                        "sharding {self} does not tile the {rank} dimensions of the array"
                    )));
                }
                Ok(tile_assignment.dims[..rank].to_vec())
            }
            other => Err(Error::unimplemented(format!(
                "sharding {other} does not split a global array into shards"
            ))),
        }
    }

    /// The dims of each device's buffer for a global array of `global` dims: `ceil(n / t)`
    /// along a dimension of size `n` split into `t` tiles (the program's per-device shape).
    ///
    /// Errors: as [`HloSharding::tiles_per_dim`]; `InvalidArgument` for a negative dimension.
    pub fn tile_dims(&self, global: &[i64]) -> Result<Vec<i64>> {
        check_dims(global)?;
        let tiles = self.tiles_per_dim(global.len())?;
        Ok(global
            .iter()
            .zip(&tiles)
            .map(|(&n, &t)| ceil_div(n, t))
            .collect())
    }

    /// Each device's part of a global array of `global` dims, for a program over
    /// `num_devices` logical devices (partitions): entry `d` is device `d`'s [`Shard`].
    /// What is needed to split a global array into per-device buffers, and to gather the
    /// devices' buffers back (reading each [`Shard::primary`] one).
    ///
    /// Errors: as [`HloSharding::tiles_per_dim`]; `InvalidArgument` if `num_devices` is 0, a
    /// device of the sharding is not below `num_devices`, or a tiled sharding does not cover
    /// every device (XLA's SPMD shardings name each partition once).
    pub fn shards(&self, global: &[i64], num_devices: usize) -> Result<Vec<Shard>> {
        check_dims(global)?;
        if num_devices == 0 {
            return Err(Error::invalid_argument(
                "a sharding needs at least one device",
            ));
        }
        let full = |primary| Shard {
            start: vec![0; global.len()],
            limit: global.to_vec(),
            primary,
        };
        match self {
            Self::Replicated => Ok((0..num_devices).map(|d| full(d == 0)).collect()),
            Self::Maximal { device } => {
                if !(0..num_devices as i64).contains(device) {
                    return Err(Error::invalid_argument(format!(
                        "sharding {self} names device {device} of {num_devices}"
                    )));
                }
                Ok((0..num_devices)
                    .map(|d| full(d as i64 == *device))
                    .collect())
            }
            Self::Tiled {
                tile_assignment, ..
            } => {
                let tiles = self.tiles_per_dim(global.len())?;
                if tile_assignment.devices.len() != num_devices {
                    return Err(Error::invalid_argument(format!(
                        "sharding {self} covers {} devices; the program has {num_devices}",
                        tile_assignment.devices.len()
                    )));
                }
                let mut out: Vec<Option<Shard>> = vec![None; num_devices];
                let mut seen_tiles = std::collections::HashSet::new();
                for (pos, &device) in tile_assignment.devices.iter().enumerate() {
                    let index = unflatten(pos as i64, &tile_assignment.dims);
                    let tile = &index[..global.len()];
                    let mut start = Vec::with_capacity(global.len());
                    let mut limit = Vec::with_capacity(global.len());
                    for ((&n, &t), &i) in global.iter().zip(&tiles).zip(tile) {
                        let size = ceil_div(n, t);
                        start.push((i * size).min(n));
                        limit.push(((i + 1) * size).min(n));
                    }
                    let slot = usize::try_from(device)
                        .ok()
                        .and_then(|d| out.get_mut(d))
                        .ok_or_else(|| {
                            Error::invalid_argument(format!(
                                "sharding {self} names device {device} of {num_devices}"
                            ))
                        })?;
                    *slot = Some(Shard {
                        start,
                        limit,
                        primary: seen_tiles.insert(tile.to_vec()),
                    });
                }
                out.into_iter()
                    .enumerate()
                    .map(|(d, s)| {
                        s.ok_or_else(|| {
                            Error::invalid_argument(format!(
                                "sharding {self} gives device {d} nothing"
                            ))
                        })
                    })
                    .collect()
            }
            other => Err(Error::new(
                ErrorCode::Unimplemented,
                format!("sharding {other} does not split a global array into shards"),
            )),
        }
    }
}

fn check_dims(global: &[i64]) -> Result<()> {
    match global.iter().find(|&&n| n < 0) {
        Some(n) => Err(Error::invalid_argument(format!(
            "negative dimension {n} in {global:?}"
        ))),
        None => Ok(()),
    }
}

fn ceil_div(n: i64, t: i64) -> i64 {
    (n + t - 1) / t
}

/// Product of `dims`, each at least 1, at most [`MAX_DEVICES`].
fn device_count(dims: &[i64]) -> Result<i64> {
    let mut n: i64 = 1;
    for &d in dims {
        if d < 1 {
            return Err(Error::invalid_argument(format!(
                "tile assignment dimension {d} in {dims:?} is below 1"
            )));
        }
        n = n.saturating_mul(d);
        if n > MAX_DEVICES {
            return Err(Error::invalid_argument(format!(
                "tile assignment {dims:?} names more than {MAX_DEVICES} devices"
            )));
        }
    }
    Ok(n)
}

fn row_major_strides(dims: &[i64]) -> Vec<i64> {
    let mut strides = vec![1; dims.len()];
    for k in (0..dims.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1] * dims[k + 1];
    }
    strides
}

/// The multi-index of row-major position `flat` in an array of `dims`.
fn unflatten(mut flat: i64, dims: &[i64]) -> Vec<i64> {
    let mut index = vec![0; dims.len()];
    for k in (0..dims.len()).rev() {
        index[k] = flat % dims[k];
        flat /= dims[k];
    }
    index
}

fn join<T: fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// XLA's text form (`xla::HloSharding::ToString`): `{replicated}`, `{maximal device=1}`,
/// `{devices=[4,1]0,1,2,3}`, `{devices=[2,1,2]<=[4] last_tile_dim_replicate}`,
/// `{devices=[2,2]<=[2,2]T(1,0)}`, `{devices=[2,2]0,1,2,3 last_tile_dims={manual}}`,
/// `{manual}`, `{unreduced}`, `{unknown}`, and a tuple as `{{…}, {…}}`.
impl fmt::Display for HloSharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Replicated => f.write_str("{replicated}"),
            Self::Maximal { device } => write!(f, "{{maximal device={device}}}"),
            Self::Manual => f.write_str("{manual}"),
            Self::Unreduced => f.write_str("{unreduced}"),
            Self::Unknown => f.write_str("{unknown}"),
            Self::Tuple(v) => {
                f.write_str("{")?;
                for (i, s) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{s}")?;
                }
                f.write_str("}")
            }
            Self::Tiled {
                tile_assignment: t,
                subgroups,
            } => {
                write!(f, "{{devices=[{}]", join(&t.dims))?;
                match &t.iota {
                    Some((reshape, perm)) => {
                        write!(f, "<=[{}]", join(reshape))?;
                        if !perm.is_empty() {
                            write!(f, "T({})", join(perm))?;
                        }
                    }
                    None => f.write_str(&join(&t.devices))?,
                }
                if self.replicate_on_last_tile_dim() {
                    f.write_str(" last_tile_dim_replicate")?;
                } else if !subgroups.is_empty() {
                    let names: Vec<&str> = subgroups.iter().map(|s| s.name()).collect();
                    write!(f, " last_tile_dims={{{}}}", names.join(", "))?;
                }
                f.write_str("}")
            }
        }
    }
}

/// Parses XLA's text form (see the `Display` impl; also what `mhlo.sharding` attributes hold).
/// Metadata (`metadata={…}`) is not accepted.
impl FromStr for HloSharding {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        HloSharding::parse_bounded(s, MAX_DEVICES)
    }
}

impl HloSharding {
    /// Parses XLA's text form as [`FromStr`] does, refusing a tile assignment of more than
    /// `max_devices` devices before it is built (an iota assignment of 46 bytes of text
    /// otherwise lists up to 2^20 devices: 8 MiB and as many small allocations).
    ///
    /// Errors: `InvalidArgument` for text that does not parse, or names more devices.
    pub fn parse_bounded(s: &str, max_devices: i64) -> Result<Self> {
        let mut p = Parser {
            s,
            at: 0,
            max_devices,
        };
        let out = p.sharding()?;
        p.ws();
        if p.at != s.len() {
            return Err(p.err("trailing text"));
        }
        Ok(out)
    }
}

struct Parser<'a> {
    s: &'a str,
    at: usize,
    /// Most devices a tile assignment may name.
    max_devices: i64,
}

impl Parser<'_> {
    fn err(&self, what: &str) -> Error {
        Error::invalid_argument(format!(
            "cannot parse sharding {:?}: {what} at byte {}",
            self.s, self.at
        ))
    }

    fn rest(&self) -> &str {
        &self.s[self.at..]
    }

    fn ws(&mut self) {
        let r = self.rest();
        self.at += r.len() - r.trim_start().len();
    }

    fn eat(&mut self, t: &str) -> bool {
        self.ws();
        if self.rest().starts_with(t) {
            self.at += t.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, t: &str) -> Result<()> {
        if self.eat(t) {
            Ok(())
        } else {
            Err(self.err(&format!("expected {t:?}")))
        }
    }

    fn int(&mut self) -> Result<i64> {
        self.ws();
        let n = self
            .rest()
            .bytes()
            .take_while(|b| b.is_ascii_digit())
            .count();
        let v = self.rest()[..n]
            .parse()
            .map_err(|_| self.err("expected a number"))?;
        self.at += n;
        Ok(v)
    }

    fn ints(&mut self, open: &str, close: &str) -> Result<Vec<i64>> {
        self.expect(open)?;
        let mut v = Vec::new();
        if self.eat(close) {
            return Ok(v);
        }
        loop {
            v.push(self.int()?);
            if self.eat(close) {
                return Ok(v);
            }
            self.expect(",")?;
        }
    }

    fn sharding(&mut self) -> Result<HloSharding> {
        self.expect("{")?;
        self.ws();
        if self.rest().starts_with('{') || self.rest().starts_with('}') {
            let mut v = Vec::new();
            while !self.eat("}") {
                if !v.is_empty() {
                    self.expect(",")?;
                }
                v.push(self.sharding()?);
            }
            return Ok(HloSharding::Tuple(v));
        }
        let out = if self.eat("replicated") {
            HloSharding::Replicated
        } else if self.eat("manual") {
            HloSharding::Manual
        } else if self.eat("unreduced") {
            HloSharding::Unreduced
        } else if self.eat("unknown") {
            HloSharding::Unknown
        } else if self.eat("maximal") {
            self.expect("device=")?;
            HloSharding::Maximal {
                device: self.int()?,
            }
        } else if self.eat("devices=") {
            let dims = self.ints("[", "]")?;
            let n = dims.iter().fold(1i64, |a, &d| a.saturating_mul(d.max(0)));
            if n > self.max_devices {
                return Err(self.err(&format!(
                    "a tile assignment of more than {} devices",
                    self.max_devices
                )));
            }
            let tile_assignment = if self.eat("<=") {
                let reshape = self.ints("[", "]")?;
                let perm = if self.eat("T") {
                    self.ints("(", ")")?
                        .into_iter()
                        .map(|x| x as usize)
                        .collect()
                } else {
                    Vec::new()
                };
                TileAssignment::iota(dims, reshape, perm)?
            } else {
                let mut devices = vec![self.int()?];
                while self.eat(",") {
                    devices.push(self.int()?);
                }
                TileAssignment::new(dims, devices)?
            };
            let subgroups = if self.eat("last_tile_dim_replicate") {
                vec![Subgroup::Replicated]
            } else if self.eat("last_tile_dims=") {
                self.expect("{")?;
                let mut v = Vec::new();
                while !self.eat("}") {
                    if !v.is_empty() {
                        self.expect(",")?;
                    }
                    v.push(if self.eat("replicated") {
                        Subgroup::Replicated
                    } else if self.eat("manual") {
                        Subgroup::Manual
                    } else if self.eat("unreduced") {
                        Subgroup::Unreduced
                    } else {
                        return Err(self.err("expected a subgroup type"));
                    });
                }
                v
            } else {
                Vec::new()
            };
            HloSharding::tiled(tile_assignment, subgroups)?
        } else {
            return Err(self.err("expected a sharding"));
        };
        self.expect("}")?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tile assignment is refused by its device count before its devices are listed (an
    /// iota of 2^20 devices in 46 bytes of text took 8 MiB; found by the fuzz target `doors`).
    #[test]
    fn parse_bounded_refuses_more_devices_before_listing_them() {
        let e = HloSharding::parse_bounded("{devices=[1048576]<=[1048576]}", 4096).unwrap_err();
        assert!(e.to_string().contains("more than 4096 devices"), "{e}");
        let e = HloSharding::parse_bounded("{devices=[65536,65536]0}", 4096).unwrap_err();
        assert!(e.to_string().contains("more than 4096 devices"), "{e}");
        assert!(HloSharding::parse_bounded("{devices=[2,2]<=[4]}", 3).is_err());
        assert_eq!(
            HloSharding::parse_bounded("{devices=[2,2]<=[4]}", 4).unwrap(),
            "{devices=[2,2]<=[4]}".parse::<HloSharding>().unwrap()
        );
    }

    fn parse(s: &str) -> HloSharding {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn ranges(s: &HloSharding, global: &[i64], n: usize) -> Vec<(Vec<i64>, Vec<i64>, bool)> {
        s.shards(global, n)
            .unwrap()
            .into_iter()
            .map(|s| (s.start, s.limit, s.primary))
            .collect()
    }

    #[test]
    fn text_round_trips() {
        for s in [
            "{replicated}",
            "{maximal device=2}",
            "{manual}",
            "{unreduced}",
            "{unknown}",
            "{devices=[4,1]0,1,2,3}",
            "{devices=[4,1]<=[4]}",
            "{devices=[2,2]<=[2,2]T(1,0)}",
            "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}",
            "{devices=[2,1,2]<=[4] last_tile_dims={manual}}",
            "{devices=[1,2,2]<=[4] last_tile_dims={replicated, manual}}",
            "{{devices=[4,1]<=[4]}, {replicated}}",
            "{}",
        ] {
            assert_eq!(parse(s).to_string(), s);
        }
        assert_eq!(
            parse("{devices=[2,2]<=[2,2]T(1,0)}"),
            parse("{devices=[2,2]0,2,1,3}")
        );
        assert_eq!(
            parse("{devices=[2,1,2]<=[2,2]T(1,0) last_tile_dims={replicated}}"),
            parse("{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}")
        );
        for bad in [
            "",
            "{",
            "{replicated",
            "{devices=[4,1]0,1,2}",
            "{devices=[2,2]0,1,2,2}",
            "{devices=[0]}",
            "{devices=[4]<=[3]}",
            "{devices=[4]<=[2,2]T(0,0)}",
            "{devices=[2]0,1 last_tile_dims={manual, replicated}}",
            "{maximal}",
            "{replicated} x",
        ] {
            assert_eq!(
                bad.parse::<HloSharding>().unwrap_err().code,
                ErrorCode::InvalidArgument,
                "{bad}"
            );
        }
    }

    #[test]
    fn iota_with_transpose() {
        // [2,3]<=[3,2]T(1,0): iota(6) as 3x2 [[0,1],[2,3],[4,5]], transposed to 2x3
        // [[0,2,4],[1,3,5]].
        let t = TileAssignment::iota(vec![2, 3], vec![3, 2], vec![1, 0]).unwrap();
        assert_eq!(t.devices(), [0, 2, 4, 1, 3, 5]);
        // Three reshape dims, read into a different shape.
        let t = TileAssignment::iota(vec![4, 2], vec![2, 2, 2], vec![2, 0, 1]).unwrap();
        // Source strides [4,2,1]; transposed dims [2,2,2]; element t -> 1*t0 + 4*t1 + 2*t2.
        assert_eq!(t.devices(), [0, 2, 4, 6, 1, 3, 5, 7]);
    }

    #[test]
    fn shards_of_each_kind() {
        let rows = parse("{devices=[4,1]0,1,2,3}");
        assert_eq!(
            ranges(&rows, &[8, 3], 4),
            [
                (vec![0, 0], vec![2, 3], true),
                (vec![2, 0], vec![4, 3], true),
                (vec![4, 0], vec![6, 3], true),
                (vec![6, 0], vec![8, 3], true),
            ]
        );
        assert_eq!(rows.tile_dims(&[8, 3]).unwrap(), [2, 3]);
        // Devices in another order: device 0 holds the last tile.
        let r = ranges(&parse("{devices=[4]3,2,1,0}"), &[8], 4);
        assert_eq!(r[0], (vec![6], vec![8], true));
        assert_eq!(r[3], (vec![0], vec![2], true));
        // 2x2 mesh, the second dim split along the mesh's first axis (T(1,0)).
        let r = ranges(&parse("{devices=[2,2]<=[2,2]T(1,0)}"), &[4, 6], 4);
        assert_eq!(r[0], (vec![0, 0], vec![2, 3], true));
        assert_eq!(r[2], (vec![0, 3], vec![2, 6], true));
        assert_eq!(r[1], (vec![2, 0], vec![4, 3], true));
        assert_eq!(r[3], (vec![2, 3], vec![4, 6], true));
        // Rows split in two, each half replicated on two devices.
        let half = parse("{devices=[2,1,2]<=[4] last_tile_dim_replicate}");
        assert!(half.replicate_on_last_tile_dim());
        assert_eq!(
            ranges(&half, &[4, 2], 4),
            [
                (vec![0, 0], vec![2, 2], true),
                (vec![0, 0], vec![2, 2], false),
                (vec![2, 0], vec![4, 2], true),
                (vec![2, 0], vec![4, 2], false),
            ]
        );
        // Uneven: 5 rows over 4 devices are tiles of 2, the last one empty.
        let r = ranges(&parse("{devices=[4]<=[4]}"), &[5], 4);
        assert_eq!(
            r.iter().map(|(s, l, _)| (s[0], l[0])).collect::<Vec<_>>(),
            [(0, 2), (2, 4), (4, 5), (5, 5)]
        );
        assert_eq!(parse("{devices=[4]<=[4]}").tile_dims(&[5]).unwrap(), [2]);
        // Replicated and maximal: the whole array everywhere, read from one device.
        let r = ranges(&HloSharding::Replicated, &[3], 2);
        assert_eq!(r, [(vec![0], vec![3], true), (vec![0], vec![3], false)]);
        let r = ranges(&HloSharding::Maximal { device: 1 }, &[], 2);
        assert_eq!(r, [(vec![], vec![], false), (vec![], vec![], true)]);
        // Scalars under a tiled sharding of rank 0 plus a replicated subgroup.
        let r = ranges(&parse("{devices=[2]0,1 last_tile_dim_replicate}"), &[], 2);
        assert_eq!(r, [(vec![], vec![], true), (vec![], vec![], false)]);
    }

    #[test]
    fn extract_and_insert_round_trip() {
        // A 5x3 array of u16 over a 2x2 tiling: tiles of 3x2, padded on the bottom and right.
        let global: Vec<u8> = (0..15u16).flat_map(|x| x.to_le_bytes()).collect();
        let s = parse("{devices=[2,2]<=[4]}");
        let tile = s.tile_dims(&[5, 3]).unwrap();
        assert_eq!(tile, [3, 2]);
        let shards = s.shards(&[5, 3], 4).unwrap();
        let bufs: Vec<Vec<u8>> = shards
            .iter()
            .map(|sh| sh.extract(&global, &[5, 3], 2, &tile).unwrap())
            .collect();
        let u16s = |b: &[u8]| -> Vec<u16> {
            b.chunks(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        assert_eq!(u16s(&bufs[0]), [0, 1, 3, 4, 6, 7]);
        assert_eq!(u16s(&bufs[1]), [2, 0, 5, 0, 8, 0]);
        assert_eq!(u16s(&bufs[2]), [9, 10, 12, 13, 0, 0]);
        assert_eq!(u16s(&bufs[3]), [11, 0, 14, 0, 0, 0]);
        let mut back = vec![0xffu8; global.len()];
        for (sh, b) in shards.iter().zip(&bufs) {
            sh.insert(b, &tile, &mut back, &[5, 3], 2).unwrap();
        }
        assert_eq!(back, global);
        // A scalar, and an empty shard.
        let one = HloSharding::Replicated.shards(&[], 1).unwrap().remove(0);
        assert_eq!(one.extract(&[7, 8], &[], 2, &[]).unwrap(), [7, 8]);
        let r = parse("{devices=[4]<=[4]}").shards(&[3], 4).unwrap();
        assert_eq!(r[3].dims(), [0]);
        assert_eq!(r[3].extract(&[1, 2, 3], &[3], 1, &[1]).unwrap(), [0]);
        // Mismatches.
        let sh = &shards[0];
        assert!(sh.extract(&global[1..], &[5, 3], 2, &tile).is_err());
        assert!(sh.extract(&global, &[5, 3], 2, &[2, 2]).is_err());
        assert!(sh.extract(&global, &[15], 2, &[15]).is_err());
        let mut g = global.clone();
        assert!(sh.insert(&bufs[0][2..], &tile, &mut g, &[5, 3], 2).is_err());
    }

    #[test]
    fn shards_refuse_what_does_not_fit() {
        let rows = parse("{devices=[4,1]0,1,2,3}");
        let code = |r: Result<Vec<Shard>>| r.unwrap_err().code;
        assert_eq!(code(rows.shards(&[8], 4)), ErrorCode::InvalidArgument);
        assert_eq!(code(rows.shards(&[8, 3], 2)), ErrorCode::InvalidArgument);
        assert_eq!(code(rows.shards(&[8, 3], 8)), ErrorCode::InvalidArgument);
        assert_eq!(code(rows.shards(&[-1, 3], 4)), ErrorCode::InvalidArgument);
        assert_eq!(code(rows.shards(&[8, 3], 0)), ErrorCode::InvalidArgument);
        let max = HloSharding::Maximal { device: 4 };
        assert_eq!(code(max.shards(&[1], 4)), ErrorCode::InvalidArgument);
        for s in ["{manual}", "{unreduced}", "{unknown}", "{{replicated}}"] {
            assert_eq!(
                code(parse(s).shards(&[1], 4)),
                ErrorCode::Unimplemented,
                "{s}"
            );
        }
    }

    #[test]
    fn decodes_protos() {
        let p = OpShardingProto {
            r#type: OTHER,
            tile_assignment_dimensions: vec![2, 1, 2],
            iota_reshape_dims: vec![2, 2],
            iota_transpose_perm: vec![1, 0],
            replicate_on_last_tile_dim: true,
            ..Default::default()
        };
        let s = HloSharding::from_proto(&p).unwrap();
        assert_eq!(
            s.to_string(),
            "{devices=[2,1,2]<=[2,2]T(1,0) last_tile_dim_replicate}"
        );
        let t = OpShardingProto {
            r#type: TUPLE,
            tuple_shardings: vec![
                p.clone(),
                OpShardingProto {
                    r#type: MAXIMAL,
                    tile_assignment_devices: vec![3],
                    ..Default::default()
                },
                OpShardingProto {
                    r#type: OTHER,
                    tile_assignment_dimensions: vec![2, 2],
                    tile_assignment_devices: vec![0, 1, 2, 3],
                    last_tile_dims: vec![MANUAL],
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        assert_eq!(
            HloSharding::from_proto(&t).unwrap().to_string(),
            "{{devices=[2,1,2]<=[2,2]T(1,0) last_tile_dim_replicate}, {maximal device=3}, \
             {devices=[2,2]0,1,2,3 last_tile_dims={manual}}}"
        );
        let bad = [
            OpShardingProto {
                r#type: 9,
                ..Default::default()
            },
            OpShardingProto {
                r#type: MAXIMAL,
                ..Default::default()
            },
            OpShardingProto {
                r#type: OTHER,
                tile_assignment_dimensions: vec![2],
                tile_assignment_devices: vec![0],
                ..Default::default()
            },
            OpShardingProto {
                r#type: OTHER,
                tile_assignment_dimensions: vec![2],
                iota_reshape_dims: vec![2],
                iota_transpose_perm: vec![-1],
                ..Default::default()
            },
        ];
        for b in bad {
            assert_eq!(
                HloSharding::from_proto(&b).unwrap_err().code,
                ErrorCode::InvalidArgument,
                "{b:?}"
            );
        }
        let named = OpShardingProto {
            named_sharding: Some(vec![]),
            ..Default::default()
        };
        assert_eq!(
            HloSharding::from_proto(&named).unwrap_err().code,
            ErrorCode::Unimplemented
        );
    }
}
