//! Serving one door: the accept loop, each connection's driver (timeouts, graceful close),
//! and each request's admission before its body is touched.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;
use tpubox_core::logsafe::clip;
use tpubox_core::protection::{triggered, triggered_by};

use crate::accept::{Listener, Stream};
use crate::limits::{
    Authenticated, ConnectionGuard, Connections, DoorLimits, PUBLIC_BODY_BYTES, Peer,
};

/// What a door decides about a request from its head alone (method, path, headers), before
/// any of its body is read.
pub enum Admission {
    /// The caller presented a valid credential of the tenant named here: the request goes
    /// on, its body bounded by the body timeout (and by the handler's own size limits), and
    /// its connection is counted as that tenant's from now on
    /// ([`ConnectionGuard::authenticate`](crate::ConnectionGuard::authenticate)); an empty
    /// name admits the request without counting the connection for anyone.
    Authenticated(String),
    /// A request the door serves to anyone (health probes): its body is capped at
    /// [`PUBLIC_BODY_BYTES`].
    Public,
    /// The answer to send instead (401 / gRPC `UNAUTHENTICATED`); the body is never read.
    Refused(Response<Body>),
}

/// Decides [`Admission`] from a request's head.
pub type Admit = Arc<dyn Fn(&http::request::Parts) -> Admission + Send + Sync>;

/// HTTP/2 flow-control settings of a door, in bytes (RFC 9113 §6.9.2, §6.5.2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Windows {
    /// `SETTINGS_INITIAL_WINDOW_SIZE`: what a peer may send on one stream before the door
    /// reads it.
    pub stream: u32,
    /// The connection's window: what a peer may send on all streams together.
    pub connection: u32,
    /// `SETTINGS_MAX_FRAME_SIZE`.
    pub frame: u32,
}

/// One door: its name in logs and metrics, its limits, who may come in.
#[derive(Clone)]
pub struct Door {
    /// `"rest"`, `"grpc"`, `"metrics"`, `"session-tcp"`, `"session-unix"`.
    pub name: &'static str,
    /// Timeouts and caps ([`DoorLimits::effective`] already applied).
    pub limits: DoorLimits,
    /// The connection counts every door shares.
    pub connections: Arc<Connections>,
    /// Who may come in.
    pub admit: Admit,
    /// HTTP/2 only (gRPC doors); otherwise HTTP/1.1 and HTTP/2 (prior knowledge) both.
    pub http2_only: bool,
    /// HTTP/2 windows; `None` keeps hyper's (1 MiB stream and connection windows, 16 KiB
    /// frames).
    pub windows: Option<Windows>,
    /// HTTP/2 keep-alive: a PING every `.0`, the connection closed when no answer comes in
    /// `.1` (finds clients whose machine went away).
    pub keepalive: Option<(Duration, Duration)>,
    /// Request paths whose bodies may stay open as long as the call lasts (bidirectional
    /// streams), exempt from the body timeout.
    pub long_lived: &'static [&'static str],
    /// TLS for the door's TCP connections (Unix-socket connections never use it).
    pub tls: Option<Arc<crate::tls::Tls>>,
}

