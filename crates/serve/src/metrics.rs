//! Prometheus metrics: Triton's names and labels for per-model inference counters (so existing
//! dashboards work), and tpubox's own for the compile cache, tenants' device bytes and refused
//! requests. Rendered in the Prometheus text format for `GET /metrics`.

use prometheus::{
    CounterVec, Encoder, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use super::model::{Model, VERSION};
use tpubox_core::cache::CacheStats;
use tpubox_core::tenant::TenantUsage;

/// The server's metrics.
pub struct Metrics {
    registry: Registry,
    success: IntCounterVec,
    failure: IntCounterVec,
    count: IntCounterVec,
    exec_count: IntCounterVec,
    device_executions: IntCounterVec,
    request_us: IntCounterVec,
    queue_us: IntCounterVec,
    compute_us: IntCounterVec,
    pending: IntGaugeVec,
    cache_hits: IntCounterVec,
    compiles: IntCounterVec,
    device_bytes: IntGaugeVec,
    device_bytes_by_device: IntGaugeVec,
    refused: IntCounterVec,
    tenant_executions: IntCounterVec,
    tenant_device_seconds: CounterVec,
    tenant_compiles: IntCounterVec,
    tenant_refusals: IntCounterVec,
    sessions: IntGaugeVec,
    protections: IntCounterVec,
    instances: IntGaugeVec,
    stream_responses: IntCounterVec,
    streams_cancelled: IntCounterVec,
    transfers: IntCounterVec,
    live_bytes: IntGaugeVec,
    published_bytes: IntGaugeVec,
    published_versions: IntGaugeVec,
    /// What the tenants of replaced or unloaded models had counted when they were dropped, by
    /// tenant name (`model:NAME`): added to the live model's, so a reload does not reset the
    /// per-tenant counters.
    retired: std::sync::Mutex<std::collections::BTreeMap<String, Retired>>,
}

/// A retired model tenant's counters ([`Metrics::retire`]).
#[derive(Debug, Default, Clone, Copy)]
struct Retired {
    executions: u64,
    compiles: u64,
    refused: u64,
    device_seconds: f64,
}

fn counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("a valid metric");
    r.register(Box::new(c.clone())).expect("a unique metric");
    c
}

fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("a valid metric");
    r.register(Box::new(g.clone())).expect("a unique metric");
    g
}

/// What the device service and the weight registry counted, for [`Metrics::render`].
#[derive(Debug, Clone, Default)]
pub struct DeviceStats {
    /// Tensor bytes copied host → device so far
    /// ([`DeviceService::transferred_bytes`](tpubox_core::DeviceService::transferred_bytes)).
    pub host_to_device_bytes: u64,
    /// Tensor bytes copied device → host so far.
    pub device_to_host_bytes: u64,
    /// Dense bytes of the device buffers held now, and the most at once
    /// ([`tpubox_core::types::live_device_bytes`]).
    pub live_bytes: u64,
    /// See `live_bytes`.
    pub peak_live_bytes: u64,
    /// Each publishing tenant's ledger.
    pub published: Vec<(String, tpubox_core::weights::PublishedUsage)>,
}

/// One request's numbers, for [`Metrics::record`].
pub struct RequestRecord<'a> {
    /// Model name.
    pub model: &'a str,
    /// Whether it succeeded.
    pub success: bool,
    /// Batch items (its batch size).
    pub items: u64,
    /// End to end, in microseconds.
    pub request_us: u64,
    /// Waiting in the queue, in microseconds.
    pub queue_us: u64,
    /// The `infer` call it was part of, in microseconds.
    pub compute_us: u64,
}

