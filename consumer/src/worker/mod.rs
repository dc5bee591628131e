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
//! - [`fetch`]: which consumers, how many jobs, in which order ([`priority`]); [`reserve`]:
//!   jobs fetched ahead, dealt to the free slots by priority with their batch partners;
//! - [`job`]: one job's steps: take, [`render`] (with the in-place ladder and the time limit),
//!   upload and [`commit`] (the outcome as the commit point), then [`settle`], the one place
//!   that decides ack, nak, term, degrade ([`degrade`]) or stopping the worker;
//! - [`group`]: compatible jobs rendered in shared batches;
//! - [`lora`]: a job's LoRA set, from the library through the pool to the render;
//! - [`route`]: `auto` and wrong-class jobs; [`failed`]: failed records; [`advisory`]: jobs
//!   that died on their last delivery; [`attempts`]: failed attempts per job message;
//! - [`delivery`]: a fetched message, its acks and its keep-alive.
//! - [`progress`]: a held job's progress events; [`watch`]: stops a held job's work when an
//!   outcome settles it elsewhere; [`cancel`]: answers cancel requests; [`ping`]: answers
//!   `shots.workers.ping` with this worker's state; [`backlog`]: the served consumers' backlog
//!   as a metric.

pub mod advisory;
pub mod attempts;
pub mod backlog;
pub mod cancel;
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
pub mod lora;
pub mod ping;
pub mod priority;
pub mod progress;
pub mod render;
pub mod reserve;
pub mod restart;
pub mod route;
pub mod run_thread;
pub mod settle;
pub mod serving;
pub mod startup;
pub mod tail;
pub mod unserved;
pub mod watch;

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
    #[error("{}", crate::failure::cannot(step, detail))]
    Start { step: String, detail: String },
    /// The GPU or its driver failed; the process must be restarted (`EXIT_DRIVER_FAULT`).
    #[error("driver fault: {0}")]
    DriverFault(String),
    /// Memory crept up and survived a session rebuild; restart the process (`EXIT_RESTART`).
    #[error("restart needed: {0}")]
    Restart(String),
    /// The object store refuses for good; fix it, then restart (`EXIT_STORE`).
    #[error("the object store is unusable: {0}")]
    StoreUnusable(String),
    /// The card holds none of the classes the worker may serve (`EXIT_NOTHING_FITS`): it needs a larger
    /// card or share, fewer other processes on it, other classes, or smaller weights.
    #[error(
        "this card holds nothing this worker may serve; give it a larger card or `[budget] max_mib`, move other processes off the card, or change `classes`: {0}"
    )]
    NothingFits(String),
    /// The model folder itself is wrong (a file missing, a JSON or graph not as the pipeline
    /// needs): like a bad configuration, no restart mends it (`EXIT_CONFIG`).
    #[error("cannot load the model: {0}; fix the model folder, then start the worker again")]
    Model(String),
}

impl WorkerError {
    /// A card that holds nothing beside a float UNet may hold work beside a packed one: the
    /// way out that needs no other card, named where it applies.
    pub(crate) fn with_weights_hint(self, unet_packed: bool) -> Self {
        match self {
            Self::NothingFits(detail) if !unet_packed => Self::NothingFits(format!(
                "{detail}; or serve the model with its UNet's weights packed into 4 bits (onnx/quantize_unet.py), which leaves the renders about 3 GB more of an SDXL card"
            )),
            other => other,
        }
    }

