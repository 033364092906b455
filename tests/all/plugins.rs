//! `tpubox devices` with an accelerator plugin on a machine without that accelerator: it exits
//! non-zero with one `tpubox:` line on stderr, before the plugin file is loaded.
//!
//! No real plugin is involved. The "plugins" are empty files named like the real libraries
//! (`libtpu.so`, `xla_cuda_plugin.so`), in a temp dir; if the check let one through, loading it
//! would fail as "cannot load" (an empty file is no shared library), so nothing can run, let
//! alone reach the network. On a machine that does have the accelerator the check passes and
//! the test expects that load error instead.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tpubox_core::accelerator::{self, Accelerator};

/// Runs `tpubox devices --plugin PATH` with a clean plugin environment, `TPUBOX_LOG` as given.
fn devices(plugin: &Path, cache: &Path, log: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tpubox"));
    cmd.args(["devices", "--plugin"])
        .arg(plugin)
        .env("TPUBOX_CACHE_DIR", cache)
        .env("TPUBOX_COMPILE_CACHE_DIR", cache.join("executables"))
        .env_remove(accelerator::SKIP_CHECK_ENV)
        .env_remove("TPUBOX_PJRT_PLUGIN")
        .env_remove("TPU_SKIP_MDS_QUERY")
        .env_remove("TPUBOX_LOG");
    if let Some(l) = log {
        cmd.env("TPUBOX_LOG", l);
    }
    cmd.output().expect("running tpubox")
}

/// A temp dir holding an empty file named like `accel`'s plugin library.
fn fake_plugin(accel: Accelerator) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join(accel.library_file_name());
    std::fs::write(&lib, b"").unwrap();
    (dir, lib)
}

fn one_line_failure(accel: Accelerator) {
    let (dir, lib) = fake_plugin(accel);
    let o = devices(&lib, dir.path(), None);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(
        o.stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line expected; stderr:\n{stderr}");
    let line = lines[0];
    match accelerator::detect(accel, Path::new("/")) {
        Err(missing) => {
            assert_eq!(line, format!("tpubox: {missing}"));
            assert!(
                line.starts_with(&format!(
                    "tpubox: the {} plugin ({})",
                    accel.plugin_name(),
                    accel.library_file_name()
                )),
                "{line}"
            );
            assert!(line.contains("--plugin cpu"), "{line}");
        }
        // This machine has the accelerator: the check passed and the empty file was refused by
        // the loader.
        Ok(found) => assert!(
            line.contains("cannot load"),
            "{} present: {line}",
            found.display()
        ),
    }
}

#[test]
fn fake_libtpu_fails_in_one_line_without_loading() {
    one_line_failure(Accelerator::Tpu);
}

#[test]
fn fake_cuda_plugin_fails_in_one_line_without_loading() {
    one_line_failure(Accelerator::Cuda);
}

/// `--plugin tpu` after `setup tpu`: the installed library is found, then refused the same way.
/// The install is faked (the layout `setup` leaves, with an empty `libtpu.so`): nothing is
/// downloaded.
#[test]
fn installed_tpu_plugin_by_name_fails_the_same_way() {
    let Err(missing) = accelerator::detect(Accelerator::Tpu, Path::new("/")) else {
        return; // a TPU machine: covered by the test above
    };
    let cache = tempfile::tempdir().unwrap();
    let p = tpubox_core::plugin::known("tpu").unwrap();
    let dir = cache
        .path()
        .join("plugins")
        .join(format!("{}-{}", p.package, p.version));
    std::fs::create_dir_all(dir.join(p.library).parent().unwrap()).unwrap();
    std::fs::write(dir.join(p.library), b"").unwrap();
    std::fs::write(dir.join(".tpubox-installed"), b"fake\n").unwrap();
    let o = devices(Path::new("tpu"), cache.path(), None);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "stderr:\n{stderr}");
    assert_eq!(stderr.trim_end(), format!("tpubox: {missing}"));
}

/// The plugin environment is set while `tpubox` is still single-threaded: with
/// `TPUBOX_LOG=tpubox=debug` its debug line lists what was set (here only
/// `TPU_SKIP_MDS_QUERY`, on a machine without a TPU, since debug logging keeps plugin logs on).
#[test]
fn plugin_environment_is_prepared_before_threads_start() {
    if accelerator::detect(Accelerator::Tpu, Path::new("/")).is_ok() {
        return;
    }
    let (dir, lib) = fake_plugin(Accelerator::Tpu);
    let o = devices(&lib, dir.path(), Some("tpubox=debug"));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "stderr:\n{stderr}");
    let set = stderr
        .lines()
        .find(|l| l.contains("set for the PJRT plugin"))
        .unwrap_or_else(|| panic!("no debug line; stderr:\n{stderr}"));
    assert!(set.contains("\"TPU_SKIP_MDS_QUERY\""), "{set}");
    assert!(!set.contains("TF_CPP_MIN_LOG_LEVEL"), "{set}");
}

/// `--plugin tpu|cuda` by name before `tpubox setup`: on a machine without the chip the line
/// says the chip is missing (installing the plugin would not help), not "run tpubox setup".
#[test]
fn accelerator_names_not_installed_say_the_chip_is_missing() {
    for accel in [Accelerator::Tpu, Accelerator::Cuda] {
        let empty = tempfile::tempdir().unwrap();
        let o = devices(Path::new(accel.plugin_name()), empty.path(), None);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "stderr:\n{stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line; stderr:\n{stderr}");
        match accelerator::detect(accel, Path::new("/")) {
            Err(missing) => assert_eq!(stderr.trim(), format!("tpubox: {missing}")),
            // With the chip present, the plugin is simply not installed.
            Ok(_) => assert!(stderr.contains("is not installed"), "{stderr}"),
        }
    }
}
