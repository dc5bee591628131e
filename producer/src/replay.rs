//! Replaying failed jobs: failed records from `SHOTS_FAILED` back to their original subjects.
//!
//! The walk reads the failed stream record by record (`STREAM.MSG.GET` with `next_by_subj`,
//! which nats-server 2.9 and later answer, and which skips deleted records on the server) up to
//! the last sequence that existed when the walk began, so a replayed job that fails again at
//! once is not replayed twice in one run. Each record that matches the [`Filter`] is checked,
//! republished byte for byte (same `Content-Type`) with `Nats-Msg-Id = <job>:replay:<seq>`, and
//! deleted from the failed stream only after the PubAck: an interrupted replay loses nothing.
//!
//! Except for three kinds of record, decided by the job's payload and its last outcome:
//! - a job that failed after the degrade ladder had lowered it goes back at the size and steps
//!   its producer asked for (`degrade.from`, where a worker could have written it), to the
//!   subject of that size: a replay is a new try at the job, and whatever made it degrade (a busy
//!   card, a driver crash) may be gone; the ladder lowers it again if not;
//! - a job whose last outcome is a rendered result is not sent, and its record is deleted (as a
//!   worker deletes the record of a job another finished): a worker would settle the replay
//!   without rendering, and "replayed" would promise a render that never comes;
//! - a job cancelled after it failed is not sent: its owner stopped it, and `submit --again`
//!   renders it anew if they want it.

use std::str::FromStr;
use std::time::{Duration, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::message::{PublishMessage, StreamMessage};
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use async_nats::jetstream;
use bytes::Bytes;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::failure::{self, FailureReason, one_line};
use shotfleet_schema::nats::outcome::{self, OutcomeError};
use shotfleet_schema::nats;
use shotfleet_schema::subject::{self, JobSubject, SubjectClass};
use shotfleet_schema::{Original, ResultStatus, ShotJob, validate};

/// Which records to replay. Empty lists match everything.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Reasons asked for. A record without a job id is replayed only when its reason is here.
    pub reasons: Vec<FailureReason>,
    pub projects: Vec<String>,
    pub jobs: Vec<String>,
    /// Records written at or after this.
    pub since: Option<SystemTime>,
    /// Records written at or before this.
    pub until: Option<SystemTime>,
}

/// A point in time on the command line: `2h` (that long ago) or an RFC 3339 timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    Ago(Duration),
    At(SystemTime),
}

impl When {
    pub fn resolve(self, now: SystemTime) -> SystemTime {
        match self {
            Self::Ago(d) => now.checked_sub(d).unwrap_or(SystemTime::UNIX_EPOCH),
            Self::At(t) => t,
        }
    }
}

impl FromStr for When {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Ok(d) = shotfleet_schema::nats::topology::parse_duration(text) {
            return Ok(Self::Ago(d));
        }
        // A bare date is its midnight, UTC.
        let text = text.trim();
        let time = if text.len() == 10 { format!("{text}T00:00:00Z") } else { text.to_owned() };
        async_nats::datetime::parse_rfc3339(&time).map(|t| Self::At(t.into())).map_err(|_| {
            format!("`{text}` is neither a duration (90s, 20m, 2h, 14d: that long ago) nor an RFC 3339 time (2026-11-30T08:00:00Z) or date (2026-11-30, UTC)")
        })
    }
}

/// One failed record as stored.
#[derive(Debug, Clone)]
pub struct FailedRecord {
    /// Its sequence in `SHOTS_FAILED`.
    pub seq: u64,
    /// `shots.failed.<prio>.<project>`.
    pub subject: String,
    pub project: Option<String>,
    pub job_id: Option<String>,
    /// The `job_id` its payload holds where that is no valid id (`a.b`, a subject wildcard, too
    /// long): the record has no `Shotfleet-Job-Id` then, but a person still looks for it by it.
    pub id_as_sent: Option<String>,
    /// As written (`Shotfleet-Reason`); unknown reasons are kept as text.
    pub reason: String,
    pub detail: String,
    pub attempts: String,
    pub original_subject: Option<String>,
    pub content_type: Option<String>,
    pub written: SystemTime,
    pub payload: Bytes,
}