    /// The exit code for the supervisor.
    pub fn exit_code(&self) -> i32 {
        use crate::failure::{EXIT_CONFIG, EXIT_DRIVER_FAULT, EXIT_NOTHING_FITS, EXIT_RESTART, EXIT_START, EXIT_STORE};
        match self {
            Self::Start { .. } => EXIT_START,
            Self::DriverFault(_) => EXIT_DRIVER_FAULT,
            Self::Restart(_) => EXIT_RESTART,
            Self::StoreUnusable(_) => EXIT_STORE,
            Self::NothingFits(_) => EXIT_NOTHING_FITS,
            Self::Model(_) => EXIT_CONFIG,
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
    /// Failed attempts per job message.
    pub attempts: attempts::Attempts,
    /// What `/readyz` says.
    pub health: Health,
    /// The consumers' `max_deliver`: a job failing on that delivery is not delivered again, so
    /// it is failed at once whatever its count of failed attempts.
    pub max_deliver: u64,
    pub budget: Budget,
    /// The LoRA library and the pool of merged sets (a line of the budget).
    pub loras: lora::Loras,
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
    /// The model as loaded at start (a rebuild loads the same folder): read without the
    /// pipeline, which a rebuild takes out for a while.
    pub model: crate::pipeline::ModelInfo,
    /// How often a job in progress sends `AckKind::Progress`.
    pub progress_interval: Duration,
    /// Cancelled when the grace period is over: renders stop and their jobs are naked.
    pub abort: CancellationToken,
    /// Cancelled to stop fetching: shutdown, a driver fault, a restart.
    pub stop: CancellationToken,
    /// Rendered jobs being uploaded and committed, `concurrency` at most: a job gives its render
    /// slot back once it holds one of these, so the next render starts while it uploads.
    pub commits: Arc<Semaphore>,
    /// The jobs (`project/job_id`) this worker holds a delivery of: a second delivery of one
    /// (redelivered while the first is still here, or the job published twice) is given back
    /// for another worker rather than rendered beside it.
    pub held: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// Consumers this worker leaves to the fleet for a moment after giving one of their jobs
    /// back (fetch.rs).
    pub hold_off: fetch::HoldOff,
    /// Why the worker must exit with a non-zero code, once known.
    exit: std::sync::Mutex<Option<WorkerError>>,
}

impl Shared {
    /// The classes it serves whose largest one-image job fits its budget when idle: what its
    /// pings answer, and what a restart holds (restart.rs).
    pub fn admits(&self) -> Vec<shotfleet_schema::MemoryClass> {
        self.budget.admits_when_idle(&self.config.classes).unwrap_or_default()
    }

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

    /// How often a held job tells the server it is alive; `None` while fault injection stalls
    /// publishes (the server must then redeliver).
    pub fn keep_alive_interval(&self) -> Option<Duration> {
        self.config.faults.stall().is_none().then_some(self.progress_interval)
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

    /// The object store refuses for good: stop fetching, give every job back at once (they are
    /// fine; a healthy worker renders them), say why on `/readyz`, exit with `EXIT_STORE`.
    pub async fn store_unusable(&self, detail: &str) {
        tracing::error!(detail, "the object store refuses for good: stopping this worker");
        self.health.set_not_ready(format!("object store unusable: {detail}"));
        self.set_exit(WorkerError::StoreUnusable(detail.to_owned()));
        self.stop.cancel();
        self.abort.cancel();
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
    // Served until the worker exits, the drain included: a liveness probe must not see a
    // draining worker as dead, nor Prometheus lose the drain.
    let exited = CancellationToken::new();
    let server_stop = exited.clone();
    let telemetry_server = telemetry::serve(config.metrics_addr(), metrics, health.clone(), async move {
        server_stop.cancelled().await;
    })
    .await
    .map_err(|e| WorkerError::start("serve metrics and health", e))?;
    info!(addr = %telemetry_server.local_addr(), "metrics and health listening");

    let client = config.nats.connect().await.map_err(|e| WorkerError::start("connect to NATS", e))?;
    health.watch_connection(client.clone());
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
    let cancels = cancel::subscribe(&client).await.map_err(|e| WorkerError::start("listen for cancel requests", e))?;
    let pings = ping::subscribe(&client).await.map_err(|e| WorkerError::start("listen for pings", e))?;
    ping::warn_of_a_namesake(&client, &config.worker_id).await;
    // Answered from here on: while this worker starts, the fleet leaves the classes it admitted
    // when it last served to it (restart.rs).
    let last_served = restart::LastServed::new(&config.state_dir, &config.worker_id);
    let held = last_served.take(&config.classes);
    let answers = ping::Answers::starting(restart::Starting::new(&config.worker_id, &config.classes, held, config.degrade.restart_grace));
    let _pings = ping::listen(client.clone(), answers.clone(), pings);
    let mut consumers =
        fetch::Consumers::bind(&jobs_stream, &config.classes, config.idle_poll).await.map_err(|e| WorkerError::start("bind consumers", e))?;
    let (ack_wait, max_deliver) = consumers.limits().await.map_err(|e| WorkerError::start("read consumer limits", e))?;
    let attempts = attempts::Attempts::open(&js).await.map_err(|e| WorkerError::start("open the attempts bucket", e))?;
    let lora_env = env.clone();
    // Refused for good (permissions, credentials, no bucket) at start as while serving: the same
    // exit, so a supervisor waits out its store backoff rather than restarting within seconds.
    let store = Store::connect(&config.store, env).await.map_err(|e| match e.kind() {
        crate::store::StoreErrorKind::Permanent => WorkerError::StoreUnusable(crate::failure::cannot("open the object store", &e.to_string())),
        _ => WorkerError::start("open the object store", e),
    })?;

    health.set_not_ready("loading models and calibrating");
    // Loading and calibrating take minutes on a card: a signal meanwhile ends the worker there
    // (it holds no job yet), rather than after the probes, past an orchestrator's grace. A probe
    // ends at its step; a session ONNX Runtime is building, when that returns.
    let ready = tokio::select! {
        ready = async {
            if let Some(wait) = config.faults.slow_start {
                tokio::time::sleep(wait).await;
            }
            startup::prepare(&config).await
        } => ready.inspect_err(|e| health.set_not_ready(e.to_string()))?,
        () = stop.cancelled() => {
            info!("stopped while loading models and calibrating");
            return Ok(());
        }
    };
    // Consumers were bound for every candidate class; from here on only those served are fetched.
    let config = serving::serve(config, &ready.classes, &health)
        .map_err(|e| e.with_weights_hint(ready.pipeline.info().unet_packed.is_some()))
        .inspect_err(|e| health.set_not_ready(e.to_string()))?;
    let unserved =
        unserved::Unserved::bind(&jobs_stream, &config.classes).await.map_err(|e| WorkerError::start("bind consumers", e))?;
    let device_name = ready.probe.snapshot().map(|s| s.device).unwrap_or_else(|_| "unknown".into());
    let progress_interval = config.progress_interval.unwrap_or(ack_wait / 3).max(Duration::from_millis(100));
    let meter = (config.concurrency == 1).then_some(ready.meter);
    let idle_room = ready.budget.status().map_or(0, |status| status.budget);
    let loras = lora::Loras::open(&config, lora_env, &ready.pipeline, idle_room).map_err(|e| WorkerError::start("open the LoRA library", e))?;
    ready.budget.count_line(loras.line());
    let config_concurrency = config.concurrency;
    let model = ready.pipeline.info().clone();
    let shared = Arc::new(Shared {
        config,
        js,
        results,
        store,
        attempts,
        health: health.clone(),
        max_deliver,
        budget: ready.budget,
        loras,
        probe: ready.probe,
        meter,
        pipeline: std::sync::RwLock::new(Some(ready.pipeline)),
        renders: std::sync::atomic::AtomicU32::new(0),
        device_name,
        model,
        progress_interval,
        abort: CancellationToken::new(),
        stop: stop.clone(),
        commits: Arc::new(Semaphore::new(config_concurrency)),
        held: Arc::default(),
        hold_off: fetch::HoldOff::default(),
        exit: std::sync::Mutex::new(None),
    });
    let _advisories = advisory::listen(shared.clone(), advisories);
    let _cancels = cancel::listen(shared.clone(), cancels);
    answers.serve(shared.clone());
    let _backlog = backlog::export(shared.clone());
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(gpu) = shared.config.gpu_index() {
        watch_driver_events(&shared, gpu, watching.clone());
    }
    health.set_ready();
    last_served.record(&shared.admits());
    info!(worker = %shared.config.worker_id, classes = %shared.config.classes, "taking jobs");

    let tracker = TaskTracker::new();
    let mut guard = leak::LeakGuard::new(&shared).await;
    let _unserved = unserved.watch(shared.clone());
    fetch_loop(&shared, &consumers, &tracker, &mut guard).await;

    // Shutdown: no more fetching; in-flight jobs get the grace period, then are cancelled.
    health.set_draining();
    tracker.close();
    let grace = shared.config.grace_period;
    info!(in_flight = tracker.len(), grace_s = grace.as_secs_f64(), "stopping: finishing in-flight jobs");
    finish_in_flight(&tracker, grace, &shared.abort).await;
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
    // Bounded: with the server gone, a drain waits for it forever, and the process would keep
    // its GPU memory until NATS came back.
    match tokio::time::timeout(Duration::from_secs(10), client.drain()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "draining the NATS connection failed"),
        Err(_) => warn!("draining the NATS connection took over 10 s; exiting without it"),
    }
    // What it admits as it stops: a restart holds these (restart.rs).
    last_served.record(&shared.admits());
    exited.cancel();
    let _ = telemetry_server.stopped().await;
    match shared.take_exit() {
        Some(error) => Err(error),
        None => {
            info!("stopped");
            Ok(())
        }
    }
}

/// The loop: route, check for leaks while idle, admit and fetch, hand out; wait a little when
/// there was nothing to do.
async fn fetch_loop(shared: &Arc<Shared>, consumers: &fetch::Consumers, tracker: &TaskTracker, guard: &mut leak::LeakGuard) {
    let mut fetching = Fetching {
        shared,
        consumers,
        tracker,
        slots: Arc::new(Semaphore::new(shared.config.concurrency)),
        finished: Arc::new(Notify::new()),
        scheduler: priority::Scheduler::new(&shared.config.priorities, Instant::now()),
        reserve: reserve::Reserve::new(
            shared.config.lookahead(),
            shared.config.affinity_passes,
            shared.keep_alive_interval(),
            &shared.config.priorities,
            shared.config.job_time_limit,
        ),
        idle: shared.config.idle_poll,
        shrunk_for_room: false,
        routed_at: None,
        tail: tail::Tail::default(),
    };
    while !shared.stop.is_cancelled() {
        let routed = fetching.route().await;
        if fetching.all_slots_free()
            && let Err(error) = guard.check(shared).await
        {
            shared.set_exit(error);
            shared.stop.cancel();
            break;
        }
        let started = match fetching.admit_and_start(guard).await {
            Ok(started) => started,
            Err(Stop) => break,
        };
        fetching.tail.look(shared, &mut fetching.reserve).await;
        if routed || started {
            fetching.idle = shared.config.idle_poll;
        } else if fetching.wait().await.is_err() {
            break;
        }
    }
    // Stopping (or stopped by a fault): what waits for a slot goes back for other workers now.
    fetching.reserve.give_back_all().await;
}

/// The worker must stop fetching (a driver fault).
struct Stop;

/// A render slot of the fetch loop, held by a job from its start until its render ends (or
/// until it ends without one): dropping it frees the slot and wakes the loop to fill it.
pub(crate) struct Slot {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    finished: Arc<Notify>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The permit first: the loop, once woken, must find the slot free.
        self.permit.take();
        self.finished.notify_one();
    }
}

/// What the fetch loop keeps between rounds.
struct Fetching<'a> {
    shared: &'a Arc<Shared>,
    consumers: &'a fetch::Consumers,
    tracker: &'a TaskTracker,
    /// One permit per job (or group) rendering at once.
    slots: Arc<Semaphore>,
    /// Notified when a slot is given back.
    finished: Arc<Notify>,
    scheduler: priority::Scheduler,
    /// Jobs fetched and not yet dealt to a slot.
    reserve: reserve::Reserve,
    /// How long to wait when there was nothing to do: doubles up to ten times `idle_poll`.
    idle: Duration,
    /// Whether the arenas were shrunk since nothing last fitted: once per stall is enough.
    shrunk_for_room: bool,
    /// When the `auto` subjects were last found empty (`None`: look on the next round).
    routed_at: Option<Instant>,
    /// The end of a queue: what the reserve holds beyond its next groups goes to an idle worker.
    tail: tail::Tail,
}

impl Fetching<'_> {
    fn all_slots_free(&self) -> bool {
        self.slots.available_permits() == self.shared.config.concurrency
    }

