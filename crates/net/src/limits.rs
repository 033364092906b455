//! What a door allows a connection ([`DoorLimits`]) and the connection caps every door shares
//! ([`Connections`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The limits of the daemon's doors (REST, gRPC, metrics, and the session API on TCP and on
/// its Unix socket). Every field has a `tpubox serve` flag (docs/SECURITY.md lists them).
#[derive(Debug, Clone, PartialEq)]
pub struct DoorLimits {
    /// Connections open at once, all doors together (`--max-connections`, default 1024). A
    /// connection over the cap is accepted and closed at once (protection
    /// `connections-total`). Also capped at half the process's descriptor limit
    /// ([`DoorLimits::effective`]).
    pub max_connections: usize,
    /// Connections open at once from one peer address (a Unix-socket peer counts as one
    /// address), all doors together (`--max-connections-per-peer`, default 128; protection
    /// `connections-per-peer`).
    pub max_connections_per_peer: usize,
    /// How long a new connection may take to send its first complete request head: the
    /// HTTP/1 request line and headers, or the HTTP/2 preface, settings and first HEADERS
    /// (`--header-timeout-seconds`, default 10 s; protection `header-timeout`). For later
    /// HTTP/1 requests on a kept-alive connection hyper applies the same limit to each head.
    pub header_timeout: Duration,
    /// How long a request body may take to arrive in full, from its head
    /// (`--body-timeout-seconds`, default 60 s; protection `body-timeout`). Streams the door
    /// declares long-lived (the session API's `Attach`) are exempt.
    pub body_timeout: Duration,
    /// A connection with no request in flight for this long is closed (gracefully: HTTP/2
    /// GOAWAY) (`--idle-timeout-seconds`, default 120 s; protection `idle-timeout`).
    pub idle_timeout: Duration,
    /// HTTP/2 streams one connection may have open at once, advertised as
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` (RFC 9113 §6.5.2) (`--max-streams`, default 128).
    pub max_streams: u32,
    /// Largest request head, in bytes: HTTP/1's read buffer and HTTP/2's
    /// `SETTINGS_MAX_HEADER_LIST_SIZE` (default 64 KiB).
    pub max_header_bytes: usize,
}

/// Largest body a public request (one a door serves without a token: `/v2/health/*`) may
/// carry, in bytes; a larger one gets 413 before it is read.
pub const PUBLIC_BODY_BYTES: usize = 4 << 10;

impl Default for DoorLimits {
    fn default() -> Self {
        DoorLimits {
            max_connections: 1024,
            max_connections_per_peer: 128,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(120),
            max_streams: 128,
            max_header_bytes: 64 << 10,
        }
    }
}

impl DoorLimits {
    /// These limits with `max_connections` lowered to half the process's soft descriptor
    /// limit (`RLIMIT_NOFILE`), so that connections alone can never exhaust the descriptors
    /// that sessions, the compile cache and plugins need. Returns the limits and whether the
    /// cap was lowered.
    pub fn effective(&self) -> (DoorLimits, bool) {
        let mut l = self.clone();
        let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        let cap = usize::try_from(soft / 2).unwrap_or(usize::MAX).max(1);
        let lowered = cap < l.max_connections;
        if lowered {
            l.max_connections = cap;
        }
        l.max_connections_per_peer = l.max_connections_per_peer.min(l.max_connections);
        (l, lowered)
    }
}

/// Who is on the other end of a connection, for the per-peer cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// A TCP peer's IP address.
    Ip(IpAddr),
    /// Any client of a Unix socket (mode 0600: the daemon's own user).
    Unix,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Ip(a) => write!(f, "{a}"),
            Peer::Unix => f.write_str("unix"),
        }
    }
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_peer: HashMap<Peer, usize>,
}

/// The connections open on all doors, counted against [`DoorLimits::max_connections`] and
/// [`DoorLimits::max_connections_per_peer`]. One per daemon, shared by every door.
pub struct Connections {
    max_total: usize,
    max_per_peer: usize,
    counts: Mutex<Counts>,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// [`DoorLimits::max_connections`] connections are open.
    Total,
    /// [`DoorLimits::max_connections_per_peer`] connections from this peer are open.
    PerPeer,
}

impl Refused {
    /// The protection's name ([`tpubox_core::protection`]).
    pub fn protection(self) -> &'static str {
        match self {
            Refused::Total => "connections-total",
            Refused::PerPeer => "connections-per-peer",
        }
    }
}

impl Connections {
    /// Counters for `limits`'s caps.
    pub fn new(limits: &DoorLimits) -> Arc<Self> {
        Arc::new(Connections {
            max_total: limits.max_connections,
            max_per_peer: limits.max_connections_per_peer,
            counts: Mutex::new(Counts::default()),
        })
    }

    /// Counts a connection from `peer` until the returned guard drops.
    ///
    /// Errors: [`Refused`] when a cap is reached (nothing is counted then).
    pub fn admit(self: &Arc<Self>, peer: Peer) -> Result<ConnectionGuard, Refused> {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if c.total >= self.max_total {
            return Err(Refused::Total);
        }
        let n = c.per_peer.get(&peer).copied().unwrap_or(0);
        if n >= self.max_per_peer {
            return Err(Refused::PerPeer);
        }
        c.total += 1;
        c.per_peer.insert(peer, n + 1);
        Ok(ConnectionGuard {
            owner: Arc::clone(self),
            peer,
        })
    }

    /// Connections open now, all doors together.
    pub fn open(&self) -> usize {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).total
    }
}

/// One admitted connection; dropping it gives its place back.
pub struct ConnectionGuard {
    owner: Arc<Connections>,
    peer: Peer,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        let mut c = self.owner.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                c.per_peer.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_total_and_per_peer_and_gives_places_back() {
        let limits = DoorLimits {
            max_connections: 3,
            max_connections_per_peer: 2,
            ..DoorLimits::default()
        };
        let c = Connections::new(&limits);
        let a = Peer::Ip([10, 0, 0, 1].into());
        let b = Peer::Ip([10, 0, 0, 2].into());
        let a1 = c.admit(a).unwrap();
        let _a2 = c.admit(a).unwrap();
        assert_eq!(c.admit(a).err(), Some(Refused::PerPeer));
        let _b1 = c.admit(b).unwrap();
        assert_eq!(c.admit(Peer::Unix).err(), Some(Refused::Total));
        drop(a1);
        assert_eq!(c.open(), 2);
        let _u = c.admit(Peer::Unix).unwrap();
        assert_eq!(c.admit(b).err(), Some(Refused::Total));
    }
}