impl Metrics {
    /// The metrics, all at zero.
    pub fn new() -> Self {
        let r = Registry::new();
        let mv = &["model", "version"];
        Metrics {
            success: counter(
                &r,
                "nv_inference_request_success",
                "Successful inference requests",
                mv,
            ),
            failure: counter(
                &r,
                "nv_inference_request_failure",
                "Failed inference requests",
                mv,
            ),
            count: counter(
                &r,
                "nv_inference_count",
                "Inferences performed (batch items)",
                mv,
            ),
            exec_count: counter(
                &r,
                "nv_inference_exec_count",
                "Model executions (batches)",
                mv,
            ),
            device_executions: counter(
                &r,
                "tpubox_device_executions_total",
                "Model executions (batches; a decoupled model's responses) by the device of the instance that ran them",
                &["device", "model"],
            ),
            request_us: counter(
                &r,
                "nv_inference_request_duration_us",
                "Cumulative end-to-end request duration, microseconds",
                mv,
            ),
            queue_us: counter(
                &r,
                "nv_inference_queue_duration_us",
                "Cumulative time requests waited in the queue, microseconds",
                mv,
            ),
            compute_us: counter(
                &r,
                "nv_inference_compute_infer_duration_us",
                "Cumulative model execution time, microseconds",
                mv,
            ),
            pending: gauge(
                &r,
                "nv_inference_pending_request_count",
                "Requests waiting in the model's queue",
                mv,
            ),
            protections: counter(
                &r,
                "tpubox_protection_triggered_total",
                "Times a protection against callers triggered (timeouts, connection and stream caps, refused credentials, descriptor caps, compile-worker caps; docs/SECURITY.md)",
                &["protection"],
            ),
            cache_hits: counter(
                &r,
                "tpubox_compile_cache_hits_total",
                "Compile-cache hits per tier (memory, disk, remote)",
                &["tier"],
            ),
            compiles: counter(
                &r,
                "tpubox_compiles_total",
                "Programs compiled (cache misses)",
                &[],
            ),
            device_bytes: gauge(
                &r,
                "tpubox_tenant_device_bytes",
                "Device bytes held by a tenant (a model's instances, or a tenant's sessions)",
                &["tenant"],
            ),
            device_bytes_by_device: gauge(
                &r,
                "tpubox_tenant_device_bytes_by_device",
                "Device bytes held by a tenant on one device (a model's instances there, or all of a tenant's sessions there)",
                &["tenant", "device"],
            ),
            sessions: gauge(
                &r,
                "tpubox_sessions",
                "Open sessions of a tenant (session API)",
                &["tenant"],
            ),
            instances: gauge(
                &r,
                "tpubox_model_instances",
                "Live instances of a model's component, a replaced or unloaded version's included until they end",
                &["model"],
            ),
            stream_responses: counter(
                &r,
                "tpubox_stream_responses_total",
                "Responses a decoupled model's instances computed for streams (one generation.next call each)",
                &["model"],
            ),
            streams_cancelled: counter(
                &r,
                "tpubox_streams_cancelled_total",
                "Streams a decoupled model stopped before their end: the client went away, or took no response for tpubox.decoupled.stall_seconds",
                &["model", "reason"],
            ),
            transfers: counter(
                &r,
                "tpubox_transfer_bytes_total",
                "Tensor bytes the daemon copied between host and device, by direction (host_to_device: uploads, inline arguments, weight files; device_to_host: reads, fetched results, served outputs)",
                &["direction"],
            ),
            live_bytes: gauge(
                &r,
                "tpubox_device_live_bytes",
                "Dense bytes of every device buffer the daemon holds (sessions, models, weight sets, published versions, outputs in flight); `peak` is the most at once since start",
                &["at"],
            ),
            published_bytes: gauge(
                &r,
                "tpubox_published_weight_bytes",
                "Device bytes of a tenant's live published weight versions (its ledger, against max-published-bytes)",
                &["tenant"],
            ),
            published_versions: gauge(
                &r,
                "tpubox_published_weight_versions",
                "A tenant's live published weight versions (against max-published-versions)",
                &["tenant"],
            ),
            retired: Default::default(),
            refused: counter(
                &r,
                "tpubox_refused_requests_total",
                "Requests refused by a limit",
                &["tenant", "limit"],
            ),
            tenant_executions: counter(
                &r,
                "tpubox_tenant_executions_total",
                "Executions of a tenant (a model's tenant, or all of a tenant's sessions since its first)",
                &["tenant"],
            ),
            tenant_device_seconds: {
                let c = CounterVec::new(
                    Opts::new(
                        "tpubox_tenant_device_seconds_total",
                        "Device time of a tenant's executions, seconds (billed as docs/SECURITY.md says)",
                    ),
                    &["tenant"],
                )
                .expect("a valid metric");
                r.register(Box::new(c.clone())).expect("a unique metric");
                c
            },
            tenant_compiles: counter(
                &r,
                "tpubox_tenant_compiles_total",
                "Compiles charged to a tenant (those the compile cache's tier 1 did not serve)",
                &["tenant"],
            ),
            tenant_refusals: counter(
                &r,
                "tpubox_tenant_refusals_total",
                "Calls of a tenant refused by one of its limits or its program policy (the limit is in the error)",
                &["tenant"],
            ),
            registry: r,
        }
    }