    /// Hands jobs waiting on `auto` subjects to tasks of their own (routing needs no budget and
    /// no slot). Whether there were any. Once they are found empty they are looked at again
    /// after `idle_poll`, not on every round: a busy worker's rounds come one per job, and a
    /// pull on the `auto` consumer each time would be a server round trip per job for nothing.
    async fn route(&mut self) -> bool {
        if self.routed_at.is_some_and(|at| at.elapsed() < self.shared.config.idle_poll) {
            return false;
        }
        let deliveries = self.consumers.next_unrouted(16).await;
        let any = !deliveries.is_empty();
        self.routed_at = (!any).then(Instant::now);
        for delivery in deliveries {
            let kept = delivery::Kept::start(delivery, self.shared.keep_alive_interval());
            self.tracker.spawn(job::handle(self.shared.clone(), kept, None));
        }
        any
    }

    /// Asks the budget what fits, tops the reserve up in priority order, and deals each free
    /// slot one group (reserve.rs); shrinks the arenas once when an idle worker is kept out by
    /// its own arena cache, and gives back what it still cannot start. Whether anything started
    /// (or was shrunk: look again at once).
    async fn admit_and_start(&mut self, guard: &mut leak::LeakGuard) -> Result<bool, Stop> {
        let shared = self.shared;
        let free = self.slots.available_permits();
        if free == 0 {
            return Ok(false);
        }
        export_budget(&shared.budget);
        shared.loras.export();
        let admission = match shared.budget.admit(&shared.config.classes) {
            Ok(admission) => admission,
            Err(e) => {
                if e.nvml_error().map(crate::failure::classify_nvml) == Some(crate::failure::ErrorKind::DriverFault) {
                    shared.driver_fault(None, &format!("NVML: {e}")).await;
                    return Err(Stop);
                }
                warn!(error = %e, "cannot read the GPU; not fetching");
                // What waits here past its hold goes to workers that can read their card.
                let idle = self.all_slots_free();
                self.reserve.give_back_unstartable(None, idle, shared.max_deliver).await;
                return Ok(false);
            }
        };
        // Up to `batch_jobs` jobs per free slot: a slot renders one job, or one group of
        // compatible jobs in shared batches.
        let per_slot = shared.config.batch_jobs.max(1);
        // Taken before the fetch marks priorities served: an overdue one leads this round.
        let mut round = reserve::Round::new(self.scheduler.order(Instant::now()), &admission);
        let wanted = self.reserve.wanted(free, per_slot, &round);
        if wanted > 0 && !admission.classes().is_empty() {
            let fetched = self.consumers.next_jobs(&admission, wanted, &mut self.scheduler, &shared.hold_off).await;
            self.reserve.add(fetched);
        }
        if shared.stop.is_cancelled() {
            return Err(Stop);
        }
        let mut started = false;
        for _ in 0..free {
            let group = self.reserve.deal(per_slot, &mut round);
            if group.is_empty() {
                break;
            }
            group.iter().for_each(|_| guard.job_started());
            self.start(group);
            started = true;
        }
        if started {
            self.shrunk_for_room = false;
        } else if self.shrink_if_kept_out(&admission, free).await {
            return Ok(true);
        }
        // Idle, shrunk once, and nothing started: what waits cannot start on this card now.
        let idle = !started && self.all_slots_free();
        self.reserve.give_back_unstartable(Some(&admission), idle, shared.max_deliver).await;
        Ok(started)
    }

