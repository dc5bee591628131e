//! One job, start to finish: decode -> (route) -> already done? -> plan -> render -> upload ->
//! publish result -> sweep -> ack. Each step is a function below, in that order.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use shotfleet_schema::encoding::{self, ContentType, InvalidJob};
use shotfleet_schema::subject;
use shotfleet_schema::failure::FailureReason;
use shotfleet_schema::subject::SubjectClass;
use shotfleet_schema::{ImageRef, ResultStatus, ShotJob, ShotResult, Timing};
use tracing::{info, warn};

use crate::budget::{MIB, Measured, Reservation, Shape};
use crate::faults::{self, CrashPoint};
use crate::failure::{classify_render, ErrorKind};
use crate::pipeline::{CancelHandle, RenderControl, RenderError, RenderOutput, RenderRequest, RenderedImage, Stage, VaeDecode};
use crate::telemetry::{self, JobOutcome};
use crate::worker::delivery::{backoff, Delivery};
use crate::worker::{commit, degrade, failed, route, shrink_arenas, Shared};

/// Handles one delivery to the end: it is acked, naked, terminated or routed when this returns.
pub async fn handle(shared: Arc<Shared>, delivery: Delivery) {
    let _in_flight = telemetry::in_flight();
    if let Some(job) = take(&shared, &delivery).await {
        let outcome = render_and_commit(&shared, &delivery, &job).await;
        telemetry::job_finished(outcome, delivery.origin.priority, SubjectClass::Class(job.class()));
    }
}

/// The steps before rendering: decode and validate (a job that can never be rendered gets its
/// failed record), route (`auto` or the wrong class), and look for a committed result (then only
/// the sweep and the ack are left). Returns the job when it is this worker's to render.
pub(crate) async fn take(shared: &Shared, delivery: &Delivery) -> Option<ShotJob> {
    let origin = delivery.origin;
    telemetry::queue_wait(origin.priority, delivery.queued);
    let job = match decode(shared, delivery) {
        Ok(job) => job,
        Err((job_id, invalid)) => {
            failed::fail(shared, delivery, job_id.as_deref(), FailureReason::Invalid, &invalid.to_string()).await;
            telemetry::job_finished(JobOutcome::Failed, origin.priority, origin.class);
            return None;
        }
    };
    if needs_routing(delivery, &job) {
        route::reroute(shared, delivery, &job).await;
        return None;
    }
    let class = SubjectClass::Class(job.class());
    match commit::existing_result(shared, &job.project, &job.job_id).await {
        Ok(Some(result)) => {
            finish_committed(shared, delivery, &result).await;
            telemetry::job_finished(JobOutcome::DuplicateSkip, origin.priority, class);
            None
        }
        Ok(None) => Some(job),
        Err(e) => {
            let outcome = nak_transient(shared, delivery, &job, &e.to_string()).await;
            telemetry::job_finished(outcome, origin.priority, class);
            None
        }
    }
}

/// Decodes and validates. A job that can never be rendered is returned as an error, with its
/// id when the payload was readable enough to have one (the failed record then names it).
fn decode(shared: &Shared, delivery: &Delivery) -> Result<ShotJob, (Option<String>, InvalidJob)> {
    let job = encoding::decode_job(delivery.content_type().as_deref(), &delivery.message.payload)
        .map_err(|e| (None, InvalidJob::Decode(e)))?;
    let named = |e: InvalidJob| (Some(job.job_id.clone()), e);
    job.validate(&shared.config.limits).map_err(|e| named(InvalidJob::Invalid(e)))?;
    if let Some(lora) = job.loras.first() {
        // Never render a job without the style it asked for.
        return Err(named(InvalidJob::Decode(encoding::DecodeError::Malformed {
            format: "job",
            path: "loras[0].name".into(),
            detail: format!("LoRA `{}` is not available: this worker loads no LoRA adapters yet", lora.name),
        })));
    }
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

/// Renders a job taken by [`take`] on its own, then commits it.
pub(crate) async fn render_and_commit(shared: &Arc<Shared>, delivery: &Delivery, job: &ShotJob) -> JobOutcome {
    // Plan the largest sub-batch the budget holds now and render it off the async threads,
    // stepping down the in-place rungs on out-of-memory.
    match render_in_place(shared, delivery, job).await {
        Ok(rendered) => commit_output(shared, delivery, job, rendered.output, rendered.elapsed).await,
        Err(outcome) => outcome,
    }
}

/// Upload, publish the result (the commit point), sweep, ack.
pub(crate) async fn commit_output(
    shared: &Shared,
    delivery: &Delivery,
    job: &ShotJob,
    output: RenderOutput,
    elapsed: Duration,
) -> JobOutcome {
    telemetry::render_time(SubjectClass::Class(job.class()), elapsed);
    // 4. Upload.
    let upload_started = Instant::now();
    let stages = output.timings;
    let images = match upload(shared, job, output.images).await {
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
            render_ms: elapsed.as_millis() as u64,
            upload_ms: upload_started.elapsed().as_millis() as u64,
        },
        finished_at_ms: SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_millis() as u64,
    };
    let committed = match commit::publish(shared, &result).await {
        Ok(commit::Commit::Ours) => result,
        Ok(commit::Commit::Theirs(theirs)) => {
            info!(job = %job.job_id, winner = %theirs.worker, "another worker committed this job first; keeping its images");
            *theirs
        }
        Err(e) => return nak_transient(shared, delivery, job, &e.to_string()).await,
    };
    shared.config.faults.crash_point(CrashPoint::AfterPublish);
    shared.config.faults.leak();

    // 6. Sweep what the committed result does not name, then ack.
    finish_committed(shared, delivery, &committed).await;
    if committed.worker != shared.config.worker_id || committed.attempt != delivery.attempt as u32 {
        return JobOutcome::DuplicateSkip;
    }
    info!(
        job = %job.job_id,
        images = committed.images.len(),
        render_ms = committed.timing.render_ms,
        text_ms = stages.text_encode.as_millis() as u64,
        unet_ms = stages.unet.as_millis() as u64,
        vae_ms = stages.vae.as_millis() as u64,
        png_ms = stages.png.as_millis() as u64,
        upload_ms = committed.timing.upload_ms,
        "job done"
    );
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
    /// The worker is shutting down past its grace period (or after a driver fault elsewhere).
    Shutdown,
    /// The job ran past `job_time_limit`.
    TimeLimit(Duration),
    Error(RenderError),
}

