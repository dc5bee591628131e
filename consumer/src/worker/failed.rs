//! Failed records: the job's original payload, published to `shots.failed.<prio>.<project>` with
//! the reason in headers. Replay reads them back.

use async_nats::HeaderMap;
use bytes::Bytes;
use shotfleet_schema::failure::{self, FailureReason};
use shotfleet_schema::subject::{self, Priority};

use crate::worker::delivery::Delivery;
use crate::worker::Shared;

/// What a failed record is made of.
pub struct Record<'a> {
    pub payload: Bytes,
    pub content_type: Option<String>,
    /// The subject the job was taken from: replay sends it back there.
    pub original_subject: &'a str,
    pub attempts: u64,
    /// `None` when the payload could not be decoded.
    pub job_id: Option<&'a str>,
    /// The job's sequence in the work stream: part of the record's message id.
    pub stream_sequence: u64,
}

impl Record<'_> {
    /// The failed subject: the original's priority and project (`unknown` when unparsable).
    fn subject(&self) -> String {
        match subject::parse_job(self.original_subject) {
            Ok(parsed) => subject::failed(parsed.priority, &parsed.project),
            Err(_) => subject::failed(Priority::P2, "unknown"),
        }
    }
}

/// Publishes a failed record and waits for the server to store it.
///
/// # Errors
/// The publish or its acknowledgement failed; the caller must keep the job.
pub async fn publish(shared: &Shared, record: &Record<'_>, reason: FailureReason, detail: &str) -> Result<(), String> {
    let mut headers = HeaderMap::new();
    if let Some(ct) = &record.content_type {
        headers.insert(failure::CONTENT_TYPE, ct.as_str());
    }
    headers.insert(failure::REASON, reason.as_str());
    headers.insert(failure::DETAIL, failure::header_safe(detail).as_str());
    headers.insert(failure::ORIGINAL_SUBJECT, record.original_subject);
    headers.insert(failure::ATTEMPTS, record.attempts.to_string().as_str());
    headers.insert(failure::WORKER, shared.config.worker_id.as_str());
    let id = match record.job_id {
        Some(job_id) => {
            headers.insert(failure::JOB_ID, job_id);
            subject::msg_id::failed(job_id, record.stream_sequence)
        }
        None => format!("seq-{}:failed", record.stream_sequence),
    };
    headers.insert("Nats-Msg-Id", id.as_str());
    shared
        .js
        .publish_with_headers(record.subject(), headers, record.payload.clone())
        .await
        .map_err(|e| e.to_string())?
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Publishes the failed record of a delivery and, once the server has it, terminates the job.
/// `job_id` is `None` when the payload could not be decoded.
pub async fn fail(shared: &Shared, delivery: &Delivery, job_id: Option<&str>, reason: FailureReason, detail: &str) {
    let record = Record {
        payload: delivery.message.payload.clone(),
        content_type: delivery.content_type(),
        original_subject: delivery.subject(),
        attempts: delivery.attempt,
        job_id,
        stream_sequence: delivery.stream_sequence,
    };
    match publish(shared, &record, reason, detail).await {
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
