//! What a client controls, made safe to log and to echo: cut to a bounded length before it
//! is logged ([`clip`], [`clip_to`]), and refusals rate-limited per peer ([`RefusalLog`],
//! through [`crate::protection::triggered_by`]).
//!
//! Every field a client sends (model names, versions, request ids, paths, header values,
//! labels, shared-memory region names, weight-set names, error texts that quote a request)
//! goes through [`clip`] where it is logged and through [`clip_to`] where an error message
//! echoes it, so a 1 MiB name costs the log (and the response) at most [`FIELD_BYTES`] bytes
//! plus a marker. The log writer escapes control characters on top of this (`host/src/logfmt.rs`),
//! and bounds each line's fields at [`LINE_BYTES`] as a last resort.
//!
//! A refusal a client can repeat at will (a bad token, an invalid request, a cap) is logged
//! through a [`RefusalLog`]: a token bucket per peer and kind ([`PEER_BURST`] lines, then
//! [`PEER_PER_SECOND`] a second), another per kind for all peers together (so that a flood
//! from many addresses is bounded too), and a line `suppressed K similar messages from PEER`
//! for what was left out ([`RefusalLog::flush`], which the daemon calls every few seconds).
//! The peers it remembers are at most [`MAX_PEERS`]: past that the oldest half is forgotten
//! (their suppressed counts are reported in one line), so a flood of distinct peers costs no
//! memory beyond that bound.

use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The most bytes of one client-controlled field that reach a log line or an error message.
pub const FIELD_BYTES: usize = 128;

/// The most bytes of the fields of one log line (the message included), a backstop for text
/// no call site clipped.
pub const LINE_BYTES: usize = 16 * 1024;

/// `s`, cut to at most [`FIELD_BYTES`] bytes (at a character boundary) with a marker that says
/// how many bytes were cut: `abc…[+1048448 bytes]`. Formats as `s` when it is short enough.
pub fn clip(s: &str) -> Clip<'_> {
    Clip {
        text: s,
        max: FIELD_BYTES,
    }
}

/// [`clip`] as an owned string, to embed in an error message a client receives.
pub fn clip_to(s: &str) -> String {
    clip(s).to_string()
}

/// A client-controlled string, cut where it is formatted; see [`clip`].
#[derive(Debug, Clone, Copy)]
pub struct Clip<'a> {
    text: &'a str,
    max: usize,
}

impl<'a> Clip<'a> {
    /// `s` cut to at most `max` bytes (and the marker).
    pub fn with_max(s: &'a str, max: usize) -> Self {
        Clip { text: s, max }
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends at a character boundary.
pub fn prefix(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl fmt::Display for Clip<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kept = prefix(self.text, self.max);
        f.write_str(kept)?;
        let cut = self.text.len() - kept.len();
        if cut > 0 {
            write!(f, "…[+{cut} bytes]")?;
        }
        Ok(())
    }
}

/// Lines one peer may log of one kind at once, before [`PEER_PER_SECOND`] applies.
pub const PEER_BURST: f64 = 5.0;
/// Lines one peer may log of one kind per second, in the long run.
pub const PEER_PER_SECOND: f64 = 1.0;
/// Lines all peers together may log of one kind at once.
pub const KIND_BURST: f64 = 50.0;
/// Lines all peers together may log of one kind per second, in the long run.
pub const KIND_PER_SECOND: f64 = 10.0;
/// The most (peer, kind) pairs a [`RefusalLog`] remembers.
pub const MAX_PEERS: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Self {
        Bucket {
            tokens: burst,
            at: now,
        }
    }

    fn take(&mut self, now: Instant, burst: f64, per_second: f64) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * per_second).min(burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[derive(Debug)]
struct PeerEntry {
    bucket: Bucket,
    suppressed: u64,
    seen: Instant,
}

/// What [`RefusalLog::admit`] says about one refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `suppressed` similar messages from the same peer were left out since its last
    /// line (say so in the line).
    Log {
        /// Messages of this peer and kind left out since the last line.
        suppressed: u64,
    },
    /// Leave it out (counted, reported later).
    Suppress,
}

/// A line [`RefusalLog::flush`] asks to be written: `suppressed` messages of `kind` from
/// `peer` were left out (`peer` is `None` for peers no longer remembered).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suppressed {
    /// The peer, as it was formatted (clipped); `None`: peers forgotten to keep the map bounded.
    pub peer: Option<String>,
    /// The kind of refusal.
    pub kind: &'static str,
    /// How many messages were left out.
    pub count: u64,
}

