//! Process groups: collectives over the buffers of several sessions of one tenant, each on its
//! own device, run as one SPMD program on the daemon (what `torch.distributed` ranks do, one
//! process per device, each process a session).
//!
//! A group is made by one rank ([`Groups::create`]: its size and timeout; the daemon hands out
//! its id), and every rank, the creator included, joins it with its rank number
//! ([`crate::session::Session::join_group`]): each rank's device is its session's default
//! device, and no two ranks may share one. Ranks then call collectives in the same order, as
//! PyTorch requires; the n-th collective of every rank makes round n. When the last rank of a
//! round arrives, the daemon checks that all asked the same thing (the collective, the
//! reduction, dtype and dims) and runs one program over the ranks' devices whose partition k
//! takes rank k's tensor and gives rank k's result ([`program_text`]: StableHLO with Shardy's
//! `manual_computation`, the form `jax.shard_map` lowers to). Nothing passes through the host.
//!
//! The tenant rules:
//! - A group belongs to its creator's tenant: an id is found only by sessions of that tenant
//!   ([`Groups::find`]; another tenant gets the same `not-found` as for an id that never
//!   existed), at most [`MAX_GROUPS_PER_TENANT`] groups live per tenant, and a group has at
//!   most as many ranks as the tenant may use devices (the door says how many).
//! - Each rank's results are charged to the tenant on its own device before the program runs.
//! - A round waits at most the group's timeout (PyTorch's `timeout=`) for its last rank; then
//!   every rank waiting in it fails (`failed-precondition`, naming the collective and the ranks
//!   that never arrived) and the group is broken: every later collective fails at once, as
//!   PyTorch's process groups abort after a timeout. A rank whose session ends breaks the group
//!   the same way, so the others do not wait out the timeout for a rank that is gone.
//! - A group is forgotten when its last member's session ends.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use pjrt::{PrimitiveType, TensorSpec};
use tokio::sync::oneshot;

use crate::device::{CompileSettings, DeviceService};
use crate::error::{DeviceError, DeviceResult, ErrorKind};
use crate::tenant::{Charge, Tenant};
use crate::types::{DeviceExecutable, DeviceTensor};

/// Most ranks in a group.
pub const MAX_GROUP_SIZE: u32 = 1024;
/// Most groups one tenant has at once.
pub const MAX_GROUPS_PER_TENANT: usize = 64;
/// Longest timeout a group may ask for (PyTorch's default is 10 minutes for gloo, 30 for
/// NCCL's watchdog).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// A reduction, as `torch.distributed.ReduceOp` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Sum divided by the group's size (floating-point dtypes only).
    Avg,
    /// Element-wise product.
    Product,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
}

impl ReduceOp {
    /// Parses `sum`, `avg`, `product`, `min`, `max` (any case).
    pub fn parse(s: &str) -> DeviceResult<ReduceOp> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "avg" => ReduceOp::Avg,
            "product" | "prod" => ReduceOp::Product,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            _ => {
                return Err(DeviceError::invalid(format!(
                    "unknown reduction {s:?} (sum, avg, product, min, max)"
                )));
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    fn combiner(self) -> &'static str {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => "add",
            ReduceOp::Product => "multiply",
            ReduceOp::Min => "minimum",
            ReduceOp::Max => "maximum",
        }
    }
}

/// One collective of a round. Every rank gives one tensor (none for a barrier) and gets one.
/// With `n` ranks and a rank's tensor of dims `[d0, ..]` (rank 1 at least):
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Collective {
    /// The reduction of the ranks' tensors, on every rank (same dims).
    AllReduce(ReduceOp),
    /// Rank `root`'s tensor, on every rank.
    Broadcast {
        /// The rank whose tensor every rank gets.
        root: u32,
    },
    /// The ranks' tensors concatenated along dimension 0 in rank order: `[n·d0, ..]`.
    AllGather,
    /// The reduction of the ranks' tensors, split along dimension 0 in `n` equal parts; rank
    /// `k` gets part `k`: `[d0/n, ..]` (`d0` a multiple of `n`).
    ReduceScatter(ReduceOp),
    /// Each rank's tensor split along dimension 0 in `n` equal parts; rank `k` gets part `k` of
    /// every rank, concatenated in rank order (same dims; `d0` a multiple of `n`).
    AllToAll,
    /// No tensor: every rank waits for all the others.
    Barrier,
    /// This rank's tensor to rank `peer`'s matching [`Collective::Recv`] (same `tag`): queued
    /// at once (the sender does not wait), copied device to device when the receiver comes.
    /// Not a round: point-to-point calls match by (sender, receiver, tag), in order.
    Send {
        /// The receiving rank.
        peer: u32,
        /// Matches a receive of the same tag.
        tag: i64,
    },
    /// The tensor rank `peer` sent with the same `tag`, on this rank's device; the given
    /// tensor says the dtype and dims expected.
    Recv {
        /// The sending rank.
        peer: u32,
        /// Matches a send of the same tag.
        tag: i64,
    },
}

