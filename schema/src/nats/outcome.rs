//! A job's last outcome as the results stream holds it (the last message on
//! `shots.done.<project>.<job_id>`): what a worker reads before it settles a job message, and
//! what `shotfleet submit --again` reads before it queues a job that ended again.

use std::time::SystemTime;

use async_nats::jetstream::stream::{DirectGetErrorKind, Stream};

use crate::encoding::{self, ContentType};
use crate::{ShotResult, subject};

/// The header of an outcome naming the last job message (its sequence in `SHOTS`) that it
/// settles: the delivered message for a result or a failure, the last queued copy for a
/// cancellation. A producer, who may not read the jobs stream, tells by it whether a message
/// it published (its PubAck's sequence) was settled or is still to come.
pub const SETTLES_HEADER: &str = "Shotfleet-Settles";

/// The header of a `failed` or `cancelled` outcome naming the job's failed records that still
/// wait in `SHOTS_FAILED` (their sequences, comma-separated, newest first): its own, and those
/// the outcome it claimed over named, carried forward. A worker that renders the job later
/// (`submit --again`, a fix, a replay) withdraws them, as they would else wait, counted by
/// `status`, for a replay to find the job rendered and delete them. A failure withdraws none: an
/// earlier failure's payload may be the one worth replaying (a driver fault before an invalid
/// re-submission).
pub const FAILED_RECORDS_HEADER: &str = "Shotfleet-Failed-Records";

/// The most records an outcome names; older ones wait for a replay.
pub const MAX_FAILED_RECORDS: usize = 16;

/// The last outcome on a job's result subject.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub result: ShotResult,
    /// Its sequence in `SHOT_RESULTS`: a later claim expects it.
    pub sequence: u64,
    /// When the server stored it.
    pub stored: SystemTime,
    /// The last job message it settles ([`SETTLES_HEADER`]; for an outcome written before the
    /// header, from its message id `<job_id>:outcome:<seq>`), when it says.
    pub settles_through: Option<u64>,
    /// The job's failed records it names ([`FAILED_RECORDS_HEADER`]), newest first.
    pub failed_records: Vec<u64>,
}

impl Outcome {
    /// Whether this outcome settles the job message at `sequence` in `SHOTS`, published at
    /// `published`: a rendered result settles every message of the job; a failure or
    /// cancellation the messages up to the one it names ([`Self::settles_through`]), so a copy
    /// queued after that one (a fix sent while the first still waited, a replay, a
    /// re-submission) is a request of its own. An outcome written before it named one settles
    /// the messages published before it was stored.
    pub fn settles(&self, sequence: u64, published: SystemTime) -> bool {
        self.result.is_rendered() || self.settles_through.map_or(self.stored >= published, |through| sequence <= through)
    }
}

/// Why the last outcome could not be read.
#[derive(Debug, thiserror::Error)]
pub enum OutcomeError {
    /// The last message on the subject does not decode as an outcome (a tool or client that
    /// published there by mistake, on a server without the shipped roles): it is no outcome,
    /// and settles nothing; a claim expects its `sequence`.
    #[error("the last message on the job's result subject (sequence {sequence}) is no outcome: {detail}")]
    Unreadable { detail: String, sequence: u64 },
    #[error("cannot look up the job's outcome: {0}")]
    Lookup(String),
}

/// The last outcome of `project`/`job_id` in the results stream `results`, `None` when the job
/// has none.
///
/// # Errors
/// [`OutcomeError`] when the stream cannot be read or the stored outcome does not decode.
pub async fn last<I>(results: &Stream<I>, project: &str, job_id: &str) -> Result<Option<Outcome>, OutcomeError> {
    match results.direct_get_last_for_subject(subject::result(project, job_id)).await {
        Ok(message) => {
            let unreadable = |detail: String| OutcomeError::Unreadable { detail, sequence: message.sequence };
            let content_type = super::content_type(&message.headers);
            let content_type = ContentType::from_header(content_type.as_deref()).map_err(|e| unreadable(e.to_string()))?;
            let result = encoding::decode(content_type, &message.payload).map_err(|e| unreadable(e.to_string()))?;
            let settles_through = match super::header_value(&message.headers, SETTLES_HEADER) {
                Some(through) => through.parse().ok(),
                None => super::header_value(&message.headers, crate::failure::MSG_ID).and_then(|id| subject::msg_id::outcome_sequence(&id)),
            };
            let failed_records = super::header_value(&message.headers, FAILED_RECORDS_HEADER)
                .map(|list| list.split(',').filter_map(|seq| seq.trim().parse().ok()).take(MAX_FAILED_RECORDS).collect())
                .unwrap_or_default();
            Ok(Some(Outcome { result, sequence: message.sequence, stored: message.time.into(), settles_through, failed_records }))
        }
        Err(e) if matches!(e.kind(), DirectGetErrorKind::NotFound) => Ok(None),
        Err(e) => Err(OutcomeError::Lookup(e.to_string())),
    }
}
