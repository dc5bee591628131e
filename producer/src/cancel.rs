//! `shotfleet cancel`: asks the fleet to cancel jobs of a project (schema `cancel`) and reports
//! what became of each. One worker answers; the client needs no access to the queue.

use std::time::Duration;

use shotfleet_schema::cancel::{self, CancelReply, CancelRequest, WHOLE_PROJECT};
use shotfleet_schema::validate::{MAX_ID_BYTES, MAX_PROJECT_BYTES, id_problem};

/// Which jobs of a project.
#[derive(Debug, Clone)]
pub struct Selection {
    pub project: String,
    /// These jobs; none: every unfinished job of the project (or of `shot`).
    pub jobs: Vec<String>,
    pub shot: Option<String>,
}

impl Selection {
    /// Checks every id; the message names the one to fix.
    ///
    /// # Errors
    /// An id that no job can have.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(problem) = id_problem(&self.project, MAX_PROJECT_BYTES) {
            return Err(format!("project `{}` {problem}", self.project));
        }
        for id in self.jobs.iter().chain(&self.shot) {
            if let Some(problem) = id_problem(id, MAX_ID_BYTES) {
                return Err(format!("`{id}` {problem}"));
            }
        }
        Ok(())
    }

    /// The request's subject and payload.
    pub fn request(&self, by: &str) -> (String, CancelRequest) {
        let request = CancelRequest { v: shotfleet_schema::VERSION, by: by.to_owned(), jobs: Vec::new(), shot: None };
        match (&self.jobs[..], &self.shot) {
            ([job], None) => (cancel::subject(&self.project, job), request),
            _ => (
                cancel::subject(&self.project, WHOLE_PROJECT),
                CancelRequest { jobs: self.jobs.clone(), shot: self.shot.clone(), ..request },
            ),
        }
    }
}

/// Why nothing was cancelled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CancelError {
    #[error("no worker answered the cancel request within {0:?}: nothing was cancelled (is any worker running?)")]
    NoAnswer(Duration),
    #[error(
        "no worker is running to take the cancel request: nothing was cancelled (queued jobs can be cancelled once a worker is up)"
    )]
    NoWorker,
    #[error("the cancel request failed: {0}")]
    Request(String),
    #[error("the worker could not cancel: {0}")]
    Refused(String),
}

/// Sends the request and waits up to `timeout` for the answer.
///
/// # Errors
/// [`CancelError`]: no worker answered, the request failed, or the worker could not handle it.
pub async fn cancel(client: &async_nats::Client, selection: &Selection, by: &str, timeout: Duration) -> Result<CancelReply, CancelError> {
    let (subject, request) = selection.request(by);
    let payload = serde_json::to_vec(&request).expect("requests serialize");
    let ask = async_nats::Request::new().payload(payload.into()).timeout(Some(timeout));
    let answer = client.send_request(subject, ask).await.map_err(|e| match e.kind() {
        async_nats::RequestErrorKind::NoResponders => CancelError::NoWorker,
        async_nats::RequestErrorKind::TimedOut => CancelError::NoAnswer(timeout),
        _ => CancelError::Request(e.to_string()),
    })?;
    let reply: CancelReply =
        serde_json::from_slice(&answer.payload).map_err(|e| CancelError::Request(format!("the answer is not a CancelReply: {e}")))?;
    match reply.error {
        Some(error) => Err(CancelError::Refused(error)),
        None => Ok(reply),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selection(jobs: &[&str], shot: Option<&str>) -> Selection {
        Selection { project: "tide".into(), jobs: jobs.iter().map(|j| (*j).to_owned()).collect(), shot: shot.map(str::to_owned) }
    }

    #[test]
    fn one_job_goes_to_its_own_subject_anything_else_to_the_project() {
        let (subject, request) = selection(&["ep1-s1"], None).request("ana");
        assert_eq!(subject, "shots.cancel.tide.ep1-s1");
        assert!(request.jobs.is_empty() && request.by == "ana");
        let (subject, request) = selection(&["a", "b"], None).request("ana");
        assert_eq!((subject.as_str(), request.jobs.len()), ("shots.cancel.tide.@project", 2));
        let (subject, request) = selection(&[], Some("s03")).request("ana");
        assert_eq!((subject.as_str(), request.shot.as_deref()), ("shots.cancel.tide.@project", Some("s03")));
    }

    #[test]
    fn ids_that_cannot_be_subject_tokens_are_refused() {
        assert!(selection(&["ep1.s1"], None).validate().unwrap_err().contains("ep1.s1"));
        assert!(selection(&[], Some("s 3")).validate().is_err());
        assert!(Selection { project: "a>b".into(), jobs: vec![], shot: None }.validate().unwrap_err().contains("project"));
        assert!(selection(&["ok-1"], None).validate().is_ok());
    }
}
