//! The worker loop: admit -> fetch -> decode/validate -> render -> upload -> publish result -> ack.
//!
//! [`run`] starts everything in order (telemetry, NATS, store, models and calibration), then
//! loops: ask the budget what fits, fetch that much in priority order, hand each job to its own
//! task ([`job::handle`]), until the shutdown future resolves. Then it stops fetching, gives
//! in-flight jobs the grace period, cancels what is left (naked at once, so other workers take
//! it) and drains the connection.
//!
//! - [`startup`]: load, calibrate, fitness render;
//! - [`fetch`]: which consumers, how many jobs, in which order ([`priority`]);
//! - [`job`]: one job's steps; [`commit`]: the result as the commit point;
//! - [`route`]: `auto` and wrong-class jobs; [`failed`]: failed records;
//! - [`delivery`]: a fetched message and its acks.

pub mod commit;
pub mod delivery;
pub mod failed;
pub mod fetch;
pub mod job;
pub mod priority;
pub mod route;
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
}

impl WorkerError {
    fn start(step: &str, e: impl std::fmt::Display) -> Self {
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
    /// Measures each render's peak for the budget to learn from (one at a time: with
    /// `concurrency > 1` renders overlap and are not measured).
    pub meter: Option<Arc<crate::budget::PeakMeter>>,
    pub pipeline: Arc<Pipeline>,
    /// The device's name as the probe reports it (`NVIDIA H200`, `simulated (cpu)`).
    pub device_name: String,
    /// How often a job in progress sends `AckKind::Progress`.
    pub progress_interval: Duration,
    /// The consumers' `max_deliver`: the attempt at which a failing job goes to the failed stream.
    pub max_deliver: u64,
    /// Cancelled when the grace period is over: renders stop and their jobs are naked.
    pub abort: CancellationToken,
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
    let mut consumers =
        fetch::Consumers::bind(&jobs_stream, &config.classes).await.map_err(|e| WorkerError::start("bind consumers", e))?;
    let (ack_wait, max_deliver) = consumers.limits().await.map_err(|e| WorkerError::start("read consumer limits", e))?;
    let store = Store::connect(&config.store, env).await.map_err(|e| WorkerError::start("open the object store", e))?;

    health.set_not_ready("loading models and calibrating");
    let ready = startup::prepare(&config).await.map_err(|e| {
        health.set_not_ready(e.to_string());
        e
    })?;
    let device_name = ready.probe.snapshot().map(|s| s.device).unwrap_or_else(|_| "unknown".into());
    let progress_interval = config.progress_interval.map(|s| s.0).unwrap_or(ack_wait / 3).max(Duration::from_millis(100));
    let meter = (config.concurrency == 1).then_some(ready.meter);
    let shared = Arc::new(Shared {
        config,
        js,
        results,
        store,
        budget: ready.budget,
        meter,
        pipeline: ready.pipeline,
        device_name,
        progress_interval,
        max_deliver,
        abort: CancellationToken::new(),
    });
    health.set_ready();
    info!(worker = %shared.config.worker_id, classes = ?shared.config.classes, "taking jobs");

    let tracker = TaskTracker::new();
    fetch_loop(&shared, &consumers, &tracker, &stop).await;

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
    if let Err(e) = client.drain().await {
        warn!(error = %e, "draining the NATS connection failed");
    }
    let _ = telemetry_server.stopped().await;
    info!("stopped");
    Ok(())
}

/// The loop: admit, fetch, hand out; sleep a little when there is nothing to do.
async fn fetch_loop(shared: &Arc<Shared>, consumers: &fetch::Consumers, tracker: &TaskTracker, stop: &CancellationToken) {
    let slots = Arc::new(Semaphore::new(shared.config.concurrency));
    let finished = Arc::new(Notify::new());
    let mut scheduler = priority::Scheduler::new(&shared.config.priorities, Instant::now());
    let base_idle = shared.config.idle_poll.0;
    let mut idle = base_idle;

    while !stop.is_cancelled() {
        let mut worked = false;
        for delivery in consumers.next_unrouted(16).await {
            worked = true;
            tracker.spawn(job::handle(shared.clone(), delivery));
        }

        let free = slots.available_permits();
        if free > 0 {
            export_budget(&shared.budget);
            match shared.budget.admit(&shared.config.classes) {
                Ok(admission) if !admission.classes().is_empty() => {
                    for delivery in consumers.next_jobs(&admission, free, &mut scheduler).await {
                        worked = true;
                        let permit = slots.clone().try_acquire_owned().expect("a slot was counted free");
                        let shared = shared.clone();
                        let finished = finished.clone();
                        tracker.spawn(async move {
                            job::handle(shared, delivery).await;
                            drop(permit);
                            finished.notify_one();
                        });
                    }
                }
                Ok(_) => {}
                Err(e) => warn!(error = %e, "cannot read the GPU; not fetching"),
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

fn export_budget(budget: &Budget) {
    if let Ok(status) = budget.status() {
        telemetry::budget(status.available, status.reserved);
        telemetry::gpu_memory(status.used, status.total);
        if let Some(utilization) = status.utilization {
            telemetry::gpu_utilization(utilization);
        }
    }
}