    /// Starts one job, or one group of jobs, in a slot of its own.
    fn start(&self, batch: Vec<delivery::Kept>) {
        let permit = self.slots.clone().try_acquire_owned().expect("a slot was counted free");
        if self.shared.config.budget.cold_renders {
            // This job's render gives its arenas back at its end: the next starts cold.
            self.shared.pipeline().request_arena_shrink();
        }
        let slot = Slot { permit: Some(permit), finished: self.finished.clone() };
        let shared = self.shared.clone();
        self.tracker.spawn(async move {
            match <[_; 1]>::try_from(batch) {
                Ok([delivery]) => job::handle(shared, delivery, Some(slot)).await,
                Err(batch) => group::handle(shared, batch, slot).await,
            }
        });
    }

    /// An idle worker that fetched nothing, whose own arena cache keeps a class it serves out
    /// (the room does not count cache as free, and it keeps a crowded card above
    /// `stop_fetch_at`), gives the cache back once and looks again at once. Whether it shrank.
    async fn shrink_if_kept_out(&mut self, admission: &crate::budget::Admission, free: usize) -> bool {
        let shared = self.shared;
        let idle_worker = free == shared.config.concurrency;
        if !idle_worker || self.shrunk_for_room || !shared.budget.shrinking_opens(&shared.config.classes).unwrap_or(true) {
            return false;
        }
        self.shrunk_for_room = true;
        info!(fitting = ?admission.classes(), "a class does not fit while idle; shrinking the arenas");
        shrink_arenas(shared).await;
        true
    }