    /// Counts one finished request.
    pub fn record(&self, r: &RequestRecord) {
        let l = [r.model, VERSION];
        if r.success {
            self.success.with_label_values(&l).inc();
            self.count.with_label_values(&l).inc_by(r.items);
        } else {
            self.failure.with_label_values(&l).inc();
        }
        self.request_us.with_label_values(&l).inc_by(r.request_us);
        self.queue_us.with_label_values(&l).inc_by(r.queue_us);
        self.compute_us.with_label_values(&l).inc_by(r.compute_us);
    }

    /// Counts one execution (batch) of `model`, by an instance on device `device`.
    pub fn executed(&self, model: &str, device: u32) {
        self.exec_count.with_label_values(&[model, VERSION]).inc();
        self.device_executions
            .with_label_values(&[&device.to_string(), model])
            .inc();
    }

    /// The gauge of `model`'s live instances (`tpubox_model_instances{model}`), for
    /// [`super::instance::Instance::counted_in`].
    pub fn instances_of(&self, model: &str) -> IntGauge {
        self.instances.with_label_values(&[model])
    }

    /// Keeps what a model's tenant counted (`usage`, read as its model is dropped: after a
    /// reload or an unload), so that `tpubox_tenant_*_total{tenant}` go on from there when the
    /// model is loaded again. What the dropped model's instances still run after this is not
    /// counted.
    pub fn retire(&self, tenant: &str, usage: &TenantUsage) {
        let mut r = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        let e = r.entry(tenant.to_string()).or_default();
        e.executions += usage.executions;
        e.compiles += usage.compiles;
        e.refused += usage.refused;
        e.device_seconds += usage.device_seconds;
    }

    /// Counts one streamed response computed by `model`.
    pub fn stream_response(&self, model: &str) {
        self.stream_responses.with_label_values(&[model]).inc();
    }

    /// Counts a stream of `model` stopped early, for `reason` (`client gone`, `stalled`).
    pub fn stream_cancelled(&self, model: &str, reason: &str) {
        self.streams_cancelled
            .with_label_values(&[model, reason])
            .inc();
    }

    /// Counts a request refused by `limit` for `tenant`.
    pub fn refused(&self, tenant: &str, limit: &str) {
        self.refused.with_label_values(&[tenant, limit]).inc();
    }

