//! The safety net for jobs that died on their last delivery.
//!
//! A worker that fails a job on its last allowed delivery writes the failed record itself. But a
//! job whose last delivery ended in a crash (SIGKILL, a lost node) is never redelivered and never
//! recorded: the server only emits a `MAX_DELIVERIES` advisory (with the stream sequence, no
//! payload) and leaves the message in the work-queue stream. Every worker listens; the first to
//! act copies the message into the failed stream (reason `max_deliveries`, message id
//! `<job>:failed:<seq>`, so a second worker's copy is a duplicate) and only then deletes it
//! from the work stream. NATS-NOTES: the advisory is emitted when a later pull arrives, which a
//! running fleet always makes.

use std::sync::Arc;

use futures::StreamExt;
use serde::Deserialize;
use shotfleet_schema::encoding;
use shotfleet_schema::failure::FailureReason;
use shotfleet_schema::subject;

use crate::worker::failed::{self, Record};
use crate::worker::Shared;

#[derive(Deserialize)]
struct MaxDeliveries {
    stream_seq: u64,
    deliveries: u64,
}

/// Subscribes to the jobs stream's max-delivery advisories.
///
/// # Errors
/// The subscription could not be made.
pub async fn subscribe(client: &async_nats::Client) -> Result<async_nats::Subscriber, String> {
    let subject = format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.*", subject::JOBS_STREAM);
    client.subscribe(subject).await.map_err(|e| e.to_string())
}

/// Handles advisories until the connection closes.
pub fn listen(shared: Arc<Shared>, mut advisories: async_nats::Subscriber) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(message) = advisories.next().await {
            match serde_json::from_slice::<MaxDeliveries>(&message.payload) {
                Ok(advisory) => rescue(&shared, advisory).await,
                Err(e) => tracing::warn!(error = %e, "unreadable max-deliveries advisory"),
            }
        }
    })
}

async fn rescue(shared: &Shared, advisory: MaxDeliveries) {
    let Ok(stream) = shared.js.get_stream(subject::JOBS_STREAM).await else { return };
    // Gone already: acked, terminated (with its record) or rescued by another worker.
    let Ok(message) = stream.get_raw_message(advisory.stream_seq).await else { return };
    let content_type = message.headers.get(encoding::HEADER).map(|v| v.as_str().to_owned());
    let job_id = encoding::decode_job(content_type.as_deref(), &message.payload).ok().map(|job| job.job_id);
    let record = Record {
        payload: message.payload.clone(),
        content_type,
        original_subject: message.subject.as_str(),
        attempts: advisory.deliveries,
        job_id: job_id.as_deref(),
        stream_sequence: advisory.stream_seq,
    };
    let detail = format!("no worker finished it in {} deliveries (the last one ended without an answer)", advisory.deliveries);
    if let Err(e) = failed::publish(shared, &record, FailureReason::MaxDeliveries, &detail).await {
        tracing::warn!(seq = advisory.stream_seq, error = %e, "could not record a job past max deliveries; it stays in the stream");
        return;
    }
    match stream.delete_message(advisory.stream_seq).await {
        Ok(_) => tracing::warn!(job = job_id.as_deref().unwrap_or("?"), seq = advisory.stream_seq, "job past max deliveries moved to the failed stream"),
        Err(e) => tracing::debug!(seq = advisory.stream_seq, error = %e, "already removed"),
    }
}