impl Collective {
    /// The name PyTorch gives it (`all_reduce(sum)`, `broadcast(root 2)`, ...).
    pub fn describe(&self) -> String {
        match self {
            Collective::AllReduce(op) => format!("all_reduce({})", op.name()),
            Collective::Broadcast { root } => format!("broadcast(root {root})"),
            Collective::AllGather => "all_gather".into(),
            Collective::ReduceScatter(op) => format!("reduce_scatter({})", op.name()),
            Collective::AllToAll => "all_to_all".into(),
            Collective::Barrier => "barrier".into(),
            Collective::Send { peer, tag } => format!("send(to rank {peer}, tag {tag})"),
            Collective::Recv { peer, tag } => format!("recv(from rank {peer}, tag {tag})"),
        }
    }

    fn reduce_op(&self) -> Option<ReduceOp> {
        match self {
            Collective::AllReduce(op) | Collective::ReduceScatter(op) => Some(*op),
            _ => None,
        }
    }
}

/// The dims of each rank's result for `what` on a rank tensor of `dims` in a group of `n`.
///
/// Errors: `invalid-argument` for a tensor of rank 0 (reshape it to `[1]`), a first dimension
/// that `n` does not divide where the collective splits it, `avg` of an integer dtype, a
/// reduction of booleans or complex numbers other than a sum, a root outside the group.
pub fn result_dims(what: &Collective, spec: &TensorSpec, n: u32) -> DeviceResult<Vec<i64>> {
    let dims = &spec.dims;
    if dims.is_empty() {
        return Err(DeviceError::invalid(format!(
            "{} of a tensor of rank 0: give it dims [1]",
            what.describe()
        )));
    }
    let n64 = i64::from(n);
    if let Some(op) = what.reduce_op() {
        let float = matches!(
            spec.ty,
            PrimitiveType::F16 | PrimitiveType::Bf16 | PrimitiveType::F32 | PrimitiveType::F64
        );
        if op == ReduceOp::Avg && !float {
            return Err(DeviceError::invalid(format!(
                "avg of {} tensors: avg is for floating-point dtypes",
                spec.ty.name()
            )));
        }
        if matches!(
            spec.ty,
            PrimitiveType::Pred | PrimitiveType::C64 | PrimitiveType::C128
        ) && op != ReduceOp::Sum
        {
            return Err(DeviceError::invalid(format!(
                "{} of {} tensors is not supported",
                what.describe(),
                spec.ty.name()
            )));
        }
    }
    let mut out = dims.clone();
    match what {
        Collective::AllReduce(_)
        | Collective::Barrier
        | Collective::Send { .. }
        | Collective::Recv { .. } => {}
        Collective::Broadcast { root } => {
            if *root >= n {
                return Err(DeviceError::invalid(format!(
                    "broadcast from rank {root} in a group of {n}"
                )));
            }
        }
        Collective::AllGather => {
            out[0] = dims[0].checked_mul(n64).ok_or_else(|| {
                DeviceError::invalid("all_gather: the gathered dimension overflows")
            })?;
        }
        Collective::ReduceScatter(_) | Collective::AllToAll => {
            if dims[0] % n64 != 0 {
                return Err(DeviceError::invalid(format!(
                    "{} of dims {:?}: the first dimension must be a multiple of the group's size ({n})",
                    what.describe(),
                    dims
                )));
            }
            if matches!(what, Collective::ReduceScatter(_)) {
                out[0] = dims[0] / n64;
            }
        }
    }
    Ok(out)
}

fn tensor_type(ty: PrimitiveType, dims: &[i64]) -> String {
    let mut s = String::from("tensor<");
    for d in dims {
        s.push_str(&format!("{d}x"));
    }
    s.push_str(ty.mlir_name());
    s.push('>');
    s
}

