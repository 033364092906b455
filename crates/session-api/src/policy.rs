//! What a tenant's sessions may hold: the `[tenant.session]` table of the tokens file, and
//! the limits one session gets from it and from what the client asked for.

use std::time::Duration;

use serde::Deserialize;

use tpubox_core::error::{DeviceError, DeviceResult};
use tpubox_core::placement::DeviceRule;
use tpubox_core::tenant::{ProgramPolicy, TenantLimits};

/// `[tenant.session]` of the tokens file: the tenant may open sessions, each with these
/// limits. Absent: the tenant may not (a serving-only token opens nothing).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SessionPolicy {
    /// Sessions of the tenant open at once (default 16).
    #[serde(default = "default_max_sessions")]
    pub max_sessions: u32,
    /// Device memory one session may hold, in MiB (default 8192).
    pub max_device_mib: Option<u64>,
    /// Live tensor handles of one session (default 10 000).
    pub max_live_tensors: Option<u64>,
    /// Live executables of one session (default 1 000).
    pub max_live_executables: Option<u64>,
    /// Largest program, in MiB (default 64).
    pub max_program_mib: Option<u64>,
    /// Compiles in any 60 s, cache hits included (default 600).
    pub max_compiles_per_minute: Option<u32>,
    /// Wall-clock limit of one guest run (`RunComponent`), in seconds (default 300).
    pub max_call_seconds: Option<f64>,
    /// Guest linear memory of one run, in MiB (default 4096).
    pub max_guest_memory_mib: Option<u64>,
    /// A session ends after this long with no call and no attached client, in seconds
    /// (default 3600).
    pub idle_timeout_seconds: Option<f64>,
    /// Launches of one session queued for the device or running at once (default 256).
    pub max_pending_launches: Option<u64>,
    /// Skip the program policy (loops, host transfers, custom calls) for this tenant's
    /// programs (default false).
    #[serde(default)]
    pub trusted: bool,
    /// Most trips of loops XLA cannot bound in one execution of the tenant's programs
    /// (default 1 048 576, [`tpubox_core::tenant::DEFAULT_MAX_LOOP_ITERATIONS`]; 0 refuses
    /// such loops at compile). `max-loop-iterations`.
    pub max_loop_iterations: Option<u64>,
    /// Most work of those trips in one execution, in estimated operations plus bytes written
    /// (default 10^11, [`tpubox_core::tenant::DEFAULT_MAX_LOOP_WORK`]). `max-loop-work`.
    pub max_loop_work: Option<u64>,
    /// Device memory all of the tenant's sessions (and the guests they run) may hold
    /// together, in MiB (default: `max_device_mib`, so that opening more sessions does not
    /// multiply the tenant's memory).
    pub tenant_max_device_mib: Option<u64>,
    /// Executions of all of the tenant's sessions holding one of the device's execution
    /// slots at once (default: one fewer than the device has, at least 1, so that one tenant
    /// cannot hold every slot while another waits).
    pub tenant_max_running_executions: Option<u64>,
    /// The tenant's sessions (and the guests they run) may publish weight versions from
    /// device tensors they hold (default false; [`tpubox_core::weights`]).
    #[serde(default)]
    pub publish_weights: bool,
    /// Device memory of the tenant's live published versions, all its sessions together and
    /// outliving them, in MiB (default: `max_device_mib`'s value). Only with `publish_weights`.
    pub max_published_mib: Option<u64>,
    /// Live published versions of the tenant (default 8). Only with `publish_weights`.
    pub max_published_versions: Option<u64>,
    /// Which of the host's devices the tenant's sessions may use: a list of device indices
    /// (`devices = [1, 2]`) or a count the daemon picks when it reads the tokens file
    /// (`devices = 2`: those given to the fewest tenants). Default: every device no other
    /// tenant holds alone ([`tpubox_core::placement`]).
    pub devices: Option<DevicesField>,
    /// The tenant holds its devices alone: no other tenant's session or model is placed on
    /// them (default false).
    #[serde(default)]
    pub exclusive_devices: bool,
    /// Device memory one session may hold on any one device, in MiB (default: no limit
    /// besides `max_device_mib`). `max-device-bytes-per-device`.
    pub max_per_device_mib: Option<u64>,
    /// Device memory all of the tenant's sessions may hold together on any one device, in
    /// MiB (default: `max_per_device_mib`'s value).
    pub tenant_max_per_device_mib: Option<u64>,
}

