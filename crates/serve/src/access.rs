//! Who may call which model, and how much: bearer tokens mapped to tenants (a file the operator
//! writes), each with the models it may call, an in-flight limit and a request rate. Both front
//! doors ask [`Access::admit`] and nothing else decides.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use super::error::{ServeError, ServeErrorKind, ServeResult};
use tpubox_core::error::{DeviceError, ErrorKind};
use tpubox_core::placement::{TenantDevices, TenantRule, plan};
use tpubox_session_api::SessionAccess;
use tpubox_session_api::policy::SessionPolicy;
use tpubox_session_api::registry::{AccessError, AccessResult, OpenGrant};

/// Default `max_in_flight` of a tenant.
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 64;

/// One `[[tenant]]` of the tokens file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantEntry {
    /// The tenant's name (metrics labels, logs).
    pub name: String,
    /// Bearer tokens that identify it.
    pub tokens: Vec<String>,
    /// Models it may call; `"*"` for all.
    #[serde(default = "all_models")]
    pub models: Vec<String>,
    /// Requests in flight at once (default 64).
    #[serde(default = "default_in_flight")]
    pub max_in_flight: u32,
    /// Requests per second, as a token bucket whose burst is one second's worth; absent for
    /// no limit.
    #[serde(default)]
    pub max_requests_per_second: Option<f64>,
    /// May load and unload (the models it may call) through the repository API (default
    /// false).
    #[serde(default)]
    pub repository_control: bool,
    /// May read `GET /metrics`, which names every model and tenant (default false). Without a
    /// tokens file the metrics need no token.
    #[serde(default)]
    pub metrics: bool,
    /// May use the admin calls on the metrics port (default false): list every tenant's
    /// sessions, end one, reload the tokens file and TLS files (`tpubox admin`;
    /// [`crate::admin`]). Without a tokens file they need no token.
    #[serde(default)]
    pub admin: bool,
    /// `[tenant.session]`: the tenant may open sessions on the session API, each with these
    /// limits; absent, it may not.
    #[serde(default)]
    pub session: Option<SessionPolicy>,
}

fn all_models() -> Vec<String> {
    vec!["*".into()]
}

fn default_in_flight() -> u32 {
    DEFAULT_MAX_IN_FLIGHT
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    tenant: Vec<TenantEntry>,
}

/// A request tenant and its live counters.
#[derive(Debug)]
pub struct RequestTenant {
    /// Its entry.
    pub entry: TenantEntry,
    in_flight: AtomicU64,
    bucket: Mutex<(f64, Instant)>,
}

impl RequestTenant {
    fn new(entry: TenantEntry) -> Arc<Self> {
        let burst = entry.max_requests_per_second.unwrap_or(0.0).max(1.0);
        Arc::new(RequestTenant {
            entry,
            in_flight: AtomicU64::new(0),
            bucket: Mutex::new((burst, Instant::now())),
        })
    }

    /// Requests of this tenant in flight now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Whether the tenant may call `model` (its `models` list names it, or `"*"`).
    pub fn may_call(&self, model: &str) -> bool {
        self.entry.models.iter().any(|m| m == "*" || m == model)
    }

    /// Takes one request from the bucket; `false` when it is empty.
    fn take_rate(&self) -> bool {
        let Some(rate) = self.entry.max_requests_per_second else {
            return true;
        };
        let burst = rate.max(1.0);
        let mut b = self.bucket.lock().unwrap();
        let now = Instant::now();
        b.0 = (b.0 + now.duration_since(b.1).as_secs_f64() * rate).min(burst);
        b.1 = now;
        if b.0 >= 1.0 {
            b.0 -= 1.0;
            true
        } else {
            false
        }
    }
}

/// An admitted request: holds its tenant's in-flight slot until dropped.
pub struct Admission {
    tenant: Arc<RequestTenant>,
}

