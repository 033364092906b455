//! [`set_unset_vars`]: setting environment variables a plugin reads when it loads, soundly.
//!
//! PJRT plugins take some settings only from the process environment (libtpu's
//! `TPU_SKIP_MDS_QUERY`, the XLA logging levels), read when the library initialises. Rust's
//! [`std::env::set_var`] is `unsafe` because another thread may read or write the environment at
//! the same time (C code calls `getenv` without any lock Rust knows of). This module offers the
//! one case where setting is sound without trusting the caller: the process has exactly one
//! thread, checked at the moment of the call.

use crate::error::{Error, ErrorCode, Result};

/// Number of threads of this process, from the entries of `/proc/self/task` (one per thread).
#[cfg(target_os = "linux")]
fn thread_count() -> Result<usize> {
    let dir = std::fs::read_dir("/proc/self/task").map_err(|e| {
        Error::new(
            ErrorCode::FailedPrecondition,
            format!("cannot count this process's threads (/proc/self/task): {e}"),
        )
    })?;
    Ok(dir.count())
}

#[cfg(not(target_os = "linux"))]
fn thread_count() -> Result<usize> {
    Err(Error::new(
        ErrorCode::Unimplemented,
        "cannot count this process's threads on this platform",
    ))
}

/// Sets each `(name, value)` of `vars` whose `name` is not set in the process environment (a
/// variable the user set, even to an empty value, is kept), and returns the names it set.
///
/// Errors (and nothing is set): `FailedPrecondition` when the process has more than one thread
/// (call this at the start of `main`, before an async runtime, a logger or a plugin starts
/// threads) or when its threads cannot be counted (`/proc` not mounted); `Unimplemented` on
/// platforms other than Linux; `InvalidArgument` for a name that is empty or holds `=` or NUL,
/// or a value that holds NUL.
pub fn set_unset_vars(vars: &[(&str, &str)]) -> Result<Vec<String>> {
    for (name, value) in vars {
        if name.is_empty() || name.contains(['=', '\0']) || value.contains('\0') {
            return Err(Error::invalid_argument(format!(
                "invalid environment variable {name:?}={value:?}"
            )));
        }
    }
    let threads = thread_count()?;
    if threads != 1 {
        return Err(Error::new(
            ErrorCode::FailedPrecondition,
            format!(
                "the process has {threads} threads; environment variables can only be set while it has one"
            ),
        ));
    }
    let mut set = Vec::new();
    for (name, value) in vars {
        if std::env::var_os(name).is_none() {
            // SAFETY: `set_var` is unsound only when another thread reads or writes the
            // environment at the same time. The process had exactly one thread (this one) when
            // counted above, and only this thread could have started another since, which it
            // has not: between the count and here it runs only this function. The name and
            // value were checked above (no `=` or NUL), so `set_var` does not panic.
            unsafe { std::env::set_var(name, value) };
            set.push((*name).to_string());
        }
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_names_before_anything_else() {
        for (n, v) in [("", "1"), ("A=B", "1"), ("A\0", "1"), ("A", "x\0")] {
            let e = set_unset_vars(&[(n, v)]).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidArgument, "{n:?}");
        }
    }

    /// The test harness runs tests on worker threads, so the process has several: nothing may
    /// be set.
    #[test]
    #[cfg(target_os = "linux")]
    fn refuses_in_a_multi_threaded_process() {
        let keep = std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_millis(200)));
        let name = "TPUBOX_PJRT_PROCESS_ENV_TEST_UNSET";
        let e = set_unset_vars(&[(name, "1")]).unwrap_err();
        assert_eq!(e.code, ErrorCode::FailedPrecondition, "{e}");
        assert!(e.message.contains("threads"), "{e}");
        assert!(std::env::var_os(name).is_none());
        keep.join().unwrap();
    }
}
