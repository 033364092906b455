//! `tpubox new` and `tpubox wit`: guest projects and the WIT package for use outside this
//! repository.
//!
//! The templates (`host/templates/LANG/` in the repository), the Rust guest SDK (`guest-sdk/`) and
//! the `tpubox:device` WIT package (`wit/`) are embedded in the binary by `build.rs`, so a
//! project made with [`new_project`] builds without a checkout: its WIT is vendored under
//! `wit/` and, for Rust, the SDK under `tpubox-guest/` (a path dependency: it builds offline,
//! needing only the SDK's crates.io dependencies; a git dependency would need the repository's
//! host, and the SDK is not on crates.io).
//!
//! Template file names: a `.tmpl` suffix marks a file whose `{{name}}` is replaced by the
//! project's name (the suffix is dropped); a leading `dot-` becomes `.` (`dot-gitignore` is
//! `.gitignore`), so the repository's own tools do not read the templates' dotfiles.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{Context, Result, bail};

include!(concat!(env!("OUT_DIR"), "/embedded.rs"));

/// The part of the WASI CLI package that guest worlds export (`wasi:cli/run`), and
/// `wasi:cli/environment`, which JavaScript guests import for their arguments.
const WASI_CLI: &str = include_str!("../../examples/wit/deps/wasi-cli/run.wit");

/// The world file of Python and JavaScript projects: `command` (the tpubox imports and the
/// `wasi:cli/run` export) and `command-args` (plus `wasi:cli/environment`).
const COMMAND_WORLD: &str = "\
// The worlds this guest is built against (written by `tpubox new`): the tpubox imports
// (`tpubox:device/guest`, vendored in deps/tpubox-device) plus the `wasi:cli/run` export that
// makes the component a command `tpubox run` can start.
package tpubox:app@0.1.0;

world command {
    include tpubox:device/guest@0.1.2;
    export wasi:cli/run@0.2.0;
}

world command-args {
    include command;
    import wasi:cli/environment@0.2.0;
}
";

/// The name of the WIT package this host serves, `namespace:name@version`.
pub const WIT_PACKAGE: &str = "tpubox:device@0.1.2";

/// The file name `tpubox wit` gives the binary-encoded package (`NAMESPACE-NAME-VERSION.wasm`,
/// which the `deps/` directory of a WIT folder accepts as it is).
pub const WIT_PACKAGE_WASM: &str = "tpubox-device-0.1.2.wasm";

/// A guest language `tpubox new` has a template for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lang {
    /// Rust with the guest SDK (`tpubox-guest`), built by cargo for `wasm32-wasip2`.
    Rust,
    /// C with `wit-bindgen c`, clang for `wasm32-wasi` and `wasm-tools component new`.
    C,
    /// Python with componentize-py.
    Python,
    /// JavaScript with componentize-js.
    Js,
}

impl Lang {
    /// The name used on the command line and as the template directory.
    pub fn as_str(self) -> &'static str {
        match self {
            Lang::Rust => "rust",
            Lang::C => "c",
            Lang::Python => "python",
            Lang::Js => "js",
        }
    }

    /// The command that builds a project of this language, run in its directory.
    pub fn build_command(self) -> &'static str {
        match self {
            Lang::Rust => "cargo build --release",
            Lang::C | Lang::Python | Lang::Js => "sh build.sh",
        }
    }

    /// The component a build writes, relative to the project directory.
    pub fn component_path(self, name: &str) -> String {
        match self {
            Lang::Rust => format!("target/wasm32-wasip2/release/{name}.wasm"),
            Lang::C | Lang::Python | Lang::Js => format!("build/{name}.wasm"),
        }
    }
}

impl fmt::Display for Lang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Lang {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "rust" | "rs" => Ok(Lang::Rust),
            "c" => Ok(Lang::C),
            "python" | "py" => Ok(Lang::Python),
            "js" | "javascript" => Ok(Lang::Js),
            _ => Err(format!("unknown language {s:?}: rust, c, python or js")),
        }
    }
}

