//! Checking, before an accelerator plugin is loaded, that the machine has that accelerator.
//!
//! Loading `libtpu` on a machine without a TPU does not fail: it retries the cloud
//! instance-metadata service for minutes, logging as it goes. So [`crate::open_device`] first
//! looks at local files only ([`check`]) and, when the chip is not there, fails at once with one
//! line that names the plugin, what was looked for and what to do instead.
//!
//! Which plugin drives which accelerator is read from the library's file name
//! ([`Accelerator::for_library`]: `libtpu.so`, `xla_cuda_plugin.so`, the files `tpubox setup tpu`
//! and `tpubox setup cuda` install); any other plugin (the CPU ones, an unknown path) is not
//! checked. `TPUBOX_SKIP_ACCELERATOR_CHECK=1` ([`SKIP_CHECK_ENV`]) skips the check, for setups
//! the rules below do not recognise.
//!
//! # What counts as present
//!
//! The rules follow what JAX checks before it initialises a backend, in
//! `jax/_src/hardware_utils.py` (jax-ml/jax): `num_available_tpu_chips_and_device_id` counts the
//! PCI devices under `/sys/bus/pci/devices` whose `vendor` file reads Google's PCI vendor id
//! `0x1ae0` and whose `device` file is one of the TPU device ids (`0x0027` v2/v3, `0x0056`,
//! `0x005e` v4, `0x0062` v5p, `0x0063` v5e, `0x006f` v6e, `0x0076` TPU7x); and
//! `has_visible_nvidia_gpu` looks for any of `/dev/nvidia0`, `/dev/nvidiactl` (containers) and
//! `/dev/dxg` (WSL2). `jax/_src/cloud_tpu_init.py` does not initialise libtpu when no chip is
//! found that way (unless `JAX_FORCE_TPU_INIT` is set). PyTorch/XLA's
//! `torch_xla/_internal/tpu.py` (`num_available_chips`) uses the same PCI rule.
//!
//! - TPU: such a PCI device; or a Google (`0x1ae0`) PCI device bound to the `vfio-pci` driver
//!   (TPU v5e and newer are driven through VFIO, so this also admits a chip whose device id is
//!   newer than the list); or a TPU device file `/dev/accel<N>` (the TPU v2–v4 driver's nodes);
//!   or, only when `/sys/bus/pci/devices` cannot be read at all (a container without sysfs), a
//!   VFIO group `/dev/vfio/<N>`. A Google vendor id alone is not enough: Google Compute Engine
//!   VMs without a TPU have Google PCI devices too (the gVNIC network card).
//! - CUDA: any of `/dev/nvidiactl`, `/dev/nvidia<N>` and `/dev/dxg`: the NVIDIA driver's device
//!   files, which the CUDA plugin opens (JAX's list, with `nvidia0` widened to any `nvidia<N>`,
//!   since a container may be given only, say, `/dev/nvidia3`).
//!
//! [`detect`] applies the rules to a directory tree given as the root (`/` in production, a
//! fake tree in tests), and reads only a few small files: it answers in well under a
//! millisecond.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// Environment variable that skips [`check`] when set to anything but empty or `0`.
pub const SKIP_CHECK_ENV: &str = "TPUBOX_SKIP_ACCELERATOR_CHECK";

/// Google's PCI vendor id, as the sysfs `vendor` file spells it.
pub const GOOGLE_PCI_VENDOR_ID: &str = "0x1ae0";

/// PCI device ids of TPU chips (with vendor [`GOOGLE_PCI_VENDOR_ID`]), as listed by JAX's
/// `jax/_src/hardware_utils.py`: v2/v3, an unnamed one, v4, v5p, v5e, v6e, TPU7x.
pub const TPU_PCI_DEVICE_IDS: &[&str] = &[
    "0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076",
];

/// An accelerator a known plugin drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accelerator {
    /// A Google Cloud TPU, driven by `libtpu` (`tpubox setup tpu`).
    Tpu,
    /// An NVIDIA GPU, driven by the CUDA PJRT plugin (`tpubox setup cuda`).
    Cuda,
}

impl Accelerator {
    /// Every accelerator this module knows.
    pub const ALL: [Accelerator; 2] = [Accelerator::Tpu, Accelerator::Cuda];

