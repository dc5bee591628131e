//! One job, start to finish: take (decode, validate, route, look up its outcome, resolve its
//! LoRA set) -> render -> upload and claim the outcome -> settle. Each step is a function;
//! `settle` alone decides how the job ends.

use std::sync::Arc;
use std::time::Instant;

use shotfleet_schema::encoding::{self, DecodeError, InvalidJob};
use shotfleet_schema::failure::one_line;
use shotfleet_schema::validate::{Problem, ValidationError};
use shotfleet_schema::progress::ProgressEvent;
use shotfleet_schema::{ResultStatus, ShotJob};
use tracing::{info, warn};

use crate::failure::JobError;
use crate::faults::CrashPoint;
use crate::pipeline::RenderOutput;
use crate::telemetry::{self, JobOutcome};
use crate::worker::commit::{self, Claim, Standing};
use crate::worker::delivery::{Delivery, KeepAlive, Kept};
use crate::worker::lora::JobSet;
use crate::worker::progress::Reporter;
use crate::worker::render::{Rendered, render_job};
use crate::worker::settle::{Handled, Held, settle};
use crate::worker::watch::OutcomeWatch;
use crate::worker::{Shared, Slot, failed, route};

/// A delivery taken by this worker: kept alive until it is settled.
pub(crate) struct Taken {
    pub delivery: Delivery,
    /// `None` when the payload could not be decoded.
    pub job: Option<ShotJob>,
    /// The sequence of the job's last outcome when it was taken (0: none).
    pub last_outcome: u64,
    /// The failed records that outcome names: withdrawn once this delivery's render is the
    /// job's outcome, carried forward by its failure.
    pub failed_records: Vec<u64>,
    /// The LoRA set it renders with; `None`: the base model.
    pub set: Option<JobSet>,
    /// Progress events, for a job this worker renders.
    pub reporter: Option<Reporter>,
    /// Fires when an outcome lands that settles the job (a cancellation): its work stops.
    pub watch: OutcomeWatch,
    /// What its result will tell the person (a prompt cut at 77 tokens).
    pub notes: Vec<String>,
    _holding: Option<Holding>,
    _alive: KeepAlive,
    _in_flight: telemetry::InFlight,
}

/// How long a second delivery of a job this worker holds waits before it is offered again.
const HELD_HERE_DELAY: std::time::Duration = std::time::Duration::from_secs(1);

/// This worker's hold on a job (its `project/job_id` in [`Shared::held`]), until dropped.
struct Holding {
    held: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    key: String,
}

impl Holding {
    /// `None` when this worker holds the job already.
    fn take(shared: &Shared, job: &ShotJob) -> Option<Holding> {
        let key = job.key();
        let inserted = shared.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(key.clone());
        inserted.then(|| Holding { held: shared.held.clone(), key })
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&self.key);
    }
}

impl Taken {
    pub fn held(&self) -> Held<'_> {
        Held { delivery: &self.delivery, job: self.job.as_ref(), last_outcome: self.last_outcome, failed_records: &self.failed_records }
    }

    /// The job to render (only called after `take` said [`Next::Render`]).
    pub fn job(&self) -> &ShotJob {
        self.job.as_ref().expect("a job to render was decoded")
    }
}

/// What follows taking a job.
pub(crate) enum Next {
    /// The job is this worker's to render.
    Render,
    /// Its handling already ended (invalid, routed, settled by an earlier outcome).
    Settle(Handled),
}

/// Handles one delivery to the end: it is acked, naked, terminated or routed when this returns.
/// `slot`, the fetch loop's render slot it holds, is given back once its render has ended.
pub(crate) async fn handle(shared: Arc<Shared>, kept: Kept, slot: Option<Slot>) {
    let (taken, next) = take(&shared, kept).await;
    let handled = match next {
        Next::Render => render_and_commit(&shared, &taken, slot).await,
        Next::Settle(handled) => handled,
    };
    finish(&shared, &taken, handled).await;
}

/// Settles a taken job and tells its followers how it left this worker.
pub(crate) async fn finish(shared: &Shared, taken: &Taken, handled: Handled) {
    let detail = match &handled {
        Handled::Stopped(error) => Some(error.detail.clone()),
        _ => None,
    };
    let outcome = settle(shared, &taken.held(), handled).await;
    if outcome == JobOutcome::Cancelled {
        info!(job = taken.job.as_ref().map_or("?", |j| j.job_id.as_str()), rendering = taken.reporter.is_some(), "cancelled: its work stopped, its uploads swept");
    }
    if let Some(reporter) = &taken.reporter {
        let (event, detail) = match outcome {
            JobOutcome::Nak => (ProgressEvent::Queued, detail),
            JobOutcome::DegradeRepublished => (ProgressEvent::Queued, Some("re-published one rung down the degrade ladder".into())),
            _ => (ProgressEvent::Settled, None),
        };
        reporter.send(event, None, detail).await;
    }
}

