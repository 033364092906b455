//! Placement: which of the host's devices each tenant may use, and which devices each session
//! holds.
//!
//! A host has one PJRT client with every device of the plugin (a TPU VM's 4 or 8 chips, an
//! Ironwood chip's two devices, the CPU plugin's `cpu_device_count`). Placement works in two
//! steps:
//!
//! 1. **Tenants** ([`plan`]): each tenant's rule ([`DeviceRule`]: every device, a list, or a
//!    count the host picks) becomes a list of device indices when the host reads its tenants.
//!    A tenant whose devices are `exclusive` holds them alone: no other tenant is planned on
//!    them (another tenant's `All` leaves them out, its count never picks them, and a list
//!    naming one is refused when the tenants are read).
//! 2. **Sessions** ([`DeviceLeases::place`]): a session asks for a count of its tenant's
//!    devices, or names them, and whether it holds them alone ([`PlacementRequest`]). It gets a
//!    [`Placement`]: its devices in order, the first its default (a tensor, compile or weight
//!    that names no device lands there). Counts pick the devices with the fewest sessions. A
//!    session that holds its devices alone keeps every other session off them until it ends
//!    (the lease is returned when the `Placement` drops), which is how one Ray task gets a
//!    device of its own.
//!
//! Every refusal names the device and the rule: `not-found` for a device the host does not
//! have, `permission-denied` for one the tenant may not use or another tenant's session holds
//! alone, `resource-exhausted` naming `devices` when the tenant's devices cannot satisfy the
//! request now (more asked for than it may use, or too few free), `invalid-argument` for a
//! malformed request. The rule is the host's; nothing here knows what the devices are.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use crate::error::{DeviceError, DeviceResult, ErrorKind};

/// Which devices a tenant may use, as its configuration says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceRule {
    /// Every device of the host that no other tenant holds alone (the default).
    #[default]
    All,
    /// These device indices.
    List(Vec<u32>),
    /// This many devices, picked by the host: those the fewest tenants were given so far.
    Count(u32),
}

/// One tenant's rule, as given to [`plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantRule {
    /// The tenant's name.
    pub tenant: String,
    /// Which devices it may use.
    pub rule: DeviceRule,
    /// Whether it holds them alone (no other tenant is planned on them).
    pub exclusive: bool,
}

/// A tenant's devices after [`plan`]: ascending device indices, never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantDevices {
    /// The device indices the tenant's sessions and models may use, ascending.
    pub devices: Vec<u32>,
    /// Whether no other tenant may use them.
    pub exclusive: bool,
}

impl TenantDevices {
    /// Every device of a host with `device_count` devices, shared.
    pub fn all(device_count: u32) -> Self {
        TenantDevices {
            devices: (0..device_count.max(1)).collect(),
            exclusive: false,
        }
    }
}

fn unknown_device(device: u32, device_count: u32) -> DeviceError {
    DeviceError::new(
        ErrorKind::NotFound,
        format!(
            "device {device} does not exist (this host has {device_count} device(s), indices 0 to {})",
            device_count.saturating_sub(1)
        ),
    )
}