/// `devices` of `[tenant.session]` (and of a model's `[tpubox.limits]`): a count or a list.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum DevicesField {
    /// This many devices, picked by the daemon.
    Count(u32),
    /// These device indices.
    List(Vec<u32>),
}

impl DevicesField {
    /// The core's rule for it.
    pub fn rule(&self) -> DeviceRule {
        match self {
            DevicesField::Count(n) => DeviceRule::Count(*n),
            DevicesField::List(l) => DeviceRule::List(l.clone()),
        }
    }
}

fn default_max_sessions() -> u32 {
    16
}

impl Default for SessionPolicy {
    fn default() -> Self {
        SessionPolicy {
            max_sessions: default_max_sessions(),
            max_device_mib: None,
            max_live_tensors: None,
            max_live_executables: None,
            max_program_mib: None,
            max_compiles_per_minute: None,
            max_call_seconds: None,
            max_guest_memory_mib: None,
            idle_timeout_seconds: None,
            max_pending_launches: None,
            trusted: false,
            max_loop_iterations: None,
            max_loop_work: None,
            tenant_max_device_mib: None,
            tenant_max_running_executions: None,
            publish_weights: false,
            max_published_mib: None,
            max_published_versions: None,
            devices: None,
            exclusive_devices: false,
            max_per_device_mib: None,
            tenant_max_per_device_mib: None,
        }
    }
}

/// Default idle timeout of a session.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

/// The limits of one session: the tenant's [`TenantLimits`] and its idle timeout.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionLimits {
    /// What the session's accounting tenant may hold and do.
    pub tenant: TenantLimits,
    /// How long the session may go without a call while no client is attached.
    pub idle_timeout: Duration,
}

/// What a client may ask for at open: `None` (or 0 on the wire) keeps the tenant's value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestedLimits {
    /// Device bytes.
    pub max_device_bytes: Option<u64>,
    /// Live tensors.
    pub max_live_tensors: Option<u64>,
    /// Live executables.
    pub max_live_executables: Option<u64>,
    /// Program bytes.
    pub max_program_bytes: Option<u64>,
    /// Compiles per minute.
    pub max_compiles_per_minute: Option<u32>,
    /// One guest run, seconds.
    pub max_call_seconds: Option<f64>,
    /// Guest memory bytes.
    pub max_guest_memory_bytes: Option<u64>,
    /// Idle timeout, seconds.
    pub idle_timeout_seconds: Option<f64>,
    /// Pending launches.
    pub max_pending_launches: Option<u64>,
}

impl SessionPolicy {
    /// The tenant's placement rule ([`tpubox_core::placement::plan`] resolves it).
    pub fn device_rule(&self) -> DeviceRule {
        self.devices
            .as_ref()
            .map_or(DeviceRule::All, DevicesField::rule)
    }
}

fn mib(m: u64) -> u64 {
    m.saturating_mul(1 << 20)
}

fn seconds(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.001, 1e9))
}

