//! One job, start to finish: decode -> (route) -> already done? -> plan -> render -> upload ->
//! publish result -> sweep -> ack. Each step is a function below, in that order.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use shotfleet_schema::encoding::{self, InvalidJob};
use shotfleet_schema::failure::FailureReason;
use shotfleet_schema::subject::SubjectClass;
use shotfleet_schema::{ImageRef, ResultStatus, ShotJob, ShotResult, Timing};
use tracing::{info, warn};

use crate::budget::Reservation;
use crate::faults::{self, CrashPoint};
use crate::pipeline::{RenderError, RenderOutput, RenderRequest, RenderedImage};
use crate::telemetry::{self, JobOutcome};
use crate::worker::delivery::{backoff, Delivery};
use crate::worker::{commit, failed, route, Shared};

/// Handles one delivery to the end: it is acked, naked, terminated or routed when this returns.
pub async fn handle(shared: Arc<Shared>, delivery: Delivery) {
    let _in_flight = telemetry::in_flight();
    let origin = delivery.origin;
    telemetry::queue_wait(origin.priority, delivery.queued);

    let job = match decode(&shared, &delivery) {
        Ok(job) => job,
        Err((job_id, invalid)) => {
            failed::fail(&shared, &delivery, job_id.as_deref(), FailureReason::Invalid, &invalid.to_string()).await;
            telemetry::job_finished(JobOutcome::Failed, origin.priority, origin.class);
            return;
        }
    };
    if needs_routing(&delivery, &job) {
        return route::reroute(&shared, &delivery, &job).await;
    }
    let outcome = render_and_commit(&shared, &delivery, &job).await;
    telemetry::job_finished(outcome, origin.priority, SubjectClass::Class(job.class()));
}

/// Decodes and validates. A job that can never be rendered is returned as an error, with its
/// id when the payload was readable enough to have one (the failed record then names it).
fn decode(shared: &Shared, delivery: &Delivery) -> Result<ShotJob, (Option<String>, InvalidJob)> {
    let job = encoding::decode_job(delivery.content_type().as_deref(), &delivery.message.payload)
        .map_err(|e| (None, InvalidJob::Decode(e)))?;
    let named = |e: InvalidJob| (Some(job.job_id.clone()), e);
    job.validate(&shared.config.limits).map_err(|e| named(InvalidJob::Invalid(e)))?;
    let subject_project = delivery.subject_project();
    if job.project != subject_project {
        return Err(named(InvalidJob::Decode(encoding::DecodeError::Malformed {
            format: "subject",
            path: "project".into(),
            detail: format!("payload project `{}` was published under project `{subject_project}`", job.project),
        })));
    }
    Ok(job)
}

/// `auto` jobs, and jobs whose payload is of another class than their subject's.
fn needs_routing(delivery: &Delivery, job: &ShotJob) -> bool {
    delivery.origin.class != SubjectClass::Class(job.class())
}