impl Admission {
    /// The tenant's name.
    pub fn tenant(&self) -> &str {
        &self.tenant.entry.name
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.tenant.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The tenants of a server and their tokens: one version of the tokens file.
#[derive(Debug)]
struct Tokens {
    by_token: HashMap<String, Arc<RequestTenant>>,
    tenants: Vec<Arc<RequestTenant>>,
    /// Without a tokens file: everyone is this tenant.
    anonymous: Option<Arc<RequestTenant>>,
}

/// The tenants of a server and their tokens, from the tokens file, which
/// [`Access::reload`] reads again while the server runs (SIGHUP).
#[derive(Debug)]
pub struct Access {
    tokens: RwLock<Arc<Tokens>>,
    /// The host's device count, for planning the tenants' devices
    /// ([`Access::set_device_count`]; 1 until set).
    device_count: std::sync::atomic::AtomicU32,
    /// The tokens file (`None`: no authentication, [`Access::open`]).
    path: Option<PathBuf>,
}

/// What a [`Access::reload`] changed, by tenant name.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reload {
    /// Tenants the new file adds.
    pub added: Vec<String>,
    /// Tenants it no longer has (their sessions are to end).
    pub removed: Vec<String>,
    /// Tenants whose entry changed (new sessions and requests get the new values).
    pub changed: Vec<String>,
}

impl Access {
    /// No authentication: every request is tenant `anonymous`, which may call every model,
    /// with the default in-flight limit and no rate limit.
    pub fn open() -> Self {
        let t = RequestTenant::new(TenantEntry {
            name: "anonymous".into(),
            tokens: vec![],
            models: all_models(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_requests_per_second: None,
            repository_control: true,
            metrics: true,
            admin: true,
            // Without a tokens file the one tenant may do everything, publishing included.
            session: Some(SessionPolicy {
                publish_weights: true,
                ..SessionPolicy::default()
            }),
        });
        Access {
            tokens: RwLock::new(Arc::new(Tokens {
                by_token: HashMap::new(),
                tenants: vec![Arc::clone(&t)],
                anonymous: Some(t),
            })),
            path: None,
            device_count: std::sync::atomic::AtomicU32::new(1),
        }
    }

    /// Reads a tokens file (TOML, `[[tenant]]` entries; see `docs/SERVING.md`).
    ///
    /// Errors: the file does not read or parse; a token given twice, an empty token, a
    /// tenant name given twice, a rate that is not positive.
    pub fn from_file(path: &Path) -> Result<Self> {
        Ok(Access {
            tokens: RwLock::new(Arc::new(Access::read(path, &[])?)),
            path: Some(path.to_path_buf()),
            device_count: std::sync::atomic::AtomicU32::new(1),
        })
    }

    /// Reads the tokens file again and uses it from now on; a tenant whose entry is
    /// unchanged keeps its counters (requests in flight, rate bucket). A file that does not
    /// read or check is refused and the one in use kept.
    ///
    /// Errors: no tokens file ([`Access::open`]); as [`Access::from_file`].
    pub fn reload(&self) -> Result<Reload> {
        let Some(path) = &self.path else {
            bail!("this server has no tokens file to reload (it runs without --tokens)");
        };
        let old = self.current();
        let new = Access::read(path, &old.tenants)?;
        Access::plan_devices(&new, self.devices())
            .with_context(|| format!("{}: devices", path.display()))?;
        let name = |t: &Arc<RequestTenant>| t.entry.name.clone();
        let find =
            |ts: &[Arc<RequestTenant>], n: &str| ts.iter().find(|t| t.entry.name == n).cloned();
        let mut r = Reload::default();
        for t in &new.tenants {
            match find(&old.tenants, &t.entry.name) {
                None => r.added.push(name(t)),
                Some(o) if !Arc::ptr_eq(&o, t) => r.changed.push(name(t)),
                Some(_) => {}
            }
        }
        r.removed = old
            .tenants
            .iter()
            .filter(|t| find(&new.tenants, &t.entry.name).is_none())
            .map(name)
            .collect();
        *self.tokens.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(new);
        Ok(r)
    }

    /// Tells the access rules how many devices the host has, and checks every tenant's
    /// `devices` against them ([`tpubox_core::placement::plan`]).
    ///
    /// Errors: a tenant's `devices` names a device the host lacks, asks for more than are
    /// left, or overlaps a device another tenant holds alone.
    pub fn set_device_count(&self, n: u32) -> Result<()> {
        Access::plan_devices(&self.current(), n)?;
        self.device_count
            .store(n.max(1), std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn devices(&self) -> u32 {
        self.device_count.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every session tenant's devices on a host of `n` devices.
    fn plan_devices(
        tokens: &Tokens,
        n: u32,
    ) -> Result<std::collections::BTreeMap<String, TenantDevices>> {
        let rules: Vec<TenantRule> = tokens
            .tenants
            .iter()
            .filter_map(|t| {
                t.entry.session.as_ref().map(|p| TenantRule {
                    tenant: t.entry.name.clone(),
                    rule: p.device_rule(),
                    exclusive: p.exclusive_devices,
                })
            })
            .collect();
        plan(&rules, n).map_err(|e| anyhow::anyhow!("{}", e.message))
    }

    /// The devices some session tenant holds alone (`exclusive_devices`), ascending: served
    /// models are not spread onto them.
    pub fn exclusive_devices(&self) -> Vec<u32> {
        let mut v: Vec<u32> = Access::plan_devices(&self.current(), self.devices())
            .map(|p| {
                p.values()
                    .filter(|d| d.exclusive)
                    .flat_map(|d| d.devices.iter().copied())
                    .collect()
            })
            .unwrap_or_default();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Whether it was read from a tokens file (which [`Access::reload`] can read again).
    pub fn has_file(&self) -> bool {
        self.path.is_some()
    }

    fn current(&self) -> Arc<Tokens> {
        Arc::clone(&self.tokens.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Parses and checks the tokens file; tenants of `keep` whose entry is unchanged are
    /// reused as they are.
    fn read(path: &Path, keep: &[Arc<RequestTenant>]) -> Result<Tokens> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the tokens file {}", path.display()))?;
        let file: TokensFile =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let mut by_token = HashMap::new();
        let mut tenants: Vec<Arc<RequestTenant>> = Vec::new();
        for entry in file.tenant {
            if tenants.iter().any(|t| t.entry.name == entry.name) {
                bail!("{}: tenant `{}` is given twice", path.display(), entry.name);
            }
            if entry
                .max_requests_per_second
                .is_some_and(|r| r <= 0.0 || !r.is_finite())
            {
                bail!(
                    "{}: tenant `{}`: max_requests_per_second must be positive",
                    path.display(),
                    entry.name
                );
            }
            if let Some(p) = &entry.session
                && let Err(e) = p.check()
            {
                bail!(
                    "{}: tenant `{}`: [tenant.session]: {e}",
                    path.display(),
                    entry.name
                );
            }
            let t = match keep.iter().find(|k| k.entry == entry) {
                Some(k) => Arc::clone(k),
                None => RequestTenant::new(entry),
            };
            for tok in &t.entry.tokens {
                if tok.is_empty() {
                    bail!(
                        "{}: tenant `{}` has an empty token",
                        path.display(),
                        t.entry.name
                    );
                }
                if by_token.insert(tok.clone(), Arc::clone(&t)).is_some() {
                    bail!(
                        "{}: a token of tenant `{}` is used twice",
                        path.display(),
                        t.entry.name
                    );
                }
            }
            tenants.push(t);
        }
        Ok(Tokens {
            by_token,
            tenants,
            anonymous: None,
        })
    }

    /// Every tenant (of the tokens file in use now).
    pub fn tenants(&self) -> Vec<Arc<RequestTenant>> {
        self.current().tenants.clone()
    }

    /// Who is calling: the tenant of `authorization` (the header's or the gRPC metadata's
    /// value, `Bearer TOKEN`).
    ///
    /// Errors: unauthenticated when there is no token or an unknown one.
    pub fn identify(&self, authorization: Option<&str>) -> ServeResult<Arc<RequestTenant>> {
        let tokens = self.current();
        if let Some(t) = &tokens.anonymous {
            return Ok(Arc::clone(t));
        }
        let Some(value) = authorization else {
            return Err(ServeError::new(
                ServeErrorKind::Unauthenticated,
                "this server needs a bearer token (Authorization: Bearer TOKEN)",
            ));
        };
        // RFC 6750: the scheme is `Bearer` (case-insensitive), then the token.
        let token = match value.split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token.trim(),
            _ => {
                return Err(ServeError::new(
                    ServeErrorKind::Unauthenticated,
                    "the Authorization header must be `Bearer TOKEN`",
                ));
            }
        };
        tokens
            .by_token
            .get(token)
            .cloned()
            .ok_or_else(|| ServeError::new(ServeErrorKind::Unauthenticated, "unknown bearer token"))
    }

    /// Admits a caller of `GET /metrics`: a tenant whose entry has `metrics = true` (anyone
    /// without a tokens file).
    ///
    /// Errors: unauthenticated (401) as [`Access::identify`]; forbidden (403) for a tenant
    /// without `metrics`.
    pub fn admit_metrics(&self, authorization: Option<&str>) -> ServeResult<()> {
        let tenant = self.identify(authorization)?;
        if !tenant.entry.metrics {
            return Err(ServeError::new(
                ServeErrorKind::Forbidden,
                format!(
                    "tenant `{}` may not read the metrics (metrics = true in the tokens file)",
                    tenant.entry.name
                ),
            ));
        }
        Ok(())
    }

    /// Admits a caller of the admin calls ([`crate::admin`]): a tenant whose entry has
    /// `admin = true` (anyone without a tokens file). Returns the tenant, for the log.
    ///
    /// Errors: unauthenticated (401) as [`Access::identify`]; forbidden (403) for a tenant
    /// without `admin`.
    pub fn admit_admin(&self, authorization: Option<&str>) -> ServeResult<Arc<RequestTenant>> {
        let tenant = self.identify(authorization)?;
        if !tenant.entry.admin {
            return Err(ServeError::new(
                ServeErrorKind::Forbidden,
                format!(
                    "tenant `{}` may not use the admin calls (admin = true in the tokens file)",
                    tenant.entry.name
                ),
            ));
        }
        Ok(tenant)
    }

    /// Admits one request of `authorization` to `model`, or refuses it.
    ///
    /// Errors: unauthenticated (401) as [`Access::identify`]; not found (400, gRPC
    /// `NOT_FOUND`, exactly as for a model that does not exist:
    /// [`super::repository::unknown_model`]) when the tenant may not call `model`; too many requests (429) over its `max_in_flight` (limit
    /// `max-in-flight`) or its rate (limit `max-requests-per-second`). The refusing tenant's
    /// name is in the error for metrics.
    pub fn admit(
        &self,
        authorization: Option<&str>,
        model: &str,
    ) -> Result<Admission, (Option<String>, ServeError)> {
        let tenant = self.identify(authorization).map_err(|e| (None, e))?;
        let name = || Some(tenant.entry.name.clone());
        if !tenant.may_call(model) {
            // As for a model that does not exist: a tenant learns nothing about the others.
            return Err((name(), super::repository::unknown_model(model)));
        }
        let before = tenant.in_flight.fetch_add(1, Ordering::Relaxed);
        let admission = Admission {
            tenant: Arc::clone(&tenant),
        };
        if before >= u64::from(tenant.entry.max_in_flight) {
            return Err((
                name(),
                ServeError::limited(
                    "max-in-flight",
                    format!(
                        "tenant `{}` already has {} in flight (limit max-in-flight = {})",
                        tenant.entry.name, before, tenant.entry.max_in_flight
                    ),
                ),
            ));
        }
        if !tenant.take_rate() {
            return Err((
                name(),
                ServeError::limited(
                    "max-requests-per-second",
                    format!(
                        "tenant `{}` is over its rate (limit max-requests-per-second = {})",
                        tenant.entry.name,
                        tenant.entry.max_requests_per_second.unwrap_or_default()
                    ),
                ),
            ));
        }
        Ok(admission)
    }
}

/// The session API asks the same tokens file: a tenant token opens sessions when its entry
/// has a `[tenant.session]` table.
impl SessionAccess for Access {
    fn grant(&self, token: Option<&str>) -> AccessResult<OpenGrant> {
        let value = token.map(|t| format!("Bearer {t}"));
        let tenant = self.identify(value.as_deref()).map_err(|e| {
            AccessError::Unauthenticated(if token.is_none() {
                "opening a session needs a tenant token from the daemon's tokens file (Python: tpubox.connect(address, token); gRPC: `authorization: Bearer TOKEN` metadata)".into()
            } else {
                format!("{} (a tenant token from the daemon's tokens file is needed here, not a session token)", e.message)
            })
        })?;
        match &tenant.entry.session {
            Some(p) => {
                let n = self.devices();
                let devices = Access::plan_devices(&self.current(), n)
                    .ok()
                    .and_then(|mut plan| plan.remove(&tenant.entry.name))
                    .unwrap_or_else(|| TenantDevices::all(n));
                Ok(OpenGrant {
                    tenant: tenant.entry.name.clone(),
                    policy: p.clone(),
                    devices,
                })
            }
            None => Err(AccessError::Device(DeviceError::new(
                ErrorKind::PermissionDenied,
                format!(
                    "tenant `{}` may not open sessions (its tokens-file entry has no [tenant.session] table)",
                    tenant.entry.name
                ),
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(text: &str) -> Access {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokens.toml");
        std::fs::write(&p, text).unwrap();
        Access::from_file(&p).unwrap()
    }

    #[test]
    fn tokens_models_in_flight_and_rate() {
        let a = access(
            r#"
[[tenant]]
name = "bob"
tokens = ["b"]
models = ["dtypes"]
max_in_flight = 1
[[tenant]]
name = "slow"
tokens = ["s"]
max_requests_per_second = 1
"#,
        );
        let kind = |r: Result<Admission, (Option<String>, ServeError)>| r.err().map(|e| e.1.kind);
        assert_eq!(
            kind(a.admit(None, "dtypes")),
            Some(ServeErrorKind::Unauthenticated)
        );
        assert_eq!(
            kind(a.admit(Some("Bearer x"), "dtypes")),
            Some(ServeErrorKind::Unauthenticated)
        );
        assert_eq!(
            kind(a.admit(Some("Bearer b"), "minilm")),
            Some(ServeErrorKind::NotFound)
        );
        assert_eq!(
            a.admit(Some("Bearer b"), "minilm").err().unwrap().1,
            crate::repository::unknown_model("minilm")
        );
        let held = a.admit(Some("Bearer b"), "dtypes").ok().unwrap();
        let e = a.admit(Some("Bearer b"), "dtypes").err().unwrap().1;
        assert_eq!(e.limit, Some("max-in-flight"));
        drop(held);
        assert!(a.admit(Some("Bearer b"), "dtypes").is_ok());
        assert!(a.admit(Some("Bearer s"), "any").is_ok());
        let e = a.admit(Some("Bearer s"), "any").err().unwrap().1;
        assert_eq!(e.limit, Some("max-requests-per-second"));
    }

    #[test]
    fn metrics_need_the_flag() {
        let a = access(
            r#"
[[tenant]]
name = "ops"
tokens = ["o"]
metrics = true
[[tenant]]
name = "bob"
tokens = ["b"]
"#,
        );
        let kind = |r: ServeResult<()>| r.err().map(|e| e.kind);
        assert_eq!(kind(a.admit_metrics(Some("Bearer o"))), None);
        assert_eq!(
            kind(a.admit_metrics(Some("Bearer b"))),
            Some(ServeErrorKind::Forbidden)
        );
        assert_eq!(
            kind(a.admit_metrics(Some("Bearer x"))),
            Some(ServeErrorKind::Unauthenticated)
        );
        assert_eq!(
            kind(a.admit_metrics(None)),
            Some(ServeErrorKind::Unauthenticated)
        );
        assert_eq!(kind(Access::open().admit_metrics(None)), None);
    }
}