/// What [`new_project`] made.
#[derive(Debug)]
pub struct Project {
    /// The project's name (the last component of its directory).
    pub name: String,
    /// Its directory.
    pub dir: PathBuf,
    /// Every file written, relative to `dir`, sorted.
    pub files: Vec<String>,
}

/// The `tpubox:device` package as `(file name, text)` pairs (`device.wit`, `model.wit`).
pub fn wit_package_text() -> impl Iterator<Item = (&'static str, &'static str)> {
    WIT_FILES
        .iter()
        .copied()
        .filter(|(path, _)| path.ends_with(".wit") && !path.contains('/'))
}

/// The `tpubox:device` package encoded as a WebAssembly component (the binary form of a WIT
/// package that `wasm-tools component wit`, `wkg` and `cargo component` read).
///
/// Errors: the embedded WIT does not parse (a build of a broken `wit/`).
pub fn encode_wit_package() -> Result<Vec<u8>> {
    let mut sources = wit_parser::SourceMap::new();
    for (path, text) in wit_package_text() {
        sources.push(Path::new(path), text);
    }
    let group = sources
        .parse()
        .map_err(|(_, e)| anyhow::anyhow!("parsing the embedded WIT package: {e}"))?;
    let mut resolve = wit_parser::Resolve::default();
    let package = resolve
        .push_group(group)
        .map_err(|e| anyhow::anyhow!("resolving the embedded WIT package: {e}"))?;
    wit_component::encode(&resolve, package).context("encoding the WIT package")
}

/// Writes the `tpubox:device` package into `dir` (created if missing): its `.wit` files and
/// [`WIT_PACKAGE_WASM`], the same package binary-encoded. Returns the paths written.
///
/// Errors: `dir` cannot be created or written.
pub fn write_wit(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (name, text) in wit_package_text() {
        written.push(write_file(&dir.join(name), text.as_bytes())?);
    }
    written.push(write_file(
        &dir.join(WIT_PACKAGE_WASM),
        &encode_wit_package()?,
    )?);
    Ok(written)
}

/// Whether `name` can name a project: a lowercase letter, then lowercase letters, digits,
/// `-` or `_`, at most 64 characters (a valid Cargo package and file name in every language).
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= 64
        && chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
}

/// The files of a `lang` project named `name`, as (relative path, contents).
pub fn project_files(lang: Lang, name: &str) -> Vec<(String, String)> {
    let prefix = format!("{}/", lang.as_str());
    let mut files: Vec<(String, String)> = TEMPLATE_FILES
        .iter()
        .filter_map(|(path, text)| {
            let rel = path.strip_prefix(&prefix)?;
            let rel: Vec<String> = rel
                .split('/')
                .map(|part| match part.strip_prefix("dot-") {
                    Some(rest) => format!(".{rest}"),
                    None => part.to_string(),
                })
                .collect();
            let rel = rel.join("/");
            Some(match rel.strip_suffix(".tmpl") {
                Some(plain) => (plain.to_string(), text.replace("{{name}}", name)),
                None => (rel, text.to_string()),
            })
        })
        .collect();
    let wit = |dir: &str| {
        wit_package_text()
            .map(|(file, text)| (format!("{dir}/{file}"), text.to_string()))
            .collect::<Vec<_>>()
    };
    match lang {
        // The SDK reads the package from ../wit, as it does in the repository.
        Lang::Rust => {
            files.extend(wit("wit"));
            files.extend(
                GUEST_SDK_FILES
                    .iter()
                    .map(|(path, text)| (format!("tpubox-guest/{path}"), text.to_string())),
            );
        }
        Lang::C => files.extend(wit("wit")),
        Lang::Python | Lang::Js => {
            files.push(("wit/command.wit".into(), COMMAND_WORLD.into()));
            files.extend(wit("wit/deps/tpubox-device"));
            files.push(("wit/deps/wasi-cli/run.wit".into(), WASI_CLI.into()));
        }
    }
    files.push(("README.md".into(), readme(lang, name)));
    files.sort();
    files
}