async fn render_and_commit(shared: &Arc<Shared>, delivery: &Delivery, job: &ShotJob) -> JobOutcome {
    // 1. Already committed by someone? Then only the sweep and the ack are left.
    match commit::existing_result(shared, &job.project, &job.job_id).await {
        Ok(Some(result)) => {
            finish_committed(shared, delivery, &result).await;
            return JobOutcome::DuplicateSkip;
        }
        Ok(None) => {}
        Err(e) => return nak_transient(shared, delivery, job, &e.to_string()).await,
    }

    // 2. Plan: the largest sub-batch of this job's images that the budget holds now.
    let Some((batch, reservation)) = plan(shared, job) else {
        info!(job = %job.job_id, "no room for this job now; giving it back");
        delivery.nak(Some(Duration::from_millis(500))).await;
        return JobOutcome::Nak;
    };

    // 3. Render off the async threads, telling the server we are alive meanwhile.
    let rendered = render(shared, delivery, job, batch, reservation).await;
    let output = match rendered {
        Ok(output) => output,
        Err(failure) => return settle_render_failure(shared, delivery, job, failure).await,
    };
    telemetry::render_time(SubjectClass::Class(job.class()), output.elapsed);

    // 4. Upload.
    let upload_started = Instant::now();
    let images = match upload(shared, job, output.output.images).await {
        Ok(images) => images,
        Err(e) => return nak_transient(shared, delivery, job, &e).await,
    };
    telemetry::upload_time(upload_started.elapsed());
    shared.config.faults.crash_point(CrashPoint::AfterUpload);
    if let Some(stall) = shared.config.faults.stall() {
        warn!(job = %job.job_id, stall_s = stall.as_secs_f64(), "fault injection: stalling before publish");
        tokio::time::sleep(stall).await;
    }

    // 5. Publish the result: the commit point.
    let result = ShotResult {
        v: shotfleet_schema::VERSION,
        job_id: job.job_id.clone(),
        project: job.project.clone(),
        shot_id: job.shot_id.clone(),
        status: if job.degrade.is_some() { ResultStatus::Degraded } else { ResultStatus::Done },
        images,
        degrade: job.degrade,
        worker: shared.config.worker_id.clone(),
        device: shared.device_name.clone(),
        attempt: delivery.attempt as u32,
        timing: Timing {
            queue_ms: delivery.queued.as_millis() as u64,
            render_ms: output.elapsed.as_millis() as u64,
            upload_ms: upload_started.elapsed().as_millis() as u64,
        },
        finished_at_ms: SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_millis() as u64,
    };
    let committed = match commit::publish(shared, &result).await {
        Ok(commit::Commit::Ours) => result,
        Ok(commit::Commit::Theirs(theirs)) => {
            info!(job = %job.job_id, winner = %theirs.worker, "another worker committed this job first; keeping its images");
            theirs
        }
        Err(e) => return nak_transient(shared, delivery, job, &e.to_string()).await,
    };
    shared.config.faults.crash_point(CrashPoint::AfterPublish);

    // 6. Sweep what the committed result does not name, then ack.
    finish_committed(shared, delivery, &committed).await;
    if committed.worker != shared.config.worker_id || committed.attempt != delivery.attempt as u32 {
        return JobOutcome::DuplicateSkip;
    }
    info!(job = %job.job_id, images = committed.images.len(), render_ms = committed.timing.render_ms, "job done");
    if job.degrade.is_some() { JobOutcome::Degraded } else { JobOutcome::Done }
}

/// Sweeps leftovers of other attempts and acks. A failed sweep is logged, not retried: the next
/// delivery of this job (there is none once acked) or an operator's sweep removes them.
async fn finish_committed(shared: &Shared, delivery: &Delivery, result: &ShotResult) {
    match commit::sweep(shared, result).await {
        Ok(0) => {}
        Ok(n) => info!(job = %result.job_id, deleted = n, "removed images no result names"),
        Err(e) => warn!(job = %result.job_id, error = %e, "sweep failed"),
    }
    if let Err(e) = delivery.done().await {
        warn!(job = %result.job_id, error = %e, "ack failed; the redelivery will find the result and ack");
    }
}

fn plan(shared: &Shared, job: &ShotJob) -> Option<(u32, Reservation)> {
    let batch = shared.budget.largest_batch(job.width, job.height, job.images).ok()?;
    if batch == 0 {
        return None;
    }
    let reservation = shared.budget.reserve(job.width, job.height, batch).ok()??;
    Some((batch, reservation))
}

/// A finished render and how long it took.
struct Rendered {
    output: RenderOutput,
    elapsed: Duration,
}

/// Why a render did not finish.
enum RenderFailure {
    /// The worker is shutting down past its grace period.
    Shutdown,
    /// The job ran past `job_time_limit`.
    TimeLimit(Duration),
    Error(RenderError),
}

