//! The model repository: a directory with one subdirectory per model, scanned at start-up;
//! models load, reload and unload at run time, each with its state as Triton reports it
//! (`READY`, `LOADING`, `UNLOADING`, `UNAVAILABLE`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use super::config::CONFIG_FILES;
use super::error::{ServeError, ServeErrorKind, ServeResult};
use super::model::{LoadContext, Model};
use tpubox_core::logsafe::clip;

/// A model's state.
#[derive(Clone)]
pub enum ModelState {
    /// Loading.
    Loading,
    /// Loaded and serving.
    Ready(Arc<Model>),
    /// Unloading: no new requests.
    Unloading,
    /// Not loaded: never loaded, failed to load (the reason says why), or unloaded.
    Unavailable(String),
}

impl ModelState {
    /// Triton's name of the state.
    pub fn name(&self) -> &'static str {
        match self {
            ModelState::Loading => "LOADING",
            ModelState::Ready(_) => "READY",
            ModelState::Unloading => "UNLOADING",
            ModelState::Unavailable(_) => "UNAVAILABLE",
        }
    }
}

/// One row of the repository index.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexEntry {
    /// Model name.
    pub name: String,
    /// Its version (always `1`).
    pub version: String,
    /// `READY`, `LOADING`, `UNLOADING` or `UNAVAILABLE`.
    pub state: String,
    /// Why it is unavailable; empty otherwise.
    pub reason: String,
}

/// The models of one repository directory.
pub struct Repository {
    root: PathBuf,
    ctx: LoadContext,
    models: RwLock<BTreeMap<String, ModelState>>,
    /// One lock per model directory: loads and unloads of one model run one at a time, so
    /// each replaces (and shuts down) the model the previous one left. An entry is made only
    /// for a name with a model directory, so the map is bounded by the repository.
    changes: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// A model the repository does not have (Triton's words: [`crate::wording`]).
pub use crate::wording::unknown_model;

/// Marks a model whose load was dropped half-way `UNAVAILABLE` (while armed).
struct CancelledLoad<'a> {
    models: &'a RwLock<BTreeMap<String, ModelState>>,
    name: &'a str,
    armed: bool,
}

impl Drop for CancelledLoad<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut models = self.models.write().unwrap();
        if matches!(models.get(self.name), Some(ModelState::Loading)) {
            models.insert(
                self.name.to_string(),
                ModelState::Unavailable("its load was cancelled".into()),
            );
        }
    }
}

/// The answer to a load of a model the repository does not have, in Triton's words, as not
/// found (HTTP 400, gRPC `NOT_FOUND`); also to a tenant's load of a model it may not call, so
/// that it cannot tell the two apart.
pub fn missing_for_load(name: &str) -> ServeError {
    ServeError::new(
        super::error::ServeErrorKind::NotFound,
        format!(
            "failed to load '{}', failed to poll from model repository",
            clip(name)
        ),
    )
}

/// Checks the parameters of a load request of `model`. Triton's `config` (a configuration sent
/// with the request, [`Repository::load_with`]) is supported; its `file:…` parameters (model
/// files sent with the request) are not: a model's files load from its directory.
///
/// Errors: a `file:` parameter, in Triton's words and with its status for a file parameter it
/// cannot take (`failed to load 'm', failed to poll from model repository`, 500 / `INTERNAL`;
/// Triton's own client example `simple_grpc_model_control.py` checks both), then why.
pub fn check_load_parameters<'a>(
    model: &str,
    keys: impl IntoIterator<Item = &'a str>,
) -> ServeResult<()> {
    for k in keys {
        if k.starts_with("file:") {
            let shown: String = k.chars().take(64).collect();
            return Err(ServeError::new(
                super::error::ServeErrorKind::Internal,
                format!(
                    "failed to load '{}', failed to poll from model repository: load parameter `{shown}` is not supported: a model's files load from its directory in the repository (a `config` override is)",
                    clip(model)
                ),
            ));
        }
    }
    Ok(())
}

/// Whether `name` can name a model directory: letters, digits, `_`, `-`, `.`, not starting
/// with `.`, at most 128 bytes.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

impl Repository {
    /// A repository rooted at `root`; nothing is loaded yet.
    pub fn new(root: PathBuf, ctx: LoadContext) -> Self {
        Repository {
            root,
            ctx,
            models: RwLock::new(BTreeMap::new()),
            changes: Mutex::new(HashMap::new()),
        }
    }

