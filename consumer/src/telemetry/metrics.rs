//! Metric names, the recorder, and the typed helpers the worker records through.
//!
//! Names live only here; the worker calls the helpers, so a dashboard and the code cannot drift
//! apart one call site at a time. See the table in the [module docs](super).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use shotfleet_schema::{FailureReason, MemoryClass, Priority, SubjectClass};

use super::TelemetryError;

pub const JOBS_TOTAL: &str = "shotfleet_jobs_total";
pub const QUEUE_WAIT_SECONDS: &str = "shotfleet_queue_wait_seconds";
pub const RENDER_SECONDS: &str = "shotfleet_render_seconds";
pub const UPLOAD_SECONDS: &str = "shotfleet_upload_seconds";
pub const BUDGET_FREE_BYTES: &str = "shotfleet_budget_free_bytes";
pub const BUDGET_USED_BYTES: &str = "shotfleet_budget_used_bytes";
pub const GPU_MEMORY_USED_BYTES: &str = "shotfleet_gpu_memory_used_bytes";
pub const GPU_MEMORY_TOTAL_BYTES: &str = "shotfleet_gpu_memory_total_bytes";
pub const GPU_UTILIZATION_RATIO: &str = "shotfleet_gpu_utilization_ratio";
pub const ESTIMATE_ERROR_RATIO: &str = "shotfleet_estimate_error_ratio";
pub const IN_FLIGHT_JOBS: &str = "shotfleet_in_flight_jobs";
pub const RESERVED_JOBS: &str = "shotfleet_reserved_jobs";
pub const OUT_OF_MEMORY_TOTAL: &str = "shotfleet_out_of_memory_total";
pub const SESSION_REBUILDS_TOTAL: &str = "shotfleet_session_rebuilds_total";
pub const CLASS_SERVABLE: &str = "shotfleet_class_servable";
pub const IMAGES_TOTAL: &str = "shotfleet_images_total";
pub const FAILURES_TOTAL: &str = "shotfleet_failures_total";
pub const BACKLOG_JOBS: &str = "shotfleet_backlog_jobs";
pub const LORA_SWITCHES_TOTAL: &str = "shotfleet_lora_switches_total";
pub const LORA_POOL_BYTES: &str = "shotfleet_lora_pool_bytes";
pub const SIZE_SWITCHES_TOTAL: &str = "shotfleet_size_switches_total";

/// Where a job's LoRA set came from: the `source` label of `shotfleet_lora_switches_total`.
const LORA_SOURCES: [&str; 3] = ["resident", "host", "merged"];

/// Seconds a job waited in the stream; backfill (`p2`) can wait hours under load.
const QUEUE_WAIT_BUCKETS: &[f64] =
    &[0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0];
/// Seconds of one render: a 1024x1024 SDXL job on a large card takes a few seconds, a batch on a
/// small card minutes.
const RENDER_BUCKETS: &[f64] = &[0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 300.0];
/// Seconds to upload one job's images, retries included.
const UPLOAD_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// (observed - estimated) / estimated peak memory: positive means the estimate was too low.
const ESTIMATE_ERROR_BUCKETS: &[f64] = &[-0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0];

/// How a job left this worker; the `outcome` label of `shotfleet_jobs_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "snake_case")]
#[non_exhaustive]
pub enum JobOutcome {
    /// Rendered at full quality, result published, acked.
    Done,
    /// Rendered below the requested quality (a degraded job), result published, acked.
    Degraded,
    /// Sent to the failed stream (invalid, out of memory below the floor, retries exhausted, driver).
    Failed,
    /// Handed back for another worker or a later try (transient failure, first out-of-memory, shutdown).
    Nak,
    /// Re-published to its class subject without rendering (class `auto` or a mismatched class).
    Routed,
    /// Re-published one rung down the degrade ladder.
    DegradeRepublished,
    /// A result already existed (a redelivery after another worker committed); acked, not rendered.
    DuplicateSkip,
    /// Cancelled (`shotfleet cancel`): settled by its `cancelled` outcome, queued or mid-render.
    Cancelled,
}

