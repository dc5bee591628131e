//! Metrics and health on one HTTP port.
//!
//! - `metrics.rs`: the metric names, the Prometheus recorder ([`install`]), and the typed helpers
//!   the worker records through ([`job_finished`], [`queue_wait`], ...).
//! - `health.rs`: [`Health`], the readiness the worker declares.
//! - `server.rs`: [`serve`], the axum server for `/metrics`, `/healthz` and `/readyz`.
//!
//! # Endpoints
//!
//! | path | answer |
//! | --- | --- |
//! | `/metrics` | Prometheus text format |
//! | `/healthz` | 200 while the process runs (liveness: restart the pod when it stops answering) |
//! | `/readyz` | 200 once models are loaded and a probe render passed; 503 with the reason before that, while the worker has stopped fetching, and while draining on shutdown. Either way, once calibrated, one line per memory class after the first: served, or not and why (`m: not served (out of memory: ...)`) |
//!
//! # Metrics
//!
//! One process serves one GPU, so the scrape target (`instance`) identifies the card; no metric
//! carries a GPU label.
//!
//! | name | type | labels | meaning |
//! | --- | --- | --- | --- |
//! | `shotfleet_jobs_total` | counter | `outcome`, `priority`, `class` | jobs that left this worker. `outcome`: `done`, `degraded` (rendered below the requested quality), `failed` (to the failed stream), `nak` (handed back), `routed` (re-published to its class subject unrendered), `degrade_republished` (re-published one rung down), `duplicate_skip` (a result already existed), `cancelled` (settled by its cancellation). `priority`: `p0`..`p2`. `class`: `xs`..`xl`, or `auto` |
//! | `shotfleet_queue_wait_seconds` | histogram | `priority` | publish to render (a routed or degraded copy counts from its original's publish); a growing `p2` tail with flat `p0` is the priority policy at work, a growing `p0` tail means too few workers |
//! | `shotfleet_render_seconds` | histogram | `class` | one job's render, all its images |
//! | `shotfleet_upload_seconds` | histogram | | one job's upload, store retries included |
//! | `shotfleet_budget_free_bytes` | gauge | | GPU memory budget not yet promised to jobs |
//! | `shotfleet_budget_used_bytes` | gauge | | budget promised to running jobs |
//! | `shotfleet_gpu_memory_used_bytes` | gauge | | memory in use on the card (NVML), other processes included; under `[budget] max_mib`, this worker's own usage of its share |
//! | `shotfleet_gpu_memory_total_bytes` | gauge | | memory on the card; under `[budget] max_mib`, the share |
//! | `shotfleet_gpu_utilization_ratio` | gauge | | busy fraction, 0..1 |
//! | `shotfleet_estimate_error_ratio` | histogram | `start` | (observed - estimated) / estimated peak memory per job (at `concurrency = 1`); `start="cold"`: the render began from shrunk arenas and the peak is its own, mass above 0 means the estimate runs low; `start="warm"`: the peak includes what earlier renders left cached, an upper bound |
//! | `shotfleet_in_flight_jobs` | gauge | | jobs fetched and not yet settled |
//! | `shotfleet_reserved_jobs` | gauge | | of those, jobs fetched ahead of a free render slot and waiting in the reserve (`lookahead`: batch partners, jobs like the last render's) |
//! | `shotfleet_class_servable` | gauge | `class`, `reason` | 1 for a class this worker serves, 0 for one it does not, as calibrated at start. `reason`: `fits` (one image of its largest size fits the idle budget), `not_configured` (not in `classes`), `out_of_memory` (a probe at or below that size ran out of memory at start: the card's ceiling), `over_budget` (planned over the room beside the models) |
//! | `shotfleet_images_total` | counter | `priority`, `class` | images of the jobs this worker committed |
//! | `shotfleet_failures_total` | counter | `reason` | jobs this worker failed (failed record written): `invalid`, `oom`, `attempts`, `max_deliveries`, `driver` |
//! | `shotfleet_backlog_jobs` | gauge | `consumer`, `state` | a served consumer's `pending` and `in_progress` jobs, read from the server every 15 s (every worker of a class reports it: take the max) |
//! | `shotfleet_lora_switches_total` | counter | `source` | renders with another LoRA set than the one before (base-model renders in between change nothing): `resident` (a rebind), `host` (copied to the device from host memory), `merged` (merged from the LoRA files, then placed). A storyboard grouped by set switches about once per character |
//! | `shotfleet_lora_pool_bytes` | gauge | `memory` | merged LoRA sets the pool holds: `device` (a line of the budget, beside the models), `host` |
//! | `shotfleet_size_switches_total` | counter | | groups dealt to a render slot at another image size than the group dealt before: on a GPU each one plans the convolutions of the UNet and the VAE decoder again (~1.15 s a VAE decode on the default search, deploy/gpu/RESULTS.md). Against `rate(shotfleet_jobs_total)`, what `affinity_passes` and `lookahead` save on a mixed queue |
//!
//! Useful queries: `sum by (outcome) (rate(shotfleet_jobs_total[5m]))`;
//! `shotfleet_class_servable == 0 unless on(class) shotfleet_class_servable{reason="not_configured"}`
//! (classes a worker was asked to serve and cannot);
//! `histogram_quantile(0.95, sum by (le, priority) (rate(shotfleet_queue_wait_seconds_bucket[5m])))`;
//! `shotfleet_gpu_memory_used_bytes / shotfleet_gpu_memory_total_bytes` against the 85% / 92% water levels.