/// The steps before rendering: decode and validate, route (`auto` or the wrong class), look up
/// the job's outcome, and resolve the LoRA set it names. Its keep-alive goes on until it is
/// settled.
pub(crate) async fn take(shared: &Shared, kept: Kept) -> (Taken, Next) {
    let (delivery, _alive, _in_flight) = kept.into_parts();
    telemetry::queue_wait(delivery.origin.priority, delivery.queued);
    let decoded = decode(shared, &delivery);
    let holding = decoded.as_ref().ok().map(|job| Holding::take(shared, job));
    if let Some(None) = holding {
        let job = decoded.ok();
        info!(job = job.as_ref().map_or("?", |j| j.job_id.as_str()), "this worker already holds another delivery of the job; giving this one back");
        let busy = Handled::Stopped(JobError::give_back(HELD_HERE_DELAY, "another delivery of the job is in progress on this worker"));
        let taken = Taken {
            delivery,
            job,
            last_outcome: 0,
            failed_records: Vec::new(),
            set: None,
            reporter: None,
            watch: OutcomeWatch::none(),
            notes: Vec::new(),
            _holding: None,
            _alive,
            _in_flight,
        };
        return (taken, Next::Settle(busy));
    }
    // Before the look-up below: an outcome stored after it reaches the watch.
    let subscribed = match &decoded {
        Ok(job) => Some(OutcomeWatch::subscribe(shared, job).await),
        Err(_) => None,
    };
    // The job's last outcome first, for every message that names a job: a rendered result
    // settles it, a failure or cancellation settles it when stored after it was published, and
    // anything else claims over that outcome (an invalid re-submission after a failure too).
    let (job, invalid) = match decoded {
        Ok(job) => (Some(job), None),
        Err(rejected) => (rejected.job, Some(JobError::invalid(rejected.why.to_string()))),
    };
    let content_type = delivery.content_type();
    let ids = failed::ids_of(delivery.subject(), job.as_ref(), content_type.as_deref(), &delivery.message.payload);
    let standing = match &ids {
        Some(ids) => commit::standing(shared, &ids.project, &ids.job_id, delivery.stream_sequence, delivery.published).await,
        None => Ok(Standing::Open { last: 0, records: Vec::new() }),
    };
    let (last_outcome, failed_records, mut next) = match (standing, invalid) {
        (Err(e), _) => (0, Vec::new(), Next::Settle(Handled::Stopped(e))),
        (Ok(Standing::Settled(outcome)), _) => {
            (outcome.sequence, Vec::new(), Next::Settle(Handled::Committed { result: Box::new(outcome.result), ours: false }))
        }
        (Ok(Standing::Open { last, records }), Some(invalid)) => (last, records, Next::Settle(Handled::Stopped(invalid))),
        // Routing after the look-up: a cancelled `auto` job is settled above, not re-published
        // as a new message that its cancellation would not settle.
        (Ok(Standing::Open { last, records }), None) => match job.as_ref().filter(|job| route::needs_routing(&delivery, job)) {
            Some(job) => {
                let routed = route::reroute(shared, &delivery, job).await;
                (0, Vec::new(), Next::Settle(routed.map_or_else(Handled::Stopped, |()| Handled::Routed)))
            }
            None => (last, records, Next::Render),
        },
    };
    let mut set = None;
    if let (Some(job), Next::Render) = (&job, &next) {
        match shared.loras.resolve(job).await {
            Ok(resolved) => set = resolved,
            Err(e) => next = Next::Settle(Handled::Stopped(e)),
        }
    }
    let notes = match (&job, &next) {
        (Some(job), Next::Render) => {
            let ignored = ignored_fields(job, content_type.as_deref(), &delivery.message.payload);
            ignored.into_iter().chain(cut_prompts(shared, job)).collect()
        }
        _ => Vec::new(),
    };
    let (reporter, watch) = match (&job, &next, subscribed) {
        (Some(job), Next::Render, Some(subscribed)) => {
            let watch = OutcomeWatch::start(shared, job, &delivery, subscribed);
            let reporter = Reporter::new(shared, job);
            reporter.send(ProgressEvent::Taken, None, None).await;
            (Some(reporter), watch)
        }
        _ => (None, OutcomeWatch::none()),
    };
    let taken = Taken {
        delivery,
        job,
        last_outcome,
        failed_records,
        set,
        reporter,
        watch,
        notes,
        _holding: holding.flatten(),
        _alive,
        _in_flight,
    };
    (taken, next)
}

