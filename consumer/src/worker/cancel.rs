//! Cancel requests (`shots.cancel.<project>.<job_id|@project>`, schema `cancel`): one worker of
//! the fleet answers each (a queue group). For each job it claims a `cancelled` outcome on the
//! job's result subject the way every outcome is claimed (commit.rs), removes the job's queued
//! messages from `SHOTS` and replies. The worker rendering the job sees that outcome land
//! (watch.rs) and stops at its next step; a copy of the job that some worker takes later is
//! settled by the outcome without rendering.
//!
//! The workers answer, not the client: finding a job's queued messages reads `SHOTS`, which
//! holds every project's prompts, and a worker may already read and delete there (advisory.rs);
//! a producer may only publish its own project's cancel requests.

use std::sync::Arc;
use std::time::SystemTime;

use async_nats::jetstream::stream::RawMessageErrorKind;
use futures::StreamExt;
use shotfleet_schema::cancel::{self, CancelReply, CancelRequest, CancelResult, CancelledJob, Selection};
use shotfleet_schema::encoding;
use shotfleet_schema::validate::{MAX_ID_BYTES, MAX_PROJECT_BYTES, id_problem};
use shotfleet_schema::{Failure, ResultStatus, ShotResult, Timing, subject};
use tracing::{info, warn};

use crate::worker::Shared;
use crate::worker::commit::{self, Claim, Outcome, now_ms};

/// Subscribes this worker to cancel requests, as one of the answering queue group.
///
/// # Errors
/// The subscription's failure.
pub async fn subscribe(client: &async_nats::Client) -> Result<async_nats::Subscriber, async_nats::SubscribeError> {
    client.queue_subscribe(format!("{}.cancel.>", subject::ROOT), cancel::QUEUE_GROUP.to_owned()).await
}

/// Answers cancel requests until the subscription ends.
pub fn listen(shared: Arc<Shared>, mut requests: async_nats::Subscriber) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(message) = requests.next().await {
            let shared = shared.clone();
            tokio::spawn(async move {
                let reply = answer(&shared, &message).await;
                if let Some(to) = message.reply {
                    let payload = serde_json::to_vec(&reply).expect("replies serialize");
                    if let Err(e) = shared.js.client().publish(to, payload.into()).await {
                        warn!(error = %e, "cannot answer a cancel request");
                    }
                }
            });
        }
    })
}

/// A queued (or held) message of a job in `SHOTS`.
#[derive(Debug, Clone)]
struct Queued {
    sequence: u64,
    job_id: String,
    shot_id: String,
    published: SystemTime,
}

async fn answer(shared: &Shared, message: &async_nats::Message) -> CancelReply {
    let worker = shared.config.worker_id.clone();
    match cancel_all(shared, message).await {
        Ok(jobs) => CancelReply::with_jobs(shotfleet_schema::VERSION, worker, jobs),
        Err(error) => {
            warn!(subject = %message.subject, error, "cannot handle a cancel request");
            CancelReply { error: Some(error), ..CancelReply::with_jobs(shotfleet_schema::VERSION, worker, Vec::new()) }
        }
    }
}

async fn cancel_all(shared: &Shared, message: &async_nats::Message) -> Result<Vec<CancelledJob>, String> {
    let (project, target) = cancel::parse_subject(&message.subject)?;
    let request: CancelRequest = if message.payload.is_empty() {
        CancelRequest::default()
    } else {
        serde_json::from_slice(&message.payload)
            .map_err(|e| format!("the request is not a CancelRequest (a JSON object, cancel-request.schema.json): {e}"))?
    };
    if let Some(problem) = id_problem(&project, MAX_PROJECT_BYTES) {
        return Err(format!("project `{project}` {problem}"));
    }
    let selection = request.selection(&target)?;
    if let Selection::Jobs(named) = &selection
        && let Some((id, problem)) = named.iter().find_map(|id| id_problem(id, MAX_ID_BYTES).map(|p| (id, p)))
    {
        return Err(format!("job id `{id}` {problem}"));
    }
    let queued = queued_jobs(shared, &project).await?;
    let mut jobs: Vec<(String, String)> = match selection {
        Selection::Jobs(named) => named.into_iter().map(|id| (id, String::new())).collect(),
        Selection::Shot(shot) => in_queue(&queued, Some(&shot)),
        Selection::All => in_queue(&queued, None),
    };
    jobs.sort();
    jobs.dedup_by(|a, b| a.0 == b.0);
    let by = if request.by.trim().is_empty() { "an unnamed client".to_owned() } else { request.by.trim().to_owned() };
    let mut answers = Vec::with_capacity(jobs.len());
    for (job_id, shot_id) in jobs {
        let copies: Vec<&Queued> = queued.iter().filter(|q| q.job_id == job_id).collect();
        answers.push(cancel_one(shared, &project, &job_id, &shot_id, &copies, &by).await);
    }
    Ok(answers)
}