fn readme(lang: Lang, name: &str) -> String {
    let tools = match lang {
        Lang::Rust => {
            "Rust with the `wasm32-wasip2` target (`rustup target add wasm32-wasip2`). The \
             guest SDK is vendored in `tpubox-guest/` and the WIT package it is built from in \
             `wit/`."
        }
        Lang::C => {
            "clang with wasi-libc, wit-bindgen 0.63.0, wasm-tools 1.263.0 and the WASI preview1 \
             command adapter 48.0.8; `build.sh` says where it looks for them. `tpubox_errors.h` \
             names error kinds and reports errors."
        }
        Lang::Python => {
            "componentize-py 0.25.1; `build.sh` says where it looks for it. `tpubox_entry.py` \
             prints what escapes `main` (a tpubox error as `error: KIND: MESSAGE`)."
        }
        Lang::Js => {
            "Node.js 20 or newer and componentize-js 0.23.0; `build.sh` says where it looks \
             for it."
        }
    };
    format!(
        "# {name}\n\n\
         A tpubox guest in {lang}, made by `tpubox new`: the softmax of the numbers given as \
         arguments (default `1 2 3 4`), computed on the host's device by a StableHLO program.\n\n\
         ```sh\n{build}\ntpubox run {wasm} -- 0.5 1 -2\n```\n\n\
         Needs: {tools}\n\n\
         `wit/` holds the `{pkg}` WIT package (`tpubox wit --out DIR` writes it again, also \
         binary-encoded). To try a StableHLO program on its own, save it to a file and run \
         `tpubox exec FILE.mlir --arg x.npy --out out/` (see docs/STABLEHLO.md in the tpubox \
         repository).\n",
        lang = match lang {
            Lang::Rust => "Rust",
            Lang::C => "C",
            Lang::Python => "Python",
            Lang::Js => "JavaScript",
        },
        build = lang.build_command(),
        wasm = lang.component_path(name),
        pkg = WIT_PACKAGE,
    )
}

/// Writes a new `lang` guest project into `dir`, named after its last path component.
///
/// Errors: a name that is not a lowercase identifier (letters, digits, `-`, `_`), a `dir` that
/// exists and is not empty, or a write failure.
pub fn new_project(lang: Lang, dir: &Path) -> Result<Project> {
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("{}: no project name at the end of the path", dir.display()))?
        .to_string();
    if !valid_name(&name) {
        bail!(
            "{name:?} cannot name a project: use a lowercase letter, then lowercase letters, \
             digits, '-' or '_' (at most 64 characters)"
        );
    }
    if dir.exists()
        && std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .next()
            .is_some()
    {
        bail!("{} exists and is not empty", dir.display());
    }
    let mut files = Vec::new();
    for (rel, text) in project_files(lang, &name) {
        let path = write_file(&dir.join(&rel), text.as_bytes())?;
        if rel.ends_with(".sh") {
            make_executable(&path)?;
        }
        files.push(rel);
    }
    Ok(Project {
        name,
        dir: dir.to_path_buf(),
        files,
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<PathBuf> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_path_buf())
}

#[cfg(unix)]
fn make_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", path.display()))
}