/// The StableHLO text of `what` over `n` devices for rank tensors of `spec`: the global array
/// is the ranks' tensors stacked along dimension 0, sharded over a mesh axis `x` of `n`, and
/// the body runs per device in a Shardy `manual_computation` (what `jax.shard_map` lowers to),
/// with `stablehlo` collectives over all `n` partitions (`use_global_device_ids`).
///
/// Errors: as [`result_dims`]; `invalid-argument` for a barrier (it runs no program).
pub fn program_text(what: &Collective, spec: &TensorSpec, n: u32) -> DeviceResult<String> {
    if matches!(
        what,
        Collective::Barrier | Collective::Send { .. } | Collective::Recv { .. }
    ) {
        return Err(DeviceError::invalid(format!(
            "{} runs no program",
            what.describe()
        )));
    }
    let out_dims = result_dims(what, spec, n)?;
    let n64 = i64::from(n);
    let ty = spec.ty;
    let elem = ty.mlir_name();
    let local_in = tensor_type(ty, &spec.dims);
    let local_out = tensor_type(ty, &out_dims);
    let mut global_in_dims = spec.dims.clone();
    global_in_dims[0] *= n64;
    let mut global_out_dims = out_dims.clone();
    global_out_dims[0] *= n64;
    let global_in = tensor_type(ty, &global_in_dims);
    let global_out = tensor_type(ty, &global_out_dims);
    let rest = ", {}".repeat(spec.dims.len() - 1);
    let sharding = format!("[{{\"x\"}}{rest}]");
    let groups = format!(
        "dense<[[{}]]> : tensor<1x{n}xi64>",
        (0..n).map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
    );
    let channel = "channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>";
    let reducer = |op: ReduceOp| {
        format!(
            "({{\n      ^bb0(%x: tensor<{elem}>, %y: tensor<{elem}>):\n        %s = stablehlo.{} %x, %y : tensor<{elem}>\n        stablehlo.return %s : tensor<{elem}>\n      }})",
            op.combiner()
        )
    };
    let average = |value: &str, op: ReduceOp| -> (String, String) {
        if op != ReduceOp::Avg {
            return (String::new(), value.to_string());
        }
        (
            format!(
                "      %n = stablehlo.constant dense<{n}.0> : {local_out}\n      %avg = stablehlo.divide {value}, %n : {local_out}\n"
            ),
            "%avg".to_string(),
        )
    };
    let body = match what {
        Collective::AllReduce(op) => {
            let (tail, result) = average("%r", *op);
            format!(
                "      %r = \"stablehlo.all_reduce\"(%arg1) <{{{channel}, replica_groups = {groups}, use_global_device_ids}}> {} : ({local_in}) -> {local_out}\n{tail}      sdy.return {result} : {local_out}\n",
                reducer(*op)
            )
        }
        Collective::ReduceScatter(op) => {
            let (tail, result) = average("%r", *op);
            format!(
                "      %r = \"stablehlo.reduce_scatter\"(%arg1) <{{{channel}, replica_groups = {groups}, scatter_dimension = 0 : i64, use_global_device_ids}}> {} : ({local_in}) -> {local_out}\n{tail}      sdy.return {result} : {local_out}\n",
                reducer(*op)
            )
        }
        Collective::AllGather => format!(
            "      %r = \"stablehlo.all_gather\"(%arg1) <{{all_gather_dim = 0 : i64, {channel}, replica_groups = {groups}, use_global_device_ids}}> : ({local_in}) -> {local_out}\n      sdy.return %r : {local_out}\n"
        ),
        Collective::Broadcast { root } => {
            let mut gathered = spec.dims.clone();
            gathered[0] *= n64;
            let gathered_ty = tensor_type(ty, &gathered);
            let d0 = spec.dims[0];
            let start: Vec<String> = std::iter::once((i64::from(*root) * d0).to_string())
                .chain(spec.dims[1..].iter().map(|_| "0".to_string()))
                .collect();
            let limit: Vec<String> = std::iter::once((i64::from(*root) * d0 + d0).to_string())
                .chain(spec.dims[1..].iter().map(|d| d.to_string()))
                .collect();
            let strides = vec!["1"; spec.dims.len()].join(", ");
            format!(
                "      %g = \"stablehlo.all_gather\"(%arg1) <{{all_gather_dim = 0 : i64, {channel}, replica_groups = {groups}, use_global_device_ids}}> : ({local_in}) -> {gathered_ty}\n      %r = \"stablehlo.slice\"(%g) <{{start_indices = array<i64: {}>, limit_indices = array<i64: {}>, strides = array<i64: {strides}>}}> : ({gathered_ty}) -> {local_out}\n      sdy.return %r : {local_out}\n",
                start.join(", "),
                limit.join(", ")
            )
        }
        Collective::AllToAll => format!(
            "      %r = \"stablehlo.all_to_all\"(%arg1) <{{{channel}, concat_dimension = 0 : i64, replica_groups = {groups}, split_count = {n} : i64, split_dimension = 0 : i64}}> : ({local_in}) -> {local_out}\n      sdy.return %r : {local_out}\n"
        ),
        Collective::Barrier | Collective::Send { .. } | Collective::Recv { .. } => {
            unreachable!("refused above")
        }
    };
    Ok(format!(
        "module @collective attributes {{mhlo.num_partitions = {n} : i32, mhlo.num_replicas = 1 : i32}} {{\n  sdy.mesh @mesh = <[\"x\"={n}]>\n  func.func public @main(%arg0: {global_in} {{sdy.sharding = #sdy.sharding<@mesh, {sharding}>}}) -> ({global_out} {{sdy.sharding = #sdy.sharding<@mesh, {sharding}>}}) {{\n    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, {sharding}>] out_shardings=[<@mesh, {sharding}>] manual_axes={{\"x\"}} (%arg1: {local_in}) {{\n{body}    }} : ({global_in}) -> {global_out}\n    return %0 : {global_out}\n  }}\n}}\n"
    ))
}