/// The payload's fields that are no job's: ignored, as a newer producer's optional fields must
/// be, but named in the log and in a note for the result, so that a misspelt one (`lora` for
/// `loras`) does not render the shot without it unsaid.
fn ignored_fields(job: &ShotJob, content_type: Option<&str>, payload: &[u8]) -> Option<String> {
    /// Named in full; the rest are counted (a client may send many fields of its own).
    const NAMED: usize = 8;
    let unknown = encoding::unknown_job_fields(content_type, payload);
    if unknown.is_empty() {
        return None;
    }
    let shown: Vec<String> = unknown.iter().take(NAMED).map(|field| one_line(&field.path, 64)).collect();
    warn!(job = %job.job_id, fields = ?shown, count = unknown.len(), "the job has fields that are no job's (contract v1): ignored");
    let mut named: Vec<String> = shown
        .iter()
        .zip(&unknown)
        .map(|(shown, field)| match field.near {
            Some(near) => format!("`{shown}` (did you mean `{near}`?)"),
            None => format!("`{shown}`"),
        })
        .collect();
    if unknown.len() > NAMED {
        named.push(format!("{} more", unknown.len() - NAMED));
    }
    Some(format!("ignored, not fields of a job (contract v1): {}", named.join(", ")))
}

/// When the text encoders will not read all of a job's prompt (CLIP reads 77 tokens, 75
/// words' worth and less, and SDXL's pipeline cuts the rest, as this one does): a warning in
/// the log, and a note for the result, so the person who wrote it hears it too.
fn cut_prompts(shared: &Shared, job: &ShotJob) -> Vec<String> {
    let pipeline = shared.pipeline();
    let mut notes = Vec::new();
    for (field, text) in [("prompt", Some(job.prompt.as_str())), ("negative_prompt", job.negative())] {
        let cut = text.map_or(0, |text| pipeline.prompt_tokens_cut(text));
        if cut > 0 {
            warn!(job = %job.job_id, field, tokens_cut = cut, "the text encoders read 77 tokens: the end of the prompt is left out");
            notes.push(format!("{field} cut at the text encoders' 77 tokens: its last {cut} token(s) were not read"));
        }
    }
    notes
}

/// A job that can never be rendered, with the job when the payload was readable enough.
struct Rejected {
    job: Option<ShotJob>,
    why: InvalidJob,
}

/// Decodes and validates.
fn decode(shared: &Shared, delivery: &Delivery) -> Result<ShotJob, Box<Rejected>> {
    let reject = |job, why| Box::new(Rejected { job, why });
    let job = encoding::decode_job(delivery.content_type().as_deref(), &delivery.message.payload)
        .map_err(|e| reject(None, InvalidJob::Decode(e)))?;
    let malformed = |path: &str, detail: String| InvalidJob::Decode(DecodeError::Malformed { format: "job", path: path.into(), detail });
    let subject_project = delivery.subject_project();
    if job.project != subject_project {
        let detail = format!("payload project `{}` was published under project `{subject_project}`", job.project);
        // Its failure goes to the project it was published under, with its failed record: a
        // producer of one project never writes outcomes into another's.
        let job = ShotJob { project: subject_project.to_string(), ..job };
        return Err(reject(Some(job), malformed("project", detail)));
    }
    if let Err(e) = job.validate(&shared.config.limits) {
        return Err(reject(Some(job), InvalidJob::Invalid(e)));
    }
    // Before routing or degrading: a size this model cannot render is the job's fault, wherever
    // it would be sent; else a worker holding no class of it would degrade it to a size it can.
    if let Some(message) = shared.model.size_problem(job.width, job.height) {
        let sides = [("width", job.width), ("height", job.height)];
        let problems = sides
            .iter()
            .filter(|(_, side)| !shared.model.renders_side(*side))
            .map(|(field, _)| Problem { field: (*field).into(), message: message.clone() })
            .collect();
        return Err(reject(Some(job), InvalidJob::Invalid(ValidationError { problems })));
    }
    Ok(job)
}