    /// Name of the known plugin (`tpubox setup NAME`, `--plugin NAME`) that drives it.
    pub fn plugin_name(self) -> &'static str {
        match self {
            Accelerator::Tpu => "tpu",
            Accelerator::Cuda => "cuda",
        }
    }

    /// File name of that plugin's shared library.
    pub fn library_file_name(self) -> &'static str {
        match self {
            Accelerator::Tpu => "libtpu.so",
            Accelerator::Cuda => "xla_cuda_plugin.so",
        }
    }

    /// The accelerator a plugin library drives, from its file name (or, for a symbolic link,
    /// the name of the file it points to); `None` for every other plugin.
    pub fn for_library(path: &Path) -> Option<Accelerator> {
        let by_name = |p: &Path| {
            let name = p.file_name()?;
            Self::ALL
                .into_iter()
                .find(|a| name == OsStr::new(a.library_file_name()))
        };
        by_name(path).or_else(|| by_name(&std::fs::canonicalize(path).ok()?))
    }

    fn described(self) -> &'static str {
        match self {
            Accelerator::Tpu => "a Google TPU",
            Accelerator::Cuda => "an NVIDIA GPU",
        }
    }

    fn looked_for(self) -> &'static str {
        match self {
            Accelerator::Tpu => {
                "no PCI device with Google's vendor id 0x1ae0 and a TPU device id under \
                 /sys/bus/pci/devices, and no /dev/accel<N> or /dev/vfio/<N>"
            }
            Accelerator::Cuda => "no /dev/nvidiactl, /dev/nvidia<N> or /dev/dxg",
        }
    }

    fn machine(self) -> &'static str {
        match self {
            Accelerator::Tpu => "on a Cloud TPU VM",
            Accelerator::Cuda => "on a machine with an NVIDIA GPU and its driver",
        }
    }
}

impl std::fmt::Display for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.described())
    }
}

/// The accelerator a plugin needs is not on this machine. Its message is one line: the plugin,
/// what was looked for, and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the {plugin} plugin ({library}) needs {accelerator}, and this machine has none: {looked_for}; \
     use `--plugin cpu`, or run {machine} (or set {skip}=1 to load it anyway)",
    plugin = .accelerator.plugin_name(),
    library = .accelerator.library_file_name(),
    looked_for = .accelerator.looked_for(),
    machine = .accelerator.machine(),
    skip = SKIP_CHECK_ENV
)]
pub struct Missing {
    /// The accelerator that was looked for.
    pub accelerator: Accelerator,
}

/// Looks for `accelerator` in the tree under `root` (`/` for this machine), by the rules of the
/// module docs. Returns the file that shows it is there: a PCI device directory or a device
/// file, under `root`.
///
/// Errors: [`Missing`] when no rule matches. Unreadable files count as absent.
pub fn detect(accelerator: Accelerator, root: &Path) -> Result<PathBuf, Missing> {
    let found = match accelerator {
        Accelerator::Tpu => detect_tpu(root),
        Accelerator::Cuda => detect_cuda(root),
    };
    found.ok_or(Missing { accelerator })
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_ascii_lowercase())
}

/// Names of the entries of `dir`; `None` when it cannot be read.
fn entries(dir: &Path) -> Option<Vec<String>> {
    let rd = std::fs::read_dir(dir).ok()?;
    Some(
        rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect(),
    )
}

/// Names of the entries of `dir` (empty when it cannot be read).
fn entry_names(dir: &Path) -> Vec<String> {
    entries(dir).unwrap_or_default()
}

