//! The daemon's protections against its callers (timeouts, connection and stream caps,
//! descriptor caps, memory charges refused, compile-worker caps), counted each time one
//! triggers and logged at a bounded rate.
//!
//! Every door reports here with [`triggered`], naming the protection with a fixed,
//! lower-case identifier (`"header-timeout"`, `"connections-per-peer"`, ...; the full list is in
//! `docs/SECURITY.md`), so one metric (`tpubox_protection_triggered_total{protection}` on
//! `/metrics`) and one kind of log line cover them all. A flood of triggers costs a counter
//! increment each and at most one log line per protection per second ([`LOG_INTERVAL`]).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Shortest time between two log lines about one protection; the triggers in between are
/// counted and reported in the next line.
pub const LOG_INTERVAL: Duration = Duration::from_secs(1);

struct Entry {
    count: u64,
    last_log: Option<Instant>,
    unlogged: u64,
}

static TRIGGERED: Mutex<BTreeMap<&'static str, Entry>> = Mutex::new(BTreeMap::new());

/// `protection`'s entry in `map`, its count raised by one.
fn counted<'m>(
    map: &'m mut BTreeMap<&'static str, Entry>,
    protection: &'static str,
) -> &'m mut Entry {
    let e = map.entry(protection).or_insert(Entry {
        count: 0,
        last_log: None,
        unlogged: 0,
    });
    e.count = e.count.saturating_add(1);
    e
}

/// Counts one trigger of `protection` and logs it (a `warn` line with `protection`, `door`
/// and `detail` fields), at most once per [`LOG_INTERVAL`] per protection.
///
/// `door` names where it happened (`"rest"`, `"grpc"`, `"session-tcp"`, `"session-unix"`,
/// `"session-local"`, `"metrics"`, `"compiler"`); `detail` is escaped by the log writer, so a
/// peer-controlled string may appear in it.
pub fn triggered(protection: &'static str, door: &'static str, detail: std::fmt::Arguments<'_>) {
    let now = Instant::now();
    let suppressed = {
        let mut map = TRIGGERED.lock().unwrap_or_else(|p| p.into_inner());
        let e = counted(&mut map, protection);
        if e.last_log
            .is_some_and(|t| now.duration_since(t) < LOG_INTERVAL)
        {
            e.unlogged = e.unlogged.saturating_add(1);
            return;
        }
        e.last_log = Some(now);
        std::mem::take(&mut e.unlogged)
    };
    tracing::warn!(
        protection,
        door,
        suppressed,
        "protection triggered: {protection} on {door}: {detail}{}",
        if suppressed > 0 {
            format!(" ({suppressed} more since the last line)")
        } else {
            String::new()
        }
    );
}

/// Counts one trigger of `protection` caused by `peer` (a refusal the peer can repeat at will:
/// a bad credential, a connection over a cap) and logs it at the rate
/// [`crate::logsafe::RefusalLog`] allows per peer and protection: a flood from one peer costs
/// a few lines, then one a second, and `suppressed K similar messages from PEER`
/// ([`crate::logsafe::flush_suppressed`]). `detail` is cut to [`crate::logsafe::LINE_BYTES`]
/// here and escaped by the log writer; fields a peer controls in it should be clipped by the
/// caller ([`crate::logsafe::clip`]).
pub fn triggered_by(
    protection: &'static str,
    door: &'static str,
    peer: &dyn std::fmt::Display,
    detail: std::fmt::Arguments<'_>,
) {
    counted(
        &mut TRIGGERED.lock().unwrap_or_else(|p| p.into_inner()),
        protection,
    );
    let peer = peer.to_string();
    let crate::logsafe::Verdict::Log { suppressed } =
        crate::logsafe::admit_refusal(&peer, protection)
    else {
        return;
    };
    let detail = detail.to_string();
    tracing::warn!(
        protection,
        door,
        peer = %crate::logsafe::clip(&peer),
        suppressed,
        "protection triggered: {protection} on {door} from {}: {}{}",
        crate::logsafe::clip(&peer),
        crate::logsafe::Clip::with_max(&detail, crate::logsafe::LINE_BYTES / 4),
        if suppressed > 0 {
            format!(" (suppressed {suppressed} similar messages from this peer since its last line)")
        } else {
            String::new()
        }
    );
}

/// How often each protection has triggered since the process started, by name.
pub fn counts() -> Vec<(&'static str, u64)> {
    TRIGGERED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(k, e)| (*k, e.count))
        .collect()
}

/// How often `protection` has triggered since the process started.
pub fn count(protection: &str) -> u64 {
    TRIGGERED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(protection)
        .map_or(0, |e| e.count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_trigger_and_keeps_names() {
        let before = count("test-protection");
        for _ in 0..1000 {
            triggered("test-protection", "test", format_args!("x"));
        }
        assert_eq!(count("test-protection"), before + 1000);
        assert!(counts().iter().any(|(k, _)| *k == "test-protection"));
    }
}
