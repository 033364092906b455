//! tpubox's doors to the network, hardened: every listener of `tpubox serve` (REST, gRPC,
//! metrics, the session API on TCP and on its Unix socket) is served by [`serve()`], which
//! applies, before anything else runs:
//!
//! - admission that favours work over idleness ([`Connections`]): two pools of connections
//!   (TCP, and the Unix sockets), each capped; in each, connections that have not
//!   authenticated are capped per peer and closed oldest first to make room, and a
//!   tenant's authenticated connections (up to its share) are never closed to make room; a
//!   new connection is refused (accepted and closed at once, so the backlog never fills)
//!   only when its pool is full of authenticated connections;
//! - accept errors (out of descriptors) back off instead of spinning ([`accept`]);
//! - a header timeout (the first request head, HTTP/1 or HTTP/2, must arrive in full within
//!   [`DoorLimits::header_timeout`]), a body timeout and an idle timeout;
//! - HTTP/2's `SETTINGS_MAX_CONCURRENT_STREAMS` and a header-list cap;
//! - TLS on TCP connections when the daemon has a certificate ([`tls`]), the handshake
//!   within the header timeout;
//! - authentication from the request head alone ([`Admission`]): a request without a valid
//!   credential is answered (401, gRPC `UNAUTHENTICATED`) without a byte of its body read,
//!   so it costs the daemon its head (at most [`DoorLimits::max_header_bytes`]) and nothing
//!   else.
//!
//! Each protection that triggers is counted and logged through
//! [`tpubox_core::protection::triggered`]. The doors' handlers (axum routers; tonic services
//! as axum routers) stay what they were: this crate decides nothing about tenants, only
//! whether a credential is valid, by asking the door.
//!
//! Modules: [`limits`] (the limits and connection counts), [`accept`] (listeners, back-off),
//! [`serve`](mod@serve) (connections and requests), [`tls`] (certificates, client certificates).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod accept;
pub mod limits;
pub mod serve;
pub mod tls;

pub use accept::{Listener, Stream, bind_tcp};
pub use limits::{
    Authenticated, ConnectionGuard, Connections, DoorLimits, Evicted, PUBLIC_BODY_BYTES, Peer,
};
pub use serve::{Admission, Admit, BodyError, Door, Windows, body_error, serve};
pub use tls::{ClientCerts, Tls, TlsFiles};

/// The bearer token of an `Authorization` header value (RFC 6750 §2.1: `Bearer TOKEN`, the
/// scheme case-insensitive); `None` for anything else.
pub fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    let v = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The limits and connection counts every door of one daemon shares.
#[derive(Clone)]
pub struct Doors {
    /// The limits, [`DoorLimits::effective`] already applied.
    pub limits: DoorLimits,
    /// The connections open on every door.
    pub connections: std::sync::Arc<Connections>,
    /// TLS of the TCP doors (`None`: plain text).
    pub tls: Option<std::sync::Arc<Tls>>,
}

impl Doors {
    /// Doors with `limits`, the connection cap lowered to what the descriptor limit allows
    /// (logged when it is).
    pub fn new(limits: &DoorLimits) -> Self {
        let (limits, lowered) = limits.effective();
        if lowered {
            tracing::info!(
                max_connections = limits.max_connections,
                max_local_connections = limits.max_local_connections,
                "at most {} TCP and {} Unix-socket connections at once: half the process's descriptor limit (raise `ulimit -n` for more)",
                limits.max_connections,
                limits.max_local_connections
            );
        }
        Doors {
            connections: Connections::new(&limits),
            limits,
            tls: None,
        }
    }

    /// A door named `name` (HTTP/1 and HTTP/2, hyper's windows, no keep-alive pings) that
    /// admits what `admit` says.
    pub fn door(&self, name: &'static str, admit: Admit) -> Door {
        Door {
            name,
            limits: self.limits.clone(),
            connections: std::sync::Arc::clone(&self.connections),
            admit,
            http2_only: false,
            windows: None,
            keepalive: None,
            long_lived: &[],
            tls: self.tls.clone(),
        }
    }
}
