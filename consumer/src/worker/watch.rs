//! Stops work on a held job as soon as an outcome that settles it lands on the job's result
//! subject: a cancellation (`shotfleet cancel`), or another worker's result. The render stops at
//! its next step (its cancel handle), and settle sweeps and acks against that outcome.
//!
//! A core subscription to `shots.done.<project>.<job_id>` sees every outcome as the stream
//! stores it; the outcome is then read back from the stream (sequence and stored time), since
//! only an outcome stored after the job message was published settles it (commit.rs).

use std::time::SystemTime;

use futures::StreamExt;
use shotfleet_schema::{ShotJob, subject};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::worker::Shared;
use crate::worker::commit::{self, Outcome};
use crate::worker::render::AbortOnDrop;

/// Watches one held job's result subject until dropped.
pub struct OutcomeWatch {
    /// Cancelled once an outcome settles the job.
    pub settled: CancellationToken,
    _task: Option<AbortOnDrop>,
}

/// A subscription to one job's result subject, made before the job's outcome is looked up at
/// its take: every outcome stored after that look-up arrives here.
pub struct Subscribed(Option<async_nats::Subscriber>);

impl OutcomeWatch {
    /// Subscribes to the job's result subject. Without a subscription (the server refused it)
    /// the job is only settled at its commit.
    pub async fn subscribe(shared: &Shared, job: &ShotJob) -> Subscribed {
        match shared.js.client().subscribe(subject::result(&job.project, &job.job_id)).await {
            Ok(subscription) => Subscribed(Some(subscription)),
            Err(e) => {
                warn!(job = %job.job_id, error = %e, "cannot watch the job's result subject; a cancel stops it only at its commit");
                Subscribed(None)
            }
        }
    }

    /// Starts watching for an outcome that settles the job message published at `published`,
    /// on a subscription made before the take looked the outcome up (so nothing stored since
    /// that look-up goes unseen, and it need not be repeated here).
    /// `stream_sequence` is the delivery's: the outcome this delivery itself commits (its result
    /// or its failure) ends the watch quietly.
    pub fn start(shared: &Shared, job: &ShotJob, published: SystemTime, stream_sequence: u64, subscribed: Subscribed) -> Self {
        let settled = CancellationToken::new();
        let Subscribed(Some(mut outcomes)) = subscribed else {
            return Self { settled, _task: None };
        };
        let (results, token) = (shared.results.clone(), settled.clone());
        let (project, job_id, worker) = (job.project.clone(), job.job_id.clone(), shared.config.worker_id.clone());
        let own = subject::msg_id::outcome(&job.job_id, stream_sequence);
        let task = tokio::spawn(async move {
            while let Some(message) = outcomes.next().await {
                // This delivery's own outcome, its result or its failure: the job ended here.
                if message.headers.as_ref().and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID)).is_some_and(|id| id.as_str() == own) {
                    return;
                }
                match commit::last_outcome_in(&results, &project, &job_id).await {
                    // This worker's own result: the job is done here, nothing to stop.
                    Ok(Some(outcome)) if outcome.result.is_rendered() && outcome.result.worker == worker => return,
                    Ok(Some(outcome)) if outcome.settles(published) => {
                        announce(&job_id, &outcome);
                        token.cancel();
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => warn!(job = %job_id, error = %e.detail, "cannot read the job's outcome"),
                }
            }
        });
        Self { settled, _task: Some(AbortOnDrop::new(task)) }
    }

    /// A watch that never fires (jobs that are not rendered).
    pub fn none() -> Self {
        Self { settled: CancellationToken::new(), _task: None }
    }
}

fn announce(job_id: &str, outcome: &Outcome) {
    let by = outcome.result.failure.as_ref().map_or("", |f| f.detail.as_str());
    info!(job = job_id, status = ?outcome.result.status, worker = %outcome.result.worker, by, "the job was settled elsewhere; stopping its work");
}
