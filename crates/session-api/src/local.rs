//! The local socket: the fast path for a client on the same machine as the daemon. Tensor data
//! moves through shared memory instead of gRPC messages, and the calls a notebook makes most
//! (execute, free) skip HTTP/2: a round trip from Python is about 60 µs here against 130-220 µs
//! through grpcio (docs/BENCHMARKS.md).
//!
//! Beside `--session-socket PATH` the daemon listens on `PATH.local` (the same mode and group). A client sends
//! a request as one message: a 4-byte little-endian length, then that many bytes of JSON, with
//! file descriptors attached (`SCM_RIGHTS`); the reply has the same form. The requests:
//!
//! - `{"op": "put", "token": SESSION_TOKEN, "dtype": "F32", "dims": [..], "device": 0}` with
//!   one memfd (`memfd_create(2)`) whose first bytes are the tensor (dense, row-major,
//!   little-endian, as `PutTensor` takes it), sealed with `F_SEAL_WRITE | F_SEAL_SHRINK`
//!   → `{"ok": TENSOR_INFO}`;
//! - `{"op": "get", "token": SESSION_TOKEN, "handle": N, "release": [L, ..]}` →
//!   `{"ok": TENSOR_INFO}` with one memfd holding the tensor's bytes and, in the info,
//!   `"lease": L`: the memfd is *lent* (see below); `release` (optional) ends earlier leases
//!   first;
//! - `{"op": "release", "token": SESSION_TOKEN, "leases": [L, ..]}` →
//!   `{"ok": {"released": N, "unknown": [..]}}`: ends those leases;
//! - `{"op": "execute", "token": SESSION_TOKEN, "executable": E, "arguments": [..],
//!   "donate": [..]}` → `{"ok": {"results": [TENSOR_INFO, ..]}}`, as `Execute`;
//! - `{"op": "free", "token": SESSION_TOKEN, "tensors": [..], "executables": [..]}` →
//!   `{"ok": {"freed": N, "unknown": [..]}}`, as `Free`;
//! - `{"op": "call", "token": SESSION_TOKEN, "executable": E, "arguments": [ARG, ..],
//!   "donate": [..], "fetch": [..], "keep": [..], "free": [..]}`, as `Call` (one forward pass
//!   in one round trip), where each `ARG` is `{"handle": N}` or an inline tensor
//!   `{"dtype": "F32", "dims": [..], "device": 0}`. A call with inline arguments carries one
//!   sealed memfd holding all their bytes, packed in argument order, each starting at the next
//!   multiple of [`PACK_ALIGN`] (64) bytes after the previous one's end (the first at 0) →
//!   `{"ok": {"results": [RESULT, ..], "freed": N, "unknown": [..]}}`, where `RESULT` is a
//!   `TENSOR_INFO` (`handle` 0 when the result was not kept) with an `"offset"` when it was
//!   fetched: the reply then carries one lent memfd (`"lease": L`) with the fetched results
//!   packed the same way, and `offset` says where each starts, and `launch_id` the launch's
//!   id; a call's `release` ends earlier leases first, as a get's. With
//!   `"launch": true` the call launches without waiting (as `Call`'s `launch`: no `fetch`, every
//!   result a pending handle);
//! - `{"op": "wait", "token": SESSION_TOKEN, "tensors": [..], "all": false}` → `{"ok": {}}`,
//!   as `Wait`;
//! - `{"op": "reserve", "token": SESSION_TOKEN, "count": N}` → `{"ok": {"first": F, "count":
//!   N}}`: handle numbers `F..F+N` reserved for the session's client to name the results of its
//!   launches with (1 to 65536 numbers; a new reservation replaces the unused rest of the last).
//!   A call with `"out": [H, ..]` (one per kept result, each reserved and unused, in increasing
//!   order; any other number is refused, `invalid-argument`, and used numbers stay used)
//!   makes its results under those numbers, so a client may send a launch and use its results
//!   in its next requests without reading the reply (pipelining: the replies come in request
//!   order; a launch so named replies `{"ok": {"launch_id", "freed"}}` only). A client that
//!   never reads its replies stops being read once they fill the socket (the daemon answers
//!   each request before reading the next), and each launch is still charged against
//!   `max-pending-launches`, `max-live-tensors` and `max-device-bytes` as it is admitted;
//! - `{"op": "group_create", "token", "size": N, "rank": R, "timeout_ms": T}` →
//!   `{"ok": {"group": ID}}`: a process group of N ranks (one device each, the session's
//!   default device is rank R's), joined at once; `{"op": "group_join", "token", "group": ID,
//!   "rank": R}` → `{"ok": {}}`; `{"op": "collective", "token", "group": ID, "kind":
//!   "all_reduce" | "broadcast" | "all_gather" | "reduce_scatter" | "all_to_all" | "barrier"
//!   | "send" | "recv", "reduce": "sum" | "avg" | "product" | "min" | "max", "root": R,
//!   "peer": R, "tag": T, "handle": N}` → `{"ok": {"result": TENSOR_INFO}}` (`{"ok": {}}` for
//!   a barrier or a send; a receive's handle is the tensor whose spec it expects) once every
//!   rank's same
//!   collective ran ([`tpubox_core::collective`]; the request waits for the other ranks, at
//!   most the group's timeout);
//!
//! **Lent memfds.** A memfd the daemon sends (a get's, a call's fetched results) is charged
//! to the tenant's transfer pool (`2 × max-device-bytes`, [`tpubox_core::tenant::Tenant::charge_transfer`])
//! before it is made, and stays charged until its lease ends: the client releases it (op
//! `release`, or a get's or call's `release`), or the session ends. When a lease ends the
//! daemon truncates the memfd to nothing, which frees its pages even if the client still
//! holds a descriptor or a map of it (touching such a map then raises `SIGBUS`): the memfd is
//! sealed against writing and growing, and its seals are sealed, but it is not sealed against
//! shrinking, so the client cannot stop that. So however many memfds a client keeps, what the
//! daemon has lent it is at most its transfer pool, in the tenant's usage, the daemon's
//! memory cgroup and the system's shared memory alike; a get or call over it is refused
//! (`resource-exhausted` naming `max-device-bytes`) until leases are released. The Python
//! client copies a lent memfd into its own array (one `preadv`) and releases the lease with
//! its next request, so its arrays never depend on a lease.
//!
//! Small tensors travel in the messages themselves: a put or a call may carry up to
//! [`MAX_INLINE_BYTES`] after its header (`"tail": N`, the put's tensor or the call's inline
//! arguments packed as in a memfd) instead of a memfd, read only after the request was
//! admitted and the bytes charged; a get or a call with `"inline": true` whose tensor (or
//! fetched results, packed) is at most that size gets them after the reply's JSON, whose
//! top level then says how many (`{"ok": .., "tail": N}`; a get's info has `"inline": true`).
//! A request whose tail is over the limit is refused and its connection closed; one refused
//! before its tail was read has the tail skipped.
//!
//! where `TENSOR_INFO` is `{"handle", "dtype", "dims", "device", "byte_size", "read_only",
//! "weights"}` (`weights`: `[{"name", "version"}, ..]`, as `TensorInfo.weights`),
//! and a failure is `{"error": {"kind": KIND, "message": ...}}` with the kinds of the gRPC API.
//! A connection may carry any number of requests, one after another.
//!
//! Only sealed memfds are taken (a FIFO or a file on a stalled mount could block the reader;
//! an unsealed file could shrink under the daemon's map), and only the size the header
//! declares is mapped and read, checked against the session's device-byte limit and charged to
//! its tenant as a transfer in flight before the descriptor is looked at (for a call: each
//! inline argument's size; the padding between them, under 64 bytes each, is not charged).
//! Everything else goes through the same session layer calls as `PutTensor`, `GetTensor` and
//! `Call`.
//!
//! Before a request's token is checked a connection costs the daemon little: the header is
//! read into a buffer of the size it declares (at most [`MAX_HEADER_BYTES`]), and at most
//! [`MAX_DESCRIPTORS_PER_REQUEST`] descriptor is held (a put, or a call with inline arguments,
//! needs exactly one). A request that attaches more is refused (`invalid-argument`): the extra
//! descriptors are closed at once and the connection is ended (protection
//! `local-socket-descriptors`); the limit is fixed, not a flag, because the protocol's requests
//! that carry a descriptor carry exactly one (a call packs all its inline tensors in one). Failed accepts (the process out of descriptors, say) are retried after an
//! exponential back-off (`tpubox_net::accept`, protection `accept-errors`), and connections
//! count against the daemon's connection caps with every other door's (`--max-connections`,
//! `--max-connections-per-peer`; one over a cap is closed at once). A request's header must
//! arrive within `--header-timeout-seconds` of its length, and so must a connection's first
//! request (protection `header-timeout`); after a request succeeded, a connection may stay
//! idle between requests (a client keeps it for its session).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pjrt::PrimitiveType;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};

