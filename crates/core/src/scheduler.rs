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

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::tenant::Tenant;

#[derive(Debug, Default)]
struct Queue {
    running: usize,
    seq: u64,
    /// When the last execution on this device finished (see the module docs on billing).
    last_completion: Option<Instant>,
    /// Waiters by (device time used so far in ns, arrival order).
    waiting: BTreeMap<(u64, u64), tokio::sync::oneshot::Sender<()>>,
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
            if q.running >= self.inner.slots || !q.waiting.is_empty() {
                return None;
            }
            q.running += 1;
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
            if q.running < self.inner.slots && q.waiting.is_empty() {
                q.running += 1;
                None
            } else {
                let (tx, rx) = tokio::sync::oneshot::channel();
                q.seq += 1;
                let key = (tenant.device_ns(), q.seq);
                q.waiting.insert(key, tx);
                Some(WaitGuard {
                    share: &self.inner,
                    key,
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
    fn release(&self) {
        let mut q = self.queue.lock().expect("scheduler lock");
        q.running -= 1;
        while q.running < self.slots {
            let Some((_, tx)) = q.waiting.pop_first() else {
                break;
            };
            if tx.send(()).is_ok() {
                q.running += 1;
            }
        }
    }
}

/// Removes a cancelled waiter, or passes on a grant it received but can no longer use.
struct WaitGuard<'a> {
    share: &'a Inner,
    key: (u64, u64),
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
            self.share.release();
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
        self.share.release();
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
}
