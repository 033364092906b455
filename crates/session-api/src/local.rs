//! The local socket: the fast path for a client on the same machine as the daemon. Tensor data
//! moves through shared memory instead of gRPC messages, and the calls a notebook makes most
//! (execute, free) skip HTTP/2: a round trip from Python is about 60 µs here against 130-220 µs
//! through grpcio (docs/BENCHMARKS.md).
//!
//! Beside `--session-socket PATH` the daemon listens on `PATH.local` (mode 0600). A client sends
//! a request as one message: a 4-byte little-endian length, then that many bytes of JSON, with
//! file descriptors attached (`SCM_RIGHTS`); the reply has the same form. The requests:
//!
//! - `{"op": "put", "token": SESSION_TOKEN, "dtype": "F32", "dims": [..], "device": 0}` with
//!   one memfd (`memfd_create(2)`) whose first bytes are the tensor (dense, row-major,
//!   little-endian, as `PutTensor` takes it), sealed with `F_SEAL_WRITE | F_SEAL_SHRINK`
//!   → `{"ok": TENSOR_INFO}`;
//! - `{"op": "get", "token": SESSION_TOKEN, "handle": N}` → `{"ok": TENSOR_INFO}` with one
//!   memfd holding the tensor's bytes, sealed against writing, growing and shrinking;
//! - `{"op": "execute", "token": SESSION_TOKEN, "executable": E, "arguments": [..],
//!   "donate": [..]}` → `{"ok": {"results": [TENSOR_INFO, ..]}}`, as `Execute`;
//! - `{"op": "free", "token": SESSION_TOKEN, "tensors": [..], "executables": [..]}` →
//!   `{"ok": {"freed": N, "unknown": [..]}}`, as `Free`;
//!
//! where `TENSOR_INFO` is `{"handle", "dtype", "dims", "device", "byte_size", "read_only"}`,
//! and a failure is `{"error": {"kind": KIND, "message": ...}}` with the kinds of the gRPC API.
//! A connection may carry any number of requests, one after another.
//!
//! Only sealed memfds are taken (a FIFO or a file on a stalled mount could block the reader;
//! an unsealed file could shrink under the daemon's map), and only the size the header
//! declares is read, checked against the session's device-byte limit before the descriptor is
//! looked at. Everything else goes through the same session layer calls as
//! `PutTensor` and `GetTensor`.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use pjrt::PrimitiveType;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};

use super::registry::{AccessError, Registry};
use tpubox_core::error::{DeviceError, ErrorKind};
use tpubox_core::session::TensorHandle;

/// Largest JSON header of a request, in bytes.
pub const MAX_HEADER_BYTES: usize = 64 << 10;

/// The local socket's path for a session socket at `socket`.
pub fn local_path(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".local");
    PathBuf::from(s)
}

#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
enum LocalRequest {
    Put {
        token: String,
        dtype: String,
        dims: Vec<u64>,
        #[serde(default)]
        device: Option<u32>,
    },
    Get {
        token: String,
        handle: u64,
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
}

/// A failed request: its kind (the names of the gRPC API) and message.
struct Failure(&'static str, String);

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
    })
}

/// Serves the local socket until the listener fails; one task per connection.
pub async fn serve(listener: UnixListener, registry: Arc<Registry>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let registry = Arc::clone(&registry);
        tokio::spawn(async move {
            if let Err(e) = connection(stream, registry).await {
                tracing::debug!("local socket connection ended: {e}");
            }
        });
    }
}