/// What a rank gets back from a round: its result and the charge for it (none for a barrier).
pub(crate) type RankResult = DeviceResult<Option<(DeviceTensor, Charge)>>;

/// The first part of a [`DeviceTensor`]'s result reply: the tensor, before its charge joins it.
type Reply = DeviceResult<Option<DeviceTensor>>;

struct Entry {
    what: Collective,
    spec: Option<TensorSpec>,
    tensor: Option<Arc<DeviceTensor>>,
    reply: oneshot::Sender<DeviceResult<Option<DeviceTensor>>>,
}

struct Round {
    entries: Vec<Option<Entry>>,
    arrived: u32,
}

/// A point-to-point call waiting for its match, by (sender, receiver, tag).
enum P2p {
    /// A send's tensor.
    Sent(Arc<DeviceTensor>),
    /// A receive: the spec it expects, and where its tensor goes.
    Waiting(TensorSpec, oneshot::Sender<Reply>),
}

/// Most sends queued, unmatched, from one rank to another.
pub const MAX_QUEUED_SENDS: usize = 64;

struct State {
    /// Each rank's device once joined.
    devices: Vec<Option<u32>>,
    /// Unmatched point-to-point calls.
    p2p: HashMap<(u32, u32, i64), std::collections::VecDeque<P2p>>,
    /// Each rank's next round.
    next: Vec<u64>,
    rounds: BTreeMap<u64, Round>,
    broken: Option<String>,
    /// Ranks whose membership is alive (joined, session not ended).
    members: u32,
}

/// A process group; see the module docs.
pub struct Group {
    id: String,
    /// The tenant's name: only its sessions find the group.
    tenant: String,
    size: u32,
    timeout: Duration,
    state: Mutex<State>,
    programs: Mutex<HashMap<(Collective, TensorSpec), Arc<DeviceExecutable>>>,
    groups: Weak<GroupsInner>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("id", &self.id)
            .field("size", &self.size)
            .finish()
    }
}

impl Group {
    /// The id the daemon handed out.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Number of ranks.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// How long a round waits for its last rank.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Records `rank` on `device`. Errors: `invalid-argument` for a rank outside the group;
    /// `failed-precondition` for a rank already joined, a device another rank has, or a broken
    /// group.
    pub(crate) fn join(self: &Arc<Self>, rank: u32, device: u32) -> DeviceResult<Membership> {
        if rank >= self.size {
            return Err(DeviceError::invalid(format!(
                "rank {rank} in a group of {}",
                self.size
            )));
        }
        let mut st = self.state.lock().expect("group lock");
        if let Some(why) = &st.broken {
            return Err(precondition(format!("the group is broken: {why}")));
        }
        if st.devices[rank as usize].is_some() {
            return Err(precondition(format!(
                "rank {rank} has already joined the group"
            )));
        }
        if let Some(other) = st.devices.iter().position(|d| *d == Some(device)) {
            return Err(precondition(format!(
                "rank {rank}'s device {device} is rank {other}'s already: each rank needs a device of its own"
            )));
        }
        st.devices[rank as usize] = Some(device);
        st.members += 1;
        Ok(Membership {
            group: Arc::clone(self),
            rank,
            device,
        })
    }

    fn leave(&self, rank: u32) {
        let mut st = self.state.lock().expect("group lock");
        st.members = st.members.saturating_sub(1);
        let last = st.members == 0;
        self.break_locked(&mut st, format!("rank {rank}'s session ended"));
        drop(st);
        if last && let Some(groups) = self.groups.upgrade() {
            groups.remove(&self.id);
        }
    }

    /// Marks the group broken (once) and fails every rank waiting in a round.
    fn break_locked(&self, st: &mut State, why: String) {
        if st.broken.is_none() {
            st.broken = Some(why.clone());
        }
        let why = st.broken.clone().unwrap_or(why);
        for (_, round) in std::mem::take(&mut st.rounds) {
            for e in round.entries.into_iter().flatten() {
                let _ = e
                    .reply
                    .send(Err(precondition(format!("the group is broken: {why}"))));
            }
        }
        for (_, queue) in std::mem::take(&mut st.p2p) {
            for p in queue {
                if let P2p::Waiting(_, reply) = p {
                    let _ = reply.send(Err(precondition(format!("the group is broken: {why}"))));
                }
            }
        }
    }