/// The jobs (id, shot) of the messages in `queued`, of `shot` when given (a job queued twice
/// is listed twice: the caller lists each once).
fn in_queue(queued: &[Queued], shot: Option<&str>) -> Vec<(String, String)> {
    queued.iter().filter(|q| shot.is_none_or(|shot| shot == q.shot_id)).map(|q| (q.job_id.clone(), q.shot_id.clone())).collect()
}

/// Every message of `project` in `SHOTS`, oldest first: queued, or delivered and not yet acked.
async fn queued_jobs(shared: &Shared, project: &str) -> Result<Vec<Queued>, String> {
    let stream = shared.js.get_stream(subject::JOBS_STREAM).await.map_err(|e| format!("cannot open SHOTS: {e}"))?;
    let filter = format!("{}.*.*.{project}", subject::ROOT);
    let mut found = Vec::new();
    let mut next = 1;
    loop {
        let message = match stream.get_first_raw_message_by_subject(&filter, next).await {
            Ok(message) => message,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(found),
            Err(e) => return Err(format!("cannot read the project's queued jobs: {e}")),
        };
        next = message.sequence + 1;
        let content_type = shotfleet_schema::nats::content_type(&message.headers);
        // An undecodable payload names no job: it fails as invalid when a worker takes it.
        if let Ok(job) = encoding::decode_job(content_type.as_deref(), &message.payload) {
            found.push(Queued { sequence: message.sequence, job_id: job.job_id, shot_id: job.shot_id, published: message.time.into() });
        }
    }
}

