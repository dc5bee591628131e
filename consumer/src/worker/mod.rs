//! The worker loop: admit -> fetch -> decode/validate -> render -> upload -> publish result -> ack.
//!
//! [`run`] starts everything in order (telemetry, NATS, store, models and calibration), then
//! loops: ask the budget what fits, fetch that much in priority order, hand each job to its own
//! task ([`job::handle`]), until the shutdown future resolves. Then it stops fetching, gives
//! in-flight jobs the grace period, cancels what is left (naked at once, so other workers take
//! it) and drains the connection.
//!
//! - [`startup`]: load, calibrate ([`calibrate`]), fitness render; [`serving`]: the classes the
//!   calibrated budget holds;
//! - [`fetch`]: which consumers, how many jobs, in which order ([`priority`]);
//! - [`job`]: one job's steps; [`commit`]: the result as the commit point;
//! - [`route`]: `auto` and wrong-class jobs; [`failed`]: failed records;
//! - [`delivery`]: a fetched message and its acks.

pub mod advisory;
pub mod calibrate;
pub mod check;
pub mod commit;
pub mod degrade;
pub mod delivery;
pub mod failed;
pub mod fetch;
pub mod group;
pub mod job;
pub mod leak;
pub mod priority;
pub mod route;
pub mod serving;
pub mod startup;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::budget::Budget;
use crate::config::WorkerConfig;
use crate::pipeline::Pipeline;
use crate::store::Store;
use crate::telemetry::{self, Health};

/// Why the worker could not start or had to stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    #[error("cannot {step}: {detail}")]
    Start { step: String, detail: String },
    /// The GPU or its driver failed; the process must be restarted (`EXIT_DRIVER_FAULT`).
    #[error("driver fault: {0}")]
    DriverFault(String),
    /// Memory crept up and survived a session rebuild; restart the process (`EXIT_RESTART`).
    #[error("restart needed: {0}")]
    Restart(String),
    /// The card holds none of the classes the worker may serve (`EXIT_CONFIG`): it needs a larger
    /// card or share, fewer other processes on it, or other classes.
    #[error(
        "this card holds nothing this worker may serve; give it a larger card or `[budget] max_mib`, move other processes off the card, or change `classes`: {0}"
    )]
    NothingFits(String),
}

impl WorkerError {
    /// The exit code for the supervisor.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Start { .. } => 3,
            Self::DriverFault(_) => crate::failure::EXIT_DRIVER_FAULT,
            Self::Restart(_) => crate::failure::EXIT_RESTART,
            Self::NothingFits(_) => crate::failure::EXIT_CONFIG,
        }
    }
}

impl WorkerError {
    pub(crate) fn start(step: &str, e: impl std::fmt::Display) -> Self {
        Self::Start { step: step.to_owned(), detail: e.to_string() }
    }
}

/// What every job task shares.
pub struct Shared {
    pub config: WorkerConfig,
    pub js: jetstream::Context,
    pub results: jetstream::stream::Stream,
    pub store: Store,
    pub budget: Budget,
    pub probe: Arc<dyn crate::budget::GpuProbe>,
    /// Measures each render's peak for the budget to learn from (one at a time: with
    /// `concurrency > 1` renders overlap and are not measured).
    pub meter: Option<Arc<crate::budget::PeakMeter>>,
    /// The models; taken out and put back by the leak guard's rebuild while no job runs.
    pipeline: std::sync::RwLock<Option<Arc<Pipeline>>>,
    /// Renders started since start (fault injection counts them).
    pub renders: std::sync::atomic::AtomicU32,
    /// The device's name as the probe reports it (`NVIDIA H200`, `simulated (cpu)`).
    pub device_name: String,
    /// How often a job in progress sends `AckKind::Progress`.
    pub progress_interval: Duration,
    /// The consumers' `max_deliver`: the attempt at which a failing job goes to the failed stream.
    pub max_deliver: u64,
    /// Cancelled when the grace period is over: renders stop and their jobs are naked.
    pub abort: CancellationToken,
    /// Cancelled to stop fetching: shutdown, a driver fault, a restart.
    pub stop: CancellationToken,
    /// Why the worker must exit with a non-zero code, once known.
    exit: std::sync::Mutex<Option<WorkerError>>,
}

impl Shared {
    /// The current models.
    pub fn pipeline(&self) -> Arc<Pipeline> {
        self.pipeline
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .expect("the models are only taken out while no job runs")
    }