    /// The rank's tensor arrives for its next round; returns the receiver of its result, and
    /// the round's entries when it was the last to arrive (the caller then runs the round).
    fn arrive(
        &self,
        rank: u32,
        what: Collective,
        tensor: Option<Arc<DeviceTensor>>,
    ) -> DeviceResult<(u64, oneshot::Receiver<Reply>, Option<Vec<Entry>>)> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.state.lock().expect("group lock");
        if let Some(why) = &st.broken {
            return Err(precondition(format!("the group is broken: {why}")));
        }
        let joined = st.devices.iter().filter(|d| d.is_some()).count() as u32;
        if joined < self.size {
            return Err(precondition(format!(
                "{} before every rank joined the group ({joined} of {})",
                what.describe(),
                self.size
            )));
        }
        let n = st.next[rank as usize];
        st.next[rank as usize] += 1;
        let size = self.size as usize;
        let round = st.rounds.entry(n).or_insert_with(|| Round {
            entries: (0..size).map(|_| None).collect(),
            arrived: 0,
        });
        round.entries[rank as usize] = Some(Entry {
            what,
            spec: tensor.as_ref().map(|t| t.spec().clone()),
            tensor,
            reply: tx,
        });
        round.arrived += 1;
        let done = if round.arrived == self.size {
            st.rounds
                .remove(&n)
                .map(|r| r.entries.into_iter().flatten().collect())
        } else {
            None
        };
        Ok((n, rx, done))
    }

    /// A send from `from` to `to` arrives: handed to a waiting receive (copied to its
    /// device), or queued. Errors: a broken group, a peer outside the group or the rank
    /// itself, [`MAX_QUEUED_SENDS`] unmatched, a receive expecting another spec.
    fn send(
        &self,
        device: &DeviceService,
        from: u32,
        to: u32,
        tag: i64,
        tensor: Arc<DeviceTensor>,
    ) -> DeviceResult<()> {
        let mut st = self.state.lock().expect("group lock");
        self.check_peer(&st, from, to)?;
        let dest = st.devices[to as usize].unwrap_or(0);
        let queue = st.p2p.entry((from, to, tag)).or_default();
        if matches!(queue.front(), Some(P2p::Waiting(..))) {
            let Some(P2p::Waiting(spec, reply)) = queue.pop_front() else {
                unreachable!("checked above")
            };
            drop(st);
            if &spec != tensor.spec() {
                let msg = format!(
                    "rank {from} sent {} and rank {to} expects {spec} (tag {tag})",
                    tensor.spec()
                );
                let _ = reply.send(Err(DeviceError::invalid(msg.clone())));
                return Err(DeviceError::invalid(msg));
            }
            let _ = reply.send(device.copy_to_device(&tensor, dest).map(Some));
            return Ok(());
        }
        if queue.len() >= MAX_QUEUED_SENDS {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "{MAX_QUEUED_SENDS} sends from rank {from} to rank {to} wait unreceived (tag {tag})"
                ),
            ));
        }
        queue.push_back(P2p::Sent(tensor));
        Ok(())
    }

    /// A receive of `to` from `from`: a queued send's tensor copied to `to`'s device, or the
    /// receiver of it once it comes.
    fn recv(
        &self,
        device: &DeviceService,
        from: u32,
        to: u32,
        tag: i64,
        spec: TensorSpec,
    ) -> DeviceResult<oneshot::Receiver<Reply>> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.state.lock().expect("group lock");
        self.check_peer(&st, to, from)?;
        let dest = st.devices[to as usize].unwrap_or(0);
        let queue = st.p2p.entry((from, to, tag)).or_default();
        if matches!(queue.front(), Some(P2p::Sent(_))) {
            let Some(P2p::Sent(tensor)) = queue.pop_front() else {
                unreachable!("checked above")
            };
            drop(st);
            if &spec != tensor.spec() {
                return Err(DeviceError::invalid(format!(
                    "rank {from} sent {} and rank {to} expects {spec} (tag {tag})",
                    tensor.spec()
                )));
            }
            let _ = tx.send(device.copy_to_device(&tensor, dest).map(Some));
            return Ok(rx);
        }
        queue.push_back(P2p::Waiting(spec, tx));
        Ok(rx)
    }

    fn check_peer(&self, st: &State, me: u32, peer: u32) -> DeviceResult<()> {
        if let Some(why) = &st.broken {
            return Err(precondition(format!("the group is broken: {why}")));
        }
        if peer >= self.size || peer == me {
            return Err(DeviceError::invalid(format!(
                "rank {me} cannot exchange with rank {peer} in a group of {}",
                self.size
            )));
        }
        if st.devices[peer as usize].is_none() {
            return Err(precondition(format!(
                "rank {peer} has not joined the group"
            )));
        }
        Ok(())
    }

    /// Fails round `n` for a timeout, naming the ranks that never arrived, and breaks the
    /// group; returns why, or None when the round is no longer waiting (it ran meanwhile, or
    /// the group broke: the rank's reply is sent).
    fn time_out(&self, n: u64, what: &Collective) -> Option<String> {
        let mut st = self.state.lock().expect("group lock");
        let missing: Vec<usize> = {
            let r = st.rounds.get(&n)?;
            (0..r.entries.len())
                .filter(|&k| r.entries[k].is_none())
                .collect()
        };
        let why = format!(
            "collective #{n} ({}) timed out after {:.1} s: rank(s) {missing:?} never arrived",
            what.describe(),
            self.timeout.as_secs_f64()
        );
        self.break_locked(&mut st, why.clone());
        Some(why)
    }

    /// Runs a complete round: checks every rank asked the same, then the program.
    async fn run(&self, device: &Arc<DeviceService>, tenant: &Arc<Tenant>, entries: Vec<Entry>) {
        let first = (entries[0].what, entries[0].spec.clone());
        if let Some((k, e)) = entries
            .iter()
            .enumerate()
            .find(|(_, e)| (e.what, e.spec.clone()) != first)
        {
            let show = |w: &Collective, s: &Option<TensorSpec>| match s {
                Some(s) => format!("{} of {}{:?}", w.describe(), s.ty.name(), s.dims),
                None => w.describe(),
            };
            let msg = format!(
                "the ranks disagree: rank 0 called {}, rank {k} called {}",
                show(&first.0, &first.1),
                show(&e.what, &e.spec)
            );
            for e in entries {
                let _ = e.reply.send(Err(DeviceError::invalid(msg.clone())));
            }
            return;
        }
        let what = first.0;
        let Some(spec) = first.1 else {
            for e in entries {
                let _ = e.reply.send(Ok(None));
            }
            return;
        };
        match self.execute(device, tenant, what, &spec, &entries).await {
            Ok(outputs) => {
                for (e, out) in entries.into_iter().zip(outputs) {
                    let _ = e.reply.send(Ok(Some(out)));
                }
            }
            Err(err) => {
                for e in entries {
                    let _ = e.reply.send(Err(err.clone()));
                }
            }
        }
    }

    async fn program(
        &self,
        device: &Arc<DeviceService>,
        tenant: &Tenant,
        what: Collective,
        spec: &TensorSpec,
        devices: &[u32],
    ) -> DeviceResult<Arc<DeviceExecutable>> {
        let key = (what, spec.clone());
        if let Some(p) = self.programs.lock().expect("programs lock").get(&key) {
            return Ok(Arc::clone(p));
        }
        let text = program_text(&what, spec, self.size)?;
        let settings = CompileSettings {
            device: devices[0],
            devices: devices.to_vec(),
            ..Default::default()
        };
        let exe = device
            .compile_for(text.into_bytes(), true, settings, tenant)
            .await?
            .exe;
        self.programs
            .lock()
            .expect("programs lock")
            .insert(key, Arc::clone(&exe));
        Ok(exe)
    }

    /// Runs the round's program; its launch, compile and slots are the last rank's (its
    /// session's tenant), each rank's result was charged by that rank before it arrived.
    async fn execute(
        &self,
        device: &Arc<DeviceService>,
        tenant: &Arc<Tenant>,
        what: Collective,
        spec: &TensorSpec,
        entries: &[Entry],
    ) -> DeviceResult<Vec<DeviceTensor>> {
        let devices: Vec<u32> = {
            let st = self.state.lock().expect("group lock");
            st.devices.iter().map(|d| d.unwrap_or(0)).collect()
        };
        let program = self.program(device, tenant, what, spec, &devices).await?;
        let mut order: Vec<usize> = (0..devices.len()).collect();
        order.sort_by_key(|&k| devices[k]);
        let mut slots = Vec::with_capacity(devices.len());
        for k in order {
            slots.push(device.scheduler_for(devices[k]).acquire(tenant).await);
        }
        let held: Vec<Box<dyn std::any::Any + Send>> = vec![Box::new(tenant.charge_launch()?)];
        let args: Vec<Vec<Arc<DeviceTensor>>> = entries
            .iter()
            .map(|e| e.tensor.iter().cloned().collect())
            .collect();
        let outputs = device
            .execute_spmd(program, args, Vec::new(), slots, held)
            .await?;
        Ok(outputs
            .into_iter()
            .map(|mut per_device| per_device.remove(0))
            .collect())
    }
}