use super::registry::{AccessError, CallArg, CallSpec, Registry};
use tpubox_core::error::{DeviceError, ErrorKind};
use tpubox_core::session::TensorHandle;

/// Largest JSON header of a request, in bytes.
pub const MAX_HEADER_BYTES: usize = 64 << 10;

/// Most descriptors a connection holds for one request, before its token is checked: 1 (a
/// put's memfd, or the one memfd of a call's inline arguments). More are closed as they
/// arrive and the connection is ended.
pub const MAX_DESCRIPTORS_PER_REQUEST: usize = 1;

/// How long the daemon waits to send the refusal of a request with too many descriptors
/// before it ends the connection anyway.
const REFUSAL_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// The local socket's path for a session socket at `socket`.
pub fn local_path(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".local");
    PathBuf::from(s)
}

#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
pub(crate) enum LocalRequest {
    Put {
        token: String,
        dtype: String,
        dims: Vec<u64>,
        #[serde(default)]
        device: Option<u32>,
        #[serde(default)]
        tail: usize,
    },
    Get {
        token: String,
        handle: u64,
        #[serde(default)]
        inline: bool,
        #[serde(default)]
        release: Vec<u64>,
    },
    Release {
        token: String,
        leases: Vec<u64>,
    },
    Reserve {
        token: String,
        count: u64,
    },
    Execute {
        token: String,
        executable: u64,
        arguments: Vec<u64>,
        #[serde(default)]
        donate: Vec<u32>,
    },
    Free {
        token: String,
        #[serde(default)]
        tensors: Vec<u64>,
        #[serde(default)]
        executables: Vec<u64>,
    },
    Call {
        token: String,
        executable: u64,
        arguments: Vec<LocalArg>,
        #[serde(default)]
        donate: Vec<u32>,
        #[serde(default)]
        fetch: Vec<u32>,
        #[serde(default)]
        keep: Vec<u32>,
        #[serde(default)]
        free: Vec<u64>,
        #[serde(default)]
        launch: bool,
        #[serde(default)]
        out: Vec<u64>,
        #[serde(default)]
        tail: usize,
        #[serde(default)]
        inline: bool,
        #[serde(default)]
        release: Vec<u64>,
    },
    #[serde(rename = "group_create")]
    GroupCreate {
        token: String,
        size: u32,
        timeout_ms: u64,
        rank: u32,
    },
    #[serde(rename = "group_join")]
    GroupJoin {
        token: String,
        group: String,
        rank: u32,
    },
    Collective {
        token: String,
        group: String,
        kind: String,
        #[serde(default)]
        reduce: Option<String>,
        #[serde(default)]
        root: Option<u32>,
        #[serde(default)]
        peer: Option<u32>,
        #[serde(default)]
        tag: Option<i64>,
        #[serde(default)]
        handle: Option<u64>,
    },
    Wait {
        token: String,
        #[serde(default)]
        tensors: Vec<u64>,
        #[serde(default)]
        all: bool,
    },
}