/// Cancels one job: claims the outcome, then removes its queued copies that the outcome settles.
async fn cancel_one(shared: &Shared, project: &str, job_id: &str, shot_id: &str, copies: &[&Queued], by: &str) -> CancelledJob {
    let last = commit::last_outcome(shared, project, job_id).await;
    // The shot a queued copy names, else the one its last outcome names (a failed job has no
    // copy left), else the request's.
    let outcome_shot = last.as_ref().ok().and_then(|o| o.as_ref()).map(|o| o.result.shot_id.as_str());
    let shot_id = copies.first().map(|q| q.shot_id.as_str()).or(outcome_shot).unwrap_or(shot_id).to_owned();
    let answer = |result, status, removed, detail: String| CancelledJob { job_id: job_id.to_owned(), shot_id: shot_id.clone(), result, status, removed, detail };
    let last = match last {
        Ok(last) => last,
        Err(e) => return answer(CancelResult::Failed, None, 0, e.detail),
    };
    if let Some(outcome) = last.as_ref().filter(|o| o.result.is_rendered()) {
        return finished(answer, outcome);
    }
    // Only the copies published after the last failure or cancellation are a live request.
    let live: Vec<&Queued> = copies.iter().copied().filter(|q| last.as_ref().is_none_or(|o| !o.settles(q.sequence, q.published))).collect();
    // A job that failed, with nothing queued since, is cancelled over its failure: its record
    // stays in SHOT_FAILED for the operator, and `shotfleet replay` skips a job cancelled after
    // it failed, so its owner's cancel holds. It settles what the failure settled (an outcome
    // older than the header does not say: left as it is).
    let failed_through = last.as_ref().filter(|o| o.result.status == ResultStatus::Failed).and_then(|o| o.settles_through);
    let Some(settles_through) = live.iter().map(|q| q.sequence).max().or(failed_through) else {
        return match &last {
            Some(outcome) => finished(answer, outcome),
            None => answer(CancelResult::Unknown, None, 0, format!("no job `{job_id}` is queued, running or finished in project `{project}`")),
        };
    };
    let expected = last.as_ref().map_or(0, |o| o.sequence);
    let cancelled = cancelled_outcome(shared, project, job_id, &shot_id, by);
    // The failed records the last outcome named go on with the cancellation: a later render
    // withdraws them.
    let records = last.as_ref().map_or(&[][..], |o| o.failed_records.as_slice());
    match commit::claim_as(shared, &cancelled, expected, subject::msg_id::cancel(project, job_id, expected), settles_through, records).await {
        Ok(Claim::Ours) if live.is_empty() => {
            let had = last.as_ref().and_then(|o| o.result.failure.as_ref()).map_or("", |f| f.detail.as_str());
            info!(job = job_id, project, by, "cancelled after it failed");
            answer(CancelResult::Cancelled, Some(ResultStatus::Cancelled), 0, format!("it had failed ({had}); cancelled by {by}, so a replay of failed jobs skips it"))
        }
        Ok(Claim::Ours) => {
            let removed = remove(shared, &live).await;
            info!(job = job_id, project, by, removed, "cancelled");
            answer(CancelResult::Cancelled, Some(ResultStatus::Cancelled), removed, format!("cancelled by {by}"))
        }
        Ok(Claim::Theirs(theirs)) if theirs.result.status == ResultStatus::Cancelled => {
            let detail = theirs.result.failure.as_ref().map_or_else(String::new, |f| f.detail.clone());
            answer(CancelResult::Cancelled, Some(ResultStatus::Cancelled), 0, detail)
        }
        Ok(Claim::Theirs(theirs)) => finished(answer, &theirs),
        Err(e) => answer(CancelResult::Failed, None, 0, e.detail),
    }
}

fn finished(answer: impl Fn(CancelResult, Option<ResultStatus>, u32, String) -> CancelledJob, outcome: &Outcome) -> CancelledJob {
    let result = &outcome.result;
    let detail = match &result.failure {
        Some(failure) => failure.detail.clone(),
        None => format!("rendered by {}", result.worker),
    };
    answer(CancelResult::AlreadyFinished, Some(result.status), 0, detail)
}

/// The `cancelled` outcome this worker claims for a client.
fn cancelled_outcome(shared: &Shared, project: &str, job_id: &str, shot_id: &str, by: &str) -> ShotResult {
    ShotResult {
        v: shotfleet_schema::VERSION,
        job_id: job_id.to_owned(),
        project: project.to_owned(),
        shot_id: shot_id.to_owned(),
        status: ResultStatus::Cancelled,
        images: Vec::new(),
        degrade: None,
        worker: shared.config.worker_id.clone(),
        device: shared.device_name.clone(),
        attempt: 0,
        timing: Timing::default(),
        finished_at_ms: now_ms(),
        failure: Some(Failure { reason: None, detail: format!("cancelled by {by}"), attempts: 0 }),
        notes: Vec::new(),
    }
}

/// Deletes the cancelled copies from `SHOTS`; returns how many went. A copy a worker holds goes
/// too: its holder stops on the outcome, and its ack of a deleted message changes nothing.
async fn remove(shared: &Shared, copies: &[&Queued]) -> u32 {
    let Ok(stream) = shared.js.get_stream(subject::JOBS_STREAM).await else { return 0 };
    let mut removed = 0;
    for copy in copies {
        match stream.delete_message(copy.sequence).await {
            Ok(_) => removed += 1,
            // Taken and acked meanwhile (settled by the outcome), or never there: nothing to do.
            Err(e) => info!(job = %copy.job_id, seq = copy.sequence, error = %e, "queued copy not removed"),
        }
    }
    removed
}