/// How one render attempt uses memory: the in-place rungs of the degrade ladder.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Attempt {
    /// Images per UNet sub-batch.
    batch: u32,
    vae: VaeDecode,
}

/// Renders the job, and on out-of-memory steps down in place (smaller UNet batches down to one
/// image, then a tiled VAE decode: the same images, one job, one result) before re-publishing it
/// one rung down. The first out-of-memory of a job only gives it back, so a roomier worker can
/// render it at full quality; this worker's estimate is corrected either way.
async fn render_in_place(shared: &Arc<Shared>, delivery: &Delivery, job: &ShotJob) -> Result<Rendered, JobOutcome> {
    let Some((batch, mut reservation)) = plan(shared, job) else {
        info!(job = %job.job_id, "no room for this job now; giving it back");
        delivery.nak(Some(Duration::from_millis(500))).await;
        return Err(JobOutcome::Nak);
    };
    let mut attempt = Attempt { batch, vae: VaeDecode::Whole };
    let deadline = Instant::now() + shared.config.job_time_limit.0;
    loop {
        let error = match render(shared, delivery, job, attempt, reservation, deadline).await {
            Ok(rendered) => return Ok(rendered),
            Err(RenderFailure::Error(error)) => error,
            Err(other) => return Err(settle_stop(shared, delivery, job, other).await),
        };
        match classify_render(&error) {
            ErrorKind::Oom => {}
            ErrorKind::DriverFault => return Err(driver_fault(shared, delivery, job, &error.to_string()).await),
            ErrorKind::Invalid => {
                let detail = format!("this model cannot render it: {error}");
                failed::fail(shared, delivery, Some(&job.job_id), FailureReason::Invalid, &detail).await;
                return Err(JobOutcome::Failed);
            }
            ErrorKind::Transient | ErrorKind::Timeout => {
                return Err(nak_transient(shared, delivery, job, &error.to_string()).await);
            }
        }
        // Out of memory: learn, give memory back, then decide.
        let planned = shared.budget.observe_oom(job.width, job.height, attempt.batch);
        telemetry::out_of_memory();
        shrink_arenas(shared).await;
        warn!(job = %job.job_id, batch = attempt.batch, vae = ?attempt.vae, attempt = delivery.attempt, planned_now = planned, detail = %error, "out of memory");
        if delivery.attempt == 1 && attempt.batch == batch && attempt.vae == VaeDecode::Whole {
            delivery.nak(Some(FIRST_OOM_DELAY)).await;
            return Err(JobOutcome::Nak);
        }
        attempt = match next_in_place(job, attempt, error.stage()) {
            Some(next) => next,
            None => return Err(republish_smaller(shared, delivery, job).await),
        };
        reservation = match shared.budget.reserve(job.width, job.height, attempt.batch) {
            Ok(Some(reservation)) => reservation,
            _ => {
                delivery.nak(Some(FIRST_OOM_DELAY)).await;
                return Err(JobOutcome::Nak);
            }
        };
        info!(job = %job.job_id, batch = attempt.batch, vae = ?attempt.vae, "degrading in place");
    }
}

