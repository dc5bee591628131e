//! Failed records: the job's original payload, published to `shots.failed.<prio>.<project>` with
//! the reason in headers (built by `shotfleet_schema::failure::RecordHeaders`, which makes every
//! value from the payload safe). Replay reads them back. [`record`] fails a job: the record, the
//! job's `failed` outcome, the sweep of its objects.

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use bytes::Bytes;
use shotfleet_schema::failure::{FailureReason, RecordFacts, RecordHeaders, one_line};
use shotfleet_schema::subject::{self, Priority};
use shotfleet_schema::{Failure, JobIds, ResultStatus, ShotJob, ShotResult, encoding};

use crate::worker::Shared;
use crate::worker::commit::{self, Claim};

/// The failed subject of a job taken from `original_subject`: its priority and project
/// (`p2`/`unknown` when the subject is not a job subject).
fn failed_subject(original_subject: &str) -> String {
    match subject::parse_job(original_subject) {
        Ok(parsed) => subject::failed(parsed.priority, &parsed.project),
        Err(_) => subject::failed(Priority::P2, "unknown"),
    }
}

/// Publishes a failed record of `payload` and waits for the server to store it; returns its
/// sequence in `SHOTS_FAILED`.
///
/// # Errors
/// The publish or its acknowledgement failed; the caller must keep the job.
pub async fn publish(shared: &Shared, payload: Bytes, facts: &RecordFacts<'_>) -> Result<u64, String> {
    let headers = RecordHeaders::new(facts);
    let map = shotfleet_schema::nats::header_map(headers.pairs.iter().map(|(n, v)| (*n, v.as_str())));
    let ack = shared
        .js
        .publish_with_headers(failed_subject(facts.original_subject), map, payload)
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    Ok(ack.sequence)
}

/// Removes a record written for a job that turned out to have a result after all (another
/// worker committed while this one failed it), so nobody replays a finished job.
pub async fn withdraw(shared: &Shared, sequence: u64) {
    let removed = match shared.js.get_stream(subject::FAILED_STREAM).await {
        Ok(stream) => shotfleet_schema::nats::delete_stored(&stream, sequence).await,
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = removed {
        tracing::warn!(seq = sequence, error = %e, "could not withdraw a failed record of a job that has a result; replaying it finds the result and does nothing");
    }
}

/// Removes the failed records of a job this worker has just rendered (sent again with
/// `--again`, fixed, or replayed), as its last outcome named them: they would else wait,
/// counted by `status`, for a replay to find the job rendered. Each is read first and deleted
/// only when it is this job's: a failed stream made again restarts its sequences, and an old
/// outcome's number may then name another job's record. A record already gone (replayed) is
/// passed over.
pub async fn withdraw_rendered(shared: &Shared, records: &[u64], project: &str, job_id: &str) {
    if records.is_empty() {
        return;
    }
    let stream = match shared.js.get_stream(subject::FAILED_STREAM).await {
        Ok(stream) => stream,
        Err(e) => {
            tracing::warn!(job = job_id, error = %e, "could not withdraw the failed records of a job now rendered; `shotfleet replay` finds it rendered and deletes them");
            return;
        }
    };
    for &sequence in records {
        match stream.get_raw_message(sequence).await {
            Ok(record) => {
                let named = shotfleet_schema::nats::header_value(&record.headers, shotfleet_schema::failure::JOB_ID);
                let in_project = subject::parse_failed(&record.subject).is_ok_and(|(_, of)| of == project);
                if named.as_deref() != Some(job_id) || !in_project {
                    tracing::warn!(job = job_id, seq = sequence, "the failed record this job's outcome names is another job's (was the failed stream made again?); left as it is");
                    continue;
                }
            }
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => continue,
            Err(e) => {
                tracing::warn!(job = job_id, seq = sequence, error = %e, "could not read a failed record of a job now rendered; `shotfleet replay` finds it rendered and deletes it");
                continue;
            }
        }
        match shotfleet_schema::nats::delete_stored(&stream, sequence).await {
            Ok(()) => tracing::info!(job = job_id, seq = sequence, "withdrew a failed record of the job: it is rendered now"),
            Err(e) => tracing::warn!(job = job_id, seq = sequence, error = %e, "could not withdraw a failed record of a job now rendered; `shotfleet replay` finds it rendered and deletes it"),
        }
    }
}


/// A job to fail, whoever holds it: a worker settling its delivery, or the advisory rescue
/// copying a message no worker answered for.
pub(crate) struct Case<'a> {
    pub payload: Bytes,
    pub content_type: Option<&'a str>,
    pub original_subject: &'a str,
    pub stream_sequence: u64,
    /// Deliveries the job had.
    pub deliveries: u64,
    pub queued: std::time::Duration,
    /// `None` when the payload could not be decoded.
    pub job: Option<&'a ShotJob>,
    /// The sequence of the job's last outcome (0: none): the claim expects it.
    pub last_outcome: u64,
    /// The failed records that outcome names: carried forward, after this failure's own.
    pub failed_records: Vec<u64>,
}

