//! The commit protocol: a job's outcome on its result subject is the commit point.
//!
//! 1. On fetch, look up the job's last outcome (a direct get of the last message on
//!    `shots.done.<project>.<job>`). A rendered result settles every message of the job; a
//!    failed or cancelled outcome settles the messages up to the one it names (its
//!    `Shotfleet-Settles` header: the failed message, a cancellation's last queued copy). A settled message
//!    is only swept and acked.
//! 2. Render, and upload to content-addressed keys (`<shot>-<index>-<sha8>.png`).
//! 3. Claim the subject: publish the outcome with `Nats-Expected-Last-Subject-Sequence` set to
//!    the last outcome seen in step 1 (0 when none). The server stores it only if nothing was
//!    published there since, however long ago the other publish was (a duplicate window would
//!    forget it). A refusal means another worker settled the job first: its outcome stands.
//!    Failing a job claims the subject the same way, so a job never ends with both a result and
//!    a failure.
//! 4. Sweep: delete every object under the job's prefix that the outcome does not name (all of
//!    them for a failure). Then ack.
//!
//! This differs from deleting an earlier attempt's leftovers *before* rendering: two workers can
//! hold the same job at once (a redelivery while the first is still alive), and a delete before
//! the commit could remove images the other is about to name in its result. Sweeping only
//! against a committed outcome never touches a named image, and every delivery of a job ends
//! with a sweep after the commit (step 1 sweeps too), so leftovers of crashed attempts go with
//! the next delivery.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::nats::outcome::{FAILED_RECORDS_HEADER, MAX_FAILED_RECORDS, OutcomeError};
use shotfleet_schema::validate::{MAX_ID_BYTES, MAX_PROJECT_BYTES, id_problem};
use shotfleet_schema::{Degrade, Failure, ImageRef, JobIds, ResultStatus, ShotJob, ShotResult, Timing, subject};
use tracing::warn;

use crate::failure::{JobError, classify_render};
use crate::faults;
use crate::pipeline::RenderedImage;
use crate::worker::Shared;

pub use shotfleet_schema::nats::outcome::Outcome;

/// The last outcome of a job, if any.
///
/// # Errors
/// A transient [`JobError`] when the results stream cannot be read.
pub async fn last_outcome(shared: &Shared, project: &str, job_id: &str) -> Result<Option<Outcome>, JobError> {
    last_outcome_in(&shared.results, project, job_id).await
}

/// [`last_outcome`] in the results stream `results`.
///
/// # Errors
/// As [`last_outcome`].
pub async fn last_outcome_in(
    results: &async_nats::jetstream::stream::Stream,
    project: &str,
    job_id: &str,
) -> Result<Option<Outcome>, JobError> {
    shotfleet_schema::nats::outcome::last(results, project, job_id).await.map_err(|e| JobError::transient(e.to_string()))
}

/// Where a job message stands against its job's last outcome.
#[derive(Debug)]
pub enum Standing {
    /// The outcome settles the message ([`Outcome::settles`]): it is only swept and acked.
    Settled(Box<Outcome>),
    /// The message is a request of its own; its outcome claims over `last` (0: none).
    /// `records`: the failed records that outcome names, for a render to withdraw or a failure
    /// or cancellation to carry forward.
    Open { last: u64, records: Vec<u64> },
}

/// Looks up the last outcome of `project`/`job_id` and says whether it settles a message
/// published at `published`. Every path that settles a message asks this first, a payload
/// that is refused as invalid included: its outcome must claim over the job's last one, or
/// a re-submission after a failure would find its own failure refused by the server.
///
/// # Errors
/// A transient [`JobError`] when the results stream cannot be read.
///
/// A last message there that is no outcome (it does not decode) settles nothing: the message's
/// outcome claims over it, or the job could never settle (every look-up would fail alike).
pub async fn standing(shared: &Shared, project: &str, job_id: &str, sequence: u64, published: SystemTime) -> Result<Standing, JobError> {
    Ok(match shotfleet_schema::nats::outcome::last(&shared.results, project, job_id).await {
        Ok(Some(outcome)) if outcome.settles(sequence, published) => Standing::Settled(Box::new(outcome)),
        Ok(last) => Standing::Open { last: last.as_ref().map_or(0, |o| o.sequence), records: last.map(|o| o.failed_records).unwrap_or_default() },
        Err(e @ OutcomeError::Unreadable { sequence: last, .. }) => {
            warn!(project, job = job_id, error = %e, "settling the job over a message that is no outcome");
            Standing::Open { last, records: Vec::new() }
        }
        Err(e) => return Err(JobError::transient(e.to_string())),
    })
}

