//! The session API: the daemon's front door for clients that hold state on the device between
//! calls (a notebook kernel, a Python program, a Ray actor), gRPC service `tpubox.v1.Session`
//! (`host/proto/tpubox/v1/session.proto`) over a Unix socket and TCP.
//!
//! A client opens a session with a tenant token and gets a session token back; with it, it puts
//! and gets tensors, compiles StableHLO, executes with borrowed and donated handles, opens the
//! daemon's shared weight sets, runs guest components and reads its usage. Each session is one
//! [`tpubox_core::session::Session`] of the session layer with its own accounting tenant, so every
//! limit and check a Wasm guest meets applies here too; nothing about tenants is decided in
//! this module.
//!
//! One job per module:
//! - [`policy`]: the `[tenant.session]` table of the tokens file and the limits of one session;
//! - [`registry`]: the live sessions, their handle tables, and how they end;
//! - [`grpc`]: the gRPC service;
//! - [`local`]: the local socket beside the Unix socket, tensor data through shared memory.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod codec;
#[doc(hidden)]
pub mod fuzzing;
pub mod grpc;
pub mod local;
pub mod policy;
pub mod registry;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

use registry::{AccessResult, OpenGrant, Registry};
use tpubox_wasm::sandbox::Sandbox;

/// HTTP/2 stream window of the session listeners, in bytes (a connection's is 4×).
pub const WINDOW_BYTES: u32 = 16 << 20;
/// Largest HTTP/2 frame the session listeners accept, in bytes (the protocol's ceiling is
/// 2^24 - 1).
pub const FRAME_BYTES: u32 = (1 << 24) - 1;

/// Who may open sessions: the daemon's tokens file answers (`tpubox_serve::access`).
pub trait SessionAccess: Send + Sync {
    /// The tenant of a bearer token and its session policy.
    ///
    /// Errors: [`registry::AccessError::Unauthenticated`] for no token or an unknown one;
    /// [`registry::AccessError::Device`] with `permission-denied` when the tenant may not open
    /// sessions.
    fn grant(&self, token: Option<&str>) -> AccessResult<OpenGrant>;
}

/// Where the session API listens and what it offers.
#[derive(Debug, Clone, Default)]
pub struct SessionApiConfig {
    /// A Unix socket to create (mode [`socket_mode`](Self::socket_mode); an existing socket
    /// file is replaced), and beside it the local socket `PATH.local` ([`local`]).
    pub socket: Option<PathBuf>,
    /// The sockets' file mode (`None`: 0600, the daemon's user only). Who may connect is who
    /// may write the socket; every call still needs a token.
    pub socket_mode: Option<u32>,
    /// The group the sockets are given (a gid), so that a mode of 0660 lets that group's
    /// users (kernels running as other Unix users) connect.
    pub socket_group: Option<u32>,
    /// A TCP address.
    pub tcp: Option<SocketAddr>,
    /// A directory of components `RunComponent` runs by name (`DIR/NAME.wasm`).
    pub components: Option<PathBuf>,
    /// Largest request message, in bytes.
    pub max_message_bytes: usize,
}

impl SessionApiConfig {
    /// Whether any listener is configured.
    pub fn enabled(&self) -> bool {
        self.socket.is_some() || self.tcp.is_some()
    }
}

/// The bound listeners of the session API.
pub struct Listeners {
    unix: Option<(tokio::net::UnixListener, PathBuf)>,
    local: Option<(tokio::net::UnixListener, PathBuf)>,
    tcp: Option<tokio::net::TcpListener>,
}

impl Listeners {
    /// Binds what `config` names.
    ///
    /// Errors: a socket path that exists and is not a socket, a directory that does not
    /// exist, an address in use.
    pub async fn bind(config: &SessionApiConfig) -> Result<Self> {
        let (unix, local) = match &config.socket {
            Some(p) => {
                let b = local::local_path(p);
                let (mode, group) = (config.socket_mode.unwrap_or(0o600), config.socket_group);
                (
                    Some((bind_unix(p, mode, group)?, p.clone())),
                    Some((bind_unix(&b, mode, group)?, b)),
                )
            }
            None => (None, None),
        };
        let tcp = match config.tcp {
            Some(a) => Some(
                tpubox_net::bind_tcp(a).with_context(|| format!("binding the session port {a}"))?,
            ),
            None => None,
        };
        Ok(Listeners { unix, local, tcp })
    }

    /// The Unix socket's path, if any.
    pub fn socket_path(&self) -> Option<&PathBuf> {
        self.unix.as_ref().map(|(_, p)| p)
    }

    /// The TCP address actually bound, if any.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|l| l.local_addr().ok())
    }
}

/// Binds a Unix socket at `p` with `mode` (and group `group`), replacing a stale socket file.
///
/// Errors: a mode with bits outside 0666 (execute or special bits), a path that exists and is
/// not a socket, binding, setting the mode or group.
fn bind_unix(
    p: &std::path::Path,
    mode: u32,
    group: Option<u32>,
) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if mode & !0o666 != 0 {
        anyhow::bail!(
            "--session-socket-mode {mode:04o}: only read and write bits (at most 0666) make sense for a socket"
        );
    }
    if let Ok(m) = std::fs::symlink_metadata(p) {
        if !m.file_type().is_socket() {
            anyhow::bail!(
                "--session-socket {}: the path exists and is not a socket",
                p.display()
            );
        }
        std::fs::remove_file(p)
            .with_context(|| format!("removing the old socket {}", p.display()))?;
    }
    let l = tokio::net::UnixListener::bind(p)
        .with_context(|| format!("binding the session socket {}", p.display()))?;
    // The group first: until the mode is set the socket is the daemon's user's only (the
    // umask's default), never open to a group it is not yet given to.
    if let Some(gid) = group {
        std::os::unix::fs::chown(p, None, Some(gid)).with_context(|| {
            format!(
                "giving {} to group {gid} (--session-socket-group)",
                p.display()
            )
        })?;
    }
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", p.display()))?;
    Ok(l)
}