/// Per-peer rate limits of refusal log lines; see the module's documentation.
#[derive(Debug)]
pub struct RefusalLog {
    peers: HashMap<(String, &'static str), PeerEntry>,
    kinds: HashMap<&'static str, Bucket>,
    forgotten: HashMap<&'static str, u64>,
    max_peers: usize,
}

impl Default for RefusalLog {
    fn default() -> Self {
        Self::new(MAX_PEERS)
    }
}

impl RefusalLog {
    /// An empty log that remembers at most `max_peers` (peer, kind) pairs.
    pub fn new(max_peers: usize) -> Self {
        RefusalLog {
            peers: HashMap::new(),
            kinds: HashMap::new(),
            forgotten: HashMap::new(),
            max_peers: max_peers.max(2),
        }
    }

    /// How many (peer, kind) pairs are remembered.
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Whether no pair is remembered.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Whether a refusal of `kind` from `peer` at `now` may be logged.
    pub fn admit(&mut self, peer: &str, kind: &'static str, now: Instant) -> Verdict {
        let key = (prefix(peer, FIELD_BYTES).to_string(), kind);
        if !self.peers.contains_key(&key) && self.peers.len() >= self.max_peers {
            self.forget_oldest_half();
        }
        let e = self.peers.entry(key).or_insert_with(|| PeerEntry {
            bucket: Bucket::full(PEER_BURST, now),
            suppressed: 0,
            seen: now,
        });
        e.seen = now;
        let kind_bucket = self
            .kinds
            .entry(kind)
            .or_insert_with(|| Bucket::full(KIND_BURST, now));
        if e.bucket.take(now, PEER_BURST, PEER_PER_SECOND) {
            if kind_bucket.take(now, KIND_BURST, KIND_PER_SECOND) {
                return Verdict::Log {
                    suppressed: std::mem::take(&mut e.suppressed),
                };
            }
            // The peer had a token but the kind had none: give it back.
            e.bucket.tokens += 1.0;
        }
        e.suppressed = e.suppressed.saturating_add(1);
        Verdict::Suppress
    }

    fn forget_oldest_half(&mut self) {
        let mut seen: Vec<Instant> = self.peers.values().map(|e| e.seen).collect();
        let mid = seen.len() / 2;
        let (_, cut, _) = seen.select_nth_unstable(mid);
        let cut = *cut;
        let forgotten = &mut self.forgotten;
        self.peers.retain(|(_, kind), e| {
            let keep = e.seen > cut;
            if !keep && e.suppressed > 0 {
                *forgotten.entry(kind).or_insert(0) += e.suppressed;
            }
            keep
        });
    }