    /// Takes the models out for a rebuild; `None` (and nothing taken) while a job holds them.
    fn take_pipeline(&self) -> Option<Pipeline> {
        let mut slot = self.pipeline.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        let arc = slot.take()?;
        match Arc::try_unwrap(arc) {
            Ok(pipeline) => Some(pipeline),
            Err(arc) => {
                *slot = Some(arc);
                None
            }
        }
    }

    fn put_pipeline(&self, pipeline: Pipeline) {
        *self.pipeline.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(pipeline));
    }

    /// A driver fault: stop fetching, cancel every render now (their jobs are naked at once, so
    /// other workers take them), tell the fleet, and exit with `EXIT_DRIVER_FAULT` afterwards.
    pub async fn driver_fault(&self, job_id: Option<&str>, detail: &str) {
        tracing::error!(job = job_id.unwrap_or("-"), detail, "driver fault: stopping this worker");
        self.set_exit(WorkerError::DriverFault(detail.to_owned()));
        self.stop.cancel();
        self.abort.cancel();
        let event = serde_json::json!({
            "worker": self.config.worker_id,
            "device": self.device_name,
            "job_id": job_id,
            "detail": detail,
            "at_ms": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis() as u64,
        });
        let subject = format!("{}.fault.{}", shotfleet_schema::subject::ROOT, subject_token(&self.config.worker_id));
        // A plain NATS event (no stream holds it): supervisors and dashboards subscribe.
        let client = self.js.client();
        if let Err(e) = client.publish(subject, event.to_string().into()).await {
            warn!(error = %e, "could not publish the fault event");
        }
        let _ = client.flush().await;
    }

    fn set_exit(&self, error: WorkerError) {
        let mut exit = self.exit.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        exit.get_or_insert(error);
    }

    fn take_exit(&self) -> Option<WorkerError> {
        self.exit.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }
}

/// A worker id as one subject token (`host/gpu0` stays, dots and spaces become `_`).
fn subject_token(id: &str) -> String {
    id.chars().map(|c| if c == '.' || c == '*' || c == '>' || c.is_whitespace() { '_' } else { c }).collect()
}