/// Resolves every tenant's [`DeviceRule`] on a host of `device_count` devices. Exclusive lists
/// are placed first, then shared lists, then counts (exclusive ones first; each picks the
/// devices given to the fewest tenants so far, lowest index on ties), then `All`.
///
/// Errors: `not-found` for a listed device the host does not have; `invalid-argument` for an
/// empty list, a count of 0, a device listed twice, a device two tenants would both hold alone,
/// a shared tenant's list naming a device another tenant holds alone, or a count (or `All`)
/// that finds no device left; the message names the tenant.
pub fn plan(
    rules: &[TenantRule],
    device_count: u32,
) -> DeviceResult<BTreeMap<String, TenantDevices>> {
    let bad = |tenant: &str, why: String| {
        DeviceError::invalid(format!("tenant `{tenant}`: devices: {why}"))
    };
    // Which tenant holds each device alone, and how many tenants were given each.
    let mut owner: BTreeMap<u32, String> = BTreeMap::new();
    let mut given = vec![0u32; device_count as usize];
    let mut out = BTreeMap::new();
    let mut order: Vec<&TenantRule> = rules.iter().collect();
    let rank = |r: &TenantRule| match (&r.rule, r.exclusive) {
        (DeviceRule::List(_), true) => 0,
        (DeviceRule::List(_), false) => 1,
        (DeviceRule::Count(_), true) => 2,
        (DeviceRule::Count(_), false) => 3,
        (DeviceRule::All, _) => 4,
    };
    order.sort_by_key(|r| rank(r));
    for r in order {
        let free =
            |d: u32, owner: &BTreeMap<u32, String>| owner.get(&d).is_none_or(|o| *o == r.tenant);
        let devices: Vec<u32> = match &r.rule {
            DeviceRule::List(list) => {
                if list.is_empty() {
                    return Err(bad(&r.tenant, "an empty list".into()));
                }
                let mut seen = BTreeSet::new();
                for &d in list {
                    if d >= device_count {
                        let e = unknown_device(d, device_count);
                        return Err(DeviceError::new(
                            e.kind,
                            format!("tenant `{}`: devices: {}", r.tenant, e.message),
                        ));
                    }
                    if !seen.insert(d) {
                        return Err(bad(&r.tenant, format!("device {d} is listed twice")));
                    }
                    if !free(d, &owner) {
                        return Err(bad(
                            &r.tenant,
                            format!("device {d} is held alone by tenant `{}`", owner[&d]),
                        ));
                    }
                }
                seen.into_iter().collect()
            }
            DeviceRule::Count(n) => {
                if *n == 0 {
                    return Err(bad(&r.tenant, "a count of 0".into()));
                }
                let mut candidates: Vec<u32> = (0..device_count)
                    .filter(|&d| free(d, &owner) && !(r.exclusive && given[d as usize] > 0))
                    .collect();
                if (candidates.len() as u32) < *n {
                    return Err(bad(
                        &r.tenant,
                        format!(
                            "asks for {n} device(s), and only {} of the host's {device_count} are left for it",
                            candidates.len()
                        ),
                    ));
                }
                candidates.sort_by_key(|&d| (given[d as usize], d));
                candidates.truncate(*n as usize);
                candidates.sort_unstable();
                candidates
            }
            DeviceRule::All => {
                let left: Vec<u32> = (0..device_count).filter(|&d| free(d, &owner)).collect();
                if left.is_empty() {
                    return Err(bad(
                        &r.tenant,
                        "every device of the host is held alone by other tenants".into(),
                    ));
                }
                left
            }
        };
        for &d in &devices {
            if r.exclusive {
                if let Some(o) = owner.get(&d).filter(|o| **o != r.tenant) {
                    return Err(bad(
                        &r.tenant,
                        format!("device {d} is held alone by tenant `{o}`"),
                    ));
                }
                owner.insert(d, r.tenant.clone());
            }
            given[d as usize] += 1;
        }
        out.insert(
            r.tenant.clone(),
            TenantDevices {
                devices,
                exclusive: r.exclusive,
            },
        );
    }
    Ok(out)
}

/// What a session asks for when it opens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlacementRequest {
    /// How many of its tenant's devices (`None`: every one, unless `devices` names them). The
    /// host picks those with the fewest sessions.
    pub count: Option<u32>,
    /// These device indices, in this order (the first is the session's default). Empty: let
    /// `count` decide.
    pub devices: Vec<u32>,
    /// Hold the devices alone: no other session is placed on them while this one lives, and
    /// they must have no session now.
    pub exclusive: bool,
}

#[derive(Debug, Default, Clone)]
struct DeviceState {
    /// Sessions placed on the device now.
    sessions: u32,
    /// The tenant whose session holds the device alone, if one does.
    held_by: Option<String>,
}

/// Sessions placed on each device of the host, and which devices a session holds alone.
/// One per device service; shared (`Arc`).
#[derive(Debug)]
pub struct DeviceLeases {
    state: Mutex<Vec<DeviceState>>,
}

/// How many sessions each device has now, and who holds it alone
/// ([`DeviceLeases::snapshot`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceOccupancy {
    /// Device index.
    pub device: u32,
    /// Sessions placed on it.
    pub sessions: u32,
    /// The tenant whose session holds it alone.
    pub held_by: Option<String>,
}