impl FailedRecord {
    /// How a table names the record's job: `<project>/<job_id>` (ids are unique within a
    /// project only), the id alone, the id as sent when it is no valid id (quoted, one line,
    /// cut), or `-` for a payload without one.
    pub fn job_name(&self) -> String {
        match (&self.project, &self.job_id, &self.id_as_sent) {
            (Some(project), Some(job_id), _) => shotfleet_schema::job::key(project, job_id),
            (None, Some(job_id), _) => job_id.clone(),
            (_, None, Some(sent)) => format!("{:?} (no valid id)", one_line(sent, 40)),
            (_, None, None) => "-".into(),
        }
    }

    fn from_message(message: StreamMessage) -> Self {
        let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
        let subject = message.subject.to_string();
        let job_id = header(failure::JOB_ID).filter(|id| !id.is_empty());
        let content_type = header(failure::CONTENT_TYPE);
        // Only an id that is no id: a record can lack the header for other reasons (an
        // original subject that names no project, a record written by an older worker).
        let id_as_sent = match job_id {
            Some(_) => None,
            None => shotfleet_schema::encoding::read_job_id_as_sent(content_type.as_deref(), &message.payload)
                .filter(|sent| validate::id_problem(sent, validate::MAX_ID_BYTES).is_some()),
        };
        Self {
            seq: message.sequence,
            project: subject::parse_failed(&subject).ok().map(|(_, project)| project),
            job_id,
            id_as_sent,
            reason: header(failure::REASON).unwrap_or_default(),
            detail: header(failure::DETAIL).unwrap_or_default(),
            attempts: header(failure::ATTEMPTS).unwrap_or_default(),
            original_subject: header(failure::ORIGINAL_SUBJECT),
            content_type,
            written: message.time.into(),
            subject,
            payload: message.payload,
        }
    }

    fn reason(&self) -> Option<FailureReason> {
        self.reason.parse().ok()
    }

    /// The `Nats-Msg-Id` its replay is published with.
    ///
    /// `n` is the record's own sequence in `SHOTS_FAILED`, not a replay counter:
    /// - a rerun after an interruption (PubAck received, delete not done) publishes the same id,
    ///   so the duplicate window of `SHOTS` absorbs it and the rerun only deletes the record;
    /// - a replayed job that fails again gets a new failed record with a higher sequence, so its
    ///   next replay has a new id and is never mistaken for a duplicate;
    /// - it needs no state beyond the record itself (a counter would need to be stored and
    ///   read back, and two operators replaying at once would race on it).
    ///
    /// Sequences restart only if the stream is deleted and made again; an id can then repeat
    /// only inside the duplicate window (20 min by default), for the same job at the same
    /// sequence. A record without a job id (an undecodable payload) is named by its sequence,
    /// `seq-<seq>`, as the worker names its failed record `seq-<seq>:failed`.
    pub fn replay_msg_id(&self) -> String {
        match &self.job_id {
            Some(job) => subject::msg_id::replay(job, self.seq),
            None => subject::msg_id::replay(&format!("seq-{}", self.seq), self.seq),
        }
    }

    /// The age of the record at `now`.
    pub fn age(&self, now: SystemTime) -> Duration {
        now.duration_since(self.written).unwrap_or_default()
    }
}