    /// Waits for a slot to free up, the idle poll, or the stop; `Err` on the stop.
    async fn wait(&mut self) -> Result<(), Stop> {
        let base = self.shared.config.idle_poll;
        tokio::select! {
            () = self.shared.stop.cancelled() => return Err(Stop),
            () = self.finished.notified() => {}
            () = tokio::time::sleep(self.idle) => self.idle = (self.idle * 2).min(base * 10),
        }
        Ok(())
    }
}

/// Lets the closed `tracker`'s jobs finish within `grace`, then cancels what is left (their
/// renders stop and their jobs are given back) and waits for it. Whether it had to cancel.
async fn finish_in_flight(tracker: &TaskTracker, grace: Duration, abort: &CancellationToken) -> bool {
    tokio::select! {
        finished = tokio::time::timeout(grace, tracker.wait()) => {
            if finished.is_ok() {
                return false;
            }
            warn!(in_flight = tracker.len(), "grace period over: cancelling and naking the rest");
        }
        // An operator who signals again wants the worker gone now: its jobs go back at once.
        () = another_signal() => warn!(in_flight = tracker.len(), "signalled again: cancelling and naking the rest now"),
    }
    abort.cancel();
    tracker.wait().await;
    true
}

/// Resolves on a SIGTERM or SIGINT from now on (never, where they cannot be listened to).
async fn another_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
}