impl LocalRequest {
    /// The bytes that follow the request's header (`tail`): the tensor of a put, the inline
    /// arguments of a call.
    pub(crate) fn tail(&self) -> usize {
        match self {
            LocalRequest::Put { tail, .. } | LocalRequest::Call { tail, .. } => *tail,
            _ => 0,
        }
    }

    pub(crate) fn op(&self) -> &'static str {
        match self {
            LocalRequest::Put { .. } => "put",
            LocalRequest::Get { .. } => "get",
            LocalRequest::Release { .. } => "release",
            LocalRequest::Reserve { .. } => "reserve",
            LocalRequest::Execute { .. } => "execute",
            LocalRequest::Free { .. } => "free",
            LocalRequest::Call { .. } => "call",
            LocalRequest::Wait { .. } => "wait",
            LocalRequest::GroupCreate { .. } => "group_create",
            LocalRequest::GroupJoin { .. } => "group_join",
            LocalRequest::Collective { .. } => "collective",
        }
    }
}

impl LocalRequest {
    /// The session token it carries.
    fn token(&self) -> &str {
        match self {
            LocalRequest::Put { token, .. }
            | LocalRequest::Get { token, .. }
            | LocalRequest::Release { token, .. }
            | LocalRequest::Reserve { token, .. }
            | LocalRequest::Execute { token, .. }
            | LocalRequest::Free { token, .. }
            | LocalRequest::Call { token, .. }
            | LocalRequest::GroupCreate { token, .. }
            | LocalRequest::GroupJoin { token, .. }
            | LocalRequest::Collective { token, .. }
            | LocalRequest::Wait { token, .. } => token,
        }
    }
}

/// One argument of a local call: `{"handle": N}` or `{"dtype", "dims", "device"?}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LocalArg {
    #[serde(default)]
    handle: Option<u64>,
    #[serde(default)]
    dtype: Option<String>,
    #[serde(default)]
    dims: Option<Vec<u64>>,
    #[serde(default)]
    device: Option<u32>,
}

/// Fetched results up to this many bytes in all are written to their memfd on the request's
/// own task; larger ones on a blocking thread.
const INLINE_WRITE_BYTES: usize = 64 << 10;

/// Most bytes a request carries after its header (`tail`: a small put's tensor, a call's
/// small inline arguments) instead of in a memfd, and most bytes a reply carries after its
/// JSON (a small get's tensor, a call's small fetched results), when the client asks for them
/// inline.
pub const MAX_INLINE_BYTES: usize = 64 << 10;

/// Alignment of each tensor packed in a call's memfd, in bytes.
pub const PACK_ALIGN: usize = 64;

/// Where tensors of `sizes` bytes start when packed one after another in a memfd, each at the
/// next multiple of [`PACK_ALIGN`] (the first at 0), and the bytes they span in all.
///
/// Errors: `invalid-argument` when the total does not fit this host's address space.
pub(crate) fn packed(sizes: &[usize]) -> Result<(Vec<usize>, usize), Failure> {
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut end = 0usize;
    for &n in sizes {
        let at = end
            .checked_next_multiple_of(PACK_ALIGN)
            .ok_or_else(|| invalid("the packed tensors do not fit this host's address space"))?;
        offsets.push(at);
        end = at
            .checked_add(n)
            .ok_or_else(|| invalid("the packed tensors do not fit this host's address space"))?;
    }
    Ok((offsets, end))
}

/// What a lent memfd is called in the tenant's transfer-pool refusals.
const LENT_MEMFD: &str =
    "a memfd lent to the client (released with `release`, or when the session ends)";

