//! Stops work on a held job as soon as an outcome that settles it lands on the job's result
//! subject: a cancellation (`shotfleet cancel`), or another worker's result. The render stops at
//! its next step (its cancel handle), and settle sweeps and acks against that outcome.
//!
//! A core subscription to `shots.done.<project>.<job_id>` sees every outcome as the stream
//! stores it; the outcome is then read back from the stream (sequence and stored time), since
//! only an outcome stored after the job message was published settles it (commit.rs).

use futures::StreamExt;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::{ShotJob, ShotResult, subject};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::worker::Shared;
use crate::worker::commit::{self, Outcome};
use crate::worker::delivery::Delivery;
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
    /// The outcome `delivery` itself commits (its result or its failure) ends the watch quietly.
    pub fn start(shared: &Shared, job: &ShotJob, delivery: &Delivery, subscribed: Subscribed) -> Self {
        let (sequence, published) = (delivery.stream_sequence, delivery.published);
        let settled = CancellationToken::new();
        let Subscribed(Some(mut outcomes)) = subscribed else {
            return Self { settled, _task: None };
        };
        let (results, token) = (shared.results.clone(), settled.clone());
        let (project, job_id, worker) = (job.project.clone(), job.job_id.clone(), shared.config.worker_id.clone());
        let own = Own { msg_id: subject::msg_id::outcome(&job.job_id, delivery.stream_sequence), worker: worker.clone(), attempt: delivery.attempt };
        let task = tokio::spawn(async move {
            while let Some(message) = outcomes.next().await {
                // This delivery's own outcome, its result or its failure: the job ended here.
                if own.is(&message) {
                    return;
                }
                match commit::last_outcome_in(&results, &project, &job_id).await {
                    // This worker's own result: the job is done here, nothing to stop.
                    Ok(Some(outcome)) if outcome.result.is_rendered() && outcome.result.worker == worker => return,
                    Ok(Some(outcome)) if outcome.settles(sequence, published) => {
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

/// Which outcome is a delivery's own: claimed under its job message's outcome id, by this
/// worker, at this delivery's attempt. The id alone is not enough: another worker's delivery
/// of the same message (a redelivery past `ack_wait`, the max-deliveries rescue) claims under
/// the same id, and that outcome must stop this render.
struct Own {
    msg_id: String,
    worker: String,
    attempt: u64,
}

impl Own {
    fn is(&self, message: &async_nats::Message) -> bool {
        let header = |name: &str| message.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.as_str().to_owned());
        if header("Nats-Msg-Id").as_deref() != Some(self.msg_id.as_str()) {
            return false;
        }
        let Ok(content_type) = ContentType::from_header(header(encoding::HEADER).as_deref()) else { return false };
        encoding::decode::<ShotResult>(content_type, &message.payload)
            .is_ok_and(|result| result.worker == self.worker && u64::from(result.attempt) == self.attempt)
    }
}

fn announce(job_id: &str, outcome: &Outcome) {
    let by = outcome.result.failure.as_ref().map_or("", |f| f.detail.as_str());
    info!(job = job_id, status = ?outcome.result.status, worker = %outcome.result.worker, by, "the job was settled elsewhere; stopping its work");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(msg_id: &str, worker: &str, attempt: u32) -> async_nats::Message {
        let result = serde_json::json!({
            "v": 1, "job_id": "j1", "project": "acme", "shot_id": "s1", "status": "failed", "images": [],
            "worker": worker, "device": "cpu", "attempt": attempt,
            "timing": {"queue_ms": 0, "render_ms": 0, "upload_ms": 0}, "finished_at_ms": 0
        });
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        let payload = bytes::Bytes::from(serde_json::to_vec(&result).unwrap());
        async_nats::Message {
            subject: "shots.done.acme.j1".into(),
            reply: None,
            length: payload.len(),
            payload,
            headers: Some(headers),
            status: None,
            description: None,
        }
    }

    #[test]
    fn only_this_deliverys_own_outcome_ends_the_watch_quietly() {
        let own = Own { msg_id: subject::msg_id::outcome("j1", 5), worker: "w1".into(), attempt: 2 };
        assert!(own.is(&outcome("j1:outcome:5", "w1", 2)));
        // Another worker's delivery of the same message claims under the same id: it settles the job.
        assert!(!own.is(&outcome("j1:outcome:5", "w2", 3)), "another worker");
        assert!(!own.is(&outcome("j1:outcome:5", "w1", 1)), "an earlier delivery here");
        assert!(!own.is(&outcome("acme/j1:cancel:0", "w1", 2)), "a cancellation");
    }
}