/// Serves `app` on `listener` as `door` until `stop` resolves; then closes every connection
/// gracefully (HTTP/2 GOAWAY, HTTP/1 after the response in flight) and returns once they
/// are all closed.
///
/// Errors: none today (accept errors back off and retry); the `Result` leaves room for
/// listener failures that should end the daemon.
pub async fn serve(
    door: Door,
    listener: Listener,
    app: axum::Router,
    stop: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let door = Arc::new(door);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (live_tx, mut live_rx) = tokio::sync::watch::channel(0usize);
    let live_tx = Arc::new(live_tx);
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stop => break,
            s = listener.accept(door.name) => s,
        };
        let talked = stream.has_bytes();
        let (guard, crowded) = match door.connections.admit(peer, talked) {
            Ok((g, evicted)) => {
                log_evicted(door.name, peer, &evicted, &door.connections);
                (g, !evicted.is_empty())
            }
            Err(refused) => {
                triggered_by(
                    refused.protection(),
                    door.name,
                    &peer,
                    format_args!(
                        "closed a connection from {peer} at once: its pool is full of authenticated connections ({} open in all)",
                        door.connections.open()
                    ),
                );
                drop(stream);
                continue;
            }
        };
        live_tx.send_modify(|n| *n += 1);
        let (door, app, stop_rx, live_tx) = (
            Arc::clone(&door),
            app.clone(),
            stop_rx.clone(),
            Arc::clone(&live_tx),
        );
        tokio::spawn(async move {
            let accepted = Instant::now();
            let work = async {
                // Its first bytes, unless they were there at its accept: from then on it makes
                // room only after the connections that sent nothing (a request head is on its
                // way). Without any by the header timeout, the driver below closes it.
                if !talked {
                    let deadline = accepted + door.limits.header_timeout;
                    if let Ok(Ok(())) = tokio::time::timeout_at(deadline, stream.readable()).await {
                        guard.talked();
                    }
                }
                if let Some(stream) = handshake(stream, &door, accepted).await {
                    connection(stream, &door, app, stop_rx, accepted, &guard).await;
                }
            };
            // A connection closed to make room (it had not authenticated) is dropped here,
            // whatever it was doing.
            tokio::select! {
                _ = work => {}
                _ = guard.evicted() => {}
            }
            drop(guard);
            live_tx.send_modify(|n| *n -= 1);
        });
        if crowded {
            // Under a flood, let the new connection see its first bytes before the next
            // accept can make room by closing it.
            tokio::task::yield_now().await;
        }
    }
    let _ = stop_tx.send(true);
    let _ = live_rx.wait_for(|n| *n == 0).await;
    Ok(())
}

/// Logs the anonymous connections closed to make room for one from `peer` (rate-limited per
/// peer by [`triggered_by`]).
pub fn log_evicted(
    door: &'static str,
    peer: Peer,
    evicted: &[crate::limits::Evicted],
    connections: &Connections,
) {
    for e in evicted {
        triggered_by(
            e.protection,
            door,
            &e.peer,
            format_args!(
                "closed the oldest connection from {} that had not authenticated, to make room for one from {peer} ({} open in all, {} of them not authenticated)",
                e.peer,
                connections.open(),
                connections.anonymous()
            ),
        );
    }
}

/// A TCP connection of a door with TLS, after its handshake; any other connection as it is.
/// `None` when the handshake failed or did not finish within the header timeout of
/// `accepted` (protection `tls-handshake`): the connection is closed.
async fn handshake(stream: Stream, door: &Door, accepted: Instant) -> Option<Stream> {
    let Some(tls) = &door.tls else {
        return Some(stream);
    };
    let tcp = match stream {
        Stream::Tcp(t) => t,
        other => return Some(other),
    };
    let acceptor = tls.acceptor(door.http2_only);
    let deadline = accepted + door.limits.header_timeout;
    match tokio::time::timeout_at(deadline, acceptor.accept(tcp)).await {
        Ok(Ok(s)) => Some(Stream::Tls(Box::new(s))),
        Ok(Err(e)) => {
            triggered(
                "tls-handshake",
                door.name,
                format_args!("a TLS handshake failed ({e}); closed"),
            );
            None
        }
        Err(_) => {
            triggered(
                "tls-handshake",
                door.name,
                format_args!(
                    "no TLS handshake in {:?} after the connection opened; closed",
                    door.limits.header_timeout
                ),
            );
            None
        }
    }
}

/// What a connection's driver knows about its requests.
struct ConnState {
    in_flight: AtomicUsize,
    seen_request: AtomicBool,
    idle_since: Mutex<Instant>,
}

/// One request in flight on a connection, until its response body is finished or dropped.
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn start(state: &Arc<ConnState>) -> Self {
        state.seen_request.store(true, Ordering::SeqCst);
        state.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(Arc::clone(state))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            *self.0.idle_since.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        }
    }
}

