//! The environment PJRT plugins start with: their own logs kept off tpubox's stderr, and no
//! metadata-server query from libtpu on a machine without a TPU.
//!
//! The plugins read these settings only from the process environment, when they initialise,
//! and setting a variable is sound only while the process has one thread. So [`prepare`] is
//! called by `tpubox`'s `main` before anything starts a thread (the async runtime included),
//! and sets only variables the user has not set; [`crate::open_device`] itself never touches
//! the environment. An embedder that wants the same calls [`prepare`] first thing in its own
//! `main`.
//!
//! What is set, and the sources:
//! - Logging, unless `TPUBOX_LOG` asks for debug or trace output
//!   ([`plugin_logs_requested`]): `TF_CPP_MIN_LOG_LEVEL=2`, the XLA/TSL logging level the XLA
//!   plugins (CPU, CUDA) honour (0 info, 1 warning, 2 error, 3 fatal; PyTorch/XLA pull request
//!   pytorch/xla#5619 relies on it to hide libtpu's startup lines); `TPU_MIN_LOG_LEVEL=2` and
//!   `TPU_STDERR_LOG_LEVEL=2`, libtpu's own minimum level and the level copied to stderr (set to
//!   0 to turn libtpu's verbose logging on, as in AI-Hypercomputer/torchprime#122); and
//!   `GRPC_VERBOSITY=ERROR`, which JAX's `jax/_src/cloud_tpu_init.py` sets by default before it
//!   loads libtpu (jax-ml/jax#6032, "Suppress gRPC log spam on Cloud TPU"). Errors still show.
//! - `TPU_SKIP_MDS_QUERY=1` when [`crate::accelerator::detect`] finds no TPU on this machine:
//!   `jax/_src/cloud_tpu_init.py` sets exactly this when it counts no TPU chip, and libtpu then
//!   skips its query of the Google Compute Engine metadata server (its log reads "Skipping MDS
//!   query due to 1", quoted in grpc/grpc#38703; PyTorch/XLA's `torch_xla/_internal/tpu.py`
//!   reads the topology from `TPU_ACCELERATOR_TYPE`, `TPU_PROCESS_BOUNDS`/`TPU_HOST_BOUNDS`,
//!   `TPU_CHIPS_PER_PROCESS_BOUNDS` and `TPU_WORKER_ID` instead when it is set). Without a TPU,
//!   tpubox refuses to load libtpu anyway ([`crate::accelerator::check`]); this covers a load
//!   forced with `TPUBOX_SKIP_ACCELERATOR_CHECK=1`.
//!
//! On a Cloud TPU VM with its chips, nothing TPU-specific is set: libtpu reads the slice's
//! topology (accelerator type, worker id, the other hosts) from the VM's metadata server, and
//! tpubox cannot tell a single-host slice from one host of a pod slice, or derive the
//! accelerator type name (`v5litepod-8`, `v4-8`, …), from local files. To start without that
//! query, set `TPU_SKIP_MDS_QUERY=1` with `TPU_ACCELERATOR_TYPE`, `TPU_WORKER_ID=0` and
//! `TPU_WORKER_HOSTNAMES=localhost` yourself, as TPU containers on GKE are given (pytorch/xla#4499,
//! "bootstrapping tpu env from env vars"). None of this could be tried against a real TPU here;
//! it follows the sources above.

use std::path::Path;

/// Logging variables set unless plugin logs are requested (see the module docs).
pub const QUIET_LOGS: &[(&str, &str)] = &[
    ("TF_CPP_MIN_LOG_LEVEL", "2"),
    ("TPU_MIN_LOG_LEVEL", "2"),
    ("TPU_STDERR_LOG_LEVEL", "2"),
    ("GRPC_VERBOSITY", "ERROR"),
];

/// Set when no TPU is found, so that a forced libtpu load does not query the metadata server.
pub const SKIP_METADATA_QUERY: (&str, &str) = ("TPU_SKIP_MDS_QUERY", "1");

/// `TPUBOX_LOG` (its value, if set) asks for the plugins' own logs: it names the `debug` or
/// `trace` level anywhere in its filter (`TPUBOX_LOG=debug`, `TPUBOX_LOG=tpubox=trace`).
pub fn plugin_logs_requested(tpubox_log: Option<&str>) -> bool {
    tpubox_log.is_some_and(|v| {
        let v = v.to_ascii_lowercase();
        v.contains("debug") || v.contains("trace")
    })
}

/// The variables [`prepare`] would set on the machine under `root` (`/` for this one), given
/// the value of `TPUBOX_LOG`, before looking at what the user already set.
pub fn defaults(root: &Path, tpubox_log: Option<&str>) -> Vec<(&'static str, &'static str)> {
    let mut vars = Vec::new();
    if !plugin_logs_requested(tpubox_log) {
        vars.extend_from_slice(QUIET_LOGS);
    }
    if crate::accelerator::detect(crate::accelerator::Accelerator::Tpu, root).is_err() {
        vars.push(SKIP_METADATA_QUERY);
    }
    vars
}

/// Sets [`defaults`] for this machine and `TPUBOX_LOG`, keeping every variable the user set;
/// returns the names it set. Call it first thing in `main`, before any thread starts.
///
/// Errors (nothing is set): the process already has more than one thread, or its threads
/// cannot be counted; see [`pjrt::set_unset_vars`].
pub fn prepare() -> pjrt::Result<Vec<String>> {
    let log = std::env::var("TPUBOX_LOG").ok();
    pjrt::set_unset_vars(&defaults(Path::new("/"), log.as_deref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[(&str, &str)]) -> Vec<String> {
        v.iter().map(|(n, _)| n.to_string()).collect()
    }

    #[test]
    fn debug_or_trace_in_tpubox_log_keeps_plugin_logs() {
        for v in [
            "debug",
            "tpubox=debug",
            "TRACE",
            "warn,tpubox::device=trace",
        ] {
            assert!(plugin_logs_requested(Some(v)), "{v}");
        }
        for v in ["", "warn", "info", "tpubox::cache=info"] {
            assert!(!plugin_logs_requested(Some(v)), "{v}");
        }
        assert!(!plugin_logs_requested(None));
    }

    #[test]
    fn without_a_tpu_the_metadata_query_is_skipped() {
        let root = tempfile::tempdir().unwrap();
        let v = defaults(root.path(), None);
        assert!(v.contains(&SKIP_METADATA_QUERY), "{v:?}");
        for q in QUIET_LOGS {
            assert!(v.contains(q), "{v:?}");
        }
        let v = defaults(root.path(), Some("debug"));
        assert_eq!(names(&v), ["TPU_SKIP_MDS_QUERY"]);
    }

    #[test]
    fn with_a_tpu_nothing_tpu_specific_is_set() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("dev")).unwrap();
        std::fs::write(root.path().join("dev/accel0"), "").unwrap();
        assert!(defaults(root.path(), Some("trace")).is_empty());
        assert_eq!(defaults(root.path(), None), QUIET_LOGS);
    }
}