impl JobOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// The recorder this process installed, or why it could not.
static INSTALLED: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

/// Installs the Prometheus recorder as the process's global recorder and returns its handle.
/// Idempotent: later calls return the same handle (a process holds one global recorder, and the
/// tests of one binary share a process).
///
/// # Errors
///
/// [`TelemetryError::Install`] when another recorder was installed first.
pub fn install() -> Result<PrometheusHandle, TelemetryError> {
    INSTALLED
        .get_or_init(|| {
            let handle = builder().and_then(|b| b.install_recorder()).map_err(|e| e.to_string())?;
            describe();
            zeroes();
            Ok(handle)
        })
        .clone()
        .map_err(TelemetryError::Install)
}

fn builder() -> Result<PrometheusBuilder, metrics_exporter_prometheus::BuildError> {
    let buckets = [
        (QUEUE_WAIT_SECONDS, QUEUE_WAIT_BUCKETS),
        (RENDER_SECONDS, RENDER_BUCKETS),
        (UPLOAD_SECONDS, UPLOAD_BUCKETS),
        (ESTIMATE_ERROR_RATIO, ESTIMATE_ERROR_BUCKETS),
    ];
    buckets.into_iter().try_fold(PrometheusBuilder::new(), |builder, (name, bounds)| {
        builder.set_buckets_for_metric(Matcher::Full(name.to_owned()), bounds)
    })
}

/// HELP lines for `/metrics`.
fn describe() {
    describe_counter!(JOBS_TOTAL, Unit::Count, "Jobs that left this worker, by outcome, priority and class.");
    describe_counter!(OUT_OF_MEMORY_TOTAL, Unit::Count, "Renders that ran out of memory (each one corrects the estimate).");
    describe_counter!(SESSION_REBUILDS_TOTAL, Unit::Count, "Times the leak guard rebuilt the ONNX Runtime sessions.");
    describe_histogram!(QUEUE_WAIT_SECONDS, Unit::Seconds, "Time from publish to fetch, by priority.");
    describe_histogram!(RENDER_SECONDS, Unit::Seconds, "Time to render one job's images, by class.");
    describe_histogram!(UPLOAD_SECONDS, Unit::Seconds, "Time to encode one job's images as PNG and upload them, retries included.");
    describe_gauge!(BUDGET_FREE_BYTES, Unit::Bytes, "GPU memory budget not yet promised to jobs.");
    describe_gauge!(BUDGET_USED_BYTES, Unit::Bytes, "GPU memory budget promised to running jobs.");
    describe_gauge!(GPU_MEMORY_USED_BYTES, Unit::Bytes, "GPU memory in use on the card (NVML), every process; with [budget] max_mib, this worker's in its share.");
    describe_gauge!(GPU_MEMORY_TOTAL_BYTES, Unit::Bytes, "GPU memory on the card (NVML); with [budget] max_mib, the share.");
    describe_gauge!(GPU_UTILIZATION_RATIO, "GPU busy fraction over NVML's last sample period, 0 to 1.");
    describe_histogram!(
        ESTIMATE_ERROR_RATIO,
        "(observed - estimated) / estimated peak memory per job; above 0 the estimate was too low."
    );
    describe_gauge!(IN_FLIGHT_JOBS, Unit::Count, "Jobs fetched and not yet acked, naked or terminated.");
    describe_gauge!(RESERVED_JOBS, Unit::Count, "Jobs fetched ahead of a free render slot, kept alive until dealt to one (part of the in-flight jobs).");
    describe_gauge!(
        CLASS_SERVABLE,
        "1 for each memory class this worker serves, 0 for the others; `reason` says why (fits, not_configured, out_of_memory, over_budget), as calibrated at start."
    );
    describe_counter!(IMAGES_TOTAL, Unit::Count, "Images of jobs this worker committed, by priority and class.");
    describe_counter!(FAILURES_TOTAL, Unit::Count, "Jobs this worker failed (a failed record written), by reason.");
    describe_gauge!(BACKLOG_JOBS, Unit::Count, "Jobs of a render consumer this worker serves, by state, as the server last reported.");
    describe_counter!(
        LORA_SWITCHES_TOTAL,
        Unit::Count,
        "Renders with another LoRA set than the one before, by where the set came from (resident: a rebind; host: a copy to the device; merged: from the files)."
    );
    describe_gauge!(LORA_POOL_BYTES, Unit::Bytes, "Merged LoRA sets the pool holds, by memory (device: a line of the budget; host).");
    describe_counter!(
        SIZE_SWITCHES_TOTAL,
        Unit::Count,
        "Groups dealt to a render slot at another image size than the group dealt before (on a GPU each plans the convolutions again)."
    );
}

