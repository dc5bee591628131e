//! Waiting for submitted jobs: every job ends with a result or a failed record.
//!
//! Outcomes (on the result subjects) and failed records are read from their streams with
//! ordered push consumers, one per project and stream (one filter each, as nats-server 2.9
//! requires). A rendered result is final whenever it was written: a worker never renders a job
//! whose result exists. A failure (a `failed` or `cancelled` outcome, or a failed record) counts
//! when it was written after this submission started, or when the job was a duplicate (it was
//! not queued again, so an earlier failure is its fate; one still queued, a failure written
//! after that message); a later result overrides it (a replay).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::{ShotResult, failure, subject};

/// How a job ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Done(Box<ShotResult>),
    Failed { reason: String, detail: String, attempts: String },
}

impl Outcome {
    pub fn is_failed(&self) -> bool {
        matches!(self, Self::Failed { .. })
    }
}

/// A failure as one line of a listing, `reason: detail` with the detail cut to
/// [`BRIEF_DETAIL_CHARS`] on one line: ONNX Runtime's out-of-memory text runs to several lines of
/// allocator figures, which would break the row. The outcome on the result subject keeps the
/// whole text.
pub fn failure_line(reason: &str, detail: &str) -> String {
    let flat = detail.split_whitespace().collect::<Vec<_>>().join(" ");
    let brief = match flat.char_indices().nth(BRIEF_DETAIL_CHARS) {
        Some((cut, _)) => format!("{}… (cut: the job's outcome has it all)", &flat[..cut]),
        None => flat,
    };
    if brief.is_empty() { reason.to_owned() } else { format!("{reason}: {brief}") }
}

/// How much of a failure's detail a listing shows.
pub const BRIEF_DETAIL_CHARS: usize = 200;

/// A job to wait for. Outcomes are keyed by its [`key`](Awaited::key): ids are unique within
/// a project only, and one storyboard may name several projects.
#[derive(Debug, Clone)]
pub struct Awaited {
    pub project: String,
    pub job_id: String,
    /// The submission found it already queued (or done) inside the duplicate window.
    pub duplicate: bool,
    /// For a duplicate whose message is still queued: when that message was published. A
    /// failure before it is an earlier request's, not this one's fate (a server restart forgets
    /// the window of messages no longer stored, so a job failed before it is queued again).
    pub queued_at: Option<SystemTime>,
}