/// How long a job waits after its first out-of-memory: long enough for another worker's pull.
const FIRST_OOM_DELAY: Duration = Duration::from_secs(1);

/// The next in-place rung: half the UNet batch, down to one image; then, when the decoder is
/// what ran out, a tiled VAE decode (it cannot help a UNet that does not fit).
fn next_in_place(job: &ShotJob, attempt: Attempt, failed_at: Option<Stage>) -> Option<Attempt> {
    if attempt.batch > 1 {
        return Some(Attempt { batch: attempt.batch / 2, ..attempt });
    }
    if failed_at != Some(Stage::Vae) {
        return None;
    }
    // Tiles of about half the longer side (multiples of 64, 128..=1024); an image no larger than
    // one tile would decode whole, so a tile must be smaller than the image to help.
    let tile = (job.width.max(job.height) / 2 / 64 * 64).clamp(128, 1024);
    let tiled = VaeDecode::tiled(tile);
    (attempt.vae == VaeDecode::Whole && tile < job.width.max(job.height)).then_some(Attempt { vae: tiled, ..attempt })
}

/// Re-publishes the job one rung down, or fails it with reason `oom` below its floor.
async fn republish_smaller(shared: &Shared, delivery: &Delivery, job: &ShotJob) -> JobOutcome {
    let Some(smaller) = degrade::next_rung(job, &shared.config.degrade) else {
        let detail = format!("out of memory at {}x{}, {} steps, one image at a time with a tiled VAE, and the floor is reached", job.width, job.height, job.steps);
        failed::fail(shared, delivery, Some(&job.job_id), FailureReason::Oom, &detail).await;
        return JobOutcome::Failed;
    };
    let level = smaller.degrade.map_or(1, |d| d.level);
    let target = subject::job(delivery.origin.priority, SubjectClass::Class(smaller.class()), &smaller.project);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(encoding::HEADER, ContentType::MessagePack.as_str());
    headers.insert("Nats-Msg-Id", subject::msg_id::degrade(&job.job_id, level).as_str());
    let payload = encoding::encode(ContentType::MessagePack, &smaller);
    let published = match shared.js.publish_with_headers(target.clone(), headers, payload.into()).await {
        Ok(ack) => ack.await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match published {
        Ok(_) => {
            if let Err(e) = delivery.done().await {
                warn!(job = %job.job_id, error = %e, "degraded copy stored but the original's ack failed; the duplicate window absorbs the retry");
            }
            info!(job = %job.job_id, level, width = smaller.width, height = smaller.height, steps = smaller.steps, to = %target, "re-published one rung down");
            JobOutcome::DegradeRepublished
        }
        Err(e) => nak_transient(shared, delivery, job, &format!("cannot re-publish the degraded job: {e}")).await,
    }
}

async fn render(
    shared: &Arc<Shared>,
    delivery: &Delivery,
    job: &ShotJob,
    attempt: Attempt,
    reservation: Reservation,
    deadline: Instant,
) -> Result<Rendered, RenderFailure> {
    let request = render_request(job, attempt.batch);
    let started = Instant::now();
    let render_number = shared.renders.fetch_add(1, Ordering::Relaxed) + 1;
    if let Some(text) = shared.config.faults.driver_fault(render_number) {
        warn!(job = %job.job_id, "fault injection: this render fails as a driver fault");
        let source = ort::Error::new(text);
        return Err(RenderFailure::Error(RenderError::Runtime { stage: Stage::Unet, source }));
    }
    let control = RenderControl { vae_decode: attempt.vae, cancel: CancelHandle::new() };
    let timed_out = Arc::new(AtomicBool::new(false));
    let stopper = stop_at(shared, deadline, &control.cancel, &timed_out);
    let keeper = keep_alive(shared, delivery);
    let pipeline = shared.pipeline();
    let meter = shared.meter.clone();
    let outcome = tokio::task::spawn_blocking(move || {
        let render = || pipeline.render_with(&request, &control, &mut |_| ControlFlow::Continue(()));
        match meter {
            Some(meter) => {
                let (result, peak) = meter.measure(render);
                (result, peak.ok())
            }
            None => (render(), None),
        }
    })
    .await;
    keeper.abort();
    stopper.abort();
    let elapsed = started.elapsed();
    let (result, peak) = match outcome {
        Ok(pair) => pair,
        Err(e) => return Err(RenderFailure::Error(RenderError::InvalidRequest(format!("render task failed: {e}")))),
    };
    if let (Ok(_), Some(measured)) = (&result, peak) {
        learn(shared, job, reservation.shape(), measured);
    }
    drop(reservation);
    match result {
        Ok(output) => Ok(Rendered { output, elapsed }),
        Err(RenderError::Cancelled { .. } | RenderError::Terminated { .. }) if timed_out.load(Ordering::Relaxed) => {
            Err(RenderFailure::TimeLimit(elapsed))
        }
        Err(RenderError::Cancelled { .. } | RenderError::Terminated { .. }) => Err(RenderFailure::Shutdown),
        Err(e) => Err(RenderFailure::Error(e)),
    }
}

/// Learns from a render's measured peak where it is the render's own: one that started from
/// arenas an earlier, larger render left full reads their cache too, which says nothing about
/// this shape (and would plan every later job at the largest size seen).
fn learn(shared: &Shared, job: &ShotJob, shape: Shape, measured: Measured) {
    let planned = shared.budget.planned(shape.width, shape.height, shape.images);
    let cold = measured.cold();
    telemetry::estimate_error(planned, measured.peak, cold);
    let error = cold.then(|| shared.budget.observe(shape.width, shape.height, shape.images, measured.peak));
    info!(
        job = %job.job_id,
        width = shape.width,
        height = shape.height,
        images = shape.images,
        peak_mib = measured.peak / MIB,
        held_at_start_mib = measured.held_at_start / MIB,
        planned_mib = planned / MIB,
        error,
        cold,
        "observed peak"
    );
}

/// What the pipeline renders for a job: all its images, `max_batch` per UNet sub-batch.
pub(crate) fn render_request(job: &ShotJob, max_batch: u32) -> RenderRequest {
    RenderRequest {
        prompt: job.prompt.clone(),
        negative_prompt: job.negative_prompt.clone(),
        width: job.width,
        height: job.height,
        steps: job.steps,
        guidance: job.guidance,
        seed: job.seed,
        image_indices: (0..job.images).collect(),
        max_batch: max_batch as usize,
    }
}

/// Stops the run in progress (ONNX Runtime's terminate) at `deadline` (setting `timed_out`) or
/// when the worker aborts. Abort the returned task once the render is over.
pub(crate) fn stop_at(
    shared: &Shared,
    deadline: Instant,
    cancel: &CancelHandle,
    timed_out: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let (cancel, abort, timed_out) = (cancel.clone(), shared.abort.clone(), timed_out.clone());
    tokio::spawn(async move {
        tokio::select! {
            () = abort.cancelled() => {}
            () = tokio::time::sleep_until(deadline.into()) => timed_out.store(true, Ordering::Relaxed),
        }
        cancel.cancel();
    })
}

/// Sends `AckKind::Progress` every progress interval so a long render is not redelivered. Abort
/// the returned task once the render is over.
pub(crate) fn keep_alive(shared: &Shared, delivery: &Delivery) -> tokio::task::JoinHandle<()> {
    let (delivery, interval) = (delivery.clone(), shared.progress_interval);
    // A stalled publish (fault injection) must let the server redeliver.
    let disabled = shared.config.faults.stall().is_some();
    tokio::spawn(async move {
        if disabled {
            return;
        }
        let mut ticker = tokio::time::interval(interval);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            delivery.progress().await;
        }
    })
}

