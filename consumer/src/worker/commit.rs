//! The commit protocol: the result is the commit point.
//!
//! 1. On fetch, look up the job's result (a direct get of the last message on
//!    `shots.done.<project>.<job>`). If it exists, the job is done: sweep and ack.
//! 2. Render, and upload to content-addressed keys (`<shot>-<index>-<sha8>.png`).
//! 3. Publish the result with `Nats-Msg-Id = <job>:done`. If the server says duplicate, another
//!    worker committed first: its result stands.
//! 4. Sweep: delete every object under the job's prefix that the committed result does not
//!    name. Then ack.
//!
//! This differs from deleting an earlier attempt's leftovers *before* rendering: two workers can
//! hold the same job at once (a redelivery while the first is still alive), and a delete before
//! the commit could remove images the other is about to name in its result. Sweeping only
//! against a committed result never touches a named image, and every delivery of a job ends with
//! a sweep after the commit (step 1 sweeps too), so leftovers of crashed attempts go with the
//! next delivery.

use std::collections::HashSet;

use async_nats::HeaderMap;
use async_nats::jetstream::stream::DirectGetErrorKind;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::{subject, ShotResult};

use crate::worker::Shared;

/// Why a result could not be read or written; the job should be naked and retried.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CommitError(pub String);

/// The committed result of a job, if any.
pub async fn existing_result(shared: &Shared, project: &str, job_id: &str) -> Result<Option<ShotResult>, CommitError> {
    let subject = subject::result(project, job_id);
    match shared.results.direct_get_last_for_subject(subject).await {
        Ok(message) => {
            let ct = message.headers.get(encoding::HEADER).map(|v| v.as_str().to_owned());
            let ct = ContentType::from_header(ct.as_deref()).map_err(|e| CommitError(e.to_string()))?;
            encoding::decode(ct, &message.payload).map(Some).map_err(|e| CommitError(format!("committed result unreadable: {e}")))
        }
        Err(e) if matches!(e.kind(), DirectGetErrorKind::NotFound) => Ok(None),
        Err(e) => Err(CommitError(format!("cannot look up the result: {e}"))),
    }
}

/// What publishing a result found.
pub enum Commit {
    /// Ours is the job's result.
    Ours,
    /// Another worker's result was already committed; it is returned.
    Theirs(Box<ShotResult>),
}

/// Publishes `result` deduplicated by `<job>:done`.
pub async fn publish(shared: &Shared, result: &ShotResult) -> Result<Commit, CommitError> {
    let mut headers = HeaderMap::new();
    headers.insert(encoding::HEADER, ContentType::Json.as_str());
    headers.insert("Nats-Msg-Id", subject::msg_id::done(&result.job_id).as_str());
    let payload = encoding::encode(ContentType::Json, result);
    let ack = shared
        .js
        .publish_with_headers(subject::result(&result.project, &result.job_id), headers, payload.into())
        .await
        .map_err(|e| CommitError(format!("cannot publish the result: {e}")))?
        .await
        .map_err(|e| CommitError(format!("result not acknowledged: {e}")))?;
    if !ack.duplicate {
        return Ok(Commit::Ours);
    }
    match existing_result(shared, &result.project, &result.job_id).await? {
        Some(theirs) => Ok(Commit::Theirs(Box::new(theirs))),
        // Duplicate inside the window but no result stored: the stream lost it (max age).
        None => Err(CommitError("the server reports a duplicate result but holds none".into())),
    }
}

/// Deletes every object under the job's prefix that `result` does not name.
pub async fn sweep(shared: &Shared, result: &ShotResult) -> Result<usize, CommitError> {
    let keep: HashSet<String> = result.images.iter().map(|i| i.key.clone()).collect();
    shared
        .store
        .sweep_job(&result.project, &result.job_id, &keep)
        .await
        .map_err(|e| CommitError(format!("cannot sweep the job's objects: {e}")))
}