    /// Waits for the right to load or unload `name` (one change of a model at a time).
    async fn change_lock(&self, name: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = Arc::clone(
            self.changes
                .lock()
                .unwrap()
                .entry(name.to_string())
                .or_default(),
        );
        lock.lock_owned().await
    }

    /// The repository directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The names of the model directories (those with a configuration file), sorted.
    ///
    /// Errors: the directory cannot be read.
    pub fn scan(&self) -> std::io::Result<Vec<String>> {
        let mut names = Vec::new();
        for e in std::fs::read_dir(&self.root)? {
            let e = e?;
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if valid_name(&name) && CONFIG_FILES.iter().any(|f| e.path().join(f).is_file()) {
                names.push(name);
            }
        }
        names.sort();
        let mut models = self.models.write().unwrap();
        for n in &names {
            models
                .entry(n.clone())
                .or_insert_with(|| ModelState::Unavailable("not loaded".into()));
        }
        Ok(names)
    }

    /// The model `name` if it is ready.
    ///
    /// Errors: not found for a model the repository does not have; not ready for one that is
    /// not loaded (the message says its state).
    pub fn get(&self, name: &str) -> ServeResult<Arc<Model>> {
        match self.models.read().unwrap().get(name) {
            Some(ModelState::Ready(m)) => Ok(Arc::clone(m)),
            Some(ModelState::Unavailable(reason)) => Err(ServeError::new(
                ServeErrorKind::NotReady,
                format!("model `{name}` is not ready (UNAVAILABLE: {reason})"),
            )),
            Some(s) => Err(ServeError::new(
                ServeErrorKind::NotReady,
                format!("model `{name}` is not ready ({})", s.name()),
            )),
            None => Err(unknown_model(name)),
        }
    }

    /// Whether the repository has a model `name` (in any state).
    pub fn knows(&self, name: &str) -> bool {
        self.models.read().unwrap().contains_key(name)
    }

    /// Every model's state.
    pub fn states(&self) -> Vec<(String, ModelState)> {
        self.models
            .read()
            .unwrap()
            .iter()
            .map(|(n, s)| (n.clone(), s.clone()))
            .collect()
    }

    /// The repository index (after a fresh scan, so new directories appear).
    pub fn index(&self) -> Vec<IndexEntry> {
        let _ = self.scan();
        self.states()
            .into_iter()
            .map(|(name, s)| IndexEntry {
                name,
                version: super::model::VERSION.into(),
                state: s.name().into(),
                reason: match &s {
                    ModelState::Unavailable(r) => r.clone(),
                    _ => String::new(),
                },
            })
            .collect()
    }

    /// Whether every model is settled (none loading or unloading).
    pub fn settled(&self) -> bool {
        self.models
            .read()
            .unwrap()
            .values()
            .all(|s| matches!(s, ModelState::Ready(_) | ModelState::Unavailable(_)))
    }

    /// Loads (or reloads) the model `name` from its directory. A reload swaps the new model in
    /// once it loaded; the old one finishes what it queued, then its instances end. Loads and
    /// unloads of one model run one at a time, in the order they were asked for: concurrent
    /// reloads each replace the model the previous one loaded, so none is left running.
    ///
    /// Errors: bad request for a name that cannot be a model directory; bad request in
    /// Triton's words (`failed to load 'm', failed to poll from model repository`) when the
    /// directory or its configuration is missing; bad request, with
    /// the reason, when loading fails (the model is then `UNAVAILABLE` with that reason, unless
    /// an earlier version of it is still serving).
    pub async fn load(&self, name: &str) -> ServeResult<()> {
        self.load_with(name, None).await
    }