impl SessionPolicy {
    /// The limits the tenant's sessions get: [`TenantLimits::default`] with this table's
    /// values.
    pub fn limits(&self) -> SessionLimits {
        let mut t = TenantLimits::default();
        if let Some(m) = self.max_device_mib {
            t.max_device_bytes = mib(m);
        }
        if let Some(m) = self.max_per_device_mib {
            t.max_device_bytes_per_device = mib(m);
        }
        if let Some(n) = self.max_live_tensors {
            t.max_live_tensors = n;
        }
        if let Some(n) = self.max_live_executables {
            t.max_live_executables = n;
        }
        if let Some(m) = self.max_program_mib {
            t.max_program_bytes = usize::try_from(mib(m)).unwrap_or(usize::MAX);
        }
        if let Some(n) = self.max_compiles_per_minute {
            t.max_compiles_per_minute = n;
        }
        if let Some(s) = self.max_call_seconds {
            t.max_call_time = Some(seconds(s));
        }
        if let Some(m) = self.max_guest_memory_mib {
            t.max_guest_memory = usize::try_from(mib(m)).unwrap_or(usize::MAX);
        }
        if let Some(n) = self.max_pending_launches {
            t.max_pending_launches = n;
        }
        t.program_policy = ProgramPolicy {
            trusted: self.trusted,
            ..ProgramPolicy::default()
        };
        if let Some(n) = self.max_loop_iterations {
            t.program_policy.max_loop_iterations = n;
        }
        if let Some(n) = self.max_loop_work {
            t.program_policy.max_loop_work = n;
        }
        t.max_published_bytes = match (self.publish_weights, self.max_published_mib) {
            (false, _) => 0,
            (true, None) => t.max_device_bytes,
            (true, Some(m)) => mib(m),
        };
        if let Some(n) = self.max_published_versions {
            t.max_published_versions = n;
        }
        SessionLimits {
            tenant: t,
            idle_timeout: self
                .idle_timeout_seconds
                .map_or(DEFAULT_IDLE_TIMEOUT, seconds),
        }
    }

    /// The limits of the tenant's budget (all its sessions together, [`Tenant::new_budget`](tpubox_core::tenant::Tenant::new_budget))
    /// on a device with `slots` execution slots: `tenant_max_device_mib` (default
    /// `max_device_mib`'s value) and `tenant_max_running_executions` (default `slots - 1`, at
    /// least 1); the other limits stay per session.
    pub fn budget_limits(&self, slots: usize) -> TenantLimits {
        let mut t = TenantLimits {
            max_device_bytes: SessionPolicy::limits(self).tenant.max_device_bytes,
            max_running_executions: (slots as u64).saturating_sub(1).max(1),
            ..TenantLimits::default()
        };
        if let Some(m) = self.tenant_max_device_mib {
            t.max_device_bytes = mib(m);
        }
        if let Some(m) = self.tenant_max_per_device_mib.or(self.max_per_device_mib) {
            t.max_device_bytes_per_device = mib(m);
        }
        if let Some(n) = self.tenant_max_running_executions {
            t.max_running_executions = n.max(1);
        }
        t
    }

    /// Checks the table's values (the tokens file is refused at start-up otherwise).
    ///
    /// Errors: a message naming the field: `max_sessions` 0, a time that is not positive and
    /// finite.
    pub fn check(&self) -> Result<(), String> {
        if self.max_sessions == 0 {
            return Err(
                "max_sessions must be at least 1 (drop [tenant.session] to forbid sessions)".into(),
            );
        }
        for (name, v) in [
            ("max_call_seconds", self.max_call_seconds),
            ("idle_timeout_seconds", self.idle_timeout_seconds),
        ] {
            if v.is_some_and(|s| !(s.is_finite() && s > 0.0)) {
                return Err(format!("{name} must be a positive number of seconds"));
            }
        }
        if !self.publish_weights
            && (self.max_published_mib.is_some() || self.max_published_versions.is_some())
        {
            return Err(
                "max_published_mib and max_published_versions need publish_weights = true".into(),
            );
        }
        if self.publish_weights && self.max_published_mib == Some(0) {
            return Err(
                "max_published_mib must be at least 1 (set publish_weights = false to forbid publishing)"
                    .into(),
            );
        }
        match &self.devices {
            Some(DevicesField::Count(0)) => return Err("devices = 0 leaves no device".into()),
            Some(DevicesField::List(l)) if l.is_empty() => {
                return Err("devices = [] leaves no device".into());
            }
            _ => {}
        }
        if self.max_per_device_mib == Some(0) || self.tenant_max_per_device_mib == Some(0) {
            return Err("max_per_device_mib must be at least 1".into());
        }
        if self.tenant_max_running_executions == Some(0) {
            return Err("tenant_max_running_executions must be at least 1".into());
        }
        Ok(())
    }
}

