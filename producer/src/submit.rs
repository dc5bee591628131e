//! Publishing shots: one message per job, `Nats-Msg-Id = <project>/<job_id>`, PubAcks awaited pipelined.
//!
//! Publishes go out without waiting for each acknowledgement; at most `max_in_flight` are
//! unacknowledged at once, which keeps the producer near the bare client's rate while bounding
//! memory and the server's pending acks. The stream's duplicate window makes a re-submission
//! of the same file queue nothing twice: the PubAck says `duplicate` and we count it, and read
//! the job's last outcome to say why (rendered, ended failed or cancelled, or still to come).
//! With `again`, a duplicate whose job ended failed or cancelled is queued again under a
//! message id of its own ([`subject::msg_id::again`]).

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::nats::outcome::{self, Outcome};
use shotfleet_schema::ShotJob;
use shotfleet_schema::subject::{self, SubjectClass};

use crate::storyboard::Shot;

/// How to publish.
#[derive(Debug, Clone, Copy)]
pub struct SubmitOptions {
    /// Unacknowledged publishes at most.
    pub max_in_flight: usize,
    pub content_type: ContentType,
    /// Queue again the duplicates whose job ended failed or cancelled.
    pub again: bool,
}

impl Default for SubmitOptions {
    fn default() -> Self {
        Self { max_in_flight: 256, content_type: ContentType::MessagePack, again: false }
    }
}

/// What a submission did.
#[derive(Debug, Default, Clone)]
pub struct SubmitSummary {
    /// Jobs the stream took for the first time.
    pub queued: usize,
    /// Jobs the stream already had inside its duplicate window, by key (`<project>/<job_id>`):
    /// nothing was queued for them (those queued again are in `again`).
    pub duplicates: Vec<String>,
    /// Of the duplicates: those already rendered (a job is never rendered twice under its id).
    pub rendered: Vec<String>,
    /// Of the duplicates: those whose job ended failed or cancelled (not queued again).
    pub ended: Vec<String>,
    /// Jobs whose duplicate ended failed or cancelled, queued again (`again`); by key.
    pub again: Vec<String>,
    /// Jobs `again` found queued again by an earlier `--again` (their copy still waits).
    pub again_before: Vec<String>,
    /// Of the duplicates: those whose state could not be read (the look-ups were refused or
    /// not answered, or an outcome does not say which request it settles). `again` leaves them.
    pub unknown: Vec<String>,
    /// Of the duplicates: those whose message is still queued (or being rendered), with when
    /// it was published. A failure before that is an earlier request's, not this one's fate (a
    /// server restart forgets the window of messages no longer stored, so a job failed before
    /// is queued again under its id).
    pub queued_at: HashMap<String, SystemTime>,
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
    message_with_id(shot, content_type, subject::msg_id::job(&shot.job.project, &shot.job.job_id))
}

