//! Cancelling jobs: a request on `shots.cancel.<project>.<target>` that the fleet answers.
//!
//! `<target>` is a job id, or [`WHOLE_PROJECT`] with exactly one of the request's `jobs` (a list),
//! `shot`, or `all` (every unfinished job of the project). A request is refused whole, nothing
//! cancelled, when it is not exactly that: a misspelt field or a list that came out empty must
//! not read as "the whole project". One worker answers each request (a queue group): it claims
//! a `cancelled` outcome on each job's result subject (`Nats-Expected-Last-Subject-Sequence`, as
//! every outcome), removes the job's queued messages from `SHOTS`, and replies with a
//! [`CancelReply`]. A worker rendering a cancelled job sees the outcome land on the job's result
//! subject and stops at its next step. A job whose last outcome is a rendered result, or that
//! has nothing queued or running after a cancelled outcome, is already finished: nothing changes.
//! A job that failed, with nothing queued since, is cancelled over its failure, so that
//! `shotfleet replay` (which skips a job cancelled after it failed) does not render it.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::result::ResultStatus;

/// The target token of a request for several jobs of a project (never a job id: ids hold only
/// letters, digits, `_` and `-`).
pub const WHOLE_PROJECT: &str = "@project";

/// The queue group that answers cancel requests: exactly one worker handles each.
pub const QUEUE_GROUP: &str = "shotfleet-cancel";

/// A cancel request: a JSON object (an empty payload is a request with no name, for a job
/// target). Unknown fields are refused, not ignored: this request deletes work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "CancelRequest", description = "A shotfleet cancel request, contract version 1.")]
pub struct CancelRequest {
    /// Contract version; 1.
    #[serde(default = "v1")]
    pub v: u32,
    /// Who cancels, for the outcome's `failure.detail` (a person, a tool).
    #[serde(default)]
    pub by: String,
    /// Sent to `shots.cancel.<project>.@project` (the literal token `@project`): these jobs (not empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jobs: Vec<String>,
    /// Sent to `shots.cancel.<project>.@project`: the unfinished jobs of this shot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shot: Option<String>,
    /// Sent to `shots.cancel.<project>.@project`: every unfinished job of the project. Must be set for that.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all: bool,
}

/// What an empty payload asks: this contract's version, no name, no selection.
impl Default for CancelRequest {
    fn default() -> Self {
        Self { v: crate::VERSION, by: String::new(), jobs: Vec::new(), shot: None, all: false }
    }
}

/// The jobs a valid request selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// These job ids (one for a job target).
    Jobs(Vec<String>),
    /// The unfinished jobs of this shot.
    Shot(String),
    /// Every unfinished job of the project.
    All,
}

impl CancelRequest {
    /// What this request selects when sent to `target` (a job id or [`WHOLE_PROJECT`]).
    ///
    /// # Errors
    /// Why the request is refused as a whole, for the reply's `error`.
    pub fn selection(&self, target: &str) -> Result<Selection, String> {
        if self.v != crate::VERSION {
            return Err(format!("contract version {} is not supported; use {}", self.v, crate::VERSION));
        }
        let given: Vec<&str> =
            [(!self.jobs.is_empty(), "jobs"), (self.shot.is_some(), "shot"), (self.all, "all")].iter().filter(|g| g.0).map(|g| g.1).collect();
        if target != WHOLE_PROJECT {
            return match given[..] {
                [] => Ok(Selection::Jobs(vec![target.to_owned()])),
                _ => Err(format!(
                    "the subject names job `{target}`; `{}` is for requests to `{WHOLE_PROJECT}`",
                    given.join("`, `")
                )),
            };
        }
        match (given.len(), &self.shot) {
            (0, _) => Err(format!(
                "a request to `{WHOLE_PROJECT}` names what to cancel: `jobs` (a non-empty list), `shot`, or `all: true` \
                 for every unfinished job of the project"
            )),
            (2.., _) => Err(format!("give one of `jobs`, `shot` and `all`, not `{}` together", given.join("` and `"))),
            (_, Some(shot)) => Ok(Selection::Shot(shot.clone())),
            _ if self.all => Ok(Selection::All),
            _ => Ok(Selection::Jobs(self.jobs.clone())),
        }
    }
}

/// The answer to a [`CancelRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "CancelReply", description = "A shotfleet cancel reply, contract version 1.")]
pub struct CancelReply {
    pub v: u32,
    /// The worker that answered.
    pub worker: String,
    /// One entry per job the request named or selected, the first [`MAX_LISTED`] of them: a
    /// reply must fit one NATS message (1 MiB by default), and a project's thousands would not.
    pub jobs: Vec<CancelledJob>,
    /// Entries left out of `jobs` (counted in `tally`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted: u32,
    /// How many jobs ended each way, listed or not (absent from workers before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tally: Option<CancelTally>,
    /// Set when the request could not be handled at all (a malformed request, the streams
    /// unreadable); nothing was cancelled then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The most jobs a reply lists; the rest are counted ([`CancelReply::omitted`]).
pub const MAX_LISTED: usize = 2000;

/// How many jobs a request ended each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CancelTally {
    pub cancelled: u32,
    pub already_finished: u32,
    pub unknown: u32,
    pub failed: u32,
}