/// Drives one connection: hyper's HTTP/1 or HTTP/2 server, plus the header and idle
/// timeouts hyper does not apply to HTTP/2 (and to the wait for the first byte).
async fn connection(
    stream: Stream,
    door: &Arc<Door>,
    app: axum::Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
    accepted: Instant,
    guard: &Arc<ConnectionGuard>,
) {
    let state = Arc::new(ConnState {
        in_flight: AtomicUsize::new(0),
        seen_request: AtomicBool::new(false),
        idle_since: Mutex::new(accepted),
    });
    let svc = {
        let (door, state, guard) = (Arc::clone(door), Arc::clone(&state), Arc::clone(guard));
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let (door, state, app, guard) = (
                Arc::clone(&door),
                Arc::clone(&state),
                app.clone(),
                Arc::clone(&guard),
            );
            async move { Ok::<_, Infallible>(request(req, &door, &state, app, &guard).await) }
        })
    };
    let l = &door.limits;
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(l.header_timeout)
        .max_buf_size(l.max_header_bytes.max(8192));
    {
        let mut h2 = builder.http2();
        h2.timer(TokioTimer::new())
            .max_concurrent_streams(l.max_streams)
            .max_header_list_size(u32::try_from(l.max_header_bytes).unwrap_or(u32::MAX));
        if let Some(w) = door.windows {
            h2.initial_stream_window_size(w.stream)
                .initial_connection_window_size(w.connection)
                .max_frame_size(w.frame);
        }
        if let Some((every, timeout)) = door.keepalive {
            h2.keep_alive_interval(every).keep_alive_timeout(timeout);
        }
    }
    if door.http2_only {
        builder = builder.http2_only();
    }
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let mut closing: Option<Instant> = None;
    loop {
        // The next moment a timeout could fire.
        let now = Instant::now();
        let next = if closing.is_some() {
            closing.unwrap_or(now) + l.header_timeout
        } else if !state.seen_request.load(Ordering::SeqCst) {
            accepted + l.header_timeout
        } else {
            *state.idle_since.lock().unwrap_or_else(|p| p.into_inner()) + l.idle_timeout
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    // hyper's own HTTP/1 head timer (set above to the same limit) may fire before
                    // ours; count it as the same protection.
                    let head_timeout = e
                        .downcast_ref::<hyper::Error>()
                        .is_some_and(hyper::Error::is_timeout);
                    if head_timeout && closing.is_none() {
                        triggered(
                            "header-timeout",
                            door.name,
                            format_args!(
                                "no complete request head in {:?}; closed",
                                l.header_timeout
                            ),
                        );
                    } else {
                        tracing::debug!(door = door.name, "connection ended: {e}");
                    }
                }
                return;
            }
            _ = stop.changed(), if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now());
            }
            _ = tokio::time::sleep_until(next) => {
                let now = Instant::now();
                if let Some(since) = closing {
                    if now >= since + l.header_timeout {
                        // A peer that does not finish closing in time loses the connection.
                        return;
                    }
                    continue;
                }
                if state.in_flight.load(Ordering::SeqCst) > 0 {
                    continue;
                }
                if !state.seen_request.load(Ordering::SeqCst) {
                    if now >= accepted + l.header_timeout {
                        triggered(
                            "header-timeout",
                            door.name,
                            format_args!(
                                "no complete request head in {:?} after the connection opened; closed",
                                l.header_timeout
                            ),
                        );
                        return;
                    }
                    continue;
                }
                let idle = *state.idle_since.lock().unwrap_or_else(|p| p.into_inner());
                if now >= idle + l.idle_timeout {
                    triggered(
                        "idle-timeout",
                        door.name,
                        format_args!("no request in flight for {:?}; closing", l.idle_timeout),
                    );
                    conn.as_mut().graceful_shutdown();
                    closing = Some(now);
                }
            }
        }
    }
}