/// Renders a taken job on its own and commits it. The render `slot` (if it holds one) is
/// handed over for a commit permit once the render is done: the next job renders while this
/// one uploads and commits.
pub(crate) async fn render_and_commit(shared: &Arc<Shared>, taken: &Taken, slot: Option<Slot>) -> Handled {
    match render_taken(shared, taken).await {
        Ok(Rendered { output, elapsed }) => {
            let _committing = shared.commits.clone().acquire_owned().await;
            drop(slot);
            commit_output(shared, taken, output, elapsed).await
        }
        Err(handled) => handled,
    }
}

/// Renders a taken job on its own: its images, or how it ended instead (settled elsewhere, by a
/// cancellation before or during the render, or the render's error).
pub(crate) async fn render_taken(shared: &Arc<Shared>, taken: &Taken) -> Result<Rendered, Handled> {
    if let Some(settled) = settled_elsewhere(shared, taken).await {
        return Err(settled);
    }
    match render_job(shared, taken).await {
        Ok(rendered) => Ok(rendered),
        Err(error) => Err(settled_elsewhere(shared, taken).await.unwrap_or(Handled::Stopped(error))),
    }
}

/// The outcome that settled the job while this worker held it (a cancellation), if one did.
pub(crate) async fn settled_elsewhere(shared: &Shared, taken: &Taken) -> Option<Handled> {
    if !taken.watch.settled.is_cancelled() {
        return None;
    }
    let job = taken.job.as_ref()?;
    match commit::last_outcome(shared, &job.project, &job.job_id).await {
        Ok(Some(outcome)) if outcome.settles(taken.delivery.stream_sequence, taken.delivery.published) => {
            Some(Handled::Committed { result: Box::new(outcome.result), ours: false })
        }
        _ => None,
    }
}

/// Fault injection: waits until the job has an outcome (another worker's), two minutes at most.
async fn wait_for_another_outcome(shared: &Shared, job: &ShotJob) {
    let deadline = Instant::now() + std::time::Duration::from_secs(120);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = commit::last_outcome(shared, &job.project, &job.job_id).await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Upload, then claim the job's outcome: the commit point.
pub(crate) async fn commit_output(shared: &Shared, taken: &Taken, output: RenderOutput, elapsed: std::time::Duration) -> Handled {
    let (delivery, job) = (&taken.delivery, taken.job());
    let upload_started = Instant::now();
    let stages = output.timings;
    let uploaded = match commit::upload(shared, job, output.images).await {
        Ok(uploaded) => uploaded,
        Err(e) => return Handled::Stopped(e),
    };
    telemetry::upload_time(upload_started.elapsed());
    shared.config.faults.crash_point(CrashPoint::AfterUpload);
    if let Some(stall) = shared.config.faults.stall() {
        warn!(job = %job.job_id, stall_s = stall.as_secs_f64(), "fault injection: stalling before publish");
        if shared.config.faults.stall_until_committed {
            wait_for_another_outcome(shared, job).await;
        }
        tokio::time::sleep(stall).await;
    }
    let status = if job.degrade.is_some() { ResultStatus::Degraded } else { ResultStatus::Done };
    let mut result = commit::outcome_of(shared, job.ids(), job.degrade, delivery.attempt, delivery.queued, status, None);
    result.images = uploaded.images;
    result.notes.clone_from(&taken.notes);
    result.timing.render_ms = elapsed.as_millis() as u64;
    result.timing.upload_ms = upload_started.elapsed().as_millis() as u64;
    let handled = match commit::claim(shared, &result, taken.last_outcome, delivery.stream_sequence).await {
        Ok(Claim::Ours) => {
            info!(
                job = %job.job_id,
                images = result.images.len(),
                render_ms = result.timing.render_ms,
                text_ms = stages.text_encode.as_millis() as u64,
                unet_ms = stages.unet.as_millis() as u64,
                vae_ms = stages.vae.as_millis() as u64,
                png_ms = uploaded.png.as_millis() as u64,
                upload_ms = result.timing.upload_ms,
                "job done"
            );
            failed::withdraw_rendered(shared, &taken.failed_records, &job.project, &job.job_id).await;
            Handled::Committed { result: Box::new(result), ours: true }
        }
        Ok(Claim::Theirs(theirs)) => {
            info!(job = %job.job_id, winner = %theirs.result.worker, status = ?theirs.result.status, "another outcome was committed first; it stands");
            Handled::Committed { result: Box::new(theirs.result), ours: false }
        }
        Err(e) => Handled::Stopped(e),
    };
    shared.config.faults.crash_point(CrashPoint::AfterPublish);
    shared.config.faults.leak();
    handled
}
