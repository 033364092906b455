//! `tpubox admin`: the operator's calls on a running `tpubox serve` (its metrics port: list
//! sessions, end one, reload the tokens and TLS files), over HTTP or HTTPS with a token of a
//! tenant that has `admin = true` in the tokens file.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde_json::Value;

/// Where the daemon is and how to reach it.
#[derive(Args)]
pub struct AdminArgs {
    /// The daemon's metrics port (which serves the admin calls): `http://HOST:PORT`, or
    /// `https://HOST:PORT` when it serves TLS.
    #[arg(
        long,
        env = "TPUBOX_ADMIN_URL",
        default_value = "http://127.0.0.1:8002"
    )]
    url: String,
    /// A file holding the admin token (a token of a tenant with `admin = true`); the
    /// environment variable TPUBOX_ADMIN_TOKEN works too. Not needed when the daemon runs
    /// without --tokens. (Not a flag's value: command lines are readable by every user.)
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// The CA certificate(s), PEM, that signed the daemon's certificate (HTTPS): only these
    /// are trusted.
    #[arg(long, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// A client certificate chain, PEM, for a daemon that asks for one (with --key).
    #[arg(long, value_name = "FILE", requires = "key")]
    cert: Option<PathBuf>,
    /// The client certificate's private key, PEM.
    #[arg(long, value_name = "FILE", requires = "cert")]
    key: Option<PathBuf>,
    #[command(subcommand)]
    action: AdminAction,
}

#[derive(Subcommand)]
enum AdminAction {
    /// Lists the live sessions: id, tenant, label, device bytes, device-seconds, executions,
    /// age and idle time.
    Sessions {
        /// Print the daemon's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Ends a session (its tensors and executables are freed; its client's next call fails
    /// with session-ended).
    End {
        /// The session's id (`s-` and 16 hex digits, as `tpubox admin sessions` lists it).
        id: String,
    },
    /// Reads the tokens file and the TLS files again (as SIGHUP does): new tenants may
    /// connect at once, removed tenants' sessions end; a bad file changes nothing.
    Reload,
}

/// Runs one admin call; prints its result. Returns false when the daemon refused it.
///
/// Errors: unreadable files, an unreachable daemon.
pub async fn run(args: AdminArgs) -> Result<bool> {
    // reqwest is built without a crypto provider of its own (see the workspace manifest):
    // give the process ring's, unless one was installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let token = match (&args.token_file, std::env::var("TPUBOX_ADMIN_TOKEN")) {
        (Some(f), _) => Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("reading the token file {}", f.display()))?
                .trim()
                .to_string(),
        ),
        (None, Ok(t)) if !t.trim().is_empty() => Some(t.trim().to_string()),
        _ => None,
    };
    let mut client = reqwest::Client::builder().timeout(std::time::Duration::from_secs(30));
    if let Some(ca) = &args.ca {
        let pem = std::fs::read(ca).with_context(|| format!("reading --ca {}", ca.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("--ca {}: not PEM certificates", ca.display()))?;
        client = client.tls_certs_only(certs);
    }
    if let (Some(cert), Some(key)) = (&args.cert, &args.key) {
        let mut pem =
            std::fs::read(cert).with_context(|| format!("reading --cert {}", cert.display()))?;
        pem.push(b'\n');
        pem.extend(std::fs::read(key).with_context(|| format!("reading --key {}", key.display()))?);
        client = client.identity(
            reqwest::Identity::from_pem(&pem)
                .context("--cert/--key: not a PEM certificate chain and private key")?,
        );
    }
    let client = client.build().context("making the HTTP client")?;
    let base = args.url.trim_end_matches('/');
    let req = match &args.action {
        AdminAction::Sessions { .. } => client.get(format!("{base}/v2/admin/sessions")),
        AdminAction::End { id } => client.delete(format!("{base}/v2/admin/sessions/{id}")),
        AdminAction::Reload => client.post(format!("{base}/v2/admin/reload")),
    };
    let req = match &token {
        Some(t) => req.bearer_auth(t),
        None => req,
    };
    let resp = req
        .send()
        .await
        .with_context(|| format!("calling the tpubox daemon at {base}"))?;
    let status = resp.status();
    let body: Value = resp
        .json()
        .await
        .with_context(|| format!("reading the daemon's answer ({status})"))?;
    if !status.is_success() {
        let msg = body
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("(no message)");
        eprintln!("tpubox admin: {status}: {msg}");
        return Ok(false);
    }
    match args.action {
        AdminAction::Sessions { json: true } | AdminAction::Reload => {
            println!("{}", serde_json::to_string_pretty(&body)?);
        }
        AdminAction::Sessions { json: false } => print_sessions(&body)?,
        AdminAction::End { id } => println!("ended {id}"),
    }
    Ok(true)
}

fn print_sessions(body: &Value) -> Result<()> {
    let Some(rows) = body.get("sessions").and_then(Value::as_array) else {
        bail!("the daemon's answer has no `sessions` list: {body}");
    };
    let s = |r: &Value, k: &str| r.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let n = |r: &Value, k: &str| r.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    println!(
        "{:<20} {:<16} {:<24} {:<10} {:>12} {:>10} {:>10} {:>9} {:>9}",
        "ID",
        "TENANT",
        "LABEL",
        "DEVICES",
        "DEVICE-MiB",
        "DEVICE-S",
        "EXECUTIONS",
        "AGE-S",
        "IDLE-S"
    );
    for r in rows {
        let mut label = s(r, "label");
        if label.chars().count() > 24 {
            label = label.chars().take(23).collect::<String>() + "…";
        }
        // The session's devices (its default first), `*` when it holds them alone.
        let mut devices = r
            .get("devices")
            .and_then(Value::as_array)
            .map(|d| {
                d.iter()
                    .filter_map(Value::as_u64)
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        if r.get("exclusive_devices").and_then(Value::as_bool) == Some(true) {
            devices.push('*');
        }
        println!(
            "{:<20} {:<16} {:<24} {:<10} {:>12.1} {:>10.3} {:>10} {:>9.0} {:>9.0}",
            s(r, "id"),
            s(r, "tenant"),
            label,
            devices,
            n(r, "device_bytes") / (1u64 << 20) as f64,
            n(r, "device_seconds"),
            n(r, "executions") as u64,
            n(r, "age_seconds"),
            n(r, "idle_seconds"),
        );
    }
    if rows.is_empty() {
        println!("(no live sessions)");
    }
    Ok(())
}
