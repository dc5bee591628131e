//! The safety net for jobs that died on their last delivery.
//!
//! A worker that fails a job on its last allowed delivery writes the failed record itself. But a
//! job whose last delivery ended in a crash (SIGKILL, a lost node) is never redelivered and never
//! recorded: the server only emits a `MAX_DELIVERIES` advisory (with the stream sequence, no
//! payload) and leaves the message in the work-queue stream. Every worker listens; the first to
//! act fails the job as a worker would (failed record with reason `max_deliveries`, message id
//! `<job>:failed:<seq>` so a second worker's copy is a duplicate, the job's `failed` outcome,
//! the sweep of what its dead attempts uploaded) and only then deletes it from the work stream.
//! A job that a live worker settled meanwhile keeps that worker's outcome. NATS-NOTES: the
//! advisory is emitted when a later pull arrives, which a running fleet always makes.

use std::sync::Arc;
use std::time::SystemTime;

use futures::StreamExt;
use serde::Deserialize;
use shotfleet_schema::encoding;
use shotfleet_schema::failure::FailureReason;
use shotfleet_schema::subject;

use crate::worker::Shared;
use crate::worker::commit::{self, Standing};
use crate::worker::failed::{self, Case, Recorded};

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
    tracing::info!(seq = advisory.stream_seq, deliveries = advisory.deliveries, "a job reached its consumer's max deliveries");
    let Ok(stream) = shared.js.get_stream(subject::JOBS_STREAM).await else { return };
    // Gone already: acked, terminated (with its record) or rescued by another worker.
    let Ok(message) = stream.get_raw_message(advisory.stream_seq).await else {
        tracing::debug!(seq = advisory.stream_seq, "already settled");
        return;
    };
    let content_type = shotfleet_schema::nats::content_type(&message.headers);
    let job = encoding::decode_job(content_type.as_deref(), &message.payload).ok();
    let published: SystemTime = message.time.into();
    let mut case = Case {
        payload: message.payload.clone(),
        content_type: content_type.as_deref(),
        original_subject: message.subject.as_str(),
        stream_sequence: advisory.stream_seq,
        deliveries: advisory.deliveries,
        queued: SystemTime::now().duration_since(published).unwrap_or_default(),
        job: job.as_ref(),
        last_outcome: 0,
        failed_records: Vec::new(),
    };
    if let Some(ids) = case.ids() {
        match commit::standing(shared, &ids.project, &ids.job_id, advisory.stream_seq, published).await {
            Ok(Standing::Settled(_)) => {
                remove(&stream, advisory.stream_seq, &ids.job_id, "job past max deliveries already has its outcome; removed").await;
                return;
            }
            Ok(Standing::Open { last, records }) => (case.last_outcome, case.failed_records) = (last, records),
            Err(e) => {
                tracing::warn!(seq = advisory.stream_seq, error = %e, "cannot rescue a job past max deliveries now; it stays in the stream");
                return;
            }
        }
    }
    let detail = format!(
        "no worker settled it in {} deliveries, the consumer's max_deliver (workers died on it, or gave it back each time)",
        advisory.deliveries
    );
    let job_id = job.as_ref().map_or("?", |j| j.job_id.as_str());
    match failed::record(shared, &case, FailureReason::MaxDeliveries, &detail, advisory.deliveries).await {
        Recorded::Failed => remove(&stream, advisory.stream_seq, job_id, "job past max deliveries moved to the failed stream").await,
        Recorded::SettledBy(_) => remove(&stream, advisory.stream_seq, job_id, "job past max deliveries was settled meanwhile; removed").await,
        Recorded::NotStored(e) => {
            tracing::warn!(seq = advisory.stream_seq, error = %e, "could not record a job past max deliveries; it stays in the stream");
        }
    }
}

async fn remove(stream: &async_nats::jetstream::stream::Stream, sequence: u64, job_id: &str, what: &str) {
    match stream.delete_message(sequence).await {
        Ok(_) => tracing::warn!(job = job_id, seq = sequence, "{what}"),
        Err(e) => tracing::debug!(seq = sequence, error = %e, "already removed"),
    }
}