    /// The suppression lines due at `now`: each peer with messages left out and no line for
    /// at least `quiet`, then the counts of forgotten peers. Their counts restart at zero.
    pub fn flush(&mut self, now: Instant, quiet: Duration) -> Vec<Suppressed> {
        let mut out = Vec::new();
        for ((peer, kind), e) in self.peers.iter_mut() {
            if e.suppressed > 0 && now.saturating_duration_since(e.seen) >= quiet {
                out.push(Suppressed {
                    peer: Some(peer.clone()),
                    kind,
                    count: std::mem::take(&mut e.suppressed),
                });
            }
        }
        for (kind, count) in self.forgotten.drain() {
            out.push(Suppressed {
                peer: None,
                kind,
                count,
            });
        }
        // Entries that are quiet and owe nothing are forgotten: their buckets are full again.
        let full_after = Duration::from_secs_f64(PEER_BURST / PEER_PER_SECOND);
        self.peers
            .retain(|_, e| e.suppressed > 0 || now.saturating_duration_since(e.seen) < full_after);
        out.sort_by(|a, b| (a.kind, &a.peer).cmp(&(b.kind, &b.peer)));
        out
    }
}

static REFUSALS: Mutex<Option<RefusalLog>> = Mutex::new(None);

/// Asks the process's [`RefusalLog`] whether a refusal of `kind` from `peer` may be logged now.
pub fn admit_refusal(peer: &str, kind: &'static str) -> Verdict {
    let mut g = REFUSALS.lock().unwrap_or_else(|p| p.into_inner());
    g.get_or_insert_with(RefusalLog::default)
        .admit(peer, kind, Instant::now())
}

/// Writes the suppression lines due (a `warn` line each: `suppressed K similar messages from
/// PEER`) of the process's [`RefusalLog`]; the daemon calls it every few seconds.
pub fn flush_suppressed() {
    let due = {
        let mut g = REFUSALS.lock().unwrap_or_else(|p| p.into_inner());
        match g.as_mut() {
            Some(log) => log.flush(Instant::now(), Duration::from_secs(1)),
            None => return,
        }
    };
    for s in due {
        match &s.peer {
            Some(peer) => tracing::warn!(
                protection = s.kind,
                peer = %peer,
                suppressed = s.count,
                "suppressed {} similar messages from {peer} ({})",
                s.count,
                s.kind
            ),
            None => tracing::warn!(
                protection = s.kind,
                suppressed = s.count,
                "suppressed {} similar messages from peers no longer tracked ({})",
                s.count,
                s.kind
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_kept() {
        assert_eq!(clip("dtypes").to_string(), "dtypes");
        assert_eq!(
            clip(&"a".repeat(FIELD_BYTES)).to_string(),
            "a".repeat(FIELD_BYTES)
        );
    }

    #[test]
    fn long_text_is_cut_with_a_marker() {
        let s = "n".repeat(1 << 20);
        let c = clip(&s).to_string();
        assert_eq!(
            c,
            format!(
                "{}…[+{} bytes]",
                "n".repeat(FIELD_BYTES),
                (1 << 20) - FIELD_BYTES
            )
        );
        assert!(c.len() < FIELD_BYTES + 32);
    }

    #[test]
    fn cut_at_a_character_boundary() {
        // 'é' is 2 bytes: 127 a's then é would straddle byte 128.
        let s = format!("{}é{}", "a".repeat(FIELD_BYTES - 1), "z".repeat(10));
        let c = clip(&s).to_string();
        assert_eq!(c, format!("{}…[+12 bytes]", "a".repeat(FIELD_BYTES - 1)));
        let emoji = "😀".repeat(100);
        let c = Clip::with_max(&emoji, 5).to_string();
        assert_eq!(c, format!("😀…[+{} bytes]", 400 - 4));
        assert_eq!(prefix("😀", 3), "");
    }

    #[test]
    fn one_peer_is_limited_and_told_what_was_left_out() {
        let mut log = RefusalLog::new(16);
        let t0 = Instant::now();
        let logged = (0..1000)
            .filter(|_| {
                matches!(
                    log.admit("10.0.0.1", "unauthenticated", t0),
                    Verdict::Log { .. }
                )
            })
            .count();
        assert_eq!(logged, PEER_BURST as usize);
        // Another peer still gets its lines.
        assert!(matches!(
            log.admit("10.0.0.2", "unauthenticated", t0),
            Verdict::Log { suppressed: 0 }
        ));
        // A second later: one more line, which carries the count.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(
            log.admit("10.0.0.1", "unauthenticated", t1),
            Verdict::Log { suppressed: 995 }
        );
        for _ in 0..10 {
            log.admit("10.0.0.1", "unauthenticated", t1);
        }
        let due = log.flush(t1 + Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(
            due,
            vec![Suppressed {
                peer: Some("10.0.0.1".into()),
                kind: "unauthenticated",
                count: 10
            }]
        );
        assert!(
            log.flush(t1 + Duration::from_secs(3), Duration::from_secs(1))
                .is_empty()
        );
    }

    #[test]
    fn kinds_are_limited_apart() {
        let mut log = RefusalLog::new(16);
        let t0 = Instant::now();
        for _ in 0..10 {
            log.admit("p", "unauthenticated", t0);
        }
        assert!(matches!(
            log.admit("p", "invalid-request", t0),
            Verdict::Log { .. }
        ));
    }

    #[test]
    fn many_peers_are_bounded_in_memory_and_lines() {
        let mut log = RefusalLog::new(64);
        let t0 = Instant::now();
        let mut logged = 0;
        for i in 0..10_000 {
            let now = t0 + Duration::from_micros(i);
            if matches!(
                log.admit(&format!("10.0.{}.{}", i / 256, i % 256), "x", now),
                Verdict::Log { .. }
            ) {
                logged += 1;
            }
            assert!(log.len() <= 64);
        }
        // All peers together: the kind's burst plus its rate over 10 ms.
        assert!(logged <= KIND_BURST as usize + 1, "{logged}");
        let due = log.flush(t0 + Duration::from_secs(10), Duration::from_secs(1));
        let total: u64 = due.iter().map(|s| s.count).sum();
        assert_eq!(total as usize + logged, 10_000);
        assert!(due.iter().any(|s| s.peer.is_none()));
    }

    #[test]
    fn a_long_peer_name_is_clipped_in_the_map() {
        let mut log = RefusalLog::new(4);
        let long = "p".repeat(1 << 16);
        log.admit(&long, "x", Instant::now());
        for _ in 0..10 {
            log.admit(&long, "x", Instant::now());
        }
        let due = log.flush(
            Instant::now() + Duration::from_secs(5),
            Duration::from_secs(1),
        );
        assert_eq!(due[0].peer.as_deref().map(str::len), Some(FIELD_BYTES));
    }
}
