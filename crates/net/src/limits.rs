//! What a door allows a connection ([`DoorLimits`]) and the connection caps every door shares
//! ([`Connections`]).

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

/// The limits of the daemon's doors (REST, gRPC, metrics, and the session API on TCP and on
/// its Unix socket). Every field has a `tpubox serve` flag (docs/SECURITY.md lists them).
#[derive(Debug, Clone, PartialEq)]
pub struct DoorLimits {
    /// TCP connections open at once, all TCP doors together (`--max-connections`, default
    /// 1024): the TCP pool of [`Connections`]. When it is full, the oldest connection that
    /// has not authenticated is closed to make room (protection `connections-total`); a new
    /// connection is refused (accepted and closed at once) only when every connection of the
    /// pool has authenticated. Lowered with [`DoorLimits::max_local_connections`] to half the
    /// process's descriptor limit ([`DoorLimits::effective`]).
    pub max_connections: usize,
    /// Connections open at once on the Unix sockets (the session API's socket and its local
    /// socket together; `--max-local-connections`, default 512): a pool apart from TCP's,
    /// with the same rules, so that no TCP flood can take a local client's place.
    pub max_local_connections: usize,
    /// Connections that have not authenticated open at once from one peer address, per pool
    /// (every Unix-socket client is one peer) (`--max-connections-per-peer`, default 128).
    /// A peer's next one closes its oldest (protection `connections-per-peer`). Authenticated
    /// connections do not count here: behind one proxy or NAT, or on one Ray node, every
    /// client is the same peer.
    pub max_connections_per_peer: usize,
    /// Authenticated connections one tenant may hold per pool (`--max-connections-per-tenant`,
    /// default 256): a connection becomes its tenant's with its first request whose
    /// credential a door accepts, and from then on is never closed to make room. A tenant's
    /// connections beyond this share stay anonymous (served, but closable to make room;
    /// protection `connections-per-tenant`).
    pub max_connections_per_tenant: usize,
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
            max_local_connections: 512,
            max_connections_per_peer: 128,
            max_connections_per_tenant: 256,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(120),
            max_streams: 128,
            max_header_bytes: 64 << 10,
        }
    }
}

impl DoorLimits {
    /// These limits with `max_connections` and `max_local_connections` lowered in
    /// proportion so that together they are at most half the process's soft descriptor limit
    /// (`RLIMIT_NOFILE`), so that connections alone can never exhaust the descriptors that
    /// sessions, the compile cache and plugins need. Returns the limits and whether a cap was
    /// lowered.
    pub fn effective(&self) -> (DoorLimits, bool) {
        let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        self.within(usize::try_from(soft / 2).unwrap_or(usize::MAX).max(2))
    }

