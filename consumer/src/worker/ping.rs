//! Answers `shots.workers.ping` with this worker's [`WorkerState`]: what `shotfleet status`
//! shows of the fleet (also of idle workers, which send no progress events), and how it tells
//! that jobs wait in a class no live worker serves or can admit.

use std::sync::{Arc, OnceLock};

use futures::StreamExt;
use shotfleet_schema::progress::{GpuMemory, PING_SUBJECT, WorkerState};
use tracing::warn;

use crate::worker::Shared;
use crate::worker::commit::now_ms;
use crate::worker::restart::Starting;

/// Subscribes to pings.
///
/// # Errors
/// The subscription's failure.
pub async fn subscribe(client: &async_nats::Client) -> Result<async_nats::Subscriber, async_nats::SubscribeError> {
    client.subscribe(PING_SUBJECT).await
}

/// Whom a ping's answer describes: the worker starting, then, once it serves, the worker.
pub struct Answers {
    starting: Starting,
    serving: OnceLock<Arc<Shared>>,
}

impl Answers {
    pub fn starting(starting: Starting) -> Arc<Self> {
        Arc::new(Self { starting, serving: OnceLock::new() })
    }

    /// From now on pings hear the serving worker's state.
    pub fn serve(&self, shared: Arc<Shared>) {
        let _ = self.serving.set(shared);
    }

    fn state(&self) -> WorkerState {
        self.serving.get().map_or_else(|| self.starting.state(), |shared| state(shared))
    }
}

/// Answers pings until the subscription ends: from the start, so the fleet hears of a worker
/// loading its models (restart.rs), not only of one serving.
pub fn listen(client: async_nats::Client, answers: Arc<Answers>, mut pings: async_nats::Subscriber) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(ping) = pings.next().await {
            let Some(to) = ping.reply else { continue };
            let payload = serde_json::to_vec(&answers.state()).expect("states serialize");
            if let Err(e) = client.publish(to, payload.into()).await {
                warn!(error = %e, "cannot answer a ping");
            }
        }
    })
}

/// Says so when a live worker already answers under `worker_id`: results and fault events name
/// their worker, and a worker tells its own claims from another's by its id, so two of one id
/// mix them up (two CPU workers on one host both default to `<host>/cpu`). A warning, not a
/// refusal: a worker restarting beside its draining predecessor is the same worker.
pub async fn warn_of_a_namesake(client: &async_nats::Client, worker_id: &str) {
    let Ok(states) = shotfleet_schema::nats::ping::ping(client, NAMESAKE_WAIT).await else { return };
    if states.iter().any(|state| state.worker == worker_id) {
        warn!(
            worker = worker_id,
            "another live worker answers under this worker_id; give each worker its own (worker_id, SHOTFLEET_WORKER_ID, --worker-id)"
        );
    }
}

/// How long the start-up ping waits for answers (a live worker answers within milliseconds).
const NAMESAKE_WAIT: std::time::Duration = std::time::Duration::from_millis(300);

/// This worker now.
pub fn state(shared: &Shared) -> WorkerState {
    let classes = &shared.config.classes;
    let status = shared.budget.status().ok();
    WorkerState {
        v: shotfleet_schema::VERSION,
        worker: shared.config.worker_id.clone(),
        device: shared.device_name.clone(),
        serves: classes.to_vec(),
        admits: shared.admits(),
        gpu: status.as_ref().map_or_else(GpuMemory::default, |s| GpuMemory { used_bytes: s.used, total_bytes: s.total, budget_bytes: s.budget }),
        // Every job it holds, fetched and not settled, reserved ones too: a worker between two
        // renders, its next job dealt, is not idle (tail.rs asks who is).
        in_flight: u32::try_from(crate::telemetry::jobs_in_flight()).unwrap_or(u32::MAX),
        taking_jobs: !shared.stop.is_cancelled(),
        starting: false,
        at_ms: now_ms(),
    }
}