/// Runs a worker until `shutdown` resolves. `env` is the process environment (credentials).
///
/// # Errors
/// [`WorkerError`] when a start-up step fails.
pub async fn run(
    config: WorkerConfig,
    env: Vec<(String, String)>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), WorkerError> {
    if config.faults.any() {
        warn!(faults = ?config.faults, "FAULT INJECTION IS ON: this worker will misbehave on purpose");
    }
    let stop = CancellationToken::new();
    let shutdown_requested = stop.clone();
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            shutdown.await;
            stop.cancel();
        });
    }

    // Health first, so an orchestrator sees a live process that is not ready yet.
    let health = Health::new();
    health.set_not_ready("starting");
    let metrics = telemetry::install().map_err(|e| WorkerError::start("install metrics", e))?;
    let server_stop = stop.clone();
    let telemetry_server = telemetry::serve(config.metrics_addr(), metrics, health.clone(), async move {
        server_stop.cancelled().await;
    })
    .await
    .map_err(|e| WorkerError::start("serve metrics and health", e))?;
    info!(addr = %telemetry_server.local_addr(), "metrics and health listening");

    let client = config.nats.connect().await.map_err(|e| WorkerError::start("connect to NATS", e))?;
    let js = jetstream::new(client.clone());
    let jobs_stream = js
        .get_stream(shotfleet_schema::subject::JOBS_STREAM)
        .await
        .map_err(|e| WorkerError::start("open stream SHOTS (run `shotfleet setup`)", e))?;
    let results = js
        .get_stream(shotfleet_schema::subject::RESULTS_STREAM)
        .await
        .map_err(|e| WorkerError::start("open stream SHOT_RESULTS (run `shotfleet setup`)", e))?;
    // Subscribed before the models load: an advisory emitted meanwhile waits in the subscription.
    let advisories = advisory::subscribe(&client).await.map_err(|e| WorkerError::start("listen for max-delivery advisories", e))?;
    let mut consumers =
        fetch::Consumers::bind(&jobs_stream, &config.classes).await.map_err(|e| WorkerError::start("bind consumers", e))?;
    let (ack_wait, max_deliver) = consumers.limits().await.map_err(|e| WorkerError::start("read consumer limits", e))?;
    let store = Store::connect(&config.store, env).await.map_err(|e| WorkerError::start("open the object store", e))?;

    health.set_not_ready("loading models and calibrating");
    let ready = startup::prepare(&config).await.inspect_err(|e| health.set_not_ready(e.to_string()))?;
    // Consumers were bound for every candidate class; from here on only those served are fetched.
    let config = serving::serve(config, &ready.classes, &health).inspect_err(|e| health.set_not_ready(e.to_string()))?;
    let device_name = ready.probe.snapshot().map(|s| s.device).unwrap_or_else(|_| "unknown".into());
    let progress_interval = config.progress_interval.map(|s| s.0).unwrap_or(ack_wait / 3).max(Duration::from_millis(100));
    let meter = (config.concurrency == 1).then_some(ready.meter);
    let shared = Arc::new(Shared {
        config,
        js,
        results,
        store,
        budget: ready.budget,
        probe: ready.probe,
        meter,
        pipeline: std::sync::RwLock::new(Some(ready.pipeline)),
        renders: std::sync::atomic::AtomicU32::new(0),
        device_name,
        progress_interval,
        max_deliver,
        abort: CancellationToken::new(),
        stop: stop.clone(),
        exit: std::sync::Mutex::new(None),
    });
    let _advisories = advisory::listen(shared.clone(), advisories);
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(gpu) = shared.config.gpu_index() {
        watch_driver_events(&shared, gpu, watching.clone());
    }
    health.set_ready();
    info!(worker = %shared.config.worker_id, classes = %shared.config.classes, "taking jobs");

    let tracker = TaskTracker::new();
    let mut guard = leak::LeakGuard::new(&shared).await;
    fetch_loop(&shared, &consumers, &tracker, &mut guard).await;

    // Shutdown: no more fetching; in-flight jobs get the grace period, then are cancelled.
    health.set_draining();
    tracker.close();
    let grace = shared.config.grace_period.0;
    info!(in_flight = tracker.len(), grace_s = grace.as_secs_f64(), "stopping: finishing in-flight jobs");
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        warn!(in_flight = tracker.len(), "grace period over: cancelling and naking the rest");
        shared.abort.cancel();
        tracker.wait().await;
    }
    watching.store(true, std::sync::atomic::Ordering::Relaxed);
    // async-nats's `drain` only queues the drain and returns; the process may exit before its
    // buffer is written. Flush first, so the naks of the jobs cancelled above (and every result
    // and ack before them) are on the server: a lost nak left a job waiting out `ack_wait` (a
    // minute) on a loaded CI machine.
    match tokio::time::timeout(Duration::from_secs(5), client.flush()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "flushing the NATS connection failed; naks may be lost"),
        Err(_) => warn!("flushing the NATS connection took over 5 s; naks may be lost"),
    }
    if let Err(e) = client.drain().await {
        warn!(error = %e, "draining the NATS connection failed");
    }
    if !shutdown_requested.is_cancelled() {
        // Stopped by a fault or the leak guard, not by a signal: the telemetry server stops too.
        shutdown_requested.cancel();
    }
    let _ = telemetry_server.stopped().await;
    match shared.take_exit() {
        Some(error) => Err(error),
        None => {
            info!("stopped");
            Ok(())
        }
    }
}