/// Receives one message: its bytes and the descriptors attached.
async fn receive(stream: &UnixStream, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    loop {
        stream.readable().await?;
        let r = stream.try_io(Interest::READABLE, || {
            let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(buf)];
            let msg = rustix::net::recvmsg(
                stream.as_fd(),
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )
            .map_err(std::io::Error::from)?;
            let mut fds = Vec::new();
            for m in control.drain() {
                if let RecvAncillaryMessage::ScmRights(it) = m {
                    fds.extend(it);
                }
            }
            Ok((msg.bytes, fds))
        });
        match r {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

async fn send(stream: &UnixStream, reply: &Value, fd: Option<&OwnedFd>) -> std::io::Result<()> {
    let body = serde_json::to_vec(reply).unwrap_or_default();
    let mut msg = (body.len() as u32).to_le_bytes().to_vec();
    msg.extend_from_slice(&body);
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

async fn connection(stream: UnixStream, registry: Arc<Registry>) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4 + MAX_HEADER_BYTES];
    loop {
        // The length and the header, with the descriptors on the first bytes.
        let (mut n, mut fds) = receive(&stream, &mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        while n < 4 {
            let (m, more) = receive(&stream, &mut buf[n..]).await?;
            if m == 0 {
                return Ok(());
            }
            fds.extend(more);
            n += m;
        }
        let len = u32::from_le_bytes(buf[..4].try_into().unwrap_or_default()) as usize;
        if len > MAX_HEADER_BYTES {
            let e = invalid(format!(
                "a local request header is at most {MAX_HEADER_BYTES} bytes, this one says {len}"
            ));
            send(
                &stream,
                &json!({"error": {"kind": e.0, "message": e.1}}),
                None,
            )
            .await?;
            return Ok(());
        }
        while n < 4 + len {
            let (m, more) = receive(&stream, &mut buf[n..4 + len]).await?;
            if m == 0 {
                return Ok(());
            }
            fds.extend(more);
            n += m;
        }
        if n > 4 + len {
            // One request at a time: the client waits for each reply.
            let e = invalid(
                "bytes after the request header; send one request, then wait for its reply",
            );
            send(
                &stream,
                &json!({"error": {"kind": e.0, "message": e.1}}),
                None,
            )
            .await?;
            return Ok(());
        }
        let (reply, fd) = match handle(&buf[4..4 + len], fds, &registry).await {
            Ok((v, fd)) => (json!({ "ok": v }), fd),
            Err(Failure(kind, message)) => {
                (json!({"error": {"kind": kind, "message": message}}), None)
            }
        };
        send(&stream, &reply, fd.as_ref()).await?;
    }
}

fn no_fds(fds: &[OwnedFd]) -> Result<(), Failure> {
    if fds.is_empty() {
        Ok(())
    } else {
        Err(invalid("only a put carries a descriptor"))
    }
}

async fn handle(
    header: &[u8],
    mut fds: Vec<OwnedFd>,
    registry: &Arc<Registry>,
) -> Result<(Value, Option<OwnedFd>), Failure> {
    let req: LocalRequest = serde_json::from_slice(header)
        .map_err(|e| invalid(format!("a malformed local-socket request: {e}")))?;
    match req {
        LocalRequest::Put {
            token,
            dtype,
            dims,
            device,
        } => {
            let (s, _active) = registry.get(&token)?;
            if fds.len() != 1 {
                return Err(invalid(format!(
                    "a local put carries exactly one memfd with the data, this one {}",
                    fds.len()
                )));
            }
            let fd = fds.remove(0);
            let ty = PrimitiveType::from_name(&dtype.to_ascii_uppercase())
                .ok_or_else(|| invalid(format!("`{dtype}` is not a dtype tpubox supports")))?;
            // Refuse what can never fit before the descriptor is looked at.
            let expected = s.session().admit_tensor(ty, &dims)?;
            // Only a sealed memfd: reading it never waits on anything but memory, and its
            // writer can no longer shrink or change it (pjrt::MappedFile::sealed_memfd).
            let map = pjrt::MappedFile::sealed_memfd(fd).map_err(|e| invalid(e.to_string()))?;
            let data = map.as_slice();
            if data.len() < expected {
                return Err(invalid(format!(
                    "the memfd holds {} bytes, fewer than the {expected} the header declares",
                    data.len()
                )));
            }
            let (h, t) = s.put(ty, &dims, &data[..expected], device)?;
            drop(map);
            Ok((info(h, &t), None))
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
            Ok((json!({ "results": results }), None))
        }
        LocalRequest::Free {
            token,
            tensors,
            executables,
        } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            let (freed, unknown) = s.free(&tensors, &executables)?;
            Ok((json!({"freed": freed, "unknown": unknown}), None))
        }
        LocalRequest::Get { token, handle } => {
            no_fds(&fds)?;
            let (s, _active) = registry.get(&token)?;
            let t = s.tensor(handle)?;
            let bytes = s.session().read(&t).await?;
            let fd = tokio::task::spawn_blocking(move || -> std::io::Result<OwnedFd> {
                use rustix::fs::{MemfdFlags, SealFlags};
                let fd = rustix::fs::memfd_create(
                    "tpubox-tensor",
                    MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
                )?;
                let file = std::fs::File::from(fd);
                file.write_all_at(&bytes, 0)?;
                let fd = OwnedFd::from(file);
                rustix::fs::fcntl_add_seals(
                    &fd,
                    SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL,
                )?;
                Ok(fd)
            })
            .await
            .map_err(|e| Failure(ErrorKind::Internal.as_str(), e.to_string()))?
            .map_err(|e| {
                Failure(
                    ErrorKind::Internal.as_str(),
                    format!("a memfd for the tensor: {e}"),
                )
            })?;
            Ok((info(handle, &t), Some(fd)))
        }
    }
}