/// A session's membership of a group: dropped when the session ends, which breaks the group
/// (its other ranks stop waiting) and forgets it after its last member.
#[derive(Debug)]
pub struct Membership {
    group: Arc<Group>,
    rank: u32,
    device: u32,
}

impl Membership {
    /// The group.
    pub fn group(&self) -> &Arc<Group> {
        &self.group
    }

    /// This member's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// This member's device.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Runs this rank's next collective on `tensor` (none for a barrier), waiting for every
    /// rank at most the group's timeout; returns its result and the charge for it.
    ///
    /// Errors: `failed-precondition` for a broken group, a rank missing when the timeout
    /// passes (the group breaks), or a tensor on another device than this rank's;
    /// `invalid-argument` when the ranks disagree or the collective does not fit the tensor
    /// ([`result_dims`]); `resource-exhausted` naming the tenant's limit the results would
    /// pass; the device's errors.
    pub(crate) async fn run(
        &self,
        device: &Arc<DeviceService>,
        tenant: &Arc<Tenant>,
        what: Collective,
        tensor: Option<Arc<DeviceTensor>>,
    ) -> RankResult {
        let mut charge = None;
        if tensor.is_none() && what != Collective::Barrier {
            return Err(DeviceError::invalid(format!(
                "{} needs a tensor",
                what.describe()
            )));
        }
        if let Some(t) = &tensor {
            if t.device() != self.device {
                return Err(precondition(format!(
                    "rank {}'s tensor is on device {}, and the rank's device is {}",
                    self.rank,
                    t.device(),
                    self.device
                )));
            }
            let out = TensorSpec {
                ty: t.spec().ty,
                dims: result_dims(&what, t.spec(), self.group.size)?,
            };
            // This rank's result (a send has none), charged to its own session before
            // anything runs.
            if !matches!(what, Collective::Send { .. }) {
                let bytes = out
                    .byte_len()
                    .ok_or_else(|| DeviceError::invalid("the result's size overflows"))?;
                let (mut c, _scratch) =
                    tenant.charge_execution(self.device, &[bytes as u64], 0, 0)?;
                charge = c.pop();
            }
        }
        match what {
            Collective::Send { peer, tag } => {
                let t = tensor.ok_or_else(|| DeviceError::invalid("send needs a tensor"))?;
                self.group.send(device, self.rank, peer, tag, t)?;
                return Ok(None);
            }
            Collective::Recv { peer, tag } => {
                let spec = tensor
                    .as_ref()
                    .map(|t| t.spec().clone())
                    .ok_or_else(|| DeviceError::invalid("recv needs the tensor it fills"))?;
                let mut rx = self.group.recv(device, peer, self.rank, tag, spec)?;
                return match tokio::time::timeout(self.group.timeout, &mut rx).await {
                    Ok(Ok(r)) => Ok(r?.zip(charge)),
                    Ok(Err(_)) => Err(DeviceError::new(
                        ErrorKind::Internal,
                        "the receive was dropped",
                    )),
                    Err(_) => Err(precondition(format!(
                        "{} timed out after {:.1} s",
                        what.describe(),
                        self.group.timeout.as_secs_f64()
                    ))),
                };
            }
            _ => {}
        }
        let (n, rx, done) = self.group.arrive(self.rank, what, tensor)?;
        if let Some(entries) = done {
            self.group.run(device, tenant, entries).await;
        }
        let mut rx = rx;
        let reply = match tokio::time::timeout(self.group.timeout, &mut rx).await {
            Ok(reply) => reply,
            Err(_) => match self.group.time_out(n, &what) {
                Some(why) => return Err(precondition(why)),
                // Answered meanwhile (it ran, or the group broke): take that answer.
                None => rx.await,
            },
        };
        match reply {
            Ok(result) => Ok(result?.zip(charge)),
            Err(_) => Err(DeviceError::new(
                ErrorKind::Internal,
                "the collective's round was dropped",
            )),
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.group.leave(self.rank);
    }
}

fn precondition(msg: String) -> DeviceError {
    DeviceError::new(ErrorKind::FailedPrecondition, msg)
}

struct GroupsInner {
    map: Mutex<HashMap<String, Arc<Group>>>,
}

impl GroupsInner {
    fn remove(&self, id: &str) {
        self.map.lock().expect("groups lock").remove(id);
    }
}

/// The daemon's process groups (one for all its sessions: [`crate::session::Session::with_groups`]);
/// see the module docs.
pub struct Groups {
    inner: Arc<GroupsInner>,
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups")
            .field("live", &self.live())
            .finish()
    }
}

