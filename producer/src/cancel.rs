//! `shotfleet cancel`: asks the fleet to cancel jobs of a project (schema `cancel`) and reports
//! what became of each. One worker answers; the client needs no access to the queue.

use std::time::Duration;

use shotfleet_schema::cancel::{self, CancelReply, CancelRequest, Selection, WHOLE_PROJECT};
use shotfleet_schema::validate::{MAX_ID_BYTES, MAX_PROJECT_BYTES, id_problem};

/// Which jobs of a project.
#[derive(Debug, Clone)]
pub struct Target {
    pub project: String,
    pub which: Selection,
}

impl Target {
    /// Checks every id; the message names the one to fix.
    ///
    /// # Errors
    /// An id that no job can have, or an empty list of jobs.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(problem) = id_problem(&self.project, MAX_PROJECT_BYTES) {
            return Err(format!("project `{}` {problem}", self.project));
        }
        let ids: &[String] = match &self.which {
            Selection::Jobs(jobs) if jobs.is_empty() => return Err("no jobs named".into()),
            Selection::Jobs(jobs) => jobs,
            Selection::Shot(shot) => std::slice::from_ref(shot),
            Selection::All => &[],
        };
        for id in ids {
            if let Some(problem) = id_problem(id, MAX_ID_BYTES) {
                return Err(format!("`{id}` {problem}"));
            }
        }
        Ok(())
    }

    /// The request's subject and payload: one job goes to its own subject, anything else to
    /// the project's.
    pub fn request(&self, by: &str) -> (String, CancelRequest) {
        let request = CancelRequest { v: shotfleet_schema::VERSION, by: by.to_owned(), ..CancelRequest::default() };
        let project = |request| (cancel::subject(&self.project, WHOLE_PROJECT), request);
        match &self.which {
            Selection::Jobs(jobs) if jobs.len() == 1 => (cancel::subject(&self.project, &jobs[0]), request),
            Selection::Jobs(jobs) => project(CancelRequest { jobs: jobs.clone(), ..request }),
            Selection::Shot(shot) => project(CancelRequest { shot: Some(shot.clone()), ..request }),
            Selection::All => project(CancelRequest { all: true, ..request }),
        }
    }
}

/// Why nothing was cancelled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CancelError {
    #[error(
        "no worker answered the cancel request within {0:?}: a worker may still be cancelling (a large project takes longer: \
         give --timeout more), or none took it; `shotfleet status` shows what is queued, and cancelling again changes nothing already cancelled"
    )]
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
pub async fn cancel(client: &async_nats::Client, target: &Target, by: &str, timeout: Duration) -> Result<CancelReply, CancelError> {
    let (subject, request) = target.request(by);
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

    fn target(which: Selection) -> Target {
        Target { project: "tide".into(), which }
    }

    fn jobs(ids: &[&str]) -> Selection {
        Selection::Jobs(ids.iter().map(|j| (*j).to_owned()).collect())
    }

    #[test]
    fn one_job_goes_to_its_own_subject_anything_else_to_the_project() {
        let (subject, request) = target(jobs(&["ep1-s1"])).request("ana");
        assert_eq!(subject, "shots.cancel.tide.ep1-s1");
        assert!(request.jobs.is_empty() && request.by == "ana");
        let (subject, request) = target(jobs(&["a", "b"])).request("ana");
        assert_eq!((subject.as_str(), request.jobs.len()), ("shots.cancel.tide.@project", 2));
        let (subject, request) = target(Selection::Shot("s03".into())).request("ana");
        assert_eq!((subject.as_str(), request.shot.as_deref()), ("shots.cancel.tide.@project", Some("s03")));
        let (subject, request) = target(Selection::All).request("ana");
        assert_eq!((subject.as_str(), request.all), ("shots.cancel.tide.@project", true));
        // Each request is one the fleet takes as it was meant.
        for which in [jobs(&["ep1-s1"]), jobs(&["a", "b"]), Selection::Shot("s03".into()), Selection::All] {
            let (subject, request) = target(which.clone()).request("ana");
            let (_, token) = cancel::parse_subject(&subject).unwrap();
            assert_eq!(request.selection(&token), Ok(which));
        }
    }

    #[test]
    fn ids_that_cannot_be_subject_tokens_are_refused() {
        assert!(target(jobs(&["ep1.s1"])).validate().unwrap_err().contains("ep1.s1"));
        assert!(target(Selection::Shot("s 3".into())).validate().is_err());
        assert!(target(jobs(&[])).validate().unwrap_err().contains("no jobs"));
        assert!(Target { project: "a>b".into(), which: Selection::All }.validate().unwrap_err().contains("project"));
        assert!(target(jobs(&["ok-1"])).validate().is_ok());
    }
}