impl SessionLimits {
    /// These limits narrowed by what the client asked for.
    ///
    /// Errors: `invalid-argument` naming the limit when a request is above the tenant's
    /// value, or a time is not positive and finite.
    pub fn narrowed(&self, r: &RequestedLimits) -> DeviceResult<SessionLimits> {
        fn narrow<T: PartialOrd + Copy + std::fmt::Display>(
            name: &str,
            have: T,
            want: Option<T>,
        ) -> DeviceResult<T> {
            match want {
                None => Ok(have),
                Some(w) if w <= have => Ok(w),
                Some(w) => Err(DeviceError::invalid(format!(
                    "the requested {name} ({w}) is above the tenant's ({have}); a session may only narrow its tenant's limits"
                ))),
            }
        }
        fn time(name: &str, v: Option<f64>) -> DeviceResult<Option<f64>> {
            match v {
                Some(s) if !(s.is_finite() && s > 0.0) => Err(DeviceError::invalid(format!(
                    "the requested {name} must be a positive number of seconds"
                ))),
                v => Ok(v),
            }
        }
        let mut out = self.clone();
        let t = &mut out.tenant;
        t.max_device_bytes = narrow("max-device-bytes", t.max_device_bytes, r.max_device_bytes)?;
        t.max_live_tensors = narrow("max-live-tensors", t.max_live_tensors, r.max_live_tensors)?;
        t.max_live_executables = narrow(
            "max-live-executables",
            t.max_live_executables,
            r.max_live_executables,
        )?;
        t.max_program_bytes = narrow(
            "max-program-bytes",
            t.max_program_bytes as u64,
            r.max_program_bytes,
        )? as usize;
        t.max_compiles_per_minute = narrow(
            "max-compiles-per-minute",
            t.max_compiles_per_minute,
            r.max_compiles_per_minute,
        )?;
        t.max_guest_memory = narrow(
            "max-guest-memory",
            t.max_guest_memory as u64,
            r.max_guest_memory_bytes,
        )? as usize;
        t.max_pending_launches = narrow(
            "max-pending-launches",
            t.max_pending_launches,
            r.max_pending_launches,
        )?;
        if let Some(s) = time("max-call-seconds", r.max_call_seconds)? {
            let have = t.max_call_time.map_or(f64::INFINITY, |d| d.as_secs_f64());
            t.max_call_time = Some(seconds(narrow("max-call-seconds", have, Some(s))?));
        }
        if let Some(s) = time("idle-timeout-seconds", r.idle_timeout_seconds)? {
            let have = out.idle_timeout.as_secs_f64();
            out.idle_timeout = seconds(narrow("idle-timeout-seconds", have, Some(s))?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpubox_core::error::ErrorKind;

    #[test]
    fn table_values_and_narrowing() {
        let p: SessionPolicy = toml::from_str(
            "max_sessions = 2\nmax_device_mib = 64\nidle_timeout_seconds = 10\ntrusted = true",
        )
        .unwrap();
        assert!(p.check().is_ok());
        let l = p.limits();
        assert_eq!(l.tenant.max_device_bytes, 64 << 20);
        assert_eq!(l.idle_timeout, Duration::from_secs(10));
        assert!(l.tenant.program_policy.trusted);
        let n = l
            .narrowed(&RequestedLimits {
                max_device_bytes: Some(1 << 20),
                idle_timeout_seconds: Some(5.0),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(n.tenant.max_device_bytes, 1 << 20);
        assert_eq!(n.idle_timeout, Duration::from_secs(5));
        let e = l
            .narrowed(&RequestedLimits {
                max_device_bytes: Some(65 << 20),
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.contains("max-device-bytes"), "{}", e.message);
        let e = l
            .narrowed(&RequestedLimits {
                max_call_seconds: Some(f64::NAN),
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(toml::from_str::<SessionPolicy>("max_sesions = 1").is_err());
        let bad: SessionPolicy = toml::from_str("max_sessions = 0").unwrap();
        assert!(bad.check().is_err());
    }
}