impl Default for Groups {
    fn default() -> Self {
        Groups {
            inner: Arc::new(GroupsInner {
                map: Mutex::new(HashMap::new()),
            }),
        }
    }
}

impl Groups {
    /// Makes a group of `size` ranks for `tenant`, whose sessions may use `allowed_devices`
    /// devices; returns it (its id is 128 random bits in hex). Nobody is a member yet: the
    /// session layer joins its creator at once ([`crate::session::Session::create_group`]),
    /// so that every group has a member whose end forgets it; a group nobody joins is never
    /// forgotten, so doors call that, not this.
    ///
    /// Errors: `invalid-argument` for a size of 0 or over [`MAX_GROUP_SIZE`], a timeout of 0
    /// or over [`MAX_TIMEOUT`]; `resource-exhausted` for a group larger than the tenant's
    /// devices (naming both numbers) or a tenant with [`MAX_GROUPS_PER_TENANT`] groups.
    pub fn create(
        &self,
        tenant: &Arc<Tenant>,
        size: u32,
        allowed_devices: u32,
        timeout: Duration,
    ) -> DeviceResult<Arc<Group>> {
        if size == 0 || size > MAX_GROUP_SIZE {
            return Err(DeviceError::invalid(format!(
                "a group of {size} ranks (1 to {MAX_GROUP_SIZE})"
            )));
        }
        if timeout.is_zero() || timeout > MAX_TIMEOUT {
            return Err(DeviceError::invalid(format!(
                "a group timeout of {:.1} s (more than 0, at most {} s)",
                timeout.as_secs_f64(),
                MAX_TIMEOUT.as_secs()
            )));
        }
        let tenant = tenant.name();
        if size > allowed_devices {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "a group of {size} ranks, one device each, and tenant {tenant} may use {allowed_devices} device(s)"
                ),
            ));
        }
        let mut map = self.inner.map.lock().expect("groups lock");
        let mine = map.values().filter(|g| g.tenant == tenant).count();
        if mine >= MAX_GROUPS_PER_TENANT {
            return Err(DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "tenant {tenant} has {mine} process groups (at most {MAX_GROUPS_PER_TENANT})"
                ),
            ));
        }
        let id = random_id();
        let group = Arc::new(Group {
            id: id.clone(),
            tenant: tenant.to_string(),
            size,
            timeout,
            state: Mutex::new(State {
                devices: vec![None; size as usize],
                next: vec![0; size as usize],
                rounds: BTreeMap::new(),
                p2p: HashMap::new(),
                broken: None,
                members: 0,
            }),
            programs: Mutex::new(HashMap::new()),
            groups: Arc::downgrade(&self.inner),
        });
        map.insert(id, Arc::clone(&group));
        Ok(group)
    }

    /// The group `id` of `tenant`. Errors: `not-found`, the same for an id of another tenant
    /// as for one that never existed or was forgotten.
    pub fn find(&self, tenant: &Tenant, id: &str) -> DeviceResult<Arc<Group>> {
        self.inner
            .map
            .lock()
            .expect("groups lock")
            .get(id)
            .filter(|g| g.tenant == tenant.name())
            .cloned()
            .ok_or_else(|| DeviceError::new(ErrorKind::NotFound, "no such process group"))
    }

    /// Number of groups alive (made and not yet forgotten).
    pub fn live(&self) -> usize {
        self.inner.map.lock().expect("groups lock").len()
    }
}

