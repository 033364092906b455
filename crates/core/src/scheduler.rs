//! Fair sharing of a device's execution slots between tenants.
//!
//! A [`FairShare`] lets a fixed number of executions run on a device at once. When more tenants
//! want the device, the waiting tenant that has used the least device time goes first
//! (start-time fair queueing over measured execution time).
//!
//! **Device time.** PJRT reports only an execution's completion (its event), not when the device
//! started it, and executions submitted together queue inside the plugin. So a finished
//! execution is billed from the later of its submission (when it got its slot) and the
//! previous completion on this device, to its own completion: time it spent queued behind
//! another tenant's execution is billed to that execution, not to both.
//!
//! **Pending launches** ([`crate::session::Session::launch`]) take part like any execution: a
//! session's launches wait in that session's ordered submit queue, which asks for a slot for
//! one launch at a time and submits it once granted. So at most [`FairShare::slots`]
//! executions are submitted to the device at once, whoever launched them, a tenant that
//! launches thousands of programs waits for slots like everyone else (and is stopped at
//! `max-pending-launches` before that), and the tenant with the least device time goes
//! first among those waiting.
//!
//! **Tenants, not sessions.** A tenant with a budget ([`Tenant::with_budget`]: every session
//! of the session API has one, shared by all sessions of its token's tenant) is counted as
//! its budget: fair-share order by the budget's device time, and at most the budget's
//! `max_running_executions` slots held at once by all of them together. A waiter over that cap
//! keeps its place but is passed over until one of its tenant's executions finishes, so a
//! tenant with many clients cannot hold every slot while another tenant waits.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::tenant::Tenant;

/// A tenant as the scheduler counts it: its share identity ([`Tenant::share_identity`]), by
/// address.
fn key(t: &Arc<Tenant>) -> usize {
    Arc::as_ptr(t.share_identity()) as usize
}

/// Whether `identity` (a share identity) may take another slot, holding `held` already.
fn under_cap(identity: &Tenant, held: usize) -> bool {
    (held as u64) < identity.limits().max_running_executions.max(1)
}

#[derive(Debug, Default)]
struct Queue {
    running: usize,
    seq: u64,
    /// When the last execution on this device finished (see the module docs on billing).
    last_completion: Option<Instant>,
    /// Waiters by (device time their share identity used so far in ns, arrival order), with
    /// that identity.
    waiting: BTreeMap<(u64, u64), (tokio::sync::oneshot::Sender<()>, Arc<Tenant>)>,
    /// Slots held now, by share identity ([`key`]); identities holding none are absent.
    held: HashMap<usize, usize>,
}

impl Queue {
    fn held_by(&self, identity: &Arc<Tenant>) -> usize {
        self.held
            .get(&(Arc::as_ptr(identity) as usize))
            .copied()
            .unwrap_or(0)
    }

    /// Takes a slot for `identity` if one is free, nobody eligible waits ahead and the
    /// identity is under its cap.
    fn try_take(&mut self, slots: usize, identity: &Arc<Tenant>) -> bool {
        if self.running >= slots
            || !under_cap(identity, self.held_by(identity))
            || self
                .waiting
                .values()
                .any(|(_, w)| under_cap(w, self.held_by(w)))
        {
            return false;
        }
        self.take(identity);
        true
    }

    fn take(&mut self, identity: &Arc<Tenant>) {
        self.running += 1;
        *self.held.entry(Arc::as_ptr(identity) as usize).or_insert(0) += 1;
    }

    fn give_back(&mut self, identity_key: usize) {
        self.running -= 1;
        if let Some(n) = self.held.get_mut(&identity_key) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&identity_key);
            }
        }
    }
}

/// Fair sharing of one device's execution slots between tenants; see the module docs.
#[derive(Debug)]
pub struct FairShare {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    slots: usize,
    queue: Mutex<Queue>,
}

/// A granted execution slot; finishing it (drop) records the device time (billed as the
/// module docs say) and wakes the next waiter. It owns its share of the scheduler, so it can travel with an execution (for example
/// into the callback that runs when the device is done) independently of whoever asked for it.
#[derive(Debug)]
pub struct Slot {
    share: Arc<Inner>,
    tenant: Arc<Tenant>,
    start: Instant,
}

impl FairShare {
    /// A scheduler that lets `slots` executions run at once (at least 1).
    pub fn new(slots: usize) -> Self {
        FairShare {
            inner: Arc::new(Inner {
                slots: slots.max(1),
                queue: Mutex::new(Queue::default()),
            }),
        }
    }

    /// How many executions may run at once.
    pub fn slots(&self) -> usize {
        self.inner.slots
    }

    /// A slot for `tenant` if one is free and nobody waits for one (the fast path of a launch
    /// that nothing in its session's queue precedes); `None` otherwise.
    pub fn try_acquire(&self, tenant: &Arc<Tenant>) -> Option<Slot> {
        {
            let mut q = self.inner.queue.lock().expect("scheduler lock");
            if !q.try_take(self.inner.slots, tenant.share_identity()) {
                return None;
            }
        }
        tenant.execution_started();
        Some(Slot {
            share: Arc::clone(&self.inner),
            tenant: Arc::clone(tenant),
            start: Instant::now(),
        })
    }

