//! Publishing shots: one message per job, `Nats-Msg-Id = <project>/<job_id>`, PubAcks awaited pipelined.
//!
//! Publishes go out without waiting for each acknowledgement; at most `max_in_flight` are
//! unacknowledged at once, which keeps the producer near the bare client's rate while bounding
//! memory and the server's pending acks. The stream's duplicate window makes a re-submission
//! of the same file queue nothing twice: the PubAck says `duplicate` and we count it.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::subject::{self, SubjectClass};

use crate::storyboard::Shot;

/// How to publish.
#[derive(Debug, Clone, Copy)]
pub struct SubmitOptions {
    /// Unacknowledged publishes at most.
    pub max_in_flight: usize,
    pub content_type: ContentType,
}

impl Default for SubmitOptions {
    fn default() -> Self {
        Self { max_in_flight: 256, content_type: ContentType::MessagePack }
    }
}

/// What a submission did.
#[derive(Debug, Default, Clone)]
pub struct SubmitSummary {
    /// Jobs the stream took for the first time.
    pub queued: usize,
    /// Jobs the stream already had inside its duplicate window, by key (`<project>/<job_id>`):
    /// nothing was queued for them.
    pub duplicates: Vec<String>,
    pub elapsed: Duration,
}

/// A publish the server did not acknowledge.
#[derive(Debug, thiserror::Error)]
#[error(
    "publishing job `{job_id}` (line {line}) failed: {detail}; jobs acknowledged before it are queued, \
     and submitting the file again is safe (duplicates are skipped)"
)]
pub struct SubmitError {
    pub job_id: String,
    pub line: usize,
    pub detail: String,
}

/// The subject, headers and payload of one shot.
pub fn message(shot: &Shot, content_type: ContentType) -> (String, PublishMessage) {
    let job = &shot.job;
    let subject = subject::job(shot.priority, SubjectClass::Class(job.class()), &job.project);
    let mut headers = HeaderMap::new();
    headers.insert(encoding::HEADER, content_type.as_str());
    let publish = PublishMessage::build()
        .headers(headers)
        .message_id(subject::msg_id::job(&job.project, &job.job_id))
        .payload(Bytes::from(encoding::encode(content_type, job)));
    (subject, publish)
}

/// What a refused publish means for the person submitting.
fn explain(subject: &str, error: &PublishError) -> String {
    let text = error.to_string();
    match error.kind() {
        PublishErrorKind::StreamNotFound => format!(
            "no stream takes subject `{subject}`: run `shotfleet setup` against this server (or `shotfleet setup --update` after an upgrade)"
        ),
        _ if text.contains("maximum bytes") || text.contains("maximum messages") => format!(
            "the job queue is full ({text}): wait for the fleet to catch up, or raise the queue's size with `shotfleet setup --jobs-max-bytes N --update`"
        ),
        _ => text,
    }
}

/// Publishes every shot and waits for every PubAck; `on_ack` is called once per shot.
///
/// # Errors
/// [`SubmitError`] for the first shot the server did not acknowledge.
pub async fn submit(
    js: &jetstream::Context,
    shots: &[Shot],
    options: SubmitOptions,
    mut on_ack: impl FnMut(&Shot, &PublishAck),
) -> Result<SubmitSummary, SubmitError> {
    let started = Instant::now();
    let mut summary = SubmitSummary::default();
    let mut in_flight = FuturesUnordered::new();
    let fail = |shot: &Shot, detail: String| SubmitError { job_id: shot.job.job_id.clone(), line: shot.line, detail };

    let mut settle = |index: usize, ack: Result<PublishAck, String>, summary: &mut SubmitSummary| {
        let shot: &Shot = &shots[index];
        let ack = ack.map_err(|detail| fail(shot, detail))?;
        if ack.duplicate {
            summary.duplicates.push(shot.job.key());
        } else {
            summary.queued += 1;
        }
        on_ack(shot, &ack);
        Ok::<_, SubmitError>(())
    };

    for (index, shot) in shots.iter().enumerate() {
        if in_flight.len() >= options.max_in_flight.max(1)
            && let Some((i, ack)) = in_flight.next().await
        {
            settle(i, ack, &mut summary)?;
        }
        let (subject, publish) = message(shot, options.content_type);
        let pending: PublishAckFuture =
            js.send_publish(subject.clone(), publish).await.map_err(|e| fail(shot, explain(&subject, &e)))?;
        in_flight.push(async move { (index, pending.await.map_err(|e| explain(&subject, &e))) });
    }
    while let Some((i, ack)) = in_flight.next().await {
        settle(i, ack, &mut summary)?;
    }
    summary.elapsed = started.elapsed();
    Ok(summary)
}
