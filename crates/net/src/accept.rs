//! Accepting connections: TCP or Unix listeners, with back-off on errors.
//!
//! `accept(2)` fails when the process is out of descriptors (`EMFILE`) or the system is
//! (`ENFILE`), and the pending connection stays in the backlog, so a loop that retries at once
//! spins at a full core until a descriptor frees. [`Listener::accept`] sleeps after each
//! failure, doubling from [`BACKOFF_MIN`] to [`BACKOFF_MAX`], and reports the failure as the
//! protection `accept-errors`.

use std::time::Duration;

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::limits::Peer;

/// First pause after an accept error.
pub const BACKOFF_MIN: Duration = Duration::from_millis(5);
/// Longest pause after repeated accept errors.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Connections the kernel holds for a TCP listener before the daemon accepts them
/// (`listen(2)`'s backlog; the kernel caps it at `net.core.somaxconn`, 4096 by default). Over
/// the cap, connections are accepted and closed at once, so the backlog drains as fast as the
/// accept loop runs; this depth absorbs a burst of connections (a flood from one peer) while
/// the loop is briefly starved of CPU, instead of dropping other peers' SYNs (which a client
/// retries only after a second).
pub const TCP_BACKLOG: u32 = 4096;

/// A TCP listener on `addr` with [`TCP_BACKLOG`] and `SO_REUSEADDR` (a restarted daemon can
/// bind its port while old connections linger in TIME_WAIT).
///
/// Errors: the address cannot be bound (in use, not local, no permission).
pub fn bind_tcp(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(TCP_BACKLOG)
}

/// A bound listener of one door.
pub enum Listener {
    /// A TCP listener.
    Tcp(TcpListener),
    /// A Unix-socket listener.
    Unix(UnixListener),
}

/// An accepted connection.
pub enum Stream {
    /// A TCP connection (`TCP_NODELAY` set).
    Tcp(TcpStream),
    /// A Unix-socket connection.
    Unix(UnixStream),
    /// A TCP connection after its TLS handshake.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Stream {
    /// Waits until the peer has sent something (or closed): the connection's first bytes.
    ///
    /// Errors: the socket's.
    pub async fn readable(&self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(t) => t.readable().await,
            Stream::Unix(u) => u.readable().await,
            Stream::Tls(t) => t.get_ref().0.readable().await,
        }
    }

    /// Whether the peer's first bytes are already waiting in the socket (a peek that does not
    /// wait and consumes nothing): a client's connection usually arrives with its request head
    /// behind it, a flood's idle one without.
    pub fn has_bytes(&self) -> bool {
        use rustix::net::{RecvFlags, recv};
        let mut one = [0u8; 1];
        let flags = RecvFlags::PEEK | RecvFlags::DONTWAIT;
        let got = match self {
            Stream::Tcp(t) => recv(t, &mut one, flags),
            Stream::Unix(u) => recv(u, &mut one, flags),
            Stream::Tls(t) => recv(t.get_ref().0, &mut one, flags),
        };
        matches!(got, Ok((n, _)) if n > 0)
    }
}

impl Listener {
    /// The next connection and its peer; on errors, backs off and tries again (it never
    /// returns an error: a listener that stays broken keeps logging at a bounded rate).
    pub async fn accept(&self, door: &'static str) -> (Stream, Peer) {
        let mut pause = BACKOFF_MIN;
        loop {
            let r = match self {
                Listener::Tcp(l) => l.accept().await.map(|(s, a)| {
                    let _ = s.set_nodelay(true);
                    (Stream::Tcp(s), Peer::Ip(a.ip()))
                }),
                Listener::Unix(l) => l.accept().await.map(|(s, _)| (Stream::Unix(s), Peer::Unix)),
            };
            match r {
                Ok(x) => return x,
                Err(e) => {
                    tpubox_core::protection::triggered(
                        "accept-errors",
                        door,
                        format_args!("accept failed ({e}); pausing {pause:?}"),
                    );
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(BACKOFF_MAX);
                }
            }
        }
    }
}