/// Serves the session API on `listeners` until `stop` resolves; then ends every session.
///
/// Both gRPC listeners go through `doors` ([`tpubox_net::serve()`]): connection caps and
/// timeouts, and every call authenticated from its head before its message is read: `Open`
/// and `TenantUsage` by a tenant token ([`SessionAccess`]), every other call by a live
/// session's token ([`admit`]).
///
/// Errors: a listener fails.
pub async fn serve(
    listeners: Listeners,
    registry: Arc<Registry>,
    access: Arc<dyn SessionAccess>,
    sandbox: Arc<Sandbox>,
    config: SessionApiConfig,
    doors: tpubox_net::Doors,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let reaper = registry::spawn_reaper(&registry);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let local_path = listeners.local.as_ref().map(|(_, p)| p.clone());
    let app =
        tonic::service::Routes::new(grpc::service(
            grpc::Service::new(
                Arc::clone(&registry),
                Arc::clone(&access),
                Arc::clone(&sandbox),
                config.components.clone(),
            )
            .with_local_socket(local_path.clone()),
            config.max_message_bytes,
        ))
        .prepare()
        .into_axum_router()
        // A broken gRPC framing is the client's error (tonic would answer INTERNAL).
        .layer(axum::middleware::map_request(
            |req: axum::extract::Request| async move {
                codec::framed_request(req, codec::CLIENT_STREAMS)
            },
        ));
    let door = |name: &'static str| {
        let mut d = doors.door(name, admit(Arc::clone(&registry), Arc::clone(&access)));
        d.http2_only = true;
        // HTTP/2 pings find clients whose machine went away without closing the connection,
        // so their attached sessions end.
        d.keepalive = Some((Duration::from_secs(10), Duration::from_secs(20)));
        // Large flow-control windows and frames: a 64 MiB tensor then moves in a few round
        // trips instead of thousands of 16 KiB frames and window updates.
        d.windows = Some(tpubox_net::Windows {
            stream: WINDOW_BYTES,
            connection: 4 * WINDOW_BYTES,
            frame: FRAME_BYTES,
        });
        d
    };
    let mut tasks = Vec::new();
    let socket_path = listeners.socket_path().cloned();
    let local_task = listeners
        .local
        .map(|(l, _)| tokio::spawn(local::serve(l, Arc::clone(&registry), doors.clone())));
    if let Some((l, _)) = listeners.unix {
        tasks.push(tokio::spawn(tpubox_net::serve(
            door("session-unix"),
            tpubox_net::Listener::Unix(l),
            app.clone(),
            stopped(stop_rx.clone()),
        )));
    }
    if let Some(l) = listeners.tcp {
        tasks.push(tokio::spawn(tpubox_net::serve(
            door("session-tcp"),
            tpubox_net::Listener::Tcp(l),
            app.clone(),
            stopped(stop_rx.clone()),
        )));
    }
    stop.await;
    registry.close_all("the daemon is stopping");
    let _ = stop_tx.send(true);
    for t in tasks {
        if let Ok(Ok(Err(e))) = tokio::time::timeout(Duration::from_secs(1), t).await {
            tracing::warn!("a session listener ended with: {e:#}");
        }
    }
    reaper.abort();
    if let Some(t) = local_task {
        t.abort();
    }
    for p in [socket_path, local_path].into_iter().flatten() {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

/// Who may call the session API, from a call's head alone: `Open` and `TenantUsage` need a
/// tenant token of the tokens file (a tenant without a `[tenant.session]` table passes here
/// and gets `PERMISSION_DENIED` from the call), every other call a token of a session that
/// is open (`Close` also with one that ended: closing twice is not an error). Anything else is answered
/// `UNAUTHENTICATED` with the error kind the call itself would give, before its message is
/// read.
pub fn admit(registry: Arc<Registry>, access: Arc<dyn SessionAccess>) -> tpubox_net::Admit {
    Arc::new(move |parts: &http::request::Parts| {
        let token = tpubox_net::bearer(&parts.headers);
        let path = parts.uri.path();
        let r = if path == "/tpubox.v1.Session/Open" || path == "/tpubox.v1.Session/TenantUsage" {
            match access.grant(token) {
                Ok(g) => Ok(g.tenant),
                // The tenant is known; the call itself answers what went wrong.
                Err(registry::AccessError::Device(_)) => Ok(String::new()),
                Err(e) => Err(e),
            }
        } else {
            match token {
                Some(t) => registry.get(t).map(|(s, _)| s.tenant_name.clone()),
                None => Err(registry::AccessError::Unauthenticated(
                    "this call needs the session token: `authorization: Bearer SESSION_TOKEN`"
                        .into(),
                )),
            }
        };
        match r {
            Ok(tenant) => tpubox_net::Admission::Authenticated(tenant),
            // Closing a session that ended is not an error (`closed: false`); the connection
            // is not counted for anyone.
            Err(registry::AccessError::Ended(_)) if path == "/tpubox.v1.Session/Close" => {
                tpubox_net::Admission::Authenticated(String::new())
            }
            Err(e) => tpubox_net::Admission::Refused(grpc::access_status(e).into_http()),
        }
    })
}