async fn render(
    shared: &Arc<Shared>,
    delivery: &Delivery,
    job: &ShotJob,
    batch: u32,
    reservation: Reservation,
) -> Result<Rendered, RenderFailure> {
    let request = RenderRequest {
        prompt: job.prompt.clone(),
        negative_prompt: job.negative_prompt.clone(),
        width: job.width,
        height: job.height,
        steps: job.steps,
        guidance: job.guidance,
        seed: job.seed,
        image_indices: (0..job.images).collect(),
        max_batch: batch as usize,
    };
    let started = Instant::now();
    let limit = shared.config.job_time_limit.0;
    let timed_out = Arc::new(AtomicBool::new(false));
    let abort = shared.abort.clone();

    let keeper = tokio::spawn(keep_alive(delivery.clone(), shared.progress_interval, shared.config.faults.stall().is_some()));
    let pipeline = shared.pipeline.clone();
    let meter = shared.meter.clone();
    let flag = timed_out.clone();
    let outcome = tokio::task::spawn_blocking(move || {
        let render = || {
            pipeline.render(&request, &mut |_| {
                if abort.is_cancelled() {
                    return ControlFlow::Break(());
                }
                if started.elapsed() > limit {
                    flag.store(true, Ordering::Relaxed);
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            })
        };
        match meter {
            Some(meter) => match meter.measure(render) {
                Ok((result, peak)) => (result, Some(peak)),
                Err(_) => (render(), None),
            },
            None => (render(), None),
        }
    })
    .await;
    keeper.abort();
    let elapsed = started.elapsed();
    let (result, peak) = match outcome {
        Ok(pair) => pair,
        Err(e) => return Err(RenderFailure::Error(RenderError::InvalidRequest(format!("render task failed: {e}")))),
    };
    if let (Ok(_), Some(peak)) = (&result, peak) {
        let shape = reservation.shape();
        let planned = shared.budget.planned(shape.width, shape.height, shape.images);
        let error = shared.budget.observe(shape.width, shape.height, shape.images, peak);
        telemetry::estimate_error(planned, peak);
        tracing::debug!(job = %job.job_id, peak, planned, error, "observed peak");
    }
    drop(reservation);
    match result {
        Ok(output) => Ok(Rendered { output, elapsed }),
        Err(RenderError::Cancelled { .. }) if timed_out.load(Ordering::Relaxed) => Err(RenderFailure::TimeLimit(elapsed)),
        Err(RenderError::Cancelled { .. }) => Err(RenderFailure::Shutdown),
        Err(e) => Err(RenderFailure::Error(e)),
    }
}

/// Sends `AckKind::Progress` every `interval` so a long render is not redelivered.
async fn keep_alive(delivery: Delivery, interval: Duration, disabled: bool) {
    if disabled {
        return;
    }
    let mut ticker = tokio::time::interval(interval);
    ticker.tick().await;
    loop {
        ticker.tick().await;
        delivery.progress().await;
    }
}

async fn settle_render_failure(shared: &Shared, delivery: &Delivery, job: &ShotJob, failure: RenderFailure) -> JobOutcome {
    match failure {
        RenderFailure::Shutdown => {
            info!(job = %job.job_id, "shutting down: giving the job back now");
            delivery.nak(None).await;
            JobOutcome::Nak
        }
        RenderFailure::TimeLimit(took) => {
            nak_transient(shared, delivery, job, &format!("render stopped at the time limit after {:.1}s", took.as_secs_f64())).await
        }
        RenderFailure::Error(RenderError::InvalidRequest(detail)) => {
            failed::fail(shared, delivery, Some(&job.job_id), FailureReason::Invalid, &format!("this model cannot render it: {detail}")).await;
            JobOutcome::Failed
        }
        RenderFailure::Error(e) => nak_transient(shared, delivery, job, &e.to_string()).await,
    }
}

/// A failure that may pass: nak with backoff, or on the last allowed delivery, a failed record
/// (the server would not deliver the job again).
async fn nak_transient(shared: &Shared, delivery: &Delivery, job: &ShotJob, detail: &str) -> JobOutcome {
    if delivery.attempt >= shared.max_deliver {
        failed::fail(shared, delivery, Some(&job.job_id), FailureReason::MaxDeliveries, detail).await;
        return JobOutcome::Failed;
    }
    let delay = backoff(delivery.attempt);
    warn!(job = %job.job_id, attempt = delivery.attempt, retry_in_s = delay.as_secs(), detail, "job failed, will retry");
    delivery.nak(Some(delay)).await;
    JobOutcome::Nak
}

async fn upload(shared: &Shared, job: &ShotJob, images: Vec<RenderedImage>) -> Result<Vec<ImageRef>, String> {
    let mut refs = Vec::with_capacity(images.len());
    for image in images {
        let png = if shared.config.faults.mark_images {
            faults::add_png_text(&image.png, "shotfleet-worker", &shared.config.worker_id)
        } else {
            image.png
        };
        let stored = shared
            .store
            .put_image(&job.project, &job.job_id, &job.shot_id, image.index, png)
            .await
            .map_err(|e| format!("upload of image {} failed: {e}", image.index))?;
        refs.push(ImageRef {
            key: stored.key,
            index: image.index,
            seed: image.seed,
            width: image.width,
            height: image.height,
            bytes: stored.bytes,
            sha256: stored.sha256,
        });
    }
    Ok(refs)
}