/// A new memfd holding `parts` at `offsets`, sealed against writing and growing, and its
/// seals sealed; not against shrinking, so that the daemon can truncate it when the lease
/// ends whatever the client does ([`LiveSession::lend`](super::registry::LiveSession::lend)).
fn sealed_copy(parts: &[&[u8]], offsets: &[usize], len: usize) -> std::io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create(
        "tpubox-tensor",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    let file = std::fs::File::from(fd);
    file.set_len(len as u64)?;
    for (p, &at) in parts.iter().zip(offsets) {
        file.write_all_at(p, at as u64)?;
    }
    let fd = OwnedFd::from(file);
    rustix::fs::fcntl_add_seals(&fd, SealFlags::WRITE | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(fd)
}

/// Lends the client a new memfd of `len` bytes that `write` makes ([`sealed_copy`]): its
/// bytes are charged to the tenant's transfer pool before it is made and until its lease ends
/// ([`LiveSession::lend`](super::registry::LiveSession::lend)). A memfd is memory: writing a
/// few pages never waits on a device, so up to [`INLINE_WRITE_BYTES`] are written on the
/// request's own task, more on a blocking thread. Returns the memfd and its lease number.
///
/// Errors: `resource-exhausted` (`max-device-bytes`) when the pool is full; `internal` when
/// the memfd cannot be made; `session-ended`.
async fn lend(
    s: &super::registry::LiveSession,
    len: usize,
    write: impl FnOnce() -> std::io::Result<OwnedFd> + Send + 'static,
) -> Result<(OwnedFd, u64), Failure> {
    let charge = s.tenant().charge_transfer(len as u64, LENT_MEMFD)?;
    let fd = if len <= INLINE_WRITE_BYTES {
        write()
    } else {
        tokio::task::spawn_blocking(write)
            .await
            .map_err(|e| Failure(ErrorKind::Internal.as_str(), e.to_string()))?
    }
    .map_err(|e| {
        Failure(
            ErrorKind::Internal.as_str(),
            format!("a memfd for the tensor bytes: {e}"),
        )
    })?;
    let lease = s.lend(&fd, charge)?;
    Ok((fd, lease))
}

/// A failed request: its kind (the names of the gRPC API) and message.
pub(crate) struct Failure(pub(crate) &'static str, pub(crate) String);

impl From<DeviceError> for Failure {
    fn from(e: DeviceError) -> Self {
        Failure(e.kind.as_str(), e.message)
    }
}

impl From<AccessError> for Failure {
    fn from(e: AccessError) -> Self {
        match e {
            AccessError::Unauthenticated(m) => Failure("unauthenticated", m),
            AccessError::Ended(m) => Failure("session-ended", m),
            AccessError::Device(e) => e.into(),
        }
    }
}

/// The collective a request names: `kind` (`all_reduce`, `broadcast`, `all_gather`,
/// `reduce_scatter`, `all_to_all`, `barrier`, `send`, `recv`), its `reduce` (`sum`, `avg`,
/// `product`, `min`, `max`; default `sum`), a broadcast's `root`, a send's or receive's
/// `peer` and `tag` (default 0).
pub(crate) fn collective_of(
    kind: &str,
    reduce: Option<&str>,
    root: Option<u32>,
    peer: Option<u32>,
    tag: i64,
) -> Result<tpubox_core::collective::Collective, Failure> {
    let peer = || peer.ok_or_else(|| invalid(format!("a {kind} needs its peer")));
    use tpubox_core::collective::{Collective, ReduceOp};
    let op = || ReduceOp::parse(reduce.unwrap_or("sum"));
    Ok(match kind {
        "all_reduce" => Collective::AllReduce(op()?),
        "reduce_scatter" => Collective::ReduceScatter(op()?),
        "broadcast" => Collective::Broadcast {
            root: root.ok_or_else(|| invalid("a broadcast needs its root"))?,
        },
        "all_gather" => Collective::AllGather,
        "all_to_all" => Collective::AllToAll,
        "barrier" => Collective::Barrier,
        "send" => Collective::Send { peer: peer()?, tag },
        "recv" => Collective::Recv { peer: peer()?, tag },
        _ => return Err(invalid(format!("unknown collective {kind:?}"))),
    })
}

fn invalid(m: impl Into<String>) -> Failure {
    Failure(ErrorKind::InvalidArgument.as_str(), m.into())
}

fn info(handle: u64, t: &TensorHandle) -> Value {
    json!({
        "handle": handle,
        "dtype": t.spec().ty.name(),
        "dims": t.spec().dims,
        "device": t.device(),
        "byte_size": t.byte_size(),
        "read_only": t.is_read_only(),
        "weights": t
            .weight_versions()
            .iter()
            .map(|(name, version)| json!({"name": &**name, "version": version}))
            .collect::<Vec<_>>(),
    })
}

/// Serves the local socket until the listener fails: one task per connection, each counted
/// against the daemon's connection caps (`doors`: `--max-connections`, and
/// `--max-connections-per-peer`, every Unix-socket client counting as one peer; a connection
/// over a cap is closed at once, protection `connections-total` / `connections-per-peer`);
/// failed accepts back off ([`tpubox_net::accept`], protection `accept-errors`); a request
/// head must arrive within `--header-timeout-seconds` (see the module docs).
pub async fn serve(listener: UnixListener, registry: Arc<Registry>, doors: tpubox_net::Doors) {
    let listener = tpubox_net::Listener::Unix(listener);
    let header_timeout = doors.limits.header_timeout;
    loop {
        let (stream, peer) = listener.accept(DOOR).await;
        let talked = stream.has_bytes();
        let tpubox_net::Stream::Unix(stream) = stream else {
            continue;
        };
        let (guard, crowded) = match doors.connections.admit(peer, talked) {
            Ok((g, evicted)) => {
                tpubox_net::serve::log_evicted(DOOR, peer, &evicted, &doors.connections);
                (g, !evicted.is_empty())
            }
            Err(refused) => {
                tpubox_core::protection::triggered(
                    refused.protection(),
                    DOOR,
                    format_args!(
                        "closed a local-socket connection at once: the Unix sockets' pool is full of authenticated connections ({} open in all)",
                        doors.connections.open()
                    ),
                );
                continue;
            }
        };
        let registry = Arc::clone(&registry);
        tokio::spawn(async move {
            // A connection closed to make room (it had not authenticated) is dropped here.
            let r = tokio::select! {
                r = connection(stream, registry, header_timeout, &guard) => r,
                _ = guard.evicted() => Ok(()),
            };
            if let Err(e) = r {
                tracing::debug!(
                    "local socket connection ended: {}",
                    tpubox_core::logsafe::clip(&e.to_string())
                );
            }
        });
        if crowded {
            // Under a flood, let the new connection see its first bytes before the next
            // accept can make room by closing it.
            tokio::task::yield_now().await;
        }
    }
}

/// The local socket's name in logs and metrics.
const DOOR: &str = "session-local";

/// Receives bytes into `buf`, adding the descriptors attached to `fds`; returns how many bytes
/// (0 at end of stream) and whether descriptors were dropped because there was no room for
/// them (more than one in a message, or the process is out of descriptors: `MSG_CTRUNC`; the
/// kernel closes those).
async fn receive(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> std::io::Result<(usize, bool)> {
    loop {
        stream.readable().await?;
        let r = stream.try_io(Interest::READABLE, || {
            let mut space = [MaybeUninit::<u8>::uninit();
                rustix::cmsg_space!(ScmRights(MAX_DESCRIPTORS_PER_REQUEST))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(buf)];
            let msg = rustix::net::recvmsg(
                stream.as_fd(),
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )
            .map_err(std::io::Error::from)?;
            for m in control.drain() {
                if let RecvAncillaryMessage::ScmRights(it) = m {
                    fds.extend(it);
                }
            }
            Ok((
                msg.bytes,
                msg.flags.contains(rustix::net::ReturnFlags::CTRUNC),
            ))
        });
        match r {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

/// Fills `buf` from the stream; `false` when the stream ended first. Fails with
/// [`TooManyDescriptors`] as soon as more than [`MAX_DESCRIPTORS_PER_REQUEST`] arrived (those
/// held are closed).
async fn receive_exact(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> std::io::Result<Result<bool, TooManyDescriptors>> {
    let mut n = 0;
    while n < buf.len() {
        let (m, truncated) = receive(stream, &mut buf[n..], fds).await?;
        if truncated || fds.len() > MAX_DESCRIPTORS_PER_REQUEST {
            let held = fds.len();
            fds.clear();
            return Ok(Err(TooManyDescriptors { held, truncated }));
        }
        if m == 0 {
            return Ok(Ok(false));
        }
        n += m;
    }
    Ok(Ok(true))
}

/// A request arrived with more descriptors than [`MAX_DESCRIPTORS_PER_REQUEST`].
struct TooManyDescriptors {
    held: usize,
    truncated: bool,
}

async fn send(
    stream: &UnixStream,
    reply: &Value,
    fd: Option<&OwnedFd>,
    tail: &[u8],
) -> std::io::Result<()> {
    let body = serde_json::to_vec(reply).unwrap_or_default();
    let mut msg = Vec::with_capacity(4 + body.len() + tail.len());
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(&body);
    msg.extend_from_slice(tail);
    let mut sent = 0;
    let mut fd = fd;
    while sent < msg.len() {
        stream.writable().await?;
        let r = stream.try_io(Interest::WRITABLE, || {
            let fds: Vec<std::os::fd::BorrowedFd<'_>> = fd.iter().map(|f| f.as_fd()).collect();
            let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !fds.is_empty() {
                control.push(SendAncillaryMessage::ScmRights(&fds));
            }
            rustix::net::sendmsg(
                stream.as_fd(),
                &[IoSlice::new(&msg[sent..])],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .map_err(std::io::Error::from)
        });
        match r {
            Ok(n) => {
                sent += n;
                fd = None;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn refuse(stream: &UnixStream, e: Failure) -> std::io::Result<()> {
    send(
        stream,
        &json!({"error": {"kind": e.0, "message": e.1}}),
        None,
        &[],
    )
    .await
}

/// Ends a connection whose header did not arrive within `timeout`.
fn header_timeout(what: &str, timeout: Duration) -> std::io::Result<()> {
    tpubox_core::protection::triggered(
        "header-timeout",
        DOOR,
        format_args!(
            "{what} did not arrive within {timeout:?}; closed the local-socket connection"
        ),
    );
    Ok(())
}

/// The header length a request's first 4 bytes (little-endian) declare.
///
/// Errors: `invalid-argument` for more than [`MAX_HEADER_BYTES`] (the connection is then
/// ended).
pub(crate) fn header_length(len: [u8; 4]) -> Result<usize, Failure> {
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_HEADER_BYTES {
        return Err(invalid(format!(
            "a local request header is at most {MAX_HEADER_BYTES} bytes, this one says {n}"
        )));
    }
    Ok(n)
}

/// A request's JSON header, parsed.
///
/// Errors: `invalid-argument` for JSON that is not one of the requests.
pub(crate) fn parse_header(header: &[u8]) -> Result<LocalRequest, Failure> {
    serde_json::from_slice(header)
        .map_err(|e| invalid(format!("a malformed local-socket request: {e}")))
}

/// Checks the bytes a request declares after its header (`tail`).
///
/// Errors: `invalid-argument` for more than [`MAX_INLINE_BYTES`] (the connection is then
/// ended).
pub(crate) fn check_tail(declared: usize) -> Result<(), Failure> {
    if declared > MAX_INLINE_BYTES {
        return Err(invalid(format!(
            "a local request carries at most {MAX_INLINE_BYTES} bytes after its header (`tail`), this one says {declared}; send more in a memfd"
        )));
    }
    Ok(())
}

/// A dtype named in a local request (`"F32"`, any case).
///
/// Errors: `invalid-argument` for a name tpubox does not support.
pub(crate) fn local_dtype(dtype: &str) -> Result<PrimitiveType, Failure> {
    PrimitiveType::from_name(&dtype.to_ascii_uppercase())
        .ok_or_else(|| invalid(format!("`{dtype}` is not a dtype tpubox supports")))
}

/// The arguments of a local call as the session layer takes them.
///
/// Errors: `invalid-argument` for an argument that is neither a handle nor an inline tensor
/// (`dtype` and `dims`), or names an unsupported dtype.
pub(crate) fn call_arguments(arguments: Vec<LocalArg>) -> Result<Vec<CallArg>, Failure> {
    let mut args = Vec::with_capacity(arguments.len());
    for (i, a) in arguments.into_iter().enumerate() {
        args.push(match a {
            LocalArg {
                handle: Some(h),
                dtype: None,
                dims: None,
                device: None,
            } => CallArg::Handle(h),
            LocalArg {
                handle: None,
                dtype: Some(dtype),
                dims: Some(dims),
                device,
            } => CallArg::Inline {
                ty: local_dtype(&dtype)
                    .map_err(|e| invalid(format!("argument {i}: {}", e.1)))?,
                dims,
                device,
            },
            _ => {
                return Err(invalid(format!(
                    "argument {i}: either {{\"handle\"}} or {{\"dtype\", \"dims\"}} (and \"device\")"
                )));
            }
        });
    }
    Ok(args)
}

async fn connection(
    stream: UnixStream,
    registry: Arc<Registry>,
    header_timeout_after: Duration,
    guard: &tpubox_net::ConnectionGuard,
) -> std::io::Result<()> {
    // Whether the connection is counted for its session's tenant (from its first request
    // with a live session's token): from then on it is never closed to make room.
    let mut counted = false;
    // Whether a request of this connection succeeded: until then, the connection may wait at
    // most the header timeout for its first request.
    let mut served = false;
    loop {
        // The length, then the header, with the descriptors on their first bytes: at most
        // MAX_DESCRIPTORS_PER_REQUEST held until the request's token is checked.
        let mut fds = Vec::new();
        let mut len = [0u8; 4];
        let mut header = Vec::new();
        let first = receive_exact(&stream, &mut len, &mut fds);
        let mut got = if served {
            first.await?
        } else {
            let r = match tokio::time::timeout(header_timeout_after, first).await {
                Ok(r) => r?,
                Err(_) => return header_timeout("a first request", header_timeout_after),
            };
            // Its first bytes: from then on it makes room only after the connections that
            // sent nothing.
            guard.talked();
            r
        };
        if let Ok(true) = got {
            let n = match header_length(len) {
                Ok(n) => n,
                Err(e) => return refuse(&stream, e).await,
            };
            header = vec![0u8; n];
            let rest = receive_exact(&stream, &mut header, &mut fds);
            got = match tokio::time::timeout(header_timeout_after, rest).await {
                Ok(r) => r?,
                Err(_) => return header_timeout("a request's header", header_timeout_after),
            };
        }
        match got {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(TooManyDescriptors { held, truncated }) => {
                tpubox_core::protection::triggered(
                    "local-socket-descriptors",
                    "session-local",
                    format_args!(
                        "a local-socket request attached {}{held} descriptors, at most {MAX_DESCRIPTORS_PER_REQUEST} are taken; closed them and the connection",
                        if truncated { "more than " } else { "" }
                    ),
                );
                let e = invalid(format!(
                    "a local request carries at most {MAX_DESCRIPTORS_PER_REQUEST} descriptor (a put's memfd, or a call's); this one attached more, and the connection is closed"
                ));
                let _ = tokio::time::timeout(REFUSAL_SEND_TIMEOUT, refuse(&stream, e)).await;
                return Ok(());
            }
        }
        let started = std::time::Instant::now();
        let req = parse_header(&header);
        let (op, declared) = match &req {
            Ok(r) => (r.op(), r.tail()),
            Err(_) => ("malformed", 0),
        };
        if let Err(e) = check_tail(declared) {
            return refuse(&stream, e).await;
        }
        let mut tail = Tail {
            stream: &stream,
            left: declared,
            timeout: header_timeout_after,
            broken: false,
        };
        if !counted
            && let Ok(req) = &req
            && let Ok((s, _)) = registry.get(req.token())
        {
            counted = !matches!(
                guard.authenticate(&s.tenant_name),
                tpubox_net::Authenticated::OverShare
            );
        }
        let r = match req {
            Ok(req) => handle(req, fds, &registry, &mut tail).await,
            Err(e) => Err(e),
        };
        let handled = started.elapsed();
        let (reply, fd, bytes) = match r {
            Ok((v, fd, bytes)) => {
                served = true;
                let reply = if bytes.is_empty() {
                    json!({ "ok": v })
                } else {
                    json!({ "ok": v, "tail": bytes.len() })
                };
                (reply, fd, bytes)
            }
            Err(Failure(kind, message)) => (
                json!({"error": {"kind": kind, "message": message}}),
                None,
                Vec::new(),
            ),
        };
        // A request that failed before its tail was read: what is left of it is dropped, so
        // that the next request starts where it should.
        if !tail.broken && tail.left > 0 && !tail.discard().await {
            return Ok(());
        }
        send(&stream, &reply, fd.as_ref(), &bytes).await?;
        tracing::trace!(
            op,
            handled_us = handled.as_micros() as u64,
            replied_us = started.elapsed().as_micros() as u64,
            "local request"
        );
        if tail.broken {
            return Ok(());
        }
    }
}

/// The bytes a request carries after its header (`tail`), read only once the request was
/// admitted and their size charged (never more than [`MAX_INLINE_BYTES`]).
struct Tail<'a> {
    stream: &'a UnixStream,
    left: usize,
    timeout: Duration,
    /// Reading it failed: the connection ends after the reply.
    broken: bool,
}

impl Tail<'_> {
    /// Reads all of it into a new buffer of its declared size (charged by the caller first).
    ///
    /// Errors: `invalid-argument` when descriptors come with it, the stream ends first, or it
    /// does not arrive within the header timeout (the connection then ends).
    async fn read(&mut self) -> Result<Vec<u8>, Failure> {
        let mut buf = vec![0u8; self.left];
        let mut fds = Vec::new();
        let got =
            tokio::time::timeout(self.timeout, receive_exact(self.stream, &mut buf, &mut fds))
                .await;
        self.left = 0;
        match got {
            Ok(Ok(Ok(true))) if fds.is_empty() => Ok(buf),
            _ => {
                self.broken = true;
                Err(invalid(
                    "the bytes after the request's header (`tail`) did not all arrive, alone and in time; the connection is closed",
                ))
            }
        }
    }

    /// Reads and drops what is left of it, through a small buffer; `false` when that failed
    /// (the connection then ends).
    async fn discard(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        while self.left > 0 {
            let n = self.left.min(buf.len());
            let mut fds = Vec::new();
            let got = tokio::time::timeout(
                self.timeout,
                receive_exact(self.stream, &mut buf[..n], &mut fds),
            )
            .await;
            if !matches!(got, Ok(Ok(Ok(true)))) || !fds.is_empty() {
                return false;
            }
            self.left -= n;
        }
        true
    }
}

fn no_fds(fds: &[OwnedFd]) -> Result<(), Failure> {
    if fds.is_empty() {
        Ok(())
    } else {
        Err(invalid(
            "only a put and a call with inline arguments carry a descriptor",
        ))
    }
}

/// A request's reply: its `ok` value, the descriptor it carries, and the bytes that follow its
/// JSON (`tail`).
type Reply = (Value, Option<OwnedFd>, Vec<u8>);

async fn handle(
    req: LocalRequest,
    mut fds: Vec<OwnedFd>,
    registry: &Arc<Registry>,
    tail: &mut Tail<'_>,
) -> Result<Reply, Failure> {
    match req {
        LocalRequest::Put {
            token,
            dtype,
            dims,
            device,
            tail: declared,
        } => {
            let (s, _active) = registry.get(&token)?;
            if declared > 0 {
                no_fds(&fds)?;
                let ty = local_dtype(&dtype)?;
                // Charged before the buffer is allocated, as a memfd's map is.
                let (expected, upload) = s.session().admit_upload(
                    ty,
                    &dims,
                    "this local-socket put (its inline bytes)",
                )?;
                if expected != declared {
                    return Err(invalid(format!(
                        "the header declares a {ty} tensor of dims {dims:?} ({expected} bytes) and {declared} bytes after it"
                    )));
                }
                let data = tail.read().await?;
                let (h, t) = s.put(ty, &dims, &data, device)?;
                drop(data);
                drop(upload);
                return Ok((info(h, &t), None, Vec::new()));
            }
            if fds.len() != 1 {
                return Err(invalid(format!(
                    "a local put carries exactly one memfd with the data, this one {}",
                    fds.len()
                )));
            }
            let fd = fds.remove(0);
            let ty = local_dtype(&dtype)?;
            // Refuse what can never fit before the descriptor is looked at, and charge the
            // mapped bytes to the tenant until the map is dropped.
            let (expected, upload) =
                s.session()
                    .admit_upload(ty, &dims, "this local-socket put (its mapped memfd)")?;
            // Only a sealed memfd: reading it never waits on anything but memory, and its
            // writer can no longer shrink or change it; only the declared size is mapped
            // (pjrt::MappedFile::sealed_memfd).
            let map = pjrt::MappedFile::sealed_memfd(fd, expected).map_err(|e| {
                invalid(format!(
                    "{e} (the header declares a {ty} tensor of dims {dims:?}: {expected} bytes)"
                ))
            })?;
            let (h, t) = s.put(ty, &dims, map.as_slice(), device)?;
            drop(map);
            drop(upload);
            Ok((info(h, &t), None, Vec::new()))
        }
        LocalRequest::Reserve { token, count } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            let first = s.reserve_handles(count)?;
            Ok((json!({"first": first, "count": count}), None, Vec::new()))
        }
        LocalRequest::Execute {
            token,
            executable,
            arguments,
            donate,
        } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            let results: Vec<Value> = s
                .execute(executable, &arguments, &donate)
                .await?
                .iter()
                .map(|(h, t)| info(*h, t))
                .collect();
            Ok((json!({ "results": results }), None, Vec::new()))
        }
        LocalRequest::Call {
            token,
            executable,
            arguments,
            donate,
            fetch,
            keep,
            free,
            launch,
            out,
            tail: declared,
            inline,
            release,
        } => {
            let (s, _active) = registry.get(&token)?;
            if !release.is_empty() {
                s.release(&release)?;
            }
            let args = call_arguments(arguments)?;
            let named = !out.is_empty();
            // Admitted and charged before the descriptor is looked at.
            let plan = s.plan_call(CallSpec {
                executable,
                arguments: args,
                donate,
                fetch,
                keep,
                free,
                launch,
                out,
            })?;
            let sizes = plan.inline_sizes().to_vec();
            let mut buf = Vec::new();
            let map = if fds.is_empty() || sizes.is_empty() || declared > 0 {
                // No memfd: the inline arguments (if any) follow the header.
                no_fds(&fds)?;
                let (_, total) = packed(&sizes)?;
                if declared != total {
                    return Err(invalid(format!(
                        "the inline arguments, packed at multiples of {PACK_ALIGN} bytes, span {total} bytes, and {declared} follow the header"
                    )));
                }
                if declared > 0 {
                    buf = tail.read().await?;
                }
                None
            } else {
                if fds.len() != 1 {
                    return Err(invalid(format!(
                        "a local call with inline arguments carries exactly one memfd with their data, this one {}",
                        fds.len()
                    )));
                }
                let (_, total) = packed(&sizes)?;
                Some(
                    pjrt::MappedFile::sealed_memfd(fds.remove(0), total).map_err(|e| {
                        invalid(format!(
                            "{e} (the inline arguments, packed at multiples of {PACK_ALIGN} bytes, span {total} bytes)"
                        ))
                    })?,
                )
            };
            let (offsets, _) = packed(&sizes)?;
            let whole: &[u8] = match &map {
                Some(m) => m.as_slice(),
                None => &buf,
            };
            let slices: Vec<&[u8]> = if sizes.is_empty() {
                Vec::new()
            } else {
                offsets
                    .iter()
                    .zip(&sizes)
                    .map(|(&at, &n)| &whole[at..at + n])
                    .collect()
            };
            let out = plan.run(&s, &slices).await?;
            drop(slices);
            drop(map);
            drop(buf);
            if named && launch {
                // The client named the results and knows their specs: the launch's id is all
                // the reply says.
                return Ok((
                    json!({"launch_id": out.launch_id, "freed": out.freed}),
                    None,
                    Vec::new(),
                ));
            }
            let fetched: Vec<usize> = out
                .results
                .iter()
                .filter_map(|o| o.data.as_ref().map(|d| d.as_ref().len()))
                .collect();
            let (offsets, total) = packed(&fetched)?;
            let mut next = offsets.iter();
            let results: Vec<Value> = out
                .results
                .iter()
                .map(|o| {
                    let mut v = info(o.handle, &o.tensor);
                    if o.data.is_some() {
                        v["offset"] = json!(next.next().copied().unwrap_or_default());
                    }
                    v
                })
                .collect();
            let reply = json!({
                "results": results,
                "freed": out.freed,
                "unknown": out.unknown,
                "launch_id": out.launch_id,
            });
            if fetched.is_empty() {
                return Ok((reply, None, Vec::new()));
            }
            if inline && total <= MAX_INLINE_BYTES {
                // Small results follow the reply's JSON (at most MAX_INLINE_BYTES a connection).
                let mut bytes = vec![0u8; total];
                for (o, &at) in out
                    .results
                    .iter()
                    .filter_map(|o| o.data.as_ref())
                    .zip(&offsets)
                {
                    let d = o.as_ref();
                    bytes[at..at + d.len()].copy_from_slice(d);
                }
                drop(out);
                return Ok((reply, None, bytes));
            }
            let lease = lend(&s, total, move || {
                let parts: Vec<&[u8]> = out
                    .results
                    .iter()
                    .filter_map(|o| o.data.as_ref().map(|d| d.as_ref()))
                    .collect();
                sealed_copy(&parts, &offsets, total)
            })
            .await?;
            let mut reply = reply;
            reply["lease"] = json!(lease.1);
            Ok((reply, Some(lease.0), Vec::new()))
        }
        LocalRequest::Wait {
            token,
            tensors,
            all,
        } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            s.wait(&tensors, all).await?;
            Ok((json!({}), None, Vec::new()))
        }
        LocalRequest::GroupCreate {
            token,
            size,
            timeout_ms,
            rank,
        } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            let id = s.create_group(size, Duration::from_millis(timeout_ms), rank)?;
            Ok((json!({"group": id}), None, Vec::new()))
        }
        LocalRequest::GroupJoin { token, group, rank } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            s.join_group(&group, rank)?;
            Ok((json!({}), None, Vec::new()))
        }
        LocalRequest::Collective {
            token,
            group,
            kind,
            reduce,
            root,
            peer,
            tag,
            handle,
        } => {
            no_fds(&fds)?;
            let what = collective_of(&kind, reduce.as_deref(), root, peer, tag.unwrap_or(0))?;
            let (s, _active) = registry.get(&token)?;
            match s.collective(&group, what, handle).await? {
                Some((h, t)) => Ok((json!({"result": info(h, &t)}), None, Vec::new())),
                None => Ok((json!({}), None, Vec::new())),
            }
        }
        LocalRequest::Free {
            token,
            tensors,
            executables,
        } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            let (freed, unknown) = s.free(&tensors, &executables)?;
            Ok((
                json!({"freed": freed, "unknown": unknown}),
                None,
                Vec::new(),
            ))
        }
        LocalRequest::Release { token, leases } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            let (released, unknown) = s.release(&leases)?;
            Ok((
                json!({"released": released, "unknown": unknown}),
                None,
                Vec::new(),
            ))
        }
        LocalRequest::Get {
            token,
            handle,
            inline,
            release,
        } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            if !release.is_empty() {
                s.release(&release)?;
            }
            let t = s.tensor(handle)?;
            // The host copy is shared with concurrent reads of this handle and charged to the
            // tenant until the memfd (or the reply) is written.
            let bytes = s.session().read_shared(&t).await?;
            if inline && bytes.bytes().len() <= MAX_INLINE_BYTES {
                let mut v = info(handle, &t);
                v["inline"] = json!(true);
                return Ok((v, None, bytes.bytes().to_vec()));
            }
            let len = bytes.bytes().len();
            let (fd, lease) =
                lend(&s, len, move || sealed_copy(&[bytes.bytes()], &[0], len)).await?;
            let mut v = info(handle, &t);
            v["lease"] = json!(lease);
            Ok((v, Some(fd), Vec::new()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_tensors_start_at_multiples_of_the_alignment() {
        let (at, end) = packed(&[48, 32, 0, 8, 64]).ok().unwrap();
        assert_eq!(at, vec![0, 64, 128, 128, 192]);
        assert_eq!(end, 256);
        assert_eq!(packed(&[]).ok().unwrap(), (vec![], 0));
        // A total past the address space is refused, not wrapped.
        let e = packed(&[usize::MAX - 10, 20]).err().unwrap();
        assert_eq!(e.0, "invalid-argument");
    }
}
