//! The state of the queues, per priority and class: pending, in progress, oldest age; failed.

use std::time::{Duration, SystemTime};

use async_nats::jetstream;
use async_nats::jetstream::stream::RawMessageErrorKind;
use futures::StreamExt;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::subject;

/// One (priority, class) consumer's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueStatus {
    pub consumer: String,
    /// Jobs not yet delivered.
    pub pending: u64,
    /// Jobs delivered and not yet acked: being rendered (or about to be redelivered).
    pub in_progress: u64,
    /// Jobs redelivered at least once.
    pub redelivered: u64,
    /// Age of the oldest job still in the queue (pending or in progress).
    pub oldest: Option<Duration>,
}

/// Everything `shotfleet status` prints.
#[derive(Debug, Clone, Default)]
pub struct Status {
    pub queues: Vec<QueueStatus>,
    /// Failed records per subject (`shots.failed.<prio>.<project>`).
    pub failed: Vec<(String, u64)>,
    pub results: u64,
}

/// Reads the state from the server. Consumer info is recomputed by the server on each call
/// (NATS-NOTES), so this is for people and dashboards, not for per-job polling.
///
/// # Errors
/// The server's answer as text when a stream or consumer cannot be read (run `shotfleet setup`).
pub async fn read(js: &jetstream::Context) -> Result<Status, String> {
    let jobs = js.get_stream(subject::JOBS_STREAM).await.map_err(|e| missing(subject::JOBS_STREAM, e))?;
    let mut status = Status::default();
    // The oldest job's age reads a job from the stream, which a producer's permissions refuse
    // (another project's prompt); after one refusal the column stays empty instead of waiting
    // out a refusal per consumer.
    let mut oldest_readable = true;
    for config in Topology::default().consumers() {
        let name = config.durable_name.clone().unwrap_or_default();
        let mut consumer = jobs
            .get_consumer::<jetstream::consumer::pull::Config>(&name)
            .await
            .map_err(|e| missing(&name, e))?;
        let info = consumer.info().await.map_err(|e| e.to_string())?;
        let waiting = info.num_pending + info.num_ack_pending as u64 > 0;
        let oldest = if waiting && oldest_readable {
            match jobs.get_first_raw_message_by_subject(&config.filter_subject, 1).await {
                Ok(m) => SystemTime::now().duration_since(m.time.into()).ok(),
                Err(e) => {
                    oldest_readable = matches!(e.kind(), RawMessageErrorKind::NoMessageFound);
                    None
                }
            }
        } else {
            None
        };
        status.queues.push(QueueStatus {
            consumer: name,
            pending: info.num_pending,
            in_progress: info.num_ack_pending as u64,
            redelivered: info.num_redelivered as u64,
            oldest,
        });
    }
    let failed = js.get_stream(subject::FAILED_STREAM).await.map_err(|e| missing(subject::FAILED_STREAM, e))?;
    let subjects = failed
        .info_with_subjects(format!("{}.failed.>", subject::ROOT))
        .await
        .map_err(|e| e.to_string())?;
    let mut subjects: Vec<(String, u64)> = subjects
        .filter_map(|s| async move { s.ok().map(|(subject, n)| (subject, n as u64)) })
        .collect()
        .await;
    subjects.sort();
    status.failed = subjects;
    let mut results = js.get_stream(subject::RESULTS_STREAM).await.map_err(|e| missing(subject::RESULTS_STREAM, e))?;
    status.results = results.info().await.map_err(|e| e.to_string())?.state.messages;
    Ok(status)
}

fn missing(what: &str, e: impl std::fmt::Display) -> String {
    format!("cannot read {what}: {e} (has `shotfleet setup` been run against this server?)")
}