impl CancelTally {
    /// How many of `jobs` ended each way.
    pub fn of(jobs: &[CancelledJob]) -> Self {
        let mut tally = CancelTally::default();
        for job in jobs {
            *match job.result {
                CancelResult::Cancelled => &mut tally.cancelled,
                CancelResult::AlreadyFinished => &mut tally.already_finished,
                CancelResult::Unknown => &mut tally.unknown,
                CancelResult::Failed => &mut tally.failed,
            } += 1;
        }
        tally
    }
}

impl CancelReply {
    /// The reply listing `jobs` (the first [`MAX_LISTED`]), with their tally.
    pub fn with_jobs(v: u32, worker: String, mut jobs: Vec<CancelledJob>) -> Self {
        let tally = CancelTally::of(&jobs);
        let omitted = u32::try_from(jobs.len().saturating_sub(MAX_LISTED)).unwrap_or(u32::MAX);
        jobs.truncate(MAX_LISTED);
        Self { v, worker, jobs, omitted, tally: Some(tally), error: None }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
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
    /// Its outcome is now `cancelled`: it will not be rendered (a render in progress stops; a
    /// job that had failed is not replayed).
    Cancelled,
    /// It had already finished (rendered, or cancelled before); nothing changed.
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
        [crate::subject::ROOT, "cancel", _, target] if target.starts_with('@') && target != WHOLE_PROJECT => {
            Err(format!("`{subject}`: the token for the whole project is `{WHOLE_PROJECT}`, as written (shots.cancel.<project>.{WHOLE_PROJECT})"))
        }
        [crate::subject::ROOT, "cancel", project, target] => Ok((project.to_owned(), target.to_owned())),
        _ => Err(format!(
            "`{subject}` is not a cancel subject: shots.cancel.<project>.<job_id>, or shots.cancel.<project>.{WHOLE_PROJECT} (the token as written)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<CancelRequest, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn a_reply_lists_at_most_max_listed_jobs_and_counts_them_all() {
        let job = |i: usize, result| CancelledJob {
            job_id: format!("j{i}"),
            shot_id: String::new(),
            result,
            status: None,
            removed: 0,
            detail: String::new(),
        };
        let jobs: Vec<CancelledJob> =
            (0..MAX_LISTED + 500).map(|i| job(i, if i % 5 == 0 { CancelResult::AlreadyFinished } else { CancelResult::Cancelled })).collect();
        let reply = CancelReply::with_jobs(1, "w".into(), jobs);
        assert_eq!((reply.jobs.len(), reply.omitted), (MAX_LISTED, 500));
        let tally = reply.tally.unwrap();
        assert_eq!((tally.cancelled, tally.already_finished), (2000, 500));
        // 2,500 entries stay far inside a NATS message (1 MiB by default) listed; the rest counted.
        assert!(serde_json::to_vec(&reply).unwrap().len() < 512 * 1024);
    }

    #[test]
    fn a_request_for_the_whole_project_says_so() {
        let select = |json: &str, target: &str| parse(json).and_then(|r| r.selection(target));
        assert_eq!(select(r#"{"v":1,"all":true}"#, WHOLE_PROJECT), Ok(Selection::All));
        assert!(parse_subject("shots.cancel.acme.@acme").unwrap_err().contains("the token for the whole project is `@project`, as written"));
        assert_eq!(select(r#"{"jobs":["a","b"]}"#, WHOLE_PROJECT), Ok(Selection::Jobs(vec!["a".into(), "b".into()])));
        assert_eq!(select(r#"{"shot":"s1"}"#, WHOLE_PROJECT), Ok(Selection::Shot("s1".into())));
        assert_eq!(select("{}", "job-1"), Ok(Selection::Jobs(vec!["job-1".into()])));
        // An empty payload (`nats req shots.cancel.<project>.<job> ''`) is the default request.
        assert_eq!(CancelRequest::default().selection("job-1"), Ok(Selection::Jobs(vec!["job-1".into()])));
        assert!(CancelRequest::default().selection(WHOLE_PROJECT).unwrap_err().contains("names what to cancel"));
        // What an outside client may send by mistake: none of it reads as the whole project.
        for (json, says) in [
            (r#"{"v":1,"jobs":[]}"#, "names what to cancel"),
            (r#"{"v":1}"#, "names what to cancel"),
            (r#"{"v":1,"job":"x1"}"#, "unknown field `job`"),
            (r#"{"job_ids":["x1"]}"#, "unknown field `job_ids`"),
            (r#"{"shot":null}"#, "names what to cancel"),
            (r#"{"v":2,"all":true}"#, "contract version 2"),
            (r#"{"v":99,"jobs":["x1"]}"#, "contract version 99"),
            (r#"{"jobs":["x1"],"all":true}"#, "not `jobs` and `all` together"),
        ] {
            let refused = select(json, WHOLE_PROJECT).unwrap_err();
            assert!(refused.contains(says), "{json}: {refused}");
        }
        let refused = select(r#"{"all":true}"#, "job-1").unwrap_err();
        assert!(refused.contains("names job `job-1`"), "{refused}");
    }
}