/// The loop: admit, fetch, hand out; sleep a little when there is nothing to do.
async fn fetch_loop(shared: &Arc<Shared>, consumers: &fetch::Consumers, tracker: &TaskTracker, guard: &mut leak::LeakGuard) {
    let stop = &shared.stop;
    let slots = Arc::new(Semaphore::new(shared.config.concurrency));
    let finished = Arc::new(Notify::new());
    let mut scheduler = priority::Scheduler::new(&shared.config.priorities, Instant::now());
    let base_idle = shared.config.idle_poll.0;
    let mut idle = base_idle;
    // Whether the arenas were shrunk since nothing last fitted: once per stall is enough.
    let mut shrunk_for_room = false;

    while !stop.is_cancelled() {
        let mut worked = false;
        for delivery in consumers.next_unrouted(16).await {
            worked = true;
            tracker.spawn(job::handle(shared.clone(), delivery));
        }

        let free = slots.available_permits();
        if free == shared.config.concurrency
            && let Err(error) = guard.check(shared).await
        {
            shared.set_exit(error);
            stop.cancel();
            break;
        }
        if free > 0 {
            export_budget(&shared.budget);
            match shared.budget.admit(&shared.config.classes) {
                Ok(admission) => {
                    // Up to `batch_jobs` jobs per free slot: a slot renders one job, or one group
                    // of compatible jobs in shared batches.
                    let per_slot = shared.config.batch_jobs.max(1);
                    let deliveries = if admission.classes().is_empty() {
                        Vec::new()
                    } else {
                        consumers.next_jobs(&admission, free * per_slot, &mut scheduler).await
                    };
                    let fetched_none = deliveries.is_empty();
                    let mut deliveries = deliveries.into_iter().peekable();
                    while deliveries.peek().is_some() {
                        let batch: Vec<_> = deliveries.by_ref().take(per_slot).collect();
                        worked = true;
                        shrunk_for_room = false;
                        let permit = slots.clone().try_acquire_owned().expect("a slot was counted free");
                        let shared = shared.clone();
                        let finished = finished.clone();
                        batch.iter().for_each(|_| guard.job_started());
                        if shared.config.budget.cold_renders {
                            // This job's render gives its arenas back at its end: the next starts cold.
                            shared.pipeline().request_arena_shrink();
                        }
                        tracker.spawn(async move {
                            match <[_; 1]>::try_from(batch) {
                                Ok([delivery]) => job::handle(shared, delivery).await,
                                Err(batch) => group::handle(shared, batch).await,
                            }
                            drop(permit);
                            finished.notify_one();
                        });
                    }
                    let idle_worker = free == shared.config.concurrency;
                    if fetched_none
                        && idle_worker
                        && !shrunk_for_room
                        && shared.budget.shrinking_opens(&shared.config.classes).unwrap_or(true)
                    {
                        // Nothing runs, the classes that fit have nothing queued, and a class this
                        // worker serves is kept out by arena cache of earlier renders, which the
                        // room does not count as free (and which keeps the card above
                        // `stop_fetch_at` on a crowded card). Give it back, then look again at
                        // once. Before, the leak guard's idle shrink (every `check_every`)
                        // unblocked such a worker: on the 2026-11-30 lease a minute per large
                        // job, once the small ones were done.
                        shrunk_for_room = true;
                        info!(fitting = ?admission.classes(), "a class does not fit while idle; shrinking the arenas");
                        shrink_arenas(shared).await;
                        worked = true;
                    }
                }
                Err(e) => {
                    let driver = e.nvml_error().map(crate::failure::classify_nvml) == Some(crate::failure::ErrorKind::DriverFault);
                    if driver {
                        shared.driver_fault(None, &format!("NVML: {e}")).await;
                        break;
                    }
                    warn!(error = %e, "cannot read the GPU; not fetching");
                }
            }
        }

        if worked {
            idle = base_idle;
            continue;
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = finished.notified() => {}
            () = tokio::time::sleep(idle) => idle = (idle * 2).min(base_idle * 10),
        }
    }
}

/// Gives the arenas' free regions back to the device (a one-step tiny render, see
/// [`Pipeline::shrink_arenas`](crate::pipeline::Pipeline::shrink_arenas)); the next budget query
/// reads the card afresh.
pub(crate) async fn shrink_arenas(shared: &Arc<Shared>) {
    let pipeline = shared.pipeline();
    match tokio::task::spawn_blocking(move || pipeline.shrink_arenas()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "arena shrink failed"),
        Err(e) => warn!(error = %e, "arena shrink task failed"),
    }
    shared.budget.refresh();
}

/// NVML's critical events (XID, double-bit ECC) become driver faults as soon as they arrive.
fn watch_driver_events(shared: &Arc<Shared>, gpu: u32, stop: Arc<std::sync::atomic::AtomicBool>) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    match crate::budget::watch_critical_events(gpu, stop, move |what| {
        let _ = tx.send(what);
    }) {
        Ok(_) => {
            let shared = shared.clone();
            tokio::spawn(async move {
                if let Some(what) = rx.recv().await {
                    shared.driver_fault(None, &what).await;
                }
            });
        }
        Err(e) => warn!(error = %e, "cannot watch NVML events"),
    }
}

fn export_budget(budget: &Budget) {
    if let Ok(status) = budget.status() {
        telemetry::budget(status.available, status.reserved);
        telemetry::gpu_memory(status.used, status.total);
        if let Some(utilization) = status.utilization {
            telemetry::gpu_utilization(utilization);
        }
    }
}