impl Case<'_> {
    /// The ids its outcome goes under, if it can have one. Always in the project the job was
    /// published under, whatever its payload says: a producer of one project never writes (or
    /// sweeps) another's. A payload that did not decode may still name its job, so that its
    /// producer hears why.
    pub fn ids(&self) -> Option<JobIds> {
        ids_of(self.original_subject, self.job, self.content_type, &self.payload)
    }
}

/// The ids the outcome of a job message goes under ([`Case::ids`]): from the decoded `job`, else
/// read from the payload; in the project of the subject it was published under.
pub(crate) fn ids_of(original_subject: &str, job: Option<&ShotJob>, content_type: Option<&str>, payload: &[u8]) -> Option<JobIds> {
    let project = subject::parse_job(original_subject).ok()?.project;
    let ids = match job {
        Some(job) => JobIds { project, ..job.ids() },
        None => encoding::read_ids(content_type, payload, &project)?,
    };
    commit::names_a_subject(&ids).then_some(ids)
}

/// What failing a job came to.
pub(crate) enum Recorded {
    /// The failed record is stored, and the job's `failed` outcome too when its ids name a
    /// result subject; its objects are swept.
    Failed,
    /// Another worker settled the job meanwhile: its outcome stands (and a record of ours that
    /// would let a finished or cancelled job be replayed is withdrawn).
    SettledBy(Box<ShotResult>),
    /// The record or the outcome could not be written: the job must be kept.
    NotStored(String),
}

/// Fails a job: the failed record first (the payload is then safe for a replay), then the
/// `failed` outcome claimed on the job's result subject, then the sweep of its objects.
pub(crate) async fn record(shared: &Shared, case: &Case<'_>, reason: FailureReason, detail: &str, attempts: u64) -> Recorded {
    let ids = case.ids();
    let facts = RecordFacts {
        reason,
        detail,
        original_subject: case.original_subject,
        attempts,
        deliveries: case.deliveries,
        worker: &shared.config.worker_id,
        job_id: ids.as_ref().map(|ids| ids.job_id.as_str()),
        content_type: case.content_type,
        stream_sequence: case.stream_sequence,
    };
    let record = match publish(shared, case.payload.clone(), &facts).await {
        Ok(sequence) => sequence,
        Err(e) => return Recorded::NotStored(format!("failed record not stored: {e}")),
    };
    let Some(ids) = ids else {
        return Recorded::Failed;
    };
    let failure = Failure { reason: Some(reason), detail: one_line(detail, OUTCOME_DETAIL), attempts };
    let degrade = case.job.and_then(|job| job.degrade);
    let outcome = commit::outcome_of(shared, ids, degrade, case.deliveries, case.queued, ResultStatus::Failed, Some(failure));
    match commit::claim_failure(shared, &outcome, case.last_outcome, case.stream_sequence, record, &case.failed_records).await {
        Ok(Claim::Ours) => {
            if let Err(e) = commit::sweep(shared, &outcome.project, &outcome.job_id, &[]).await {
                tracing::warn!(job = %outcome.job_id, error = %e, "could not sweep a failed job's objects");
            }
            Recorded::Failed
        }
        Ok(Claim::Theirs(theirs)) => {
            if theirs.result.status != ResultStatus::Failed {
                withdraw(shared, record).await;
            }
            Recorded::SettledBy(Box::new(theirs.result))
        }
        Err(e) => Recorded::NotStored(format!("failed record stored but the outcome not: {e}")),
    }
}

/// The longest detail a `failed` outcome carries, bytes (the failed record keeps a longer one),
/// so the outcome fits wherever a result does.
const OUTCOME_DETAIL: usize = 300;

#[cfg(test)]
mod tests {
    use super::*;

    fn case<'a>(subject: &'a str, payload: &'static [u8], job: Option<&'a ShotJob>) -> Case<'a> {
        Case {
            payload: Bytes::from_static(payload),
            content_type: None,
            original_subject: subject,
            stream_sequence: 7,
            deliveries: 20,
            queued: std::time::Duration::ZERO,
            job,
            last_outcome: 0,
            failed_records: Vec::new(),
        }
    }

    #[test]
    fn an_outcome_goes_to_the_project_the_job_was_published_under() {
        let payload = br#"{"v":1,"job_id":"j1","project":"beta","shot_id":"s1","prompt":"a cat","width":64,"height":64,"steps":2,"guidance":5.0,"seed":1}"#;
        let job: ShotJob = serde_json::from_slice(payload).unwrap();
        let ids = case("shots.p1.xs.acme", payload, Some(&job)).ids().unwrap();
        assert_eq!((ids.project.as_str(), ids.job_id.as_str(), ids.shot_id.as_str()), ("acme", "j1", "s1"));
        // Undecoded, named by its readable ids; in the same project.
        let ids = case("shots.p1.xs.acme", br#"{"v":1,"job_id":"j2","project":"beta","width":"wide"}"#, None).ids().unwrap();
        assert_eq!((ids.project.as_str(), ids.job_id.as_str()), ("acme", "j2"));
        // Nothing to name it by, or no job subject to put it under.
        assert!(case("shots.p1.xs.acme", b"not json", None).ids().is_none());
        assert!(case("elsewhere", payload, Some(&job)).ids().is_none());
    }
}