/// A render stopped from outside: shutdown gives the job back at once, the time limit is a
/// transient failure.
async fn settle_stop(shared: &Shared, delivery: &Delivery, job: &ShotJob, failure: RenderFailure) -> JobOutcome {
    match failure {
        RenderFailure::TimeLimit(took) => {
            nak_transient(shared, delivery, job, &format!("render stopped at the time limit after {:.1}s", took.as_secs_f64())).await
        }
        RenderFailure::Shutdown | RenderFailure::Error(_) => {
            info!(job = %job.job_id, "stopping: giving the job back now");
            delivery.nak(None).await;
            JobOutcome::Nak
        }
    }
}

/// The GPU is broken for this process: stop the worker, and give the job back (or, when it was
/// present at repeated faults, fail it with reason `driver`).
async fn driver_fault(shared: &Shared, delivery: &Delivery, job: &ShotJob, detail: &str) -> JobOutcome {
    let outcome = if delivery.attempt >= shared.config.driver_fault_attempts {
        failed::fail(shared, delivery, Some(&job.job_id), FailureReason::Driver, detail).await;
        JobOutcome::Failed
    } else {
        delivery.nak(None).await;
        JobOutcome::Nak
    };
    // After the nak: stopping the worker flushes the connection, so the nak reaches the server
    // before the process exits. Naked after the stop, it could still be unsent at exit on a
    // loaded machine (seen in CI), and the job then waited out `ack_wait`.
    shared.driver_fault(Some(&job.job_id), detail).await;
    outcome
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