impl Awaited {
    /// `<project>/<job_id>`, as [`shotfleet_schema::job::key`].
    pub fn key(&self) -> String {
        shotfleet_schema::job::key(&self.project, &self.job_id)
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    #[error("cannot follow {what}: {detail}")]
    Follow { what: String, detail: String },
    #[error("gave up after {after:?}: {} of the jobs have no result or failed record yet ({})", pending.len(), listed(pending, 10))]
    TimedOut {
        after: Duration,
        /// The jobs without an outcome, by key.
        pending: Vec<String>,
        /// The outcomes that did arrive, by key.
        so_far: HashMap<String, Outcome>,
    },
}

/// The first `first` of `ids`, and how many more, for a message.
pub fn listed(ids: &[String], first: usize) -> String {
    let more = if ids.len() > first { format!(", and {} more", ids.len() - first) } else { String::new() };
    format!("{}{more}", ids.iter().take(first).cloned().collect::<Vec<_>>().join(", "))
}

/// Follows results and failed records until every job in `jobs` has an outcome; the outcomes
/// are keyed by [`Awaited::key`]. `on_outcome` is called with the key as outcomes arrive (for
/// progress).
///
/// # Errors
/// [`WaitError::TimedOut`] when `timeout` passes first; [`WaitError::Follow`] when a stream
/// cannot be read.
pub async fn wait(
    js: &jetstream::Context,
    jobs: &[Awaited],
    since: SystemTime,
    timeout: Option<Duration>,
    mut on_outcome: impl FnMut(&str, &Outcome),
) -> Result<HashMap<String, Outcome>, WaitError> {
    let wanted: HashMap<String, &Awaited> = jobs.iter().map(|j| (j.key(), j)).collect();
    let projects: BTreeSet<&str> = jobs.iter().map(|j| j.project.as_str()).collect();
    let mut feeds = Vec::new();
    // Each feed's project: a failed record names its job by id alone.
    let mut feed_project: Vec<&str> = Vec::new();
    // The feeds (by index) still delivering what was stored before the wait began: a failure
    // read from them may be followed by a later result of the same job (a replay), so the wait
    // does not end on a failure before they are read through.
    let mut behind: HashSet<usize> = HashSet::new();
    for project in projects {
        for (stream, filter) in [
            (subject::RESULTS_STREAM, format!("{}.done.{project}.*", subject::ROOT)),
            (subject::FAILED_STREAM, format!("{}.failed.*.{project}", subject::ROOT)),
        ] {
            let (messages, pending) = follow_counted(js, stream, filter, consumer::DeliverPolicy::All).await?;
            let feed = feeds.len();
            if pending > 0 {
                behind.insert(feed);
            }
            feed_project.push(project);
            feeds.push(messages.map(move |message| (feed, message)));
        }
    }
    let mut messages = futures::stream::select_all(feeds);
    let mut outcomes: HashMap<String, Outcome> = HashMap::new();
    let mut done: HashSet<String> = HashSet::new();
    // Failures read from what was stored before the wait began: told only once that is read
    // through, and only if no later result of the job (a replay, `--again`) replaced them.
    let mut untold: Vec<String> = Vec::new();
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let settled = |done: &HashSet<String>, outcomes: &HashMap<String, Outcome>, behind: &HashSet<usize>| {
        done.len() >= wanted.len() && (behind.is_empty() || !outcomes.values().any(Outcome::is_failed))
    };

    while !settled(&done, &outcomes, &behind) {
        // Stored messages come at once: a feed quiet this long while behind has nothing more to
        // deliver (its last stored message may have been deleted before it was delivered, and
        // none then says `pending: 0`). Only a quiet spell that ends before the deadline counts.
        let quiet = (!behind.is_empty())
            .then(|| tokio::time::Instant::now() + HISTORY_IDLE)
            .filter(|quiet| deadline.is_none_or(|deadline| *quiet < deadline));
        let next = match quiet.or(deadline) {
            None => messages.next().await,
            Some(until) => match tokio::time::timeout_at(until, messages.next()).await {
                Ok(next) => next,
                Err(_) if quiet.is_some() => {
                    behind.clear();
                    tell_standing_failures(&mut untold, &outcomes, &mut on_outcome);
                    continue;
                }
                Err(_) => {
                    let mut pending: Vec<String> = wanted.keys().filter(|key| !done.contains(*key)).cloned().collect();
                    pending.sort();
                    return Err(WaitError::TimedOut { after: timeout.unwrap_or_default(), pending, so_far: outcomes });
                }
            },
        };
        let Some((feed, message)) = next else { break };
        let Ok(message) = message else { continue };
        let caught_up = message.info().is_ok_and(|info| info.pending == 0);
        if caught_up {
            behind.remove(&feed);
        }
        // A result is final; a failure stands only until a result arrives, and is told once
        // (a failed job has both a failed outcome and a failed record).
        let read = read_outcome(&message, feed_project[feed], &wanted, since);
        if let Some((key, outcome)) = read.filter(|(key, outcome)| !outcomes.get(key).is_some_and(|o| !o.is_failed() || outcome.is_failed())) {
            if outcome.is_failed() && !behind.is_empty() {
                untold.push(key.clone());
            } else {
                on_outcome(&key, &outcome);
            }
            if !outcome.is_failed() || !done.contains(&key) {
                done.insert(key.clone());
            }
            outcomes.insert(key, outcome);
        }
        // After this message's outcome: it may be the result that replaces a held-back failure.
        if caught_up && behind.is_empty() {
            tell_standing_failures(&mut untold, &outcomes, &mut on_outcome);
        }
    }
    tell_standing_failures(&mut untold, &outcomes, &mut on_outcome);
    Ok(outcomes)
}

/// How long the feeds of stored messages may be quiet before their history counts as read.
const HISTORY_IDLE: Duration = Duration::from_secs(2);

/// Tells the failures held back in `untold` that still stand.
fn tell_standing_failures(untold: &mut Vec<String>, outcomes: &HashMap<String, Outcome>, on_outcome: &mut impl FnMut(&str, &Outcome)) {
    for key in untold.drain(..) {
        if let Some(outcome) = outcomes.get(&key).filter(|outcome| outcome.is_failed()) {
            on_outcome(&key, outcome);
        }
    }
}

/// An ordered consumer over one stream and filter, from `deliver` on. Retried for a while:
/// during a cluster's leader election, JetStream API requests time out until a new leader
/// answers.
///
/// # Errors
/// [`WaitError::Follow`] when the stream cannot be read after that while.
pub async fn follow(
    js: &jetstream::Context,
    stream: &str,
    filter: String,
    deliver: consumer::DeliverPolicy,
) -> Result<consumer::push::Ordered, WaitError> {
    follow_counted(js, stream, filter, deliver).await.map(|(messages, _)| messages)
}

/// [`follow`], with how many stored messages it has to deliver before the new ones.
///
/// # Errors
/// As [`follow`].
async fn follow_counted(
    js: &jetstream::Context,
    stream: &str,
    filter: String,
    deliver: consumer::DeliverPolicy,
) -> Result<(consumer::push::Ordered, u64), WaitError> {
    const PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);
    let started = tokio::time::Instant::now();
    loop {
        match try_follow(js, stream, &filter, deliver).await {
            Ok(followed) => return Ok(followed),
            Err(detail) if started.elapsed() < PATIENCE => {
                tracing::warn!(stream, filter = %filter, error = %detail, "cannot follow yet; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            Err(detail) => return Err(WaitError::Follow { what: format!("{stream} ({filter})"), detail }),
        }
    }
}

async fn try_follow(
    js: &jetstream::Context,
    stream: &str,
    filter: &str,
    deliver: consumer::DeliverPolicy,
) -> Result<(consumer::push::Ordered, u64), String> {
    let stream = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    let inbox = js.client().new_inbox();
    // A named consumer is created on `CONSUMER.CREATE.<stream>.<name>.<filter>`, which a
    // producer's permissions allow for its own projects' filters only (deploy/nats).
    let name = format!("wait-{}", inbox.rsplit('.').next().unwrap_or_default());
    let consumer = stream
        .create_consumer(consumer::push::OrderedConfig {
            name: Some(name),
            deliver_subject: inbox,
            filter_subject: filter.to_owned(),
            deliver_policy: deliver,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let pending = consumer.cached_info().num_pending;
    Ok((consumer.messages().await.map_err(|e| e.to_string())?, pending))
}

/// The key and outcome a message of `project`'s feeds gives one of the `wanted` jobs.
fn read_outcome(
    message: &jetstream::Message,
    project: &str,
    wanted: &HashMap<String, &Awaited>,
    since: SystemTime,
) -> Option<(String, Outcome)> {
    let header = |name: &str| message.headers.as_ref().and_then(|h| shotfleet_schema::nats::header_value(h, name));
    let written: SystemTime = message.info().ok()?.published.into();
    let counts = |key: &str| {
        wanted.get(key).is_some_and(|awaited| match (awaited.duplicate, awaited.queued_at) {
            (true, Some(queued)) => written >= queued,
            (true, None) => true,
            (false, _) => written >= since,
        })
    };
    if message.subject.starts_with(&format!("{}.done.", subject::ROOT)) {
        let content_type = ContentType::from_header(header(encoding::HEADER).as_deref()).ok()?;
        let result: ShotResult = encoding::decode(content_type, &message.payload).ok()?;
        let key = result.key();
        if !wanted.contains_key(&key) {
            return None;
        }
        if result.is_rendered() {
            return Some((key, Outcome::Done(Box::new(result))));
        }
        if !counts(&key) {
            return None;
        }
        let failure = result.failure.clone().unwrap_or_default();
        let reason = failure.reason.map_or_else(|| "cancelled".to_owned(), |r| r.to_string());
        Some((key, Outcome::Failed { reason, detail: failure.detail, attempts: failure.attempts.to_string() }))
    } else {
        let key = shotfleet_schema::job::key(project, &header(failure::JOB_ID)?);
        if !counts(&key) {
            return None;
        }
        let outcome = Outcome::Failed {
            reason: header(failure::REASON).unwrap_or_default(),
            detail: header(failure::DETAIL).unwrap_or_default(),
            attempts: header(failure::ATTEMPTS).unwrap_or_default(),
        };
        Some((key, outcome))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_one_line_and_a_long_detail_is_cut() {
        let oom = "out of memory at 2048x2048 one image at a time: Failed to allocate memory\n  BFCArena::AllocateRawInternal\n\tAvailable memory of 1234 is smaller than requested bytes of 5678";
        assert_eq!(
            failure_line("oom", oom),
            "oom: out of memory at 2048x2048 one image at a time: Failed to allocate memory BFCArena::AllocateRawInternal Available memory of 1234 is smaller than requested bytes of 5678"
        );
        let long = "é".repeat(BRIEF_DETAIL_CHARS + 50);
        let line = failure_line("driver", &long);
        assert!(line.starts_with(&format!("driver: {}…", "é".repeat(BRIEF_DETAIL_CHARS))), "{line}");
        assert!(line.ends_with("(cut: the job's outcome has it all)"), "{line}");
        assert_eq!(failure_line("cancelled", ""), "cancelled");
        assert_eq!(failure_line("invalid", "width: 10 is not a multiple of 8"), "invalid: width: 10 is not a multiple of 8");
    }
}