    /// [`DoorLimits::effective`] for a budget of `budget` descriptors.
    fn within(&self, budget: usize) -> (DoorLimits, bool) {
        let mut l = self.clone();
        let want = l.max_connections.saturating_add(l.max_local_connections);
        let lowered = want > budget;
        if lowered {
            let tcp = (l.max_connections as u128 * budget as u128 / want as u128) as usize;
            l.max_connections = tcp.max(1);
            l.max_local_connections = budget.saturating_sub(l.max_connections).max(1);
        }
        l.max_connections_per_peer = l
            .max_connections_per_peer
            .min(l.max_connections.max(l.max_local_connections));
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

/// One open connection's place in its pool.
struct Record {
    peer: Peer,
    /// `None` while the connection has not authenticated (it may be closed to make room);
    /// else the tenant it is counted for.
    tenant: Option<Arc<str>>,
    /// Woken when the connection is closed to make room ([`ConnectionGuard::evicted`]).
    wake: Arc<Notify>,
}

/// Connections that have not authenticated, oldest (smallest id) first, in two tiers: *idle*
/// ones have sent nothing yet, *talking* ones have sent bytes (a request head on its way).
/// Room is made from the idle ones first, so that a flood of connections that never send
/// anything cannot close a client's new connection between its accept and its first head.
#[derive(Default)]
struct Anonymous {
    idle: BTreeSet<u64>,
    talking: BTreeSet<u64>,
}

impl Anonymous {
    fn len(&self) -> usize {
        self.idle.len() + self.talking.len()
    }

    fn is_empty(&self) -> bool {
        self.idle.is_empty() && self.talking.is_empty()
    }

    /// The one to close first: the oldest idle one, else the oldest talking one.
    fn first(&self) -> Option<u64> {
        self.idle.first().or(self.talking.first()).copied()
    }

    fn insert(&mut self, id: u64, talked: bool) {
        if talked {
            self.talking.insert(id);
        } else {
            self.idle.insert(id);
        }
    }

    fn remove(&mut self, id: u64) {
        if !self.idle.remove(&id) {
            self.talking.remove(&id);
        }
    }

    fn talked(&mut self, id: u64) {
        if self.idle.remove(&id) {
            self.talking.insert(id);
        }
    }
}

/// The connections of one transport (TCP, or the Unix sockets).
struct Pool {
    cap: usize,
    records: HashMap<u64, Record>,
    /// The connections that have not authenticated.
    anonymous: Anonymous,
    /// The same, by peer.
    anonymous_by_peer: HashMap<Peer, Anonymous>,
    /// Authenticated connections per tenant.
    per_tenant: HashMap<Arc<str>, usize>,
}

impl Pool {
    fn new(cap: usize) -> Self {
        Pool {
            cap,
            records: HashMap::new(),
            anonymous: Anonymous::default(),
            anonymous_by_peer: HashMap::new(),
            per_tenant: HashMap::new(),
        }
    }

    fn forget_anonymous(&mut self, id: u64, peer: Peer) {
        self.anonymous.remove(id);
        if let Some(ids) = self.anonymous_by_peer.get_mut(&peer) {
            ids.remove(id);
            if ids.is_empty() {
                self.anonymous_by_peer.remove(&peer);
            }
        }
    }

    /// Removes connection `id`'s record and gives its place back; its record, if it had one.
    fn remove(&mut self, id: u64) -> Option<Record> {
        let r = self.records.remove(&id)?;
        match &r.tenant {
            None => self.forget_anonymous(id, r.peer),
            Some(t) => {
                if let Some(n) = self.per_tenant.get_mut(t) {
                    *n -= 1;
                    if *n == 0 {
                        self.per_tenant.remove(t);
                    }
                }
            }
        }
        Some(r)
    }

    /// Closes connection `id` (one that has not authenticated) to make room.
    fn evict(&mut self, id: u64) -> Option<Peer> {
        let r = self.remove(id)?;
        r.wake.notify_one();
        Some(r.peer)
    }
}

struct Pools {
    next_id: u64,
    tcp: Pool,
    unix: Pool,
}

impl Pools {
    fn of(&mut self, peer: Peer) -> &mut Pool {
        match peer {
            Peer::Ip(_) => &mut self.tcp,
            Peer::Unix => &mut self.unix,
        }
    }
}

/// The connections open on all doors, in two pools: TCP ([`DoorLimits::max_connections`])
/// and the Unix sockets ([`DoorLimits::max_local_connections`]). In each, a connection
/// starts *anonymous* and becomes *authenticated* with its first request whose credential
/// the door accepts ([`ConnectionGuard::authenticate`]), counted for that tenant up to
/// [`DoorLimits::max_connections_per_tenant`]. Room is made by closing anonymous
/// connections, those that have sent nothing ([`ConnectionGuard::talked`]) before those that
/// have, oldest first: a peer's [`DoorLimits::max_connections_per_peer`]-th anonymous
/// connection closes one of that peer's, and a full pool one of its own; a new connection is refused only when its pool is full of authenticated
/// ones. So a flood of connections that never authenticate, from any address (the tenant's
/// own included), closes only connections of its kind, and never one a tenant has
/// authenticated within its share. One per daemon, shared by every door.
pub struct Connections {
    max_per_peer: usize,
    max_per_tenant: usize,
    pools: Mutex<Pools>,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Its pool ([`DoorLimits::max_connections`] or [`DoorLimits::max_local_connections`])
    /// is full of authenticated connections.
    Total,
}

impl Refused {
    /// The protection's name ([`tpubox_core::protection`]).
    pub fn protection(self) -> &'static str {
        match self {
            Refused::Total => "connections-total",
        }
    }
}

/// An anonymous connection closed to make room for a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    /// Its peer.
    pub peer: Peer,
    /// Which cap made the room: `"connections-per-peer"` (the new connection's peer had
    /// [`DoorLimits::max_connections_per_peer`] anonymous ones) or `"connections-total"`
    /// (the pool was full).
    pub protection: &'static str,
}