/// One request: admission from its head, then the app with a bounded body; the connection
/// counts it in flight until its response body ends.
async fn request(
    req: Request<Incoming>,
    door: &Door,
    state: &Arc<ConnState>,
    mut app: axum::Router,
    guard: &ConnectionGuard,
) -> Response<Body> {
    let peer = guard.peer();
    let in_flight = InFlight::start(state);
    let (parts, body) = req.into_parts();
    let limit = match (door.admit)(&parts) {
        Admission::Refused(resp) => {
            triggered_by(
                "unauthenticated",
                door.name,
                &peer,
                format_args!(
                    "{} {}: refused before its body was read",
                    clip(parts.method.as_str()),
                    clip(parts.uri.path())
                ),
            );
            drop(body);
            return guard_response(resp, in_flight);
        }
        Admission::Public => {
            let declared = parts
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if declared.is_some_and(|n| n > PUBLIC_BODY_BYTES as u64) {
                let resp = Response::builder()
                    .status(StatusCode::PAYLOAD_TOO_LARGE)
                    .body(Body::from(format!(
                        "{{\"error\":\"a request without a token carries at most {PUBLIC_BODY_BYTES} bytes\"}}"
                    )))
                    .unwrap_or_default();
                return guard_response(resp, in_flight);
            }
            Some(PUBLIC_BODY_BYTES)
        }
        Admission::Authenticated(tenant) => {
            if !tenant.is_empty() && guard.authenticate(&tenant) == Authenticated::OverShare {
                triggered_by(
                    "connections-per-tenant",
                    door.name,
                    &peer,
                    format_args!(
                        "tenant {} holds its share of authenticated connections (--max-connections-per-tenant); this one from {peer} stays closable to make room",
                        clip(&tenant)
                    ),
                );
            }
            None
        }
    };
    let deadline = if door.long_lived.contains(&parts.uri.path()) {
        None
    } else {
        Some(Box::pin(tokio::time::sleep(door.limits.body_timeout)))
    };
    let body = Body::new(BoundedBody {
        inner: body,
        deadline,
        timeout: door.limits.body_timeout,
        limit,
        read: 0,
        door: door.name,
    });
    let resp = match tower_service::Service::call(&mut app, Request::from_parts(parts, body)).await
    {
        Ok(r) => r,
        Err(never) => match never {},
    };
    guard_response(resp, in_flight)
}

fn guard_response(resp: Response<Body>, in_flight: InFlight) -> Response<Body> {
    resp.map(|b| {
        Body::new(GuardedBody {
            inner: b,
            _in_flight: in_flight,
        })
    })
}

/// Why a request body stopped before its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// It did not arrive in full within [`DoorLimits::body_timeout`] of its head.
    Timeout(Duration),
    /// A public request's body passed [`PUBLIC_BODY_BYTES`].
    TooLarge(usize),
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::Timeout(d) => write!(
                f,
                "the request body did not arrive in full within {d:?} (tpubox serve --body-timeout-seconds)"
            ),
            BodyError::TooLarge(n) => {
                write!(f, "a request without a token carries at most {n} bytes")
            }
        }
    }
}

impl std::error::Error for BodyError {}

/// Whether `e` (an error from reading a request body served by this crate) or one of its
/// sources is a [`BodyError`].
pub fn body_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a BodyError> {
    let mut cur: Option<&'a (dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(b) = c.downcast_ref::<BodyError>() {
            return Some(b);
        }
        cur = c.source();
    }
    None
}

/// A request body with a deadline and, for public requests, a size cap.
struct BoundedBody {
    inner: Incoming,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    timeout: Duration,
    limit: Option<usize>,
    read: usize,
    door: &'static str,
}

impl HttpBody for BoundedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(limit), Some(d)) = (self.limit, frame.data_ref()) {
                    self.read = self.read.saturating_add(d.len());
                    if self.read > limit {
                        return Poll::Ready(Some(Err(Box::new(BodyError::TooLarge(limit)))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(other) => Poll::Ready(other.map(|r| r.map_err(Into::into))),
            Poll::Pending => {
                let timeout = self.timeout;
                let door = self.door;
                if let Some(d) = self.deadline.as_mut()
                    && d.as_mut().poll(cx).is_ready()
                {
                    triggered(
                        "body-timeout",
                        door,
                        format_args!("a request body was still arriving after {timeout:?}"),
                    );
                    self.deadline = None;
                    return Poll::Ready(Some(Err(Box::new(BodyError::Timeout(timeout)))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that keeps its request counted in flight until it ends.
struct GuardedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for GuardedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Unix(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }
}
