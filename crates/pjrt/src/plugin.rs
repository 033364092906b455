//! [`Plugin`]: a loaded PJRT plugin shared library and its `PJRT_Api` table.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use pjrt_sys as sys;
use sys::Args;

use crate::api::{Api, api_fn, slice_from};
use crate::error::{Error, ErrorCode, Result};
use crate::named_value::{self, NamedValue};

/// A loaded PJRT plugin. Cheap to clone (shared).
///
/// Each canonical path is loaded at most once per process (a global registry returns the same
/// `Plugin` for a second [`Plugin::load`]) and is never unloaded: `dlclose` of a PJRT plugin
/// crashed at process exit in trials.
#[derive(Clone)]
pub struct Plugin(Arc<PluginInner>);

struct PluginInner {
    path: PathBuf,
    api: Api,
    version: (u32, u32),
}

/// Loaded plugins by canonical path.
static REGISTRY: Mutex<Vec<Plugin>> = Mutex::new(Vec::new());

impl Plugin {
    /// Loads the plugin at `path` (or returns the already loaded one for the same canonical
    /// path), calls `GetPjrtApi`, checks the table, and runs `PJRT_Plugin_Initialize` once.
    ///
    /// Errors: `NotFound` if the file does not exist; `InvalidArgument` if it cannot be loaded
    /// as a shared library or lacks `GetPjrtApi`; `FailedPrecondition` if the plugin's API
    /// major version is not 0, its minor version is below [`crate::MIN_API_MINOR`] (81), or its
    /// table is too small; any error of `PJRT_Plugin_Initialize`.
    ///
    /// Loading a shared library runs its initializers: `path` must be a PJRT plugin.
    pub fn load(path: &Path) -> Result<Plugin> {
        let canonical = std::fs::canonicalize(path).map_err(|e| {
            Error::new(
                ErrorCode::NotFound,
                format!("PJRT plugin {}: {e}", path.display()),
            )
        })?;
        let mut registry = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = registry.iter().find(|p| p.0.path == canonical) {
            return Ok(p.clone());
        }
        // SAFETY: loading a shared library runs its initialization code; the caller passes a
        // PJRT plugin, whose initializers only set up its own state. The library is leaked
        // below, so it is never unloaded while code or data from it is in use.
        let lib = unsafe { libloading::Library::new(&canonical) }.map_err(|e| {
            Error::invalid_argument(format!("cannot load {}: {e}", canonical.display()))
        })?;
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        // SAFETY: `GetPjrtApi` is declared by the PJRT C API as `const PJRT_Api* GetPjrtApi()`,
        // which is the type `GetPjrtApiFn` names.
        let get_api = unsafe { lib.get::<sys::GetPjrtApiFn>(b"GetPjrtApi\0") }.map_err(|e| {
            Error::invalid_argument(format!(
                "{} is not a PJRT plugin (no GetPjrtApi): {e}",
                canonical.display()
            ))
        })?;
        // SAFETY: `GetPjrtApi` takes no arguments and returns a pointer to a static table.
        let raw = unsafe { get_api() };
        if raw.is_null() {
            return Err(Error::new(
                ErrorCode::FailedPrecondition,
                format!("{}: GetPjrtApi returned null", canonical.display()),
            ));
        }
        // SAFETY: `raw` is the non-null table returned by the plugin, which lives as long as the
        // library (forever, it is leaked above).
        let api = unsafe { Api::from_raw(raw) }?;
        let (major, minor) = api.version();
        if major != 0 || minor < crate::MIN_API_MINOR as i32 {
            return Err(Error::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "{}: plugin implements PJRT C API {major}.{minor}; need 0.{} or newer (major 0)",
                    canonical.display(),
                    crate::MIN_API_MINOR
                ),
            ));
        }
        let init = api_fn!(api, PJRT_Plugin_Initialize)?;
        let mut args = sys::PJRT_Plugin_Initialize_Args::new();
        // SAFETY: `args` is initialized with the header's struct_size; Initialize is called
        // once per plugin (guarded by the registry lock) before any other function.
        let err = unsafe { init(&mut args) };
        api.check(err)?;
        tracing::debug!(path = %canonical.display(), major, minor, "loaded PJRT plugin");
        let plugin = Plugin(Arc::new(PluginInner {
            path: canonical,
            api,
            version: (major as u32, minor as u32),
        }));
        registry.push(plugin.clone());
        Ok(plugin)
    }

    /// Canonical path the plugin was loaded from.
    pub fn path(&self) -> &Path {
        &self.0.path
    }

    /// PJRT C API version `(major, minor)` the plugin implements (`PJRT_Api.pjrt_api_version`),
    /// e.g. `(0, 115)`.
    pub fn api_version(&self) -> (u32, u32) {
        self.0.version
    }

    /// Size in bytes of the plugin's `PJRT_Api` function table (grows with the minor version).
    pub fn api_struct_size(&self) -> usize {
        self.0.api.struct_size()
    }

    /// Plugin attributes (`PJRT_Plugin_Attributes`), e.g. `xla_version`,
    /// `stablehlo_current_version` (an `Int64List` such as `[1, 20, 0]`),
    /// `stablehlo_minimum_version`. Attributes of an unknown value type are skipped.
    ///
    /// Errors: `Unimplemented` if the plugin lacks the function; the plugin's error otherwise.
    pub fn attributes(&self) -> Result<Vec<(String, NamedValue)>> {
        let api = self.0.api;
        let f = api_fn!(api, PJRT_Plugin_Attributes)?;
        let mut args = sys::PJRT_Plugin_Attributes_Args::new();
        // SAFETY: `args` is initialized with the header's struct_size; the call only writes the
        // out fields.
        api.check(unsafe { f(&mut args) })?;
        // SAFETY: returned attributes have the lifetime of the process (header comment).
        let raw = unsafe { slice_from(args.attributes, args.num_attributes) };
        // SAFETY: each element is a valid PJRT_NamedValue owned by the plugin for the process.
        Ok(raw
            .iter()
            .filter_map(|nv| unsafe { named_value::from_raw(nv) })
            .collect())
    }

    pub(crate) fn api(&self) -> Api {
        self.0.api
    }
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.0.path)
            .field("api_version", &self.0.version)
            .finish()
    }
}