/// Gives the arenas' free regions back to the device (a one-step tiny render, see
/// [`Pipeline::shrink_arenas`](crate::pipeline::Pipeline::shrink_arenas)); the next budget query
/// reads the card afresh.
pub(crate) async fn shrink_arenas(shared: &Arc<Shared>) {
    let pipeline = shared.pipeline();
    match run_thread::waiting_on_run_threads(move || pipeline.shrink_arenas()).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A job that takes `took`, or stops early when the worker aborts.
    fn job(tracker: &TaskTracker, abort: &CancellationToken, took: Duration) -> Arc<std::sync::atomic::AtomicBool> {
        let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (abort, done) = (abort.clone(), finished.clone());
        tracker.spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(took) => done.store(true, std::sync::atomic::Ordering::SeqCst),
                () = abort.cancelled() => {}
            }
        });
        finished
    }

    #[tokio::test(start_paused = true)]
    async fn jobs_inside_the_grace_period_finish() {
        let (tracker, abort) = (TaskTracker::new(), CancellationToken::new());
        let finished = job(&tracker, &abort, Duration::from_secs(20));
        tracker.close();
        let started = tokio::time::Instant::now();
        assert!(!finish_in_flight(&tracker, Duration::from_secs(60), &abort).await);
        assert!(finished.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(started.elapsed(), Duration::from_secs(20));
        assert!(!abort.is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn jobs_past_the_grace_period_are_cancelled_at_its_end() {
        let (tracker, abort) = (TaskTracker::new(), CancellationToken::new());
        let quick = job(&tracker, &abort, Duration::from_secs(5));
        let long = job(&tracker, &abort, Duration::from_secs(600));
        tracker.close();
        let started = tokio::time::Instant::now();
        assert!(finish_in_flight(&tracker, Duration::from_secs(60), &abort).await);
        assert_eq!(started.elapsed(), Duration::from_secs(60), "cancelled when the grace period ends, not later");
        assert!(quick.load(std::sync::atomic::Ordering::SeqCst));
        assert!(!long.load(std::sync::atomic::Ordering::SeqCst));
        assert!(abort.is_cancelled());
    }

    #[test]
    fn a_start_error_says_its_step_once() {
        let twice = WorkerError::start("connect to NATS", "cannot connect to NATS at nats://h:4222: refused");
        assert_eq!(twice.to_string(), "cannot connect to NATS at nats://h:4222: refused");
        let once = WorkerError::start("open the object store", "bucket gone");
        assert_eq!(once.to_string(), "cannot open the object store: bucket gone");
    }
}