/// `name` is `prefix` followed by one or more ASCII digits.
fn numbered(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

fn detect_tpu(root: &Path) -> Option<PathBuf> {
    let pci = root.join("sys/bus/pci/devices");
    let pci_devices = entries(&pci);
    let pci_readable = pci_devices.is_some();
    for name in pci_devices.unwrap_or_default() {
        let dev = pci.join(&name);
        if read_trimmed(&dev.join("vendor")).as_deref() != Some(GOOGLE_PCI_VENDOR_ID) {
            continue;
        }
        let known_id = read_trimmed(&dev.join("device"))
            .is_some_and(|id| TPU_PCI_DEVICE_IDS.contains(&id.as_str()));
        let vfio_bound = std::fs::read_link(dev.join("driver"))
            .ok()
            .is_some_and(|d| d.file_name() == Some(OsStr::new("vfio-pci")));
        if known_id || vfio_bound {
            return Some(dev);
        }
    }
    let dev = root.join("dev");
    if let Some(n) = entry_names(&dev).into_iter().find(|n| numbered(n, "accel")) {
        return Some(dev.join(n));
    }
    if !pci_readable {
        let vfio = dev.join("vfio");
        if let Some(n) = entry_names(&vfio).into_iter().find(|n| numbered(n, "")) {
            return Some(vfio.join(n));
        }
    }
    None
}

fn detect_cuda(root: &Path) -> Option<PathBuf> {
    let dev = root.join("dev");
    entry_names(&dev)
        .into_iter()
        .find(|n| n == "nvidiactl" || n == "dxg" || numbered(n, "nvidia"))
        .map(|n| dev.join(n))
}

/// The value of [`SKIP_CHECK_ENV`] asks to skip the check.
fn skip_requested(value: Option<&str>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

/// [`check`] with the root and the value of [`SKIP_CHECK_ENV`] given.
pub fn check_in(library: &Path, root: &Path, skip: Option<&str>) -> Result<(), Missing> {
    let Some(accelerator) = Accelerator::for_library(library) else {
        return Ok(());
    };
    if skip_requested(skip) {
        tracing::debug!(%accelerator, "{SKIP_CHECK_ENV} is set: not checking for the accelerator");
        return Ok(());
    }
    let found = detect(accelerator, root)?;
    tracing::debug!(%accelerator, found = %found.display(), "accelerator present");
    Ok(())
}

/// Checks, before `library` is loaded, that this machine has the accelerator it drives (see the
/// module docs); plugins that drive none pass. Reads `TPUBOX_SKIP_ACCELERATOR_CHECK`.
///
/// Errors: [`Missing`], whose message is the one line to show the user.
pub fn check(library: &Path) -> Result<(), Missing> {
    let skip = std::env::var(SKIP_CHECK_ENV).ok();
    check_in(library, Path::new("/"), skip.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A fake machine: an empty root with `sys/bus/pci/devices` and `dev`.
    struct Tree(tempfile::TempDir);

    impl Tree {
        fn new() -> Self {
            let t = Tree(tempfile::tempdir().unwrap());
            fs::create_dir_all(t.path().join("sys/bus/pci/devices")).unwrap();
            fs::create_dir_all(t.path().join("dev")).unwrap();
            t
        }
        fn path(&self) -> &Path {
            self.0.path()
        }
        fn pci(&self, addr: &str, vendor: &str, device: &str) -> PathBuf {
            let d = self.path().join("sys/bus/pci/devices").join(addr);
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("vendor"), format!("{vendor}\n")).unwrap();
            fs::write(d.join("device"), format!("{device}\n")).unwrap();
            d
        }
        fn file(&self, rel: &str) -> PathBuf {
            let p = self.path().join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, "").unwrap();
            p
        }
    }

    fn lib(a: Accelerator) -> PathBuf {
        PathBuf::from("/opt/plugins").join(a.library_file_name())
    }

    #[test]
    fn tpu_found_by_pci_vendor_and_device_id() {
        let t = Tree::new();
        t.pci("0000:00:03.0", "0x1af4", "0x1041"); // virtio
        let chip = t.pci("0000:00:04.0", "0x1ae0", "0x0063"); // v5e
        assert_eq!(detect(Accelerator::Tpu, t.path()), Ok(chip));
        assert_eq!(check_in(&lib(Accelerator::Tpu), t.path(), None), Ok(()));
    }

    #[test]
    fn every_listed_tpu_device_id_counts() {
        for id in TPU_PCI_DEVICE_IDS {
            let t = Tree::new();
            t.pci(
                "0000:00:05.0",
                "0x1AE0",
                &id.to_uppercase().replace("0X", "0x"),
            );
            assert!(detect(Accelerator::Tpu, t.path()).is_ok(), "{id}");
        }
    }

    #[test]
    fn google_nic_alone_is_not_a_tpu() {
        let t = Tree::new();
        t.pci("0000:00:04.0", "0x1ae0", "0x0042"); // gVNIC, on every GCE VM
        assert_eq!(
            detect(Accelerator::Tpu, t.path()),
            Err(Missing {
                accelerator: Accelerator::Tpu
            })
        );
    }

    #[test]
    fn google_device_bound_to_vfio_counts() {
        let t = Tree::new();
        let d = t.pci("0000:00:06.0", "0x1ae0", "0x00ff"); // an id newer than the list
        let drv = t.path().join("sys/bus/pci/drivers/vfio-pci");
        fs::create_dir_all(&drv).unwrap();
        std::os::unix::fs::symlink(&drv, d.join("driver")).unwrap();
        assert_eq!(detect(Accelerator::Tpu, t.path()), Ok(d));
    }

    #[test]
    fn tpu_found_by_accel_device_file() {
        let t = Tree::new();
        let f = t.file("dev/accel0");
        assert_eq!(detect(Accelerator::Tpu, t.path()), Ok(f));
    }

    #[test]
    fn generic_accel_subsystem_dir_is_not_a_tpu() {
        // Linux's DRM accel subsystem (Intel NPU, Habana) uses /dev/accel/accel0.
        let t = Tree::new();
        t.file("dev/accel/accel0");
        assert!(detect(Accelerator::Tpu, t.path()).is_err());
    }

    #[test]
    fn vfio_group_counts_only_without_sysfs() {
        let t = Tree::new();
        t.file("dev/vfio/vfio");
        t.file("dev/vfio/0");
        // With a readable PCI tree that shows no TPU, a VFIO group is some other device.
        assert!(detect(Accelerator::Tpu, t.path()).is_err());
        fs::remove_dir_all(t.path().join("sys")).unwrap();
        assert_eq!(
            detect(Accelerator::Tpu, t.path()),
            Ok(t.path().join("dev/vfio/0"))
        );
    }

    #[test]
    fn tpu_missing_is_one_line_naming_plugin_search_and_remedy() {
        let t = Tree::new();
        t.pci("0000:00:04.0", "0x1af4", "0x1053");
        t.file("dev/vfio/vfio");
        let err = check_in(&lib(Accelerator::Tpu), t.path(), None).unwrap_err();
        let msg = err.to_string();
        assert_eq!(
            msg,
            "the tpu plugin (libtpu.so) needs a Google TPU, and this machine has none: no PCI \
             device with Google's vendor id 0x1ae0 and a TPU device id under /sys/bus/pci/devices, \
             and no /dev/accel<N> or /dev/vfio/<N>; use `--plugin cpu`, or run on a Cloud TPU VM \
             (or set TPUBOX_SKIP_ACCELERATOR_CHECK=1 to load it anyway)"
        );
        assert!(!msg.contains('\n'));
    }

    #[test]
    fn cuda_found_by_driver_device_files() {
        for f in ["dev/nvidia0", "dev/nvidia3", "dev/nvidiactl", "dev/dxg"] {
            let t = Tree::new();
            let p = t.file(f);
            assert_eq!(detect(Accelerator::Cuda, t.path()), Ok(p), "{f}");
            assert_eq!(check_in(&lib(Accelerator::Cuda), t.path(), None), Ok(()));
        }
    }

    #[test]
    fn cuda_missing_is_one_line_naming_plugin_search_and_remedy() {
        let t = Tree::new();
        t.file("dev/nvidia-uvm"); // not a GPU node
        t.file("proc/driver/nvidia/version"); // driver loaded, but no device given to us
        let msg = check_in(&lib(Accelerator::Cuda), t.path(), None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "the cuda plugin (xla_cuda_plugin.so) needs an NVIDIA GPU, and this machine has none: \
             no /dev/nvidiactl, /dev/nvidia<N> or /dev/dxg; use `--plugin cpu`, or run on a \
             machine with an NVIDIA GPU and its driver (or set TPUBOX_SKIP_ACCELERATOR_CHECK=1 \
             to load it anyway)"
        );
        assert!(!msg.contains('\n'));
    }

    #[test]
    fn cpu_and_unknown_plugins_are_never_checked() {
        let t = Tree::new(); // no accelerator at all
        for p in [
            "/x/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so",
            "/x/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so",
            "/x/my_own_plugin.so",
            "/x/libtpu.so.bak",
        ] {
            assert_eq!(Accelerator::for_library(Path::new(p)), None, "{p}");
            assert_eq!(check_in(Path::new(p), t.path(), None), Ok(()), "{p}");
        }
    }

    #[test]
    fn symlink_to_a_known_library_is_identified() {
        let t = Tree::new();
        let real = t.file("plugins/libtpu/libtpu.so");
        let link = t.path().join("plugins/renamed.so");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert_eq!(Accelerator::for_library(&link), Some(Accelerator::Tpu));
    }

    #[test]
    fn skip_override_loads_without_looking() {
        let t = Tree::new();
        for a in Accelerator::ALL {
            assert_eq!(check_in(&lib(a), t.path(), Some("1")), Ok(()));
            assert_eq!(check_in(&lib(a), t.path(), Some("yes")), Ok(()));
            assert!(check_in(&lib(a), t.path(), Some("0")).is_err());
            assert!(check_in(&lib(a), t.path(), Some("")).is_err());
        }
    }
}