impl DeviceLeases {
    /// The leases of a host with `device_count` devices, none placed.
    pub fn new(device_count: u32) -> Arc<Self> {
        Arc::new(DeviceLeases {
            state: Mutex::new(vec![DeviceState::default(); device_count.max(1) as usize]),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<DeviceState>> {
        // The state is plain counters, consistent after any panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Each device's sessions and exclusive holder, by index.
    pub fn snapshot(&self) -> Vec<DeviceOccupancy> {
        self.lock()
            .iter()
            .enumerate()
            .map(|(i, s)| DeviceOccupancy {
                device: i as u32,
                sessions: s.sessions,
                held_by: s.held_by.clone(),
            })
            .collect()
    }

    /// Places a session of `tenant`, which may use `allowed`, as `req` asks; see the module
    /// docs. The returned placement holds its lease until dropped.
    ///
    /// Errors: `invalid-argument` for a count of 0, both a count and a list that disagree, or
    /// a device named twice; `not-found` for a device the host does not have;
    /// `permission-denied` for a device the tenant may not use or that another tenant's
    /// session holds alone; `resource-exhausted` naming `devices` for more devices than the
    /// tenant may use, a device another session of the tenant holds alone, or too few free
    /// devices for the count (or, holding alone, a named device with other sessions).
    pub fn place(
        self: &Arc<Self>,
        tenant: &str,
        allowed: &TenantDevices,
        req: &PlacementRequest,
    ) -> DeviceResult<Placement> {
        let mut st = self.lock();
        let device_count = st.len() as u32;
        let refuse = |message: String| {
            DeviceError::new(
                ErrorKind::ResourceExhausted,
                format!("tenant `{tenant}`: {message} (limit devices)"),
            )
        };
        if req.count == Some(0) {
            return Err(DeviceError::invalid("a session needs at least one device"));
        }
        if !req.devices.is_empty()
            && let Some(n) = req.count.filter(|&n| n as usize != req.devices.len())
        {
            return Err(DeviceError::invalid(format!(
                "asks for {n} device(s) and names {}",
                req.devices.len()
            )));
        }
        let may_use = allowed.devices.len() as u32;
        let chosen: Vec<u32> = if !req.devices.is_empty() {
            let mut seen = BTreeSet::new();
            for &d in &req.devices {
                if d >= device_count {
                    return Err(unknown_device(d, device_count));
                }
                if !seen.insert(d) {
                    return Err(DeviceError::invalid(format!("device {d} is named twice")));
                }
                if !allowed.devices.contains(&d) {
                    return Err(DeviceError::new(
                        ErrorKind::PermissionDenied,
                        format!(
                            "tenant `{tenant}` may not use device {d}; its devices are {:?} (rule devices)",
                            allowed.devices
                        ),
                    ));
                }
                let s = &st[d as usize];
                match &s.held_by {
                    Some(o) if o != tenant => {
                        return Err(DeviceError::new(
                            ErrorKind::PermissionDenied,
                            format!(
                                "device {d} is held alone by a session of another tenant (rule devices)"
                            ),
                        ));
                    }
                    Some(_) => {
                        return Err(refuse(format!(
                            "device {d} is held alone by another of its sessions"
                        )));
                    }
                    None if req.exclusive && s.sessions > 0 => {
                        return Err(refuse(format!(
                            "device {d} has {} other session(s), and a session that holds its devices alone needs devices nobody uses",
                            s.sessions
                        )));
                    }
                    None => {}
                }
            }
            req.devices.clone()
        } else {
            let want = req.count.unwrap_or(may_use);
            if want > device_count {
                return Err(DeviceError::invalid(format!(
                    "asks for {want} devices; the host has {device_count}"
                )));
            }
            if want > may_use {
                return Err(refuse(format!(
                    "asks for {want} devices, and may use {may_use}: {:?}",
                    allowed.devices
                )));
            }
            let mut free: Vec<u32> = allowed
                .devices
                .iter()
                .copied()
                .filter(|&d| {
                    let s = &st[d as usize];
                    s.held_by.is_none() && !(req.exclusive && s.sessions > 0)
                })
                .collect();
            if (free.len() as u32) < want {
                let how = if req.exclusive {
                    "free of other sessions"
                } else {
                    "not held alone by another session"
                };
                return Err(refuse(format!(
                    "asks for {want} of its devices {:?}, and {} of them are {how} now",
                    allowed.devices,
                    free.len()
                )));
            }
            if req.count.is_some() {
                free.sort_by_key(|&d| (st[d as usize].sessions, d));
                free.truncate(want as usize);
                free.sort_unstable();
            }
            free
        };
        for &d in &chosen {
            let s = &mut st[d as usize];
            s.sessions += 1;
            if req.exclusive {
                s.held_by = Some(tenant.to_string());
            }
        }
        Ok(Placement {
            devices: chosen,
            exclusive: req.exclusive,
            leases: Some(Arc::clone(self)),
        })
    }
}

/// The devices a session holds, in its order (the first is its default), and its lease on
/// them ([`DeviceLeases::place`]), returned when dropped.
#[derive(Debug)]
pub struct Placement {
    devices: Vec<u32>,
    exclusive: bool,
    leases: Option<Arc<DeviceLeases>>,
}

impl Placement {
    /// Every device of a host with `device_count` devices, shared, default device 0, with no
    /// lease: what a session has unless placed (`tpubox run`, `tpubox exec`, embedders).
    pub fn all(device_count: u32) -> Self {
        Placement {
            devices: (0..device_count.max(1)).collect(),
            exclusive: false,
            leases: None,
        }
    }

    /// These devices, in this order, with no lease (a model instance placed by its
    /// configuration). Empty lists are given device 0.
    pub fn fixed(devices: Vec<u32>) -> Self {
        Placement {
            devices: if devices.is_empty() { vec![0] } else { devices },
            exclusive: false,
            leases: None,
        }
    }

    /// The session's devices, its default first.
    pub fn devices(&self) -> &[u32] {
        &self.devices
    }

    /// The device used when a call names none.
    pub fn default_device(&self) -> u32 {
        self.devices[0]
    }

    /// Whether the session holds its devices alone.
    pub fn exclusive(&self) -> bool {
        self.exclusive
    }

    /// `device`, or the default when `None`, if the session may use it.
    ///
    /// Errors: `permission-denied` naming the device and the session's devices.
    pub fn resolve(&self, device: Option<u32>) -> DeviceResult<u32> {
        let d = device.unwrap_or(self.devices[0]);
        if self.devices.contains(&d) {
            Ok(d)
        } else {
            Err(DeviceError::new(
                ErrorKind::PermissionDenied,
                format!(
                    "device {d} is not one of this session's devices {:?} (rule devices)",
                    self.devices
                ),
            ))
        }
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        if let Some(leases) = &self.leases {
            let mut st = leases.lock();
            for &d in &self.devices {
                if let Some(s) = st.get_mut(d as usize) {
                    s.sessions = s.sessions.saturating_sub(1);
                    if self.exclusive {
                        s.held_by = None;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(t: &str, rule: DeviceRule, exclusive: bool) -> TenantRule {
        TenantRule {
            tenant: t.into(),
            rule,
            exclusive,
        }
    }

    #[test]
    fn plans_lists_counts_and_all_around_exclusive_tenants() {
        let p = plan(
            &[
                rule("shared", DeviceRule::All, false),
                rule("a", DeviceRule::List(vec![1]), true),
                rule("b", DeviceRule::Count(2), true),
                rule("c", DeviceRule::Count(1), false),
            ],
            4,
        )
        .unwrap();
        assert_eq!(p["a"].devices, vec![1]);
        assert_eq!(p["b"].devices, vec![0, 2]);
        assert_eq!(p["c"].devices, vec![3]);
        assert_eq!(p["shared"].devices, vec![3]);
        let e = plan(
            &[
                rule("a", DeviceRule::List(vec![1]), true),
                rule("b", DeviceRule::List(vec![1, 2]), false),
            ],
            4,
        )
        .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.contains("held alone by tenant `a`"), "{e}");
        let e = plan(&[rule("a", DeviceRule::List(vec![4]), false)], 4).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
        let e = plan(&[rule("a", DeviceRule::Count(5), false)], 4).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
    }

    #[test]
    fn sessions_take_free_devices_and_exclusive_leases_come_back() {
        let leases = DeviceLeases::new(4);
        let all = TenantDevices::all(4);
        let one = PlacementRequest {
            count: Some(1),
            exclusive: true,
            ..Default::default()
        };
        let held: Vec<Placement> = (0..4)
            .map(|_| leases.place("ray", &all, &one).unwrap())
            .collect();
        let mut got: Vec<u32> = held.iter().map(|p| p.default_device()).collect();
        got.sort_unstable();
        assert_eq!(got, vec![0, 1, 2, 3]);
        let e = leases.place("ray", &all, &one).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ResourceExhausted);
        assert!(e.message.contains("(limit devices)"), "{e}");
        // Another tenant naming a held device: permission-denied.
        let named = PlacementRequest {
            devices: vec![2],
            ..Default::default()
        };
        let e = leases.place("other", &all, &named).unwrap_err();
        assert_eq!(e.kind, ErrorKind::PermissionDenied);
        drop(held);
        assert!(
            leases
                .snapshot()
                .iter()
                .all(|d| d.sessions == 0 && d.held_by.is_none())
        );
        let p = leases.place("other", &all, &named).unwrap();
        assert_eq!(p.devices(), &[2]);
        assert_eq!(p.resolve(None).unwrap(), 2);
        assert_eq!(
            p.resolve(Some(1)).unwrap_err().kind,
            ErrorKind::PermissionDenied
        );
        // Holding alone a device with a session on it.
        let e = leases
            .place(
                "ray",
                &all,
                &PlacementRequest {
                    devices: vec![2],
                    exclusive: true,
                    ..Default::default()
                },
            )
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::ResourceExhausted);
        // Outside the tenant's devices, or more than exist.
        let mine = TenantDevices {
            devices: vec![0, 1],
            exclusive: false,
        };
        let e = leases.place("t", &mine, &named).unwrap_err();
        assert_eq!(e.kind, ErrorKind::PermissionDenied);
        let three = PlacementRequest {
            count: Some(3),
            ..Default::default()
        };
        assert_eq!(
            leases.place("t", &mine, &three).unwrap_err().kind,
            ErrorKind::ResourceExhausted
        );
        let e = leases
            .place(
                "t",
                &mine,
                &PlacementRequest {
                    devices: vec![9],
                    ..Default::default()
                },
            )
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
        // Counts spread over the least-used devices.
        let spread = leases
            .place(
                "t",
                &all,
                &PlacementRequest {
                    count: Some(2),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(spread.devices(), &[0, 1]);
    }
}