#[cfg(not(unix))]
fn make_executable(_: &Path) -> Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["softmax", "my-guest", "g2_x"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "Softmax", "2x", "-x", "a b", "a.b", &"x".repeat(65)] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert_eq!("py".parse::<Lang>(), Ok(Lang::Python));
        assert!(
            "go".parse::<Lang>()
                .unwrap_err()
                .contains("rust, c, python or js")
        );
    }

    #[test]
    fn every_language_gets_its_sources_wit_and_build() {
        let want: [(Lang, &[&str]); 4] = [
            (
                Lang::Rust,
                &[
                    "Cargo.toml",
                    ".cargo/config.toml",
                    "src/main.rs",
                    "wit/device.wit",
                    "wit/model.wit",
                    "tpubox-guest/Cargo.toml",
                    "tpubox-guest/src/lib.rs",
                    "tpubox-guest/src/graph/mod.rs",
                ],
            ),
            (
                Lang::C,
                &["main.c", "tpubox_errors.h", "build.sh", "wit/device.wit"],
            ),
            (
                Lang::Python,
                &[
                    "app.py",
                    "tpubox_entry.py",
                    "build.sh",
                    "wit/command.wit",
                    "wit/deps/tpubox-device/device.wit",
                    "wit/deps/wasi-cli/run.wit",
                ],
            ),
            (
                Lang::Js,
                &[
                    "app.js",
                    "build.sh",
                    "wit/command.wit",
                    "wit/deps/wasi-cli/run.wit",
                ],
            ),
        ];
        for (lang, paths) in want {
            let files = project_files(lang, "demo");
            for p in paths.iter().chain(&["README.md", ".gitignore"]) {
                assert!(files.iter().any(|(f, _)| f == p), "{lang}: no {p}");
            }
            for (f, text) in &files {
                assert!(!f.ends_with(".tmpl") && !f.contains("dot-"), "{lang}: {f}");
                assert!(
                    !text.contains("{{name}}"),
                    "{lang}: {f} keeps a placeholder"
                );
            }
        }
        let rust = project_files(Lang::Rust, "demo");
        let cargo = &rust.iter().find(|(f, _)| f == "Cargo.toml").unwrap().1;
        assert!(cargo.contains("name = \"demo\""), "{cargo}");
    }

    /// The build scripts pin the tool versions scripts/dev.sh installs.
    #[test]
    fn build_scripts_use_the_pinned_tools() {
        let dev = include_str!("../../scripts/dev.sh");
        let pin = |var: &str| {
            let line = dev
                .lines()
                .find(|l| l.starts_with(&format!("{var}=")))
                .unwrap_or_else(|| panic!("dev.sh has no {var}"));
            line.split('"').nth(1).unwrap().to_string()
        };
        let script = |lang| {
            project_files(lang, "demo")
                .into_iter()
                .find(|(f, _)| f == "build.sh")
                .unwrap()
                .1
        };
        let c = script(Lang::C);
        for (var, tool) in [
            ("WIT_BINDGEN_VER", "wit-bindgen"),
            ("WASM_TOOLS_VER", "wasm-tools"),
            ("ADAPTER_VER", "wasi-adapter"),
        ] {
            let want = format!("{tool}-{}/", pin(var));
            assert!(c.contains(&want), "C build.sh does not use {want}");
        }
        let want = format!("componentize-py-{}/", pin("COMPONENTIZE_PY_VER"));
        assert!(script(Lang::Python).contains(&want), "{want}");
        let want = format!("componentize-js-{}/", pin("COMPONENTIZE_JS_VER"));
        assert!(script(Lang::Js).contains(&want), "{want}");
    }

    /// The vendored SDK's Cargo.toml states what the workspace would have given it.
    #[test]
    fn vendored_sdk_manifest_matches_the_workspace() {
        let workspace = include_str!("../../Cargo.toml");
        let sdk = GUEST_SDK_FILES
            .iter()
            .find(|(p, _)| *p == "Cargo.toml")
            .unwrap()
            .1;
        for key in [
            "version = ",
            "edition = ",
            "license = ",
            "rust-version = ",
            "wit-bindgen = ",
            "half = ",
        ] {
            let line = |text: &str| {
                text.lines()
                    .find(|l| l.starts_with(key))
                    .unwrap_or_else(|| panic!("no {key}"))
                    .to_string()
            };
            assert_eq!(line(sdk), line(workspace), "guest-sdk/Cargo.toml {key}");
        }
    }

    #[test]
    fn the_encoded_package_decodes_to_the_same_interfaces() {
        let bytes = encode_wit_package().unwrap();
        let decoded = wit_parser::decoding::decode(&bytes).unwrap();
        let resolve = decoded.resolve();
        let pkg = &resolve.packages[decoded.package()];
        assert_eq!(pkg.name.to_string(), WIT_PACKAGE);
        let mut interfaces: Vec<&str> = pkg.interfaces.keys().map(String::as_str).collect();
        interfaces.sort();
        assert_eq!(
            interfaces,
            [
                "client",
                "decoupled",
                "model",
                "sharding",
                "types",
                "weights"
            ]
        );
        let mut worlds: Vec<&str> = pkg.worlds.keys().map(String::as_str).collect();
        worlds.sort();
        assert_eq!(worlds, ["decoupled-model", "guest", "served-model"]);
    }
}
