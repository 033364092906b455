//! The operator's view of a running daemon: every live session with its tenant and usage,
//! ending one, and reading the tokens file (and the TLS files) again. Callers are tenants
//! with `admin = true` in the tokens file ([`crate::access::Access::admit_admin`]); the REST
//! translation is in [`crate::rest`] (on the metrics port: `GET /v2/admin/sessions`,
//! `DELETE /v2/admin/sessions/{id}`, `POST /v2/admin/reload`), the command line is
//! `tpubox admin`. SIGHUP does what the reload call does.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use tpubox_session_api::registry::LiveSession;

use super::Server;
use super::error::{ServeError, ServeErrorKind, ServeResult};

/// One live session as the admin call lists it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SessionRow {
    /// Its id (`s-` and 16 hex digits).
    pub id: String,
    /// The tenant that opened it.
    pub tenant: String,
    /// What its client called it (a kernel id, a program name), at most 200 characters.
    pub label: String,
    /// Device bytes it holds now.
    pub device_bytes: u64,
    /// Most device bytes it held at once.
    pub peak_device_bytes: u64,
    /// Device time of its executions, in seconds.
    pub device_seconds: f64,
    /// Executions finished.
    pub executions: u64,
    /// Compiles charged to it.
    pub compiles: u64,
    /// Requests of it refused by a limit.
    pub refused: u64,
    /// Live tensor handles.
    pub live_tensors: u64,
    /// Seconds since it was opened.
    pub age_seconds: f64,
    /// Seconds since its last call began or ended.
    pub idle_seconds: f64,
    /// When it was opened, Unix time in seconds.
    pub opened_unix_seconds: f64,
    /// Calls in flight now.
    pub calls_in_flight: u32,
    /// Clients attached (Attach streams; a kernel's provisioner holds one).
    pub attached: u32,
    /// The devices it is placed on, its default first ([`tpubox_core::placement`]).
    pub devices: Vec<u32>,
    /// Whether it holds those devices alone.
    pub exclusive_devices: bool,
}

/// What one reload changed.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ReloadReport {
    /// Tenants the new tokens file adds (they may connect at once).
    pub added: Vec<String>,
    /// Tenants it no longer has (their sessions were ended).
    pub removed: Vec<String>,
    /// Tenants whose entry changed (new sessions and requests get the new values).
    pub changed: Vec<String>,
    /// Sessions ended because their tenant was removed.
    pub sessions_ended: usize,
    /// Whether the tokens file was read again (false: the daemon runs without `--tokens`).
    pub tokens_reloaded: bool,
    /// Whether the TLS files were read again (false: the daemon has no TLS).
    pub tls_reloaded: bool,
}

impl Server {
    /// Every live session of the session API, oldest first.
    pub fn admin_sessions(&self) -> Vec<SessionRow> {
        let now = Instant::now();
        let mut sessions = self.sessions.sessions();
        sessions.sort_by_key(|s| s.opened);
        sessions.iter().map(|s| session_row(s, now)).collect()
    }

    /// Ends the session `id` (its handles are freed; its clients' next call gets
    /// `session-ended` with `reason`). `by` names the admin tenant, for the log.
    ///
    /// Errors: not found for an id no live session has.
    pub fn admin_end_session(&self, id: &str, by: &str) -> ServeResult<SessionRow> {
        let s = self.sessions.by_id(id).ok_or_else(|| no_session(id))?;
        let row = session_row(&s, Instant::now());
        if !self
            .sessions
            .close(&s, &format!("ended by an operator (tenant `{by}`)"))
        {
            return Err(no_session(id));
        }
        Ok(row)
    }

    /// Reads the tokens file again ([`crate::access::Access::reload`]): new tenants may
    /// connect at once, removed tenants' sessions end, changed entries apply to new sessions
    /// and requests. Then the TLS files, if the daemon has TLS. Nothing changes when the
    /// tokens file is wrong; the TLS files are read only when it is right.
    ///
    /// Logs what changed, or why nothing did, naming `by` (`"SIGHUP"`, the admin tenant).
    ///
    /// Errors: bad request naming the file and what is wrong in it; no tokens file.
    pub fn reload(&self, by: &str) -> ServeResult<ReloadReport> {
        let r = self.reload_files();
        match &r {
            Ok(r) => tracing::info!(
                by,
                tokens = r.tokens_reloaded,
                added = ?r.added,
                removed = ?r.removed,
                changed = ?r.changed,
                sessions_ended = r.sessions_ended,
                tls = r.tls_reloaded,
                "reloaded ({by})"
            ),
            Err(e) => tracing::error!(by, "{} ({by})", e.message),
        }
        r
    }

    fn reload_files(&self) -> ServeResult<ReloadReport> {
        if !self.access.has_file() && self.tls.is_none() {
            return Err(ServeError::new(
                ServeErrorKind::BadRequest,
                "nothing to reload: the daemon runs without --tokens and without TLS",
            ));
        }
        let mut report = ReloadReport::default();
        if self.access.has_file() {
            let r = self.access.reload().map_err(|e| {
                ServeError::new(
                    ServeErrorKind::BadRequest,
                    format!("the tokens file was not reloaded, the one in use stays: {e:#}"),
                )
            })?;
            for t in &r.removed {
                report.sessions_ended += self
                    .sessions
                    .close_tenant(t, "its tenant was removed from the tokens file");
            }
            report.added = r.added;
            report.removed = r.removed;
            report.changed = r.changed;
            report.tokens_reloaded = true;
        }
        if let Some(tls) = &self.tls {
            tls.reload().map_err(|e| {
                ServeError::new(
                    ServeErrorKind::BadRequest,
                    format!(
                        "the TLS files were not reloaded, the ones in use stay (the tokens file was: {report:?}): {e:#}"
                    ),
                )
            })?;
            report.tls_reloaded = true;
        }
        Ok(report)
    }
}

/// One session's row, its ages counted to `now`.
fn session_row(s: &LiveSession, now: Instant) -> SessionRow {
    let u = s.tenant().usage();
    let (calls_in_flight, attached, idle) = s.liveness(now);
    SessionRow {
        id: s.id.clone(),
        tenant: s.tenant_name.clone(),
        label: s.label.clone(),
        device_bytes: u.device_bytes,
        peak_device_bytes: u.peak_device_bytes,
        device_seconds: u.device_seconds,
        executions: u.executions,
        compiles: u.compiles,
        refused: u.refused,
        live_tensors: u.live_tensors,
        age_seconds: now.saturating_duration_since(s.opened).as_secs_f64(),
        idle_seconds: idle.as_secs_f64(),
        opened_unix_seconds: s
            .opened_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        calls_in_flight,
        attached,
        devices: s.session().placement().devices().to_vec(),
        exclusive_devices: s.session().placement().exclusive(),
    }
}

fn no_session(id: &str) -> ServeError {
    ServeError::new(
        ServeErrorKind::NotFound,
        format!("no live session has the id `{id}`"),
    )
}

/// Reloads at each SIGHUP ([`Server::reload`]), logging what changed or why nothing did.
pub async fn reload_on_hangup(server: Arc<Server>) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("no SIGHUP handler ({e}): the tokens file cannot be reloaded");
            return;
        }
    };
    while hup.recv().await.is_some() {
        // Logged by `reload`.
        let _ = server.reload("SIGHUP");
    }
}