impl Filter {
    fn matches(&self, record: &FailedRecord) -> bool {
        let reason_ok = self.reasons.is_empty() || record.reason().is_some_and(|r| self.reasons.contains(&r));
        let project_ok = self.projects.is_empty() || record.project.as_ref().is_some_and(|p| self.projects.contains(p));
        // A job by id, or by `<project>/<job_id>` as the table names it, or by the id it was
        // sent with when that is no valid id.
        let job_ok = self.jobs.is_empty()
            || record.job_id.as_ref().is_some_and(|j| self.jobs.contains(j) || self.jobs.contains(&record.job_name()))
            || record.id_as_sent.as_ref().is_some_and(|j| self.jobs.contains(j));
        let since_ok = self.since.is_none_or(|t| record.written >= t);
        let until_ok = self.until.is_none_or(|t| record.written <= t);
        reason_ok && project_ok && job_ok && since_ok && until_ok
    }

    /// Records without a job id are replayed only when asked for by their reason: their payload
    /// could not be decoded, so most need fixing at the source, not another try.
    fn asks_for_unnamed(&self, record: &FailedRecord) -> bool {
        record.reason().is_some_and(|r| self.reasons.contains(&r))
    }

    /// The narrowest subject the server can filter on.
    fn subject(&self) -> String {
        match &self.projects[..] {
            [project] if !project.is_empty() && !project.contains(['.', '*', '>', ' ']) => {
                format!("{}.failed.*.{project}", subject::ROOT)
            }
            _ => format!("{}.failed.>", subject::ROOT),
        }
    }
}

/// A degraded job sent back as its producer asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restored {
    /// The rung it failed on.
    pub level: u32,
    /// The size it failed at.
    pub failed_width: u32,
    pub failed_height: u32,
    /// The size and steps it goes back at.
    pub original: Original,
}

impl std::fmt::Display for Restored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Original { width, height, steps } = self.original;
        write!(
            f,
            "its requested {width}x{height}, {steps} steps (it failed {} rung(s) down its ladder, at {}x{})",
            self.level, self.failed_width, self.failed_height
        )
    }
}

/// What a replay publishes for one record: where, what, and whether it was restored.
#[derive(Debug)]
struct Resend {
    subject: String,
    content_type: Option<String>,
    payload: Bytes,
    restored: Option<Restored>,
}

/// What happened to one matching record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Dry run: this would be published to `subject` with `msg_id`, restored to its requested
    /// size when it had been degraded.
    WouldReplay { subject: String, msg_id: String, restored: Option<Restored> },
    /// Published and the failed copy deleted. `duplicate`: the server already had `msg_id`
    /// (an earlier, interrupted replay queued it), so nothing was queued twice.
    Replayed { subject: String, msg_id: String, duplicate: bool, restored: Option<Restored> },
    /// Its job was rendered since (or before, by another copy): nothing to replay. The record
    /// is deleted (dry run: would be).
    Rendered { why: String },
    /// Left in place on purpose: it has no job id and its reason was not asked for, or its job
    /// was cancelled since it failed.
    Skipped { why: String },
    /// Could not be replayed; the record is kept.
    Kept { why: String },
}

impl Outcome {
    /// A record that was meant to be replayed and was not (or not completely).
    pub fn is_problem(&self) -> bool {
        matches!(self, Self::Kept { .. })
    }
}

/// Counts of what a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplaySummary {
    /// Records that matched the filter.
    pub matched: usize,
    /// Dry run: records that would be replayed.
    pub would_replay: usize,
    /// Replayed, queued now.
    pub replayed: usize,
    /// Replayed, already queued by an earlier interrupted run: only the failed copy was deleted.
    pub duplicates: usize,
    /// Records of jobs rendered since: deleted, not replayed (dry run: would be).
    pub rendered: usize,
    /// Records left on purpose: without a job id and their reason not asked for, or of a job
    /// cancelled since.
    pub skipped: usize,
    /// Records that could not be replayed and are kept.
    pub kept: usize,
    /// Why the jobs' last outcomes were not read for some records (the results stream refused
    /// or did not answer): those were replayed without the check.
    pub unchecked: Option<String>,
}

