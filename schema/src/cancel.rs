//! Cancelling jobs: a request on `shots.cancel.<project>.<target>` that the fleet answers.
//!
//! `<target>` is a job id, or [`WHOLE_PROJECT`] for every unfinished job of the project (narrowed
//! by the request's `shot` or `jobs`). One worker answers each request (a queue group): it claims
//! a `cancelled` outcome on each job's result subject (`Nats-Expected-Last-Subject-Sequence`, as
//! every outcome), removes the job's queued messages from `SHOTS`, and replies with a
//! [`CancelReply`]. A worker rendering a cancelled job sees the outcome land on the job's result
//! subject and stops at its next step. A job whose last outcome is a rendered result, or that
//! has nothing queued or running after a failed or cancelled outcome, is already finished:
//! nothing changes.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::result::ResultStatus;

/// The target token of a request for several jobs of a project (never a job id: ids hold only
/// letters, digits, `_` and `-`).
pub const WHOLE_PROJECT: &str = "@project";

/// The queue group that answers cancel requests: exactly one worker handles each.
pub const QUEUE_GROUP: &str = "shotfleet-cancel";

/// A cancel request (the payload; an empty payload is a request with no name).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "CancelRequest", description = "A shotfleet cancel request, contract version 1.")]
pub struct CancelRequest {
    /// Contract version; 1.
    #[serde(default = "v1")]
    pub v: u32,
    /// Who cancels, for the outcome's `failure.detail` (a person, a tool).
    #[serde(default)]
    pub by: String,
    /// With target [`WHOLE_PROJECT`]: only these jobs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jobs: Vec<String>,
    /// With target [`WHOLE_PROJECT`]: only the jobs of this shot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shot: Option<String>,
}

/// The answer to a [`CancelRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "CancelReply", description = "A shotfleet cancel reply, contract version 1.")]
pub struct CancelReply {
    pub v: u32,
    /// The worker that answered.
    pub worker: String,
    /// One entry per job the request named or selected.
    pub jobs: Vec<CancelledJob>,
    /// Set when the request could not be handled at all (a malformed request, the streams
    /// unreadable); nothing was cancelled then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What became of one job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CancelledJob {
    pub job_id: String,
    #[serde(default)]
    pub shot_id: String,
    pub result: CancelResult,
    /// The job's outcome now: `cancelled`, or the outcome it already had.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ResultStatus>,
    /// Queued copies removed from `SHOTS`.
    #[serde(default)]
    pub removed: u32,
    /// For a person: who finished it, or why nothing changed.
    #[serde(default)]
    pub detail: String,
}

/// What a cancel did to one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CancelResult {
    /// Its outcome is now `cancelled`: it will not be rendered (a render in progress stops).
    Cancelled,
    /// It had already finished; nothing changed.
    AlreadyFinished,
    /// Nothing of it is queued, running or finished in the project.
    Unknown,
    /// The cancel could not be committed (the stream refused); try again.
    Failed,
}

fn v1() -> u32 {
    crate::VERSION
}

/// Where a cancel request for `target` (a job id or [`WHOLE_PROJECT`]) goes.
pub fn subject(project: &str, target: &str) -> String {
    format!("{}.cancel.{project}.{target}", crate::subject::ROOT)
}

/// Parses `shots.cancel.<project>.<target>` into the project and the target.
///
/// # Errors
/// A message naming what is wrong.
pub fn parse_subject(subject: &str) -> Result<(String, String), String> {
    match subject.split('.').collect::<Vec<_>>()[..] {
        [crate::subject::ROOT, "cancel", project, target] => Ok((project.to_owned(), target.to_owned())),
        _ => Err(format!("`{subject}` is not a cancel subject: shots.cancel.<project>.<job_id|{WHOLE_PROJECT}>")),
    }
}