    /// [`Repository::load`] with Triton's config override: `config_override` (the model
    /// configuration as JSON) replaces the directory's configuration file for this load (the
    /// directory then needs none); a later load without one reads the file again.
    ///
    /// Errors: as [`Repository::load`]; an override that does not parse or check fails the
    /// load (`failed to load 'M', …`) and leaves a version already serving in place.
    pub async fn load_with(&self, name: &str, config_override: Option<&str>) -> ServeResult<()> {
        if !valid_name(name) {
            return Err(ServeError::bad_request(format!(
                "`{}` is not a model name",
                clip(name)
            )));
        }
        let dir = self.root.join(name);
        let has_config = if config_override.is_some() {
            dir.is_dir()
        } else {
            CONFIG_FILES.iter().any(|f| dir.join(f).is_file())
        };
        if !has_config {
            tracing::debug!(model = %clip(name), "load: no configuration file");
            return Err(missing_for_load(name));
        }
        let _change = self.change_lock(name).await;
        let serving = {
            let mut models = self.models.write().unwrap();
            let serving = matches!(models.get(name), Some(ModelState::Ready(_)));
            if !serving {
                models.insert(name.to_string(), ModelState::Loading);
            }
            serving
        };
        // A caller that goes away mid-load (a closed connection, a cancelled gRPC call) drops
        // this future: the model must not stay `LOADING` (which would keep readiness false).
        let mut cancelled = CancelledLoad {
            models: &self.models,
            name,
            armed: !serving,
        };
        let loaded = Model::load(&self.ctx, name, &dir, config_override).await;
        cancelled.armed = false;
        match loaded {
            Ok(model) => {
                let replaced = self
                    .models
                    .write()
                    .unwrap()
                    .insert(name.to_string(), ModelState::Ready(model));
                if let Some(ModelState::Ready(previous)) = replaced {
                    previous.shutdown().await;
                    tokio::spawn(previous.join());
                }
                Ok(())
            }
            Err(e) => {
                let reason = format!("{e:#}");
                tracing::error!(model = %clip(name), "loading failed: {reason}");
                if !serving {
                    self.models
                        .write()
                        .unwrap()
                        .insert(name.to_string(), ModelState::Unavailable(reason.clone()));
                }
                // Triton answers a failed load with 400, in these words.
                Err(crate::wording::failed_to_load(name, &reason))
            }
        }
    }

    /// Unloads the model `name`: it takes no new requests, finishes those queued, and becomes
    /// `UNAVAILABLE` ("unloaded"); its instances end once their queue is empty. Waits for a
    /// load or unload of the same model in progress.
    ///
    /// Errors: not found (as [`unknown_model`]) for a model the repository does not have; bad
    /// request when it is not loaded.
    pub async fn unload(&self, name: &str) -> ServeResult<()> {
        if !self.knows(name) {
            return Err(unknown_model(name));
        }
        let _change = self.change_lock(name).await;
        let model = {
            let mut models = self.models.write().unwrap();
            match models.get(name).cloned() {
                Some(ModelState::Ready(m)) => {
                    models.insert(name.to_string(), ModelState::Unloading);
                    m
                }
                Some(s) => {
                    return Err(ServeError::bad_request(format!(
                        "model `{name}` is not loaded ({})",
                        s.name()
                    )));
                }
                None => return Err(unknown_model(name)),
            }
        };
        model.shutdown().await;
        self.models
            .write()
            .unwrap()
            .insert(name.to_string(), ModelState::Unavailable("unloaded".into()));
        tokio::spawn(model.join());
        Ok(())
    }

    /// Fails every queued request of every model (at shutdown, once the drain time is up).
    pub fn abort_all(&self) {
        for (_, s) in self.states() {
            if let ModelState::Ready(m) = s {
                m.abort();
            }
        }
    }

    /// Unloads every model (at shutdown): they take no new requests.
    pub async fn unload_all(&self) {
        let ready: Vec<String> = self
            .states()
            .into_iter()
            .filter(|(_, s)| matches!(s, ModelState::Ready(_)))
            .map(|(n, _)| n)
            .collect();
        for n in ready {
            let _ = self.unload(&n).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `file:` load parameter is refused in Triton's words, and a model name of any length
    /// is clipped in them (the fuzz target `doors` sent one of 24 KiB, which took the whole
    /// message past the 16 KiB backstop).
    #[test]
    fn a_file_parameter_is_refused_naming_the_model_clipped() {
        let long = "m".repeat(24 << 10);
        let e = check_load_parameters(&long, ["config", "file:1/model.onnx"]).unwrap_err();
        assert_eq!(e.kind, super::super::error::ServeErrorKind::Internal);
        assert!(e.message.len() < 1024, "{} bytes", e.message.len());
        assert!(
            e.message.contains(
                "failed to poll from model repository: load parameter `file:1/model.onnx`"
            ),
            "{}",
            e.message
        );
        check_load_parameters(&long, ["config"]).unwrap();
    }
}