/// Counters a dashboard rates from the start, at zero before their first event (a series that
/// does not exist yet draws nothing, and hides a typo in a query).
fn zeroes() {
    counter!(OUT_OF_MEMORY_TOTAL).absolute(0);
    counter!(SESSION_REBUILDS_TOTAL).absolute(0);
    counter!(SIZE_SWITCHES_TOTAL).absolute(0);
    for &reason in FailureReason::ALL {
        counter!(FAILURES_TOTAL, "reason" => reason.as_str()).absolute(0);
    }
    for source in LORA_SOURCES {
        counter!(LORA_SWITCHES_TOTAL, "source" => source).absolute(0);
    }
}

/// Counts the images of a job this worker committed.
pub fn images_rendered(priority: Priority, class: SubjectClass, images: usize) {
    counter!(IMAGES_TOTAL, "priority" => priority.as_str(), "class" => class.as_str()).increment(images as u64);
}

/// Counts a job this worker failed (its failed record written), by reason.
pub fn job_failed(reason: FailureReason) {
    counter!(FAILURES_TOTAL, "reason" => reason.as_str()).increment(1);
}

/// Sets a render consumer's backlog as the server last reported it: `pending` jobs not yet
/// delivered, `in_progress` delivered and not yet acked.
pub fn backlog(consumer: &str, pending: u64, in_progress: u64) {
    gauge!(BACKLOG_JOBS, "consumer" => consumer.to_owned(), "state" => "pending").set(pending as f64);
    gauge!(BACKLOG_JOBS, "consumer" => consumer.to_owned(), "state" => "in_progress").set(in_progress as f64);
}

/// Counts one job leaving the worker.
pub fn job_finished(outcome: JobOutcome, priority: Priority, class: SubjectClass) {
    counter!(JOBS_TOTAL, "outcome" => outcome.as_str(), "priority" => priority.as_str(), "class" => class.as_str())
        .increment(1);
}

/// Records how long a job waited in the stream before this worker fetched it.
pub fn queue_wait(priority: Priority, wait: Duration) {
    histogram!(QUEUE_WAIT_SECONDS, "priority" => priority.as_str()).record(wait.as_secs_f64());
}

/// Records one job's render time.
pub fn render_time(class: SubjectClass, took: Duration) {
    histogram!(RENDER_SECONDS, "class" => class.as_str()).record(took.as_secs_f64());
}

/// Records one job's upload time, its PNG encoding included.
pub fn upload_time(took: Duration) {
    histogram!(UPLOAD_SECONDS).record(took.as_secs_f64());
}

/// Sets the budget gauges.
pub fn budget(free_bytes: u64, used_bytes: u64) {
    gauge!(BUDGET_FREE_BYTES).set(free_bytes as f64);
    gauge!(BUDGET_USED_BYTES).set(used_bytes as f64);
}

/// Sets the card's memory gauges from an NVML sample.
pub fn gpu_memory(used_bytes: u64, total_bytes: u64) {
    gauge!(GPU_MEMORY_USED_BYTES).set(used_bytes as f64);
    gauge!(GPU_MEMORY_TOTAL_BYTES).set(total_bytes as f64);
}