impl Connections {
    /// Counters for `limits`'s caps.
    pub fn new(limits: &DoorLimits) -> Arc<Self> {
        Arc::new(Connections {
            max_per_peer: limits.max_connections_per_peer.max(1),
            max_per_tenant: limits.max_connections_per_tenant,
            pools: Mutex::new(Pools {
                next_id: 0,
                tcp: Pool::new(limits.max_connections.max(1)),
                unix: Pool::new(limits.max_local_connections.max(1)),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pools> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a new (anonymous) connection from `peer` until the returned guard drops, with
    /// the anonymous connections closed to make room for it (at most two: one of its peer's,
    /// one of its pool's). `talked`: its first bytes are already waiting
    /// ([`Stream::has_bytes`](crate::accept::Stream::has_bytes)), as
    /// [`ConnectionGuard::talked`] would mark it.
    ///
    /// Errors: [`Refused::Total`] when its pool is full of authenticated connections (nothing
    /// is counted or closed then).
    pub fn admit(
        self: &Arc<Self>,
        peer: Peer,
        talked: bool,
    ) -> Result<(Arc<ConnectionGuard>, Vec<Evicted>), Refused> {
        let max_per_peer = self.max_per_peer;
        let mut pools = self.lock();
        let id = pools.next_id;
        let pool = pools.of(peer);
        if pool.records.len() >= pool.cap && pool.anonymous.is_empty() {
            return Err(Refused::Total);
        }
        let mut evicted = Vec::new();
        let peers_oldest = pool
            .anonymous_by_peer
            .get(&peer)
            .filter(|ids| ids.len() >= max_per_peer)
            .and_then(Anonymous::first);
        if let Some(old) = peers_oldest
            && let Some(p) = pool.evict(old)
        {
            evicted.push(Evicted {
                peer: p,
                protection: "connections-per-peer",
            });
        }
        if pool.records.len() >= pool.cap
            && let Some(old) = pool.anonymous.first()
            && let Some(p) = pool.evict(old)
        {
            evicted.push(Evicted {
                peer: p,
                protection: "connections-total",
            });
        }
        let wake = Arc::new(Notify::new());
        pool.records.insert(
            id,
            Record {
                peer,
                tenant: None,
                wake: Arc::clone(&wake),
            },
        );
        pool.anonymous.insert(id, talked);
        pool.anonymous_by_peer
            .entry(peer)
            .or_default()
            .insert(id, talked);
        pools.next_id += 1;
        Ok((
            Arc::new(ConnectionGuard {
                owner: Arc::clone(self),
                id,
                peer,
                wake,
                counted: AtomicBool::new(false),
            }),
            evicted,
        ))
    }

    /// Connections open now, both pools together.
    pub fn open(&self) -> usize {
        let p = self.lock();
        p.tcp.records.len() + p.unix.records.len()
    }

    /// Connections open now that have not authenticated, both pools together.
    pub fn anonymous(&self) -> usize {
        let p = self.lock();
        p.tcp.anonymous.len() + p.unix.anonymous.len()
    }
}

/// What [`ConnectionGuard::authenticate`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Authenticated {
    /// The connection is now counted for the tenant: it is never closed to make room.
    Now,
    /// It already was (for this tenant or another).
    Already,
    /// The tenant has [`DoorLimits::max_connections_per_tenant`] authenticated connections
    /// in this pool: this one stays anonymous (served, but it may be closed to make room).
    OverShare,
    /// The connection was closed to make room before its request was admitted.
    Evicted,
}

/// One admitted connection; dropping it gives its place back.
pub struct ConnectionGuard {
    owner: Arc<Connections>,
    id: u64,
    peer: Peer,
    wake: Arc<Notify>,
    /// Set once the connection is counted for a tenant: later requests skip the pools' lock.
    counted: AtomicBool,
}

impl ConnectionGuard {
    /// Counts this connection as `tenant`'s from now on (a door calls it when a request's
    /// credential was accepted), unless the tenant's share of the pool is full.
    pub fn authenticate(&self, tenant: &str) -> Authenticated {
        if self.counted.load(Ordering::Relaxed) {
            return Authenticated::Already;
        }
        let max_per_tenant = self.owner.max_per_tenant;
        let mut pools = self.owner.lock();
        let pool = pools.of(self.peer);
        let Some(r) = pool.records.get(&self.id) else {
            return Authenticated::Evicted;
        };
        if r.tenant.is_some() {
            self.counted.store(true, Ordering::Relaxed);
            return Authenticated::Already;
        }
        let held = pool.per_tenant.get(tenant).copied().unwrap_or(0);
        if held >= max_per_tenant {
            return Authenticated::OverShare;
        }
        let key: Arc<str> = match pool.per_tenant.get_key_value(tenant) {
            Some((k, _)) => Arc::clone(k),
            None => Arc::from(tenant),
        };
        pool.per_tenant.insert(Arc::clone(&key), held + 1);
        pool.forget_anonymous(self.id, self.peer);
        if let Some(r) = pool.records.get_mut(&self.id) {
            r.tenant = Some(key);
        }
        self.counted.store(true, Ordering::Relaxed);
        Authenticated::Now
    }

    /// Marks the connection as one that has sent bytes: while it has not authenticated, it is
    /// closed to make room only after every anonymous connection that has sent nothing. A
    /// door calls it when the first bytes of a connection arrive.
    pub fn talked(&self) {
        if self.counted.load(Ordering::Relaxed) {
            return;
        }
        let mut pools = self.owner.lock();
        let pool = pools.of(self.peer);
        pool.anonymous.talked(self.id);
        if let Some(ids) = pool.anonymous_by_peer.get_mut(&self.peer) {
            ids.talked(self.id);
        }
    }

    /// Resolves when the connection was closed to make room (never, once it authenticated):
    /// its driver then drops it.
    pub async fn evicted(&self) {
        self.wake.notified().await;
    }

    /// Its peer.
    pub fn peer(&self) -> Peer {
        self.peer
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        let mut pools = self.owner.lock();
        pools.of(self.peer).remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_peer: usize, per_tenant: usize) -> DoorLimits {
        DoorLimits {
            max_connections: total,
            max_local_connections: 2,
            max_connections_per_peer: per_peer,
            max_connections_per_tenant: per_tenant,
            ..DoorLimits::default()
        }
    }

    #[test]
    fn the_descriptor_budget_lowers_both_pools_in_proportion() {
        let l = DoorLimits {
            max_connections: 1024,
            max_local_connections: 512,
            ..DoorLimits::default()
        };
        let (e, lowered) = l.within(768);
        assert!(lowered);
        assert_eq!((e.max_connections, e.max_local_connections), (512, 256));
        assert_eq!(l.within(4096), (l.clone(), false));
    }

    #[test]
    fn anonymous_connections_make_room_oldest_first() {
        let c = Connections::new(&limits(3, 2, 8));
        let a = Peer::Ip([10, 0, 0, 1].into());
        let b = Peer::Ip([10, 0, 0, 2].into());
        let (a1, e) = c.admit(a, false).unwrap();
        assert!(e.is_empty());
        let (a2, _) = c.admit(a, false).unwrap();
        // A's third anonymous connection closes A's oldest.
        let (a3, e) = c.admit(a, false).unwrap();
        assert_eq!(
            e,
            vec![Evicted {
                peer: a,
                protection: "connections-per-peer"
            }]
        );
        assert_eq!(a1.authenticate("t"), Authenticated::Evicted);
        assert_eq!(c.open(), 2);
        drop(a1);
        assert_eq!(c.open(), 2);
        let (_b1, e) = c.admit(b, false).unwrap();
        assert!(e.is_empty());
        // The pool is full: B's second closes the oldest anonymous one of all (a2).
        let (_b2, e) = c.admit(b, false).unwrap();
        assert_eq!(e[0].peer, a);
        assert_eq!(e[0].protection, "connections-total");
        assert_eq!(a2.authenticate("t"), Authenticated::Evicted);
        assert_eq!(a3.authenticate("t"), Authenticated::Now);
        assert_eq!(c.open(), 3);
        assert_eq!(c.anonymous(), 2);
    }

    #[test]
    fn authenticated_connections_are_never_closed_and_shares_are_capped() {
        let c = Connections::new(&limits(3, 8, 2));
        let a = Peer::Ip([10, 0, 0, 1].into());
        let (t1, _) = c.admit(a, false).unwrap();
        let (t2, _) = c.admit(a, false).unwrap();
        let (t3, _) = c.admit(a, false).unwrap();
        assert_eq!(t1.authenticate("t"), Authenticated::Now);
        assert_eq!(t1.authenticate("u"), Authenticated::Already);
        assert_eq!(t2.authenticate("t"), Authenticated::Now);
        // The tenant's share is 2: the third stays anonymous, and is what makes room.
        assert_eq!(t3.authenticate("t"), Authenticated::OverShare);
        let (flood, e) = c.admit(a, false).unwrap();
        assert_eq!(e.len(), 1);
        assert_eq!(t3.authenticate("u"), Authenticated::Evicted);
        assert_eq!(flood.authenticate("u"), Authenticated::Now);
        // Full of authenticated connections: a new one is refused.
        assert_eq!(c.admit(a, false).err(), Some(Refused::Total));
        drop(t1);
        assert!(c.admit(a, false).is_ok());
    }

    #[test]
    fn unix_sockets_have_a_pool_of_their_own() {
        let c = Connections::new(&limits(1, 8, 8));
        let (tcp, _) = c.admit(Peer::Ip([10, 0, 0, 1].into()), false).unwrap();
        assert_eq!(tcp.authenticate("t"), Authenticated::Now);
        assert_eq!(
            c.admit(Peer::Ip([10, 0, 0, 2].into()), false).err(),
            Some(Refused::Total)
        );
        let (u1, _) = c.admit(Peer::Unix, false).unwrap();
        let (_u2, e) = c.admit(Peer::Unix, false).unwrap();
        assert!(e.is_empty());
        let (_u3, e) = c.admit(Peer::Unix, false).unwrap();
        assert_eq!(e.len(), 1);
        assert_eq!(u1.authenticate("t"), Authenticated::Evicted);
    }

    #[test]
    fn connections_that_sent_nothing_make_room_first() {
        let c = Connections::new(&limits(8, 2, 8));
        let a = Peer::Ip([10, 0, 0, 1].into());
        let (talking, _) = c.admit(a, false).unwrap();
        talking.talked();
        let (idle, _) = c.admit(a, false).unwrap();
        // A's third anonymous connection closes the idle one, though the talking one is older.
        let (_third, e) = c.admit(a, false).unwrap();
        assert_eq!(e.len(), 1);
        assert_eq!(idle.authenticate("t"), Authenticated::Evicted);
        assert_eq!(talking.authenticate("t"), Authenticated::Now);
        // Admitted with its bytes already waiting, it counts as talking at once.
        let c = Connections::new(&limits(8, 2, 8));
        let (early, _) = c.admit(a, true).unwrap();
        let (idle, _) = c.admit(a, false).unwrap();
        let (_third, _) = c.admit(a, false).unwrap();
        assert_eq!(idle.authenticate("t"), Authenticated::Evicted);
        assert_eq!(early.authenticate("t"), Authenticated::Now);
    }

    #[tokio::test]
    async fn an_evicted_connection_is_woken() {
        let c = Connections::new(&limits(1, 8, 8));
        let (old, _) = c.admit(Peer::Ip([10, 0, 0, 1].into()), false).unwrap();
        let (_new, e) = c.admit(Peer::Ip([10, 0, 0, 2].into()), false).unwrap();
        assert_eq!(e.len(), 1);
        tokio::time::timeout(std::time::Duration::from_secs(5), old.evicted())
            .await
            .expect("woken");
    }
}