    /// Waits for a slot for `tenant`. Cancel-safe: dropping the future gives up the place.
    pub async fn acquire(&self, tenant: &Arc<Tenant>) -> Slot {
        let rx = {
            let mut q = self.inner.queue.lock().expect("scheduler lock");
            let identity = tenant.share_identity();
            if q.try_take(self.inner.slots, identity) {
                None
            } else {
                let (tx, rx) = tokio::sync::oneshot::channel();
                q.seq += 1;
                let key = (identity.device_ns(), q.seq);
                q.waiting.insert(key, (tx, Arc::clone(identity)));
                Some(WaitGuard {
                    share: &self.inner,
                    key,
                    identity: Arc::as_ptr(identity) as usize,
                    rx,
                    granted: false,
                })
            }
        };
        if let Some(mut guard) = rx {
            // The sender is only dropped after sending (it sits in the map until granted).
            let _ = (&mut guard.rx).await;
            guard.granted = true;
        }
        tenant.execution_started();
        Slot {
            share: Arc::clone(&self.inner),
            tenant: Arc::clone(tenant),
            start: Instant::now(),
        }
    }
}

impl Inner {
    /// Returns a slot of share identity `identity_key` and grants free slots to the waiters
    /// first in line whose identity is under its cap (a capped identity's waiters keep their
    /// place until one of its slots is returned).
    fn release(&self, identity_key: usize) {
        let mut q = self.queue.lock().expect("scheduler lock");
        q.give_back(identity_key);
        while q.running < self.slots {
            let Some(key) = q
                .waiting
                .iter()
                .find(|(_, (_, w))| under_cap(w, q.held_by(w)))
                .map(|(k, _)| *k)
            else {
                break;
            };
            let (tx, identity) = q.waiting.remove(&key).expect("found above");
            if tx.send(()).is_ok() {
                q.take(&identity);
            }
        }
    }
}

/// Removes a cancelled waiter, or passes on a grant it received but can no longer use.
struct WaitGuard<'a> {
    share: &'a Inner,
    key: (u64, u64),
    identity: usize,
    rx: tokio::sync::oneshot::Receiver<()>,
    granted: bool,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        if self.granted {
            return;
        }
        let removed = {
            let mut q = self.share.queue.lock().expect("scheduler lock");
            q.waiting.remove(&self.key).is_some()
        };
        if !removed && self.rx.try_recv().is_ok() {
            // Granted after we were cancelled: hand the slot on.
            self.share.release(self.identity);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let now = Instant::now();
        let from = {
            let mut q = self.share.queue.lock().expect("scheduler lock");
            let from = q.last_completion.map_or(self.start, |l| l.max(self.start));
            q.last_completion = Some(q.last_completion.map_or(now, |l| l.max(now)));
            from
        };
        self.tenant
            .record_execution(now.saturating_duration_since(from));
        self.share.release(key(&self.tenant));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::TenantLimits;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiting_tenant_with_least_device_time_goes_first() {
        let share = Arc::new(FairShare::new(1));
        let heavy = Tenant::new("heavy", TenantLimits::default());
        let light = Tenant::new("light", TenantLimits::default());
        heavy.execution_started();
        heavy.record_execution(Duration::from_secs(10));
        let first = share.acquire(&heavy).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for t in [&heavy, &light] {
            let (share, t, order) = (Arc::clone(&share), Arc::clone(t), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let _slot = share.acquire(&t).await;
                order.lock().unwrap().push(t.name().to_string());
            }));
            // Let the heavy tenant queue first.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec!["light", "heavy"]);
        assert_eq!(light.usage().executions, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_waiter_does_not_leak_the_slot() {
        let share = FairShare::new(1);
        let t = Tenant::new("a", TenantLimits::default());
        let held = share.acquire(&t).await;
        let waiting = tokio::time::timeout(Duration::from_millis(20), share.acquire(&t)).await;
        assert!(waiting.is_err());
        drop(held);
        let _again = tokio::time::timeout(Duration::from_secs(5), share.acquire(&t))
            .await
            .expect("slot is free again");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_tenants_sessions_together_stay_under_its_cap_and_another_tenant_gets_a_slot() {
        let share = Arc::new(FairShare::new(2));
        let budget = Tenant::new_budget(
            "alice",
            TenantLimits {
                max_running_executions: 1,
                ..TenantLimits::default()
            },
        );
        let a1 = Tenant::with_budget("alice", TenantLimits::default(), Arc::clone(&budget));
        let a2 = Tenant::with_budget("alice", TenantLimits::default(), Arc::clone(&budget));
        let bob = Tenant::new("bob", TenantLimits::default());
        let first = share.try_acquire(&a1).expect("a free slot");
        // A slot is free, but alice's sessions together hold her one.
        assert!(share.try_acquire(&a2).is_none());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let waiter = {
            let (share, a2) = (Arc::clone(&share), Arc::clone(&a2));
            tokio::spawn(async move {
                let slot = share.acquire(&a2).await;
                tx.send(()).unwrap();
                slot
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Alice's waiter is over her cap: it does not stop bob from taking the free slot.
        let b = share.try_acquire(&bob).expect("bob gets the free slot");
        assert_eq!(budget.usage().executions_running, 1);
        drop(b);
        assert!(!waiter.is_finished());
        // Alice's execution finishes: her waiting session gets the slot.
        drop(first);
        tokio::time::timeout(Duration::from_secs(5), rx)
            .await
            .expect("granted")
            .unwrap();
        let second = waiter.await.unwrap();
        assert_eq!(budget.usage().executions, 1);
        assert_eq!(budget.usage().executions_running, 1);
        drop(second);
        assert_eq!(budget.usage().executions, 2);
        assert_eq!(a1.usage().executions + a2.usage().executions, 2);
    }
}