mod health;
mod metrics;
mod server;

use std::net::SocketAddr;

use serde::Deserialize;

pub use self::health::Health;
pub use self::metrics::{
    BUDGET_FREE_BYTES, BUDGET_USED_BYTES, CLASS_SERVABLE, ESTIMATE_ERROR_RATIO, GPU_MEMORY_TOTAL_BYTES, GPU_MEMORY_USED_BYTES,
    GPU_UTILIZATION_RATIO, IN_FLIGHT_JOBS, Counted, InFlight, JOBS_TOTAL, JobOutcome, OUT_OF_MEMORY_TOTAL, QUEUE_WAIT_SECONDS,
    RENDER_SECONDS, SESSION_REBUILDS_TOTAL, UPLOAD_SECONDS, BACKLOG_JOBS, FAILURES_TOTAL, IMAGES_TOTAL, LORA_POOL_BYTES,
    LORA_SWITCHES_TOTAL, RESERVED_JOBS, Reserved, SIZE_SWITCHES_TOTAL, backlog, budget, class_servable, estimate_error, gpu_memory, gpu_utilization, images_rendered, in_flight,
    install, jobs_in_flight, job_failed, job_finished, lora_pool_bytes, lora_set, out_of_memory, queue_wait, render_time, reserved, session_rebuilt, size_switch,
    upload_time,
};
pub use self::server::{TelemetryServer, serve};

/// `[telemetry]` settings.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Address of the metrics and health port. One process per GPU: give each its own port.
    /// Loopback by default: the port has no authentication, so reaching it from elsewhere (a
    /// pod's probes, a remote Prometheus) is set on purpose (deploy/k8s, deploy/systemd).
    pub listen: SocketAddr,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self { listen: SocketAddr::from(([127, 0, 0, 1], 9400)) }
    }
}

/// A telemetry failure. None is worth retrying: each needs a different address or a fixed binary.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    /// Another metrics recorder was installed in this process first.
    #[error("cannot install the Prometheus recorder: {0}")]
    Install(String),
    /// The address is in use or not local.
    #[error("cannot listen on {addr} for metrics and health: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    /// Accepting connections failed after start.
    #[error("metrics and health server failed: {0}")]
    Serve(std::io::Error),
}