/// The failed stream could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    #[error("cannot read {stream}: {detail} (has `shotfleet setup` been run against this server?)")]
    Stream { stream: &'static str, detail: String },
    #[error("reading {stream} stopped at sequence {seq}: {detail}; records before it are done, rerunning is safe")]
    Read { stream: &'static str, seq: u64, detail: String },
}

/// Walks `SHOTS_FAILED` and replays (or, with `dry_run`, lists) every record `filter` matches;
/// `on_record` is called once per matching record with what happened to it.
///
/// # Errors
/// [`ReplayError`] when the failed stream cannot be read; per-record problems (a bad original
/// subject, a refused publish, a failed delete) are [`Outcome::Kept`] and the walk goes on.
pub async fn replay(
    js: &jetstream::Context,
    filter: &Filter,
    dry_run: bool,
    mut on_record: impl FnMut(&FailedRecord, &Outcome),
) -> Result<ReplaySummary, ReplayError> {
    let stream_err = |e: &dyn std::fmt::Display| ReplayError::Stream { stream: subject::FAILED_STREAM, detail: e.to_string() };
    let mut stream = js.get_stream(subject::FAILED_STREAM).await.map_err(|e| stream_err(&e))?;
    let last = stream.info().await.map_err(|e| stream_err(&e))?.state.last_sequence;
    let mut outcomes = LastOutcomes::open(js).await;
    let filter_subject = filter.subject();
    let mut summary = ReplaySummary::default();
    let mut next = 1;
    while next <= last {
        let message = match stream.get_first_raw_message_by_subject(&filter_subject, next).await {
            Ok(message) => message,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => break,
            Err(e) => {
                return Err(ReplayError::Read { stream: subject::FAILED_STREAM, seq: next, detail: e.to_string() });
            }
        };
        if message.sequence > last {
            break;
        }
        next = message.sequence + 1;
        let record = FailedRecord::from_message(message);
        if !filter.matches(&record) {
            continue;
        }
        summary.matched += 1;
        let outcome = settle(js, &stream, &mut outcomes, filter, &record, dry_run).await;
        match &outcome {
            Outcome::WouldReplay { .. } => summary.would_replay += 1,
            Outcome::Replayed { duplicate: false, .. } => summary.replayed += 1,
            Outcome::Replayed { duplicate: true, .. } => summary.duplicates += 1,
            Outcome::Rendered { .. } => summary.rendered += 1,
            Outcome::Skipped { .. } => summary.skipped += 1,
            Outcome::Kept { .. } => summary.kept += 1,
        }
        on_record(&record, &outcome);
    }
    summary.unchecked = outcomes.off;
    Ok(summary)
}

/// Decides, publishes and deletes one record.
async fn settle(
    js: &jetstream::Context,
    stream: &Stream,
    outcomes: &mut LastOutcomes,
    filter: &Filter,
    record: &FailedRecord,
    dry_run: bool,
) -> Outcome {
    let no_id = record.id_as_sent.as_deref().and_then(|sent| validate::id_problem(sent, validate::MAX_ID_BYTES));
    if let (None, Some(problem)) = (&record.job_id, no_id) {
        return Outcome::Skipped {
            why: format!("its job id is no valid id ({problem}): a replay would fail the same way; have its producer send it again under a valid id"),
        };
    }
    if record.job_id.is_none() && !filter.asks_for_unnamed(record) {
        let reason = if record.reason.is_empty() { "its reason" } else { record.reason.as_str() };
        return Outcome::Skipped {
            why: format!("no job id (undecodable payload); pass --reason {reason} to replay it as it is"),
        };
    }
    let (target, parsed) = match check_subject(record) {
        Ok(checked) => checked,
        Err(why) => return Outcome::Kept { why },
    };
    match outcomes.standing(record).await {
        Standing::Open => {}
        Standing::Cancelled(why) => return Outcome::Skipped { why },
        Standing::Rendered(why) if dry_run => return Outcome::Rendered { why: format!("{why}; the record would be deleted") },
        Standing::Rendered(why) => {
            return match nats::delete_stored(stream, record.seq).await {
                Ok(()) => Outcome::Rendered { why: format!("{why}; the record is deleted") },
                Err(e) => Outcome::Kept { why: format!("{why}, but the record could not be deleted: {e}") },
            };
        }
    }
    // Only a record that goes back is decoded and, when degraded, re-encoded.
    let resend = Resend::of(record, target, &parsed);
    let (target, restored) = (resend.subject.clone(), resend.restored);
    let msg_id = record.replay_msg_id();
    if dry_run {
        return Outcome::WouldReplay { subject: target, msg_id, restored };
    }
    let duplicate = match publish(js, &resend, &msg_id).await {
        Ok(duplicate) => duplicate,
        Err(e) => return Outcome::Kept { why: format!("publishing to {target} failed: {e}; the record is kept") },
    };
    // Only now, with the job back in SHOTS, may the failed copy go.
    if let Err(e) = nats::delete_stored(stream, record.seq).await {
        return Outcome::Kept {
            why: format!(
                "queued on {target} as {msg_id}, but the failed copy could not be deleted: {e}; \
                 rerun within the duplicate window to delete it without queueing the job twice"
            ),
        };
    }
    Outcome::Replayed { subject: target, msg_id, duplicate, restored }
}

/// What a record's job became after the record was written.
enum Standing {
    /// Nothing since, or it cannot be told: replay it.
    Open,
    /// Rendered: nothing to replay.
    Rendered(String),
    /// Cancelled after it failed: not to be rendered unless its owner asks again.
    Cancelled(String),
}

/// How long one read of the results stream may take: a role that may not read it is never
/// answered, and would otherwise wait a whole request timeout for each record.
const LOOKUP: Duration = Duration::from_secs(1);

/// Reads the last outcome of each record's job. Turned off, with the reason kept for the
/// summary, the first time the results stream refuses or does not answer (an older setup, a
/// role that may not read it): the records are then replayed unchecked, and a worker still
/// settles the replay of a rendered job without rendering it.
struct LastOutcomes {
    results: Option<Stream>,
    off: Option<String>,
}

impl LastOutcomes {
    async fn open(js: &jetstream::Context) -> Self {
        match tokio::time::timeout(LOOKUP, js.get_stream(subject::RESULTS_STREAM)).await {
            Ok(Ok(results)) => Self { results: Some(results), off: None },
            Ok(Err(e)) => Self::off(format!("cannot read {}: {e}", subject::RESULTS_STREAM)),
            Err(_) => Self::off(format!("{} did not answer within {LOOKUP:?}", subject::RESULTS_STREAM)),
        }
    }

    fn off(why: String) -> Self {
        Self { results: None, off: Some(why) }
    }

    async fn standing(&mut self, record: &FailedRecord) -> Standing {
        let (Some(results), Some(project), Some(job_id)) = (&self.results, &record.project, &record.job_id) else {
            return Standing::Open;
        };
        let last = match tokio::time::timeout(LOOKUP, outcome::last(results, project, job_id)).await {
            Ok(Ok(Some(last))) => last,
            // No outcome, or one that does not decode: that job's record goes as it is.
            Ok(Ok(None) | Err(OutcomeError::Unreadable { .. })) => return Standing::Open,
            Ok(Err(e @ OutcomeError::Lookup(_))) => {
                *self = Self::off(e.to_string());
                return Standing::Open;
            }
            Err(_) => {
                *self = Self::off(format!("a look-up on {} got no answer within {LOOKUP:?}", subject::RESULTS_STREAM));
                return Standing::Open;
            }
        };
        let ago = format_age(SystemTime::now().duration_since(last.stored).unwrap_or_default());
        match last.result.status {
            ResultStatus::Done | ResultStatus::Degraded => {
                let how = if last.result.status == ResultStatus::Degraded { "degraded" } else { "done" };
                let by = &last.result.worker;
                Standing::Rendered(format!("already rendered ({how}, {ago} ago, by {by}): a replay would render nothing"))
            }
            // Stored after the record: its owner stopped the job since it failed.
            ResultStatus::Cancelled if last.stored > record.written => {
                // A cancellation names who asked in its detail (`cancelled by ...`).
                let who = last.result.failure.as_ref().map(|f| f.detail.as_str()).filter(|d| !d.is_empty()).unwrap_or("by its owner");
                Standing::Cancelled(format!(
                    "cancelled {ago} ago, after it failed ({who}): `shotfleet submit --again` renders it anew; the record is kept"
                ))
            }
            ResultStatus::Cancelled | ResultStatus::Failed => Standing::Open,
        }
    }
}

impl Resend {
    /// The record as it goes back to `target` (`parsed`): byte for byte, unless it is a job a
    /// worker degraded, which goes back at its requested size to that size's subject, in its
    /// own encoding.
    fn of(record: &FailedRecord, target: String, parsed: &JobSubject) -> Self {
        let as_is = Self { subject: target, content_type: record.content_type.clone(), payload: record.payload.clone(), restored: None };
        // A payload that does not decode, or a `degrade` no worker wrote (a producer's, refused as
        // invalid), goes back as it is: a worker names why, again.
        let Ok(job) = encoding::decode_job(record.content_type.as_deref(), &record.payload) else { return as_is };
        let Some(degrade) = job.worker_degrade() else { return as_is };
        let Original { width, height, steps } = degrade.from;
        let restored = Restored { level: degrade.level, failed_width: job.width, failed_height: job.height, original: degrade.from };
        let original = ShotJob { width, height, steps, degrade: None, ..job };
        let encoding = ContentType::from_header(record.content_type.as_deref()).unwrap_or_default();
        Self {
            subject: subject::job(parsed.priority, SubjectClass::Class(original.class()), &parsed.project),
            content_type: Some(encoding.as_str().to_owned()),
            payload: encoding::encode(encoding, &original).into(),
            restored: Some(restored),
        }
    }
}

/// The record's original subject, if it is a job subject a worker serves, and its parts.
fn check_subject(record: &FailedRecord) -> Result<(String, JobSubject), String> {
    let Some(original) = record.original_subject.as_deref() else {
        return Err(format!("no {} header: nowhere to replay it to; the record is kept", failure::ORIGINAL_SUBJECT));
    };
    let parsed = subject::parse_job(original)
        .map_err(|e| format!("{} is not a job subject ({e}); the record is kept", failure::ORIGINAL_SUBJECT))?;
    if parsed.project.is_empty() || parsed.project.contains(['*', '>']) || original.contains(char::is_whitespace) {
        return Err(format!(
            "{} `{original}` names no single project; the record is kept",
            failure::ORIGINAL_SUBJECT
        ));
    }
    Ok((original.to_owned(), parsed))
}

/// Publishes the payload and waits for the PubAck; `Ok(true)` for a duplicate.
async fn publish(js: &jetstream::Context, resend: &Resend, msg_id: &str) -> Result<bool, String> {
    let mut headers = HeaderMap::new();
    if let Some(content_type) = &resend.content_type {
        headers.insert(failure::CONTENT_TYPE, content_type.as_str());
    }
    let message = PublishMessage::build().headers(headers).message_id(msg_id).payload(resend.payload.clone());
    let ack = js.send_publish(resend.subject.clone(), message).await.map_err(|e| e.to_string())?;
    let ack = ack.await.map_err(|e| e.to_string())?;
    if ack.stream != subject::JOBS_STREAM {
        // Only a stream someone added by hand could take a job subject; the job is there now.
        tracing::warn!(stream = %ack.stream, subject = %resend.subject, "replayed job stored outside the jobs stream");
    }
    Ok(ack.duplicate)
}

/// `42s`, `17m`, `5h`, `3d`: an age for a table.
pub fn format_age(age: Duration) -> String {
    let secs = age.as_secs();
    match secs {
        0..90 => format!("{secs}s"),
        90..5400 => format!("{}m", secs / 60),
        5400..172_800 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn when_takes_durations_and_timestamps() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!("2h".parse::<When>().unwrap().resolve(now), now - Duration::from_secs(7200));
        let at = "1970-01-02T00:00:01.5Z".parse::<When>().unwrap();
        assert_eq!(at, When::At(SystemTime::UNIX_EPOCH + Duration::from_millis(86_401_500)));
        let offset = "1970-01-02T02:00:00+02:00".parse::<When>().unwrap();
        assert_eq!(offset, When::At(SystemTime::UNIX_EPOCH + Duration::from_secs(86_400)));
        assert!("yesterday".parse::<When>().unwrap_err().contains("RFC 3339"));
        let day = "1970-01-02".parse::<When>().unwrap().resolve(now);
        assert_eq!(day, SystemTime::UNIX_EPOCH + Duration::from_secs(86_400), "a bare date is its midnight, UTC");
    }

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(format_age(Duration::from_secs(42)), "42s");
        assert_eq!(format_age(Duration::from_secs(17 * 60)), "17m");
        assert_eq!(format_age(Duration::from_secs(5 * 3600)), "5h");
        assert_eq!(format_age(Duration::from_secs(3 * 86_400)), "3d");
    }

    fn record(job: Option<&str>, reason: &str, subject: Option<&str>) -> FailedRecord {
        FailedRecord {
            seq: 7,
            subject: "shots.failed.p1.acme".into(),
            project: Some("acme".into()),
            job_id: job.map(Into::into),
            id_as_sent: None,
            reason: reason.into(),
            detail: String::new(),
            attempts: "1".into(),
            original_subject: subject.map(Into::into),
            content_type: None,
            written: SystemTime::now(),
            payload: Bytes::new(),
        }
    }

    #[test]
    fn msg_ids_name_the_record() {
        assert_eq!(record(Some("ep1-s1"), "oom", None).replay_msg_id(), "ep1-s1:replay:7");
        assert_eq!(record(None, "invalid", None).replay_msg_id(), "seq-7:replay:7");
    }

    #[test]
    fn only_job_subjects_are_targets() {
        assert!(check_subject(&record(Some("j"), "oom", Some("shots.p1.m.acme"))).is_ok());
        assert!(check_subject(&record(Some("j"), "oom", None)).unwrap_err().contains("no Shotfleet-Original-Subject"));
        assert!(check_subject(&record(Some("j"), "oom", Some("shots.failed.p1.acme"))).is_err());
        assert!(check_subject(&record(Some("j"), "oom", Some("shots.p1.m.*"))).is_err());
    }

    #[test]
    fn a_record_whose_id_is_no_id_is_named_and_found_by_it() {
        let sent = FailedRecord { id_as_sent: Some("ep1.s1".into()), ..record(None, "invalid", Some("shots.p1.m.acme")) };
        assert_eq!(sent.job_name(), r#""ep1.s1" (no valid id)"#);
        let by_id = Filter { jobs: vec!["ep1.s1".into()], ..Default::default() };
        assert!(by_id.matches(&sent));
        let hostile = FailedRecord { id_as_sent: Some(format!("a\r\n{}", "x".repeat(100))), ..sent };
        assert!(hostile.job_name().len() < 60 && !hostile.job_name().contains('\n'), "{}", hostile.job_name());
    }

    #[test]
    fn unnamed_records_need_their_reason_asked_for() {
        let unnamed = record(None, "invalid", Some("shots.p1.m.acme"));
        assert!(!Filter::default().asks_for_unnamed(&unnamed));
        let asked = Filter { reasons: vec![FailureReason::Invalid], ..Default::default() };
        assert!(asked.matches(&unnamed) && asked.asks_for_unnamed(&unnamed));
        let narrowed = Filter { projects: vec!["acme".into()], ..Default::default() };
        assert_eq!(narrowed.subject(), "shots.failed.*.acme");
    }
}
