//! Failed records: the job's original payload, published to `shots.failed.<prio>.<project>` with
//! the reason in headers, then the job is terminated. Replay reads them back.

use async_nats::HeaderMap;
use shotfleet_schema::failure::{self, FailureReason};
use shotfleet_schema::subject;

use crate::worker::delivery::Delivery;
use crate::worker::Shared;

/// Publishes the failed record and, once the server has it, terminates the job.
/// `job_id` is `None` when the payload could not be decoded.
pub async fn fail(shared: &Shared, delivery: &Delivery, job_id: Option<&str>, reason: FailureReason, detail: &str) {
    let project = delivery.subject_project();
    let mut headers = HeaderMap::new();
    if let Some(ct) = delivery.content_type() {
        headers.insert(failure::CONTENT_TYPE, ct.as_str());
    }
    headers.insert(failure::REASON, reason.as_str());
    headers.insert(failure::DETAIL, failure::header_safe(detail).as_str());
    headers.insert(failure::ORIGINAL_SUBJECT, delivery.subject());
    headers.insert(failure::ATTEMPTS, delivery.attempt.to_string().as_str());
    headers.insert(failure::WORKER, shared.config.worker_id.as_str());
    let id = match job_id {
        Some(job_id) => {
            headers.insert(failure::JOB_ID, job_id);
            subject::msg_id::failed(job_id, delivery.stream_sequence)
        }
        None => format!("seq-{}:failed", delivery.stream_sequence),
    };
    headers.insert("Nats-Msg-Id", id.as_str());
    let target = subject::failed(delivery.origin.priority, &project);
    let published = match shared.js.publish_with_headers(target, headers, delivery.message.payload.clone()).await {
        Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match published {
        Ok(()) => {
            tracing::warn!(job = job_id.unwrap_or("?"), reason = reason.as_str(), detail, "job failed");
            delivery.term().await;
        }
        Err(e) => {
            // Without the record the job must not vanish: give it back.
            tracing::error!(job = job_id.unwrap_or("?"), error = %e, "failed record not stored; naking");
            delivery.nak(Some(std::time::Duration::from_secs(5))).await;
        }
    }
}