fn message_with_id(shot: &Shot, content_type: ContentType, message_id: String) -> (String, PublishMessage) {
    let job = &shot.job;
    let subject = subject::job(shot.priority, SubjectClass::Class(job.class()), &job.project);
    let mut headers = HeaderMap::new();
    headers.insert(encoding::HEADER, content_type.as_str());
    let publish = PublishMessage::build().headers(headers).message_id(message_id).payload(Bytes::from(encoding::encode(content_type, job)));
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

/// Publishes every shot and waits for every PubAck; `on_ack` is called once per shot, with
/// the PubAck of the message that stands for it (for a job queued again, the new one's).
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
    let duplicates = publish_all(js, shots.iter().enumerate().map(|(i, shot)| (i, message(shot, options.content_type))), shots, options, |index, ack| {
        if ack.duplicate {
            return Some(ack);
        }
        summary.queued += 1;
        on_ack(&shots[index], &ack);
        None
    })
    .await?;
    // Why each duplicate was not queued: its message still queued (with when it was
    // published), or its job's last outcome.
    let queued_at = still_queued(js, duplicates.iter().map(|(i, ack)| (*i, ack.sequence)).collect()).await;
    let outcomes = last_outcomes(js, duplicates.iter().map(|(i, _)| (*i, &shots[*i].job)).collect()).await;
    let mut again = Vec::new();
    let mut kept = Vec::new();
    for (index, ack) in duplicates {
        let job = &shots[index].job;
        let last = outcomes.found.get(&index);
        // Whether the job's last failure or cancellation settled this message (or a later copy
        // of it): the outcome says which messages it settles; an older one that does not, the
        // jobs stream where this role may read it (the message is gone). `None`: neither says.
        let settled = |o: &Outcome| o.settles_through.map(|through| through >= ack.sequence).or(queued_at.answered.then_some(true));
        match last {
            Some(o) if o.result.is_rendered() => summary.rendered.push(job.key()),
            _ if queued_at.found.contains_key(&index) => {
                summary.queued_at.insert(job.key(), queued_at.found[&index]);
            }
            Some(o) => match settled(o) {
                Some(true) if options.again => {
                    let id = subject::msg_id::again(&job.project, &job.job_id, o.sequence);
                    again.push((index, message_with_id(&shots[index], options.content_type, id)));
                    continue;
                }
                Some(true) => summary.ended.push(job.key()),
                // An earlier request's outcome: this message is still to come.
                Some(false) => {}
                None => summary.unknown.push(job.key()),
            },
            None if outcomes.answered => {}
            None => summary.unknown.push(job.key()),
        }
        summary.duplicates.push(job.key());
        kept.push((index, ack));
    }
    publish_all(js, again.into_iter(), shots, options, |index, ack| {
        let key = shots[index].job.key();
        // Asked again while the first copy waits: the server keeps one.
        if ack.duplicate { summary.again_before.push(key) } else { summary.again.push(key) }
        on_ack(&shots[index], &ack);
        None::<()>
    })
    .await?;
    for (index, ack) in kept {
        on_ack(&shots[index], &ack);
    }
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// Publishes `messages` (a shot's index and its message), at most `max_in_flight` unacknowledged
/// at once; `acked` is called with each PubAck, and what it returns is collected.
async fn publish_all<T>(
    js: &jetstream::Context,
    messages: impl Iterator<Item = (usize, (String, PublishMessage))>,
    shots: &[Shot],
    options: SubmitOptions,
    mut acked: impl FnMut(usize, PublishAck) -> Option<T>,
) -> Result<Vec<(usize, T)>, SubmitError> {
    let fail = |index: usize, detail: String| SubmitError { job_id: shots[index].job.job_id.clone(), line: shots[index].line, detail };
    let mut kept = Vec::new();
    let mut in_flight = FuturesUnordered::new();
    let mut settle = |index: usize, ack: Result<PublishAck, String>| {
        let ack = ack.map_err(|detail| fail(index, detail))?;
        kept.extend(acked(index, ack).map(|t| (index, t)));
        Ok::<_, SubmitError>(())
    };
    for (index, (subject, publish)) in messages {
        if in_flight.len() >= options.max_in_flight.max(1)
            && let Some((i, ack)) = in_flight.next().await
        {
            settle(i, ack)?;
        }
        let pending: PublishAckFuture =
            js.send_publish(subject.clone(), publish).await.map_err(|e| fail(index, explain(&subject, &e)))?;
        in_flight.push(async move { (index, pending.await.map_err(|e| explain(&subject, &e))) });
    }
    while let Some((i, ack)) = in_flight.next().await {
        settle(i, ack)?;
    }
    Ok(kept)
}

/// What [`look_up_each`] found, by a shot's index, and whether the look-ups were answered.
struct Found<T> {
    found: HashMap<usize, T>,
    answered: bool,
}

impl<T> Found<T> {
    /// Nothing looked up (the stream could not be opened).
    fn none() -> Self {
        Self { found: HashMap::new(), answered: false }
    }
}

/// When each duplicate's message (a shot's index and the sequence its PubAck names), if still
/// in the jobs stream, was published: queued or being rendered, its outcome is to come.
async fn still_queued(js: &jetstream::Context, duplicates: Vec<(usize, u64)>) -> Found<SystemTime> {
    let Ok(stream) = js.get_stream_no_info(subject::JOBS_STREAM).await else { return Found::none() };
    look_up_each(duplicates, |(index, sequence)| {
        let stream = stream.clone();
        async move { stream.get_raw_message(sequence).await.ok().map(|m| (index, SystemTime::from(m.time))) }
    })
    .await
}

/// The last outcome of each job (by its shot's index) that has one.
async fn last_outcomes(js: &jetstream::Context, jobs: Vec<(usize, &ShotJob)>) -> Found<Outcome> {
    let Ok(stream) = js.get_stream_no_info(subject::RESULTS_STREAM).await else { return Found::none() };
    look_up_each(jobs, |(index, job)| {
        let stream = stream.clone();
        async move { outcome::last(&stream, &job.project, &job.job_id).await.ok().flatten().map(|o| (index, o)) }
    })
    .await
}

/// Runs `look_up` over `items`, 16 at a time, each bounded by a second. A producer role may be
/// refused a look-up, and a refused request is never answered: the first one tells, and the
/// rest are then not asked (`answered` false: what they would have said stays unknown).
async fn look_up_each<I, T, F>(items: Vec<I>, look_up: impl Fn(I) -> F) -> Found<T>
where
    F: Future<Output = Option<(usize, T)>>,
{
    const EACH: Duration = Duration::from_secs(1);
    // `None`: no answer in time; `Some(None)`: answered, nothing found.
    let bounded = |item| {
        let asked = look_up(item);
        async move { tokio::time::timeout(EACH, asked).await.ok() }
    };
    let mut items = items.into_iter();
    let mut found = Found::none();
    let Some(first) = items.next() else { return found };
    match bounded(first).await {
        Some(answer) => found.found.extend(answer),
        None => return found,
    }
    found.answered = true;
    let rest: Vec<_> = futures::stream::iter(items.map(bounded)).buffer_unordered(16).collect().await;
    found.found.extend(rest.into_iter().flatten().flatten());
    found
}