/// What claiming a job's result subject found.
#[derive(Debug)]
pub enum Claim {
    /// Ours is the job's outcome.
    Ours,
    /// Another outcome was there first; it stands.
    Theirs(Box<Outcome>),
}

/// Publishes `result` as the outcome of the job message at `stream_sequence`, if the last
/// outcome on its subject is still `expected` (0: none).
///
/// # Errors
/// A transient [`JobError`] when the publish or the look-up after a refusal failed.
pub async fn claim(shared: &Shared, result: &ShotResult, expected: u64, stream_sequence: u64) -> Result<Claim, JobError> {
    claim_as(shared, result, expected, subject::msg_id::outcome(&result.job_id, stream_sequence), stream_sequence, &[]).await
}

/// [`claim`] for a failure: it names its failed record, then the records the outcome it claims
/// over named ([`FAILED_RECORDS_HEADER`]).
///
/// # Errors
/// As [`claim`].
pub async fn claim_failure(shared: &Shared, result: &ShotResult, expected: u64, stream_sequence: u64, record: u64, carried: &[u64]) -> Result<Claim, JobError> {
    let message_id = subject::msg_id::outcome(&result.job_id, stream_sequence);
    let records: Vec<u64> = std::iter::once(record).chain(carried.iter().copied()).collect();
    claim_as(shared, result, expected, message_id, stream_sequence, &records).await
}

/// [`claim`] with the publish's message id given: a cancellation is no job message's outcome.
/// `settles_through` is the last job message the outcome settles
/// ([`shotfleet_schema::nats::outcome::SETTLES_HEADER`]).
///
/// # Errors
/// As [`claim`].
pub async fn claim_as(
    shared: &Shared,
    result: &ShotResult,
    expected: u64,
    message_id: String,
    settles_through: u64,
    failed_records: &[u64],
) -> Result<Claim, JobError> {
    let payload = encoding::encode(ContentType::Json, result);
    let mut publish = PublishMessage::build()
        .payload(payload.into())
        .header(encoding::HEADER, ContentType::Json.as_str())
        .header(shotfleet_schema::nats::outcome::SETTLES_HEADER, settles_through.to_string().as_str())
        .message_id(message_id)
        .expected_last_subject_sequence(expected);
    if !failed_records.is_empty() {
        let listed: Vec<String> = failed_records.iter().take(MAX_FAILED_RECORDS).map(u64::to_string).collect();
        publish = publish.header(FAILED_RECORDS_HEADER, listed.join(",").as_str());
    }
    let target = subject::result(&result.project, &result.job_id);
    let published = match shared.js.send_publish(target, publish).await {
        Ok(ack) => ack.await,
        Err(e) => return Err(JobError::transient(format!("cannot publish the job's outcome: {e}"))),
    };
    match published {
        Ok(ack) if !ack.duplicate => Ok(Claim::Ours),
        // This message's outcome was published before: by this worker (a retried publish) or
        // by another that held the same delivery.
        Ok(_) => theirs_unless_ours(shared, result).await,
        Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => theirs_unless_ours(shared, result).await,
        Err(e) => Err(JobError::transient(format!("the job's outcome was not acknowledged: {e}"))),
    }
}

async fn theirs_unless_ours(shared: &Shared, ours: &ShotResult) -> Result<Claim, JobError> {
    match last_outcome(shared, &ours.project, &ours.job_id).await? {
        Some(outcome) if outcome.result.worker == ours.worker && outcome.result.attempt == ours.attempt && outcome.result.status == ours.status => {
            Ok(Claim::Ours)
        }
        Some(outcome) => Ok(Claim::Theirs(Box::new(outcome))),
        None => Err(JobError::transient("the server refused the job's outcome but holds none (results stream max age?)")),
    }
}