    /// The text exposition, with gauges read now from `models`, `cache` and `device`.
    pub fn render(
        &self,
        models: &[std::sync::Arc<Model>],
        cache: Option<CacheStats>,
        sessions: &[(String, u32, TenantUsage)],
        budgets: &[(String, TenantUsage)],
        device: &DeviceStats,
    ) -> String {
        for (direction, n) in [
            ("host_to_device", device.host_to_device_bytes),
            ("device_to_host", device.device_to_host_bytes),
        ] {
            let m = self.transfers.with_label_values(&[direction]);
            m.reset();
            m.inc_by(n);
        }
        self.live_bytes
            .with_label_values(&["now"])
            .set(device.live_bytes as i64);
        self.live_bytes
            .with_label_values(&["peak"])
            .set(device.peak_live_bytes as i64);
        // Tenants whose versions are all freed drop out.
        self.published_bytes.reset();
        self.published_versions.reset();
        for (tenant, u) in &device.published {
            self.published_bytes
                .with_label_values(&[tenant])
                .set(u.bytes as i64);
            self.published_versions
                .with_label_values(&[tenant])
                .set(u.versions as i64);
        }
        // Per-tenant totals: the session tenants' budgets and the models' tenants, copied at
        // each scrape from the counters the tenants keep.
        let retired = self
            .retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut model_totals: std::collections::BTreeMap<&str, TenantUsage> = retired
            .iter()
            .map(|(n, r)| {
                let u = TenantUsage {
                    executions: r.executions,
                    compiles: r.compiles,
                    refused: r.refused,
                    device_seconds: r.device_seconds,
                    ..TenantUsage::default()
                };
                (n.as_str(), u)
            })
            .collect();
        for m in models {
            let live = m.tenant.usage();
            let t = model_totals.entry(m.tenant.name()).or_default();
            t.executions += live.executions;
            t.compiles += live.compiles;
            t.refused += live.refused;
            t.device_seconds += live.device_seconds;
        }
        let totals = budgets
            .iter()
            .map(|(n, u)| (n.as_str(), u.clone()))
            .chain(model_totals);
        for (tenant, u) in totals {
            for (c, v) in [
                (&self.tenant_executions, u.executions),
                (&self.tenant_compiles, u.compiles),
                (&self.tenant_refusals, u.refused),
            ] {
                let m = c.with_label_values(&[tenant]);
                m.reset();
                m.inc_by(v);
            }
            let m = self.tenant_device_seconds.with_label_values(&[tenant]);
            m.reset();
            m.inc_by(u.device_seconds);
        }
        // A tenant's device bytes: its model's (a model tenant is named after its model) and
        // its sessions', summed.
        let mut bytes: std::collections::BTreeMap<&str, u64> = Default::default();
        for (tenant, n, u) in sessions {
            *bytes.entry(tenant).or_default() += u.device_bytes;
            self.sessions
                .with_label_values(&[tenant])
                .set(i64::from(*n));
        }
        for m in models {
            let l = [m.name.as_str(), VERSION];
            // Every series of a loaded model exists from the start, at zero.
            for c in [
                &self.success,
                &self.failure,
                &self.count,
                &self.exec_count,
                &self.request_us,
                &self.queue_us,
                &self.compute_us,
            ] {
                c.with_label_values(&l);
            }
            let mut placed = m.devices.clone();
            placed.sort_unstable();
            placed.dedup();
            for d in placed {
                self.device_executions
                    .with_label_values(&[&d.to_string(), m.name.as_str()]);
            }
            self.pending.with_label_values(&l).set(m.pending() as i64);

            *bytes.entry(m.tenant.name()).or_default() += m.tenant.usage().device_bytes;
        }
        for (tenant, b) in bytes {
            self.device_bytes.with_label_values(&[tenant]).set(b as i64);
        }
        // Per device: the session tenants' live sessions and the models' tenants, as above.
        // Rebuilt at each scrape: a tenant with no live session or model drops out.
        let mut by_device: std::collections::BTreeMap<(&str, u32), u64> = Default::default();
        let per_device = sessions
            .iter()
            .map(|(n, _, u)| (n.as_str(), u.device_bytes_by_device.clone()))
            .chain(
                models
                    .iter()
                    .map(|m| (m.tenant.name(), m.tenant.usage().device_bytes_by_device)),
            );
        for (tenant, devices) in per_device {
            for d in devices {
                *by_device.entry((tenant, d.device)).or_default() += d.bytes;
            }
        }
        self.device_bytes_by_device.reset();
        for ((tenant, device), b) in by_device {
            self.device_bytes_by_device
                .with_label_values(&[tenant, &device.to_string()])
                .set(b as i64);
        }
        if let Some(c) = cache {
            // Counters the cache keeps; copied here at each scrape.
            for (tier, t) in [("memory", c.memory), ("disk", c.disk), ("remote", c.remote)] {
                let m = self.cache_hits.with_label_values(&[tier]);
                m.reset();
                m.inc_by(t.hits);
            }
            let m = self.compiles.with_label_values::<&str>(&[]);
            m.reset();
            m.inc_by(c.compiles);
        }
        // Counted by tpubox_core::protection for every door; copied here at each scrape.
        for (name, n) in tpubox_core::protection::counts() {
            let m = self.protections.with_label_values(&[name]);
            m.reset();
            m.inc_by(n);
        }
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