/// Sets the utilisation gauge; `ratio` is clamped to 0..=1 (NVML reports percent: divide by 100).
pub fn gpu_utilization(ratio: f64) {
    gauge!(GPU_UTILIZATION_RATIO).set(ratio.clamp(0.0, 1.0));
}

/// Records how far a job's memory estimate was from its observed peak. Ignored without an estimate.
/// `cold`: the render started from shrunk arenas, so the peak is its own; a warm start's peak
/// also counts what earlier renders left cached (an upper bound).
pub fn estimate_error(estimated_bytes: u64, observed_bytes: u64, cold: bool) {
    if estimated_bytes > 0 {
        let ratio = (observed_bytes as f64 - estimated_bytes as f64) / estimated_bytes as f64;
        histogram!(ESTIMATE_ERROR_RATIO, "start" => if cold { "cold" } else { "warm" }).record(ratio);
    }
}

/// Counts a render that ran out of memory.
pub fn out_of_memory() {
    counter!(OUT_OF_MEMORY_TOTAL).increment(1);
}

/// Records whether this worker serves `class` and why (`fits`, `not_configured`,
/// `out_of_memory`, `over_budget`).
pub fn class_servable(class: MemoryClass, served: bool, reason: &'static str) {
    gauge!(CLASS_SERVABLE, "class" => class.as_str(), "reason" => reason).set(if served { 1.0 } else { 0.0 });
}

/// Counts a job's LoRA set arriving on the device (`source`: resident, host, merged) when it is
/// another set than the one before.
pub fn lora_set(source: &'static str, switched: bool) {
    debug_assert!(LORA_SOURCES.contains(&source), "{source}");
    if switched {
        counter!(LORA_SWITCHES_TOTAL, "source" => source).increment(1);
    }
}

/// Counts a group dealt at another image size than the group before.
pub fn size_switch() {
    counter!(SIZE_SWITCHES_TOTAL).increment(1);
}

/// Sets the LoRA pool's gauges.
pub fn lora_pool_bytes(device: u64, host: u64) {
    gauge!(LORA_POOL_BYTES, "memory" => "device").set(device as f64);
    gauge!(LORA_POOL_BYTES, "memory" => "host").set(host as f64);
}

/// Counts a rebuild of the sessions by the leak guard.
pub fn session_rebuilt() {
    counter!(SESSION_REBUILDS_TOTAL).increment(1);
}

/// Jobs in flight in this process (the gauge's value, which the recorder does not read back).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Counts a job in flight until the guard drops, so every exit path (ack, nak, panic unwinding)
/// brings the gauge back down.
#[must_use = "the job counts as in flight only while the guard lives"]
pub fn in_flight() -> InFlight {
    IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
    InFlight { _gauge: Counted::new(IN_FLIGHT_JOBS) }
}

/// How many jobs this worker holds now, fetched and not settled: reserved, rendering or
/// committing (`shotfleet_in_flight_jobs`).
pub fn jobs_in_flight() -> usize {
    IN_FLIGHT.load(Ordering::Relaxed)
}

/// See [`in_flight`].
#[derive(Debug)]
pub struct InFlight {
    _gauge: Counted,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a job waiting in the reserve for a render slot until the guard drops (its delivery
/// counts it in flight meanwhile: `worker::delivery::Kept`).
#[must_use = "the job counts as reserved only while the guard lives"]
pub fn reserved() -> Reserved {
    Reserved { _counted: Counted::new(RESERVED_JOBS) }
}

/// One job in a gauge, while it lives.
#[derive(Debug)]
pub struct Counted(&'static str);

impl Counted {
    fn new(gauge: &'static str) -> Self {
        gauge!(gauge).increment(1.0);
        Self(gauge)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        gauge!(self.0).decrement(1.0);
    }
}

/// See [`reserved`].
#[derive(Debug)]
pub struct Reserved {
    _counted: Counted,
}