fn random_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    // Two SipHash keys drawn from the OS's randomness by std (RandomState), hashing a counter:
    // unguessable ids without a new dependency.
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut out = String::with_capacity(32);
    for salt in 0..2u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        h.write_u64(salt);
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dims: &[i64]) -> TensorSpec {
        TensorSpec {
            ty: PrimitiveType::F32,
            dims: dims.to_vec(),
        }
    }

    #[test]
    fn result_dims_follow_pytorch() {
        let s = spec(&[4, 3]);
        assert_eq!(
            result_dims(&Collective::AllReduce(ReduceOp::Sum), &s, 4).unwrap(),
            vec![4, 3]
        );
        assert_eq!(
            result_dims(&Collective::AllGather, &s, 4).unwrap(),
            vec![16, 3]
        );
        assert_eq!(
            result_dims(&Collective::ReduceScatter(ReduceOp::Max), &s, 4).unwrap(),
            vec![1, 3]
        );
        assert_eq!(
            result_dims(&Collective::AllToAll, &s, 2).unwrap(),
            vec![4, 3]
        );
        for (what, s, n) in [
            (Collective::AllReduce(ReduceOp::Sum), spec(&[]), 2),
            (Collective::ReduceScatter(ReduceOp::Sum), spec(&[3]), 2),
            (Collective::AllToAll, spec(&[5, 2]), 4),
            (Collective::Broadcast { root: 4 }, spec(&[1]), 4),
        ] {
            let e = result_dims(&what, &s, n).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{what:?}");
        }
        let ints = TensorSpec {
            ty: PrimitiveType::S32,
            dims: vec![2],
        };
        let e = result_dims(&Collective::AllReduce(ReduceOp::Avg), &ints, 2).unwrap_err();
        assert!(e.message.contains("floating-point"), "{}", e.message);
    }

    #[test]
    fn ids_differ() {
        let a = random_id();
        assert_eq!(a.len(), 32);
        assert_ne!(a, random_id());
    }
}