/// Deletes every object under the job's prefix that `keep` does not name; returns how many.
///
/// # Errors
/// The store's failure, as a [`JobError`] (a permanent one stops the worker).
pub async fn sweep(shared: &Shared, project: &str, job_id: &str, keep: &[ImageRef]) -> Result<usize, JobError> {
    let keep: HashSet<String> = keep.iter().map(|i| i.key.clone()).collect();
    shared.store.sweep_job(project, job_id, &keep).await.map_err(|e| JobError::store("sweep the job's objects", &e))
}

/// A job's images as stored, and the time their PNG encoding took.
pub struct Uploaded {
    pub images: Vec<ImageRef>,
    /// The encodings' wall time: they run side by side, one blocking thread each.
    pub png: Duration,
}

/// Encodes a job's images as PNGs (off the render's slot: the next job renders meanwhile) and
/// uploads them to their content-addressed keys.
///
/// # Errors
/// The store's failure, as a [`JobError`]; an image the encoder refused, as its render error.
pub async fn upload(shared: &Shared, job: &ShotJob, images: Vec<RenderedImage>) -> Result<Uploaded, JobError> {
    let started = std::time::Instant::now();
    // Each task keeps what the image's reference needs and drops its pixels once encoded.
    let encodings = images.into_iter().map(|image| {
        tokio::task::spawn_blocking(move || {
            let png = image.encode_png();
            let RenderedImage { index, seed, width, height, .. } = image;
            (index, seed, width, height, png)
        })
    });
    let encoded = futures::future::try_join_all(encodings)
        .await
        .map_err(|e| JobError::transient(format!("PNG encoding task failed: {e}")))?;
    let png_time = started.elapsed();
    let mut refs = Vec::with_capacity(encoded.len());
    for (index, seed, width, height, png) in encoded {
        let png = png.map_err(|e| JobError::new(classify_render(&e), format!("encode image {index} as PNG: {e}")))?;
        let png = if shared.config.faults.mark_images { faults::add_png_text(&png, "shotfleet-worker", &shared.config.worker_id) } else { png };
        let stored = shared
            .store
            .put_image(&job.project, &job.job_id, &job.shot_id, index, png)
            .await
            .map_err(|e| JobError::store(&format!("upload image {index}"), &e))?;
        refs.push(ImageRef {
            key: stored.key,
            index,
            seed,
            width,
            height,
            bytes: stored.bytes,
            sha256: stored.sha256,
        });
    }
    Ok(Uploaded { images: refs, png: png_time })
}

/// Whether a job's project and id make a result subject (they do once validated; a job
/// failed as invalid may have either broken).
pub fn names_a_subject(ids: &JobIds) -> bool {
    id_problem(&ids.job_id, MAX_ID_BYTES).is_none() && id_problem(&ids.project, MAX_PROJECT_BYTES).is_none()
}

/// An outcome of the job `ids` names from this worker, without images: `degrade` its rung,
/// `attempt` the delivery's count, `queued` how long it waited in the stream.
pub fn outcome_of(
    shared: &Shared,
    ids: JobIds,
    degrade: Option<Degrade>,
    attempt: u64,
    queued: Duration,
    status: ResultStatus,
    failure: Option<Failure>,
) -> ShotResult {
    let JobIds { job_id, project, shot_id } = ids;
    ShotResult {
        v: shotfleet_schema::VERSION,
        job_id,
        project,
        shot_id,
        status,
        images: Vec::new(),
        degrade,
        worker: shared.config.worker_id.clone(),
        device: shared.device_name.clone(),
        attempt: attempt as u32,
        timing: Timing { queue_ms: queued.as_millis() as u64, ..Timing::default() },
        finished_at_ms: now_ms(),
        failure,
        notes: Vec::new(),
    }
}

/// Milliseconds since the Unix epoch, for outcomes.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or(Duration::ZERO).as_millis() as u64
}
